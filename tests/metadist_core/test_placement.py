import pytest

from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import (
    IndivisibleError,
    Partial,
    Replicate,
    Shard,
    Sharding,
    chunk_bounds,
    chunk_sizes,
    parse_placement,
    shard_shape,
)


def test_placements_are_values():
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0)
    assert Shard(1).dim == 1 and Partial("max").reduce == "max" and Partial().reduce == "sum"
    assert not hasattr(Replicate(), "dim") and not hasattr(Replicate(), "reduce")
    assert {Shard(0), Shard(0), Replicate()} == {Shard(0), Replicate()}
    for p in (Shard(2), Replicate(), Partial("avg"), Partial("min")):
        assert parse_placement(str(p)) == p
    with pytest.raises(ValueError, match="sum, avg, max, min"):
        Partial("prod")


def test_chunk_sizes_follow_torch_chunk():
    assert chunk_sizes(8, 4) == [2, 2, 2, 2]
    assert chunk_sizes(7, 2) == [4, 3]
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]
    assert sum(chunk_sizes(50257, 8)) == 50257
    assert [chunk_bounds(7, 2, r) for r in range(2)] == [(0, 4), (4, 7)]


def test_shard_shape_nd_mesh():
    mesh = Mesh((2, 4), ("dp", "tp"))
    s = Sharding([Shard(0), Shard(1)])
    assert shard_shape((8, 16), s, mesh) == (4, 4)
    assert shard_shape((8, 16), Sharding([Shard(0), Shard(0)]), mesh) == (1, 16)
    assert shard_shape((8, 16), Sharding([Replicate(), Partial()]), mesh) == (8, 16)
    # uneven: the last device gets less
    assert shard_shape((7, 3), Sharding([Shard(0), Replicate()]), mesh, coords=(1, 0)) == (3, 3)


def test_indivisible_error_names_axis_dim_and_shape():
    mesh = Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(IndivisibleError) as e:
        shard_shape((8, 50257), Sharding([Replicate(), Shard(1)]), mesh, even=True)
    msg = str(e.value)
    assert "'tp'" in msg and "4 ways" in msg and "dim 1" in msg and "(8, 50257)" in msg


def test_mesh_validation_and_json():
    m = Mesh((2, 2), ("a", "b"), alpha=[1e-6, 1e-5], beta=1e-9)
    assert m.size == 4 and m.ndim == 2 and m.coordinates(3) == (1, 1) and m.coordinates(2) == (1, 0)
    assert Mesh.from_json(m.to_json()) == m
    assert Mesh.parse("2x4").shape == (2, 4) and Mesh.parse("8").shape == (8,)
    with pytest.raises(ValueError, match="2 axes but 1 axis names"):
        Mesh((2, 2), ("a",))
    with pytest.raises(ValueError, match="positive"):
        Mesh((0, 2))
    with pytest.raises(ValueError, match="write it like"):
        Mesh.parse("two")
    with pytest.raises(ValueError, match="2 axes but alpha gives 3"):
        Mesh((2, 2), alpha=[1, 2, 3])


def test_sharding_queries():
    s = Sharding([Shard(0), Partial(), Shard(0)])
    assert s.sharded_dims() == {0: [0, 2]} and s.has_partial() and not s.is_fully_replicated()
    assert Sharding.replicated(3).is_fully_replicated()
    assert Sharding.from_json(s.to_json()) == s
    assert str(s) == "[S(0), P(sum), S(0)]"
