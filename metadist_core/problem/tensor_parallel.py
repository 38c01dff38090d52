"""The ``tp`` preset's pins: Megatron's column/row weight pairs and attention heads, found in the graph.

A weight whose matmul output feeds, through elementwise ops but not across a
residual add, the matmul of another weight is split by columns, that other one
by rows; attention inputs and output are split by heads, the q/k/v projections
that feed them alone by columns and the output projection by rows. A split
weight is read only in its split, never gathered.
"""

from __future__ import annotations

import math
from typing import Mapping

from metadist_core.problem.constraints import Forbid, var_name
from metadist_core.ir.placement import Replicate, Shard, Sharding
from metadist_core.problem.presetgraph import MATMULS, NOT_ELEMENTWISE, PASS_WEIGHT, GraphView, Pins, split_on


def _weight_of(
    g: GraphView, var: str, dims: tuple[int, int] = (0, 1), depth: int = 6
) -> tuple[str, tuple[int, int]] | None:
    """The 2-D parameter ``var`` comes from through transposes/casts/views, and which of its dims are
    ``var``'s dims 0 and 1."""
    for _ in range(depth):
        if var in g.role:
            return (var, dims) if g.role[var] == "parameter" and len(g.shape(var) or ()) == 2 else None
        i = g.producer.get(var)
        if i is None or g.name(i) not in PASS_WEIGHT:
            return None
        n = g.prob.nodes[i]
        src = n.inputs[0] if n.inputs else None
        if src is None or len(g.shape(src) or ()) != 2 or len(g.shape(var) or ()) != 2:
            return None
        if g.name(i) in ("t", "transpose", "permute"):
            dims = (dims[1], dims[0])
        var = src
    return None


def _matmul_weight(g: GraphView, i: int) -> tuple[int, str, int, int, str | None] | None:
    """For a forward matmul node: (activation slot, weight, its output-feature dim, contraction dim, bias)."""
    n, name = g.prob.nodes[i], g.name(i)
    if name not in MATMULS or i not in g.forward:
        return None
    if name == "linear" and len(n.inputs) >= 2:
        w = _weight_of(g, n.inputs[1])
        if w is None:
            return None
        bias = n.inputs[2] if len(n.inputs) > 2 and g.role.get(n.inputs[2]) == "parameter" else None
        return 0, w[0], w[1][0], w[1][1], bias
    a, b = (1, 2) if name == "addmm" else (0, 1)
    if len(n.inputs) <= b:
        return None
    w = _weight_of(g, n.inputs[b])
    if w is None:
        return None
    bias = None
    if name == "addmm":
        bw = n.inputs[0]
        bias = bw if g.role.get(bw) == "parameter" and len(g.shape(bw) or ()) == 1 else None
    return a, w[0], w[1][1], w[1][0], bias  # B = W^T-ish: B's dim 1 is the output feature dim


def _matmuls_reached(g: GraphView, var: str, step, depth: int) -> list[int]:
    """Forward matmul nodes that ``var`` reaches as their activation; ``step(i, v)`` names the outputs of a
    non-matmul reader ``i`` of ``v`` to go on through (up to ``depth`` ops)."""
    hits, seen, todo = [], set(), [(var, 0)]
    while todo:
        v, d = todo.pop()
        for i, slot in g.readers.get(v, []):
            if i in seen or i not in g.forward:
                continue
            seen.add(i)
            mw = _matmul_weight(g, i)
            if mw is not None:
                if mw[0] == slot:
                    hits.append(i)
            elif d < depth:
                todo += [(o, d + 1) for o in step(i, v)]
    return hits


def _matmul_at(g: GraphView, i: int) -> tuple[int, str, int, int, str | None]:
    """:func:`_matmul_weight` of a node a walk found to be a forward matmul."""
    mw = _matmul_weight(g, i)
    if mw is None:
        raise ValueError(f"node {g.prob.nodes[i].id} is not a forward matmul with a weight")
    return mw


def _follow(g: GraphView, var: str, width: int, depth: int = 12) -> list[int]:
    """Forward matmul nodes that ``var`` reaches (as their activation) through ops keeping its last dim."""

    def step(i: int, v: str) -> list[str]:
        if g.name(i) in NOT_ELEMENTWISE or _residual(g, i, v):
            return []
        return [o for o in g.prob.nodes[i].outputs if (g.shape(o) or (None,))[-1] == width]

    return _matmuls_reached(g, var, step, depth)


def _back_to_matmuls(g: GraphView, var: str, depth: int = 10) -> list[int]:
    """The forward matmuls whose outputs reach ``var`` through other ops (views, rotary embeddings)."""
    hits, seen, todo = [], set(), [(var, 0)]
    while todo:
        v, d = todo.pop()
        i = g.producer.get(v)
        if i is None or i in seen or i not in g.forward:
            continue
        seen.add(i)
        if _matmul_weight(g, i) is not None:
            hits.append(i)
        elif d < depth and (g.name(i) not in NOT_ELEMENTWISE or g.name(i) == "cat"):  # cat: a KV cache
            todo += [(u, d + 1) for u in g.prob.nodes[i].inputs if g.role.get(u) is None]
    return hits


def _residual(g: GraphView, i: int, v: str) -> bool:
    """Is node ``i`` an add of ``v`` and another activation of its shape (a residual connection)? A column
    split does not cross one: LLaMA's o_proj output reaches the next q_proj through the residual stream and
    the RMSNorm's elementwise ops, and is no column/row pair with it."""
    if g.name(i) not in ("add", "sub"):
        return False
    return any(u != v and g.shape(u) == g.shape(v) and g.role.get(u) != "parameter" for u in g.prob.nodes[i].inputs)


