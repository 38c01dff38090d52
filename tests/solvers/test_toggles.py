"""Toggles (yes/no decisions priced beside the shardings, as recomputing a forward segment): the ILP's
toggles and shardings equal brute force over every combination, coarsened or not; coarsening keeps a
toggle's cost and memory; solvers that do not price toggles leave them off."""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager
from metadist_core.problem.problem import InfeasibleBudgetError
from metadist_core.problem.build import build_problem
from metadist_core.problem.terms import EdgeTerm, MemTerm, Toggle, contract

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metadist_core"))
from _small_graphs import linear_step, rulebook  # noqa: E402


@pytest.fixture(scope="module")
def pm():
    return PluginManager()


def _random_toggles(problem, rng, n: int = 3) -> list[Toggle]:
    """Toggles priced as recomputation is: the compute of a few random op nodes paid again, their input
    edges paid again, their outputs held again for a while, and part of another value's life dropped."""
    t = problem.terms()
    ops = [i for i, nd in enumerate(problem.nodes) if nd.kind == "op"]
    out = []
    for j in range(n):
        nodes = [int(i) for i in rng.choice(ops, size=2, replace=False)]
        unary = [(i, problem.compute[i]) for i in nodes]
        pairs = [
            EdgeTerm(e.src, e.dst, e.src_map, e.dst_map, e.table)
            for e in problem.edges
            if e.dst in nodes and e.dst_slot >= 0
        ]
        held = [m for m in t.mem if m.node >= 0 and m.end - m.start >= 2]
        m = held[int(rng.integers(len(held)))]
        drop = [MemTerm(m.node, m.nbytes, m.start + 1, m.end)]
        add = []
        for i in nodes:
            for m2 in t.mem:
                if m2.node == i:
                    a = int(rng.integers(0, t.n_steps))
                    add.append(MemTerm(i, m2.nbytes, a, min(t.n_steps, a + 2)))
        out.append(Toggle(unary, add, drop, f"t{j}", pairs))
    return out


def _brute_force(problem, budget):
    """(best objective, least peak) over every allowed choice and every set of toggles on."""
    t = problem.terms()
    allowed = [np.flatnonzero(a) for a in t.allowed]
    best, least = np.inf, np.inf
    for ch in itertools.product(*allowed):
        ch = np.array(ch)
        for bits in itertools.product((False, True), repeat=len(t.toggles)):
            on = np.array(bits)
            peak = t.peak_memory(ch, on)
            least = min(least, peak)
            if budget is None or peak <= budget:
                best = min(best, t.objective(ch, on))
    return best, least


@pytest.mark.parametrize("seed", [1, 3, 4, 6])
def test_ilp_toggles_equal_brute_force(pm, seed):
    rng = np.random.default_rng(seed)
    g = linear_step(8, 4, 8)
    p = build_problem(g, rulebook(g), Mesh((2,), alpha=1e-6, beta=1e-9))
    p.toggles = _random_toggles(p, rng)
    free, least = _brute_force(p, None)
    plain_least = min(
        p.terms().peak_memory(np.array(ch)) for ch in itertools.product(*[np.flatnonzero(a) for a in p.terms().allowed])
    )
    for budget in (None, int((least + plain_least) / 2), int(least)):
        best, _ = _brute_force(p, budget)
        plan = pm.solve("ilp", p.with_budget(budget), {"coarsen": False})
        st = plan.stats
        assert st.extra["objective_with_toggles"] == pytest.approx(best, rel=1e-6, abs=1e-12), budget
        if budget is not None:
            assert st.extra["peak_with_toggles"] <= budget
        # what the plan says it costs is what its choices and toggles cost on the fine terms
        on = np.zeros(len(p.toggles), dtype=bool)
        on[st.toggles_on] = True
        assert p.terms().objective(np.asarray(plan.choices), on) == pytest.approx(st.extra["objective_with_toggles"])
        try:  # coarsened: the followers pass restricts the space, so never better, and equal unbudgeted
            co = pm.solve("ilp", p.with_budget(budget), {}).stats.extra["objective_with_toggles"]
        except InfeasibleBudgetError:
            assert budget is not None
            continue
        assert co >= best * (1 - 1e-6) and (budget is not None or co == pytest.approx(best, rel=1e-6))
    assert plain_least > least  # the toggles save memory that no sharding does
    with pytest.raises(InfeasibleBudgetError) as e:  # below what any choice and toggles reach
        pm.solve("ilp", p.with_budget(int(least) - 8), {"coarsen": False})  # (1 byte is within tolerance)
    assert e.value.needed == pytest.approx(least, rel=1e-6)


def test_contraction_keeps_a_toggles_cost_and_memory():
    rng = np.random.default_rng(0)
    g = linear_step(8, 4, 8)
    p = build_problem(g, rulebook(g), Mesh((2,), alpha=1e-6, beta=1e-9))
    p.toggles = _random_toggles(p, rng)
    t = p.terms()
    # merge nodes 0 and 1 (each option of the merged node: a pair of theirs), fix node 2 to its option 0
    pairs = list(itertools.product(range(t.n_options[0]), range(t.n_options[1])))
    assign, maps, n_opts = [], [], []
    for i in range(t.n_nodes):
        if i in (0, 1):
            assign.append(0)
            maps.append(np.array([pr[i] for pr in pairs]))
        elif i == 2:
            assign.append(-1)
            maps.append(np.array([0]))
        else:
            assign.append(i - 2)
            maps.append(np.arange(t.n_options[i]))
    n_opts = [len(pairs)] + [t.n_options[i] for i in range(3, t.n_nodes)]
    co = contract(t, assign, maps, n_opts)
    for _ in range(20):
        cc = np.array([rng.integers(k) for k in n_opts])
        fine = np.array([maps[i][0] if assign[i] < 0 else maps[i][cc[assign[i]]] for i in range(t.n_nodes)])
        on = rng.random(len(t.toggles)) < 0.5
        assert co.objective(cc, on) == pytest.approx(t.objective(fine, on), rel=1e-12)
        assert np.allclose(co.memory_profile(cc, on), t.memory_profile(fine, on))


def test_solvers_that_do_not_price_toggles_leave_them_off(pm):
    g = linear_step(8, 4, 8)
    p = build_problem(g, rulebook(g), Mesh((2,), alpha=1e-6, beta=1e-9))
    plain = pm.solve("beam", p, {})
    p.toggles = _random_toggles(p, np.random.default_rng(1))
    plan = pm.solve("beam", p, {})
    assert plan.stats.toggles_on is None and plan.objective == pytest.approx(plain.objective)
