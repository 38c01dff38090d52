"""The cost model: collectives (alpha-beta per mesh axis), compute and memory; the reshard search is in
:mod:`metadist_core.cost.reshard`.

Every collective runs on one mesh **axis**: the devices that differ only in
their coordinate on that axis form a group of ``n = mesh.shape[axis]``.
Costs are ring-style alpha-beta figures in seconds, with ``nbytes`` the size
of the per-device buffer that the collective reads or writes (see each
function). :func:`metadist_core.cost.reshard.reshard` finds the cheapest *sequence* of
such steps between two Shardings and returns it, so that a frontend lowers
exactly what was priced.

Layout convention (as in ``placement.shard_shape``): mesh axes that split the
same tensor dim nest in mesh-axis order, axis 0 outermost. A step may only
change a Shard on an axis that is the innermost splitter of its dim, and may
only add a Shard of a dim on an axis behind every axis that splits it already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from metadist_core.ir.ir import DTYPE_BYTES
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Placement, Shard, Sharding, largest_local_shape, parse_placement

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "local_split",  # free: keep this device's slice of a replicated dim
    "local_partial",  # free: make a replicated value Partial (sum: zero it off coordinate 0)
)
# What reshard() emits, hence what a ShardingPlan holds and every lowering implements;
# send_recv is priced (for solvers that model pipelines) but never part of a reshard.
RESHARD_KINDS: tuple[str, ...] = tuple(k for k in COLLECTIVE_KINDS if k != "send_recv")


class UnknownCollectiveError(ValueError):
    """A plan step that no reshard emits, so no lowering runs it (a hand-edited or foreign plan)."""

    def __init__(self, kind: str, where: str) -> None:
        super().__init__(
            f"{where} cannot run collective {kind!r}: plans hold only the steps reshard() emits "
            f"({', '.join(RESHARD_KINDS)}); rebuild the plan with ShardingPlan.from_choices"
        )


# -- collective costs ------------------------------------------------------


def all_reduce_cost(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-reduce of a ``nbytes`` buffer on every device: 2(n-1) steps, 2(n-1)/n of the bytes."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


def all_gather_cost(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring all-gather; ``nbytes`` is the gathered (output) buffer per device."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes * beta


def reduce_scatter_cost(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Ring reduce-scatter; ``nbytes`` is the input buffer per device."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes * beta


def all_to_all_cost(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Pairwise all-to-all; ``nbytes`` is the local buffer, of which (n-1)/n leaves the device."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes * beta


def send_recv_cost(nbytes: float, alpha: float, beta: float) -> float:
    """One point-to-point message of ``nbytes``."""
    return alpha + nbytes * beta


def collective_cost(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Cost in seconds of one collective ``kind`` on a group of ``n`` devices."""
    if kind == "all_reduce":
        return all_reduce_cost(nbytes, n, alpha, beta)
    if kind == "all_gather":
        return all_gather_cost(nbytes, n, alpha, beta)
    if kind == "reduce_scatter":
        return reduce_scatter_cost(nbytes, n, alpha, beta)
    if kind == "all_to_all":
        return all_to_all_cost(nbytes, n, alpha, beta)
    if kind == "send_recv":
        return send_recv_cost(nbytes, alpha, beta)
    if kind in ("local_split", "local_partial"):
        return 0.0
    raise ValueError(f"unknown collective kind {kind!r}; known: {', '.join(COLLECTIVE_KINDS)}")


@dataclass(frozen=True)
class Collective:
    """One resharding step on one mesh axis.

    ``dims``: ``(dim,)`` for all_gather / reduce_scatter / local_split (the
    tensor dim gathered or split), ``(from_dim, to_dim)`` for all_to_all,
    ``()`` otherwise. ``reduce`` is the reduce op of all_reduce /
    reduce_scatter / local_partial. ``nbytes`` is the per-device buffer the
    cost was priced on, ``cost`` seconds. ``before``/``after`` are the whole
    Shardings around the step.
    """

    kind: str
    axis: int
    dims: tuple[int, ...]
    reduce: str | None
    nbytes: int
    cost: float
    before: Sharding
    after: Sharding

    def __str__(self) -> str:
        what = {
            "all_gather": "dim {0}",
            "reduce_scatter": "dim {0}",
            "local_split": "dim {0}",
            "all_to_all": "dim {0}->{1}",
        }.get(self.kind, "").format(*self.dims)
        red = f" {self.reduce}" if self.reduce else ""
        return (
            f"{self.kind}(axis {self.axis}{', ' + what if what else ''}{red}, "
            f"{_fmt_bytes(self.nbytes)}, {self.cost * 1e6:.1f} us)"
        )

    @property
    def is_free(self) -> bool:
        return self.kind in ("local_split", "local_partial")

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "axis": self.axis,
            "dims": list(self.dims),
            "reduce": self.reduce,
            "nbytes": self.nbytes,
            "cost": self.cost,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Collective":
        return cls(
            d["kind"],
            int(d["axis"]),
            tuple(d["dims"]),
            d.get("reduce"),
            int(d["nbytes"]),
            float(d["cost"]),
            Sharding.from_json(d["before"]),
            Sharding.from_json(d["after"]),
        )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


