"""Context-parallel causal attention: the framework-neutral record of its distributed implementation.

Queries, keys and values are split along the sequence on one mesh axis; each rank all-gathers the
keys and values (only their own heads: grouped-query attention gathers the few K/V heads), attends its
local queries to the keys it may see, and merges the partial results by log-sum-exp. With the
``head_tail`` layout rank r holds sequence chunks r and 2W-1-r of 2W, so every rank does the same causal
work. The backward gathers K/V again and reduce-scatters their gradients.

This module holds what the planner needs (op keys, placements, price, refusals); a frontend attaches the
per-rank math (``metadist_torch/ops/cp_attention.py`` for torch) to the records :func:`attention_impls` makes.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from metadist_core.discovery.distimpl import DistImpl, DistImplRegistry, ImplPrice, SeqLayout
from metadist_core.ir.placement import Shard

CPU_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
CPU_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"

#: positional argument names of the attention calls this module reads (keyword-only ones are found by name)
CALL_ARGS: dict[str, tuple[str, ...]] = {
    CPU_FORWARD: ("query", "key", "value", "dropout_p", "is_causal"),
    CPU_BACKWARD: ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal"),
}
#: which tensor inputs are query, key and value (their index among the op's tensor inputs)
QKV = {CPU_FORWARD: (0, 1, 2), CPU_BACKWARD: (1, 2, 3)}
#: the sequence dim of (batch, heads, sequence, head dim) tensors and of the (batch, heads, sequence) log-sum-exp
SEQ = 2
#: backward matmul flops over forward matmul flops (recomputed scores, dV, dP, dQ, dK: 5 matmuls to 2)
BACKWARD_FLOPS_RATIO = 2.5


def call_arg(attrs: Mapping[str, Any], op_key: str, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an encoded call (``{"args": [...], "kwargs": {...}}``); a tensor is ``{"$in": i}``."""
    args, kwargs = list(attrs.get("args", ())), dict(attrs.get("kwargs", {}))
    names = CALL_ARGS.get(op_key, ())
    if name in names and names.index(name) < len(args):
        return args[names.index(name)]
    return kwargs.get(name, default)


def call_refusal(op_key: str, attrs: Mapping[str, Any]) -> str | None:
    """Why the arguments of this call (mask, causal flag, dropout) rule context-parallel attention out; None
    when they do not. The shapes are :func:`refusal`'s to judge."""
    mask = call_arg(attrs, op_key, "attn_mask")
    if mask is not None:
        return (
            "an explicit attn_mask (padding, document or custom mask) is not supported by context-parallel "
            "attention, which computes plain causal attention only and would drop the mask; keep this op's "
            "sequence unsplit, or call it with is_causal=True and no mask"
        )
    if call_arg(attrs, op_key, "is_causal", False) is not True:
        return (
            "is_causal=False (bidirectional attention) is not implemented by context-parallel attention (causal only)"
        )
    p = call_arg(attrs, op_key, "dropout_p", 0.0)
    if p not in (0, 0.0):
        return f"dropout_p={p}: attention dropout is not supported by context-parallel attention; set it to 0"
    return None


def refusal(op_key: str, attrs: Mapping[str, Any], shapes: Sequence[Sequence[int]], n: int, layout: SeqLayout):
    """Why causal context-parallel attention does not serve this call on an axis of ``n``; None when it does."""
    reason = call_refusal(op_key, attrs)
    if reason is not None:
        return reason
    iq, ik, iv = QKV[op_key]
    q, k, v = (tuple(shapes[i]) for i in (iq, ik, iv))
    if not len(q) == len(k) == len(v) == 4:
        return f"context-parallel attention takes 4-dim (batch, heads, sequence, head dim) tensors, got {q}, {k}, {v}"
    if not q[SEQ] == k[SEQ] == v[SEQ]:
        return f"query, key and value sequences differ ({q[SEQ]}, {k[SEQ]}, {v[SEQ]}): only self-attention splits"
    if k[1] == 0 or q[1] % k[1]:
        return f"{q[1]} query heads are not a multiple of {k[1]} key/value heads"
    return layout.check(q[SEQ], n)


def busiest_blocks(n: int, layout: SeqLayout) -> float:
    """Attention blocks (chunk x chunk, a diagonal block counting half) of the busiest rank."""
    return max(sum(i + 0.5 for i in layout.chunks(r, n)) for r in range(n))


