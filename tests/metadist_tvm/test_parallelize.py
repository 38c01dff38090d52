"""parallelize runs TE graphs split over simulated meshes and gives the numpy result, whatever plan
it runs; kernels are compiled once per shape."""

import json

import numpy as np
import pytest
from tvm import te

import metadist_tvm
from metadist_core.problem.constraints import Pin
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Shard, Sharding, shard_shape
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.build import build_problem
from metadist_core.plan.simulate import devices, simulate
from metadist_tvm.execute import LocalRunner

from _tvm_graphs import conv_ref, convnet, draw, mlp, mlp_ref


def pin(var, *placements):
    return Pin(var, Sharding(placements))


@pytest.mark.parametrize("shape", [(2,), (4,)])
def test_mlp_matches_numpy(shape):
    inputs, y = mlp()
    xs = draw(inputs)
    want = mlp_ref(*[x.astype(np.float64) for x in xs])
    f = metadist_tvm.parallelize(inputs, y, shape)
    np.testing.assert_allclose(f(*xs), want, rtol=1e-4, atol=1e-6)
    # tensor parallel: w1 split by rows forces a column-split dense and a gather
    f = metadist_tvm.parallelize(inputs, y, shape, constraints=[pin("w1", Shard(0))])
    assert f.plan.var_shardings["w1"] == Sharding([Shard(0)])
    assert any(not c.is_free for _, c in f.plan.collectives())
    np.testing.assert_allclose(f(*xs), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape", [(2,), (4,)])
def test_conv_relu_pool_matches_numpy(shape):
    inputs, y = convnet()
    xs = draw(inputs, seed=1)
    want = conv_ref(*[x.astype(np.float64) for x in xs])
    for constraints in ([pin("x", Shard(0))], [pin("w", Shard(0))], [pin("x", Shard(1))]):
        f = metadist_tvm.parallelize(inputs, y, shape, constraints=constraints)
        assert not f.plan.var_shardings[constraints[0].var].is_fully_replicated()
        np.testing.assert_allclose(f(*xs), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)])
def test_random_plans_match_numpy(shape):
    """Every strategy the rules allow runs right on TVM kernels, with the plan's collectives."""
    inputs, y = mlp()
    xs = draw(inputs, seed=2)
    want = mlp_ref(*[x.astype(np.float64) for x in xs])
    mesh = Mesh(shape)
    f = metadist_tvm.parallelize(inputs, y, mesh)
    problem = build_problem(f.graph, f.result.rulebook, mesh)
    rng = np.random.default_rng(len(shape) * 10 + shape[0])
    runner = LocalRunner(f.traced)
    feed = dict(zip(f.graph.inputs, xs))
    for _ in range(6):
        choice = [int(rng.choice(np.flatnonzero(problem.allowed[i]))) for i in range(len(problem.nodes))]
        plan = ShardingPlan.from_choices(problem, choice)
        outs, _ = simulate(f.graph, plan, mesh, feed, runner)
        np.testing.assert_allclose(outs[f.graph.outputs[0]], want, rtol=1e-4, atol=1e-6)


def test_kernels_are_compiled_once_per_shape(tmp_path):
    cache = metadist_tvm.kernel_cache()
    inputs, y = mlp(batch=12, d_in=8, hidden=12, d_out=4)
    xs = draw(inputs, seed=3)
    mesh = Mesh((4,))
    cache.clear()
    f = metadist_tvm.parallelize(inputs, y, mesh, constraints=[pin("x", Shard(0))])
    after_discovery = cache.builds
    assert after_discovery > 0
    # discovery again (an empty rule cache, so every op is run again) builds nothing new
    again = metadist_tvm.parallelize(inputs, y, mesh, constraints=[pin("x", Shard(0))], cache_dir=str(tmp_path / "b"))
    assert again.result.rulebook.discovered == len(f.graph.ops)
    assert cache.builds == after_discovery  # (discovery runs at proxy sizes: its kernels are not these shapes')
    # the first run builds one kernel per distinct (op, local input shapes), in the graph's dtype
    expected = set()
    g = f.graph
    for op in g.ops:
        call = f.traced.calls[op.id]
        for d in devices(mesh):
            shapes = tuple(
                shard_shape(g.vars[v].shape, s, mesh, d) for v, s in zip(op.inputs, f.plan.strategies[op.id].inputs)
            )
            expected.add((op.key, json.dumps(call.attrs(), sort_keys=True), shapes))
    before = cache.builds
    np.testing.assert_allclose(f(*xs), mlp_ref(*xs), rtol=1e-4, atol=1e-6)
    assert cache.builds - before == len(expected)
    assert len(expected) < len(g.ops) * mesh.size  # the devices share their kernels
    before = cache.builds
    for _ in range(3):
        f(*xs)
    assert cache.builds == before  # later runs build nothing


