"""Run a ShardingPlan on simulated devices with numpy: every device's local values, every collective.

This is the framework-free proof that a plan is right: the graph runs once per
simulated device on that device's pieces, the plan's collectives move data
exactly as priced, and the outputs must equal the unsplit run. Frontends lower
the same plan to real collectives; tests use this to check plans (and the
collective sequences of the cost model) without any framework.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping

import numpy as np

from metadist_core.cost.model import UnknownCollectiveError
from metadist_core.plan.interpret import COLLECTIVE_KINDS, Collectives, PlanError, interpret
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding, chunk_bounds, local_piece, shard_shape

Device = tuple[int, ...]
Values = dict[Device, Any]
# run_local(op, local_inputs, local_output_shapes) -> output or tuple of outputs
LocalRunner = Callable[[MetaOp, list[Any], list[tuple[int, ...] | None]], Any]

_REDUCE: dict[str, Callable[..., Any]] = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


class SimulationError(AssertionError):
    """The simulated plan did not reproduce the unsplit result or broke a layout invariant."""


def devices(mesh: Mesh) -> list[Device]:
    return list(itertools.product(*(range(s) for s in mesh.shape)))


def axis_groups(mesh: Mesh, axis: int) -> list[list[Device]]:
    """Device groups along ``axis``: the devices that differ only in their coordinate on it."""
    others = [range(s) if a != axis else [0] for a, s in enumerate(mesh.shape)]
    out = []
    for base in itertools.product(*others):
        out.append([base[:axis] + (i,) + base[axis + 1 :] for i in range(mesh.shape[axis])])
    return out


def distribute(x: np.ndarray, sharding: Sharding, mesh: Mesh) -> Values:
    """Each device's piece of a full value under ``sharding`` (Partial(sum) keeps it on coordinate 0)."""
    x = np.asarray(x)
    return {dev: np.ascontiguousarray(local_piece(x, sharding, mesh, dev)) for dev in devices(mesh)}


def assemble(vals: Values, sharding: Sharding, mesh: Mesh) -> np.ndarray:
    """The full value from per-device pieces (inverse of :func:`distribute`; reduces Partials)."""
    cur = dict(vals)
    for axis in reversed(range(mesh.ndim)):
        p = sharding[axis]
        nxt: Values = {}
        for group in axis_groups(mesh, axis):
            pieces = [np.asarray(cur[d]) for d in group]
            if isinstance(p, Shard):
                v = np.concatenate(pieces, axis=p.dim)
            elif isinstance(p, Partial):
                v = reduce_pieces(pieces, p.reduce)
            else:
                v = pieces[0]
            for d in group:
                nxt[d] = v
        cur = nxt
    return np.asarray(cur[devices(mesh)[0]])


class SimCollectives(Collectives):
    """The plan's collectives on simulated devices: a value is ``{device: numpy array}``."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def _groups(self, vals: Values, axis: int, make: Callable[[list[np.ndarray], int], list[np.ndarray]]) -> Values:
        out: Values = {}
        for group in axis_groups(self.mesh, axis):
            new = make([np.asarray(vals[d]) for d in group], len(group))
            for d, v in zip(group, new):
                out[d] = v
        return out

    def all_reduce(self, vals: Values, c: Any, shape: tuple) -> Values:
        _expect(c, isinstance(c.before[c.axis], Partial) and c.after[c.axis] == Replicate())
        return self._groups(vals, c.axis, lambda p, n: [reduce_pieces(p, c.reduce)] * n)

    def all_gather(self, vals: Values, c: Any, shape: tuple) -> Values:
        _expect(c, c.before[c.axis] == Shard(c.dims[0]) and c.after[c.axis] == Replicate())
        return self._groups(vals, c.axis, lambda p, n: [np.concatenate(p, axis=c.dims[0])] * n)

    def reduce_scatter(self, vals: Values, c: Any, shape: tuple) -> Values:
        _expect(c, isinstance(c.before[c.axis], Partial) and c.after[c.axis] == Shard(c.dims[0]))
        return self._groups(
            vals, c.axis, lambda p, n: [_chunk(reduce_pieces(p, c.reduce), c.dims[0], n, i) for i in range(n)]
        )

    def all_to_all(self, vals: Values, c: Any, shape: tuple) -> Values:
        src, dst = c.dims
        _expect(c, c.before[c.axis] == Shard(src) and c.after[c.axis] == Shard(dst))
        return self._groups(
            vals, c.axis, lambda p, n: [_chunk(np.concatenate(p, axis=src), dst, n, i) for i in range(n)]
        )

    def local_split(self, vals: Values, c: Any, shape: tuple) -> Values:
        _expect(c, c.before[c.axis] == Replicate() and c.after[c.axis] == Shard(c.dims[0]))
        return self._groups(vals, c.axis, lambda p, n: [_chunk(p[i], c.dims[0], n, i) for i in range(n)])

    def local_partial(self, vals: Values, c: Any, shape: tuple) -> Values:
        after = c.after[c.axis]
        _expect(c, c.before[c.axis] == Replicate() and isinstance(after, Partial))
        if after.reduce != "sum":
            return dict(vals)
        return self._groups(vals, c.axis, lambda p, n: [p[i] if i == 0 else np.zeros_like(p[i]) for i in range(n)])


def reduce_pieces(pieces: list[np.ndarray], reduce: str) -> np.ndarray:
    """The reduction of one group's pieces, in their dtype (``avg`` is the sum divided by the group size)."""
    if reduce == "avg":
        return (np.sum(np.stack(pieces), axis=0) / len(pieces)).astype(pieces[0].dtype)
    return _REDUCE[reduce](np.stack(pieces), axis=0).astype(pieces[0].dtype)


