"""Cost model: collective formulas, and reshard sequences checked by simulating them on numpy pieces."""

import itertools

import numpy as np
import pytest

from metadist_core.cost.model import Collective, all_gather_cost, all_reduce_cost, compute_cost, local_bytes
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding, chunk_bounds, largest_local_shape
from metadist_core.cost.reshard import reshard, reshard_cost

R, P = Replicate(), Partial("sum")


def _take(x, dim, n, i):
    lo, hi = chunk_bounds(x.shape[dim], n, i)
    return np.take(x, np.arange(lo, hi), axis=dim)


def layout(full, sh: Sharding, mesh: Mesh, rng):
    """Per-device pieces of ``full`` under ``sh`` (Partial sum: random addends)."""
    pieces = {}
    for c in itertools.product(*map(range, mesh.shape)):
        x = full
        for a, p in enumerate(sh):
            if isinstance(p, Shard):
                x = _take(x, p.dim, mesh.shape[a], c[a])
        pieces[c] = x.copy()
    for a, p in enumerate(sh):
        if isinstance(p, Partial):
            for c in pieces:
                if c[a] == 0:
                    group = [c[:a] + (j,) + c[a + 1 :] for j in range(mesh.shape[a])]
                    total = pieces[c].copy()
                    for g in group[1:]:
                        r = rng.integers(-5, 5, size=total.shape).astype(float)
                        pieces[g] = r
                        total = total - r
                    pieces[c] = total
    return pieces


def groups(mesh, axis):
    others = [range(s) if a != axis else [0] for a, s in enumerate(mesh.shape)]
    for c in itertools.product(*others):
        yield [c[:axis] + (j,) + c[axis + 1 :] for j in range(mesh.shape[axis])]


def apply(pieces, step: Collective, mesh: Mesh):
    out = dict(pieces)
    n = mesh.shape[step.axis]
    for g in groups(mesh, step.axis):
        xs = [pieces[c] for c in g]
        for i, c in enumerate(g):
            if step.kind == "all_reduce":
                out[c] = sum(xs)
            elif step.kind == "all_gather":
                out[c] = np.concatenate(xs, axis=step.dims[0])
            elif step.kind == "reduce_scatter":
                out[c] = _take(sum(xs), step.dims[0], n, i)
            elif step.kind == "all_to_all":
                d_from, d_to = step.dims
                out[c] = np.concatenate([_take(x, d_to, n, i) for x in xs], axis=d_from)
            elif step.kind == "local_split":
                out[c] = _take(xs[i], step.dims[0], n, i)
            elif step.kind == "local_partial":
                out[c] = xs[i] if i == 0 else np.zeros_like(xs[i])
            else:
                raise AssertionError(step.kind)
    return out


def check_equal(pieces, full, sh, mesh):
    """Collapse Partial axes by summing over their groups, then compare with the exact layout."""
    pieces = dict(pieces)
    for a, p in enumerate(sh):
        if isinstance(p, Partial):
            for g in groups(mesh, a):
                s = sum(pieces[c] for c in g)
                for c in g:
                    pieces[c] = s
    ref_sh = Sharding(R if isinstance(p, Partial) else p for p in sh)
    ref = layout(full, ref_sh, mesh, None)
    for c in ref:
        np.testing.assert_array_equal(pieces[c], ref[c], err_msg=f"device {c}")


def all_shardings(ndim, mesh, shape):
    per_axis = [[R, P] + [Shard(d) for d in range(ndim)] for _ in mesh.shape]
    for combo in itertools.product(*per_axis):
        if largest_local_shape(tuple(shape), combo, mesh.shape) is not None:
            yield Sharding(combo)


@pytest.mark.parametrize("mesh_shape,shape", [((2, 2), (4, 6)), ((2, 3), (6, 5)), ((2, 2, 2), (8, 4)), ((4,), (6, 7))])
def test_reshard_sequences_move_the_data_right(mesh_shape, shape):
    mesh = Mesh(mesh_shape)
    rng = np.random.default_rng(0)
    full = rng.integers(-9, 9, size=shape).astype(float)
    shs = list(all_shardings(len(shape), mesh, shape))
    pairs = list(itertools.product(shs, shs))
    idx = rng.choice(len(pairs), size=min(len(pairs), 150), replace=False)
    for k in idx:
        src, dst = pairs[k]
        steps = reshard(src, dst, shape, "float32", mesh)
        pieces = layout(full, src, mesh, rng)
        cur = src
        for s in steps:
            assert s.before == cur
            pieces = apply(pieces, s, mesh)
            cur = s.after
        assert cur == dst or src == dst
        check_equal(pieces, full, dst, mesh)
        assert reshard_cost(src, dst, shape, "float32", mesh) == pytest.approx(sum(s.cost for s in steps))


