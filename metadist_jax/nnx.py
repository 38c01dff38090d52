"""flax.nnx steps: a step over nnx objects run as a pure step, its objects updated after every call.

The nnx objects among a step's arguments (Modules, Optimizers, metrics, Rngs, bare Variables) are
flattened together (shared references kept) into a graph definition and the values of their Variables.
The step is traced as the pure step ``(params, state, inputs) -> (out, params, state)``: ``params`` the
values of the ``nnx.Param``s, ``state`` those of every other Variable (optimizer state and step count,
batch statistics, RNG keys and counters, metrics), ``inputs`` the other arguments with the graph definition
kept beside them. Inside, the objects are rebuilt from the graph definition, the user's step runs on them,
and their Variables are read back out. After each call every Variable of the user's objects takes its new
value, and the call returns what the step returned.

A step that changes its objects' structure (a plain Python attribute set, a new attribute, a Variable of
another shape) is an :class:`~metadist_jax.effects.UncarriedChangeError` naming the attribute.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

import jax

from .effects import UncarriedChangeError, check_unchanged

_ADVICE = (
    "a compiled step runs the traced program, so the change happened once, while the step was traced, and "
    "never reaches the object on later calls"
)


def _nnx() -> Any:
    """``flax.nnx`` if it was imported (an nnx object cannot exist otherwise), else None."""
    return sys.modules.get("flax.nnx")


def is_object(x: Any) -> bool:
    """Is ``x`` an nnx object: a Module, Optimizer, metric, Rngs (any ``nnx.Pytree``) or a Variable?"""
    nnx = _nnx()
    return nnx is not None and isinstance(x, (nnx.Pytree, nnx.Variable))


@dataclass(frozen=True)
class Layout:
    """How a call's arguments become the pure step's and back: static, so it keys the compile."""

    graphdef: Any  # nnx GraphDef of the tuple of objects
    tree: Any  # treedef of (args, kwargs), every object one leaf
    slots: tuple[int, ...]  # the leaves of ``tree`` that are objects
    params: tuple[int, ...]  # the Variables (in nnx flatten order) that are nnx.Params
    others: tuple[int, ...]  # every other Variable
    keys: tuple[tuple[int, str], ...]  # Variables holding PRNG keys, with their impl: they travel as key data
    names: tuple[str, ...]  # per Variable: "model/linear/kernel"
    roles: tuple[str, ...]  # per Variable: parameter, optimizer_state or buffer
    object_names: tuple[str, ...]  # per object: "model"
    input_names: tuple[str, ...]  # per leaf of ``tree`` that is no object

    def pure(self, values: Sequence[Any]) -> tuple[list, list]:
        """The Variables' values as the pure step takes them: ``(params, state)``, keys as key data."""
        vals = list(values)
        for i, _ in self.keys:
            vals[i] = jax.random.key_data(vals[i])
        return [vals[i] for i in self.params], [vals[i] for i in self.others]

    def values(self, params: Sequence[Any], state: Sequence[Any]) -> list:
        """The inverse of :meth:`pure`: every Variable's value in nnx flatten order."""
        vals: list[Any] = [None] * (len(self.params) + len(self.others))
        for i, x in zip(self.params, params):
            vals[i] = x
        for i, x in zip(self.others, state):
            vals[i] = x
        for i, impl in self.keys:
            vals[i] = jax.random.wrap_key_data(vals[i], impl=impl)
        return vals


class Inputs:
    """The arguments of a step that are no nnx object (the pytree's children), with the :class:`Layout`."""

    def __init__(self, leaves: Sequence[Any], layout: Layout) -> None:
        self.leaves, self.layout = list(leaves), layout

    def __repr__(self) -> str:
        return f"Inputs({', '.join(self.layout.input_names)})"


jax.tree_util.register_pytree_with_keys(
    Inputs,
    lambda x: (tuple((jax.tree_util.GetAttrKey(n), v) for n, v in zip(x.layout.input_names, x.leaves)), x.layout),
    lambda layout, leaves: Inputs(leaves, layout),
    lambda x: (tuple(x.leaves), x.layout),
)


def is_pure_call(args: Sequence[Any]) -> bool:
    """Are ``args`` the pure form :func:`split_call` makes of a call with nnx objects?"""
    return len(args) == 3 and isinstance(args[2], Inputs)


