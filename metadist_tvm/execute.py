"""``parallelize``: trace a TE graph, plan it on a mesh, and lower it, through the one driver.

:func:`parallelize` is :func:`metadist_core.driver.compile.compile_step` with the
TVM adapter (:class:`metadist_tvm.plugin.TvmFrontend`): tracing, discovery,
solving, sharing the plan between torchrun ranks, plan-only runs
(``metadist plan script.py``) and mesh profiles are the driver's. The result
is a :class:`~metadist_tvm.runtime.Parallelized`.

``engine="auto"`` picks ``torch`` when torchrun started this process with
more than one rank and ``simulate`` else.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .plugin import ENGINES, TvmFrontend
from .runtime import LocalRunner, Parallelized, to_numpy


def plugin_manager(plugins: Any = None) -> Any:
    """``plugins`` (default a new PluginManager) with the tvm frontend registered (say, from a checkout)."""
    from metadist_core.plugins import PluginManager
    from . import plugin

    pm = plugins or PluginManager()
    if pm.pm.get_plugin("frontend:tvm") is None:
        pm.register(plugin, "frontend", "tvm")
    return pm


def parallelize(
    inputs: Sequence[Any],
    outputs: Any,
    mesh: Any = None,
    *,
    solver: str | None = None,
    engine: str = "auto",
    memory_budget: int | None = None,
    cache_dir: str | None = None,
    constraints: Any = None,
    plugins: Any = None,
    name: str = "te_graph",
    solver_options: Mapping | None = None,
) -> Parallelized:
    """Split the TE graph from placeholders ``inputs`` to ``outputs`` over ``mesh``; a callable running it.

    ``outputs`` is one te.Tensor (the callable then returns one array) or a
    list of them. ``mesh`` is a shape such as ``(4,)`` or ``(2, 2)``, a
    :class:`~metadist_core.ir.mesh.Mesh`, or None for one axis over the
    torch world (or 2 simulated devices without one). ``engine`` is
    ``auto``, ``simulate`` (every device in this process) or ``torch`` (one
    process per device under torchrun, gloo on CPU). The returned program has
    ``.plan``, ``.graph``, ``.mesh``, ``.timings`` and ``.result``.
    """
    from metadist_core.config import load_settings
    from metadist_core.driver.compile import compile_step

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    settings = load_settings(solver=solver, memory_budget=memory_budget, cache_dir=cache_dir)
    res = compile_step(
        TvmFrontend(engine),
        None,
        (inputs, outputs),
        {"name": name},
        settings,
        mesh=mesh,
        plugins=plugin_manager(plugins),
        constraints=constraints,
        solver_options=dict(solver_options or {}),
    )
    return res.runnable.with_result(res)


__all__ = ["parallelize", "Parallelized", "LocalRunner", "to_numpy", "plugin_manager"]
