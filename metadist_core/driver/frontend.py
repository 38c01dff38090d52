"""The Frontend adapter: what a framework plugs into the one driver (:mod:`metadist_core.driver.compile`).

A frontend plugin implements one hook, ``metadist_frontend()``, returning an
instance of a :class:`Frontend` subclass. The driver calls, in this order and
nowhere else::

    traced = fe.trace(fn, args, kwargs)            # every process
    mesh   = fe.resolve_mesh(mesh_arg, profile)    # shape from the engine, link costs from the profile
    extra  = fe.constraints(traced.graph, mesh)    # what the engine cannot run (say, uneven splits)
    if fe.is_planner(): discover, build, solve     # core; op_spec / op_cost are called here
    plan   = fe.share(plan, traced)                # the one way this engine agrees on a plan
    step   = fe.lower(traced, plan, mesh, settings) # a callable running one step on this process

``signature(args, kwargs)`` is the cache key of a call (a new key compiles
again). ``op_spec``/``op_cost`` serve discovery and the cost model for op keys
starting with one of ``op_prefixes``. ``demo`` and ``calibrate`` are optional
(the ``metadist`` command reaches them through the adapter).
"""
from __future__ import annotations

import abc
import contextlib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Hashable, Sequence

if TYPE_CHECKING:  # pragma: no cover - types only
    from metadist_core.driver.autotune import Trial
    from metadist_core.config import Settings
    from metadist_core.cost.model import DeviceSpec
    from metadist_core.ir.ir import MetaIR, MetaOp
    from metadist_core.ir.placement import Mesh
    from metadist_core.plan.plan import ShardingPlan
    from metadist_core.cost.profile import MeshProfile
    from metadist_core.discovery.shardcombine import OpSpec


@dataclass
class Traced:
    """A traced step: the frontend-neutral graph and the frontend's own context for lowering and running."""

    graph: "MetaIR"
    context: Any = None


class Watch(abc.ABC):
    """What a compiled step depends on beyond its call signature, checked at every call (a frontend's)."""

    @abc.abstractmethod
    def failed(self, args: tuple, kwargs: dict, returning: bool = True) -> str | None:
        """What changed since the compile that makes its program wrong, in words; None when nothing did.
        ``returning``: another program of the step ran since this one did (what only another program can
        change may have changed)."""

    def agree(self, decision: Sequence[int]) -> None:
        """Make sure every process took the same ``decision`` (which compiled program runs), or raise the same
        error on every process; one process alone (the default) has nothing to agree with."""


class NotSupported(RuntimeError):
    """A frontend was asked for something it does not offer (names the frontend and the feature)."""


