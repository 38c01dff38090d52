"""The cost of an aten op: FLOPs from torch's formulas on meta tensors, bytes from its tensors."""

from __future__ import annotations

import functools
import json
from typing import Callable, Sequence

import torch

from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.discovery.shardcombine import Unrunnable

from ..trace.calls import TORCH_DTYPES, rebuild, resolve_overload
from ..moe.dropless import dropless_flops
from ..moe.experts_ffn import ffn_flops


def _sdpa_cpu_flops(shapes: Sequence[tuple[int, ...]], backward: bool) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if backward:
        return int(sdpa_backward_flop_count(shapes[0], shapes[1], shapes[2], shapes[3]))
    return int(sdpa_flop_count(shapes[0], shapes[1], shapes[2]))


_CUSTOM_FLOPS: dict[str, Callable[[Sequence[tuple[int, ...]]], int]] = {
    "_scaled_dot_product_flash_attention_for_cpu": lambda s: _sdpa_cpu_flops(s, False),
    "_scaled_dot_product_flash_attention_for_cpu_backward": lambda s: _sdpa_cpu_flops(s, True),
}


def _is_view(overload) -> bool:
    """Does the op return an alias of an input without writing (view, t, transpose, slice...)?"""
    rets = overload._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


@functools.lru_cache(maxsize=4096)
def _counted_flops(
    key: str, shapes: tuple, dtypes: tuple, attrs_json: str, out_shapes: tuple = (), out_dtypes: tuple = ()
) -> int | None:
    """FLOPs of one call from torch's flop formulas on meta tensors; None when torch has no formula.

    The formula gets the call's arguments and its outputs (meta tensors of the traced output shapes) as
    FlopCounterMode would give them, but the op is not run: running addmm's meta kernel (a Python
    decomposition) imports torch._dynamo, which takes seconds and which planning a recorded graph needs
    nowhere else."""
    from torch.utils.flop_counter import flop_registry

    overload = resolve_overload(key)
    name = overload._schema.name.split("::")[-1]
    if name in _CUSTOM_FLOPS:
        return _CUSTOM_FLOPS[name](shapes)
    if name in ("experts_ffn", "experts_ffn_backward"):  # the filled share of the slots (moe/experts_ffn.py)
        args = json.loads(attrs_json).get("args", [])
        backward = name == "experts_ffn_backward"
        fill = args[-1] if args and isinstance(args[-1], (int, float)) else 1.0
        x, gate_up = (shapes[1], shapes[3]) if backward else (shapes[0], shapes[2])  # (grad,) x, counts, gate_up
        return ffn_flops(x, gate_up, float(fill), backward)
    if name in ("moe_dropless", "moe_dropless_backward"):  # the routed rows through the experts (moe/dropless.py)
        backward = name == "moe_dropless_backward"
        x, idx, gate_up = (shapes[1], shapes[2], shapes[4]) if backward else (shapes[0], shapes[1], shapes[3])
        return dropless_flops(x, idx, gate_up) * (3 if backward else 1)
    formula = flop_registry.get(overload.overloadpacket)
    if formula is None:
        return None
    attrs = json.loads(attrs_json)
    tensors = [torch.empty(s, dtype=TORCH_DTYPES[d], device="meta") for s, d in zip(shapes, dtypes)]
    args = rebuild(attrs.get("args", []), tensors, device="meta")
    kwargs = rebuild(attrs.get("kwargs", {}), tensors, device="meta")
    n_ret = len(overload._schema.returns)
    positions = attrs.get("select") or list(range(len(out_shapes)))  # which returns the graph kept
    if not out_shapes or len(positions) != len(out_shapes) or max(positions) >= n_ret:
        out = overload(*args, **kwargs)  # the traced outputs do not say: the op's meta kernel does
    else:
        full: list = [None] * n_ret  # a return the graph dropped (a masked-off gradient) stays None
        for pos, sh, d in zip(positions, out_shapes, out_dtypes):
            if sh is not None:
                full[pos] = torch.empty(sh, dtype=TORCH_DTYPES[d], device="meta")
        out = full[0] if n_ret == 1 else tuple(full)
    return int(formula(*args, **kwargs, out_val=out))


def _out_shapes(op: MetaOp, graph: MetaIR) -> tuple[tuple, tuple]:
    """Per output position, its shape and dtype; None for one that is not a tensor (a masked-off gradient)."""
    vs = [graph.vars[v] for v in op.outputs]
    return (tuple(v.shape if v.is_tensor else None for v in vs), tuple(v.dtype if v.is_tensor else None for v in vs))


def op_cost(op: MetaOp, graph: MetaIR) -> tuple[int, int]:
    """``(flops, bytes_moved)`` of the whole op.

    FLOPs come from torch's registered formulas (mm, bmm, addmm, convolution,
    attention...), counted on meta tensors; any other op counts one FLOP per
    element of its largest input or of its outputs (elementwise ops,
    reductions). Bytes are the input plus output tensor bytes at their real
    dtype. Pure views (the output aliases an input: view, t, transpose,
    slice...) cost nothing.
    """
    tensors_in = [graph.vars[v] for v in op.inputs]
    tensors_out = [graph.vars[v] for v in op.outputs if graph.vars[v].is_tensor]
    nbytes = sum(v.nbytes for v in tensors_in) + sum(v.nbytes for v in tensors_out)
    try:
        overload = resolve_overload(op.key)
    except Unrunnable:
        overload = None
    if overload is not None and _is_view(overload):
        return 0, 0
    flops = None
    if overload is not None:
        try:
            flops = _counted_flops(
                op.key,
                tuple(v.shape for v in tensors_in),
                tuple(v.dtype for v in tensors_in),
                json.dumps(op.attrs, sort_keys=True, default=str),
                *_out_shapes(op, graph),
            )
        except Exception:  # no meta kernel, odd attrs: fall back to the element count
            flops = None
    if flops is None:
        flops = max([v.numel for v in tensors_out] + [v.numel for v in tensors_in] + [0]) if tensors_in else 0
    return int(flops), int(nbytes)


__all__ = ["op_cost"]
