"""Which values of a traced step are parameter gradients (MetaIR role ``"gradient"``).

While the step is traced, a step pre-hook on every optimizer records a clone
of each parameter's ``.grad`` as the optimizer is about to read it (the last
one, when a step calls ``step()`` more than once). The clones are extra
outputs of the traced function, so they survive functionalization; then
:func:`strip_gradients` removes them again and names the values they copied.
Those are exactly the gradients the optimizer update reads, however the
backward computed them (autocast casts, tied weights, accumulation).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Iterator, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


@contextlib.contextmanager
def capture_gradients(
    optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> Iterator[dict[int, torch.Tensor]]:
    """Record ``{index in params: clone of its .grad}`` before each ``optimizer.step()`` inside the block."""
    index = {id(p): i for i, p in enumerate(params)}
    box: dict[int, torch.Tensor] = {}

    def hook(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                i = index.get(id(p))
                if i is not None and isinstance(p.grad, torch.Tensor):
                    box[i] = p.grad.detach().clone()

    handles = [opt.register_step_pre_hook(hook) for opt in optimizers]
    try:
        yield box
    finally:
        for h in handles:
            h.remove()


def strip_gradients(gm: fx.GraphModule, n_grads: int, recompile: bool = True) -> list[str]:
    """Drop the last ``n_grads`` graph outputs (gradient clones); the names of the values they copied.

    A duplicate ``getitem`` is named by the first ``getitem`` of the same
    output, as :func:`metadist_torch.trace.to_ir.to_meta_ir` folds them.
    """
    if n_grads == 0:
        return []
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat, spec = pytree.tree_flatten(out.args[0])
    kept, grads = flat[: len(flat) - n_grads], flat[len(flat) - n_grads :]
    first: dict[tuple, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            first.setdefault((n.args[0], n.args[1]), n)
    names = []
    for g in grads:
        if not isinstance(g, fx.Node):
            continue
        src = g.args[0] if g.op == "call_function" and g.target is torch.ops.aten.clone.default else g
        if isinstance(src, fx.Node) and src.op == "call_function":
            if src.target is operator.getitem:
                src = first[(src.args[0], src.args[1])]
            if len(src.users) == 1:  # a view functionalization made again for the clone only
                src = _read_twin(gm, src)
            names.append(src.name)
    out.args = (tuple(kept),)
    gm.graph.eliminate_dead_code()
    if recompile:
        gm.recompile()
    return names


VIEWS = (torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _read_twin(gm: fx.GraphModule, src: fx.Node) -> fx.Node:
    """A value the graph reads that equals ``src``, a view that functionalization made again after an
    in-place update of a gradient (``t(t(x))`` is ``x``; ``view(view(x))`` of ``x``'s shape is ``x``;
    the same call twice is one value); ``src`` itself when there is none."""
    for n in gm.graph.nodes:
        if (
            n is not src
            and n.op == "call_function"
            and n.target is src.target
            and n.args == src.args
            and n.kwargs == src.kwargs
            and n.users
        ):
            return n
    inner = src.args[0] if src.args else None
    if src.target in VIEWS and isinstance(inner, fx.Node) and inner.target in VIEWS and inner.args:
        base = inner.args[0]
        shape = getattr(src.meta.get("val"), "shape", None)
        if isinstance(base, fx.Node) and shape is not None and getattr(base.meta.get("val"), "shape", None) == shape:
            return base
    return src


__all__ = ["capture_gradients", "strip_gradients"]
