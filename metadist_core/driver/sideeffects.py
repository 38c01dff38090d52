"""What a step changes that its trace cannot carry back: found by comparing before and after the trace.

A traced step replays tensor operations only. A Python attribute it sets on a
module or on an object it was handed, a list it appends to, a global it
rebinds: each happens once, while tracing, and never again in the compiled
program, so the user's objects would silently drift from the program. A
frontend takes a :class:`Snapshot` of those Python values before its trace and
calls :meth:`Snapshot.check` after it: every change is undone and reported in
one :class:`SideEffectError` that names it and says what to do.

Values are compared by a shallow fingerprint: numbers, strings and tuples of
them by value, containers by identity and length, anything else by identity.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

_SCALARS = (int, float, complex, bool, str, bytes, type(None))
_MISSING = object()


class SideEffectError(RuntimeError):
    """A step changed Python state that a compiled program cannot change at every call."""


def fingerprint(value: Any) -> Hashable:
    """What must stay equal for ``value`` to count as unchanged."""
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value):
        return ("tuple", value)
    if isinstance(value, (list, dict, set, bytearray)):
        return (id(value), len(value))
    return id(value)


@dataclass
class _Watched:
    what: str  # how the user names it: "model.blocks.0", "argument 'log'", "global 'counter'"
    owner: Any  # the object whose __dict__ is watched, or a function's globals dict
    values: dict[str, Any]  # key -> the value before the trace
    marks: dict[str, Hashable]  # key -> its fingerprint before the trace
    kind: str = "attrs"  # "attrs": owner.__dict__ | "globals": a globals dict, only ``values``' keys | "value"
    skip: Callable[[str], bool] = lambda k: False  # attribute names that are not the user's
    tolerate: Callable[[str, Any], bool] = lambda k, v: False  # (name, new value) a library may set once


@dataclass
class Snapshot:
    """Python values a step may change, as they were before its trace."""

    watched: list[_Watched] = field(default_factory=list)

    def attrs(
        self,
        what: str,
        obj: Any,
        skip: Callable[[str], bool] = lambda k: False,
        tolerate: Callable[[str, Any], bool] = lambda k, v: False,
    ) -> None:
        """Watch the instance attributes of ``obj`` (named ``what``) but those ``skip`` says are not the
        user's; a change to a value ``tolerate(name, value)`` accepts is left as it is (a library's
        one-time flag)."""
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict):
            return
        vals = {k: v for k, v in d.items() if not skip(k)}
        marks = {k: fingerprint(v) for k, v in vals.items()}
        self.watched.append(_Watched(what, obj, vals, marks, skip=skip, tolerate=tolerate))

    def value(self, what: str, value: Any) -> None:
        """Watch one container handed to the step (a list appended to, a dict filled in)."""
        if isinstance(value, (list, dict, set, bytearray)):
            self.watched.append(_Watched(what, value, {"": value}, {"": fingerprint(value)}, kind="value"))

    def globals_of(self, fn: Callable) -> None:
        """Watch the module globals the step function names."""
        fn = inspect.unwrap(fn)
        code, g = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or not isinstance(g, dict):
            return
        names = [n for n in code.co_names if n in g or n in _stored_globals(code)]
        vals = {n: g.get(n, _MISSING) for n in names}
        marks = {n: fingerprint(v) for n, v in vals.items()}
        self.watched.append(_Watched(f"the globals of {fn.__qualname__}", g, vals, marks, kind="globals"))

    def changes(self) -> list[str]:
        """Each change since the snapshot, in words."""
        out = []
        for w in self.watched:
            if w.kind == "value":
                if fingerprint(w.owner) != w.marks[""]:
                    out.append(f"{w.what} (a {type(w.owner).__name__}) was changed in place")
                continue
            now = w.owner if w.kind == "globals" else w.owner.__dict__
            skip = w.skip
            keys = w.values.keys() if w.kind == "globals" else {k for k in now if not skip(k)} | w.values.keys()
            for k in sorted(keys):
                v = now.get(k, _MISSING)
                if v is not _MISSING and w.tolerate(k, v):
                    continue
                if k not in w.values:
                    out.append(f"{_name(w, k)} was set (it did not exist before the step)")
                elif v is _MISSING:
                    out.append(f"{_name(w, k)} was deleted")
                elif fingerprint(v) != w.marks[k]:
                    out.append(f"{_name(w, k)} changed from {_short(w.values[k])} to {_short(v)}")
        return out

    def restore(self) -> None:
        """Put back every watched attribute and global as it was (the contents of a container excepted)."""
        for w in self.watched:
            if w.kind == "value":
                continue
            now = w.owner if w.kind == "globals" else w.owner.__dict__
            skip = w.skip
            if w.kind != "globals":
                for k in [k for k in now if not skip(k) and k not in w.values and not w.tolerate(k, now[k])]:
                    del now[k]
            for k, v in w.values.items():
                if k in now and w.tolerate(k, now[k]):
                    continue
                if v is _MISSING:
                    now.pop(k, None)
                else:
                    now[k] = v

    def check(self, step_name: str) -> None:
        """Raise :class:`SideEffectError` naming every change since the snapshot, after undoing them."""
        found = self.changes()
        if not found:
            return
        self.restore()
        listed = "\n".join(f"  - {c}" for c in found)
        raise SideEffectError(
            f"metadist: step {step_name} changes Python state that a compiled program cannot change at every "
            f"call (the trace ran it once):\n{listed}\nReturn such values from the step instead, or keep them "
            f"as tensors the step updates (a registered buffer, an optimizer's state), or change them outside "
            f"the step. The changes were undone."
        )


def _stored_globals(code: Any) -> set[str]:
    import dis

    return {i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}


def _name(w: _Watched, key: str) -> str:
    if w.kind == "globals":
        return f"global '{key}' ({w.what})"
    return f"{w.what}.{key}"


def _short(v: Any) -> str:
    if v is _MISSING:
        return "nothing"
    s = repr(v) if isinstance(v, _SCALARS) or isinstance(v, tuple) else f"a {type(v).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."


def bound_arguments(fn: Callable, args: tuple, kwargs: dict) -> Iterable[tuple[str, Any]]:
    """``(parameter name, value)`` of a call, in order (``arg0``... where the signature cannot be read)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [*((f"arg{i}", a) for i, a in enumerate(args)), *kwargs.items()]
    out: list[tuple[str, Any]] = []
    for name, v in bound.arguments.items():
        if isinstance(v, tuple) and bound.signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            out += [(f"{name}[{i}]", x) for i, x in enumerate(v)]
        elif isinstance(v, dict) and bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out += list(v.items())
        else:
            out.append((name, v))
    return out


__all__ = ["Snapshot", "SideEffectError", "fingerprint", "bound_arguments"]
