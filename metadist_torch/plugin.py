"""The torch frontend adapter (entry point ``torch`` in group ``metadist.frontends``).

The driver (:func:`metadist_core.driver.compile.compile_step`) calls, on every rank:
``trace`` (every rank traces: tracing is deterministic), ``resolve_mesh`` (the
process group and DeviceMesh of this job), ``is_planner`` (rank 0), ``share``
(rank 0's plan, checked against each rank's own graph) and ``lower`` (this
rank's program). Importing this module imports no torch: every method imports
what it needs on first use.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Sequence

from metadist_core.driver.frontend import Frontend, Traced
from metadist_core.hookspecs import hookimpl

if TYPE_CHECKING:  # pragma: no cover - types only
    from metadist_core.config import Settings
    from metadist_core.ir.placement import Mesh
    from metadist_core.plan.plan import ShardingPlan
    from metadist_core.cost.profile import MeshProfile

    from .engine import Engine

OP_PREFIXES = ("aten.",)


class TorchFrontend(Frontend):
    """PyTorch: a whole training step (forward, backward, optimizer) traced to aten ops; runs on torch.distributed.

    ``lower`` returns a callable taking the step's own ``(*args, **kwargs)`` and
    returning what the step returns (see :mod:`metadist_torch.program`).
    """

    name = "torch"
    op_prefixes = OP_PREFIXES
    description = "PyTorch: aten ops run through torch.ops for ShardCombine"
    runner_module = "metadist_torch.oprunner"
    proxy_shapes = True   # op specs come from the graph's shapes and op.attrs alone
    bucket_copies = 1     # collectives.AxisComm.all_reduce_bucket: the concatenation (reduced in place)
    shard_buckets = True   # lower.coalesce_all_gathers and coalesce_reduces
    whole_inputs = True    # every rank calls the step with the whole batch (RankProgram slices it: lower_plan)

    def __init__(self) -> None:
        self.engine: Engine | None = None   # the engine of the last resolve_mesh

    @contextlib.contextmanager
    def discovering(self) -> Iterator[None]:
        """One intra-op thread while ShardCombine runs thousands of tiny ops (a pool costs more than it
        gives there); the user's setting is restored."""
        import torch
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def can_fork_discovery(self) -> bool:
        """Forked children run CPU aten ops well (as DataLoader workers do), but not once CUDA or a process
        group is up in this process (a rank of torchrun plans alone, its peers waiting)."""
        import torch
        if torch.cuda.is_initialized():
            return False
        return not (torch.distributed.is_available() and torch.distributed.is_initialized())

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        from .state import signature
        return signature(args, kwargs)

    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        from .state import collect_state, init_optimizer_state, optimizers_in
        from .trace import trace_step
        if fn is None:
            raise TypeError("the torch frontend traces a step function; got None")
        init_optimizer_state(optimizers_in(args, kwargs))
        state = collect_state(args, kwargs)
        from .offload import state_to_device
        state_to_device(state)   # offloaded optimizer state back beside the parameters: tracing runs the optimizer
        step = trace_step(fn, args, kwargs, state=state)
        self._traced_step = step   # op_slowdowns times its program whole (optime.program_factor)
        return Traced(step.graph, context=step)

    def watch(self, result: Any, args: tuple, kwargs: dict) -> Any:
        """The guards on everything the trace read from Python state (:mod:`metadist_torch.watch`)."""
        from .watch import StepWatch
        step = result.traced.context if result.traced is not None else None
        if step is None:
            return None
        return StepWatch(step, self.engine if self.engine is not None and result.mesh is not None
                         and self.engine.mesh.shape == result.mesh.shape else None)

    def resolve_mesh(self, mesh: Any, profile: "MeshProfile") -> "Mesh":
        from .engine import engine_for
        self.engine = engine_for(mesh)   # a mesh whose size is not the world size: ValueError quoting both
        return profile.mesh(self.engine.mesh.shape, self.engine.mesh.axis_names)

    def _engine(self) -> "Engine":
        if self.engine is None:
            from .engine import engine_for
            self.engine = engine_for(None)
        return self.engine

    def is_planner(self) -> bool:
        eng = self._engine()
        return eng.rank == 0 or not eng.distributed

    def share(self, plan: "ShardingPlan | None", traced: Traced) -> "ShardingPlan":
        from .share import share_plan
        return share_plan(self._engine(), plan, traced.graph)

    def share_error(self, error: BaseException) -> None:
        from .share import share_error
        share_error(self._engine(), error)

    def lower(self, traced: Traced, plan: "ShardingPlan", mesh: "Mesh", settings: "Settings") -> Callable:
        from .engine import engine_for
        from .lower import lower_plan
        from .program import LocalProgram, RankProgram, place_state
        step = traced.context
        eng = self.engine if self.engine is not None and self.engine.mesh.shape == mesh.shape else engine_for(mesh)
        if not eng.distributed and not getattr(plan, "recompute", None):
            if settings.offload:   # the optimizer update on the host (metadist_torch.offload)
                from .offload import offload_traced, state_to_host
                off_step, info = offload_traced(step)
                state_to_host(step.state)
                prog = LocalProgram(off_step, reinplace=False)   # the update runs on the host copy
                prog.offload = info
                return prog
            return LocalProgram(step)   # one device: the traced step itself
        if eng.distributed:
            place_state(step, plan, eng)
        else:   # one device recomputing: the rewritten graph, lowered as the only rank of a one-device mesh,
            #     on the device the state lives on (the engine's is the CPU at world size 1)
            eng = dataclasses.replace(eng, device=_state_device(step) or eng.device)
        from .compression import wire_map
        graph = lower_plan(traced.graph, plan, mesh, coords=eng.coords, groups=eng.groups(),
                           coalesce=settings.coalesce, bucket_bytes=settings.bucket_bytes,
                           shard_bucket_bytes=settings.shard_bucket_bytes,
                           first_bucket_bytes=settings.first_bucket_bytes,
                           wire=wire_map(traced.graph, settings.grad_compression),
                           inplace_state=not settings.offload)   # offload moves the update to the host
        info = None
        if settings.offload:   # the optimizer update on the host, its state stored there (metadist_torch.offload)
            from .offload import offload_rank_graph, state_to_host
            info = offload_rank_graph(graph, traced.graph, eng.device)
            state_to_host(step.state, eng)
        if step.random_ops:
            eng.sync_rng()   # once per engine: every rank draws what rank 0 (and one device) would
        prog = RankProgram(step, graph, plan, eng)
        prog.offload = info
        return prog

    def split_batch(self, args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
        from .pipeline import split_batch
        return split_batch(args, kwargs, m)

    def lower_micro_batches(self, traced: Traced, cut: Any, plans: tuple, mesh: "Mesh",
                            settings: "Settings") -> Callable:
        from .engine import engine_for
        from .pipeline import lower_micro_batches
        eng = self.engine if self.engine is not None and self.engine.mesh.shape == mesh.shape else engine_for(mesh)
        return lower_micro_batches(traced.context, cut, plans, mesh, eng, settings)

    def offloads(self) -> bool:
        return True

    def pipelines(self) -> bool:
        return True

    def lower_stages(self, traced: Traced, plan: "ShardingPlan", mesh: "Mesh", settings: "Settings") -> Callable:
        from metadist_core.levers.microbatch import cut_at_gradients
        from .engine import engine_for
        from .stages import lower_stages
        eng = self.engine if self.engine is not None and self.engine.mesh.shape == mesh.shape else engine_for(mesh)
        g = traced.graph
        batch_in = [v for v in g.inputs if g.vars[v].role == "input" and g.vars[v].shape]
        cut = cut_at_gradients(g, g.vars[batch_in[0]].shape[0] if batch_in else None)
        return lower_stages(traced.context, cut, list(plan.stages), plan, eng, settings)

    def demo(self, args: Sequence[str]) -> int:
        """``[--nproc N] [--mesh M] [--solver S] ...``: the GPT example on N local CPU ranks under torchrun."""
        from .demo import run
        rest, nproc = list(args), 4
        if "--nproc" in rest:
            i = rest.index("--nproc")
            if i + 1 >= len(rest):
                raise ValueError("--nproc needs a number of local ranks, such as --nproc 4")
            nproc = int(rest[i + 1])
            del rest[i:i + 2]
        return run(nproc=nproc, args=rest)

    def op_slowdowns(self, graph: Any, costs: dict, cache_file: str | None) -> dict[str, float]:
        """Each op run at its real shapes on this rank's device, over its roofline (metadist_torch.optime)."""
        from .optime import alone_rates, measure_slowdowns, program_factor
        # the GPU of the one-device step device_spec measured in this compile, else this rank's device
        dev = self.__dict__.pop("_one_device", None) or self._engine().device
        rates = alone_rates(dev)   # measured once, for both
        with _same_random_draws(dev):
            slow = measure_slowdowns(graph, costs, cache_file, dev, rates=rates)
            factor = program_factor(self.__dict__.pop("_traced_step", None), graph, costs, slow, dev, rates=rates)
        if factor is None:
            return slow
        return {i: slow.get(i, 1.0) * factor for i in costs}

    def device_spec(self, traced: Traced) -> Any:
        """A one-device step on a GPU (its state there): the GPU's rates and host link, timed (about 1 s),
        so that the memory plan keeps offloaded state off the device's memory and the step is priced on
        that GPU (its ops are then timed there too: :meth:`op_slowdowns`)."""
        dev = _state_device(traced.context, "cuda")
        self._one_device = dev
        if dev is None:
            return None
        from .calibrate import measure_device
        with _same_random_draws(dev):
            return measure_device(on=dev)

    def device_kind(self) -> str | None:
        import torch
        eng = self._engine()
        if eng.device.type == "cuda":
            return "cuda-" + torch.cuda.get_device_name(eng.device).replace(" ", "_")
        return f"cpu{torch.get_num_threads()}t"

    def measure_profile(self, mesh: "Mesh", cached: Any) -> Any:
        """Alpha/beta per axis on the live process groups and the device's rates (a few seconds), unless
        every rank has ``cached`` and it covers this mesh (ranks agree first: one all_reduce)."""
        import torch
        import torch.distributed as dist
        eng = self._engine()
        if not eng.distributed:
            return cached
        have = cached is not None and "x".join(map(str, mesh.shape)) in cached.axis_costs
        flag = torch.tensor([1 if have else 0], device=eng.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 1:
            return cached
        from .calibrate import measure_live
        with _same_random_draws(eng.device):
            return measure_live(eng, mesh, cached)

    def calibrate(self, out: str, nprocs: int | None = None) -> Any:
        from .calibrate import run_calibrate
        return run_calibrate(out, nprocs=nprocs, refresh=refresh_cached_profile)


def refresh_cached_profile() -> "MeshProfile":
    """Measure the profile a compile on the whole world as one axis would use, and cache it (what
    ``metadist calibrate`` forces; later compiles on this machine read it)."""
    from metadist_core.config import load_settings
    from metadist_core.cost.profile import MeshProfile, profile_for
    fe = TorchFrontend()
    mesh = fe.resolve_mesh(None, MeshProfile())
    return profile_for(fe, mesh, load_settings(mesh_profile=None), force=True)


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
