"""Shape guards: CPU kernels that read out of bounds instead of checking their input shapes.

During discovery an op runs on pieces of every shape ShardCombine tries; a
few CPU kernels trust their shapes and read past an input (seen to crash the
process). Each guard checks what its kernel assumes and raises a ValueError
(a rejected candidate) instead.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..trace.calls import in_index, schema_arg


def attention_guard(overload, args_t: Sequence[Any], kwargs_t: Mapping[str, Any]):
    """The CPU attention kernels trust their shapes: a key piece shorter than the value piece reads
    past its end (seen to crash the process). Check what they assume before calling them."""
    names = {a.name for a in overload._schema.arguments}
    if not {"query", "key", "value"} <= names:
        return None
    pos = {
        n: in_index(schema_arg(overload, args_t, kwargs_t, n))
        for n in ("query", "key", "value", "out", "grad_out", "logsumexp", "attn_mask")
    }
    gqa = schema_arg(overload, args_t, kwargs_t, "enable_gqa", False) is True
    # the CPU flash kernels (forward and backward) take grouped-query shapes without a flag: torch's sdpa hands
    # them key/value with fewer heads (a divisor of the query's) when it was called with enable_gqa=True
    gqa = gqa or ("enable_gqa" not in names and "flash_attention_for_cpu" in overload._schema.name)

    def check(arrays: Sequence[np.ndarray]) -> None:
        q, k, v = (arrays[pos[n]].shape for n in ("query", "key", "value"))
        ok = len(q) == len(k) == len(v) >= 2 and k[:-1] == v[:-1] and q[-1] == k[-1]
        if ok and len(q) > 2:
            if gqa:
                ok = q[:-3] == k[:-3] and k[-3] > 0 and q[-3] % k[-3] == 0
            else:
                ok = q[:-2] == k[:-2]
        want_out = q[:-1] + v[-1:]
        for n, want in (("out", want_out), ("grad_out", want_out), ("logsumexp", q[:-1])):
            if ok and pos[n] is not None:
                ok = arrays[pos[n]].shape == want
        if ok and pos["attn_mask"] is not None:
            try:
                np.broadcast_shapes(arrays[pos["attn_mask"]].shape, q[:-1] + k[-2:-1])
            except ValueError:
                ok = False
        if not ok:
            raise ValueError(f"{overload}: query/key/value/out shapes do not fit: {[tuple(a.shape) for a in arrays]}")

    return check


POOL_BACKWARD = {
    "_adaptive_avg_pool2d_backward": 2,
    "_adaptive_avg_pool3d_backward": 3,
    "avg_pool2d_backward": 2,
    "avg_pool3d_backward": 3,
    "adaptive_max_pool2d_backward": 2,
    "adaptive_max_pool3d_backward": 3,
}


def pool_backward_guard(overload, args_t: Sequence[Any], kwargs_t: Mapping[str, Any]):
    """The CPU pooling backward kernels loop over the input's batch and channel dims and read the
    gradient (and indices) at the same positions unchecked: a gradient piece with fewer channels
    corrupts the heap (seen: "free(): corrupted unsorted chunks"). Check the leading dims agree."""
    spatial = POOL_BACKWARD.get(overload._schema.name.split("::")[-1])
    if spatial is None:
        return None
    pos = [
        p
        for p in (in_index(schema_arg(overload, args_t, kwargs_t, n)) for n in ("grad_output", "self", "indices"))
        if p is not None
    ]

    def check(arrays: Sequence[np.ndarray]) -> None:
        lead = {tuple(arrays[p].shape[:-spatial]) for p in pos}
        if len(lead) != 1:
            raise ValueError(
                f"{overload}: batch/channel dims of grad, input and indices differ: "
                f"{[tuple(arrays[p].shape) for p in pos]}"
            )

    return check


def batch_norm_guard(overload, args_t: Sequence[Any], kwargs_t: Mapping[str, Any]):
    """The CPU batch-norm kernels (forward and backward) trust that every per-channel tensor (weight,
    bias, running stats, saved mean/invstd) has one entry per channel of the input; a shorter piece
    corrupts the heap (seen: "double free or corruption"). Check that before calling them."""
    if "batch_norm" not in overload._schema.name:
        return None
    names = [a.name for a in overload._schema.arguments]
    pos = {n: in_index(schema_arg(overload, args_t, kwargs_t, n)) for n in names}
    x = pos.get("input")
    if x is None:
        return None
    per_channel = [
        pos[n]
        for n in ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd", "mean", "invstd")
        if pos.get(n) is not None
    ]
    same = [pos[n] for n in ("grad_out", "grad_output") if pos.get(n) is not None]

    def check(arrays: Sequence[np.ndarray]) -> None:
        shape = arrays[x].shape
        c = shape[1] if len(shape) >= 2 else (shape[0] if shape else 1)
        ok = all(arrays[i].shape == (c,) for i in per_channel) and all(arrays[i].shape == shape for i in same)
        if not ok:
            raise ValueError(
                f"{overload}: per-channel shapes do not fit input {shape}: {[tuple(a.shape) for a in arrays]}"
            )

    return check


# Kernels that size their loops by one input and read the others without checking them: on
# mismatched pieces they read past the end (native_layer_norm_backward with a shorter mean/rstd or
# grad, _log_softmax_backward_data with a shorter grad, both checked here on torch 2.13), which now
# and then crashes the process. During discovery each call first goes through torch's reference
# decomposition, which is the same computation in checked ops and raises on such pieces; only
# then does the native kernel run (its own checks, such as a bias matching normalized_shape, still
# apply, and its result is the one verified).
DECOMPOSE_FOR_DISCOVERY = {
    "native_layer_norm_backward",
    "_log_softmax_backward_data",
    "_softmax_backward_data",
    "native_group_norm_backward",
    # writes through indices taken from the whole input: a row piece corrupts the heap
    "max_pool2d_with_indices_backward",
    "max_pool3d_with_indices_backward",
}


def checked_call(overload, call: Callable[..., Any]) -> Callable[..., Any]:
    if overload is None or overload._schema.name.split("::")[-1] not in DECOMPOSE_FOR_DISCOVERY:
        return call
    from torch._decomp import decomposition_table

    reference = decomposition_table.get(overload)
    if reference is None:
        return call

    def checked(*args: Any, **kwargs: Any) -> Any:
        reference(*args, **kwargs)  # raises where the native kernel would read past an input
        return call(*args, **kwargs)

    return checked


def shape_guard(overload, args_t: Sequence[Any], kwargs_t: Mapping[str, Any]):
    """The guard of ``overload``'s kernel for this call, or None when it checks its own shapes."""
    return (
        attention_guard(overload, args_t, kwargs_t)
        or batch_norm_guard(overload, args_t, kwargs_t)
        or pool_backward_guard(overload, args_t, kwargs_t)
    )


__all__ = [
    "shape_guard",
    "attention_guard",
    "pool_backward_guard",
    "batch_norm_guard",
    "checked_call",
    "DECOMPOSE_FOR_DISCOVERY",
    "POOL_BACKWARD",
]
