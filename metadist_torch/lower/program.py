"""The runnable steps ``TorchFrontend.lower`` returns, and the state stored as the plan says.

Both take the user's ``(*args, **kwargs)`` and return what the step returns.
:class:`LocalProgram` (world size 1) runs the traced functional graph on
plain tensors. :class:`RankProgram` feeds this rank's local pieces to the
rank's fx program (:class:`~metadist_torch.lower.lower.RankGraph`), returns whole
outputs and writes the new state shards back in place. :func:`place_state`
stores parameters, buffers and optimizer state as DTensors with the plan's
placements, so that ``torch.distributed.checkpoint`` can save them.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from metadist_core.ir.placement import Sharding, local_piece

from ..runtime.eager import attach as attach_eager
from ..runtime.engine import Engine
from .lower import RankGraph
from .reinplace import layout_from_meta, reinplace_updates
from ..trace.state import ROLE_BUFFER, ROLE_PARAM
from ..runtime.stats import CommStats
from ..trace.trace import TracedStep


def user_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments, in the order tracing saw them, detached."""
    leaves = pytree.tree_leaves((list(args), dict(kwargs)))
    return [x.detach() for x in leaves if isinstance(x, torch.Tensor)]


def moved_once(user: list[torch.Tensor], user_in: dict[str, int], device: Any) -> Callable[[str], torch.Tensor]:
    """``whole(var)``: user input ``var`` on ``device``, moved once per call however many layouts read it."""
    moved: dict[str, torch.Tensor] = {}

    def whole(v: str) -> torch.Tensor:
        if v not in moved:
            moved[v] = user[user_in[v]].to(device)
        return moved[v]

    return whole


