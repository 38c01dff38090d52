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
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment for the ranks: one thread each, no progress bar, no warnings, this checkout
    first on ``PYTHONPATH``, and ``extra`` on top."""
    env = dict(os.environ, OMP_NUM_THREADS="1", METADIST_PROGRESS="0", PYTHONWARNINGS="ignore", **extra)
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
    :func:`torchrun_env`), once: a rank that crashes, at exit included, fails the launch. ``out``, when given,
    is the file the ranks write: removed before the launch."""
    from metadist_torch.demo import torchrun_cmd

    cmd = torchrun_cmd(worker, nproc, list(args))
    env = dict(env) if env is not None else torchrun_env()
    if out is not None and out.exists():
        out.unlink()
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


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
