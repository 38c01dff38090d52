"""The TVM frontend's pluggy hooks (entry point ``tvm`` in group ``metadist.frontends``).

It owns op keys starting with ``te.``. Ops are traced by
:func:`metadist_tvm.parallelize` (TE graphs are not Python step functions,
so ``metadist_trace`` and ``metadist_lower`` answer only for frontend ``tvm``
with a ``(inputs, outputs)`` pair).
"""
from __future__ import annotations

from metadist_core.frontend_hooks import op_hooks
from metadist_core.hookspecs import hookimpl

OP_PREFIXES = ("te.",)


@hookimpl
def metadist_frontend_info():
    return {"name": "tvm", "op_prefixes": list(OP_PREFIXES),
            "description": "TVM Tensor Expression: topi operators and TE builders rebuilt at shard shapes, llvm"}


metadist_op_spec, metadist_op_cost = op_hooks(OP_PREFIXES, "metadist_tvm.oprunner")


@hookimpl
def metadist_trace(frontend, fn, args, kwargs):
    """For frontend ``tvm``: ``fn`` is ignored; ``args`` is ``(inputs, outputs)``, lists of te tensors."""
    if frontend != "tvm":
        return None
    from .trace import trace
    inputs, outputs = args[:2]
    traced = trace(inputs, outputs if isinstance(outputs, (list, tuple)) else [outputs],
                   (kwargs or {}).get("name", "te_graph"))
    return traced.graph


@hookimpl
def metadist_lower(frontend, graph, plan, mesh, context):
    """For frontend ``tvm``: a :class:`~metadist_tvm.execute.Parallelized` running ``plan`` in this process.

    ``context`` may be the ``Traced`` of the graph; without it the calls are
    taken from the ops' payloads (the graph must have been traced in this process).
    """
    if frontend != "tvm":
        return None
    from .execute import Parallelized
    from .record import Call
    from .trace import Traced
    traced = context
    if not isinstance(traced, Traced):
        missing = [op.id for op in graph.ops if not isinstance(op.payload, Call)]
        if missing:
            raise ValueError(f"ops {missing[:5]} of {graph.name!r} carry no TE call; lower a graph traced by "
                             f"metadist_tvm in this process")
        traced = Traced(graph, {op.id: op.payload for op in graph.ops})
    return Parallelized(traced, plan, mesh, "simulate", len(graph.outputs) == 1)
