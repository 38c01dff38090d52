"""The Frontend adapter: what a framework plugs into the one driver (:mod:`metadist_core.driver.compile`).

A frontend plugin implements one hook, ``metadist_frontend()``, returning an
instance of a :class:`Frontend` subclass. The driver calls, in this order and
nowhere else::

    traced   = fe.trace(fn, args, kwargs)             # every process
    resolved = fe.resolve_mesh(mesh_arg, profile)     # the planning Mesh and the engine's own mesh, together
    extra    = fe.constraints(traced.graph, mesh)     # what the engine cannot run (say, uneven splits)
    plan     = fe.share(plan_fn, traced, resolved)    # plans where this frontend plans; every process gets it
    lowered  = fe.lower(traced, program, resolved, settings)   # what runs one step on this process

``signature(args, kwargs)`` is the cache key of a call (a new key compiles
again). ``op_spec``/``op_cost`` serve discovery and the cost model for op keys
starting with one of ``traits.op_prefixes``; ``time_ops`` times ops on the
device where the driver prices with measured costs; ``measure_profile`` measures
the live engine's links and device. What the lowering makes of buckets, phases
and inputs, and what the frontend can run at all, are data: :class:`FrontendTraits`.
``demo`` and ``calibrate`` are optional (the ``metadist`` command reaches them).
"""

from __future__ import annotations

import abc
import contextlib
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Hashable, Sequence

if TYPE_CHECKING:  # pragma: no cover - types only
    from metadist_core.config import Settings
    from metadist_core.cost.model import DeviceSpec
    from metadist_core.cost.profile import MeshProfile
    from metadist_core.discovery.shardcombine import OpSpec
    from metadist_core.driver.autotune import Trial
    from metadist_core.ir.ir import MetaIR, MetaOp
    from metadist_core.ir.mesh import Mesh
    from metadist_core.levers.microbatch import GradientCut
    from metadist_core.plan.plan import ShardingPlan


def _never(op: Any) -> bool:
    return False


def _can_not_fork() -> bool:
    return False


@dataclass(frozen=True)
class BatchLeaves:
    """A call's arguments flattened: its leaves, which of them are batch tensors (cut along dim 0 into
    micro-batches) and how to put leaves back into ``(args, kwargs)``."""

    leaves: list
    batch: list[int]
    rebuild: Callable[[list], tuple[tuple, dict]]
    what: str = "batch leaf"  # how an error names one batch leaf ("tensor input")


@dataclass(frozen=True)
class FrontendTraits:
    """What a frontend's lowering makes of a plan and what it can run: data the driver reads and hands to
    the planner (:func:`metadist_core.driver.planner.plan_graph` prices each)."""

    op_prefixes: tuple[str, ...] = ()
    #: a module with ``op_spec(op, graph)`` and optionally ``op_cost(op, graph)``, imported on first use
    runner_module: str = ""
    #: op_spec reads only the graph's shapes and op.attrs: discovery may run the op at proxy sizes
    proxy_shapes: bool = False
    #: extra copies of a gradient bucket the lowering holds where it runs (metadist_core.plan.memprofile)
    bucket_copies: int = 0
    #: the lowering gathers inputs and reduce-scatters gradients in buckets (metadist_core.cost.gathers)
    shard_buckets: bool = False
    #: the lowering moves a value again for its readers after the forward (torch frees the forward's copy,
    #: metadist_core.cost.phases); False: one move serves every phase (XLA merges identical collectives)
    phased_reshards: bool = True
    #: every process receives the user's inputs whole (each rank calls the step with the whole batch): the
    #: lowering slices an input to any layout a reader wants, so the planner prices that at nothing
    whole_inputs: bool = False
    #: ``lower`` runs ``offload="optimizer"`` (the host region of metadist_core.levers.offload)
    offloads: bool = False
    #: ``lower`` runs :class:`Stages` (a pipeline); the planner prices one only then
    pipelines: bool = False
    #: does the frontend's compiler fuse ``op`` into the elementwise loop of its neighbours (the optimizer
    #: update is then priced as one loop per parameter, metadist_core.cost.fusion)
    fuses: Callable[[Any], bool] = _never
    #: what the frontend's optional compiler fuses into elementwise loops, when a ``backend`` other than
    #: eager runs the rank program (Inductor for torch); priced as ``fuses`` is
    compiled_fuses: Callable[[Any], bool] = _never
    #: the ops :meth:`Frontend.time_ops` is asked to time at each strategy's local shapes
    #: (metadist_core.cost.localtime); the others, where it times at all, at their whole shapes
    times_local: Callable[[Any], bool] = _never
    #: a context entered around a discovery run over this frontend's ops (say, one compute thread)
    discovering: Callable[[], ContextManager[None]] = contextlib.nullcontext
    #: may discovery run this frontend's ops in forked child processes right now?
    can_fork_discovery: Callable[[], bool] = _can_not_fork
    #: a call's arguments as leaves and which are batch tensors (metadist_core.levers.microbatch.split_batch);
    #: None: this frontend cannot cut a batch into micro-batches
    batch_leaves: Callable[[tuple, dict], BatchLeaves] | None = None
    #: the distributed implementations this frontend lowers: (a registry with the frontend's ``lower`` hooks
    #: attached, the frontend's name there), made when first planned; None: the planner offers none
    #: (:mod:`metadist_core.problem.distimpls`)
    dist_impls: Callable[[], tuple[Any, str]] | None = None

    def owns(self, op: Any) -> bool:
        """Is ``op``'s key one of this frontend's (by prefix)?"""
        return isinstance(getattr(op, "key", None), str) and op.key.startswith(tuple(self.op_prefixes))


