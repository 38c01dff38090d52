"""Clean-up passes over a traced fx graph: detaches, profiler records and input copies dropped, random seeds
drawn by shape, and the step counters of several optimizers merged into one."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


from .state import (
    StepState,
)
from .to_ir import target_key

log = logging.getLogger("metadist.torch.trace")

PROFILER_PREFIX = ("profiler.",)  # op keys of the profiler's record functions, dropped from the graph


def _drop_detach(gm: fx.GraphModule) -> None:
    """``detach`` is the identity in a graph without autograd: read its input instead."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)


def _seed_by_shape(gm: fx.GraphModule) -> None:
    """``ones_like(loss)``, the backward's seed, reads the loss only for its shape: a 0-d one becomes a constant
    ``full([], 1)`` of its dtype and device, so that on many ranks the backward does not wait for the loss's
    all_reduce (only its gradient scale, the token count, is needed, and that is known from the inputs)."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.ones_like.default:
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() != 0:
            continue
        with gm.graph.inserting_before(n):
            f = gm.graph.call_function(
                torch.ops.aten.full.default, ([], 1), {"dtype": v.dtype, "device": v.device, "pin_memory": False}
            )
        f.meta.update(n.meta)
        n.replace_all_uses_with(f)
        gm.graph.erase_node(n)


def merge_step_counters(gm: fx.GraphModule, state: StepState) -> dict[int, int]:
    """Read one step counter for all parameters whose counters are equal now, then share the work.

    Optimizers keep a ``step`` tensor per parameter and compute the same bias
    corrections from each; where the counters hold the same value, all readers
    read the first one and common subexpressions are merged. Kept only when
    every merged counter's updated value is then the same graph value (so they
    stay equal after every step); otherwise the graph is left as it was. The
    graph is changed in place and not recompiled (the caller does that once).
    Returns ``{state slot: the slot it is read as}`` of the counters merged: the program is right only while
    they stay equal (a guard, :mod:`metadist_torch.trace.watch`).
    """
    n_p, n_b = len(state.params), len(state.buffers)
    first: dict[tuple, int] = {}
    merged: dict[int, int] = {}
    for j, slot in enumerate(state.opt_states):
        if slot.key != "step":
            continue
        v = slot.get()
        v = getattr(v, "_local_tensor", v)
        if not isinstance(v, torch.Tensor) or v.numel() != 1:
            continue
        # on the meta device (a model planned, never run) every counter is the zero init_optimizer_state made
        value = 0.0 if v.device.type == "meta" else float(v.reshape(()).item())
        k = (str(v.dtype), str(v.device), value)
        i = n_p + n_b + j
        if k in first:
            merged[i] = first[k]
        else:
            first[k] = i
    if not merged:
        return {}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rep = _value_numbers(gm.graph, {phs[i]: phs[i0] for i, i0 in merged.items()})
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(out.args[0])
    outs = flat[len(flat) - len(state.slots) :]
    for i, i0 in merged.items():
        if rep.get(outs[i], outs[i]) is not rep.get(outs[i0], outs[i0]):
            log.debug("step counters update differently; not merged")
            return {}
    for n in gm.graph.nodes:
        if rep[n] is not n:
            n.replace_all_uses_with(rep[n])
    gm.graph.eliminate_dead_code()
    return {i - n_p - n_b: i0 - n_p - n_b for i, i0 in merged.items()}


def _frozen(v: Any) -> Any:
    """A hashable key of an argument, the Python type kept (``mul(x, 1)`` and ``mul(x, 1.0)`` differ)."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_frozen(a) for a in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _frozen(a)) for k, a in v.items())))
    if isinstance(v, fx.Node):
        return v
    return (type(v).__name__, v)


def _value_numbers(graph: fx.Graph, same: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    """Common subexpressions: per node, the first node of the graph computing the same value, reading the
    placeholders ``same`` maps as the ones they map to. Random and impure ops are never merged, nor constants
    made from no value (``scalar_tensor(1.0)``): each is made where it is read, so that one shared by the
    device's ops and the host's (``offload``) never crosses between them."""
    from torch.fx.passes.dialect.common.cse_pass import get_CSE_banned_ops

    banned = set(get_CSE_banned_ops())
    rep: dict[fx.Node, fx.Node] = {}
    seen: dict[tuple, fx.Node] = {}
    for n in graph.nodes:
        rep[n] = n
        if n.op == "placeholder":
            rep[n] = same.get(n, n)
            continue
        t = n.target
        if (
            n.op != "call_function"
            or not n.all_input_nodes
            or getattr(t, "overloadpacket", t) in banned
            or (
                isinstance(t, torch._ops.OpOverload)
                and (torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable)
            )
        ):
            continue
        key = (
            t,
            _frozen(fx.node.map_arg(n.args, lambda a: rep[a])),
            _frozen(fx.node.map_arg(n.kwargs, lambda a: rep[a])),
        )
        try:
            rep[n] = seen.setdefault(key, n)
        except TypeError:  # an unhashable argument: left alone
            pass
    return rep


def _drop_profiler_nodes(gm: fx.GraphModule) -> None:
    """Remove ``profiler._record_function_*`` nodes (exit nodes first, then the enter nodes they read)."""
    g = gm.graph
    for _ in range(2):
        for n in reversed(list(g.nodes)):
            if n.op == "call_function" and (target_key(n.target) or "").startswith(PROFILER_PREFIX) and not n.users:
                g.erase_node(n)


def _drop_input_copies(gm: fx.GraphModule) -> None:
    """Remove ``copy_(placeholder, value)`` that functionalization adds for mutated inputs."""
    g = gm.graph
    for n in list(g.nodes):
        if (
            n.op == "call_function"
            and n.target is torch.ops.aten.copy_.default
            and n.args[0].op == "placeholder"
            and not n.users
        ):
            g.erase_node(n)


__all__ = ["merge_step_counters"]
