"""Faults: a rank that stops is named by every other rank, which then exits; a job restarted by torchrun
resumes from its checkpoint to the numbers of a run that never stopped; a save cut short or a corrupted
checkpoint never loads; out-of-memory and a shrunken world say what to do.

The multi-rank cases are ``slow``; the lean CI set keeps the restart on 2 ranks (``slow`` + ``ci``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun import REPO, torchrun_env  # noqa: E402

import _resume_worker as W  # noqa: E402
from metadist_torch import latest_checkpoint, load_checkpoint, metadist_compile, save_checkpoint  # noqa: E402
from metadist_torch.checkpoint.commit import CheckpointError  # noqa: E402
from metadist_torch.runtime.faults import Heartbeat, diagnose  # noqa: E402

HERE = Path(__file__).resolve().parent


# -- naming the rank that stopped -------------------------------------------------------------------------


def _beats(world: int, live: list[int], steps: dict[int, int] | None = None, never: int = -1) -> list[Heartbeat]:
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))  # what a read of a missing key would wait
    hearts = [Heartbeat(store, r, world, interval=0.05) for r in range(world)]
    for r, h in enumerate(hearts):
        h.steps = (steps or {}).get(r, 5)
        if r in live:
            h.start()
        elif r != never:
            h._beat()  # beat once, then never again
    return hearts


def test_diagnose_names_the_rank_that_stopped_beating():
    hearts = _beats(4, live=[0, 1, 3])
    try:
        stopped, how = diagnose(hearts[0])
        assert stopped == [2], how
        assert "rank 2" in how and "no heartbeat" in how
        # a rank that fails later takes what the first one found, instead of taking ranks that exited for it
        hearts[1].stop()
        again, how1 = diagnose(hearts[3])
        assert again == [2] and "found by rank 0" in how1
    finally:
        for h in hearts:
            h.stop()


def test_diagnose_names_a_rank_that_never_beat_without_waiting_on_its_keys():
    hearts = _beats(3, live=[0, 1], never=2)
    try:
        t = time.perf_counter()
        stopped, how = diagnose(hearts[0])
        assert stopped == [2] and "rank 2 (it never beat)" in how
        assert time.perf_counter() - t < 3.0
    finally:
        for h in hearts:
            h.stop()


def test_diagnose_names_a_rank_that_beats_but_fell_behind():
    hearts = _beats(3, live=[0, 1, 2], steps={0: 7, 1: 6, 2: 7})
    try:
        stopped, how = diagnose(hearts[0])
        assert stopped == [1] and "fell behind" in how and "at step call 6" in how
    finally:
        for h in hearts:
            h.stop()


def test_diagnose_without_a_heartbeat_says_it_cannot_tell():
    from metadist_torch.runtime import faults

    assert faults.heartbeat() is None  # no process group started in this process
    stopped, how = faults.diagnose()
    assert stopped == [] and "cannot tell which rank" in how


def _launch_ranks(
    tmp: Path, world: int, sig: str, victim: int, timeout_s: float, init: str = "metadist", **extra: str
) -> dict:
    """``world`` processes of ``_dead_rank_worker.py`` without torchrun; when each survivor exited, after the
    victim's signal."""
    from metadist_torch.demo import free_port

    port = str(free_port())
    procs = []
    for r in range(world):
        env = torchrun_env(
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            METADIST_COLLECTIVE_TIMEOUT=str(timeout_s),
            METADIST_CACHE_DIR=str(tmp / "cache"),
            **extra,
        )
        cmd = [sys.executable, str(HERE / "_dead_rank_worker.py"), str(tmp), sig, str(victim), init]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    ended: dict[int, float] = {}
    deadline = time.time() + 240
    try:
        while time.time() < deadline and len(ended) < world - 1:
            for r, p in enumerate(procs):
                if r != victim and r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        logs = {r: p.communicate()[0].decode(errors="replace") for r, p in enumerate(procs)}
    victim_at = json.loads((tmp / "victim.json").read_text())["at"] if (tmp / "victim.json").exists() else None
    return {"ended": ended, "victim_at": victim_at, "codes": [p.returncode for p in procs], "logs": logs}


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,init,backend,world",
    [
        ("KILL", "metadist", "eager", 4),
        ("STOP", "metadist", "eager", 4),
        ("KILL", "user", "eager", 4),
        ("KILL", "metadist", "inductor", 2),
    ],
)
def test_a_stopped_rank_is_named_and_every_other_rank_exits(tmp_path, sig, init, backend, world):
    """The last rank but one is killed (dead) or stopped (hung) mid-loop: every other rank raises a RankFailure
    naming it and exits, within the collective timeout and the diagnosis; also where the script started the
    process group itself (on a file store), and where Inductor compiled the program (its collectives native)."""
    victim, timeout_s = world - 2 if world > 2 else 1, 8.0
    got = _launch_ranks(tmp_path, world, sig, victim, timeout_s, init, METADIST_BACKEND=backend)
    logs = "\n".join(f"--- rank {r}\n" + "\n".join(t.splitlines()[-8:]) for r, t in got["logs"].items())
    assert got["victim_at"] is not None, logs
    for r in range(world):
        if r == victim:
            continue
        assert r in got["ended"] and got["codes"][r] == 3, logs
        rep = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert rep["stopped"] == [victim] and f"rank {victim}" in rep["error"], rep["error"]
        assert init == "user" or "collective_timeout=8 s" in rep["error"]
        waited = got["ended"][r] - got["victim_at"]
        assert waited < timeout_s + 20, f"rank {r} took {waited:.1f} s to stop"
        print(f"{sig}: rank {r} exited {waited:.1f} s after rank {victim} stopped")