@dataclass
class Traced:
    """A traced step: the frontend-neutral graph and the frontend's own context for lowering and running."""

    graph: "MetaIR"
    context: Any = None


@dataclass(frozen=True)
class Resolved:
    """The mesh a step runs on: the planning ``mesh`` (link costs priced) and the framework's own ``engine``
    (a torch Engine, a ``jax.sharding.Mesh``; None where the frontend has none), resolved once and handed
    to every later hook; ``device_kind`` keys this machine's measured profile (None: nothing is measured)."""

    mesh: "Mesh"
    engine: Any = None
    device_kind: str | None = None
    lead: bool = True  # this process writes what the job caches (one per job: rank 0)
    #: bytes of memory of the device each process runs on (CUDA), the default memory budget
    #: (metadist_core.driver.budget); None: not known or a CPU (no default budget)
    device_memory: int | None = None

    def priced(self, mesh: "Mesh") -> "Resolved":
        """The same engine with the planning mesh repriced (same shape)."""
        return Resolved(mesh, self.engine, self.device_kind, self.lead, self.device_memory)


# -- what to lower ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WholeStep:
    """One step under ``plan``, as traced."""

    plan: "ShardingPlan"


@dataclass(frozen=True)
class MicroBatches:
    """One step as ``settings.micro_batches`` micro-batches: ``cut.grad_graph`` under ``plans[0]`` on each
    (gradients combined as ``cut.reduction`` says), then ``cut.update_graph`` under ``plans[1]`` once;
    ``plans[2]`` is the whole step's plan (how its inputs are stored). ``cut`` None: only asks whether the
    frontend runs micro-batches (raises :class:`NotSupported` when it does not)."""

    cut: "GradientCut | None"
    plans: tuple


@dataclass(frozen=True)
class Stages:
    """One step as the pipeline ``plan.stages`` (``plan``: the stages' sub-mesh plan), with
    ``settings.schedule`` over ``settings.micro_batches`` micro-batches; ``plan`` None: only asks whether
    the frontend runs pipelines (raises :class:`NotSupported` when it does not)."""

    plan: "ShardingPlan | None"


@dataclass(frozen=True)
class Trials:
    """``plan`` made runnable on the step's own ``args``/``kwargs`` for autotune to time
    (:mod:`metadist_core.driver.autotune`), on the planning process alone."""

    plan: "ShardingPlan"
    args: tuple
    kwargs: dict


Program = WholeStep | MicroBatches | Stages | Trials


