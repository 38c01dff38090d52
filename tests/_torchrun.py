"""Running a test's worker on N local gloo ranks under torchrun, for the tests of every frontend.

A test imports it as the helpers of other test folders are imported::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _torchrun import launch  # noqa: E402

    res = launch(Path(__file__).with_name("_my_worker.py"), 4, out=tmp_path / "out.json",
                 METADIST_CACHE_DIR=str(tmp_path / "rules"))

:func:`launch` fails the test, with the ranks' last lines, when torchrun fails or the ranks write nothing, and
returns the JSON rank 0 wrote to ``$MD_TEST_OUT``; :func:`run_torchrun` is the launch alone, for a worker that
reports on stdout or in files of its own.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]


# what a rank that dies in native code (not in Python) leaves in the launch's output
NATIVE_CRASH = ("double free", "corrupted", "Segmentation fault", "SIGSEGV", "terminate called", "Fatal Python error")


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment for the ranks: one thread each, no progress bar, no warnings, this checkout
    first on ``PYTHONPATH``, Python's fault handler on (a rank that dies in native code prints every thread's
    Python stack), and ``extra`` on top."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", METADIST_PROGRESS="0", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1", **extra
    )
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_torchrun(
    worker: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    out: Path | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Run ``worker`` with ``args`` on ``nproc`` local ranks (environment ``env``, by default
    :func:`torchrun_env`). ``out``, when given, is the file the ranks write: removed before each launch.

    A rank that exits abnormally fails the launch, at exit included, with one exception: a rank that died
    of heap corruption or a signal in native code *before the job ended* (``out`` not written) is launched
    once more, with a warning that carries the crash and every thread's Python stack (docs/HISTORY.md says
    which crash this is for). A crash after the job wrote its results (the exit path) is never relaunched."""
    from metadist_torch.demo import torchrun_cmd

    env = dict(env) if env is not None else torchrun_env()
    for attempt in (1, 2):
        cmd = torchrun_cmd(worker, nproc, list(args))  # a fresh port each launch
        if out is not None and out.exists():
            out.unlink()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        text = proc.stdout + proc.stderr
        crashed = proc.returncode != 0 and any(s in text for s in NATIVE_CRASH)
        if attempt == 2 or not crashed or out is None or out.exists():
            return proc
        warnings.warn(
            f"a rank of {Path(worker).name} on {nproc} ranks died in native code before the job ended; "
            "launched once more. Its output:\n" + _crash_lines(text),
            stacklevel=2,
        )
    return proc


def _crash_lines(text: str, around: int = 40) -> str:
    """The lines of ``text`` from the first native-crash marker on (the fault handler's stacks follow it)."""
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if any(s in line for s in NATIVE_CRASH)), 0)
    return "\n".join(lines[max(0, first - 5) : first + around])


def tail(proc: subprocess.CompletedProcess, lines: int = 60) -> str:
    """The last ``lines`` lines of a launch's stdout and stderr."""
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-lines:])


def launch(
    worker: str | os.PathLike, nproc: int, args: Sequence[str] = (), *, out: Path, timeout: float = 900, **env: str
) -> Any:
    """Run ``worker`` on ``nproc`` ranks (:func:`run_torchrun`) with ``MD_TEST_OUT=out`` and ``env`` set, and
    return the JSON the ranks wrote to ``out``; fail the test with the ranks' last lines when torchrun
    failed or wrote nothing."""
    import json

    proc = run_torchrun(worker, nproc, args, env=torchrun_env(MD_TEST_OUT=str(out), **env), out=out, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        why = f"exit {proc.returncode}" if proc.returncode != 0 else f"exit 0 but no {out.name} written"
        pytest.fail(f"torchrun of {Path(worker).name} with {nproc} ranks failed ({why}):\n{tail(proc)}")
    return json.loads(out.read_text())


def write_results(errors: list[str], report: Any) -> None:
    """On a rank: gather every rank's ``errors``; rank 0 writes them, with ``report``, to ``$MD_TEST_OUT``
    (what :func:`launch` returns). Call on every rank."""
    import json

    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    if dist.get_rank() == 0:
        out = {"errors": [e for errs in gathered for e in errs], "report": report}
        Path(os.environ["MD_TEST_OUT"]).write_text(json.dumps(out, indent=1, default=str))
