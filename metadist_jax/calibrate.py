"""Time real JAX collectives on the local devices and fit a mesh profile (alpha, beta per link level).

``measure_live`` (what a compile uses by default, through
:func:`metadist_core.cost.profile.profile_for`) times psums on each axis of the mesh
the step runs on, inside one jitted shard_map as a step runs them, and the
devices' compute rates; ``measure_profile()`` (``metadist calibrate``) runs
``psum`` and ``all_gather`` over every device as one axis. Both fit alpha/beta
with :func:`metadist_core.cost.profile.fit_alpha_beta`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from metadist_core.cost.profile import MeshProfile, profile_from_samples
from metadist_core.cost.timing import time_call, time_rounds

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)  # bytes per device


def _median_seconds(fn, arg, iters: int) -> float:
    """Median seconds of ``fn(arg)`` to its result, after one untimed call."""
    return time_call(lambda: jax.block_until_ready(fn(arg)), iters)


def measure(sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 7) -> list[dict]:
    """Raw samples (level, kind, n, nbytes, seconds) of psum and all_gather over all devices."""
    devs = jax.devices()
    n = len(devs)
    mesh = jax.sharding.Mesh(np.asarray(devs, dtype=object), ("x",))
    samples = []
    for kind, body in (
        ("all_reduce", lambda x: lax.psum(x, "x")),
        ("all_gather", lambda x: lax.all_gather(x, "x", axis=0, tiled=True)),
    ):
        f = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=P("x"), out_specs=P() if kind == "all_gather" else P("x"), check_vma=False
            )
        )
        for nbytes in sizes:
            per = max(1, nbytes // 4)
            x = jax.device_put(np.ones((n * per,), np.float32), jax.sharding.NamedSharding(mesh, P("x")))
            secs = _median_seconds(f, x, iters)
            # all_gather is priced on its gathered buffer, all_reduce on the local one
            samples.append(
                {
                    "level": "intra",
                    "kind": kind,
                    "n": n,
                    "nbytes": per * 4 * (n if kind == "all_gather" else 1),
                    "seconds": secs,
                }
            )
    return samples


def measure_profile(sizes: Sequence[int] = DEFAULT_SIZES, iters: int = 7) -> MeshProfile:
    """A measured profile of this process's devices as one node."""
    n = jax.device_count()
    return profile_from_samples(measure(sizes, iters), 1, n, f"jax-{jax.devices()[0].platform}")


# -- measured by default: per mesh axis, on the mesh the step runs on ---------------------------------

#: bytes per device of the psums timed on each mesh axis
LIVE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
CHAIN = 4  # collectives timed one after another inside one jitted program (XLA runs a step so)
#: rounds over all of a live calibration's programs; each round runs every program ``iters // 2 + 1`` times,
#: in alternating order, and each figure is the median of all its runs. Timed program after program, a slow
#: spell of the shared cores would fall on whichever figure was being timed
ROUNDS = 3


