"""Check a lowered plan value by value against the unsplit run (a debugging aid).

:func:`first_mismatch` runs the graph twice: whole on one device, and under the
plan inside shard_map, where every op output is also gathered back whole (the
cost model's reshard to Replicate). It returns the first op whose gathered
output differs, with both values, or None when all agree.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import jax
from jax.sharding import PartitionSpec

from metadist_core.cost import reshard
from metadist_core.ir import MetaIR
from metadist_core.placement import Mesh, Sharding

from .lower import apply_collective, build_body, lower_plan
from .oprunner import OpPayload, bind_payload


def run_whole(graph: MetaIR, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """Every value of ``graph`` run unsplit (jitted), by var id."""
    tensor_vars = [v for op in graph.ops for v in op.outputs]

    def f(*xs):
        env = dict(zip(graph.inputs, xs))
        for op in graph.ops:
            payload = op.payload or OpPayload(None, {}, [0], ())
            for v, x in zip(op.outputs, bind_payload(payload, [env[i] for i in op.inputs])):
                env[v] = x
        return [env[v] for v in tensor_vars]

    return dict(zip(tensor_vars, [np.asarray(x) for x in jax.jit(f)(*inputs)]))


def run_planned(graph: MetaIR, plan: Any, mesh: Mesh, jax_mesh: Any, inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """Every op output under the plan, gathered whole after its op, by var id."""
    mesh = Mesh(mesh.shape, tuple(jax_mesh.axis_names))
    rep = Sharding.replicated(mesh.ndim)
    outs = [(v, (plan.strategies[op.id].outputs[i] if op.id in plan.strategies else rep))
            for op in graph.ops for i, v in enumerate(op.outputs)]
    program = lower_plan(graph, plan, mesh, jax_mesh)
    def body(*xs):
        seen: list = []
        build_body(graph, plan, mesh, list(graph.outputs), tap=lambda op, res: seen.extend(res))(*xs)
        flat = seen
        gathered = []
        for (v, sh), x in zip(outs, flat):
            shape = graph.vars[v].shape
            for c in ([] if sh == rep or shape is None else reshard(sh, rep, shape, graph.vars[v].dtype, mesh)):
                x = apply_collective(x, c, mesh)
            gathered.append(x)
        return tuple(gathered)

    mapped = jax.shard_map(body, mesh=jax_mesh, in_specs=tuple(program.in_specs),
                           out_specs=tuple(PartitionSpec() for _ in outs), check_vma=False)
    placed = [jax.device_put(x, s) for x, s in zip(inputs, program.in_shardings)]
    vals = jax.jit(mapped)(*placed)
    return {v: np.asarray(x) for (v, _), x in zip(outs, vals)}


def first_mismatch(graph: MetaIR, plan: Any, mesh: Mesh, jax_mesh: Any, inputs: Sequence[Any],
                   rtol: float = 1e-4, atol: float = 1e-5) -> dict | None:
    """The first op (in graph order) whose output under the plan differs from the unsplit run."""
    whole = run_whole(graph, inputs)
    planned = run_planned(graph, plan, mesh, jax_mesh, inputs)
    for op in graph.ops:
        for v in op.outputs:
            a, b = whole[v], planned[v]
            if a.shape != b.shape or not np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=rtol,
                                                     atol=atol, equal_nan=True):
                st = plan.strategies.get(op.id)
                return {"op": op.id, "key": op.key, "var": v, "strategy": str(st), "whole": a, "planned": b,
                        "inputs": list(op.inputs)}
    return None
