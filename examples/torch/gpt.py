"""A small GPT trained with one MetaDist line: embedding, layer norm, causal attention, MLP, cross-entropy.

    python examples/torch/gpt.py                              # one process
    torchrun --nproc_per_node=4 examples/torch/gpt.py         # 4 ranks, mesh = the world as one axis
    torchrun --nproc_per_node=4 examples/torch/gpt.py --mesh 2x2 --vocab 1001

Prints the plan, the loss next to the single-device loss, and the step time.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab: int = 512
    seq: int = 64
    width: int = 128
    heads: int = 4
    layers: int = 2
    hidden_mult: int = 4
    dropout: float = 0.0
    batch: int = 8
    lr: float = 3e-3
    seed: int = 0


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width, bias=False)  # a key bias has no gradient: Adam would amplify noise
        self.proj = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width)
        self.fc = nn.Linear(c.width, c.hidden_mult * c.width)
        self.out = nn.Linear(c.hidden_mult * c.width, c.width)
        self.dropout = c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, w)), self.dropout, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.seq, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 if p.shape[0] != c.vocab else 1 / math.sqrt(c.width))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def build(c: GPTConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(c.seed)
    model = GPT(c)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=(0.9, 0.95)
    )
    return model, opt


def batch(c: GPTConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, made in code (a repeating pattern plus noise, so the loss falls)."""
    g = torch.Generator().manual_seed(1000 + step)
    base = torch.randint(0, c.vocab, (c.batch, 1), generator=g)
    ramp = torch.arange(c.seq + 1).unsqueeze(0)
    noise = torch.randint(0, 3, (c.batch, c.seq + 1), generator=g)
    seq = (base + ramp * 7 + noise) % c.vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor):
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None, help="mesh shape such as 4 or 2x2 (default: the world as one axis)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--solver", default=None)
    ap.add_argument("--memory-budget", type=int, default=None, help="bytes per device")
    ap.add_argument("--vocab", type=int, default=GPTConfig.vocab)
    ap.add_argument("--width", type=int, default=GPTConfig.width)
    ap.add_argument("--layers", type=int, default=GPTConfig.layers)
    ap.add_argument("--seq", type=int, default=GPTConfig.seq)
    ap.add_argument("--batch", type=int, default=GPTConfig.batch)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--no-reference", action="store_true", help="skip the single-device reference run")
    ap.add_argument("--backend", default=None, help="eager (default) | inductor | any torch.compile backend")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds against DDP (or eager)")
    a = ap.parse_args(argv)
    c = GPTConfig(vocab=a.vocab, width=a.width, layers=a.layers, seq=a.seq, batch=a.batch, dropout=a.dropout)
    from metadist_torch.harness import run_example

    return run_example(
        "gpt",
        lambda: build(c),
        lambda s: batch(c, s),
        train_step,
        steps=a.steps,
        mesh=a.mesh,
        solver=a.solver,
        memory_budget=a.memory_budget,
        reference=not a.no_reference,
        backend=a.backend,
        rounds=a.rounds,
    )


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(main())
