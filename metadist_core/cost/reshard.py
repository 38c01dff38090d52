"""The cheapest sequence of collectives between two Shardings, and its cost (Dijkstra over per-axis placements).

Layout convention (as in ``placement.shard_shape``): mesh axes that split the
same tensor dim nest in mesh-axis order, axis 0 outermost. A step may only
change a Shard on an axis that is the innermost splitter of its dim, and may
only add a Shard of a dim on an axis behind every axis that splits it already.
Each step is priced by :mod:`metadist_core.cost.model`'s alpha-beta figures, per
collective kind where the mesh has them (``Mesh.links``, :func:`link_costs`).
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache
from typing import Sequence

import numpy as np

from metadist_core.cost.model import (
    Collective,
    _normalise,
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    itemsize,
    reduce_scatter_cost,
)
from metadist_core.ir.mesh import Mesh, link_costs
from metadist_core.ir.placement import Partial, Placement, Replicate, Shard, Sharding, largest_local_shape


def _inner_splits(state: tuple[Placement, ...], axis: int, dim: int) -> bool:
    """Does an axis behind ``axis`` split tensor ``dim``?"""
    return any(isinstance(p, Shard) and p.dim == dim for p in state[axis + 1 :])


#: the ``Mesh.links`` kind that prices a local copy, seconds per byte copied (read and write): a gather or
#: scatter of a dim behind another of more than one element runs beside a copy of its whole buffer (XLA's CPU
#: runtime lays the buffer out with that dim outermost and transposes; the torch lowering concatenates the
#: gathered pieces, or packs the chunks to scatter). Priced only where a profile measured it.
LOCAL_COPY = "local_copy"


def _copy_beta(links: tuple, axis: int) -> float:
    if links and links[axis]:
        for k, _, b in links[axis]:
            if k == LOCAL_COPY:
                return b
    return 0.0


def _inner(shape_: tuple, d: int) -> bool:
    """Is dim ``d`` of a buffer of ``shape_`` behind a dim of more than one element (not contiguous pieces)?"""
    return math.prod(shape_[:d]) > 1


def _neighbours(state, shape, isz, mesh_shape, alphas, betas, reduces, links=()):
    """Every legal one-axis step out of ``state``: (next_state, kind, axis, dims, reduce, nbytes, cost)."""
    local = largest_local_shape(shape, state, mesh_shape)
    if local is None:  # the searches start from feasible layouts and step only to feasible ones
        raise ValueError(f"layout {state} leaves a device an empty piece of shape {shape}")
    local_bytes = math.prod(local) * isz
    ndim = len(shape)
    for axis, p in enumerate(state):
        n = mesh_shape[axis]
        if n == 1:
            continue
        a, b = alphas[axis], betas[axis]
        copy = _copy_beta(links, axis)
        if links and links[axis]:

            def ab(kind, numel=None):
                return link_costs(links, axis, kind, a, b, numel, n)
        else:

            def ab(kind, numel=None):
                return a, b

        def nxt(q):
            return state[:axis] + (q,) + state[axis + 1 :]

        def can_split(d):
            return not _inner_splits(state, axis, d) and local[d] >= n

        if isinstance(p, Partial):
            yield (
                nxt(Replicate()),
                "all_reduce",
                axis,
                (),
                p.reduce,
                local_bytes,
                all_reduce_cost(local_bytes, n, *ab("all_reduce", local_bytes // isz)),
            )
            for d in range(ndim):
                if can_split(d):
                    yield (
                        nxt(Shard(d)),
                        "reduce_scatter",
                        axis,
                        (d,),
                        p.reduce,
                        local_bytes,
                        reduce_scatter_cost(local_bytes, n, *ab("reduce_scatter"))
                        + (copy * local_bytes if _inner(local, d) else 0.0),
                    )
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
            g_local = largest_local_shape(shape, gathered, mesh_shape)
            if g_local is None:  # gathering a feasible layout only grows the pieces
                raise ValueError(f"layout {gathered} leaves a device an empty piece of shape {shape}")
            g_bytes = math.prod(g_local) * isz
            yield (
                gathered,
                "all_gather",
                axis,
                (d,),
                None,
                g_bytes,
                all_gather_cost(g_bytes, n, *ab("all_gather")) + (copy * g_bytes if _inner(g_local, d) else 0.0),
            )
            for e in range(ndim):
                if e != d and not _inner_splits(state, axis, e):
                    cand = nxt(Shard(e))
                    if largest_local_shape(shape, cand, mesh_shape) is not None:
                        yield (
                            cand,
                            "all_to_all",
                            axis,
                            (d, e),
                            None,
                            local_bytes,
                            all_to_all_cost(local_bytes, n, *ab("all_to_all")),
                        )


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
        for t, kind, axis, dims, red, nb, cost in _neighbours(s, shape, isz, mesh_shape, alphas, betas, reduces, links):
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
    except TypeError:  # layouts given as lists: not hashable, so not cached
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
        raise ValueError(
            f"destination sharding {dst} leaves a device an empty piece of shape {shape} "
            f"on mesh {mesh}; choose a split that every axis size fits"
        )
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


_FREE = 1e-300  # the weight a free step takes in the compiled search (far below any collective's seconds)


@lru_cache(maxsize=4096)
def _state_graph(shape, isz, mesh_shape, alphas, betas, reduces, links=()) -> _StateGraph:
    return _StateGraph((shape, isz, mesh_shape, alphas, betas, reduces, links))


def reshard_costs(src: Sharding, dsts: Sequence[Sharding], shape: Sequence[int], dtype: str, mesh: Mesh) -> list[float]:
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
            index, dist = _state_graph(
                shape, itemsize(dtype), mesh.shape, mesh.alpha, mesh.beta, reduces, mesh.links
            ).costs_from(s)
            j = index.get(d)
            if j is not None and j < len(dist) and np.isfinite(dist[j]):
                best = float(dist[j])
                best = 0.0 if best < 1e-250 else best
        if best is None:  # the same error reshard gives, with its message
            reshard(src, dst, shape, dtype, mesh)
            raise AssertionError("unreachable")  # pragma: no cover
        out.append(best)
    return out


def reshard_cost(src: Sharding, dst: Sharding, shape: Sequence[int], dtype: str, mesh: Mesh) -> float:
    """Seconds of the cheapest sequence from :func:`reshard`."""
    if src == dst:
        return 0.0
    return sum(c.cost for c in reshard(src, dst, shape, dtype, mesh))


__all__ = ["reshard", "reshard_cost", "reshard_costs"]
