"""Training loops as users write them, run eagerly and through a compiled step, for tests to compare.

Each :class:`Loop` builds a small model and optimizer the same way each time and
runs a few steps, changing between calls what real loops change: a learning-rate
schedule, a weight decay, a frozen layer, a param group, train/eval, a Python
flag, gradients accumulated over calls. :func:`run_both` runs it with the plain
step and with ``metadist_compile(**kw)`` and returns what differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, CLASSES, BATCH = 16, 8, 16


def build_model(dropout: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, CLASSES)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, (x[:, :CLASSES].argmax(dim=1) + step) % CLASSES


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def clipped_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss


def flag_step(model, opt, x, y, smooth):
    loss = F.cross_entropy(model(x), y, label_smoothing=0.1) if smooth else F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def backward_step(model, x, y):
    loss = F.cross_entropy(model(x), y) / 4
    loss.backward()
    return loss


def eval_step(model, x, y):
    with torch.no_grad():
        return F.cross_entropy(model(x), y)


@dataclass
class Loop:
    """A user's loop: ``run(call, model, opt)`` makes the calls (``call(fn, *args)`` runs one step, plain or
    compiled) and returns the losses; ``replans``: what the changes need (None: not checked)."""

    name: str
    make: Callable[[nn.Module], torch.optim.Optimizer]
    run: Callable[[Callable, nn.Module, torch.optim.Optimizer], list[float]]
    replans: int | None = 0
    dropout: float = 0.0
    steps: list[Callable] = field(default_factory=lambda: [train_step])


def _adamw(model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=kw.pop("lr", 1e-2), **kw)


def _warmup_cosine(call, model, opt):
    total, warm = 7, 2
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm)))
    )
    out = []
    for s in range(total):
        out.append(call(clipped_step, model, opt, *batch(s)))
        sched.step()
    return out


def _onecycle(call, model, opt):
    max_lr = 0.05 if isinstance(opt, torch.optim.SGD) else 0.01
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=7, cycle_momentum=True)
    out = []
    for s in range(7):
        out.append(call(train_step, model, opt, *batch(s)))
        sched.step()
    return out


def _plateau(call, model, opt):
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
    out = []
    for s in range(6):
        out.append(call(train_step, model, opt, *batch(s)))
        sched.step(out[-1])
    return out


def _by_hand(call, model, opt):
    out = []
    for s, lr in enumerate([1e-2, 0.0, 0.0, 2e-2, 5e-3, 1e-2]):
        for g in opt.param_groups:
            g["lr"] = lr
        out.append(call(train_step, model, opt, *batch(s)))
    return out


def _weight_decay(call, model, opt):
    out = []
    for s, wd in enumerate([0.01, 0.1, 0.1, 0.0, 0.05, 0.05]):
        opt.param_groups[0]["weight_decay"] = wd
        out.append(call(train_step, model, opt, *batch(s)))
    return out


def _freeze(call, model, opt):
    out = []
    for s in range(6):
        if s == 2:
            model[0].requires_grad_(False)
        if s == 4:
            model[0].requires_grad_(True)
        out.append(call(train_step, model, opt, *batch(s)))
    return out


def _add_group(call, model, opt):
    """Progressive unfreezing: the head trains from step 2 on, in a param group of its own."""
    model[5].requires_grad_(False)
    out = []
    for s in range(6):
        if s == 2:
            model[5].requires_grad_(True)
            opt.add_param_group({"params": list(model[5].parameters()), "lr": 5e-3})
        out.append(call(train_step, model, opt, *batch(s)))
    return out


def _train_eval(call, model, opt):
    out = []
    for s in range(6):
        if s in (2, 3):
            model.eval()
            out.append(call(eval_step, model, *batch(s)))
            model.train()
        out.append(call(train_step, model, opt, *batch(s)))
    return out


def _flag(call, model, opt):
    return [call(flag_step, model, opt, *batch(s), s % 3 == 1) for s in range(6)]


def _accumulate(call, model, opt):
    out = []
    for s in range(8):
        out.append(call(backward_step, model, *batch(s)))
        if s % 4 == 3:
            opt.step()
            opt.zero_grad()
    return out


LOOPS = {
    "warmup_cosine": Loop(
        "warmup_cosine", lambda m: _adamw(m, weight_decay=0.01), _warmup_cosine, steps=[clipped_step]
    ),
    "onecycle_sgd": Loop(
        "onecycle_sgd", lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True), _onecycle
    ),
    "onecycle_adamw": Loop("onecycle_adamw", lambda m: _adamw(m), _onecycle),
    "plateau": Loop("plateau", lambda m: _adamw(m), _plateau),
    "lr_by_hand": Loop("lr_by_hand", lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9), _by_hand),
    # 0.0 is a branch of AdamW (no decay step): 0.1 -> 0.0 re-plans; 0.0 -> 0.05 runs the first program again
    "weight_decay": Loop("weight_decay", lambda m: _adamw(m, weight_decay=0.01), _weight_decay, replans=1),
    # frozen: one re-plan; unfrozen: another, since the frozen layer's step counters fell behind the others'
    # (the first program read them all as one)
    "freeze": Loop("freeze", lambda m: _adamw(m), _freeze, replans=2),
    "add_param_group": Loop(
        "add_param_group",
        lambda m: torch.optim.AdamW([p for mod in list(m)[:5] for p in mod.parameters()], lr=1e-2),
        _add_group,
        replans=1,
    ),
    "train_eval": Loop("train_eval", lambda m: _adamw(m), _train_eval, dropout=0.25, steps=[train_step, eval_step]),
    "python_flag": Loop("python_flag", lambda m: _adamw(m), _flag, steps=[flag_step]),
    # .grad appears after the first call: one re-plan; zero_grad() clears it: the first program again
    "accumulate": Loop("accumulate", lambda m: _adamw(m), _accumulate, replans=1, steps=[backward_step]),
}


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor's whole value on the CPU (a DTensor's gathered)."""
    f = getattr(t, "full_tensor", None)
    return (f() if f is not None else t).detach().cpu()


