"""Dropless expert parallelism for torch: the per-rank exchange of :mod:`metadist_torch.moe.dropless`'s steps,
simulated (all ranks in one process, each all_to_all a reshuffle of lists) and lowered (one rank, torch's
``all_to_all_single`` with uneven splits), attached to the core's records
(:mod:`metadist_core.discovery.moe_dispatch`).

Rank r of ``n`` owns experts ``[r*E/n, (r+1)*E/n)`` and holds its own tokens. Forward: sort the pairs by
expert; an even all_to_all of the ``E`` counts (read on the host: they size the next two); the rows to the
experts' owners; the experts on them; the results back; the weighted sum. Backward: the same exchange
carrying ``[x, grad, weight]`` there and ``[dx, dweight]`` back, each expert recomputed beside its
gradients; the experts' weight gradients stay where the experts live. A rank or an expert with no tokens
sends and receives empty pieces: every rank issues the same collectives whatever the routing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from metadist_core.discovery import moe_dispatch as core
from metadist_core.discovery.distimpl import DistImplRegistry

from ..moe.dropless import (
    Dispatched,
    backward_results,
    backward_rows,
    combine,
    dispatch,
    dispatch_pairs,
    run_experts,
    run_experts_backward,
    weighted_sum,
)

Tensor = torch.Tensor
FRONTEND = "torch"


# -- simulation: all ranks in one process ---------------------------------------


def _recv_counts(ds: Sequence[Dispatched], n: int) -> list[Tensor]:
    """Per rank d: ``[n, E/n]``, how many rows each rank s sends for each of d's experts."""
    el = ds[0].counts.shape[0] // n
    return [torch.stack([ds[s].counts[d * el : (d + 1) * el] for s in range(n)]) for d in range(n)]


def _there(ds: Sequence[Dispatched], n: int) -> list[Tensor]:
    """Every rank's received rows (from rank 0's first, by expert within each sender)."""
    pieces = [list(d.rows.split(d.send_splits(n))) for d in ds]
    return [torch.cat([pieces[s][d] for s in range(n)]) for d in range(n)]


def _back(results: Sequence[Tensor], recv_counts: Sequence[Tensor], n: int) -> list[Tensor]:
    """Every sender's rows returned, in the order it sent them (by destination rank, then expert)."""
    pieces = [list(y.split([int(c) for c in rc.sum(1).tolist()])) for y, rc in zip(results, recv_counts)]
    return [torch.cat([pieces[d][s] for d in range(n)]) for s in range(n)]


def simulate_forward(
    xs: Sequence[Tensor], idxs: Sequence[Tensor], ws: Sequence[Tensor], gus: Sequence[Tensor], downs: Sequence[Tensor],
    *, act: str,
) -> list[Tensor]:  # fmt: skip
    """Every rank's output from every rank's pieces (tokens, and its share of the experts)."""
    n = len(xs)
    e = gus[0].shape[0] * n
    ds = [dispatch(x, i, e) for x, i in zip(xs, idxs)]
    rcs = _recv_counts(ds, n)
    ys = [run_experts(r, rc, gu, dn, act) for r, rc, gu, dn in zip(_there(ds, n), rcs, gus, downs)]
    ret = _back(ys, rcs, n)
    return [weighted_sum(combine(ret[s], ds[s].order, *idxs[s].shape), ws[s], xs[s].dtype) for s in range(n)]


