"""Run one JAX primitive on concrete arrays: for ShardCombine, for lowering, and `rules_for`.

Discovery binds the primitive eagerly on CPU numpy pieces. Floating inputs run
in float64 under ``jax.enable_x64`` (only inside the call, so the user's float32
step is untouched); ops carrying a nested jaxpr (scan, while, cond) run in their
own dtypes, since their bodies are typed; a scatter's scalar combiner is retyped
to float64 (:func:`metadist_jax.payload.x64_params`), so a scatter-add runs in
float64 too (in float32 the partial sums of its pieces missed the tolerance and
the data-parallel rule of the embedding's gradient was rejected).

A primitive whose params name shapes is run on a piece with those params
localized from the piece's shape (:func:`metadist_jax.payload.localize`), the
same way in discovery and in the lowered program, so that a rule verified here
is the rule lowered.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import types
from typing import Any, Sequence

import numpy as np

import jax
from jax.extend import core as jcore

from metadist_core.discovery.patterns import NoProxy, proxy_int
from metadist_core.discovery.shardcombine import OpSpec, Unrunnable, discover_rules

from .payload import COPY_KEY, IDENTITY, OpPayload, bind_payload, is_float_dtype
from .trace import GraphBuilder

# -- discovery ----------------------------------------------------------------


def _seed(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16)


# operands that index into another operand: an unknown example is 0 there (always in range)
_INDEX_OPERANDS = {
    "gather": (1,),
    "scatter": (1,),
    "scatter-add": (1,),
    "scatter_add": (1,),
    "scatter-mul": (1,),
    "scatter_mul": (1,),
    "scatter-min": (1,),
    "scatter-max": (1,),
    "scatter_min": (1,),
    "scatter_max": (1,),
    "dynamic_slice": tuple(range(1, 64)),
    "dynamic_update_slice": tuple(range(2, 64)),
}


def _example(aval: Any, rng: np.random.Generator, x64: bool, known: np.ndarray | None, index: bool) -> np.ndarray:
    shape = tuple(aval.shape)
    dt = np.dtype(aval.dtype)
    if is_float_dtype(dt):
        return rng.standard_normal(shape).astype(np.float64 if x64 else dt)
    if known is not None and known.shape == shape:
        return np.asarray(known, dtype=dt)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if index:
        return np.zeros(shape, dtype=dt)
    return rng.integers(0, 2, size=shape).astype(dt)


# Discovery compiles many tiny programs: XLA's CPU fusion emitters and optimization
# passes make each compile far slower than it needs to be for a one-primitive program.
FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}
_fast_ok: list[bool] = [True]
_CACHE: dict[Any, Any] = {}
_CACHE_MAX = 8192


def _no_traceback_filtering():
    """Rejected candidates raise often; JAX's traceback filtering would cost more than the runs."""
    try:
        from jax._src.config import traceback_filtering  # a private switch: fall back quietly without it

        return traceback_filtering("off")
    except Exception:
        return contextlib.nullcontext()


def _compile(fn: Any, args: Sequence[Any]) -> Any:
    with _no_traceback_filtering():
        lowered = jax.jit(fn).lower(*args)
    if _fast_ok[0]:
        try:
            with _no_traceback_filtering():
                return lowered.compile(compiler_options=FAST_COMPILE)
        except Exception as e:  # an XLA build without these options
            if "compile option" not in str(e).lower() and "option" not in str(e).lower():
                raise
            _fast_ok[0] = False
    return lowered.compile()


