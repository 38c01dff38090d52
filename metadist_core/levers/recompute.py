"""Activation recomputation, the choice: which forward segments to recompute under a memory budget.

The segments and the rewritten graph are :mod:`metadist_core.levers.recompute_segments`'.

- :func:`toggles` prices each segment as a yes/no decision of the sharding
  problem of the plain graph (:class:`metadist_core.problem.terms.Toggle`): on, the
  copies' compute (each under its original's sharding) is paid, the copies'
  bytes are live from where they run to their last backward reader, and the
  originals' bytes stop at their last forward reader. A solver that prices
  toggles (the ILP) chooses the segments and the shardings together.
- :func:`choose` solves the plain graph; when no plan meets the budget it takes
  the segments the ILP chose (``propose``) and solves their rewritten graph
  exactly; without a proposal (another solver), or when the exact solve does
  not fit, it searches: the fewest segments, in order of bytes saved per FLOP
  recomputed, whose rewritten graph has a plan under the memory budget
  (bisection over the count).
"""

from __future__ import annotations

import numpy as np

import logging
from typing import Any, Callable, Sequence

from metadist_core.ir.ir import MetaIR
from metadist_core.problem.problem import InfeasibleBudgetError
from metadist_core.plan.planstats import PlanStats
from metadist_core.levers.recompute_segments import SUFFIX, Segment, order, rewrite, segments
from metadist_core.ir.aliasing import alias_liveness
from metadist_core.problem.terms import EdgeTerm, MemTerm, Toggle
from metadist_core.plan.memprofile import budget_for
from metadist_core.plan.overlap import predict

log = logging.getLogger("metadist.recompute")


class RecomputeBudgetError(InfeasibleBudgetError):
    """No plan meets the memory budget, with or without recomputation (or with it turned off).

    ``without`` / ``with_recompute``: the least bytes per device a plan needs without recomputation, and
    with every segment recomputed (with ``recompute=False``: a plan's bytes that fits when recomputing).
    """

    def __init__(self, message: str, budget: int, without: int, with_recompute: int) -> None:
        ValueError.__init__(self, message)
        self.budget, self.without, self.with_recompute = int(budget), int(without), int(with_recompute)
        self.needed = min(self.without, self.with_recompute) if self.with_recompute > self.budget else self.without


def toggles(problem: Any, graph: MetaIR, segs: Sequence[Segment]) -> tuple[list[Any], list[int]]:
    """One :class:`metadist_core.problem.terms.Toggle` per segment of ``graph``, on the nodes of ``problem`` (the sharding
    problem of ``graph`` itself, not rewritten), and the step map to set as ``problem.step_map``: memory is
    counted at the positions of the graph with every segment rewritten, so a chain of copies frees each
    link as the next one runs, as the lowering does. Set both with :func:`price_segments`."""

    if not segs:
        return [], list(range(len(graph.ops) + 1))
    full = rewrite(graph, [i for s in segs for i in s.recompute])
    live, views = alias_liveness(full, full.liveness())
    step_map = [k for k, op in enumerate(full.ops) if not op.id.endswith(SUFFIX)] + [len(full.ops)]
    sm = lambda p: p if p < 0 else step_map[p]  # noqa: E731   (plain position -> rewritten)

    def nbytes(v: str) -> tuple[int, Any]:
        node, slot = problem.definer(v)
        return node, problem.output_bytes(node, slot)

    into: dict[tuple[int, str], list] = {}  # (reader node, value) -> its edges
    for e in problem.edges:
        if e.dst >= 0 and e.dst_slot >= 0:
            into.setdefault((e.dst, e.var), []).append(e)
    out = []
    for s in segs:
        unary = [(problem.op_node(i), problem.compute[problem.op_node(i)]) for i in s.recompute]
        # the copies read their inputs again, in the backward: each reshard paid once more (an upper bound:
        # a backward reader of the same value in the same target may share it)
        pairs = [
            EdgeTerm(e.src, e.dst, e.src_map, e.dst_map, e.table)
            for i in s.recompute
            for v in dict.fromkeys(graph.op(i).inputs)
            for e in into.get((problem.op_node(i), v), [])
            if np.any(e.table)
        ]
        drop, add = [], []
        for i in s.ops:  # the segment's values held for less long
            for v in graph.op(i).outputs:
                info = problem.vars.get(v)
                if info is None or info["shape"] is None or info.get("view") or info.get("host") or v not in live:
                    continue
                end, stop = sm(int(info["live"][1])), live[v][1]
                if stop < end:
                    node, b = nbytes(v)
                    drop.append(MemTerm(node, b, stop + 1, end))
        for i in s.recompute:  # the copies, from where they run to their last reader
            for v in graph.op(i).outputs:
                c = v + SUFFIX
                info = problem.vars.get(v)
                if c not in live or c in views or info is None or info["shape"] is None:
                    continue
                node, b = nbytes(v)
                add.append(MemTerm(node, b, live[c][0], live[c][1]))
        out.append(Toggle(unary, add, drop, f"segment {s.index}", pairs))
    return out, step_map


