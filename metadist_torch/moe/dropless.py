"""A mixture-of-experts layer as one op with static boundary shapes: ``metadist::moe_dropless`` and its backward.

``moe_dropless(x [T, H], idx [T, k], w [T, k], gate_up [E, 2F, H], down [E, H, F], act) -> [T, H]``: every
token through the ``k`` experts ``idx`` names (a gated feed-forward without biases,
``down(act(gate(x)) * up(x))``), the results summed with the routing weights ``w``. No token is dropped and
no tensor of ``T x E`` or more is made: the (token, expert) pairs are sorted by expert and each expert runs
once on its contiguous rows. How many rows each expert gets is data, inside the op; its outputs' shapes are
its inputs'.

The computation is written as three steps so that the same code runs on one device, on simulated ranks
and on real ones (:mod:`metadist_torch.ops.ep_dispatch`): :func:`dispatch` (a rank sorts its pairs by
expert: the rows it sends each rank, and its per-expert counts), :func:`run_experts` (a rank runs its
experts on the rows it received, from every rank) and :func:`combine` (a rank puts the rows it got back in
its pairs' order and sums each token's). On one device the exchanges between them are the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .experts_ffn import expert_backward, expert_forward

Tensor = torch.Tensor


@dataclass
class Dispatched:
    """One rank's pairs sorted by expert: ``order`` (pair indices, ``token * k + choice``), the rows to send
    (in that order, so grouped by the rank owning each expert), and ``counts [E]`` (pairs per expert)."""

    order: Tensor
    rows: Tensor
    counts: Tensor

    def send_splits(self, n: int) -> list[int]:
        """Rows sent to each of ``n`` ranks (rank r owns experts ``[r*E/n, (r+1)*E/n)``)."""
        return [int(c) for c in self.counts.reshape(n, -1).sum(1).tolist()]


def dispatch(rows_of_tokens: Tensor, idx: Tensor, num_experts: int) -> Dispatched:
    """Sort a rank's (token, expert) pairs by expert. ``rows_of_tokens [T, D]``: what each pair carries of its
    token (the token's row; in the backward, with its output gradient and weight beside it)."""
    order, counts = _sorted_pairs(idx, num_experts)
    k = idx.shape[-1] if idx.dim() > 1 else 1
    return Dispatched(order, rows_of_tokens[order // k], counts)


def _sorted_pairs(idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """The pairs (``token * k + choice``) in expert order, and how many each expert has."""
    flat = idx.reshape(-1).to(torch.int64)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def group_permutation(recv_counts: Tensor) -> list[int]:
    """Received rows (from rank s, by expert within s) reordered by local expert, then source rank.
    ``recv_counts [n, E_local]``: how many rows rank s sent for each local expert."""
    counts = recv_counts.tolist()
    n, el = len(counts), len(counts[0]) if counts else 0
    start, starts = 0, []
    for s in range(n):
        row = []
        for e in range(el):
            row.append(start)
            start += int(counts[s][e])
        starts.append(row)
    perm: list[int] = []
    for e in range(el):
        for s in range(n):
            perm.extend(range(starts[s][e], starts[s][e] + int(counts[s][e])))
    return perm


def _by_expert(recv: Tensor, recv_counts: Tensor) -> tuple[Tensor, Tensor, list[tuple[int, int, int]]]:
    """The received rows grouped by local expert: the permutation, the grouped rows, and (expert, first row,
    end row) of each expert that has rows."""
    perm = torch.tensor(group_permutation(recv_counts), dtype=torch.int64, device=recv.device)
    ranges, lo = [], 0
    for e, c in enumerate(int(c) for c in recv_counts.sum(0).tolist()):
        if c:
            ranges.append((e, lo, lo + c))
        lo += c
    return perm, recv[perm], ranges


def _received_order(perm: Tensor, grouped: Tensor) -> Tensor:
    """Rows grouped by expert put back in the order they were received."""
    out = torch.empty_like(grouped)
    out[perm] = grouped
    return out


def run_experts(recv: Tensor, recv_counts: Tensor, gate_up: Tensor, down: Tensor, act: str) -> Tensor:
    """The local experts (``gate_up``/``down`` hold ``E_local`` of them) on the rows a rank received: each
    expert once, on its rows from every rank; the results in the rows' received order."""
    perm, grouped, ranges = _by_expert(recv, recv_counts)
    y = recv.new_empty((recv.shape[0], down.shape[1]))
    for e, lo, hi in ranges:
        y[lo:hi] = expert_forward(grouped[lo:hi], gate_up[e], down[e], act)
    return _received_order(perm, y)


def run_experts_backward(
    recv: Tensor, recv_counts: Tensor, gate_up: Tensor, down: Tensor, act: str
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward at the experts. ``recv [rows, 2H + 1]``: each pair's token row, its output gradient and
    its routing weight. Returns rows ``[rows, H + 1]`` (the token row's gradient and the weight's), in the
    received order, and the local experts' weight gradients."""
    h = down.shape[1]
    perm, grouped, ranges = _by_expert(recv, recv_counts)
    res = recv.new_empty((recv.shape[0], h + 1))
    g_gate_up, g_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    for e, lo, hi in ranges:
        xe, ge, we = grouped[lo:hi, :h], grouped[lo:hi, h : 2 * h], grouped[lo:hi, 2 * h :]
        y = expert_forward(xe, gate_up[e], down[e], act)
        dx, g_gate_up[e], g_down[e] = expert_backward(ge * we, xe, gate_up[e], down[e], act)
        res[lo:hi, :h] = dx
        res[lo:hi, h:] = (ge * y).sum(-1, keepdim=True)
    return _received_order(perm, res), g_gate_up, g_down


def combine(returned: Tensor, order: Tensor, tokens: int, k: int) -> Tensor:
    """Rows returned in the sorted pairs' order, put back in pair order: ``[T, k, D]``."""
    pairs = torch.empty_like(returned)
    pairs[order] = returned
    return pairs.reshape(tokens, k, -1)


def weighted_sum(pairs: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """Each token's expert outputs ``pairs [T, k, H]`` summed with its routing weights ``w [T, k]``."""
    acc = torch.promote_types(pairs.dtype, w.dtype)
    return (pairs.to(acc) * w.to(acc).unsqueeze(-1)).sum(1).to(dtype)


def backward_rows(grad: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """Per token, what the backward sends with each of its pairs: ``[x, grad]`` and, per choice, its weight
    (``[T * k, 2H + 1]`` in pair order), at a dtype holding all three."""
    dt = torch.promote_types(torch.promote_types(x.dtype, grad.dtype), w.dtype)
    k = w.shape[1]
    tok = torch.cat([x.to(dt), grad.to(dt)], -1).repeat_interleave(k, 0)
    return torch.cat([tok, w.reshape(-1, 1).to(dt)], -1)


def dispatch_pairs(pair_rows: Tensor, idx: Tensor, num_experts: int) -> Dispatched:
    """:func:`dispatch` for rows already one per pair (``[T * k, D]`` in pair order)."""
    order, counts = _sorted_pairs(idx, num_experts)
    return Dispatched(order, pair_rows[order], counts)


def backward_results(back: Tensor, order: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """The input's and the routing weights' gradients from the rows returned ``[T * k, H + 1]`` (sorted)."""
    t, k = w.shape
    pairs = combine(back, order, t, k)
    return pairs[..., :-1].sum(1).to(x.dtype), pairs[..., -1].to(w.dtype)


@torch.library.custom_op("metadist::moe_dropless", mutates_args=())
def moe_dropless(x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str) -> Tensor:
    """The layer on one device (the module docstring)."""
    d = dispatch(x, idx, gate_up.shape[0])
    y = run_experts(d.rows, d.counts.reshape(1, -1), gate_up, down, act)
    return weighted_sum(combine(y, d.order, *idx.shape), w, x.dtype)


@moe_dropless.register_fake
def _moe_dropless_fake(x, idx, w, gate_up, down, act):
    return x.new_empty((x.shape[0], down.shape[1]))


@torch.library.custom_op("metadist::moe_dropless_backward", mutates_args=())
def moe_dropless_backward(
    grad: Tensor, x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`moe_dropless` for ``x``, ``w``, ``gate_up`` and ``down`` (experts recomputed)."""
    d = dispatch_pairs(backward_rows(grad, x, w), idx, gate_up.shape[0])
    back, g_gate_up, g_down = run_experts_backward(d.rows, d.counts.reshape(1, -1), gate_up, down, act)
    gx, gw = backward_results(back, d.order, x, w)
    return gx, gw, g_gate_up, g_down


@moe_dropless_backward.register_fake
def _moe_dropless_backward_fake(grad, x, idx, w, gate_up, down, act):
    return torch.empty_like(x), torch.empty_like(w), torch.empty_like(gate_up), torch.empty_like(down)


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, idx, w, gate_up, down, act = inputs
    ctx.save_for_backward(x, idx, w, gate_up, down)
    ctx.act = act


def _backward(ctx: Any, grad: Tensor) -> tuple:
    x, idx, w, gate_up, down = ctx.saved_tensors
    gx, gw, g_gate_up, g_down = torch.ops.metadist.moe_dropless_backward(grad, x, idx, w, gate_up, down, ctx.act)
    return gx, None, gw, g_gate_up, g_down, None


moe_dropless.register_autograd(_backward, setup_context=_setup)


def dropless_flops(x_shape: tuple[int, ...], idx_shape: tuple[int, ...], gate_up_shape: tuple[int, ...]) -> int:
    """FLOPs of the forward's expert matmuls: ``T * k`` rows through ``H -> 2F`` and ``F -> H``."""
    pairs = idx_shape[0] * (idx_shape[1] if len(idx_shape) > 1 else 1)
    two_f, h = gate_up_shape[-2], gate_up_shape[-1]
    return int(2 * pairs * h * (two_f + two_f // 2))


__all__ = [
    "Dispatched",
    "backward_results",
    "backward_rows",
    "combine",
    "dispatch",
    "dispatch_pairs",
    "dropless_flops",
    "group_permutation",
    "moe_dropless",
    "moe_dropless_backward",
    "run_experts",
    "run_experts_backward",
    "weighted_sum",
]
