"""``metadist_compile`` for JAX: trace, discover, solve, lower to shard_map, run.

>>> @metadist_compile(mesh=(2, 4))
... def train_step(params, opt_state, batch):
...     loss, grads = jax.value_and_grad(loss_fn)(params, batch)
...     updates, opt_state = optimizer.update(grads, opt_state, params)
...     return loss, optax.apply_updates(params, updates), opt_state
>>> loss, params, opt_state = train_step(params, opt_state, batch)   # doctest: +SKIP

The step is compiled on its first call and again whenever the structure,
shapes or dtypes of its arguments change. Parameters and optimizer state come
back as jax.Arrays with the plan's NamedShardings; feed them to the next call
as they are.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

import jax

from metadist_core.ir import MetaIR
from metadist_core.pipeline import plan_graph
from metadist_core.placement import Mesh
from metadist_core.plugins import PluginManager

from .engine import agree_on_plan, even_split_constraints, put, resolve_mesh
from .lower import Program, lower_plan
from .trace import TraceContext, trace_step

log = logging.getLogger("metadist.jax")


class LoweredStep:
    """A lowered program called with the user's pytrees: places inputs, runs, rebuilds the results."""

    def __init__(self, program: Program, context: TraceContext) -> None:
        self.program, self.context = program, context
        pos = {v: i for i, v in enumerate(program.input_ids)}
        self.consts = [put(context.const_values[v], program.in_shardings[pos[v]]) for v in context.const_ids]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self.context.in_tree:
            raise TypeError(f"the step was compiled for arguments shaped {self.context.in_tree}, got {tree}")
        placed = [put(x, s) for x, s in zip(leaves, self.program.in_shardings)]
        outs = self.program.fn(*placed, *self.consts)
        return jax.tree_util.tree_unflatten(self.context.out_tree, list(outs))


@dataclass
class Compiled:
    """One compile of the step for one argument signature."""

    graph: MetaIR
    context: TraceContext
    plan: Any
    program: Program
    runner: LoweredStep
    timings: dict[str, float]


def _signature(args: tuple, kwargs: dict) -> Any:
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    return tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


