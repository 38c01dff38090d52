"""The pluggy hook specifications of MetaDist (project name ``metadist``).

Frontends (entry-point group ``metadist.frontends``) implement one hook,
``metadist_frontend``, returning their adapter; solvers (group
``metadist.solvers``) implement the solver hooks. A hook implementation whose
name no spec here knows is an error that names it (``check_pending``).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("metadist")
hookimpl = pluggy.HookimplMarker("metadist")

# -- frontends ---------------------------------------------------------------


@hookspec
def metadist_frontend():
    """Return this plugin's frontend adapter.

    Return an instance of a ``metadist_core.driver.frontend.Frontend`` subclass: its
    ``name`` is what users pass and what the entry point is called; its
    ``traits`` (a ``FrontendTraits``) name the op keys it runs for discovery
    (``op_spec``) and prices (``op_cost``) and what its lowering does;
    ``trace``, ``resolve_mesh``, ``constraints``, ``share`` and ``lower`` are the
    steps the driver (``metadist_core.driver.compile.compile_step``) calls in
    order; ``time_ops`` and ``measure_profile`` serve measured costs; ``demo``
    and ``calibrate`` are optional. Importing the plugin module must not import
    the framework: do that inside the adapter's methods.
    """


# -- solvers ----------------------------------------------------------------


@hookspec
def metadist_solver_info():
    """Describe this solver: a dict with ``name`` (str) and ``description`` (one line)."""


@hookspec(firstresult=True)
def metadist_solve(problem, options):
    """Solve a sharding problem.

    Only the solver the user chose is called (the pipeline calls this hook on
    that one plugin), so an implementation never needs to check a name.

    :param problem: a ``metadist_core.problem.problem.ShardingProblem``.
    :param options: dict of solver options (``time_limit`` seconds,
        ``beam_width``...; unknown keys are ignored).
    Return a ``metadist_core.plan.plan.ShardingPlan``, built with
    ``ShardingPlan.replicated(problem)`` or ``ShardingPlan.from_choices(problem, choices)``.
    """
