"""Shared solver machinery: coarsen -> solve Terms -> expand -> ShardingPlan, memory repair, local search."""

from __future__ import annotations

import copy
import logging
import time
from typing import Callable

import numpy as np

from metadist_core.problem.coarsen import Coarsening, coarsen
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.problem import InfeasibleBudgetError, ShardingProblem
from metadist_core.problem.terms import Terms

log = logging.getLogger("metadist.solvers")

# A Terms solver returns (coarse choice, lower bound or None, stats dict).
TermsSolver = Callable[[Terms, dict], tuple[np.ndarray, float | None, dict]]


def over_budget(peak: float, budget: float | None) -> bool:
    """Does ``peak`` break ``budget`` (None: no budget)? A byte and a relative 1e-9 of slack absorb the float
    rounding of memory rows solved in scaled units."""
    return budget is not None and peak > budget * (1 + 1e-9) + 1


def solve_problem(problem: ShardingProblem, options: dict, name: str, fn: TermsSolver) -> ShardingPlan:
    """Coarsen (unless ``options['coarsen']`` is False), run ``fn`` on the Terms, and build the plan."""
    t0 = time.perf_counter()
    co = coarsened(problem, options)
    t1 = time.perf_counter()
    if problem.mesh.ndim > 1:  # what the axis descent needs to slice options by mesh axis (solvers/_axes.py)
        from ._axes import axis_codes

        options = {**options, "_axis_codes": lambda: axis_codes(problem, co)}
    choice, lb, stats = fn(co.terms, options)
    t2 = time.perf_counter()
    fine = co.expand(choice)
    stats = {
        **stats,
        "coarsen_seconds": t1 - t0,
        "search_seconds": t2 - t1,
        "sizes": co.stages,
        "coarse_objective": co.terms.objective(np.asarray(choice)),
    }
    on = stats.get("toggles_on")
    if on is not None:  # toggles priced (recomputation): the plan is a proposal whose memory counts them
        mask = np.zeros(len(co.terms.toggles), dtype=bool)
        mask[list(on)] = True
        peak = co.terms.peak_memory(np.asarray(choice), mask)
        stats["peak_with_toggles"] = peak
        stats["objective_with_toggles"] = co.terms.objective(np.asarray(choice), mask)
    plan = ShardingPlan.from_choices(problem, fine, solver=name, solve_seconds=t2 - t0, lower_bound=lb, stats=stats)
    if on is not None:
        if over_budget(peak, problem.memory_budget):
            raise RuntimeError(
                f"solver {name} returned toggles and shardings of {peak:,} bytes per device over "
                f"the budget of {problem.memory_budget:,}; this is a solver bug"
            )
    elif problem.memory_budget is not None and plan.memory_per_device > problem.memory_budget:
        if stats.get("status") == "trivial":  # nothing to choose (one device): the only plan is the leanest
            raise InfeasibleBudgetError(problem.memory_budget, plan.memory_per_device, problem.mesh)
        raise RuntimeError(
            f"solver {name} returned a plan of {plan.memory_per_device:,} bytes per device over the "
            f"budget of {problem.memory_budget:,}; this is a solver bug"
        )
    return plan


def coarsened(problem: ShardingProblem, options: dict) -> Coarsening:
    """``problem`` coarsened as ``options`` say (``coarsen``: False keeps every node but the fixed ones;
    ``tie_layers``), kept with the problem's terms: the same problem solved again under another budget
    (:meth:`ShardingProblem.with_budget`, which shares its terms) is not coarsened again."""
    plain = options.get("coarsen", True) is False
    tie = False if plain else bool(options.get("tie_layers", True))
    kept = problem.terms_memo()
    key = (plain, tie, tuple(id(t) for t in problem.toggles), id(problem.step_map))
    hit = kept.get(key)
    if hit is None:
        co = (
            coarsen(problem, followers=False, fixed=True, tie_layers=False)
            if plain
            else coarsen(problem, tie_layers=tie)
        )
        kept[key] = (co, list(problem.toggles), problem.step_map)  # the toggles kept alive: their ids stay theirs
        return co
    co = copy.copy(hit[0])
    co.terms = copy.copy(co.terms)
    co.terms.budget = problem.memory_budget
    return co


