import json
import logging

import pytest

from metadist_core.discovery.discover import discover
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard
from metadist_core.plugins import PluginManager
from metadist_core.reference.plugin import transformer_block
from metadist_core.discovery.rules import CACHE_FILE, CACHE_VERSION, OpRules, RuleBook, ShardingRule, expand_rules


class CountingFrontend:
    """Wraps the reference frontend and counts how many op specs discovery asked for."""

    from metadist_core.hookspecs import hookimpl

    def __init__(self):
        from metadist_core.reference.plugin import ReferenceFrontend

        outer = self
        self.calls = 0

        class Counting(ReferenceFrontend):
            name = "counting"

            def op_spec(self, op, graph):
                outer.calls += 1
                return super().op_spec(op, graph)

        self.adapter = Counting()

    @hookimpl
    def metadist_frontend(self):
        return self.adapter


def _pm():
    pm = PluginManager(load_entry_points=False)
    front = CountingFrontend()
    pm.register(front, "frontend", "counting")
    return pm, front


def test_rulebook_json_round_trip(tmp_path):
    book = RuleBook(cache_dir=tmp_path)
    book.add(
        "k|8x4|float32|x",
        OpRules(
            "np.relu", [ShardingRule((Shard(0),), (Shard(0),)), ShardingRule((Partial("max"),), (Partial("max"),))]
        ),
    )
    path = book.save()
    assert path.name == CACHE_FILE
    again = RuleBook.load(tmp_path)
    assert again.rules("k|8x4|float32|x") == book.rules("k|8x4|float32|x")
    assert json.loads(path.read_text())["version"] == CACHE_VERSION


def test_second_discovery_reads_the_cache(tmp_path):
    ir = transformer_block()
    pm, front = _pm()
    book = discover(ir, pm, RuleBook.load(tmp_path))
    n_patterns = len(book.entries)
    assert n_patterns <= len(ir.unique_signatures())
    # every pattern runs at two proxy sizes (an op a proxy cannot keep runs once, at its real shapes)
    assert n_patterns <= front.calls <= 2 * n_patterns and book.discovered == n_patterns
    pm2, front2 = _pm()
    book2 = discover(ir, pm2, RuleBook.load(tmp_path))
    assert front2.calls == 0 and book2.cache_hits == n_patterns
    assert {s: book2.rules(s) for s in book2.entries} == {s: book.rules(s) for s in book.entries}


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": 0, "entries": {}}),
        json.dumps({"version": 1, "entries": {"x": {"rules": 3}}}),
    ],
)
def test_corrupt_or_old_cache_warns_once_and_is_rebuilt(tmp_path, caplog, content):
    (tmp_path / CACHE_FILE).write_text(content)
    with caplog.at_level(logging.WARNING, logger="metadist"):
        book = RuleBook.load(tmp_path)
    assert len(book) == 0
    assert len([r for r in caplog.records if "unreadable" in r.message]) == 1
    pm, _ = _pm()
    discover(transformer_block(), pm, book)
    assert len(RuleBook.load(tmp_path)) == len(book) > 0


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("METADIST_CACHE_DIR", str(tmp_path / "here"))
    pm, _ = _pm()
    discover(transformer_block(), pm, RuleBook.load())
    assert (tmp_path / "here" / CACHE_FILE).exists()


def test_op_without_runner_runs_replicated_with_one_warning(caplog):
    from metadist_core.ir.ir import MetaIR

    g = MetaIR()
    g.add_input("x", (4, 4), "float32")
    g.add_op("custom.thing", ["x"], [("y", (4, 4), "float32")])
    g.add_op("custom.thing", ["y"], [("z", (4, 4), "float32")])
    pm, _ = _pm()
    with caplog.at_level(logging.WARNING, logger="metadist"):
        book = discover(g, pm, RuleBook())
    (entry,) = book.entries.values()
    assert entry.status == "replicated" and entry.rules == [ShardingRule((Replicate(),), (Replicate(),))]
    assert len([r for r in caplog.records if "custom.thing" in r.message]) == 1


