"""The numeric view of a sharding problem that solvers optimise.

``Terms`` is a pairwise cost problem: every node takes one option; a node's
option has a unary cost (compute, final resharding of outputs); an edge between
two nodes costs ``table[src_map[a], dst_map[b]]`` for options ``a``, ``b``
(rows and columns are the distinct shardings on each side). Memory terms say
how many bytes per device a value takes under each option of the node that
defines it, and over which op positions it is live. :func:`contract` maps
options of a finer Terms onto a coarser one (followers, tied layers, fixed
nodes), which is all coarsening needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class EdgeTerm:
    src: int
    dst: int
    src_map: np.ndarray  # option of src -> row of table
    dst_map: np.ndarray  # option of dst -> column of table
    table: np.ndarray  # seconds, rows x columns

    def cost(self, a: int, b: int) -> float:
        return float(self.table[self.src_map[a], self.dst_map[b]])

    def dense(self) -> np.ndarray:
        return self.table[np.ix_(self.src_map, self.dst_map)]


@dataclass
class SharedTerm:
    """One value read by several ends: each distinct (source row, target column) is paid once.

    The lowering runs a reshard once per (value, target sharding, reader phase)
    however many ops read it (:func:`metadist_core.plan.interpret.interpret`), so the
    readers of a value share the cost: ``cost = sum over the distinct columns c
    chosen by the readers of table[row, c]``, where a column is a (target, phase)
    and ``merge`` folds the phases of one target into one column under a Partial
    source row. ``src`` / a reader's node is -1 when it is fixed;
    its map then holds one entry (the fixed row or column).
    """

    src: int
    src_map: np.ndarray  # option of src -> row
    readers: list[tuple[int, np.ndarray]]  # (node, option -> column)
    table: np.ndarray  # seconds, rows x columns
    merge: np.ndarray | None = None  # rows x columns -> the column actually paid (None: itself)

    def paid(self, row: int, col: int) -> int:
        """The column paid when a reader takes ``col`` under source row ``row``: columns that differ only in
        the reader's phase are one reshard under a Partial source (:mod:`metadist_core.cost.phases`)."""
        return col if self.merge is None else int(self.merge[row, col])

    def cost(self, choice: np.ndarray) -> float:
        r = int(self.src_map[0 if self.src < 0 else choice[self.src]])
        cols = {self.paid(r, int(m[0 if n < 0 else choice[n]])) for n, m in self.readers}
        return float(sum(self.table[r, c] for c in cols))


@dataclass
class MemTerm:
    node: int
    nbytes: np.ndarray  # bytes per device under each option of ``node``
    start: int  # first op position where the value is live (-1: before the first op)
    end: int  # last op position (n_steps - 1 ... n_steps: held to the end)


@dataclass
class Toggle:
    """A yes/no decision beside the shardings (recomputing one forward segment, metadist_core.levers.recompute).

    Off, the problem is the plain one. On: the ``unary`` costs are paid (``(node, cost per option)``;
    node -1: a constant, one entry), the ``mem_add`` terms are live and the ``mem_drop`` terms (parts of
    the plain problem's memory terms) are not. Solvers that do not price toggles leave them off.
    """

    unary: list[tuple[int, np.ndarray]]
    mem_add: list[MemTerm]
    mem_drop: list[MemTerm]
    name: str = ""
    pairs: list[EdgeTerm] = field(default_factory=list)  # pairwise costs paid when on (both ends free nodes)

    def cost(self, choice: np.ndarray) -> float:
        return float(
            sum(a[0 if n < 0 else choice[n]] for n, a in self.unary)
            + sum(e.cost(choice[e.src], choice[e.dst]) for e in self.pairs)
        )


def _toggle_terms(on: np.ndarray | None, toggles: list[Toggle]) -> list[tuple[MemTerm, int]]:
    """(term, +1 added / -1 dropped) of the toggles that are on."""
    if on is None:
        return []
    return [(m, sg) for t, o in zip(toggles, on) if o for sg, ms in ((1, t.mem_add), (-1, t.mem_drop)) for m in ms]


