"""Activation recomputation (metadist_core.levers.recompute) on traced torch steps.

- the rewritten graph computes exactly what the original does (both lowered and run on one device), dropout
  included (random ops are kept, never recomputed);
- recomputing lowers the cost model's peak and raises its compute;
- a segment's toggle (recomputation priced in the ILP) costs and holds exactly what rewriting the graph does;
- under a budget between the leanest plan without recomputation and the leanest with it, the planner
  recomputes (segments chosen by the ILP with the shardings, no worse than the search over segment counts)
  and meets the budget, and ``recompute=False`` is the infeasibility error with both byte counts;
- 4 gloo ranks: the compiled GPT example and transformers' GPT-2 under such a budget give the single-device
  numbers (slow; the GPT example case runs in CI).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from metadist_core.config import load_settings  # noqa: E402
from metadist_core.driver.compile import plan_graph, replicated_plan  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.levers.recompute_segments import SUFFIX, is_random, order, rewrite, segments  # noqa: E402
from metadist_core.levers.recompute import RecomputeBudgetError  # noqa: E402
from metadist_core.plan.planstats import PlanStats  # noqa: E402
from metadist_torch.lower.lower import lower_plan  # noqa: E402
from metadist_torch.plugin import TorchFrontend  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun


def _gpt():
    spec = importlib.util.spec_from_file_location("example_gpt_rc", REPO / "examples" / "torch" / "gpt.py")
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    return m


gpt = _gpt()


def _traced(dropout: float = 0.0, layers: int = 2):
    c = gpt.GPTConfig(layers=layers, dropout=dropout, vocab=128, width=64, seq=64, batch=16)
    model, opt = gpt.build(c)
    idx, tg = gpt.batch(c)
    return TorchFrontend().trace(gpt.train_step, (model, opt, idx, tg), {}), (idx, tg)


def _run_on_one_device(graph, step, user):
    """Lower ``graph`` with the replicated plan on a mesh of one and run it on the step's state and ``user``."""
    mesh = Mesh((1,))
    plan, _ = replicated_plan(graph, mesh)
    rg = lower_plan(graph, plan, mesh, coords=(0,), groups=None, coalesce=False)
    n_s = len(step.state.slots)
    vals = {step.in_names[i]: s.get().detach().clone() for i, s in enumerate(step.state.slots)}
    vals.update({step.in_names[n_s + j]: t for j, t in enumerate(user)})
    vals.update({n: t for n, t in zip(step.in_names[n_s + len(user) :], step.constants)})
    torch.manual_seed(7)
    with torch.no_grad():
        return rg(*[vals[v] for v in rg.input_vars]), rg


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_rewritten_step_computes_the_same_numbers(dropout):
    tr, user = _traced(dropout)
    g = tr.graph
    segs = segments(g)
    assert len(segs) >= 4, f"expected the two halves of each block as segments, got {len(segs)}"
    ops = [i for s in segs for i in s.recompute]
    assert not any(is_random(g.op(i).key) for i in ops)
    g2 = rewrite(g, ops)
    assert len(g2.ops) == len(g.ops) + len(ops)
    # every copy runs after the forward ended (right before the backward that reads it)
    loss_pos = max(g2.op_index(g2.producer(o).id) for o in g2.outputs[:1])
    assert all(g2.op_index(i + SUFFIX) > loss_pos for i in ops)
    base, rg1 = _run_on_one_device(g, tr.context, user)
    rec, rg2 = _run_on_one_device(g2, tr.context, user)
    assert rg1.output_vars == rg2.output_vars and rg1.state_inputs == rg2.state_inputs
    assert len(base) == len(rec)
    for k, (a, b) in enumerate(zip(base, rec)):
        assert torch.equal(a, b), f"output {k} ({(rg1.output_vars + rg1.state_inputs)[k]}) differs"


