"""A compiled step against the single-device step: loss, parameters and optimizer state after the same batches."""

from __future__ import annotations

from typing import Any, Callable, Sequence


def compare_steps(
    name: str,
    build: Callable[[], tuple[Any, Any]],
    batches: Sequence[tuple],
    step_fn: Callable[..., Any],
    compiled_fn: Callable[..., Any],
    errors: list[str],
    rtol: float = 1e-4,
    state_rtol: float | None = None,
) -> None:
    """Run ``step_fn`` on one model and ``compiled_fn`` on another, both from ``build()``, over ``batches``;
    append to ``errors`` each loss off by more than ``rtol`` (relative, at least 1 absolute) and each parameter
    or optimizer state off by more than ``state_rtol`` (default ``rtol``) relative to its largest element."""
    import torch

    tol = rtol if state_rtol is None else state_rtol
    model_ref, opt_ref = build()
    model, opt = build()
    ref = [float(step_fn(model_ref, opt_ref, *b)) for b in batches]
    got = [float(compiled_fn(model, opt, *b)) for b in batches]
    for i, (a, b) in enumerate(zip(ref, got)):
        if abs(a - b) > rtol * max(1.0, abs(a)):
            errors.append(f"{name}: loss of step {i}: {b} vs single-device {a}")

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()

    def close(a, b):
        return torch.allclose(full(a), b.double(), rtol=tol, atol=tol * max(1e-3, b.abs().max().item()))

    for (k, v), w in zip(model_ref.state_dict().items(), model.state_dict().values()):
        if not close(w, v):
            errors.append(f"{name}: {k} differs by {(full(w) - v.double()).abs().max().item():.3g}")
    ref_params = [p for g in opt_ref.param_groups for p in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for pr, p in zip(ref_params, params):
        for k, a in opt_ref.state[pr].items():
            if isinstance(a, torch.Tensor) and not close(opt.state[p][k], a):
                errors.append(f"{name}: optimizer state {k} differs")
