"""The ``tp`` preset finds Megatron's layout on transformers' LLaMA: q/k/v projections by columns (behind the
rotary embedding and the KV cache's cat), o_proj and down_proj by rows, gate/up by columns, and no column/row
pair across a residual add (o_proj's output reaches the next q_proj through the residual stream and the
RMSNorm's elementwise ops). Planned in one process on a (4,) mesh; no weight is moved."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks._models import adamw, llama, lm_step  # noqa: E402
from metadist_core.config import load_settings  # noqa: E402
from metadist_core.driver.compile import plan_graph  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.ir.placement import Replicate, Shard, Sharding  # noqa: E402
from metadist_core.problem.presets import preset_constraints  # noqa: E402
from metadist_torch.plugin import TorchFrontend  # noqa: E402


def test_tp_preset_is_megatron_on_llama():
    model = llama(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16,
    )
    fe = TorchFrontend()
    tr = fe.trace(lm_step, (model, adamw(model, 1e-3), torch.randint(0, 64, (4, 16))), {})
    g = tr.graph
    mesh = Mesh((4,), alpha=[2e-4], beta=[1e-9])
    res = plan_graph(
        g, mesh, settings=load_settings(progress=False, strategy="tp"), constraints=fe.constraints(g, mesh)
    )
    label = {v: g.vars[v].label for v in g.inputs}
    pc = preset_constraints(res.problem.unsteered, "tp")
    pairs = {(label.get(a, a), label[b]) for a, b in pc.pairs}
    assert pairs == {
        (f"model.layers.{i}.mlp.{p}_proj.weight", f"model.layers.{i}.mlp.down_proj.weight")
        for i in range(2)
        for p in ("gate", "up")
    } | {("<attention>", f"model.layers.{i}.self_attn.o_proj.weight") for i in range(2)}, pairs
    by = {label[v]: res.plan.input_shardings[v] for v in g.inputs if g.vars[v].role == "parameter"}
    col, row, rep = Sharding((Shard(0),)), Sharding((Shard(1),)), Sharding((Replicate(),))
    for i in range(2):
        for p in ("q", "k", "v"):
            assert by[f"model.layers.{i}.self_attn.{p}_proj.weight"] == col, p
        for p in ("gate", "up"):
            assert by[f"model.layers.{i}.mlp.{p}_proj.weight"] == col, p
        assert by[f"model.layers.{i}.self_attn.o_proj.weight"] == row
        assert by[f"model.layers.{i}.mlp.down_proj.weight"] == row
        assert by[f"model.layers.{i}.input_layernorm.weight"] == rep
    assert by["lm_head.weight"] == rep and by["model.embed_tokens.weight"] == rep
    params = {v for v in g.inputs if g.vars[v].role == "parameter"}
    assert not [label[e.var] for e, c in res.plan.collectives() if not c.is_free and e.var in params]


def test_tp_preset_leaves_an_attention_whole_whose_weights_the_user_keeps_whole():
    """The GPT example's hand Megatron plan splits the MLPs only (its fused qkv cannot be split by heads with
    ColwiseParallel). With the tp preset and the attention's weights pinned whole by name, the preset leaves
    the attention to the solver instead of splitting its activations by heads around the user's pins: the MLPs
    are column/row pairs, the attention's weights stay whole, and no weight is moved."""
    from test_compile_single import gpt

    c = gpt.GPTConfig(vocab=64, seq=16, width=32, heads=4, layers=2, batch=4)
    model, opt = gpt.build(c)
    fe = TorchFrontend()
    g = fe.trace(gpt.train_step, (model, opt, *gpt.batch(c, 0)), {}).graph
    mesh = Mesh((4,), alpha=[2e-4], beta=[1e-9])
    whole = {f"blocks.*.{n}.*": "R" for n in ("qkv", "proj")}
    res = plan_graph(
        g, mesh, settings=load_settings(progress=False, strategy="tp"), constraints=fe.constraints(g, mesh) + [whole]
    )
    label = {v: g.vars[v].label for v in g.inputs}
    by = {label[v]: res.plan.input_shardings[v] for v in g.inputs if g.vars[v].role == "parameter"}
    col, row, rep = Sharding((Shard(0),)), Sharding((Shard(1),)), Sharding((Replicate(),))
    for i in range(2):
        assert by[f"blocks.{i}.fc.weight"] == col and by[f"blocks.{i}.fc.bias"] == col
        assert by[f"blocks.{i}.out.weight"] == row
        assert by[f"blocks.{i}.qkv.weight"] == rep and by[f"blocks.{i}.proj.weight"] == rep
    from metadist_core.problem.presets import preset_constraints
    from metadist_core.problem.constraints import pins_by_name

    user = {p.var: p.sharding for p in pins_by_name(res.problem.unsteered, whole)}
    pc = preset_constraints(res.problem.unsteered, "tp", user)
    assert not [p for p in pc.pairs if p[0] == "<attention>"], pc.pairs
    assert sum("attention" in n and "left to the solver" in n for n in pc.notes) == 2, pc.notes
    plain = preset_constraints(res.problem.unsteered, "tp")  # without the user's pins: heads split
    assert sum(p[0] == "<attention>" for p in plain.pairs) == 2
    params = {v for v in g.inputs if g.vars[v].role == "parameter"}
    assert not [label[e.var] for e, c in res.plan.collectives() if not c.is_free and e.var in params]
