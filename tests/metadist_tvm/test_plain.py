"""Users' own tensor expressions: plain ``te.compute`` and plain ``tvm.topi`` graphs are split without
wrappers (each compute's body is rebuilt at the shard shapes), and what cannot be rebuilt runs replicated."""

import logging

import numpy as np
import pytest
from tvm import te, topi

import metadist_tvm
from metadist_core.problem.constraints import Pin
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding
from metadist_core.discovery.rules import ShardingRule
from metadist_core.plan.simulate import assemble, devices, distribute
from metadist_tvm.oprunner import run_call
from metadist_tvm.plain import plain_call
from metadist_tvm.rebuild import ComputeRebuilder, NotRebuildable

from _tvm_graphs import conv_ref, draw, plain_convnet, plain_mlp, plain_mlp_ref

R = Replicate()


def pin(var, *placements):
    return Pin(var, Sharding(placements))


def plain_matmul(m=8, k=6, n=4):
    a = te.placeholder((m, k), name="a")
    b = te.placeholder((k, n), name="b")
    r = te.reduce_axis((0, k), name="r")
    return a, b, te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="mm")


def brute_force(tensor, rule, seed=0):
    """Split the inputs of ``tensor``'s op per ``rule`` on 2 simulated devices, run each device's piece,
    combine the outputs per the rule and compare with the whole op (in the compute's own dtype)."""
    call = plain_call(tensor)
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal([int(s) for s in t.shape]).astype(str(t.dtype)) for t in call.inputs]
    want = run_call(call, xs)[0]
    mesh = Mesh((2,))
    pieces = [distribute(x, Sharding([p]), mesh) for x, p in zip(xs, rule.inputs)]
    outs = {d: run_call(call, [p[d] for p in pieces])[0] for d in devices(mesh)}
    got = assemble(outs, Sharding([rule.outputs[0]]), mesh)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rules_of_a_plain_te_matmul_hold_by_brute_force():
    a, b, c = plain_matmul()
    rules = set(metadist_tvm.rules_for(c))
    wanted = [
        ShardingRule((Shard(0), R), (Shard(0),)),
        ShardingRule((R, Shard(1)), (Shard(1),)),
        ShardingRule((Shard(1), Shard(0)), (Partial("sum"),)),
    ]
    assert set(wanted) <= rules
    assert ShardingRule((Shard(0), Shard(0)), (Shard(0),)) not in rules
    for k, r in enumerate(wanted):
        brute_force(c, r, seed=k)


def test_the_rebuilder_follows_shapes_and_refuses_what_it_cannot():
    a, b, c = plain_matmul()
    rb = ComputeRebuilder(c.op)
    assert rb.new_extents([(4, 6), (6, 4)]) == [4, 4, 6]
    assert rb.new_extents([(8, 3), (3, 2)]) == [8, 2, 3]
    with pytest.raises(NotRebuildable, match="must agree"):
        rb.new_extents([(8, 3), (6, 4)])
    x = te.placeholder((8, 8), name="x")
    shifted = te.compute((8, 8), lambda i, j: x[i, (j + 1) % 8], name="shifted")
    with pytest.raises(NotRebuildable, match="dim 1 of input 0"):
        ComputeRebuilder(shifted.op).new_extents([(8, 4)])
    rules = set(metadist_tvm.rules_for(shifted))
    assert ShardingRule((Shard(0),), (Shard(0),)) in rules and ShardingRule((Shard(1),), (Shard(1),)) not in rules


def test_conv2d_and_pooling_from_plain_topi():
    x = te.placeholder((2, 4, 6, 6), name="x")
    w = te.placeholder((6, 4, 3, 3), name="w")
    conv = topi.nn.conv2d_nchw(x, w, 1, 0, 1)  # no padding: one compute over the placeholders
    rules = set(metadist_tvm.rules_for(conv))
    assert {
        ShardingRule((Shard(0), R), (Shard(0),)),
        ShardingRule((R, Shard(0)), (Shard(1),)),
        ShardingRule((Shard(1), Shard(1)), (Partial("sum"),)),
    } <= rules
    assert ShardingRule((Shard(2), R), (Shard(2),)) not in rules
    for r in [ShardingRule((Shard(0), R), (Shard(0),)), ShardingRule((Shard(1), Shard(1)), (Partial("sum"),))]:
        brute_force(conv, r)
    pool = topi.nn.pool2d(x, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "max")
    prules = set(metadist_tvm.rules_for(pool))
    assert {ShardingRule((Shard(0),), (Shard(0),)), ShardingRule((Shard(1),), (Shard(1),))} <= prules

    inputs, y = plain_convnet()
    xs = draw(inputs, seed=1)
    want = conv_ref(*[v.astype(np.float64) for v in xs])
    for constraints in ([pin("x", Shard(0))], [pin("w", Shard(0))], [pin("x", Shard(1))]):
        f = metadist_tvm.parallelize(inputs, y, (2,), constraints=constraints)
        assert not f.plan.var_shardings[constraints[0].var].is_fully_replicated()
        np.testing.assert_allclose(f(*xs), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pins", [[], [("X", Shard(0))], [("W1", Shard(0))], [("X", Shard(1))]])
def test_a_plain_topi_graph_on_four_devices_matches_numpy(pins):
    inputs, y = plain_mlp()
    f = metadist_tvm.parallelize(inputs, y, (4,), constraints=[pin(v, p) for v, p in pins])
    assert all(op.key.startswith("te.compute.") for op in f.graph.ops)
    for v, p in pins:
        assert f.plan.var_shardings[v] == Sharding([p])
    for seed in (0, 1):  # two input sets
        xs = draw(inputs, seed=seed)
        np.testing.assert_allclose(f(*xs), plain_mlp_ref(*[v.astype(np.float64) for v in xs]), rtol=1e-4, atol=1e-6)


def test_an_extern_op_runs_replicated_with_one_warning(caplog):
    x = te.placeholder((4, 6), name="x")
    h = topi.nn.relu(x)
    y = topi.exp(topi.cumsum(h, 1))  # cumsum is an extern op on llvm
    assert isinstance(topi.cumsum(h, 1).op, te.ExternOp)
    with caplog.at_level(logging.WARNING, logger="metadist"):
        f = metadist_tvm.parallelize([x], y, (2,), constraints=[pin("x", Shard(0))])
    cums = [op for op in f.graph.ops if op.key.startswith("te.extern.")]
    assert len(cums) == 1 and cums[0].inputs == ["x"]  # it reads the graph input and recomputes the relu
    warned = [r for r in caplog.records if cums[0].key in r.getMessage() and "replicated" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    a = draw([x], seed=3)[0]
    np.testing.assert_allclose(f(a), np.exp(np.cumsum(np.maximum(a, 0), 1)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        metadist_tvm.rules_for(y.op.input_tensors[0])