@dataclass
class Lowered:
    """What ``lower`` made: ``run`` called with the step's arguments runs one step on this process;
    ``watch``: the guards of that program (:class:`Watch`, read right after lowering; None: the signature
    alone decides); ``trials``: for :class:`Trials`, one :class:`~metadist_core.driver.autotune.Trial` per
    lowering of the plan (empty: nothing can be timed)."""

    run: Callable | None = None
    watch: "Watch | None" = None
    trials: "list[Trial]" = field(default_factory=list)


@dataclass(frozen=True)
class OpTimes:
    """What :meth:`Frontend.time_ops` measured: per request, the seconds of one run (None: not run), and the
    device's rates measured in the same run; ``harness``: seconds of a tiny op timed the same way (what the
    timing's call path adds to any op); ``program``: seconds of one run of the whole traced step, replicated
    on this device (None: not timed)."""

    seconds: list
    device: "DeviceSpec"
    harness: float = 0.0
    program: float | None = None


class Watch(abc.ABC):
    """What a compiled step depends on beyond its call signature, checked at every call (a frontend's)."""

    @abc.abstractmethod
    def failed(self, args: tuple, kwargs: dict, returning: bool = True) -> str | None:
        """What changed since the compile that makes its program wrong, in words; None when nothing did.
        ``returning``: another program of the step ran since this one did (what only another program can
        change may have changed)."""

    def agree(self, decision: Sequence[int]) -> None:  # noqa: B027 - a default that does nothing, not abstract
        """Make sure every process took the same ``decision`` (which compiled program runs), or raise the same
        error on every process; one process alone (the default) has nothing to agree with."""


class NotSupported(RuntimeError):
    """A frontend was asked for something it does not offer (names the frontend and the feature)."""


def not_supported(frontend: str, program: Any) -> NotSupported:
    """The error for a ``program`` frontend ``frontend`` does not lower, naming the option that asked for it."""
    if isinstance(program, MicroBatches):
        return NotSupported(f"frontend {frontend!r} cannot run micro-batches (micro_batches > 1)")
    if isinstance(program, Stages):
        return NotSupported(
            f"pipeline_stages > 1 is not yet for the {frontend} frontend: plan it with "
            f"`metadist plan` (it prices the stages) and run with pipeline_stages=1"
        )
    return NotSupported(f"frontend {frontend!r} cannot lower {type(program).__name__}")


