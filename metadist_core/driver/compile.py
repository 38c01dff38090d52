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
import functools
import logging
import time
import warnings
from typing import Any, Callable, Hashable, Iterable, Mapping

from metadist_core.config import Settings, load_settings
from metadist_core.problem.constraints import as_constraint_list
from metadist_core.driver.frontend import Frontend
from metadist_core.ir.ir import MetaIR
from metadist_core.cost.localtime import LocalTimer
from metadist_core.ir.placement import Mesh
from metadist_core.plugins import PluginManager
from metadist_core.config import check_strategy
from metadist_core.discovery.rules import RuleBook
# planning a traced graph (re-exported: tools, benchmarks and tests import these from here)
from metadist_core.driver.planner import CompileResult, lowering_traits, op_costs, plan_graph, replicated_plan

log = logging.getLogger("metadist.pipeline")


def _own_link_costs(mesh: Any) -> bool:
    """Is ``mesh`` a metadist Mesh whose link costs differ from the built-in ones (set by its maker)?"""
    from metadist_core.ir.placement import DEFAULT_ALPHA, DEFAULT_BETA
    return isinstance(mesh, Mesh) and (any(a != DEFAULT_ALPHA for a in mesh.alpha)
                                       or any(b != DEFAULT_BETA for b in mesh.beta) or bool(mesh.links))


