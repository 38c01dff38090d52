"""Peak memory of one chosen plan, with the buffers its collectives make.

The solver's memory terms (:meth:`metadist_core.problem.terms.Terms.peak_memory`)
charge every value its bytes under the sharding its defining node chose, over
its liveness; they depend on one decision each, which keeps them linear in
the ILP. A plan also holds what its reshards make: an all_reduce's result
beside the partial sum it reduces, an all_gather's whole parameter, each held
from where it is made to the last op of its reader phase that reads the value
in that sharding (:mod:`metadist_core.cost.phases`: the forward's copy is not kept for
the backward), while a value that every reader takes resharded dies as soon as its
collective has been issued. Those bytes depend on two decisions (the source's
sharding and the reader's), so :func:`peak_with_buffers` prices them for a
chosen plan, after the solve: what ``step.memory`` and the memory benchmark
report beside the measurement (``predicted_with_buffers_bytes``).

Positions are op positions as in the memory terms (-1: before the first op,
``n_steps``: the end of the step). A reshard from a ``Partial`` sharding
(all_reduce, reduce_scatter) is issued as soon as its input exists (the torch
lowering issues all_reduces early, :mod:`metadist_torch.lower.schedule`); others are
made at their first reader; a view of a moved value (a reshape of a gathered
activation) keeps the moved copy alive as long as the view lives. Bucketed
all_reduces of gradients share one flat buffer per bucket: each gradient lives
from where it is made until the last reader of its bucket, and where the bucket
runs (once its last member exists) its concatenation and the collective's
result are held beside the members (``problem.bucket_copies``, what the
frontend's lowering makes: the torch one 2; an ``avg``'s quotient is made
where the result is waited for, once the members and the concatenation are gone; XLA schedules JAX's collectives itself, 0). Inputs all-gathered in one bucket
(:mod:`metadist_core.cost.gathers`) are all made where the bucket runs, beside its
two flat buffers (the pieces sent and the gathered whole), which are held from where the bucket
before it runs: the program issues each bucket then (FSDP's prefetch).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import numpy as np

from metadist_core.cost.buckets import bucket_key, bucketed_step
from metadist_core.cost.model import local_bytes
from metadist_core.cost.gathers import bucket_cap, gather_buckets
from metadist_core.ir.placement import Sharding
from metadist_core.cost.reshard import reshard
from metadist_core.problem.problem import InfeasibleBudgetError

log = logging.getLogger("metadist.memprofile")

# the part of a memory budget plans leave free for what the model does not count (a kernel's workspace,
# allocator rounding, the engine's own buffers)
HEADROOM = 0.03
#: the most solves :func:`fit_with_buffers` spends tightening the solver's budget until the buffers fit
FIT_ROUNDS = 6
#: where a tighter budget gave no leaner plan, the next cut is at least this part of the budget (1/200: 0.5 %)
MIN_CUT_PARTS = 200


def _intervals(problem: Any, choice: np.ndarray) -> list[tuple[int, int, float]]:
    """(start, end, bytes) of every value and every reshard buffer of the plan ``choice``."""
    n_in = sum(1 for n in problem.nodes if n.kind == "input")
    n_steps = problem.n_steps
    rep = Sharding.replicated(problem.mesh.ndim)
    src_sh: dict[str, Sharding] = {}
    for i, n in enumerate(problem.nodes):
        for s, v in enumerate(n.outputs):
            src_sh[v] = n.options[int(choice[i])].outputs[s]
    # per value: (target sharding, reader phase) -> [first reader position, last reader position]
    targets: dict[str, dict[tuple[Sharding, int], list[int]]] = {}
    for e in problem.edges:
        if e.dst < 0:  # a graph output, returned whole
            pos, tgt = n_steps, rep
        elif e.dst_slot < 0:  # an updated state, back to its input's sharding at the end of the step
            pos, tgt = n_steps, problem.nodes[e.dst].options[int(choice[e.dst])].outputs[0]
        else:
            pos = e.dst - n_in
            tgt = problem.nodes[e.dst].options[int(choice[e.dst])].inputs[e.dst_slot]
        span = targets.setdefault(e.var, {}).setdefault((tgt, problem.edge_phase(e, src_sh[e.var])), [pos, pos])
        last = pos
        if e.dst >= 0 and e.dst_slot >= 0:  # a view of the moved copy keeps the copy alive while the view lives
            last = max(
                [pos]
                + [
                    problem.vars[o]["live"][1]
                    for o in problem.nodes[e.dst].outputs
                    if problem.vars.get(o, {}).get("view")
                ]
            )
        span[0], span[1] = min(span[0], pos), max(span[1], last)
    out: list[tuple[int, int, float]] = []
    early: dict[tuple, int] = {}  # (var, target, phase) -> where its gather bucket runs (metadist_core.cost.gathers)
    before = None  # where the bucket before runs: the program issues this one there (prefetch)
    for bucket in gather_buckets(problem, choice):
        at = bucket[0].first
        for g in bucket:
            early[(g.var, g.key[2], g.key[3])] = at
        # the flat buffers (the pieces sent and the gathered whole), from the issue to the wait
        out.append((at if before is None else min(before, at), at, float(sum(g.gathered + g.local for g in bucket))))
        before = at
    reduced: list[
        tuple
    ] = []  # bucketed gradients: (issue, end, bytes, bucket group, copies, source bytes, held, first read)
    # offloaded values (metadist_core.levers.offload) live in the host's memory, not the device's, where the device
    # has a memory of its own (a host link); on a CPU the host is the device and they count
    apart = getattr(getattr(problem, "device", None), "host_link", None) is not None
    for v, info in problem.vars.items():
        if info["shape"] is None or v not in src_sh or (apart and info.get("host")):
            continue
        start, end = info["live"]
        own = src_sh[v]
        reads = targets.get(v, {})
        direct = [span for (t, _), span in reads.items() if t == own]
        moved = [(t, span) for (t, _), span in reads.items() if t != own]
        issue = [
            start if own.has_partial() else early.get((v, t, ph), span[0])
            for (t, ph), span in reads.items()
            if t != own
        ]
        if moved and not direct and end < n_steps:  # read only resharded: gone once its collectives are issued
            end = max(issue)
        if not info.get("view"):  # a view holds its base's storage (counted there); its reshards are its own
            out.append((start, end, float(local_bytes(info["shape"], info["dtype"], own, problem.mesh))))
        for (t, span), at in zip(moved, issue):
            b = float(local_bytes(info["shape"], info["dtype"], t, problem.mesh))
            colls = (
                reshard(own, t, info["shape"], info.get("comm_dtype", info["dtype"]), problem.mesh)
                if info.get("bucketed")
                else []
            )
            step = bucketed_step(problem, v, colls)
            if step is not None and all(c.is_free for c in colls[step + 1 :]):  # a bucket makes the target
                copies = problem.bucket_copies
                # the bucket's result: a gradient all_reduced whole and then split is a narrow of the whole
                b = float(local_bytes(info["shape"], info["dtype"], colls[step].after, problem.mesh))
                src_b = float(local_bytes(info["shape"], info["dtype"], own, problem.mesh))
                held = 0.0 if info.get("view") else src_b  # a view's partial sum is its base's bytes
                reduced.append((at, span[1], b, bucket_key(problem, v, colls[step]), copies, src_b, held, span[0]))
            else:
                out.append((at, span[1], b))
    caps = {"all_reduce": problem.bucket_bytes, "reduce_scatter": getattr(problem, "shard_bucket_bytes", None)}
    return out + _buckets(reduced, caps, getattr(problem, "first_bucket_bytes", None))


def _buckets(reduced: list[tuple], caps: dict, first_cap: int | None = None) -> list[tuple[int, int, float]]:
    """All_reduces and reduce_scatters of gradients made in buckets of up to ``caps[kind]`` bytes
    (:func:`metadist_torch.lower.coalesce.coalesce_all_reduces`): one flat buffer per bucket whose results are
    views, so every result lives until the bucket's last reader. A bucket runs once its last member
    exists; until then each member is its own partial sum, held from where it is made. Where the bucket
    runs, the partial sums, their concatenation and the collective's result are all held at once
    (``copies``: 2; 0 when the lowering makes no copies; an ``avg``'s quotient comes later, at the wait,
    when the concatenation is gone). A reduce_scatter's concatenation is held from there while the collective
    is in flight: until the next bucket of its group is issued, or the program waits for it (the first read
    of any member's result), whichever comes first (a step can peak at a bucket's reduce_scatter with the
    concatenation of the bucket before it still held).
    The results (whole for an all_reduce, the members' shards for a reduce_scatter) live on
    from there; the partial sums die there. A gradient that is a view holds no bytes of its own until the
    bucket runs: its base holds its partial sum (counting both would charge it twice)."""
    out = []
    open_: dict[tuple, list] = {}
    opened: dict[tuple, int] = {}  # buckets per key: the first all_reduce bucket is held to first_cap

    in_flight: dict[tuple, tuple[int, int, float]] = {}  # key -> the last reduce_scatter bucket's concatenation

    def close(cur: list, key: tuple) -> None:
        end, total, members, copies, src_total = cur
        at = max(start for start, _, _, _ in members)
        for start, b, held, _ in members:  # the partial sum until the bucket runs, then the result
            out.extend([(start, at, held), (at, end, b)])
        if not copies:
            return
        if key[0][0] != "reduce_scatter":  # the concatenation, less the result where it is reduced in place
            out.append((at, at, src_total + total * (copies - 2)))
            return
        # a reduce_scatter's result is a tensor of its own (held as the members): the concatenation is all extra
        # (charged less the result under one copy, the prediction falls short of what the step holds)
        extra = src_total
        # a reduce_scatter's concatenation is a buffer of its own that the collective holds while in flight:
        # until the next bucket of its group is issued or the program waits for it (before the first read of
        # any member's result), whichever comes first
        prev = in_flight.pop(key, None)
        if prev is not None:
            out.append((prev[0], max(prev[0], min(prev[1], at)), prev[2]))
        in_flight[key] = (at, max(at, min(first for _, _, _, first in members)), extra)

    for start, end, b, group, copies, sb, held, first in sorted(reduced, key=lambda r: r[:3]):
        key = (group, copies)  # group: kind, mesh axis, reduce op and dtype (metadist_core.cost.buckets.bucket_key)
        kind = group[0]
        cur = open_.get(key)
        cap = bucket_cap(caps.get(kind) or 0, first_cap if kind == "all_reduce" else None, opened.get(key, 0))
        if cur is None or ((cur[1] + b) if kind == "all_reduce" else (cur[4] + sb)) > cap:
            if cur is not None:
                close(cur, key)
            cur = open_[key] = [end, 0.0, [], copies, 0.0]
            opened[key] = opened.get(key, 0) + 1
        cur[0], cur[1], cur[4] = max(cur[0], end), cur[1] + b, cur[4] + sb
        cur[2].append((start, b, held, first))
    for key, c in open_.items():
        close(c, key)
    out.extend(in_flight.values())
    return out


def profile_with_buffers(problem: Any, choice: np.ndarray) -> np.ndarray:
    """Bytes per device live at each position -1 .. n_steps (index 0 is position -1), buffers included."""
    prof = np.zeros(problem.n_steps + 3)
    for start, end, b in _intervals(problem, np.asarray(choice)):
        prof[start + 1] += b
        prof[end + 2] -= b
    return np.cumsum(prof)[:-1]


def peak_with_buffers(problem: Any, plan: Any) -> int:
    """The peak bytes per device of ``plan`` (its ``choices`` on ``problem``), reshard buffers included."""
    if problem is None or not getattr(plan, "choices", None) or len(plan.choices) != len(problem.nodes):
        return int(getattr(plan, "memory_per_device", 0) or 0)
    return int(profile_with_buffers(problem, np.asarray(plan.choices)).max())


def headroom_target(budget: int) -> int:
    """The bytes a plan may hold under ``budget``, collectives' buffers included: the budget less :data:`HEADROOM`."""
    return int(budget * (1.0 - HEADROOM))


def fit_with_buffers(problem: Any, plan: Any, resolve: Callable[[Any], Any], rounds: int = FIT_ROUNDS) -> Any:
    """A plan whose peak *with* collective buffers meets ``problem.memory_budget`` less :data:`HEADROOM`.

    The solver holds only its linear memory terms to the budget. When the chosen plan's buffers take it
    over the target, ``resolve(tighter_problem)`` solves again under a tighter solver budget: first the
    target less the overshooting plan's buffers; when that is infeasible (no plan's own terms go that
    low), halfway between the least any plan needs and the last budget that gave too many buffers; after
    a plan that still overshoots, that budget less the overshoot (at most ``rounds`` solves). When none
    fits, ``InfeasibleBudgetError`` says what the leanest plan found needs, with its buffers and the
    headroom.
    """
    budget = problem.memory_budget
    if budget is None:
        return plan
    target = headroom_target(budget)
    peak = peak_with_buffers(problem, plan)
    log.debug(
        "fit_with_buffers: the plan under %s peaks at %s with buffers (target %s)",
        f"{int(budget):,}",
        f"{peak:,}",
        f"{target:,}",
    )
    if peak <= target:
        return plan
    best = peak  # the least peak with buffers seen
    over = int(problem.memory_budget)  # the last solver budget whose plan overshot the target
    floor = 0  # no plan's own terms go below this (from an infeasible solve)
    b = target - max(0, peak - int(plan.memory_per_device))
    last_cut = 0
    for _ in range(rounds):
        if b <= floor:
            b = (floor + over) // 2
        if b <= floor or b >= over:
            break
        try:
            cand = resolve(problem.with_budget(int(b)))
        except InfeasibleBudgetError as e:
            floor = max(floor, int(e.needed))
            b = (floor + over) // 2
            continue
        peak = peak_with_buffers(problem, cand)
        log.debug(
            "fit_with_buffers: solver budget %s gives a peak of %s with buffers (target %s)",
            f"{int(b):,}",
            f"{peak:,}",
            f"{target:,}",
        )
        if peak <= target:
            return cand
        # below the plan's own terms, not the budget it was solved under (the terms may have had slack: then
        # cutting the budget by the overshoot gives the same plan back); and when the overshoot did not shrink,
        # by twice the last cut, at least 1 / MIN_CUT_PARTS of the budget, so that a few rounds reach a different plan
        cut = peak - target
        if peak >= best:
            cut = max(cut, 2 * last_cut, int(budget) // MIN_CUT_PARTS)
        last_cut = cut
        best = min(best, peak)
        over = int(b)
        b = min(int(b), int(cand.memory_per_device)) - cut
    need = int(math.ceil(best / (1.0 - HEADROOM)))
    raise InfeasibleBudgetError(
        budget, need, problem.mesh, f"found needs, with its collectives' buffers and {HEADROOM:.0%} headroom,"
    )


def budget_for(problem: Any, plan: Any) -> int:
    """The budget under which ``plan`` fits with its collectives' buffers and the :data:`HEADROOM`."""
    return int(math.ceil(peak_with_buffers(problem, plan) / (1.0 - HEADROOM)))


def leanest_with_buffers(problem: Any, needed: int, resolve: Callable[[Any], Any]) -> int:
    """The budget the solver's leanest plan needs once its buffers and the headroom are counted.

    ``needed``: the least bytes the solver's own terms allow (an ``InfeasibleBudgetError``'s); the plan
    solved under that budget is measured with :func:`peak_with_buffers`. This is the figure to give a
    user: a budget of it fits that plan (``fit_with_buffers`` accepts it)."""
    return max(int(needed), budget_for(problem, resolve(problem.with_budget(int(needed)))))


__all__ = [
    "profile_with_buffers",
    "peak_with_buffers",
    "fit_with_buffers",
    "budget_for",
    "headroom_target",
    "leanest_with_buffers",
    "HEADROOM",
]
