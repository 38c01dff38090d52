"""Proven ILP answers are kept on disk (solvers/_cache.py): the same MILP is answered from the cache with the same
plan; any change to the problem is a new MILP; unproven answers are not kept; a broken entry is solved again."""

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import OptimizeResult

from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager
from metadist_core.problem.problem import InfeasibleBudgetError
from metadist_core.problem.build import build_problem
from metadist_solvers import _cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metadist_core"))
from _small_graphs import linear_step, mm_only, rulebook  # noqa: E402


@pytest.fixture(scope="module")
def pm():
    return PluginManager()


def _problem(make=mm_only, mesh=(2, 2), alpha=1e-7, budget=None):
    g = make()
    return build_problem(g, rulebook(g), Mesh(mesh, alpha=alpha, beta=1e-9), memory_budget=budget)


def _entries(d: Path) -> list[Path]:
    return sorted((d / _cache.SUBDIR).glob("*.npz"))


def test_the_same_problem_is_answered_from_the_cache(pm, tmp_path):
    opts = {"cache_dir": str(tmp_path), "coarsen": False}
    first = pm.solve("ilp", _problem(), opts)
    assert first.stats.extra.get("cached") == 0 and len(_entries(tmp_path)) == 1
    again = pm.solve("ilp", _problem(), opts)  # built afresh: equal, not the same object
    assert again.stats.extra.get("cached") == 1
    assert again.objective == pytest.approx(first.objective, rel=1e-12)
    assert [again.choices[k] for k in sorted(first.choices)] == [first.choices[k] for k in sorted(first.choices)]
    assert again.gap == pytest.approx(first.gap) and len(_entries(tmp_path)) == 1
    fresh = pm.solve("ilp", _problem(), {"coarsen": False})  # no cache: the solver's own answer is the same
    assert fresh.objective == pytest.approx(first.objective, rel=1e-12)


def test_a_changed_problem_is_solved_again(pm, tmp_path):
    opts = {"cache_dir": str(tmp_path), "coarsen": False}
    a = pm.solve("ilp", _problem(alpha=1e-7), opts)
    b = pm.solve("ilp", _problem(alpha=1e-3), opts)  # other link costs: another MILP
    c = pm.solve("ilp", _problem(mesh=(2, 3), make=lambda: mm_only(6, 6, 6)), opts)
    assert [p.stats.extra.get("cached") for p in (a, b, c)] == [0, 0, 0]
    assert len(_entries(tmp_path)) == 3
    tighter = pm.solve("ilp", _problem(), {**opts, "mip_rel_gap": 1e-9})  # the gap is part of the key
    assert tighter.stats.extra.get("cached") == 0


def test_an_infeasible_budget_is_a_kept_proof(pm, tmp_path):
    g = linear_step()
    p = build_problem(g, rulebook(g), Mesh((2,), alpha=1e-7, beta=1e-9), memory_budget=1)
    opts = {"cache_dir": str(tmp_path), "least_peak": False}
    with pytest.raises(InfeasibleBudgetError):
        pm.solve("ilp", p, opts)
    n = len(_entries(tmp_path))
    assert n >= 1
    with pytest.raises(InfeasibleBudgetError):
        pm.solve("ilp", p, opts)
    assert len(_entries(tmp_path)) == n


def test_only_proofs_are_kept_and_a_broken_entry_is_solved_again(pm, tmp_path, caplog):
    stopped = OptimizeResult(status=1, message="time limit reached", success=False, x=np.ones(3), fun=1.0)
    _cache.store(tmp_path, "k1", stopped)
    assert _cache.load(tmp_path, "k1") is None and not _entries(tmp_path)
    proof = OptimizeResult(
        status=0,
        message="optimal",
        success=True,
        x=np.array([0.0, 1.0]),
        fun=2.5,
        mip_dual_bound=2.5,
        mip_gap=0.0,
        mip_node_count=3,
    )
    _cache.store(tmp_path, "k2", proof)
    back = _cache.load(tmp_path, "k2")
    assert back.status == 0 and back.fun == 2.5 and list(back.x) == [0.0, 1.0] and back.cached
    opts = {"cache_dir": str(tmp_path), "coarsen": False}
    first = pm.solve("ilp", _problem(), opts)
    for f in _entries(tmp_path):
        f.write_bytes(b"not an npz")
    with caplog.at_level(logging.WARNING, logger="metadist.solve"):
        again = pm.solve("ilp", _problem(), opts)
    assert again.stats.extra.get("cached") == 0 and again.objective == pytest.approx(first.objective, rel=1e-12)
    assert "unreadable" in caplog.text


