"""Causal attention split along the sequence (context parallelism) for torch: the per-rank math, its
simulation (all ranks in one process, the all-gather a concatenation) and its lowering (one rank, torch's
functional collectives), attached to the core's records (:mod:`metadist_core.discovery.cp_attention`).

Every rank holds its queries, keys and values split on the sequence (dim 2), in the layout's order. It
all-gathers K and V (their own heads only: grouped-query attention gathers the few K/V heads), puts them
in sequence order, and for each of its query chunks (sequence chunk i, of c positions) attends to keys
[0, i*c) without a mask and to keys [i*c, (i+1)*c) with a causal one (a square diagonal block, so the
kernel's alignment of a causal mask never matters), merging the two by log-sum-exp in at least float32:
``out -= sigmoid(lse_b - lse) * (out - out_b); lse -= logsigmoid(lse - lse_b)``.

The backward is written by hand, not by autograd (the kernels' log-sum-exp output carries no gradient):
each block's kernel backward takes the merged output and log-sum-exp, which makes its dQ, dK, dV the
block's exact share; dQ is summed over blocks, dK/dV over blocks and then over ranks (a reduce-scatter).

A kernel backend is a pair of functions (:class:`AttentionBackend`); the CPU flash kernel, which returns
a log-sum-exp, is the one here. A CUDA flash or efficient-attention backend slots in as another pair.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from metadist_core.discovery import cp_attention as core
from metadist_core.discovery.distimpl import DistImplRegistry, SeqLayout

Tensor = torch.Tensor
FRONTEND = "torch"


class UnsupportedAttention(ValueError):
    """An attention call context parallelism does not implement (a mask, dropout, bidirectional, a bad size)."""


@dataclass(frozen=True)
class AttentionBackend:
    """``forward(q, k, v, causal, scale) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, causal, scale)
    -> (dq, dk, dv)`` on (batch, heads, sequence, head dim) tensors; k/v may have fewer heads (a divisor)."""

    name: str
    forward: Callable[[Tensor, Tensor, Tensor, bool, float | None], tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dq, dk, dv = op(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, dk, dv


CPU_FLASH = AttentionBackend("cpu_flash", _cpu_forward, _cpu_backward)
BACKENDS = {CPU_FLASH.name: CPU_FLASH}


# -- the per-rank math ------------------------------------------------------------


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions over disjoint keys merged: weights exp(lse_b) / (exp(lse) + exp(lse_b))."""
    out = out - torch.sigmoid(lse_b - lse).unsqueeze(-1) * (out - out_b)
    lse = lse - F.logsigmoid(lse - lse_b)
    return out, lse