@dataclass
class Call:
    """One call of an nnx step: its pure arguments and the user's objects to write the results back into."""

    args: tuple  # (params, state, Inputs): the pure step's arguments
    objects: tuple  # the user's objects
    paths: list  # the nnx path of every Variable (nnx flatten order)

    def write_back(self, params: Sequence[Any], state: Sequence[Any]) -> None:
        """Every Variable of the user's objects takes its value from the step's results."""
        from flax.nnx import statelib

        values = self.args[2].layout.values(params, state)
        _nnx().update(self.objects, statelib.from_flat_state(list(zip(self.paths, values))))


def split_call(fn: Callable, args: tuple, kwargs: dict) -> Call | None:
    """The pure form of ``fn(*args, **kwargs)``, or None when no argument holds an nnx object."""
    if _nnx() is None:
        return None
    from flax.nnx import graphlib

    flat, tree = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)), is_leaf=is_object)
    slots = tuple(i for i, (_, x) in enumerate(flat) if is_object(x))
    if not slots:
        return None
    arg_names = _argument_names(fn, len(args))
    leaf_names = [_leaf_name(path, arg_names) for path, _ in flat]
    objects = tuple(flat[i][1] for i in slots)
    graphdef, state = graphlib.flatten(objects)
    nnx = _nnx()
    paths, variables = list(state.paths), list(state.leaves)
    values = [v.get_value() if isinstance(v, nnx.Variable) else v for v in variables]
    roles = tuple(_role(v) for v in variables)
    object_names = tuple(leaf_names[i] for i in slots)
    layout = Layout(
        graphdef=graphdef,
        tree=tree,
        slots=slots,
        params=tuple(i for i, r in enumerate(roles) if r == "parameter"),
        others=tuple(i for i, r in enumerate(roles) if r != "parameter"),
        keys=tuple((i, str(jax.random.key_impl(x))) for i, x in enumerate(values) if _is_key(x)),
        names=tuple("/".join([object_names[p[0]], *map(str, p[1:])]) for p in paths),
        roles=roles,
        object_names=object_names,
        input_names=tuple(n for i, n in enumerate(leaf_names) if i not in slots),
    )
    params, rest = layout.pure(values)
    inputs = Inputs([x for i, (_, x) in enumerate(flat) if i not in slots], layout)
    return Call((params, rest, inputs), objects, paths)


def namer(layout: Layout) -> Callable[[Any], tuple[str, str]]:
    """``trace_step``'s ``names`` for a pure call of ``layout``: each Variable by its object's argument and
    attribute path (``model/linear/kernel``), each other argument by its name (``batch/0``)."""

    def names(path: Any) -> tuple[str, str]:
        pos = path[1].idx
        if pos == 2:
            return "input", path[2].name
        i = (layout.params if pos == 0 else layout.others)[path[2].idx]
        return layout.roles[i], layout.names[i]

    return names


class PureStep:
    """The user's nnx step as the pure step ``(params, state, inputs) -> (out, params, state)``."""

    def __init__(self, fn: Callable) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, params: list, state: list, inputs: Inputs) -> tuple:
        from flax.nnx import graphlib

        layout = inputs.layout
        objects = graphlib.unflatten(layout.graphdef, layout.values(params, state))
        leaves = list(inputs.leaves)
        for slot, obj in zip(layout.slots, objects):
            leaves.insert(slot, obj)
        args, kwargs = jax.tree_util.tree_unflatten(layout.tree, leaves)
        before = _attributes(objects, layout.object_names)
        out = self.fn(*args, **kwargs)
        names = [n for n in layout.input_names]
        for slot, name in zip(layout.slots, layout.object_names):
            names.insert(slot, name)
        check_unchanged(leaves, layout.tree, (args, kwargs), names, is_leaf=is_object)
        _check_output(out)
        graphdef, new = graphlib.flatten(objects, with_paths=False)
        if graphdef != layout.graphdef:
            raise _structure_changed(before, _attributes(objects, layout.object_names))
        old = layout.values(params, state)
        for i, (x, y) in enumerate(zip(old, new)):
            if _aval(x) != _aval(y):
                raise UncarriedChangeError(
                    f"the step changed `{layout.names[i].replace('/', '.')}` from {_aval(x)[1]}{list(_aval(x)[0])} "
                    f"to {_aval(y)[1]}{list(_aval(y)[0])}: a compiled step keeps every Variable's shape and dtype. Give the "
                    f"Variable its final shape and dtype where it is made"
                )
        params_out, state_out = layout.pure(new)
        return out, params_out, state_out