class MemIndex:
    """Vectorised peak-memory evaluation of a Terms (its toggles' terms where ``on`` says a toggle is on)."""

    def __init__(self, t: Terms) -> None:
        self.t = t
        m = t.mem
        self.node, self.start, self.stop, self.bytes = self._arrays(m)
        self.by_node: dict[int, np.ndarray] = {}
        for r, x in enumerate(m):
            self.by_node.setdefault(x.node, []).append(r)
        self.by_node = {k: np.asarray(v) for k, v in self.by_node.items()}
        self.length = t.n_steps + 3
        # the toggles' terms: sign +1 (added when on) / -1 (dropped when on), and the toggle of each
        tm = [
            (x, sg, j) for j, tg in enumerate(t.toggles) for sg, xs in ((1, tg.mem_add), (-1, tg.mem_drop)) for x in xs
        ]
        self.t_node, self.t_start, self.t_stop, self.t_bytes = self._arrays([x for x, _, _ in tm])
        self.t_sign = np.array([sg for _, sg, _ in tm], dtype=float)
        self.t_toggle = np.array([j for _, _, j in tm], dtype=np.int64)

    @staticmethod
    def _arrays(m) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        node = np.array([x.node for x in m], dtype=np.int64)
        start = np.array([x.start + 1 for x in m], dtype=np.int64)
        stop = np.array([x.end + 2 for x in m], dtype=np.int64)
        kmax = max([len(x.nbytes) for x in m] + [1])
        b = np.zeros((len(m), kmax))
        for r, x in enumerate(m):
            b[r, : len(x.nbytes)] = x.nbytes
        return node, start, stop, b

    def profile(self, choice: np.ndarray, on: np.ndarray | None = None) -> np.ndarray:
        """Bytes per device at each position under ``choice``, with the toggles ``on`` (None: all off)."""
        if not len(self.node):
            return np.zeros(1)
        k = np.where(self.node < 0, 0, np.asarray(choice)[np.maximum(self.node, 0)])
        b = self.bytes[np.arange(len(k)), k]
        prof = np.zeros(self.length)
        np.add.at(prof, self.start, b)
        np.add.at(prof, self.stop, -b)
        if on is not None and len(self.t_node):
            sel = np.asarray(on, dtype=bool)[self.t_toggle]
            k = np.where(self.t_node < 0, 0, np.asarray(choice)[np.maximum(self.t_node, 0)])
            b = self.t_bytes[np.arange(len(k)), k] * self.t_sign * sel
            np.add.at(prof, self.t_start, b)
            np.add.at(prof, self.t_stop, -b)
        return np.cumsum(prof)[:-1]

    def peak(self, choice: np.ndarray, on: np.ndarray | None = None) -> float:
        return float(self.profile(choice, on).max())

    def live_at(self, node: int, step_index: int) -> np.ndarray:
        """Bytes at profile index ``step_index`` that node's options hold (per option)."""
        rows = self.by_node.get(node)
        if rows is None:
            return np.zeros(self.t.n_options[node])
        live = (self.start[rows] <= step_index) & (self.stop[rows] > step_index)
        k = self.t.n_options[node]
        return self.bytes[rows[live]][:, :k].sum(axis=0) if live.any() else np.zeros(k)


def local_costs(
    t: Terms, adj, choice: np.ndarray, i: int, lookahead: bool = False, ref: np.ndarray | None = None
) -> np.ndarray:
    """Cost of each option of node ``i`` given its assigned neighbours (choice < 0: unassigned).

    An unassigned neighbour counts at its option in ``ref`` when given, else
    (``lookahead``) at its best option for each of ours, else not at all.
    """
    cost = t.masked_unary(i)
    for j, is_src in adj[i]:
        e = t.edges[j]
        other = e.dst if is_src else e.src
        k = choice[other]
        if k < 0 and ref is not None:
            k = ref[other]
        if k >= 0:
            cost = cost + (e.table[e.src_map, e.dst_map[k]] if is_src else e.table[e.src_map[k], e.dst_map])
        elif lookahead:
            ou = t.masked_unary(other)
            dense = e.dense() if is_src else e.dense().T
            cost = cost + (dense + ou[None, :]).min(axis=1) - ou.min()
    return cost


def icm(
    t: Terms, adj, choice: np.ndarray, mem: MemIndex | None = None, budget: float | None = None, max_passes: int = 10
) -> np.ndarray:
    """Iterated conditional modes: move one node at a time to its best option while that lowers the cost."""
    choice = choice.copy()
    for _ in range(max_passes):
        improved = False
        for i in range(t.n_nodes):
            cost = local_costs(t, adj, choice, i)
            cur = cost[choice[i]]
            order = np.argsort(cost, kind="stable")
            for k in order:
                if cost[k] >= cur - 1e-15 * max(1.0, abs(cur)):
                    break
                if budget is not None and mem is not None:
                    trial = choice.copy()
                    trial[i] = k
                    if mem.peak(trial) > budget:
                        continue
                choice[i] = k
                improved = True
                break
        if not improved:
            break
    return choice


