"""Plan-only runs: `metadist plan SCRIPT` runs a user's script until its first compiled step,
plans that step on the mesh asked for, prints and saves the plan, and stops the script.

The command sets ``METADIST_PLAN_ONLY`` (JSON: mesh shape, output path, solver,
memory budget, mesh profile); a frontend's decorated step calls :func:`requested`
first and, when it is set, traces the step and hands the graph to :func:`finish`,
which never returns. No devices or process group are needed: the mesh may be
larger than this machine.
"""
from __future__ import annotations

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


def finish(graph: Any, plugins: Any = None, constraints: Any = None) -> None:
    """Plan ``graph`` as requested, print the plan, save it as JSON, and raise :class:`PlanOnlyDone`."""
    from .pipeline import plan_graph
    from .profile import load_profile

    req = requested() or {}
    mesh = load_profile(req.get("profile")).mesh(tuple(req.get("mesh", [2])))
    result = plan_graph(graph, mesh, plugins=plugins, solver=req.get("solver"), memory_budget=req.get("memory_budget"),
                        cache_dir=req.get("cache_dir"), constraints=constraints, progress=None)
    print(f"{graph.name}: {len(graph.ops)} ops, {len(graph.inputs)} inputs; planned on mesh {mesh}")
    print(result.plan)
    out = Path(req.get("out") or f"{graph.name}.plan.json")
    out.write_text(json.dumps(result.plan.to_json(), indent=1))
    print(f"plan saved to {out}; timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items()))
    raise PlanOnlyDone(str(out))
