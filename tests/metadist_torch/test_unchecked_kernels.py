"""Kernels that do not check their inputs' shapes never see mismatched pieces during discovery."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from metadist_core.ir.ir import MetaIR  # noqa: E402
from metadist_core.ir.placement import Replicate, Shard  # noqa: E402
from metadist_torch.ops.oprunner import op_spec  # noqa: E402
from metadist_core.discovery.shardcombine import discover_rules  # noqa: E402


def _graph(key, shapes, attrs, outs):
    g = MetaIR("one")
    for i, (s, dt) in enumerate(shapes):
        g.add_input(f"in{i}", s, dt)
    g.add_op(
        key, [f"in{i}" for i in range(len(shapes))], [(f"out{i}", o, "float32") for i, o in enumerate(outs)], attrs
    )
    return g


def test_log_softmax_backward_rejects_mismatched_pieces_instead_of_reading_past_them():
    g = _graph(
        "aten._log_softmax_backward_data.default",
        [((8, 16), "float32"), ((8, 16), "float32")],
        {"args": [{"$in": 0}, {"$in": 1}, 1, {"$dtype": "float32"}], "kwargs": {}},
        [(8, 16)],
    )
    spec = op_spec(g.ops[0], g)
    x = np.random.default_rng(0).standard_normal((8, 16))
    with pytest.raises(Exception):  # noqa: B017 - the native kernel would run on a half-size grad and read past it
        spec.fn(x[:4], x)
    rules = discover_rules(spec, 2)
    assert {(r.inputs, r.outputs) for r in rules} >= {((Shard(0), Shard(0)), (Shard(0),))}
    shard_vs_whole = [r for r in rules if {type(p) for p in r.inputs} == {Shard, Replicate}]
    assert not shard_vs_whole, shard_vs_whole


def test_layer_norm_backward_rejects_mismatched_statistics():
    args = [{"$in": 0}, {"$in": 1}, [16], {"$in": 2}, {"$in": 3}, {"$in": 4}, {"$in": 5}, [True, True, True]]
    g = _graph(
        "aten.native_layer_norm_backward.default",
        [
            ((8, 16), "float32"),
            ((8, 16), "float32"),
            ((8, 1), "float32"),
            ((8, 1), "float32"),
            ((16,), "float32"),
            ((16,), "float32"),
        ],
        {"args": args, "kwargs": {}},
        [(8, 16), (16,), (16,)],
    )
    spec = op_spec(g.ops[0], g)
    ex = [np.asarray(x) for x in spec.example_inputs]
    with pytest.raises(Exception):  # noqa: B017 - mean/rstd for half the rows: the native kernel reads past them
        spec.fn(ex[0], ex[1], ex[2][:4], ex[3][:4], ex[4], ex[5])
    rules = discover_rules(spec, 2)
    batch = (Shard(0), Shard(0), Shard(0), Shard(0), Replicate(), Replicate())
    assert any(r.inputs == batch for r in rules)


def test_max_pool_backward_never_writes_through_indices_of_another_piece():
    """Row pieces of the max-pool indices point past a row piece of the input: the native kernel
    writes out of bounds (heap corruption); discovery must reject the candidate, not run it."""
    kw = [[2, 2], [2, 2], [0, 0], [1, 1], False]
    g = _graph(
        "aten.max_pool2d_with_indices_backward.default",
        [((2, 3, 4, 4), "float32"), ((2, 3, 8, 8), "float32"), ((2, 3, 4, 4), "int64")],
        {"args": [{"$in": 0}, {"$in": 1}, *kw, {"$in": 2}], "kwargs": {}},
        [(2, 3, 8, 8)],
    )
    spec = op_spec(g.ops[0], g)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    _, idx = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    gr = np.random.default_rng(0).standard_normal((2, 3, 4, 4))
    with pytest.raises(Exception):  # noqa: B017 - whichever error the kernel check raises
        spec.fn(gr[:, :, 2:], x.numpy()[:, :, 4:], idx.numpy()[:, :, 2:])
    rules = discover_rules(spec, 2)
    assert any(r.inputs == (Shard(0), Shard(0), Shard(0)) for r in rules)
    assert not any(r.inputs[1] == Shard(2) for r in rules)


def test_adaptive_avg_pool_backward_checks_channels_before_running():
    g = _graph(
        "aten._adaptive_avg_pool2d_backward.default",
        [((2, 8, 1, 1), "float32"), ((2, 8, 4, 4), "float32")],
        {"args": [{"$in": 0}, {"$in": 1}], "kwargs": {}},
        [(2, 8, 4, 4)],
    )
    spec = op_spec(g.ops[0], g)
    gr, x = (np.asarray(a) for a in spec.example_inputs)
    with pytest.raises(ValueError, match="channel dims"):  # natively: heap corruption
        spec.fn(gr, x[:, :4])
    rules = discover_rules(spec, 2)
    assert any(r.inputs == (Shard(1), Shard(1)) for r in rules) and any(r.inputs == (Shard(0), Shard(0)) for r in rules)
    assert not any(r.inputs[0] != r.inputs[1] and Shard(1) in r.inputs for r in rules)