def forward_price(shapes: Sequence[Sequence[int]], itemsize: int, n: int, layout: SeqLayout) -> ImplPrice:
    """All-gather of K and V ((n-1)/n of the gathered K/V received per rank); the busiest rank's matmul flops."""
    q, k, v = shapes[0], shapes[1], shapes[2]
    b, h, seq, d = q
    kv = b * k[1] * seq * (k[3] + v[3]) * itemsize
    c = seq / (n * layout.chunks_per_rank())
    flops = busiest_blocks(n, layout) * 2.0 * b * h * c * c * (d + v[3])
    return ImplPrice(kv * (n - 1) / n, flops, calls=2)


def backward_price(shapes: Sequence[Sequence[int]], itemsize: int, n: int, layout: SeqLayout) -> ImplPrice:
    """K/V all-gathered again and their gradients reduce-scattered; :data:`BACKWARD_FLOPS_RATIO` x the forward."""
    fwd = forward_price(shapes[1:4], itemsize, n, layout)
    return ImplPrice(2 * fwd.comm_bytes, BACKWARD_FLOPS_RATIO * fwd.flops, calls=4)


def forward_workspace(shapes: Sequence[Sequence[int]], itemsize: int, n: int) -> float:
    """K and V gathered whole along the sequence (``shapes`` are the pieces before the split: whole there)."""
    k, v = shapes[1], shapes[2]
    return float(k[0] * k[1] * k[2] * (k[3] + v[3]) * itemsize)


def backward_workspace(shapes: Sequence[Sequence[int]], itemsize: int, n: int) -> float:
    """K and V gathered again, and their gradients summed over the whole sequence (at least float32)."""
    gathered = forward_workspace(shapes[1:4], itemsize, n)
    return gathered * (1 + max(itemsize, 4) / itemsize)


def impl_name(layout: SeqLayout, backward: bool = False) -> str:
    return f"cp_attention.allgather.{layout.kind}" + (".backward" if backward else "")


def attention_impls(layout: SeqLayout) -> tuple[DistImpl, DistImpl]:
    """The forward and backward records of causal context-parallel attention in ``layout``."""
    s = Shard(SEQ)
    fwd = DistImpl(
        name=impl_name(layout),
        op_keys=(CPU_FORWARD,),
        inputs=(s, s, s),
        outputs=(s, s),
        price=lambda shapes, itemsize, n: forward_price(shapes, itemsize, n, layout),
        refusal=lambda attrs, shapes, n: refusal(CPU_FORWARD, attrs, shapes, n, layout),
        layout=layout,
        grad_outputs=(0,),
        backward=impl_name(layout, True),
        description="causal attention split on the sequence: K/V all-gathered, partial results merged by lse",
        workspace=forward_workspace,
    )
    bwd = DistImpl(
        name=impl_name(layout, True),
        op_keys=(CPU_BACKWARD,),
        inputs=(s,) * 6,
        outputs=(s, s, s),
        price=lambda shapes, itemsize, n: backward_price(shapes, itemsize, n, layout),
        refusal=lambda attrs, shapes, n: refusal(CPU_BACKWARD, attrs, shapes, n, layout),
        layout=layout,
        description="its backward: K/V all-gathered, dK/dV reduce-scattered",
        workspace=backward_workspace,
    )
    return fwd, bwd


def register_attention(registry: DistImplRegistry) -> list[DistImpl]:
    """Register causal context-parallel attention, forward and backward, in both layouts."""
    out = []
    for kind in ("head_tail", "contiguous"):
        for impl in attention_impls(SeqLayout(kind)):
            out.append(registry.impls.get(impl.name) or registry.register(impl))  # once per registry
    return out


def balance(n: int, layout: SeqLayout) -> float:
    """The busiest rank's causal work over the mean rank's (1.0: balanced)."""
    total = sum(i + 0.5 for i in range(n * layout.chunks_per_rank()))
    return busiest_blocks(n, layout) / (total / n) if n else math.nan


__all__ = [
    "CPU_BACKWARD",
    "CPU_FORWARD",
    "attention_impls",
    "backward_price",
    "backward_workspace",
    "balance",
    "call_arg",
    "call_refusal",
    "forward_price",
    "forward_workspace",
    "impl_name",
    "refusal",
    "register_attention",
]