class MetaDistStep:
    """A step compiled by MetaDist. Call it like the step; ``.plan`` is the plan of its last compile."""

    def __init__(self, fn: Callable, *, mesh: Any = None, solver: str | None = None,
                 memory_budget: int | None = None, cache_dir: str | None = None,
                 constraints: Iterable[Any] | None = None, solver_options: dict | None = None,
                 progress: bool | None = None, plugins: PluginManager | None = None) -> None:
        self.fn = fn
        self._mesh_arg = mesh
        self.solver = solver
        self.memory_budget = memory_budget
        self.cache_dir = cache_dir
        self.constraints = list(constraints or [])
        self.solver_options = solver_options
        self.progress = progress
        self._plugins = plugins
        self._compiled: dict[Any, Compiled] = {}
        self._last: Compiled | None = None
        self.mesh: Mesh | None = None
        self.jax_mesh: jax.sharding.Mesh | None = None
        functools.update_wrapper(self, fn)

    # -- compiling ------------------------------------------------------------
    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        """Trace, plan and lower the step for these arguments (without running it)."""
        key = _signature(args, kwargs)
        hit = self._compiled.get(key)
        if hit is not None:
            self._last = hit
            return hit
        from metadist_core import planonly
        if planonly.requested():  # `metadist plan SCRIPT`: plan for the mesh asked, stop the script
            from metadist_core.placement import Mesh as _Mesh
            graph, _ = trace_step(self.fn, args, kwargs)
            shape = _Mesh(tuple(planonly.requested()["mesh"]))
            planonly.finish(graph, plugins=self._plugins or PluginManager(),
                            constraints=self.constraints + even_split_constraints(graph, shape))
        if self.mesh is None:
            self.mesh, self.jax_mesh = resolve_mesh(self._mesh_arg)
        mesh = self.mesh
        t0 = time.perf_counter()
        graph, ctx = trace_step(self.fn, args, kwargs)
        t_trace = time.perf_counter() - t0
        pm = self._plugins or PluginManager()
        pm.frontend("jax")
        constraints = self.constraints + even_split_constraints(graph, mesh)
        result = plan_graph(graph, mesh, plugins=pm, solver=self.solver, memory_budget=self.memory_budget,
                            cache_dir=self.cache_dir, constraints=constraints, progress=self.progress,
                            solver_options=self.solver_options)
        plan = agree_on_plan(result.plan)
        t = time.perf_counter()
        program = lower_plan(graph, plan, mesh, self.jax_mesh, ctx.output_ids)
        runner = LoweredStep(program, ctx)
        timings = {"trace": t_trace, **result.timings, "lower": time.perf_counter() - t}
        c = Compiled(graph, ctx, plan, program, runner, timings)
        log.info("compiled %s on mesh %s in %.2f s: %s", graph.name, mesh, sum(timings.values()), plan.summary())
        self._compiled[key] = c
        self._last = c
        return c

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compile(*args, **kwargs).runner(*args, **kwargs)

    # -- what the plan says -----------------------------------------------------
    @property
    def plan(self) -> Any:
        """The ShardingPlan of the last compile (None before the first call)."""
        return None if self._last is None else self._last.plan

    @property
    def graph(self) -> MetaIR | None:
        return None if self._last is None else self._last.graph

    @property
    def timings(self) -> dict[str, float]:
        return {} if self._last is None else dict(self._last.timings)

    def _need(self) -> Compiled:
        if self._last is None:
            raise RuntimeError("the step has not been compiled yet: call it (or .compile(...)) with its arguments first")
        return self._last

    def partition_specs(self) -> tuple[Any, Any]:
        """``(in_specs, out_specs)``: PartitionSpec pytrees shaped like the step's arguments and results.

        ``in_specs`` is ``(args, kwargs)``-shaped as the step was called; use
        ``in_specs[0]`` for positional arguments. With ``jax.jit(step,
        in_shardings=..., out_shardings=...)`` this is the plan's layout left
        to GSPMD for everything in between.
        """
        c = self._need()
        n = len(c.context.input_ids)
        ins = jax.tree_util.tree_unflatten(c.context.in_tree, c.program.in_specs[:n])
        outs = jax.tree_util.tree_unflatten(c.context.out_tree, c.program.out_specs)
        return ins, outs

    def shardings(self) -> tuple[Any, Any]:
        """``(in_shardings, out_shardings)``: the NamedSharding pytrees of :meth:`partition_specs`."""
        c = self._need()
        n = len(c.context.input_ids)
        ins = jax.tree_util.tree_unflatten(c.context.in_tree, c.program.in_shardings[:n])
        outs = jax.tree_util.tree_unflatten(c.context.out_tree, c.program.out_shardings)
        return ins, outs

    def place(self, *args: Any, **kwargs: Any) -> tuple:
        """The arguments as jax.Arrays laid out as the plan stores them (compiles if needed)."""
        c = self.compile(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        placed = [put(x, s) for x, s in zip(leaves, c.program.in_shardings)]
        a, _ = jax.tree_util.tree_unflatten(tree, placed)
        return a


def metadist_compile(fn: Callable | None = None, *, mesh: Any = None, solver: str | None = None,
                     memory_budget: int | None = None, cache_dir: str | None = None,
                     constraints: Iterable[Any] | None = None, solver_options: dict | None = None,
                     progress: bool | None = None) -> Any:
    """Parallelize a pure JAX step ``(params, opt_state, batch) -> (loss, params, opt_state)``.

    :param mesh: None (every device of every process as one axis), a shape
        such as ``(2, 4)`` whose sizes multiply to the device count, a metadist
        ``Mesh`` or a ``jax.sharding.Mesh``.
    :param solver: the solver plugin (default from ``METADIST_SOLVER`` or
        ``[tool.metadist]``, else ``ilp``).
    :param memory_budget: bytes per device.
    :param cache_dir: where discovered rules are cached.
    :param constraints: ``Pin``/``Forbid`` constraints on the plan (values are named by their
        path: ``params/layer/w``, ``opt_state/0/mu/layer/w``, ``batch/0``).

    Use as ``@metadist_compile`` or ``@metadist_compile(mesh=(2, 4))``.
    """
    def wrap(f: Callable) -> MetaDistStep:
        return MetaDistStep(f, mesh=mesh, solver=solver, memory_budget=memory_budget, cache_dir=cache_dir,
                            constraints=constraints, solver_options=solver_options, progress=progress)

    return wrap(fn) if fn is not None else wrap


def plan_partition_specs(step: MetaDistStep) -> tuple[Any, Any]:
    """The plan of a compiled step as PartitionSpec pytrees (same as ``step.partition_specs()``)."""
    return step.partition_specs()


__all__ = ["LoweredStep", "MetaDistStep", "metadist_compile", "plan_partition_specs"]