@dataclass
class Terms:
    unary: list[np.ndarray]
    edges: list[EdgeTerm]
    mem: list[MemTerm]
    allowed: list[np.ndarray]  # bool per option
    n_steps: int = 0  # op positions span -1 .. n_steps
    budget: int | None = None
    offset: float = 0.0  # constant cost folded out of the problem
    names: list[str] = field(default_factory=list)
    mesh_name: str = "?"  # the mesh, for messages (an infeasible budget names it)
    shared: list[SharedTerm] = field(default_factory=list)  # values read by several ops: paid once per target
    toggles: list[Toggle] = field(default_factory=list)  # yes/no decisions priced beside the shardings

    @property
    def n_nodes(self) -> int:
        return len(self.unary)

    @property
    def n_options(self) -> list[int]:
        return [len(u) for u in self.unary]

    def size(self) -> dict:
        """Problem size figures: nodes, options, edges and edge table cells."""
        return {
            "nodes": self.n_nodes,
            "options": int(sum(self.n_options)),
            "edges": len(self.edges),
            "edge_cells": int(sum(e.table.size for e in self.edges)),
        }

    def masked_unary(self, i: int) -> np.ndarray:
        u = self.unary[i].astype(float).copy()
        u[~self.allowed[i]] = np.inf
        return u

    # -- evaluation ---------------------------------------------------------
    def objective(self, choice: np.ndarray, on: np.ndarray | None = None) -> float:
        """The cost of ``choice``, with the toggles ``on`` (a bool per toggle; None: all off)."""
        c = self.offset + sum(float(self.unary[i][k]) for i, k in enumerate(choice))
        for e in self.edges:
            c += e.cost(choice[e.src], choice[e.dst])
        for g in self.shared:
            c += g.cost(choice)
        if on is not None:
            c += sum(t.cost(choice) for t, o in zip(self.toggles, on) if o)
        return c

    def pairwise(self) -> "Terms":
        """The same problem with every shared term charged once per reader (an upper bound of the
        exact cost): what the pairwise heuristics (beam, greedy, local search) read. Node indices are
        unchanged; :meth:`objective` of the original stays the exact price."""
        if not self.shared:
            return self
        unary = [u.astype(float).copy() for u in self.unary]
        edges = list(self.edges)
        offset = self.offset + sum(_fold_per_reader(g, unary, edges) for g in self.shared)
        return Terms(
            unary, edges, self.mem, self.allowed, self.n_steps, self.budget, offset, self.names, self.mesh_name
        )

    def memory_profile(self, choice: np.ndarray, on: np.ndarray | None = None) -> np.ndarray:
        """Bytes per device live at each position -1 .. n_steps (index 0 is position -1), with the toggles
        ``on`` (None: all off)."""
        terms = [(m, 1) for m in self.mem] + _toggle_terms(on, self.toggles)
        return _live_bytes(self.n_steps, [(m, sg * m.nbytes[0 if m.node < 0 else choice[m.node]]) for m, sg in terms])

    def least_peak_bound(self) -> int:
        """A lower bound on the peak of every allowed plan: at each position, each live value at the least
        bytes any allowed option of its node gives it. Values of a node some toggle may drop (a recomputed
        segment's) are left out, so the bound holds with any toggles on."""
        if not self.mem:
            return 0
        droppable = {m.node for t in self.toggles for m in t.mem_drop}

        def least(m: Any) -> float:
            if m.node < 0:
                return float(m.nbytes[0])
            ok = self.allowed[m.node]
            return float(m.nbytes[ok].min() if ok.any() else m.nbytes.min())

        return int(_live_bytes(self.n_steps, [(m, least(m)) for m in self.mem if m.node not in droppable]).max())

    def peak_memory(self, choice: np.ndarray, on: np.ndarray | None = None) -> int:
        if not self.mem:
            return 0
        return int(self.memory_profile(choice, on).max())

    def is_allowed(self, choice: np.ndarray) -> bool:
        return all(self.allowed[i][k] for i, k in enumerate(choice))

    def adjacency(self) -> list[list[tuple[int, bool]]]:
        """node -> [(edge index, node is the edge's src)]."""
        adj: list[list[tuple[int, bool]]] = [[] for _ in range(self.n_nodes)]
        for j, e in enumerate(self.edges):
            adj[e.src].append((j, True))
            adj[e.dst].append((j, False))
        return adj