def compile_step(frontend: Frontend, fn: Callable | None, args: tuple, kwargs: dict,
                 settings: Settings | None = None, *, mesh: Any = None, plugins: PluginManager | None = None,
                 constraints: Iterable[Any] | None = None, solver_options: dict | None = None) -> CompileResult:
    """Trace ``fn(*args, **kwargs)`` with ``frontend``, plan it on ``mesh`` and lower the plan.

    ``mesh`` is the user's mesh argument, resolved by the frontend against its
    engine. In a plan-only run (``metadist plan SCRIPT``) this plans for the
    mesh asked for, prints and saves the plan, and ends the script.
    """
    from metadist_core.driver import planonly
    from metadist_core.cost.profile import load_profile

    s = settings or load_settings()
    pm = plugins or PluginManager()
    pm.solver(s.solver)  # an unknown solver is an error on every process, before any work
    user_constraints = as_constraint_list(constraints)   # Pin/Forbid, and {parameter name or glob: placements}
    timings: dict[str, float] = {}

    if s.micro_batches > 1:   # trace and plan one micro-batch (a batch m does not divide: a clear error)
        args, kwargs = frontend.split_batch(tuple(args), dict(kwargs), s.micro_batches)[0]
    request = planonly.requested()
    if request is not None:
        s = planonly.settings_for(request, s)
        if request.get("strategy"):
            s = dataclasses.replace(s, strategy=check_strategy(request["strategy"]))
        traced = frontend.trace(fn, tuple(args), dict(kwargs))
        plan_mesh = load_profile(request.get("profile") or s.mesh_profile).mesh(tuple(request.get("mesh", [2])))
        if s.pipeline_stages is not None and s.pipeline_stages > 1:   # priced for every frontend, JAX included
            from metadist_core.driver.pipeplan import plan_only_pipeline
            result = plan_only_pipeline(traced.graph, plan_mesh, s, pm, solver_options,
                                        user_constraints + frontend.constraints(traced.graph, plan_mesh))
        else:
            result = plan_graph(traced.graph, plan_mesh, plugins=pm, settings=s, solver_options=solver_options,
                                constraints=user_constraints + frontend.constraints(traced.graph, plan_mesh),
                                **lowering_traits(frontend))
        try:
            planonly.finish(result, plan_mesh, request)
        except planonly.PlanOnlyDone:   # the problem beside the plan (`metadist explain`), --compare's table
            from metadist_core.plan.explain import report_plan_only
            report_plan_only(result, request, s, pm)
            raise

    if s.offload and not frontend.offloads():
        from metadist_core.driver.frontend import NotSupported
        raise NotSupported(f"offload={s.offload!r} is not yet for the {frontend.name} frontend (torch runs it); "
                           f"`metadist plan` prices it, running needs offload=None")
    t = time.perf_counter()
    traced = frontend.trace(fn, tuple(args), dict(kwargs))
    timings["trace"] = time.perf_counter() - t
    graph = traced.graph
    run_mesh = frontend.resolve_mesh(mesh, load_profile(s.mesh_profile))
    profile = None
    # costs measured by default: cached per host, world size and device kind. A metadist Mesh given as
    # ``mesh`` with link costs of its own keeps them (a mesh built from a calibrated profile is priced with
    # that profile's costs, even when the frontend measures none); one with the built-in costs
    # (``Mesh((2, 2))``: a shape and axis names) takes the measured ones
    if run_mesh.size > 1:
        from metadist_core.cost.profile import profile_for
        t = time.perf_counter()
        profile = profile_for(frontend, run_mesh, s)
        if not _own_link_costs(mesh):
            run_mesh = profile.mesh(run_mesh.shape, run_mesh.axis_names)
        timings["profile"] = time.perf_counter() - t
    k_stages = s.pipeline_stages
    if k_stages is not None and k_stages > 1:   # a count that does not match mesh axis 0: a clear error
        from metadist_core.driver.pipeplan import check_stages
        if not frontend.pipelines():   # before any planning: `metadist plan` prices it, running it cannot
            frontend.lower_stages(traced, None, run_mesh, s)
        check_stages(k_stages, run_mesh, s.schedule, s.micro_batches)

    measured_ops: dict[str, dict[str, float]] = {}

    def beside(suffix: str):
        """A file kept beside this machine's cached profile (None: the profile is not one kept by key)."""
        from metadist_core.cost.profile import beside_profile
        return beside_profile(s.cache_dir, profile.key, suffix) if getattr(profile, "key", None) else None

    def slowdowns(g: MetaIR, costs: dict) -> Mapping[str, float]:
        """The ops' measured slowdowns, timed once per compile (every mesh a pipeline search tries)."""
        if "ops" not in measured_ops:
            where = beside("-ops.json")
            measured_ops["ops"] = dict(frontend.op_slowdowns(g, costs, None if where is None else str(where)) or {})
        return measured_ops["ops"]

    def replicated_only(m: Mesh) -> bool:
        """One device and nothing to plan: no budget that may ask to recompute, no optimizer on the host."""
        return m.size == 1 and s.memory_budget is None and not s.offload

    one_device: list = []   # the frontend's measured DeviceSpec of a one-device step (a GPU), asked once
    # with measured costs, the ops the frontend times at each strategy's local shapes (metadist_core.cost.localtime),
    # one timer for every plan of this compile
    local_timer = None
    if getattr(profile, "measured", False) and s.local_time_seconds > 0:
        local_timer = LocalTimer(frontend.times_local, frontend.local_op_times, cache_file=beside("-local.json"),
                                 budget=s.local_time_seconds)

    def solve_on(m: Mesh, settings: Settings | None = None) -> CompileResult:
        """The plan on ``m`` (``settings``: another preset of the same compile; else the compile's)."""
        st = settings or s
        if replicated_only(m):
            p1, pr1 = replicated_plan(graph, m)
            return CompileResult(graph, RuleBook(), pr1, p1)
        if profile is None and m.size == 1 and not one_device:
            one_device.append(frontend.device_spec(traced))
        own = one_device[0] if profile is None and m.size == 1 else None
        return plan_graph(graph, m, plugins=pm, settings=st, solver_options=solver_options,
                          constraints=user_constraints + frontend.constraints(graph, m),
                          device=profile.device if profile is not None else own,
                          **lowering_traits(frontend),
                          # measured costs price the ops as measured too (a one-device step's device the
                          # frontend measured: its ops timed on it); the built-in ones at their roofline
                          op_slowdowns=slowdowns if getattr(profile, "measured", False) or own is not None
                          else None, local_timer=local_timer if m.size > 1 else None)

    book, problem, plan = RuleBook(), None, None
    tuned, tuned_plan = None, None   # the autotune trial of the plan kept, whose lowering is reused
    if replicated_only(run_mesh):
        t = time.perf_counter()
        plan, problem = replicated_plan(graph, run_mesh)
        timings["solve"] = time.perf_counter() - t
    elif frontend.is_planner():
        try:
            res = _plan_with_pipeline(graph, run_mesh, s, solve_on, frontend)   # metadist_core.driver.pipeplan
            if res is None:
                res = solve_on(run_mesh)
            timings.update(res.timings)
            from metadist_core.driver.autotune import autotune_result
            res, tuned = autotune_result(res, frontend, traced, run_mesh, s, user_constraints, solve_on, args,
                                         kwargs, timings)
            book, problem, plan = res.rulebook, res.problem, res.plan
            tuned_plan = plan
        except BaseException as e:
            frontend.share_error(e)   # the other processes wait for a plan: tell them instead
            raise
    t = time.perf_counter()
    if run_mesh.size > 1:
        plan = frontend.share(plan, traced)
        timings["share"] = time.perf_counter() - t
    first = (getattr(plan, "stats", None) or {}).get("first_bucket_mb")
    if first is not None:   # every rank lowers the buckets rank 0 priced (plan_graph), whatever its own profile read
        s = dataclasses.replace(s, first_bucket_mb=float(first))
    if getattr(plan, "recompute", None):   # every rank runs the graph the plan was made for
        from metadist_core.levers.recompute import rewrite
        traced = dataclasses.replace(traced, graph=rewrite(traced.graph, plan.recompute))
        graph = traced.graph
    t = time.perf_counter()
    if getattr(plan, "stages", None):
        runnable = frontend.lower_stages(traced, plan, run_mesh, s)   # a pipeline: stage programs
    elif s.micro_batches > 1:
        from metadist_core.levers.microbatch import lower_micro_batches
        runnable = lower_micro_batches(frontend, traced, plan, run_mesh, s)
    elif tuned is not None and tuned.runnable is not None and plan is tuned_plan:
        runnable = tuned.runnable   # lowered (and compiled) already when it was timed
    else:
        runnable = frontend.lower(traced, plan, run_mesh, s)
    timings["lower"] = time.perf_counter() - t
    log.info("compiled %s with %s on mesh %s: %s", graph.name, frontend.name, run_mesh,
             ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    return CompileResult(graph, book, problem, plan, runnable, timings, traced, run_mesh)


def _plan_with_pipeline(graph: MetaIR, mesh: Mesh, s: Settings, solve_on: Callable[[Mesh], CompileResult],
                        frontend: Frontend) -> CompileResult | None:
    """The result whose plan is pipelined (``plan.stages`` set) when ``pipeline_stages=k`` asks for one
    or, with ``None``, when no unpipelined plan meets the memory budget and a pipeline does (training
    steps on a frontend that runs pipelines); with ``None`` and a fitting plan, that result; else None."""
    from metadist_core.driver.pipeplan import has_gradients, pipeline_plan
    k = s.pipeline_stages
    if k is not None and k > 1:
        return pipeline_plan(graph, mesh, s, solve_on, k)
    if k is not None or s.memory_budget is None or mesh.shape[0] < 2 or not has_gradients(graph) \
            or not frontend.pipelines() or s.offload:   # stage programs do not offload (yet)
        return None
    try:
        flat = solve_on(mesh)
        if flat.plan.memory_per_device > s.memory_budget:
            flat = None
    except Exception as e:   # no unpipelined plan meets the budget: a pipeline may
        log.info("no unpipelined plan: %s", e)
        flat = None
    if flat is not None and not flat.plan.recompute:   # the unpipelined plan meets the budget as it is
        return flat
    if flat is None:
        return pipeline_plan(graph, mesh, s, solve_on, None, flat=None)
    try:   # it meets the budget by recomputing: a pipeline may be cheaper
        piped = pipeline_plan(graph, mesh, s, solve_on, None, flat=None)
    except Exception as e:
        log.info("no pipeline beside the recomputing plan: %s", e)
        return flat
    return piped if piped is not None and piped.plan.objective < flat.plan.objective else flat


class CompiledStep:
    """A step compiled by MetaDist for one frontend: call it like the original step.

    Each new call signature (as the frontend defines it) is traced, planned and
    lowered once through :func:`compile_step`. ``.plan``, ``.graph``,
    ``.timings``, ``.problem`` and ``.mesh`` describe the last compile used.
    """

    def __init__(self, frontend: Frontend, fn: Callable | None, *, mesh: Any = None,
                 constraints: Iterable[Any] | None = None, solver_options: dict | None = None,
                 plugins: PluginManager | None = None, **settings: Any) -> None:
        if fn is not None:
            functools.update_wrapper(self, fn)
        self.fn = fn
        self.frontend = frontend
        self.mesh_arg = mesh
        self.constraints = as_constraint_list(constraints)
        self.solver_options = dict(solver_options or {})
        self.plugins = plugins
        self.settings = load_settings(**settings)
        (plugins or PluginManager()).solver(self.settings.solver)  # an unknown solver fails at decoration
        # per call signature: its compiled programs, the one run last first (at most settings.guard_cache)
        self.cache: dict[Hashable, list[CompileResult]] = {}
        self.last: CompileResult | None = None
        self.replans = 0   # compiles made because a guard failed (not for a new signature)
        self.replan_reasons: list[str] = []

    def compile(self, *args: Any, **kwargs: Any) -> CompileResult:
        """The compiled program for these arguments, without running it: the one of their signature whose
        guards hold (every process deciding alike), else a new trace, plan and lowering."""
        key = self.frontend.signature(args, kwargs)
        entries = self.cache.setdefault(key, [])
        choice, reason = self._choose(entries, args, kwargs)
        if choice >= 0:
            hit = entries.pop(choice)
        else:
            if entries:
                self._replanned(reason or "a guard failed")
            hit = compile_step(self.frontend, self.fn, args, kwargs, self.settings, mesh=self.mesh_arg,
                               plugins=self.plugins, constraints=self.constraints,
                               solver_options=self.solver_options)
            hit.watch = self.frontend.watch(hit, args, kwargs)
        entries.insert(0, hit)
        del entries[self.settings.guard_cache:]
        self.last = hit
        return hit

    def _choose(self, entries: list[CompileResult], args: tuple, kwargs: dict) -> tuple[int, str | None]:
        """The index of the first entry whose guards hold (-1: none) and, where one failed, what changed.
        Every process takes the same decision or raises (``sync_guards``)."""
        choice, reason = -1, None
        for i, res in enumerate(entries):
            why = res.watch.failed(args, kwargs, res is not self.last) if res.watch is not None else None
            if why is None:
                choice = i
                break
            reason = reason or why
        if entries and entries[0].watch is not None and self.settings.sync_guards:
            entries[0].watch.agree((choice, len(entries)))
        return choice, reason

    def _replanned(self, reason: str) -> None:
        name = getattr(self.fn, "__name__", "step")
        self.replans += 1
        self.replan_reasons.append(reason)
        log.info("re-planning %s: %s", name, reason)
        if self.replans == self.settings.max_replans + 1:
            warnings.warn(f"metadist: {name} has re-planned {self.replans} times (max_replans="
                          f"{self.settings.max_replans}): the loop changes what the compiled program depends on "
                          f"between calls, and each change costs a new plan. The guard that failed last: {reason}. "
                          f"Keep it fixed between calls, or raise max_replans to silence this.", stacklevel=3)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compile(*args, **kwargs).runnable(*args, **kwargs)

    @property
    def plan(self) -> Any:
        """The ShardingPlan of the last compile (None before the first call)."""
        return None if self.last is None else self.last.plan

    @property
    def graph(self) -> MetaIR | None:
        return None if self.last is None else self.last.graph

    @property
    def problem(self) -> Any:
        return None if self.last is None else self.last.problem

    @property
    def mesh(self) -> Mesh | None:
        return None if self.last is None else self.last.mesh

    @property
    def runnable(self) -> Callable | None:
        return None if self.last is None else self.last.runnable

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of the last compile: trace, discover, build_problem, solve, share, lower."""
        return {} if self.last is None else dict(self.last.timings)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", "step")
        n = sum(len(v) for v in self.cache.values())
        return f"<CompiledStep {name} ({self.frontend.name}), {n} compiled, {self.replans} re-planned>"


__all__ = ["CompileResult", "CompiledStep", "compile_step", "plan_graph", "replicated_plan", "op_costs"]
