"""Planning a traced graph: discover its rules, build the ShardingProblem on a mesh and solve it.

:func:`plan_graph` is the discover -> solve half of the flow, with the memory
budget's recomputation and the collectives' buffers; the driver
(:mod:`metadist_core.driver.compile`) calls it for every frontend, and tools,
benchmarks and tests call it on a graph already traced. :class:`CompileResult`
is what one compile produced.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from metadist_core.config import Settings, load_settings, resolve_first_bucket
from metadist_core.problem.constraints import split_constraints
from metadist_core.discovery.discover import discover
from metadist_core.driver.budget import plan_budget, unfit_advice
from metadist_core.driver.frontend import FrontendTraits, Traced
from metadist_core.cost.fusion import fused_bytes
from metadist_core.ir.ir import RECOMPUTED_SUFFIX, MetaIR
from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager
from metadist_core.problem.presets import gathers_parameters, steer
from metadist_core.progress import Ticker
from metadist_core.problem.problem import BUDGET_GATHER_SHARE, GATHER_SHARE, InfeasibleBudgetError
from metadist_core.discovery.rules import RuleBook
from metadist_core.problem.build import estimate_op_cost
from metadist_core.cost.profile import load_profile
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.build import build_problem
from metadist_core.levers.offload import apply_offload
from metadist_core.levers.offload import offload_stats
from metadist_core.levers import recompute
from metadist_core.plan import memprofile

log = logging.getLogger("metadist.planner")


@dataclass
class CompileResult:
    """Everything one compile produced: the graph, its rules, problem and plan, and the runnable step."""

    graph: MetaIR
    rulebook: RuleBook
    problem: Any = None
    plan: Any = None
    runnable: Callable | None = None
    timings: dict[str, float] = field(default_factory=dict)
    traced: Traced | None = None
    mesh: Mesh | None = None
    watch: Any = None  # the frontend's guards on what the trace read (Frontend.watch); None: the signature only


def op_costs(graph: MetaIR, plugins: PluginManager, compiled: bool = False) -> dict[str, tuple[float, float]]:
    """``(flops, bytes)`` per op id, from the frontend that owns each op (missing: the core estimates); the
    optimizer update's ops at the bytes of their fused loop where the frontend's compiler fuses them
    (:mod:`metadist_core.cost.fusion`); ``compiled``: the rank program runs compiled (a ``backend`` other
    than eager), so the ops the frontend's compiler fuses then are fused too."""
    out = {}
    for op in graph.ops:
        c = plugins.op_cost(op, graph)
        if c is not None:
            out[op.id] = tuple(c)
    for i, nbytes in fused_bytes(graph, lambda op: plugins.fuses(op, compiled)).items():
        flops, _, *rest = out.get(i) or estimate_op_cost(graph.op(i), graph)
        out[i] = (flops, nbytes, *rest)
    return out


#: seconds the ILP may take to choose recomputed segments beside the shardings (at most ``time_limit``).
#: Past it the fewest segments that fit are searched for by count, so that a proposal the ILP does not find
#: soon does not take most of the planning time.
PROPOSAL_SECONDS = 10.0