def purified(fn: Callable, args: Sequence[Any]) -> Callable:
    """``fn`` as the pure step when ``args`` are a pure call (:func:`is_pure_call`), else ``fn`` itself."""
    return PureStep(fn) if is_pure_call(args) else fn


def _role(v: Any) -> str:
    nnx = _nnx()
    if isinstance(v, nnx.Param):
        return "parameter"
    if isinstance(v, nnx.OptState):
        return "optimizer_state"
    return "buffer"


def _aval(x: Any) -> tuple[tuple[int, ...], str]:
    return tuple(np.shape(x)), str(jax.numpy.result_type(x))


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _argument_names(fn: Callable, n: int) -> list[str]:
    """The names of the first ``n`` positional parameters of ``fn`` (``argN`` where it has none)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    out = []
    for i in range(n):
        p = params[i] if i < len(params) else None
        ok = p is not None and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        out.append(p.name if ok else f"arg{i}")
    return out


def _leaf_name(path: Any, arg_names: list[str]) -> str:
    head = arg_names[path[1].idx] if path[0].idx == 0 else str(path[1].key)
    rest = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path[2:]]
    return "/".join([head, *rest])


def _check_output(out: Any) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_object)[0]:
        if is_object(x):
            raise UncarriedChangeError(
                f"the step returns an nnx object ({type(x).__name__} at output{jax.tree_util.keystr(path)}): a "
                f"compiled step returns arrays; the nnx objects passed to it are updated in place, so return "
                f"arrays (or nothing) and read the objects"
            )


def _attributes(objects: tuple, object_names: Sequence[str]) -> dict[str, Any]:
    """Every attribute of the objects' graph by its dotted name, as a value to compare: what an object, a
    Variable or an array is (its kind, shape and dtype), or a plain Python value itself."""
    from flax.nnx import graphlib

    out: dict[str, Any] = {}
    for path, x in graphlib.iter_graph(objects):
        if not path or any(isinstance(p, str) and p.startswith("_pytree__") for p in path):
            continue
        name = ".".join([object_names[path[0]], *map(str, path[1:])])
        if is_object(x):
            out[name] = ("object", type(x).__name__)
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            out[name] = ("array", tuple(x.shape), str(x.dtype))
        else:
            out[name] = ("value", x)
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _structure_changed(before: dict[str, Any], after: dict[str, Any]) -> UncarriedChangeError:
    """The error for a step that changed its objects' structure, naming the first attribute that differs."""
    for name in sorted(set(before) | set(after)):
        was, now = before.get(name), after.get(name)
        if was is not None and now is not None and _same(was, now):
            continue
        attr = name.rsplit(".", 1)[-1]
        fix = (
            f"Keep what the step changes in an nnx.Variable (say `self.{attr} = nnx.Variable(jnp.zeros(...))` in "
            f"__init__, then `self.{attr}[...] = new` in the step), or return it from the step"
        )
        if was is None:
            what = f"set a new attribute `{name}` ({_describe(now)})"
        elif now is None:
            what = f"deleted the attribute `{name}` ({_describe(was)})"
        elif was[0] == "value" and now[0] == "value":
            what = f"set the plain Python attribute `{name}` from {was[1]!r} to {now[1]!r}"
        else:
            what = f"replaced the attribute `{name}` ({_describe(was)}) by {_describe(now)}"
        return UncarriedChangeError(f"the step {what}: {_ADVICE}. {fix}")
    return UncarriedChangeError(
        f"the step changed the structure of its nnx objects (their graph definition differs after the step): "
        f"{_ADVICE}. Keep what the step changes in nnx.Variables made in __init__, or return it from the step"
    )


def _describe(entry: tuple) -> str:
    kind = entry[0]
    if kind == "object":
        return f"an nnx {entry[1]}"
    if kind == "array":
        return f"an array {entry[2]}{list(entry[1])}"
    return f"a {type(entry[1]).__name__}"


__all__ = ["Call", "Inputs", "Layout", "PureStep", "is_object", "is_pure_call", "namer", "purified", "split_call"]
