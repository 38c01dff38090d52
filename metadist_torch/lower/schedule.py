"""Asynchronous all_reduces and reduce_scatters in a rank program: issued as early as the graph allows,
waited for as late.

The all_reduce and reduce_scatter calls of a lowered program (``md_all_reduce_axis*``,
``md_reduce_scatter_axis*`` and their buckets ``md_*_bucket_axis*``) start torch's functional collective
op and return a :class:`~metadist_torch.lower.collectives.Pending` (plain tensors: no ``AsyncCollectiveTensor``,
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
from typing import Any, Callable

import torch
import torch.fx as fx

from .collectives import md_done
from .reinplace import input_aliases

SMALL = 1 << 16  # elements: what hoist_input_chains may make and sink_to_outputs may keep alive longer
HOIST_OPS = 8  # ops at most in a chain hoist_input_chains moves
GATHER_PREFIX = "md_all_gather_bucket_axis"  # issued one bucket ahead (prefetch_gathers), not as early as it can
ASYNC_PREFIXES = (
    "md_all_reduce_axis",
    "md_all_reduce_bucket_axis",
    "md_reduce_scatter_axis",
    "md_reduce_scatter_bucket_axis",
)


def md_wait(*xs: Any) -> tuple:
    """Wait for every pending collective among ``xs`` (their values in its place); other values pass."""
    return tuple(md_done(x) for x in xs)


def is_done(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "md_done"


def is_async(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "").startswith(ASYNC_PREFIXES)


def _pure(node: fx.Node) -> bool:
    """An aten op that neither writes a tensor nor draws random numbers (moving it changes no value)."""
    t = node.target
    return (
        node.op == "call_function"
        and isinstance(t, torch._ops.OpOverload)
        and not t._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in t.tags
    )


def hoist_input_chains(g: fx.Graph, numel: Callable[[fx.Node], int | None]) -> int:
    """Move the few ops that compute an async collective's input from the step's inputs alone to the start of
    the program (a mean loss's token count, from the targets), so the collective runs during the forward
    instead of making every rank wait for the others where the backward needs it.

    A chain moves when it has at most :data:`HOIST_OPS` ops, every one pure (:func:`_pure`) and no larger than
    the largest of its inputs or :data:`SMALL` elements (``numel``: a node's element count, None: unknown).
    Returns how many chains moved."""
    nodes = list(g.nodes)
    anchor = next((n for n in reversed(nodes) if n.op == "placeholder"), None)
    if anchor is None:
        return 0
    order = {n: i for i, n in enumerate(nodes)}
    moved = 0
    for c in [n for n in nodes if is_async(n)]:
        chain: set[fx.Node] = set()
        todo, ok = list(c.all_input_nodes), True
        while todo and ok:
            a = todo.pop()
            if a.op in ("placeholder", "get_attr") or a in chain:
                continue
            ins = a.all_input_nodes
            size, biggest = numel(a), max([numel(x) or 0 for x in ins], default=0)
            ok = _pure(a) and size is not None and size <= max(SMALL, biggest) and len(chain) < HOIST_OPS
            chain.add(a)
            todo.extend(ins)
        if not ok or not chain or all(order[a] <= order[anchor] for a in chain):
            continue
        for a in sorted(chain, key=lambda n: order[n]):
            if order[a] > order[anchor]:
                anchor.append(a)
                anchor = a
        moved += 1
        order = {n: i for i, n in enumerate(g.nodes)}
    return moved


def sink_to_outputs(g: fx.Graph, numel: Callable[[fx.Node], int | None]) -> int:
    """Move each ``md_done`` whose value reaches only the step's outputs, and the pure ops between, to the end
    of the program (a loss's all_reduce, returned but read by nothing else): the ranks then wait for it once,
    with the gradients, not in the middle of the step. Only where the other values those ops read are small
    (at most :data:`SMALL` elements), so that nothing large stays alive longer, and none is an input or may
    share an input's storage (the state is updated in place at the end: a moved op would read the new value).
    Returns how many moved."""
    out = next(n for n in g.nodes if n.op == "output")
    held = input_aliases(g)
    only_out: dict[fx.Node, bool] = {}
    for n in reversed(list(g.nodes)):
        if n is not out:
            only_out[n] = bool(n.users) and all(u is out or only_out.get(u, False) for u in n.users)
    order = {n: i for i, n in enumerate(g.nodes)}
    sunk: set[fx.Node] = set()
    for d in [n for n in g.nodes if is_done(n) and only_out[n]]:
        part, todo = {d}, [u for u in d.users if u is not out]
        while todo:
            u = todo.pop()
            if u not in part:
                part.add(u)
                todo.extend(x for x in u.users if x is not out)
        pure = all(n is d or _pure(n) or (n.op == "call_function" and n.target is operator.getitem) for n in part)
        small = all(
            x in part or x in sunk or (x not in held and (numel(x) or SMALL + 1) <= SMALL)
            for n in part
            for x in n.all_input_nodes
            if x is not d
        )
        if not pure or not small:
            continue
        for n in sorted(part, key=lambda n: order[n]):
            out.prepend(n)
        sunk |= part
    return len([n for n in sunk if is_done(n)])


def issue_early(g: fx.Graph, numel: Callable[[fx.Node], int | None] | None = None) -> int:
    """Move every async all_reduce (and the getitems of a bucket) right after its latest input and every
    ``md_done`` right before its first reader; wrap the outputs in one :func:`md_wait`. With ``numel`` (a
    node's element count), first :func:`hoist_input_chains` and then :func:`sink_to_outputs`. Returns how many
    collective nodes moved."""
    if numel is not None:
        hoist_input_chains(g, numel)
    order = {n: i for i, n in enumerate(g.nodes)}
    for node in [n for n in g.nodes if is_done(n)]:
        first = min(node.users, key=lambda u: order[u], default=None)
        if first is not None and order[first] > order[node] + 1:
            first.prepend(node)
    if numel is not None:
        sink_to_outputs(g, numel)
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


def is_gather_bucket(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "").startswith(GATHER_PREFIX)


def prefetch_gathers(g: fx.Graph) -> int:
    """Issue each bucket of parameter all_gathers (:func:`metadist_torch.lower.coalesce.coalesce_all_gathers`) just
    before the program waits for the bucket before it, as FSDP prefetches the next block's parameters: it
    is gathered while the ops reading the one before compute, at the price of one more bucket held.
    Buckets keep their order (the same on every rank). Run after :func:`issue_early`, which puts each
    ``md_done`` at its first reader. Returns how many buckets moved."""
    calls = [n for n in g.nodes if is_gather_bucket(n)]
    moved = 0
    for prev, nxt in zip(calls, calls[1:]):
        order = {n: i for i, n in enumerate(g.nodes)}
        waits = [d for it in prev.users for d in it.users if is_done(d)]
        if not waits:
            continue
        at = min(waits, key=lambda n: order[n])
        if order[at] >= order[nxt] or any(order[a] >= order[at] for a in nxt.all_input_nodes):
            continue
        items = sorted(
            (u for u in nxt.users if u.op == "call_function" and u.target is operator.getitem), key=lambda n: order[n]
        )
        for n in [nxt] + items:
            at.prepend(n)
        moved += 1
    return moved


__all__ = [
    "issue_early",
    "prefetch_gathers",
    "is_gather_bucket",
    "hoist_input_chains",
    "sink_to_outputs",
    "md_wait",
    "is_async",
    "is_done",
]
