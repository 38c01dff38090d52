"""transformers' GPT2LMHeadModel built from a config (no download), trained with AdamW under metadist_compile.

    python examples/torch/gpt2_hf.py                         # a small GPT-2, world size 1
    torchrun --nproc_per_node=4 examples/torch/gpt2_hf.py --mesh 2x2
    metadist plan examples/torch/gpt2_hf.py --mesh 2x4 -- --size small --seq 1024   # GPT-2 small at its real size

``--size small`` is GPT-2 small as released (12 layers, width 768, 12 heads, vocabulary
50,257); ``--size tiny`` (the default) is 2 layers of width 128 for a quick run.
"""

from __future__ import annotations

import argparse

import torch

from metadist_torch import metadist_compile

SIZES = {
    "tiny": dict(n_layer=2, n_embd=128, n_head=4, vocab_size=1024),
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257),
}


def build(size: str, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_positions=max(seq, 1024),
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **SIZES[size],
    )
    model = GPT2LMHeadModel(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mesh", default=None, help="mesh shape like 4 or 2x2 (default: the world as one axis)")
    a = ap.parse_args(argv)
    mesh = tuple(int(x) for x in a.mesh.split("x")) if a.mesh else None
    model, opt = build(a.size, a.seq)
    step = metadist_compile(mesh=mesh)(train_step)
    vocab = model.config.vocab_size
    for i in range(a.steps):
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(i))
        loss = float(step(model, opt, ids))
        if int(__import__("os").environ.get("RANK", "0")) == 0:
            print(f"step {i}: loss {loss:.4f}", flush=True)
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        print(step.plan.summary())
        print("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in step.timings.items()))
    if int(__import__("os").environ.get("WORLD_SIZE", "1")) > 1:
        from metadist_torch.runtime.engine import finish_worker

        finish_worker(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
