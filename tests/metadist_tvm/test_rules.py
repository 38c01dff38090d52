"""rules_for on TE operators: every rule is verified by ShardCombine on TVM kernels, and the known
splits of each operator are among them."""

import numpy as np
import pytest
import tvm
from tvm import te

import metadist_tvm
from metadist_core.ir.placement import Partial, Replicate, Shard
from metadist_core.discovery.rules import ShardingRule

R = Replicate()


def rule(ins, outs):
    return ShardingRule(tuple(ins), tuple(outs))


def rnd(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape)


def test_matmul_row_column_and_contraction_splits():
    rules = set(metadist_tvm.rules_for(tvm.topi.nn.matmul, rnd(8, 6), rnd(6, 4)))
    assert rule([Shard(0), R], [Shard(0)]) in rules  # rows
    assert rule([R, Shard(1)], [Shard(1)]) in rules  # columns
    assert rule([Shard(1), Shard(0)], [Partial("sum")]) in rules  # contraction -> Partial(sum)
    assert rule([Shard(0), Shard(0)], [Shard(0)]) not in rules


def test_dense_and_batch_matmul():
    dense = set(metadist_tvm.rules_for(tvm.topi.nn.dense, rnd(8, 6), rnd(4, 6)))
    assert {
        rule([Shard(0), R], [Shard(0)]),
        rule([R, Shard(0)], [Shard(1)]),
        rule([Shard(1), Shard(1)], [Partial("sum")]),
    } <= dense
    bmm = set(metadist_tvm.rules_for(tvm.topi.nn.batch_matmul, rnd(2, 4, 6), rnd(2, 8, 6)))
    assert {
        rule([Shard(0), Shard(0)], [Shard(0)]),
        rule([Shard(1), R], [Shard(1)]),
        rule([Shard(2), Shard(2)], [Partial("sum")]),
    } <= bmm


def test_conv2d_nchw():
    rules = set(metadist_tvm.rules_for(tvm.topi.nn.conv2d_nchw, rnd(2, 4, 6, 6), rnd(6, 4, 3, 3), 1, 1, 1))
    assert rule([Shard(0), R], [Shard(0)]) in rules  # batch
    assert rule([R, Shard(0)], [Shard(1)]) in rules  # output channels
    assert rule([Shard(1), Shard(1)], [Partial("sum")]) in rules  # input channels
    assert rule([Shard(2), R], [Shard(2)]) not in rules  # rows need a halo


def test_softmax_relu_and_layer_norm():
    sm = set(metadist_tvm.rules_for(tvm.topi.nn.softmax, rnd(4, 6)))
    assert sm == {rule([R], [R]), rule([Shard(0)], [Shard(0)])}
    relu = set(metadist_tvm.rules_for(tvm.topi.nn.relu, rnd(4, 6)))
    assert {
        rule([Shard(0)], [Shard(0)]),
        rule([Shard(1)], [Shard(1)]),
        rule([Partial("max")], [Partial("max")]),
    } <= relu
    assert rule([Partial("sum")], [Partial("sum")]) not in relu
    # layer_norm takes only float32 in TVM 0.27: it is discovered in float32
    ln = set(metadist_tvm.rules_for(tvm.topi.nn.layer_norm, rnd(4, 6), rnd(6), rnd(6), [-1]))
    assert rule([Shard(0), R, R], [Shard(0)]) in ln
    assert not any(r.inputs[0] == Shard(1) for r in ln)


def test_broadcasting_add_and_multiply():
    add = set(metadist_tvm.rules_for(tvm.topi.add, rnd(4, 6), rnd(6)))
    assert {
        rule([Shard(0), R], [Shard(0)]),
        rule([Shard(1), Shard(0)], [Shard(1)]),
        rule([Partial("sum"), Partial("sum")], [Partial("sum")]),
    } <= add
    mul = set(metadist_tvm.rules_for(tvm.topi.multiply, rnd(4, 6), rnd(4, 1)))
    assert {
        rule([Shard(0), Shard(0)], [Shard(0)]),
        rule([Shard(1), R], [Shard(1)]),
        rule([Partial("sum"), R], [Partial("sum")]),
    } <= mul


