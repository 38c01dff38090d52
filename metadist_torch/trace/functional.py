"""Functionalize a captured step's graph in one pass over its nodes, without tracing it again.

A captured training step mutates few things, in few ways: the optimizer updates its state and the
parameters in place (``mul_``, ``add_``, ``lerp_``, ``addcmul_``, ``addcdiv_`` on placeholders, on the
``detach`` of a parameter, or on its own fresh results), and BatchNorm writes its running statistics
(``_native_batch_norm_legit``). Each such op is replaced by its functional overload (``mul`` for
``mul_``; ``foo_functional`` for an op writing other arguments, whose extra results are the new
values) and every later reader of the mutated tensor reads the newest value instead. Re-tracing the
graph under ``torch.func.functionalize`` gives the same ops, but it runs every op of the step again
(for a large model, a large part of the trace's time).

The pass declines (returns None, and the caller re-traces) wherever aliasing could make the rename
wrong: a mutated tensor that is a view of another (not its ``detach``), a view of a mutated tensor read
after the mutation, an op writing through an ``out=`` argument, an op with no functional overload of the
same arguments, or a functional result whose shape or dtype is not the mutated tensor's (a type
promotion that the in-place op would cast back).
"""

from __future__ import annotations

import logging
from typing import Any

import operator

import torch
import torch.utils._pytree as pytree
from torch import fx

log = logging.getLogger(__name__)
aten = torch.ops.aten
_IDENTITY = {aten.detach.default, aten.alias.default}  # same storage, same shape and strides


class _Decline(Exception):
    """This graph needs the general functionalization."""


def _schema(target: Any):
    return getattr(target, "_schema", None)


def _written(schema) -> list[int]:
    """Positions of the arguments the op writes."""
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _functional_overload(target: Any, written: list[int]):
    """The functional overload of an in-place op and how its results map: ``(op, n_results_of_the_original)``."""
    schema = target._schema
    name = schema.name.split("::")[-1]
    ns = getattr(torch.ops, schema.name.split("::")[0])
    over = target._overloadname
    if written == [0] and name.endswith("_") and not name.startswith("_foreach"):
        cand = getattr(getattr(ns, name[:-1], None), over, None)
        if cand is not None and [a.name for a in cand._schema.arguments] == [a.name for a in schema.arguments]:
            return cand, 0
    packet = getattr(ns, name + "_functional", None)
    cand = getattr(packet, over, None) if packet is not None else None
    if (
        cand is not None
        and [a.name for a in cand._schema.arguments] == [a.name for a in schema.arguments]
        and len(cand._schema.returns) == len(schema.returns) + len(written)
    ):
        return cand, len(schema.returns)
    raise _Decline(f"no functional overload of {schema.name}.{over}")