def test_single_axis_transitions_use_the_named_collective():
    mesh = Mesh((4,))
    shp = (8, 8)
    kinds = lambda a, b: [s.kind for s in reshard(Sharding([a]), Sharding([b]), shp, "float32", mesh)]
    assert kinds(P, R) == ["all_reduce"]
    assert kinds(P, Shard(0)) == ["reduce_scatter"]
    assert kinds(Shard(1), R) == ["all_gather"]
    assert kinds(Shard(0), Shard(1)) == ["all_to_all"]
    assert kinds(R, Shard(1)) == ["local_split"]
    assert kinds(R, P) == ["local_partial"]
    assert kinds(R, R) == []
    assert reshard_cost(Sharding([R]), Sharding([Shard(0)]), shp, "float32", mesh) == 0.0


def test_collective_costs_follow_alpha_beta():
    a, b = 1e-5, 1e-9
    assert all_reduce_cost(1000, 4, a, b) == pytest.approx(6 * a + 1.5 * 1000 * b)
    assert all_gather_cost(1000, 4, a, b) == pytest.approx(3 * a + 0.75 * 1000 * b)
    assert all_reduce_cost(1000, 1, a, b) == 0.0
    mesh = Mesh((2, 4), alpha=[1e-4, 1e-6], beta=[1e-9, 1e-11])
    # reducing over the cheap axis costs less than over the dear one
    c0 = reshard_cost(Sharding([P, R]), Sharding([R, R]), (64, 64), "float32", mesh)
    c1 = reshard_cost(Sharding([R, P]), Sharding([R, R]), (64, 64), "float32", mesh)
    assert c1 < c0


def test_compute_and_memory():
    assert compute_cost(2e9, 1e3, split=4) == pytest.approx(2e9 / 4 / 100e9)
    assert compute_cost(1.0, 20e9) == pytest.approx(1.0)  # memory bound
    mesh = Mesh((2, 4))
    assert local_bytes((8, 8), "float32", Sharding([Shard(0), Shard(1)]), mesh) == 4 * 2 * 4
    assert local_bytes((8, 8), "float32", Sharding([P, R]), mesh) == 256


def test_collective_json_round_trip():
    s = reshard(Sharding([P, Shard(0)]), Sharding([Shard(1), R]), (8, 8), "bfloat16", Mesh((2, 2)))
    assert s and [Collective.from_json(c.to_json()) for c in s] == s
    assert "axis" in str(s[0])


@pytest.mark.parametrize(
    "mesh_shape,shape", [((2, 2, 2), (8, 6, 4)), ((2, 2, 2), (16,)), ((2, 4), (12, 8)), ((8, 16), (24, 40))]
)
def test_table_costs_equal_the_priced_step_lists_for_every_pair(mesh_shape, shape):
    """The compiled all-pairs search the problem's edge tables read agrees with the step list reshard
    returns (what the lowering runs), pair by pair, and refuses what reshard refuses."""
    from metadist_core.cost.reshard import reshard_costs

    mesh = Mesh(mesh_shape, alpha=(1e-6, 3e-6, 5e-6)[: len(mesh_shape)], beta=(1e-9, 2e-9, 4e-9)[: len(mesh_shape)])
    opts = [Replicate(), Partial("sum"), Partial("max")] + [Shard(d) for d in range(len(shape))]
    states = [
        Sharding(c)
        for c in itertools.product(opts, repeat=len(mesh_shape))
        if largest_local_shape(shape, c, mesh_shape) is not None
    ]
    compared = 0
    for a in states[:: max(1, len(states) // 24)]:  # two dozen sources, every destination
        reachable = []
        for b in states:
            try:
                reachable.append((b, reshard_cost(a, b, shape, "float32", mesh)))
            except ValueError:  # e.g. Partial(max) -> Partial(sum): no step sequence
                with pytest.raises(ValueError):
                    reshard_costs(a, [b], shape, "float32", mesh)
        got = reshard_costs(a, [b for b, _ in reachable], shape, "float32", mesh)
        for (_, want), g in zip(reachable, got):
            assert g == pytest.approx(want, rel=1e-12, abs=1e-18)
            compared += 1
    assert compared > 50
