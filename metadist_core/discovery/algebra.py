"""Rules that follow from an op's dims alone: a reshape by its dim algebra, a copy by its input's placement, a
slice, split, concatenation or slice-scatter by the dims it leaves alone, a new empty tensor by its own size.

A reshape keeps the row-major order of the elements, so which splits pass it, and where they land, is
:func:`metadist_core.discovery.reshape.reshape_output_placement`'s arithmetic on the two shapes; a copy
gives every piece back as it was. Neither needs a run: these are the rules ShardCombine finds for them
(the same candidates, Partial inputs only for floating dtypes), written down at the op's own sizes.
Discovery uses them where no proxy stands for the op (a proxy whose every size is a product of equal
sizes holds more elements than a proxy may: LLaMA-70B's grouped-query heads, 64 = 8 x 8, beside a
batch of 64), so such ops are never left to run replicated for want of a run.
"""

from __future__ import annotations

from metadist_core.discovery.canonical import encoded_arg
from metadist_core.discovery.reshape import reshape_output_placement
from metadist_core.discovery.rules import ShardingRule
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.placement import REDUCE_OPS, Partial, Placement, Replicate, Shard, splits_nonempty

#: ops whose one output is their one tensor input reshaped (row-major order kept)
RESHAPES = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten._reshape_alias.default",
    }
)
#: ops whose one output equals their one tensor input, element for element
COPIES = frozenset(
    {
        "aten.clone.default",
        "aten.alias.default",
        "aten.detach.default",
        "aten.lift_fresh_copy.default",
        "aten.contiguous.default",
    }
)
FLOAT_PREFIXES = ("float", "bfloat", "complex")
#: ops that select, split, join or overwrite along one dim and copy every other dim through: each op's
#: position of that dim among its arguments. Their tensors split alike on any other dim, and a reduction
#: pending on every input is pending on the outputs (each output element is one input element)
ALONG_DIM = {
    "aten.slice.Tensor": 1,
    "aten.split_with_sizes.default": 2,
    "aten.split.Tensor": 2,
    "aten.cat.default": 1,
    "aten.slice_scatter.default": 2,
}
#: a new tensor of static size and strides whose values are never read before written: any split of it is
#: its own, whatever its input (which gives only dtype and device) holds
NEW_EMPTY = frozenset({"aten.new_empty_strided.default"})


def has_algebra(op: MetaOp) -> bool:
    """Do ``op``'s rules follow from its shapes alone (:func:`algebra_rules`)?"""
    return op.key in RESHAPES or op.key in COPIES or op.key in ALONG_DIM or op.key in NEW_EMPTY


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(int(size), 1)
    return out[::-1]


def _along_dim_rules(op: MetaOp, graph: MetaIR, n: int) -> list[ShardingRule] | None:
    """The rules of an :data:`ALONG_DIM` op at its own shapes; None where its tensors' ranks differ or its dim
    is not a plain integer."""
    shapes = [graph.vars[v].shape for v in op.inputs + op.outputs]
    if not op.outputs or any(s is None for s in shapes) or len({len(s) for s in shapes if s is not None}) != 1:
        return None
    ndim = len(shapes[0] or ())
    dim = encoded_arg(op.attrs, ALONG_DIM[op.key], "dim", 0)
    if not isinstance(dim, int) or ndim == 0:
        return None
    dim %= ndim
    n_in, n_out = len(op.inputs), len(op.outputs)
    rules = [ShardingRule.replicated(n_in, n_out)]
    if all(str(graph.vars[v].dtype).startswith(FLOAT_PREFIXES) for v in op.inputs + op.outputs):
        rules += [ShardingRule((Partial(r),) * n_in, (Partial(r),) * n_out) for r in REDUCE_OPS]
    for d in range(ndim):
        if d != dim and all(splits_nonempty(int(s[d]), n) for s in shapes if s is not None):
            rules.append(ShardingRule((Shard(d),) * n_in, (Shard(d),) * n_out))
    return rules


def _new_empty_rules(op: MetaOp, graph: MetaIR, n: int) -> list[ShardingRule] | None:
    """The rules of a :data:`NEW_EMPTY` op of contiguous strides: its input as it is (placements of its own),
    its output whole or split on any dim (the lowering makes the local size)."""
    if len(op.inputs) != 1 or len(op.outputs) != 1:
        return None
    x, y = graph.vars[op.inputs[0]], graph.vars[op.outputs[0]]
    if x.shape is None or y.shape is None or encoded_arg(op.attrs, 2, "stride") != _contiguous(tuple(y.shape)):
        return None
    rules = [ShardingRule((Replicate(),), (Replicate(),))]
    rules += [ShardingRule((Replicate(),), (Shard(d),)) for d, s in enumerate(y.shape) if splits_nonempty(int(s), n)]
    rules += [
        ShardingRule((Shard(d),), (Shard(d),))
        for d in range(min(len(x.shape), len(y.shape)))
        if splits_nonempty(int(x.shape[d]), n) and splits_nonempty(int(y.shape[d]), n)
    ]
    return rules


def algebra_rules(op: MetaOp, graph: MetaIR, axis_size: int) -> list[ShardingRule] | None:
    """The rules of a reshape or a copy at its own shapes on an axis of ``axis_size`` devices; None when
    ``op`` is neither (or not one tensor in, one tensor out, of known shapes and equal element counts)."""
    if op.key in ALONG_DIM:
        return _along_dim_rules(op, graph, axis_size)
    if op.key in NEW_EMPTY:
        return _new_empty_rules(op, graph, axis_size)
    if not has_algebra(op) or len(op.inputs) != 1 or len(op.outputs) != 1:
        return None
    x, y = graph.vars[op.inputs[0]], graph.vars[op.outputs[0]]
    if x.shape is None or y.shape is None or x.numel != y.numel or x.dtype != y.dtype:
        return None
    src, dst = tuple(int(d) for d in x.shape), tuple(int(d) for d in y.shape)
    if op.key in COPIES and src != dst:
        return None
    n = int(axis_size)
    rules = [ShardingRule((Replicate(),), (Replicate(),))]
    if x.numel > 0 and str(x.dtype).startswith(FLOAT_PREFIXES):
        rules += [ShardingRule((Partial(r),), (Partial(r),)) for r in REDUCE_OPS]
    for d, size in enumerate(src):
        if not splits_nonempty(size, n):
            continue
        out: Placement | None = Shard(d) if op.key in COPIES else reshape_output_placement(src, dst, Shard(d), n)
        if out is not None:
            rules.append(ShardingRule((Shard(d),), (out,)))
    return rules


__all__ = ["ALONG_DIM", "COPIES", "NEW_EMPTY", "RESHAPES", "algebra_rules", "has_algebra"]
