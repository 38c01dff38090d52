"""Plan-only runs: `metadist plan SCRIPT` runs a user's script until its first compiled step,
plans that step on the mesh asked for, prints and saves the plan, and stops the script.

Plan-only is a setting of the driver, given explicitly: the command enters
``with plan_only(PlanOnly(mesh=...)):`` around the script; the driver
(:func:`metadist_core.driver.compile.compile_step`) reads :func:`requested` for
every frontend, traces the step, plans it and raises :class:`PlanOnlyDone`
(an ordinary exception, which the command catches) once the plan is saved. No
devices or process group are needed: the mesh may be larger than this machine.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from metadist_core.plan.explain import report_plan_only
from metadist_core.config import check_strategy


@dataclass(frozen=True)
class PlanOnly:
    """What `metadist plan` asks of the driver: plan for ``mesh`` (a shape), save the plan to ``out``
    (default ``NAME.plan.json``), with these settings on top of the step's own where given; ``compare``:
    price every strategy preset beside the plan."""

    mesh: tuple[int, ...] = (2,)
    out: str | None = None
    solver: str | None = None
    memory_budget: int | None = None
    cache_dir: str | None = None
    profile: str | None = None
    strategy: str | None = None
    compare: bool = False

    def settings(self, settings: Any) -> Any:
        """``settings`` with what the command line asked for (solver, budget, cache dir, profile, strategy)
        on top."""
        over: dict[str, Any] = {
            k: getattr(self, k) for k in ("solver", "memory_budget", "cache_dir") if getattr(self, k) is not None
        }
        if self.profile:
            over["mesh_profile"] = self.profile
        if self.strategy:
            over["strategy"] = check_strategy(self.strategy)
        return dataclasses.replace(settings, **over)


class PlanOnlyDone(Exception):
    """Raised by the driver once a plan-only run's plan is saved (at ``path``): ends the user's script."""

    def __init__(self, path: str) -> None:
        super().__init__(f"plan saved to {path}")
        self.path = path


_REQUEST: contextvars.ContextVar[PlanOnly | None] = contextvars.ContextVar("metadist_plan_only", default=None)


@contextlib.contextmanager
def plan_only(request: PlanOnly) -> Iterator[PlanOnly]:
    """Within this context every compiled step is planned for ``request`` and not run."""
    token = _REQUEST.set(request)
    try:
        yield request
    finally:
        _REQUEST.reset(token)


def requested() -> PlanOnly | None:
    """The plan-only request in force, or None for a normal run."""
    return _REQUEST.get()


def show_and_save(result: Any, out: str | Path | None, mesh: Any = None) -> Path:
    """Print the planned ``result`` (with the mesh it was planned on, where given), save its plan as JSON
    at ``out`` (default ``NAME.plan.json``); the path written."""
    graph = result.graph
    if mesh is not None:
        print(f"{graph.name}: {len(graph.ops)} ops, {len(graph.inputs)} inputs; planned on mesh {mesh}")
    print(result.plan)
    path = Path(out or f"{graph.name}.plan.json")
    path.write_text(json.dumps(result.plan.to_json(), indent=1))
    print(f"plan saved to {path}; timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items()))
    return path


def report(result: Any, request: PlanOnly, out: Path, settings: Any, plugins: Any) -> None:
    """The problem beside the plan (for `metadist explain`) and, with ``compare``, every preset's price."""
    report_plan_only(result, {"out": str(out), "compare": request.compare}, settings, plugins)


__all__ = ["PlanOnly", "PlanOnlyDone", "plan_only", "report", "requested", "show_and_save"]
