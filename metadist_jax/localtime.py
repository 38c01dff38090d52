"""JAX ops timed at a strategy's local shapes, every device of the mesh running them at once.

What :meth:`metadist_core.driver.frontend.Frontend.local_op_times` asks of the JAX frontend
(:mod:`metadist_core.cost.localtime` prices the plans with it). The ops timed are the matmuls and convolutions
(:data:`TIMED`): the kernels whose rate moves with the local shape (on virtual CPU devices computing at
once, a matmul of few local rows runs at a lower rate than one of many rows).

Each op is bound on arrays of its local shapes inside one jitted ``shard_map`` over the whole mesh (so
the devices share the host's cores as in a step), timed in the same interleaved rounds as the device's
rates (:mod:`metadist_jax.calibrate`), less a trivial program's time timed there (the call's own dispatch).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

import jax
from jax.sharding import PartitionSpec as P

from metadist_core.cost.model import DeviceSpec

from .calibrate import _Programs, _rates_programs
from .payload import bind_payload

log = logging.getLogger("metadist.jax.localtime")

#: the primitives timed at their local shapes
TIMED = frozenset({"dot_general", "conv_general_dilated"})
#: runs of each program a round (calibrate._Programs: rounds of iters // 2 + 1 runs each)
ITERS = 5


def timed(op: Any) -> bool:
    """Is ``op`` one the JAX frontend times at its local shapes? Its primitive is in :data:`TIMED` and
    every operand is one of its tensor inputs (no literal)."""
    payload = getattr(op, "payload", None)
    return getattr(payload, "name", None) in TIMED and all(isinstance(slot, int) for slot in payload.layout)


def measure_local(
    requests: Sequence[tuple[Any, tuple, tuple]], jax_mesh: "jax.sharding.Mesh", iters: int = ITERS
) -> tuple[list[float | None], DeviceSpec]:
    """Seconds of one run of each (op, local input shapes, dtypes) with every device of ``jax_mesh``
    running it at once (None where the op refuses the shapes), and the device's rates timed in the same
    rounds."""
    names = tuple(jax_mesh.axis_names)
    n_all = int(np.prod(jax_mesh.devices.shape))
    spec = P(names)
    sharding = jax.sharding.NamedSharding(jax_mesh, spec)
    rng = np.random.default_rng(0)
    progs = _Programs()
    rates_of = _rates_programs(jax_mesh, progs)
    index: list[int | None] = []
    for op, shapes, dtypes in requests:
        try:
            args = tuple(
                jax.device_put(
                    (rng.standard_normal((n_all,) + tuple(s)) / np.sqrt(max(s[-1] if s else 1, 1))).astype(
                        np.dtype(dt)
                    ),
                    sharding,
                )
                for s, dt in zip(shapes, dtypes)
            )

            def body(*xs, payload=op.payload):
                outs = bind_payload(payload, [x[0] for x in xs])
                return tuple(o[None] for o in outs)

            f = jax.jit(
                jax.shard_map(body, mesh=jax_mesh, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)
            )
            jax.block_until_ready(f(*args))
            index.append(progs.add(lambda a, f=f: f(*a), args))
        except Exception as e:  # a dtype numpy lacks, shapes the op refuses: untimed (metadist_core.cost.localtime)
            log.debug("op %s not timed at local shapes %s: %s: %s", op.id, shapes, type(e).__name__, e)
            index.append(None)
    secs = progs.run(iters)
    rates = rates_of(secs)
    device = DeviceSpec(
        "jax-local-times", rates["peak_flops"], rates["mem_bandwidth"], op_overhead=rates["op_overhead"]
    )
    base = rates["call_seconds"]
    return [None if i is None else max(secs[i] - base, 1e-7) for i in index], device


__all__ = ["ITERS", "TIMED", "measure_local", "timed"]
