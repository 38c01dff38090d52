"""Bytes a plan's distributed implementations move inside their ops, which the plan's own collectives do not
list: what each rank puts into the all_to_alls of its expert-parallel layers."""

from __future__ import annotations

from metadist_core.discovery import moe_dispatch
from metadist_core.ir.ir import DTYPE_BYTES, MetaIR
from metadist_core.ir.mesh import Mesh
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.distimpls import local_shapes


def moe_dispatch_bytes(graph: MetaIR, plan: ShardingPlan) -> tuple[int, int]:
    """(bytes one rank puts into the all_to_alls of the ops ``plan`` runs expert-parallel, those ops) per step:
    :func:`~metadist_core.discovery.moe_dispatch.dispatch_bytes` at each op's local shapes, its rows at the
    widest dtype they carry (x; in the backward, the gradient and the routing weights beside it)."""
    total, ops = 0, 0
    mesh = Mesh(tuple(plan.mesh_shape))
    for op in graph.ops:
        strategy = plan.strategies.get(op.id)
        placed = strategy.impl_axis() if strategy is not None else None
        if strategy is None or placed is None or not placed[1].startswith(moe_dispatch.EP):
            continue
        shapes = [tuple(graph.vars[v].shape or ()) for v in op.inputs]
        local = local_shapes(strategy, shapes, mesh, -1)
        rows = op.inputs[:2] + op.inputs[3:4] if op.key == moe_dispatch.BACKWARD else op.inputs[:1]
        item = max(DTYPE_BYTES.get(str(graph.vars[v].dtype), 4) for v in rows)
        total += moe_dispatch.dispatch_bytes(op.key, local, item, plan.mesh_shape[placed[0]])
        ops += 1
    return total, ops


__all__ = ["moe_dispatch_bytes"]