class _Runner:
    """``fn(*numpy)`` -> list of numpy outputs: the op compiled once per piece shape, under x64 when asked."""

    def __init__(self, payload: OpPayload, full_shapes: list[tuple], x64: bool, key: str = "") -> None:
        self.payload, self.full_shapes, self.x64 = payload, full_shapes, x64
        self.key = key or f"{id(payload)}"

    def _run(self, xs: Sequence[np.ndarray], reshape_to: tuple | None = None) -> list[np.ndarray]:
        xs = [np.asarray(x) for x in xs]
        ck = (self.key, self.x64, reshape_to, tuple((x.shape, x.dtype.str) for x in xs))
        with jax.enable_x64(self.x64):
            hit = _CACHE.get(ck)
            if hit is None:

                def f(*ts):
                    return bind_payload(
                        self.payload, ts, full_shapes=self.full_shapes, reshape_to=reshape_to, x64=self.x64
                    )

                try:
                    hit = _compile(f, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs])
                except Exception as e:  # the op refuses these shapes: remembered, re-raised each time
                    hit = e
                if len(_CACHE) >= _CACHE_MAX:
                    _CACHE.clear()
                _CACHE[ck] = hit
            if isinstance(hit, Exception):
                raise hit
            return [np.asarray(o) for o in hit(*xs)]

    def __call__(self, *xs: np.ndarray) -> list[np.ndarray]:
        return self._run(xs)

    def reshape(self, x: np.ndarray, shape: tuple) -> list[np.ndarray]:
        return self._run([x], reshape_to=tuple(shape))


def op_spec(op: Any, graph: Any) -> OpSpec:
    """An OpSpec that binds a traced JAX op on numpy pieces (float64 where the op allows it)."""
    payload: OpPayload | None = op.payload
    ctx = getattr(graph, "payload", None)
    if payload is None:
        if op.key == COPY_KEY:
            payload = IDENTITY
        else:
            raise Unrunnable(f"{op.key} ({op.id}) carries no primitive: trace the step with metadist_jax to run it")
    if payload.prim is not None and (
        payload.prim.name.startswith("random_") or payload.name in ("rng_bit_generator", "rng_uniform", "threefry2x32")
    ):
        raise Unrunnable(f"{op.key} draws random numbers")
    hint = getattr(graph, "proxy_sizes", None)
    if hint:  # the op at proxy sizes (metadist_core.discovery.patterns.proxy_op): its params follow
        payload = proxied_payload(payload, hint["map"], hint["small"])
    avals = getattr(ctx, "avals", {}) or {}
    examples_known = getattr(ctx, "examples", {}) or {}
    for v in op.inputs + op.outputs:
        if graph.vars[v].shape is None or (v in avals and not hasattr(avals[v], "shape")):
            raise Unrunnable(f"{op.key} ({op.id}) has a non-array value {v}")
        if v in avals and not _plain_dtype(avals[v].dtype):
            raise Unrunnable(f"{op.key} ({op.id}) works on {avals[v].dtype} values")
    x64 = payload.runs_in_float64()
    rng = np.random.default_rng(_seed(op.signature(graph)))
    examples = []
    index_slots = {
        payload.layout[pos]
        for pos in _INDEX_OPERANDS.get(payload.name, ())
        if pos < len(payload.layout) and isinstance(payload.layout[pos], int)
    }
    for slot, v in enumerate(op.inputs):
        aval = avals.get(v) or jax.ShapeDtypeStruct(graph.vars[v].shape, np.dtype(graph.vars[v].dtype))
        examples.append(_example(aval, rng, x64, examples_known.get(v), slot in index_slots))
    full_shapes = [tuple(graph.vars[v].shape) for v in op.inputs]
    run = _Runner(payload, full_shapes, x64, key=_runner_key(op, full_shapes))
    if payload.name == "reshape":
        return OpSpec(run, examples, op.key, reshape_fn=run.reshape, out_shape=tuple(graph.vars[op.outputs[0]].shape))
    return OpSpec(run, examples, op.key)


