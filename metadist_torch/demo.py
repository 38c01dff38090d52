"""The torch demo: launching a script on local ranks under ``torchrun``.

:func:`run` launches ``examples/torch/gpt.py`` under ``torchrun`` on local CPU
ranks (gloo) and streams its report: the plan summary, the loss next to the
single-device loss, and the step time (printed by
:func:`metadist_torch.harness.run_example`). :func:`torchrun_cmd` is the
command line that runs any script so.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT_EXAMPLE = REPO / "examples" / "torch" / "gpt.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(script: str | os.PathLike, nproc: int, args: list[str] | None = None) -> list[str]:
    """The command line that runs ``script`` on ``nproc`` local ranks (a fresh port, so jobs never collide)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        f"--master-port={free_port()}",
        str(script),
        *(args or []),
    ]


def run(
    nproc: int = 4, args: list[str] | None = None, script: str | os.PathLike | None = None, timeout: float | None = 900
) -> int:
    """Run the GPT example on ``nproc`` local CPU ranks under torchrun and print its report.

    An unknown ``--solver`` in ``args`` is an ``UnknownSolverError`` naming the known ones, before any launch.
    """
    args = list(args or [])
    if "--solver" in args[:-1]:
        from metadist_core.plugins import PluginManager

        PluginManager().solver(args[args.index("--solver") + 1])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = torchrun_cmd(script or GPT_EXAMPLE, nproc, args)
    print(
        f"MetaDist demo: {Path(cmd[-1 - len(args)]).name} on {nproc} local CPU ranks (gloo) under torchrun", flush=True
    )
    proc = subprocess.run(cmd, env=env, timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if _noise(line):
            continue
        print(line)
    return proc.returncode


def _noise(line: str) -> bool:
    return (
        (line.startswith(("W1", "W0", "I1", "I0")) and "torch/distributed" in line)
        or "FutureWarning" in line
        or line.strip().startswith("*****")
        or "OMP_NUM_THREADS" in line
    )


__all__ = ["run", "torchrun_cmd", "free_port"]
