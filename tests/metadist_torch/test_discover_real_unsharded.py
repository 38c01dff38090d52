"""An op discovered at its real shapes on an axis of more than 3 devices verifies the input combinations that
shard nothing on the two proxies of an axis of 2 (metadist_core.discovery.discover._real_size_unsharded): the same rules
as verifying everything at the real shapes, with the Partial inputs' whole-size pieces made on smaller tensors."""

import pytest

torch = pytest.importorskip("torch")

import metadist_core.discovery.discover as disc  # noqa: E402
from metadist_core.ir.placement import Partial, Shard  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402


def test_real_shape_discovery_takes_the_small_proxies_for_unsharded_combinations(monkeypatch):
    from metadist_torch.trace.trace import trace_step

    def step(x):  # attention scores' view: batch x heads becomes one dim of the sequence's size
        return (x.view(128, 32, 32) * 2.0).sum()

    graph = trace_step(step, (torch.randn(8, 16, 32, 32),)).graph
    view = next(op for op in graph.ops if op.key == "aten.view.default")
    pm = PluginManager()
    calls = []
    real = disc.discover_rules

    def spy(spec, n, **kw):
        calls.append((kw.get("sharded"), sum(x.size for x in spec.example_inputs)))
        return real(spec, n, **kw)

    monkeypatch.setattr(disc, "discover_rules", spy)
    split = disc.discover_op(view, graph, pm, 8)
    small = [e for s, e in calls if s is False]
    assert len(small) == 2 and all(2 * e <= 8 * 16 * 32 * 32 for e in small)  # both axis-2 proxies, smaller
    calls.clear()
    monkeypatch.setattr(disc, "UNSHARDED_AT", 10**9)
    whole = disc.discover_op(view, graph, pm, 8)
    assert [s for s, _ in calls] == [None]  # everything at the real shapes
    assert split.status == whole.status == "ok" and set(split.rules) == set(whole.rules)
    assert any(isinstance(r.inputs[0], Partial) for r in split.rules)  # Partial rules came from the proxies
    assert any(isinstance(r.inputs[0], Shard) for r in split.rules)
