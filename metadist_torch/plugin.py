"""The torch frontend adapter (entry point ``torch`` in group ``metadist.frontends``).

The driver (:func:`metadist_core.driver.compile.compile_step`) calls, on every rank:
``trace`` (every rank traces: tracing is deterministic), ``resolve_mesh`` (the
process group and DeviceMesh of this job, with this rank's Engine), ``share``
(rank 0 plans; its plan is checked against each rank's own graph) and ``lower``
(this rank's program). Importing this module imports no torch: every method imports
what it needs on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Sequence

from metadist_core.driver.frontend import (
    BatchLeaves,
    Frontend,
    FrontendTraits,
    Lowered,
    MicroBatches,
    Program,
    Resolved,
    Stages,
    Traced,
    Trials,
)
from metadist_core.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover - types only
    from metadist_core.config import Settings
    from metadist_core.cost.profile import MeshProfile
    from metadist_core.plan.plan import ShardingPlan

OP_PREFIXES = (
    "aten.",
    "metadist.experts_ffn",
    "metadist.moe_dropless",
)  # aten, and MetaDist's own runnable ops (calls.OWN_OPS)


def _discovering() -> Any:
    """One intra-op thread while ShardCombine runs thousands of tiny ops (a pool costs more than it
    gives there); the user's setting is restored."""
    import torch

    @contextlib.contextmanager
    def one_thread() -> Iterator[None]:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return one_thread()


def _can_fork_discovery() -> bool:
    """Forked children run CPU aten ops well (as DataLoader workers do), but not once CUDA or a process
    group is up in this process (a rank of torchrun plans alone, its peers waiting)."""
    import torch

    if torch.cuda.is_initialized():
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _batch_leaves(args: tuple, kwargs: dict) -> BatchLeaves:
    """Every tensor of the call is a batch leaf (the model and optimizer hold the state)."""
    from .lower.pipeline import batch_leaves

    return batch_leaves(args, kwargs)


def _pointwise(op: Any) -> bool:
    """Inductor fuses torch's pointwise ops (the ``pointwise`` tag) into one loop with their neighbours."""
    import torch

    from .trace.calls import resolve_target

    try:
        return torch.Tag.pointwise in resolve_target(op.key).tags
    except (ValueError, AttributeError, RuntimeError):
        return False


def _dist_impls() -> tuple:
    from .ops.distimpls import torch_impls

    return torch_impls()


TRAITS = FrontendTraits(
    op_prefixes=OP_PREFIXES,
    runner_module="metadist_torch.ops.oprunner",
    proxy_shapes=True,  # op specs come from the graph's shapes and op.attrs alone
    bucket_copies=1,  # collectives.AxisComm.all_reduce_bucket: the concatenation (reduced in place)
    shard_buckets=True,  # lower.coalesce_all_gathers and coalesce_reduces
    whole_inputs=True,  # every rank calls the step with the whole batch (RankProgram slices it: lower_plan)
    offloads=True,
    pipelines=True,
    discovering=_discovering,
    can_fork_discovery=_can_fork_discovery,
    batch_leaves=_batch_leaves,
    compiled_fuses=_pointwise,
    dist_impls=_dist_impls,
)


