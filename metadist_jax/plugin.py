"""The JAX frontend adapter (entry point ``jax`` in group ``metadist.frontends``).

Importing this module does not import jax; each method does, when it is
called. The driver (:func:`metadist_core.driver.compile.compile_step`) traces with
``jax.make_jaxpr``, plans on every process (each reaches the same plan;
:meth:`JaxFrontend.share` checks it), and lowers the plan to one jitted
``jax.shard_map`` whose body walks the plan with the core's interpreter.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable

from metadist_core.driver.frontend import Frontend, NotSupported, Traced
from metadist_core.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover - types only
    from metadist_core.config import Settings
    from metadist_core.ir.ir import MetaIR
    from metadist_core.ir.placement import Mesh
    from metadist_core.plan.plan import ShardingPlan
    from metadist_core.cost.profile import MeshProfile


#: jaxpr primitives XLA's loop fusion runs inside one loop (priced so in the optimizer update,
#: :mod:`metadist_core.cost.fusion`)
XLA_LOOP_FUSED = frozenset({
    "add", "sub", "mul", "div", "neg", "sqrt", "rsqrt", "integer_pow", "pow", "max", "min", "abs", "sign",
    "square", "exp", "log", "log1p", "expm1", "tanh", "logistic", "select_n", "convert_element_type",
    "broadcast_in_dim", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "clamp", "copy", "copy_p",
})


class JaxFrontend(Frontend):
    """JAX: pure steps ``(params, opt_state, batch) -> (loss, params, opt_state)`` on every JAX device."""

    name = "jax"
    op_prefixes = ("jax.lax.",)
    description = "JAX: jaxpr primitives bound on CPU arrays for ShardCombine, lowered to shard_map"
    runner_module = "metadist_jax.oprunner"
    proxy_shapes = True   # op specs come from the graph's shapes, op.attrs and the payload (params rewritten)
    # XLA's CSE merges the interpreter's second, identical collective of a value for the backward's readers
    # (measured in the optimized HLO: one all_gather where the phases priced two), so one is priced and held
    phased_reshards = False

    def __init__(self) -> None:
        # (shape, axis names) -> the jax.sharding.Mesh resolve_mesh chose for it (say, the user's own)
        self.jax_meshes: dict[tuple, Any] = {}

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        from .trace import call_signature
        return call_signature(args, kwargs)

    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        from .trace import trace_step
        graph, context = trace_step(fn, tuple(args), dict(kwargs or {}))
        return Traced(graph, context)

    def resolve_mesh(self, mesh: Any, profile: "MeshProfile") -> "Mesh":
        from .engine import resolve_mesh
        planning, jax_mesh = resolve_mesh(mesh, profile)
        self.jax_meshes[(planning.shape, planning.axis_names)] = jax_mesh
        return planning

    def jax_mesh(self, mesh: "Mesh") -> Any:
        """The ``jax.sharding.Mesh`` of planning ``mesh``: the one resolved for it, else all devices shaped so."""
        hit = self.jax_meshes.get((mesh.shape, mesh.axis_names))
        if hit is None:
            from .engine import resolve_mesh
            _, hit = resolve_mesh(mesh)
        return hit

    def constraints(self, graph: "MetaIR", mesh: "Mesh") -> list:
        from .engine import even_split_constraints
        return even_split_constraints(graph, mesh)   # shard_map needs even splits

    def is_planner(self) -> bool:
        return True   # every process plans; share checks they agree

    def share(self, plan: "ShardingPlan | None", traced: Traced) -> "ShardingPlan":
        if plan is None:
            return super().share(plan, traced)
        from .engine import agree_on_plan
        return agree_on_plan(plan)

    def lower(self, traced: Traced, plan: "ShardingPlan", mesh: "Mesh", settings: "Settings") -> Callable:
        """A :class:`~metadist_jax.lower.LoweredStep` called with the user's pytrees.

        XLA schedules and combines the collectives itself, so ``settings``' bucketing knobs do not apply.
        """
        from .lower import LoweredStep, lower_plan
        from .trace import TraceContext

        ctx = traced.context
        if not isinstance(ctx, TraceContext):
            raise ValueError("the JAX frontend lowers only graphs it traced itself (the traced step has no "
                             "JAX context); trace it with PluginManager().frontend('jax').trace(...)")
        program = lower_plan(traced.graph, plan, mesh, self.jax_mesh(mesh), ctx.output_ids)
        return LoweredStep(program, ctx)

    def trial(self, traced: Traced, plan: "ShardingPlan", mesh: "Mesh", settings: "Settings", args: tuple,
              kwargs: dict) -> Any:
        """The plan lowered three ways and placed on ``args`` for autotune to time: as a manual shard_map (the
        plan's collectives as written, :mod:`metadist_jax.lower`) and through GSPMD (:mod:`metadist_jax.gspmd`:
        its layouts held, XLA placing the collectives; and only its input and output layouts held, XLA laying
        out the rest); under a ``memory_budget`` the shard_map only (the
        memory plan is the shard_map's; XLA's partitioner keeps what it likes). None with several processes
        (each would time alone, and every process must run the same plan)."""
        import jax
        if jax.process_count() > 1:
            return None
        from .gspmd import IO_LOWERING, LOWERING, lower_gspmd
        from .lower import LoweredStep
        lowered = self.lower(traced, plan, mesh, settings)
        operands = lowered.operands(args, kwargs)   # placed once: every lowering of the plan stores it alike
        out = [lowered.trial(args, kwargs, "shard_map", operands)]
        if settings.memory_budget is not None:
            return out
        for name, hold in ((LOWERING, True), (IO_LOWERING, False)):
            program = lower_gspmd(traced.graph, plan, mesh, self.jax_mesh(mesh), traced.context.output_ids, hold)
            same = list(program.in_shardings) == list(lowered.program.in_shardings)
            out.append(LoweredStep(program, traced.context).trial(args, kwargs, name, operands if same else None))
        return out

    def split_batch(self, args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
        from .microbatch import split_batch
        return split_batch(args, kwargs, m)

    def lower_micro_batches(self, traced: Traced, cut: Any, plans: tuple, mesh: "Mesh",
                            settings: "Settings") -> Callable:
        """Every micro-batch inside one jitted shard_map (:mod:`metadist_jax.microbatch`)."""
        from .microbatch import lower_micro_batches
        return lower_micro_batches(traced.graph, traced.context, cut, plans, plans[2], mesh, self.jax_mesh(mesh),
                                   settings.micro_batches)

    def fuses(self, op: Any) -> bool:
        """XLA fuses elementwise primitives (and broadcasts and casts) into one loop."""
        payload = getattr(op, "payload", None)
        return getattr(payload, "name", None) in XLA_LOOP_FUSED

    def times_local(self, op: Any) -> bool:
        """Matmuls and convolutions are timed at each strategy's local shapes (:mod:`metadist_jax.localtime`),
        in one process only (every process must plan alike, and each would time its own devices)."""
        import jax
        from .localtime import timed
        return jax.process_count() == 1 and timed(op)

    def local_op_times(self, requests: Any, mesh: "Mesh") -> tuple:
        from .localtime import measure_local
        return measure_local(requests, self.jax_mesh(mesh))

    def device_kind(self) -> str | None:
        import jax
        d = jax.devices()[0]
        return f"jax-{d.platform}-{str(getattr(d, 'device_kind', d.platform)).replace(' ', '_')}"

    def measure_profile(self, mesh: "Mesh", cached: Any) -> Any:
        """Alpha/beta per axis of ``mesh`` from psums inside one jitted shard_map, and the devices' rates
        (a few seconds), unless ``cached`` covers this mesh shape already."""
        if cached is not None and "x".join(map(str, mesh.shape)) in cached.axis_costs:
            return cached
        from .calibrate import measure_live
        return measure_live(self.jax_mesh(mesh), mesh.shape, cached)

    def calibrate(self, out: str, nprocs: int | None = None) -> Any:
        """Time psum and all_gather over this process's JAX devices; write and return the MeshProfile."""
        import jax

        if (nprocs not in (None, 1)) or jax.process_count() > 1:
            raise NotSupported(f"the JAX frontend calibrates the devices of one process (it has "
                               f"{jax.device_count()}); got nprocs={nprocs} and {jax.process_count()} processes: "
                               f"run it in one process, with XLA_FLAGS=--xla_force_host_platform_device_count=N "
                               f"for N CPU devices")
        from .calibrate import measure_profile
        profile = measure_profile()
        profile.save(out)
        return profile


@hookimpl
def metadist_frontend() -> JaxFrontend:
    return JaxFrontend()
