"""Dropless expert parallelism: the framework-neutral record of a mixture-of-experts layer's distributed
implementation, and the rules the layer's op declares.

The layer is one op, ``moe_dropless(x [T, H], idx [T, k], w [T, k], gate_up [E, 2F, H], down [E, H, F])
-> [T, H]``: every token through the ``k`` experts ``idx`` names, their outputs summed with weights ``w``.
Its boundary shapes are static; how many tokens each expert gets is data, and stays inside the op.

- **Declared rules** (:func:`declared_rules`): the op works token by token with whole weights, so its tokens
  split on any axis (the backward's weight gradients are then partial sums); a gradient that is a partial
  sum gives partial gradients. Discovery cannot find these by running the op at proxy sizes (a proxy that
  shrinks the experts leaves ``idx`` naming experts that are not there), and needs no run to know them.
- **Expert parallelism** (:func:`moe_impls`): on one mesh axis of ``n`` ranks the experts are split on dim
  0 (rank r owns experts ``[r*E/n, (r+1)*E/n)``) and the tokens on dim 0. Each rank sorts its (token,
  expert) pairs by expert, exchanges its per-expert counts with an even all_to_all of ``E`` integers, moves
  the pairs' rows to the experts' owners with an all_to_all of uneven splits, runs each local expert on its
  rows, and sends the results back by the reverse all_to_all; the weighted sum is made where the token
  lives. Every rank issues the same three collectives whatever the routing (a rank or an expert with no
  tokens sends and receives empty pieces). The counts are read on the host to size the exchange.
  Other axes may split the tokens too (each rank's pairs are its own), never the experts.

A frontend attaches the per-rank math (``metadist_torch/ops/ep_dispatch.py`` for torch).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from metadist_core.discovery.distimpl import DistImpl, DistImplRegistry, ImplPrice
from metadist_core.discovery.rules import ShardingRule
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.placement import Partial, Placement, Replicate, Shard, splits_nonempty

FORWARD = "metadist.moe_dropless.default"
BACKWARD = "metadist.moe_dropless_backward.default"
OP_KEYS = frozenset({FORWARD, BACKWARD})
EP = "moe.ep"
EP_BACKWARD = "moe.ep.backward"
#: tensor inputs of the forward and the backward that run token by token (dim 0 is the token)
TOKEN_INPUTS = {FORWARD: (0, 1, 2), BACKWARD: (0, 1, 2, 3)}
#: index (among the tensor inputs) of ``x``, ``idx``, ``gate_up`` in each op
X, IDX, GATE_UP = {FORWARD: 0, BACKWARD: 1}, {FORWARD: 1, BACKWARD: 2}, {FORWARD: 3, BACKWARD: 4}
#: backward flops over forward flops: the forward recomputed, then the gradients of x and of both weights
BACKWARD_FLOPS_RATIO = 3.0
COUNT_BYTES = 8  # the per-expert counts travel as 64-bit integers


def declared_rules(op: MetaOp, graph: MetaIR, n: int) -> list[ShardingRule] | None:
    """The one-axis rules of a ``moe_dropless`` op (forward or backward) on an axis of ``n``; None for any
    other op. Tokens split together on dim 0 (weights whole; the backward's weight gradients partial); the
    backward also takes a partial gradient to partial results."""
    if op.key not in OP_KEYS:
        return None
    n_in, n_out = len(op.inputs), len(op.outputs)
    rules = [ShardingRule.replicated(n_in, n_out)]
    tokens = graph.vars[op.inputs[0]].shape
    if tokens is not None and len(tokens) >= 1 and splits_nonempty(int(tokens[0]), n):
        ins: list[Placement] = [Replicate()] * n_in
        for i in TOKEN_INPUTS[op.key]:
            ins[i] = Shard(0)
        if op.key == FORWARD:
            outs: list[Placement] = [Shard(0)] * n_out
        else:  # (gx, gw, g_gate_up, g_down): per token, then summed over the tokens
            outs = [Shard(0), Shard(0)] + [Partial("sum")] * (n_out - 2)
        rules.append(ShardingRule(tuple(ins), tuple(outs)))
    if op.key == BACKWARD and str(graph.vars[op.inputs[0]].dtype).startswith(("float", "bfloat")):
        rules.append(ShardingRule((Partial("sum"),) + (Replicate(),) * (n_in - 1), (Partial("sum"),) * n_out))
    return rules


def _dims(op_key: str, shapes: Sequence[Sequence[int]]) -> tuple[int, int, int, int, int]:
    """(tokens, top_k, hidden, experts, expert width F) of a call's tensor input shapes."""
    t, k = shapes[IDX[op_key]][0], shapes[IDX[op_key]][1]
    e, two_f, h = shapes[GATE_UP[op_key]]
    return int(t), int(k), int(h), int(e), int(two_f) // 2


def refusal(op_key: str, attrs: Mapping[str, Any], shapes: Sequence[Sequence[int]], n: int) -> str | None:
    """Why expert parallelism over ``n`` ranks does not serve this call; None when it does."""
    if len(shapes) <= GATE_UP[op_key] or len(shapes[IDX[op_key]]) != 2 or len(shapes[GATE_UP[op_key]]) != 3:
        return f"expects idx [T, k] and gate_up [E, 2F, H]; got input shapes {[tuple(s) for s in shapes]}"
    t, _, _, e, _ = _dims(op_key, shapes)
    if e % n:
        return f"its {e} experts do not split evenly over {n} ranks; use a mesh axis whose size divides {e}"
    if t < n:
        return f"its {t} tokens are fewer than the {n} ranks"
    return None


def _pairs(shapes: Sequence[Sequence[int]], op_key: str, n: int) -> tuple[float, int, int, int, int]:
    t, k, h, e, f = _dims(op_key, shapes)
    return t * k / n, h, e, f, k  # one rank's (token, expert) pairs at a balanced load


def forward_price(shapes: Sequence[Sequence[int]], itemsize: int, n: int) -> ImplPrice:
    """One rank's price at a balanced routing: its share of the experts' flops, and the rows it receives in
    both all_to_alls (each keeps its own ``1/n``) plus the counts."""
    pairs, h, e, f, _ = _pairs(shapes, FORWARD, n)
    flops = 2.0 * pairs * h * 3 * f
    moved = 2.0 * pairs * (n - 1) / n * h * itemsize + e * COUNT_BYTES
    return ImplPrice(comm_bytes=moved, flops=flops, calls=3)


def backward_price(shapes: Sequence[Sequence[int]], itemsize: int, n: int) -> ImplPrice:
    """The backward's: rows of x, the output gradient and the weight there ([2H + 1] a pair), the input
    gradient and the weight's gradient back ([H + 1]); the forward recomputed beside the gradients."""
    pairs, h, e, f, _ = _pairs(shapes, BACKWARD, n)
    flops = BACKWARD_FLOPS_RATIO * 2.0 * pairs * h * 3 * f
    moved = pairs * (n - 1) / n * (3 * h + 2) * itemsize + e * COUNT_BYTES
    return ImplPrice(comm_bytes=moved, flops=flops, calls=3)


def forward_workspace(shapes: Sequence[Sequence[int]], itemsize: int, n: int) -> float:
    """Bytes a rank holds inside the forward at a balanced routing: its sorted rows, the rows it received,
    the experts' hidden activations on them and the rows it gets back."""
    pairs, h, _, f, _ = _pairs(shapes, FORWARD, n)
    return pairs * (3 * h + 2 * f) * itemsize


def backward_workspace(shapes: Sequence[Sequence[int]], itemsize: int, n: int) -> float:
    """The backward's: rows [2H + 1] sent and received, the hidden activations and their gradients, rows
    [H + 1] sent back and received."""
    pairs, h, _, f, _ = _pairs(shapes, BACKWARD, n)
    return pairs * (2 * (2 * h + 1) + 4 * f + 2 * (h + 1)) * itemsize


def dispatch_bytes(op_key: str, shapes: Sequence[Sequence[int]], itemsize: int, n: int) -> int:
    """Bytes one rank puts into its three all_to_alls, whatever the routing: the ``E`` counts and its own
    pairs' rows there and back (``[H]`` and ``[H]`` forward; ``[2H + 1]`` and ``[H + 1]`` backward).
    ``shapes``: the rank's own pieces (tokens split on every axis, its experts)."""
    t, k, h, e_local, _ = _dims(op_key, shapes)
    width = 2 * h if op_key == FORWARD else 3 * h + 2
    return e_local * n * COUNT_BYTES + t * k * width * itemsize


def moe_impls() -> tuple[DistImpl, DistImpl]:
    """The forward and backward records of dropless expert parallelism."""
    s = Shard(0)
    fwd = DistImpl(
        name=EP,
        op_keys=(FORWARD,),
        inputs=(s, s, s, s, s),
        outputs=(s,),
        price=forward_price,
        refusal=lambda attrs, shapes, n: refusal(FORWARD, attrs, shapes, n),
        grad_outputs=(0,),
        backward=EP_BACKWARD,
        description="experts split over the axis; tokens sent to their experts by uneven all_to_all and back",
        workspace=forward_workspace,
        shared=(0, 1, 2, 5),
    )
    bwd = DistImpl(
        name=EP_BACKWARD,
        op_keys=(BACKWARD,),
        inputs=(s, s, s, s, s, s),
        outputs=(s, s, s, s),
        price=backward_price,
        refusal=lambda attrs, shapes, n: refusal(BACKWARD, attrs, shapes, n),
        description="its backward: rows and output gradients there, input and routing gradients back",
        workspace=backward_workspace,
        shared=(0, 1, 2, 3, 6, 7),
    )
    return fwd, bwd


def register_moe(registry: DistImplRegistry) -> list[DistImpl]:
    """Register dropless expert parallelism, forward and backward (once per registry)."""
    return [registry.impls.get(i.name) or registry.register(i) for i in moe_impls()]


__all__ = [
    "BACKWARD",
    "EP",
    "EP_BACKWARD",
    "FORWARD",
    "OP_KEYS",
    "backward_price",
    "backward_workspace",
    "declared_rules",
    "dispatch_bytes",
    "forward_price",
    "forward_workspace",
    "moe_impls",
    "refusal",
    "register_moe",
]
