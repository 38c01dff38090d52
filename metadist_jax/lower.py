"""Lower a ShardingPlan to ``jax.shard_map`` with explicit collectives.

Inside the shard_map body every device walks the plan with the one plan
interpreter, :func:`metadist_core.plan.interpret.interpret`, exactly as the numpy
simulator does: before an op reads a value, the collectives the plan priced on
that edge run (:class:`JaxCollectives`: ``psum``/``pmax``/``pmin``,
``all_gather``, ``psum_scatter``, ``all_to_all``, a local slice, a local
Partial), then the primitive binds on the local pieces with its shape params
localized (:func:`metadist_jax.payload.bind_payload`). Nothing is left to
GSPMD propagation: the body is manual over every mesh axis.

Graph inputs enter with the plan's ``input_shardings`` as PartitionSpecs;
updated state leaves with the sharding of its input, the loss replicated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from metadist_core.cost.model import Collective
from metadist_core.plan.interpret import COLLECTIVE_KINDS, Collectives, check_plan_ends, interpret
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import IndivisibleError, Sharding, shard_shape
from metadist_core.levers.recompute_segments import SUFFIX as RECOMPUTED

from .engine import put
from .payload import COPY_KEY, IDENTITY, OpPayload, bind_payload
from .trace import TraceContext

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

_ALL_REDUCE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


def _local_slice(x: Any, dim: int, n: int, name: str) -> Any:
    size = x.shape[dim]
    if size % n:
        raise IndivisibleError(
            f"a local split of dim {dim} ({size} elements) over mesh axis {name!r} of "
            f"{n} devices is uneven; shard_map needs even splits"
        )
    part = size // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(name) * part, part, axis=dim)


def _reduce(x: Any, reduce: str, name: str, n: int) -> Any:
    """The all-reduce of ``x`` over mesh axis ``name``; ``avg`` is the sum divided by ``n`` (in x's dtype)."""
    if reduce == "avg":
        return (lax.psum(x, name) / n).astype(x.dtype)
    if reduce not in _ALL_REDUCE:
        raise LoweringError(
            f"no all-reduce {reduce!r} over mesh axis {name!r}; the reductions are "
            f"{', '.join(sorted(_ALL_REDUCE))} and avg"
        )
    return _ALL_REDUCE[reduce](x, name)


class JaxCollectives(Collectives):
    """The plan's collectives on local values inside shard_map (the semantics of metadist_core.plan.simulate)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh  # axis names are the jax mesh's

    def _axis(self, c: Collective) -> tuple[str, int]:
        return self.mesh.axis_names[c.axis], self.mesh.shape[c.axis]

    def all_reduce(self, x: Any, c: Collective, shape: tuple[int, ...]) -> Any:
        name, n = self._axis(c)
        return _reduce(x, c.reduce, name, n)

    def all_gather(self, x: Any, c: Collective, shape: tuple[int, ...]) -> Any:
        name, _ = self._axis(c)
        return lax.all_gather(x, name, axis=c.dims[0], tiled=True)

    def reduce_scatter(self, x: Any, c: Collective, shape: tuple[int, ...]) -> Any:
        name, n = self._axis(c)
        d = c.dims[0]
        if x.shape[d] % n:
            raise IndivisibleError(
                f"reduce_scatter of dim {d} ({x.shape[d]} elements) over mesh axis "
                f"{name!r} of {n} devices is uneven; shard_map needs even splits"
            )
        if c.reduce in ("sum", "avg"):
            y = lax.psum_scatter(x, name, scatter_dimension=d, tiled=True)
            return (y / n).astype(x.dtype) if c.reduce == "avg" else y
        return _local_slice(_reduce(x, c.reduce, name, n), d, n, name)

    def all_to_all(self, x: Any, c: Collective, shape: tuple[int, ...]) -> Any:
        name, n = self._axis(c)
        src, dst = c.dims
        if x.shape[dst] % n:
            raise IndivisibleError(
                f"all_to_all into dim {dst} ({x.shape[dst]} elements) over mesh axis "
                f"{name!r} of {n} devices is uneven; shard_map needs even splits"
            )
        return lax.all_to_all(x, name, split_axis=dst, concat_axis=src, tiled=True)

    def local_split(self, x: Any, c: Collective, shape: tuple[int, ...]) -> Any:
        name, n = self._axis(c)
        return _local_slice(x, c.dims[0], n, name)

    def local_partial(self, x: Any, c: Collective, shape: tuple[int, ...]) -> Any:
        name, _ = self._axis(c)
        if c.reduce == "sum":
            return jnp.where(lax.axis_index(name) == 0, x, jnp.zeros_like(x))
        return x


def apply_collective(x: Any, c: Collective, mesh: Mesh) -> Any:
    """Apply one cost-model Collective to a local value inside shard_map (same semantics as simulate)."""
    if c.kind not in COLLECTIVE_KINDS:
        raise LoweringError(
            f"the shard_map lowering has no collective {c.kind!r} (mesh axis {c.axis}); "
            f"it runs {', '.join(COLLECTIVE_KINDS)}"
        )
    return getattr(JaxCollectives(mesh), c.kind)(x, c, ())


# -- running one op on local pieces ----------------------------------------------


def op_payload(op: MetaOp) -> OpPayload:
    """The payload that runs ``op``; a clear error when the op was not traced by metadist_jax."""
    if op.payload is not None:
        return op.payload
    if op.key == COPY_KEY:
        return IDENTITY
    raise LoweringError(
        f"op {op.id} ({op.key}) carries no primitive to run; trace the step with "
        f"metadist_jax so that every op keeps its JAX primitive"
    )


def local_op_runner(graph: MetaIR, mesh: Mesh) -> Any:
    """``run_op(op, local inputs, output shardings)`` for :func:`~metadist_core.plan.interpret.interpret`.

    Binds the op's primitive on the local pieces (shape params localized) and
    checks every local output against the shape its sharding gives.
    """

    def run_op(op: MetaOp, ins: list, out_sh: list[Sharding]) -> list:
        payload = op_payload(op)
        full_in = [tuple(graph.vars[v].shape) for v in op.inputs]
        want = [
            None if graph.vars[v].shape is None else tuple(shard_shape(graph.vars[v].shape, sh, mesh, even=True))
            for v, sh in zip(op.outputs, out_sh)
        ]
        reshape_to = want[0] if payload.name == "reshape" else None
        if op.id.endswith(RECOMPUTED):  # a recomputed copy: XLA must not merge it with the forward's op
            arrays = [k for k, x in enumerate(ins) if isinstance(x, jax.Array)]
            fenced = jax.lax.optimization_barrier(tuple(ins[k] for k in arrays))
            ins = list(ins)
            for k, x in zip(arrays, fenced):
                ins[k] = x
        outs = bind_payload(payload, ins, full_shapes=full_in, reshape_to=reshape_to)
        for v, x, w, sh in zip(op.outputs, outs, want, out_sh):
            if w is not None and tuple(x.shape) != w:
                raise LoweringError(
                    f"op {op.id} ({op.key}) made a local {v} of shape {tuple(x.shape)} under {sh}, but the "
                    f"plan expects {w} (full shape {graph.vars[v].shape}); its inputs were "
                    f"{[tuple(i.shape) for i in ins]}"
                )
        return outs

    return run_op


# -- the program ----------------------------------------------------------------


@dataclass
class Program:
    """The lowered step: a jitted shard_map over flat graph inputs, with the shardings of both ends."""

    fn: Any  # jitted: (*graph inputs) -> (*outputs in output-leaf order)
    input_ids: list[str]  # graph inputs, in the order fn takes them
    in_specs: list[PartitionSpec]
    out_specs: list[PartitionSpec]
    in_shardings: list[NamedSharding]
    out_shardings: list[NamedSharding]
    n_collectives: int
    jax_mesh: jax.sharding.Mesh


def output_shardings(graph: MetaIR, plan: Any, mesh: Mesh, output_ids: Sequence[str]) -> list[Sharding]:
    """How each output leaves the step: state as its input is stored, everything else replicated."""
    rep = Sharding.replicated(mesh.ndim)
    state_of = {out: s_in for s_in, out in graph.aliases.items()}
    return [plan.input_shardings.get(state_of[o], rep) if o in state_of else rep for o in output_ids]


def moves_only(op: MetaOp) -> tuple[int, ...] | None:
    """The dim permutation of a transpose (the reduce of its input may run after it), else None.

    XLA folds a transpose into the dot before it (a weight gradient's ``dot_general`` then ``transpose``)
    only when no collective stands between them; held apart, the transpose is fused into each of its readers
    as a strided read, which is far slower: a gradient is better all-reduced after its transpose."""
    if op.key != "jax.lax.transpose" or op.payload is None:
        return None
    perm = op.payload.params.get("permutation")
    return tuple(perm) if perm is not None else None


def build_body(
    graph: MetaIR,
    plan: Any,
    mesh: Mesh,
    output_ids: Sequence[str],
    run_op: Any = None,
    collectives: Collectives | None = None,
    reduce_after: Callable[[MetaOp], tuple[int, ...] | None] | None = moves_only,
) -> Any:
    """The per-device function: local graph inputs -> local outputs in ``output_ids`` order (``run_op`` and
    ``collectives``: another view of the same walk, :mod:`metadist_jax.gspmd`'s whole values;
    ``reduce_after``: :func:`metadist_core.plan.interpret.interpret`'s)."""
    state_of = {out: s_in for s_in, out in graph.aliases.items()}
    run_op = run_op or local_op_runner(graph, mesh)
    collectives = collectives or JaxCollectives(mesh)

    def body(*inputs: Any) -> tuple:
        res = interpret(
            graph, plan, mesh, dict(zip(graph.inputs, inputs)), run_op, collectives, reduce_after=reduce_after
        )
        return tuple(res.state[state_of[o]] if o in state_of else res.outputs[o] for o in output_ids)

    return body


def program_ends(
    graph: MetaIR, plan: Any, mesh: Mesh, jax_mesh: jax.sharding.Mesh, output_ids: Sequence[str]
) -> tuple[Mesh, list[PartitionSpec], list[PartitionSpec]]:
    """``plan`` checked for a program over ``jax_mesh`` (even splits, its ends, every op runnable): the
    planning mesh under the JAX mesh's axis names, and the PartitionSpecs of the inputs and ``output_ids``."""
    names = list(jax_mesh.axis_names)
    if tuple(jax_mesh.devices.shape) != tuple(mesh.shape):
        raise LoweringError(f"the JAX mesh has shape {tuple(jax_mesh.devices.shape)} but the plan is for {mesh}")
    mesh = Mesh(mesh.shape, names, mesh.alpha, mesh.beta, mesh.links or None)
    check_even(plan, graph, mesh)
    check_plan_ends(graph, plan, mesh)
    for op in graph.ops:
        op_payload(op)  # every op can run, before anything is traced
    rep = Sharding.replicated(mesh.ndim)
    in_sh = [plan.input_shardings.get(v, rep) for v in graph.inputs]
    in_specs = [partition_spec(s, graph.vars[v].ndim, names) for v, s in zip(graph.inputs, in_sh)]
    out_sh = output_shardings(graph, plan, mesh, output_ids)
    out_specs = [partition_spec(s, graph.vars[v].ndim, names) for v, s in zip(output_ids, out_sh)]
    return mesh, in_specs, out_specs


def lower_plan(
    graph: MetaIR, plan: Any, mesh: Mesh, jax_mesh: jax.sharding.Mesh, output_ids: Sequence[str] | None = None
) -> Program:
    """Turn ``plan`` into a jitted shard_map program over ``jax_mesh``."""
    output_ids = list(output_ids if output_ids is not None else graph.outputs)
    mesh, in_specs, out_specs = program_ends(graph, plan, mesh, jax_mesh, output_ids)
    mapped = jax.shard_map(
        build_body(graph, plan, mesh, output_ids),
        mesh=jax_mesh,
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        check_vma=False,
    )
    n_coll = sum(1 for _, c in plan.collectives() if not c.is_free)
    log.info("lowered %s to shard_map over mesh %s: %d collectives", graph.name, mesh, n_coll)
    return Program(
        jax.jit(mapped),
        list(graph.inputs),
        in_specs,
        out_specs,
        [NamedSharding(jax_mesh, s) for s in in_specs],
        [NamedSharding(jax_mesh, s) for s in out_specs],
        n_coll,
        jax_mesh,
    )


class LoweredStep:
    """A lowered program called with the user's pytrees: places inputs, runs, rebuilds the results."""

    def __init__(self, program: Program, context: TraceContext) -> None:
        self.program, self.context = program, context
        pos = {v: i for i, v in enumerate(program.input_ids)}
        self.consts = [put(context.const_values[v], program.in_shardings[pos[v]]) for v in context.const_ids]

    def operands(self, args: tuple, kwargs: dict) -> list:
        """The program's operands for the user's arguments: each leaf placed as the plan stores it (the
        static ones left out: the trace fixed them), then the step's constants."""
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self.context.in_tree:
            raise TypeError(f"the step was compiled for arguments shaped {self.context.in_tree}, got {tree}")
        leaves = self.context.dynamic(leaves)
        return [put(x, s) for x, s in zip(leaves, self.program.in_shardings)] + list(self.consts)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outs = self.program.fn(*self.operands(args, kwargs))
        return jax.tree_util.tree_unflatten(self.context.out_tree, list(outs))

    def compiled_text(self, *args: Any, **kwargs: Any) -> str:
        """The optimized HLO XLA compiles for these arguments (what :mod:`metadist_jax.hlo` reads)."""
        return self.program.fn.lower(*self.operands(args, kwargs)).compile().as_text()

    def trial(self, args: tuple, kwargs: dict, lowering: str = "", operands: list | None = None) -> Any:
        """A :class:`metadist_core.driver.autotune.Trial` of this step on ``args`` (``lowering``: its name): placed
        once (or given ``operands``, placed already: another lowering of the same plan takes the same), each
        ``run()`` runs the program and waits for it. Nothing is donated, so the arguments stay as they were."""
        from metadist_core.driver.autotune import Trial

        if operands is None:
            operands = self.operands(args, kwargs)
        return Trial(lambda: jax.block_until_ready(self.program.fn(*operands)), self, lowering)


__all__ = [
    "JaxCollectives",
    "LoweredStep",
    "LoweringError",
    "Program",
    "apply_collective",
    "build_body",
    "moves_only",
    "check_even",
    "local_op_runner",
    "lower_plan",
    "output_shardings",
    "partition_spec",
    "program_ends",
]