def test_user_builders_and_unrecorded_computes():
    @metadist_tvm.op
    def gelu(x):
        def f(*i):
            v = x(*i)
            return 0.5 * v * (1.0 + te.tanh(0.7978845608 * (v + 0.044715 * v * v * v)))

        return te.compute(x.shape, f, name="gelu")

    x = te.placeholder((8, 6), name="x")
    w = te.placeholder((6, 4), name="w")
    y = metadist_tvm.topi.nn.matmul(gelu(x), w)
    f = metadist_tvm.parallelize([x, w], y, (2,), constraints=[pin("x", Shard(0))])
    assert [op.key for op in f.graph.ops] == ["te.gelu", "te.topi.nn.matmul"]
    a, b = draw([x, w])
    g = 0.5 * a * (1 + np.tanh(0.7978845608 * (a + 0.044715 * a**3)))
    np.testing.assert_allclose(f(a, b), g @ b, rtol=1e-4, atol=1e-5)

    # plain te.computes, on graph inputs or on other ops' outputs, are rebuilt at the shard shapes
    plain = te.compute((8, 6), lambda i, j: x[i, j] * 2.0, name="plain")
    f = metadist_tvm.parallelize([x, w], metadist_tvm.topi.nn.matmul(plain, w), (2,), constraints=[pin("x", Shard(0))])
    assert f.plan.var_shardings["x"] == Sharding([Shard(0)])
    np.testing.assert_allclose(f(a, b), (2 * a) @ b, rtol=1e-4, atol=1e-5)
    h = metadist_tvm.topi.nn.relu(x)
    after = te.compute((8, 6), lambda i, j: h[i, j] + 1.0, name="after")
    f = metadist_tvm.parallelize([x], after, (2,), constraints=[pin("x", Shard(1))])
    assert [op.key for op in f.graph.ops] == ["te.topi.nn.relu", "te.compute.after"]
    np.testing.assert_allclose(f(a), np.maximum(a, 0) + 1, rtol=1e-6)
    with pytest.raises(ValueError, match="placeholder 'w'.*not in inputs"):
        metadist_tvm.parallelize([x], y, (2,))


def test_reshape_and_transpose_in_a_graph():
    topi = metadist_tvm.topi
    x = te.placeholder((8, 6), name="x")
    y = topi.sum(topi.transpose(topi.reshape(topi.nn.relu(x), (4, 2, 6)), (0, 2, 1)), 2)
    a = draw([x])[0]
    want = np.maximum(a, 0).reshape(4, 2, 6).transpose(0, 2, 1).sum(2)
    for shape in [(2,), (4,)]:
        f = metadist_tvm.parallelize([x], y, shape, constraints=[pin("x", Shard(0))])
        np.testing.assert_allclose(f(a), want, rtol=1e-5, atol=1e-5)


def test_bad_calls_give_clear_errors():
    inputs, y = mlp()
    with pytest.raises(ValueError, match="unknown engine"):
        metadist_tvm.parallelize(inputs, y, (2,), engine="mpi")
    f = metadist_tvm.parallelize(inputs, y, (2,))
    with pytest.raises(TypeError, match="takes 3 inputs"):
        f(np.ones((8, 16)))
    with pytest.raises(ValueError, match=r"input x must have shape \(8, 16\)"):
        f(np.ones((8, 15)), np.ones((32, 16)), np.ones((8, 32)))


def test_uneven_splits():
    """A batch of 5 on 2 devices: pieces of 3 and 2 rows, each with its own kernel."""
    topi = metadist_tvm.topi
    x = te.placeholder((5, 6), name="x")
    w = te.placeholder((3, 6), name="w")
    y = topi.nn.softmax(topi.nn.dense(topi.nn.relu(x), w))
    a, b = draw([x, w], seed=4)
    h = np.maximum(a, 0) @ b.T
    e = np.exp(h - h.max(-1, keepdims=True))
    f = metadist_tvm.parallelize([x, w], y, (2,), constraints=[pin("x", Shard(0))])
    assert f.plan.var_shardings["x"] == Sharding([Shard(0)])
    np.testing.assert_allclose(f(a, b), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_the_driver_traces_plans_and_lowers_through_the_adapter():
    from metadist_core.driver.compile import compile_step
    from metadist_core.plugins import PluginManager
    from metadist_tvm.plugin import TvmFrontend

    inputs, y = mlp()
    xs = draw(inputs, seed=5)
    pm = PluginManager()
    assert "tvm" in pm.names("frontend")
    fe = pm.frontend("tvm")
    assert isinstance(fe, TvmFrontend) and fe.traits.op_prefixes == ("te.",)
    assert [op.key for op in fe.trace(None, (inputs, y), {}).graph.ops] == [
        "te.topi.nn.dense",
        "te.topi.nn.relu",
        "te.topi.nn.dense",
        "te.topi.nn.softmax",
    ]
    result = compile_step(fe, None, (inputs, y), {}, mesh=Mesh((2,)), plugins=pm)
    assert [op.key for op in result.graph.ops] == [
        "te.topi.nn.dense",
        "te.topi.nn.relu",
        "te.topi.nn.dense",
        "te.topi.nn.softmax",
    ]
    np.testing.assert_allclose(result.runnable(*xs), mlp_ref(*xs), rtol=1e-4, atol=1e-6)
    assert {"trace", "discover", "solve", "lower"} <= set(result.timings)
    # parallelize is the same driver: the program carries the plan, the graph and the timings
    f = metadist_tvm.parallelize(inputs, y, (2,))
    assert f.plan is not None and f.graph.name == "te_graph" and "solve" in f.timings
    # a one-device mesh gets the replicated plan without discovery
    one = metadist_tvm.parallelize(inputs, y, (1,))
    assert "discover" not in one.timings
    np.testing.assert_allclose(one(*xs), mlp_ref(*xs), rtol=1e-4, atol=1e-6)


def test_importing_the_plugin_imports_no_framework():
    import subprocess
    import sys

    code = (
        "import sys, metadist_tvm.plugin as p; p.metadist_frontend(); "
        "bad = [m for m in ('tvm', 'torch') if m in sys.modules]; assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