# -- restart and resume ---------------------------------------------------------------------------------------


def _torchrun(out: Path, nproc: int, kill_at: int, restarts: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [f"--max-restarts={restarts}", str(HERE / "_resume_worker.py"), str(out), "10", "3", str(kill_at)]
    cmd += [str(nproc - 1)]
    out.mkdir(parents=True, exist_ok=True)
    env = torchrun_env(METADIST_CACHE_DIR=str(out / "cache"))
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def _final(folder: Path) -> dict:
    model, opt, sched = W.build()
    extra = {"step": 0}
    load_checkpoint(folder, model, opt, scheduler=sched, extra=extra)
    rng = torch.get_rng_state().clone()
    return {"model": model, "opt": opt, "sched": sched.state_dict(), "step": extra["step"], "rng": rng}


def _assert_identical(a: dict, b: dict) -> None:
    for (name, x), (_, y) in zip(a["model"].state_dict().items(), b["model"].state_dict().items()):
        assert torch.equal(x, y), f"{name} differs by {(x - y).abs().max().item():.3g}"
    pa, pb = list(a["model"].parameters()), list(b["model"].parameters())
    for i, (p, q) in enumerate(zip(pa, pb)):
        sa, sb = a["opt"].state[p], b["opt"].state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            va, vb = sa[k], sb[k]
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(vb)), f"optimizer state {k} of parameter {i}"
    assert a["sched"] == b["sched"] and a["step"] == b["step"]
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.ci), 4])
def test_a_restarted_job_resumes_to_the_uninterrupted_numbers(tmp_path, nproc):
    """Rank N-1 is killed after step 7 of 10 (checkpoints every 3 steps); torchrun restarts all ranks, which
    resume from step 6. Parameters, AdamW state, the StepLR state and the random state (dropout draws in
    the step) at the end are bit-identical to a run that never stopped, and so are the losses of steps 7-10."""
    cut = _torchrun(tmp_path / "cut", nproc, kill_at=7, restarts=1)
    assert cut.returncode == 0, cut.stdout[-3000:] + cut.stderr[-3000:]
    whole = _torchrun(tmp_path / "whole", nproc, kill_at=-1, restarts=0)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert not (tmp_path / "cut" / "report-0.json").exists(), "the first attempt was not cut short"
    resumed = json.loads((tmp_path / "cut" / "report-1.json").read_text())
    ref = json.loads((tmp_path / "whole" / "report-0.json").read_text())
    assert resumed["start"] == 6 and resumed["world"] == nproc
    assert {k: v for k, v in ref["losses"].items() if int(k) > 6} == resumed["losses"]
    _assert_identical(_final(tmp_path / "cut" / "final"), _final(tmp_path / "whole" / "final"))
    killed = [float(line.rsplit(" at ", 1)[1]) for line in cut.stdout.splitlines() if "kills itself" in line]
    if killed:
        print(f"{nproc} ranks: step 8 ran again {resumed['first_step_at'] - killed[0]:.1f} s after the kill")


