"""The JAX frontend adapter (entry point ``jax`` in group ``metadist.frontends``).

Importing this module does not import jax; each method does, when it is
called. The driver (:func:`metadist_core.driver.compile.compile_step`) traces with
``jax.make_jaxpr``, plans on every process (each reaches the same plan;
:meth:`JaxFrontend.share` checks it), and lowers the plan to one jitted
``jax.shard_map`` whose body walks the plan with the core's interpreter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable

from metadist_core.driver.frontend import (
    Frontend,
    FrontendTraits,
    Lowered,
    MicroBatches,
    NotSupported,
    Program,
    Resolved,
    Stages,
    Traced,
    Trials,
    not_supported,
)
from metadist_core.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover - types only
    from metadist_core.config import Settings
    from metadist_core.ir.ir import MetaIR
    from metadist_core.ir.mesh import Mesh
    from metadist_core.cost.profile import MeshProfile


#: jaxpr primitives XLA's loop fusion runs inside one loop (priced so in the optimizer update,
#: :mod:`metadist_core.cost.fusion`)
XLA_LOOP_FUSED = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "sqrt",
        "rsqrt",
        "integer_pow",
        "pow",
        "max",
        "min",
        "abs",
        "sign",
        "square",
        "exp",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "select_n",
        "convert_element_type",
        "broadcast_in_dim",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "and",
        "or",
        "not",
        "clamp",
        "copy",
        "copy_p",
    }
)


def _fuses(op: Any) -> bool:
    """XLA fuses elementwise primitives (and broadcasts and casts) into one loop."""
    payload = getattr(op, "payload", None)
    return getattr(payload, "name", None) in XLA_LOOP_FUSED


def _times_local(op: Any) -> bool:
    """Matmuls and convolutions are timed at each strategy's local shapes (:mod:`metadist_jax.localtime`),
    in one process only (every process must plan alike, and each would time its own devices)."""
    import jax
    from .localtime import timed

    return jax.process_count() == 1 and timed(op)


def _batch_leaves(args: tuple, kwargs: dict) -> Any:
    from .microbatch import batch_leaves

    return batch_leaves(args, kwargs)


TRAITS = FrontendTraits(
    op_prefixes=("jax.lax.",),
    runner_module="metadist_jax.oprunner",
    proxy_shapes=True,  # op specs come from the graph's shapes, op.attrs and the payload (params rewritten)
    # XLA's CSE merges the interpreter's second, identical collective of a value for the backward's readers
    # (measured in the optimized HLO: one all_gather where the phases priced two), so one is priced and held
    phased_reshards=False,
    fuses=_fuses,
    times_local=_times_local,
    batch_leaves=_batch_leaves,
)


class JaxFrontend(Frontend):
    """JAX: pure steps ``(params, opt_state, batch) -> (loss, params, opt_state)`` on every JAX device, and
    flax.nnx steps in their pure form (:mod:`metadist_jax.nnx`)."""

    name = "jax"
    description = "JAX: jaxpr primitives bound on CPU arrays for ShardCombine, lowered to shard_map"
    traits = TRAITS

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        from .trace import call_signature

        return call_signature(args, kwargs)

    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        from .nnx import is_pure_call, namer, purified
        from .trace import input_name, trace_step

        names = namer(args[2].layout) if is_pure_call(args) else input_name
        graph, context = trace_step(purified(fn, args), tuple(args), dict(kwargs or {}), names=names)
        return Traced(graph, context)

    def resolve_mesh(self, mesh: Any, profile: "MeshProfile") -> Resolved:
        """The planning Mesh and its ``jax.sharding.Mesh`` (say, the user's own)."""
        import jax
        from .engine import resolve_mesh

        planning, jax_mesh = resolve_mesh(mesh, profile)
        d = jax.devices()[0]
        kind = f"jax-{d.platform}-{str(getattr(d, 'device_kind', d.platform)).replace(' ', '_')}"
        return Resolved(planning, jax_mesh, kind)  # every process plans and keeps its own caches

    def constraints(self, graph: "MetaIR", mesh: "Mesh") -> list:
        from .engine import even_split_constraints

        return even_split_constraints(graph, mesh)  # shard_map needs even splits

    def share(self, plan_fn: Callable[[], Any], traced: Traced, resolved: Resolved) -> Any:
        """Every process plans; the plans are checked to agree."""
        from .engine import agree_on_plan

        return agree_on_plan(plan_fn())

    def lower(self, traced: Traced, program: Program, resolved: Resolved, settings: "Settings") -> Lowered:
        """A :class:`~metadist_jax.lower.LoweredStep` called with the user's pytrees (XLA schedules and
        combines the collectives itself, so ``settings``' bucketing knobs do not apply); micro-batches all
        inside one jitted shard_map (:mod:`metadist_jax.microbatch`)."""
        from .lower import LoweredStep, lower_plan
        from .trace import TraceContext

        ctx = traced.context
        if not isinstance(ctx, TraceContext):
            raise ValueError(
                "the JAX frontend lowers only graphs it traced itself (the traced step has no "
                "JAX context); trace it with PluginManager().frontend('jax').trace(...)"
            )
        if isinstance(program, Stages):
            raise not_supported(self.name, program)
        if isinstance(program, Trials):
            return Lowered(trials=_trials(traced, program, resolved, settings))
        if isinstance(program, MicroBatches):
            from .microbatch import lower_micro_batches

            return Lowered(
                lower_micro_batches(
                    traced.graph,
                    ctx,
                    program.cut,
                    program.plans,
                    program.plans[2],
                    resolved.mesh,
                    resolved.engine,
                    settings.micro_batches,
                )
            )
        program_ = lower_plan(traced.graph, program.plan, resolved.mesh, resolved.engine, ctx.output_ids)
        return Lowered(LoweredStep(program_, ctx))

    def time_ops(self, requests: Any, resolved: Resolved, traced: Traced | None = None, program: bool = False) -> Any:
        """The matmuls and convolutions among ``requests`` (:func:`_times_local`) at their shapes, with
        every device of the mesh running them at once (:mod:`metadist_jax.localtime`); the other ops are
        not timed (None)."""
        from metadist_core.driver.frontend import OpTimes
        from .localtime import measure_local

        asked = [i for i, r in enumerate(requests) if _times_local(r[0])]
        if not asked:
            return None
        jax_mesh = resolved.engine
        if jax_mesh is None:
            from .engine import resolve_mesh

            _, jax_mesh = resolve_mesh(resolved.mesh)
        secs, rates = measure_local([requests[i] for i in asked], jax_mesh)
        seconds: list = [None] * len(requests)
        for i, sec in zip(asked, secs):
            seconds[i] = sec
        return OpTimes(seconds, rates)

    def measure_profile(self, resolved: Resolved, cached: Any, traced: Traced | None = None) -> Any:
        """Alpha/beta per axis of the mesh from psums inside one jitted shard_map, and the devices' rates
        (a few seconds), unless ``cached`` covers this mesh shape already."""
        if resolved.mesh.size == 1 or (cached is not None and cached.covers(resolved.mesh)):
            return cached
        from .calibrate import measure_live

        return measure_live(resolved.engine, resolved.mesh.shape, cached)

    def calibrate(self, out: str, nprocs: int | None = None) -> Any:
        """Time psum and all_gather over this process's JAX devices; write and return the MeshProfile."""
        import jax

        if (nprocs not in (None, 1)) or jax.process_count() > 1:
            raise NotSupported(
                f"the JAX frontend calibrates the devices of one process (it has "
                f"{jax.device_count()}); got nprocs={nprocs} and {jax.process_count()} processes: "
                f"run it in one process, with XLA_FLAGS=--xla_force_host_platform_device_count=N "
                f"for N CPU devices"
            )
        from .calibrate import measure_profile

        profile = measure_profile()
        profile.save(out)
        return profile


def _trials(traced: Traced, program: Trials, resolved: Resolved, settings: "Settings") -> list:
    """The plan lowered three ways and placed on the step's arguments for autotune to time: as a manual
    shard_map (the plan's collectives as written, :mod:`metadist_jax.lower`) and through GSPMD
    (:mod:`metadist_jax.gspmd`: its layouts held, XLA placing the collectives; and only its input and output
    layouts held, XLA laying out the rest); under a ``memory_budget`` the shard_map only (the memory plan is
    the shard_map's; XLA's partitioner keeps what it likes). None with several processes (each would time
    alone, and every process must run the same plan)."""
    import jax

    if jax.process_count() > 1:
        return []
    from .gspmd import IO_LOWERING, LOWERING, lower_gspmd
    from .lower import LoweredStep, lower_plan

    args, kwargs, plan, mesh = program.args, program.kwargs, program.plan, resolved.mesh
    lowered = LoweredStep(
        lower_plan(traced.graph, plan, mesh, resolved.engine, traced.context.output_ids), traced.context
    )
    operands = lowered.operands(args, kwargs)  # placed once: every lowering of the plan stores it alike
    out = [lowered.trial(args, kwargs, "shard_map", operands)]
    if settings.memory_budget is not None:
        return out
    for name, hold in ((LOWERING, True), (IO_LOWERING, False)):
        gspmd = lower_gspmd(traced.graph, plan, mesh, resolved.engine, traced.context.output_ids, hold)
        same = list(gspmd.in_shardings) == list(lowered.program.in_shardings)
        out.append(LoweredStep(gspmd, traced.context).trial(args, kwargs, name, operands if same else None))
    return out


@hookimpl
def metadist_frontend() -> JaxFrontend:
    return JaxFrontend()
