"""Views, reshapes, copies, transposes, permutations, (un)squeezes and expands take their rules from their dims,
without a run: the rules written down are exactly those ShardCombine finds by running the op on pieces, on
every such op of a GPT-2 and a LLaMA training step (and a transpose of two equal dims, where only the op's
arguments tell which dims moved), and discovery runs no proxy for them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks._models import adamw, gpt2, llama, lm_step  # noqa: E402
from metadist_core.discovery import discover as discover_mod  # noqa: E402
from metadist_core.discovery.algebra import FIRST, algebra_rules  # noqa: E402
from metadist_core.discovery.rules import RuleBook  # noqa: E402
from metadist_core.discovery.shardcombine import discover_rules  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402
from metadist_torch.ops.oprunner import op_spec  # noqa: E402
from metadist_torch.plugin import TorchFrontend  # noqa: E402


def _step_graph(name: str):
    torch.manual_seed(0)
    if name == "gpt2":
        model = gpt2(seed=0, n_layer=1, n_embd=24, n_head=4, vocab_size=37, n_positions=16)
    else:
        model = llama(
            seed=0,
            num_hidden_layers=1,
            hidden_size=24,
            intermediate_size=40,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=37,
            max_position_embeddings=16,
        )
    ids = torch.randint(0, 37, (4, 12))
    return TorchFrontend().trace(lm_step, (model, adamw(model, 1e-3), ids), {}).graph


def _compare(graph, sizes=(2, 4)) -> dict[str, int]:
    seen: dict[str, int] = {}
    done = set()
    for op in graph.ops:
        if op.key not in FIRST:
            continue
        for n in sizes:
            sig = (op.signature(graph), n)
            if sig in done:
                continue
            done.add(sig)
            written = algebra_rules(op, graph, n)
            assert written is not None, (op.key, [graph.vars[v].shape for v in op.inputs + op.outputs], op.attrs)
            found = discover_rules(op_spec(op, graph), n)
            shapes = [graph.vars[v].shape for v in op.inputs + op.outputs]
            assert set(map(str, written)) == set(map(str, found)), (op.key, n, shapes, op.attrs)
            seen[op.key] = seen.get(op.key, 0) + 1
    return seen


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_rules_from_dims_are_the_rules_shardcombine_finds(name):
    seen = _compare(_step_graph(name))
    want = {"aten.view.default", "aten.transpose.int", "aten.t.default", "aten.unsqueeze.default"}
    if name == "llama":  # grouped-query heads repeated by an expand
        want |= {"aten.expand.default", "aten._unsafe_view.default"}
    assert want <= set(seen), seen


def test_a_transpose_of_equal_dims_and_a_permutation_follow_their_arguments():
    def f(x, y):
        return (x.transpose(0, 1) * 2).sum() + (y.permute(2, 0, 1).unsqueeze(1).expand(6, 3, 4, 4) ** 2).sum()

    graph = TorchFrontend().trace(f, (torch.randn(4, 4, 6), torch.randn(4, 4, 6)), {}).graph
    seen = _compare(graph)
    assert {"aten.transpose.int", "aten.permute.default", "aten.unsqueeze.default", "aten.expand.default"} <= set(seen)


def test_discovery_runs_no_proxy_for_views_and_copies(monkeypatch):
    graph = _step_graph("llama")
    ran: list[str] = []
    real = discover_mod._discover_proxied

    def spy(op, *a, **k):
        ran.append(op.key)
        return real(op, *a, **k)

    monkeypatch.setattr(discover_mod, "_discover_proxied", spy)
    book = discover_mod.discover(graph, PluginManager(), RuleBook(), axis_sizes=(2,), workers=1, progress=False)
    assert ran and not [k for k in ran if k in FIRST], sorted(set(ran) & FIRST)
    for op in graph.ops:
        if op.key in FIRST:
            e = book.lookup(op, graph, 2)
            assert e is not None and e.status == "ok" and e.rules == algebra_rules(op, graph, 2)
