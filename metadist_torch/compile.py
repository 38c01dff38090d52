"""``metadist_compile``: the core's step decorator bound to the torch frontend.

    @metadist_compile()
    def train_step(model, optimizer, inputs, labels):
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss

On each call the step's signature (tensor shapes, dtypes and devices, the
other arguments by value, modules and optimizers by identity) picks a compiled
entry; a new signature is traced, planned and lowered once by the one driver
(:func:`metadist_core.driver.compile.compile_step`) through :class:`TorchFrontend`:
every rank traces, rank 0 discovers and solves, the plan is shared, every
rank lowers.

State lives sharded: parameters become DTensor ``nn.Parameter``s over the
torch DeviceMesh with the plan's storage placements, optimizer state entries
and buffers become DTensors, so that ``torch.distributed.checkpoint`` can save
them; each call feeds their local shards to the per-rank program and writes
the new shards back in place. Inputs are split on entry (every rank passes the
whole batch), returned values are whole on every rank. At world size 1 the
traced functional graph runs directly on plain tensors.

Random ops run replicated; at the first compile with random ops every rank
takes rank 0's random state, so all ranks (and a single-device run seeded the
same way) draw the same numbers.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from metadist_core.config import check_setting_names
from metadist_core.driver.step import CompiledStep
from metadist_core.plugins import PluginManager

from .lower.compiled import check_settings
from .runtime.eager import compiled_call
from .runtime.faults import RankFailure, count_step, is_collective_failure, rank_failure
from .plugin import TorchFrontend
from .runtime.stats import CommStats


class TorchStep(CompiledStep):
    """A training step compiled by MetaDist for torch: call it like the original step.

    ``.plan``, ``.graph``, ``.timings`` (trace, discover, build_problem, solve,
    share, lower seconds) describe its last compile; ``.comm_stats`` counts
    what the collectives of its last lowered program moved.
    """

    @property
    def comm_stats(self) -> CommStats:
        stats = getattr(self.runnable, "stats", None)
        return stats if isinstance(stats, CommStats) else CommStats()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        count_step()
        try:
            with compiled_call():
                return self._call(args, kwargs)
        except Exception as e:
            raised = _explained(e, self)
            if raised is e:
                raise
            raise raised from e

    def _call(self, args: tuple, kwargs: dict) -> Any:
        res = self.compile(*args, **kwargs)
        if "compile" not in res.timings and getattr(res.runnable, "compiled_programs", None):
            return self._compile_call(res, args, kwargs)
        measured = self.__dict__.setdefault("_memory", {})
        if not self.settings.measure_memory or id(res) in measured:
            return res.runnable(*args, **kwargs)
        from .measure.memory import measure_compiled  # the first call after a compile: peak memory measured

        t = time.perf_counter()
        out, measured[id(res)] = measure_compiled(res, args, kwargs)
        res.timings["measure_memory"] = time.perf_counter() - t
        return out

    def _compile_call(self, res: Any, args: tuple, kwargs: dict) -> Any:
        """The first call of a program run by a torch.compile backend: it compiles (``timings["compile"]``,
        ``plan.stats.compile``). Memory is measured at the next call, and only on a GPU (compiled kernels
        run past the dispatcher that counts tensors on a CPU)."""
        from .lower.compiled import compile_report

        out = res.runnable(*args, **kwargs)
        report = compile_report(res.runnable)
        if report is not None:
            res.timings["compile"] = report["seconds"]
            if res.plan is not None and getattr(res.plan, "stats", None) is not None:
                res.plan.stats.compile = report
            if not _on_gpu(res):
                self.__dict__.setdefault("_memory", {})[id(res)] = {
                    "method": "not measured",
                    "reason": "a compiled program on a CPU: its kernels run past the dispatcher that counts tensors",
                }
        return out

    @property
    def memory(self) -> dict[str, Any]:
        """Peak tensor bytes on this rank in the first call after the last compile, beside the plan's
        prediction: ``predicted_peak_bytes`` (with collective buffers), ``predicted_solver_bytes``
        (``plan.memory_per_device``, what the budget bounds), ``measured_peak_bytes``,
        ``method`` ("cuda_allocator" | "live_storages"), ``baseline_bytes`` (held before the call),
        ``end_bytes`` and ``ratio`` (measured / predicted); {} before it (or with ``measure_memory`` off).
        See :mod:`metadist_torch.measure.memory`."""
        if self.last is None:
            return {}
        return dict(self.__dict__.get("_memory", {}).get(id(self.last), {}))


def _explained(e: BaseException, step: "TorchStep") -> BaseException:
    """``e`` as the error a user can act on: a failed collective names the rank that stopped
    (:mod:`metadist_torch.runtime.faults`), a device out of memory names the plan's predicted bytes and the
    budget; any other error as it is."""
    import torch

    from .runtime.engine import collective_timeout, world_info

    if isinstance(e, torch.OutOfMemoryError):
        return _out_of_memory(e, step)
    rank, world = world_info()
    if world > 1 and not isinstance(e, RankFailure) and is_collective_failure(e):
        return rank_failure(e, rank, world, collective_timeout())
    return e


def _out_of_memory(e: BaseException, step: "TorchStep") -> BaseException:
    plan = step.plan
    predicted = getattr(plan, "memory_per_device", None)
    budget = step.settings.memory_budget
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    said = f"the plan predicted {predicted / 2**30:.2f} GiB per device" if predicted else "no plan was made yet"
    limit = (
        f"memory_budget is {budget / 2**30:.2f} GiB"
        if budget
        else "memory_budget is not set, so the planner did not bound the plan's memory"
    )
    import torch

    return torch.OutOfMemoryError(
        f"metadist: the device ran out of memory in step {getattr(step.fn, '__name__', 'step')}: {said}, and "
        f"{limit}. Set memory_budget (bytes per device; METADIST_MEMORY_BUDGET) below what the device has free "
        f"so that the planner shards, offloads or recomputes to fit, or use a smaller batch. The device's "
        f"error: {first}"
    )


def _on_gpu(res: Any) -> bool:
    engine = getattr(res.runnable, "engine", None)
    device = getattr(engine, "device", None)
    return getattr(device, "type", "cpu") == "cuda" or any(
        getattr(getattr(s.get(), "device", None), "type", "") == "cuda"
        for s in getattr(getattr(res.traced.context, "state", None), "slots", [])[:1]
    )


def metadist_compile(
    mesh: Any = None,
    solver: str | None = None,
    memory_budget: int | None = None,
    cache_dir: str | None = None,
    *,
    constraints: Iterable[Any] | None = None,
    plugins: PluginManager | None = None,
    micro_batches: int | None = None,
    pipeline_stages: int | None = None,
    schedule: str | None = None,
    grad_compression: str | None = None,
    offload: str | None = None,
    recompute: bool | None = None,
    strategy: str | None = None,
    backend: str | None = None,
    compile_options: dict[str, Any] | None = None,
    **settings: Any,
) -> Callable[[Callable], TorchStep]:
    """Decorate a training step so that it runs split over the devices of ``mesh``.

    :param mesh: None (the whole world as one axis), a shape such as ``(2, 2)``,
        or a torch ``DeviceMesh``; its size must be the world size.
    :param solver: solver name (default from ``METADIST_SOLVER`` / pyproject / "ilp").
    :param memory_budget: bytes per device the plan must fit in.
    :param cache_dir: where the rule cache lives.
    :param constraints: ``{parameter name or glob: Placement or tuple of Placements, one per axis}``
        (``{"head.weight": Replicate(), "*.fc.weight": Shard(0)}``) and/or ``Pin``/``Forbid`` constraints.
    :param strategy: "auto" (default) or a preset: "ddp", "zero1", "zero2", "zero3" (= "fsdp"), "tp",
        "tp+dp", "ep" (mixture-of-experts weights split by expert over mesh axis 0, the rest as ddp) --
        constraints on the same plan search (:mod:`metadist_core.problem.presets`).
    :param plugins: the PluginManager to find solvers in (default: the installed plugins).
    :param micro_batches: cut the batch (dim 0 of every tensor input) into this many equal parts; gradients
        accumulate over them within one call (a mean-reduced loss gives the whole batch's numbers).
    :param pipeline_stages: 1: no pipeline; k > 1: k stages along mesh axis 0 (its size must be k), each
        split by its own plan on the other axes, run on torch.distributed.pipelining; None: the planner may
        pipeline when a ``memory_budget`` is set (:mod:`metadist_core.driver.pipeplan`).
    :param schedule: "1f1b" | "gpipe" | "interleaved" (2 stages per device): the pipelining schedule.
    :param recompute: True (default): under a ``memory_budget`` no plan meets as it is, forward segments
        (a transformer block's halves) are recomputed for the backward, the fewest that make a plan fit
        (``plan.recompute`` lists the ops; :mod:`metadist_core.levers.recompute`); False: never.
    :param grad_compression: None, "bf16" or "fp16": gradient collectives travel in that dtype and are
        decompressed before the optimizer (approximate; see :mod:`metadist_torch.lower.compression`).
    :param offload: None or "optimizer": optimizer state lives in host memory (pinned on CUDA) and the
        optimizer update runs on the host CPU; gradients go to the host and new parameters come back every
        step (:mod:`metadist_torch.lower.offload`, priced by :mod:`metadist_core.levers.offload`).
    :param backend: "eager" (default): each rank runs its program op by op; "inductor": compiled by
        torch.compile into fused kernels, its collectives included (:mod:`metadist_torch.lower.compiled`); or any
        other torch.compile backend name.
    :param compile_options: keywords for torch.compile with a compiled backend (``{"mode": "reduce-overhead"}``
        for CUDA graphs, ``{"options": {...}}`` for Inductor's config).
    :param settings: any other setting of :class:`metadist_core.config.Settings` by name (``max_replans``,
        ``guard_cache``, ``sync_guards``, ``time_limit``, ...).
    """
    if callable(mesh) and not isinstance(mesh, (tuple, list)) and not hasattr(mesh, "shape"):
        raise TypeError("metadist_compile takes arguments: write @metadist_compile() with parentheses")

    check_setting_names(settings)

    def wrap(fn: Callable) -> TorchStep:
        step = TorchStep(
            TorchFrontend(),
            fn,
            mesh=mesh,
            constraints=constraints,
            plugins=plugins,
            solver=solver,
            memory_budget=memory_budget,
            cache_dir=cache_dir,
            micro_batches=micro_batches,
            pipeline_stages=pipeline_stages,
            schedule=schedule,
            grad_compression=grad_compression,
            strategy=strategy,
            offload=offload,
            recompute=recompute,
            backend=backend,
            compile_options=compile_options,
            **settings,
        )
        check_settings(step.settings)  # an unknown backend, or an option it cannot compile: before any trace
        step.frontend.moe_capacity_factor = step.settings.moe_capacity_factor
        step.frontend.mesh_shape = _mesh_shape(mesh)
        return step

    return wrap


def _mesh_shape(mesh: Any) -> tuple[int, ...] | None:
    """The shape of the user's ``mesh`` argument (a shape or a DeviceMesh); None for the whole world."""
    if mesh is None:
        return None
    shape = mesh.shape if hasattr(mesh, "shape") else mesh
    try:
        return tuple(int(n) for n in shape)
    except TypeError:
        return None


__all__ = ["metadist_compile", "TorchStep"]
