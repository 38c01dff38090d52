"""ShardingProblem: construction, constraints, coarsening and the JSON round trip."""

import json

import numpy as np
import pytest

from metadist_core.problem.coarsen import coarsen
from metadist_core.problem.constraints import Forbid, Pin
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.problem import OUTPUT, ShardingProblem
from metadist_core.problem.build import build_problem
from metadist_core.discovery.rules import RuleBook

from _small_graphs import linear_step, mm_only, rulebook

R = Replicate()


def test_nodes_options_and_edges():
    g = linear_step()
    p = build_problem(g, rulebook(g), Mesh((2,)))
    assert [n.id for n in p.nodes] == ["x", "w", "mm", "scale", "sum", "decay"]
    mm = p.nodes[p.op_node("mm")]
    assert len(mm.options) == 4  # replicated + row, column, contraction split
    assert any(o.outputs[0] == Sharding([Partial("sum")]) for o in mm.options)
    # the output s is priced back to Replicate; the updated w goes back to w's node
    assert any(e.dst == -1 and e.var == "s" for e in p.edges)
    assert any(e.var == "w2" and e.dst == p.definer("w")[0] and e.dst_slot == -1 for e in p.edges)
    plan = ShardingPlan.replicated(p)
    assert plan.comm_seconds == 0 and plan.memory_per_device > 0


def test_op_without_rules_is_replicated_only():
    g = mm_only()
    p = build_problem(g, RuleBook(), Mesh((2, 2)))
    assert len(p.nodes[p.op_node("mm")].options) == 1


def test_output_edge_prices_the_final_all_reduce():
    g = mm_only()
    p = build_problem(g, rulebook(g), Mesh((2,)))
    mm = p.nodes[p.op_node("mm")]
    k = next(i for i, o in enumerate(mm.options) if o.outputs[0][0] == Partial("sum"))
    xk = next(i for i, o in enumerate(p.nodes[0].options) if o.outputs[0] == Sharding([Shard(1)]))
    wk = next(i for i, o in enumerate(p.nodes[1].options) if o.outputs[0] == Sharding([Shard(0)]))
    plan = ShardingPlan.from_choices(p, [xk, wk, k])
    colls = plan.edge_collectives("y", OUTPUT)
    assert [c.kind for c in colls] == ["all_reduce"]
    assert plan.comm_seconds == pytest.approx(colls[0].cost)
    assert "all_reduce" in str(plan)


def test_constraints_pin_and_forbid():
    g = linear_step()
    pinned = Sharding([Shard(0)])
    p = build_problem(g, rulebook(g), Mesh((2,)), constraints=[Pin("w", pinned), Forbid(Partial("sum"))])
    wn = p.definer("w")[0]
    assert all(p.nodes[wn].options[k].outputs[0] == pinned for k in np.flatnonzero(p.allowed[wn]))
    mm = p.op_node("mm")
    assert not any(p.nodes[mm].options[k].outputs[0][0] == Partial("sum") for k in np.flatnonzero(p.allowed[mm]))
    with pytest.raises(ValueError, match="without any allowed sharding"):
        build_problem(g, rulebook(g), Mesh((2,)), constraints=[Pin("w", pinned), Pin("w", Sharding([R]))])


def test_forbid_on_a_value_narrows_exactly_its_writer_and_readers():
    """A Forbid naming a value removes the options that place that value so, on the node that makes it and on
    every node that reads it, and nothing else (checked against every node's options one by one)."""
    g = linear_step()
    free = build_problem(g, rulebook(g), Mesh((2,)))
    for var, placement in [("y", Shard(0)), ("w", Shard(1)), ("y", Partial("sum"))]:
        p = build_problem(g, rulebook(g), Mesh((2,)), constraints=[Forbid(placement, var=var)])
        touched = 0
        for i, n in enumerate(p.nodes):
            names = list(n.inputs) + list(n.outputs)
            want = np.array(
                [
                    free.allowed[i][k]
                    and not any(
                        v == var and sh[0] == placement for v, sh in zip(names, list(o.inputs) + list(o.outputs))
                    )
                    for k, o in enumerate(n.options)
                ],
                dtype=bool,
            )
            assert (p.allowed[i] == want).all(), (var, placement, n.id)
            touched += bool((want != free.allowed[i]).any())
        assert touched >= 2, (var, placement)  # the writer and at least one reader lost options


def test_json_round_trip_keeps_costs_and_plans():
    g = linear_step()
    p = build_problem(
        g, rulebook(g), Mesh((2, 2)), constraints=[{"forbid": "P(sum)", "var": "y"}], memory_budget=10_000
    )
    q = ShardingProblem.loads(json.dumps(p.to_json()))
    assert q.to_json() == p.to_json()
    rng = np.random.default_rng(0)
    for _ in range(5):
        ch = [int(rng.choice(np.flatnonzero(a))) for a in p.allowed]
        a, b = ShardingPlan.from_choices(p, ch), ShardingPlan.from_choices(q, ch)
        assert a.objective == pytest.approx(b.objective)
        assert a.memory_per_device == b.memory_per_device
        back = ShardingPlan.from_json(json.loads(a.dumps()))
        assert back.to_json() == a.to_json()


def test_coarsening_maps_back_exactly():
    from benchmarks.synthetic_gpt2 import build_gpt2
    from benchmarks.synthetic_rules import synthetic_rulebook

    G = build_gpt2("gpt2-tiny-2l", layers=2)
    p = build_problem(G.graph, synthetic_rulebook(G.graph), Mesh((2, 2)), op_costs=G.op_costs)
    fine = p.terms()
    co = coarsen(p)
    assert co.terms.n_nodes < fine.n_nodes / 3
    rng = np.random.default_rng(1)
    for _ in range(10):
        c = np.array([rng.integers(k) for k in co.terms.n_options])
        f = co.expand(c)
        assert co.terms.objective(c) == pytest.approx(fine.objective(f), rel=1e-9, abs=1e-15)
        assert co.terms.peak_memory(c) == fine.peak_memory(f)
