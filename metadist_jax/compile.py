"""``metadist_compile`` for JAX: the step decorator, bound to the JAX frontend adapter.

>>> @metadist_compile(mesh=(2, 4))
... def train_step(params, opt_state, batch):
...     loss, grads = jax.value_and_grad(loss_fn)(params, batch)
...     updates, opt_state = optimizer.update(grads, opt_state, params)
...     return loss, optax.apply_updates(params, updates), opt_state
>>> loss, params, opt_state = train_step(params, opt_state, batch)   # doctest: +SKIP

A flax.nnx step (``train_step(model, optimizer, batch)`` updating its objects in place) is decorated the
same way, where it had ``@nnx.jit`` (:mod:`metadist_jax.nnx`).

The step is compiled (by the one driver, :mod:`metadist_core.driver.compile`) on its
first call and again whenever the structure, shapes or dtypes of its arguments
change. Parameters and optimizer state come back as jax.Arrays with the plan's
NamedShardings; feed them to the next call as they are.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax

from metadist_core.driver.step import CompiledStep, CompileResult
from metadist_core.plugins import PluginManager

from .engine import put
from .lower import LoweredStep
from .nnx import split_call
from .plugin import JaxFrontend


class JaxStep(CompiledStep):
    """A JAX step compiled by MetaDist. Call it like the step; ``.plan`` is the plan of its last compile.

    Beyond :class:`~metadist_core.driver.step.CompiledStep` it exports the plan as
    PartitionSpecs and NamedShardings, and places arguments as the plan stores them.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        mesh: Any = None,
        solver: str | None = None,
        memory_budget: int | None = None,
        cache_dir: str | None = None,
        constraints: Iterable[Any] | None = None,
        solver_options: dict | None = None,
        progress: bool | None = None,
        plugins: PluginManager | None = None,
        micro_batches: int | None = None,
        pipeline_stages: int | None = None,
        schedule: str | None = None,
        strategy: str | None = None,
        recompute: bool | None = None,
        autotune: bool | None = None,
    ) -> None:
        pm = plugins or PluginManager()
        super().__init__(
            pm.frontend(JaxFrontend.name),
            fn,
            mesh=mesh,
            constraints=constraints,
            solver_options=solver_options,
            plugins=pm,
            solver=solver,
            memory_budget=memory_budget,
            cache_dir=cache_dir,
            progress=progress,
            micro_batches=micro_batches,
            pipeline_stages=pipeline_stages,
            schedule=schedule,
            strategy=strategy,
            recompute=recompute,
            autotune=autotune,
        )

    def compile(self, *args: Any, **kwargs: Any) -> CompileResult:
        """The compiled program for these arguments, without running it (a step over nnx objects compiles
        in its pure form, :mod:`metadist_jax.nnx`)."""
        call = split_call(self.fn, args, kwargs)
        if call is not None:
            args, kwargs = call.args, {}
        return super().compile(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the step. Over nnx objects, every Variable of the objects passed in takes its new value (as
        ``nnx.jit`` does) and the call returns what the step returned."""
        call = split_call(self.fn, args, kwargs)
        if call is None:
            return super().__call__(*args, **kwargs)
        out, params, state = super().__call__(*call.args)
        call.write_back(params, state)
        return out

    def lowered(self) -> LoweredStep:
        """The lowered step of the last compile (an error before the first call)."""
        if self.last is None or self.last.runnable is None:
            raise RuntimeError(
                "the step has not been compiled yet: call it (or .compile(...)) with its arguments first"
            )
        return self.last.runnable

    @property
    def jax_mesh(self) -> jax.sharding.Mesh | None:
        """The ``jax.sharding.Mesh`` the last compile runs on (None before the first call)."""
        return None if self.last is None or self.last.runnable is None else self.last.runnable.program.jax_mesh

    def partition_specs(self) -> tuple[Any, Any]:
        """``(in_specs, out_specs)``: PartitionSpec pytrees shaped like the step's arguments and results.

        ``in_specs`` is ``(args, kwargs)``-shaped as the step was called (None at a static leaf, a Python
        bool or str); use ``in_specs[0]`` for positional arguments. A step over nnx objects is shaped as its
        pure form: ``((params, state, inputs), {})`` with ``params`` and ``state`` lists in nnx flatten order. With ``jax.jit(step,
        in_shardings=..., out_shardings=...)`` this is the plan's layout left
        to GSPMD for everything in between.
        """
        run = self.lowered()
        n = len(run.context.input_ids)
        ins = jax.tree_util.tree_unflatten(run.context.in_tree, run.context.spread(run.program.in_specs[:n]))
        outs = jax.tree_util.tree_unflatten(run.context.out_tree, run.program.out_specs)
        return ins, outs

    def shardings(self) -> tuple[Any, Any]:
        """``(in_shardings, out_shardings)``: the NamedSharding pytrees of :meth:`partition_specs`."""
        run = self.lowered()
        n = len(run.context.input_ids)
        ins = jax.tree_util.tree_unflatten(run.context.in_tree, run.context.spread(run.program.in_shardings[:n]))
        outs = jax.tree_util.tree_unflatten(run.context.out_tree, run.program.out_shardings)
        return ins, outs

    def place(self, *args: Any, **kwargs: Any) -> tuple:
        """The arguments as jax.Arrays laid out as the plan stores them, static ones as given (compiles if
        needed)."""
        call = split_call(self.fn, args, kwargs)
        if call is not None:
            args, kwargs = call.args, {}
        run = self.compile(*args, **kwargs).runnable
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        it = iter([put(x, s) for x, s in zip(run.context.dynamic(leaves), run.program.in_shardings)])
        placed = [x if i in run.context.static else next(it) for i, x in enumerate(leaves)]
        a, _ = jax.tree_util.tree_unflatten(tree, placed)
        return a

    def __repr__(self) -> str:
        return f"<JaxStep {getattr(self.fn, '__name__', 'step')}, {len(self.cache)} compiled>"


def metadist_compile(
    fn: Callable | None = None,
    *,
    mesh: Any = None,
    solver: str | None = None,
    memory_budget: int | None = None,
    cache_dir: str | None = None,
    constraints: Iterable[Any] | None = None,
    solver_options: dict | None = None,
    progress: bool | None = None,
    plugins: PluginManager | None = None,
    micro_batches: int | None = None,
    pipeline_stages: int | None = None,
    schedule: str | None = None,
    strategy: str | None = None,
    recompute: bool | None = None,
    autotune: bool | None = None,
) -> Any:
    """Parallelize a pure JAX step ``(params, opt_state, batch) -> (loss, params, opt_state)``, or a flax.nnx
    step over nnx objects (``train_step(model, optimizer, batch)``, as ``nnx.jit`` takes it): every Variable
    of the objects passed in is written back after each call, and the call returns what the step returns.

    :param mesh: None (every device of every process as one axis), a shape
        such as ``(2, 4)`` whose sizes multiply to the device count, a metadist
        ``Mesh`` or a ``jax.sharding.Mesh``.
    :param solver: the solver plugin (default from ``METADIST_SOLVER`` or
        ``[tool.metadist]``, else ``ilp``).
    :param memory_budget: bytes per device.
    :param cache_dir: where discovered rules are cached.
    :param constraints: ``Pin``/``Forbid`` constraints on the plan (values are named by their
        path: ``params/layer/w``, ``opt_state/0/mu/layer/w``, ``batch/0``; in an nnx step by argument and
        attribute: ``model/linear/kernel``, ``optimizer/opt_state/0/mu/linear/kernel``, ``batch/0``).
    :param solver_options: extra options for the solver.
    :param progress: show progress of discovery and solving (default: on a terminal).
    :param plugins: the PluginManager to use (default: the installed plugins).
    :param micro_batches: cut the batch (dim 0 of every leaf of ``args[2:]``) into this many equal parts;
        gradients accumulate over them inside the step (all in one shard_map).
    :param pipeline_stages: None or 1; more stages are not implemented yet (an error).
    :param schedule: validated only (pipelines are not implemented yet).
    :param strategy: "auto" (default) or a preset ("ddp", "zero1", "zero2", "zero3"/"fsdp", "tp", "tp+dp"):
        constraints on the same plan search (:mod:`metadist_core.problem.presets`).
    :param recompute: True (default): recompute forward segments when no plan meets ``memory_budget``
        without it (copies fenced by ``optimization_barrier`` so XLA keeps them); False: never.
    :param autotune: True (default): with measured costs, the solver's plan is timed beside the ddp, zero1
        and fsdp presets' on these devices at the first call (seconds) and the fastest kept
        (:mod:`metadist_core.driver.autotune`; ``plan.stats.autotune``); False: the solver's plan as priced.

    Use as ``@metadist_compile`` or ``@metadist_compile(mesh=(2, 4))``; returns a :class:`JaxStep`.
    """

    def wrap(f: Callable) -> JaxStep:
        return JaxStep(
            f,
            mesh=mesh,
            solver=solver,
            memory_budget=memory_budget,
            cache_dir=cache_dir,
            constraints=constraints,
            solver_options=solver_options,
            progress=progress,
            plugins=plugins,
            micro_batches=micro_batches,
            pipeline_stages=pipeline_stages,
            schedule=schedule,
            strategy=strategy,
            recompute=recompute,
            autotune=autotune,
        )

    return wrap(fn) if fn is not None else wrap


__all__ = ["JaxStep", "metadist_compile"]
