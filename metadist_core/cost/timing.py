"""Timing a call as every frontend times one: an untimed warm-up, repeated timings, one figure from them.

Framework-free: a frontend hands its own ``sync`` (``torch.cuda.synchronize``; for JAX the call itself
ends in ``jax.block_until_ready``) and, where the ranks of one machine must compute at once, its own
``before`` (a barrier). :func:`time_call` times one call; :func:`time_rounds` times several calls in
interleaved rounds, so that a slow spell of the machine falls on all of them alike.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

#: at most this many calls in one timing, however short one call is (``window``)
MAX_REPS = 10000


def calls_per_window(one: float, window: float, at_least: int = 1) -> int:
    """How many calls of ``one`` seconds each make one timing last about ``window`` seconds
    (``at_least`` of them, :data:`MAX_REPS` at most)."""
    return max(at_least, min(MAX_REPS, int(window / max(one, 1e-7))))


def time_call(
    fn: Callable[[], Any],
    iters: int | None = 7,
    *,
    sync: Callable[[], Any] | None = None,
    before: Callable[[], Any] | None = None,
    reps: int = 1,
    window: float = 0.0,
    budget: float | None = None,
    pick: Callable[[list[float]], float] = statistics.median,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """``pick`` (the median by default) of the seconds one ``fn()`` takes, over ``iters`` timings of ``reps``
    calls each, after one untimed warm-up call.

    ``sync()`` waits for the device after the warm-up and after each timing's calls; ``before()`` runs
    untimed ahead of every timing. ``window``: more calls per timing, until one timing lasts about that
    many seconds (read off the warm-up). ``budget``: seconds from the end of the warm-up after which no
    timing starts (``iters=None``: as many timings as the budget holds). No timing at all: ``inf``."""
    if iters is None and budget is None:
        raise ValueError("time_call needs iters or a budget")
    t0 = clock()
    fn()
    if sync is not None:
        sync()
    if window > 0:
        reps = calls_per_window(clock() - t0, window, reps)
    end = None if budget is None else clock() + budget
    ts: list[float] = []
    while (iters is None or len(ts) < iters) and (end is None or clock() < end):
        if before is not None:
            before()
        t0 = clock()
        for _ in range(reps):
            fn()
        if sync is not None:
            sync()
        ts.append((clock() - t0) / reps)
    return pick(ts) if ts else math.inf


def time_rounds(
    calls: Sequence[Callable[[], Any]],
    rounds: int,
    per_round: int = 1,
    *,
    sync: Callable[[], Any] | None = None,
    pick: Callable[[list[float]], float] = statistics.median,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """``pick`` (the median by default) of the seconds of each of ``calls``: each run once untimed, then
    ``rounds`` rounds that time every call ``per_round`` times, forwards and backwards in turn so that none
    always goes first."""
    for fn in calls:
        fn()
        if sync is not None:
            sync()
    times: list[list[float]] = [[] for _ in calls]
    order = list(range(len(calls)))
    for r in range(rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            for _ in range(per_round):
                t0 = clock()
                calls[i]()
                if sync is not None:
                    sync()
                times[i].append(clock() - t0)
    return [pick(t) for t in times]


__all__ = ["MAX_REPS", "calls_per_window", "time_call", "time_rounds"]
