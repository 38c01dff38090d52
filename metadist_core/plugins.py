"""The PluginManager: loads frontends and solvers from their entry-point groups."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Iterable

import pluggy

from . import hookspecs

log = logging.getLogger("metadist.plugins")

FRONTEND_GROUP = "metadist.frontends"
SOLVER_GROUP = "metadist.solvers"


class UnknownSolverError(ValueError):
    """The solver name asked for is not among the loaded solver plugins."""


class UnknownFrontendError(ValueError):
    """The frontend name asked for is not among the loaded frontend plugins."""


@dataclass(frozen=True)
class PluginRecord:
    kind: str          # "frontend" | "solver"
    name: str          # entry-point name, the name users pass
    module: str        # the module it came from
    distribution: str  # the distribution that declared it ("" when registered by hand)
    error: str = ""    # why it failed to load, when it did


class PluginManager:
    """Loads, registers and finds MetaDist plugins.

    Each instance is independent (no global singleton): the pipeline makes one,
    and tests may make their own with hand-registered plugins.
    """

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("metadist")
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        if load_entry_points:
            self.load_entry_points()

    # -- loading ------------------------------------------------------------
    def load_entry_points(self) -> None:
        for group, kind in ((FRONTEND_GROUP, "frontend"), (SOLVER_GROUP, "solver")):
            for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
                dist = getattr(getattr(ep, "dist", None), "name", "") or ""
                if self.pm.get_plugin(f"{kind}:{ep.name}") is not None:
                    continue
                try:
                    module = ep.load()
                except Exception as e:  # a broken plugin must not take the others down
                    msg = f"{type(e).__name__}: {e}"
                    log.warning("metadist %s plugin %r (%s, from %s) failed to load and is skipped: %s",
                                kind, ep.name, ep.value, dist or "?", msg)
                    self.records.append(PluginRecord(kind, ep.name, ep.value, dist, msg))
                    continue
                self.register(module, kind, ep.name, dist)

    def register(self, plugin: Any, kind: str, name: str, distribution: str = "") -> None:
        """Register a frontend or solver object (module or instance) under ``name``."""
        if kind not in ("frontend", "solver"):
            raise ValueError(f"plugin kind must be 'frontend' or 'solver', got {kind!r}")
        try:
            self.pm.register(plugin, name=f"{kind}:{name}")
        except Exception as e:
            raise ValueError(f"{kind} plugin {name!r} could not be registered: {e}") from e
        mod = getattr(plugin, "__name__", type(plugin).__module__)
        self.records.append(PluginRecord(kind, name, mod, distribution))

    # -- queries ------------------------------------------------------------
    @property
    def hook(self):
        return self.pm.hook

    def names(self, kind: str) -> list[str]:
        return sorted(r.name for r in self.records if r.kind == kind and not r.error)

    def solver(self, name: str):
        """The plugin object of solver ``name``; an unknown name raises naming the known ones."""
        plugin = self.pm.get_plugin(f"solver:{name}")
        if plugin is None:
            known = ", ".join(self.names("solver")) or "(none loaded)"
            raise UnknownSolverError(f"unknown solver {name!r}; known solvers: {known}")
        return plugin

    def solve(self, name: str, problem: Any, options: dict | None = None):
        """Call ``metadist_solve`` on the one solver plugin called ``name``."""
        plugin = self.solver(name)
        caller = self.pm.subset_hook_caller(
            "metadist_solve", remove_plugins=[p for n, p in self.pm.list_name_plugin() if n != f"solver:{name}"]
        )
        result = caller(problem=problem, options=dict(options or {}))
        if result is None:
            raise RuntimeError(f"solver plugin {name!r} ({getattr(plugin, '__name__', plugin)}) "
                               f"returned no plan from metadist_solve")
        return result

    def frontend(self, name: str):
        plugin = self.pm.get_plugin(f"frontend:{name}")
        if plugin is None:
            known = ", ".join(self.names("frontend")) or "(none loaded)"
            raise UnknownFrontendError(f"unknown frontend {name!r}; known frontends: {known}")
        return plugin
