"""Ops priced at the time they take at each strategy's local shapes, where the frontend times them.

The roofline prices a strategy of an op at its FLOPs and bytes divided by the ways the strategy splits
it: a matmul split by its rows is priced as the whole one, an eighth of the time. On a CPU the kernel's
rate depends on the local shape: with every device computing at once, a matmul of few local rows runs
further over its roofline than one of many rows (:mod:`metadist_jax.localtime`), so a plan of thin local
matmuls runs over its price. So where a frontend says it times an op
(:attr:`~metadist_core.driver.frontend.FrontendTraits.times_local`), :func:`apply` asks it to time the op at the
local input shapes of every strategy the problem offers (:meth:`~metadist_core.driver.frontend.Frontend.time_ops`,
the dearest first, in batches, within :data:`BUDGET_SECONDS` a compile), and multiplies each strategy's
roofline by the measured time over the roofline at the rates measured in the same run, a ratio that
carries over to the profile's rates. A strategy left untimed (too small, past the budget, refused) takes
the median of those timed, so that it does not look cheap for being untimed. A kernel (the op's signature
at the local shapes: the same op of every layer, and every strategy that gives it those pieces) is timed
once per machine: the figures are kept beside the mesh profile (``<profile>-local.json``), so later
compiles, the presets autotune solves and the recompute proposals time nothing twice.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from metadist_core import cachefiles
from metadist_core.cost.model import DeviceSpec, compute_cost, local_shape
from metadist_core.cost.profile import cache_dir_of
from metadist_core.ir.ir import op_signature

log = logging.getLogger("metadist.localtime")

#: a strategy whose roofline is under this many seconds is not timed (its time would be mostly the per-op
#: overhead, priced apart, and noise); it takes the median
MIN_SECONDS = 20e-6
#: measured slowdowns are clamped to this range
LIMITS = (0.5, 4.0)
#: seconds a compile may spend timing kernels it has no figure for, by default (the ``local_time_seconds``
#: setting): the dearest (by roofline) go first, in
#: batches of :data:`BATCH`, and what is left when it is spent takes the median (a transformer offers
#: hundreds of distinct local matmuls, each compiled and timed)
BUDGET_SECONDS = 10.0
BATCH = 32
#: the cache file's format (:meth:`LocalTimer.save`): a file of another version is measured again
VERSION = 1

Shapes = tuple[tuple[int, ...], ...]
#: what a frontend is asked to time: an op, its tensor inputs' local shapes and their dtypes
Request = tuple[Any, Shapes, tuple[str, ...]]


@dataclass
class LocalTimer:
    """What a compile's builds share: which ops the frontend times (``wants``), how it times a batch of
    requests on the mesh (``measure(requests, mesh)`` -> seconds per request, None where it could not, and
    the DeviceSpec of the rates it measured in the same run), and what it measured so far, per op signature
    at the local shapes (the same kernel on the same pieces, whichever op and strategy asked)."""

    wants: Callable[[Any], bool]
    measure: Callable[[list[Request], Any], tuple[list[float | None], DeviceSpec]]
    times: dict[str, tuple[float, DeviceSpec] | None] = field(default_factory=dict)
    seconds: float = 0.0  # time spent measuring, in all
    slowdowns: list[float] = field(default_factory=list)  # of the strategies priced so, every build
    cache_file: str | os.PathLike | None = None  # this machine's figures, kept between compiles
    budget: float = BUDGET_SECONDS
    left_out: int = 0  # kernels left untimed when the budget was spent (priced at the median)
    warned: bool = False

    def __post_init__(self) -> None:
        self._load()

    def stats(self) -> dict:
        return {
            "kernels_timed": sum(v is not None for v in self.times.values()),
            "seconds": self.seconds,
            "left_untimed": self.left_out,
            "median_slowdown": float(np.median(self.slowdowns)) if self.slowdowns else None,
        }

    def _load(self) -> None:
        if self.cache_file is None:
            return
        for kernel, figure in _read(Path(self.cache_file)).items():
            self.times.setdefault(kernel, figure)

    def save(self) -> None:
        """Write the figures measured so far beside the mesh profile (atomically), merged with those other
        processes kept there meanwhile; a cache dir that cannot be written gives one warning."""
        if self.cache_file is None:
            return
        path = Path(self.cache_file)
        with cachefiles.exclusive(path):
            kernels = {k: v for k, v in _read(path).items() if self.times.get(k) is None}
            kernels.update({k: v for k, v in self.times.items() if v is not None})
            text = json.dumps(
                {"version": VERSION, "kernels": {k: [v[0], v[1].to_json()] for k, v in kernels.items()}},
                sort_keys=True,
            )
            cachefiles.write_atomic(path, text, cache_dir=cache_dir_of(path), what="local op times")


def _parse(raw: bytes) -> dict[str, tuple[float, DeviceSpec]]:
    """The figures in a cache file's bytes; none when it is of another :data:`VERSION`."""
    saved = json.loads(raw)
    if not isinstance(saved, dict):
        raise ValueError(f"a JSON {type(saved).__name__}, not an object of kernel times")
    if saved.get("version") != VERSION:
        return {}  # another format: measured again
    return {str(k): (float(sec), DeviceSpec.from_json(rates)) for k, (sec, rates) in saved.get("kernels", {}).items()}


