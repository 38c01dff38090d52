"""One MILP solve through HiGHS: highspy when it is installed, else ``scipy.optimize.milp``.

highspy (HiGHS 1.16 here) solved GPT-2 small's whole-step MILP on (2,4) (30,768 variables) in 3.9 s
against 5.8 s through scipy 1.17's bundled HiGHS, same optimum, and it takes a starting solution (a MIP
start), which scipy's interface cannot pass. The answer has scipy's fields either way: ``x``, ``fun``,
``status`` (0 optimal, 1 stopped by a limit, 2 infeasible, 3 unbounded, 4 other), ``message`` and
``mip_dual_bound``.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
from scipy.sparse import csr_matrix

try:
    import highspy
except ImportError:  # pragma: no cover - scipy's HiGHS stands in
    highspy = None

_BANNER_DONE = False


def _new_highs():
    """A Highs object; the first one of a process prints HiGHS's copyright banner on stdout, kept off it."""
    global _BANNER_DONE
    if _BANNER_DONE:
        return highspy.Highs()
    _BANNER_DONE = True
    try:
        sys.stdout.flush()
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # pragma: no cover - no file descriptor 1
        return highspy.Highs()
    try:
        os.dup2(null, 1)
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def solve_milp(c: np.ndarray, integrality: np.ndarray, lb: np.ndarray, ub: np.ndarray, A: csr_matrix,
               row_lo: np.ndarray, row_hi: np.ndarray, *, time_limit: float, gap: float, presolve: bool,
               start: np.ndarray | None = None) -> SimpleNamespace:
    """Minimise ``c @ x`` subject to ``row_lo <= A x <= row_hi``, ``lb <= x <= ub``, ``x[j]`` integral where
    ``integrality[j]``; ``start``: a solution to begin from, NaN where open (ignored without highspy)."""
    if highspy is None:
        return _scipy(c, integrality, lb, ub, A, row_lo, row_hi, time_limit, gap, presolve)
    inf = highspy.kHighsInf
    h = _new_highs()
    for k, v in (("output_flag", False), ("time_limit", float(max(0.1, time_limit))), ("mip_rel_gap", float(gap)),
                 ("presolve", "on" if presolve else "off")):
        h.setOptionValue(k, v)
    A = csr_matrix(A).tocsc()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(c), A.shape[0]
    lp.col_cost_ = np.asarray(c, dtype=np.float64)
    lp.col_lower_ = np.clip(np.asarray(lb, dtype=np.float64), -inf, inf)
    lp.col_upper_ = np.clip(np.asarray(ub, dtype=np.float64), -inf, inf)
    lp.row_lower_ = np.clip(np.asarray(row_lo, dtype=np.float64), -inf, inf)
    lp.row_upper_ = np.clip(np.asarray(row_hi, dtype=np.float64), -inf, inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(c), A.shape[0]
    lp.a_matrix_.start_ = A.indptr.astype(np.int32)
    lp.a_matrix_.index_ = A.indices.astype(np.int32)
    lp.a_matrix_.value_ = A.data.astype(np.float64)
    integral = np.asarray(integrality, dtype=bool)
    if integral.any():
        lp.integrality_ = [highspy.HighsVarType.kInteger if v else highspy.HighsVarType.kContinuous
                           for v in integral]
    h.passModel(lp)
    if start is not None and integral.any():   # NaN entries left open: HiGHS completes a partial start
        start = np.asarray(start, dtype=np.float64)
        idx = np.flatnonzero(~np.isnan(start)).astype(np.int32)
        h.setSolution(len(idx), idx, start[idx])
    h.run()
    ms = h.getModelStatus()
    S = highspy.HighsModelStatus
    info = h.getInfo()
    has_x = info.primal_solution_status >= 1   # 1 infeasible point, 2 feasible
    x = np.asarray(h.getSolution().col_value, dtype=np.float64) if has_x and info.primal_solution_status == 2 \
        else None
    if ms == S.kOptimal:
        status = 0
    elif ms in (S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit, S.kInterrupt, S.kHighsInterrupt):
        status = 1
    elif ms == S.kInfeasible:
        status = 2
    elif ms in (S.kUnbounded, S.kUnboundedOrInfeasible):
        status = 3
    else:
        status = 4
    fun = float(info.objective_function_value) if x is not None else None
    bound = float(info.mip_dual_bound) if integral.any() else fun
    return SimpleNamespace(x=x, fun=fun, status=status, message=h.modelStatusToString(ms),
                           mip_dual_bound=bound, success=x is not None and status == 0)


def _scipy(c, integrality, lb, ub, A, row_lo, row_hi, time_limit, gap, presolve) -> SimpleNamespace:
    from scipy.optimize import Bounds, LinearConstraint, milp
    res = milp(c, integrality=np.asarray(integrality, dtype=float), bounds=Bounds(lb, ub),
               constraints=[LinearConstraint(A, row_lo, row_hi)],
               options={"time_limit": max(0.1, time_limit), "mip_rel_gap": gap, "disp": False, "presolve": presolve})
    return SimpleNamespace(x=res.x, fun=res.fun, status=res.status, message=res.message,
                           mip_dual_bound=getattr(res, "mip_dual_bound", None), success=res.success)


__all__ = ["solve_milp"]
