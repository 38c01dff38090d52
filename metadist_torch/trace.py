"""Trace a whole training step (forward, backward, optimizer step, zero_grad) into one functional graph.

How (torch 2.13):

1. The step's state is collected from its arguments: every ``nn.Module``
   (parameters, buffers) and every ``torch.optim.Optimizer`` (its per-parameter
   state). Optimizer state is created lazily on the first ``step()``, so it is
   made eagerly first (:func:`init_optimizer_state`): zero grads, ``lr=0`` and
   ``weight_decay=0``, one ``step()``, every ``step`` counter back to 0.
2. The step runs as a flat function ``(params, buffers, state, *inputs) ->
   (outputs, new params, new buffers, new state)`` under ``make_fx`` with fake
   tensors: the parameters are swapped in with ``_reparametrize_module`` as
   fresh leaves that require grad, the optimizer's ``param_groups`` and
   ``state`` are pointed at the traced tensors. Optimizers run with
   ``capturable=True`` (CPU included, by patching
   ``_get_capturable_supported_devices`` while tracing), so the step counter
   stays a tensor and no ``.item()`` reaches the graph.
3. The captured graph (which still holds in-place updates) is functionalized
   by tracing it again under ``torch.func.functionalize``; profiler nodes and
   the trailing ``copy_`` into placeholders are dropped (the updated values are
   returned anyway).
4. The fx graph becomes MetaIR with the attrs encoding of
   :mod:`metadist_core.recorded`, roles parameter / buffer / optimizer_state /
   input, and aliases from each state input to its updated value.

Caveat: SGD with ``dampening != 0`` starts its momentum buffer by a clone of
the first gradient; the traced step always runs the later-step formula, which
differs on the very first step. A warning says so.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from metadist_core.ir import MetaIR, canonical_dtype

log = logging.getLogger("metadist.torch.trace")

ROLE_PARAM, ROLE_BUFFER, ROLE_STATE, ROLE_INPUT = "parameter", "buffer", "optimizer_state", "input"


class TraceError(RuntimeError):
    """The step could not be traced into one functional graph."""


# -- what the step holds ------------------------------------------------------------------


@dataclass
class StateSlot:
    """One state tensor of the step: where it lives, so that the runner can read and write it back."""

    role: str                      # parameter | buffer | optimizer_state
    name: str                      # readable: "model.fc1.weight", "opt0.state[3].exp_avg"
    owner: Any                     # the module (param/buffer) or the optimizer state dict of one param
    key: str                       # attribute name in the module, or the key in the state dict
    shape: tuple[int, ...]
    dtype: torch.dtype

    def get(self) -> torch.Tensor:
        if self.role == ROLE_PARAM:
            return self.owner._parameters[self.key]
        if self.role == ROLE_BUFFER:
            return self.owner._buffers[self.key]
        return self.owner[self.key]


@dataclass
class StepState:
    """The modules and optimizers found among a step's arguments, and their state tensors in order."""

    modules: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    params: list[StateSlot]
    buffers: list[StateSlot]
    opt_states: list[StateSlot]
    param_objs: list[torch.nn.Parameter]      # the Parameter objects, in the order of ``params``
    tied: list = field(default_factory=list)  # (module, attribute, index into params) of tied weights

    @property
    def slots(self) -> list[StateSlot]:
        return self.params + self.buffers + self.opt_states


