"""The harness the examples share.

:func:`run_example` is what each example's ``main`` calls: it runs the step
compiled by ``metadist_compile`` and, unless told not to, the same step eagerly
on one device, and prints both from rank 0 (the report :func:`metadist_torch.demo.run`
streams).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

from .compile import metadist_compile


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_example(
    name: str,
    build: Callable[[], tuple],
    make_batch: Callable[[int], tuple],
    step: Callable,
    *,
    steps: int = 5,
    mesh: Any = None,
    solver: str | None = None,
    memory_budget: int | None = None,
    reference: bool = True,
    seed: int = 0,
    out: Callable[[str], None] | None = None,
) -> int:
    """Run ``step`` compiled over the world for ``steps`` steps next to the eager single-device step.

    Returns 0 when the losses agree (rtol 1e-4), 1 otherwise.
    """
    import torch

    say = out or (lambda s: print(s, flush=True) if _rank() == 0 else None)
    mesh_arg = (
        None
        if mesh in (None, "")
        else (tuple(int(x) for x in str(mesh).replace(",", "x").split("x")) if isinstance(mesh, str) else mesh)
    )
    batches = [make_batch(s) for s in range(steps)]
    ref_losses: list[float] = []
    ref_times: list[float] = []
    if reference:
        model, opt = build()
        torch.manual_seed(seed + 1)
        for b in batches:
            t = time.perf_counter()
            ref_losses.append(float(step(model, opt, *b).detach()))
            ref_times.append(time.perf_counter() - t)
        del model, opt
    model, opt = build()
    torch.manual_seed(seed + 1)
    cstep = metadist_compile(mesh=mesh_arg, solver=solver, memory_budget=memory_budget)(step)
    losses, times = [], []
    for b in batches:
        t = time.perf_counter()
        losses.append(float(cstep(model, opt, *b)))
        times.append(time.perf_counter() - t)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = cstep.plan
    say(
        f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters, {len(cstep.graph.ops)} ops traced, "
        f"world size {world}"
    )
    say(f"plan: {plan.summary()}")
    sharded = [
        v
        for v, s in plan.input_shardings.items()
        if not s.is_fully_replicated() and cstep.graph.vars[v].role in ("parameter", "optimizer_state")
    ]
    say(
        f"state stored sharded: {len(sharded)} of "
        f"{sum(1 for v in cstep.graph.inputs if cstep.graph.vars[v].role in ('parameter', 'optimizer_state'))} "
        f"tensors"
    )
    if os.environ.get("METADIST_SHOW_PLAN"):
        say(str(plan))
    ok = True
    for i, l in enumerate(losses):
        if ref_losses:
            r = ref_losses[i]
            good = abs(l - r) <= 1e-4 * max(1.0, abs(r))
            ok &= good
            say(f"step {i}: loss {l:.6f}   single-device {r:.6f}   {'ok' if good else 'DIFFERS'}")
        else:
            say(f"step {i}: loss {l:.6f}")
    steady = times[1:] or times
    say("compile: " + ", ".join(f"{k} {v:.2f}s" for k, v in cstep.timings.items()))
    msg = f"step time: {statistics.median(steady) * 1e3:.1f} ms (median of {len(steady)} after the compile)"
    if ref_times:
        msg += f"; single-device eager {statistics.median(ref_times[1:] or ref_times) * 1e3:.1f} ms"
    say(msg)
    if cstep.problem is not None:
        from metadist_core.plan.overlap import predict

        pr = predict(plan, cstep.problem)
        say(
            f"cost model's prediction for this plan: {pr.step * 1e3:.1f} ms (compute {pr.compute * 1e3:.1f}, "
            f"communication {pr.comm * 1e3:.1f} of which {pr.exposed_comm * 1e3:.1f} not overlapped)"
        )
    if world > 1:
        ddp_ms = _ddp_step_ms(build, batches, step, world)
        say(f"torch DDP on the same {world} ranks: {ddp_ms:.1f} ms per step")
        cores = os.cpu_count() or 1
        if cores < world:
            say(
                f"why not faster than one process: {world} ranks share {cores} CPU cores here, so they take turns "
                f"computing and every collective waits for a rank to be scheduled; the split pays off on one "
                f"device (or core) per rank"
            )
    return 0 if ok else 1


def _ddp_step_ms(build: Callable[[], tuple], batches: list, step: Callable, world: int) -> float:
    """The median step of torch DDP over the same step function, each rank on its slice of the batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model, opt = build()
    ddp = DDP(model)
    times = []
    for b in batches:
        local = tuple(
            x[x.shape[0] // world * rank : x.shape[0] // world * (rank + 1)]
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] % world == 0
            else x
            for x in b
        )
        dist.barrier()
        t = time.perf_counter()
        step(ddp, opt, *local)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:] or times) * 1e3


__all__ = ["run_example"]
