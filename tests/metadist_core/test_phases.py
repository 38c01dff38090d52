"""A value read in the forward and again after it is moved once per reader phase (metadist_core.cost.phases):
the interpreter runs it so, the plan, the exact Terms, the ILP and the memory profile price it so, and a
Partial source's one early all_reduce still serves both phases."""

import itertools

import numpy as np
import pytest

from metadist_core.problem.constraints import Pin
from metadist_core.cost.model import all_reduce_cost
from metadist_core.plan.interpret import interpret
from metadist_core.ir.ir import MetaIR
from metadist_core.plan.memprofile import peak_with_buffers
from metadist_core.plan.overlap import predict, priced_collectives
from metadist_core.cost.phases import FORWARD, LATER, reader_phases
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding
from metadist_core.plan.plan import ShardingPlan
from metadist_core.plugins import PluginManager
from metadist_core.problem.problem import ShardingProblem
from metadist_core.problem.build import build_problem
from metadist_core.plan.simulate import simulate

from _small_graphs import rulebook

R = Replicate()


def two_phase_step(m=8, k=4, n=6) -> MetaIR:
    """loss = sum(x @ w); after the forward the 'backward' reads x and y again, the update reads w again."""
    g = MetaIR("phases")
    g.add_input("x", (m, k), "float32", "input")
    g.add_input("w", (k, n), "float32", "parameter")
    g.add_op("aten.mm.default", ["x", "w"], [("y", (m, n), "float32")], id="mm")
    g.add_op("aten.sum.dim_IntList", ["y"], [("loss", (n,), "float32")], {"dims": [0]}, id="loss")
    g.add_op("aten.mul.Tensor", ["y"], [("dy", (m, n), "float32")], {"scalar": 2.0}, id="dy")
    g.add_op("aten.t.default", ["x"], [("xt", (k, m), "float32")], id="xt")
    g.add_op("aten.mm.default", ["xt", "dy"], [("dw", (k, n), "float32")], id="dw")
    g.add_op("aten.mul.Tensor", ["w"], [("wd", (k, n), "float32")], {"scalar": 0.9}, id="decay")
    g.add_op("aten.sub.Tensor", ["wd", "dw"], [("w2", (k, n), "float32")], id="upd")
    g.set_outputs(["loss", "w2"])
    g.alias("w", "w2")
    return g


def _run_local(op, ins, out_shapes):
    """The ops of two_phase_step on one simulated device's numpy pieces."""
    name = op.key.split(".")[1]
    if name == "mm":
        return np.matmul(ins[0], ins[1])
    if name == "sum":
        return np.sum(ins[0], axis=tuple(op.attrs["dims"]))
    if name == "mul":
        return ins[0] * op.attrs["scalar"]
    if name == "t":
        return ins[0].T
    if name == "sub":
        return ins[0] - ins[1]
    raise KeyError(op.key)


class _Recorder:
    def __getattr__(self, kind):
        return lambda x, c, shape: x


def _choice(p: ShardingProblem, want: dict) -> np.ndarray:
    out = []
    for i, n in enumerate(p.nodes):
        opts = [k for k, o in enumerate(n.options) if p.allowed[i][k]]
        if n.id in want:
            opts = [k for k in opts if want[n.id](n.options[k])]
        assert opts, f"no option of {n.id} matches"
        out.append(opts[0])
    return np.asarray(out)


def test_forward_ops_are_phase_0_and_the_rest_phase_1():
    g = two_phase_step()
    ph = reader_phases(g)
    assert {i for i, p in ph.items() if p == FORWARD} == {"mm", "loss"}
    assert {i for i, p in ph.items() if p == LATER} == {"dy", "xt", "dw", "decay", "upd"}
    inference = MetaIR("inf")
    inference.add_input("x", (4, 4), "float32", "input")
    inference.add_op("aten.mul.Tensor", ["x"], [("y", (4, 4), "float32")], {"scalar": 2.0}, id="m")
    inference.set_outputs(["y"])
    assert reader_phases(inference) == {}  # one phase: every op feeds the output


