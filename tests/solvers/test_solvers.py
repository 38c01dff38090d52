"""Solvers: the ILP equals brute force on small problems, greedy and beam never beat it, budgets hold or are refused."""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager, UnknownSolverError
from metadist_core.problem.problem import InfeasibleBudgetError
from metadist_core.problem.build import build_problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metadist_core"))
from _small_graphs import linear_step, mm_only, rulebook, scaled_by_param  # noqa: E402

SOLVERS = ("greedy", "beam", "ilp")


@pytest.fixture(scope="module")
def pm():
    return PluginManager()


def brute_force(problem, budget=None):
    """(best objective, least peak memory) over every combination of allowed options."""
    t = problem.terms()
    allowed = [np.flatnonzero(a) for a in t.allowed]
    best, least = np.inf, np.inf
    for ch in itertools.product(*allowed):
        ch = np.array(ch)
        peak = t.peak_memory(ch)
        least = min(least, peak)
        if budget is not None and peak > budget:
            continue
        best = min(best, t.objective(ch))
    return best, least


CASES = [
    ("linear", linear_step, (2,)),
    ("linear-uneven", lambda: linear_step(6, 3, 5), (3,)),
    ("mm", mm_only, (2, 2)),
    ("mm-2x3", lambda: mm_only(6, 6, 6), (2, 3)),
    ("param-first", scaled_by_param, (2,)),
]


@pytest.mark.parametrize("name,make,mesh", CASES, ids=[c[0] for c in CASES])
def test_ilp_equals_brute_force_and_heuristics_never_beat_it(pm, name, make, mesh):
    g = make()
    # tiny links make communication matter against compute
    p = build_problem(g, rulebook(g), Mesh(mesh, alpha=1e-7, beta=1e-9))
    best, _ = brute_force(p)
    for coarse in (False, True):
        plan = pm.solve("ilp", p, {"coarsen": coarse})
        assert plan.objective == pytest.approx(best, rel=1e-9, abs=1e-15)
        assert plan.gap is not None and plan.gap <= 1e-3
        assert plan.lower_bound <= plan.objective * (1 + 1e-9) + 1e-15
    for s in ("greedy", "beam"):
        assert pm.solve(s, p, {}).objective >= best * (1 - 1e-9)


def _binding_budget(pm):
    """A problem, its unbudgeted ILP plan, the least memory any plan needs, and a budget between the two."""
    g = linear_step(16, 8, 16)
    p = build_problem(g, rulebook(g), Mesh((4,)))
    free, least = brute_force(p)
    free_plan = pm.solve("ilp", p, {})
    budget = int((least + free_plan.memory_per_device) / 2)
    if budget >= free_plan.memory_per_device:
        budget = free_plan.memory_per_device - 1
    return p, free_plan, least, budget


def test_memory_budget_is_honoured_or_refused(pm):
    p, free_plan, least, budget = _binding_budget(pm)
    assert least <= budget
    pb = p.with_budget(budget)
    best, _ = brute_force(pb, budget)
    plan = pm.solve("ilp", pb, {})
    assert plan.memory_per_device <= budget
    assert plan.objective == pytest.approx(best, rel=1e-9)
    for s in ("greedy", "beam"):
        hp = pm.solve(s, pb, {})
        assert hp.memory_per_device <= budget and hp.objective >= best * (1 - 1e-9)
    too_small = int(least) - 1
    with pytest.raises(InfeasibleBudgetError) as err:
        pm.solve("ilp", p.with_budget(too_small), {})
    msg = str(err.value)
    assert f"{int(least):,} bytes per device" in msg and f"{too_small:,} bytes per device" in msg
    assert err.value.needed == least
    for s in ("greedy", "beam"):
        with pytest.raises(InfeasibleBudgetError, match="bytes per device"):
            pm.solve(s, p.with_budget(too_small), {})