def _meta_like(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def _check_result(fop, node: fx.Node, args, kwargs, written: list[int], extra: int) -> None:
    """The functional op, run on meta tensors, gives each written argument's shape and dtype."""

    def val(a):
        return _meta_like(a.meta.get("val")) if isinstance(a, fx.Node) else a

    try:
        out = fop(*pytree.tree_map(val, list(args)), **pytree.tree_map(val, dict(kwargs)))
    except Exception as e:  # noqa: BLE001 - any failure: the general path decides
        raise _Decline(f"{fop} on meta tensors: {type(e).__name__}: {e}") from e
    outs = [out] if not extra and not isinstance(out, (tuple, list)) else list(out)
    news = outs[:1] if not extra else outs[extra:]
    for pos, new in zip(written, news):
        ref = node.args[pos].meta.get("val") if isinstance(node.args[pos], fx.Node) else None
        if (
            not isinstance(ref, torch.Tensor)
            or not isinstance(new, torch.Tensor)
            or tuple(new.shape) != tuple(ref.shape)
            or new.dtype != ref.dtype
        ):
            raise _Decline(f"{fop} does not give argument {pos}'s shape and dtype")


def functionalize_in_place(gm: fx.GraphModule) -> bool:
    """Rewrite ``gm``'s in-place ops functionally, in place; False (``gm`` untouched) where it declines."""
    try:
        plan = _plan(gm)
    except _Decline as e:
        log.debug("one-pass functionalization declined: %s", e)
        return False
    _apply(gm, plan)
    return True


def _plan(gm: fx.GraphModule) -> list[tuple]:
    """Check the whole graph first (nothing is changed until every mutation is known to be safe)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    root: dict[fx.Node, fx.Node] = {}  # node -> the storage it names (identity aliases share one)
    views: dict[fx.Node, list[fx.Node]] = {}  # storage -> views of it (other shapes or strides)
    view_of: dict[fx.Node, fx.Node] = {}
    plan = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            root[n] = n
            continue
        schema = _schema(n.target)
        if schema is None:  # getitem and other Python callables: fresh names, but an item of a view is a view
            root[n] = n
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if src is not None and src in view_of:
                views.setdefault(view_of[src], []).append(n)
                view_of[n] = view_of[src]
            continue
        written = _written(schema)
        if any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            raise _Decline(f"{schema.name} writes an out= argument")
        first = n.args[0] if n.args else None
        if n.target in _IDENTITY and isinstance(first, fx.Node):
            root[n] = root.get(first, first)
            continue
        if not written:
            ret = schema.returns[0].alias_info if schema.returns else None
            if ret is not None and isinstance(first, fx.Node):  # a view: shares the storage of its input
                base = view_of.get(first) or root.get(first, first)
                views.setdefault(base, []).append(n)
                view_of[n] = base
            root[n] = n
            continue
        for pos in written:
            a = n.args[pos] if pos < len(n.args) else None
            if not isinstance(a, fx.Node):
                raise _Decline(f"{schema.name} writes a non-node argument")
            if a in view_of or root.get(a, a) in view_of:
                raise _Decline(f"{schema.name} writes a view ({a.name})")
            r = root.get(a, a)
            for v in views.get(r, []):
                if any(order[u] > order[n] for u in v.users):
                    raise _Decline(f"a view of {r.name} ({v.name}) is read after {schema.name} writes it")
        fop, extra = _functional_overload(n.target, written)
        _check_result(fop, n, n.args, n.kwargs, written, extra)
        if written == [0]:
            root[n] = root.get(first, first)  # the in-place result names the written storage
        else:
            root[n] = n
        plan.append((n, fop, extra, written, [root.get(n.args[p], n.args[p]) for p in written]))
    return plan


def _apply(gm: fx.GraphModule, plan: list[tuple]) -> None:
    g = gm.graph
    current: dict[fx.Node, fx.Node] = {}  # storage -> the node holding its newest value
    root: dict[fx.Node, fx.Node] = {}
    todo = {n: (fop, extra, written, roots) for n, fop, extra, written, roots in plan}

    def newest(a: fx.Node) -> fx.Node:  # a reader of a written storage reads its newest value
        return current.get(root.get(a, a), a)

    for n in list(g.nodes):
        if n.op == "call_function" and n.target in _IDENTITY and isinstance(n.args[0], fx.Node):
            root[n] = root.get(n.args[0], n.args[0])
        if n.op in ("output", "call_function", "call_method"):
            n.args = fx.node.map_arg(n.args, newest)
            n.kwargs = fx.node.map_arg(n.kwargs, newest)
        if n not in todo:
            continue
        fop, extra, written, roots = todo[n]
        with g.inserting_after(n):
            new = g.call_function(fop, n.args, n.kwargs)
        new.meta = dict(n.meta)
        if not extra:  # foo_ -> foo: the result is the written tensor's new value; later readers of the
            current[roots[0]] = new  # in-place result (an alias of the storage) read its newest value
            root[new] = roots[0]
            n.replace_all_uses_with(new)
        else:  # foo -> foo_functional: the first results as before, then each written argument's new value
            prev = new
            for k, (pos, r) in enumerate(zip(written, roots)):
                with g.inserting_after(prev):
                    item = g.call_function(operator.getitem, (new, extra + k))
                item.meta = {"val": n.args[pos].meta.get("val")}
                current[r] = item
                prev = item
            n.replace_all_uses_with(new)
            if isinstance(n.meta.get("val"), (tuple, list)):
                new.meta["val"] = tuple(n.meta["val"]) + tuple(n.args[p].meta.get("val") for p in written)
        g.erase_node(n)


__all__ = ["functionalize_in_place"]