def tensor_parallel(g: GraphView, pins: Pins, axes: list[int], user: Mapping[str, Sharding] | None = None) -> None:
    """The tp pins on ``axes``. ``user``: the user's own pins; an attention or a column/row pair one of whose
    weights the user keeps unsplit on ``axes`` is left to the solver whole (Megatron on the MLPs alone, say:
    a hand plan that cannot split a fused qkv by heads), where pinning the rest of it would fight the user's."""
    shape = g.prob.mesh.shape
    n_tp = math.prod(shape[a] for a in axes)
    how = f"does not divide by {n_tp}"
    user = user or {}

    def unsplit(w: str) -> bool:
        return w in user and not any(user[w][a].is_shard() for a in axes)

    def split(var: str, dim: int, role: str) -> None:
        sh = split_on(g.shape(var), dim, axes, shape)
        # the first role to pin a value holds; a weight it split is read only in that split
        if pins.pin(var, sh, f"{role} dim {dim} {how}") and sh is not None and role.endswith("weight"):
            _read_split(g, pins, var, dim, axes)

    # attention: inputs and output split by heads (dim 1 of [batch, heads, seq, head dim])
    for i in sorted(g.forward):
        n = g.prob.nodes[i]
        if n.kind != "op" or "scaled_dot_product" not in n.key or "backward" in n.key:
            continue
        # the q/k/v projections (behind the 4-D inputs) and the output projections, walked once
        cols = [
            (v, _matmul_at(g, j)) for v in n.inputs[:3] if len(g.shape(v) or ()) == 4 for j in _back_to_matmuls(g, v)
        ]
        rows = [_matmul_at(g, j) for j in _follow_any(g, n.outputs[0])]
        mine = list(dict.fromkeys([r[1] for r in rows] + [c[1] for _, c in cols]))
        if any(unsplit(w) for w in mine):  # a fused qkv weight named once
            pins.out.notes.append(
                f"attention {n.id}: {', '.join(var_name(g.prob, w) for w in mine if unsplit(w))} "
                f"pinned unsplit by the user; the attention is left to the solver"
            )
            continue
        for v in list(n.inputs[:3]) + list(n.outputs[:1]):
            if len(g.shape(v) or ()) == 4:
                split(v, 1, "attention heads")
        for v, (_, w, out_dim, _, bias) in cols:  # q/k/v projections: column-parallel (a fused qkv is left whole)
            shp = g.tensor_shape(v)
            if g.tensor_shape(w)[out_dim] == shp[1] * shp[3]:
                split(w, out_dim, "column-parallel weight")
                if bias is not None:
                    split(bias, 0, "column-parallel bias")
        for _, w, _out_dim, in_dim, _ in rows:
            pins.out.pairs.append(("<attention>", w))
            split(w, in_dim, "row-parallel weight")
    # MLP-like chains: column split, then row split
    for i in sorted(g.forward):
        mw = _matmul_weight(g, i)
        if mw is None:
            continue
        _, w1, out1, in1, bias = mw
        width = g.tensor_shape(w1)[out1]
        for j in _follow(g, g.prob.nodes[i].outputs[0], width):
            _, w2, out2, in2, _ = _matmul_at(g, j)
            if w2 == w1 or g.tensor_shape(w2)[in2] != width:
                continue
            if unsplit(w1) or unsplit(w2):
                pins.out.notes.append(
                    f"{var_name(g.prob, w1)} / {var_name(g.prob, w2)}: pinned unsplit by the "
                    f"user; the pair is left to the solver"
                )
                continue
            pins.out.pairs.append((w1, w2))
            split(w1, out1, "column-parallel weight")
            if bias is not None:
                split(bias, 0, "column-parallel bias")
            split(w2, in2, "row-parallel weight")
    if not pins.out.pairs:
        pins.out.notes.append("no column/row matmul pairs or attention found: every parameter stays replicated")


def _read_split(g: GraphView, pins: Pins, weight: str, dim: int, axes: list[int]) -> None:
    """Megatron never moves a weight: on the tp ``axes``, ``weight`` (split on ``dim``) and the transposes,
    views and casts made of it are read only in that split wherever they are read. (Pinning the stored
    weight alone let the solver gather it and split the batch instead: ZeRO-3's program priced as "tp".)"""
    chain, todo, seen = [], [(weight, dim)], {weight}
    while todo:
        v, d = todo.pop()
        chain.append((v, d))
        for i, _ in g.readers.get(v, []):
            if g.name(i) not in PASS_WEIGHT:
                continue
            for o in g.prob.nodes[i].outputs:
                if o in seen or len(g.shape(o) or ()) != 2:
                    continue
                seen.add(o)
                if g.name(i) in ("t", "transpose", "permute"):
                    todo.append((o, 1 - d))
                elif g.shape(o) == g.shape(v):
                    todo.append((o, d))
    for v, d in chain:
        if not all(
            any(all(o.inputs[slot][a] == Shard(d) for a in axes) for o in g.prob.nodes[i].options)
            for i, slot in g.readers.get(v, [])
        ):
            pins.out.notes.append(f"{var_name(g.prob, v)}: a reader cannot take it split on dim {d}; it may be moved")
            continue
        others = [Replicate()] + [Shard(k) for k in range(len(g.shape(v) or ())) if k != d]
        pins.out.pins.extend(Forbid(p, var=v, axis=a) for p in others for a in axes)


def _follow_any(g: GraphView, var: str, depth: int = 8) -> list[int]:
    """The first forward matmuls ``var`` reaches as their activation, through transposes, views and casts."""
    return _matmuls_reached(g, var, lambda i, v: g.prob.nodes[i].outputs if g.name(i) in PASS_WEIGHT else [], depth)


__all__ = ["tensor_parallel"]
