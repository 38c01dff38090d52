"""One plan on every rank: rank 0 broadcasts it with a digest of its graph; every rank checks its own.

Every rank traces the step itself (tracing is deterministic), so only the plan
travels: rank 0 broadcasts its JSON and the sha256 of the graph's JSON, every
rank compares that digest with its own graph's, and all ranks learn (one
all_gather) whether every rank agreed, so that a rank holding another model
is a clear error on every rank rather than a hang. When rank 0 cannot plan it
broadcasts the error instead, and the other ranks raise it.
"""

from __future__ import annotations

import hashlib
import json

from metadist_core.ir.ir import MetaIR
from metadist_core.plan.plan import ShardingPlan

from .engine import Engine


class PlanShareError(RuntimeError):
    """The ranks could not agree on one plan (rank 0 failed, or the ranks traced different graphs)."""


def graph_digest(graph: MetaIR) -> str:
    """The sha256 of the graph's JSON: equal on two ranks exactly when they traced the same step."""
    return hashlib.sha256(json.dumps(graph.to_json(), sort_keys=True, default=str).encode()).hexdigest()


def share_plan(engine: Engine, plan: ShardingPlan | None, graph: MetaIR) -> ShardingPlan:
    """Rank 0's plan on every rank (``plan`` is None on the other ranks)."""
    mine = graph_digest(graph)
    payload = {"plan": plan.to_json(), "digest": mine} if engine.rank == 0 else None
    payload = engine.broadcast(payload)
    if "error" in payload:
        raise PlanShareError(f"rank 0 could not plan the step: {payload['error']}")
    agree = engine.all_gather(mine == payload["digest"])
    differ = [r for r, ok in enumerate(agree) if not ok]
    if differ:
        ranks = ", ".join(map(str, differ))
        raise PlanShareError(
            f"rank(s) {ranks} traced another graph than rank 0 ({len(graph.ops)} ops, "
            f"{len(graph.inputs)} inputs on rank {engine.rank}); every rank must build the same "
            f"model and optimizer and call the step with arguments of the same shapes"
        )
    return plan if engine.rank == 0 else ShardingPlan.from_json(payload["plan"])


def share_error(engine: Engine, error: BaseException) -> None:
    """Rank 0 failed to plan: send the error to the ranks waiting in :func:`share_plan`."""
    if engine.distributed and engine.rank == 0:
        engine.broadcast({"error": f"{type(error).__name__}: {error}"})


__all__ = ["share_plan", "share_error", "graph_digest", "PlanShareError"]
