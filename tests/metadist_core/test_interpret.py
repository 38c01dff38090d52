"""The one plan interpreter: identical reshards of a value run once, plan ends are checked, and the
mixed-Partial reduce convention is the simulator's."""
import numpy as np
import pytest

from metadist_core.interpret import Collectives, PlanError, interpret
from metadist_core.placement import Mesh, Partial, Shard, Sharding
from metadist_core.plan import ShardingPlan
from metadist_core.build import build_problem
from metadist_core.reference import GraphBuilder, run_graph, run_local
from metadist_core.rules import RuleBook
from metadist_core.simulate import SimCollectives, assemble, devices, distribute


class Counting(SimCollectives):
    def __init__(self, mesh):
        super().__init__(mesh)
        self.calls = []

    def all_gather(self, vals, c, shape):
        self.calls.append(("all_gather", shape))
        return super().all_gather(vals, c, shape)


def _three_readers():
    g = GraphBuilder("fanout")
    x = g.input("x", (8, 4))
    a, b, c = g.op("np.relu", x), g.op("np.gelu", x), g.op("np.tanh", x)
    g.output(g.op("np.add", g.op("np.add", a, b), c))
    return g.ir


def test_a_reshard_read_by_three_ops_runs_once():
    ir = _three_readers()
    mesh = Mesh((2,))
    problem = build_problem(ir, RuleBook(), mesh)     # no rules: every op replicated
    plan = ShardingPlan.replicated(problem)
    x_sh = Sharding([Shard(0)])
    plan.input_shardings["x"] = x_sh                   # x stored split: each reader needs it gathered
    from metadist_core.reshard import reshard
    for e in plan.edges:
        if e.var == "x":
            e.src_sharding = x_sh
            e.collectives = reshard(x_sh, e.dst_sharding, (8, 4), "float32", mesh)
    readers = [e for e in plan.edges if e.var == "x"]
    assert len(readers) == 3 and all(e.collectives for e in readers)
    rng = np.random.default_rng(3)
    full = rng.standard_normal((8, 4))
    coll = Counting(mesh)
    local = {"x": distribute(full, x_sh, mesh)}

    def run_op(op, ins, out_sh):
        r = {d: run_local(op, [v[d] for v in ins], [None]) for d in devices(mesh)}
        return [r]

    res = interpret(ir, plan, mesh, local, run_op, coll)
    assert coll.calls == [("all_gather", (8, 4))]
    assert [c.kind for _, c in res.collectives] == ["all_gather"]
    ref = run_graph(ir, {"x": full})
    (out,) = res.outputs.values()
    np.testing.assert_allclose(out[(0,)], ref[ir.outputs[0]])


def test_an_output_left_split_is_a_plan_error():
    ir = _three_readers()
    mesh = Mesh((2,))
    plan = ShardingPlan.replicated(build_problem(ir, RuleBook(), mesh))
    out = ir.outputs[0]
    for e in plan.edges:
        if e.var == out:
            e.dst_sharding = Sharding([Shard(0)])
    with pytest.raises(PlanError, match=f"graph output {out} ends as"):
        interpret(ir, plan, mesh, {"x": None}, lambda *a: [], Collectives())


def test_mixed_partial_reduces_last_axis_first():
    """Partial(max) on axis 0 and Partial(sum) on axis 1: sum over axis 1 inside each row, then max."""
    mesh = Mesh((2, 2))
    vals = {(0, 0): np.array([1.0]), (0, 1): np.array([5.0]), (1, 0): np.array([4.0]), (1, 1): np.array([-1.0])}
    got = assemble(vals, Sharding([Partial("max"), Partial("sum")]), mesh)
    assert got.tolist() == [max(1 + 5, 4 - 1)]