def _walk_args(obj: Any, modules: list, optimizers: list, seen: set) -> None:
    if id(obj) in seen:
        return
    if isinstance(obj, torch.nn.Module):
        seen.add(id(obj))
        modules.append(obj)
    elif isinstance(obj, torch.optim.Optimizer):
        seen.add(id(obj))
        optimizers.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _walk_args(x, modules, optimizers, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            _walk_args(x, modules, optimizers, seen)


def collect_state(args: Sequence[Any], kwargs: dict) -> StepState:
    """Find modules and optimizers in ``args``/``kwargs`` and list their parameters, buffers and state."""
    modules: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    seen: set[int] = set()
    _walk_args(list(args) + list(kwargs.values()), modules, optimizers, seen)
    params: list[StateSlot] = []
    buffers: list[StateSlot] = []
    param_objs: list[torch.nn.Parameter] = []
    seen_t: set[int] = set()
    first_index: dict[int, int] = {}
    tied: list[tuple[torch.nn.Module, str, int]] = []
    for mi, m in enumerate(modules):
        prefix = f"m{mi}." if len(modules) > 1 else ""
        for mname, mod in m.named_modules(remove_duplicate=False):
            for k, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) in seen_t:
                    if id(p) in first_index:  # a tied weight: the same Parameter under another name
                        tied.append((mod, k, first_index[id(p)]))
                    continue
                first_index[id(p)] = len(params)
                seen_t.add(id(p))
                params.append(StateSlot(ROLE_PARAM, prefix + (f"{mname}.{k}" if mname else k), mod, k,
                                        tuple(p.shape), p.dtype))
                param_objs.append(p)
            for k, b in list(mod._buffers.items()):
                if b is None or id(b) in seen_t:
                    continue
                seen_t.add(id(b))
                buffers.append(StateSlot(ROLE_BUFFER, prefix + (f"{mname}.{k}" if mname else k), mod, k,
                                         tuple(b.shape), b.dtype))
    # optimizer parameters that no module holds are still state of the step
    for oi, opt in enumerate(optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in seen_t:
                    seen_t.add(id(p))
                    params.append(StateSlot(ROLE_PARAM, f"opt{oi}.param{len(param_objs)}", _Holder(p), "p",
                                            tuple(p.shape), p.dtype))
                    param_objs.append(p)
    opt_states: list[StateSlot] = []
    index = {id(p): i for i, p in enumerate(param_objs)}
    for oi, opt in enumerate(optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                st = opt.state.get(p)
                if not st:
                    continue
                for k in sorted(st):
                    v = st[k]
                    if isinstance(v, torch.Tensor):
                        opt_states.append(StateSlot(ROLE_STATE, f"opt{oi}.state[{index[id(p)]}].{k}", st, k,
                                                    tuple(v.shape), v.dtype))
    return StepState(modules, optimizers, params, buffers, opt_states, param_objs, tied)


class _Holder:
    """A stand-in module for a parameter that only an optimizer holds."""

    def __init__(self, p: torch.Tensor) -> None:
        self._parameters = {"p": p}


# -- optimizer state made eagerly, and the capturable patch ------------------------------


def init_optimizer_state(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Create every optimizer's lazy per-parameter state with a step that changes nothing."""
    for opt in optimizers:
        missing = [p for g in opt.param_groups for p in g["params"] if not opt.state.get(p)]
        if not missing:
            continue
        for g in opt.param_groups:
            if g.get("dampening", 0) and g.get("momentum", 0):
                warnings.warn("metadist: SGD with dampening != 0 starts its momentum buffer by cloning the first "
                              "gradient; the compiled step uses the later-step formula from the first step on, "
                              "so the first update differs from eager torch", stacklevel=3)
        saved_grads = {p: p.grad for g in opt.param_groups for p in g["params"]}
        saved = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in opt.param_groups]
        try:
            for g in opt.param_groups:
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
                if "lr" in g:
                    g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
                if "weight_decay" in g:
                    g["weight_decay"] = 0.0
            with torch.no_grad():
                opt.step()
            for p in missing:
                st = opt.state.get(p, {})
                if "step" in st:
                    s = st["step"]
                    st["step"] = torch.zeros_like(s) if isinstance(s, torch.Tensor) else 0
        finally:
            for g, s in zip(opt.param_groups, saved):
                g.update(s)
            for p, gr in saved_grads.items():
                p.grad = gr


@contextlib.contextmanager
def capturable_optimizers(optimizers: Sequence[torch.optim.Optimizer]):
    """Run optimizers with ``capturable=True`` on any device while tracing (step counters stay tensors)."""
    import importlib
    import pkgutil
    import torch.optim as optim

    patched: list[tuple[Any, Callable]] = []

    def supported(supports_xla: bool = True) -> list[str]:
        return ["cpu", "cuda", "xla", "meta", torch._C._get_privateuse1_backend_name(), "mps", "xpu", "hpu"]

    mods = [optim]
    for info in pkgutil.iter_modules(optim.__path__):
        try:
            mods.append(importlib.import_module(f"torch.optim.{info.name}"))
        except Exception:  # pragma: no cover - an optional submodule
            continue
    for m in mods:
        if hasattr(m, "_get_capturable_supported_devices"):
            patched.append((m, m._get_capturable_supported_devices))
            m._get_capturable_supported_devices = supported
    saved_groups = []
    for opt in optimizers:
        for g in opt.param_groups:
            saved_groups.append((g, g.get("capturable", None), "capturable" in g))
            if "capturable" in g:
                g["capturable"] = True
    try:
        yield
    finally:
        for m, f in patched:
            m._get_capturable_supported_devices = f
        for g, v, had in saved_groups:
            if had:
                g["capturable"] = v


@contextlib.contextmanager
def swapped_optimizer(opt: torch.optim.Optimizer, old_params: Sequence[torch.Tensor],
                      new_params: Sequence[torch.Tensor]):
    """Point ``opt``'s param groups and state at ``new_params`` (same order as ``old_params``)."""
    m = {id(o): n for o, n in zip(old_params, new_params)}
    saved_groups = [list(g["params"]) for g in opt.param_groups]
    saved_state = opt.state
    try:
        for g in opt.param_groups:
            g["params"] = [m.get(id(p), p) for p in g["params"]]
        from collections import defaultdict
        new_state = defaultdict(dict)
        for p, st in saved_state.items():
            new_state[m.get(id(p), p)] = st
        opt.state = new_state
        yield
    finally:
        for g, ps in zip(opt.param_groups, saved_groups):
            g["params"] = ps
        opt.state = saved_state


# -- the trace -----------------------------------------------------------------------------


@dataclass
class TracedStep:
    """A traced, functional step: the fx graph, its MetaIR and how to feed and read it."""

    gm: fx.GraphModule              # (params, buffers, states, inputs, constants) -> flat outputs
    graph: MetaIR
    state: StepState
    n_inputs: int                   # user tensor inputs
    out_spec: Any                   # pytree spec of the user's return value
    n_outputs: int                  # flat user outputs (tensors and constants)
    out_consts: dict[int, Any]      # flat output index -> non-tensor value
    in_names: list[str]             # placeholder (MetaIR input) ids, in call order
    constants: list[torch.Tensor]   # values of get_attr tensor constants, fed after the user inputs
    state_out: list[int | None]     # per state slot: index into flat outputs of its new value, or None (unchanged)
    out_vars: list[str | None]      # per flat graph output: MetaIR var id (None for constants)
    random_ops: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


_PROFILER_PREFIX = ("profiler.",)


def _target_key(t: Any) -> str | None:
    if isinstance(t, torch._ops.OpOverload):
        ns = t.namespace
        name = t._schema.name.split("::")[-1]
        return f"{ns}.{name}.{t._overloadname}"
    return None


def _flat_user_inputs(args: Sequence[Any], kwargs: dict) -> tuple[list[torch.Tensor], Any, list[Any]]:
    """The tensors among the user's arguments (modules and optimizers left out), and how to put them back."""
    leaves, spec = pytree.tree_flatten((list(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return tensors, spec, leaves


def trace_step(fn: Callable, args: Sequence[Any], kwargs: dict | None = None, *, name: str | None = None,
               state: StepState | None = None, example_state: Sequence[torch.Tensor] | None = None) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` (forward, backward, optimizer step) into a functional TracedStep.

    ``example_state`` (same order as ``state.slots``) gives the full-size
    values to trace with when the live state is sharded (retracing).
    """
    import time
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.utils.stateless import _reparametrize_module

    kwargs = dict(kwargs or {})
    t0 = time.perf_counter()
    if state is None:
        init_optimizer_state([o for o in _optimizers_in(args, kwargs)])
        state = collect_state(args, kwargs)
    slots = state.slots
    n_p, n_b, n_s = len(state.params), len(state.buffers), len(state.opt_states)
    user_tensors, in_spec, leaves = _flat_user_inputs(args, kwargs)
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    out_box: dict[str, Any] = {}

    def flat(*values: torch.Tensor):
        pv, bv, sv = values[:n_p], values[n_p:n_p + n_b], values[n_p + n_b:n_p + n_b + n_s]
        uv = values[n_p + n_b + n_s:]
        new_params = [v.detach().requires_grad_(v.dtype.is_floating_point or v.dtype.is_complex) for v in pv]
        new_params = [p if p.requires_grad else v for p, v in zip(new_params, pv)]
        groups: dict[int, tuple[torch.nn.Module, dict]] = {}
        for slot, v in zip(state.params + state.buffers, list(new_params) + list(bv)):
            mod = slot.owner
            groups.setdefault(id(mod), (mod, {}))[1][slot.key] = v
        for mod, k, i in state.tied:
            groups.setdefault(id(mod), (mod, {}))[1][k] = new_params[i]
        # optimizer state dicts point at the traced values
        saved_state_vals = [(s.owner, s.key, s.owner[s.key]) for s in state.opt_states]
        for s, v in zip(state.opt_states, sv):
            s.owner[s.key] = v
        lv = list(leaves)
        for i, v in zip(tensor_pos, uv):
            lv[i] = v
        a, kw = pytree.tree_unflatten(lv, in_spec)
        try:
            with contextlib.ExitStack() as stack:
                for mod, d in groups.values():
                    if isinstance(mod, _Holder):
                        continue
                    stack.enter_context(_reparametrize_module(mod, dict(d), strict=False))
                for opt in state.optimizers:
                    stack.enter_context(swapped_optimizer(opt, state.param_objs, new_params))
                out = fn(*a, **kw)
                new_state = [s.owner[s.key] for s in state.opt_states]
        finally:
            for owner, k, v in saved_state_vals:
                owner[k] = v
        flat_out, spec = pytree.tree_flatten(out)
        out_box["spec"] = spec
        out_box["consts"] = {i: o for i, o in enumerate(flat_out) if not isinstance(o, torch.Tensor)}
        tensors_out = [o for o in flat_out if isinstance(o, torch.Tensor)]
        out_box["n_tensor_out"] = len(tensors_out)
        # buffers were updated in place (BatchNorm running stats): functionalization turns that into new values
        return (*[o.detach() for o in tensors_out], *[p.detach() for p in new_params], *bv, *new_state)

    if example_state is None:
        example_state = [s.get() for s in slots]
    example_state = [_plain(t) for t in example_state]
    examples = list(example_state) + [t.detach() for t in user_tensors]
    with capturable_optimizers(state.optimizers), _quiet():
        try:
            gm = make_fx(flat, tracing_mode="fake", decomposition_table=_decompositions())(*examples)
        except Exception as e:
            raise TraceError(f"metadist could not trace the step {getattr(fn, '__name__', fn)!r}: "
                             f"{type(e).__name__}: {e}") from e
    t1 = time.perf_counter()
    gm = functionalize_graph(gm, examples)
    gm = merge_step_counters(gm, state)
    t2 = time.perf_counter()
    n_user_out = out_box["n_tensor_out"]
    spec, consts = out_box["spec"], out_box["consts"]
    traced = _to_meta_ir(gm, state, len(user_tensors), n_user_out, name or getattr(fn, "__name__", "step"))
    traced.out_spec, traced.out_consts = spec, consts
    traced.n_outputs = n_user_out + len(consts)
    traced.timings = {"make_fx": t1 - t0, "functionalize": t2 - t1, "to_meta_ir": time.perf_counter() - t2}
    return traced


def _bn_with_stats(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` writes its running stats without saying so in its schema, so functionalization
    would miss the update; ``_native_batch_norm_legit`` is the same kernel with the writes declared."""
    aten = torch.ops.aten
    if running_mean is None or running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    return aten._native_batch_norm_legit.default(input, weight, bias, running_mean, running_var, training,
                                                 momentum, eps)


def _decompositions() -> dict:
    return {torch.ops.aten.native_batch_norm.default: _bn_with_stats}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the full shape for tracing (DTensors are traced by their global shape)."""
    try:
        from torch.distributed.tensor import DTensor
        if isinstance(t, DTensor):
            return torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    except ImportError:  # pragma: no cover
        pass
    return t.detach()


def _optimizers_in(args, kwargs) -> list[torch.optim.Optimizer]:
    mods: list = []
    opts: list = []
    _walk_args(list(args) + list(kwargs.values()), mods, opts, set())
    return opts


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable.*")
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.optim")
        yield


def functionalize_graph(gm: fx.GraphModule, examples: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Functionalize a captured graph (in-place ops -> functional ops) and clean it for MetaIR."""
    from torch.fx.experimental.proxy_tensor import make_fx
    _drop_profiler_nodes(gm)
    gm.recompile()
    fgm = make_fx(torch.func.functionalize(gm, remove="mutations"), tracing_mode="fake")(*examples)
    _drop_profiler_nodes(fgm)
    _drop_input_copies(fgm)
    _drop_detach(fgm)
    fgm.graph.eliminate_dead_code()
    fgm.recompile()
    return fgm


def _drop_detach(gm: fx.GraphModule) -> None:
    """``detach`` is the identity in a graph without autograd: read its input instead."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)


def merge_step_counters(gm: fx.GraphModule, state: StepState) -> fx.GraphModule:
    """Read one step counter for all parameters whose counters are equal now, then share the work.

    Optimizers keep a ``step`` tensor per parameter and compute the same bias
    corrections from each; where the counters hold the same value, all readers
    read the first one and common subexpressions are merged. Kept only when
    every merged counter's updated value is then the same graph value (so they
    stay equal after every step); otherwise the graph is left as it was.
    """
    from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops
    n_p, n_b = len(state.params), len(state.buffers)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first: dict[tuple, int] = {}
    merged: dict[int, int] = {}
    for j, slot in enumerate(state.opt_states):
        if slot.key != "step":
            continue
        v = slot.get()
        v = getattr(v, "_local_tensor", v)
        if not isinstance(v, torch.Tensor) or v.numel() != 1:
            continue
        k = (str(v.dtype), str(v.device), float(v.reshape(()).item()))
        i = n_p + n_b + j
        if k in first:
            merged[i] = first[k]
        else:
            first[k] = i
    if not merged:
        return gm
    import copy
    new = copy.deepcopy(gm)
    nphs = [n for n in new.graph.nodes if n.op == "placeholder"]
    for i, i0 in merged.items():
        nphs[i].replace_all_uses_with(nphs[i0])
    banned = set(get_CSE_banned_ops()) | {n.target.overloadpacket for n in new.graph.nodes
                                          if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                                          and torch.Tag.nondeterministic_seeded in n.target.tags}
    res = CSEPass(banned).call(new).graph_module
    out = next(n for n in res.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(out.args[0])
    n_state = len(state.slots)
    outs = flat[len(flat) - n_state:]
    for i, i0 in merged.items():
        if outs[i] is not outs[i0]:
            log.debug("step counters update differently; not merged")
            return gm
    res.graph.eliminate_dead_code()
    res.recompile()
    return res


def _drop_profiler_nodes(gm: fx.GraphModule) -> None:
    """Remove ``profiler._record_function_*`` nodes (exit nodes first, then the enter nodes they read)."""
    g = gm.graph
    for _ in range(2):
        for n in reversed(list(g.nodes)):
            if n.op == "call_function" and (_target_key(n.target) or "").startswith(_PROFILER_PREFIX) and not n.users:
                g.erase_node(n)


def _drop_input_copies(gm: fx.GraphModule) -> None:
    """Remove ``copy_(placeholder, value)`` that functionalization adds for mutated inputs."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder" \
                and not n.users:
            g.erase_node(n)


# -- fx graph -> MetaIR ----------------------------------------------------------------------


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


def _val_meta(val: Any) -> tuple[tuple[int, ...], str] | None:
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape), canonical_dtype(val.dtype)
    return None


def _to_meta_ir(gm: fx.GraphModule, state: StepState, n_inputs: int, n_user_out: int, name: str) -> TracedStep:
    g = MetaIR(name)
    slots = state.slots
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(slots) + n_inputs:
        raise TraceError(f"traced graph has {len(placeholders)} inputs; expected {len(slots)} state tensors "
                         f"+ {n_inputs} inputs")
    in_names: list[str] = []
    for i, ph in enumerate(placeholders):
        meta = _val_meta(ph.meta.get("val"))
        role = slots[i].role if i < len(slots) else ROLE_INPUT
        g.add_input(ph.name, meta[0] if meta else None, meta[1] if meta else "float32", role)
        in_names.append(ph.name)
    constants: list[torch.Tensor] = []
    random_ops: list[str] = []
    var_of: dict[fx.Node, str] = {ph: ph.name for ph in placeholders}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            val = getattr(gm, n.target)
            if not isinstance(val, torch.Tensor):
                raise TraceError(f"graph attribute {n.target!r} is not a tensor")
            g.add_input(n.name, tuple(val.shape), canonical_dtype(val.dtype), ROLE_BUFFER)
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
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        key = _target_key(n.target)
        if key is None:
            raise TraceError(f"graph node {n.name} calls {n.target!r}, which is not a torch op overload")
        if torch.Tag.nondeterministic_seeded in n.target.tags:
            random_ops.append(n.name)
        op_inputs: list[str] = []

        def enc(x: Any) -> Any:
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
                raise TraceError(f"graph node {n.name} ({key}) returns {type(val).__name__}, not a tensor; "
                                 f"data-dependent Python values cannot be planned")
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
    return TracedStep(gm, g, state, n_inputs, None, n_user_out, {}, in_names, constants, state_out, out_vars,
                      random_ops)


__all__ = ["TracedStep", "StepState", "StateSlot", "TraceError", "collect_state", "init_optimizer_state",
           "capturable_optimizers", "trace_step", "functionalize_graph"]
