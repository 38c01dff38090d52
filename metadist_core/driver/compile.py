"""The one driver: trace -> discover -> solve -> share -> lower, for every frontend.

:func:`compile_step` is the only caller of that sequence for torch, JAX and
TVM; each frontend is a :class:`~metadist_core.driver.frontend.Frontend` adapter that
supplies the framework-specific steps. It alone handles plan-only runs
(``metadist plan SCRIPT``), mesh profiles (link and device costs for every
frontend), the frontend's engine constraints and the timings.
:class:`CompiledStep` is the step decorator bound to an adapter (each
frontend's ``metadist_compile`` is one). Planning a graph already traced
(:func:`plan_graph`, :class:`CompileResult`) lives in :mod:`metadist_core.driver.planner`
and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from metadist_core.config import Settings, load_settings
from metadist_core.discovery.rules import RuleBook
from metadist_core.driver import planonly
from metadist_core.driver.frontend import (
    Frontend,
    Lowered,
    MicroBatches,
    NotSupported,
    Resolved,
    Stages,
    Traced,
    Trials,
    WholeStep,
    not_supported,
)

# planning a traced graph (re-exported: tools, benchmarks and tests import these from here)
from metadist_core.driver.planner import CompileResult, op_costs, plan_graph, replicated_plan
from metadist_core.driver.pipeplan import plan_with_pipeline
from metadist_core.driver.job import Job
from metadist_core.driver.pricing import Pricing, Solver, price, replicated_only
from metadist_core.plugins import PluginManager
from metadist_core.problem.constraints import as_constraint_list
from metadist_core.levers.microbatch import split_batch
from metadist_core.cost.profile import load_profile
from metadist_core.driver.pipeplan import plan_only_pipeline
from metadist_core.driver.pipeplan import check_stages
from metadist_core.driver.autotune import autotune_result
from metadist_core.levers.recompute_segments import rewrite
from metadist_core.levers.microbatch import micro_batch_program

log = logging.getLogger("metadist.pipeline")


@dataclass
class Planned:
    """What the planning step gave this process: the plan, the planning's result where this process
    planned (rules, problem, timings), and the autotune trial of the plan kept (its lowering reused)."""

    plan: Any
    result: CompileResult | None = None
    tuned: Any = None
    seconds: float = 0.0  # spent planning here (inside the frontend's share)


def compile_step(
    frontend: Frontend,
    fn: Callable | None,
    args: tuple,
    kwargs: dict,
    settings: Settings | None = None,
    *,
    mesh: Any = None,
    plugins: PluginManager | None = None,
    constraints: Iterable[Any] | None = None,
    solver_options: dict | None = None,
) -> CompileResult:
    """Trace ``fn(*args, **kwargs)`` with ``frontend``, plan it on ``mesh`` and lower the plan.

    ``mesh`` is the user's mesh argument, resolved by the frontend against its
    engine. In a plan-only run (:mod:`metadist_core.driver.planonly`) this plans for the
    mesh asked for, prints and saves the plan, and raises ``PlanOnlyDone``.
    """
    job = _job(frontend, settings, plugins, constraints, solver_options)
    args, kwargs = one_micro_batch(job, tuple(args), dict(kwargs))
    request = planonly.requested()
    if request is not None:
        plan_only_step(job, request, fn, args, kwargs)
    check_offload(job)
    traced = trace(job, fn, args, kwargs)
    resolved = resolve(job, mesh)
    pricing, resolved = price(job, traced, resolved, mesh)
    check_pipeline(job, traced, resolved)
    planned = plan_and_share(job, traced, resolved, pricing, args, kwargs)
    job, traced = adopt(job, traced, planned)
    lowered = lower(job, traced, resolved, planned)
    res = planned.result
    log.info(
        "compiled %s with %s on mesh %s: %s",
        traced.graph.name,
        frontend.name,
        resolved.mesh,
        ", ".join(f"{k} {v:.2f}s" for k, v in job.timings.items()),
    )
    return CompileResult(
        traced.graph,
        res.rulebook if res else RuleBook(),
        res.problem if res else None,
        planned.plan,
        lowered.run,
        job.timings,
        traced,
        resolved.mesh,
        lowered.watch,
    )


def _job(
    frontend: Frontend,
    settings: Settings | None,
    plugins: PluginManager | None,
    constraints: Iterable[Any] | None,
    solver_options: dict | None,
) -> Job:
    """The compile's job; an unknown solver is an error on every process, before any work."""
    job = Job(
        frontend,
        settings or load_settings(),
        plugins or PluginManager(),
        as_constraint_list(constraints),
        solver_options,
    )  # Pin/Forbid, and {name or glob: placements}
    job.plugins.solver(job.settings.solver)
    return job