def test_a_recompute_proposal_that_ran_out_of_time_is_not_waited_for_again(pm, tmp_path, monkeypatch):
    """A toggled solve (the recompute proposal) whose toggles and shardings did not meet the budget in its
    time leaves a marker: the same problem given no more time fails at once, given more time it is solved
    again (GPT-2, 11 layers, 48 MiB on 4 devices: a recompile's planning 14.9 s -> 4.9 s, the same plan)."""
    import metadist_solvers.ilp as ilp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_toggles import _random_toggles

    g = linear_step(8, 4, 8)
    p = build_problem(g, rulebook(g), Mesh((2,), alpha=1e-6, beta=1e-9))
    p.toggles = _random_toggles(p, np.random.default_rng(1))
    budget = int(p.terms().peak_memory(np.zeros(p.terms().n_nodes, dtype=np.int64)) * 0.9)
    lazy_calls = []
    real_lazy = ilp._lazy

    def lazy(*a, **k):
        lazy_calls.append(1)
        return real_lazy(*a, **k)

    monkeypatch.setattr(ilp, "_lazy", lazy)
    monkeypatch.setattr(ilp, "over_budget", lambda peak, limit: True)  # as if time ran out every time
    opts = {"cache_dir": str(tmp_path), "coarsen": False, "time_limit": 5.0}
    for _attempt, limit in enumerate((5.0, 5.0, 2.0, 20.0)):
        with pytest.raises(RuntimeError, match="ran out of time_limit"):
            pm.solve("ilp", p.with_budget(budget), {**opts, "time_limit": limit})
    assert len(lazy_calls) == 2  # the first and the one given more time; not the two given no more
    assert len(list((tmp_path / _cache.SUBDIR).glob("*.timeout"))) == 1


def test_the_planner_keeps_answers_beside_its_rules(tmp_path):
    from metadist_core.driver.compile import plan_graph
    from metadist_core.reference.plugin import transformer_block

    g = transformer_block()
    one = plan_graph(g, Mesh((2, 2)), cache_dir=str(tmp_path), progress=False)
    two = plan_graph(g, Mesh((2, 2)), cache_dir=str(tmp_path), progress=False)
    assert _entries(tmp_path) and two.plan.stats.extra.get("cached", 0) >= 1
    assert two.plan.choices == one.plan.choices and two.plan.objective == one.plan.objective


def test_the_least_recently_used_answers_go_past_the_size_limit(tmp_path, monkeypatch):
    import os
    from metadist_core.config import load_settings

    proof = OptimizeResult(
        status=0,
        message="optimal",
        success=True,
        x=np.random.default_rng(0).random(4000),
        fun=1.0,
        mip_dual_bound=1.0,
        mip_gap=0.0,
        mip_node_count=1,
    )
    for i, key in enumerate(["a", "b"]):
        _cache.store(tmp_path, key, proof)
        os.utime(_cache._path(tmp_path, key), (1000 + i, 1000 + i))  # a written first, b after
    size = _cache._path(tmp_path, "a").stat().st_size
    assert _cache.load(tmp_path, "a") is not None  # a read now: b is the least recently used
    _cache.store(tmp_path, "c", proof, limit_mb=2.5 * size / 2**20)  # room for two answers
    assert sorted(p.stem for p in _entries(tmp_path)) == ["a", "c"]
    _cache.store(tmp_path, "d", proof, limit_mb=0)  # nothing but the answer just written
    assert [p.stem for p in _entries(tmp_path)] == ["d"]
    # the limit is a setting the planner hands the ILP solver
    monkeypatch.setenv("METADIST_ILP_CACHE_MB", "0.5")
    assert load_settings().solver_options()["cache_mb"] == 0.5
    monkeypatch.setenv("METADIST_ILP_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="ilp_cache_mb must be a number"):
        load_settings()


def test_the_ilp_solver_keeps_its_answers_within_cache_mb(pm, tmp_path):
    import os

    for k, make in enumerate([mm_only, linear_step, lambda: mm_only(6, 6, 6)]):
        pm.solve("ilp", _problem(make), {"cache_dir": str(tmp_path), "coarsen": False, "cache_mb": 0})
        for p in _entries(tmp_path):  # distinct times: the one just written is the newest
            os.utime(p, (1000 + k, 1000 + k))
        assert len(_entries(tmp_path)) == 1  # the limit of 0 keeps only the newest answer


def test_a_problem_solved_again_under_another_budget_is_coarsened_once(pm, monkeypatch):
    """The same problem under a tighter budget (what fitting the collectives' buffers does) shares its
    coarsening; each solve still holds its own budget, and an edited copy of the problem is coarsened anew."""
    from metadist_solvers import _common

    calls = []
    real = _common.coarsen
    monkeypatch.setattr(_common, "coarsen", lambda p, **k: calls.append(1) or real(p, **k))
    loose = _problem(make=linear_step)
    free = pm.solve("ilp", loose, {})
    with pytest.raises(InfeasibleBudgetError) as e:
        pm.solve("ilp", loose.with_budget(1), {})
    lean = int(e.value.needed)
    assert lean < free.memory_per_device, "the test needs a budget that binds"
    budget = (free.memory_per_device + lean) // 2
    tight = pm.solve("ilp", loose.with_budget(budget), {})
    assert len(calls) == 1
    assert tight.memory_per_device <= budget < free.memory_per_device
    assert tight.objective >= free.objective
    fresh = pm.solve("ilp", _problem(make=linear_step, budget=budget), {})  # its own terms: coarsened again
    assert len(calls) == 2 and fresh.objective == pytest.approx(tight.objective, rel=1e-9)
    edited = loose.with_budget(budget)
    edited.forget_terms()  # what a preset does to a copy whose options it changes
    pm.solve("ilp", edited, {})
    assert len(calls) == 3
    pm.solve("ilp", loose, {})  # the original keeps its own
    assert len(calls) == 3