def test_expand_rules_to_2d_mesh():
    rules = [
        ShardingRule((Shard(0), Replicate()), (Shard(0),)),
        ShardingRule((Replicate(), Shard(1)), (Shard(1),)),
        ShardingRule((Shard(1), Shard(0)), (Partial("sum"),)),
    ]
    mesh = Mesh((2, 2))
    strategies = expand_rules(rules, mesh, [(8, 8), (8, 4)], [(8, 4)])
    as_text = {str(s) for s in strategies}
    assert "([S(0), R], [R, S(1)]) -> ([S(0), S(1)])" in as_text  # 2-D: rows on one axis, columns on the other
    assert "([S(1), S(1)], [S(0), S(0)]) -> ([P(sum), P(sum)])" in as_text
    assert len(strategies) == len(as_text) == 16  # (1 replicated + 3 rules) per axis, all shapes allow it
    # an axis of size 1 only replicates; a dim too small to split is dropped
    assert len(expand_rules(rules, Mesh((1, 2)), [(8, 6), (6, 4)], [(8, 4)])) == 4
    assert all(s.inputs[0][0] != Shard(0) for s in expand_rules(rules, Mesh((2,)), [(1, 6), (6, 4)], [(1, 4)]))
    # rules verified on an axis of 2 only split evenly on an axis of 4
    assert not any(s.inputs[0][0] == Shard(0) for s in expand_rules(rules, Mesh((4,)), [(6, 8), (8, 4)], [(6, 4)]))
    assert any(s.inputs[0][0] == Shard(0) for s in expand_rules(rules, Mesh((2,)), [(7, 8), (8, 4)], [(7, 4)]))


def test_a_rule_cached_at_one_axis_size_is_never_used_at_another(tmp_path):
    """Rules are verified per axis size: discovery on an axis of 2 serves meshes of 2 only."""
    from metadist_core.problem.build import build_problem

    ir = transformer_block()
    pm, front = _pm()
    book = discover(ir, pm, RuleBook.load(tmp_path), axis_sizes=(2,))
    op = next(o for o in ir.ops if o.key == "np.matmul")
    assert book.lookup(op, ir, 2) is not None and book.lookup(op, ir, 4) is None
    assert all(e.axis_size == 2 for e in book.entries.values())
    # a mesh of 4 finds no rule of the axis of 2: every op stays replicated until discovery runs at 4
    p4 = build_problem(ir, book, Mesh((4,)))
    assert all(len(n.options) == 1 for n in p4.nodes if n.kind == "op")
    calls = front.calls
    book4 = discover(ir, pm, RuleBook.load(tmp_path), axis_sizes=(2, 4))
    assert front.calls > calls and book4.lookup(op, ir, 4).axis_size == 4
    assert any(len(n.options) > 1 for n in build_problem(ir, book4, Mesh((4,))).nodes if n.kind == "op")


def test_patterns_do_not_grow_with_width_or_depth():
    """One pattern serves every size: a block twice as wide and a step twice as deep add no pattern."""
    from metadist_core.discovery.patterns import op_pattern

    def keys(g, n=2):
        return {op_pattern(op, g, n).key for op in g.ops}

    small = transformer_block(batch=6, seq=10, width=14, hidden=30)
    big = transformer_block(batch=8, seq=26, width=14, hidden=98)
    assert keys(small) == keys(big)
    # a wider block differs only where the width is a float argument (the attention scale 1/sqrt(width))
    wide = transformer_block(batch=6, seq=10, width=50, hidden=30)
    assert len(keys(wide)) == len(keys(small)) and len(keys(wide) - keys(small)) == 1
    assert len(keys(small)) < len({op.signature(small) for op in small.ops}) + 1
    # the remainder by the axis size is part of the pattern: an odd width is another pattern
    odd = transformer_block(batch=6, seq=10, width=15, hidden=30)
    assert keys(odd) != keys(small)
    # and so is an equality of sizes (a square attention matrix is not a rectangular one)
    square = transformer_block(batch=6, seq=14, width=14, hidden=30)
    assert keys(square) != keys(small)
