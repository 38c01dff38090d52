"""Walks over a def-use graph: the backward slice of a set of values (MetaIR's and the sharding
problem's graphs alike)."""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, NamedTuple, TypeVar


class Slice(NamedTuple):
    """What a walk over the graph reached: values (the ones it started from included) and the ops it passed."""

    values: set
    ops: set


_V = TypeVar("_V", bound=Hashable)  # a value of a def-use graph
_N = TypeVar("_N", bound=Hashable)  # a node (an op) of a def-use graph


def walk_upstream(
    starts: Iterable[_V],
    producer: Callable[[_V], _N | None],
    reads: Callable[[_N], Iterable[_V]],
    *,
    stop: Iterable[_V] = (),
    through: Callable[[_N], bool] | None = None,
) -> Slice:
    """The backward slice of ``starts`` in any def-use graph (:meth:`MetaIR.upstream` on a MetaIR): from each
    value reached, not past a ``stop`` value, to its ``producer`` (None: a graph input) where ``through``
    accepts it (every producer when None), and on to the values the producer ``reads``."""
    stop = set(stop)
    values: set = set()
    ops: set = set()
    todo = list(starts)
    while todo:
        v = todo.pop()
        if v in values:
            continue
        values.add(v)
        if v in stop:
            continue
        p = producer(v)
        if p is None or p in ops or (through is not None and not through(p)):
            continue
        ops.add(p)
        todo.extend(reads(p))
    return Slice(values, ops)


__all__ = ["Slice", "walk_upstream"]
