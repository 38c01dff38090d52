"""An op a distributed implementation runs, as a node of the rank program: the implementation's torch
``lower`` hook called as the aten op is called, with ``comm`` added: the
:class:`~metadist_torch.lower.collectives.AxisComm` of its mesh axis (the process group, the axis size and
this rank's coordinate on it, and the stats its collectives count in)."""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Sequence

import torch.fx as fx

from metadist_core.discovery.distimpl import DistImplRegistry
from metadist_core.ir.ir import MetaOp

from ..trace.calls import rebuild
from .collectives import AxisComm

FRONTEND = "torch"


def _called(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function called ``name`` around ``fn`` (fx prints call targets by name), keywords passed on."""

    def f(*a: Any, **kw: Any) -> Any:
        return fn(*a, **kw)

    f.__name__ = f.__qualname__ = name
    return f


def impl_node(
    g: fx.Graph,
    op: MetaOp,
    ins: Sequence[fx.Node],
    impl: str,
    comm: AxisComm,
    registry: DistImplRegistry,
    name: str,
    select_fn: Callable[..., Any],
    item: Callable[[fx.Node], fx.Node],
) -> tuple[fx.Node, list[fx.Node]]:
    """The node calling implementation ``impl`` of ``op`` on this rank's pieces ``ins`` over ``comm``'s axis,
    and one node per op output (``op.attrs["select"]`` picks them from the call's results, as for the op)."""
    hook = registry.hook(impl, FRONTEND, "lower")
    target = _called(f"md_{impl.replace('.', '_')}_axis{comm.axis}", functools.partial(hook, comm=comm))
    args = rebuild(op.attrs.get("args", []), ins, item=item)
    kwargs = rebuild(op.attrs.get("kwargs", {}), ins, item=item)
    node = g.create_node("call_function", target, tuple(args), kwargs, name=name)
    select = op.attrs.get("select")
    if select is None:
        return node, [node]
    picked = g.call_function(select_fn, (node, list(select)))
    return node, [g.call_function(operator.getitem, (picked, i)) for i in range(len(op.outputs))]


__all__ = ["impl_node"]
