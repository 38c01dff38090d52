"""The cost model: collectives (alpha-beta per mesh axis), resharding, compute and memory.

Every collective runs on one mesh **axis**: the devices that differ only in
their coordinate on that axis form a group of ``n = mesh.shape[axis]``.
Costs are ring-style alpha-beta figures in seconds, with ``nbytes`` the size
of the per-device buffer that the collective reads or writes (see each
function). :func:`reshard` finds the cheapest *sequence* of such steps between
two Shardings (Dijkstra over the per-axis placements) and returns it, so that
a frontend lowers exactly what was priced.

Layout convention (as in ``placement.shard_shape``): mesh axes that split the
same tensor dim nest in mesh-axis order, axis 0 outermost. A step may only
change a Shard on an axis that is the innermost splitter of its dim, and may
only add a Shard of a dim on an axis behind every axis that splits it already.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from .ir import DTYPE_BYTES
from .placement import Mesh, Partial, Placement, Replicate, Shard, Sharding, largest_local_shape, parse_placement

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv",
    "local_split",    # free: keep this device's slice of a replicated dim
    "local_partial",  # free: make a replicated value Partial (sum: zero it off coordinate 0)
)
# What reshard() emits, hence what a ShardingPlan holds and every lowering implements;
# send_recv is priced (for solvers that model pipelines) but never part of a reshard.
RESHARD_KINDS: tuple[str, ...] = tuple(k for k in COLLECTIVE_KINDS if k != "send_recv")


class UnknownCollectiveError(ValueError):
    """A plan step that no reshard emits, so no lowering runs it (a hand-edited or foreign plan)."""

    def __init__(self, kind: str, where: str) -> None:
        super().__init__(f"{where} cannot run collective {kind!r}: plans hold only the steps reshard() emits "
                         f"({', '.join(RESHARD_KINDS)}); rebuild the plan with ShardingPlan.from_choices")


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
        what = {"all_gather": "dim {0}", "reduce_scatter": "dim {0}", "local_split": "dim {0}",
                "all_to_all": "dim {0}->{1}"}.get(self.kind, "").format(*self.dims)
        red = f" {self.reduce}" if self.reduce else ""
        return (f"{self.kind}(axis {self.axis}{', ' + what if what else ''}{red}, "
                f"{_fmt_bytes(self.nbytes)}, {self.cost * 1e6:.1f} us)")

    @property
    def is_free(self) -> bool:
        return self.kind in ("local_split", "local_partial")

    def to_json(self) -> dict:
        return {"kind": self.kind, "axis": self.axis, "dims": list(self.dims), "reduce": self.reduce,
                "nbytes": self.nbytes, "cost": self.cost, "before": self.before.to_json(),
                "after": self.after.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "Collective":
        return cls(d["kind"], int(d["axis"]), tuple(d["dims"]), d.get("reduce"), int(d["nbytes"]),
                   float(d["cost"]), Sharding.from_json(d["before"]), Sharding.from_json(d["after"]))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


# -- resharding ------------------------------------------------------------

def itemsize(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 4)


def _inner_splits(state: tuple[Placement, ...], axis: int, dim: int) -> bool:
    """Does an axis behind ``axis`` split tensor ``dim``?"""
    return any(isinstance(p, Shard) and p.dim == dim for p in state[axis + 1:])


def _normalise(sharding: Sharding, ndim: int, mesh: Mesh, what: str) -> tuple[Placement, ...]:
    if len(sharding) != mesh.ndim:
        raise ValueError(f"{what} sharding {sharding} has {len(sharding)} placements for the "
                         f"{mesh.ndim}-axis mesh {mesh}")
    out = []
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{what} sharding {sharding} shards dim {p.dim} of a {ndim}-dim tensor")
            p = Shard(p.dim % ndim)
        out.append(p)
    return tuple(out)


def link_costs(links: tuple, axis: int, kind: str, alpha: float, beta: float, numel: int | None = None,
               n: int = 0) -> tuple[float, float]:
    """``(alpha, beta)`` of a ``kind`` collective on ``axis`` from a mesh's ``links`` (see
    :meth:`~metadist_core.placement.Mesh.link`), else the axis's own ``alpha``/``beta``."""
    if links and links[axis]:
        own = {k: (a, b) for k, a, b in links[axis]}
        if kind == "all_reduce" and numel is not None and numel < n and "all_reduce_tiny" in own:
            return own["all_reduce_tiny"]
        if kind in own:
            return own[kind]
    return alpha, beta


