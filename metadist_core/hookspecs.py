"""The pluggy hook specifications of MetaDist (project name ``metadist``).

Frontends (entry-point group ``metadist.frontends``) implement the frontend
hooks; solvers (group ``metadist.solvers``) implement the solver hooks. Every
hook that a frontend implements takes ``frontend`` (its name) or an op whose key
it owns, and returns None for work that is not its own, so that several
frontends can be loaded side by side.
"""
from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("metadist")
hookimpl = pluggy.HookimplMarker("metadist")

# -- frontends ---------------------------------------------------------------


@hookspec
def metadist_frontend_info():
    """Describe this frontend.

    Return a dict with ``name`` (str, the name users pass, e.g. "torch") and
    ``op_prefixes`` (list of str: the op-key prefixes it owns, e.g.
    ["aten."]), and optionally ``description``.
    """


@hookspec(firstresult=True)
def metadist_op_spec(op, graph):
    """Make an op runnable for ShardCombine.

    :param op: a ``MetaOp`` of ``graph``.
    :param graph: the ``MetaIR`` the op belongs to (for shapes and dtypes).
    Return a ``metadist_core.shardcombine.OpSpec`` that runs this op on numpy
    inputs (with example inputs at the op's shapes), or None if the op key is
    not owned by this frontend. Raise ``metadist_core.shardcombine.Unrunnable``
    with a reason when the op is yours but cannot be run in isolation (random,
    data-dependent, custom): it then runs replicated with one warning.
    """


@hookspec(firstresult=True)
def metadist_op_cost(op, graph):
    """Count the work of one op for the cost model.

    :param op: a ``MetaOp`` of ``graph``.
    :param graph: its ``MetaIR``.
    Return ``(flops, bytes_moved)`` for the whole (unsplit) op, or None if not
    this frontend's op (the core then estimates from the tensor sizes).
    """


@hookspec(firstresult=True)
def metadist_trace(frontend, fn, args, kwargs):
    """Trace a step function into MetaIR.

    :param frontend: the frontend name asked for; return None if not yours.
    :param fn: the user's step function.
    :param args: its positional arguments (models, optimizers, tensors...).
    :param kwargs: its keyword arguments.
    Return a ``metadist_core.ir.MetaIR``.
    """


@hookspec(firstresult=True)
def metadist_lower(frontend, graph, plan, mesh, context):
    """Turn a solved plan into a runnable per-rank program.

    :param frontend: the frontend name asked for; return None if not yours.
    :param graph: the ``MetaIR`` that was planned.
    :param plan: the ``ShardingPlan`` chosen by the solver.
    :param mesh: the ``Mesh`` it was planned on.
    :param context: frontend-private data that trace left for lowering
        (the ``payload`` of the graph), or None.
    Return a callable that runs one step.
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

    :param problem: a ``metadist_core.problem.ShardingProblem``.
    :param options: dict of solver options (``time_limit`` seconds,
        ``beam_width``...; unknown keys are ignored).
    Return a ``metadist_core.plan.ShardingPlan``, built with
    ``ShardingPlan.replicated(problem)`` or ``ShardingPlan.from_choices(problem, choices)``.
    """
