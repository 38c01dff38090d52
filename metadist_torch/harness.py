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
    backend: str | None = None,
    rounds: int = 20,
) -> int:
    """Run ``step`` compiled over the world for ``steps`` steps next to the eager single-device step, then
    time it in ``rounds`` interleaved rounds against what a user would run instead: torch DDP on the same
    ranks, or the eager step at world size 1 (:func:`time_against`).

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
    if reference:
        model, opt = build()
        torch.manual_seed(seed + 1)
        ref_losses = [float(step(model, opt, *b).detach()) for b in batches]
        del model, opt
    model, opt = build()
    torch.manual_seed(seed + 1)
    cstep = metadist_compile(mesh=mesh_arg, solver=solver, memory_budget=memory_budget, backend=backend)(step)
    losses = [float(cstep(model, opt, *b)) for b in batches]
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
    say("compile: " + ", ".join(f"{k} {v:.2f}s" for k, v in cstep.timings.items()))
    world_name = f"torch DDP on the same {world} ranks" if world > 1 else "the eager step on one device"
    other = _ddp_runner(build, step, world) if world > 1 else _eager_runner(build, step)
    mine = lambda b: cstep(model, opt, *b)  # noqa: E731
    got = time_against({"metadist": mine, "other": other}, batches, rounds)
    md, ot = got["metadist"], got["other"]
    say(
        f"step time, {rounds} interleaved rounds (median, fastest-slowest): MetaDist "
        f"({cstep.settings.backend}) {_ms(md)}; {world_name} {_ms(ot)}; "
        f"MetaDist / {'DDP' if world > 1 else 'eager'} {statistics.median(a / b for a, b in zip(md, ot)):.2f}x "
        f"(median of the rounds' ratios)"
    )
    if cstep.problem is not None:
        from metadist_core.plan.overlap import predict

        pr = predict(plan, cstep.problem)
        say(
            f"cost model's prediction for this plan: {pr.step * 1e3:.1f} ms (compute {pr.compute * 1e3:.1f}, "
            f"communication {pr.comm * 1e3:.1f} of which {pr.exposed_comm * 1e3:.1f} not overlapped)"
        )
    cores = os.cpu_count() or 1
    if world > 1 and cores < world:
        say(
            f"why not faster than one process: {world} ranks share {cores} CPU cores here, so they take turns "
            f"computing and every collective waits for a rank to be scheduled; the split pays off on one "
            f"device (or core) per rank"
        )
    return 0 if ok else 1


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.1f} ms ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})"


def time_against(runs: dict[str, Callable[[tuple], Any]], batches: list, rounds: int) -> dict[str, list[float]]:
    """Seconds of each of ``runs`` (name -> ``run(batch)``) over ``rounds`` rounds of one step each, after
    one untimed step each; the order alternates from round to round, so that a slow spell of a shared
    machine falls on both alike. On several ranks every step starts at a barrier."""
    import torch.distributed as dist

    sync = dist.barrier if dist.is_available() and dist.is_initialized() else (lambda: None)
    names = list(runs)
    for n in names:
        sync()
        runs[n](batches[0])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            b = batches[r % len(batches)]
            sync()
            t = time.perf_counter()
            runs[n](b)
            times[n].append(time.perf_counter() - t)
    return times


def _eager_runner(build: Callable[[], tuple], step: Callable) -> Callable[[tuple], Any]:
    model, opt = build()
    return lambda b: step(model, opt, *b)


def _ddp_runner(build: Callable[[], tuple], step: Callable, world: int) -> Callable[[tuple], Any]:
    """torch DDP over the same step function, each rank on its slice of the batch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model, opt = build()
    ddp = DDP(model)

    def run(b: tuple) -> Any:
        local = tuple(
            x[x.shape[0] // world * rank : x.shape[0] // world * (rank + 1)]
            if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] % world == 0
            else x
            for x in b
        )
        return step(ddp, opt, *local)

    return run


__all__ = ["run_example"]
