"""torchrun worker of tests/metadist_torch/test_faults.py: a training loop that checkpoints and resumes.

``_resume_worker.py OUT_DIR STEPS EVERY KILL_AT VICTIM`` trains a small MLP with dropout (random numbers
drawn in the step), AdamW and a StepLR schedule, ``strategy="fsdp"`` (parameters and optimizer state split
over the ranks). At start it loads the newest checkpoint under ``OUT_DIR/ckpt`` (model, optimizer, scheduler,
random state and the step to resume at); every ``EVERY`` steps it saves one. On torchrun's first attempt,
rank ``VICTIM`` kills itself (SIGKILL) before step ``KILL_AT`` + 1 (``KILL_AT`` < 0: never). After the last
step every rank saves ``OUT_DIR/final`` and rank 0 writes ``OUT_DIR/report.json`` (losses per step, the
attempt, seconds). The batch of step ``i`` is made from a generator seeded with ``i``: the data order
survives a restart without any state of its own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return model, opt, sched


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def train_step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main() -> None:
    out, steps, every, kill_at, victim = Path(sys.argv[1]), *map(int, sys.argv[2:6])
    from metadist_torch import latest_checkpoint, load_checkpoint, metadist_compile, save_checkpoint
    from metadist_torch.runtime.engine import ensure_process_group, finish_worker

    rank, world = ensure_process_group()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, opt, sched = build()
    start, t0 = 0, time.time()
    last = latest_checkpoint(out / "ckpt")
    if last is not None:
        extra = {"step": 0}
        load_checkpoint(last, model, opt, scheduler=sched, extra=extra)
        start = int(extra["step"])
    step = metadist_compile(strategy="fsdp")(train_step)
    losses, first = {}, 0.0
    for i in range(start, steps):
        if attempt == 0 and i == kill_at and rank == victim:
            print(f"rank {rank} kills itself before step {i + 1} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        losses[i + 1] = float(step(model, opt, *batch(i)))
        first = first or time.time()
        sched.step()
        if (i + 1) % every == 0:
            save_checkpoint(
                out / "ckpt" / f"step-{i + 1}", model, opt, scheduler=sched, extra={"step": i + 1}, step=i + 1
            )
    save_checkpoint(out / "final", model, opt, scheduler=sched, extra={"step": steps}, step=steps)
    if rank == 0:
        (out / f"report-{attempt}.json").write_text(
            json.dumps(
                {
                    "attempt": attempt,
                    "start": start,
                    "losses": losses,
                    "seconds": time.time() - t0,
                    "first_step_at": first,
                    "world": world,
                }
            )
        )
    finish_worker(0)


if __name__ == "__main__":
    main()
