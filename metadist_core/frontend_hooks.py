"""Shared pieces of frontend plugins: the op hooks every frontend implements the same way."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

from .hookspecs import hookimpl


def op_hooks(prefixes: Sequence[str], runner_module: str) -> tuple[Callable, Callable]:
    """``metadist_op_spec`` and ``metadist_op_cost`` hookimpls for a frontend that owns op keys
    starting with ``prefixes``; ``runner_module`` (imported only when an owned op arrives, so that
    loading the plugin imports no framework) provides ``op_spec(op, graph)`` and ``op_cost(op, graph)``.

    In a plugin module: ``metadist_op_spec, metadist_op_cost = op_hooks(("aten.",), "metadist_torch.oprunner")``.
    """
    prefixes = tuple(prefixes)

    def owned(op: Any) -> bool:
        return isinstance(getattr(op, "key", None), str) and op.key.startswith(prefixes)

    @hookimpl
    def metadist_op_spec(op, graph):
        if not owned(op):
            return None
        return importlib.import_module(runner_module).op_spec(op, graph)

    @hookimpl
    def metadist_op_cost(op, graph):
        if not owned(op):
            return None
        return importlib.import_module(runner_module).op_cost(op, graph)

    return metadist_op_spec, metadist_op_cost
