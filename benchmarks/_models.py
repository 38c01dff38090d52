"""The language models the benchmarks train, and their training step: transformers' GPT-2 and LLaMA built
from a config (nothing downloaded), token batches made in code, and the step (loss, backward, optimizer step).

The builders fill in what every benchmark and test here wants unless told otherwise: token ids 0 for
begin/end (and padding, for LLaMA), no dropout for GPT-2 (a compiled step and the eager one it is checked
against then draw no random masks), and ``torch.manual_seed(seed)`` before the weights are made, so that
two builds are equal. A keyword the caller passes wins over these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

# GPT2Config's defaults the benchmarks override
GPT2_DEFAULTS = dict(bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# LlamaConfig's defaults the benchmarks override
LLAMA_DEFAULTS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _seeded(seed: int | None) -> None:
    if seed is not None:
        import torch

        torch.manual_seed(seed)


def _build(cls, cfg, device: str | None):
    if device is None:
        return cls(cfg)
    import torch

    with torch.device(device):
        return cls(cfg)


def gpt2(seed: int | None = 0, device: str | None = None, released: bool = False, **config) -> "torch.nn.Module":
    """transformers' ``GPT2LMHeadModel(GPT2Config(**config))`` with :data:`GPT2_DEFAULTS` under ``config``
    (``released``: transformers' own defaults instead, GPT-2 as released, dropout 0.1), its weights drawn
    after ``torch.manual_seed(seed)`` (``None``: the global generator as it is), made on ``device``
    (``"meta"``: shapes only, nothing allocated)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    _seeded(seed)
    return _build(GPT2LMHeadModel, GPT2Config(**{**({} if released else GPT2_DEFAULTS), **config}), device)


def llama(seed: int | None = 0, device: str | None = None, **config) -> "torch.nn.Module":
    """transformers' ``LlamaForCausalLM(LlamaConfig(**config))`` with :data:`LLAMA_DEFAULTS` under ``config``;
    ``seed`` and ``device`` as for :func:`gpt2`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    _seeded(seed)
    return _build(LlamaForCausalLM, LlamaConfig(**{**LLAMA_DEFAULTS, **config}), device)


def llama_of(layers: int, width: int, seq: int, vocab: int, seed: int | None = 0) -> "torch.nn.Module":
    """The benchmarks' LLaMA-style shape (:func:`llama`): 4 heads of as many keys, an MLP twice the width."""
    return llama(
        seed,
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
    )


def adamw(model: "torch.nn.Module", lr: float) -> "torch.optim.Optimizer":
    """AdamW over all of ``model``'s parameters at learning rate ``lr`` (torch's other defaults)."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=lr)


def tokens(vocab: int, batch: int, seq: int, seeds: int | Sequence[int]) -> "list[torch.Tensor]":
    """Token-id batches of ``batch`` x ``seq`` below ``vocab``, one per seed (an int ``n``: seeds ``0..n-1``),
    each drawn from its own generator so that batch ``i`` is the same whichever others are made."""
    import torch

    seeds = range(seeds) if isinstance(seeds, int) else seeds
    return [torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(s)) for s in seeds]


def lm_step(model: "torch.nn.Module", opt: "torch.optim.Optimizer", ids: "torch.Tensor") -> "torch.Tensor":
    """One training step of a transformers causal LM on ``ids`` (the labels too: the model shifts them):
    loss, backward, optimizer step, gradients cleared. Returns the loss."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def lm_step_labels(
    model: "torch.nn.Module", opt: "torch.optim.Optimizer", ids: "torch.Tensor", labels: "torch.Tensor"
) -> "torch.Tensor":
    """:func:`lm_step` with the labels passed apart from the inputs."""
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


__all__ = [
    "GPT2_DEFAULTS",
    "LLAMA_DEFAULTS",
    "gpt2",
    "llama",
    "llama_of",
    "adamw",
    "tokens",
    "lm_step",
    "lm_step_labels",
]


def qwen3_moe(seed: int | None = 0, device: str | None = None, **config) -> "torch.nn.Module":
    """transformers' ``Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))`` (every layer a mixture of experts)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _quiet_transformers()
    _seeded(seed)
    return _build(Qwen3MoeForCausalLM, Qwen3MoeConfig(**{**LLAMA_DEFAULTS, **config}), device)


def deepseek_v3(seed: int | None = 0, device: str | None = None, **config) -> "torch.nn.Module":
    """transformers' ``DeepseekV3ForCausalLM(DeepseekV3Config(**config))``: latent attention, routed experts
    beside a shared expert, the first ``first_k_dense_replace`` layers dense."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    _quiet_transformers()
    _seeded(seed)
    return _build(DeepseekV3ForCausalLM, DeepseekV3Config(**{**LLAMA_DEFAULTS, **config}), device)