def input_pieces(lowered: RankGraph, whole: Callable[[str], torch.Tensor], engine: Engine) -> list[torch.Tensor]:
    """This rank's slice of each user input the program reads in another layout (``lowered.input_pieces``);
    ``whole(var)``: the whole input on this rank's device (:func:`moved_once`)."""
    return [
        local_piece(whole(v), sh, engine.mesh, engine.coords, zeros_like=torch.zeros_like)
        for v, sh in lowered.input_pieces
    ]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a plain tensor is its own)."""
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t


LAYOUT_ATTR = "_metadist_layout"  # on each module and optimizer: the token of the program its state is placed for
_TOKENS = itertools.count(1)


def claim_layout(traced: TracedStep, plan: Any, engine: Engine, token: int) -> None:
    """Store the step's state as ``plan`` wants it, unless the program of ``token`` placed it last: another
    compiled program of the same model (another signature, a re-plan after a guard, an eval step) may have
    stored it in its own layout since."""
    owners = [*traced.state.modules, *traced.state.optimizers]
    if engine.distributed and any(getattr(o, LAYOUT_ATTR, None) != token for o in owners):
        place_state(traced, plan, engine)
        for o in owners:
            o.__dict__[LAYOUT_ATTR] = token


class LocalProgram:
    """World size 1: the traced functional graph on plain tensors. State updates run in the state's storage
    where they can (:func:`metadist_torch.lower.reinplace.reinplace_updates`, ``reinplace``); any other new state
    is swapped in with ``.data``."""

    def __init__(self, traced: TracedStep, reinplace: bool = True) -> None:
        self.traced = traced
        self.gm = traced.gm
        self.inplace_updates: list[str] = []  # the state values updated in their own storage
        writes = [(k, o) for k, o in enumerate(traced.state_out) if o is not None]
        if reinplace and writes:
            g = fx.Graph()
            g.output(g.graph_copy(traced.gm.graph, {}))  # node meta (the fake values) copied along
            phs = [n for n in g.nodes if n.op == "placeholder"]
            done = set(
                reinplace_updates(g, [(phs[k], o) for k, o in writes], range(traced.n_tensor_outputs), layout_from_meta)
            )
            if done:
                self.gm = fx.GraphModule(traced.gm, g)
            self.inplace_updates = [traced.in_names[k] for k, o in writes if o in done]
            writes = [(k, o) for k, o in writes if o not in done]
        self.writes = writes
        self.stats = CommStats()  # nothing to count on one device
        self.compiled: Callable | None = None  # gm compiled (metadist_torch.lower.compiled), run in its place

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.traced.refresh()
        vals = [s.get() for s in self.traced.state.slots]
        with torch.no_grad():
            outs = (self.compiled or self.gm)(*vals, *self.traced.inputs(args, kwargs))
            # one value written to several slots (step counters read as one), or a slot's own tensor: each
            # slot keeps storage of its own, else a later program updating one would update them all
            held = {id(v) for v in vals}
            for k, o in self.writes:
                new = outs[o]
                if id(new) in held:
                    new = new.clone()
                vals[k].data = new
                held.add(id(new))
        return self.traced.unflatten_outputs(list(outs[: self.traced.n_tensor_outputs]))


class RankProgram:
    """Runs a RankGraph on this rank: local pieces in, whole outputs back, new shards written in place."""

    def __init__(self, traced: TracedStep, lowered: RankGraph, plan: Any, engine: Engine) -> None:
        self.traced, self.lowered, self.plan, self.engine = traced, lowered, plan, engine
        self.stats = lowered.stats
        self.inplace_updates: list[str] = list(lowered.inplace_updates)
        n_s = len(traced.state.slots)
        self.slot_of = {traced.in_names[i]: i for i in range(n_s)}
        self.user_in = {traced.in_names[n_s + j]: j for j in range(traced.n_inputs)}
        rep = Sharding.replicated(engine.mesh.ndim)
        self.const_local = {}
        for k, name in enumerate(traced.in_names[n_s + traced.n_inputs :]):
            sh = plan.input_shardings.get(name, rep)
            self.const_local[name] = local_piece(
                traced.constant_on(k, engine.device), sh, engine.mesh, engine.coords, zeros_like=torch.zeros_like
            )
        self.in_shardings = [plan.input_shardings.get(v, rep) for v in lowered.input_vars]
        out_index = {v: i for i, v in enumerate(lowered.output_vars)}
        missing = [v for v in traced.out_vars[: traced.n_tensor_outputs] if v is not None and v not in out_index]
        if missing:
            raise ValueError(
                f"the step returns {', '.join(missing)}, which it also writes back as state; "
                f"return a copy (.clone()) or a value computed from it"
            )
        self.out_pos = [out_index[v] for v in traced.out_vars[: traced.n_tensor_outputs]]
        n_out = len(lowered.output_vars)
        self.state_write = [(n_out + i, self.slot_of[s]) for i, s in enumerate(lowered.state_inputs)]
        self.layout = next(_TOKENS)
        claim_layout(traced, plan, engine, self.layout)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.traced.refresh()
        claim_layout(self.traced, self.plan, self.engine, self.layout)
        slots = self.traced.state.slots
        mesh, coords, dev = self.engine.mesh, self.engine.coords, self.engine.device
        whole = moved_once(self.traced.inputs(args, kwargs), self.user_in, dev)
        local = []
        for v, sh in zip(self.lowered.input_vars, self.in_shardings):
            i = self.slot_of.get(v)
            if i is not None:
                local.append(local_of(slots[i].get()))
            elif v in self.user_in:
                local.append(local_piece(whole(v), sh, mesh, coords, zeros_like=torch.zeros_like))
            else:
                local.append(self.const_local[v])
        local += input_pieces(self.lowered, whole, self.engine)
        with torch.no_grad():
            outs = self.lowered(*local)
            for k, i in self.state_write:
                dst = local_of(slots[i].get())
                if outs[k] is not dst:  # an update run in place returns the state itself
                    dst.copy_(outs[k])
        return self.traced.unflatten_outputs([outs[k] for k in self.out_pos])


def _placements(sh: Sharding) -> list:
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in sh:
        if p.is_shard():
            out.append(Shard(p.dim))
        elif p.is_replicate():
            out.append(Replicate())
        else:
            raise ValueError(f"state cannot be stored as {p}; only Shard and Replicate")
    return out


def _optimizers_holding(new_param: dict[int, Any], known: list) -> list:
    """The live optimizers that hold any of the replaced parameters: those of the step, and any the user keeps
    outside it (a step that only runs the backward, its optimizer stepped in the loop)."""
    import gc

    seen = {id(o) for o in known}
    out = list(known)
    for o in gc.get_objects():
        if (
            issubclass(type(o), torch.optim.Optimizer)
            and id(o) not in seen
            and any(id(p) in new_param for g in o.param_groups for p in g["params"])
        ):
            out.append(o)
            seen.add(id(o))
    return out


def place_state(traced: TracedStep, plan: Any, engine: Engine) -> None:
    """Store every parameter, buffer and optimizer state tensor as a DTensor with the plan's placements.

    Parameters become DTensor ``nn.Parameter``s in their modules; every
    optimizer's param groups and state are re-keyed to them.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    dm = engine.device_mesh
    rep = Sharding.replicated(engine.mesh.ndim)
    st = traced.state
    new_param: dict[int, torch.nn.Parameter] = {}
    for k, slot in enumerate(st.slots):
        want = _placements(plan.input_shardings.get(traced.in_names[k], rep))
        cur = slot.get()
        if isinstance(cur, DTensor):
            if tuple(cur.placements) == tuple(want):
                continue
            with torch.no_grad():
                dt = cur.redistribute(dm, want)
            if slot.role == ROLE_PARAM:
                dt = DTensor.from_local(
                    dt.to_local(), dm, want, run_check=False, shape=cur.shape, stride=cur.stride()
                )  # re-wrapped below
        else:
            with torch.no_grad():
                dt = distribute_tensor(cur.detach().to(engine.device), dm, want, src_data_rank=None)
        if slot.role == ROLE_PARAM:
            p = torch.nn.Parameter(dt, requires_grad=cur.requires_grad)
            new_param[id(cur)] = p
            slot.owner._parameters[slot.key] = p
        elif slot.role == ROLE_BUFFER:
            slot.owner._buffers[slot.key] = dt
        else:
            slot.owner[slot.key] = dt
    attach_eager(st.modules)
    if not new_param:
        return
    for mod, k, _ in st.tied:
        old_p = mod._parameters.get(k)
        if old_p is not None and id(old_p) in new_param:
            mod._parameters[k] = new_param[id(old_p)]
    for opt in _optimizers_holding(new_param, st.optimizers):
        for g in opt.param_groups:
            g["params"] = [new_param.get(id(p), p) for p in g["params"]]
        state: defaultdict = defaultdict(dict)
        for p, s in opt.state.items():
            state[new_param.get(id(p), p)] = s
        opt.state = state
    st.param_objs = [new_param.get(id(p), p) for p in st.param_objs]


__all__ = [
    "LocalProgram",
    "RankProgram",
    "place_state",
    "claim_layout",
    "user_tensors",
    "local_of",
    "input_pieces",
    "moved_once",
]
