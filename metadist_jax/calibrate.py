"""Time real JAX collectives on the local devices and fit a mesh profile (alpha, beta per link level).

``measure_live`` (what a compile uses by default, through
:func:`metadist_core.profile.profile_for`) times psums on each axis of the mesh
the step runs on, inside one jitted shard_map as a step runs them, and the
devices' compute rates; ``measure_profile()`` (``metadist calibrate``) runs
``psum`` and ``all_gather`` over every device as one axis. Both fit alpha/beta
with :func:`metadist_core.profile.fit_alpha_beta`.
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


# -- measured by default: per mesh axis, on the mesh the step runs on ---------------------------------

#: bytes per device of the psums timed on each mesh axis
LIVE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
CHAIN = 4   # collectives timed one after another inside one jitted program (XLA runs a step so)


def measure_axes(jax_mesh: "jax.sharding.Mesh", iters: int = 5) -> tuple[list[dict], list[dict]]:
    """Alpha/beta of every axis of ``jax_mesh`` from psums timed inside one jitted shard_map, as a step
    runs them (``CHAIN`` psums after each other, less one, so that the jit call's own dispatch drops out).
    Returns (per-axis {"alpha", "beta"}, raw samples)."""
    from metadist_core.profile import fit_alpha_beta
    names = tuple(jax_mesh.axis_names)
    spec = P(names)
    n_all = int(np.prod(jax_mesh.devices.shape))
    axes, samples = [], []
    for axis, name in enumerate(names):
        n = int(jax_mesh.shape[name])
        rows = []
        for nbytes in LIVE_SIZES:
            per = max(1, nbytes // 4)
            x = jax.device_put(np.ones((n_all * per,), np.float32), jax.sharding.NamedSharding(jax_mesh, spec))

            def chain(k: int):
                def body(v):
                    for _ in range(k):   # scaled so that values stay put: nothing to fold away
                        v = lax.psum(v, name) * (1.0 / n)
                    return v
                return jax.shard_map(body, mesh=jax_mesh, in_specs=spec, out_specs=spec, check_vma=False)
            one = _median_seconds(jax.jit(chain(1)), x, iters)
            many = _median_seconds(jax.jit(chain(CHAIN)), x, iters)
            secs = max((many - one) / (CHAIN - 1), 1e-7)
            rows.append(("all_reduce", n, per * 4, secs))
            samples.append({"level": f"axis{axis}", "kind": "all_reduce", "n": n, "nbytes": per * 4, "seconds": secs})
        a, b = fit_alpha_beta(rows) if n > 1 else (0.0, 0.0)
        entry = {"alpha": a, "beta": b}
        if n > 1:
            entry["kinds"], more = _measure_gather_scatter(jax_mesh, name, axis, n, n_all, iters)
            samples += more
        axes.append(entry)
    return axes, samples


def _measure_gather_scatter(jax_mesh, name: str, axis: int, n: int, n_all: int, iters: int) -> tuple[dict, list]:
    """Alpha/beta of all_gather and reduce_scatter on axis ``name``, from chains of gather-then-scatter
    pairs (``CHAIN`` pairs, less one), half of a pair each: XLA's CPU runtime combines independent psums but
    runs every gather and scatter by itself, a rendezvous of all the devices each; on 8 virtual devices a
    pair of 4 KB pieces took 331 us where the psums' fit priced each at 70 us (measured 2026-11-26)."""
    from metadist_core.profile import fit_alpha_beta
    spec = P(tuple(jax_mesh.axis_names))
    rows, samples = [], []
    for nbytes in LIVE_SIZES:
        per = max(1, nbytes // 4 // n)   # the gathered buffer is ``nbytes`` a device
        x = jax.device_put(np.ones((n_all * per,), np.float32), jax.sharding.NamedSharding(jax_mesh, spec))

        def chain(k: int):
            def body(v):
                for _ in range(k):
                    w = lax.all_gather(v, name, axis=0, tiled=True)
                    v = lax.psum_scatter(w, name, scatter_dimension=0, tiled=True) * (1.0 / n)
                return v
            return jax.shard_map(body, mesh=jax_mesh, in_specs=spec, out_specs=spec, check_vma=False)
        one = _median_seconds(jax.jit(chain(1)), x, iters)
        many = _median_seconds(jax.jit(chain(CHAIN)), x, iters)
        secs = max((many - one) / (CHAIN - 1) / 2, 1e-7)
        for kind in ("all_gather", "reduce_scatter"):   # both priced on the whole (gathered) buffer
            rows.append((kind, n, per * n * 4, secs))
            samples.append({"level": f"axis{axis}", "kind": kind, "n": n, "nbytes": per * n * 4, "seconds": secs})
    a, b = fit_alpha_beta(rows)
    return {"all_gather": {"alpha": a, "beta": b}, "reduce_scatter": {"alpha": a, "beta": b}}, samples


def measure_device_rates(jax_mesh: "jax.sharding.Mesh", iters: int = 5) -> dict:
    """Per-device matmul FLOP/s, memory-bound bytes/s and per-op overhead with every device of
    ``jax_mesh`` computing at once (virtual CPU devices share the host's cores, as in a step)."""
    names = tuple(jax_mesh.axis_names)
    n_all = int(np.prod(jax_mesh.devices.shape))
    sh = jax.sharding.NamedSharding(jax_mesh, P(names))

    def run(body, shape):
        x = jax.device_put(np.random.default_rng(0).standard_normal((n_all * shape[0],) + shape[1:]).astype(np.float32)
                           / np.sqrt(shape[-1]), sh)
        f = jax.shard_map(body, mesh=jax_mesh, in_specs=P(names), out_specs=P(names), check_vma=False)
        return _median_seconds(jax.jit(f), x, iters)
    n, k_mm, k_tiny = 256, 8, 256

    def dots(k):
        def body(a):
            for _ in range(k):
                a = a @ a   # each waits for the one before: no two fuse
            return a
        return body
    t_mm = (run(dots(1 + k_mm), (n, n)) - run(dots(1), (n, n))) / k_mm
    # 8x8 dots: what an op costs besides its work
    t_tiny = (run(dots(1 + k_tiny), (8, 8)) - run(dots(1), (8, 8))) / k_tiny
    big = 1 << 20
    t_add1 = run(lambda a: a + 1.0, (big,))
    t_add0 = run(lambda a: a + 1.0, (8,))
    over = max(t_tiny, 0.0)
    return {"peak_flops": 2 * n ** 3 / max(t_mm - over, 1e-9),
            "mem_bandwidth": 2 * big * 4 / max(t_add1 - t_add0, 1e-9), "op_overhead": over}


def measure_live(jax_mesh: "jax.sharding.Mesh", mesh_shape: Sequence[int], cached: MeshProfile | None = None,
                 iters: int = 5) -> MeshProfile:
    """A measured profile for ``jax_mesh`` (``cached`` grows by this mesh shape when given). With several
    processes, process 0's figures are every process's, so that all of them plan alike."""
    from metadist_core.cost import DeviceSpec
    axes, samples = measure_axes(jax_mesh, iters)
    rates = measure_device_rates(jax_mesh, iters)
    def gs(a: dict) -> tuple[float, float]:
        k = a.get("kinds", {}).get("all_gather")
        return (k["alpha"], k["beta"]) if k else (-1.0, -1.0)
    vec = np.array([rates["peak_flops"], rates["mem_bandwidth"], rates["op_overhead"]]
                   + [v for a in axes for v in (a["alpha"], a["beta"], *gs(a))], dtype=np.float64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        vec = np.asarray(multihost_utils.broadcast_one_to_all(vec), dtype=np.float64)
    axes = [{"alpha": float(vec[3 + 4 * i]), "beta": float(vec[4 + 4 * i])} for i in range(len(axes))]
    for i, a in enumerate(axes):   # process 0's gather/scatter figures, where its axis had them
        ka, kb = float(vec[5 + 4 * i]), float(vec[6 + 4 * i])
        if ka >= 0:
            a["kinds"] = {k: {"alpha": ka, "beta": kb} for k in ("all_gather", "reduce_scatter")}
    platform = jax.devices()[0].platform
    device = DeviceSpec(f"measured-jax-{platform}", float(vec[0]), float(vec[1]), op_overhead=float(vec[2]))
    for a in axes:   # a gather/scatter of an inner dim copies its buffer (metadist_core.reshard.LOCAL_COPY)
        if "kinds" in a:
            a["kinds"]["local_copy"] = {"alpha": 0.0, "beta": 2.0 / max(device.mem_bandwidth, 1.0)}
    if cached is not None:
        prof = MeshProfile.from_json(cached.to_json())
    else:
        inner = next((a for a in reversed(axes) if a["alpha"] > 0), {"alpha": 1e-5, "beta": 1e-10})
        n = jax.device_count()
        per_node = jax.local_device_count()
        prof = MeshProfile(max(1, n // per_node), per_node, {"intra": dict(inner), "inter": dict(axes[0] if axes else inner)},
                           f"jax-{platform}", True)
    prof.device = device
    prof.axis_costs["x".join(map(str, mesh_shape))] = axes
    prof.samples = list(prof.samples) + samples
    prof.measured = True
    return prof
