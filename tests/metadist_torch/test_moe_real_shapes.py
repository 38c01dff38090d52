"""Mixtures of experts at the shapes they train, on the meta device: every op of Qwen3-MoE and of a
DeepSeek-V3-like model (latent attention, 256 routed experts beside a shared one) at 8 x 4,096 tokens gets its
rules on an axis of 8, none left to run replicated; the rules written down for slices, splits, concatenations,
slice-scatters and new empty tensors (used where no proxy stands for such an op) are among those ShardCombine
finds by running the op on pieces."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks.plan_scale import MOE_SIZES, build_real, trace_lm  # noqa: E402
from metadist_core.discovery import moe_dispatch  # noqa: E402
from metadist_core.discovery.algebra import ALONG_DIM, NEW_EMPTY, algebra_rules  # noqa: E402
from metadist_core.discovery.discover import discover, discover_pattern  # noqa: E402
from metadist_core.discovery.patterns import op_pattern  # noqa: E402
from metadist_core.discovery.rules import RuleBook  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402


def _graph(model: str, layers: int):
    sizes = dict(MOE_SIZES[model])
    MOE_SIZES[model] = {**sizes, "num_hidden_layers": layers}
    try:
        return trace_lm(*build_real(model, 8, 4096))
    finally:
        MOE_SIZES[model] = sizes


@pytest.mark.parametrize("model", [pytest.param("qwen3-moe-30b", marks=pytest.mark.slow), "deepseek-v3-like"])
def test_the_layers_ops_without_a_proxy_keep_their_rules_at_8_x_4096(model):
    """The lean variant: the experts layer's op gets its declared rules; every slice, split, concatenation,
    slice-scatter and new empty tensor (latent attention's 192-wide heads cut into 128 + 64, which no proxy
    keeps) has rules from its dims to fall back on where its proxy fails."""
    g = _graph(model, 2)
    pm, seen, checked = PluginManager(), set(), {}
    for op in g.ops:
        if op.key in moe_dispatch.OP_KEYS:
            pat = op_pattern(op, g, 8)
            if pat.key not in seen:
                seen.add(pat.key)
                rules, _ = discover_pattern(op, g, pm, pat, set())
                assert rules.status == "ok" and len(rules.rules) > 1, (op.key, rules.note)
        elif op.key in ALONG_DIM or op.key in NEW_EMPTY:
            rules = algebra_rules(op, g, 8)
            shapes = [g.vars[v].shape for v in op.inputs + op.outputs]
            assert rules is not None and len(rules) > 1, (op.key, shapes, op.attrs)
        else:
            continue
        checked[op.key] = checked.get(op.key, 0) + 1
    assert set(moe_dispatch.OP_KEYS) <= set(checked), checked
    if model == "deepseek-v3-like":
        assert {"aten.split_with_sizes.default", "aten.cat.default", "aten.new_empty_strided.default"} <= set(checked)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3-moe-30b", "deepseek-v3-like"])
def test_no_op_of_the_moe_models_runs_replicated_at_8_x_4096(model, caplog):
    """The whole 2-layer step (DeepSeek-V3-like: one dense layer, one of experts) on an axis of 8."""
    g = _graph(model, 2)
    with caplog.at_level(logging.WARNING, logger="metadist"):
        book = discover(g, PluginManager(), RuleBook(), axis_sizes=(8,), progress=False)
    replicated = {k: e.note for k, e in book.entries.items() if e.status != "ok"}
    assert not replicated, replicated
    assert not [r for r in caplog.records if "runs replicated" in r.getMessage()]


def test_the_along_dim_rules_are_among_those_shardcombine_finds():
    from metadist_core.discovery.shardcombine import discover_rules
    from metadist_torch.ops.oprunner import op_spec
    from metadist_torch.plugin import TorchFrontend

    class Attention(torch.nn.Module):
        """Latent attention's head layout: a 12-wide head of an 8-wide part and a 4-wide rotary part."""

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(12, 2 * 12)

        def forward(self, x):
            q, k = self.proj(x).chunk(2, -1)
            q_pass, q_rot = torch.split(q, [8, 4], dim=-1)
            k_pass, k_rot = torch.split(k, [8, 4], dim=-1)
            q = torch.cat((q_pass, q_rot * 2), dim=-1)
            k = torch.cat((k_pass, k_rot[..., :1].expand_as(k_rot)), dim=-1)
            return (q * k)[:, 2:].sum(-1)

    def step(model, x):
        loss = (model(x) ** 2).sum()
        loss.backward()
        return loss

    graph = TorchFrontend().trace(step, (Attention(), torch.randn(6, 10, 12)), {}).graph
    seen = {}
    for op in graph.ops:
        declared = algebra_rules(op, graph, 2) if op.key in ALONG_DIM else None
        if declared is None:
            continue
        found = discover_rules(op_spec(op, graph), 2)
        missing = [str(r) for r in declared if r not in found]
        assert not missing, (op.key, missing, [str(r) for r in found])
        seen[op.key] = len(declared)
    assert {"aten.split_with_sizes.default", "aten.cat.default", "aten.slice.Tensor"} <= set(seen), seen
