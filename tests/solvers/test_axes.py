"""Descent over mesh axes (solvers/_axes.py): slices keep the other axes' placements, the plan is never worse
than its start, no one-axis slice of the result improves it, and the one ILP stays the reference on small
problems."""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from metadist_core.problem.coarsen import coarsen
from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager
from metadist_core.problem.build import build_problem
from metadist_core.problem.terms import contract
from metadist_solvers._axes import _key, axis_codes, descend
from metadist_solvers.ilp import ilp_terms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metadist_core"))
from _small_graphs import linear_step, mm_only, rulebook  # noqa: E402

CASES = [("mm", lambda: mm_only(8, 8, 8)), ("linear", lambda: linear_step(16, 8, 16))]


def _problem(make, mesh=(2, 2, 2)):
    g = make()
    return build_problem(g, rulebook(g), Mesh(mesh, alpha=1e-7, beta=1e-9))


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_options_with_one_key_place_everything_alike_on_the_fixed_axes(name, make):
    p = _problem(make)
    co = coarsen(p)
    groups = axis_codes(p, co)
    members = {}
    for i, c in enumerate(co.assign):
        if c >= 0:
            members.setdefault(int(c), []).append(i)
    checked = 0
    for c, g in enumerate(groups):
        if g is None:
            continue
        for fixed in itertools.chain.from_iterable(itertools.combinations(range(3), r) for r in (1, 2)):
            key = _key(g, fixed)
            for a, b in itertools.combinations(range(len(key)), 2):
                same = all(
                    tuple(s[x] for s in tuple(o.inputs) + tuple(o.outputs))
                    == tuple(s[x] for s in tuple(q.inputs) + tuple(q.outputs))
                    for i in members[c]
                    for o, q in [(p.nodes[i].options[co.maps[i][a]], p.nodes[i].options[co.maps[i][b]])]
                    for x in fixed
                )
                assert (key[a] == key[b]) == same
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_descent_is_monotone_a_local_optimum_and_never_beats_the_whole_ilp(name, make):
    p = _problem(make)
    co = coarsen(p)
    t = co.terms
    groups = axis_codes(p, co)
    start = np.array([int(np.flatnonzero(a)[0]) for a in t.allowed])  # the first allowed option: a poor start

    def solve(sub, seconds):
        return ilp_terms(sub, {"time_limit": seconds, "method": "whole"})[0]

    ch, stats = descend(t, groups, start, solve, deadline=float("inf"))
    hist = stats["descent_history_ms"]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(hist, hist[1:]))
    assert t.objective(ch) <= t.objective(start)
    for free in range(3):  # no slice of one free axis around the result does better
        fixed = tuple(a for a in range(3) if a != free)
        maps = [
            np.flatnonzero(t.allowed[i])
            if g is None
            else np.flatnonzero(t.allowed[i] & (_key(g, fixed) == _key(g, fixed)[ch[i]]))
            for i, g in enumerate(groups)
        ]
        sub = contract(t, list(range(t.n_nodes)), maps, [len(m) for m in maps])
        best = solve(sub, 60.0)
        assert sub.objective(best) >= t.objective(ch) * (1 - 1e-9)
    whole = ilp_terms(t, {"method": "whole"})[0]
    assert t.objective(ch) >= t.objective(whole) * (1 - 1e-9)


def test_the_ilp_plugin_takes_the_descent_when_asked_or_when_the_one_ilp_is_too_big(monkeypatch):
    import metadist_solvers.ilp as ilp

    pm = PluginManager()
    p = _problem(lambda: linear_step(16, 8, 16))
    exact = pm.solve("ilp", p, {"method": "whole"})
    axes = pm.solve("ilp", p, {"method": "axes"})
    assert "descent" in axes.stats.status and axes.lower_bound is None
    assert axes.objective >= exact.objective * (1 - 1e-9)
    assert axes.objective <= axes.stats.extra["start_ms"] * 1e-3 * (1 + 1e-12)
    monkeypatch.setattr(ilp, "AXES_ABOVE", 10)
    assert "descent" in pm.solve("ilp", p, {}).stats.status
    one_axis = build_problem(linear_step(16, 8, 16), rulebook(linear_step(16, 8, 16)), Mesh((8,)))
    assert "descent" not in (pm.solve("ilp", one_axis, {}).stats.status or "")  # nothing to slice
    with pytest.raises(ValueError, match="method='both'"):
        pm.solve("ilp", p, {"method": "both"})


def test_the_descent_keeps_a_memory_budget_that_binds():
    from metadist_core.problem.problem import InfeasibleBudgetError

    pm = PluginManager()
    p = _problem(lambda: linear_step(16, 8, 16))
    free = pm.solve("ilp", p, {"method": "whole"})
    with pytest.raises(InfeasibleBudgetError) as e:
        pm.solve("ilp", p.with_budget(1), {"method": "whole"})
    least = e.value.needed
    assert least < free.memory_per_device  # a budget between the two binds
    budget = (least + free.memory_per_device) // 2
    q = p.with_budget(budget)
    exact = pm.solve("ilp", q, {"method": "whole"})
    axes = pm.solve("ilp", q, {"method": "axes"})
    assert axes.memory_per_device <= budget
    assert axes.objective >= exact.objective * (1 - 1e-9)


def test_a_block_out_of_time_leaves_the_plan_so_far():
    """A block's ILP that finds no plan in the time left (the deadline reached) ends the descent with the best
    plan found so far; the same failure before the deadline is an error."""
    import time

    p = _problem(CASES[1][1])
    co = coarsen(p)
    t = co.terms
    groups = axis_codes(p, co)
    start = np.array([int(np.flatnonzero(a)[0]) for a in t.allowed])
    calls = []

    def late(sub, seconds):  # the first block improves; the second runs out of time at the deadline
        calls.append(seconds)
        if len(calls) == 1:
            return ilp_terms(sub, {"time_limit": 60.0, "method": "whole"})[0]
        while time.perf_counter() < deadline:
            time.sleep(0.01)
        raise RuntimeError("the ILP found no plan within time_limit")

    deadline = time.perf_counter() + 2.0
    ch, stats = descend(t, groups, start, late, deadline=deadline)
    assert stats["descent_out_of_time"] and stats["descent_solves"] == 1
    assert t.objective(ch) < t.objective(start)

    def broken(sub, seconds):
        raise RuntimeError("the ILP found no plan within time_limit")

    with pytest.raises(RuntimeError):
        descend(t, groups, start, broken, deadline=time.perf_counter() + 60.0)
