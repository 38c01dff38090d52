"""Every cost-model collective lowered to lax inside shard_map moves data exactly as metadist_core.plan.simulate does."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
from jax.sharding import PartitionSpec as P  # noqa: E402

from metadist_core.cost.model import Collective  # noqa: E402
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding  # noqa: E402
from metadist_core.plan.simulate import apply_collective as sim_apply, devices  # noqa: E402
from metadist_jax.engine import resolve_mesh  # noqa: E402
from metadist_jax.lower import apply_collective, partition_spec  # noqa: E402

R = Replicate()
LOCAL = (4, 8)


def _cases():
    out = []
    for axis in (0, 1):

        def sh(p):
            return Sharding([p if a == axis else R for a in range(2)])

        for red in ("sum", "avg", "max", "min"):
            out.append(Collective("all_reduce", axis, (), red, 0, 0.0, sh(Partial(red)), sh(R)))
            out.append(Collective("reduce_scatter", axis, (1,), red, 0, 0.0, sh(Partial(red)), sh(Shard(1))))
        out.append(Collective("all_gather", axis, (0,), None, 0, 0.0, sh(Shard(0)), sh(R)))
        out.append(Collective("all_to_all", axis, (0, 1), None, 0, 0.0, sh(Shard(0)), sh(Shard(1))))
        out.append(Collective("local_split", axis, (1,), None, 0, 0.0, sh(R), sh(Shard(1))))
        out.append(Collective("local_partial", axis, (), "sum", 0, 0.0, sh(R), sh(Partial("sum"))))
    return out


@pytest.mark.parametrize("c", _cases(), ids=lambda c: f"{c.kind}-{c.reduce}-axis{c.axis}")
def test_collective_matches_simulation(devices8, c):
    mesh, jmesh = resolve_mesh((2, 4))
    rng = np.random.default_rng(0)
    vals = {d: rng.integers(-5, 6, size=LOCAL).astype(np.float32) for d in devices(mesh)}
    if c.before[c.axis] == R:  # replicated along the axis: equal values across it
        vals = {d: vals[tuple(0 if a == c.axis else d[a] for a in range(2))] for d in vals}
    want = sim_apply(vals, c, mesh)
    stacked = np.stack([np.stack([vals[(i, j)] for j in range(4)]) for i in range(2)])

    def body(x):
        return apply_collective(x[0, 0], c, mesh)[None, None]

    f = jax.jit(jax.shard_map(body, mesh=jmesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check_vma=False))
    got = np.asarray(f(stacked))
    for (i, j), w in want.items():
        np.testing.assert_allclose(got[i, j], w, rtol=1e-6, err_msg=f"device {(i, j)}")


def test_partition_spec_nests_axes_outermost_first():
    names = ("dp", "tp")
    assert partition_spec(Sharding([Shard(0), Shard(0)]), 2, names) == P(("dp", "tp"))
    assert partition_spec(Sharding([Shard(1), Shard(0)]), 2, names) == P("tp", "dp")
    assert partition_spec(Sharding([R, R]), 3, names) == P()
    assert partition_spec(Sharding([R, Shard(2)]), 3, names) == P(None, None, "tp")


def test_calibrate_fits_a_profile_that_prices_meshes(devices8):
    from metadist_jax.calibrate import measure_profile

    prof = measure_profile(sizes=(1 << 10, 1 << 16), iters=2)
    assert prof.measured and prof.levels["intra"]["alpha"] > 0 and prof.levels["intra"]["beta"] > 0
    mesh = prof.mesh((2, 4))
    assert mesh.shape == (2, 4) and mesh.alpha[0] == prof.levels["intra"]["alpha"]
    md, jm = resolve_mesh(mesh)
    assert md is mesh and jm.devices.shape == (2, 4)