def _gathered_weight_plan(mesh):
    g = two_phase_step()
    p = build_problem(g, rulebook(g), mesh)
    whole = Sharding([R] * mesh.ndim)
    split = Sharding([Shard(0)] + [R] * (mesh.ndim - 1))
    # w stored split, read whole by the forward mm and again whole by the update's decay
    ch = _choice(
        p,
        {
            "w": lambda o: o.outputs[0] == split,
            "mm": lambda o: o.inputs[1] == whole and o.inputs[0] == whole,
            "decay": lambda o: o.inputs[0] == whole and o.outputs[0] == whole,
        },
    )
    return g, p, ch


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_weight_read_in_both_phases_is_gathered_twice_everywhere(mesh_shape):
    mesh = Mesh(mesh_shape)
    g, p, ch = _gathered_weight_plan(mesh)
    plan = ShardingPlan.from_choices(p, ch)
    gathers = [(v, c.kind, c.nbytes) for v, c in priced_collectives(plan) if v == "w"]
    assert len(gathers) == 2 and {k for _, k, _ in gathers} == {"all_gather"}
    # the interpreter runs exactly the priced list, and the plan still computes the one-device numbers
    res = interpret(g, plan, mesh, {v: v for v in g.inputs}, lambda op, ins, sh: [op.id] * len(op.outputs), _Recorder())
    assert [(v, c.kind, c.axis, c.nbytes) for v, c in res.collectives if not c.is_free] == [
        (v, c.kind, c.axis, c.nbytes) for v, c in priced_collectives(plan)
    ]
    rng = np.random.default_rng(7)
    feeds = {v: rng.standard_normal(g.vars[v].shape) for v in g.inputs}
    outs, state = simulate(g, plan, mesh, feeds, _run_local)
    ref_outs, ref_state = simulate(g, ShardingPlan.replicated(p), mesh, feeds, _run_local)
    np.testing.assert_allclose(outs["loss"], ref_outs["loss"], rtol=1e-12)
    np.testing.assert_allclose(state["w"], ref_state["w"], rtol=1e-12)
    # price: the exact Terms (what the ILP optimises) and the plan agree, and predict counts both gathers
    assert p.terms().objective(ch) == pytest.approx(plan.objective, rel=1e-12)
    assert predict(plan).n_collectives == len(priced_collectives(plan))


def test_the_backward_copy_is_not_held_from_the_forward():
    mesh = Mesh((2,))
    g, p, ch = _gathered_weight_plan(mesh)
    plan = ShardingPlan.from_choices(p, ch)
    merged = ShardingProblem.from_json({**p.to_json(), "phases": {}})  # one phase: the copy is kept
    assert not merged.phases and p.phases
    one = ShardingPlan.from_choices(merged, ch)
    # one gather fewer when the copy is kept, and a higher peak: the 96-byte copy spans the forward's end
    assert len(priced_collectives(one)) == len(priced_collectives(plan)) - 1
    assert peak_with_buffers(p, plan) < peak_with_buffers(merged, one)


def test_a_partial_source_read_in_both_phases_is_reduced_once():
    mesh = Mesh((2,))
    g = two_phase_step()
    # y = x @ w made Partial (contraction split) and read whole by the loss (forward) and by dy (after)
    p = build_problem(
        g, rulebook(g), mesh, constraints=[Pin("x", Sharding([Shard(1)])), Pin("w", Sharding([Shard(0)]))]
    )
    ch = _choice(
        p,
        {
            "mm": lambda o: o.outputs[0] == Sharding([Partial("sum")]),
            "loss": lambda o: o.inputs[0] == Sharding([R]),
            "dy": lambda o: o.inputs[0] == Sharding([R]),
        },
    )
    plan = ShardingPlan.from_choices(p, ch)
    reduces = [c for v, c in priced_collectives(plan) if v == "y"]
    assert [c.kind for c in reduces] == ["all_reduce"]
    res = interpret(g, plan, mesh, {v: v for v in g.inputs}, lambda op, ins, sh: [op.id] * len(op.outputs), _Recorder())
    assert [c.kind for v, c in res.collectives if v == "y" and not c.is_free] == ["all_reduce"]
    one = all_reduce_cost(8 * 6 * 4, 2, mesh.alpha[0], mesh.beta[0])
    y_cost = sum(c.cost for c in reduces)
    assert y_cost == pytest.approx(one)
    assert p.terms().objective(ch) == pytest.approx(plan.objective, rel=1e-12)


@pytest.mark.parametrize("mesh_shape", [(2,)])
def test_ilp_matches_brute_force_with_phased_reshards(mesh_shape):
    mesh = Mesh(mesh_shape, alpha=[1e-6] * len(mesh_shape), beta=[1e-8] * len(mesh_shape))
    g = two_phase_step()
    p = build_problem(g, rulebook(g), mesh, constraints=[Pin("loss", Sharding([R] * len(mesh_shape)))])
    t = p.terms()
    assert any(s.merge is not None for s in t.shared)  # the phases are in the exact terms
    allowed = [np.flatnonzero(a) for a in t.allowed]
    assert np.prod([len(a) for a in allowed]) < 2e5, "too many plans to enumerate"
    best = min(t.objective(np.array(c)) for c in itertools.product(*allowed))
    pm = PluginManager()
    for coarse in (False, True):
        plan = pm.solve("ilp", p, {"coarsen": coarse, "mip_rel_gap": 1e-9})
        assert plan.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
        assert t.objective(np.asarray(plan.choices)) == pytest.approx(plan.objective, rel=1e-9)
