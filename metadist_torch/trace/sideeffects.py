"""The Python state a torch step may change, watched across its trace (:mod:`metadist_core.driver.sideeffects`):
the user's attributes on every module of the step's models, the attributes of other objects and the
containers handed to the step, and the globals the step function names."""

from __future__ import annotations

from typing import Any, Callable

import torch

from metadist_core.driver.sideeffects import SideEffectError, Snapshot, bound_arguments

# what torch itself keeps in a module's __dict__ (parameters, buffers, submodules, hooks, flags)
_TORCH_KEYS = frozenset(torch.nn.Module().__dict__)


def _not_users(key: str) -> bool:
    return key in _TORCH_KEYS or key.startswith("_metadist")


def _library_flag(key: str, value: Any) -> bool:
    """A private attribute that holds no tensor: a library's own one-time flag or handle (transformers marks
    a model whose output hooks it installed), left as the library set it."""
    import torch.utils._pytree as pytree

    if not key.startswith("_"):
        return False
    try:
        leaves = pytree.tree_leaves(value)
    except Exception:
        return True
    return not any(isinstance(x, torch.Tensor) for x in leaves)


def snapshot(fn: Callable, args: tuple, kwargs: dict, modules: list[torch.nn.Module]) -> Snapshot:
    """What the trace of ``fn(*args, **kwargs)`` must leave as it found (``modules``: the step's models)."""
    snap = Snapshot()
    named = list(bound_arguments(fn, args, kwargs))
    for top in modules:
        top_name = next((n for n, v in named if v is top), type(top).__name__)
        for name, m in top.named_modules(remove_duplicate=True):
            snap.attrs(f"{top_name}.{name}" if name else top_name, m, _not_users, _library_flag)
    for name, v in named:
        if isinstance(v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)) or _framework_object(v):
            continue
        if isinstance(v, (list, dict, set)):
            snap.value(f"argument '{name}'", v)
        elif hasattr(v, "__dict__") and not isinstance(v, type) and not callable(v):
            snap.attrs(f"argument '{name}'", v)
    snap.globals_of(fn)
    return snap


def arguments_unchanged(fn: Callable, args: tuple, kwargs: dict, spec: Any, leaves: list) -> None:
    """Raise :class:`SideEffectError` where the traced ``fn`` changed a container among its arguments (a list
    appended to, a dict entry set): the trace handed it a copy rebuilt from ``spec`` and ``leaves``."""
    import torch.utils._pytree as pytree

    now, now_spec = pytree.tree_flatten((list(args), dict(kwargs)))
    if now_spec == spec and len(now) == len(leaves) and all(a is b for a, b in zip(now, leaves)):
        return
    changed = [
        name
        for (name, v), (_, was) in zip(bound_arguments(fn, args, kwargs), _rebuilt(spec, leaves, fn))
        if pytree.tree_structure(v) != pytree.tree_structure(was)
        or any(a is not b for a, b in zip(pytree.tree_leaves(v), pytree.tree_leaves(was)))
    ] or ["an argument"]
    raise SideEffectError(
        f"metadist: step {getattr(fn, '__qualname__', 'step')} changes its argument "
        f"{', '.join(repr(n) for n in changed)} in place (an item added, set or removed), which a compiled "
        f"program cannot repeat at every call (the trace ran it once, on a copy). Return the value from the "
        f"step instead and add it outside."
    )


def _rebuilt(spec: Any, leaves: list, fn: Callable) -> list:
    import torch.utils._pytree as pytree

    a, kw = pytree.tree_unflatten(leaves, spec)
    return list(bound_arguments(fn, tuple(a), kw))


def _framework_object(v: Any) -> bool:
    """Objects of torch's own whose attributes change by design (a GradScaler, an LR scheduler)."""
    mod = type(v).__module__ or ""
    return mod.startswith("torch.") or mod == "torch"


__all__ = ["snapshot", "arguments_unchanged", "SideEffectError"]