def _read(path: Path) -> dict[str, tuple[float, DeviceSpec]]:
    """The figures kept in ``path``; none when there is no file or it is corrupt (one warning)."""
    return cachefiles.read(path, _parse, "local op times") or {}


def _measure(timer: LocalTimer, kernels: list[str], ask: dict[str, Request], mesh: Any) -> None:
    """Time ``kernels`` (dearest first) in batches until the timer's budget is spent; keep the figures."""
    t0 = time.perf_counter()
    done = 0
    for i in range(0, len(kernels), BATCH):
        if timer.seconds + (time.perf_counter() - t0) >= timer.budget:
            break
        batch = kernels[i : i + BATCH]
        secs, rates = timer.measure([ask[k] for k in batch], mesh)
        for kernel, sec in zip(batch, secs):
            timer.times[kernel] = None if sec is None else (float(sec), rates)
        done += len(batch)
    spent = time.perf_counter() - t0
    timer.seconds += spent
    if done < len(kernels):
        timer.left_out += len(kernels) - done
        (log.warning if not timer.warned else log.info)(
            "timed %d of %d kernels at their local shapes in %.1f s, the budget of a compile (the rest are "
            "priced at the median slowdown of those timed until a later compile times them; kept in %s)",
            done,
            len(kernels),
            spent,
            timer.cache_file or "no file",
        )
        timer.warned = True
    else:
        log.info("timed %d kernels at their local shapes in %.1f s", done, spent)
    timer.save()


def apply(
    timer: LocalTimer,
    graph: Any,
    mesh: Any,
    device: DeviceSpec,
    entries: Sequence[tuple[int, Any, list, list[int], float, float, str | None]],
    compute: list[np.ndarray],
) -> None:
    """Reprice, in place, the strategies of the ops ``timer`` wants: ``entries`` holds per op its index in
    ``compute``, the op, its strategies, their splits, its FLOPs and bytes and its compute dtype."""
    todo: list[tuple[int, int, str | None, float, float, int, str | None]] = []
    ask: dict[str, Request] = {}
    dearest: dict[str, float] = {}  # a kernel's largest roofline among the strategies that ask for it
    for row, op, opts, splits, flops, nbytes, dt in entries:
        if not timer.wants(op):
            continue
        t_in = [v for v in op.inputs if graph.vars[v].is_tensor]
        dtypes = tuple(graph.vars[v].dtype for v in t_in)
        for k, (strategy, split) in enumerate(zip(opts, splits)):
            roof = compute_cost(flops, nbytes, split, device, dt) - device.op_overhead
            if roof < MIN_SECONDS:  # not timed: priced at the others' median slowdown (below)
                todo.append((row, k, None, flops, nbytes, split, dt))
                continue
            shapes = tuple(local_shape(graph.vars[v].shape, sh, mesh) for v, sh in zip(t_in, strategy.inputs))
            kernel = op_signature(op.key, shapes, dtypes, op.attrs)
            todo.append((row, k, kernel, flops, nbytes, split, dt))
            if kernel not in timer.times:
                ask[kernel] = (op, shapes, dtypes)
                dearest[kernel] = max(dearest.get(kernel, 0.0), roof)
    if ask:
        _measure(timer, sorted(ask, key=lambda kn: -dearest[kn]), ask, mesh)
    found: list[tuple[int, int, float, float, int, str | None, float | None]] = []
    for row, k, kernel_of, flops, nbytes, split, dt in todo:
        got = timer.times.get(kernel_of) if kernel_of is not None else None
        slow = None
        if got is not None:
            sec, rates = got
            roof = compute_cost(flops, nbytes, split, rates, dt) - rates.op_overhead
            if roof > 0:
                slow = float(min(max(sec / roof, LIMITS[0]), LIMITS[1]))
                timer.slowdowns.append(slow)
        found.append((row, k, flops, nbytes, split, dt, slow))
    # a strategy not timed (too small, over the budget, refused) takes the median of those timed: priced at
    # its bare roofline it would look cheaper than its timed neighbours for being untimed
    timed = [f[-1] for f in found if f[-1] is not None]
    if not timed:
        return
    median = float(np.median(timed))
    for row, k, flops, nbytes, split, dt, slow in found:
        compute[row][k] = compute_cost(flops, nbytes, split, device, dt, median if slow is None else slow)


__all__ = ["BATCH", "BUDGET_SECONDS", "LIMITS", "LocalTimer", "MIN_SECONDS", "Request", "VERSION", "apply"]
