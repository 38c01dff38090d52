"""A plan lowered through GSPMD: every value held in the plan's layout, XLA's partitioner placing the collectives.

:mod:`metadist_jax.lower` runs a plan in one manual ``shard_map``: each
device binds its ops on local pieces and the plan's collectives run as
written. This module runs the same plan under ``jax.jit`` in GSPMD's global
view: the plan's interpreter walks the graph with every op bound on whole
values, each op's outputs and each collective's result that the plan splits
are constrained to the plan's layout (``with_sharding_constraint``), and XLA's
SPMD partitioner inserts the collectives. Replicated and Partial layouts are
left to XLA's propagation: constraining a replicated gradient makes XLA
all-reduce it where the constraint stands, one at a time, slower than with
only the split values held.

A third lowering, ``gspmd-io`` (:data:`IO_LOWERING`), holds only the plan's
input and output layouts and leaves every value in between to XLA's
propagation: the program jax.jit makes of the step given those layouts. For
the data-parallel plan it is the hand-written jax.jit data parallelism
instruction for instruction (the same optimized HLO), where holding the split
activations can make XLA partition the embedding gradient's scatter-add by
columns (an all-gather of the token ids and of the table and its moments),
slower than jax.jit's data parallelism. For a plan that splits activations or weights XLA may choose
another layout in between, so both GSPMD lowerings are timed.

Why a second lowering: XLA's partitioner rewrites the local program as it
partitions it. On a data-parallel plan it moves the weight gradients'
transposes into the matmuls (the manual program keeps the single-device form)
and merges every gradient all-reduce into one, so jax.jit's data parallelism
can run faster than the shard_map of the same plan. Autotune
(:mod:`metadist_core.driver.autotune`) times the three lowerings of each plan and
keeps the fastest. The collectives of a GSPMD lowering are XLA's, so its bytes are
read from the compiled HLO (:mod:`metadist_jax.hlo`), not from the plan.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding

from metadist_core.cost.model import Collective
from metadist_core.plan.interpret import Collectives
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding

from .lower import Program, build_body, op_payload, partition_spec, program_ends
from .payload import bind_payload

LOWERING = "gspmd"
#: the lowering that holds only the plan's input and output layouts
IO_LOWERING = "gspmd-io"


class _Constrain:
    """``x`` held in ``sharding`` on ``jax_mesh`` where the layout splits it (else left to XLA)."""

    def __init__(self, jax_mesh: Any, names: Sequence[str]) -> None:
        self.jax_mesh, self.names = jax_mesh, list(names)

    def __call__(self, x: Any, sharding: Sharding) -> Any:
        if sharding.has_partial() or sharding.is_fully_replicated() or getattr(x, "ndim", None) is None:
            return x
        spec = partition_spec(sharding, x.ndim, self.names)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.jax_mesh, spec))


class GlobalCollectives(Collectives):
    """The plan's collectives in GSPMD's global view: each is its result's layout, nothing else."""

    def __init__(self, constrain: _Constrain) -> None:
        self.constrain = constrain

    def _to(self, x: Any, c: Collective, shape: tuple[int, ...]) -> Any:
        return self.constrain(x, c.after)

    all_reduce = all_gather = reduce_scatter = all_to_all = local_split = local_partial = _to


def whole_op_runner(graph: MetaIR, constrain: _Constrain) -> Any:
    """``run_op`` for the interpreter in the global view: the op bound on whole values, its outputs held in
    their planned layouts."""

    def run_op(op: MetaOp, ins: list, out_sh: list[Sharding]) -> list:
        full_in = [tuple(graph.vars[v].shape) for v in op.inputs]
        payload = op_payload(op)
        reshape_to = tuple(graph.vars[op.outputs[0]].shape) if payload.name == "reshape" else None
        outs = bind_payload(payload, ins, full_shapes=full_in, reshape_to=reshape_to)
        return [constrain(x, sh) for x, sh in zip(outs, out_sh)]

    return run_op


def _unconstrained(x: Any, sharding: Sharding) -> Any:
    return x


def lower_gspmd(
    graph: MetaIR,
    plan: Any,
    mesh: Mesh,
    jax_mesh: Any,
    output_ids: Sequence[str] | None = None,
    hold_layouts: bool = True,
) -> Program:
    """``plan`` as one ``jax.jit`` over ``jax_mesh`` that GSPMD partitions, inputs and outputs stored as planned.

    ``hold_layouts``: every value the plan splits is held in its layout (:data:`LOWERING`); False: only the
    inputs and outputs are, XLA lays out the rest (:data:`IO_LOWERING`)."""
    output_ids = list(output_ids if output_ids is not None else graph.outputs)
    mesh, in_specs, out_specs = program_ends(graph, plan, mesh, jax_mesh, output_ids)
    constrain = _Constrain(jax_mesh, mesh.axis_names) if hold_layouts else _unconstrained
    body = build_body(
        graph,
        plan,
        mesh,
        output_ids,
        whole_op_runner(graph, constrain),
        GlobalCollectives(constrain),
        reduce_after=None,
    )  # whole values: XLA places the collectives itself
    in_sh = [NamedSharding(jax_mesh, s) for s in in_specs]
    out_sh = [NamedSharding(jax_mesh, s) for s in out_specs]
    fn = jax.jit(body, in_shardings=tuple(in_sh), out_shardings=tuple(out_sh))
    return Program(fn, list(graph.inputs), in_specs, out_specs, in_sh, out_sh, -1, jax_mesh)


__all__ = ["GlobalCollectives", "IO_LOWERING", "LOWERING", "lower_gspmd", "whole_op_runner"]
