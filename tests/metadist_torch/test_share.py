"""Sharing the plan between ranks, without torchrun: an engine stub plays the other ranks' side."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("torch")

from metadist_core.driver.compile import replicated_plan  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.reference.plugin import transformer_block  # noqa: E402
from metadist_torch.runtime.share import PlanShareError, graph_digest, share_error, share_plan  # noqa: E402


@dataclass
class StubEngine:
    """Rank ``rank`` of a job in which rank 0 broadcast ``sent`` and the ranks' digests agree as ``agree``."""

    rank: int
    sent: object = None
    agree: list = field(default_factory=lambda: [True, True])
    broadcasts: list = field(default_factory=list)
    distributed: bool = True

    def broadcast(self, obj):
        self.broadcasts.append(obj)
        return obj if self.rank == 0 else self.sent

    def all_gather(self, ok):
        return [ok if r == self.rank else a for r, a in enumerate(self.agree)]


def _plan():
    graph = transformer_block()
    plan, _ = replicated_plan(graph, Mesh((2,)))
    return graph, plan


def test_rank_0_sends_its_plan_and_the_graph_digest_and_the_others_rebuild_it():
    graph, plan = _plan()
    e0 = StubEngine(0)
    assert share_plan(e0, plan, graph) is plan
    sent = e0.broadcasts[0]
    assert sent["digest"] == graph_digest(graph) and sent["plan"] == plan.to_json()
    got = share_plan(StubEngine(1, sent=sent), None, graph)
    assert got.to_json() == plan.to_json()


def test_a_rank_with_another_graph_is_an_error_on_every_rank():
    graph, plan = _plan()
    other = transformer_block(width=24)
    assert graph_digest(other) != graph_digest(graph)
    sent = {"plan": plan.to_json(), "digest": graph_digest(graph)}
    with pytest.raises(PlanShareError, match=r"rank\(s\) 1 traced another graph.*same model and optimizer"):
        share_plan(StubEngine(1, sent=sent), None, other)
    with pytest.raises(PlanShareError, match=r"rank\(s\) 1 traced another graph"):  # rank 0 learns it too
        share_plan(StubEngine(0, agree=[True, False]), plan, graph)


def test_rank_0_failing_to_plan_reaches_the_other_ranks():
    graph, _ = _plan()
    e0 = StubEngine(0)
    share_error(e0, ValueError("no plan today"))
    assert e0.broadcasts == [{"error": "ValueError: no plan today"}]
    with pytest.raises(PlanShareError, match="rank 0 could not plan the step: ValueError: no plan today"):
        share_plan(StubEngine(1, sent=e0.broadcasts[0]), None, graph)
    e1 = StubEngine(1)
    share_error(e1, ValueError("x"))  # only rank 0 sends
    assert e1.broadcasts == []
