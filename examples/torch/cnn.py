"""A small CNN (conv, BatchNorm, pooling) trained with one MetaDist line; BatchNorm's running
statistics are buffers that the compiled step updates like the eager one.

    python examples/torch/cnn.py
    torchrun --nproc_per_node=2 examples/torch/cnn.py [--mesh 2]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class CNNConfig:
    channels: int = 16
    image: int = 16
    classes: int = 10
    batch: int = 16
    lr: float = 0.05
    seed: int = 0


class CNN(nn.Module):
    def __init__(self, c: CNNConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c.channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c.channels)
        self.conv2 = nn.Conv2d(c.channels, 2 * c.channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * c.channels)
        self.fc = nn.Linear(2 * c.channels, c.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def build(c: CNNConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(c.seed)
    model = CNN(c)
    return model, torch.optim.SGD(model.parameters(), lr=c.lr, momentum=0.9)


def batch(c: CNNConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(c.batch, 3, c.image, c.image, generator=g)
    y = (x.mean(dim=(2, 3)).argmax(dim=1) * 3 + step) % c.classes
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
    a = ap.parse_args(argv)
    c = CNNConfig()
    from metadist_torch.harness import run_example

    return run_example(
        "cnn", lambda: build(c), lambda s: batch(c, s), train_step, steps=a.steps, mesh=a.mesh, solver=a.solver
    )


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(main())
