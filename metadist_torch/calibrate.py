"""Time real collectives with torch.distributed and write a mesh profile (``metadist calibrate``).

Runs inside an existing process group (under torchrun), or spawns ``nprocs``
local processes itself (gloo on CPU, NCCL when CUDA is there). Timings are
medians after a warm-up; alpha and beta per link level are fitted with
:func:`metadist_core.profile.fit_alpha_beta`.
"""
from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

from metadist_core.profile import MeshProfile, profile_from_samples

log = logging.getLogger("metadist.calibrate")

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)   # bytes
KINDS = ("all_reduce", "all_gather")


def _time(fn, iters: int, sync) -> float:
    fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


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
                t = torch.tensor([_time(fn, iters, sync)], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                samples.append({"level": level, "kind": kind, "n": n, "nbytes": size, "seconds": float(t.item())})
    return samples


def _worker(rank: int, nprocs: int, init_file: str, out_path: str, sizes, iters: int) -> None:
    import torch.distributed as dist
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(nprocs))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=nprocs)
    try:
        samples = measure(sizes, iters)
        if rank == 0:
            profile_from_samples(samples, 1, nprocs, "gloo").save(out_path)
    finally:
        dist.destroy_process_group()


def run_calibrate(out_path: str | os.PathLike, *, nprocs: int | None = None, sizes: Sequence[int] = DEFAULT_SIZES,
                  iters: int = 5) -> MeshProfile:
    """Measure collectives and write the profile to ``out_path``; returns it.

    Inside an initialised process group (torchrun) every rank measures and rank
    0 writes; otherwise ``nprocs`` (default 2) local gloo processes are spawned.
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
        dist.barrier()
        return prof
    import torch.multiprocessing as mp

    n = int(nprocs or 2)
    if n < 2:
        raise ValueError(f"calibrate needs at least 2 processes to time collectives; got nprocs={n}")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(n, os.path.join(d, "init"), str(out), tuple(sizes), iters), nprocs=n, join=True)
    from metadist_core.profile import load_profile
    return load_profile(out)