def simulate_backward(
    grads: Sequence[Tensor], xs: Sequence[Tensor], idxs: Sequence[Tensor], ws: Sequence[Tensor],
    gus: Sequence[Tensor], downs: Sequence[Tensor], *, act: str,
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:  # fmt: skip
    """Every rank's (dx, dw, d gate_up, d down); the experts' gradients on the rank owning them."""
    n = len(xs)
    e = gus[0].shape[0] * n
    ds = [dispatch_pairs(backward_rows(g, x, w), i, e) for g, x, w, i in zip(grads, xs, ws, idxs)]
    rcs = _recv_counts(ds, n)
    res = [run_experts_backward(r, rc, gu, dn, act) for r, rc, gu, dn in zip(_there(ds, n), rcs, gus, downs)]
    ret = _back([r[0] for r in res], rcs, n)
    out = []
    for s in range(n):
        gx, gw = backward_results(ret[s], ds[s].order, xs[s], ws[s])
        out.append((gx, gw, res[s][1], res[s][2]))
    return out


# -- lowering: one rank, real collectives ---------------------------------------


def _exchange(d: Dispatched, n: int, group: Any) -> tuple[Tensor, Tensor, list[int], list[int]]:
    """The counts' all_to_all and the rows': this rank's received rows, ``[n, E/n]`` counts, and the splits
    sent and received."""
    import torch.distributed as dist

    counts = d.counts.contiguous()
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    rc = recv_counts.reshape(n, -1)
    send, recv_splits = d.send_splits(n), [int(c) for c in rc.sum(1).tolist()]  # the host reads the counts
    recv = d.rows.new_empty((sum(recv_splits), d.rows.shape[1]))
    dist.all_to_all_single(recv, d.rows.contiguous(), recv_splits, send, group=group)
    return recv, rc, send, recv_splits


def _return(rows: Tensor, send: list[int], recv_splits: list[int], group: Any) -> Tensor:
    import torch.distributed as dist

    back = rows.new_empty((sum(send), rows.shape[1]))
    dist.all_to_all_single(back, rows.contiguous(), send, recv_splits, group=group)
    return back


def _count(comm: Any, d: Dispatched, rows_back: Tensor) -> None:
    """The three all_to_alls counted by this rank's own pairs: the counts, the rows it sends, the rows it gets
    back (:func:`metadist_core.discovery.moe_dispatch.dispatch_bytes`, whatever the routing)."""
    comm.stats.add("all_to_all", d.counts.numel() * d.counts.element_size(), calls=1)
    comm.stats.add("all_to_all", d.rows.numel() * d.rows.element_size(), calls=1)
    comm.stats.add("all_to_all", rows_back.numel() * rows_back.element_size(), calls=1)


@torch.compiler.disable
def lower_forward_call(
    x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str, *, comm: Any
) -> Tensor:
    """This rank's output, called as ``metadist::moe_dropless`` is with ``comm`` added (the mesh axis's
    :class:`~metadist_torch.lower.collectives.AxisComm`); ``gate_up``/``down`` hold this rank's experts."""
    d = dispatch(x, idx, gate_up.shape[0] * comm.n)
    recv, rc, send, recv_splits = _exchange(d, comm.n, comm.group)
    y = run_experts(recv, rc, gate_up, down, act)
    ret = _return(y, send, recv_splits, comm.group)
    _count(comm, d, ret)
    return weighted_sum(combine(ret, d.order, *idx.shape), w, x.dtype)


@torch.compiler.disable
def lower_backward_call(
    grad: Tensor, x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str, *, comm: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This rank's (dx, dw, d gate_up, d down), called as ``metadist::moe_dropless_backward`` is, with ``comm``."""
    d = dispatch_pairs(backward_rows(grad, x, w), idx, gate_up.shape[0] * comm.n)
    recv, rc, send, recv_splits = _exchange(d, comm.n, comm.group)
    back, g_gate_up, g_down = run_experts_backward(recv, rc, gate_up, down, act)
    ret = _return(back, send, recv_splits, comm.group)
    _count(comm, d, ret)
    gx, gw = backward_results(ret, d.order, x, w)
    return gx, gw, g_gate_up, g_down


def register_torch(registry: DistImplRegistry) -> None:
    """Register the core's dropless expert-parallel records in ``registry`` and attach torch's ``simulate``
    and ``lower`` hooks for the forward and the backward."""
    for impl in core.register_moe(registry):
        bwd = impl.name == core.EP_BACKWARD
        sim, low = (simulate_backward, lower_backward_call) if bwd else (simulate_forward, lower_forward_call)
        for hook, fn in (("simulate", sim), ("lower", low)):
            if (impl.name, FRONTEND, hook) not in registry.hooks:
                registry.attach(impl.name, FRONTEND, hook, fn)


__all__ = ["lower_backward_call", "lower_forward_call", "register_torch", "simulate_backward", "simulate_forward"]
