"""Trace a pure JAX step into MetaIR.

The step ``(params, opt_state, batch) -> (loss, params, opt_state)`` goes
through :func:`jax.make_jaxpr`; nested jaxprs (``jit``/pjit, ``custom_jvp_call``,
``custom_vjp_call``, ``closed_call``, ``checkpoint``) are inlined, so that every
MetaOp is one primitive. Control flow (``scan``, ``while``, ``cond``) stays one
op: it runs replicated unless ShardCombine verifies a rule for it.

Every MetaOp keeps a :class:`~metadist_jax.payload.OpPayload` (the primitive,
its params, where scalar literals sit among its operands) for running it during
discovery and for lowering. Static params go into ``attrs`` in a JSON-able form
(they key the rule cache); literals go into ``attrs["literals"]``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

import jax
from jax.extend import core as jcore

from metadist_core.ir.ir import MetaIR, canonical_dtype

from .effects import GlobalsWatch, UncarriedChangeError, check_leaves, check_unchanged
from .payload import COPY_KEY, KEY_PREFIX, OpPayload, bind_payload

log = logging.getLogger("metadist.jax.trace")

# part of every op's attrs, hence of its rule-cache signature: bump it when the way an op is run on
# pieces changes (localized params, examples), so that rules found the old way are not reused
RUNNER_VERSION = 1

# primitive name -> the param holding the jaxpr that is inlined in its place
_INLINE = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
# identity primitives that carry no computation
_IDENTITY = {"sharding_constraint", "optimization_barrier_identity", "pvary", "copy", "copy_p"}

# dtypes the core does not list, mapped to one of the same size (the real dtype stays in the context)
_DTYPE_PROXY = {"int4": "int8", "uint4": "uint8"}


class TraceError(ValueError):
    """The step cannot be traced into MetaIR as written."""


@dataclass
class TraceContext:
    """What lowering needs beyond the MetaIR: the pytrees, the constants and the real avals."""

    in_tree: Any  # treedef of (args, kwargs)
    out_tree: Any  # treedef of the step's output
    input_ids: list[str]  # graph input id per input leaf
    const_ids: list[str]  # graph input ids of captured constants
    const_values: dict[str, np.ndarray]  # their values
    output_ids: list[str]  # graph output var per output leaf
    avals: dict[str, Any]  # var id -> jax ShapedArray (real dtype)
    examples: dict[str, np.ndarray] = field(default_factory=dict)  # concrete integer values seen at trace
    n_params: int = 0
    n_state: int = 0
    static: dict[int, Any] = field(default_factory=dict)  # leaf index -> static value, fixed in the trace

    def dynamic(self, leaves: Sequence[Any]) -> list[Any]:
        """The leaves of a call that are graph inputs (in ``input_ids`` order): all but the static ones."""
        return [x for i, x in enumerate(leaves) if i not in self.static]

    def spread(self, values: Sequence[Any], fill: Any = None) -> list[Any]:
        """``values`` (one per graph input) laid over every leaf of a call, ``fill`` at the static leaves."""
        it = iter(values)
        return [fill if i in self.static else next(it) for i in range(len(self.static) + len(self.input_ids))]


def dtype_name(dtype: Any) -> str:
    """The core's canonical dtype string for a JAX dtype (a same-size proxy for ones it lacks)."""
    s = str(np.dtype(dtype)) if not hasattr(dtype, "_rules") else str(dtype)
    s = _DTYPE_PROXY.get(s, s)
    try:
        return canonical_dtype(s)
    except ValueError:
        return "uint8" if "key" in s else "float32"


