"""Run a ShardingPlan on simulated devices with numpy: every device's local values, every collective.

This is the framework-free proof that a plan is right: the graph runs once per
simulated device on that device's pieces, the plan's collectives move data
exactly as priced, and the outputs must equal the unsplit run. Frontends lower
the same plan to real collectives; tests use this to check plans (and the
collective sequences of the cost model) without any framework.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .cost import UnknownCollectiveError
from .ir import MetaIR, MetaOp
from .placement import Mesh, Partial, Replicate, Shard, Sharding, chunk_bounds, shard_shape

Device = tuple[int, ...]
Values = dict[Device, Any]
# run_local(op, local_inputs, local_output_shapes) -> output or tuple of outputs
LocalRunner = Callable[[MetaOp, list[Any], list[tuple[int, ...] | None]], Any]

_REDUCE = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


class SimulationError(AssertionError):
    """The simulated plan did not reproduce the unsplit result or broke a layout invariant."""


def devices(mesh: Mesh) -> list[Device]:
    return list(itertools.product(*(range(s) for s in mesh.shape)))


def axis_groups(mesh: Mesh, axis: int) -> list[list[Device]]:
    """Device groups along ``axis``: the devices that differ only in their coordinate on it."""
    others = [range(s) if a != axis else [0] for a, s in enumerate(mesh.shape)]
    out = []
    for base in itertools.product(*others):
        out.append([base[:axis] + (i,) + base[axis + 1:] for i in range(mesh.shape[axis])])
    return out


def distribute(x: np.ndarray, sharding: Sharding, mesh: Mesh) -> Values:
    """Each device's piece of a full value under ``sharding`` (Partial(sum) keeps it on coordinate 0)."""
    out: Values = {}
    for dev in devices(mesh):
        local = np.asarray(x)
        for axis, p in enumerate(sharding):
            if isinstance(p, Shard):
                lo, hi = chunk_bounds(local.shape[p.dim], mesh.shape[axis], dev[axis])
                local = np.take(local, range(lo, hi), axis=p.dim)
            elif isinstance(p, Partial) and p.reduce == "sum" and dev[axis] != 0:
                local = np.zeros_like(local)
        out[dev] = local
    return out


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
                v = _REDUCE[p.reduce](np.stack(pieces), axis=0)
            else:
                v = pieces[0]
            for d in group:
                nxt[d] = v
        cur = nxt
    return np.asarray(cur[devices(mesh)[0]])


def apply_collective(vals: Values, c: Any, mesh: Mesh) -> Values:
    """Apply one cost-model Collective to per-device values."""
    axis = c.axis
    before, after = c.before[axis], c.after[axis]
    out: Values = {}
    for group in axis_groups(mesh, axis):
        pieces = [np.asarray(vals[d]) for d in group]
        n = len(group)
        if c.kind == "all_reduce":
            _expect(c, isinstance(before, Partial) and after == Replicate())
            v = _REDUCE[c.reduce](np.stack(pieces), axis=0).astype(pieces[0].dtype)
            new = [v] * n
        elif c.kind == "all_gather":
            _expect(c, before == Shard(c.dims[0]) and after == Replicate())
            new = [np.concatenate(pieces, axis=c.dims[0])] * n
        elif c.kind == "reduce_scatter":
            _expect(c, isinstance(before, Partial) and after == Shard(c.dims[0]))
            v = _REDUCE[c.reduce](np.stack(pieces), axis=0).astype(pieces[0].dtype)
            new = [_chunk(v, c.dims[0], n, i) for i in range(n)]
        elif c.kind == "all_to_all":
            src, dst = c.dims
            _expect(c, before == Shard(src) and after == Shard(dst))
            v = np.concatenate(pieces, axis=src)
            new = [_chunk(v, dst, n, i) for i in range(n)]
        elif c.kind == "local_split":
            _expect(c, before == Replicate() and after == Shard(c.dims[0]))
            new = [_chunk(pieces[i], c.dims[0], n, i) for i in range(n)]
        elif c.kind == "local_partial":
            _expect(c, before == Replicate() and isinstance(after, Partial))
            if after.reduce == "sum":
                new = [pieces[i] if i == 0 else np.zeros_like(pieces[i]) for i in range(n)]
            else:
                new = pieces
        else:
            raise UnknownCollectiveError(c.kind, "the simulator")
        for d, v in zip(group, new):
            out[d] = v
    return out