def apply_collective(vals: Values, c: Any, mesh: Mesh) -> Values:
    """Apply one cost-model Collective to per-device values."""
    fn = getattr(SimCollectives(mesh), c.kind, None) if c.kind in COLLECTIVE_KINDS else None
    if fn is None:
        raise UnknownCollectiveError(c.kind, "the simulator")
    return fn(vals, c, ())


def _chunk(x: np.ndarray, dim: int, n: int, i: int) -> np.ndarray:
    lo, hi = chunk_bounds(x.shape[dim], n, i)
    return np.take(x, range(lo, hi), axis=dim)


def _expect(c: Any, ok: bool) -> None:
    if not ok:
        raise SimulationError(f"collective {c.kind} on axis {c.axis} does not turn {c.before} into {c.after}")


def simulate(
    graph: MetaIR,
    plan: Any,
    mesh: Mesh,
    inputs: Mapping[str, np.ndarray],
    run_local: LocalRunner,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run ``graph`` under ``plan`` on simulated devices (through :func:`metadist_core.plan.interpret.interpret`).

    Returns (graph outputs, updated state by state-input id), each whole as the
    plan's final collectives make them on device 0; every device must agree.
    """
    devs = devices(mesh)
    rep = Sharding.replicated(mesh.ndim)
    local: dict[str, Values] = {}
    for v in graph.inputs:
        sh = plan.input_shardings.get(v, rep)
        local[v] = (
            distribute(np.asarray(inputs[v]), sh, mesh) if graph.vars[v].is_tensor else {d: inputs[v] for d in devs}
        )

    def run_op(op: MetaOp, ins: list[Values], out_sh: list[Sharding]) -> list[Values]:
        results: dict[Device, list[Any]] = {}
        for d in devs:
            shapes = [
                None if (shp := graph.vars[o].shape) is None else shard_shape(shp, s, mesh, d)
                for o, s in zip(op.outputs, out_sh)
            ]
            r = run_local(op, [x[d] for x in ins], shapes)
            results[d] = list(r) if isinstance(r, (tuple, list)) else [r]
        return [{d: results[d][i] for d in devs} for i in range(len(op.outputs))]

    try:
        res = interpret(
            graph,
            plan,
            mesh,
            local,
            run_op,
            SimCollectives(mesh),  # every device has every input
            whole=lambda v, sh: distribute(np.asarray(inputs[v]), sh, mesh),
        )
    except PlanError as e:
        raise SimulationError(str(e)) from None
    outputs = {}
    for o, vals in res.outputs.items():
        first = np.asarray(vals[devs[0]])
        for d in devs[1:]:
            if not np.array_equal(np.asarray(vals[d]), first):
                raise SimulationError(f"graph output {o} differs between devices {devs[0]} and {d}")
        outputs[o] = first
    state = {s_in: assemble(vals, plan.input_shardings.get(s_in, rep), mesh) for s_in, vals in res.state.items()}
    return outputs, state
