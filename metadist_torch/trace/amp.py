"""float16 training with ``torch.amp.GradScaler`` inside one traced step.

``scaler.step(opt)`` skips the update when a gradient holds inf or NaN. For a
plain optimizer it decides that on the host (``found_inf.item()``), which one
whole-step graph cannot hold. Fused optimizers (``torch.optim.Adam/AdamW/SGD(...,
fused=True)``, ``_step_supports_amp_scaling``) take ``grad_scale`` and
``found_inf`` as tensors and skip the update on the device; that path is what
MetaDist traces, and :func:`check_scalers` says so when a step uses a scaler
with another optimizer.

The fused kernels and the scaler's kernels each take a list of tensors, so
while tracing they are replaced by the same arithmetic per tensor
(:func:`amp_decompositions`), in ops whose sharding rules discovery finds:

- ``_amp_foreach_non_finite_check_and_unscale_``: ``found_inf`` is 1 when
  ``any(not isfinite(g_i))`` for some gradient. The one step from floats to
  booleans is a predicate, which discovery verifies on draws holding inf and
  NaN in one device's piece only (``metadist_core.discovery.verify``, family
  ``nonfinite``); a rule that took each device's own answer for the whole
  (Replicate) fails there, so the planner combines the pieces' answers (an
  all-reduce max) and every device skips the same steps. (A partial sum whose
  finite pieces overflow only when added is the one case a piece cannot see.)
- ``_fused_adam(w)_`` / ``_fused_sgd_``: the kernels' formulas, then every
  updated value is ``where(found_inf > 0, old, new)`` (an exact skip);
  ``_foreach_add_`` / ``_foreach_sub_`` on the step counters per tensor.
- ``_amp_update_scale_``: back off on an overflow, grow after
  ``growth_interval`` clean steps, as the CPU and CUDA kernels do.

The scaler's ``_scale`` and ``_growth_tracker`` are state of the step (as an
optimizer's state is): :mod:`metadist_torch.trace.state` lists them and makes them
eagerly (:func:`init_scalers`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

aten = torch.ops.aten


class ScalerError(TypeError):
    """A GradScaler is used in a way one traced step cannot run."""


def is_grad_scaler(obj: Any) -> bool:
    """Is ``obj`` a ``torch.amp.GradScaler`` (the CUDA-namespace one included)?"""
    return isinstance(obj, torch.amp.GradScaler)


def init_scalers(scalers: Sequence[Any], device: torch.device) -> None:
    """Make each enabled scaler's lazy ``_scale`` / ``_growth_tracker`` now, on ``device`` (what its first
    ``scale()`` would do), so that they are state of the traced step."""
    for s in scalers:
        if s.is_enabled() and s._scale is None:
            s._lazy_init_scale_growth_tracker(device)


def check_scalers(scalers: Sequence[Any], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse an enabled scaler beside an optimizer that decides the skip on the host."""
    if not any(s.is_enabled() for s in scalers):
        return
    bad = [type(o).__name__ for o in optimizers if not getattr(o, "_step_supports_amp_scaling", False)]
    if bad:
        raise ScalerError(
            f"metadist: a torch.amp.GradScaler is passed to the step with {', '.join(bad)} "
            f"(not fused): GradScaler.step() then calls .item() on found_inf, a host sync that one traced step "
            f"cannot hold. Build the optimizer with fused=True (torch.optim.AdamW/Adam/SGD(..., fused=True)): "
            f"its step takes grad_scale and found_inf as tensors and skips the update on the device"
        )


# -- per-tensor decompositions of the list kernels (used while tracing) ---------------------------


def _skip(found_inf: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return new if found_inf is None else torch.where(found_inf > 0, old, new)


def _unscaled(grad: torch.Tensor, grad_scale: torch.Tensor | None, maximize: bool) -> torch.Tensor:
    g = grad if grad_scale is None else grad / grad_scale
    return -g if maximize else g


def _non_finite_check_and_unscale(
    grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    if not grads:
        return
    bad = None
    for g in grads:
        b = torch.logical_not(torch.isfinite(g)).any()
        bad = b if bad is None else torch.logical_or(bad, b)
        g.copy_(g * inv_scale)
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype)))


