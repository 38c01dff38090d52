"""Time real collectives with torch.distributed and write a mesh profile (``metadist calibrate``).

Runs inside an existing process group (under torchrun), or spawns ``nprocs``
local processes itself (gloo on CPU, NCCL when CUDA is there). Timings are
medians after a warm-up; alpha and beta per link level are fitted with
:func:`metadist_core.cost.profile.fit_alpha_beta`.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from metadist_core.cost.profile import MeshProfile, profile_from_samples
from metadist_core.cost.timing import time_call

from ..lower.collectives import _group_name, _ops
from .devicerates import LOW_DTYPES, curve_elements, dispatch_program, measure_device_rates

log = logging.getLogger("metadist.calibrate")

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)  # bytes
KINDS = ("all_reduce", "all_gather")


def measure(sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 5) -> list[dict]:
    """Time all_reduce and all_gather per link level in the current process group; same list on every rank."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // local)
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    groups = {}
    intra_groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]
    groups["intra"] = (intra_groups[rank // local], local)
    if nodes > 1:
        inter = [dist.new_group(list(range(r, world, local))) for r in range(local)]
        groups["inter"] = (inter[rank % local], nodes)
    samples = []
    for level, (group, n) in groups.items():
        if n < 2:
            continue
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            x = torch.ones(numel, dtype=torch.float32, device=dev)
            outs = [torch.empty_like(x) for _ in range(n)]
            for kind in KINDS:
                if kind == "all_reduce":
                    fn = lambda: dist.all_reduce(x, group=group)
                    size = numel * 4
                else:
                    fn = lambda: dist.all_gather(outs, x, group=group)
                    size = numel * 4 * n
                t = torch.tensor([time_call(fn, iters, sync=sync)], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                samples.append({"level": level, "kind": kind, "n": n, "nbytes": size, "seconds": float(t.item())})
    return samples


def _worker(
    rank: int, nprocs: int, init_file: str, out_path: str, sizes, iters: int, refresh: Callable[[], object] | None
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_WORLD_SIZE", str(nprocs))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=nprocs)
    try:
        samples = measure(sizes, iters)
        if rank == 0:
            profile_from_samples(samples, 1, nprocs, "gloo").save(out_path)
        if refresh is not None:
            refresh()
    finally:
        dist.destroy_process_group()


def run_calibrate(
    out_path: str | os.PathLike,
    *,
    nprocs: int | None = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 5,
    refresh: Callable[[], object] | None = None,
) -> MeshProfile:
    """Measure collectives and write the profile to ``out_path``; returns it.

    Inside an initialised process group (torchrun) every rank measures and rank
    0 writes; otherwise ``nprocs`` (default 2) local gloo processes are spawned.
    ``refresh``: called on every rank inside the process group once the profile
    is written (the frontend re-measures the profile its compiles cache:
    :func:`metadist_torch.plugin.refresh_cached_profile`); a module-level function,
    as the spawned processes receive it pickled.
    """
    import torch.distributed as dist

    out = Path(out_path)
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        samples = measure(sizes, iters)
        prof = profile_from_samples(samples, max(1, world // local), local, dist.get_backend())
        if dist.get_rank() == 0:
            prof.save(out)
        if refresh is not None:
            refresh()
        dist.barrier()
        return prof
    import torch.multiprocessing as mp

    n = int(nprocs or 2)
    if n < 2:
        raise ValueError(f"calibrate needs at least 2 processes to time collectives; got nprocs={n}")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(
            _worker, args=(n, os.path.join(d, "init"), str(out), tuple(sizes), iters, refresh), nprocs=n, join=True
        )
    from metadist_core.cost.profile import load_profile

    return load_profile(out)


# -- measured by default: the first compile on a machine ----------------------------

# bytes per all_reduce timed on each mesh axis: up to 16 MiB, where the bandwidth term outweighs the
# latency and the ranks' uneven arrival (with small messages only, the fit can read beta as 0)
LIVE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
SHARE_SECONDS = 0.1  # about how long the mixed compute that measures the ranks' share of the device runs
#: alone/at-once pairs the share is the median of (one pair can read far off when a slow spell of the machine
#: falls on it)
SHARE_ROUNDS = 3


def measure_share(dev, iters: int = 5) -> float:
    """How many times longer compute takes on this rank while every rank of the process group computes
    at once than while it runs alone (``DeviceSpec`` rates are the alone ones divided by it): at least 1.
    The compute is a mix like a step's (small matmuls, adds, a program of tiny ops) and runs for about
    :data:`SHARE_SECONDS`, several scheduler time slices: ranks that share cores take turns only over
    such spans (short kernels timed all at once read less of the share than a step pays, and rates timed
    at once over short windows do not price a step's compute right). Rank 0 times
    it alone while the others wait, then all time it at once, the slowest rank's median; the figure is
    the median ratio of :data:`SHARE_ROUNDS` such pairs.
    One rank per device (NCCL, one GPU each): about 1."""
    import torch
    import torch.distributed as dist

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    a = torch.randn(128, 128, device=dev)
    x = torch.randn(1 << 16, device=dev)
    prog = dispatch_program(dev, 50)

    def unit():
        for _ in range(4):
            a @ a
        x.add(1.0)
        prog()

    from metadist_core.cost.timing import calls_per_window

    unit()
    sync()
    t0 = time.perf_counter()
    unit()
    sync()
    reps = calls_per_window(time.perf_counter() - t0, SHARE_SECONDS)
    t = torch.tensor([reps], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)  # every rank runs the same work
    reps = int(t.item())

    def work():
        for _ in range(reps):
            unit()
        sync()

    # all at once: from a barrier to the barrier after every rank's work, on each rank, the longest of them. A
    # rank's own work timed from when the scheduler first runs it would read about its alone time where the
    # ranks take turns on the cores, and the share would come out near 1
    def together():
        work()
        dist.barrier()

    together()
    ratios = []
    for _ in range(SHARE_ROUNDS):  # alone and at once in turns: a slow spell of the machine falls on one ratio
        alone = torch.zeros(1, dtype=torch.float64, device=dev)
        dist.barrier()
        if dist.get_rank() == 0:
            alone[0] = time_call(work, iters, sync=lambda: None, pick=min)
        dist.barrier()
        dist.all_reduce(alone)  # rank 0's figure on every rank
        both = torch.tensor(
            [time_call(together, iters, sync=lambda: None, before=dist.barrier)], dtype=torch.float64, device=dev
        )
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        ratios.append(float(both.item()) / max(float(alone.item()), 1e-9))
    return max(1.0, statistics.median(ratios))


KIND_SIZES = (1 << 12, 1 << 18, 1 << 22)


def _measure_kinds(axes: Sequence[tuple], dev, work, base: float, iters: int, sync) -> list[tuple[dict, list]]:
    """Per axis ``(group, n, beta)``: alpha/beta of the all_gather, reduce_scatter and all_to_all the lowering
    runs, each timed between compute as the all_reduces are and fitted on its own ring factors, and the time of
    a one-element all_reduce (``all_reduce_tiny``: gloo runs an all_reduce of fewer elements than ranks in far
    fewer steps than a ring).
    Size by size, every axis in turn (as the all_reduces are). The same figures on every rank (the slowest
    rank's). Returns ``(kinds, samples)`` per axis."""
    import torch
    import torch.distributed as dist

    from metadist_core.cost.profile import collective_factors, fit_alpha_beta

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer names first
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows: list[dict[str, list | None]] = [{"all_gather": [], "reduce_scatter": [], "all_to_all": []} for _ in axes]
    for nbytes in KIND_SIZES:
        for ax, (group, n, _) in enumerate(axes):
            numel = max(n, nbytes // 4 // n * n)
            x = torch.ones(numel, dtype=torch.float32, device=dev)
            gathered = torch.empty(numel * n, dtype=torch.float32, device=dev)
            piece = torch.empty(numel // n, dtype=torch.float32, device=dev)
            out = torch.empty_like(x)
            calls = {
                "all_gather": (lambda: gather(gathered, x, group=group), numel * 4 * n),
                "reduce_scatter": (lambda: scatter(piece, x, group=group), numel * 4),
                "all_to_all": (lambda: dist.all_to_all_single(out, x, group=group), numel * 4),
            }
            for kind, (fn, size) in calls.items():
                if rows[ax][kind] is None:
                    continue
                try:
                    fn()
                except (RuntimeError, NotImplementedError, ValueError) as e:  # a backend without it: not priced apart
                    log.debug("calibrate: %s on this backend: %s", kind, e)
                    rows[ax][kind] = None
                    continue
                both = time_call(lambda: (work(), fn()), iters, sync=sync)
                rows[ax][kind].append((kind, n, size, max(both - base, 1e-7)))
    one = torch.ones(1, dtype=torch.float32, device=dev)
    tiny = [
        max(time_call(lambda: (work(), dist.all_reduce(one, group=group)), iters, sync=sync) - base, 1e-7)
        for group, _, _ in axes
    ]
    flat = [
        [r for rs in rows[ax].values() if rs for r in rs] + [("all_reduce_tiny", n, 4, tiny[ax])]
        for ax, (_, n, _) in enumerate(axes)
    ]
    t = torch.tensor([r[3] for f in flat for r in f], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank prices alike: the slowest rank's timings
    it = iter(t.tolist())
    out_axes = []
    for ax, (_, n, beta) in enumerate(axes):
        mine_all = [(k, nn, b, float(next(it))) for k, nn, b, _ in flat[ax]]
        kinds = {}
        for kind in rows[ax]:
            mine = [r for r in mine_all if r[0] == kind]
            if mine:
                a, b = fit_alpha_beta(mine)
                kinds[kind] = {"alpha": a, "beta": b}
        steps = collective_factors("all_reduce", n)[0]
        kinds["all_reduce_tiny"] = {"alpha": mine_all[-1][3] / steps, "beta": beta}
        out_axes.append((kinds, [{"kind": k, "n": nn, "nbytes": b, "seconds": v} for k, nn, b, v in mine_all]))
    return out_axes


#: float32 elements of the all_reduce whose overlap with compute is timed (4 MiB: a gradient bucket's size)
OVERLAP_ELEMENTS = 1 << 20


def measure_overlap(group, dev, work, iters: int, sync) -> float:
    """The fraction of an asynchronous all_reduce's time that ``work`` (compute) running beside it hides on
    this process group (``DeviceSpec.overlap``): the compute alone, the all_reduce alone, then the
    all_reduce started, the compute run and the all_reduce waited for, as the lowering runs a gradient
    bucket; ``(compute + all_reduce - both) / min(compute, all_reduce)``, clamped to [0, 1], from the
    slowest rank's medians. Where gloo ranks share cores, both together take about as long as one after
    the other (the collective needs the cores the compute runs on): about 0. NCCL on a GPU runs the
    collective on its own stream: near 1."""
    import torch
    import torch.distributed as dist

    ops, name = _ops(), _group_name(group)
    x = torch.ones(OVERLAP_ELEMENTS, dtype=torch.float32, device=dev)

    def comm():
        ops.wait_tensor(ops.all_reduce(x, "sum", name))

    def barrier():
        dist.barrier(group=group)

    def timed(fn) -> float:  # the slowest rank's median
        t = torch.tensor([time_call(fn, iters, sync=sync, before=barrier)], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    # as much compute as the all_reduce takes (else the smaller one's noise is all the figure says)
    reps = max(1, min(200, round(timed(comm) / max(timed(work), 1e-7))))

    def compute():
        for _ in range(reps):
            work()

    def both():
        pending = ops.all_reduce(x, "sum", name)
        compute()
        ops.wait_tensor(pending)

    fractions = []
    for _ in range(3):  # the median of three measurements
        tc, tm, tb = timed(compute), timed(comm), timed(both)
        fractions.append(min(1.0, max(0.0, (tc + tm - tb) / max(min(tc, tm), 1e-9))))
    return statistics.median(fractions)


def measure_live(engine, mesh, cached: MeshProfile | None = None, iters: int = 7) -> MeshProfile:
    """Alpha/beta of every axis of ``mesh`` on the engine's live process groups, and the device's
    rates, as a profile (``cached`` grows by this mesh when given). Every rank calls it; every rank gets
    the same figures (the slowest rank's timings)."""
    import torch
    import torch.distributed as dist

    from metadist_core.cost.model import DeviceSpec
    from metadist_core.cost.profile import fit_alpha_beta

    dev = engine.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    groups = engine.groups()
    axes, samples = [], []
    a = torch.randn(192, 192, device=dev)
    work = lambda: [a @ a for _ in range(8)]  # the compute a collective sits between in a step
    for group in groups:
        for _ in range(3):  # the first collectives of a group set its connections up: not timed
            dist.all_reduce(torch.ones(1, device=dev), group=group)
    base = time_call(work, iters, sync=sync)
    rows: list[list] = [[] for _ in groups]
    # size by size, every axis in turn: a slow spell of the shared machine falls on all the axes alike (timed
    # axis by axis, it would fall on one axis's figures)
    for nbytes in LIVE_SIZES:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
        for axis, group in enumerate(groups):
            n = mesh.shape[axis]
            # timed between compute, as in a step: the ranks arrive at the collective as unevenly as they
            # do there (ranks sharing cores are scheduled in turn), which a loop of bare collectives hides
            both = time_call(lambda: (work(), dist.all_reduce(x, group=group)), iters, sync=sync)
            t = torch.tensor([max(both - base, 1e-7)], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows[axis].append(("all_reduce", n, x.numel() * 4, float(t.item())))
            samples.append(
                {
                    "level": f"axis{axis}",
                    "kind": "all_reduce",
                    "n": n,
                    "nbytes": x.numel() * 4,
                    "seconds": float(t.item()),
                }
            )
    for axis in range(len(groups)):
        n = mesh.shape[axis]
        fa, fb = fit_alpha_beta(rows[axis]) if n > 1 else (0.0, 0.0)
        axes.append({"alpha": fa, "beta": fb})
    wide_axes = [ax for ax in range(len(groups)) if mesh.shape[ax] > 1]
    measured = (
        _measure_kinds(
            [(groups[ax], mesh.shape[ax], axes[ax]["beta"]) for ax in wide_axes], dev, work, base, iters, sync
        )
        if wide_axes
        else []
    )
    for ax, (kinds, more) in zip(wide_axes, measured):
        axes[ax]["kinds"] = kinds
        samples += [{"level": f"axis{ax}", **m} for m in more]
    # how much of an asynchronous collective the compute beside it hides, on the widest axis
    wide = max(range(len(groups)), key=lambda ax: mesh.shape[ax], default=None)
    hidden = 1.0
    if wide is not None and mesh.shape[wide] > 1:
        hidden = measure_overlap(groups[wide], dev, work, iters, sync=sync)
    # the rates of one rank alone (the fastest of single calls, as metadist_torch.measure.optime times each op),
    # divided by the share of the device a rank gets while all compute at once
    # (rank 0 alone times them while the others wait: the same device on every rank)
    share = measure_share(dev)
    low = sorted(LOW_DTYPES)
    curve = [(2 * k * 4, 0.0) for k in curve_elements(dev)]
    vec = torch.zeros(3 + len(low) + len(curve), dtype=torch.float64, device=dev)
    dist.barrier()
    if dist.get_rank() == 0:
        rates = measure_device_rates(iters=7, alone=True, dev=dev)
        vec = torch.tensor(
            [rates["peak_flops"], rates["mem_bandwidth"], -rates["op_overhead"]]
            + [rates["flops_by_dtype"][k] for k in low]
            + [r for _, r in rates["mem_curve"]],
            dtype=torch.float64,
            device=dev,
        )
    dist.broadcast(vec, 0)
    vec[0] /= share
    vec[1] /= share
    vec[2] *= share
    vec[3:] /= share
    log.info(
        "measured device: %.1f GFLOP/s alone, %.2fx slower with every rank computing at once",
        float(vec[0]) * share / 1e9,
        share,
    )
    device_spec = DeviceSpec(
        f"measured-{dev.type}",
        float(vec[0]),
        float(vec[1]),
        op_overhead=float(-vec[2]),
        flops_by_dtype={k: float(vec[3 + i]) for i, k in enumerate(low)},
        mem_curve=[(b, float(vec[3 + len(low) + i])) for i, (b, _) in enumerate(curve)],
        overlap=hidden,
    )
    shape_key = "x".join(map(str, mesh.shape))
    if cached is not None:
        prof = MeshProfile.from_json(cached.to_json())
    else:
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        inner = axes[-1] if axes else {"alpha": 1e-5, "beta": 1e-10}
        prof = MeshProfile(
            max(1, world // local),
            local,
            {"intra": dict(inner), "inter": dict(axes[0] if axes else inner)},
            dist.get_backend(),
            True,
        )
    prof.device = device_spec
    prof.axis_costs[shape_key] = axes
    prof.samples = list(prof.samples) + samples
    prof.measured = True
    return prof