def _neighbours(state, shape, isz, mesh_shape, alphas, betas, reduces, links=()):
    """Every legal one-axis step out of ``state``: (next_state, kind, axis, dims, reduce, nbytes, cost)."""
    local = largest_local_shape(shape, state, mesh_shape)
    local_bytes = math.prod(local) * isz
    ndim = len(shape)
    for axis, p in enumerate(state):
        n = mesh_shape[axis]
        if n == 1:
            continue
        a, b = alphas[axis], betas[axis]
        if links and links[axis]:
            def ab(kind, numel=None):
                return link_costs(links, axis, kind, a, b, numel, n)
        else:
            def ab(kind, numel=None):
                return a, b

        def nxt(q):
            return state[:axis] + (q,) + state[axis + 1:]

        def can_split(d):
            return not _inner_splits(state, axis, d) and local[d] >= n

        if isinstance(p, Partial):
            yield (nxt(Replicate()), "all_reduce", axis, (), p.reduce, local_bytes,
                   all_reduce_cost(local_bytes, n, *ab("all_reduce", local_bytes // isz)))
            for d in range(ndim):
                if can_split(d):
                    yield (nxt(Shard(d)), "reduce_scatter", axis, (d,), p.reduce, local_bytes,
                           reduce_scatter_cost(local_bytes, n, *ab("reduce_scatter")))
        elif isinstance(p, Replicate):
            for d in range(ndim):
                if can_split(d):
                    yield nxt(Shard(d)), "local_split", axis, (d,), None, local_bytes // n, 0.0
            for r in reduces:
                yield nxt(Partial(r)), "local_partial", axis, (), r, local_bytes, 0.0
        elif isinstance(p, Shard):
            d = p.dim
            if _inner_splits(state, axis, d):
                continue
            gathered = nxt(Replicate())
            g_bytes = math.prod(largest_local_shape(shape, gathered, mesh_shape)) * isz
            yield gathered, "all_gather", axis, (d,), None, g_bytes, all_gather_cost(g_bytes, n, *ab("all_gather"))
            for e in range(ndim):
                if e != d and not _inner_splits(state, axis, e):
                    cand = nxt(Shard(e))
                    if largest_local_shape(shape, cand, mesh_shape) is not None:
                        yield (cand, "all_to_all", axis, (d, e), None, local_bytes,
                               all_to_all_cost(local_bytes, n, *ab("all_to_all")))


@lru_cache(maxsize=8192)
def _dijkstra(shape, isz, src, mesh_shape, alphas, betas, reduces, links=()):
    """Single-source cheapest step sequences from ``src`` to every reachable state."""
    best = {src: (0.0, 0)}
    parent: dict = {}
    heap = [(0.0, 0, 0, src)]
    tie = 1
    done = set()
    while heap:
        c, k, _, s = heapq.heappop(heap)
        if s in done:
            continue
        done.add(s)
        for t, kind, axis, dims, red, nb, cost in _neighbours(s, shape, isz, mesh_shape, alphas, betas, reduces,
                                                              links):
            nc = (c + cost, k + 1)
            if t not in best or nc < best[t]:
                best[t] = nc
                parent[t] = (s, kind, axis, dims, red, nb, cost)
                heapq.heappush(heap, (nc[0], nc[1], tie, t))
                tie += 1
    return best, parent


def reshard(src: Sharding, dst: Sharding, shape: Sequence[int], dtype: str, mesh: Mesh) -> list[Collective]:
    """The cheapest sequence of collectives that turns layout ``src`` into ``dst``.

    Partial -> Replicate is an all_reduce, Partial -> Shard a reduce_scatter,
    Shard -> Replicate an all_gather, Shard(i) -> Shard(j) an all_to_all,
    Replicate -> Shard a free local slice and Replicate -> Partial free
    (sum keeps the value on coordinate 0 and zeros elsewhere). Several axes
    change one step at a time, in the cheapest order that keeps the layout
    well defined. An empty list means nothing to do.
    """
    shape = tuple(int(s) for s in shape)
    try:
        return list(_reshard(src, dst, shape, dtype, mesh))
    except TypeError:   # layouts given as lists: not hashable, so not cached
        return list(_reshard.__wrapped__(src, dst, shape, dtype, mesh))


@lru_cache(maxsize=1 << 16)
def _reshard(src: Sharding, dst: Sharding, shape: tuple[int, ...], dtype: str, mesh: Mesh) -> tuple[Collective, ...]:
    """:func:`reshard`, once per (layouts, shape, dtype, mesh): a step's layers ask the same questions."""
    s = _normalise(src, len(shape), mesh, "source")
    d = _normalise(dst, len(shape), mesh, "destination")
    if s == d:
        return ()
    if largest_local_shape(shape, s, mesh.shape) is None:
        raise ValueError(f"source sharding {src} leaves a device an empty piece of shape {shape} on mesh {mesh}")
    if largest_local_shape(shape, d, mesh.shape) is None:
        raise ValueError(f"destination sharding {dst} leaves a device an empty piece of shape {shape} "
                         f"on mesh {mesh}; choose a split that every axis size fits")
    reduces = tuple(sorted({p.reduce for p in s + d if isinstance(p, Partial)}))
    best, parent = _dijkstra(shape, itemsize(dtype), s, mesh.shape, mesh.alpha, mesh.beta, reduces, mesh.links)
    if d not in best:
        raise ValueError(f"no collective sequence turns {src} into {dst} for shape {shape} on mesh {mesh}")
    steps = []
    cur = d
    while cur != s:
        prev, kind, axis, dims, red, nb, cost = parent[cur]
        steps.append(Collective(kind, axis, dims, red, int(nb), float(cost), Sharding(prev), Sharding(cur)))
        cur = prev
    steps.reverse()
    return tuple(steps)


class _StateGraph:
    """Every layout reachable from the sources asked so far for one (shape, itemsize, mesh, reductions), the
    cheapest one-axis step between each pair, and the cheapest path costs from each source (compiled
    Dijkstra, scipy.sparse.csgraph): a problem's edge tables ask for every source x destination pair."""

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.index: dict[tuple, int] = {}
        self.edges: dict[tuple[int, int], float] = {}
        self.dist: dict[int, np.ndarray] = {}
        self.matrix = None

    def _add(self, state: tuple) -> int:
        i = self.index.get(state)
        if i is None:
            i = self.index[state] = len(self.index)
            self._todo.append(state)
        return i

    def _close(self, src: tuple) -> None:
        """Add ``src`` and every layout it reaches, with their steps (a layout's steps depend on it alone,
        so the rows computed before stay right)."""
        self._todo: list[tuple] = []
        self._add(src)
        while self._todo:
            s = self._todo.pop()
            i = self.index[s]
            for t, *_, cost in _neighbours(s, *self.key):
                j = self._add(t)
                if cost < self.edges.get((i, j), math.inf):
                    self.edges[(i, j)] = cost
        self.matrix = None

    def costs_from(self, src: tuple) -> tuple[dict[tuple, int], np.ndarray]:
        if src not in self.index:
            self._close(src)
        i = self.index[src]
        if i not in self.dist or len(self.dist[i]) < len(self.index):
            if self.matrix is None:
                from scipy.sparse import csr_matrix
                n = len(self.index)
                ij = np.array(list(self.edges), dtype=np.int64).reshape(-1, 2)
                w = np.fromiter(self.edges.values(), dtype=float, count=len(self.edges))
                # csgraph drops stored zeros as non-edges: free steps (local slices) get the smallest positive
                # weight and the sums are read back without it (at most ``n`` of them on a path)
                self.matrix = csr_matrix((np.maximum(w, _FREE), (ij[:, 0], ij[:, 1])), shape=(n, n))
            from scipy.sparse.csgraph import dijkstra
            self.dist[i] = dijkstra(self.matrix, indices=i)
        return self.index, self.dist[i]


_FREE = 1e-300   # the weight a free step takes in the compiled search (far below any collective's seconds)


@lru_cache(maxsize=4096)
def _state_graph(shape, isz, mesh_shape, alphas, betas, reduces, links=()) -> _StateGraph:
    return _StateGraph((shape, isz, mesh_shape, alphas, betas, reduces, links))


def reshard_costs(src: Sharding, dsts: Sequence[Sharding], shape: Sequence[int], dtype: str, mesh: Mesh
                  ) -> list[float]:
    """:func:`reshard_cost` from ``src`` to each of ``dsts``, read off one cheapest-path search per kind
    of reduction involved (no step list is built: a problem's tables ask for millions of these)."""
    shape = tuple(int(x) for x in shape)
    s = _normalise(src, len(shape), mesh, "source")
    src_ok = largest_local_shape(shape, s, mesh.shape) is not None
    out: list[float] = []
    for dst in dsts:
        d = _normalise(dst, len(shape), mesh, "destination")
        if s == d:
            out.append(0.0)
            continue
        best = None
        if src_ok and largest_local_shape(shape, d, mesh.shape) is not None:
            reduces = tuple(sorted({p.reduce for p in s + d if isinstance(p, Partial)}))
            index, dist = _state_graph(shape, itemsize(dtype), mesh.shape, mesh.alpha, mesh.beta,
                                       reduces, mesh.links).costs_from(s)
            j = index.get(d)
            if j is not None and j < len(dist) and np.isfinite(dist[j]):
                best = float(dist[j])
                best = 0.0 if best < 1e-250 else best
        if best is None:   # the same error reshard gives, with its message
            reshard(src, dst, shape, dtype, mesh)
            raise AssertionError("unreachable")   # pragma: no cover
        out.append(best)
    return out


def reshard_cost(src: Sharding, dst: Sharding, shape: Sequence[int], dtype: str, mesh: Mesh) -> float:
    """Seconds of the cheapest sequence from :func:`reshard`."""
    if src == dst:
        return 0.0
    return sum(c.cost for c in reshard(src, dst, shape, dtype, mesh))


# -- compute ---------------------------------------------------------------

@dataclass(frozen=True)
class DeviceSpec:
    """Peak figures of one device for the roofline: FLOP/s, memory bytes/s, memory capacity."""

    name: str = "cpu"
    peak_flops: float = 100e9
    mem_bandwidth: float = 20e9
    memory_bytes: int = 16 * 2**30
    op_overhead: float = 0.0      # seconds every op costs on top of the roofline (dispatch; measured)
    # peak FLOP/s per compute dtype where it differs from ``peak_flops`` (tensor cores: bf16/fp16); a dict
    # is accepted and kept as sorted (dtype, FLOP/s) pairs so that the spec stays hashable
    flops_by_dtype: tuple[tuple[str, float], ...] = ()
    # bytes/s between host memory and this device (PCIe/NVLink-C2C); None: the host is this device (a CPU):
    # offload's transfers are free (metadist_core.offload)
    host_link: float | None = None

    def __post_init__(self) -> None:
        pairs = self.flops_by_dtype.items() if isinstance(self.flops_by_dtype, dict) else self.flops_by_dtype
        object.__setattr__(self, "flops_by_dtype", tuple(sorted((str(k), float(v)) for k, v in pairs)))

    def flops_for(self, dtype: str | None) -> float:
        """Peak FLOP/s of compute in ``dtype`` (canonical string); ``peak_flops`` where none is given."""
        return dict(self.flops_by_dtype).get(dtype, self.peak_flops) if dtype else self.peak_flops

    def to_json(self) -> dict:
        return {"name": self.name, "peak_flops": self.peak_flops, "mem_bandwidth": self.mem_bandwidth,
                "memory_bytes": self.memory_bytes, "op_overhead": self.op_overhead,
                "flops_by_dtype": dict(self.flops_by_dtype), "host_link": self.host_link}

    @classmethod
    def from_json(cls, d: dict) -> "DeviceSpec":
        return cls(d.get("name", "device"), float(d["peak_flops"]), float(d["mem_bandwidth"]),
                   int(d.get("memory_bytes", 16 * 2**30)), float(d.get("op_overhead", 0.0)),
                   dict(d.get("flops_by_dtype") or {}),
                   None if d.get("host_link") is None else float(d["host_link"]))


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec(),
    # peak_flops: fp32 without tensor cores; bf16/fp16: dense tensor-core figures (A100 312, H100/H200 SXM 989)
    # host_link: PCIe gen4 x16 (A100) / gen5 x16 (H100, H200), about 25 / 50 GB/s each way
    "a100": DeviceSpec("a100", 19.5e12, 1.6e12, 80 * 2**30, flops_by_dtype={"bfloat16": 312e12, "float16": 312e12},
                       host_link=25e9),
    "h100": DeviceSpec("h100", 67e12, 3.3e12, 80 * 2**30, flops_by_dtype={"bfloat16": 989e12, "float16": 989e12},
                       host_link=50e9),
    "h200": DeviceSpec("h200", 67e12, 4.8e12, 141 * 10**9, flops_by_dtype={"bfloat16": 989e12, "float16": 989e12},
                       host_link=50e9),
}


def compute_dtype(inputs: Sequence[str], outputs: Sequence[str] = ()) -> str | None:
    """The dtype an op computes in: its widest floating input dtype (else output dtype); None without one.

    Autocast casts both operands of a matmul, so its inputs are bf16/fp16; a
    mixed op is priced at the slower, wider rate."""
    floats = [d for d in inputs if d in FLOAT_DTYPES] or [d for d in outputs if d in FLOAT_DTYPES]
    return max(floats, key=lambda d: (itemsize(d), d)) if floats else None


FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "complex64", "complex128"})