def _adam(decoupled: bool) -> Callable[..., None]:
    def fused(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        *,
        lr,
        beta1,
        beta2,
        weight_decay,
        eps,
        amsgrad,
        maximize,
        grad_scale=None,
        found_inf=None,
    ) -> None:
        for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
            g = _unscaled(g, grad_scale, maximize)
            p_new = p
            if weight_decay != 0:
                if decoupled:
                    p_new = p * (1 - lr * weight_decay)
                else:
                    g = g + p * weight_decay
            m_new = m * beta1 + g * (1 - beta1)
            v_new = v * beta2 + g * g * (1 - beta2)
            bc1 = 1 - torch.pow(beta1, step)
            bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
            if amsgrad:
                vmax = torch.maximum(max_exp_avg_sqs[i], v_new)
                max_exp_avg_sqs[i].copy_(_skip(found_inf, max_exp_avg_sqs[i], vmax))
                v_used = vmax
            else:
                v_used = v_new
            denom = torch.sqrt(v_used) / bc2_sqrt + eps
            p_new = p_new - (lr / bc1) * m_new / denom
            grads[i].copy_(_skip(found_inf, grads[i], g))
            m.copy_(_skip(found_inf, m, m_new))
            v.copy_(_skip(found_inf, v, v_new))
            p.copy_(_skip(found_inf, p, p_new))

    return fused


def _fused_sgd(
    params,
    grads,
    momentum_buffer_list,
    *,
    weight_decay,
    momentum,
    lr,
    dampening,
    nesterov,
    maximize,
    is_first_step,
    grad_scale=None,
    found_inf=None,
) -> None:
    for i, (p, g) in enumerate(zip(params, grads)):
        g = _unscaled(g, grad_scale, maximize)
        grads[i].copy_(_skip(found_inf, grads[i], g))
        if weight_decay != 0:
            g = g + p * weight_decay
        if momentum != 0:
            buf = momentum_buffer_list[i]
            b_new = g if is_first_step else buf * momentum + g * (1 - dampening)
            buf.copy_(_skip(found_inf, buf, b_new))
            g = g + b_new * momentum if nesterov else b_new
        p.copy_(_skip(found_inf, p, p - g * lr))


def _update_scale(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> torch.Tensor:
    found = found_inf > 0
    successful = growth_tracker + 1
    grow = successful == growth_interval
    grown = scale * growth_factor
    new_scale = torch.where(found, scale * backoff_factor, torch.where(grow & torch.isfinite(grown), grown, scale))
    new_tracker = torch.where(found | grow, torch.zeros_like(successful), successful)
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    return scale


def _foreach(op: Callable[..., torch.Tensor], list_arg: bool) -> Callable[..., None]:
    def each(tensors, other, **kw) -> None:
        for i, t in enumerate(tensors):
            t.copy_(op(t, other[i] if list_arg else other, **kw))

    return each


def amp_decompositions() -> dict:
    """``{OpOverload: per-tensor function}`` for make_fx: the fused optimizers and the scaler's kernels."""
    table: dict = {
        aten._amp_foreach_non_finite_check_and_unscale_.default: _non_finite_check_and_unscale,
        aten._amp_update_scale_.default: _update_scale,
        aten._foreach_add_.Scalar: _foreach(torch.add, False),
        aten._foreach_add_.List: _foreach(torch.add, True),
        aten._foreach_sub_.Scalar: _foreach(torch.sub, False),
        aten._foreach_sub_.List: _foreach(torch.sub, True),
    }
    for packet, fn in (
        (aten._fused_adamw_, _adam(True)),
        (aten._fused_adam_, _adam(False)),
        (aten._fused_sgd_, _fused_sgd),
    ):
        table[packet.default] = fn
        table[packet.tensor_lr] = fn
    return table


__all__ = ["ScalerError", "amp_decompositions", "check_scalers", "init_scalers", "is_grad_scaler"]
