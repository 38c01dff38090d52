"""Proxy sizes: the two instances discovery runs keep every property a rule may depend on (remainder mod the
axis, distinctness, which devices an uneven split leaves empty, products a view needs), and the second is
no larger than the first; a placement that leaves a device an empty piece is never planned."""

import math

import pytest

from metadist_core.discovery.patterns import SMALL, proxy_sizes, size_basis
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Shard, Sharding, chunk_sizes, splits_nonempty
from metadist_core.discovery.rules import _tensor_ok

ATTENTION = [(8, 12, 128, 64)] * 3 + [(8, 12, 128)]
VIEW = [(8, 128, 768), (8, 128, 12, 64)]


@pytest.mark.parametrize("shapes", [ATTENTION, VIEW, [(100, 64, 3)], [(1000, 50257)]])
@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_proxy_instances_keep_the_pattern(shapes, n):
    basis = size_basis(shapes)
    first, second = proxy_sizes(basis, n, 0), proxy_sizes(basis, n, 1)
    for sizes in (first, second):
        bases = [s for s in basis if basis[s][0] == "base"]
        assert len({sizes[s] for s in bases}) == len(bases)  # distinct stay distinct
        for s in bases:
            assert sizes[s] % n == s % n and sizes[s] > SMALL  # remainder kept
            assert splits_nonempty(sizes[s], n) == splits_nonempty(s, n)  # empty pieces kept
            assert all(abs(sizes[s] - sizes[t]) > SMALL for t in bases if t != s)
        for s, e in basis.items():
            if e[0] == "prod":
                assert sizes[s] == math.prod(sizes.get(f, f) for f in e[1:])  # a view's product kept
    assert second != first  # another instance


@pytest.mark.parametrize("n", [2, 4])
def test_the_second_instance_changes_every_size_of_the_attention_step_and_costs_no_more(n):
    basis = size_basis(ATTENTION)
    first, second = proxy_sizes(basis, n, 0), proxy_sizes(basis, n, 1)
    assert sorted(first.values()) == sorted(second.values())  # the same sizes, handed round
    assert all(first[s] != second[s] for s in basis)
    numel = [math.prod(sizes[d] for d in ATTENTION[0]) for sizes in (first, second)]
    assert numel[0] == numel[1] < 200_000


def test_a_split_that_leaves_a_device_empty_is_never_planned():
    assert chunk_sizes(12, 8) == [2, 2, 2, 2, 2, 2, 0, 0]
    assert not splits_nonempty(12, 8) and splits_nonempty(16, 8) and splits_nonempty(100, 8)
    mesh = Mesh((8,))
    assert not _tensor_ok((8, 12, 128), Sharding((Shard(1),)), mesh, 8)  # 12 heads over 8 devices
    assert _tensor_ok((8, 16, 128), Sharding((Shard(1),)), mesh, 8)
    assert _tensor_ok((8, 12, 128), Sharding((Shard(2),)), mesh, 8)


def _one_op(shape):
    from metadist_core.ir.ir import MetaIR

    g = MetaIR("one")
    g.add_input("x", shape, "float32", "input")
    g.add_op("aten.relu.default", ["x"], [("y", shape, "float32")], id="relu")
    return g.ops[0], g


def test_a_pattern_tells_apart_sizes_whose_split_leaves_a_device_empty():
    from metadist_core.discovery.patterns import op_pattern

    key = {s: op_pattern(*_one_op((s, 6)), 8).key for s in (20, 28, 36)}
    assert not splits_nonempty(20, 8) and not splits_nonempty(28, 8) and splits_nonempty(36, 8)
    assert key[20] == key[28] != key[36]  # all three are 4 mod 8; 36 gives every device a piece


def test_sizes_below_the_axis_size_stay_exact_so_a_proxy_is_never_larger_than_the_op():
    """GPT-2 XL's attention on an axis of 16 (batch 8, 25 heads): proxies used to come out larger than the
    real tensors (every size pushed to at least 16), past the proxy budget, and discovery then ran the op at
    its real shapes with 16 pieces of each (6 GB)."""
    from metadist_core.discovery.patterns import exact_below, op_pattern, proxy_op

    op, g = _one_op((8, 25, 128, 64))
    assert exact_below(16) == 15 and exact_below(2) == SMALL
    for inst in (0, 1):
        p, pg = proxy_op(op, g, 16, inst)
        shape = pg.vars[p.inputs[0]].shape
        assert shape[0] == 8 and math.prod(shape) < math.prod((8, 25, 128, 64)) // 8
    assert op_pattern(op, g, 16).key != op_pattern(*_one_op((9, 25, 128, 64)), 16).key  # 8 and 9 are exact
