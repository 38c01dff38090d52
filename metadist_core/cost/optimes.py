"""How much slower than the roofline each op of a step runs on this device: derived from the seconds a
frontend measured (``Frontend.time_ops``), for the cost model.

The cost model prices an op as ``max(flops / FLOP rate, bytes / memory rate)``. Most ops run slower
than that (on a CPU ``tanh`` or a layer norm runs many times its roofline where a matmul runs close to
it), so the roofline prices a step under what it takes. Here each distinct op of the step at its whole
shapes (its signature) is timed once by the frontend, and its time less the harness's (a tiny op timed
the same way: what the timing's call path adds to any op), divided by its roofline at the rates measured
in the same run, is its slowdown, clamped to :data:`LIMITS`. Being a ratio it carries over to the rates of
the live mesh profile. An op the frontend did not time (too large, random, refused) takes the slowdown
of the largest timed op of the same key and dtypes, and none (1) when there is none. Where the frontend
also timed the step's whole program (replicated on one device), every op's slowdown is multiplied by how
much longer the program ran than its ops' times say (:data:`PROGRAM_FACTOR`). Slowdowns, and each
program's factor, are kept per machine in a JSON file beside the mesh profile (:data:`VERSION`): a step
compiled again is priced as before, so its solver sees the same problem. Ops a frontend times at each strategy's
local shapes are priced by :mod:`metadist_core.cost.localtime` instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from metadist_core import cachefiles
from metadist_core.cost.model import DeviceSpec, compute_cost, compute_dtype
from metadist_core.cost.profile import cache_dir_of
from metadist_core.ir.ir import MetaIR, MetaOp

log = logging.getLogger("metadist.optime")

VERSION = 3  # the cache file's format: a file of another version is measured again
VERSION_KEY = "__version__"
LIMITS = (0.25, 100.0)  # slowdowns are clamped to this range (a tiny op's time is mostly noise)
PROGRAM_FACTOR = (1.0, 4.0)  # the program's factor over its ops' alone times is clamped to this range


def roofline(op: MetaOp, graph: MetaIR, cost: tuple, dev: DeviceSpec) -> float:
    """Seconds of ``op``'s roofline (``cost``: its flops and bytes) on ``dev``, without the per-op overhead."""
    dt = compute_dtype([graph.vars[v].dtype for v in op.inputs], [graph.vars[v].dtype for v in op.outputs])
    return compute_cost(cost[0], cost[1], 1, dev, dt) - dev.op_overhead


def _whole_shape(graph: MetaIR, v: str, op: MetaOp) -> tuple[int, ...]:
    """The shape of input ``v`` of ``op``, which a timed op must know."""
    shape = graph.vars[v].shape
    if shape is None:
        raise ValueError(
            f"op {op.id!r} ({op.key}) has costs but its input {v!r} has no known shape; an op "
            "timed at its whole shape needs the shapes of its inputs (give the value a shape when "
            "tracing, or give the op no costs)"
        )
    return tuple(shape)


def _parse(raw: bytes) -> dict[str, float]:
    """The slowdowns in a cache file's bytes; none when it is of another :data:`VERSION`."""
    saved = json.loads(raw)
    if not isinstance(saved, dict):
        raise ValueError(f"a JSON {type(saved).__name__}, not an object of slowdowns")
    if saved.get(VERSION_KEY) != VERSION:
        return {}  # another format: measured again
    return {str(k): float(v) for k, v in saved.items() if k != VERSION_KEY}


def _load(path: Path | None) -> dict[str, float]:
    if path is None:
        return {}
    return cachefiles.read(path, _parse, "op timings") or {}


def _save(path: Path, cache: dict[str, float]) -> bool:
    """Keep ``cache`` in ``path``, merged with what other processes kept there meanwhile (``cache`` wins);
    False when the cache dir cannot be written (one warning)."""
    with cachefiles.exclusive(path):
        merged = {**_load(path), **cache}
        text = json.dumps({VERSION_KEY: VERSION, **merged}, sort_keys=True)
        return cachefiles.write_atomic(path, text, cache_dir=cache_dir_of(path), what="op timings")