class _Programs:
    """Programs to time together: each compiled and run once, then :data:`ROUNDS` rounds that run every
    program a few times, forwards and backwards in turn, so that a slow spell of the machine falls on all of
    them alike. ``add`` returns the program's index in what ``run`` returns (median seconds a run)."""

    def __init__(self) -> None:
        self.items: list[tuple] = []

    def add(self, fn, arg) -> int:
        self.items.append((fn, arg))
        return len(self.items) - 1

    def run(self, iters: int, rounds: int = ROUNDS) -> list[float]:
        calls = [lambda fn=fn, arg=arg: jax.block_until_ready(fn(arg)) for fn, arg in self.items]
        return time_rounds(calls, rounds, per_round=max(1, iters // 2 + 1))


def _sharded(jax_mesh, n_elems: int):
    """An (n_elems,) float32 array of ones split over every device of ``jax_mesh``."""
    spec = P(tuple(jax_mesh.axis_names))
    return jax.device_put(np.ones((n_elems,), np.float32), jax.sharding.NamedSharding(jax_mesh, spec))


def _chain_program(jax_mesh, step):
    """``k`` -> a jitted shard_map that applies ``step`` ``k`` times, each waiting for the one before."""
    spec = P(tuple(jax_mesh.axis_names))

    def chain(k: int):
        def body(v):
            for _ in range(k):
                v = step(v)
            return v

        return jax.jit(jax.shard_map(body, mesh=jax_mesh, in_specs=spec, out_specs=spec, check_vma=False))

    return chain


def _axes_programs(jax_mesh: "jax.sharding.Mesh", progs: _Programs):
    """Adds the programs that measure every axis of ``jax_mesh`` to ``progs``; returns the function that
    turns their timings into (per-axis {"alpha", "beta", "kinds"}, raw samples)."""
    from metadist_core.cost.profile import fit_alpha_beta

    names = tuple(jax_mesh.axis_names)
    n_all = int(np.prod(jax_mesh.devices.shape))
    plans = []  # per axis: (name, n, [(nbytes, i_one, i_many)] for psums, the same for gather/scatter pairs)
    for name in names:
        n = int(jax_mesh.shape[name])
        # psums scaled so that values stay put (nothing to fold away)
        psum = _chain_program(jax_mesh, lambda v, name=name, n=n: lax.psum(v, name) * (1.0 / n))

        def pair(v, name=name, n=n):
            w = lax.all_gather(v, name, axis=0, tiled=True)
            return lax.psum_scatter(w, name, scatter_dimension=0, tiled=True) * (1.0 / n)

        gs = _chain_program(jax_mesh, pair)
        ar_rows, gs_rows = [], []
        for nbytes in LIVE_SIZES:
            per = max(1, nbytes // 4)
            x = _sharded(jax_mesh, n_all * per)
            ar_rows.append((per * 4, progs.add(psum(1), x), progs.add(psum(CHAIN), x)))
            if n > 1:
                per_g = max(1, nbytes // 4 // n)  # the gathered buffer is ``nbytes`` a device
                xg = _sharded(jax_mesh, n_all * per_g)
                gs_rows.append((per_g * n * 4, progs.add(gs(1), xg), progs.add(gs(CHAIN), xg)))
        plans.append((n, ar_rows, gs_rows))

    def finish(secs: list[float]) -> tuple[list[dict], list[dict]]:
        axes, samples = [], []
        for axis, (n, ar_rows, gs_rows) in enumerate(plans):
            rows = []
            for nbytes, one, many in ar_rows:  # the jit call's own dispatch drops out of the difference
                t = max((secs[many] - secs[one]) / (CHAIN - 1), 1e-7)
                rows.append(("all_reduce", n, nbytes, t))
                samples.append({"level": f"axis{axis}", "kind": "all_reduce", "n": n, "nbytes": nbytes, "seconds": t})
            a, b = fit_alpha_beta(rows) if n > 1 else (0.0, 0.0)
            entry = {"alpha": a, "beta": b}
            if gs_rows:
                g_rows = []
                for nbytes, one, many in gs_rows:  # half of a gather-then-scatter pair each
                    t = max((secs[many] - secs[one]) / (CHAIN - 1) / 2, 1e-7)
                    for kind in ("all_gather", "reduce_scatter"):  # both priced on the whole (gathered) buffer
                        g_rows.append((kind, n, nbytes, t))
                        samples.append({"level": f"axis{axis}", "kind": kind, "n": n, "nbytes": nbytes, "seconds": t})
                ga, gb = fit_alpha_beta(g_rows)
                entry["kinds"] = {"all_gather": {"alpha": ga, "beta": gb}, "reduce_scatter": {"alpha": ga, "beta": gb}}
            axes.append(entry)
        return axes, samples

    return finish


def measure_axes(jax_mesh: "jax.sharding.Mesh", iters: int = 5) -> tuple[list[dict], list[dict]]:
    """Alpha/beta of every axis of ``jax_mesh`` from psums timed inside one jitted shard_map, as a step
    runs them (``CHAIN`` psums after each other, less one, so that the jit call's own dispatch drops out),
    and, in ``kinds``, of all_gather and reduce_scatter from chains of gather-then-scatter pairs: XLA's CPU
    runtime combines independent psums but runs every gather and scatter by itself, a rendezvous of all the
    devices each (far dearer than the psums' fit prices them). Returns (per-axis {"alpha", "beta", "kinds"},
    raw samples)."""
    progs = _Programs()
    finish = _axes_programs(jax_mesh, progs)
    return finish(progs.run(iters))


def _rates_programs(jax_mesh: "jax.sharding.Mesh", progs: _Programs):
    """Adds the programs that measure the devices' rates to ``progs``; returns the function that turns
    their timings into :func:`measure_device_rates`' figures."""
    names = tuple(jax_mesh.axis_names)
    n_all = int(np.prod(jax_mesh.devices.shape))
    sh = jax.sharding.NamedSharding(jax_mesh, P(names))

    def add(body, shape) -> int:
        x = jax.device_put(
            np.random.default_rng(0).standard_normal((n_all * shape[0],) + shape[1:]).astype(np.float32)
            / np.sqrt(shape[-1]),
            sh,
        )
        f = jax.shard_map(body, mesh=jax_mesh, in_specs=P(names), out_specs=P(names), check_vma=False)
        return progs.add(jax.jit(f), x)

    n, k_mm, k_tiny = 256, 8, 256

    def dots(k):
        def body(a):
            for _ in range(k):
                a = a @ a  # each waits for the one before: no two fuse
            return a

        return body

    big = 1 << 20
    i = {
        "mm": add(dots(1 + k_mm), (n, n)),
        "mm1": add(dots(1), (n, n)),
        "tiny": add(dots(1 + k_tiny), (8, 8)),
        "tiny1": add(dots(1), (8, 8)),  # 8x8 dots: what an op costs besides its work
        "add1": add(lambda a: a + 1.0, (big,)),
        "add0": add(lambda a: a + 1.0, (8,)),
    }

    def finish(secs: list[float]) -> dict:
        t_mm = (secs[i["mm"]] - secs[i["mm1"]]) / k_mm
        over = max((secs[i["tiny"]] - secs[i["tiny1"]]) / k_tiny, 0.0)
        return {
            "peak_flops": 2 * n**3 / max(t_mm - over, 1e-9),
            "mem_bandwidth": 2 * big * 4 / max(secs[i["add1"]] - secs[i["add0"]], 1e-9),
            "op_overhead": over,
            "call_seconds": secs[i["add0"]],
        }

    return finish


def measure_device_rates(jax_mesh: "jax.sharding.Mesh", iters: int = 5) -> dict:
    """Per-device matmul FLOP/s, memory-bound bytes/s and per-op overhead with every device of
    ``jax_mesh`` computing at once (virtual CPU devices share the host's cores, as in a step), and
    ``call_seconds``, the time of a trivial program (what a jitted call costs besides its work)."""
    progs = _Programs()
    finish = _rates_programs(jax_mesh, progs)
    return finish(progs.run(iters))


def measure_live(
    jax_mesh: "jax.sharding.Mesh", mesh_shape: Sequence[int], cached: MeshProfile | None = None, iters: int = 5
) -> MeshProfile:
    """A measured profile for ``jax_mesh`` (``cached`` grows by this mesh shape when given). With several
    processes, process 0's figures are every process's, so that all of them plan alike."""
    from metadist_core.cost.model import DeviceSpec

    progs = _Programs()  # the links' and the device's programs timed in the same rounds
    axes_of, rates_of = _axes_programs(jax_mesh, progs), _rates_programs(jax_mesh, progs)
    secs = progs.run(iters)
    axes, samples = axes_of(secs)
    rates = rates_of(secs)

    def gs(a: dict) -> tuple[float, float]:
        k = a.get("kinds", {}).get("all_gather")
        return (k["alpha"], k["beta"]) if k else (-1.0, -1.0)

    vec = np.array(
        [rates["peak_flops"], rates["mem_bandwidth"], rates["op_overhead"]]
        + [v for a in axes for v in (a["alpha"], a["beta"], *gs(a))],
        dtype=np.float64,
    )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        vec = np.asarray(multihost_utils.broadcast_one_to_all(vec), dtype=np.float64)
    axes = [{"alpha": float(vec[3 + 4 * i]), "beta": float(vec[4 + 4 * i])} for i in range(len(axes))]
    for i, a in enumerate(axes):  # process 0's gather/scatter figures, where its axis had them
        ka, kb = float(vec[5 + 4 * i]), float(vec[6 + 4 * i])
        if ka >= 0:
            a["kinds"] = {k: {"alpha": ka, "beta": kb} for k in ("all_gather", "reduce_scatter")}
    platform = jax.devices()[0].platform
    device = DeviceSpec(f"measured-jax-{platform}", float(vec[0]), float(vec[1]), op_overhead=float(vec[2]))
    for a in axes:  # a gather/scatter of an inner dim copies its buffer (metadist_core.cost.reshard.LOCAL_COPY)
        if "kinds" in a:
            a["kinds"]["local_copy"] = {"alpha": 0.0, "beta": 2.0 / max(device.mem_bandwidth, 1.0)}
    if cached is not None:
        prof = MeshProfile.from_json(cached.to_json())
    else:
        inner = next((a for a in reversed(axes) if a["alpha"] > 0), {"alpha": 1e-5, "beta": 1e-10})
        n = jax.device_count()
        per_node = jax.local_device_count()
        prof = MeshProfile(
            max(1, n // per_node),
            per_node,
            {"intra": dict(inner), "inter": dict(axes[0] if axes else inner)},
            f"jax-{platform}",
            True,
        )
    prof.device = device
    prof.axis_costs["x".join(map(str, mesh_shape))] = axes
    prof.samples = list(prof.samples) + samples
    prof.measured = True
    return prof
