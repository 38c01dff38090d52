"""Hand-derived one-axis ShardingRules for the aten ops of the synthetic GPT-2 graphs.

Stands in for ShardCombine discovery until the PyTorch op runner exists; see
``benchmarks.solvers.RULE_SOURCES`` for the hook point that swaps in
discovered rules. Scalars are op attributes, never tensor inputs.
"""

from __future__ import annotations

from typing import Sequence

from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.placement import Partial, Replicate, Shard
from metadist_core.discovery.rules import OpRules, RuleBook, ShardingRule

R, P, PA = Replicate(), Partial("sum"), Partial("avg")
S = Shard

LINEAR_ALL = {"add", "sub"}  # (P, P) -> P
LINEAR_FIRST = {"mul", "div"}  # (P, R) -> P when the other is a tensor; P -> P with a scalar
NONLINEAR = {"sqrt", "tanh", "gelu", "exp", "neg", "relu"}


def _bcast(in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int], d: int) -> tuple:
    """Placements of broadcast inputs when the output is split on dim ``d``."""
    nd = len(out_shape)
    pl = []
    for s in in_shapes:
        k = d - (nd - len(s))
        pl.append(S(k) if k >= 0 and s[k] == out_shape[d] else R)
    return tuple(pl)


def elementwise(name: str, in_shapes, out_shape, scalar_other: bool) -> list[ShardingRule]:
    rules = [ShardingRule(_bcast(in_shapes, out_shape, d), (S(d),)) for d in range(len(out_shape)) if out_shape[d] > 1]
    n = len(in_shapes)
    if name in LINEAR_ALL:
        rules.append(ShardingRule((P,) * n, (P,)))
    elif name in LINEAR_FIRST and n == 1 and scalar_other:
        rules.append(ShardingRule((P,), (P,)))
    elif name == "mul" and n == 2:
        rules += [ShardingRule((P, R), (P,)), ShardingRule((R, P), (P,))]
    elif name == "div" and n == 2:
        rules.append(ShardingRule((P, R), (P,)))
    return rules


def view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """(in dim, out dim) pairs that a Shard may pass through a reshape: first dims of matching groups."""
    pairs, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        pa, pb, i0, j0 = a[i], b[j], i, j
        while pa != pb:
            if pa < pb:
                i += 1
                pa *= a[i]
            else:
                j += 1
                pb *= b[j]
        pairs.append((i0, j0))
        i, j = i + 1, j + 1
    return [(x, y) for x, y in pairs if a[x] == b[y] or (a[x] % 2 == 0 and b[y] % a[x] == 0)]


def rules_for_op(op: MetaOp, g: MetaIR) -> list[ShardingRule]:
    """One-axis rules of one synthetic op, from its key, shapes and attributes."""
    name = op.key.split(".")[1]
    ins = [g.vars[v].shape for v in op.inputs if g.vars[v].is_tensor]
    outs = [g.vars[v].shape for v in op.outputs]
    a = op.attrs
    if name in LINEAR_ALL | LINEAR_FIRST | NONLINEAR:
        return elementwise(name, ins, outs[0], "scalar" in a)
    if name in ("gelu_backward", "tanh_backward"):
        return [ShardingRule((S(d), S(d)), (S(d),)) for d in range(len(outs[0]))]
    if name == "mm":
        return [ShardingRule((S(0), R), (S(0),)), ShardingRule((R, S(1)), (S(1),)), ShardingRule((S(1), S(0)), (P,))]
    if name == "addmm":
        return [
            ShardingRule((R, S(0), R), (S(0),)),
            ShardingRule((S(0), R, S(1)), (S(1),)),
            ShardingRule((P, S(1), S(0)), (P,)),
        ]
    if name in ("view", "_unsafe_view"):
        return [ShardingRule((S(x),), (S(y),)) for x, y in view_groups(ins[0], outs[0])] + [ShardingRule((P,), (P,))]
    if name in ("t", "transpose"):
        d0, d1 = a.get("dims", (0, 1))
        perm = {d0: d1, d1: d0}
        return [ShardingRule((S(d),), (S(perm.get(d, d)),)) for d in range(len(ins[0]))] + [ShardingRule((P,), (P,))]
    if name == "split":
        dim = a["dim"]
        k = len(outs)
        return [ShardingRule((S(d),), (S(d),) * k) for d in range(len(ins[0])) if d != dim] + [
            ShardingRule((P,), (P,) * k)
        ]
    if name == "cat":
        dim = a["dim"]
        return [ShardingRule((S(d),) * len(ins), (S(d),)) for d in range(len(outs[0])) if d != dim] + [
            ShardingRule((P,) * len(ins), (P,))
        ]
    if name == "sum":
        dims = set(a["dims"])
        keep = [d for d in range(len(ins[0])) if d not in dims]
        return (
            [ShardingRule((S(d),), (S(keep.index(d)),)) for d in keep]
            + [ShardingRule((S(d),), (P,)) for d in dims]
            + [ShardingRule((P,), (P,))]
        )
    if name == "native_layer_norm":  # x, w, b -> out, mean, rstd
        return [ShardingRule((S(d), R, R), (S(d), S(d), S(d))) for d in range(len(ins[0]) - 1)]
    if name == "native_layer_norm_backward":  # dout, x, mean, rstd, w, b -> dx, dw, db
        return [ShardingRule((S(d), S(d), S(d), S(d), R, R), (S(d), P, P)) for d in range(len(ins[0]) - 1)]
    if name.startswith("_scaled_dot_product"):
        n_in, n_out = len(ins), len(outs)
        return [ShardingRule((S(d),) * n_in, (S(d),) * n_out) for d in (0, 1)]
    if name == "_log_softmax":
        return [ShardingRule((S(0),), (S(0),))]
    if name == "_log_softmax_backward_data":
        return [ShardingRule((S(0), S(0)), (S(0),))]
    if name == "nll_loss_forward":  # logp, target -> loss (mean), total_weight
        return [ShardingRule((S(0), S(0)), (PA, P))]
    if name == "nll_loss_backward":  # grad, logp, target, total_weight -> grad_logp
        return [ShardingRule((R, S(0), S(0), R), (S(0),))]
    if name == "embedding":  # weight, ids -> out
        return [
            ShardingRule((R, S(0)), (S(0),)),
            ShardingRule((R, S(1)), (S(1),)),
            ShardingRule((S(1), R), (S(2),)),
            ShardingRule((S(0), R), (P,)),
        ]
    if name == "embedding_dense_backward":  # grad, ids -> dweight
        return [ShardingRule((S(0), S(0)), (P,)), ShardingRule((S(1), S(1)), (P,)), ShardingRule((S(2), R), (S(1),))]
    return []


def synthetic_rulebook(graph: MetaIR) -> RuleBook:
    """A RuleBook with the hand-derived rules of every op signature in ``graph``."""
    book = RuleBook()
    for _sig, op in graph.unique_signatures().items():
        rules = rules_for_op(op, graph)
        book.add_op(
            op,
            graph,
            OpRules(op.key, rules, 2, "ok" if rules else "replicated", "" if rules else "no hand-derived rule"),
        )
    return book
