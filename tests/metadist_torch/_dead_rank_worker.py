"""Worker of tests/metadist_torch/test_faults.py: one rank of a job stops in the middle of its steps.

Started once per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (no torchrun,
whose agent would end the other ranks itself, as a multi-node job's remote ranks are not):
``_dead_rank_worker.py OUT_DIR SIGNAL VICTIM [user]`` (``user``: the script starts the process group itself, on a
file store). Each rank runs a compiled step (``strategy="tp+dp"`` on mesh (2, N/2): collectives on the
DeviceMesh's groups, not only the default one) in a loop;
before the 4th step rank ``VICTIM`` sends itself ``SIGNAL`` (KILL: dead; STOP: hung). Every other rank must
stop with a :class:`~metadist_torch.runtime.faults.RankFailure`: it writes ``OUT_DIR/rank-R.json`` with the error,
the ranks it names and the time, and exits 3.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _resume_worker as W  # noqa: E402  (the same model, batches and step)


def main() -> None:
    out, sig, victim = Path(sys.argv[1]), getattr(signal, "SIG" + sys.argv[2]), int(sys.argv[3])
    from metadist_torch import metadist_compile
    from metadist_torch.runtime.engine import ensure_process_group
    from metadist_torch.runtime.faults import RankFailure

    if len(sys.argv) > 4 and sys.argv[4] == "user":  # the user starts the group (a file store, no MASTER_ADDR)
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=float(os.environ["METADIST_COLLECTIVE_TIMEOUT"]))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k)
        dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world, timeout=timeout)
    rank, world = ensure_process_group()
    model, opt, _ = W.build()
    step = metadist_compile(mesh=(2, world // 2), strategy="tp+dp")(W.train_step)
    x, y = W.batch(0)
    for i in range(10_000):
        if i == 3 and rank == victim:
            (out / "victim.json").write_text(json.dumps({"rank": rank, "at": time.time(), "pid": os.getpid()}))
            os.kill(os.getpid(), sig)
        try:
            step(model, opt, x, y)
        except RankFailure as e:
            (out / f"rank-{rank}.json").write_text(
                json.dumps({"rank": rank, "error": str(e), "stopped": e.stopped, "at": time.time()})
            )
            sys.stdout.flush()
            os._exit(3)
        time.sleep(0.02)
    os._exit(0)


if __name__ == "__main__":
    main()
