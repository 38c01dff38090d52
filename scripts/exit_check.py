"""Launch README's first example (or a script of yours) under torchrun again and again, and record every exit.

A job that did its work must exit 0 every time: a rank that aborts at interpreter exit ("terminate called
without an active exception") fails the whole job under torchrun although every rank printed its results.
Such an abort comes and goes with timing, so one launch proves little; this runs many in a row::

    python scripts/exit_check.py                      # 20 launches of README's example on 4 gloo ranks
    python scripts/exit_check.py -n 50 --nproc 2 --script examples/torch/mlp.py --out exits.json

It prints one line per launch (exit code, seconds, ranks that aborted), writes every record to ``--out`` as
JSON when given, and exits 1 when any launch did not exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABORT = "terminate called"


def readme_example(folder: Path) -> Path:
    """README's first example (the ``## A first step`` block), written to ``folder/train.py``."""
    block = re.search(r"## A first step\s+```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    if block is None:
        raise SystemExit("README.md has no python block under '## A first step'")
    path = folder / "train.py"
    path.write_text(block.group(1))
    return path


def launch(script: Path, nproc: int, env: dict[str, str], timeout: float) -> dict:
    """One torchrun launch of ``script`` on ``nproc`` ranks: its exit code, seconds and the ranks' aborts."""
    sys.path.insert(0, str(REPO))
    from metadist_torch.demo import torchrun_cmd

    t = time.perf_counter()
    try:
        proc = subprocess.run(
            torchrun_cmd(script, nproc), env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, text = -1, f"timed out after {timeout:g} s: {e}"
    failed = re.findall(r"exitcode\s*:\s*(-?\d+)", text)
    return {
        "exit": code,
        "seconds": round(time.perf_counter() - t, 1),
        "aborts": text.count(ABORT),
        "rank_exits": [int(c) for c in failed],
        "tail": "" if code == 0 else "\n".join(text.splitlines()[-25:]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--runs", type=int, default=20, help="launches in a row (default 20)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks per launch (default 4)")
    ap.add_argument("--script", type=Path, default=None, help="the script to launch (default: README's example)")
    ap.add_argument("--out", type=Path, default=None, help="write every launch's record here, as JSON")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one launch may take")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="metadist-exit-") as tmp:
        script = args.script.resolve() if args.script else readme_example(Path(tmp))
        env = dict(os.environ, OMP_NUM_THREADS="1", METADIST_PROGRESS="0", PYTHONWARNINGS="ignore")
        env.setdefault("METADIST_CACHE_DIR", str(Path(tmp) / "rules"))
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        records = []
        for run in range(1, args.runs + 1):
            rec = {
                "run": run,
                "script": script.name,
                "nproc": args.nproc,
                **launch(script, args.nproc, env, args.timeout),
            }
            records.append(rec)
            print(f"launch {run:3d}: exit {rec['exit']}  {rec['seconds']:6.1f} s  aborts {rec['aborts']}", flush=True)
            if rec["exit"] != 0:
                print(rec["tail"], flush=True)
    ok = sum(r["exit"] == 0 for r in records)
    print(f"{ok} of {len(records)} launches of {script.name} on {args.nproc} ranks exited 0")
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))
    return 0 if ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
