"""Mixture-of-experts models as a user builds them (transformers' Mixtral and Qwen2-MoE from configs), their
training steps and batches, for the MoE tests and their multi-rank worker."""

from __future__ import annotations

import torch

VOCAB = 128


def mixtral(hidden: int = 64, experts: int = 4, top_k: int = 2, layers: int = 2) -> torch.nn.Module:
    """The Mixtral of examples/torch/mixtral_hf.py (seeded), at this file's vocabulary."""
    from _examples import load_example

    return load_example("mixtral_hf").build(hidden, experts, top_k, layers, VOCAB)[0]


def qwen_moe(hidden: int = 64, experts: int = 4, top_k: int = 2, layers: int = 2) -> torch.nn.Module:
    """Qwen2-MoE: routed experts beside a gated shared expert in every layer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
    )
    return Qwen2MoeForCausalLM(cfg)


def one_expert(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every router zeroed and frozen: all logits tie, so every token goes to the same expert
    (the same two with top-2), and the others get no token, at every step."""
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            with torch.no_grad():
                p.zero_()
            p.requires_grad_(False)
    return model


def batch(step: int, size: int = 8, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, seq), generator=torch.Generator().manual_seed(100 + step))


def lm_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def autocast_step(model, opt, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def optimizer(model: torch.nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":  # bf16 tests: Adam turns a near-zero gradient's rounding into a whole step of lr
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def qwen3_moe(hidden: int = 64, experts: int = 32, top_k: int = 8, layers: int = 2) -> torch.nn.Module:
    """Qwen3-MoE as it is trained: many small experts, top-8 (at 32 experts here), routing weights renormalised."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        moe_intermediate_size=hidden // 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    return Qwen3MoeForCausalLM(cfg)


def deepseek_v3(hidden: int = 64, experts: int = 8, top_k: int = 2, layers: int = 2) -> torch.nn.Module:
    """DeepSeek-V3's architecture small: latent attention (a head of a 16-wide part and an 8-wide rotary part),
    routed experts in groups beside a shared expert, the first layer dense."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=top_k,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
    )
    return DeepseekV3ForCausalLM(cfg)
