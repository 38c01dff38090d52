"""Per-device outputs put together and compared with the full op's result (ShardCombine's verdict).

:func:`combine` puts ``n`` per-device outputs together as an output placement says (identity, concat
along a dim, sum, avg, max, min; logical or/and for booleans, as max/min); :func:`valid_combines`
keeps the placements whose combination reproduces the full result, exactly for integer data and
within a dtype-scaled tolerance (:func:`same_result`) for floats, after a 16-element probe that rules
most wrong combines out cheaply.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from metadist_core.ir.placement import REDUCE_OPS, Partial, Placement, Replicate, Shard, chunk_sizes


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def is_float(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating)


def tolerance(a: np.ndarray) -> float:
    if a.dtype == np.float64 or a.dtype == np.complex128:
        return 1e-9
    if a.dtype == np.float32 or a.dtype == np.complex64:
        return 2e-5
    return 1e-2


def same_result(full: Any, got: Any, exact: bool) -> bool:
    """Does ``got`` reproduce ``full``? Exact for integer data, else a dtype-scaled tolerance."""
    if is_array(full) != is_array(got):
        if is_array(got) and got.ndim == 0 and not is_array(full):
            got = got.item()
        elif is_array(full) and full.ndim == 0 and not is_array(got):
            full = full.item()
        else:
            return False
    if not is_array(full):
        if isinstance(full, (int, float, complex, np.number)) and isinstance(got, (int, float, complex, np.number)):
            full, got = np.asarray(full), np.asarray(got)
        else:
            try:
                return bool(full == got)
            except Exception:
                return False
    if full.shape != got.shape:
        return False
    if not is_float(full) or exact:
        if is_float(full):
            return bool(np.array_equal(full, got, equal_nan=True))
        return bool(np.array_equal(full, got))
    tol = tolerance(full)
    with np.errstate(invalid="ignore", over="ignore"):
        if np.isfinite(full).all() and np.isfinite(got).all():
            scale = float(np.max(np.abs(full))) if full.size else 0.0
            return bool(np.all(np.abs(full - got) <= tol * (np.abs(full) + 1e-3 * max(scale, 1e-30))))
    if not np.array_equal(np.isnan(full), np.isnan(got)):
        return False
    fin = np.isfinite(full)
    if not np.array_equal(full[~fin & ~np.isnan(full)], got[~fin & ~np.isnan(full)]):
        return False
    f, g = full[fin], got[fin]
    if f.size == 0:
        return True
    scale = max(float(np.max(np.abs(f))), 1e-30)
    return bool(np.all(np.abs(f - g) <= tol * (np.abs(f) + 1e-3 * scale)))


def output_combines(ndim: int | None) -> list[Placement]:
    """Every way to combine per-device outputs, in order of preference."""
    if ndim is None:
        return [Replicate()]
    return [Replicate()] + [Shard(d) for d in range(ndim)] + [Partial(r) for r in REDUCE_OPS]


def combine(pieces: list[Any], p: Placement, full: Any) -> Any | None:
    """Put per-device outputs together as placement ``p`` says; None when they cannot be."""
    n = len(pieces)
    if isinstance(p, Replicate):
        return pieces  # every piece must equal the full value: checked by the caller
    if not all(is_array(x) for x in pieces) or not is_array(full):
        return None
    if isinstance(p, Shard):
        if full.ndim == 0 or any(x.ndim != full.ndim for x in pieces):
            return None
        sizes = chunk_sizes(full.shape[p.dim], n)
        if [x.shape[p.dim] for x in pieces] != sizes:
            return None
        try:
            return np.concatenate(pieces, axis=p.dim)
        except ValueError:
            return None
    if not isinstance(p, Partial):
        raise TypeError(f"unknown placement {p!r}")
    if any(x.shape != full.shape for x in pieces):
        return None
    if full.dtype == np.bool_:
        if p.reduce not in ("max", "min"):  # or / and
            return None
        stack = np.stack(pieces)
        return stack.any(axis=0) if p.reduce == "max" else stack.all(axis=0)
    stack = np.stack(pieces)
    with np.errstate(invalid="ignore", over="ignore"):
        if p.reduce == "sum":
            return stack.sum(axis=0).astype(full.dtype)
        if p.reduce == "avg":
            if not is_float(full):
                return None
            return stack.mean(axis=0).astype(full.dtype)
        if p.reduce == "max":
            return stack.max(axis=0)
        return stack.min(axis=0)


def valid_combines(pieces: list[Any], full: Any, exact: bool, among: set[Placement] | None = None) -> set[Placement]:
    """The ways to combine ``pieces`` that give ``full`` (only those in ``among``, when given)."""
    ndim = full.ndim if is_array(full) else None
    probe = _Probe.of(full)
    ok: set[Placement] = set()
    for p in output_combines(ndim):
        if among is not None and p not in among:
            continue
        if probe is not None and probe.rules_out(pieces, p):  # 16 elements first: most combines fail there
            continue
        got = combine(pieces, p, full)
        if got is None:
            continue
        if isinstance(p, Replicate):
            if all(same_result(full, x, exact) for x in got):
                ok.add(p)
        elif (probe is None or not probe.differs(got)) and same_result(full, got, exact):
            ok.add(p)
    return ok


class _Probe:
    """16 fixed elements of a float output and its scale, read once: a cheap look that shows most wrong
    combines wrong before a whole one is built and compared (the look never accepts anything)."""

    def __init__(self, full: np.ndarray) -> None:
        self.full = full
        self.index = _probe_multi(full.shape)
        self.values = full[self.index]
        self.tol = 10 * tolerance(full)
        with np.errstate(invalid="ignore", over="ignore"):
            self.scale = float(np.max(np.abs(full))) if np.isfinite(full).all() else 0.0

    @classmethod
    def of(cls, full: Any) -> "_Probe | None":
        if not is_array(full) or full.size <= 64 or not is_float(full):
            return None
        return cls(full)

    def _differs(self, b: np.ndarray) -> bool:
        a = self.values
        with np.errstate(invalid="ignore", over="ignore"):
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                return False
            return bool(np.any(np.abs(a - b) > self.tol * (np.abs(a) + 1e-3 * max(self.scale, 1e-30))))

    def differs(self, got: Any) -> bool:
        """True when ``got`` (a whole output) already differs at the probed elements."""
        if not is_array(got) or got.shape != self.full.shape:
            return False
        return self._differs(got[self.index])

    def rules_out(self, pieces: list[Any], p: Placement) -> bool:
        """True when combining ``pieces`` as ``p`` surely does not give the output (Replicate, Partial)."""
        if not all(is_array(x) and x.shape == self.full.shape for x in pieces):
            return False
        if isinstance(p, Replicate):
            return any(self._differs(x[self.index]) for x in pieces)
        if not isinstance(p, Partial) or not all(is_float(x) for x in pieces):
            return False
        got = combine([x[self.index] for x in pieces], p, self.values)  # the same reduction, on 16 elements
        return got is not None and self._differs(got)


@functools.lru_cache(maxsize=1024)
def _probe_multi(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The multi-index of 16 fixed elements of an array of ``shape`` (read without flattening a view)."""
    size = int(np.prod(shape))
    return np.unravel_index(np.linspace(0, size - 1, 16).astype(np.int64), shape)
