"""This device's rates as the cost model prices them: matmul FLOP/s by dtype, the memory rate by size,
per-op dispatch and, on a GPU, the host link (a :class:`~metadist_core.cost.model.DeviceSpec`)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Callable

from metadist_core.cost.timing import time_call

from ..runtime.engine import device

if TYPE_CHECKING:  # pragma: no cover - types only
    import torch

    from metadist_core.cost.model import DeviceSpec

# float32 elements of the adds that time the memory rate by size (DeviceSpec.mem_curve); 16x on a GPU (1 GiB at most)
CURVE_ELEMENTS = (1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
LOW_DTYPES = ("bfloat16", "float16")  # the matmul rates timed beside float32's (DeviceSpec.flops_by_dtype)


def curve_elements(dev) -> tuple[int, ...]:
    """The adds' sizes that time the memory-rate curve on ``dev``."""
    return CURVE_ELEMENTS if dev.type == "cpu" else tuple(e << 4 for e in CURVE_ELEMENTS)


#: ops in the program that times the per-op dispatch (DeviceSpec.op_overhead)
DISPATCH_OPS = 100


def dispatch_program(dev, n: int = DISPATCH_OPS) -> Callable[[], object]:
    """A call that runs ``n`` tiny ops as a lowered step runs its ops: an fx GraphModule calling aten
    overloads one after another. Its time over ``n`` is what every op costs beside its roofline, as the
    program pays it (a Python loop of ``t.add(1.0)`` calls pays more a call than the program does)."""
    import torch
    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    y = x
    for _ in range(n):
        y = g.call_function(torch.ops.aten.add.Tensor, (y, x))
    g.output(y)
    gm = fx.GraphModule(torch.nn.Module(), g)
    tiny = torch.randn(8, device=dev)
    return lambda: gm(tiny)


def measure_device_rates(iters: int = 7, before=None, window: float = 0.0, alone: bool = False, dev=None) -> dict:
    """This process's matmul FLOP/s, memory-bound bytes/s (also by bytes moved: ``mem_curve``) and per-op
    overhead (medians). ``before``: a barrier, so that the ranks of one machine measure at once and the
    figures include what they take from each other (ranks that share cores read far lower rates so than
    one at a time). ``window``: seconds each timing lasts at least; ranks that share cores need
    one far longer than a time slice, or the figures depend on which ranks the scheduler ran in it.
    ``alone``: the rates of
    this process while it has the device to itself: the fastest of ``iters`` single calls (what
    :mod:`metadist_torch.measure.optime` divides an op's own fastest time by). ``dev``: the device (default: the
    rank's, :func:`metadist_torch.runtime.engine.device`)."""
    import torch

    dev = dev if dev is not None else device()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    n = 2048 if dev.type == "cuda" else 256
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    x = torch.randn(1 << 20 if dev.type == "cpu" else 1 << 26, device=dev)
    pick = min if alone else statistics.median

    def timed(fn, reps: int = 1) -> float:
        return time_call(fn, iters, sync=sync, before=before, reps=1 if alone else reps, window=window, pick=pick)

    mm = timed(lambda: a @ b, 20)
    add = timed(lambda: x.add(1.0), 5)
    over = timed(dispatch_program(dev)) / DISPATCH_OPS
    low = {}  # bf16/fp16 matmul rates: tensor cores (or AMX on a CPU) make them far faster, or far slower
    for name, dt in ((k, getattr(torch, k)) for k in LOW_DTYPES):
        a16, b16 = a.to(dt), b.to(dt)
        low[name] = 2 * n**3 / max(timed(lambda: a16 @ b16, 5) - over, 1e-9)
    curve = []  # bytes/s by bytes moved: in cache, streamed, and with a fresh output's pages faulted in
    for k in curve_elements(dev):
        y = torch.randn(k, device=dev)
        t = timed(lambda: y.add(1.0), max(1, (1 << 18) // k))
        curve.append((2 * k * 4, 2 * k * 4 / max(t - over, 1e-9)))
    return {
        "peak_flops": 2 * n**3 / max(mm - over, 1e-9),
        "mem_bandwidth": 2 * x.numel() * 4 / max(add - over, 1e-9),
        "op_overhead": over,
        "flops_by_dtype": low,
        "mem_curve": curve,
    }


def measure_device(seconds: float = 0.5, on: "torch.device | None" = None) -> "DeviceSpec":
    """This process's rates on device ``on`` (default: the rank's, :func:`metadist_torch.runtime.engine.device`) as
    the cost model's DeviceSpec: matmul FLOP/s, memory rate by bytes moved, per-op dispatch
    (:func:`measure_device_rates`, alone: the rates :mod:`metadist_torch.measure.optime` divides each op's time
    by) and, on a GPU, the host link (pinned host to device copies of 64 MiB, the fastest over about
    ``seconds / 2``)."""
    import torch

    from metadist_core.cost.model import DeviceSpec

    dev = on if on is not None else device()
    r = measure_device_rates(iters=7, alone=True, dev=dev)
    link = None  # a CPU is its own host (metadist_core.levers.offload): no link to price
    if dev.type == "cuda":
        h = torch.empty(1 << 24, pin_memory=True)
        x = torch.empty(h.shape, device=dev)
        best = time_call(
            lambda: x.copy_(h, non_blocking=True),
            None,
            sync=lambda: torch.cuda.synchronize(dev),
            budget=seconds / 2,
            pick=min,
        )
        link = h.numel() * 4 / best
    return DeviceSpec(
        f"measured-{dev.type}",
        float(r["peak_flops"]),
        float(r["mem_bandwidth"]),
        host_link=link,
        op_overhead=float(r["op_overhead"]),
        flops_by_dtype=r["flops_by_dtype"],
        mem_curve=r["mem_curve"],
    )


# bytes per collective for the kinds timed apart from the all_reduces (all_gather: per rank, the output is n x)