# -- resharding ------------------------------------------------------------


def itemsize(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 4)


def _normalise(sharding: Sharding, ndim: int, mesh: Mesh, what: str) -> tuple[Placement, ...]:
    if len(sharding) != mesh.ndim:
        raise ValueError(
            f"{what} sharding {sharding} has {len(sharding)} placements for the {mesh.ndim}-axis mesh {mesh}"
        )
    out = []
    for _axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{what} sharding {sharding} shards dim {p.dim} of a {ndim}-dim tensor")
            p = Shard(p.dim % ndim)
        out.append(p)
    return tuple(out)


# -- compute ---------------------------------------------------------------


@dataclass(frozen=True)
class DeviceSpec:
    """Peak figures of one device for the roofline: FLOP/s, memory bytes/s, memory capacity."""

    name: str = "cpu"
    peak_flops: float = 100e9
    mem_bandwidth: float = 20e9
    memory_bytes: int = 16 * 2**30
    op_overhead: float = 0.0  # seconds every op costs on top of the roofline (dispatch; measured)
    # peak FLOP/s per compute dtype where it differs from ``peak_flops`` (tensor cores: bf16/fp16); a dict
    # is accepted and kept as sorted (dtype, FLOP/s) pairs so that the spec stays hashable
    flops_by_dtype: tuple[tuple[str, float], ...] | dict[str, float] = ()
    # bytes/s between host memory and this device (PCIe/NVLink-C2C); None: the host is this device (a CPU):
    # offload's transfers are free (metadist_core.levers.offload)
    host_link: float | None = None
    # memory bytes/s by the bytes an op moves, measured ((bytes, bytes/s) pairs, ascending): an op whose data
    # stays in cache runs far faster than one that streams from memory and faults its fresh output's pages in;
    # () : ``mem_bandwidth`` alone
    mem_curve: tuple[tuple[float, float], ...] = ()
    # the fraction of an asynchronous collective's time that compute running beside it hides, measured on the
    # live ranks (metadist_torch.measure.calibrate.measure_overlap): 1 where the link has its own engine (NCCL on a
    # GPU), about 0 where the collective needs the cores the compute runs on (4 gloo ranks on 2 cores); the
    # rest of the collective's time the compute beside it is slowed by (metadist_core.plan.overlap.predict)
    overlap: float = 1.0

    def __post_init__(self) -> None:
        pairs = self.flops_by_dtype.items() if isinstance(self.flops_by_dtype, dict) else self.flops_by_dtype
        object.__setattr__(self, "flops_by_dtype", tuple(sorted((str(k), float(v)) for k, v in pairs)))
        object.__setattr__(self, "mem_curve", tuple(sorted((float(b), float(r)) for b, r in self.mem_curve)))

    def bandwidth_for(self, nbytes: float) -> float:
        """Memory bytes/s of an op that moves ``nbytes``: ``mem_curve`` interpolated in log-bytes (its
        ends beyond its range), or ``mem_bandwidth`` without one."""
        c = self.mem_curve
        if not c:
            return self.mem_bandwidth
        if nbytes <= c[0][0]:
            return c[0][1]
        for (b0, r0), (b1, r1) in zip(c, c[1:]):
            if nbytes <= b1:
                w = (math.log(nbytes) - math.log(b0)) / max(math.log(b1) - math.log(b0), 1e-12)
                return r0 + w * (r1 - r0)
        return c[-1][1]

    def flops_for(self, dtype: str | None) -> float:
        """Peak FLOP/s of compute in ``dtype`` (canonical string); ``peak_flops`` where none is given."""
        return dict(self.flops_by_dtype).get(dtype, self.peak_flops) if dtype else self.peak_flops

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "peak_flops": self.peak_flops,
            "mem_bandwidth": self.mem_bandwidth,
            "memory_bytes": self.memory_bytes,
            "op_overhead": self.op_overhead,
            "flops_by_dtype": dict(self.flops_by_dtype),
            "host_link": self.host_link,
            "mem_curve": [list(p) for p in self.mem_curve],
            "overlap": self.overlap,
        }

    @classmethod
    def from_json(cls, d: dict) -> "DeviceSpec":
        return cls(
            d.get("name", "device"),
            float(d["peak_flops"]),
            float(d["mem_bandwidth"]),
            int(d.get("memory_bytes", 16 * 2**30)),
            float(d.get("op_overhead", 0.0)),
            dict(d.get("flops_by_dtype") or {}),
            None if d.get("host_link") is None else float(d["host_link"]),
            tuple(tuple(p) for p in d.get("mem_curve") or ()),
            float(d.get("overlap", 1.0)),
        )


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec(),
    # peak_flops: fp32 without tensor cores; bf16/fp16: dense tensor-core figures (A100 312, H100/H200 SXM 989)
    # host_link: PCIe gen4 x16 (A100) / gen5 x16 (H100, H200), about 25 / 50 GB/s each way
    "a100": DeviceSpec(
        "a100", 19.5e12, 1.6e12, 80 * 2**30, flops_by_dtype={"bfloat16": 312e12, "float16": 312e12}, host_link=25e9
    ),
    "h100": DeviceSpec(
        "h100", 67e12, 3.3e12, 80 * 2**30, flops_by_dtype={"bfloat16": 989e12, "float16": 989e12}, host_link=50e9
    ),
    "h200": DeviceSpec(
        "h200", 67e12, 4.8e12, 141 * 10**9, flops_by_dtype={"bfloat16": 989e12, "float16": 989e12}, host_link=50e9
    ),
}


