"""transformers' MixtralForCausalLM (a mixture of experts) built from a config, trained with AdamW under metadist_compile.

    python examples/torch/mixtral_hf.py                                    # world size 1
    torchrun --nproc_per_node=4 examples/torch/mixtral_hf.py --strategy ep # experts split over the 4 ranks
    torchrun --nproc_per_node=4 examples/torch/mixtral_hf.py --mesh 2x2    # the planner's own choice
    metadist plan examples/torch/mixtral_hf.py --mesh 2x4 -- --experts 8   # planned for 8 devices

Prints each step's loss, the plan, and where each expert lives. No token is dropped unless
``--capacity-factor`` is given (see docs/moe.md).
"""

from __future__ import annotations

import argparse
import os

import torch

from metadist_torch import metadist_compile


def build(hidden: int, experts: int, top_k: int, layers: int, vocab: int):
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=1024,
    )
    model = MixtralForCausalLM(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mesh", default=None, help="mesh shape like 4 or 2x2 (default: the world as one axis)")
    ap.add_argument("--strategy", default="auto", help="auto, or a preset such as ep")
    ap.add_argument("--capacity-factor", type=float, default=None, help="drop tokens past this many slots")
    a = ap.parse_args(argv)
    mesh = tuple(int(x) for x in a.mesh.split("x")) if a.mesh else None
    model, opt = build(a.hidden, a.experts, a.top_k, a.layers, a.vocab)
    step = metadist_compile(mesh=mesh, strategy=a.strategy, moe_capacity_factor=a.capacity_factor)(train_step)
    first = int(os.environ.get("RANK", "0")) == 0
    for i in range(a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(i))
        loss = float(step(model, opt, ids))
        if first:
            print(f"step {i}: loss {loss:.4f}", flush=True)
    if first:
        print(step.plan.summary())
        text = step.plan.explain(presets=False)
        if "\nexperts\n" in text:
            print("experts" + text.split("\nexperts\n", 1)[1].split("\n\n", 1)[0])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from metadist_torch.runtime.engine import finish_worker

        finish_worker(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