def compute_cost(flops: float, nbytes: float, split: int = 1, device: DeviceSpec | None = None,
                 dtype: str | None = None) -> float:
    """Roofline seconds of an op that does ``flops`` in ``dtype`` and moves ``nbytes``, split ``split`` ways.

    The FLOP rate is ``device.flops_for(dtype)`` (tensor-core rates for bf16/fp16 where the device has them);
    bytes are already counted at each tensor's own dtype."""
    dev = device or DEVICE_PRESETS["cpu"]
    split = max(1, int(split))
    return max(flops / split / dev.flops_for(dtype), nbytes / split / dev.mem_bandwidth) + dev.op_overhead


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

def local_bytes(shape: Sequence[int] | None, dtype: str, sharding: Sharding, mesh: Mesh) -> int:
    """Bytes of the largest local piece of a tensor under ``sharding`` (0 for a non-tensor)."""
    if shape is None:
        return 0
    local = largest_local_shape(tuple(shape), _normalise(sharding, len(shape), mesh, "memory"), mesh.shape)
    if local is None:
        local = tuple(shape)
    return math.prod(local) * itemsize(dtype)


__all__ = [
    "COLLECTIVE_KINDS", "Collective", "DeviceSpec", "DEVICE_PRESETS", "all_gather_cost", "all_reduce_cost",
    "all_to_all_cost", "collective_cost", "compute_cost", "compute_dtype", "local_bytes", "reduce_scatter_cost",
    "reshard", "reshard_cost", "send_recv_cost", "strategy_split", "parse_placement",
]