def whole_slowdowns(
    graph: MetaIR,
    costs: dict[str, tuple],
    time_ops: Callable[..., Any],
    cache_file: str | os.PathLike | None = None,
    *,
    skip: Callable[[MetaOp], bool] = lambda op: False,
    program: bool = False,
) -> dict[str, float]:
    """Per op id of ``graph``, its measured time over its roofline (see the module doc). ``time_ops(requests,
    program)`` is the frontend's hook bound to this compile (an :class:`~metadist_core.driver.frontend.OpTimes`
    or None); ops already in ``cache_file`` and ops ``skip`` says are priced elsewhere are not asked for."""
    path = Path(cache_file) if cache_file else None
    cache = _load(path)
    sig_of = {op.id: op.signature(graph) for op in graph.ops}
    ask: dict[str, MetaOp] = {}
    for op in graph.ops:
        cost = costs.get(op.id)
        if cost is None or (cost[0] <= 0 and cost[1] <= 0) or skip(op):
            continue  # a view: free
        if sig_of[op.id] not in cache:
            ask.setdefault(sig_of[op.id], op)
    t0 = time.perf_counter()
    requests = [
        (op, tuple(_whole_shape(graph, v, op) for v in op.inputs), tuple(graph.vars[v].dtype for v in op.inputs))
        for op in ask.values()
    ]
    prog_key = program_key(graph, sig_of) if program else None
    kept = cache.get(prog_key) if prog_key is not None else None
    timing_program = program and kept is None
    times = time_ops(requests, timing_program) if requests or timing_program else None
    new = tried = 0
    if times is not None and requests:
        spec = dataclasses.replace(times.device, op_overhead=times.harness)
        for (sig, op), t in zip(ask.items(), times.seconds):
            if t is None:
                cache[sig] = 0.0  # not run: priced by its key's largest timed op, else by the roofline
                tried += 1
                continue
            roof = roofline(op, graph, costs[op.id], spec)
            cache[sig] = min(max((t - spec.op_overhead) / max(roof, 1e-9), LIMITS[0]), LIMITS[1])
            new += 1
    out = _by_signature(graph, costs, cache, sig_of)
    factor = kept if kept is not None else (None if times is None else program_factor(graph, costs, out, times))
    if new or tried:
        log.info(
            "timed %d ops of %s in %.1f s (%d could not run alone)", new, graph.name, time.perf_counter() - t0, tried
        )
    if prog_key is not None and kept is None and factor is not None:
        cache[prog_key] = factor
    if path is not None and (new or tried or cache.get(prog_key or "") != kept):
        _save(path, cache)
    if factor is None:
        return out
    return {i: out.get(i, 1.0) * factor for i in costs}


def program_key(graph: MetaIR, sig_of: dict[str, str]) -> str:
    """The cache key of a program's factor: a digest of its ops' signatures in order. Kept like the ops'
    slowdowns, so that the next compile of the same step (a restart, another rank count's re-plan) prices it
    the same and its solver sees the same problem (and finds its answer kept)."""
    import hashlib

    h = hashlib.sha256()
    for op in graph.ops:
        h.update(sig_of[op.id].encode())
        h.update(b"\n")
    return "program:" + h.hexdigest()


def _by_signature(graph: MetaIR, costs: dict, cache: dict[str, float], sig_of: dict[str, str]) -> dict[str, float]:
    """Each op's slowdown: its signature's, else that of the largest timed op of its key and dtypes."""
    by_key: dict[tuple, tuple[int, float]] = {}
    for op in graph.ops:
        s = cache.get(sig_of[op.id])
        if op.id not in costs or not s:
            continue
        key = (op.key, tuple(graph.vars[v].dtype for v in op.inputs))
        n = sum(int(graph.vars[v].numel) for v in [*op.inputs, *op.outputs] if graph.vars[v].is_tensor)
        if n >= by_key.get(key, (-1, 0.0))[0]:
            by_key[key] = (n, s)
    out = {}
    for op in graph.ops:
        key = (op.key, tuple(graph.vars[v].dtype for v in op.inputs))
        s = cache.get(sig_of[op.id]) or by_key.get(key, (0, None))[1]
        if s and op.id in costs:
            out[op.id] = s
    return out


def program_factor(graph: MetaIR, costs: dict[str, tuple], slowdowns: dict[str, float], times: Any) -> float | None:
    """How many times longer the whole step's program ran (``times.program``) than its ops' times say (their
    rooflines times ``slowdowns``, plus the per-op dispatch of a lowered program, ``times.device.op_overhead``):
    each op is timed on its own inputs, hot in the caches, while the program reads what the op before it
    wrote. None where the program was not timed; clamped to :data:`PROGRAM_FACTOR`."""
    if times.program is None:
        return None
    spec = dataclasses.replace(times.device, op_overhead=0.0)
    roof = sum(
        roofline(op, graph, costs[op.id], spec) * slowdowns.get(op.id, 1.0) for op in graph.ops if op.id in costs
    )
    dispatch = times.device.op_overhead * len(graph.ops)
    factor = (times.program - dispatch) / max(roof, 1e-9)
    log.info(
        "the step's program ran %.1f ms alone; its ops' alone times say %.1f (+ %.1f dispatch): x%.2f",
        times.program * 1e3,
        roof * 1e3,
        dispatch * 1e3,
        factor,
    )
    return min(max(factor, PROGRAM_FACTOR[0]), PROGRAM_FACTOR[1])


__all__ = ["LIMITS", "PROGRAM_FACTOR", "VERSION", "program_factor", "program_key", "roofline", "whole_slowdowns"]