def jsonable(value: Any, depth: int = 0) -> Any:
    """A JSON-able, stable stand-in for a primitive param (it keys the rule cache)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, float) and not np.isfinite(value):
            return str(value)
        return value
    if isinstance(value, (np.generic,)):
        return jsonable(value.item(), depth)
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return str(np.dtype(value))
    if isinstance(value, np.ndarray):
        return {
            "array": value.tolist() if value.size <= 64 else hashlib.sha1(value.tobytes()).hexdigest(),
            "dtype": str(value.dtype),
        }
    if isinstance(value, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return {"jaxpr": hashlib.sha1(_stable(str(value)).encode()).hexdigest()}
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (tuple, list)):
        return [jsonable(v, depth + 1) for v in value]
    if hasattr(value, "_asdict"):
        return {type(value).__name__: jsonable(value._asdict(), depth + 1)}
    if hasattr(value, "__dataclass_fields__"):
        return {type(value).__name__: {k: jsonable(getattr(value, k), depth + 1) for k in value.__dataclass_fields__}}
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # a jax array
        return jsonable(np.asarray(value), depth)
    return _stable(str(value))


def _stable(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _walk_params(params: dict) -> dict:
    return {k: jsonable(v) for k, v in sorted(params.items())}


class GraphBuilder:
    """Builds a MetaIR from a jaxpr: one MetaOp per primitive, nested jaxprs inlined."""

    def __init__(self, name: str) -> None:
        self.ir = MetaIR(name)
        self.avals: dict[str, Any] = {}
        self.const_ids: list[str] = []
        self.const_values: dict[str, np.ndarray] = {}
        self.n = 0

    def fresh(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def add_input(self, vid: str, aval: Any, role: str) -> str:
        self.ir.add_input(vid, tuple(aval.shape), dtype_name(aval.dtype), role)
        self.avals[vid] = aval
        return vid

    def add_const(self, value: Any) -> str:
        arr = np.asarray(value)
        vid = self.fresh("const")
        self.add_input(vid, jax.ShapeDtypeStruct(arr.shape, arr.dtype), "buffer")
        self.const_ids.append(vid)
        self.const_values[vid] = arr
        return vid

    # env values: ("var", id) or ("lit", numpy value)
    def read(self, env: dict, atom: Any) -> tuple[str, Any]:
        if isinstance(atom, jcore.Literal):
            return ("lit", np.asarray(atom.val, dtype=atom.aval.dtype))
        return env[atom]

    def walk(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            arr = np.asarray(c)
            env[v] = ("lit", arr) if arr.ndim == 0 else ("var", self.add_const(arr))
        if len(jaxpr.invars) != len(args):
            raise TraceError(f"jaxpr takes {len(jaxpr.invars)} inputs, got {len(args)}")
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [self.read(env, a) for a in eqn.invars])
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
        return [self.read(env, a) for a in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        name = eqn.primitive.name
        sub = eqn.params.get(_INLINE.get(name, ""), None)
        if sub is not None:
            if isinstance(sub, jcore.ClosedJaxpr):
                return self.walk(sub.jaxpr, sub.consts, ins)
            if isinstance(sub, jcore.Jaxpr):
                return self.walk(sub, [], ins)
        if name in _IDENTITY and len(ins) == len(eqn.outvars):
            return list(ins)
        return self.op(KEY_PREFIX + name, eqn.primitive, dict(eqn.params), ins, [v.aval for v in eqn.outvars])

    def op(self, key: str, prim: Any, params: dict, ins: list[tuple[str, Any]], out_avals: list) -> list:
        layout: list[Any] = []
        inputs: list[str] = []
        literals = []
        for pos, (kind, val) in enumerate(ins):
            if kind == "var":
                layout.append(len(inputs))
                inputs.append(val)
            else:
                layout.append(("lit", val))
                literals.append([pos, jsonable(val), str(val.dtype)])
        out_ids = []
        base = key[len(KEY_PREFIX) :].replace("-", "_")
        outs = []
        for aval in out_avals:
            vid = self.fresh(base)
            shape = tuple(aval.shape) if hasattr(aval, "shape") else None
            self.ir.add_var(vid, shape, dtype_name(aval.dtype) if hasattr(aval, "dtype") else "float32")
            self.avals[vid] = aval
            out_ids.append(vid)
            outs.append(("var", vid))
        attrs = {"params": _walk_params(params), "runner": RUNNER_VERSION}
        if literals:
            attrs["literals"] = literals
        payload = OpPayload(prim, params, layout, tuple(out_avals))
        self.ir.add_op(key, inputs, [self.ir.vars[o] for o in out_ids], attrs, id=f"op_{out_ids[0]}", payload=payload)
        return outs

    def copy(self, src: tuple[str, Any]) -> str:
        """A fresh var holding ``src`` (a var or a literal), made by an identity op."""
        kind, val = src
        if kind == "lit":
            val = self.add_const(val)
        aval = self.avals[val]
        (out,) = self.op(COPY_KEY, None, {}, [("var", val)], [aval])
        return out[1]


def is_state_path(path: Any) -> bool:
    """Is the leaf at ``path`` (in the ``(args, kwargs)`` pytree) a parameter or optimizer state (args 0, 1)?"""
    return path[0].idx == 0 and len(path) > 1 and getattr(path[1], "idx", None) in (0, 1)


def static_leaves(flat_with_path: Sequence[tuple[Any, Any]]) -> dict[int, Any]:
    """The static leaves of a call's flat ``(path, leaf)`` list, by index: each Python ``bool`` or ``str``
    outside the parameters and optimizer state. Such a value steers the step's Python code (a flag, a mode),
    so it is fixed in the trace and keys the compile, as ``jax.jit``'s ``static_argnames`` would make it; a
    Python int or float stays a traced input, so that a new value needs no new compile."""
    return {
        i: x for i, (path, x) in enumerate(flat_with_path) if isinstance(x, (bool, str)) and not is_state_path(path)
    }


def call_signature(args: tuple, kwargs: dict) -> Any:
    """The compile-cache key of a call: the pytree structure, every leaf's shape and dtype, and the value
    of every static leaf (:func:`static_leaves`)."""
    flat, tree = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))
    static = static_leaves(flat)
    return tree, tuple(
        ("static", type(x).__name__, x)
        if i in static
        else (x.shape, x.dtype)
        if isinstance(x, (jax.Array, np.ndarray))
        else (tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)))
        for i, (_, x) in enumerate(flat)
    )


def unplaced(x: Any) -> Any:
    """``x`` as the trace takes it: a jax.Array by its shape, dtype and weak type alone. Traced on an array
    placed on a mesh, primitives record that mesh in their params (``broadcast_in_dim``'s ``sharding``),
    and then cannot bind inside the lowered shard_map, whose mesh is manual."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type)
    return x


def _leaf_name(prefix: str, path: Any) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join([prefix, *parts]) if parts else prefix


def input_name(path: Any) -> tuple[str, str]:
    """The role and name of the argument leaf at ``path`` (in the ``(args, kwargs)`` pytree) of a pure step:
    ``params/...`` (parameters), ``opt_state/...`` (optimizer state), ``batch/...``, ``argN/...``, ``kw/...``."""
    if path[0].idx == 0 and len(path) > 1 and hasattr(path[1], "idx"):
        pos = path[1].idx
        role = "parameter" if pos == 0 else "optimizer_state" if pos == 1 else "input"
        prefix = {0: "params", 1: "opt_state"}.get(pos, "batch" if pos == 2 else f"arg{pos}")
        return role, _leaf_name(prefix, path[2:])
    return "input", _leaf_name("kw", path[1:])


def trace_step(
    fn: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    name: str | None = None,
    names: Callable[[Any], tuple[str, str]] = input_name,
) -> tuple[MetaIR, TraceContext]:
    """Trace ``fn(*args, **kwargs)`` into a MetaIR and the context lowering needs.

    ``args[0]`` and ``args[1]`` are the state (by default the parameters and the optimizer state); the
    step must return ``(loss, new_args0, new_args1, ...)`` with the new values shaped like the old ones:
    they become the state aliases. Steps with fewer than two arguments are traced without state. Static
    leaves (:func:`static_leaves`) are fixed in the trace and are no graph inputs. ``names`` gives each
    argument leaf's role and name from its path (:func:`input_name`). A step that changes what its program
    cannot carry back (:mod:`metadist_jax.effects`) is an error naming it.
    """
    kwargs = dict(kwargs or {})
    flat_with_path, in_tree = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs))
    static = static_leaves(flat_with_path)
    leaves = [x for i, (_, x) in enumerate(flat_with_path) if i not in static]
    roles, ids, every_name = [], [], []
    seen: set[str] = set()
    for i, (path, _) in enumerate(flat_with_path):
        role, vid = names(path)
        every_name.append(vid)
        if i in static:
            continue
        while vid in seen:
            vid += "_"
        seen.add(vid)
        roles.append(role)
        ids.append(vid)
    check_leaves(list(zip(ids, leaves)))

    def flat_fn(*xs):
        it = iter(xs)
        every = [static[i] if i in static else next(it) for i in range(len(flat_with_path))]
        a, k = jax.tree_util.tree_unflatten(in_tree, every)
        out = fn(*a, **k)
        check_unchanged(every, in_tree, (a, k), every_name)
        return out

    watch = GlobalsWatch(fn)
    try:
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*map(unplaced, leaves))
    except UncarriedChangeError:
        raise
    except Exception as e:
        raise TraceError(
            f"jax.make_jaxpr could not trace {getattr(fn, '__name__', fn)!r}: {type(e).__name__}: {e}"
        ) from e
    watch.check()
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    b = GraphBuilder(name or getattr(fn, "__name__", "step"))
    in_vals = []
    for vid, role, aval in zip(ids, roles, closed.in_avals):
        b.add_input(vid, aval, role)
        in_vals.append(("var", vid))
    outs = b.walk(closed.jaxpr, closed.consts, in_vals)

    # every output leaf becomes a distinct var made by an op (copies for pass-throughs and literals)
    out_ids: list[str] = []
    used: set[str] = set()
    for o in outs:
        if o[0] == "lit" or o[1] in b.ir.inputs or o[1] in used:
            vid = b.copy(o)
        else:
            vid = o[1]
        used.add(vid)
        out_ids.append(vid)
    b.ir.set_outputs(out_ids)

    n_params = n_state = 0
    if len(args) >= 2 and isinstance(out_shape, (tuple, list)) and len(out_shape) >= 3:
        for pos in (0, 1):
            in_t = jax.tree_util.tree_structure(args[pos])
            out_t = jax.tree_util.tree_structure(out_shape[pos + 1])
            if in_t != out_t:
                raise TraceError(
                    f"the step returns a new {'params' if pos == 0 else 'opt_state'} shaped {out_t}, but takes "
                    f"{in_t}; a step must return (loss, params, opt_state) with the same structure it takes"
                )
        dynamic_paths = [path for i, (path, _) in enumerate(flat_with_path) if i not in static]
        i_leaf = [i for i, path in enumerate(dynamic_paths) if is_state_path(path)]
        first = len(jax.tree_util.tree_leaves(out_shape[0]))
        o_leaf = list(range(first, first + len(i_leaf)))
        for i, o in zip(i_leaf, o_leaf):
            b.ir.alias(ids[i], out_ids[o])
        n_params = sum(1 for path in dynamic_paths if is_state_path(path) and path[1].idx == 0)
        n_state = len(i_leaf) - n_params
    b.ir.validate()
    ctx = TraceContext(
        in_tree,
        out_tree,
        ids,
        b.const_ids,
        b.const_values,
        out_ids,
        b.avals,
        n_params=n_params,
        n_state=n_state,
        static=static,
    )
    ctx.examples = integer_examples(b.ir, ctx, dict(zip(ids, leaves)))
    b.ir.payload = ctx  # frontend-private data for lowering (not serialised)
    log.info("traced %s: %d ops over %d inputs", b.ir.name, len(b.ir.ops), len(b.ir.inputs))
    return b.ir, ctx