def _live_bytes(n_steps: int, held: Sequence[tuple[Any, float]]) -> np.ndarray:
    """Bytes live at each position -1 .. n_steps (index 0 is position -1), each memory term ``m`` holding its
    bytes from ``m.start`` to ``m.end``."""
    prof = np.zeros(n_steps + 3)
    for m, b in held:
        prof[m.start + 1] += b
        prof[m.end + 2] -= b
    return np.cumsum(prof)[:-1]


def _fold_per_reader(g: SharedTerm, unary: list[np.ndarray], edges: list[EdgeTerm]) -> float:
    """Charge ``g`` once per reader into ``unary`` and ``edges`` (in place); returns the constant part."""
    const = 0.0
    for n, m in g.readers:
        if g.src < 0 and n < 0:
            const += float(g.table[g.src_map[0], m[0]])
        elif g.src < 0:
            unary[n] += g.table[g.src_map[0], m]
        elif n < 0:
            unary[g.src] += g.table[g.src_map, m[0]]
        elif n == g.src:
            unary[n] += g.table[g.src_map, m]
        else:
            edges.append(EdgeTerm(g.src, n, g.src_map, m, g.table))
    return const


def _compress(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dense option x option matrix -> (src_map, dst_map, table) over distinct rows and columns."""
    rows, src_map = np.unique(dense, axis=0, return_inverse=True)
    cols, dst_map = np.unique(rows, axis=1, return_inverse=True)
    return src_map.reshape(-1).astype(np.int32), dst_map.reshape(-1).astype(np.int32), cols


def _onto(
    e: EdgeTerm, assign: list[int], maps: list[np.ndarray]
) -> tuple[int, int, np.ndarray, np.ndarray, tuple[int, np.ndarray] | None]:
    """Edge ``e`` on the coarse nodes: its coarse ends, their option maps into its table, and ``(node, cost
    per option)`` when it folds into one node's unary cost (node -1: a constant, one entry), else None."""
    cu, cw = assign[e.src], assign[e.dst]
    smap, dmap = e.src_map[maps[e.src]], e.dst_map[maps[e.dst]]
    if cu < 0 and cw < 0:
        return cu, cw, smap, dmap, (-1, e.table[smap[:1], dmap[0]])
    if cu < 0:
        return cu, cw, smap, dmap, (cw, e.table[smap[0], dmap])
    if cw < 0:
        return cu, cw, smap, dmap, (cu, e.table[smap, dmap[0]])
    if cu == cw:
        return cu, cw, smap, dmap, (cu, e.table[smap, dmap])
    return cu, cw, smap, dmap, None


def contract(
    terms: Terms, assign: list[int], maps: list[np.ndarray], n_options: list[int], names: list[str] | None = None
) -> Terms:
    """Coarser Terms in which fine node ``i`` takes option ``maps[i][k]`` when coarse node ``assign[i]`` takes ``k``.

    ``assign[i] == -1`` fixes fine node ``i`` to option ``maps[i][0]``: its
    cost becomes a constant and its edges unary terms of their other side.
    Edges inside one coarse node become unary costs; parallel edges between two
    coarse nodes are summed into one table; memory terms follow their node.
    """
    n = len(n_options)
    unary = [np.zeros(k) for k in n_options]
    allowed = [np.ones(k, dtype=bool) for k in n_options]
    offset = terms.offset
    for i, (c, m) in enumerate(zip(assign, maps)):
        if c < 0:
            offset += float(terms.unary[i][m[0]])
            continue
        unary[c] += terms.unary[i][m]
        allowed[c] &= terms.allowed[i][m]
    pairs: dict[tuple[int, int], list] = {}
    for e in terms.edges:
        cu, cw, smap, dmap, folded = _onto(e, assign, maps)
        if folded is not None:
            node, a = folded
            if node < 0:
                offset += float(a[0])
            else:
                unary[node] += a
            continue
        if cu > cw:
            pairs.setdefault((cw, cu), []).append((dmap, smap, e.table.T))
        else:
            pairs.setdefault((cu, cw), []).append((smap, dmap, e.table))
    edges = []
    for (u, w), parts in pairs.items():
        if len(parts) == 1 and n_options[u] > 1 and n_options[w] > 1:
            sm, dm, tab = parts[0]
            ru, sm = np.unique(sm, return_inverse=True)
            cu_, dm = np.unique(dm, return_inverse=True)
            tab = tab[np.ix_(ru, cu_)]
            if tab.shape[0] > 1 and tab.shape[1] > 1:
                edges.append(EdgeTerm(u, w, sm.astype(np.int32), dm.astype(np.int32), tab))
                continue
            parts = [(sm, dm, tab)]
        dense = sum(tab[np.ix_(sm, dm)] for sm, dm, tab in parts)
        # a side with one option makes the edge a unary term of the other side
        if dense.shape[0] == 1:
            unary[w] += dense[0]
            continue
        if dense.shape[1] == 1:
            unary[u] += dense[:, 0]
            continue
        if np.all(dense == dense.flat[0]):
            offset += float(dense.flat[0])
            continue
        sm, dm, tab = _compress(dense)
        edges.append(EdgeTerm(u, w, sm, dm, tab))
    shared: list[SharedTerm] = []
    merged: dict[tuple, SharedTerm] = {}
    for g in terms.shared:
        ends = []
        for node, m in [(g.src, g.src_map)] + list(g.readers):
            if node < 0:
                ends.append((-1, m[:1]))
            elif assign[node] < 0:
                ends.append((-1, m[maps[node][:1]]))
            else:
                ends.append((int(assign[node]), m[maps[node]].astype(np.int32)))
        (s_node, s_map), readers = ends[0], []
        seen: set = set()
        rows_all = np.unique(s_map)
        for node, m in ends[1:]:
            k = (node, m.tobytes())
            if k in seen:
                continue
            seen.add(k)
            # a reader that never pays (every pair it can form with the source costs nothing) drops out
            if node >= 0 and node == s_node:
                free = not np.any(g.table[s_map, m])
            else:
                free = not np.any(g.table[np.ix_(rows_all, np.unique(m))])
            if not free:
                readers.append((node, m))
        g2 = SharedTerm(s_node, s_map, readers, g.table, g.merge)
        if not np.any(g.table):
            continue
        if not readers:
            continue
        if s_node < 0 and all(n < 0 for n, _ in readers):
            offset += g2.cost(np.zeros(0, dtype=np.int64))
        elif len(readers) == 1:  # one reader left: an ordinary pairwise term
            offset += _fold_per_reader(g2, unary, edges)
        else:  # terms with the same ends (tied layers) pick the same columns: their tables add up
            key = (
                s_node,
                s_map.tobytes(),
                tuple((n, m.tobytes()) for n, m in readers),
                g.table.shape,
                None if g.merge is None else g.merge.tobytes(),
            )
            if key in merged:
                merged[key].table = merged[key].table + g.table
            else:
                merged[key] = g2
                shared.append(g2)

    def mem_of(m: MemTerm) -> MemTerm:
        if m.node < 0:
            return m
        if assign[m.node] < 0:
            return MemTerm(-1, m.nbytes[maps[m.node][:1]], m.start, m.end)
        return MemTerm(assign[m.node], m.nbytes[maps[m.node]], m.start, m.end)

    def unary_of(node: int, a: np.ndarray) -> tuple[int, np.ndarray]:
        if node < 0:
            return -1, a[:1]
        return (-1, a[maps[node][:1]]) if assign[node] < 0 else (int(assign[node]), a[maps[node]])

    toggles = []
    for t in terms.toggles:  # a toggle's costs on one coarse node add up; constants fold into one entry
        by: dict[int, np.ndarray] = {}
        on_pairs: list[EdgeTerm] = []

        def put(c: int, a2: np.ndarray) -> None:
            by[c] = by[c] + a2 if c in by else a2.astype(float).copy()

        for node, a in t.unary:
            put(*unary_of(node, a))
        for e in t.pairs:  # as the edges above: inside one node or to a fixed one it is a unary cost
            cu, cw, smap, dmap, folded = _onto(e, assign, maps)
            if folded is not None:
                put(*folded)
            else:
                on_pairs.append(EdgeTerm(cu, cw, smap, dmap, e.table))
        toggles.append(
            Toggle(list(by.items()), [mem_of(m) for m in t.mem_add], [mem_of(m) for m in t.mem_drop], t.name, on_pairs)
        )
    return Terms(
        unary,
        edges,
        [mem_of(m) for m in terms.mem],
        allowed,
        terms.n_steps,
        terms.budget,
        offset,
        names or [f"n{i}" for i in range(n)],
        terms.mesh_name,
        shared,
        toggles,
    )