def run_both(loop: Loop, rtol: float, **compile_kw: Any) -> tuple[list[str], dict]:
    """Run ``loop`` eagerly and compiled; the differences (empty: none) and what the compiled steps did."""
    from metadist_torch import metadist_compile

    torch.manual_seed(1234)
    ref_model = build_model(loop.dropout)
    ref_opt = loop.make(ref_model)
    ref = [float(x) for x in loop.run(lambda fn, *a: fn(*a), ref_model, ref_opt)]

    torch.manual_seed(1234)
    model = build_model(loop.dropout)
    opt = loop.make(model)
    compiled = {fn: metadist_compile(**compile_kw)(fn) for fn in loop.steps}
    got = [float(x) for x in loop.run(lambda fn, *a: compiled[fn](*a), model, opt)]

    errors: list[str] = []
    for i, (a, b) in enumerate(zip(got, ref)):
        if not math.isclose(a, b, rel_tol=rtol):
            errors.append(f"{loop.name}: loss {i}: compiled {a!r}, eager {b!r}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if not close(full(p), q.detach(), rtol):
            errors.append(f"{loop.name}: parameter {name} differs by {(full(p) - q).abs().max().item():.3g}")
        if (p.grad is None) != (q.grad is None) or (q.grad is not None and not close(full(p.grad), q.grad, rtol)):
            errors.append(f"{loop.name}: {name}.grad differs")
    for p, q in zip(_group_params(opt), _group_params(ref_opt)):
        st, rst = opt.state.get(p, {}), ref_opt.state.get(q, {})
        for k, v in rst.items():  # MetaDist makes every parameter's state before its first step: eager's subset
            if isinstance(v, torch.Tensor) and not close(full(st[k]).to(v.dtype), v, rtol):
                errors.append(f"{loop.name}: optimizer state {k} differs")
    for g, rg in zip(opt.param_groups, ref_opt.param_groups):
        for k in rg:
            if k != "params" and g[k] != rg[k]:
                errors.append(f"{loop.name}: param group {k}: {g[k]!r} against {rg[k]!r}")
    train = compiled[loop.steps[0]]
    info = {
        "replans": train.replans,
        "reasons": list(train.replan_reasons),
        "signatures": len(train.cache),
        "programs": sum(len(v) for v in train.cache.values()),
    }
    if loop.replans is not None and train.replans != loop.replans:
        errors.append(f"{loop.name}: {train.replans} re-plans ({train.replan_reasons}), expected {loop.replans}")
    return errors, info


def close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    """Equal to ``rtol`` of the tensor's scale: |a - b| <= rtol * max|b| everywhere (an element near zero is
    held to the same absolute bound as the rest of its tensor)."""
    return (
        a.shape == b.shape and bool((a - b).abs().max() <= rtol * max(float(b.abs().max()), 1e-12))
        if b.numel()
        else a.shape == b.shape
    )


def _group_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


__all__ = ["LOOPS", "Loop", "run_both", "build_model", "batch", "train_step", "full"]
