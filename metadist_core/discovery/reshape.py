"""Shape analysis of reshape/view ops: which input dims map to which output dims.

Reshaping keeps the row-major element order, so the dims of the input and of
the output fall into groups whose sizes multiply to the same count. A split of
the *major* (first non-unit) dim of an input group is a contiguous range of
that group's elements, which is a split of the major dim of the matching
output group; any other split is not contiguous and cannot pass a reshape
without communication.
"""

from __future__ import annotations

import math
from typing import Sequence

from metadist_core.ir.placement import Placement, Shard, chunk_bounds


def dim_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of input dims and output dims with equal element counts.

    Unit dims are attached to the group they sit next to. Raises ValueError
    when the element counts differ.
    """
    if math.prod(in_shape) != math.prod(out_shape):
        raise ValueError(
            f"cannot reshape {tuple(in_shape)} ({math.prod(in_shape)} elements) "
            f"to {tuple(out_shape)} ({math.prod(out_shape)} elements)"
        )
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    ni, nj = len(in_shape), len(out_shape)
    while i < ni or j < nj:
        gi, gj = [], []
        pi = pj = 1
        # take at least one dim from each side that still has dims
        if i < ni:
            gi.append(i)
            pi *= in_shape[i]
            i += 1
        if j < nj:
            gj.append(j)
            pj *= out_shape[j]
            j += 1
        while pi != pj:
            if pi < pj and i < ni:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif pj < pi and j < nj:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                break
        # trailing unit dims join this group
        while i < ni and in_shape[i] == 1 and (j >= nj or out_shape[j] != 1):
            gi.append(i)
            i += 1
        while j < nj and out_shape[j] == 1 and (i >= ni or in_shape[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _major(dims: list[int], shape: Sequence[int]) -> int | None:
    for d in dims:
        if shape[d] != 1:
            return d
    return None


def reshape_output_placement(
    in_shape: Sequence[int], out_shape: Sequence[int], p: Placement, n: int
) -> Placement | None:
    """The output placement a reshape gives an input placed as ``p``, or None if it cannot pass."""
    if not isinstance(p, Shard):
        return p
    for gi, gj in dim_groups(in_shape, out_shape):
        if p.dim in gi:
            if p.dim != _major(gi, in_shape):
                return None
            o = _major(gj, out_shape)
            if o is None:
                return None
            inner = math.prod(in_shape[d] for d in gi) // in_shape[p.dim]
            out_inner = math.prod(out_shape[d] for d in gj) // out_shape[o]
            # piece r holds rows [a, b) of the input major dim = elements [a*inner, b*inner) of the group,
            # which must be whole rows of the output major dim, matching its own chunking
            for r in range(n):
                a, b = chunk_bounds(in_shape[p.dim], n, r)
                oa, ob = chunk_bounds(out_shape[o], n, r)
                if a * inner != oa * out_inner or b * inner != ob * out_inner:
                    return None
            return Shard(o)
    return None


def reshape_local_shape(
    in_shape: Sequence[int], out_shape: Sequence[int] | None, p: Placement, n: int, rank: int
) -> tuple[int, ...] | None:
    """The target shape device ``rank`` passes to its local reshape when the input is placed as ``p``."""
    if out_shape is None:
        return None
    out = tuple(int(s) for s in out_shape)
    if not isinstance(p, Shard):
        return out
    q = reshape_output_placement(in_shape, out, p, n)
    if not isinstance(q, Shard):  # None: it cannot pass (a Shard input gives a Shard or None)
        return None
    local = list(out)
    lo, hi = chunk_bounds(out[q.dim], n, rank)
    local[q.dim] = hi - lo
    return tuple(local)