def min_memory_choice(t: Terms, mem: MemIndex) -> np.ndarray:
    """Per node, the allowed option whose values take the fewest bytes (summed over its lifetimes)."""
    choice = np.zeros(t.n_nodes, dtype=np.int64)
    for i in range(t.n_nodes):
        rows = mem.by_node.get(i)
        k = t.n_options[i]
        w = (
            (mem.bytes[rows][:, :k] * (mem.stop[rows] - mem.start[rows])[:, None]).sum(axis=0)
            if rows is not None
            else np.zeros(k)
        )
        w = np.where(t.allowed[i], w, np.inf)
        tie = t.unary[i] * 1e-30
        choice[i] = int(np.argmin(w + tie))
    return choice


def repair_memory(
    t: Terms, adj, choice: np.ndarray, mem: MemIndex, budget: float, max_moves: int = 2000
) -> np.ndarray | None:
    """Move nodes to smaller options at the peak, cheapest cost per byte saved first, until the budget holds."""
    choice = choice.copy()
    for _ in range(max_moves):
        prof = mem.profile(choice)
        tpk = int(np.argmax(prof))
        if prof[tpk] <= budget:
            return choice
        best = None
        for node in mem.by_node:
            if node < 0:
                continue
            held = mem.live_at(node, tpk)
            saving = held[choice[node]] - held
            if not (saving > 0).any():
                continue
            cost = local_costs(t, adj, choice, node)
            delta = cost - cost[choice[node]]
            for k in np.flatnonzero((saving > 0) & np.isfinite(cost)):
                score = delta[k] / saving[k]
                if best is None or score < best[0]:
                    best = (score, node, int(k))
        if best is None:
            return None
        choice[best[1]] = best[2]
    return None


def enforce_budget(t: Terms, adj, choice: np.ndarray, solver: str) -> np.ndarray:
    """Make ``choice`` fit ``t.budget`` (repair, else the least-memory plan), or raise InfeasibleBudgetError."""
    if t.budget is None or not t.mem:
        return choice
    if t.shared:  # local search reads pairwise terms: shared reshards charged per reader (an upper bound)
        t = t.pairwise()
        adj = t.adjacency()
    mem = MemIndex(t)
    if mem.peak(choice) <= t.budget:
        return choice
    fixed = repair_memory(t, adj, choice, mem, t.budget)
    if fixed is None:
        low = min_memory_choice(t, mem)
        need = mem.peak(low)
        if need > t.budget:
            raise InfeasibleBudgetError(t.budget, int(need), t.mesh_name, how=f"that {solver} found needs")
        fixed = repair_memory(t, adj, low, mem, t.budget) or low
    return icm(t, adj, fixed, mem, t.budget)


def sweep(t: Terms, adj, width: int, ref: np.ndarray | None) -> tuple[float, np.ndarray]:
    """One beam sweep in node order; unassigned neighbours count at ``ref`` (or by lookahead when None).

    Returns the best full choice and its exact objective.
    """
    beams = [(0.0, np.full(t.n_nodes, -1, dtype=np.int64))]
    for i in range(t.n_nodes):
        cands = []
        for bi, (real, ch) in enumerate(beams):
            exact = local_costs(t, adj, ch, i)
            score = local_costs(t, adj, ch, i, lookahead=ref is None, ref=ref)
            for k in np.argsort(score, kind="stable")[:width]:
                if np.isfinite(exact[k]):
                    cands.append((real + score[k], real + exact[k], bi, int(k)))
        cands.sort(key=lambda c: (c[0], c[1]))
        new_beams = []
        for _, real, bi, k in cands[:width]:
            ch = beams[bi][1].copy()
            ch[i] = k
            new_beams.append((real, ch))
        beams = new_beams
    best = min(beams, key=lambda b: b[0])[1]
    return t.objective(best), best


def multi_sweep(t: Terms, width: int, passes: int, icm_passes: int = 10) -> tuple[np.ndarray, list[float]]:
    """Sweeps (first with lookahead, then against the best so far), each polished by ICM; also tries all-first options."""
    t = t.pairwise()  # shared reshards charged per reader: what one-node moves can price (an upper bound)
    adj = t.adjacency()
    trace = []
    obj, best = sweep(t, adj, width, None)
    best = icm(t, adj, best, max_passes=icm_passes)
    obj = t.objective(best)
    trace.append(obj)
    start = np.array([int(np.flatnonzero(a)[0]) for a in t.allowed], dtype=np.int64)
    start = icm(t, adj, start, max_passes=icm_passes)
    if t.objective(start) < obj:
        obj, best = t.objective(start), start
    for _ in range(max(0, passes - 1)):
        o2, c2 = sweep(t, adj, width, best)
        c2 = icm(t, adj, c2, max_passes=icm_passes)
        o2 = t.objective(c2)
        trace.append(o2)
        if o2 >= obj - 1e-15 * abs(obj):
            break
        obj, best = o2, c2
    return best, trace
