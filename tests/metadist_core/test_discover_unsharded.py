"""On axes of more than 3 devices, the input combinations that shard no input (Replicate and Partial) are
verified on the smaller proxy of an axis of 2 (metadist_core.discovery.discover._unsharded_proxy): their pieces
are whole-size on every device, so only the sharded combinations need sizes that split over n. The
rules are the same as verifying everything on the proxy of n, in fewer element-runs."""

import pytest

import metadist_core.discovery.discover as disc
from metadist_core.discovery.discover import discover
from metadist_core.ir.placement import Shard
from metadist_core.reference.plugin import transformer_block
from metadist_core.discovery.rules import RuleBook

from _small_graphs import reference_pm as _pm, rules_by_op as _rules


@pytest.mark.parametrize("n", [4, 8])
def test_unsharded_combinations_on_the_small_proxy_find_the_same_rules(monkeypatch, n):
    graph = transformer_block()
    calls = []
    real = disc._rules_at

    def spy(spec, g, op, n, draws, check, only=None, sharded=None):
        elems = sum(x.size for x in spec.example_inputs if hasattr(x, "size"))
        calls.append((op.key, sharded, elems))
        return real(spec, g, op, n, draws, check, only, sharded)

    monkeypatch.setattr(disc, "_rules_at", spy)
    split = discover(graph, _pm(), RuleBook(), axis_sizes=(n,), progress=False, workers=1)
    monkeypatch.setattr(disc, "UNSHARDED_AT", 10**9)
    whole = discover(graph, _pm(), RuleBook(), axis_sizes=(n,), progress=False, workers=1)
    assert _rules(split, graph, n) == _rules(whole, graph, n)
    assert any(any(isinstance(p, Shard) for r in rs for p in r.inputs) for rs in _rules(split, graph, n).values())
    small = [(k, e) for k, s, e in calls if s is False]
    big = {k: e for k, s, e in calls if s is True}
    assert small, "no op took the small proxy"
    assert all(2 * e <= big[k] for k, e in small if k in big)  # at most half the elements


def test_no_small_proxy_on_small_axes(monkeypatch):
    graph = transformer_block()
    seen = []
    real = disc._rules_at

    def spy(spec, g, op, n, draws, check, only=None, sharded=None):
        seen.append(sharded)
        return real(spec, g, op, n, draws, check, only, sharded)

    monkeypatch.setattr(disc, "_rules_at", spy)
    discover(graph, _pm(), RuleBook(), axis_sizes=(3,), progress=False, workers=1)
    assert seen and all(s is None for s in seen)