# -- atomic checkpoints -----------------------------------------------------------------------------------------

_CRASH = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {here!r})
    import torch
    import _resume_worker as W
    from metadist_torch import save_checkpoint
    from metadist_torch.checkpoint import commit as ckpt_commit
    model, opt, sched = W.build()
    W.train_step(model, opt, *W.batch(0))
    save_checkpoint({path!r}, model, opt, scheduler=sched, step=1)
    torch.save(model.state_dict(), {saved!r})
    W.train_step(model, opt, *W.batch(1))
    where = {where!r}
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "writing":      # the data files written, the manifest not yet
        ckpt_commit.write_manifest = die
    else:                       # the old folder moved aside, the new one not yet in place
        def half(path):
            os.replace(path, str(path) + ckpt_commit.PREVIOUS)
            die()
        ckpt_commit.commit = half
    save_checkpoint({path!r}, model, opt, scheduler=sched, step=2)
    """
)


@pytest.mark.parametrize("where", ["writing", "committing"])
def test_a_save_cut_short_leaves_the_previous_checkpoint(tmp_path, where):
    path, saved = tmp_path / "ckpt", tmp_path / "values.pt"
    code = _CRASH.format(here=str(HERE), path=str(path), saved=str(saved), where=where)
    proc = subprocess.run([sys.executable, "-c", code], env=torchrun_env(), cwd=REPO, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    model, opt, sched = W.build()
    if where == "committing":
        assert not path.exists()
        with pytest.warns(UserWarning, match="cut short while committing"):
            load_checkpoint(path, model, opt, scheduler=sched)
    else:
        assert Path(str(path) + ".partial").exists()
        load_checkpoint(path, model, opt, scheduler=sched)
    want = torch.load(saved)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert latest_checkpoint(tmp_path) == (None if where == "committing" else str(path))
    save_checkpoint(path, model, opt, scheduler=sched, step=3)  # the next save clears what was left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt"]


def _saved(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model, opt, sched = W.build()
    W.train_step(model, opt, *W.batch(0))
    path = tmp_path / "ckpt"
    save_checkpoint(path, model, opt, scheduler=sched, step=1)
    return path, model


def test_a_corrupt_checkpoint_is_named_and_never_loaded(tmp_path):
    path, _ = _saved(tmp_path)
    data = sorted(path.glob("__0_*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    model, opt, _ = W.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"corrupt.*{data.name} fails its checksum"):
        load_checkpoint(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(CheckpointError, match=rf"{data.name} has \d+ bytes, the manifest \d+"):
        load_checkpoint(path, model, opt)


def test_a_partial_checkpoint_is_named(tmp_path):
    path, _ = _saved(tmp_path)
    (path / "metadist.json").unlink()
    (path / ".metadata").unlink()
    model, opt, _ = W.build()
    with pytest.raises(CheckpointError, match="did not finish"):
        load_checkpoint(path, model, opt)
    with pytest.raises(FileNotFoundError, match="unfinished save"):
        Path(str(tmp_path / "other") + ".partial").mkdir()
        load_checkpoint(tmp_path / "other", model, opt)


def test_latest_checkpoint_takes_the_highest_complete_step(tmp_path):
    model, opt, sched = W.build()
    for s in (3, 6, 12):
        save_checkpoint(tmp_path / f"step-{s}", model, opt, scheduler=sched, step=s)
    (tmp_path / "step-12" / "metadist.json").unlink()  # not complete
    (tmp_path / "step-15.partial").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-6")
    assert latest_checkpoint(tmp_path / "none") is None


def test_rng_and_extra_round_trip(tmp_path):
    model, opt, sched = W.build()
    torch.manual_seed(5)
    save_checkpoint(tmp_path / "c", model, opt, scheduler=sched, extra={"step": 4, "epoch": 1})
    want = torch.rand(3)
    torch.manual_seed(9)
    extra = {"step": 0, "epoch": 0}
    load_checkpoint(tmp_path / "c", model, opt, scheduler=sched, extra=extra)
    assert extra == {"step": 4, "epoch": 1}
    assert torch.equal(torch.rand(3), want)


# -- what users hit ---------------------------------------------------------------------------------------------


def test_out_of_memory_names_the_prediction_and_the_budget(monkeypatch):
    from metadist_torch.lower.program import LocalProgram

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(LocalProgram, "__call__", oom)  # the first step's program runs out
    model, opt, _ = W.build()
    step = metadist_compile(memory_budget=3 * 2**30)(W.train_step)
    with pytest.raises(torch.OutOfMemoryError) as got:
        step(model, opt, *W.batch(0))
    text = str(got.value)
    assert "the plan predicted" in text and "GiB per device" in text and "memory_budget is 3.00 GiB" in text
    assert "Tried to allocate 2.00 GiB" in text


def test_a_restart_with_fewer_ranks_says_so(monkeypatch):
    from metadist_torch.runtime.engine import resolve_mesh

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ValueError, match=r"mesh 2x2 has 4 devices but the world size is 2 \(this is restart 1"):
        resolve_mesh((2, 2), 2)


def test_collective_timeout_setting(monkeypatch):
    from metadist_core.config import load_settings

    monkeypatch.setenv("METADIST_COLLECTIVE_TIMEOUT", "7.5")
    assert load_settings().collective_timeout == 7.5
    monkeypatch.setenv("METADIST_COLLECTIVE_TIMEOUT", "0")
    with pytest.raises(ValueError, match="collective_timeout must be a positive number"):
        load_settings()


def test_heartbeat_thread_survives_a_lost_store():
    """A heartbeat whose store goes away stops quietly and says why."""

    class Gone:
        def add(self, *a):
            raise RuntimeError("connection refused")

        def set(self, *a):
            raise RuntimeError("connection refused")

    h = Heartbeat(Gone(), 0, 2, interval=0.01)
    t = threading.Thread(target=h._run)
    t.start()
    t.join(2)
    assert not t.is_alive() and "connection refused" in (h.lost or "")


def test_nccl_groups_get_the_timeout_and_async_error_handling(monkeypatch):
    """The NCCL branch of ensure_process_group, without GPUs: the group is made on the attempt's prefixed
    store with the collective_timeout, and TORCH_NCCL_ASYNC_ERROR_HANDLING is set unless the user set it."""
    import datetime

    import torch.distributed as dist

    from metadist_torch.runtime import engine
    from metadist_torch.runtime import faults

    made: dict = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("METADIST_COLLECTIVE_TIMEOUT", "42")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "")  # recorded, so the value the code sets is undone
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    monkeypatch.setattr(engine, "default_backend", lambda: "nccl")
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: made.setdefault("device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(made.get("pg")))
    monkeypatch.setattr(dist, "rendezvous", lambda url, r, w, timeout: iter([(dist.HashStore(), r, w)]))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.update(pg=backend, **kw))
    monkeypatch.setattr(faults, "start_heartbeat", lambda *a: made.setdefault("heartbeat", a))
    monkeypatch.setattr(engine, "world_info", lambda: (1, 2))
    monkeypatch.setattr(engine, "_TIMEOUT", [])
    engine.ensure_process_group()
    assert made["pg"] == "nccl" and made["rank"] == 1 and made["world_size"] == 2
    assert made["timeout"] == datetime.timedelta(seconds=42)
    assert isinstance(made["store"], dist.PrefixStore)
    made["store"].set("k", "v")  # written under the attempt's prefix
    assert made["heartbeat"] == (1, 2, "3", 42.0)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert engine.collective_timeout() == 42.0
