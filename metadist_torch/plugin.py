"""The torch frontend's pluggy hooks (entry point ``torch`` in group ``metadist.frontends``)."""
from __future__ import annotations

from metadist_core.hookspecs import hookimpl

OP_PREFIXES = ("aten.",)


def _owned(op) -> bool:
    return isinstance(getattr(op, "key", None), str) and op.key.startswith(OP_PREFIXES)


@hookimpl
def metadist_frontend_info():
    return {"name": "torch", "op_prefixes": list(OP_PREFIXES),
            "description": "PyTorch: aten ops run through torch.ops for ShardCombine"}


@hookimpl
def metadist_op_spec(op, graph):
    if not _owned(op):
        return None
    from .oprunner import op_spec
    return op_spec(op, graph)


@hookimpl
def metadist_op_cost(op, graph):
    if not _owned(op):
        return None
    from .oprunner import op_cost
    return op_cost(op, graph)


@hookimpl
def metadist_trace(frontend, fn, args, kwargs):
    if frontend != "torch":
        return None
    from .compile import trace_for_hook
    return trace_for_hook(fn, tuple(args), dict(kwargs or {}))


@hookimpl
def metadist_lower(frontend, graph, plan, mesh, context):
    if frontend != "torch":
        return None
    from .compile import lower_for_hook
    return lower_for_hook(graph, plan, mesh, context)
