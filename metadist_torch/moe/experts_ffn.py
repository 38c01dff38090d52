"""The experts' feed-forward over the filled slots only: ``metadist::experts_ffn`` and its backward.

The capacity-padded dispatch (:mod:`metadist_torch.moe.moe`) hands the experts
``x [*G, E, C, H]``: per group and expert ``C`` slots, of which the first
``counts[g, e]`` hold tokens (slots fill in order) and the rest are zero. Run as
batched matmuls, the experts would work on every slot, ``E / top_k`` times the
routed tokens when no token may be dropped. This op reads ``counts`` and runs
each expert once on its filled rows of every group; the empty slots' outputs
are zero (the combine gives them weight 0, so the step's numbers are those of
the padded matmuls). Its shapes are static, so ShardCombine discovers its rules
by running it on pieces as any other op's: split by group (``x``, ``counts``)
or by expert (``x``, ``counts`` and both weights).

A gated feed-forward without biases, ``down(act(gate(x)) * up(x))`` with
``gate_up [E, 2F, H]`` and ``down [E, H, F]``, as Mixtral's and Qwen-MoE's
experts are. ``fill`` is the share of slots the planner may expect filled; it
prices the op and does not change what it computes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# each activation's backward (grad, input) -> grad of the input, as aten computes it (no autograd inside an op)
_BACKWARDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": torch.ops.aten.silu_backward,
    "swish": torch.ops.aten.silu_backward,
    "gelu": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="none"),
    "gelu_pytorch_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "relu": lambda g, x: torch.ops.aten.threshold_backward(g, F.relu(x), 0),
}


def _filled(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """``x`` as ``[groups, E, C, H]`` and, per group and expert, how many of its first slots hold tokens."""
    e, c, h = x.shape[-3:]
    n = counts.reshape(-1, e).round().clamp(0, c).to(torch.int64).tolist()
    return x.reshape(-1, e, c, h), n


def expert_forward(xe: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One expert's gated feed-forward ``down(act(gate(xe)) * up(xe))`` on its rows ``xe``."""
    gate, up = F.linear(xe, gate_up.to(xe.dtype)).chunk(2, dim=-1)
    return F.linear(ACTIVATIONS[act](gate) * up, down.to(xe.dtype))


@torch.library.custom_op("metadist::experts_ffn", mutates_args=())
def experts_ffn(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str, fill: float
) -> torch.Tensor:
    """``x [*G, E, C, H]`` through each expert, on the first ``counts [*G, E]`` slots of each group."""
    xf, n = _filled(x, counts)
    out = x.new_zeros(xf.shape[:-1] + (down.shape[1],))
    for e in range(xf.shape[1]):
        rows = [(g, n[g][e]) for g in range(xf.shape[0]) if n[g][e] > 0]
        if not rows:
            continue
        ye = expert_forward(torch.cat([xf[g, e, :k] for g, k in rows]), gate_up[e], down[e], act)
        start = 0
        for g, k in rows:
            out[g, e, :k] = ye[start : start + k]
            start += k
    return out.reshape(x.shape[:-1] + (down.shape[1],))


@experts_ffn.register_fake
def _experts_ffn_fake(x, counts, gate_up, down, act, fill):
    return x.new_empty(x.shape[:-1] + (down.shape[1],))


def expert_backward(
    dy: torch.Tensor, xe: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's gradients for its rows ``xe``, its ``gate_up`` and ``down``, from ``dy``."""
    w1, w2 = gate_up.to(xe.dtype), down.to(xe.dtype)
    gate, up = F.linear(xe, w1).chunk(2, dim=-1)
    s = ACTIVATIONS[act](gate)
    d_down = dy.t() @ (s * up)
    dm = dy @ w2
    da = torch.cat([_BACKWARDS[act](dm * up, gate), dm * s], dim=-1)
    return da @ w1, (da.t() @ xe).to(gate_up.dtype), d_down.to(down.dtype)


@torch.library.custom_op("metadist::experts_ffn_backward", mutates_args=())
def experts_ffn_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    fill: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`experts_ffn` for ``x``, ``gate_up`` and ``down`` (each expert recomputed)."""
    xf, n = _filled(x, counts)
    gf = grad.reshape(xf.shape[:-1] + (grad.shape[-1],))
    gx = torch.zeros_like(xf)
    g_gate_up, g_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    for e in range(xf.shape[1]):
        rows = [(g, n[g][e]) for g in range(xf.shape[0]) if n[g][e] > 0]
        if not rows:
            continue
        xe = torch.cat([xf[g, e, :k] for g, k in rows])
        dx, g_gate_up[e], g_down[e] = expert_backward(
            torch.cat([gf[g, e, :k] for g, k in rows]), xe, gate_up[e], down[e], act
        )
        start = 0
        for g, k in rows:
            gx[g, e, :k] = dx[start : start + k]
            start += k
    return gx.reshape(x.shape), g_gate_up, g_down


@experts_ffn_backward.register_fake
def _experts_ffn_backward_fake(grad, x, counts, gate_up, down, act, fill):
    return torch.empty_like(x), torch.empty_like(gate_up), torch.empty_like(down)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, counts, gate_up, down, act, fill = inputs
    ctx.save_for_backward(x, counts, gate_up, down)
    ctx.act, ctx.fill = act, fill


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, counts, gate_up, down = ctx.saved_tensors
    gx, g_gate_up, g_down = torch.ops.metadist.experts_ffn_backward(grad, x, counts, gate_up, down, ctx.act, ctx.fill)
    return gx, None, g_gate_up, g_down, None, None


experts_ffn.register_autograd(_backward, setup_context=_setup)


def ffn_flops(x_shape: tuple[int, ...], gate_up_shape: tuple[int, ...], fill: float, backward: bool) -> int:
    """FLOPs of :func:`experts_ffn` (twice that for its backward) with ``fill`` of the slots holding tokens."""
    rows = 1
    for s in x_shape[:-1]:
        rows *= s
    two_f, h = gate_up_shape[-2], gate_up_shape[-1]
    flops = 2 * rows * h * (two_f + two_f // 2) * max(0.0, min(1.0, fill))
    return int(flops * (2 if backward else 1))


def plain_gated(module: torch.nn.Module) -> str | None:
    """The activation's name when ``module``'s experts are the gated feed-forward this op runs (no biases, not
    transposed, the default gate, no post-expert norm), else None."""
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    gate = getattr(type(module), "_apply_gate", None)
    if (
        act in ACTIVATIONS
        and getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and not getattr(module, "has_post_expert_norm", False)
        and getattr(module, "is_concatenated", True)
        and getattr(gate, "__name__", "") == "_default_apply_gate"
    ):
        return act
    return None


__all__ = [
    "ACTIVATIONS",
    "expert_backward",
    "expert_forward",
    "experts_ffn",
    "experts_ffn_backward",
    "ffn_flops",
    "plain_gated",
]
