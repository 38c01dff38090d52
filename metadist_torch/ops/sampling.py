"""Random example inputs for discovering an aten op's rules: in range where the op needs it.

Floats are drawn normal (or small integer-valued); index-like integer inputs
(embedding indices, loss targets, gather/scatter indices) inside their valid
range; the argument of sqrt/log positive; divisors nonzero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..trace.calls import FLOATS, in_index, schema_arg

# numpy dtype used during discovery, per canonical dtype
DISCOVERY_NP: dict[str, Any] = {
    "float64": np.float64,
    "float32": np.float64,
    "float16": np.float64,
    "bfloat16": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
    "complex64": np.complex128,
    "complex128": np.complex128,
}
# inputs whose domain is positive (sqrt, log...): drawn positive so that results stay finite
POSITIVE_INPUT_OPS = frozenset({"sqrt", "rsqrt", "log", "log2", "log10", "lgamma", "digamma", "acosh"})
# divisors: drawn nonzero, so that integer-valued draws stay finite
NONZERO_SECOND_INPUT_OPS = frozenset({"div", "remainder", "fmod", "floor_divide", "true_divide"})


@dataclass
class InputMeta:
    shape: tuple[int, ...]
    dtype: str  # canonical


def int_ranges(
    name: str, overload, args: Sequence[Any], kwargs: Mapping[str, Any], metas: Sequence[InputMeta]
) -> dict[int, tuple[int, ...]]:
    """``(lo, hi)`` of the valid values of each index-like integer input, from the other inputs' shapes;
    ``(lo, hi, special)`` where the op also takes one value apart (a loss's ignore_index)."""
    ranges: dict[int, tuple[int, ...]] = {}

    def arg(n: str, default: Any = None) -> Any:
        return schema_arg(overload, args, kwargs, n, default)

    def shape_of(n: str) -> tuple[int, ...] | None:
        i = in_index(arg(n))
        return None if i is None else metas[i].shape

    def put(n: str, hi: int | None) -> None:
        i = in_index(arg(n))
        if i is not None and hi is not None and hi > 0:
            ranges[i] = (0, int(hi))

    def dim_size(shape: tuple[int, ...] | None, dim: Any) -> int | None:
        if shape is None or not isinstance(dim, int):
            return None
        if not shape:
            return 1
        return shape[dim % len(shape)]

    if name == "embedding":
        w = shape_of("weight")
        put("indices", w[0] if w else None)
    elif name in ("embedding_dense_backward", "embedding_backward", "_embedding_bag_dense_backward"):
        put("indices", arg("num_weights"))
    elif name in (
        "nll_loss_forward",
        "nll_loss",
        "nll_loss_nd",
        "nll_loss_backward",
        "cross_entropy_loss",
        "nll_loss2d_forward",
        "nll_loss2d",
        "nll_loss2d_backward",
    ):
        s = shape_of("self")
        put("target", None if s is None else (s[1] if len(s) >= 2 else s[0] if s else None))
        # some targets hit ignore_index: a mean over the kept targets is not an average of local means
        i, ignore = in_index(arg("target")), arg("ignore_index", -100)
        if i in ranges and isinstance(ignore, int):
            ranges[i] = ranges[i] + (ignore,)
    elif name in (
        "gather",
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index_select",
        "index_add",
        "index_copy",
        "index_fill",
        "index_reduce",
    ):
        put("index", dim_size(shape_of("self"), arg("dim")))
    elif name == "take_along_dim":
        s = shape_of("self")
        d = arg("dim")
        put("indices", math.prod(s) if s is not None and d is None else dim_size(s, d))
    elif name in ("index", "index_put", "_index_put_impl", "_unsafe_index", "_unsafe_index_put"):
        s = shape_of("self")
        idx = arg("indices")
        if s is not None and isinstance(idx, list):
            for k, t in enumerate(idx):
                i = in_index(t)
                if i is not None and k < len(s) and s[k] > 0:
                    ranges[i] = (0, s[k])
    elif name == "one_hot":
        put("self", arg("num_classes"))
    return ranges


def positive_inputs(name: str, overload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> set[int]:
    """Inputs that only ever hold positive values (the argument of sqrt/log..., a loss's total_weight);
    ``-1 - i`` for an input ``i`` that must only be nonzero (a divisor)."""
    if overload is not None and name.startswith("nll_loss") and name.endswith("backward"):
        i = in_index(schema_arg(overload, args, kwargs, "total_weight"))
        return {i} if i is not None else set()
    if name in NONZERO_SECOND_INPUT_OPS and len(args) >= 2 and in_index(args[1]) is not None:
        return {-1 - in_index(args[1])}  # negative: nonzero, not positive (see make_sampler)
    if name in POSITIVE_INPUT_OPS:
        i = in_index(args[0]) if args else None
        return {i} if i is not None else set()
    if name == "pow" and len(args) >= 2 and isinstance(args[1], float) and not float(args[1]).is_integer():
        i = in_index(args[0])
        return {i} if i is not None else set()
    return set()


def make_sampler(
    metas: Sequence[InputMeta], int_ranges: Mapping[int, tuple[int, ...]], positive: set[int] | frozenset = frozenset()
) -> Callable[[np.random.Generator, bool], list[np.ndarray]]:
    """Random inputs at the given shapes (discovery dtypes): normal or small integer-valued floats
    (positive where the op needs it), integers in their valid range ([0, 2) when unknown; one in eight
    set to the special value where there is one), random bools."""

    def sample(rng: np.random.Generator, integer: bool) -> list[np.ndarray]:
        out = []
        for i, m in enumerate(metas):
            npdt = DISCOVERY_NP[m.dtype]
            if m.dtype in FLOATS or m.dtype.startswith("complex"):
                if integer:
                    if i in positive:
                        a = rng.integers(1, 5, size=m.shape)
                    elif -1 - i in positive:  # nonzero
                        a = rng.integers(1, 5, size=m.shape) * rng.choice([-1, 1], size=m.shape)
                    else:
                        a = rng.integers(-4, 5, size=m.shape)
                else:
                    a = rng.standard_normal(m.shape)
                    if i in positive:
                        a = np.abs(a) + 0.5
                out.append(np.asarray(a, dtype=npdt))
            elif m.dtype == "bool":
                out.append(np.asarray(rng.random(m.shape) < 0.5))
            else:
                lo, hi, *special = int_ranges.get(i, (0, 2))
                a = rng.integers(lo, hi, size=m.shape)
                if special:  # a value outside [lo, hi) that the op treats apart (ignore_index)
                    a = np.where(rng.random(m.shape) < 0.125, special[0], a)
                out.append(np.asarray(a, dtype=npdt))
        return out

    return sample


__all__ = ["InputMeta", "DISCOVERY_NP", "int_ranges", "positive_inputs", "make_sampler"]
