"""Run each state update in the state's own storage, as an eager optimizer does (``exp_avg.lerp_(grad, w)``).

A traced step is functional: AdamW's update of a parameter is ``p2 = mul(p, 1 - lr*wd)``,
``p3 = addcdiv(p2, m, d)``, each a fresh tensor, and the program then copies ``p3`` back into ``p``.
On a CPU that is an allocation, a write to cold memory and a copy per op and state tensor, which makes
the per-rank AdamW update slower than torch's own.

:func:`reinplace_updates` finds, for each state input, the *update chain*: the ops from the input to its
new value where each op's first argument is the previous value and nothing else reads that value. When
every other reader of the old value (and of every tensor that may share its storage) runs before the
chain starts, and every op of the chain is a pointwise aten op with an in-place overload that keeps the
dtype, the chain runs in place (``aten.mul_``, ``aten.lerp_``, ``aten.addcdiv_``...) and the program
returns the input itself: no new tensors, no copy back. Values are unchanged: an in-place pointwise op
computes the same result into ``self`` when the result has ``self``'s dtype and shape (a shape that does
not fit raises, it is never cut).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

Layout = Callable[[fx.Node], "tuple[tuple[int, ...], Any] | None"]


def inplace_overload(target: Any) -> Any | None:
    """The in-place aten overload of a pointwise aten op whose first argument is ``self`` (None: none)."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return None
    args = target._schema.arguments
    if not args or args[0].name != "self" or target._schema.returns[0].alias_info is not None:
        return None
    packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1] + "_", None)
    inplace = getattr(packet, target._overloadname, None) if packet is not None else None
    if inplace is None or [a.name for a in inplace._schema.arguments] != [a.name for a in args]:
        return None
    return inplace


def _may_alias(node: fx.Node) -> bool:
    """Whether ``node``'s result may share its inputs' storage: an aten view, or anything not an aten op
    (a collective, a getitem, a local split) -- assumed to, to be safe."""
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in t._schema.returns)
    return True


def input_aliases(g: fx.Graph) -> set[fx.Node]:
    """The placeholders and every node that may share storage with one (whose value an update in place or a
    state written back may change later in the program)."""
    return _aliases(*[n for n in g.nodes if n.op == "placeholder"])[0]


def _aliases(*phs: fx.Node) -> tuple[set[fx.Node], set[fx.Node]]:
    """``(aliases, readers)``: the nodes that may share storage with one of ``phs`` (``phs`` among them) and
    every node that reads one of them."""
    seen, todo, out = set(phs), list(phs), set()
    while todo:
        n = todo.pop()
        for u in n.users:
            out.add(u)
            if u not in seen and _may_alias(u):
                seen.add(u)
                todo.append(u)
    return seen, out


def _chain(ph: fx.Node, new: fx.Node, layout: Layout) -> list[fx.Node] | None:
    """The update chain from ``ph`` to ``new`` (first op first), or None when it cannot run in place."""
    chain = [new]
    while True:
        n = chain[-1]
        if (
            n.op != "call_function"
            or not n.args
            or not isinstance(n.args[0], fx.Node)
            or inplace_overload(n.target) is None
        ):
            return None
        self_ = n.args[0]
        if any(a is self_ for a in list(n.args[1:]) + list(n.kwargs.values())):
            return None  # aten.mul_(a, a): not promised sound
        lo, li = layout(n), layout(self_)
        if lo is None or li is None or lo != li:
            return None
        if self_ is ph:
            return chain[::-1]
        if self_.op != "call_function" or len(self_.users) != 1:
            return None
        chain.append(self_)


def reinplace_updates(
    g: fx.Graph, updates: Sequence[tuple[fx.Node, int]], keep: Sequence[int], layout: Layout
) -> list[int]:
    """Run the update chains of ``updates`` (state placeholder, index of its new value among the graph's
    outputs) in place; a new value is then the placeholder itself, returned as that output.

    ``keep``: output indices the caller hands out as fresh tensors (the step's own results), never
    reinplaced. ``layout(node)``: its (shape, dtype), None when unknown. Returns the output indices
    rewritten."""
    out = next(n for n in g.nodes if n.op == "output")
    vals = list(out.args[0])
    order = {n: i for i, n in enumerate(g.nodes)}
    kept = {vals[i] for i in keep}
    done: list[int] = []
    for ph, k in updates:
        new = vals[k]
        if (
            not isinstance(new, fx.Node)
            or new is ph
            or new in kept
            or new.op == "placeholder"
            or sum(1 for v in vals if v is new) > 1
        ):
            continue
        chain = _chain(ph, new, layout)
        if chain is None:
            continue
        aliases, readers = _aliases(ph)
        first = chain[0]
        if any(order[r] >= order[first] for r in readers - {first}):
            continue  # the old value is still read after the update starts
        if any(isinstance(a, fx.Node) and a in aliases for a in list(first.args[1:]) + list(first.kwargs.values())):
            continue  # the first op also reads a view of what it would overwrite
        for n in chain:
            n.target = inplace_overload(n.target)
        vals[k] = ph
        done.append(k)
    out.args = (tuple(vals),)
    return done


def layout_from_meta(node: fx.Node) -> tuple[tuple[int, ...], Any] | None:
    """(shape, dtype) of a traced node from its fake value (``meta["val"]``)."""
    v = node.meta.get("val")
    return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None


__all__ = ["reinplace_updates", "inplace_overload", "layout_from_meta", "input_aliases"]
