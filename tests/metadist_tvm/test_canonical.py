"""One source of truth: the same operator in three frontends has one canonical name, and
ShardCombine finds the same rules for it in each (TE on TVM kernels, aten on torch, lax on XLA)."""

import numpy as np
import pytest
import tvm
from tvm import te

import metadist_tvm
from metadist_core.discovery.canonical import canonical_name
from metadist_core.ir.placement import Partial, Replicate, Shard
from metadist_core.reference.plugin import rules_for as reference_rules_for
from metadist_core.discovery.rules import ShardingRule
from metadist_core.discovery.shardcombine import OpSpec, discover_rules
from metadist_tvm.trace import trace

A_SHAPE, B_SHAPE = (8, 6), (6, 4)
DOT_NN = (((1,), (0,)), ((), ()))
DOT_NT = (((1,), (1,)), ((), ()))


def _arrays(*shapes):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s) for s in shapes]


def _torch_rules(op_name, a, b):
    torch = pytest.importorskip("torch")
    op = getattr(torch.ops.aten, op_name).default
    try:
        from metadist_torch import rules_for
    except ImportError:  # the torch frontend's rules_for is not there: run ShardCombine on torch directly

        def rules_for(op, a, b):
            fn = lambda x, y: op(torch.from_numpy(x), torch.from_numpy(y)).numpy()
            return discover_rules(OpSpec(fn, [a.numpy(), b.numpy()], str(op)))

    return rules_for(op, torch.from_numpy(a), torch.from_numpy(b))


def _jax_rules(dimension_numbers, a, b):
    jax = pytest.importorskip("jax", reason="jax is not installed")
    from jax import lax

    try:
        from metadist_jax import rules_for as jax_rules_for
    except ImportError:
        jax_rules_for = None
    if jax_rules_for is not None:
        return jax_rules_for(lambda x, y: lax.dot_general(x, y, dimension_numbers), a, b)
    with jax.enable_x64(True):  # float64 on a scoped switch, not the process-wide flag
        fn = lambda x, y: np.asarray(lax.dot_general(x, y, dimension_numbers))
        return discover_rules(OpSpec(fn, [a, b], "jax.lax.dot_general"))


def test_canonical_names_of_a_2d_matmul():
    x = te.placeholder(A_SHAPE, name="x")
    w = te.placeholder(B_SHAPE, name="w")
    traced = trace([x, w], [metadist_tvm.topi.nn.matmul(x, w)])
    op = traced.graph.ops[0]
    shapes = [A_SHAPE, B_SHAPE]
    assert op.key == "te.topi.nn.matmul"
    assert canonical_name(op.key, op.attrs, shapes) == "matmul"
    assert canonical_name("aten.mm.default", {"args": [{"$in": 0}, {"$in": 1}], "kwargs": {}}, shapes) == "matmul"
    assert canonical_name("jax.lax.dot_general", {"dimension_numbers": DOT_NN}, shapes) == "matmul"
    jax_attrs = {
        "params": {
            "dimension_numbers": [[[1], [0]], [[], []]],
            "precision": None,
            "preferred_element_type": None,
            "out_sharding": None,
        }
    }  # as metadist_jax traces it
    assert canonical_name("jax.lax.dot_general", jax_attrs, shapes) == "matmul"
    assert canonical_name("np.matmul", {}, shapes) == "matmul"
    # not the same operator: transposed, batched, other dims contracted, unknown keys
    assert (
        canonical_name(
            "te.topi.nn.matmul", {"args": [{"$in": 0}, {"$in": 1}], "kwargs": {"transpose_a": True}}, [(6, 8), (6, 4)]
        )
        is None
    )
    assert canonical_name("aten.mm.default", {}, [(2, 8, 6), (6, 4)]) is None
    assert (
        canonical_name("jax.lax.dot_general", {"params": {"dimension_numbers": [[[0], [0]], [[], []]]}}, shapes) is None
    )
    assert canonical_name("te.topi.nn.dense", {"args": [{"$in": 0}, {"$in": 1}]}, [A_SHAPE, (4, 6)]) == "matmul_nt"
    assert canonical_name("aten.linear.default", {}, [A_SHAPE, (4, 6)]) == "matmul_nt"
    assert canonical_name("aten.linear.default", {}, [A_SHAPE, (4, 6), (4,)]) is None  # with a bias
    assert canonical_name("te.something_else", {}, shapes) is None


def test_matmul_rules_agree_across_frontends():
    a, b = _arrays(A_SHAPE, B_SHAPE)
    te_rules = set(metadist_tvm.rules_for(tvm.topi.nn.matmul, a, b))
    # the three splits that define a matmul are there
    R = Replicate()
    assert {
        ShardingRule((Shard(0), R), (Shard(0),)),
        ShardingRule((R, Shard(1)), (Shard(1),)),
        ShardingRule((Shard(1), Shard(0)), (Partial("sum"),)),
    } <= te_rules
    assert set(_torch_rules("mm", a, b)) == te_rules
    assert set(_jax_rules(DOT_NN, a, b)) == te_rules
    assert set(reference_rules_for("np.matmul", a, b)) == te_rules


def test_matmul_nt_rules_agree_across_frontends():
    a, w = _arrays(A_SHAPE, (4, 6))
    te_rules = set(metadist_tvm.rules_for(tvm.topi.nn.dense, a, w))
    assert set(_torch_rules("linear", a, w)) == te_rules
    assert set(_jax_rules(DOT_NT, a, w)) == te_rules
