"""Block coordinate descent over mesh axes, for problems too big for one ILP (meshes of three or more axes).

A node's option fixes its placements on every mesh axis at once, so a 3-axis
mesh multiplies the options of a one-axis mesh three times over and the edge
tables with them (an ILP that HiGHS may not close the gap of within its time
limit). Here each round frees the placements on one
block of mesh axes and keeps every node's placements on the other axes where the
current plan has them; that slice is an ILP of one-axis size, solved exactly,
and its optimum never costs more than the plan it started from. Rounds go
through every block until none improves the plan. The start is a beam sweep's
plan. The result has no optimality bound (the plan's gap is unknown).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import numpy as np

from metadist_core.problem.terms import Terms, contract


def axis_codes(problem, co) -> list[np.ndarray | None]:
    """Per coarse node of ``co``, an int array (options, mesh axes, member nodes): the code of the placements
    each member node's option has on each mesh axis. Two options of a coarse node place everything the
    same on the axes in S exactly when their codes agree on S."""
    intern: dict = {}
    per_strategy: dict[int, np.ndarray] = {}
    ndim = problem.mesh.ndim

    def codes(opt) -> np.ndarray:
        got = per_strategy.get(id(opt))
        if got is None:
            shardings = tuple(opt.inputs) + tuple(opt.outputs)
            got = np.array(
                [intern.setdefault(tuple(s[a] for s in shardings), len(intern)) for a in range(ndim)], dtype=np.int64
            )
            per_strategy[id(opt)] = got
        return got

    fine: dict[int, np.ndarray] = {}
    members: list[list[int]] = [[] for _ in range(co.terms.n_nodes)]
    for i, c in enumerate(co.assign):
        if c >= 0:
            members[c].append(i)
    out: list[np.ndarray | None] = []
    for ms in members:
        if not ms:
            out.append(None)
            continue
        cols = []
        for i in ms:
            if i not in fine:
                fine[i] = np.stack([codes(o) for o in problem.nodes[i].options])
            cols.append(fine[i][co.maps[i]])
        out.append(np.stack(cols, axis=2))
    return out


def _key(g: np.ndarray, fixed: tuple[int, ...]) -> np.ndarray:
    """Per option, an id of its placements on the ``fixed`` axes."""
    if not fixed:
        return np.zeros(g.shape[0], dtype=np.int64)
    flat = np.ascontiguousarray(g[:, list(fixed), :].reshape(g.shape[0], -1))
    return np.unique(flat, axis=0, return_inverse=True)[1].reshape(-1)


def descend(
    t: Terms,
    groups: list[np.ndarray | None],
    start: np.ndarray,
    solve: Callable[[Terms, float], np.ndarray],
    deadline: float,
    block: int = 1,
    max_rounds: int = 50,
    log: Callable[[str], None] | None = None,
    accept: Callable[[np.ndarray], bool] | None = None,
) -> tuple[np.ndarray, dict]:
    """Improve ``start`` one block of ``block`` mesh axes at a time (see the module docstring), for at most
    ``max_rounds`` rounds through every block.

    ``solve(sub_terms, seconds)`` returns a choice of the sub-problem; a cheaper one replaces the plan when
    ``accept`` (if given: the memory budget) takes it. Returns the choice and stats.
    """
    ndim = next((g.shape[1] for g in groups if g is not None), 0)
    blocks = list(itertools.combinations(range(ndim), min(block, ndim)))
    keys: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
    cur = np.asarray(start, dtype=np.int64).copy()
    obj = t.objective(cur)
    history = [obj]
    rounds = solves = 0
    biggest = 0
    out_of_time = False
    while time.perf_counter() < deadline and rounds < max_rounds:
        rounds += 1
        improved = False
        for free in blocks:
            if time.perf_counter() >= deadline:
                break
            fixed = tuple(a for a in range(ndim) if a not in free)
            maps = []
            for i in range(t.n_nodes):
                g = groups[i]
                if g is None:
                    ok = np.flatnonzero(t.allowed[i])
                else:
                    k = keys.get((i, fixed))
                    if k is None:
                        k = keys[(i, fixed)] = _key(g, fixed)
                    ok = np.flatnonzero(t.allowed[i] & (k == k[cur[i]]))
                maps.append(ok)
            sub = contract(t, list(range(t.n_nodes)), maps, [len(m) for m in maps], t.names)
            biggest = max(biggest, sub.size()["edge_cells"] + sum(sub.n_options))
            try:
                ch = solve(sub, max(0.1, deadline - time.perf_counter()))
            except RuntimeError:  # no plan of the block in the time left: the plan so far stands
                if time.perf_counter() < deadline:
                    raise
                out_of_time = True
                break
            solves += 1
            new = np.array([m[k] for m, k in zip(maps, ch)], dtype=np.int64)
            o = t.objective(new)
            if o < obj - 1e-12 * max(1.0, abs(obj)) and (accept is None or accept(new)):
                cur, obj = new, o
                improved = True
            if log:
                log(f"axis descent round {rounds}, axes {free} free: {o * 1e3:.4f} ms (best {obj * 1e3:.4f} ms)")
        history.append(obj)
        if not improved:
            break
    return cur, {
        "descent_rounds": rounds,
        "descent_solves": solves,
        "descent_history_ms": [h * 1e3 for h in history],
        "descent_largest_subproblem": int(biggest),
        "descent_out_of_time": out_of_time,
    }
