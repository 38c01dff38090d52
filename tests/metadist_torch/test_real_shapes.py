"""Planning at the shapes people train, on the meta device (nothing allocated).

- every op of LLaMA at 8B and 70B widths at 64 x 4,096 tokens gets its rules on an axis of 8: the views of
  70B's grouped-query heads (64 = 8 x 8 beside a batch of 64) and their copies, 2**32 elements each, have no
  proxy small enough and take their rules from their dim algebra instead of running replicated (the whole
  graph's discovery is slow; the views alone are the lean variant CI runs);
- the forward is cut into two segments a layer (attention and MLP halves), not one segment for all layers but
  the last (the rotary tables, read by every layer, no longer thicken the layers' cuts), and recomputing every
  segment never predicts more peak memory than recomputing none;
- on CUDA the device's memory (a substituted query here) reaches the planner as the default budget;
- the same for Qwen2, Qwen3 and Mistral at their 7-8B widths: Qwen2's attention backward (28 heads beside 4
  key-value heads and a whole causal mask) keeps a proxy.
"""

from __future__ import annotations

import logging
import time
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks.plan_scale import DENSE_SIZES, dense_on_meta, llama_on_meta, trace_lm  # noqa: E402
from metadist_core.discovery.discover import discover, discover_pattern  # noqa: E402
from metadist_core.discovery.patterns import op_numel, op_pattern  # noqa: E402
from metadist_core.discovery.rules import RuleBook  # noqa: E402
from metadist_core.driver.compile import replicated_plan  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.ir.placement import Shard  # noqa: E402
from metadist_core.levers.recompute_segments import order, rewrite, segments  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402

WIDTHS = {  # LlamaConfig sizes of LLaMA-3 8B and 70B (vocabulary 128,256, 8 key-value heads of 128)
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32},
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64},
}


def _llama_graph(width: str, layers: int = 2, batch: int = 64, seq: int = 4096):
    model, ids = llama_on_meta(
        batch,
        seq,
        vocab_size=128256,
        num_hidden_layers=layers,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=seq,
        **WIDTHS[width],
    )
    return trace_lm(model, ids)


def test_the_grouped_query_views_of_70b_keep_their_rules():
    """The lean variant: 70B's views and copies of 2**32 elements, discovered on an axis of 8."""
    g = _llama_graph("70b", layers=1)
    pm, seen, big = PluginManager(), set(), 0
    for op in g.ops:
        if op.key.split(".")[1] not in ("view", "_unsafe_view", "clone") or op_numel(op, g) < 2**32:
            continue
        pat = op_pattern(op, g, 8)
        if pat.key in seen:
            continue
        seen.add(pat.key)
        rules, _ = discover_pattern(op, g, pm, pat, set())
        assert rules.status == "ok", (op.key, [g.vars[v].shape for v in op.inputs + op.outputs], rules.note)
        big += 1
        if [g.vars[v].shape for v in op.inputs] == [(64, 64, 4096, 128)] and op.key == "aten.view.default":
            assert any(r.inputs == (Shard(1),) and r.outputs == (Shard(1),) for r in rules.rules)  # by kv head
    assert big >= 3, "the 2**32-element views and copies of the grouped heads were not found"


@pytest.mark.slow
@pytest.mark.parametrize("width", ["8b", "70b"])
def test_no_op_of_llama_runs_replicated_at_64_x_4096(width, tmp_path, caplog):
    """The whole 2-layer step (~700 ops, ~150 patterns) on an axis of 8: 2-5 minutes on 2 loaded cores."""
    g = _llama_graph(width)
    t = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="metadist"):
        book = discover(g, PluginManager(), RuleBook(), axis_sizes=(8,), progress=False)
    replicated = {k: e.note for k, e in book.entries.items() if e.status != "ok"}
    assert not replicated, replicated
    assert not [r for r in caplog.records if "runs replicated" in r.getMessage()]
    assert time.perf_counter() - t < 900


def test_qwen2s_attention_backward_keeps_a_proxy():
    """The lean variant for Qwen2-7B (28 heads, 4 key-value heads, the causal mask made whole): its attention
    backward, 10 tensors over 4 independent sizes, has a proxy of 3 million elements; it gets its rules there
    (the batch split; 28 heads do not split over 8 devices) instead of running replicated."""
    g = trace_lm(*dense_on_meta("qwen2-7b", 64, 4096, layers=1))
    pm = PluginManager()
    ops = [op for op in g.ops if op.key == "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    assert ops
    rules, _ = discover_pattern(ops[0], g, pm, op_pattern(ops[0], g, 8), set())
    assert rules.status == "ok", rules.note
    assert any(r.inputs[0] == Shard(0) for r in rules.rules)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DENSE_SIZES))
def test_no_op_of_qwen_and_mistral_runs_replicated_at_64_x_4096(name, caplog):
    """Qwen2-7B, Qwen3-8B and Mistral-7B (sliding window), 2 layers each, on an axis of 8: 15-20 s each."""
    g = trace_lm(*dense_on_meta(name, 64, 4096, layers=2))
    with caplog.at_level(logging.WARNING, logger="metadist"):
        book = discover(g, PluginManager(), RuleBook(), axis_sizes=(8,), progress=False)
    replicated = {k: e.note for k, e in book.entries.items() if e.status != "ok"}
    assert not replicated, replicated
    assert not [r for r in caplog.records if "runs replicated" in r.getMessage()]


def _small_llama(layers: int, seq: int = 256):
    model, ids = llama_on_meta(
        1,
        seq,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=seq,
    )
    return trace_lm(model, ids)


@pytest.mark.parametrize("layers", [2, 4])
def test_every_layer_is_cut_in_two_and_recomputing_never_costs_memory(layers):
    g = _small_llama(layers)
    segs = order(segments(g))
    assert len(segs) >= 2 * layers, f"{len(segs)} segments for {layers} layers: want the halves of each"
    mesh = Mesh((1,))
    peaks = []
    for k in (0, len(segs) // 2, len(segs)):
        plan, _ = replicated_plan(rewrite(g, [i for s in segs[:k] for i in s.recompute]), mesh)
        peaks.append(plan.memory_per_device)
    assert peaks[2] <= peaks[1] <= peaks[0], peaks
    assert peaks[2] < 0.6 * peaks[0], peaks  # the layers' saved activations go, their checkpoints stay


def test_the_cuda_memory_query_reaches_the_plan_as_its_budget(monkeypatch):
    import torch.cuda
    import metadist_torch.runtime.engine as engine_mod
    import metadist_torch.plugin as plugin
    from metadist_core.cost.profile import MeshProfile

    eng = types.SimpleNamespace(
        device=torch.device("cuda", 0), mesh=Mesh((2,)), rank=0, distributed=False, world_size=1
    )
    monkeypatch.setattr(engine_mod, "engine_for", lambda mesh: eng)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Fake GPU")
    monkeypatch.setattr(plugin, "cuda_memory", lambda dev: 80 * 2**30)
    resolved = plugin.TorchFrontend().resolve_mesh((2,), MeshProfile())
    assert resolved.device_memory == 80 * 2**30 and resolved.device_kind == "cuda-Fake_GPU"
    assert resolved.priced(resolved.mesh).device_memory == 80 * 2**30  # kept when the mesh is repriced
