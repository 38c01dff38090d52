"""The engine side: the device mesh, placing values on it, and one plan for every process.

One process sees ``jax.devices()``; under ``jax.distributed.initialize`` every
process sees the devices of all processes (its own are
``jax.local_devices()``), and each runs the same step on its own devices
(multi-controller). Every process traces, discovers and solves on its own;
:func:`agree_on_plan` (the adapter's ``share``) checks that they reached the
same plan and makes them adopt process 0's if not.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

import numpy as np

import jax
from jax.sharding import NamedSharding

from metadist_core.problem.constraints import Forbid
from metadist_core.ir.ir import MetaIR
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Shard
from metadist_core.cost.profile import MeshProfile

log = logging.getLogger("metadist.jax.engine")


class MeshMismatchError(ValueError):
    """The mesh asked for does not use exactly the devices JAX has."""


def resolve_mesh(
    mesh: Any = None, profile: MeshProfile | None = None, devices: Sequence[Any] | None = None
) -> tuple[Mesh, jax.sharding.Mesh]:
    """The planning Mesh and the ``jax.sharding.Mesh`` for ``mesh``.

    ``mesh`` is None (all devices as one axis), an int, a shape such as
    ``(2, 4)`` or ``"2x4"``, a metadist ``Mesh`` (used as is) or a
    ``jax.sharding.Mesh`` (used as is). Link costs of a mesh given by its shape
    come from ``profile`` (default: the built-in profile).
    """
    prof = profile if profile is not None else MeshProfile()
    if isinstance(mesh, jax.sharding.Mesh):
        shape = tuple(int(s) for s in mesh.devices.shape)
        names = tuple(str(a) for a in mesh.axis_names)
        return prof.mesh(shape, names), mesh
    devs = list(devices) if devices is not None else jax.devices()
    if mesh is None:
        md = prof.mesh((len(devs),))
    elif isinstance(mesh, Mesh):
        md = mesh
    elif isinstance(mesh, str):
        md = prof.mesh(Mesh.parse(mesh).shape)
    elif isinstance(mesh, int) or (isinstance(mesh, (tuple, list)) and all(isinstance(s, int) for s in mesh)):
        md = prof.mesh((mesh,) if isinstance(mesh, int) else tuple(mesh))
    else:
        raise TypeError(
            f"mesh must be None, an int, a shape like (2, 4), a metadist Mesh or a jax.sharding.Mesh; got {mesh!r}"
        )
    if md.size != len(devs):
        procs = jax.process_count()
        where = (
            f"{procs} processes with {jax.local_device_count()} local devices each"
            if procs > 1
            else f"one process with {len(devs)} {devs[0].platform} devices"
        )
        raise MeshMismatchError(
            f"mesh {tuple(md.shape)} needs {md.size} devices, but JAX has {len(devs)} ({where}); pass a mesh "
            f"whose sizes multiply to {len(devs)}, e.g. mesh=({len(devs)},), or change the device count "
            f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax)"
        )
    return md, jax.sharding.Mesh(np.asarray(devs, dtype=object).reshape(md.shape), md.axis_names)


def even_split_constraints(graph: MetaIR, mesh: Mesh) -> list[Forbid]:
    """Forbid every Shard that would split a dim unevenly on a mesh axis (shard_map needs even splits)."""
    out = []
    for v in graph.vars.values():
        if v.shape is None:
            continue
        for axis, n in enumerate(mesh.shape):
            if n == 1:
                continue
            for d, size in enumerate(v.shape):
                if size >= n and size % n:
                    out.append(Forbid(Shard(d), var=v.id, axis=axis))
    return out


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` as a jax.Array with ``sharding`` (single- or multi-process; host values are the whole value)."""
    if isinstance(x, jax.Array):
        try:
            have = x.sharding
            if have is sharding or have == sharding or have.is_equivalent_to(sharding, x.ndim):
                return x  # (the step's own outputs come back with the very shardings it asks for)
        except Exception:
            pass
        if jax.process_count() == 1 or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array on this host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def plan_digest(plan: Any) -> str:
    """A digest of what a plan does (:meth:`~metadist_core.plan.plan.ShardingPlan.digest`)."""
    return plan.digest()


def agree_on_plan(plan: Any) -> Any:
    """Every process must run the same plan: compare digests; if they differ, all adopt process 0's plan."""
    if jax.process_count() == 1:
        return plan
    from jax.experimental import multihost_utils

    from metadist_core.plan.plan import ShardingPlan

    digest = plan_digest(plan)
    words = np.frombuffer(bytes.fromhex(digest)[:16], dtype=np.int32)
    allw = np.asarray(multihost_utils.process_allgather(words))
    if all(np.array_equal(allw[i], allw[0]) for i in range(allw.shape[0])):
        log.info("all %d processes reached the same plan (%s)", jax.process_count(), digest[:12])
        return plan
    log.warning("processes reached different plans; every process adopts process 0's plan")
    text = np.frombuffer(plan.dumps().encode(), dtype=np.uint8)
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array([text.size], dtype=np.int32)))[0])
    buf = np.zeros(n, dtype=np.uint8)
    buf[: min(n, text.size)] = text[:n]
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)
    return ShardingPlan.from_json(json.loads(got.tobytes().decode()))
