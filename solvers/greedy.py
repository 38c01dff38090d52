"""Greedy solver: one pass in graph order with a one-step lookahead, then sweeps and local search.

A width-1 sweep picks each node's cheapest option given the nodes before it
(and a lookahead to the rest); further sweeps re-decide each node against the
best plan so far; iterated conditional modes (ICM) polish each. Fast and never
optimal by proof. A memory budget is met by moving nodes to smaller options at
the memory peak, cheapest cost per byte first.
"""

from __future__ import annotations

import numpy as np

from metadist_core.hookspecs import hookimpl
from metadist_core.problem.terms import Terms

from ._common import enforce_budget, multi_sweep, solve_problem

NAME = "greedy"


def greedy_terms(t: Terms, options: dict) -> tuple[np.ndarray, None, dict]:
    """Greedy sweeps + ICM; returns (choice, None, stats)."""
    choice, trace = multi_sweep(t, 1, int(options.get("passes", 3)), int(options.get("icm_passes", 10)))
    choice = enforce_budget(t, t.adjacency(), choice, NAME)
    return choice, None, {"sweep_objectives": trace}


@hookimpl
def metadist_solver_info():
    return {"name": NAME, "description": "greedy sweeps in graph order with lookahead, then local search; fastest"}


@hookimpl
def metadist_solve(problem, options):
    return solve_problem(problem, options or {}, NAME, greedy_terms)
