"""Lower a ShardingPlan to ``jax.shard_map`` with explicit collectives.

Inside the shard_map body every device runs the MetaIR on its local pieces,
exactly as :mod:`metadist_core.simulate` does with numpy: before an op reads a
value, the collectives the plan priced on that edge run (``psum``/``pmean``/
``pmax``/``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all``, a local
slice, a local Partial), then the primitive binds on the local pieces with its
shape params localized. Nothing is left to GSPMD propagation: the body is
manual over every mesh axis.

Graph inputs enter with the plan's ``input_shardings`` as PartitionSpecs;
updated state leaves with the sharding of its input, the loss replicated.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from metadist_core.cost import UnknownCollectiveError
from metadist_core.ir import MetaIR
from metadist_core.placement import IndivisibleError, Mesh, Sharding, shard_shape

from .oprunner import COPY_KEY, OpPayload, bind_payload

log = logging.getLogger("metadist.jax.lower")


class LoweringError(RuntimeError):
    """The plan cannot be lowered to shard_map as it stands (names the op, value or collective)."""


def partition_spec(sharding: Sharding, ndim: int, axis_names: Sequence[str]) -> PartitionSpec:
    """The PartitionSpec of a Sharding: per tensor dim, the mesh axes that split it (outermost first)."""
    if sharding.has_partial():
        raise LoweringError(f"sharding {sharding} holds a Partial, which no PartitionSpec can express")
    dims: list[Any] = [None] * ndim
    for d, axes in sharding.sharded_dims().items():
        names = tuple(axis_names[a] for a in axes)
        dims[d % ndim] = names[0] if len(names) == 1 else names
    while dims and dims[-1] is None:
        dims.pop()
    return PartitionSpec(*dims)


def check_even(plan: Any, graph: MetaIR, mesh: Mesh) -> None:
    """Raise :class:`IndivisibleError` if any layout of the plan splits a dim unevenly (shard_map needs even)."""
    def check(var: str, sh: Sharding, where: str) -> None:
        shape = graph.vars[var].shape
        if shape is None:
            return
        try:
            shard_shape(shape, sh, mesh, even=True)
        except IndivisibleError as e:
            raise IndivisibleError(f"{where}: value {var} of shape {shape} as {sh}: {e}") from None

    for v, sh in plan.input_shardings.items():
        check(v, sh, "graph input")
    for op in graph.ops:
        st = plan.strategies.get(op.id)
        if st is None:
            continue
        for v, sh in zip(op.inputs, st.inputs):
            check(v, sh, f"op {op.id} ({op.key}) input")
        for v, sh in zip(op.outputs, st.outputs):
            check(v, sh, f"op {op.id} ({op.key}) output")
    for e in plan.edges:
        for c in e.collectives:
            check(e.var, c.after, f"collective {c.kind} on edge {e.var} -> {e.dst}")


# -- collectives ------------------------------------------------------------------

_ALL_REDUCE = {"sum": lax.psum, "avg": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def _local_slice(x: Any, dim: int, n: int, name: str) -> Any:
    size = x.shape[dim]
    if size % n:
        raise IndivisibleError(f"a local split of dim {dim} ({size} elements) over mesh axis {name!r} of "
                               f"{n} devices is uneven; shard_map needs even splits")
    part = size // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(name) * part, part, axis=dim)


def apply_collective(x: Any, c: Any, mesh: Mesh) -> Any:
    """Apply one cost-model Collective to a local value inside shard_map (same semantics as simulate)."""
    name = mesh.axis_names[c.axis]
    n = mesh.shape[c.axis]
    kind = c.kind
    if kind == "all_reduce":
        return _ALL_REDUCE[c.reduce](x, name)
    if kind == "all_gather":
        return lax.all_gather(x, name, axis=c.dims[0], tiled=True)
    if kind == "reduce_scatter":
        d = c.dims[0]
        if x.shape[d] % n:
            raise IndivisibleError(f"reduce_scatter of dim {d} ({x.shape[d]} elements) over mesh axis "
                                   f"{name!r} of {n} devices is uneven")
        if c.reduce in ("sum", "avg"):
            y = lax.psum_scatter(x, name, scatter_dimension=d, tiled=True)
            return y / n if c.reduce == "avg" else y
        return _local_slice(_ALL_REDUCE[c.reduce](x, name), d, n, name)
    if kind == "all_to_all":
        src, dst = c.dims
        if x.shape[dst] % n:
            raise IndivisibleError(f"all_to_all into dim {dst} ({x.shape[dst]} elements) over mesh axis "
                                   f"{name!r} of {n} devices is uneven")
        return lax.all_to_all(x, name, split_axis=dst, concat_axis=src, tiled=True)
    if kind == "local_split":
        return _local_slice(x, c.dims[0], n, name)
    if kind == "local_partial":
        if c.reduce == "sum":
            return jnp.where(lax.axis_index(name) == 0, x, jnp.zeros_like(x))
        return x
    raise UnknownCollectiveError(kind, f"the shard_map lowering (mesh axis {name!r})")


# -- the program ----------------------------------------------------------------


@dataclass
class Program:
    """The lowered step: a jitted shard_map over flat graph inputs, with the shardings of both ends."""

    fn: Any                               # jitted: (*graph inputs) -> (*outputs in output-leaf order)
    input_ids: list[str]                  # graph inputs, in the order fn takes them
    in_specs: list[PartitionSpec]
    out_specs: list[PartitionSpec]
    in_shardings: list[NamedSharding]
    out_shardings: list[NamedSharding]
    n_collectives: int


def _local_shapes(graph: MetaIR, vars_: Sequence[str], shardings: Sequence[Sharding], mesh: Mesh) -> list:
    out = []
    for v, sh in zip(vars_, shardings):
        shape = graph.vars[v].shape
        out.append(None if shape is None else tuple(shard_shape(shape, sh, mesh, even=True)))
    return out


def build_body(graph: MetaIR, plan: Any, mesh: Mesh, output_ids: Sequence[str], tap: Any = None):
    """The per-device function: local graph inputs -> local outputs, collectives as the plan says.

    ``tap(op, outputs)``, when given, sees every op's local outputs (for checking).
    """
    incoming, finals = plan.edge_index()
    state_of = {out: s_in for s_in, out in graph.aliases.items()}
    rep = Sharding.replicated(mesh.ndim)
    steps = []
    for op in graph.ops:
        st = plan.strategies.get(op.id)
        out_sh = list(st.outputs) if st is not None else [rep] * len(op.outputs)
        payload: OpPayload | None = op.payload
        if payload is None:
            if op.key != COPY_KEY:
                raise LoweringError(f"op {op.id} ({op.key}) carries no primitive to run; trace the step with "
                                    f"metadist_jax so that every op keeps its JAX primitive")
            payload = OpPayload(None, {}, [0], ())
        colls = [incoming[(op.id, s)].collectives if (op.id, s) in incoming else [] for s in range(len(op.inputs))]
        full_in = [tuple(graph.vars[v].shape) for v in op.inputs]
        local_out = _local_shapes(graph, op.outputs, out_sh, mesh)
        steps.append((op, payload, colls, full_in, local_out, out_sh))

    def body(*inputs):
        env = dict(zip(graph.inputs, inputs))
        for op, payload, colls, full_in, local_out, out_sh in steps:
            ins = []
            for v, cs in zip(op.inputs, colls):
                x = env[v]
                for c in cs:
                    x = apply_collective(x, c, mesh)
                ins.append(x)
            reshape_to = local_out[0] if payload.name == "reshape" else None
            outs = bind_payload(payload, ins, full_shapes=full_in, reshape_to=reshape_to)
            for v, x, want, sh in zip(op.outputs, outs, local_out, out_sh):
                if want is not None and tuple(x.shape) != want:
                    raise LoweringError(
                        f"op {op.id} ({op.key}) made a local {v} of shape {tuple(x.shape)} under {sh}, but the "
                        f"plan expects {want} (full shape {graph.vars[v].shape}); its inputs were "
                        f"{[tuple(i.shape) for i in ins]}")
                env[v] = x
            if tap is not None:
                tap(op, outs)
        results = []
        for o in output_ids:
            dst = state_of.get(o, "<output>")
            x = env[o]
            e = finals.get((o, dst))
            for c in (e.collectives if e is not None else []):
                x = apply_collective(x, c, mesh)
            results.append(x)
        return tuple(results)

    return body


def output_shardings(graph: MetaIR, plan: Any, mesh: Mesh, output_ids: Sequence[str]) -> list[Sharding]:
    """How each output leaves the step: state as its input is stored, everything else replicated."""
    rep = Sharding.replicated(mesh.ndim)
    state_of = {out: s_in for s_in, out in graph.aliases.items()}
    out = []
    for o in output_ids:
        if o in state_of:
            out.append(plan.input_shardings.get(state_of[o], rep))
        else:
            out.append(rep)
    return out


def lower_plan(graph: MetaIR, plan: Any, mesh: Mesh, jax_mesh: jax.sharding.Mesh,
               output_ids: Sequence[str] | None = None) -> Program:
    """Turn ``plan`` into a jitted shard_map program over ``jax_mesh``."""
    check_even(plan, graph, mesh)
    output_ids = list(output_ids if output_ids is not None else graph.outputs)
    names = list(jax_mesh.axis_names)
    if tuple(jax_mesh.devices.shape) != tuple(mesh.shape):
        raise LoweringError(f"the JAX mesh has shape {tuple(jax_mesh.devices.shape)} but the plan is for {mesh}")
    mesh = Mesh(mesh.shape, names, mesh.alpha, mesh.beta)
    rep = Sharding.replicated(mesh.ndim)
    in_sh = [plan.input_shardings.get(v, rep) for v in graph.inputs]
    in_specs = [partition_spec(s, graph.vars[v].ndim, names) for v, s in zip(graph.inputs, in_sh)]
    out_sh = output_shardings(graph, plan, mesh, output_ids)
    out_specs = [partition_spec(s, graph.vars[v].ndim, names) for v, s in zip(output_ids, out_sh)]
    body = build_body(graph, plan, mesh, output_ids)
    mapped = jax.shard_map(body, mesh=jax_mesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                           check_vma=False)
    n_coll = sum(1 for _, c in plan.collectives() if not c.is_free)
    return Program(jax.jit(mapped), list(graph.inputs), in_specs, out_specs,
                   [NamedSharding(jax_mesh, s) for s in in_specs], [NamedSharding(jax_mesh, s) for s in out_specs],
                   n_coll)
