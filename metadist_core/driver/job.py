"""One compile's fixed inputs (:class:`Job`), shared by the driver's steps
(:mod:`metadist_core.driver.compile`) and the pricing of its plans (:mod:`metadist_core.driver.pricing`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from metadist_core.config import Settings
from metadist_core.driver.frontend import Frontend
from metadist_core.ir.ir import MetaIR
from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager


@dataclass
class Job:
    """One compile's fixed inputs: the frontend, the settings, the plugins, the user's constraints and
    solver options, and the seconds each step took so far."""

    frontend: Frontend
    settings: Settings
    plugins: PluginManager
    constraints: list
    solver_options: dict | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def constraints_on(self, graph: MetaIR, mesh: Mesh) -> list:
        """The user's constraints and the frontend's engine constraints on ``mesh``."""
        return self.constraints + self.frontend.constraints(graph, mesh)


__all__ = ["Job"]
