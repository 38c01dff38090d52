"""What a traced step changes that its program cannot carry back, found and named.

A compiled step runs the traced program; the step's Python code runs once, while it is traced. So a
change the step makes to something outside its inputs and outputs (a Python global, an attribute of an
object it closes over, an item of an argument's dict set in place) happens once, at compile time, and
never again: each is an :class:`UncarriedChangeError` naming what changed and what to do instead.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import jax

from metadist_core.driver.sideeffects import SideEffectError

_ADVICE = (
    "a compiled step runs the traced program, so this change happened once, while the step was traced, and "
    "never again on later calls"
)

# the kinds of objects whose own state no step changes (their contents are code, not data)
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class UncarriedChangeError(SideEffectError, ValueError):
    """The step changes something its compiled program cannot carry back (named in the message); the core's
    :class:`~metadist_core.driver.sideeffects.SideEffectError`, as the torch frontend raises it."""


def is_array_leaf(x: Any) -> bool:
    """Can ``x`` be a leaf of a traced step's arguments (an array, a Python or numpy scalar, or a static str)?"""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex, str, jax.ShapeDtypeStruct))


def check_leaves(named_leaves: Sequence[tuple[str, Any]]) -> None:
    """Raise if a leaf of the arguments is neither an array nor a scalar: an object that is not a pytree."""
    for name, x in named_leaves:
        if not is_array_leaf(x):
            raise UncarriedChangeError(
                f"the step's argument `{name}` is a {type(x).__name__}, which is neither an array nor a pytree of "
                f"arrays: the compiled step can neither pass it in nor carry a change to it back. Pass its arrays "
                f"instead, register its class as a pytree (jax.tree_util.register_dataclass), or make it an "
                f"nnx.Module/nnx.Pytree whose changing values are nnx.Variables"
            )


def check_unchanged(before: Sequence[Any], tree: Any, after: Any, names: Sequence[str], **flatten: Any) -> None:
    """Raise if ``after`` (the arguments once the step ran) no longer holds the leaves ``before`` it was called
    with (``names``: theirs), or holds more or fewer: the step changed an argument in place."""
    leaves, now = jax.tree_util.tree_flatten(after, **flatten)
    if now != tree:
        what = "added or removed an item of its arguments in place (in a dict or list argument)"
    else:
        changed = [n for n, x, y in zip(names, before, leaves) if x is not y]
        if not changed:
            return
        what = f"replaced {', '.join(f'`{n}`' for n in changed[:5])} of its arguments in place"
    raise UncarriedChangeError(
        f"the step {what}: {_ADVICE}, and the caller's object stays as it was. Return the new value from the "
        f"step instead"
    )


@dataclass
class GlobalsWatch:
    """The Python globals and closed-over objects a step function reads, as they were before it was traced.

    :meth:`check` after the trace raises for any that the step rebound or changed: a global assigned, an item
    added to a global list or dict, an attribute set on an object the step reaches by name.
    """

    fn: Callable
    before: dict[str, tuple[int, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.before = {name: _fingerprint(obj) for name, obj in self._reached()}

    def _reached(self) -> Iterator[tuple[str, Any]]:
        missing = object()
        for fn, names in _step_functions(self.fn):
            glob = getattr(fn, "__globals__", {})
            for name in names:
                obj = glob.get(name, missing)
                yield (name, None if obj is missing else obj)
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                try:
                    yield (name, cell.cell_contents)
                except ValueError:  # an empty cell
                    continue

    def check(self) -> None:
        """Raise :class:`UncarriedChangeError` naming the first global or captured object the trace changed."""
        for name, obj in self._reached():
            was = self.before.get(name)
            now = _fingerprint(obj)
            if was is None or was == now:
                continue
            what = f"the Python global or captured variable `{name}`"
            if was[0] != now[0]:
                detail = f"now bound to a {type(obj).__name__}" + (
                    " holding a traced value" if isinstance(obj, jax.core.Tracer) else ""
                )
            elif isinstance(obj, dict) or isinstance(obj, (list, set)):
                detail = f"a {type(obj).__name__} changed in place, now of length {len(obj)}"
            else:
                attrs = sorted(k for k, v in now[1] if (k, v) not in set(was[1]))
                detail = f"a {type(obj).__name__}, its attribute {', '.join(f'`{a}`' for a in attrs)} set"
            raise UncarriedChangeError(
                f"the step changed {what} ({detail}): {_ADVICE}. Return the value from the step instead, or keep it "
                f"in an nnx.Variable of an object passed to the step"
            )


def _step_functions(fn: Callable, depth: int = 2) -> Iterator[tuple[Any, list[str]]]:
    """The step's Python function and the functions of its module it calls by name (``depth`` levels), each
    with the global names its code reads or writes."""
    fn = inspect.unwrap(fn)
    while isinstance(fn, functools.partial):
        fn = inspect.unwrap(fn.func)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    names = sorted(_global_names(code))
    yield fn, names
    if depth <= 0:
        return
    glob = fn.__globals__
    for name in names:
        sub = glob.get(name)
        if isinstance(sub, types.FunctionType) and sub.__globals__ is glob and sub is not fn:
            yield from _step_functions(sub, depth - 1)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            names |= _global_names(const)
    return names


def _fingerprint(obj: Any) -> tuple[int, Any]:
    """What :class:`GlobalsWatch` compares: the object's identity and, for a container or a plain object, the
    identities of what it holds (one level)."""
    if obj is None or isinstance(obj, _OPAQUE):
        return (id(obj), None)
    if isinstance(obj, list):
        return (id(obj), tuple(map(id, obj)))
    if isinstance(obj, dict):
        return (id(obj), tuple((repr(k), id(v)) for k, v in obj.items()))
    if isinstance(obj, set):
        return (id(obj), frozenset(map(id, obj)))
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(obj, jax.Array):
        return (id(obj), tuple((k, id(v)) for k, v in attrs.items()))
    return (id(obj), None)


__all__ = [
    "GlobalsWatch",
    "UncarriedChangeError",
    "check_leaves",
    "check_unchanged",
    "is_array_leaf",
]