def plan_graph(
    graph: MetaIR,
    mesh: Mesh,
    *,
    plugins: PluginManager | None = None,
    settings: Settings | None = None,
    constraints: Iterable[Any] | None = None,
    solver_options: dict | None = None,
    device: Any = None,
    traits: FrontendTraits | None = None,
    op_slowdowns: Callable[[MetaIR, dict], Mapping[str, float]] | None = None,
    local_timer: Any = None,
    device_memory: int | None = None,
    **setting_values: Any,
) -> CompileResult:
    """Discover rules for ``graph``, build the ShardingProblem on ``mesh`` and solve it.

    ``settings`` (else ``load_settings(**setting_values)``: solver, memory_budget,
    cache_dir, progress...) says how. ``device`` is the cost model's DeviceSpec;
    by default the one of the mesh profile (``mesh_profile`` setting), else the
    CPU preset. ``traits`` (:class:`~metadist_core.driver.frontend.FrontendTraits`, default: none of them):
    what the frontend's lowering makes of buckets, of a value moved again after the forward and of the
    user's inputs, priced by the memory model and the prediction. ``op_slowdowns(graph, costs)``: each op's
    measured time over its roofline (:mod:`metadist_core.cost.optimes`), priced into its compute.
    ``local_timer`` (:class:`~metadist_core.cost.localtime.LocalTimer`): the ops the frontend times at
    each strategy's local shapes, priced so. ``device_memory``: bytes of the device the plan runs on (CUDA),
    the default budget where ``memory_budget`` is not set (:mod:`metadist_core.driver.budget`: else the
    device preset's memory, none on a CPU); a default budget binds only where the plan without it does not
    fit, and a plan that cannot fit is an error saying where the budget came from and what to change.
    """
    s = settings or load_settings(**setting_values)
    pm = plugins or PluginManager()
    pm.solver(s.solver)  # fail fast on an unknown solver name, before any discovery
    timings: dict[str, float] = {}
    t = time.perf_counter()
    book = discover(
        graph,
        pm,
        RuleBook.load(s.cache_dir),
        axis_sizes=mesh.shape,
        progress=s.progress,
        draws=s.verify_draws,
        max_real=s.max_real_discovery,
        workers=s.discovery_workers,
    )
    timings["discover"] = time.perf_counter() - t
    if device is None and s.mesh_profile:
        device = load_profile(s.mesh_profile).device
    budget = plan_budget(s, device, device_memory)

    def plan_under(st: Settings) -> CompileResult:
        planner = _planner(
            graph,
            mesh,
            book,
            pm,
            st,
            constraints,
            solver_options,
            device,
            traits or FrontendTraits(),
            local_timer,
            timings,
        )
        planner.costs = costs
        return _solved(planner, graph, mesh, book, timings, local_timer)

    timings["build_problem"] = timings["solve"] = 0.0  # both plans' (a default budget may need two)
    costs = _priced_costs(graph, pm, op_slowdowns, timings, compiled=s.compiles)
    try:
        if budget.bytes is None or budget.explicit:
            res = plan_under(dataclasses.replace(s, memory_budget=budget.bytes))
        else:  # the device's memory: the plan without a budget where it fits, else one solved under it
            res = plan_under(s)
            peak = res.plan.stats.peak_with_buffers
            if peak is not None and peak > memprofile.headroom_target(budget.bytes):
                log.info(
                    "the plan without a budget needs %s bytes per device; planning under %s (%s)",
                    f"{peak:,}",
                    f"{budget.bytes:,}",
                    budget.source,
                )
                res = plan_under(dataclasses.replace(s, memory_budget=budget.bytes))
    except InfeasibleBudgetError as e:
        e.args = (f"{e.args[0] if e.args else e}{unfit_advice(budget)}", *e.args[1:])
        raise
    res.plan.stats.budget = budget.to_json()
    log.info("planned %s on mesh %s with %s: %s", res.graph.name, mesh, s.solver, res.plan.summary())
    return res


def _solved(
    planner: "GraphPlanner", graph: MetaIR, mesh: Mesh, book: RuleBook, timings: dict, local_timer: Any
) -> CompileResult:
    """The planner's plan under its budget (recomputing where it must), its stats recorded; a budget no plan
    meets is an InfeasibleBudgetError counting the collectives' buffers where the solve can."""
    try:
        graph, (problem, plan), segs = planner.under_budget()
    except InfeasibleBudgetError as e:
        if getattr(e, "need_with_buffers", None) is None:
            raise
        raise InfeasibleBudgetError(
            e.budget,
            recompute.needed(e),
            mesh,
            f"needs, with its collectives' buffers and {memprofile.HEADROOM:.0%} headroom,",
        ) from e
    _record_stats(plan, problem, segs, planner.settings, local_timer)
    return CompileResult(graph, book, problem, plan, None, timings)