def _blocks(i: int, c: int) -> list[tuple[int, int, bool]]:
    """The key ranges query chunk ``i`` sees: [0, i*c) whole, then its own chunk causally."""
    return ([(0, i * c, False)] if i else []) + [(i * c, (i + 1) * c, True)]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rank_forward(
    q: Tensor, k_all: Tensor, v_all: Tensor, chunks: Sequence[int], scale: float | None, backend: AttentionBackend
) -> tuple[Tensor, Tensor]:
    """One rank's output and log-sum-exp: local queries (``chunks``, in order) against K/V in sequence order."""
    c = q.shape[2] // len(chunks)
    acc = _acc(q.dtype)
    outs, lses = [], []
    for j, i in enumerate(chunks):
        qi = q[:, :, j * c : (j + 1) * c]
        out: Tensor | None = None
        lse: Tensor | None = None
        for lo, hi, causal in _blocks(i, c):
            o_b, l_b = backend.forward(qi, k_all[:, :, lo:hi], v_all[:, :, lo:hi], causal, scale)
            o_b, l_b = o_b.to(acc), l_b.to(acc)
            out, lse = (o_b, l_b) if out is None or lse is None else _merge(out, lse, o_b, l_b)
        assert out is not None and lse is not None
        outs.append(out.to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def rank_backward(
    dout: Tensor,
    q: Tensor,
    k_all: Tensor,
    v_all: Tensor,
    out: Tensor,
    lse: Tensor,
    chunks: Sequence[int],
    scale: float | None,
    backend: AttentionBackend,
) -> tuple[Tensor, Tensor, Tensor]:
    """One rank's dQ, and its contributions to dK and dV over the whole sequence (in sequence order)."""
    c = q.shape[2] // len(chunks)
    acc = _acc(q.dtype)
    dk_all = torch.zeros(k_all.shape, dtype=acc, device=k_all.device)
    dv_all = torch.zeros(v_all.shape, dtype=acc, device=v_all.device)
    dqs = []
    for j, i in enumerate(chunks):
        sl = slice(j * c, (j + 1) * c)
        qi, doi, oi, li = q[:, :, sl], dout[:, :, sl], out[:, :, sl], lse[:, :, sl]
        dq = torch.zeros(qi.shape, dtype=acc, device=q.device)
        for lo, hi, causal in _blocks(i, c):
            dq_b, dk_b, dv_b = backend.backward(doi, qi, k_all[:, :, lo:hi], v_all[:, :, lo:hi], oi, li, causal, scale)
            dq += dq_b
            dk_all[:, :, lo:hi] += dk_b
            dv_all[:, :, lo:hi] += dv_b
        dqs.append(dq.to(q.dtype))
    return torch.cat(dqs, 2), dk_all, dv_all


# -- layout order -----------------------------------------------------------------


def _rank_chunk_order(n: int, layout: SeqLayout) -> list[int]:
    return [i for r in range(n) for i in layout.chunks(r, n)]


def to_sequence_order(x: Tensor, n: int, layout: SeqLayout, dim: int = core.SEQ) -> Tensor:
    """A gathered tensor (ranks' pieces in rank order) put in sequence order: the inverse permutation."""
    order = _rank_chunk_order(n, layout)
    pieces = x.chunk(len(order), dim)
    where = {i: j for j, i in enumerate(order)}
    return torch.cat([pieces[where[i]] for i in range(len(order))], dim)


def to_rank_order(x: Tensor, n: int, layout: SeqLayout, dim: int = core.SEQ) -> Tensor:
    """A tensor in sequence order put in rank order (rank r's chunks r-th): the permutation."""
    pieces = x.chunk(n * layout.chunks_per_rank(), dim)
    return torch.cat([pieces[i] for i in _rank_chunk_order(n, layout)], dim)


# -- simulation: all ranks in one process ---------------------------------------


def _gather(pieces: Sequence[Tensor], layout: SeqLayout) -> Tensor:
    return to_sequence_order(torch.cat(list(pieces), core.SEQ), len(pieces), layout)


def simulate_forward(
    qs: Sequence[Tensor],
    ks: Sequence[Tensor],
    vs: Sequence[Tensor],
    *,
    layout: SeqLayout,
    scale: float | None = None,
    backend: AttentionBackend = CPU_FLASH,
) -> list[tuple[Tensor, Tensor]]:
    """Every rank's (out, lse) from every rank's pieces; the all-gather of K/V a concatenation."""
    n = len(qs)
    k_all, v_all = _gather(ks, layout), _gather(vs, layout)
    return [rank_forward(qs[r], k_all, v_all, layout.chunks(r, n), scale, backend) for r in range(n)]


def simulate_backward(
    douts: Sequence[Tensor],
    qs: Sequence[Tensor],
    ks: Sequence[Tensor],
    vs: Sequence[Tensor],
    outs: Sequence[Tensor],
    lses: Sequence[Tensor],
    *,
    layout: SeqLayout,
    scale: float | None = None,
    backend: AttentionBackend = CPU_FLASH,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Every rank's (dq, dk, dv); dK/dV summed over ranks and split back (a reduce-scatter)."""
    n = len(qs)
    k_all, v_all = _gather(ks, layout), _gather(vs, layout)
    per = [
        rank_backward(douts[r], qs[r], k_all, v_all, outs[r], lses[r], layout.chunks(r, n), scale, backend)
        for r in range(n)
    ]
    dk = to_rank_order(sum(p[1] for p in per), n, layout).to(ks[0].dtype).chunk(n, core.SEQ)  # type: ignore[union-attr]
    dv = to_rank_order(sum(p[2] for p in per), n, layout).to(vs[0].dtype).chunk(n, core.SEQ)  # type: ignore[union-attr]
    return [(per[r][0], dk[r], dv[r]) for r in range(n)]


# -- lowering: one rank, real collectives ---------------------------------------


def lower_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any,
    layout: SeqLayout,
    scale: float | None = None,
    backend: AttentionBackend = CPU_FLASH,
) -> tuple[Tensor, Tensor]:
    """This rank's (out, lse): K/V all-gathered over ``group`` (a process group of the mesh axis)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the newer name first
    k_all = to_sequence_order(gather(k.contiguous(), core.SEQ, group), n, layout)
    v_all = to_sequence_order(gather(v.contiguous(), core.SEQ, group), n, layout)
    return rank_forward(q, k_all, v_all, layout.chunks(rank, n), scale, backend)


def lower_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    group: Any,
    layout: SeqLayout,
    scale: float | None = None,
    backend: AttentionBackend = CPU_FLASH,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's (dq, dk, dv): K/V all-gathered again, dK/dV reduce-scattered over ``group``."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the newer name first
    k_all = to_sequence_order(gather(k.contiguous(), core.SEQ, group), n, layout)
    v_all = to_sequence_order(gather(v.contiguous(), core.SEQ, group), n, layout)
    dq, dk_all, dv_all = rank_backward(dout, q, k_all, v_all, out, lse, layout.chunks(rank, n), scale, backend)
    dk = funcol.reduce_scatter_tensor(to_rank_order(dk_all, n, layout).contiguous(), "sum", core.SEQ, group)
    dv = funcol.reduce_scatter_tensor(to_rank_order(dv_all, n, layout).contiguous(), "sum", core.SEQ, group)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def lower_forward_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    comm: Any,
    layout: SeqLayout,
) -> tuple[Tensor, Tensor]:
    """The rank program's call of the split forward: called as the CPU flash op is, with ``comm`` added (the
    mesh axis's :class:`~metadist_torch.lower.collectives.AxisComm`: its group, and the stats its gathers
    count in, each its gathered output as every all_gather counts)."""
    _only_causal(attn_mask, dropout_p, is_causal)
    out = lower_forward(query, key, value, group=comm.group, layout=layout, scale=scale)
    comm.stats.add("all_gather", comm.n * (_nbytes(key) + _nbytes(value)), calls=2)
    return out


def lower_backward_call(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    comm: Any,
    layout: SeqLayout,
) -> tuple[Tensor, Tensor, Tensor]:
    """The rank program's call of the split backward: called as the CPU flash backward op is, with ``comm``
    (K/V gathered again, counted as gathers; dK/dV reduce-scattered, counted at their unscattered input)."""
    _only_causal(attn_mask, dropout_p, is_causal)
    grads = lower_backward(grad_out, query, key, value, out, logsumexp, group=comm.group, layout=layout, scale=scale)
    comm.stats.add("all_gather", comm.n * (_nbytes(key) + _nbytes(value)), calls=2)
    acc = torch.empty((), dtype=_acc(key.dtype)).element_size()  # dK/dV are summed and scattered at this size
    comm.stats.add("reduce_scatter", comm.n * (key.numel() + value.numel()) * acc, calls=2)
    return grads


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _call_attrs(attn_mask: Tensor | None, dropout_p: float, is_causal: bool) -> dict:
    """A forward call's arguments in the trace's encoding (``{"$in": i}`` for a tensor), as the core reads them."""
    return {
        "args": [{"$in": 0}, {"$in": 1}, {"$in": 2}, dropout_p, is_causal],
        "kwargs": {"attn_mask": None if attn_mask is None else {"$in": 3}},
    }


def _only_causal(attn_mask: Tensor | None, dropout_p: float, is_causal: bool) -> None:
    """What the planner checked (:func:`metadist_core.discovery.cp_attention.call_refusal`), checked again where
    it runs: a call with a mask, dropout or without the causal flag is never run as plain causal attention."""
    reason = core.call_refusal(core.CPU_FORWARD, _call_attrs(attn_mask, dropout_p, is_causal))
    if reason is not None:
        raise UnsupportedAttention(f"context-parallel attention refused where it runs: {reason}")


# -- refusals and registration ------------------------------------------------------


def check_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    n: int,
    layout: SeqLayout,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> None:
    """Raise :class:`UnsupportedAttention` naming what this call has that context parallelism does not do
    (the sequence lengths are those of the whole tensors: ``q.shape[2] * n`` on a rank's pieces)."""
    shapes = [tuple(t.shape) for t in (q, k, v)]
    reason = core.refusal(core.CPU_FORWARD, _call_attrs(attn_mask, dropout_p, is_causal), shapes, n, layout)
    if reason is not None:
        raise UnsupportedAttention(f"context-parallel attention over {n} ranks ({layout.kind}) refused: {reason}")


def simulate_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    n: int,
    layout: SeqLayout,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Whole q, k, v in; the output of the split computation on ``n`` simulated ranks, in sequence order."""
    check_call(q, k, v, n, layout, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    split = [to_rank_order(t, n, layout).chunk(n, core.SEQ) for t in (q, k, v)]
    outs = simulate_forward(split[0], split[1], split[2], layout=layout, scale=scale)
    return to_sequence_order(torch.cat([o for o, _ in outs], core.SEQ), n, layout)


def register_torch(registry: DistImplRegistry) -> None:
    """Register the core's context-parallel attention records in ``registry`` and attach torch's hooks for the
    forward and the backward, in both layouts: ``simulate`` (every rank's pieces in one process) and ``lower``
    (one rank, called as the aten op is called, with the mesh axis's ``AxisComm`` as ``comm``)."""
    for impl in core.register_attention(registry):
        bwd = impl.name.endswith(".backward")
        sim, low = (simulate_backward, lower_backward_call) if bwd else (simulate_forward, lower_forward_call)
        for hook, fn in (("simulate", sim), ("lower", low)):
            key = (impl.name, FRONTEND, hook)
            if key not in registry.hooks:
                registry.attach(impl.name, FRONTEND, hook, functools.partial(fn, layout=impl.layout))


__all__ = [
    "AttentionBackend",
    "BACKENDS",
    "CPU_FLASH",
    "UnsupportedAttention",
    "check_call",
    "lower_backward",
    "lower_backward_call",
    "lower_forward",
    "lower_forward_call",
    "rank_backward",
    "rank_forward",
    "register_torch",
    "simulate_attention",
    "simulate_backward",
    "simulate_forward",
    "to_rank_order",
    "to_sequence_order",
]
