"""Plan-only runs: `metadist plan SCRIPT` runs a user's script until its first compiled step,
plans that step on the mesh asked for, prints and saves the plan, and stops the script.

The command sets ``METADIST_PLAN_ONLY`` (JSON: mesh shape, output path, solver,
memory budget, mesh profile, cache dir); the driver (:func:`metadist_core.driver.compile.compile_step`)
checks :func:`requested` for every frontend, traces the step, plans it and calls
:func:`finish`, which never returns. No devices or process group are needed:
the mesh may be larger than this machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

ENV = "METADIST_PLAN_ONLY"


class PlanOnlyDone(SystemExit):
    """Raised by :func:`finish` once the plan is saved: ends the user's script."""

    def __init__(self, path: str) -> None:
        super().__init__(0)
        self.path = path


def requested() -> dict[str, Any] | None:
    """The plan-only request of this process, or None for a normal run."""
    text = os.environ.get(ENV)
    return json.loads(text) if text else None


def settings_for(request: dict[str, Any], settings: Any) -> Any:
    """``settings`` with what the command line asked for (solver, budget, cache dir, profile) on top."""
    over = {k: request[k] for k in ("solver", "memory_budget", "cache_dir") if request.get(k) is not None}
    if request.get("profile"):
        over["mesh_profile"] = request["profile"]
    return dataclasses.replace(settings, **over)


def finish(result: Any, mesh: Any, request: dict[str, Any]) -> None:
    """Print the planned ``result``, save its plan as JSON, and raise :class:`PlanOnlyDone`."""
    graph = result.graph
    print(f"{graph.name}: {len(graph.ops)} ops, {len(graph.inputs)} inputs; planned on mesh {mesh}")
    print(result.plan)
    out = Path(request.get("out") or f"{graph.name}.plan.json")
    out.write_text(json.dumps(result.plan.to_json(), indent=1))
    print(f"plan saved to {out}; timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items()))
    raise PlanOnlyDone(str(out))