def _planner(
    graph: MetaIR,
    mesh: Mesh,
    book: RuleBook,
    pm: PluginManager,
    s: Settings,
    constraints: Any,
    solver_options: dict | None,
    device: Any,
    traits: FrontendTraits,
    local_timer: Any,
    timings: dict[str, float],
) -> "GraphPlanner":
    """The planner of ``graph`` on ``mesh``: the device priced, the first bucket resolved, the constraints
    split and the solver's options gathered."""
    if device is None and s.mesh_profile:
        device = load_profile(s.mesh_profile).device
    # DDP's small first gradient bucket only where the device hides a collective behind compute; the plan
    # records the size it was priced with, and every rank lowers that (compile_step)
    s = resolve_first_bucket(s, getattr(device, "overlap", None))
    plain, named = split_constraints(constraints)
    # proven ILP answers are kept beside the rules (solvers/_cache.py): a re-run of the same problem is not re-solved
    cache = getattr(book, "cache_dir", None)
    options = {"cache_dir": None if cache is None else str(cache), **s.solver_options(), **(solver_options or {})}
    timings.setdefault("build_problem", 0.0)
    timings.setdefault("solve", 0.0)
    # under a budget, and for a preset whose every plan gathers the parameters (presets.gathers_parameters),
    # input gathers priced by their bucket share (FSDP-like plans); else, or once under_budget gives up on
    # those, each gather nearly whole
    share = BUDGET_GATHER_SHARE if s.memory_budget is not None or gathers_parameters(s.strategy) else GATHER_SHARE
    return GraphPlanner(
        graph, mesh, book, pm, s, options, plain, named, device, traits, local_timer, timings, gather_share=share
    )


def _priced_costs(
    graph: MetaIR, pm: PluginManager, op_slowdowns: Callable | None, timings: dict[str, float], compiled: bool = False
) -> dict[str, tuple]:
    """``(flops, bytes[, slowdown])`` per op id: the frontend's figures, each op's measured slowdown on
    top where ``op_slowdowns`` is given (timed once: a recomputed copy costs what its original does)."""
    t = time.perf_counter()
    costs: dict[str, tuple] = dict(op_costs(graph, pm, compiled))
    timings["build_problem"] += time.perf_counter() - t  # the ops' costs are part of the problem
    if op_slowdowns is not None:  # each op timed on this device (cached per machine)
        t = time.perf_counter()
        slow = op_slowdowns(graph, costs)
        if compiled:  # an op timed alone is the unfused op: the compiled loop it joins is priced by its bytes
            fused = fused_bytes(graph, lambda op: pm.fuses(op, True)).keys() - fused_bytes(graph, pm.fuses).keys()
            slow = {k: v for k, v in slow.items() if k not in fused}
        costs = {k: (*c[:2], slow[k]) if k in slow else c for k, c in costs.items()}
        timings["op_times"] = time.perf_counter() - t
    return costs


def _record_stats(plan: Any, problem: Any, segs: list, s: Settings, local_timer: Any) -> None:
    """What the plan records beside its choices: recomputation, strategy, local times, the first bucket
    every rank lowers, the peak with the collectives' buffers."""
    if segs:
        plan.recompute = [i for seg in segs for i in seg.recompute]
        stats = plan.stats
        stats.recompute = {
            "segments": len(segs),
            "ops": len(plan.recompute),
            "chosen_by": stats.recompute_chosen_by or "?",
            "saved_bytes": sum(seg.saved_bytes for seg in segs),
        }
        stats.recompute_chosen_by = None
    if plan.stats.strategy is None:
        plan.stats.strategy = s.strategy
    if local_timer is not None and local_timer.slowdowns:
        plan.stats.local_times = local_timer.stats()
    if s.coalesce:
        plan.stats.first_bucket_mb = s.first_bucket_mb
    plan.stats.peak_with_buffers = memprofile.peak_with_buffers(problem, plan)