def _is_int(aval: Any) -> bool:
    """Integer or bool (the values whose range matters: indices, labels, masks, predicates)."""
    try:
        dt = np.dtype(aval.dtype)
    except TypeError:
        return False
    return np.issubdtype(dt, np.integer) or dt == np.bool_


def integer_examples(
    ir: MetaIR, ctx: TraceContext, inputs: dict[str, Any], limit: int = 1 << 20
) -> dict[str, np.ndarray]:
    """Concrete values of the integer vars computable from integer inputs alone (labels, indices, iotas).

    Discovery draws integer inputs from the range of these examples, so that
    indices stay in range and a gather is verified on the lookups it really does.
    """
    vals: dict[str, np.ndarray] = {}
    for vid, x in inputs.items():
        aval = ctx.avals[vid]
        if _is_int(aval) and np.prod(aval.shape, dtype=np.int64) <= limit:
            try:
                vals[vid] = np.asarray(x)
            except Exception:  # a global array this process cannot read whole
                pass
    for vid, x in ctx.const_values.items():
        if _is_int(ctx.avals[vid]):
            vals[vid] = x
    for op in ir.ops:
        if op.payload is None and op.key != COPY_KEY:
            continue
        outs = [ctx.avals[o] for o in op.outputs]
        if not outs or not all(_is_int(a) for a in outs) or not all(v in vals for v in op.inputs):
            continue
        if any(np.prod(a.shape, dtype=np.int64) > limit for a in outs):
            continue
        if op.key == COPY_KEY:
            vals[op.outputs[0]] = vals[op.inputs[0]]
            continue
        try:
            res = bind_payload(op.payload, [vals[v] for v in op.inputs])
        except Exception:
            continue
        for o, r in zip(op.outputs, res):
            vals[o] = np.asarray(r)
    return vals
