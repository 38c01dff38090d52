"""An fx graph of a traced step -> MetaIR, with the attrs encoding of :mod:`metadist_core.ir.recorded`.

Roles are parameter / buffer / optimizer_state / input (tensor constants of
the graph become buffer inputs fed after the user's inputs); each state input
is aliased to its updated value; ops returning tuples keep the positions the
graph uses in ``attrs["select"]``.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from metadist_core.ir.ir import MetaIR, canonical_dtype

from .hyper import ATTR_PREFIX
from .state import ROLE_BUFFER, ROLE_INPUT, StepState

ROLE_HYPER = "hyperparameter"  # a param group's number, fed at every call (metadist_torch.trace.hyper)


class TraceError(RuntimeError):
    """The step could not be traced into one functional graph."""


def target_key(t: Any) -> str | None:
    """The MetaIR op key of an fx call target (``aten.mm.default``), or None for anything not an op overload."""
    if isinstance(t, torch._ops.OpOverload):
        ns = t.namespace
        name = t._schema.name.split("::")[-1]
        return f"{ns}.{name}.{t._overloadname}"
    return None


@dataclass
class Conversion:
    """A MetaIR of a functional step graph and how the graph's inputs and outputs map onto it."""

    graph: MetaIR
    in_names: list[str]  # placeholder (MetaIR input) ids, in call order, then the constants'
    constants: list[torch.Tensor]  # values of get_attr tensor constants, fed after the user inputs
    state_out: list[int | None]  # per state slot: index into flat outputs of its new value, or None (unchanged)
    out_vars: list[str | None]  # per flat graph output: MetaIR var id (None for constants)
    random_ops: list[str] = field(default_factory=list)


def _encode_const(x: Any) -> Any:
    if isinstance(x, torch.dtype):
        return {"$dtype": canonical_dtype(x)}
    if isinstance(x, torch.device):
        # no index: every rank runs on its own current device, and all ranks must trace the same graph
        return {"$device": x.type if x.type != "cpu" else "cpu"}
    if isinstance(x, (torch.memory_format, torch.layout)):
        return {"$torch": str(x).split(".")[-1]}
    if isinstance(x, (list, tuple)):
        return [_encode_const(y) for y in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return x
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, torch.SymInt):  # pragma: no cover - static shapes only
        return int(x)
    raise TraceError(f"cannot encode argument {x!r} of type {type(x).__name__}")


def state_label(state: StepState, i: int) -> str:
    """The user's name of state slot ``i``: ``blocks.0.fc.weight``, and ``blocks.0.fc.weight.exp_avg`` for
    the optimizer state of that parameter."""
    name = state.slots[i].name
    m = re.match(r"^opt\d+\.state\[(\d+)\]\.(.+)$", name)
    if m and int(m.group(1)) < len(state.params):
        return f"{state.params[int(m.group(1))].name}.{m.group(2)}"
    return name


def _experts_of(slot: Any) -> int | None:
    """The number of experts a parameter's dim 0 indexes, for the weights of a mixture-of-experts layer."""
    from ..moe.moe import is_experts_module

    owner, value = slot.owner, slot.get()
    if isinstance(owner, torch.nn.Module) and is_experts_module(owner) and value.dim() >= 2:
        return owner.num_experts if value.shape[0] == owner.num_experts else None
    return None


def is_annotation(target: Any) -> bool:
    """Is this fx call target ``metadist::annotate`` (:func:`metadist_torch.annotate`)?"""
    return (
        isinstance(target, torch._ops.OpOverload)
        and target.namespace == "metadist"
        and target._schema.name.split("::")[-1] == "annotate"
    )


def decode_placements(text: str) -> tuple:
    """The placements ``metadist::annotate`` carries, from their short forms (``"S(0),R"``)."""
    from metadist_core.ir.placement import parse_placement

    return tuple(parse_placement(p) for p in str(text).split(","))


def _val_meta(val: Any) -> tuple[tuple[int, ...], str] | None:
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape), canonical_dtype(val.dtype)
    return None