@dataclass
class GraphPlanner:
    """One graph's planning on one mesh: builds its problem (the plain graph's once), solves it, and under a
    memory budget proposes and chooses recomputed segments (:mod:`metadist_core.levers.recompute`)."""

    graph: MetaIR
    mesh: Mesh
    book: RuleBook
    pm: PluginManager
    settings: Settings
    options: dict
    plain: list
    named: dict[str, Any]
    device: Any
    traits: FrontendTraits
    local_timer: Any
    timings: dict[str, float]
    gather_share: float = GATHER_SHARE
    costs: dict[str, tuple] = field(default_factory=dict)
    plain_built: tuple | None = None  # the plain graph's (problem, offload region, costs)

    def costs_of(self, g: MetaIR) -> dict[str, tuple]:
        """The ops' costs of ``g``: a recomputed copy costs what its original does."""
        if g is self.graph:
            return self.costs
        return {
            op.id: self.costs[op.id.removesuffix(RECOMPUTED_SUFFIX)]
            for op in g.ops
            if op.id.removesuffix(RECOMPUTED_SUFFIX) in self.costs
        }

    def build(self, g: MetaIR) -> tuple[Any, Any, dict]:
        """The problem of ``g`` steered by the user, its offload region and its ops' costs."""
        if g is self.graph and self.plain_built is not None:  # a shallow copy: a proposal sets toggles on it
            problem, region, g_costs = self.plain_built
            return copy.copy(problem), region, g_costs
        s, t = self.settings, self.traits
        g_costs = self.costs_of(g)
        impls, frontend = t.dist_impls() if t.dist_impls is not None else (None, "")
        problem = build_problem(
            g,
            self.book,
            self.mesh,
            op_costs=g_costs,
            constraints=self.plain,
            memory_budget=s.memory_budget,
            device=self.device,
            grad_compression=s.grad_compression,
            bucket_bytes=s.bucket_bytes if s.coalesce else None,
            bucket_copies=t.bucket_copies,
            shard_bucket_bytes=s.shard_bucket_bytes if s.coalesce and t.shard_buckets else None,
            first_bucket_bytes=s.first_bucket_bytes if s.coalesce else None,
            phased=t.phased_reshards,
            whole_inputs=t.whole_inputs,
            gather_share=self.gather_share,
            local_timer=self.local_timer,
            dist_impls=impls,
            frontend=frontend,
        )
        region = None
        if s.offload:  # optimizer state and update on the host, priced (metadist_core.levers.offload)
            region = apply_offload(problem, g, g_costs)
        # the user's steering: annotations, constraints by name, the strategy preset (metadist_core.problem.presets)
        problem = steer(problem, s.strategy, self.named, getattr(g, "annotations", None))
        if g is self.graph:
            self.plain_built = (problem, region, g_costs)
        return problem, region, g_costs

    def _solve(self, problem: Any) -> Any:
        return self.pm.solve(self.settings.solver, problem, self.options)

    def solve(self, g: MetaIR) -> tuple[Any, Any]:
        """The problem of ``g`` and the solver's plan of it, fitted to the budget with the buffers."""
        s = self.settings
        t0 = time.perf_counter()
        problem, region, _ = self.build(g)
        t1 = time.perf_counter()
        self.timings["build_problem"] += t1 - t0
        with Ticker(f"solve ({s.solver}, {len(problem.nodes)} decisions)", enabled=s.progress):
            try:  # finally: a graph with no plan under the budget took solver time too
                try:  # under the budget less its headroom, which the plan must leave free with its buffers
                    plan = self._solve(_less_headroom(problem))
                except InfeasibleBudgetError as e:  # the solver's figure lacks the buffers: priced when asked
                    if e.budget != problem.memory_budget:  # the error names the budget as set
                        e = InfeasibleBudgetError(problem.memory_budget, e.needed, problem.mesh)
                    e.need_with_buffers = functools.partial(
                        memprofile.leanest_with_buffers, problem, e.needed, self._solve
                    )
                    raise e
                if s.memory_budget is not None:  # the budget holds with the collectives' buffers (memprofile)
                    plan = memprofile.fit_with_buffers(problem, plan, self._solve)
            finally:
                self.timings["solve"] += time.perf_counter() - t1
        if region is not None:
            plan.stats.offload = offload_stats(region, problem, plan)
        return problem, plan

    def propose(self, segs: list, cut: int) -> list | None:
        """The segments the solver recomputes when it prices them beside the shardings (the ILP), or None."""
        s = self.settings
        if s.solver != "ilp":
            return None
        if s.memory_budget is None:
            raise ValueError(
                "recomputed segments are proposed only under a memory budget, and memory_budget is "
                "None; set memory_budget (bytes per device) to recompute"
            )
        t0 = time.perf_counter()
        problem, _, _ = self.build(self.graph)
        recompute.price_segments(problem, self.graph, segs)
        limit = min(float(self.options.get("time_limit") or PROPOSAL_SECONDS), PROPOSAL_SECONDS)
        with Ticker(
            f"solve ({s.solver}, {len(problem.nodes)} decisions, {len(segs)} recompute segments)", enabled=s.progress
        ):
            try:  # under the headroom, less what an earlier proposal overshot with its buffers
                plan = self.pm.solve(
                    s.solver,
                    problem.with_budget(memprofile.headroom_target(s.memory_budget) - cut),
                    {**self.options, "least_peak": False, "time_limit": limit},
                )
            except (InfeasibleBudgetError, RuntimeError) as e:
                log.info("no plan with recomputation priced in the ILP (%s); searching segment counts", e)
                return None
            finally:
                self.timings["solve"] += time.perf_counter() - t0
        on = plan.stats.toggles_on
        return None if on is None else [segs[j] for j in on]

    def under_budget(self) -> tuple[MetaIR, tuple[Any, Any], list]:
        """The graph planned (recomputing forward segments where no plan meets the memory budget), its
        problem and plan, and the recomputed segments."""
        s = self.settings
        flops = {i: c[0] for i, c in self.costs.items()} if s.memory_budget is not None else None
        try:
            return recompute.choose(
                self.graph, s.memory_budget, self.solve, flops, enabled=s.recompute, propose=self.propose
            )
        except InfeasibleBudgetError:
            if s.memory_budget is None or not (s.coalesce and self.traits.shard_buckets and s.shard_bucket_bytes):
                raise
        # the plans that gather parameters in buckets hold each bucket's whole parameters beside the rest,
        # outside the solver's memory terms (memprofile.fit_with_buffers); where none of them fits, the
        # plans that gather few inputs may
        log.info("no plan with its input gathers priced in buckets meets the budget; pricing each gather whole")
        self.gather_share = GATHER_SHARE
        self.plain_built = None
        return recompute.choose(
            self.graph, s.memory_budget, self.solve, flops, enabled=s.recompute, propose=self.propose
        )


def _less_headroom(problem: Any) -> Any:
    """``problem`` under its memory budget less :data:`memprofile.HEADROOM` (the same where it has none): a plan
    solved under the whole budget fills it and leaves no room for the headroom, and would be solved again."""
    if problem.memory_budget is None:
        return problem
    return problem.with_budget(memprofile.headroom_target(problem.memory_budget))


def replicated_plan(graph: MetaIR, mesh: Mesh, costs: Mapping[str, tuple] | None = None) -> tuple[Any, Any]:
    """The all-replicated plan and its problem (a mesh of one device: nothing to discover or solve), its ops
    priced by ``costs`` (:func:`op_costs`; None: the core's estimates)."""
    problem = build_problem(graph, RuleBook(), mesh, op_costs=costs)
    return ShardingPlan.replicated(problem), problem
