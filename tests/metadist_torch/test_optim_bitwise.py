"""At world size 1 the compiled step is eager torch's step bit for bit: SGD, Adam and AdamW (their default
single-tensor path and foreach=True) over several steps with a learning-rate schedule, every loss, parameter
and optimizer-state tensor compared with torch.equal.
"""

from __future__ import annotations

import warnings
from typing import Callable

import pytest

torch = pytest.importorskip("torch")

from metadist_torch import metadist_compile  # noqa: E402

STEPS = 6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the machines running tests are small and shared
    yield
    torch.set_num_threads(n)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS)]


def train_step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


OPTIMIZERS: dict[str, Callable] = {
    "sgd_momentum_wd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, **kw),
    "sgd_nesterov": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, **kw),
    "sgd_plain": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, **kw),
    "adam_wd": lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01, **kw),
    "adam_amsgrad": lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, amsgrad=True, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.95), **kw),
    "adamw_amsgrad": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, **kw),
}

SCHEDULES: dict[str, Callable] = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
}


def _run(step: Callable, name: str, schedule: str, **kw):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters(), **kw)
    sched = SCHEDULES[schedule](opt)
    losses = []
    for x, y in _batches():
        losses.append(step(model, opt, x, y).detach())
        sched.step()
    return losses, model, opt


def _assert_bitwise(name: str, schedule: str, **kw) -> None:
    step = metadist_compile()(train_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_losses, ref_model, ref_opt = _run(train_step, name, schedule, **kw)
        losses, model, opt = _run(step, name, schedule, **kw)
    assert step.replans == 0 and len(step.cache) == 1, "a new learning rate is an input, never a new program"
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"loss of step {i}: {b.item()!r} vs eager {a.item()!r}"
    for (k, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{k} differs from eager by {(a - b).abs().max().item():.3g}"
    ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, (pr, p) in enumerate(zip(ref_params, params)):
        sr, s = ref_opt.state[pr], opt.state[p]
        assert set(sr) == set(s), f"state[{i}] holds {sorted(s)}, eager {sorted(sr)}"
        for k, a in sr.items():
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, s[k]), f"state[{i}][{k}] differs from eager by {(a - s[k]).abs().max():.3g}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_default_path_is_eager_bit_for_bit(name):
    _assert_bitwise(name, "lambda")


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adam_wd", "adamw"])
def test_step_lr_is_eager_bit_for_bit(name):
    _assert_bitwise(name, "step")


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adam_wd", "adamw", "adamw_amsgrad"])
def test_foreach_is_eager_bit_for_bit(name):
    _assert_bitwise(name, "lambda", foreach=True)


def test_a_branch_on_the_step_counter_traces_the_capturable_path():
    """RAdam's own path branches on its step counter's value; its capturable path (float32 tensor ops, close
    to eager, not bit for bit) is traced instead."""
    OPTIMIZERS["radam"] = lambda ps, **kw: torch.optim.RAdam(ps, lr=0.01, **kw)
    try:
        step = metadist_compile()(train_step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_losses, ref_model, _ = _run(train_step, "radam", "lambda")
            losses, model, _ = _run(step, "radam", "lambda")
    finally:
        del OPTIMIZERS["radam"]
    assert step.replans == 0
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
