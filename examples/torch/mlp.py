"""An MLP classifier trained with one MetaDist line.

python examples/torch/mlp.py
torchrun --nproc_per_node=2 examples/torch/mlp.py [--mesh 2] [--optimizer sgd|adam|adamw]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPConfig:
    inputs: int = 64
    hidden: int = 256
    layers: int = 3
    classes: int = 10
    batch: int = 32
    optimizer: str = "adamw"  # sgd (momentum) | adam | adamw
    lr: float = 1e-2
    seed: int = 0


def build(c: MLPConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(c.seed)
    dims = [c.inputs] + [c.hidden] * c.layers
    mods: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        mods += [nn.Linear(a, b), nn.GELU()]
    model = nn.Sequential(*mods, nn.Linear(dims[-1], c.classes))
    weights = [p for p in model.parameters() if p.dim() == 2]
    biases = [p for p in model.parameters() if p.dim() == 1]
    groups = [{"params": weights}, {"params": biases, "lr": c.lr / 2}]  # two parameter groups
    if c.optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=c.lr, momentum=0.9, weight_decay=1e-4)
    elif c.optimizer == "adam":
        opt = torch.optim.Adam(groups, lr=c.lr)
    else:
        opt = torch.optim.AdamW(groups, lr=c.lr, weight_decay=0.01)
    return model, opt


def batch(c: MLPConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(c.batch, c.inputs, generator=g)
    y = (x[:, : c.classes].argmax(dim=1) + step) % c.classes
    return x, y


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--solver", default=None)
    ap.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw"])
    ap.add_argument("--hidden", type=int, default=MLPConfig.hidden)
    ap.add_argument("--batch", type=int, default=MLPConfig.batch)
    a = ap.parse_args(argv)
    c = MLPConfig(hidden=a.hidden, batch=a.batch, optimizer=a.optimizer)
    from metadist_torch.harness import run_example

    return run_example(
        "mlp", lambda: build(c), lambda s: batch(c, s), train_step, steps=a.steps, mesh=a.mesh, solver=a.solver
    )


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(main())
