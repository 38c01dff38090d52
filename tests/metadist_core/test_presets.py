"""Strategy presets and constraints by name, on a small training step of numpy reference ops: each preset
pins the layout it promises, the simulated plan gives the unsplit numbers, bad names fail clearly."""

from __future__ import annotations

import numpy as np
import pytest

from metadist_core.config import load_settings
from metadist_core.driver.compile import plan_graph
from metadist_core.driver.step import CompiledStep
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding
from metadist_core.config import STRATEGIES
from metadist_core.problem.presets import preset_constraints
from metadist_core.reference.plugin import GraphBuilder, ReferenceFrontend, run_graph, run_local
from metadist_core.plan.simulate import simulate


def mlp_step():
    """x @ w1 -> gelu -> @ w2 -> mean; momentum SGD on w1, plain SGD on w2 (gradient stand-ins)."""
    g = GraphBuilder("mlp_step")
    x = g.input("x", (8, 16))
    w1, w2 = g.param("w1", (16, 32)), g.param("w2", (32, 16))
    m1 = g.input("m1", (16, 32), role="optimizer_state")
    h = g.op("np.matmul", x, w1)
    a = g.op("np.gelu", h)
    y = g.op("np.matmul", a, w2)
    loss = g.op("np.mean", y)
    g2 = g.op("np.matmul", g.op("np.transpose", a, perm=[1, 0]), y)
    g1 = g.op("np.matmul", g.op("np.transpose", x, perm=[1, 0]), h)
    m1n = g.op("np.add", g.op("np.scale", m1, factor=0.9), g1)
    w1n = g.op("np.sub", w1, g.op("np.scale", m1n, factor=0.01))
    # what SGD's update reads is the scaled gradient; the gradient recognised is the one it is made from, the
    # earliest value of w2's shape that can be a partial sum (Adam reads (1-b1)*g and g*g, both from g)
    g2s = g.op("np.scale", g2, factor=0.01)
    w2n = g.op("np.sub", w2, g2s)
    g.output(loss, w1n, w2n, m1n)
    ir = g.ir
    for s, n in (("w1", w1n), ("w2", w2n), ("m1", m1n)):
        ir.alias(s, n)
    for v, label in (("w1", "mlp.fc1.weight"), ("w2", "mlp.fc2.weight"), ("m1", "mlp.fc1.weight.momentum")):
        ir.vars[v].label = label
    return ir, g1, g2


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rules"))


def _check_numbers(ir, plan, mesh):
    rng = np.random.default_rng(0)
    inputs = {v: rng.standard_normal(ir.vars[v].shape) for v in ir.inputs}
    want = run_graph(ir, inputs)
    outs, state = simulate(ir, plan, mesh, inputs, run_local)
    for o, v in outs.items():
        np.testing.assert_allclose(v, want[o], rtol=1e-6, atol=1e-8)
    for s, v in state.items():
        np.testing.assert_allclose(v, want[ir.aliases[s]], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_every_preset_pins_its_layout_and_keeps_the_numbers(mesh_shape, cache):
    ir, g1, g2 = mlp_step()
    mesh = Mesh(mesh_shape)
    nd = len(mesh_shape)
    R, S0, S1 = (Sharding((p,) * nd) for p in (Replicate(), Shard(0), Shard(1)))
    for name in ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "tp+dp"):
        res = plan_graph(ir, mesh, cache_dir=cache, progress=False, strategy=name)
        sh = res.plan.input_shardings
        _check_numbers(ir, res.plan, mesh)
        if name in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            assert sh["x"] == S0, name
            assert (sh["w1"], sh["w2"]) == ((S0, S0) if name in ("zero3", "fsdp") else (R, R)), name
            assert sh["m1"] == (R if name == "ddp" else S0), name
        kinds = {c.kind for _, c in res.plan.collectives()}
        if name in ("ddp", "zero1", "zero2"):  # gradients made as partial sums, then reduced
            pc = preset_constraints(res.problem.unsteered, name)
            assert pc.gradients == {g1: "w1", g2: "w2"}
            P = Sharding((Partial("sum"),) * nd)
            assert res.plan.var_shardings[g1] == P and res.plan.var_shardings[g2] == P
            assert ("all_reduce" if name == "ddp" else "reduce_scatter") in kinds, (name, kinds)
        if name == "tp":  # Megatron pair: w1 by columns, w2 by rows; state follows w1; batch whole
            assert preset_constraints(res.problem.unsteered, name).pairs == [("w1", "w2")]
            assert (sh["w1"], sh["w2"], sh["m1"], sh["x"]) == (S1, S0, S1, R)
        if name in ("tp", "tp+dp"):  # Megatron never gathers a weight: the matmuls read them split
            assert not [(e.var, str(c)) for e, c in res.plan.collectives() if e.var in ("w1", "w2")], name
        if name == "tp+dp":
            last = lambda p: Sharding((Replicate(),) * (nd - 1) + (p,))  # noqa: E731
            dp = Sharding((Shard(0),) * (nd - 1) + (Replicate(),))
            assert (sh["w1"], sh["w2"], sh["x"]) == (last(Shard(1)), last(Shard(0)), dp)
        assert res.plan.stats.strategy == name


def test_constraints_by_name_and_glob_are_kept(cache):
    ir, _, _ = mlp_step()
    mesh = Mesh((2, 2))
    res = plan_graph(
        ir,
        mesh,
        cache_dir=cache,
        progress=False,
        constraints={"mlp.fc1.weight": (Shard(0), Replicate()), "mlp.fc2.*": Replicate()},
    )
    sh = res.plan.input_shardings
    assert sh["w1"] == Sharding((Shard(0), Replicate()))
    assert sh["w2"] == Sharding((Replicate(), Replicate()))
    _check_numbers(ir, res.plan, mesh)
    assert res.plan.placements() == {
        "mlp.fc1.weight": (Shard(0), Replicate()),
        "mlp.fc2.weight": (Replicate(), Replicate()),
    }


def test_bad_names_and_placements_fail_clearly(cache):
    ir, _, _ = mlp_step()
    mesh = Mesh((2,))
    with pytest.raises(ValueError, match=r"'mlp\.fc3\.weight' names no value.*did you mean 'mlp\.fc(1|2)\.weight'"):
        plan_graph(ir, mesh, cache_dir=cache, progress=False, constraints={"mlp.fc3.weight": Replicate()})
    with pytest.raises(ValueError, match=r"no rule allows \[S\(2\)\] for mlp\.fc1\.weight"):
        plan_graph(ir, mesh, cache_dir=cache, progress=False, constraints={"mlp.fc1.weight": Shard(2)})
    with pytest.raises(ValueError, match=r"3 placements .* for a 1-axis mesh"):
        plan_graph(
            ir,
            mesh,
            cache_dir=cache,
            progress=False,
            constraints={"mlp.fc1.weight": (Shard(0), Replicate(), Replicate())},
        )


def test_an_unknown_strategy_lists_the_presets_at_decoration():
    with pytest.raises(
        ValueError,
        match=r"unknown strategy 'zero4'; choose one of auto, ddp, zero1, zero2, zero3, "
        r"fsdp, tp, tp\+dp",
    ):
        CompiledStep(ReferenceFrontend(), lambda: None, strategy="zero4")
    assert load_settings(strategy="FSDP").strategy == "fsdp"
    assert "tp+dp" in STRATEGIES
