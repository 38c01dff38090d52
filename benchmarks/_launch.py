"""The torchrun scaffold of the multi-rank benchmarks: launch a benchmark's own module on N local gloo ranks,
pass it its configuration as command-line arguments, collect the JSON the ranks leave, and report a failed
or overdue launch.

A benchmark using it has two halves in one file:

- the launcher, ``main``: ``got = launch(__file__, nproc, ["--quick"], timeout=3000)``; ``got`` is ``None``
  when the launch failed (the reason and the ranks' last lines are printed), else ``got.data`` is what the
  ranks wrote and ``got.output`` their merged stdout and stderr;
- the worker, the same module under torchrun with ``--worker --out PATH [--cache-dir DIR]`` added to its
  arguments (:func:`add_worker_args` declares them): ``if args.worker: finish(worker(args))``, and the
  worker ends with :func:`write_gathered` (every rank's result, as a list in rank order) or
  :func:`write_rank0` (one result that the ranks already agreed on).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

REPO = Path(__file__).resolve().parents[1]
# how many of the ranks' last output lines a failed launch prints
TAIL = 40


@dataclass
class Launched:
    """What one launch left: ``data``, the JSON the ranks wrote to ``--out``; ``output``, their stdout and
    stderr, merged in the order written."""

    data: Any
    output: str


def worker_env(unset: Sequence[str] = (), **extra: str) -> dict[str, str]:
    """This process's environment for the ranks: one thread each, no progress bar, no warnings, this checkout
    first on ``PYTHONPATH``; ``extra`` set on top, ``unset`` removed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", METADIST_PROGRESS="0", PYTHONWARNINGS="ignore", **extra)
    for name in unset:
        env.pop(name, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _text(s: str | bytes | None) -> str:
    return s.decode(errors="replace") if isinstance(s, bytes) else (s or "")


def _tail(output: str) -> str:
    return "\n".join(output.splitlines()[-TAIL:])


def launch(
    script: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    *,
    timeout: float,
    cache: bool = False,
    unset_env: Sequence[str] = (),
    show: Callable[[str], bool] | None = None,
) -> Launched | None:
    """Run ``script`` on ``nproc`` local ranks under torchrun with ``--worker --out FILE`` and ``args``, and
    read what the ranks wrote to FILE.

    ``cache``: also pass ``--cache-dir``, ``$METADIST_CACHE_DIR`` when set, else a folder that lives as long
    as the launch (a cold rule cache). ``unset_env``: variables the ranks must not inherit. ``show``: print
    the output lines it accepts once the ranks are done (progress a benchmark wants on screen), whether or
    not the launch failed. Returns ``None`` when torchrun failed, ran past ``timeout`` seconds, or the ranks
    wrote nothing, after printing which, with the ranks' last lines.
    """
    from metadist_torch.demo import torchrun_cmd

    name = Path(script).stem
    with tempfile.TemporaryDirectory(prefix=f"metadist-{name}-") as tmp:
        out = Path(tmp) / "ranks.json"
        wargs = ["--worker", "--out", str(out)]
        if cache:
            wargs += ["--cache-dir", os.environ.get("METADIST_CACHE_DIR") or str(Path(tmp) / "cache")]
        cmd = torchrun_cmd(Path(script), nproc, [*wargs, *args])
        try:
            proc = subprocess.run(
                cmd,
                env=worker_env(unset_env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=str(REPO),
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            output = _text(e.stdout)
            _show(output, show)
            print(
                f"{name}: the {nproc} ranks ran past {timeout:g} s and were stopped; run with fewer "
                f"models or systems, or --quick. Their last lines:\n{_tail(output)}"
            )
            return None
        _show(proc.stdout, show)
        if proc.returncode != 0 or not out.exists():
            why = f"exited with {proc.returncode}" if proc.returncode != 0 else f"wrote no result to {out.name}"
            print(f"{name}: torchrun with {nproc} ranks {why}; the ranks' last lines say why:\n{_tail(proc.stdout)}")
            return None
        return Launched(json.loads(out.read_text()), proc.stdout)


def _show(output: str, show: Callable[[str], bool] | None) -> None:
    if show is not None:
        lines = [line for line in output.splitlines() if show(line)]
        if lines:
            print("\n".join(lines))


def add_worker_args(ap: argparse.ArgumentParser, cache: bool = False) -> None:
    """The hidden arguments :func:`launch` passes the ranks: ``--worker``, ``--out`` (and ``--cache-dir``)."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    if cache:
        ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)


def finish(code: int) -> NoReturn:
    """End a rank with ``code``: the process group torn down and the interpreter left without its teardown,
    where gloo ranks have aborted after their work was done (``metadist_torch.runtime.engine.finish_worker``)."""
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(code)
    raise SystemExit(code)  # not reached: finish_worker exits the process


def write_gathered(out: str | os.PathLike, mine: Any) -> None:
    """Every rank's ``mine``, gathered in rank order; rank 0 writes the list to ``out`` as JSON. Call on
    every rank."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    write_rank0(out, gathered)


def write_rank0(out: str | os.PathLike, data: Any) -> None:
    """Rank 0 writes ``data`` to ``out`` as JSON (values JSON does not know as their ``str``); the other ranks
    write nothing."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(data, default=str))
