"""Beam search: keep the ``beam_width`` cheapest partial plans while sweeping the graph in order.

The first sweep scores options by the edges to already-chosen neighbours plus
a one-step lookahead to the rest; later sweeps (``passes``, default 4) score
the rest at the best plan so far, so a whole chain of nodes can switch
together. Each sweep is polished by local search (ICM). Options:
``beam_width`` (default 8), ``passes``.
"""

from __future__ import annotations

import numpy as np

from metadist_core.hookspecs import hookimpl
from metadist_core.problem.terms import Terms

from ._common import enforce_budget, multi_sweep, solve_problem

NAME = "beam"


def beam_terms(t: Terms, options: dict) -> tuple[np.ndarray, None, dict]:
    """Beam sweeps + ICM; returns (choice, None, stats)."""
    width = max(1, int(options.get("beam_width", 8)))
    choice, trace = multi_sweep(t, width, int(options.get("passes", 4)), int(options.get("icm_passes", 10)))
    choice = enforce_budget(t, t.adjacency(), choice, NAME)
    return choice, None, {"beam_width": width, "sweep_objectives": trace}


@hookimpl
def metadist_solver_info():
    return {"name": NAME, "description": "beam search sweeps in graph order (beam_width, default 8), then local search"}


@hookimpl
def metadist_solve(problem, options):
    return solve_problem(problem, options or {}, NAME, beam_terms)