def price_segments(problem: Any, graph: MetaIR, segs: Sequence[Segment]) -> Any:
    """``problem`` (of ``graph``, not rewritten) with one toggle per segment (:func:`toggles`); returns it."""
    problem.toggles, problem.step_map = toggles(problem, graph, segs)
    return problem


def needed(e: InfeasibleBudgetError) -> int:
    """The budget the error's leanest plan needs, its collectives' buffers included where the solve that
    raised it says how to count them (``e.need_with_buffers``, set by the driver)."""
    f = getattr(e, "need_with_buffers", None)
    return int(f()) if f is not None else int(getattr(e, "needed", 0))


def choose(
    graph: MetaIR,
    budget: int | None,
    solve: Callable[[MetaIR], tuple[Any, Any]],
    flops: dict[str, float] | None = None,
    enabled: bool = True,
    propose: Callable[[list[Segment], int], list[Segment] | None] | None = None,
) -> tuple[MetaIR, tuple[Any, Any], list[Segment]]:
    """Solve ``graph``; when no plan fits ``budget``, recompute forward segments until one fits.

    ``propose(segments, cut)``: the segments a solver that prices :func:`toggles` chose under the budget
    less ``cut`` bytes (None: it has no choice); their rewritten graph is solved first, and proposed again
    under a budget cut by what its plan overshot with the collectives' buffers (once more). Without one, or
    when that graph has no plan under the budget, segment counts are solved from all down, halving, while
    the step :func:`step_seconds` predicts does not grow (bisecting for the fewest that fit where a count
    does not fit and fewer were still faster), and the count predicted fastest wins (fewer recomputed ops
    leave the sharding less memory, which it may pay for in collectives).

    ``solve(graph)`` returns ``(problem, plan)`` or raises :class:`InfeasibleBudgetError`
    (its ``.needed``: the least bytes per device any plan of that graph needs; :func:`needed`). Returns
    the graph solved (rewritten when recomputing), ``solve``'s result and the
    segments recomputed.
    """
    try:
        return graph, solve(graph), []
    except InfeasibleBudgetError as e:
        if budget is None:
            raise
        first = e
    segs = order(segments(graph, flops))
    if not segs:
        raise first
    picked = propose(segs, 0) if enabled and propose is not None else None
    cut = 0
    tried: set = set()
    for _ in range(3):  # the proposal's plan may overshoot once the collectives' buffers are priced
        if not picked or propose is None:
            break
        key = tuple(sorted(id(s) for s in picked))
        g = rewrite(graph, [i for s in picked for i in s.recompute])
        try:
            res = solve(g)
        except InfeasibleBudgetError as e:
            over = int(getattr(e, "needed", 0)) - int(budget)
            log.info(
                "the %d segments chosen with the shardings need %s bytes per device with the collectives' "
                "buffers, over the budget of %s",
                len(picked),
                f"{getattr(e, 'needed', 0):,}",
                f"{budget:,}",
            )
            if over <= 0:
                break
            # cut the proposal's budget by the overshoot; when the same segments come back (the solver's terms
            # had that much slack), by at least 1 % of the budget more, and twice the cut before
            cut = max(cut + over, 2 * cut, cut + int(budget) // 100) if key in tried else cut + over
            tried.add(key)
            picked = propose(segs, cut)
            continue
        _chosen_by(res, "the solver, with the shardings")
        log.info(
            "recompute %d of %d forward segments (%d ops), chosen with the shardings, to fit %s bytes per device",
            len(picked),
            len(segs),
            sum(len(s.recompute) for s in picked),
            f"{budget:,}",
        )
        return g, res, picked
    if propose is not None and enabled:
        log.info("no recomputation chosen with the shardings fits; searching segment counts")
    ops_for = lambda k: [i for s in segs[:k] for i in s.recompute]  # noqa: E731
    full = rewrite(graph, ops_for(len(segs)))
    try:
        best = (len(segs), full, solve(full))
    except InfeasibleBudgetError as e:
        without, lean = needed(first), needed(e)
        raise RecomputeBudgetError(
            f"memory budget of {budget:,} bytes per device cannot be met: the leanest plan without "
            f"recomputation needs {without:,} bytes, and recomputing every one of the {len(segs)} forward "
            f"segments still needs {lean:,}; raise memory_budget to at least {min(without, lean):,}, use more devices, "
            f"or offload the optimizer state",
            budget,
            without,
            lean,
        ) from e
    if not enabled:
        without = needed(first)
        raise RecomputeBudgetError(
            f"memory budget of {budget:,} bytes per device cannot be met with recompute=False: the leanest "
            f"plan needs {without:,} bytes per device; with recomputation (recompute=True) a plan needs "
            f"{budget_for(*best[2]):,} or less; allow recompute or raise memory_budget to {without:,}",
            budget,
            without,
            budget_for(*best[2]),
        ) from first
    fits = {len(segs): best[1:]}  # segments recomputed -> (graph, (problem, plan))
    times = {len(segs): step_seconds(*best[2])}

    def attempt(k: int) -> bool:
        try:
            g = rewrite(graph, ops_for(k))
            fits[k] = (g, solve(g))
        except InfeasibleBudgetError:
            return False
        times[k] = step_seconds(*fits[k][1])
        return True

    # from all segments down, halving: each count fewer leaves the sharding less memory, which it may pay
    # for in collectives more than the recomputation saved. Down while the predicted step
    # (metadist_core.plan.overlap.predict) does not grow; where a count does not fit while fewer segments were
    # still faster, the fewest that fit are found by bisection, while each count found is not slower than
    # the one above it (fewer solves than a bisection over every count). Under a tight budget every segment
    # recomputed is often fastest, and two solves decide, where a bisection from none up would solve many
    # more counts
    prev, k = len(segs), len(segs) // 2
    while k >= 1:
        if not attempt(k):
            lo, hi = k, prev  # infeasible at lo, feasible at hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if not attempt(mid):
                    lo = mid
                elif times[mid] > times[hi]:  # fewer segments cost more here: the fewest that fit would too
                    break
                else:
                    hi = mid
            break
        if times[k] > times[prev]:  # fewer segments cost more: fewer still would not pay
            break
        prev, k = k, k // 2
    k = min(times, key=lambda c: (times[c], c))
    g, res = fits[k]
    _chosen_by(res, "search over segment counts")
    log.info(
        "recompute %d of %d forward segments (%d ops) to fit %s bytes per device (predicted step %s)",
        k,
        len(segs),
        len(ops_for(k)),
        f"{budget:,}",
        ", ".join(f"{c}: {times[c] * 1e3:.1f} ms" for c in sorted(times)),
    )
    return g, res, segs[:k]


def _chosen_by(res: tuple[Any, Any], how: str) -> None:
    stats = getattr(res[1], "stats", None)
    if isinstance(stats, PlanStats):
        stats.recompute_chosen_by = how


def step_seconds(problem: Any, plan: Any) -> float:
    """The step time the cost model predicts for ``plan`` as the lowering runs it (the solver's objective
    when the plan has no problem to replay)."""
    if problem is None or not getattr(plan, "choices", None):
        return float(plan.objective)
    return predict(plan, problem).step


__all__ = ["RecomputeBudgetError", "choose", "needed", "price_segments", "step_seconds", "toggles"]
