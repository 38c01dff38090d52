"""A model on the meta device (planned, never run) is traced as the CPU would run it.

Traced on meta itself, scaled dot-product attention fell back to its math decomposition: two bmm over
batch x heads merged into one dim, which no head split can pass, so LLaMA-8B's attention could only be
split by batch. As fake CPU tensors it is the fused kernel the compiled step runs, and discovery finds its
head split (the kernel's traced call leaves its default ``dropout_p`` out; that once read as a random op).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks.plan_scale import llama_on_meta  # noqa: E402
from metadist_core.discovery.discover import discover_pattern  # noqa: E402
from metadist_core.discovery.patterns import op_pattern  # noqa: E402
from metadist_core.ir.placement import Replicate, Shard  # noqa: E402
from metadist_torch.plugin import TorchFrontend  # noqa: E402
from test_third_party import step  # noqa: E402


def _llama_on_meta():
    """A one-layer LLaMA with grouped-query attention (8 query heads over 2 key/value heads), on meta."""
    return llama_on_meta(
        4,
        32,
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )


def test_meta_model_traces_the_fused_attention_and_splits_it_by_heads():
    model, ids = _llama_on_meta()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fe = TorchFrontend()
    graph = fe.trace(step, (model, opt, ids), {}).graph
    keys = [op.key for op in graph.ops]
    assert "aten.bmm.default" not in keys, "attention was decomposed into bmm (the meta device's math path)"
    attn = [op for op in graph.ops if op.key == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert len(attn) == 1, sorted(set(keys))
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was allocated for the trace
    op = attn[0]
    rules, _ = discover_pattern(op, graph, fe, op_pattern(op, graph, 2))
    assert rules.status == "ok", rules
    heads = [r for r in rules.rules if r.inputs[:3] == (Shard(1),) * 3]
    assert heads and heads[0].outputs[0] == Shard(1), [str(r) for r in rules.rules]
    assert any(r.inputs[:3] == (Shard(0),) * 3 for r in rules.rules)
    assert not any(r.inputs[:3] == (Shard(1), Shard(1), Replicate()) for r in rules.rules)