def _map_sizes(value: Any, sizes: dict, small: int) -> Any:
    """``value`` (a primitive's param) with every integer rewritten by :func:`proxy_int`, inside tuples,
    lists and NamedTuples (dimension numbers); an integer array holding a large value cannot be kept."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return type(value)(proxy_int(int(value), sizes, small))
    if hasattr(value, "_fields") and hasattr(value, "_replace"):  # a NamedTuple (dimension numbers)
        return value._replace(**{f: _map_sizes(getattr(value, f), sizes, small) for f in value._fields})
    if isinstance(value, (tuple, list)):
        return type(value)(_map_sizes(v, sizes, small) for v in value)
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.integer):
        if value.size and int(np.max(np.abs(value))) > small:
            raise NoProxy("an integer array param holds sizes")
        return value
    return value


def proxied_payload(payload: OpPayload, sizes: dict, small: int) -> OpPayload:
    """The payload of an op whose sizes are proxies: size-bearing params (a broadcast's shape, a reshape's
    new sizes, slice bounds, slice sizes) rewritten by value, as proxy_op rewrote its attrs. NoProxy for
    an op carrying a jaxpr (its body is typed at the real sizes) or a literal with a large dim."""
    if payload.prim is None:
        return payload
    if payload.has_jaxpr():
        raise NoProxy("it carries a jaxpr typed at its real sizes")
    for lit in payload.layout:
        if not isinstance(lit, int) and any(int(d) > small for d in np.shape(lit[1])):
            raise NoProxy(f"a literal operand of shape {np.shape(lit[1])}")
    sizes = {int(k): int(v) for k, v in sizes.items()}
    params = {k: _map_sizes(v, sizes, small) for k, v in payload.params.items()}
    outs = tuple(
        jax.ShapeDtypeStruct(tuple(sizes.get(int(d), int(d)) for d in a.shape), a.dtype) if hasattr(a, "shape") else a
        for a in payload.out_avals
    )
    return OpPayload(payload.prim, params, payload.layout, outs)


def _runner_key(op: Any, full_shapes: list[tuple]) -> str:
    """What decides a compiled piece program besides the piece shapes: key, params, literals, full shapes."""
    import json

    return json.dumps([op.key, op.attrs, [list(s) for s in full_shapes]], sort_keys=True, default=str)


def _plain_dtype(dt: Any) -> bool:
    try:
        np.dtype(dt)
    except TypeError:
        return False
    return not hasattr(dt, "_rules")


# -- rules_for ------------------------------------------------------------------


def rules_for(op: Any, *example_inputs: Any, axis_size: int = 2, **params: Any):
    """The verified one-axis ShardingRules of a JAX primitive or callable on these example inputs.

    ``op`` is a primitive (``jax.lax.exp_p``; its params as keyword arguments)
    or any callable over arrays (``jnp.matmul``, ``lambda x: x.reshape(4, -1)``).
    ``example_inputs`` are the positional arguments; every array among them,
    also inside lists and tuples, is one input of the rules, in order. Floats
    run in float64. A callable that traces to one primitive is run exactly as
    the frontend runs that primitive inside a step.
    """
    leaves, tree = jax.tree_util.tree_flatten(list(example_inputs))
    is_arr = [isinstance(x, (np.ndarray, jax.Array)) for x in leaves]
    arrays = [np.asarray(x) for x, a in zip(leaves, is_arr) if a]

    def call(*xs):
        it = iter(xs)
        full = [next(it) if a else x for x, a in zip(leaves, is_arr)]
        args = jax.tree_util.tree_unflatten(tree, full)
        if isinstance(op, jcore.Primitive):
            return op.bind(*args, **params)
        return op(*args)

    spec = _single_op_spec(call, arrays, getattr(op, "name", getattr(op, "__name__", "op")))
    return discover_rules(spec, axis_size)


def _single_op_spec(call: Any, arrays: list[np.ndarray], name: str) -> OpSpec:
    closed = jax.make_jaxpr(call)(*arrays)
    b = GraphBuilder(name)
    ins = [("var", b.add_input(f"x{i}", a, "input")) for i, a in enumerate(closed.in_avals)]
    outs = b.walk(closed.jaxpr, closed.consts, ins)
    ops = b.ir.ops
    if (
        len(ops) == 1
        and not b.const_ids
        and [o[1] for o in outs] == ops[0].outputs
        and sorted(ops[0].inputs) == sorted(b.ir.inputs)
        and len(set(ops[0].inputs)) == len(ops[0].inputs)
    ):
        # one primitive: run it exactly as inside a traced step
        op = ops[0]
        b.ir.payload = types.SimpleNamespace(avals=b.avals, examples={})
        spec = op_spec(op, b.ir)
        order = [b.ir.inputs.index(v) for v in op.inputs]
        spec.example_inputs = [_upcast(arrays[i]) for i in order]
        if order != sorted(order):
            inner = spec.fn
            spec.fn = lambda *xs: inner(*[xs[order.index(i)] for i in range(len(xs))])
        spec.name = name
        return spec
    x64 = True

    def fn(*xs):
        with jax.enable_x64(x64):
            out = jax.jit(call)(*xs)
            return [np.asarray(o) for o in jax.tree_util.tree_leaves(out)]

    return OpSpec(fn, [_upcast(a) for a in arrays], name)


def _upcast(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) if is_float_dtype(a.dtype) else a


# -- cost -----------------------------------------------------------------------


def _numel(aval: Any) -> int:
    return int(math.prod(getattr(aval, "shape", ()) or ()))


def _nbytes(aval: Any) -> int:
    try:
        return _numel(aval) * np.dtype(aval.dtype).itemsize
    except TypeError:
        return _numel(aval) * 4


def eqn_flops(name: str, params: dict, in_avals: Sequence[Any], out_avals: Sequence[Any]) -> float:
    """FLOPs of one primitive application: exact for dot_general and conv, output size otherwise."""
    out_n = sum(_numel(a) for a in out_avals)
    if name == "dot_general" and len(in_avals) >= 2:
        (lc, _), _ = params["dimension_numbers"]
        k = math.prod(in_avals[0].shape[d] for d in lc) if lc else 1
        return 2.0 * out_n * k
    if name == "conv_general_dilated" and len(in_avals) >= 2:
        rhs = in_avals[1].shape
        dn = params.get("dimension_numbers")
        spatial = math.prod(rhs[d] for d in dn.rhs_spec[2:]) if dn is not None else math.prod(rhs[2:])
        cin = rhs[dn.rhs_spec[1]] if dn is not None else rhs[1]
        return 2.0 * out_n * spatial * cin
    if name in ("scan", "while", "cond"):
        return float(sum(_jaxpr_flops(j) for j in _sub_jaxprs(params)) * (params.get("length") or 1))
    if name in (
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "argmax",
        "argmin",
        "cumsum",
        "cumprod",
        "cummax",
        "cumlogsumexp",
    ):
        return float(sum(_numel(a) for a in in_avals))
    return float(out_n)


def _sub_jaxprs(params: dict) -> list:
    out = []
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else [v]:
            if isinstance(x, jcore.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                out.append(x)
    return out


def _jaxpr_flops(jaxpr: Any) -> float:
    total = 0.0
    for e in jaxpr.eqns:
        total += eqn_flops(e.primitive.name, e.params, [v.aval for v in e.invars], [v.aval for v in e.outvars])
    return total


def op_cost(op: Any, graph: Any) -> tuple[float, float] | None:
    """(flops, bytes moved) of a traced JAX op, for the cost model."""
    payload: OpPayload | None = op.payload
    avals = getattr(getattr(graph, "payload", None), "avals", {}) or {}
    ins = [avals.get(v) or graph.vars[v] for v in op.inputs]
    outs = [avals.get(v) or graph.vars[v] for v in op.outputs]
    nbytes = float(sum(graph.vars[v].nbytes for v in op.inputs + op.outputs))
    if payload is None or payload.prim is None:
        return (float(sum(_numel(a) for a in outs)), nbytes)
    shapes = [a if hasattr(a, "shape") else None for a in ins]
    return (eqn_flops(payload.name, payload.params, shapes, outs), nbytes)
