"""The draw families that verification uses: data chosen against the ways a rule can hold by luck.

A candidate rule is accepted only if it reproduces the full op on every draw
of every family that the op accepts. Each family targets one way a wrong rule
survives convenient data:

- ``random``: standard-normal floats, in-range integers, fair booleans;
- ``uniform``: floats spread over [-4, 4], where most activations turn (30 draws for a tiny input);
- ``integer``: small integer-valued floats, matched exactly where the result stays integral;
- ``wide``: magnitudes far past every scalar static argument (bounds, thresholds, epsilons),
  both signs, so a clamp whose bounds lie outside the drawn range is not taken for linear;
- ``straddle``: values packed around each scalar argument, so both sides of a bound are seen;
- ``sparse``: mostly zeros (booleans mostly False), so ``any`` over a piece is not always True;
- ``constant``: one value everywhere (booleans all False);
- ``int_wide``: negative and large integers for integer operands, so ``mul(float, int)`` cannot keep
  Partial(max) and ``prod`` over integers cannot pass as Partial(min);
- ``on_one_shard``: each integer scalar argument (an ``ignore_index``) written into the first half of
  every integer operand only, so a loss whose ignored targets fall on one shard is seen;
- ``nonfinite`` (only for predicates: ops with a float operand and a boolean result, such as
  ``isnan``/``isfinite``): inf, -inf and NaN in the first half of every float operand (a 0-dim one is
  NaN, then inf), so that a test of finiteness that one shard's piece decides (a GradScaler's
  ``found_inf``) cannot pass as Replicate on finite data, where it is False everywhere.

A family whose draw the full op refuses (an index out of range) is skipped for
that op. :func:`partial_pieces` makes Partial(max/min) pieces whose gaps span
several orders of magnitude, so pieces straddle a function's turning point.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np

from metadist_core.discovery.combine import is_array, is_float

Sampler = Callable[[np.random.Generator, bool], list]
FAMILIES = (
    "random",
    "uniform",
    "integer",
    "wide",
    "straddle",
    "sparse",
    "constant",
    "int_wide",
    "on_one_shard",
    "nonfinite",
)


def _is_int(x: np.ndarray) -> bool:
    return np.issubdtype(x.dtype, np.integer)


def _fill(
    examples: Sequence[Any],
    floats: Callable[[tuple], np.ndarray] | None,
    ints: Callable[[np.ndarray], np.ndarray] | None,
    bools: Callable[[tuple], np.ndarray] | None,
    base: list,
) -> list:
    """A draw: each float/int/bool tensor from its maker (or from ``base`` when that maker is None)."""
    out = []
    for x, b in zip(examples, base):
        if not is_array(x) or x.size == 0:
            out.append(b)
        elif is_float(x):
            out.append(b if floats is None else floats(x.shape).astype(x.dtype))
        elif x.dtype == np.bool_:
            out.append(b if bools is None else bools(x.shape))
        elif _is_int(x):
            out.append(b if ints is None else ints(x).astype(x.dtype))
        else:
            out.append(b)
    return out


def families(
    examples: Sequence[Any],
    sampler: Sampler,
    rng: np.random.Generator,
    scalars: Sequence[float],
    draws: int = 2,
    predicate: bool = False,
) -> Iterator[tuple[str, list, bool]]:
    """``(family, inputs, integer_valued)`` for every verification draw, the examples first.

    ``predicate``: the op turns floats into booleans (adds the ``nonfinite`` family)."""
    yield "examples", list(examples), False
    has_float = any(is_array(x) and is_float(x) for x in examples)
    has_int = any(is_array(x) and _is_int(x) for x in examples)
    has_bool = any(is_array(x) and x.dtype == np.bool_ for x in examples)
    for _ in range(max(draws, 2) - 1):
        yield "random", sampler(rng, False), False
    if has_float:
        yield "integer", sampler(rng, True), True
    # uniform over the range where most activations turn (silu, mish, gelu, hardswish...): a Partial(max/min)
    # rule of a non-monotone function fails there; a tiny input gives little evidence per draw, so many
    tiny = any(is_array(x) and is_float(x) and 0 < x.size < 16 for x in examples)
    if has_float:
        for _ in range(30 if tiny else 1):
            yield (
                "uniform",
                _fill(examples, lambda sh: rng.uniform(-4.0, 4.0, sh), None, None, sampler(rng, False)),
                False,
            )
    big = 4.0 * max([abs(s) for s in scalars] + [1.0]) + 10.0
    if has_float:
        yield "wide", _fill(examples, lambda sh: rng.standard_normal(sh) * big, None, None, sampler(rng, False)), False
        for s in sorted(set(scalars), key=abs)[:4]:
            span = max(abs(s) * 0.5, 1.0)

            def straddle(sh: tuple, s: float = s, span: float = span) -> np.ndarray:
                return s + rng.uniform(-span, span, sh)

            yield "straddle", _fill(examples, straddle, None, None, sampler(rng, False)), False
    if has_float or has_bool:

        def sparse(sh: tuple) -> np.ndarray:
            out = np.zeros(sh)
            k = max(1, out.size // 10)
            out.flat[rng.choice(out.size, size=k, replace=False)] = rng.standard_normal(k) * 3
            return out

        def one_true(sh: tuple) -> np.ndarray:
            out = np.zeros(sh, dtype=bool)
            out.flat[rng.integers(0, out.size)] = True
            return out

        yield "sparse", _fill(examples, sparse, None, one_true, sampler(rng, False)), False
        c = float(rng.standard_normal() * 3)
        yield (
            "constant",
            _fill(examples, lambda sh: np.full(sh, c), None, lambda sh: np.zeros(sh, dtype=bool), sampler(rng, False)),
            False,
        )
    if has_int:
        yield (
            "int_wide",
            _fill(examples, None, lambda x: rng.integers(-1000, 1000, size=x.shape), None, sampler(rng, False)),
            False,
        )
        for s in [s for s in scalars if float(s).is_integer()][:4]:

            def on_first_half(x: np.ndarray, s: float = s) -> np.ndarray:
                lo, hi = (int(x.min()), int(x.max())) if x.size else (0, 0)
                y = rng.integers(lo, hi + 1, size=x.shape)
                if x.ndim:
                    y[: max(1, x.shape[0] // 2)] = int(s)
                else:
                    y = np.asarray(int(s))
                return y

            yield "on_one_shard", _fill(examples, None, on_first_half, None, sampler(rng, False)), False
    if predicate and has_float:
        for specials in ((np.nan, np.inf, -np.inf), (np.inf,)):

            def nonfinite(sh: tuple, specials: tuple = specials) -> np.ndarray:
                out = rng.standard_normal(sh)
                if not out.shape:
                    return np.asarray(specials[0])
                half = out[: max(1, out.shape[0] // 2)].reshape(-1)  # a view: the first half along dim 0
                k = max(1, half.size // 4)
                half[rng.choice(half.size, size=k, replace=False)] = rng.choice(specials, size=k)
                return out

            yield "nonfinite", _fill(examples, nonfinite, None, None, sampler(rng, False)), False


def scalars_of(attrs: Any) -> list[float]:
    """The numbers among an op's static attributes (bounds, thresholds, epsilons, ignore indices...):
    what the ``wide``, ``straddle`` and ``on_one_shard`` families are built around."""
    out: list[float] = []

    def walk(x: Any) -> None:
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            if np.isfinite(x) and abs(x) < 2**31:
                out.append(float(x))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict) and not (len(x) == 1 and next(iter(x)) in ("$in", "$item", "var")):
            for v in x.values():
                walk(v)

    walk({k: v for k, v in (attrs or {}).items() if not str(k).startswith("_") and k != "select"})
    return sorted(set(out))


def _pooled(
    draw: Callable[[int], tuple[np.ndarray, ...]], n: int, size: int, rng: np.random.Generator
) -> tuple[np.ndarray, ...]:
    """``n`` rows of ``size`` random values for each array ``draw(k)`` gives (``k`` values each): for ``n``
    over 2, ``n`` distinct windows of one pool of twice ``size`` values, so an axis of 16 draws 2 values
    per element, not 16 (drawing per device would make the draws a large part of discovery's time). Rows
    are shifted copies of one pool, every value still independent of the data and of its element's owner."""
    if n <= 2 or size < 2:
        return tuple(a.reshape(n, size) for a in draw(n * size))
    length = size + max(size, n)
    starts = rng.choice(length - size + 1, size=n, replace=False)
    return tuple(np.lib.stride_tricks.sliding_window_view(a, size)[starts] for a in draw(length))  # copies


def partial_pieces(x: np.ndarray, reduce: str, n: int, rng: np.random.Generator, integer: bool) -> list[np.ndarray]:
    """``n`` pieces whose ``reduce`` over devices is ``x``.

    sum/avg: random pieces at the scale of ``x`` that add up; max/min: a random
    device holds the true value per element, the others hold strictly less
    (more) by gaps from 0.05 to 50 times the value's scale, so that pieces land
    on both sides of any turning point of the op.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        scale = float(np.max(np.abs(x))) if x.size and np.all(np.isfinite(x)) else 1.0
    scale = max(scale, 1.0)
    size = x.size
    shape = (n,) + x.shape
    if reduce in ("sum", "avg"):
        target = x if reduce == "sum" else x * n
        if integer:
            noise = rng.integers(-3, 4, size=(n - 1,) + x.shape).astype(x.dtype)
        else:
            (noise,) = _pooled(lambda k: (rng.standard_normal(k),), n - 1, size, rng)
            noise = (noise.reshape((n - 1,) + x.shape) * scale).astype(x.dtype, copy=False)
        rest = (target - noise.sum(axis=0)).astype(x.dtype, copy=False)
        return list(noise) + [rest]
    owner = rng.integers(0, n, size=size)
    sign = -1 if reduce == "max" else 1
    flat = x.reshape(-1)
    if integer:
        gap = rng.integers(1, 5, size=(n, size)).astype(x.dtype)
    else:  # half the gaps small next to the value itself, half spanning four decades of the scale

        def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
            # one uniform draw per value picks the half (below or above 0.5) and, rescaled, the place in it;
            # a gap is near * max(|value|, 0.5) + far, one of the two zero: arithmetic, not a random mask
            # (a masked write on a random half of the values mispredicts every other branch)
            u = rng.random(k)
            far = (u >= 0.5).astype(u.dtype)
            u *= 2.0
            u -= far
            with np.errstate(over="ignore", invalid="ignore"):
                wide = u * np.log(1000.0)
                wide += np.log(0.05)
                np.exp(wide, out=wide)
                wide *= scale * far
                u *= 1.95
                u += 0.05
                u *= 1.0 - far
            return u, wide

        near, wide = _pooled(draw, n, size, rng)
        gap = near
        with np.errstate(over="ignore", invalid="ignore"):
            gap *= np.maximum(np.abs(flat), 0.5)[None]
            gap += wide
        del wide
    with np.errstate(invalid="ignore", over="ignore"):
        if sign < 0:
            np.negative(gap, out=gap)
        if gap.dtype != x.dtype:
            gap = gap.astype(x.dtype)
        gap += flat[None]  # the others: the value pushed by a gap
        gap.reshape(-1)[owner * size + np.arange(size)] = flat  # the owner: the value itself
    pieces = gap.reshape(shape)
    if not np.all(np.isfinite(x)):  # NaN, or inf beyond every other piece: only the owner holds it
        mine = owner.reshape(x.shape)[None] == np.arange(n).reshape((n,) + (1,) * x.ndim)
        alone = np.isnan(x) | (x == -sign * np.inf)
        pieces = np.where(~mine & alone[None], rng.standard_normal(shape) * scale, pieces)
    return list(pieces.astype(x.dtype, copy=False))


__all__ = ["families", "partial_pieces", "scalars_of", "FAMILIES"]
