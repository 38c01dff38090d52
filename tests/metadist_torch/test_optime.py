"""Ops timed on this device at their real shapes: a slowdown per op, cached per machine, reused.

No figure here is asserted against a time: what is checked is which ops are timed, that each gets a
bounded factor, that the cache spares the next compile any run, and that an op too large to run takes the
factor of its key's largest timed op.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from metadist_torch.measure import optime  # noqa: E402
from metadist_torch.ops.opcost import op_cost  # noqa: E402
from metadist_torch.plugin import TorchFrontend  # noqa: E402


def _step(x, w1, w2, idx):
    h = torch.tanh(x @ w1)
    y = torch.nn.functional.log_softmax(h @ w2, dim=-1)
    small = torch.tanh(x[:2] @ w1)  # the same op keys on fewer elements
    return y.gather(1, idx).sum() + small.sum()


def _graph():
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(64, 32, generator=g),
        torch.randn(32, 48, generator=g),
        torch.randn(48, 16, generator=g),
        torch.randint(0, 16, (64, 1), generator=g),
    )
    tr = TorchFrontend().trace(_step, args, {})
    return tr.graph, {op.id: op_cost(op, tr.graph) for op in tr.graph.ops}


def test_every_costed_op_is_timed_once_and_the_cache_spares_the_next_compile(tmp_path, monkeypatch):
    graph, costs = _graph()
    cache = tmp_path / "ops.json"
    slow = optime.measure_slowdowns(graph, costs, cache, torch.device("cpu"))
    priced = {op.id for op in graph.ops if costs[op.id][0] > 0 or costs[op.id][1] > 0}
    assert set(slow) == priced, (sorted(priced - set(slow)), [op.key for op in graph.ops])
    lo, hi = optime.LIMITS
    assert all(lo <= s <= hi for s in slow.values()), slow
    keys = {op.key for op in graph.ops if op.id in slow}
    assert {"aten.tanh.default", "aten.mm.default", "aten._log_softmax.default", "aten.gather.default"} <= keys, keys
    assert cache.exists()

    def no_run(*a, **k):
        raise AssertionError("an op was run again although its time is cached")

    monkeypatch.setattr(optime, "_timed", no_run)
    assert optime.measure_slowdowns(graph, costs, cache, torch.device("cpu")) == slow


def test_a_cache_of_another_way_of_timing_is_measured_again(tmp_path):
    """Slowdowns cached by an older way of timing (medians: no version in the file) are not reused."""
    import json

    graph, costs = _graph()
    cache = tmp_path / "ops.json"
    optime.measure_slowdowns(graph, costs, cache, torch.device("cpu"))
    saved = json.loads(cache.read_text())
    assert saved.pop(optime.VERSION_KEY) == optime.VERSION
    cache.write_text(json.dumps({k: 77.0 for k in saved}))  # an old file: no version, other figures
    again = optime.measure_slowdowns(graph, costs, cache, torch.device("cpu"))
    assert again and 77.0 not in again.values()
    assert json.loads(cache.read_text())[optime.VERSION_KEY] == optime.VERSION


def test_an_op_too_large_to_run_takes_its_keys_largest_timed_op(tmp_path, monkeypatch):
    graph, costs = _graph()
    tanh = sorted((op for op in graph.ops if op.key == "aten.tanh.default"), key=lambda op: optime._elements(op, graph))
    assert len(tanh) == 2 and optime._elements(tanh[0], graph) < optime._elements(tanh[1], graph)
    monkeypatch.setattr(optime, "MAX_ELEMENTS", optime._elements(tanh[0], graph))
    timed = []
    real = optime._timed
    monkeypatch.setattr(optime, "_timed", lambda fn, sync, iters=5: timed.append(1) or real(fn, sync, iters))
    slow = optime.measure_slowdowns(graph, costs, None, torch.device("cpu"))
    assert slow[tanh[1].id] == slow[tanh[0].id]  # the large tanh is not run: the small one's factor
    big_only = {op.key for op in graph.ops if op.id in costs and optime._elements(op, graph) > optime.MAX_ELEMENTS}
    small = {op.key for op in graph.ops if optime._elements(op, graph) <= optime.MAX_ELEMENTS}
    for op in graph.ops:  # a key with no op small enough to run is priced at its roofline (no factor)
        if op.key in big_only - small:
            assert op.id not in slow, op.key
    assert len(timed) == 1 + len(
        {
            op.signature(graph)
            for op in graph.ops
            if op.id in slow  # 1: the tiny op
            and optime._elements(op, graph) <= optime.MAX_ELEMENTS
        }
    )