def test_ilp_out_of_time_with_lazy_memory_rows_still_honours_the_budget(pm, monkeypatch):
    """When time runs out before every memory row is in, the incumbent may be over budget: it is repaired."""
    from metadist_solvers import ilp

    p, free_plan, _, budget = _binding_budget(pm)
    real = ilp._lazy
    # as if the deadline hit before the first memory row went in: the unbudgeted optimum comes back
    monkeypatch.setattr(
        ilp,
        "_lazy",
        lambda model, steps, b, deadline, gap, peak_var=False: real(model, [], float("inf"), deadline, gap, peak_var),
    )
    plan = pm.solve("ilp", p.with_budget(budget), {})
    assert plan.memory_per_device <= budget < free_plan.memory_per_device
    assert "repaired" in plan.stats.status


def test_an_ilp_stopped_by_its_time_limit_returns_no_worse_than_a_beam_sweep(pm, monkeypatch):
    """HiGHS stopped at its time limit may hold a poor incumbent (on (2,2,2) 1.43x a beam sweep's plan):
    the ILP then returns whichever of the two is cheaper."""
    from types import SimpleNamespace

    from metadist_solvers import ilp

    g = mm_only(6, 6, 6)
    p = build_problem(g, rulebook(g), Mesh((2, 3), alpha=1e-7, beta=1e-9))
    best, _ = brute_force(p)
    real = ilp._lazy
    worst: dict = {}

    def stopped(model, steps, b, deadline, gap, peak_var=False):  # the dearest option everywhere
        res, ch, steps, rounds = real(model, steps, b, deadline, gap, peak_var)
        bad = np.array([int(np.argmax(np.where(a, u, -np.inf))) for a, u in zip(model.t.allowed, model.t.unary)])
        worst["objective"] = model.t.objective(bad)
        return (
            SimpleNamespace(
                status=1, message="Time limit reached", x=res.x, mip_dual_bound=getattr(res, "mip_dual_bound", None)
            ),
            bad,
            steps,
            rounds,
        )

    monkeypatch.setattr(ilp, "_lazy", stopped)
    plan = pm.solve("ilp", p, {"coarsen": False})
    beam = pm.solve("beam", p, {"coarsen": False})
    assert worst["objective"] > beam.objective * 1.01  # the stopped incumbent is really worse
    assert plan.objective == pytest.approx(min(worst["objective"], beam.objective), rel=1e-9)
    assert plan.objective >= best * (1 - 1e-9) and "beam sweep" in plan.stats.status


def test_plans_carry_collectives_and_figures(pm):
    g = linear_step()
    p = build_problem(g, rulebook(g), Mesh((2,), alpha=1e-7, beta=1e-9))
    plan = pm.solve("ilp", p, {"time_limit": 5})
    assert plan.solver == "ilp" and plan.solve_seconds > 0
    assert set(plan.var_shardings) >= {"x", "w", "y", "z", "s", "w2"}
    assert set(plan.op_strategies) == {"mm", "scale", "sum", "decay"}
    for e in plan.edges:
        assert sum(c.cost for c in e.collectives) == pytest.approx(e.cost)
    assert plan.comm_seconds == pytest.approx(sum(e.cost for e in plan.edges))
    assert "ilp on mesh 2" in plan.summary()


def test_unknown_solver_lists_known_ones(pm):
    with pytest.raises(UnknownSolverError) as err:
        pm.solve("simplex", None, {})
    for s in SOLVERS:
        assert s in str(err.value)


def test_gpt2_tiny_heuristics_not_better_than_ilp(pm):
    from benchmarks.synthetic_gpt2 import build_gpt2
    from benchmarks.synthetic_rules import synthetic_rulebook

    G = build_gpt2("gpt2-tiny-2l")
    p = build_problem(G.graph, synthetic_rulebook(G.graph), Mesh((2, 2)), op_costs=G.op_costs)
    ilp = pm.solve("ilp", p, {"time_limit": 30})
    assert ilp.gap <= 1e-3
    for s in ("greedy", "beam"):
        assert pm.solve(s, p, {}).objective >= ilp.objective * (1 - 1e-9)


