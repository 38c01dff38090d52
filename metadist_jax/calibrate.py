"""Time real JAX collectives on the local devices and fit a mesh profile (alpha, beta per link level).

``measure_profile()`` runs ``psum`` (all_reduce) and ``all_gather`` under
shard_map over every device as one axis, for a few message sizes, and fits
alpha/beta with :func:`metadist_core.profile.fit_alpha_beta`. Save the profile
and point ``METADIST_MESH_PROFILE`` at it: ``metadist_compile`` then prices
collectives with what this machine really does.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import numpy as np

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from metadist_core.profile import MeshProfile, profile_from_samples

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)   # bytes per device


def _median_seconds(fn, arg, iters: int) -> float:
    jax.block_until_ready(fn(arg))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 7) -> list[dict]:
    """Raw samples (level, kind, n, nbytes, seconds) of psum and all_gather over all devices."""
    devs = jax.devices()
    n = len(devs)
    mesh = jax.sharding.Mesh(np.asarray(devs, dtype=object), ("x",))
    samples = []
    for kind, body in (("all_reduce", lambda x: lax.psum(x, "x")),
                       ("all_gather", lambda x: lax.all_gather(x, "x", axis=0, tiled=True))):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P() if kind == "all_gather"
                                  else P("x"), check_vma=False))
        for nbytes in sizes:
            per = max(1, nbytes // 4)
            x = jax.device_put(np.ones((n * per,), np.float32), jax.sharding.NamedSharding(mesh, P("x")))
            secs = _median_seconds(f, x, iters)
            # all_gather is priced on its gathered buffer, all_reduce on the local one
            samples.append({"level": "intra", "kind": kind, "n": n,
                            "nbytes": per * 4 * (n if kind == "all_gather" else 1), "seconds": secs})
    return samples


def measure_profile(sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 7) -> MeshProfile:
    """A measured profile of this process's devices as one node."""
    n = jax.device_count()
    return profile_from_samples(measure(sizes, iters), 1, n, f"jax-{jax.devices()[0].platform}")
