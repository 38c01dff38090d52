"""The JAX frontend's pluggy hooks (entry point ``jax`` in group ``metadist.frontends``).

Importing this module does not import jax; each hook does, when it is called
for work that is its own (op keys ``jax.lax.*``, frontend name ``jax``).
"""
from __future__ import annotations

from metadist_core.frontend_hooks import op_hooks
from metadist_core.hookspecs import hookimpl

NAME = "jax"
OP_PREFIXES = ("jax.lax.",)


@hookimpl
def metadist_frontend_info():
    return {"name": NAME, "op_prefixes": list(OP_PREFIXES),
            "description": "JAX: jaxpr primitives bound on CPU arrays for ShardCombine, lowered to shard_map"}


metadist_op_spec, metadist_op_cost = op_hooks(OP_PREFIXES, "metadist_jax.oprunner")


@hookimpl
def metadist_trace(frontend, fn, args, kwargs):
    if frontend != NAME:
        return None
    from .trace import trace_step
    graph, _ = trace_step(fn, tuple(args), dict(kwargs or {}))
    return graph


@hookimpl
def metadist_lower(frontend, graph, plan, mesh, context):
    """A callable running one step with the user's pytrees, over all of ``jax.devices()`` shaped as ``mesh``."""
    if frontend != NAME:
        return None
    from .engine import resolve_mesh
    from .lower import lower_plan
    from .compile import LoweredStep

    ctx = context if context is not None else getattr(graph, "payload", None)
    if ctx is None:
        raise ValueError("the JAX frontend lowers only graphs it traced itself (the graph has no JAX context)")
    md, jmesh = resolve_mesh(tuple(mesh.shape))
    program = lower_plan(graph, plan, mesh, jmesh, ctx.output_ids)
    return LoweredStep(program, ctx)
