"""The PluginManager: loads frontends and solvers from their entry-point groups."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from metadist_core import hookspecs

log = logging.getLogger("metadist.plugins")

FRONTEND_GROUP = "metadist.frontends"
SOLVER_GROUP = "metadist.solvers"


class UnknownSolverError(ValueError):
    """The solver name asked for is not among the loaded solver plugins."""


class UnknownFrontendError(ValueError):
    """The frontend name asked for is not among the loaded frontend plugins."""


@dataclass(frozen=True)
class PluginRecord:
    kind: str  # "frontend" | "solver"
    name: str  # entry-point name, the name users pass
    module: str  # the module it came from
    distribution: str  # the distribution that declared it ("" when registered by hand)
    error: str = ""  # why it failed to load, when it did


class PluginManager:
    """Loads, registers and finds MetaDist plugins.

    Each instance is independent (no global singleton): the pipeline makes one,
    and tests may make their own with hand-registered plugins.
    """

    def __init__(self, load_entry_points: bool = True) -> None:
        self.pm = pluggy.PluginManager("metadist")
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self._adapters: dict[str, Any] | None = None
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
                    log.warning(
                        "metadist %s plugin %r (%s, from %s) failed to load and is skipped: %s",
                        kind,
                        ep.name,
                        ep.value,
                        dist or "?",
                        msg,
                    )
                    self.records.append(PluginRecord(kind, ep.name, ep.value, dist, msg))
                    continue
                try:
                    self.register(module, kind, ep.name, dist)
                except ValueError as e:  # a misspelled hook: named, and the plugin skipped
                    log.warning("%s", e)
                    self.records.append(PluginRecord(kind, ep.name, ep.value, dist, str(e)))

    def register(self, plugin: Any, kind: str, name: str, distribution: str = "") -> None:
        """Register a frontend or solver object (module or instance) under ``name``.

        A hook implementation whose name no spec knows (a misspelled hook) is an
        error naming the plugin and the hook; nothing of that plugin stays registered.
        """
        if kind not in ("frontend", "solver"):
            raise ValueError(f"plugin kind must be 'frontend' or 'solver', got {kind!r}")
        pname = f"{kind}:{name}"
        try:
            self.pm.register(plugin, name=pname)
        except Exception as e:
            raise ValueError(f"{kind} plugin {name!r} could not be registered: {e}") from e
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            self.pm.unregister(name=pname)
            known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("metadist_")))
            raise ValueError(
                f"{kind} plugin {name!r} ({getattr(plugin, '__name__', plugin)}): {e}; the hooks are {known}"
            ) from None
        mod = getattr(plugin, "__name__", type(plugin).__module__)
        self.records.append(PluginRecord(kind, name, mod, distribution))
        self._adapters = None

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
            raise RuntimeError(
                f"solver plugin {name!r} ({getattr(plugin, '__name__', plugin)}) returned no plan from metadist_solve"
            )
        return result

    def frontends(self) -> dict[str, Any]:
        """The loaded frontend adapters by name (each plugin's ``metadist_frontend()``)."""
        if self._adapters is None:
            adapters = {}
            for pname, plugin in self.pm.list_name_plugin():
                if not pname.startswith("frontend:") or not hasattr(plugin, "metadist_frontend"):
                    continue
                fe = plugin.metadist_frontend()
                if fe is None:
                    continue
                if not fe.name:
                    raise ValueError(f"frontend plugin {pname[9:]!r} returned an adapter with no name")
                adapters[fe.name] = fe
            self._adapters = adapters
        return self._adapters

    def frontend(self, name: str):
        """The adapter of frontend ``name``; an unknown name raises naming the known ones."""
        fe = self.frontends().get(name)
        if fe is None:
            known = ", ".join(sorted(self.frontends())) or "(none loaded)"
            raise UnknownFrontendError(f"unknown frontend {name!r}; known frontends: {known}")
        return fe

    def owner(self, op: Any):
        """The frontend adapter that owns ``op``'s key (by prefix), or None."""
        for fe in self.frontends().values():
            if fe.traits.owns(op):
                return fe
        return None

    def op_spec(self, op: Any, graph: Any):
        """The OpSpec of ``op`` from the frontend that owns it; None when no loaded frontend does."""
        fe = self.owner(op)
        return None if fe is None else fe.op_spec(op, graph)

    def op_cost(self, op: Any, graph: Any):
        """``(flops, bytes)`` of ``op`` from its frontend, or None (the core then estimates)."""
        fe = self.owner(op)
        return None if fe is None else fe.op_cost(op, graph)

    def fuses(self, op: Any, compiled: bool = False) -> bool:
        """Does the compiler of ``op``'s frontend fuse it with its elementwise neighbours? ``compiled``: the
        rank program runs through the frontend's optional compiler (``backend``), which fuses more."""
        fe = self.owner(op)
        if fe is None:
            return False
        return bool(fe.traits.fuses(op)) or (compiled and bool(fe.traits.compiled_fuses(op)))
