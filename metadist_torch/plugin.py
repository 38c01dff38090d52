"""The torch frontend's pluggy hooks (entry point ``torch`` in group ``metadist.frontends``)."""
from __future__ import annotations

from metadist_core.frontend_hooks import op_hooks
from metadist_core.hookspecs import hookimpl

OP_PREFIXES = ("aten.",)


@hookimpl
def metadist_frontend_info():
    return {"name": "torch", "op_prefixes": list(OP_PREFIXES),
            "description": "PyTorch: aten ops run through torch.ops for ShardCombine"}


metadist_op_spec, metadist_op_cost = op_hooks(OP_PREFIXES, "metadist_torch.oprunner")


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