def to_meta_ir(gm: fx.GraphModule, state: StepState, n_inputs: int, n_user_out: int, name: str) -> Conversion:
    """The MetaIR of ``gm``: ``(state, user inputs) -> (user tensor outputs, new state)``."""
    g = MetaIR(name)
    slots = state.slots
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(slots) + n_inputs:
        raise TraceError(
            f"traced graph has {len(placeholders)} inputs; expected {len(slots)} state tensors + {n_inputs} inputs"
        )
    in_names: list[str] = []
    for i, ph in enumerate(placeholders):
        meta = _val_meta(ph.meta.get("val"))
        role = slots[i].role if i < len(slots) else ROLE_INPUT
        mv = g.add_input(ph.name, meta[0] if meta else None, meta[1] if meta else "float32", role)
        mv.label = state_label(state, i) if i < len(slots) else None
        mv.experts = _experts_of(slots[i]) if i < len(slots) and slots[i].role == "parameter" else None
        in_names.append(ph.name)
    constants: list[torch.Tensor] = []
    random_ops: list[str] = []
    var_of: dict[fx.Node, str] = {ph: ph.name for ph in placeholders}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            val = getattr(gm, n.target)
            if not isinstance(val, torch.Tensor):
                raise TraceError(f"graph attribute {n.target!r} is not a tensor")
            role = ROLE_HYPER if str(n.target).startswith(ATTR_PREFIX) else ROLE_BUFFER
            g.add_input(n.name, tuple(val.shape), canonical_dtype(val.dtype), role)
            in_names.append(n.name)
            constants.append(val)
            var_of[n] = n.name
    # getitem folding
    picks: dict[fx.Node, dict[int, fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            picks.setdefault(n.args[0], {}).setdefault(n.args[1], n)
    alias_getitem: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            first = picks[n.args[0]][n.args[1]]
            if first is not n:
                alias_getitem[n] = first
    item_of: dict[fx.Node, fx.Node] = {}  # a 0-d tensor's number passed to an op (metadist_torch.trace.hyper)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if (
            n.target is torch.ops.aten._local_scalar_dense.default
            and isinstance(n.args[0], fx.Node)
            and n.args[0] in var_of
            and all(u.op == "call_function" for u in n.users)
        ):
            item_of[n] = n.args[0]  # its readers take the tensor as an input, as a number: {"$item": i}
            continue
        if is_annotation(n.target):  # metadist_torch.annotate: the value itself, pinned (no op of its own)
            src = alias_getitem.get(n.args[0], n.args[0])
            var_of[n] = var_of[src]
            g.annotations[var_of[src]] = decode_placements(n.args[1])
            continue
        key = target_key(n.target)
        if key is None:
            raise TraceError(f"graph node {n.name} calls {n.target!r}, which is not a torch op overload")
        if torch.Tag.nondeterministic_seeded in n.target.tags:
            random_ops.append(n.name)
        op_inputs: list[str] = []

        def enc(x: Any) -> Any:
            if isinstance(x, fx.Node) and x in item_of:
                op_inputs.append(var_of[item_of[x]])
                return {"$item": len(op_inputs) - 1}
            if isinstance(x, fx.Node):
                x = alias_getitem.get(x, x)
                if x not in var_of:
                    raise TraceError(f"graph node {n.name} ({key}) reads {x.name}, which is not a tensor value")
                op_inputs.append(var_of[x])
                return {"$in": len(op_inputs) - 1}
            if isinstance(x, (list, tuple)):
                return [enc(y) for y in x]
            return _encode_const(x)

        args = [enc(a) for a in n.args]
        kwargs = {k: enc(v) for k, v in n.kwargs.items()}
        attrs: dict[str, Any] = {"args": args, "kwargs": kwargs}
        val = n.meta.get("val")
        meta = _val_meta(val)
        if meta is not None:
            outs = [(n.name, meta[0], meta[1])]
            out_nodes = [n]
        elif isinstance(val, (list, tuple)):
            taken = sorted(picks.get(n, {}).items())
            outs, out_nodes, sel = [], [], []
            for idx, gi in taken:
                gm_ = _val_meta(gi.meta.get("val"))
                if gm_ is None:
                    raise TraceError(f"{gi.name} = {n.name}[{idx}] is not a tensor")
                outs.append((gi.name, gm_[0], gm_[1]))
                out_nodes.append(gi)
                sel.append(idx)
            attrs["select"] = sel
            if not outs:
                continue  # nothing used
        else:
            if n.users:
                raise TraceError(
                    f"graph node {n.name} ({key}) returns {type(val).__name__}, not a tensor; "
                    f"data-dependent Python values cannot be planned"
                )
            continue
        g.add_op(key, op_inputs, outs, attrs, id=n.name, payload=n)
        for on in out_nodes:
            var_of[on] = on.name
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = list(pytree.tree_leaves(output_node.args[0]))
    out_vars: list[str | None] = []
    for o in flat_out:
        if isinstance(o, fx.Node):
            o = alias_getitem.get(o, o)
            out_vars.append(var_of[o])
        else:
            out_vars.append(None)
    n_state = len(slots)
    if len(out_vars) != n_user_out + n_state:
        raise TraceError(f"traced graph has {len(out_vars)} outputs, expected {n_user_out} + {n_state} state")
    state_out: list[int | None] = []
    aliases: dict[str, str] = {}
    graph_outs: list[str] = []
    for i in range(n_user_out):
        if out_vars[i] is None:
            raise TraceError("a returned tensor folded to a constant")
        graph_outs.append(out_vars[i])
    for k in range(n_state):
        v = out_vars[n_user_out + k]
        src = in_names[k]
        if v is None or v == src:
            state_out.append(None)
            continue
        state_out.append(n_user_out + k)
        graph_outs.append(v)
        aliases[src] = v
    # graph outputs: distinct, in order (MetaIR keeps a list; duplicates would be harmless but confusing)
    seen: set[str] = set()
    uniq = [o for o in graph_outs if not (o in seen or seen.add(o))]
    g.set_outputs(uniq)
    for s, v in aliases.items():
        g.alias(s, v)
    g.validate()
    return Conversion(g, in_names, constants, state_out, out_vars, random_ops)


__all__ = ["Conversion", "TraceError", "target_key", "to_meta_ir"]
