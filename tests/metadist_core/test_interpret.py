"""The one plan interpreter: identical reshards of a value run once, plan ends are checked, and the
mixed-Partial reduce convention is the simulator's."""

import numpy as np
import pytest

from metadist_core.plan.interpret import Collectives, PlanError, interpret
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Shard, Sharding
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.build import build_problem
from metadist_core.reference.plugin import GraphBuilder, run_graph, run_local
from metadist_core.discovery.rules import RuleBook
from metadist_core.plan.simulate import SimCollectives, assemble, devices, distribute


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
    problem = build_problem(ir, RuleBook(), mesh)  # no rules: every op replicated
    plan = ShardingPlan.replicated(problem)
    x_sh = Sharding([Shard(0)])
    plan.input_shardings["x"] = x_sh  # x stored split: each reader needs it gathered
    from metadist_core.cost.reshard import reshard

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


def _late_reduce_case(mesh_shape, n_rows, cols):
    """y = x @ w split on the contraction (a Partial y), then transpose(y) read whole and tanh'd: the plan
    reduces y before the transpose. Returns the graph, the plan and the inputs' full values."""
    from metadist_core.cost.reshard import reshard
    from metadist_core.discovery.rules import Strategy

    g = GraphBuilder("late_reduce")
    x, w = g.input("x", (n_rows, 16)), g.input("w", (16, cols))
    y = g.op("np.matmul", x, w)
    t = g.op("np.transpose", y, perm=[1, 0])
    g.output(g.op("np.tanh", t))
    ir = g.ir
    mesh = Mesh(mesh_shape)
    plan = ShardingPlan.replicated(build_problem(ir, RuleBook(), mesh))
    split = lambda d: Sharding([Shard(d)] * mesh.ndim)  # noqa: E731
    part = Sharding([Partial("sum")] * mesh.ndim)
    rep = Sharding.replicated(mesh.ndim)
    mm = next(op for op in ir.ops if op.key == "np.matmul")
    plan.strategies[mm.id] = Strategy((split(1), split(0)), (part,))
    plan.input_shardings.update({"x": split(1), "w": split(0)})
    for e in plan.edges:
        if e.var in ("x", "w"):
            e.src_sharding = e.dst_sharding = plan.input_shardings[e.var]
        if e.var == y:
            e.src_sharding, e.dst_sharding = part, rep
            e.collectives = reshard(part, rep, (n_rows, cols), "float32", mesh)
    rng = np.random.default_rng(5)
    return ir, plan, mesh, {"x": rng.standard_normal((n_rows, 16)), "w": rng.standard_normal((16, cols))}


@pytest.mark.parametrize(
    "mesh_shape,n_rows,cols,dims",
    [((2,), 8, 6, {}), ((2, 2), 8, 6, {0: 1}), ((2, 2), 12, 6, {0: 1}), ((2, 2), 8, 8, {0: 0})],
    ids=["2", "2x2", "2x2-rows12", "2x2-square"],
)
def test_a_transpose_runs_before_the_reduce_planned_ahead_of_it(mesh_shape, n_rows, cols, dims):
    """With ``reduce_after`` the transpose runs on the Partial value and the same collectives (on a (2, 2)
    mesh a reduce-scatter, an all-reduce and an all-gather) on its result: the same numbers, the same list
    of collectives. On (2, 2) the planned dim 0 of y (8 or 12 rows) is dim 1 of the transposed (6, n) value:
    6 does not split 4 ways, so the dims move with the permutation; a square y keeps the planned dim."""
    from metadist_core.plan.interpret import late_reduces

    ir, plan, mesh, full = _late_reduce_case(mesh_shape, n_rows, cols)
    inc, _ = plan.edge_index()
    tr = next(op for op in ir.ops if op.key == "np.transpose")
    y_edge = inc[(tr.id, 0)]
    assert y_edge.collectives and y_edge.collectives[0].kind in ("all_reduce", "reduce_scatter")

    def perm(op):
        return tuple(op.attrs["perm"]) if op.key == "np.transpose" else None

    late = late_reduces(ir, plan, inc, mesh, perm)
    assert set(late) == {tr.id} and late[tr.id] == dims, late

    def run_op(op, ins, out_sh):
        r = {d: run_local(op, [v[d] for v in ins], [None]) for d in devices(mesh)}
        return [r]

    local = {v: distribute(full[v], plan.input_shardings[v], mesh) for v in ("x", "w")}
    ref = run_graph(ir, full)[ir.outputs[0]]
    planned = interpret(ir, plan, mesh, local, run_op, SimCollectives(mesh))
    moved = interpret(ir, plan, mesh, local, run_op, SimCollectives(mesh), reduce_after=perm)
    for res in (planned, moved):
        (out,) = res.outputs.values()
        for d in devices(mesh):
            np.testing.assert_allclose(out[d], ref, rtol=1e-12)
    assert [(v, c.kind, c.nbytes) for v, c in moved.collectives] == [
        (v, c.kind, c.nbytes) for v, c in planned.collectives
    ]
