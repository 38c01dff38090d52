"""ILP solver: every mesh axis at once, through scipy.optimize.milp (HiGHS).

One binary per (node, option) of the coarsened problem: a node's option fixes
its shardings on all mesh axes together. Each edge gets continuous variables
only over its *distinct* source and destination shardings (a transportation
polytope: row sums equal the source's choice, column sums the destination's),
which is exact for 0/1 choices and keeps the LP tight. The memory budget is a
constraint per op position, added lazily where the solution's peak breaks it.
Options: ``time_limit`` (s, default 60), ``mip_rel_gap`` (default 1e-4), ``presolve``
(HiGHS presolve; default "auto": on when constraints leave some options out, see :func:`wants_presolve`), ``least_peak`` (default True: an
infeasible budget's error gives the least peak any plan needs, one more solve), ``method`` ("auto":
one ILP unless a multi-axis mesh makes it bigger than ``AXES_ABOVE`` variables, then block coordinate
descent over mesh axes, solvers/_axes.py, except with recompute toggles; "whole"; "axes"), ``axis_block`` (the most mesh axes freed at a time, 2:
one at a time until no slice improves, then two), ``cache_dir`` (where proven answers are kept, solvers/_cache.py: the
same MILP is not solved twice; the planner passes its rule cache's directory; None: not kept), ``cache_mb`` (the
most MiB those answers take, the least recently used going first; the ilp_cache_mb setting, 512).
The plan carries the objective, the LP/MIP lower bound and the gap.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from metadist_core.hookspecs import hookimpl
from metadist_core.problem.problem import InfeasibleBudgetError
from metadist_core.problem.terms import Terms

from ._common import MemIndex, enforce_budget, min_memory_choice, over_budget, solve_problem
from . import _cache
from ._milp import _Model

NAME = "ilp"
log = logging.getLogger("metadist.solvers.ilp")
# above this many variables (options + edge table cells) the ILP of a multi-axis mesh is solved one block of
# mesh axes at a time (solvers/_axes.py): well above it HiGHS may not close the gap within the time limit, while
# problems below it solve exactly
AXES_ABOVE = 200_000


def _lazy(model: _Model, start_steps: list[int], budget: float, deadline: float, gap: float, peak_var: bool = False):
    """Solve, adding the memory row of each violated peak, until the budget holds everywhere."""
    steps = list(dict.fromkeys(start_steps))
    rounds = 0
    while True:
        rounds += 1
        res = model.solve(steps, budget, deadline - time.perf_counter(), gap, peak_var=peak_var)
        if res.x is None:
            return res, None, steps, rounds
        ch = model.choice(res.x)
        if model.mem is None:
            return res, ch, steps, rounds
        prof = model.profile(res.x)
        tpk = int(np.argmax(prof))
        limit = res.x[-1] * model.mem_unit if peak_var else budget
        log.debug(
            "ilp lazy round %d: %d memory rows, peak %s at step %d against %s (%s), %.1f s left",
            rounds,
            len(steps),
            f"{int(prof[tpk]):,}",
            tpk,
            f"{limit:,.0f}",
            res.message,
            deadline - time.perf_counter(),
        )
        if not over_budget(prof[tpk], limit) or tpk in steps or time.perf_counter() > deadline:
            return res, ch, steps, rounds
        steps.append(tpk)


def wants_presolve(t: Terms) -> bool:
    """HiGHS presolve pays where constraints (a strategy preset, pins, forbids) leave options out: the
    transportation polytopes of their edges keep pair variables that only presolve removes, and the solve
    is many times faster with it. It pays under a memory budget too, where the memory rows join the
    polytopes (docs/HISTORY.md has the measurements). On an unconstrained problem without a budget it buys
    nothing (the same time or slower), so there it stays off."""
    return t.budget is not None or any(not a.all() for a in t.allowed)


def ilp_terms(t: Terms, options: dict) -> tuple[np.ndarray, float | None, dict]:
    """Solve Terms exactly (up to ``mip_rel_gap``) within ``time_limit``; returns (choice, lower bound, stats)."""
    t0 = time.perf_counter()
    time_limit = float(options.get("time_limit", 60.0))
    gap = float(options.get("mip_rel_gap", 1e-4))
    deadline = t0 + time_limit
    if t.n_nodes == 0:
        return np.zeros(0, dtype=np.int64), t.offset, {"status": "trivial"}
    method = options.get("method", "auto")
    size = ilp_size(t)
    if method not in ("auto", "whole", "axes"):
        raise ValueError(
            f"ilp option method={method!r}: use 'auto', 'whole' (one ILP) or 'axes' (descent over mesh axes)"
        )
    codes = options.get("_axis_codes")
    if codes is not None and not t.toggles and (method == "axes" or (method == "auto" and size > AXES_ABOVE)):
        return _by_axes(t, options, codes(), deadline, size)
    model = _Model(t)
    pre = options.get("presolve", "auto")
    model.presolve = wants_presolve(t) if pre == "auto" else bool(pre)
    model.cache_dir = options.get("cache_dir")
    model.cache_mb = float(options.get("cache_mb", model.cache_mb))
    stats = {
        "variables": model.nv,
        "binaries": model.nx,
        "constraints": model.A.shape[0],
        "presolve": model.presolve,
        "build_seconds": time.perf_counter() - t0,
    }
    budget = t.budget
    steps: list[int] = []
    if budget is not None and model.mem is not None:
        mem = model.mem
        steps = [int(np.argmax(mem.profile(min_memory_choice(t, mem))))]
    first = None
    if model.r_idx and budget is not None and model.cache_dir is not None:
        # the recompute proposal of this very problem ran out of this much time before: not waited for again
        # (a run given no more time would run out again)
        first = model.key(steps, budget, gap)
        spent = _cache.ran_out(model.cache_dir, first, time_limit)
        if spent is not None:
            raise RuntimeError(
                f"the ILP ran out of time_limit={spent:g} s before its toggles and shardings met "
                f"the memory budget when this problem was solved before; raise time_limit"
            )
    res, ch, steps, rounds = _lazy(model, steps, budget if budget is not None else np.inf, deadline, gap)
    stats.update(
        {
            "status": res.message,
            "memory_rows": len(steps),
            "lazy_rounds": rounds,
            "cached": model.cache_hits,
            "milp_seconds": time.perf_counter() - t0 - stats["build_seconds"],
        }
    )
    if ch is None:
        if res.status == 2 and budget is not None:
            # least_peak=False: the caller only needs to know (the least peak is another ILP solve)
            need = _min_peak(model, t, deadline + 30.0, gap) if options.get("least_peak", True) else budget + 1
            raise InfeasibleBudgetError(budget, need, t.mesh_name)
        if budget is None:
            # no incumbent in time: hand back a beam plan, with the ILP's bound when it has one
            from ._common import multi_sweep

            ch, _ = multi_sweep(t, 8, 3)
            stats["status"] = f"no ILP incumbent within time_limit={time_limit:g} s; beam plan returned"
        else:
            bound = t.least_peak_bound()  # no plan in time: a budget under what every plan holds is the reason
            if bound > budget:
                raise InfeasibleBudgetError(budget, bound, t.mesh_name, how="needs at least")
            raise RuntimeError(
                f"the ILP found no plan within time_limit={time_limit:g} s ({res.message}); "
                f"raise time_limit or use solver='beam'"
            )
    if model.r_idx:  # toggles priced: the toggles and shardings go back together, not repaired one by one
        on = model.toggles_on(res.x)
        stats["toggles_on"] = [int(j) for j in np.flatnonzero(on)]
        if model.mem is not None and over_budget(model.mem.peak(ch, on), budget):
            if first is not None:
                _cache.note_ran_out(model.cache_dir, first, time_limit)
            raise RuntimeError(
                f"the ILP ran out of time_limit={time_limit:g} s before its toggles and shardings "
                f"met the memory budget ({res.message}); raise time_limit"
            )
    elif model.mem is not None and over_budget(model.mem.peak(ch), budget):
        # the lazy memory rows ran out of time (or a row was already in): the incumbent is over budget;
        # repair it rather than return it (the bound below still holds for the repaired plan)
        over = int(model.mem.peak(ch))
        ch = enforce_budget(t, t.adjacency(), ch, NAME)
        stats["status"] = (
            f"{res.message}; the ILP incumbent needed {over:,} bytes per device over the budget "
            f"of {int(budget):,} when time ran out, repaired by local search"
        )
    if res.status != 0 and not model.r_idx:  # stopped before proving optimality: a beam sweep may do better
        ch, note = _better_of_beam(t, model, ch, budget)
        if note:
            stats["status"] = f"{stats['status']}; {note}"
    lb = getattr(res, "mip_dual_bound", None)
    lb = None if lb is None or not np.isfinite(lb) else float(lb) / model.scale + t.offset
    return ch, lb, stats


def ilp_size(t: Terms) -> int:
    """The size of the ILP of ``t``, counted before building it: its options and its edge and shared tables'
    cells (the model adds indicator variables for shared terms, so the model built is larger)."""
    return int(sum(t.n_options) + sum(e.table.size for e in t.edges) + sum(g.table.size for g in t.shared))


def _by_axes(t: Terms, options: dict, groups: list, deadline: float, size: int) -> tuple[np.ndarray, None, dict]:
    """Block coordinate descent over mesh axes from a beam plan (solvers/_axes.py), each slice an exact ILP."""
    from ._axes import descend
    from ._common import multi_sweep

    t0 = time.perf_counter()
    start, _ = multi_sweep(t, 8, 3)
    if t.budget is not None and t.mem:
        start = enforce_budget(t, t.adjacency(), start, NAME)
    sub_opts = {k: v for k, v in options.items() if k != "_axis_codes"}
    sub_opts.update(method="whole", least_peak=False)

    budget = t.budget if t.mem else None
    mem = MemIndex(t) if budget is not None else None

    def solve(sub: Terms, seconds: float) -> np.ndarray:
        return ilp_terms(sub, {**sub_opts, "time_limit": seconds})[0]

    def fits(choice: np.ndarray) -> bool:  # a slice stopped by its time limit may hand back an over-budget plan
        return mem is None or not over_budget(mem.peak(choice), budget)

    # one axis at a time until no slice improves (cheap slices); then each block of up to ``axis_block`` axes
    # once (slices as big as a smaller mesh's whole problem), and one axis at a time again from there
    ch, stats = start, {}
    top = int(options.get("axis_block", 2))
    for phase, (block, rounds) in enumerate([(1, 50)] + [(b, 1) for b in range(2, top + 1)] + [(1, 50)] * (top > 1)):
        ch, st = descend(t, groups, ch, solve, deadline, block=block, max_rounds=rounds, accept=fits)
        stats.update({f"{k}_{phase}": v for k, v in st.items()})
    stats.update(
        {
            "status": f"block coordinate descent over mesh axes: the whole ILP has {size:,} options and table "
            f"cells (over {AXES_ABOVE:,}); each slice solved exactly, no bound on the whole",
            "variables": size,
            "start_ms": t.objective(start) * 1e3,
            "milp_seconds": time.perf_counter() - t0,
        }
    )
    return ch, None, stats


def _better_of_beam(t: Terms, model: _Model, ch: np.ndarray, budget: float | None) -> tuple[np.ndarray, str]:
    """The ILP incumbent or a beam sweep's plan, whichever is cheaper (and within the budget). On a large
    problem HiGHS's incumbent at the time limit can cost well over the plan a beam sweep finds in a
    fraction of a second."""
    from ._common import multi_sweep

    beam, _ = multi_sweep(t, 8, 3)
    if model.mem is not None and over_budget(model.mem.peak(beam), budget):
        return ch, ""
    ours, theirs = t.objective(ch), t.objective(beam)
    if theirs < ours:
        return beam, f"a beam sweep's plan ({theirs * 1e3:.3f} ms) beat the ILP incumbent ({ours * 1e3:.3f} ms)"
    return ch, ""


def _min_peak(model: _Model, t: Terms, deadline: float, gap: float) -> int:
    """The least peak memory any plan of ``t`` can have (ILP, lazily over op positions)."""
    start = [int(np.argmax(model.mem.profile(min_memory_choice(t, model.mem))))]
    res, ch, _, _ = _lazy(model, start, np.inf, deadline, gap, peak_var=True)
    if ch is None:
        return int(model.mem.peak(min_memory_choice(t, model.mem)))
    return int(np.ceil(model.profile(res.x).max()))


@hookimpl
def metadist_solver_info():
    return {
        "name": NAME,
        "description": "exact ILP over all mesh axes at once (scipy milp / HiGHS), "
        "memory budget as a constraint; objective, lower bound and gap",
    }


@hookimpl
def metadist_solve(problem, options):
    return solve_problem(problem, options or {}, NAME, ilp_terms)