class Frontend(abc.ABC):
    """Base class of frontend adapters; override what your framework supports.

    Subclasses set ``name`` (what users pass), ``op_prefixes`` (op keys they
    own, e.g. ``("aten.",)``) and ``description`` (one line).
    """

    name: str = ""
    op_prefixes: tuple[str, ...] = ()
    description: str = ""
    runner_module: str = ""   # a module with op_spec(op, graph) and op_cost(op, graph), imported on first use
    proxy_shapes: bool = False  # op_spec reads only the graph's shapes and op.attrs: discovery may use proxy sizes
    bucket_copies: int = 0     # extra copies of a gradient bucket the lowering holds where it runs (memprofile)
    shard_buckets: bool = False   # the lowering gathers inputs and reduce-scatters gradients in buckets (gathers.py)
    # the lowering moves a value again for its readers after the forward (torch frees the forward's copy,
    # metadist_core.cost.phases); False: one move serves every phase (XLA merges identical collectives)
    phased_reshards: bool = True
    # every process receives the user's inputs whole (each rank calls the step with the whole batch): the
    # lowering slices an input to any layout a reader wants, so the planner prices that at nothing and the
    # plan has no collective there (interpret's ``whole``); False: inputs are placed once, moved by collectives
    whole_inputs: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A concrete adapter runs ops for discovery: it names a ``runner_module`` or overrides ``op_spec``."""
        super().__init_subclass__(**kwargs)
        abstract = any(getattr(getattr(cls, n, None), "__isabstractmethod__", False)
                       for n in getattr(Frontend, "__abstractmethods__", ()))
        if not abstract and not cls.runner_module and cls.op_spec is Frontend.op_spec:
            raise TypeError(f"frontend adapter {cls.__name__} runs no ops for discovery: set runner_module to a "
                            f"module with op_spec(op, graph), or override op_spec")

    # -- the flow ---------------------------------------------------------------
    @abc.abstractmethod
    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        """The compile-cache key of a call; calls with equal keys reuse one compiled step."""

    def watch(self, result: Any, args: tuple, kwargs: dict) -> "Watch | None":
        """The guards of a compiled step (:class:`Watch`), read right after ``result`` was lowered for this
        call; None (the default): the signature alone decides which compiled program runs."""
        return None

    @abc.abstractmethod
    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        """Trace the step ``fn(*args, **kwargs)`` into MetaIR (plus what lowering needs)."""

    @abc.abstractmethod
    def resolve_mesh(self, mesh: Any, profile: "MeshProfile") -> "Mesh":
        """The Mesh this process runs on for the user's ``mesh`` argument, priced with ``profile``.

        A mesh whose size differs from the engine's device count is an error quoting both.
        """

    def constraints(self, graph: "MetaIR", mesh: "Mesh") -> list:
        """Constraints (``Pin``/``Forbid``) the engine needs on every plan of ``graph`` (default none)."""
        return []

    def is_planner(self) -> bool:
        """Does this process discover and solve? (One per job; the others receive the plan in ``share``.)"""
        return True

    def share(self, plan: "ShardingPlan | None", traced: Traced) -> "ShardingPlan":
        """Make every process hold the same plan. ``plan`` is None on processes that did not plan."""
        if plan is None:
            raise RuntimeError(f"frontend {self.name!r}: this process did not plan and has no way to receive one")
        return plan

    def share_error(self, error: BaseException) -> None:
        """The planner failed with ``error``: tell the other processes so that none waits for a plan."""

    @abc.abstractmethod
    def lower(self, traced: Traced, plan: "ShardingPlan", mesh: "Mesh", settings: "Settings") -> Callable:
        """A callable that runs one step of ``plan`` on this process, called with the step's arguments.

        ``settings`` carries the lowering's knobs (``coalesce``, ``bucket_bytes``...)."""

    # -- micro-batches (metadist_core.levers.microbatch) --------------------
    def trial(self, traced: Traced, plan: "ShardingPlan", mesh: "Mesh", settings: "Settings", args: tuple,
              kwargs: dict) -> "Trial | None":
        """``plan`` made runnable on the step's own ``args`` for :mod:`metadist_core.driver.autotune` to time: a
        :class:`~metadist_core.driver.autotune.Trial` whose ``run()`` runs one step and leaves the arguments as they
        were. Called on the planning process alone; None (the default) where one process cannot run a plan
        by itself (torch: every rank takes part in a step), and then nothing is timed."""
        return None

    def split_batch(self, args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
        """The call cut into ``m`` micro-batches along dim 0 of every tensor input, each ``(args, kwargs)``;
        a batch ``m`` does not divide is an error quoting both (``microbatch.micro_batch_size``)."""
        raise NotSupported(f"frontend {self.name!r} cannot cut a batch into micro-batches")

    def lower_micro_batches(self, traced: Traced, cut: Any, plans: tuple, mesh: "Mesh",
                            settings: "Settings") -> Callable:
        """A callable running one step as ``settings.micro_batches`` micro-batches: ``cut.grad_graph`` under
        ``plans[0]`` on each (gradients combined as ``cut.reduction`` says), then ``cut.update_graph`` under
        ``plans[1]`` once (``cut`` is a :class:`~metadist_core.levers.microbatch.GradientCut`; ``plans[2]`` is the
        whole step's plan: how its inputs are stored)."""
        raise NotSupported(f"frontend {self.name!r} cannot run micro-batches (micro_batches > 1)")

    # -- offload (metadist_core.levers.offload) ------------------------------------------
    def offloads(self) -> bool:
        """Does ``lower`` run ``offload="optimizer"`` (the host region of :mod:`metadist_core.levers.offload` on the
        host)? Only then may a step compile with it; `metadist plan` prices it for every frontend."""
        return False

    # -- pipelines (metadist_core.levers.stages, metadist_core.driver.pipeplan) ---------------
    def pipelines(self) -> bool:
        """Can ``lower_stages`` run a pipeline? (The planner prices one only then.)"""
        return False

    def lower_stages(self, traced: Traced, plan: "ShardingPlan", mesh: "Mesh", settings: "Settings") -> Callable:
        """A callable running one step as the pipeline ``plan.stages`` (``plan``: the stages' sub-mesh plan)
        with ``settings.schedule`` over ``settings.micro_batches`` micro-batches."""
        raise NotSupported(f"pipeline_stages > 1 is not yet for the {self.name} frontend: plan it with "
                           f"`metadist plan` (it prices the stages) and run with pipeline_stages=1")

    # -- ops, for discovery and the cost model ----------------------------------
    def owns(self, op: "MetaOp") -> bool:
        return isinstance(getattr(op, "key", None), str) and op.key.startswith(tuple(self.op_prefixes))

    def op_spec(self, op: "MetaOp", graph: "MetaIR") -> "OpSpec":
        """An OpSpec that runs ``op`` on numpy inputs for ShardCombine; raise ``Unrunnable`` when it cannot.

        By default ``runner_module.op_spec(op, graph)``, the module imported on first use (so that
        loading the plugin imports no framework); an adapter with neither is refused at class creation."""
        return importlib.import_module(self.runner_module).op_spec(op, graph)

    def op_cost(self, op: "MetaOp", graph: "MetaIR") -> tuple[float, float] | None:
        """``(flops, bytes moved)`` of the whole op, or None to let the core estimate from tensor sizes.

        By default ``runner_module.op_cost(op, graph)`` when that module has one."""
        if not self.runner_module:
            return None
        fn = getattr(importlib.import_module(self.runner_module), "op_cost", None)
        return None if fn is None else fn(op, graph)

    def fuses(self, op: "MetaOp") -> bool:
        """Does this frontend's compiler fuse ``op`` into the elementwise loop of its neighbours? Where it
        says so for the optimizer's update, that update is priced as one loop per parameter
        (:mod:`metadist_core.cost.fusion`). False by default: every op is priced as run by itself."""
        return False

    def times_local(self, op: "MetaOp") -> bool:
        """Does this frontend time ``op`` at the local input shapes of each strategy the planner offers it
        (:meth:`local_op_times`, :mod:`metadist_core.cost.localtime`)? False by default."""
        return False

    def local_op_times(self, requests: "Sequence[tuple[MetaOp, tuple, tuple]]", mesh: "Mesh") \
            -> "tuple[list[float | None], DeviceSpec]":
        """Seconds of one run of each requested op (an op :meth:`times_local` takes, its tensor inputs' local
        shapes and their dtypes) with every device of ``mesh`` running it at once, None where it could not be
        run; and the device's rates measured in the same run (the roofline the times are divided by). Called
        on the planner only, with measured costs, with batches of the requests no earlier call answered. Every
        process of a step must plan alike: a frontend that plans on several processes times nothing there."""
        from metadist_core.cost.model import DEVICE_PRESETS
        return [None] * len(requests), DEVICE_PRESETS["cpu"]

    def op_slowdowns(self, graph: "MetaIR", costs: "dict[str, tuple]", cache_file: str | None) -> dict[str, float]:
        """Per op id, how much slower than its roofline (``costs``: its ``(flops, bytes)``) the op runs on
        this process's device, measured; the cost model multiplies its roofline by it. Called on the
        planner only, when the driver prices with a measured profile; ``cache_file``: where the figures of
        this machine are kept. The default measures nothing (every op at its roofline)."""
        return {}

    def discovering(self) -> ContextManager[None]:
        """A context entered around a discovery run over this frontend's ops (say, one compute thread:
        ShardCombine runs many tiny ops, where a thread pool costs more than it gives)."""
        return contextlib.nullcontext()

    def can_fork_discovery(self) -> bool:
        """May discovery run this frontend's ops in forked child processes right now? False by default (a
        runtime with threads or a device context of its own may not survive a fork)."""
        return False

    # -- optional command-line jobs ------------------------------------------------
    def demo(self, args: Sequence[str]) -> int:
        """Run this frontend's end-to-end demo with command-line ``args``; return an exit code."""
        raise NotSupported(f"frontend {self.name!r} has no demo")

    def device_spec(self, traced: "Traced") -> "DeviceSpec | None":
        """The device a one-device step runs on, for its memory plan (``memory_budget``, ``offload``); None
        (the default): priced as a CPU, whose memory is the host's."""
        return None

    def device_kind(self) -> str | None:
        """The kind of device this process runs on ("cpu", "cuda-NVIDIA H100 ..."), the key of its measured
        profile in the cache; None (the default): this frontend does not measure, the built-in costs apply."""
        return None

    def measure_profile(self, mesh: "Mesh", cached: "MeshProfile | None") -> "MeshProfile | None":
        """Link alpha/beta per axis of ``mesh`` on the live engine and the device's compute rate, in a few
        seconds, as a measured MeshProfile; every process calls it at once. ``cached``: the profile this
        machine has (on every process alike), returned as it is when it covers ``mesh``. The driver caches
        what this returns (:func:`metadist_core.cost.profile.profile_for`)."""
        return cached

    def calibrate(self, out: str, nprocs: int | None = None) -> Any:
        """Measure link and device costs on this engine; write and return a MeshProfile."""
        raise NotSupported(f"frontend {self.name!r} cannot calibrate")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


__all__ = ["Frontend", "Traced", "NotSupported"]