def test_recomputing_trades_memory_for_compute():
    tr, _ = _traced(layers=3)
    g = tr.graph
    segs = order(segments(g))
    mesh = Mesh((1,))
    peaks, comps = [], []
    for k in (0, len(segs) // 2, len(segs)):
        p, _ = replicated_plan(rewrite(g, [i for s in segs[:k] for i in s.recompute]), mesh)
        peaks.append(p.memory_per_device)
        comps.append(p.compute_seconds)
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert comps[0] < comps[2], comps


class _Priced:
    """A plan of a scripted solve: only its objective (seconds) is read (recompute.step_seconds)."""

    def __init__(self, objective):
        self.objective, self.stats, self.choices = objective, PlanStats(), None


@pytest.mark.parametrize("shape", ["more_is_faster", "fewer_is_faster", "more_is_faster_above_half"])
def test_segment_search_goes_down_from_all_and_stops_where_fewer_cost_more(shape):
    """The search over segment counts (a solver without toggles) solves all segments first and halves
    while the predicted step does not grow: where every segment recomputed is fastest (a tight budget,
    the sharding paying in collectives for memory) two counts decide; where fewer are faster it bisects
    down to the fewest that fit. Each time the count predicted fastest is taken."""
    from metadist_core.problem.problem import InfeasibleBudgetError
    from metadist_core.levers.recompute import choose

    tr, _ = _traced(layers=4)
    g = tr.graph
    n = len(order(segments(g)))
    assert n >= 8, n
    # the fewest segments with a plan under the budget
    fewest = n // 2 + 2 if shape == "more_is_faster_above_half" else 3
    solved = []

    def solve(graph):
        k = sum(op.id.endswith(SUFFIX) for op in graph.ops)  # recomputed ops: which count this is
        counts = {sum(len(s.recompute) for s in order(segments(g))[:j]): j for j in range(n + 1)}
        j = counts[k]
        solved.append(j)
        if j < fewest:
            raise InfeasibleBudgetError(1, 2 + fewest - j, Mesh((1,)))
        return None, _Priced(100.0 + j if shape == "fewer_is_faster" else 100.0 - j)

    graph, (_, plan), segs = choose(g, 1, solve)
    if shape == "more_is_faster":
        assert len(segs) == n and solved == [0, n, n // 2], solved
    elif shape == "more_is_faster_above_half":  # half does not fit; the count between is slower: stop
        assert len(segs) == n and solved == [0, n, n // 2, (n // 2 + n) // 2], solved
    else:
        assert len(segs) == fewest, (len(segs), solved)
        assert solved[:2] == [0, n] and fewest - 1 in solved and len(solved) <= 2 + 2 * n.bit_length(), solved
    assert plan.objective == min(100.0 + j if shape == "fewer_is_faster" else 100.0 - j for j in solved if j >= fewest)


def test_toggles_price_the_rewritten_graph_exactly():
    """A segment's toggle on the plain graph's problem costs and holds what rewriting the graph does: for
    several sets of segments, the plain problem with those toggles on and the rewritten graph's problem
    (copies sharded as their originals) give the same step cost and memory profile peak, on one device and
    under the 4-device plan."""
    import numpy as np

    from metadist_core.driver.compile import op_costs
    from metadist_core.plan.plan import ShardingPlan
    from metadist_core.plugins import PluginManager
    from metadist_core.problem.build import build_problem
    from metadist_core.levers.recompute import price_segments

    tr, _ = _traced(layers=2)
    g = tr.graph
    segs = order(segments(g))
    costs = op_costs(g, PluginManager())
    for mesh in (Mesh((1,)), Mesh((4,))):
        res = plan_graph(g, mesh, settings=load_settings(coalesce=False))
        prob = build_problem(g, res.rulebook, mesh, op_costs=costs, device=res.problem.device)
        price_segments(prob, g, segs)
        t = prob.terms()
        ch = np.asarray(
            ShardingPlan.from_choices(prob, {n.id: int(k) for n, k in zip(res.problem.nodes, res.plan.choices)}).choices
        )
        by_id = {n.id: int(k) for n, k in zip(prob.nodes, ch)}
        for picked in ([], [0], [1, 3], list(range(len(segs)))):
            on = np.zeros(len(segs), dtype=bool)
            on[picked] = True
            g2 = rewrite(g, [i for k in picked for i in segs[k].recompute])
            c2 = {op.id: c for op in g2.ops for c in [costs.get(op.id.removesuffix(SUFFIX))] if c is not None}
            p2 = build_problem(g2, res.rulebook, mesh, op_costs=c2, device=prob.device)
            exact = ShardingPlan.from_choices(p2, {n.id: by_id[n.id.removesuffix(SUFFIX)] for n in p2.nodes})
            assert t.peak_memory(ch, on) == exact.memory_per_device, (mesh, picked)
            assert t.objective(ch, on) == pytest.approx(exact.objective, rel=1e-9), (mesh, picked)


def test_planner_recomputes_under_a_budget_only_recompute_meets(monkeypatch):
    tr, _ = _traced(layers=2)
    g, mesh = tr.graph, Mesh((4,))
    with pytest.raises(RecomputeBudgetError) as e:  # nothing fits one byte: both leanest figures come back
        plan_graph(g, mesh, settings=load_settings(memory_budget=1))
    without, lean = e.value.without, e.value.with_recompute
    assert without > lean > 0, (without, lean)
    half = (without + lean) // 2  # halfway: a plan recomputes and fits, whichever way it is chosen
    res = plan_graph(g, mesh, settings=load_settings(memory_budget=half))
    assert res.plan.recompute and res.plan.stats.peak_with_buffers <= half, res.plan.stats.recompute
    # three quarters of the way the ILP's own choice fits (halfway, with HiGHS 1.16, the 2 segments it picks
    # leave no room for the collectives' buffers, which its memory terms do not count, and the search decides)
    budget = lean + 3 * (without - lean) // 4
    res = plan_graph(g, mesh, settings=load_settings(memory_budget=budget))
    assert res.plan.recompute, "the plan meets the budget without recomputing?"
    assert res.plan.stats.recompute["chosen_by"].startswith("the solver"), res.plan.stats.recompute
    assert res.plan.memory_per_device <= budget and res.plan.stats.peak_with_buffers <= budget
    # the figures are budgets, the collectives' buffers and the headroom counted: the one without
    # recomputation is met without it
    at = plan_graph(g, mesh, settings=load_settings(memory_budget=without))
    assert not at.plan.recompute and at.plan.stats.peak_with_buffers <= without
    assert "recomputed for the backward" in str(res.plan)
    assert res.graph is not g and len(res.graph.ops) == len(g.ops) + len(res.plan.recompute)
    free = plan_graph(g, mesh, settings=load_settings())
    assert not free.plan.recompute and free.plan.objective <= res.plan.objective
    # the search over segment counts (what a solver without toggles gets) finds no cheaper plan (1 %: the
    # search picks by overlap.predict, the ILP by its objective)
    import metadist_core.levers.recompute as rc

    monkeypatch.setattr(rc, "price_segments", lambda problem, *a: problem)
    searched = plan_graph(g, mesh, settings=load_settings(memory_budget=budget))
    assert searched.plan.stats.recompute["chosen_by"].startswith("search")
    assert res.plan.objective <= searched.plan.objective * 1.01, (res.plan.objective, searched.plan.objective)
    with pytest.raises(RecomputeBudgetError, match="recompute=False") as e:
        plan_graph(g, mesh, settings=load_settings(memory_budget=budget, recompute=False))
    # both counts in the message; the one without recomputation is a budget some plan meets, found here from
    # the plans solved under this budget rather than under a budget of one byte: within 1 % of the figure above
    assert f"{e.value.without:,}" in str(e.value) and f"{e.value.with_recompute:,}" in str(e.value)
    assert e.value.without == pytest.approx(without, rel=0.01) and e.value.without > budget


def _torchrun(case: str, timeout: int = 900) -> str:
    from _torchrun import run_torchrun

    r = run_torchrun(Path(__file__).with_name("_recompute_worker.py"), 4, [case], timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
@pytest.mark.ci
def test_gpt_example_recomputes_on_4_ranks_with_single_device_numbers():
    out = _torchrun("gpt")
    assert "RECOMPUTE OK gpt" in out, out[-2000:]


@pytest.mark.slow
def test_hf_gpt2_recomputes_on_4_ranks_with_single_device_numbers():
    pytest.importorskip("transformers")
    out = _torchrun("gpt2")
    assert "RECOMPUTE OK gpt2" in out, out[-2000:]


@pytest.mark.slow
def test_recompute_with_micro_batches_on_4_ranks_with_single_device_numbers():
    out = _torchrun("gpt_mb")
    assert "RECOMPUTE OK gpt_mb" in out, out[-2000:]
