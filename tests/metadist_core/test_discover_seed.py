"""Discovery on a larger axis is seeded by the rules of the smaller one (metadist_core.discovery.discover.seed_combos):
every rule is still verified on the larger axis, so seeding never admits a rule; on the reference
transformer block it finds exactly the rules the unseeded search finds, in fewer candidate runs."""

import metadist_core.discovery.discover as disc
from metadist_core.discovery.discover import discover
from metadist_core.reference.plugin import transformer_block
from metadist_core.discovery.rules import RuleBook

from _small_graphs import reference_pm as _pm, rules_by_op as _rules


def test_seeded_rules_on_the_larger_axis_equal_the_unseeded_search(monkeypatch):
    graph = transformer_block()
    calls = []
    real = disc._rules_at

    def spy(spec, g, op, n, draws, check, only=None):
        calls.append((n, None if only is None else len(only)))
        return real(spec, g, op, n, draws, check, only)

    monkeypatch.setattr(disc, "_rules_at", spy)
    seeded = discover(graph, _pm(), RuleBook(), axis_sizes=(2, 4), progress=False, workers=1)
    seeded_first = [c for c in calls if c[0] == 4]
    calls.clear()
    alone = discover(graph, _pm(), RuleBook(), axis_sizes=(4,), progress=False, workers=1)
    assert _rules(seeded, graph, 4) == _rules(alone, graph, 4)
    assert _rules(seeded, graph, 2) != {}  # the smaller axis was discovered too
    # on the axis of 4 every first proxy instance was seeded (a limited candidate list), none unseeded
    assert seeded_first and all(k is not None for _, k in seeded_first)
    assert any(k is None for n, k in calls if n == 4)  # alone, the axis of 4 searched everything


def test_a_seed_that_holds_nowhere_falls_back_to_the_whole_search():
    graph = transformer_block()
    op = next(o for o in graph.ops if o.key == "np.matmul")
    from metadist_core.discovery.patterns import op_pattern
    from metadist_core.ir.placement import Partial

    pat = op_pattern(op, graph, 4, True)
    bogus = [tuple(Partial("max") for _ in op.inputs)]  # max-partial inputs of a matmul: never a rule
    got, _ = disc.discover_pattern(op, graph, _pm(), pat, set(), seed=bogus)
    want, _ = disc.discover_pattern(op, graph, _pm(), pat, set())
    assert got.status == "ok" and set(got.rules) == set(want.rules)
