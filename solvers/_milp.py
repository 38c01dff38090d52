"""The MILP of a Terms for scipy.optimize.milp (HiGHS): one binary per (node, option), edges as transportation
polytopes over their distinct source and destination shardings, memory rows added on demand, proven answers
kept on disk (solvers/_cache.py). The search strategy around it (lazy memory rows, axis descent, fallbacks) is
solvers/ilp.py's.
"""

from __future__ import annotations

import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from metadist_core.problem.terms import Terms

from . import _cache
from ._common import MemIndex


class _Model:
    """The MILP of a Terms: variables, the fixed rows, and memory rows added on demand."""

    def __init__(self, t: Terms) -> None:
        self.t = t
        self._keys: dict[tuple, str] = {}  # cache keys already digested (key)
        self.xoff = np.cumsum([0] + t.n_options[:-1]).astype(np.int64) if t.n_nodes else np.zeros(0, np.int64)
        nx = int(sum(t.n_options))
        c = [np.asarray(u, dtype=float) for u in t.unary]
        ub = [a.astype(float) for a in t.allowed]
        rows, cols, vals, lo, hi = [], [], [], [], []
        r = 0
        for i, k in enumerate(t.n_options):  # one option per node
            rows += [r] * k
            cols += list(range(self.xoff[i], self.xoff[i] + k))
            vals += [1.0] * k
            lo.append(1.0)
            hi.append(1.0)
            r += 1
        nv = nx

        def polytope(e) -> np.ndarray:
            """Pair variables y[row, column] of edge ``e`` (new, from ``nv``), tied to its ends' choices: each
            row sums to the source's indicator of that row, each column to the destination's."""
            nonlocal nv, r
            R, C = e.table.shape
            yidx = nv + np.arange(R * C).reshape(R, C)
            nv += R * C
            for q in range(R):
                ks = np.flatnonzero(e.src_map == q)
                rows.extend([r] * (C + len(ks)))
                cols.extend(yidx[q].tolist() + (self.xoff[e.src] + ks).tolist())
                vals.extend([1.0] * C + [-1.0] * len(ks))
                lo.append(0.0)
                hi.append(0.0)
                r += 1
            for q in range(C):
                ks = np.flatnonzero(e.dst_map == q)
                rows.extend([r] * (R + len(ks)))
                cols.extend(yidx[:, q].tolist() + (self.xoff[e.dst] + ks).tolist())
                vals.extend([1.0] * R + [-1.0] * len(ks))
                lo.append(0.0)
                hi.append(0.0)
                r += 1
            return yidx

        for e in t.edges:  # transportation polytope per edge
            polytope(e)
            c.append(e.table.reshape(-1))
            ub.append(np.full(e.table.size, np.inf))
        lb_extra: dict[int, float] = {}
        self._polytopes: dict[tuple, dict] = {}
        for g in t.shared:  # one z per (row, column) paid once, z >= every reader's pair
            R, C = g.table.shape
            z0 = nv
            nv += R * C
            c.append(g.table.reshape(-1))
            ub.append(np.ones(R * C))
            zidx = z0 + np.arange(R * C).reshape(R, C)
            for node, m in g.readers:
                pairs: dict = {}
                for (rr, cc), terms in self._pair_indicators(g, node, m, nv).items():
                    pairs.setdefault((rr, g.paid(rr, cc)), []).extend(terms)
                for (rr, cc), terms in pairs.items():
                    if g.table[rr, cc] <= 0:
                        continue
                    if not terms:  # both ends fixed: the pair is always there
                        lb_extra[int(zidx[rr, cc])] = 1.0
                        continue
                    rows += [r] * (1 + len(terms))
                    cols += [int(zidx[rr, cc])] + [j for j, _ in terms]
                    vals += [1.0] + [-v for _, v in terms]
                    lo.append(0.0)
                    hi.append(np.inf)
                    r += 1
                for extra_c, extra_ub, y_rows in self._pending:  # a transportation polytope for the pair
                    c.append(extra_c)
                    ub.append(extra_ub)
                    nv += len(extra_c)
                    for idx, coef in y_rows:
                        rows += [r] * len(idx)
                        cols += idx
                        vals += coef
                        lo.append(0.0)
                        hi.append(0.0)
                        r += 1
                self._pending = []
        # toggles (recomputing a forward segment): binary r; its costs through g >= cost(x) - C (1 - r); an
        # added memory term through w >= bytes(x) - B (1 - r), a dropped one through u <= bytes(x), u <= B r
        finite = np.abs(np.concatenate(c)) if c else np.zeros(0)
        finite = finite[np.isfinite(finite)]
        # HiGHS tolerances are absolute: bring costs (seconds, often 1e-9..1e-1) to order one
        self.scale = 1.0 / finite.max() * 1e3 if finite.size and finite.max() > 0 else 1.0
        self.mem_unit = float(max([1.0] + [float(np.max(m.nbytes)) for m in t.mem if len(m.nbytes)]))
        S, U = self.scale, self.mem_unit  # toggle rows in scaled seconds and in memory units
        self.r_idx: list[int] = []
        self.toggle_mem: list[tuple[object, int, int]] = []  # (MemTerm, variable, sign) for memory_row
        xo = self.xoff

        def expr(node: int, a: np.ndarray) -> tuple[list[int], list[float], float]:
            if node < 0:
                return [], [], float(a[0])
            return [int(xo[node] + k) for k in range(len(a))], [float(v) for v in a], 0.0

        for tg in t.toggles:
            rv = nv
            nv += 1
            self.r_idx.append(rv)
            c.append(np.zeros(1))
            ub.append(np.ones(1))
            if tg.unary or tg.pairs:
                cols_, vals_, const = [], [], 0.0
                for node, a in tg.unary:
                    cc, vv, k0 = expr(node, a)
                    cols_ += cc
                    vals_ += vv
                    const += k0
                for e in tg.pairs:  # a transportation polytope per pair, its cost into g
                    yidx = polytope(e)
                    c.append(np.zeros(e.table.size))
                    ub.append(np.full(e.table.size, np.inf))
                    cols_ += yidx.reshape(-1).tolist()
                    vals_ += e.table.reshape(-1).tolist()
                gv = nv
                nv += 1
                big = (
                    const
                    + sum(float(np.max(a)) for n_, a in tg.unary if n_ >= 0)
                    + sum(float(np.max(e.table)) for e in tg.pairs)
                )
                c.append(np.full(1, 1.0 / S))  # g in scaled seconds
                ub.append(np.full(1, np.inf))
                rows += [r] * (2 + len(cols_))  # g - cost(x) - big r >= const - big
                cols += [gv, rv] + cols_
                vals += [1.0, -big * S] + [-v * S for v in vals_]
                lo.append((const - big) * S)
                hi.append(np.inf)
                r += 1
            for sign, terms_ in ((1, tg.mem_add), (-1, tg.mem_drop)):
                for m in terms_:
                    mv = nv
                    nv += 1
                    c.append(np.zeros(1))
                    ub.append(np.full(1, np.inf))
                    cc, vv, k0 = expr(m.node, m.nbytes / U)  # w, u in memory units
                    big = float(np.max(m.nbytes)) / U
                    if sign > 0:  # w - bytes(x) - B r >= k0 - B
                        rows += [r] * (2 + len(cc))
                        cols += [mv, rv] + cc
                        vals += [1.0, -big] + [-v for v in vv]
                        lo.append(k0 - big)
                        hi.append(np.inf)
                        r += 1
                    else:  # u - bytes(x) <= k0 and u - B r <= 0
                        rows += [r] * (1 + len(cc))
                        cols += [mv] + cc
                        vals += [1.0] + [-v for v in vv]
                        lo.append(-np.inf)
                        hi.append(k0)
                        r += 1
                        rows += [r, r]
                        cols += [mv, rv]
                        vals += [1.0, -big]
                        lo.append(-np.inf)
                        hi.append(0.0)
                        r += 1
                    self.toggle_mem.append((m, mv, sign))
        self.nx, self.nv = nx, nv
        self.c = np.concatenate(c) if c else np.zeros(0)
        self.ub = np.concatenate(ub) if ub else np.zeros(0)
        self.lb = np.zeros(nv)
        for j, v in lb_extra.items():
            self.lb[j] = v
        self.A = coo_matrix((vals, (rows, cols)), shape=(r, nv)).tocsr()
        self.A.eliminate_zeros()  # zero costs of toggled pairs: HiGHS stumbled on explicit zeros
        self.lo, self.hi = np.asarray(lo), np.asarray(hi)
        self.mem = MemIndex(t) if t.mem else None
        self.mem_rows: dict[int, tuple[np.ndarray, float]] = {}

    _pending: list = []
    # scipy's HiGHS, not highspy: highspy's process-wide thread pool does not survive a fork (forked gloo ranks
    # that solve again hang)
    # HiGHS presolve: the ILP solver sets it (solvers/ilp.py: wants_presolve); on an unconstrained problem it
    # slows the solve down and finds the same optimum
    presolve: bool = False
    cache_dir: str | None = None  # where proven answers are kept (solvers/_cache.py); None: not kept
    cache_mb: float = _cache.DEFAULT_MB  # the most disk they take (the ilp_cache_mb setting)
    cache_hits: int = 0

    def _pair_indicators(self, g, node: int, m: np.ndarray, nv: int) -> dict:
        """``{(row, column): [(variable, coefficient)]}``: linear expressions that are 1 exactly when the
        source takes ``row`` and this reader ``column`` (empty list: always). New pair variables (a
        transportation polytope between two free nodes) start at index ``nv``, queued in ``_pending``."""
        out: dict = {}
        xo = self.xoff
        if g.src < 0 and node < 0:
            return {(int(g.src_map[0]), int(m[0])): []}
        if node < 0:
            for k, rr in enumerate(g.src_map):
                out.setdefault((int(rr), int(m[0])), []).append((int(xo[g.src] + k), 1.0))
            return out
        if g.src < 0:
            for k, cc in enumerate(m):
                out.setdefault((int(g.src_map[0]), int(cc)), []).append((int(xo[node] + k), 1.0))
            return out
        if node == g.src:
            for k, (rr, cc) in enumerate(zip(g.src_map, m)):
                out.setdefault((int(rr), int(cc)), []).append((int(xo[node] + k), 1.0))
            return out
        rows_, cols_ = np.unique(g.src_map), np.unique(m)
        key = (g.src, g.src_map.tobytes(), node, m.tobytes())
        if key in self._polytopes:  # the same two partitions of the same two nodes: reuse the pair variables
            return self._polytopes[key]
        yidx = nv + np.arange(len(rows_) * len(cols_)).reshape(len(rows_), len(cols_))
        y_rows = []
        for a, rr in enumerate(rows_):
            ks = np.flatnonzero(g.src_map == rr)
            y_rows.append((yidx[a].tolist() + (xo[g.src] + ks).tolist(), [1.0] * len(cols_) + [-1.0] * len(ks)))
        for b, cc in enumerate(cols_):
            ks = np.flatnonzero(m == cc)
            y_rows.append((yidx[:, b].tolist() + (xo[node] + ks).tolist(), [1.0] * len(rows_) + [-1.0] * len(ks)))
        self._pending = [(np.zeros(yidx.size), np.full(yidx.size, np.inf), y_rows)]
        for a, rr in enumerate(rows_):
            for b, cc in enumerate(cols_):
                out[(int(rr), int(cc))] = [(int(yidx[a, b]), 1.0)]
        self._polytopes[key] = out
        return out

    def memory_row(self, step: int) -> tuple[np.ndarray, float]:
        """Coefficients over x of the bytes live at profile index ``step``, and the constant part."""
        if step not in self.mem_rows:
            m = self.mem
            live = (m.start <= step) & (m.stop > step)
            coef = np.zeros(self.nv)
            const = 0.0
            for rr in np.flatnonzero(live):
                node = m.node[rr]
                if node < 0:
                    const += m.bytes[rr, 0]
                else:
                    k = self.t.n_options[node]
                    coef[self.xoff[node] : self.xoff[node] + k] += m.bytes[rr, :k]
            for mt, mv, sign in self.toggle_mem:  # toggled terms through their variables
                if mt.start + 1 <= step < mt.end + 2:
                    coef[mv] += sign * self.mem_unit
            self.mem_rows[step] = (coef, const)
        return self.mem_rows[step]

    def key(
        self,
        steps: list[int],
        budget: float,
        gap: float,
        objective: np.ndarray | None = None,
        peak_var: bool = False,
        parts: tuple | None = None,
    ) -> str:
        """The cache key of :meth:`solve` with these memory rows (the model HiGHS would see; ``parts``: its
        :meth:`_parts`, when built already). Kept per rows and budget under the model's own objective, so
        that the recompute proposal's marker check (solvers/ilp.py) and its first solve digest it once."""
        memo = (tuple(steps), float(budget), gap, peak_var, self.presolve) if objective is None else None
        if memo is not None and memo in self._keys:
            return self._keys[memo]
        c, integrality, lb, ub, cons = parts or self._parts(steps, budget, objective, peak_var)
        key = _cache.milp_key(
            [c, integrality, lb, ub, *[p for k in cons for p in (k.A, k.lb, k.ub)], gap, self.presolve]
        )
        if memo is not None:
            self._keys[memo] = key
        return key

    def _parts(self, steps: list[int], budget: float, objective: np.ndarray | None, peak_var: bool):
        c = self.c if objective is None else objective
        c = c * self.scale
        A, lo, hi = self.A, self.lo, self.hi
        nv = self.nv
        integrality = np.zeros(nv + int(peak_var))
        integrality[: self.nx] = 1
        integrality[self.r_idx] = 1
        ub = self.ub
        cons = [LinearConstraint(A if not peak_var else _pad(A), lo, hi)]
        if steps:
            M = np.array([self.memory_row(s)[0] for s in steps])
            consts = np.array([self.memory_row(s)[1] for s in steps])
            if peak_var:  # minimise the peak P (in units of mem_unit): rows - P <= -const
                M = np.hstack([M / self.mem_unit, -np.ones((len(steps), 1))])
                cons.append(LinearConstraint(M, -np.inf, -consts / self.mem_unit))
            else:
                cons.append(LinearConstraint(M / self.mem_unit, -np.inf, (budget - consts) / self.mem_unit))
        if peak_var:
            c = np.concatenate([np.zeros(nv), [1.0]])
            ub = np.concatenate([ub, [np.inf]])
        lb = np.concatenate([self.lb, np.zeros(len(ub) - len(self.lb))])
        return c, integrality, lb, ub, cons

    def solve(
        self,
        steps: list[int],
        budget: float,
        time_limit: float,
        gap: float,
        objective: np.ndarray | None = None,
        peak_var: bool = False,
    ):
        parts = self._parts(steps, budget, objective, peak_var)
        c, integrality, lb, ub, cons = parts
        t0 = time.perf_counter()

        def run(presolve: bool):
            return milp(
                c,
                integrality=integrality,
                bounds=Bounds(lb, ub),
                constraints=cons,
                options={
                    "time_limit": max(0.1, time_limit - (time.perf_counter() - t0)),
                    "mip_rel_gap": gap,
                    "disp": False,
                    "presolve": presolve,
                },
            )

        key = None
        if self.cache_dir is not None:  # the same model solved before: its proven answer (solvers/_cache.py)
            key = self.key(steps, budget, gap, objective, peak_var, parts)
            hit = _cache.load(self.cache_dir, key)
            if hit is not None:
                self.cache_hits += 1
                return hit
        res = run(self.presolve)
        if res.status == 4:
            # HiGHS "Solve error" (seen in transformNewIntegerFeasibleSolution, with presolve off and with it
            # on, on small problems with toggles): the same model with presolve the other way
            res = run(not self.presolve)
        if key is not None:
            _cache.store(self.cache_dir, key, res, self.cache_mb)
        return res

    def choice(self, x: np.ndarray) -> np.ndarray:
        return np.array([int(np.argmax(x[o : o + k])) for o, k in zip(self.xoff, self.t.n_options)], dtype=np.int64)

    def toggles_on(self, x: np.ndarray) -> np.ndarray | None:
        """The toggles the solution turns on (None: the Terms have none)."""
        return np.asarray(x)[self.r_idx] > 0.5 if self.r_idx else None

    def profile(self, x: np.ndarray) -> np.ndarray:
        """Bytes per device at each position under the solution ``x`` (its shardings and toggles)."""
        return self.mem.profile(self.choice(x), self.toggles_on(x))


def _pad(A):
    from scipy.sparse import hstack, csr_matrix

    return hstack([A, csr_matrix((A.shape[0], 1))]).tocsr()