@pytest.mark.parametrize("make,mesh", [(linear_step, (2,)), (mm_only, (2, 2))])
def test_presolve_on_constrained_problems_keeps_the_brute_force_optimum(pm, make, mesh):
    """Presolve turns on by itself where constraints leave options out, and the ILP still finds brute force's
    optimum there, as it does with presolve off and, unconstrained, with presolve left off."""
    from metadist_core.problem.constraints import Forbid
    from metadist_core.ir.placement import Partial, Replicate

    g = make()
    free = build_problem(g, rulebook(g), Mesh(mesh, alpha=1e-7, beta=1e-9))
    plan = pm.solve("ilp", free, {"coarsen": False})
    assert plan.stats.extra["presolve"] is False
    assert plan.objective == pytest.approx(brute_force(free)[0], rel=1e-6)
    for forbid in (Forbid(Replicate(), var="w", axis=0), Forbid(Partial("sum"))):
        p = build_problem(g, rulebook(g), Mesh(mesh, alpha=1e-7, beta=1e-9), constraints=[forbid])
        assert not all(a.all() for a in p.allowed)
        auto = pm.solve("ilp", p, {"coarsen": False})
        off = pm.solve("ilp", p, {"coarsen": False, "presolve": False})
        assert auto.stats.extra["presolve"] is True and off.stats.extra["presolve"] is False
        best = brute_force(p)[0]
        assert auto.objective == pytest.approx(best, rel=1e-6) and off.objective == pytest.approx(best, rel=1e-6)


@pytest.mark.parametrize("name,make,mesh", CASES, ids=[c[0] for c in CASES])
def test_the_least_peak_bound_is_never_above_the_leanest_plan(name, make, mesh):
    g = make()
    p = build_problem(g, rulebook(g), Mesh(mesh, alpha=1e-7, beta=1e-9))
    _, least = brute_force(p)
    bound = p.terms().least_peak_bound()
    assert 0 < bound <= least, (bound, least)


def test_an_ilp_out_of_time_under_an_impossible_budget_says_what_every_plan_needs(pm, monkeypatch):
    """No incumbent in time under a budget below what every plan holds: the error is the budget's, with the
    bound, not a time-out (which would send the user after time_limit)."""
    from types import SimpleNamespace

    from metadist_solvers import ilp

    g = linear_step()
    p = build_problem(g, rulebook(g), Mesh((2,), alpha=1e-7, beta=1e-9))
    bound = p.terms().least_peak_bound()
    stopped = SimpleNamespace(status=1, message="time limit reached", x=None)
    monkeypatch.setattr(ilp, "_lazy", lambda model, steps, b, deadline, gap, peak_var=False: (stopped, None, steps, 1))
    with pytest.raises(InfeasibleBudgetError, match=f"needs at least {bound:,} bytes"):
        pm.solve("ilp", p.with_budget(bound - 1), {"least_peak": False})
    with pytest.raises(RuntimeError, match="no plan within time_limit"):  # a budget the bound allows: time it was
        pm.solve("ilp", p.with_budget(bound), {"least_peak": False})


def test_under_a_budget_the_ilp_presolves(pm):
    """HiGHS presolve is on under a memory budget (and where constraints leave options out), off on a free
    problem (test_memory_budget_is_honoured_or_refused holds the budgeted optimum to brute force's)."""
    from metadist_solvers.ilp import wants_presolve

    p, free_plan, least, budget = _binding_budget(pm)
    assert not wants_presolve(p.terms()) and free_plan.stats.extra.get("presolve") is False
    tight = p.with_budget(budget)
    assert wants_presolve(tight.terms())
    plan = pm.solve("ilp", tight, {})
    assert plan.stats.extra.get("presolve") is True and plan.memory_per_device <= budget
