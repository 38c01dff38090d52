"""Coarsening: shrink a ShardingProblem before the solve, and map the answer back.

Three passes, each a :func:`terms.contract`:

1. **followers**: an elementwise op, view or cast rides on the producer of its
   first tensor input: for every option of that producer it takes the strategy
   whose input sharding matches exactly (no reshard); not on a graph input that
   the lowering gathers in buckets (its gather is cheaper than the op's). It merges only when such
   a match exists for every producer option, so nothing forces a reshard, and,
   for an op of several inputs, only when that match is the only allowed option
   (else which is best depends on the other inputs' producers: ``gain * x``
   riding on a replicated gain would take the replicated product and could
   replicate everything computed from it).
2. **fixed**: a node left with one allowed option is folded into constants and
   into the unary costs of its neighbours.
3. **tied layers**: nodes with the same structure around them (colour
   refinement over option counts, costs, memory and neighbour colours), as in
   the repeated layers of a transformer, share one decision.

Passes 1 and 3 restrict the search space; benchmarks/solvers.py checks on the
2-layer graph that the optimum does not get worse.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from metadist_core.problem.problem import ShardingProblem, gathers_bucketed
from metadist_core.problem.terms import Terms, contract

# Op names (the part after the framework prefix) that ride on their producer.
FOLLOWER_OPS: frozenset[str] = frozenset(
    """
