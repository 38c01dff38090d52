"""A job that did its work exits 0, every time: what MetaDist starts (the heartbeat thread, its store client,
process groups) is stopped and released before the interpreter finalizes.

The abort this guards against: a daemon thread that comes back from a torch store call (pybind11 released
the GIL for it) while Python finalizes is ended by ``pthread_exit``, whose unwind through the ``noexcept``
``gil_scoped_release`` destructor calls ``std::terminate``: "terminate called without an active exception",
SIGABRT, and torchrun reports the job FAILED after every rank printed its results.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _torchrun import REPO, run_torchrun, tail, torchrun_env  # noqa: E402

WORKER = Path(__file__).with_name("_exit_worker.py")
ABORT = "terminate called"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_exit_waits_for_a_heartbeat_inside_a_store_call(tmp_path):
    """The heartbeat is caught inside a store call (its server paused) when the script ends; the call comes back
    only once the interpreter finalizes, or would. The process must not start finalizing before the heartbeat
    has stopped, and must exit 0."""
    server = subprocess.Popen([sys.executable, str(WORKER), "server"], stdout=subprocess.PIPE, text=True, env=_env())
    rank = None
    try:
        port = server.stdout.readline().strip()  # type: ignore[union-attr]
        assert port.isdigit(), f"the store's server printed {port!r}"
        rank = subprocess.Popen(
            [sys.executable, str(WORKER), "rank", port, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        assert rank.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        os.kill(server.pid, signal.SIGSTOP)
        rank.stdin.write("go\n")  # type: ignore[union-attr]
        rank.stdin.flush()  # type: ignore[union-attr]
        assert rank.stdout.readline().strip() == "blocked"  # type: ignore[union-attr]
        finalizing = tmp_path / "finalizing"
        t = time.monotonic()
        while not finalizing.exists() and time.monotonic() - t < 3.0:
            time.sleep(0.05)
        early = finalizing.exists()  # finalization began with the heartbeat still inside its store call
        os.kill(server.pid, signal.SIGCONT)
        (tmp_path / "resumed").touch()
        out, err = rank.communicate(timeout=120)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
        if rank is not None and rank.poll() is None:
            rank.kill()
    assert rank.returncode == 0 and ABORT not in err, f"exit {rank.returncode}:\n{err[-3000:]}"
    assert not early, "the interpreter began finalizing while the heartbeat was inside a store call"
    assert finalizing.exists(), "the process never reached finalization"


def test_destroying_the_users_group_stops_the_heartbeat():
    """A user who destroys the process group MetaDist beats for ends the heartbeat too (at its next beat)."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), "destroy"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert proc.returncode == 0 and ABORT not in proc.stderr, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"stopped": True, "forgotten": True}


def test_exit_steps_run_in_order_once_and_past_a_failure(monkeypatch):
    from metadist_torch.runtime import shutdown

    monkeypatch.setattr(shutdown, "_STEPS", {})
    monkeypatch.setattr(shutdown, "_HOOKED", [True])  # no atexit hook in the test's process
    ran = []

    def broken():
        ran.append("groups")
        raise RuntimeError("gone")

    shutdown.on_exit("process groups", broken)
    shutdown.on_exit("heartbeat", lambda: ran.append("heartbeat"))
    shutdown.shutdown()
    shutdown.shutdown()
    assert ran == ["heartbeat", "groups"]
    with pytest.raises(ValueError, match="unknown exit step 'threads'; the steps are heartbeat, process groups"):
        shutdown.on_exit("threads", lambda: None)


def readme_example(folder: Path) -> Path:
    """README's first example (the ``## A first step`` block), written to ``folder/train.py``."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## A first step\s+```python\n(.*?)```", text, re.S)
    assert block, "README.md has no python block under '## A first step'"
    path = folder / "train.py"
    path.write_text(block.group(1))
    return path


@pytest.mark.slow
@pytest.mark.ci
def test_readme_example_exits_0_on_four_ranks_again_and_again(tmp_path):
    """README's first example under torchrun on 4 gloo ranks, twice in a row: every launch exits 0 and no rank
    aborts at exit (scripts/exit_check.py runs it 20 times and more)."""
    script = readme_example(tmp_path)
    env = torchrun_env(METADIST_CACHE_DIR=str(tmp_path / "rules"))
    for run in range(2):
        proc = run_torchrun(script, 4, env=env, timeout=600)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0 and ABORT not in text, (
            f"launch {run + 1} of 2: exit {proc.returncode}\n{tail(proc)}"
        )
        assert len(re.findall(r"step 2: loss", proc.stdout)) == 4, tail(proc)  # ranks' lines may interleave
