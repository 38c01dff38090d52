"""The MILP adapter: highspy and scipy's HiGHS give the same optima; a MIP start is taken; statuses map."""
import numpy as np
import pytest
from scipy.sparse import csr_matrix

from metadist_solvers import _highs


def _assignment(seed: int, n: int = 6):
    """A random assignment problem with a knapsack row: integral, several near-optimal solutions."""
    rng = np.random.default_rng(seed)
    c = rng.uniform(1, 10, n * n)
    rows = []
    for i in range(n):   # each row and each column takes exactly one
        r = np.zeros(n * n)
        r[i * n:(i + 1) * n] = 1
        rows.append(r)
        r = np.zeros(n * n)
        r[i::n] = 1
        rows.append(r)
    w = rng.uniform(0, 1, n * n)
    A = csr_matrix(np.vstack(rows + [w]))
    lo = np.concatenate([np.ones(2 * n), [-np.inf]])
    hi = np.concatenate([np.ones(2 * n), [0.45 * n]])
    return c, A, lo, hi


@pytest.mark.parametrize("seed", range(4))
def test_highspy_and_scipy_find_the_same_optimum(seed, monkeypatch):
    c, A, lo, hi = _assignment(seed)
    n = len(c)
    args = (c, np.ones(n), np.zeros(n), np.ones(n), A, lo, hi)
    got = _highs.solve_milp(*args, time_limit=30, gap=0, presolve=False)
    monkeypatch.setattr(_highs, "highspy", None)
    ref = _highs.solve_milp(*args, time_limit=30, gap=0, presolve=False)
    assert got.status == ref.status
    if ref.status == 2:
        assert got.x is None
        return
    assert got.status == 0 and got.fun == pytest.approx(ref.fun, rel=1e-9)
    assert np.all(A @ got.x <= hi + 1e-9) and np.all(A @ got.x >= lo - 1e-9)
    assert got.mip_dual_bound == pytest.approx(got.fun, rel=1e-6)


def test_a_partial_start_is_completed_and_an_infeasible_problem_says_so():
    if _highs.highspy is None:
        pytest.skip("highspy not installed")
    # x0 + x1 = 1 (binaries), y >= x0 (continuous): start x0=1 open y; the optimum takes x1
    c = np.array([1.0, 2.0, 1.0])
    A = csr_matrix(np.array([[1.0, 1.0, 0.0], [-1.0, 0.0, 1.0]]))
    res = _highs.solve_milp(c, np.array([1, 1, 0]), np.zeros(3), np.array([1, 1, np.inf]), A,
                            np.array([1.0, 0.0]), np.array([1.0, np.inf]), time_limit=10, gap=0, presolve=False,
                            start=np.array([1.0, 0.0, np.nan]))
    assert res.status == 0 and res.fun == pytest.approx(2.0)
    bad = _highs.solve_milp(c, np.array([1, 1, 0]), np.zeros(3), np.array([1, 1, np.inf]), A,
                            np.array([3.0, 0.0]), np.array([3.0, np.inf]), time_limit=10, gap=0, presolve=False)
    assert bad.status == 2 and bad.x is None