class Frontend(abc.ABC):
    """Base class of frontend adapters; override what your framework supports.

    Subclasses set ``name`` (what users pass), ``description`` (one line) and ``traits``
    (:class:`FrontendTraits`: the op keys they own, their op runner module, what their lowering does).
    """

    name: str = ""
    description: str = ""
    traits: FrontendTraits = FrontendTraits()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A concrete adapter runs ops for discovery: it names a ``runner_module`` or overrides ``op_spec``."""
        super().__init_subclass__(**kwargs)
        abstract = any(
            getattr(getattr(cls, n, None), "__isabstractmethod__", False)
            for n in getattr(Frontend, "__abstractmethods__", ())
        )
        if not abstract and not cls.traits.runner_module and cls.op_spec is Frontend.op_spec:
            raise TypeError(
                f"frontend adapter {cls.__name__} runs no ops for discovery: set "
                f"traits.runner_module to a module with op_spec(op, graph), or override op_spec"
            )

    # -- the flow ---------------------------------------------------------------
    @abc.abstractmethod
    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        """The compile-cache key of a call; calls with equal keys reuse one compiled step."""

    @abc.abstractmethod
    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        """Trace the step ``fn(*args, **kwargs)`` into MetaIR (plus what lowering needs)."""

    @abc.abstractmethod
    def resolve_mesh(self, mesh: Any, profile: "MeshProfile") -> Resolved:
        """The mesh this process runs on for the user's ``mesh`` argument: the planning Mesh priced with
        ``profile`` and the engine's own mesh, together.

        A mesh whose size differs from the engine's device count is an error quoting both.
        """

    def constraints(self, graph: "MetaIR", mesh: "Mesh") -> list:
        """Constraints (``Pin``/``Forbid``) the engine needs on every plan of ``graph`` (default none)."""
        return []

    def share(self, plan_fn: Callable[[], Any], traced: Traced, resolved: Resolved) -> Any:
        """Run ``plan_fn`` where this frontend plans and give every process its result (a
        :class:`~metadist_core.driver.planner.CompileResult`; on a process that did not plan, one holding
        only the plan); where ``plan_fn`` raises, every process raises (none waits for a plan). The
        default: this one process plans."""
        return plan_fn()

    @abc.abstractmethod
    def lower(self, traced: Traced, program: Program, resolved: Resolved, settings: "Settings") -> Lowered:
        """What runs ``program`` (:class:`WholeStep`, :class:`MicroBatches`, :class:`Stages`,
        :class:`Trials`) on this process; a program this frontend cannot run raises :class:`NotSupported`
        naming the option (:func:`not_supported`). ``settings`` carries the lowering's knobs."""

    # -- ops, for discovery and the cost model ----------------------------------
    def op_spec(self, op: "MetaOp", graph: "MetaIR") -> "OpSpec":
        """An OpSpec that runs ``op`` on numpy inputs for ShardCombine; raise ``Unrunnable`` when it cannot.

        By default ``traits.runner_module.op_spec(op, graph)``, the module imported on first use (so that
        loading the plugin imports no framework); an adapter with neither is refused at class creation."""
        return importlib.import_module(self.traits.runner_module).op_spec(op, graph)

    def op_cost(self, op: "MetaOp", graph: "MetaIR") -> tuple[float, float] | None:
        """``(flops, bytes moved)`` of the whole op, or None to let the core estimate from tensor sizes.

        By default ``traits.runner_module.op_cost(op, graph)`` when that module has one."""
        if not self.traits.runner_module:
            return None
        fn = getattr(importlib.import_module(self.traits.runner_module), "op_cost", None)
        return None if fn is None else fn(op, graph)

    def time_ops(
        self,
        requests: "Sequence[tuple[MetaOp, tuple, tuple]]",
        resolved: Resolved,
        traced: Traced | None = None,
        program: bool = False,
    ) -> OpTimes | None:
        """Seconds of one run of each requested op (the op, its tensor inputs' shapes and dtypes) on this
        process's device as this frontend's step runs it: ops :attr:`FrontendTraits.times_local` takes at a
        strategy's local shapes with every device of ``resolved`` running it at once, the others at their
        whole shapes, the fastest of several runs; and the device's rates measured in the same run.
        ``traced``: the step the ops come from; with ``program``, its whole program is timed too, replicated
        on this device (:attr:`OpTimes.program`). The core derives what it prices from these figures
        (:mod:`metadist_core.cost.optimes`, :mod:`metadist_core.cost.localtime`).
        Called on the planner only, with measured costs; None (the default): this frontend times nothing."""
        return None

    def measure_profile(
        self, resolved: Resolved, cached: "MeshProfile | None", traced: Traced | None = None
    ) -> "MeshProfile | None":
        """On a mesh of several devices: link alpha/beta per axis on the live engine and the device's rates,
        in a few seconds, as a measured MeshProfile; every process calls it at once; ``cached`` (the profile
        this machine has, on every process alike) returned as it is where it covers the mesh
        (:meth:`~metadist_core.cost.profile.MeshProfile.covers`). On one device, ``traced`` given: a profile
        whose ``device`` is the one the step's state lives on, measured (a GPU: its rates and host link),
        for its memory plan; None (the default): the built-in costs apply."""
        return cached

    # -- optional command-line jobs ------------------------------------------------
    def demo(self, args: Sequence[str]) -> int:
        """Run this frontend's end-to-end demo with command-line ``args``; return an exit code."""
        raise NotSupported(f"frontend {self.name!r} has no demo")

    def calibrate(self, out: str, nprocs: int | None = None) -> Any:
        """Measure link and device costs on this engine; write and return a MeshProfile."""
        raise NotSupported(f"frontend {self.name!r} cannot calibrate")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


__all__ = [
    "BatchLeaves",
    "Frontend",
    "FrontendTraits",
    "Lowered",
    "MicroBatches",
    "NotSupported",
    "OpTimes",
    "Program",
    "Resolved",
    "not_supported",
    "Stages",
    "Traced",
    "Trials",
    "Watch",
    "WholeStep",
]