def _chunk(x: np.ndarray, dim: int, n: int, i: int) -> np.ndarray:
    lo, hi = chunk_bounds(x.shape[dim], n, i)
    return np.take(x, range(lo, hi), axis=dim)


def _expect(c: Any, ok: bool) -> None:
    if not ok:
        raise SimulationError(f"collective {c.kind} on axis {c.axis} does not turn {c.before} into {c.after}")


def simulate(graph: MetaIR, plan: Any, mesh: Mesh, inputs: Mapping[str, np.ndarray], run_local: LocalRunner,
             ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run ``graph`` under ``plan`` on simulated devices.

    Returns (graph outputs, updated state by state-input id), each whole as the
    plan's final collectives make them on device 0; every device must agree.
    """
    env: dict[str, Values] = {}
    for v in graph.inputs:
        sh = plan.input_shardings.get(v, Sharding.replicated(mesh.ndim))
        env[v] = distribute(np.asarray(inputs[v]), sh, mesh) if graph.vars[v].is_tensor else \
            {d: inputs[v] for d in devices(mesh)}
    incoming, finals = plan.edge_index()
    devs = devices(mesh)
    for op in graph.ops:
        local_inputs: list[Values] = []
        for slot, v in enumerate(op.inputs):
            vals = env[v]
            e = incoming.get((op.id, slot))
            if e is not None:
                for c in e.collectives:
                    vals = apply_collective(vals, c, mesh)
            local_inputs.append(vals)
        strategy = plan.strategies.get(op.id)
        out_sh = list(strategy.outputs) if strategy is not None else [Sharding.replicated(mesh.ndim)] * len(op.outputs)
        results: dict[Device, list[Any]] = {}
        for d in devs:
            shapes = [None if graph.vars[o].shape is None else shard_shape(graph.vars[o].shape, s, mesh, d)
                      for o, s in zip(op.outputs, out_sh)]
            r = run_local(op, [li[d] for li in local_inputs], shapes)
            results[d] = list(r) if isinstance(r, (tuple, list)) else [r]
        for i, o in enumerate(op.outputs):
            env[o] = {d: results[d][i] for d in devs}

    def final(var: str, dst: str) -> np.ndarray:
        vals = env[var]
        e = finals.get((var, dst))
        if e is not None:
            for c in e.collectives:
                vals = apply_collective(vals, c, mesh)
            sh = e.dst_sharding
        else:
            sh = plan.var_shardings.get(var, Sharding.replicated(mesh.ndim))
        return vals, sh

    outputs = {}
    for o in graph.outputs:
        if o in graph.aliases.values():
            continue
        vals, sh = final(o, "<output>")
        if not sh.is_fully_replicated():
            raise SimulationError(f"graph output {o} ends as {sh}, not whole on every device")
        first = np.asarray(vals[devs[0]])
        for d in devs[1:]:
            if not np.array_equal(np.asarray(vals[d]), first):
                raise SimulationError(f"graph output {o} differs between devices {devs[0]} and {d}")
        outputs[o] = first
    state = {}
    for s_in, s_out in graph.aliases.items():
        vals, sh = final(s_out, s_in)
        want = plan.input_shardings.get(s_in, Sharding.replicated(mesh.ndim))
        if sh != want:
            raise SimulationError(f"updated state {s_out} ends as {sh}, but its input {s_in} is stored as {want}")
        state[s_in] = assemble(vals, sh, mesh)
    return outputs, state