def test_reductions():
    s = set(metadist_tvm.rules_for(tvm.topi.sum, rnd(4, 6), 1))
    assert {rule([Shard(0)], [Shard(0)]), rule([Shard(1)], [Partial("sum")])} <= s
    m = set(metadist_tvm.rules_for(tvm.topi.max, rnd(4, 6), 0))
    assert {rule([Shard(1)], [Shard(0)]), rule([Shard(0)], [Partial("max")])} <= m


def test_pooling():
    mx = set(metadist_tvm.rules_for(tvm.topi.nn.pool2d, rnd(2, 4, 4, 4), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "max"))
    assert {rule([Shard(d)], [Shard(d)]) for d in range(4)} <= mx  # windows do not straddle the split
    assert rule([Partial("max")], [Partial("max")]) in mx
    avg = set(metadist_tvm.rules_for(tvm.topi.nn.pool2d, rnd(2, 4, 4, 4), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "avg"))
    assert rule([Partial("sum")], [Partial("sum")]) in avg
    # 3x3 windows with stride 1 straddle a split of the rows
    win = set(metadist_tvm.rules_for(tvm.topi.nn.pool2d, rnd(2, 4, 6, 6), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), "max"))
    assert rule([Shard(2)], [Shard(2)]) not in win and rule([Shard(1)], [Shard(1)]) in win


def test_reshape_and_transpose():
    rs = set(metadist_tvm.rules_for(tvm.topi.reshape, rnd(4, 6), (8, 3)))
    assert rule([Shard(0)], [Shard(0)]) in rs
    assert rule([Shard(1)], [Shard(1)]) not in rs
    tr = set(metadist_tvm.rules_for(tvm.topi.transpose, rnd(4, 6, 2), (2, 0, 1)))
    assert {rule([Shard(0)], [Shard(1)]), rule([Shard(1)], [Shard(2)]), rule([Shard(2)], [Shard(0)])} <= tr


def test_a_user_builder_and_a_recorded_tensor():
    @metadist_tvm.op
    def scaled_exp(x, factor):
        return te.compute(x.shape, lambda *i: te.exp(x(*i)) * factor, name="scaled_exp")

    rules = set(metadist_tvm.rules_for(scaled_exp, rnd(4, 6), 0.5))
    assert rules == {
        rule([R], [R]),
        rule([Shard(0)], [Shard(0)]),
        rule([Shard(1)], [Shard(1)]),
        rule([Partial("max")], [Partial("max")]),
        rule([Partial("min")], [Partial("min")]),
    }
    a = te.placeholder((8, 6), name="a")
    b = te.placeholder((6, 4), name="b")
    c = metadist_tvm.topi.nn.matmul(a, b)
    assert set(metadist_tvm.rules_for(c)) >= {
        rule([Shard(0), R], [Shard(0)]),
        rule([Shard(1), Shard(0)], [Partial("sum")]),
    }


def test_a_builder_that_reads_out_of_its_piece_gets_no_split():
    def shift(x):  # y[i] = x[(i + 1) % n]: a split of dim 0 is wrong
        n = x.shape[0]
        return te.compute(x.shape, lambda i: x[(i + 1) % n], name="shift")

    rules = set(metadist_tvm.rules_for(shift, rnd(8)))
    assert rule([Shard(0)], [Shard(0)]) not in rules
    assert rule([R], [R]) in rules


def test_a_plain_tensor_gets_the_rules_of_its_rebuilt_compute():
    a = te.placeholder((4,), name="a")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="plain")
    assert rule([Shard(0)], [Shard(0)]) in set(metadist_tvm.rules_for(b))
    ext = tvm.topi.cumsum(a, 0)  # an extern op: no body to rebuild
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        metadist_tvm.rules_for(ext)
