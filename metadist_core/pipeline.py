"""The one driver: trace -> discover -> solve -> lower, through the plugin hooks.

Frontends hand their step here (:func:`compile_step`); tools and tests that
already hold a MetaIR call :func:`plan_graph`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .config import Settings, load_settings
from .discover import discover
from .ir import MetaIR
from .placement import Mesh
from .plugins import PluginManager
from .progress import Ticker
from .rules import RuleBook

log = logging.getLogger("metadist.pipeline")


@dataclass
class CompileResult:
    graph: MetaIR
    rulebook: RuleBook
    problem: Any = None
    plan: Any = None
    runnable: Callable | None = None
    timings: dict[str, float] = field(default_factory=dict)


def plan_graph(graph: MetaIR, mesh: Mesh, *, plugins: PluginManager | None = None, solver: str | None = None,
               memory_budget: int | None = None, cache_dir: str | None = None, constraints: Any = None,
               settings: Settings | None = None, progress: bool | None = None,
               solver_options: dict | None = None, device: Any = None) -> CompileResult:
    """Discover rules for ``graph``, build the ShardingProblem on ``mesh`` and solve it.

    ``device`` is the cost model's DeviceSpec; by default the one of the mesh
    profile (``mesh_profile`` setting), else the CPU preset.
    """
    from .problem import build_problem  # the solve half of the flow

    s = settings or load_settings(solver=solver, memory_budget=memory_budget, cache_dir=cache_dir)
    pm = plugins or PluginManager()
    pm.solver(s.solver)  # fail fast on an unknown solver name, before any discovery
    timings: dict[str, float] = {}

    t = time.perf_counter()
    book = discover(graph, pm.hook, RuleBook.load(s.cache_dir), axis_size=s.axis_size, progress=progress)
    timings["discover"] = time.perf_counter() - t

    t = time.perf_counter()
    op_costs = {}
    for op in graph.ops:
        c = pm.hook.metadist_op_cost(op=op, graph=graph)
        if c is not None:
            op_costs[op.id] = tuple(c)
    if device is None and s.mesh_profile:
        from .profile import load_profile
        device = load_profile(s.mesh_profile).device
    problem = build_problem(graph, book, mesh, op_costs=op_costs, constraints=constraints,
                            memory_budget=s.memory_budget, device=device)
    timings["build_problem"] = time.perf_counter() - t

    t = time.perf_counter()
    options = {"time_limit": s.time_limit, **(solver_options or {})}
    with Ticker(f"solve ({s.solver}, {len(problem.nodes)} decisions)", enabled=progress):
        plan = pm.solve(s.solver, problem, options)
    timings["solve"] = time.perf_counter() - t
    log.info("planned %s on mesh %s with %s: %s", graph.name, mesh, s.solver, getattr(plan, "summary", lambda: "")())
    return CompileResult(graph, book, problem, plan, None, timings)


def compile_step(frontend: str, fn: Callable, args: tuple, kwargs: dict, mesh: Mesh, *,
                 plugins: PluginManager | None = None, context: Any = None, **plan_kwargs: Any) -> CompileResult:
    """Trace ``fn`` with ``frontend``, plan it on ``mesh`` and lower the plan to a runnable step."""
    pm = plugins or PluginManager()
    pm.frontend(frontend)
    t = time.perf_counter()
    graph = pm.hook.metadist_trace(frontend=frontend, fn=fn, args=args, kwargs=kwargs)
    if graph is None:
        raise RuntimeError(f"frontend {frontend!r} returned no graph from metadist_trace")
    t_trace = time.perf_counter() - t
    result = plan_graph(graph, mesh, plugins=pm, **plan_kwargs)
    result.timings = {"trace": t_trace, **result.timings}
    t = time.perf_counter()
    result.runnable = pm.hook.metadist_lower(frontend=frontend, graph=graph, plan=result.plan, mesh=mesh,
                                             context=context)
    result.timings["lower"] = time.perf_counter() - t
    return result