def compute_dtype(inputs: Sequence[str], outputs: Sequence[str] = ()) -> str | None:
    """The dtype an op computes in: its widest floating input dtype (else output dtype); None without one.

    Autocast casts both operands of a matmul, so its inputs are bf16/fp16; a
    mixed op is priced at the slower, wider rate."""
    floats = [d for d in inputs if d in FLOAT_DTYPES] or [d for d in outputs if d in FLOAT_DTYPES]
    return max(floats, key=lambda d: (itemsize(d), d)) if floats else None


FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "complex64", "complex128"})


def compute_cost(
    flops: float,
    nbytes: float,
    split: int = 1,
    device: DeviceSpec | None = None,
    dtype: str | None = None,
    slowdown: float = 1.0,
) -> float:
    """Seconds of an op that does ``flops`` in ``dtype`` and moves ``nbytes``, split ``split`` ways: its
    roofline times ``slowdown`` (how much slower than its roofline the op was measured to run on this
    device, :mod:`metadist_torch.measure.optime`; 1 where unmeasured), plus the per-op overhead.

    The FLOP rate is ``device.flops_for(dtype)`` (tensor-core rates for bf16/fp16 where the device has them),
    the memory rate ``device.bandwidth_for`` the local bytes; bytes are counted at each tensor's own dtype."""
    dev = device or DEVICE_PRESETS["cpu"]
    split = max(1, int(split))
    local = nbytes / split
    roof = max(flops / split / dev.flops_for(dtype), local / dev.bandwidth_for(local) if local > 0 else 0.0)
    return roof * slowdown + dev.op_overhead


def strategy_split(inputs: Sequence[Sharding], outputs: Sequence[Sharding], mesh: Mesh) -> int:
    """How many ways a strategy divides an op's work: the product of the axes on which it splits a dim.

    An axis on which values are only Partial does not divide the work: every
    device still runs the op on a full-size (partial) value.
    """
    split = 1
    for axis, n in enumerate(mesh.shape):
        if any(sh[axis].is_shard() for sh in (*inputs, *outputs)):
            split *= n
    return split


# -- memory ----------------------------------------------------------------


def local_shape(shape: Sequence[int], sharding: Sharding, mesh: Mesh) -> tuple[int, ...]:
    """The largest device's local shape of a tensor under ``sharding`` (the whole shape where some device
    would get an empty piece)."""
    local = largest_local_shape(tuple(shape), _normalise(sharding, len(shape), mesh, "memory"), mesh.shape)
    return tuple(shape) if local is None else local


def local_bytes(shape: Sequence[int] | None, dtype: str, sharding: Sharding, mesh: Mesh) -> int:
    """Bytes of the largest local piece of a tensor under ``sharding`` (0 for a non-tensor)."""
    if shape is None:
        return 0
    return math.prod(local_shape(shape, sharding, mesh)) * itemsize(dtype)


__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "DeviceSpec",
    "DEVICE_PRESETS",
    "all_gather_cost",
    "all_reduce_cost",
    "all_to_all_cost",
    "collective_cost",
    "compute_cost",
    "compute_dtype",
    "local_bytes",
    "local_shape",
    "reduce_scatter_cost",
    "send_recv_cost",
    "strategy_split",
    "parse_placement",
]
