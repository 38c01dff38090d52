"""The state of a training step: the modules and optimizers among its arguments and their tensors,
and the compile-cache key of a call (:func:`signature`).

:func:`collect_state` lists every parameter, buffer and optimizer state tensor
of a step's arguments as a :class:`StateSlot` (where it lives, so that the
runner can read and write it back). Optimizer state is created lazily on the
first ``step()``, so :func:`init_optimizer_state` makes it eagerly first: zero
grads, ``lr=0`` and ``weight_decay=0``, one ``step()``, every ``step`` counter
back to 0. :func:`capturable_optimizers` and :func:`swapped_optimizer` are the
two patches tracing runs the optimizers under.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .amp import check_scalers, init_scalers, is_grad_scaler

ROLE_PARAM, ROLE_BUFFER, ROLE_STATE, ROLE_INPUT = "parameter", "buffer", "optimizer_state", "input"


# -- what the step holds ------------------------------------------------------------------


@dataclass
class StateSlot:
    """One state tensor of the step: where it lives, so that the runner can read and write it back."""

    role: str  # parameter | buffer | optimizer_state
    name: str  # readable: "model.fc1.weight", "opt0.state[3].exp_avg"
    owner: Any  # the module (param/buffer) or the optimizer state dict of one param
    key: str  # attribute name in the module, or the key in the state dict
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
    param_objs: list[torch.nn.Parameter]  # the Parameter objects, in the order of ``params``
    tied: list = field(default_factory=list)  # (module, attribute, index into params) of tied weights
    scalers: list = field(default_factory=list)  # torch.amp.GradScaler arguments (state: metadist_torch.trace.amp)

    @property
    def slots(self) -> list[StateSlot]:
        return self.params + self.buffers + self.opt_states


def walk_args(obj: Any, modules: list, optimizers: list, seen: set, scalers: list | None = None) -> None:
    if id(obj) in seen:
        return
    if scalers is not None and is_grad_scaler(obj):
        seen.add(id(obj))
        scalers.append(obj)
    elif isinstance(obj, torch.nn.Module):
        seen.add(id(obj))
        modules.append(obj)
    elif isinstance(obj, torch.optim.Optimizer):
        seen.add(id(obj))
        optimizers.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            walk_args(x, modules, optimizers, seen, scalers)
    elif isinstance(obj, dict):
        for x in obj.values():
            walk_args(x, modules, optimizers, seen, scalers)


def collect_state(args: Sequence[Any], kwargs: dict) -> StepState:
    """Find modules and optimizers in ``args``/``kwargs`` and list their parameters, buffers and state."""
    modules: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    seen: set[int] = set()
    scalers: list = []
    walk_args(list(args) + list(kwargs.values()), modules, optimizers, seen, scalers)
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
                params.append(
                    StateSlot(ROLE_PARAM, prefix + (f"{mname}.{k}" if mname else k), mod, k, tuple(p.shape), p.dtype)
                )
                param_objs.append(p)
            for k, b in list(mod._buffers.items()):
                if b is None or id(b) in seen_t:
                    continue
                seen_t.add(id(b))
                buffers.append(
                    StateSlot(ROLE_BUFFER, prefix + (f"{mname}.{k}" if mname else k), mod, k, tuple(b.shape), b.dtype)
                )
    # optimizer parameters that no module holds are still state of the step
    for oi, opt in enumerate(optimizers):
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in seen_t:
                    seen_t.add(id(p))
                    params.append(
                        StateSlot(
                            ROLE_PARAM,
                            f"opt{oi}.param{len(param_objs)}",
                            OptimizerParamHolder(p),
                            "p",
                            tuple(p.shape),
                            p.dtype,
                        )
                    )
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
                        opt_states.append(
                            StateSlot(ROLE_STATE, f"opt{oi}.state[{index[id(p)]}].{k}", st, k, tuple(v.shape), v.dtype)
                        )
    if scalers:  # a GradScaler's scale and growth tracker are state of the step, like an optimizer's
        check_scalers(scalers, optimizers)
        init_scalers(scalers, param_objs[0].device if param_objs else torch.device("cpu"))
        for si, sc in enumerate(s for s in scalers if s.is_enabled()):
            for k in ("_scale", "_growth_tracker"):
                v = sc.__dict__[k]
                opt_states.append(StateSlot(ROLE_STATE, f"scaler{si}.{k}", sc.__dict__, k, tuple(v.shape), v.dtype))
    return StepState(modules, optimizers, params, buffers, opt_states, param_objs, tied, scalers)


class OptimizerParamHolder:
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
                warnings.warn(
                    "metadist: SGD with dampening != 0 starts its momentum buffer by cloning the first "
                    "gradient; the compiled step uses the later-step formula from the first step on, "
                    "so the first update differs from eager torch",
                    stacklevel=3,
                )
        saved_grads = {p: p.grad for g in opt.param_groups for p in g["params"]}
        saved = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in opt.param_groups]
        # only the parameters without state take this step: the others' state (moments, step counters) stays
        saved_params = [g["params"] for g in opt.param_groups]
        no_state = {id(p) for p in missing}
        try:
            for g in opt.param_groups:
                g["params"] = [p for p in g["params"] if id(p) in no_state]
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
                    if isinstance(s, torch.Tensor) and p.device.type == "meta":
                        # a model built on the meta device (planned, never run): the step counter lives with it
                        st["step"] = torch.zeros((), dtype=s.dtype, device="meta")
        finally:
            for g, s, ps in zip(opt.param_groups, saved, saved_params):
                g.update(s)
                g["params"] = ps
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
def swapped_optimizer(
    opt: torch.optim.Optimizer, old_params: Sequence[torch.Tensor], new_params: Sequence[torch.Tensor]
):
    """Point ``opt``'s param groups and state at ``new_params`` (same order as ``old_params``)."""
    m = {id(o): n for o, n in zip(old_params, new_params)}
    saved_groups = [list(g["params"]) for g in opt.param_groups]
    saved_state = opt.state
    try:
        for g in opt.param_groups:
            g["params"] = [m.get(id(p), p) for p in g["params"]]
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


def optimizers_in(args: Sequence[Any], kwargs: dict) -> list[torch.optim.Optimizer]:
    """The optimizers among a step's arguments, in order."""
    mods: list = []
    opts: list = []
    walk_args(list(args) + list(kwargs.values()), mods, opts, set())
    return opts


def _sig_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), str(x.dtype), str(x.device), bool(x.requires_grad))
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)) or is_grad_scaler(x):
        return ("O", id(x))
    if isinstance(x, (int, float, bool, str, type(None))):
        return ("V", type(x).__name__, x)
    return ("R", type(x).__name__, repr(x))


def signature(args: Sequence[Any], kwargs: dict) -> tuple:
    """The compile-cache key of a call: argument structure, tensor metadata, other values by value,
    modules and optimizers by identity."""
    leaves, spec = pytree.tree_flatten(
        (list(args), dict(kwargs)),
        is_leaf=lambda x: isinstance(x, (torch.nn.Module, torch.optim.Optimizer)) or is_grad_scaler(x),
    )
    return (str(spec), tuple(_sig_leaf(x) for x in leaves))


__all__ = [
    "signature",
    "StateSlot",
    "StepState",
    "OptimizerParamHolder",
    "collect_state",
    "optimizers_in",
    "walk_args",
    "init_optimizer_state",
    "capturable_optimizers",
    "swapped_optimizer",
    "ROLE_PARAM",
    "ROLE_BUFFER",
    "ROLE_STATE",
    "ROLE_INPUT",
]