view _unsafe_view reshape t transpose permute unsqueeze squeeze expand clone detach alias contiguous
_to_copy to copy lift_fresh_copy convert_element_type
add sub mul div neg sqrt rsqrt pow exp log tanh gelu relu silu sigmoid abs where maximum minimum
tanh_backward gelu_backward threshold_backward sign reciprocal lerp addcmul addcdiv square
""".split()
)


def op_name(key: str) -> str:
    """``aten.mul.Tensor`` -> ``mul``; ``jax.lax.mul`` -> ``mul``; ``te.add`` -> ``add``."""
    parts = key.split(".")
    if parts[0] == "aten" and len(parts) > 1:
        return parts[1]
    return parts[-1]


@dataclass
class Coarsening:
    """A coarse Terms and the way back: fine node ``i`` takes ``maps[i][c[assign[i]]]`` (``assign -1``: ``maps[i][0]``)."""

    terms: Terms
    assign: np.ndarray
    maps: list[np.ndarray]
    fine: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)

    def expand(self, coarse_choice) -> np.ndarray:
        """Fine choices (one per problem node) from the coarse choices."""
        cc = np.asarray(coarse_choice, dtype=np.int64)
        out = np.empty(len(self.assign), dtype=np.int64)
        for i, (c, m) in enumerate(zip(self.assign, self.maps)):
            out[i] = m[0] if c < 0 else m[cc[c]]
        return out

    def then(self, assign2: list[int], maps2: list[np.ndarray], terms2: Terms, label: str) -> "Coarsening":
        """Compose with a further contraction of ``self.terms``."""
        assign, maps = [], []
        for c, m in zip(self.assign, self.maps):
            if c < 0:
                assign.append(-1)
                maps.append(m)
            elif assign2[c] < 0:
                assign.append(-1)
                maps.append(m[maps2[c][:1]])
            else:
                assign.append(assign2[c])
                maps.append(m[maps2[c]])
        return Coarsening(terms2, np.asarray(assign), maps, self.fine, {**self.stages, label: terms2.size()})


def identity(terms: Terms) -> Coarsening:
    return Coarsening(
        terms, np.arange(terms.n_nodes), [np.arange(k) for k in terms.n_options], terms.size(), {"fine": terms.size()}
    )


def coarsen(
    problem: ShardingProblem, *, followers: bool = True, fixed: bool = True, tie_layers: bool = True, rounds: int = 3
) -> Coarsening:
    """Coarsen ``problem`` (see the module docstring); each pass can be switched off."""
    co = identity(problem.terms())
    if followers:
        a, m, k = _followers(problem)
        co = co.then(a, m, contract(co.terms, a, m, k), "followers")
    if fixed:
        co = _fold_fixed(co, "fixed")
    if tie_layers:
        a, m, k = _tie(co.terms, rounds)
        if len(k) < co.terms.n_nodes:
            co = co.then(a, m, contract(co.terms, a, m, k), "tied")
            if fixed:
                co = _fold_fixed(co, "fixed2")
    return co


def _followers(problem: ShardingProblem) -> tuple[list[int], list[np.ndarray], list[int]]:
    n = len(problem.nodes)
    assign = [0] * n
    maps: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
    n_opts: list[int] = []
    for j, node in enumerate(problem.nodes):
        merged = False
        # an op on a graph input the solver prices gathered in buckets (metadist_core.cost.gathers) stays free:
        # gathering the input is cheaper than gathering the op's output (a parameter's transpose), which
        # riding on the input would leave as the only way
        if (
            node.kind == "op"
            and node.inputs
            and op_name(node.key) in FOLLOWER_OPS
            and not gathers_bucketed(problem, node.inputs[0])
        ):
            var0 = node.inputs[0]
            i, s = problem.definer(var0)
            g, mi = assign[i], maps[i]
            same_slots = [t for t, v in enumerate(node.inputs) if v == var0]
            best: dict = {}
            count: dict = {}
            allowed = problem.allowed[j]
            comp = problem.compute[j]
            for k, o in enumerate(node.options):
                if not allowed[k] or any(o.inputs[t] != o.inputs[0] for t in same_slots):
                    continue
                uniform = all(x == o.inputs[0] for x in o.inputs)
                score = (not uniform, float(comp[k]))
                count[o.inputs[0]] = count.get(o.inputs[0], 0) + 1
                cur = best.get(o.inputs[0])
                if cur is None or score < cur[0]:
                    best[o.inputs[0]] = (score, k)
            srcs = [problem.nodes[i].options[mi[kg]].outputs[s] for kg in range(n_opts[g])]
            if len(set(node.inputs)) > 1 and any(count.get(sh, 0) > 1 for sh in srcs):
                pass  # more than one way to read the other inputs: which is best depends on their producers
            elif all(sh in best for sh in srcs):
                assign[j] = g
                maps[j] = np.array([best[sh][1] for sh in srcs], dtype=np.int64)
                merged = True
        if not merged:
            assign[j] = len(n_opts)
            maps[j] = np.arange(len(node.options))
            n_opts.append(len(node.options))
    return assign, maps, n_opts


def _fold_fixed(co: Coarsening, label: str) -> Coarsening:
    t = co.terms
    if not any(a.sum() == 1 for a in t.allowed):
        return co
    assign: list[int] = []
    maps: list[np.ndarray] = []
    n_opts: list[int] = []
    for _i, a in enumerate(t.allowed):
        if a.sum() == 1:
            assign.append(-1)
            maps.append(np.flatnonzero(a)[:1])
        else:
            assign.append(len(n_opts))
            maps.append(np.arange(len(a)))
            n_opts.append(len(a))
    return co.then(assign, maps, contract(t, assign, maps, n_opts), label)


def _digest(*arrays) -> str:
    h = hashlib.blake2b(digest_size=12)
    for a in arrays:
        if isinstance(a, np.ndarray):
            h.update(str(a.dtype).encode() + str(a.shape).encode())
            h.update(np.ascontiguousarray(np.round(a, 15) if a.dtype.kind == "f" else a).tobytes())
        else:
            h.update(repr(a).encode())
    return h.hexdigest()


def _tie(t: Terms, rounds: int) -> tuple[list[int], list[np.ndarray], list[int]]:
    """Colour refinement; nodes of one colour share a decision."""
    mem_by_node: dict[int, list[str]] = {}
    for m in t.mem:
        if m.node >= 0:
            mem_by_node.setdefault(m.node, []).append(_digest(m.nbytes))
    for g in t.shared:  # a value read by several ops: its ends must look alike to share a decision
        sig = _digest(g.table, g.merge)
        for role, (node, end_map) in [("src", (g.src, g.src_map))] + [("reader", r) for r in g.readers]:
            if node >= 0:
                mem_by_node.setdefault(node, []).append(_digest(role, sig, end_map))
    for tg in t.toggles:  # a node a toggle prices (recomputation) ties only with nodes priced alike
        for node, a in tg.unary:
            if node >= 0:
                mem_by_node.setdefault(node, []).append(_digest("toggle", a))
        for m in tg.mem_add + tg.mem_drop:
            if m.node >= 0:
                mem_by_node.setdefault(m.node, []).append(_digest("toggle-mem", m.nbytes))
        for e in tg.pairs:
            for end, node in (("src", e.src), ("dst", e.dst)):
                mem_by_node.setdefault(node, []).append(_digest("toggle-pair", end, e.table, e.src_map, e.dst_map))
    color = [_digest(u, a, sorted(mem_by_node.get(i, []))) for i, (u, a) in enumerate(zip(t.unary, t.allowed))]
    edge_sig = [_digest(e.src_map, e.dst_map, e.table) for e in t.edges]
    adj = t.adjacency()
    for _ in range(rounds):
        new = []
        for i in range(t.n_nodes):
            nb = sorted(
                (is_src, edge_sig[j], color[t.edges[j].dst if is_src else t.edges[j].src]) for j, is_src in adj[i]
            )
            new.append(_digest(color[i], nb))
        color = new
    ids: dict[str, int] = {}
    assign = [ids.setdefault(c, len(ids)) for c in color]
    n_opts = [0] * len(ids)
    for i, c in enumerate(assign):
        n_opts[c] = t.n_options[i]
    return assign, [np.arange(k) for k in t.n_options], n_opts