def one_micro_batch(job: Job, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's first micro-batch, what is traced and planned (``micro_batches > 1``); else the call."""
    m = job.settings.micro_batches
    if m <= 1:
        return args, kwargs
    traits = job.frontend.traits
    if traits.batch_leaves is None:
        raise not_supported(job.frontend.name, MicroBatches(None, ()))
    return split_batch(args, kwargs, m, traits.batch_leaves, job.frontend.name)[0]


def plan_only_step(job: Job, request: planonly.PlanOnly, fn: Callable | None, args: tuple, kwargs: dict) -> None:
    """Trace the step, plan it on the requested mesh (no engine needed), print and save the plan, and end
    the run with :class:`~metadist_core.driver.planonly.PlanOnlyDone`."""
    s = request.settings(job.settings)
    traced = job.frontend.trace(fn, args, kwargs)
    mesh = load_profile(s.mesh_profile).mesh(tuple(request.mesh))
    graph, pm = traced.graph, job.plugins
    if s.pipeline_stages is not None and s.pipeline_stages > 1:  # priced for every frontend, JAX included
        result = plan_only_pipeline(graph, mesh, s, pm, job.solver_options, job.constraints_on(graph, mesh))
    else:
        result = plan_graph(
            graph,
            mesh,
            plugins=pm,
            settings=s,
            solver_options=job.solver_options,
            constraints=job.constraints_on(graph, mesh),
            traits=job.frontend.traits,
        )
    out = planonly.show_and_save(result, request.out, mesh)
    planonly.report(result, request, out, s, pm)  # the problem beside the plan (`metadist explain`), --compare
    raise planonly.PlanOnlyDone(str(out))


def check_offload(job: Job) -> None:
    """``offload`` runs only on a frontend whose lowering offloads (`metadist plan` prices it for all)."""
    s, fe = job.settings, job.frontend
    if s.offload and not fe.traits.offloads:
        raise NotSupported(
            f"offload={s.offload!r} is not yet for the {fe.name} frontend (torch runs it); "
            f"`metadist plan` prices it, running needs offload=None"
        )


def trace(job: Job, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
    """The step traced by the frontend."""
    t = time.perf_counter()
    traced = job.frontend.trace(fn, args, kwargs)
    job.timings["trace"] = time.perf_counter() - t
    return traced


def resolve(job: Job, mesh: Any) -> Resolved:
    """The mesh this process runs on and the engine's own, priced with the ``mesh_profile`` setting."""
    return job.frontend.resolve_mesh(mesh, load_profile(job.settings.mesh_profile))


def check_pipeline(job: Job, traced: Traced, resolved: Resolved) -> None:
    """``pipeline_stages=k > 1``: a frontend that runs pipelines and a count that matches mesh axis 0,
    checked before any planning."""
    s = job.settings
    k = s.pipeline_stages
    if k is None or k <= 1:
        return
    if not job.frontend.traits.pipelines:  # `metadist plan` prices it, running it cannot
        raise not_supported(job.frontend.name, Stages(None))
    check_stages(k, resolved.mesh, s.schedule, s.micro_batches)


def plan_and_share(
    job: Job, traced: Traced, resolved: Resolved, pricing: Pricing, args: tuple, kwargs: dict
) -> Planned:
    """The plan every process runs: replicated on one device with nothing to plan; else discovered, built
    and solved (pipelined and autotuned where that applies) where the frontend plans, and shared."""
    s = job.settings
    if replicated_only(resolved.mesh, s):
        t = time.perf_counter()
        costs = op_costs(traced.graph, job.plugins, compiled=s.compiles)
        plan, problem = replicated_plan(traced.graph, resolved.mesh, costs)
        job.timings["solve"] = time.perf_counter() - t
        return Planned(plan, CompileResult(traced.graph, RuleBook(), problem, plan))
    planned = Planned(None)

    def plan_here() -> Any:
        t0 = time.perf_counter()
        planned.result, planned.tuned = solve(job, traced, resolved, pricing, args, kwargs)
        planned.seconds = time.perf_counter() - t0
        return planned.result.plan

    if resolved.mesh.size == 1:
        planned.plan = plan_here()
        return planned
    t = time.perf_counter()
    planned.plan = job.frontend.share(plan_here, traced, resolved)
    job.timings["share"] = time.perf_counter() - t - planned.seconds  # the planning is timed apart
    return planned


def solve(
    job: Job, traced: Traced, resolved: Resolved, pricing: Pricing, args: tuple, kwargs: dict
) -> tuple[CompileResult, Any]:
    """Discover, build and solve on the planning process: a pipeline where one is asked for or needed,
    then the presets timed beside the plan (autotune); the result and the kept plan's trial."""
    solve_on = Solver(job, traced.graph, pricing)
    res = plan_with_pipeline(traced.graph, resolved.mesh, job.settings, solve_on, job.frontend)
    if res is None:
        res = solve_on(resolved.mesh)
    job.timings.update(res.timings)

    def trials(plan: Any) -> list:
        return job.frontend.lower(traced, Trials(plan, tuple(args), dict(kwargs)), resolved, job.settings).trials

    return autotune_result(res, resolved.mesh, job.settings, job.constraints, solve_on, trials, job.timings)


def adopt(job: Job, traced: Traced, planned: Planned) -> tuple[Job, Traced]:
    """What every rank takes from the shared plan: the first gradient bucket rank 0 priced (whatever its own
    profile read), and the graph the plan was made for (recomputed ops rewritten in)."""
    plan = planned.plan
    stats = getattr(plan, "stats", None)
    first = stats.first_bucket_mb if stats is not None else None
    if first is not None:
        job = dataclasses.replace(job, settings=dataclasses.replace(job.settings, first_bucket_mb=float(first)))
    if getattr(plan, "recompute", None):
        traced = dataclasses.replace(traced, graph=rewrite(traced.graph, plan.recompute))
    return job, traced


def lower(job: Job, traced: Traced, resolved: Resolved, planned: Planned) -> Lowered:
    """This process's program of the plan: pipeline stages, micro-batches, the trial autotune timed (lowered
    already), or the whole step."""
    s, plan = job.settings, planned.plan
    t = time.perf_counter()
    if getattr(plan, "stages", None):
        lowered = job.frontend.lower(traced, Stages(plan), resolved, s)
    elif s.micro_batches > 1:
        cut, plans = micro_batch_program(traced, plan, s)
        lowered = job.frontend.lower(traced, MicroBatches(cut, plans), resolved, s)
    elif (
        planned.tuned is not None
        and planned.tuned.runnable is not None
        and planned.result is not None
        and plan is planned.result.plan
    ):
        lowered = Lowered(planned.tuned.runnable)  # lowered (and compiled) already when it was timed
    else:
        lowered = job.frontend.lower(traced, WholeStep(plan), resolved, s)
    job.timings["lower"] = time.perf_counter() - t
    return lowered


__all__ = ["CompileResult", "compile_step", "plan_graph", "replicated_plan", "op_costs"]