class TorchFrontend(Frontend):
    """PyTorch: a whole training step (forward, backward, optimizer) traced to aten ops; runs on torch.distributed.

    ``lower`` gives a callable taking the step's own ``(*args, **kwargs)`` and
    returning what the step returns (see :mod:`metadist_torch.lower.program`).
    """

    name = "torch"
    description = "PyTorch: aten ops run through torch.ops for ShardCombine"
    traits = TRAITS
    moe_capacity_factor: float | None = None  # the setting's value, for tracing mixture-of-experts layers
    mesh_shape: tuple[int, ...] | None = None  # the step's mesh, where given: a token group per device

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        from .trace.state import signature

        return signature(args, kwargs)

    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        from metadist_core.driver.planonly import requested

        from .trace.state import collect_state, init_optimizer_state, optimizers_in
        from .trace.trace import trace_step

        if fn is None:
            raise TypeError("the torch frontend traces a step function; got None")
        init_optimizer_state(optimizers_in(args, kwargs))
        state = collect_state(args, kwargs)
        from .lower.offload import state_to_device

        state_to_device(state)  # offloaded optimizer state back beside the parameters: tracing runs the optimizer
        plan_only = requested()  # `metadist plan --mesh`: the mesh planned for, not this process's world
        mesh_shape = tuple(plan_only.mesh) if plan_only is not None else self.mesh_shape
        from .trace.sideeffects import snapshot

        before = snapshot(fn, args, kwargs, state.modules)
        step = trace_step(
            fn, args, kwargs, state=state, moe_capacity_factor=self.moe_capacity_factor, mesh_shape=mesh_shape
        )
        before.check(getattr(fn, "__qualname__", "step"))  # what the trace cannot carry back: named, undone
        return Traced(step.graph, context=step)

    def resolve_mesh(self, mesh: Any, profile: "MeshProfile") -> Resolved:
        """The process group's mesh and this rank's Engine (a mesh whose size is not the world size:
        ValueError quoting both)."""
        import torch
        from .runtime.engine import engine_for

        eng = engine_for(mesh)
        memory = None
        if eng.device.type == "cuda":
            kind = "cuda-" + torch.cuda.get_device_name(eng.device).replace(" ", "_")
            memory = cuda_memory(eng.device)  # the default memory budget (metadist_core.driver.budget)
        else:
            kind = f"cpu{torch.get_num_threads()}t"
        return Resolved(
            profile.mesh(eng.mesh.shape, eng.mesh.axis_names),
            eng,
            kind,
            lead=eng.rank == 0 or not eng.distributed,
            device_memory=memory,
        )

    def share(self, plan_fn: Callable[[], Any], traced: Traced, resolved: Resolved) -> Any:
        """Rank 0 plans; its plan is broadcast and checked against each rank's own graph; where it fails,
        every rank raises its error."""
        from .runtime.share import share_error, share_plan

        eng = resolved.engine
        if not eng.distributed:
            return plan_fn()
        plan = None
        if eng.rank == 0:
            try:
                plan = plan_fn()
            except BaseException as e:
                share_error(eng, e)  # the other ranks wait for a plan: tell them instead
                raise
        return share_plan(eng, plan, traced.graph)

    def lower(self, traced: Traced, program: Program, resolved: Resolved, settings: "Settings") -> Lowered:
        from .trace.watch import StepWatch

        eng = resolved.engine
        if isinstance(program, Trials):
            return Lowered()  # every rank takes part in a step: one process cannot time a plan alone
        if isinstance(program, Stages):
            if program.plan is None:
                return Lowered()
            if settings.compiles:
                from .lower.compiled import check_settings

                check_settings(settings, stages=True)
            from metadist_core.levers.microbatch import cut_at_gradients
            from .lower.stages import lower_stages

            g = traced.graph
            batch_in = [v for v in g.inputs if g.vars[v].role == "input" and g.vars[v].shape]
            cut = cut_at_gradients(g, g.vars[batch_in[0]].shape[0] if batch_in else None)
            run = lower_stages(traced.context, cut, list(program.plan.stages), program.plan, eng, settings)
        elif isinstance(program, MicroBatches):
            from .lower.pipeline import lower_micro_batches

            run = lower_micro_batches(traced.context, program.cut, program.plans, resolved.mesh, eng, settings)
        else:
            run = _lower_whole(traced, program.plan, resolved, settings)
        if settings.compiles:
            from .lower.compiled import compile_programs

            compile_programs(run, settings, random=bool(traced.context.random_ops))
        return Lowered(run, StepWatch(traced.context, eng))

    def time_ops(self, requests: Any, resolved: Resolved, traced: Traced | None = None, program: bool = False) -> Any:
        """Each op run alone at the requested shapes on this rank's device (the GPU a one-device step's
        state lives on), and the step's program whole (:mod:`metadist_torch.measure.optime`)."""
        from .measure.optime import time_ops

        step = traced.context if traced is not None else None
        dev = (_state_device(step, "cuda") if resolved.mesh.size == 1 else None) or resolved.engine.device
        with _same_random_draws(dev):
            return time_ops(list(requests), dev, step, program)

    def measure_profile(self, resolved: Resolved, cached: Any, traced: Traced | None = None) -> Any:
        """On several ranks: alpha/beta per axis on the live process groups and the device's rates (a few
        seconds), unless every rank has ``cached`` and it covers this mesh (ranks agree first: one
        all_reduce). On one device: the GPU the step's state lives on, its rates and host link timed
        (about 1 s), so that the memory plan keeps offloaded state off the device's memory and the step
        is priced on that GPU; None on a CPU."""
        import torch
        import torch.distributed as dist

        eng = resolved.engine
        if resolved.mesh.size == 1:
            dev = _state_device(traced.context, "cuda") if traced is not None else None
            if dev is None:
                return None
            from metadist_core.cost.profile import MeshProfile
            from .measure.devicerates import measure_device

            with _same_random_draws(dev):
                return MeshProfile(nodes=1, devices_per_node=1, device=measure_device(on=dev))
        if not eng.distributed:
            return cached
        have = cached is not None and cached.covers(resolved.mesh)
        flag = torch.tensor([1 if have else 0], device=eng.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 1:
            return cached
        from .measure.calibrate import measure_live

        with _same_random_draws(eng.device):
            return measure_live(eng, resolved.mesh, cached)

    def demo(self, args: Sequence[str]) -> int:
        """``[--nproc N] [--mesh M] [--solver S] ...``: the GPT example on N local CPU ranks under torchrun."""
        from .demo import run

        rest, nproc = list(args), 4
        if "--nproc" in rest:
            i = rest.index("--nproc")
            if i + 1 >= len(rest):
                raise ValueError("--nproc needs a number of local ranks, such as --nproc 4")
            nproc = int(rest[i + 1])
            del rest[i : i + 2]
        return run(nproc=nproc, args=rest)

    def calibrate(self, out: str, nprocs: int | None = None) -> Any:
        from .measure.calibrate import run_calibrate

        return run_calibrate(out, nprocs=nprocs, refresh=refresh_cached_profile)


def cuda_memory(device: Any) -> int:
    """Bytes of memory of the CUDA ``device`` (all of it: what the plan may use is that less
    ``device_reserve_mb``, whatever this process holds now)."""
    import torch

    return int(torch.cuda.get_device_properties(device).total_memory)


def refresh_cached_profile() -> "MeshProfile":
    """Measure the profile a compile on the whole world as one axis would use, and cache it (what
    ``metadist calibrate`` forces; later compiles on this machine read it)."""
    from metadist_core.config import load_settings
    from metadist_core.cost.profile import MeshProfile, profile_for

    fe = TorchFrontend()
    resolved = fe.resolve_mesh(None, MeshProfile())
    return profile_for(fe, resolved, load_settings(mesh_profile=None), force=True)


def _lower_whole(traced: Traced, plan: "ShardingPlan", resolved: Resolved, settings: "Settings") -> Callable:
    """This rank's program of the whole step under ``plan`` (one device without recomputation: the traced
    step itself)."""
    from .lower.lower import lower_plan
    from .lower.program import LocalProgram, RankProgram, place_state

    step, eng, mesh = traced.context, resolved.engine, resolved.mesh
    if not eng.distributed and not getattr(plan, "recompute", None):
        if settings.offload:  # the optimizer update on the host (metadist_torch.lower.offload)
            from .lower.offload import offload_traced, state_to_host

            off_step, info = offload_traced(step)
            state_to_host(step.state)
            prog = LocalProgram(off_step, reinplace=False)  # the update runs on the host copy
            prog.offload = info
            return prog
        return LocalProgram(step)  # one device: the traced step itself
    if eng.distributed:
        place_state(step, plan, eng)
    else:  # one device recomputing: the rewritten graph, lowered as the only rank of a one-device mesh,
        #     on the device the state lives on (the engine's is the CPU at world size 1)
        eng = dataclasses.replace(eng, device=_state_device(step) or eng.device)
    from .lower.compression import wire_map

    graph = lower_plan(
        traced.graph,
        plan,
        mesh,
        coords=eng.coords,
        groups=eng.groups(),
        coalesce=settings.coalesce,
        bucket_bytes=settings.bucket_bytes,
        shard_bucket_bytes=settings.shard_bucket_bytes,
        first_bucket_bytes=settings.first_bucket_bytes,
        wire=wire_map(traced.graph, settings.grad_compression),
        inplace_state=not settings.offload,
    )  # offload moves the update to the host
    info = None
    if settings.offload:  # the optimizer update on the host, its state stored there (metadist_torch.lower.offload)
        from .lower.offload import offload_rank_graph, state_to_host

        info = offload_rank_graph(graph, traced.graph, eng.device)
        state_to_host(step.state, eng)
    if step.random_ops:
        eng.sync_rng()  # once per engine: every rank draws what rank 0 (and one device) would
    prog = RankProgram(step, graph, plan, eng)
    prog.offload = info
    return prog


def _same_random_draws(dev: Any) -> Any:
    """The random generators as they were after the measurements inside (their inputs are random, and the
    step-sized program may run dropout): the step's first draws must be the ones the single-device step
    makes from the same seed (every rank starts from rank 0's state, which planning had advanced)."""
    import torch

    return torch.random.fork_rng(devices=[dev] if getattr(dev, "type", "cpu") == "cuda" else [])


def _state_device(step: Any, kind: str | None = None) -> Any:
    """The device a traced step's state (parameters, buffers, optimizer state) lives on (the first state
    tensor's, or the first on a device of ``kind``); None without any."""
    import torch

    for slot in getattr(getattr(step, "state", None), "slots", []):
        t = slot.get()
        if isinstance(t, torch.Tensor) and (kind is None or t.device.type == kind):
            return t.device
    return None


@hookimpl
def metadist_frontend() -> TorchFrontend:
    return TorchFrontend()


__all__ = ["TorchFrontend", "metadist_frontend", "refresh_cached_profile", "OP_PREFIXES"]
