"""Asynchronous all_reduces and reduce_scatters in a rank program: issued as early as the graph allows,
waited for as late.

The all_reduce and reduce_scatter calls of a lowered program (``md_all_reduce_axis*``,
``md_reduce_scatter_axis*`` and their buckets ``md_*_bucket_axis*``) start torch's functional collective
op and return a :class:`~metadist_torch.collectives.Pending` (plain tensors: no ``AsyncCollectiveTensor``,
whose Python dispatch on every later op cost more than the overlap gained); an ``md_done`` node
waits for it and gives the value. :func:`issue_early` moves each collective to right after the last
node it reads and each ``md_done`` to right before the first node that reads the value, so the
collective runs while the ops in between compute: a gradient's all_reduce overlaps with the rest of
the backward, as in DDP. The order of collectives stays the same on every rank (the same
deterministic pass on the same program). Outputs pass through :func:`md_wait` before the program
returns.
"""
from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

ASYNC_PREFIXES = ("md_all_reduce_axis", "md_all_reduce_bucket_axis", "md_reduce_scatter_axis",
                  "md_reduce_scatter_bucket_axis")


def md_wait(*xs: Any) -> tuple:
    """Wait for every pending collective among ``xs`` (their values in its place); other values pass."""
    from .collectives import md_done
    return tuple(md_done(x) for x in xs)


def is_done(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "md_done"


def is_async(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "").startswith(ASYNC_PREFIXES)


def issue_early(g: fx.Graph) -> int:
    """Move every async all_reduce (and the getitems of a bucket) right after its latest input and every
    ``md_done`` right before its first reader; wrap the outputs in one :func:`md_wait`. Returns how many
    collective nodes moved."""
    order = {n: i for i, n in enumerate(g.nodes)}
    for node in [n for n in g.nodes if is_done(n)]:
        first = min(node.users, key=lambda u: order[u], default=None)
        if first is not None and order[first] > order[node] + 1:
            first.prepend(node)
    moved = 0
    nodes = list(g.nodes)
    for node in nodes:
        if not is_async(node):
            continue
        deps = [a for a in node.all_input_nodes]
        if not deps:
            continue
        order = {n: i for i, n in enumerate(g.nodes)}
        last = max(deps, key=lambda n: order[n])
        if order[last] + 1 >= order[node]:
            continue
        users = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
        last.append(node)
        anchor = node
        for u in users:
            anchor.append(u)
            anchor = u
        moved += 1
    out = next(n for n in g.nodes if n.op == "output")
    vals = out.args[0]
    flat = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    if flat:
        with g.inserting_before(out):
            w = g.call_function(md_wait, tuple(flat))
            new = [g.call_function(operator.getitem, (w, i)) for i in range(len(flat))]
        out.args = (tuple(new) if isinstance(vals, (tuple, list)) else new[0],)
    return moved


__all__ = ["issue_early", "md_wait", "is_async", "is_done"]
