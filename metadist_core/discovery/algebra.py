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

import math

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
#: ops whose every output dim is one input dim or a new one (size 1, or broadcast from size 1), element for
#: element: transposes, permutations, unsqueezes, squeezes and expands. A split of a kept dim lands on its
#: output dim; a reduction pending on the input is pending on the output
DIM_MAPS = frozenset(
    {
        "aten.t.default",
        "aten.transpose.int",
        "aten.permute.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.expand.default",
    }
)
#: a new tensor of static size and strides whose values are never read before written: any split of it is
#: its own, whatever its input (which gives only dtype and device) holds
NEW_EMPTY = frozenset({"aten.new_empty_strided.default"})


#: ops whose rules discovery takes from their dims without a run, at their own sizes: ShardCombine finds the
#: same rules for them (a test compares the two), only slower. Slices, splits and concatenations are run
#: at proxy sizes first: there ShardCombine finds a few more (a slice over the whole dim, a Partial mean
#: concatenated with a whole tensor)
FIRST = RESHAPES | COPIES | DIM_MAPS


def has_algebra(op: MetaOp) -> bool:
    """Do ``op``'s rules follow from its shapes alone (:func:`algebra_rules`)?"""
    return op.key in FIRST or op.key in ALONG_DIM or op.key in NEW_EMPTY


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


def _dims(value: object, ndim: int) -> list[int] | None:
    """``value`` (a dim or a list of dims, negative from the end) as dims in ``range(ndim)``; None if not ints."""
    dims = value if isinstance(value, (list, tuple)) else [value]
    if ndim == 0 or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    return [d % ndim for d in dims]  # type: ignore[operator]


def dim_map(op: MetaOp, src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int] | None:
    """For a :data:`DIM_MAPS` op from ``src`` to ``dst``: each input dim that reaches the output whole, and the
    output dim it becomes; None where the op's arguments do not say it plainly."""
    key, a = op.key, op.attrs
    if key in ("aten.t.default", "aten.transpose.int"):
        if key == "aten.t.default" and len(src) < 2:  # a 1-D or 0-D tensor's t() is itself
            return {d: d for d in range(len(src))}
        pair = (
            [0, 1]
            if key == "aten.t.default"
            else _dims([encoded_arg(a, 1, "dim0"), encoded_arg(a, 2, "dim1")], len(src))
        )
        if pair is None:
            return None
        order = list(range(len(src)))
        order[pair[0]], order[pair[1]] = order[pair[1]], order[pair[0]]
        return {i: j for j, i in enumerate(order)}
    if key == "aten.permute.default":
        perm = _dims(encoded_arg(a, 1, "dims"), len(src))
        if perm is None or sorted(perm) != list(range(len(src))):
            return None
        return {i: j for j, i in enumerate(perm)}
    if key == "aten.unsqueeze.default":
        new = _dims(encoded_arg(a, 1, "dim"), len(dst))
        if new is None:
            return None
        return {i: i + (i >= new[0]) for i in range(len(src))}
    if key.startswith("aten.squeeze."):
        named = list(range(len(src))) if key == "aten.squeeze.default" else _dims(encoded_arg(a, 1, "dim"), len(src))
        if named is None:
            return None
        gone = set(named)
        kept = [i for i in range(len(src)) if not (i in gone and src[i] == 1)]
        return {i: j for j, i in enumerate(kept)}
    if key == "aten.expand.default":  # right-aligned; a dim expanded from 1 is new
        lead = len(dst) - len(src)
        return {i: i + lead for i in range(len(src)) if src[i] == dst[i + lead]}
    return None


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


def _dim_map_rules(
    op: MetaOp, src: tuple[int, ...], dst: tuple[int, ...], dtype: str, n: int
) -> list[ShardingRule] | None:
    """The rules of a :data:`DIM_MAPS` op from ``src`` to ``dst`` on an axis of ``n`` devices."""
    dims = dim_map(op, src, dst)
    if dims is None or any(j >= len(dst) or dst[j] != src[i] for i, j in dims.items()):
        return None
    rules = [ShardingRule((Replicate(),), (Replicate(),))]
    if math.prod(src) > 0 and dtype.startswith(FLOAT_PREFIXES):
        rules += [ShardingRule((Partial(r),), (Partial(r),)) for r in REDUCE_OPS]
    rules += [ShardingRule((Shard(i),), (Shard(j),)) for i, j in sorted(dims.items()) if splits_nonempty(src[i], n)]
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
    if x.shape is None or y.shape is None or x.dtype != y.dtype:
        return None
    src, dst = tuple(int(d) for d in x.shape), tuple(int(d) for d in y.shape)
    if op.key in DIM_MAPS:
        return _dim_map_rules(op, src, dst, str(x.dtype), int(axis_size))
    if x.numel != y.numel:
        return None
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


__all__ = ["ALONG_DIM", "COPIES", "DIM_MAPS", "FIRST", "NEW_EMPTY", "RESHAPES", "algebra_rules", "has_algebra"]
