"""Rules that follow from an op's dims alone: a reshape by its dim algebra, a copy by its input's placement.

A reshape keeps the row-major order of the elements, so which splits pass it, and where they land, is
:func:`metadist_core.discovery.reshape.reshape_output_placement`'s arithmetic on the two shapes; a copy
gives every piece back as it was. Neither needs a run: these are the rules ShardCombine finds for them
(the same candidates, Partial inputs only for floating dtypes), written down at the op's own sizes.
Discovery uses them where no proxy stands for the op (a proxy whose every size is a product of equal
sizes holds more elements than a proxy may: LLaMA-70B's grouped-query heads, 64 = 8 x 8, beside a
batch of 64), so such ops are never left to run replicated for want of a run.
"""

from __future__ import annotations

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


def has_algebra(op: MetaOp) -> bool:
    """Do ``op``'s rules follow from its shapes alone (:func:`algebra_rules`)?"""
    return op.key in RESHAPES or op.key in COPIES


def algebra_rules(op: MetaOp, graph: MetaIR, axis_size: int) -> list[ShardingRule] | None:
    """The rules of a reshape or a copy at its own shapes on an axis of ``axis_size`` devices; None when
    ``op`` is neither (or not one tensor in, one tensor out, of known shapes and equal element counts)."""
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


__all__ = ["RESHAPES", "COPIES", "has_algebra", "algebra_rules"]
