"""Build a TE op at given shapes, run it on numpy arrays, and make it an OpSpec for ShardCombine.

A kernel is the op's call (:class:`metadist_tvm.record.Call`) rebuilt on
placeholders of the wanted shapes and dtypes, turned into a PrimFunc with
``te.create_prim_func`` and compiled for the ``llvm`` target. Kernels are
cached by (op key, builder, static attributes, input shapes, input dtypes), so
discovery and execution build each shape once; :attr:`KernelCache.builds`
counts the compilations.

Discovery runs float ops in float64 (the kernels are rebuilt in float64), so
that ShardCombine's tolerance stays tight; integer inputs keep their dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import tvm
from tvm import te

from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.discovery.patterns import NoProxy, proxy_int
from metadist_core.discovery.rules import ShardingRule
from metadist_core.discovery.shardcombine import OpSpec, Unrunnable, discover_rules

from .plain import plain_call
from .rebuild import ComputeRebuilder
from .record import Call, Slot, template

log = logging.getLogger("metadist.tvm")

TARGET = "llvm"


@dataclass
class Kernel:
    """One compiled op at fixed input shapes and dtypes."""

    func: Any  # the compiled "main"
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[str, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[str, ...]

    def __call__(self, *arrays: np.ndarray) -> list[np.ndarray]:
        dev = tvm.cpu()
        ins = []
        for a, shp, dt in zip(arrays, self.in_shapes, self.in_dtypes):
            a = np.ascontiguousarray(np.asarray(a, dtype=dt))
            if a.shape != shp:
                raise ValueError(f"kernel built for input shape {shp} got {a.shape}")
            ins.append(tvm.runtime.tensor(a, dev))
        outs = [tvm.runtime.empty(s, d, dev) for s, d in zip(self.out_shapes, self.out_dtypes)]
        self.func(*ins, *outs)
        return [o.numpy() for o in outs]


class KernelCache:
    """Compiled kernels by (op key, builder, static attrs, input shapes, input dtypes)."""

    def __init__(self) -> None:
        self._kernels: dict[tuple, Kernel] = {}
        self._lock = threading.Lock()
        self.builds = 0  # compilations done
        self.hits = 0  # lookups served from the cache

    def __len__(self) -> int:
        return len(self._kernels)

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()
            self.builds = self.hits = 0

    def get(self, call: Call, shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> Kernel:
        shapes = tuple(tuple(int(s) for s in shp) for shp in shapes)
        dtypes = tuple(str(d) for d in dtypes)
        key = (*call.cache_key, shapes, dtypes)
        with self._lock:
            k = self._kernels.get(key)
            if k is not None:
                self.hits += 1
                return k
        k = build_kernel(call, shapes, dtypes)
        with self._lock:
            self._kernels[key] = k
            self.builds += 1
        return k


_DEFAULT_CACHE = KernelCache()


def kernel_cache() -> KernelCache:
    """The process's kernel cache (shared by discovery and execution)."""
    return _DEFAULT_CACHE


def build_kernel(call: Call, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str]) -> Kernel:
    """Rebuild ``call`` on placeholders of ``shapes``/``dtypes`` and compile it for llvm."""
    phs = [te.placeholder(s, dtype=d, name=f"in{i}") for i, (s, d) in enumerate(zip(shapes, dtypes))]
    outs = call.build(phs)
    for o in outs:
        if any(o.same_as(p) for p in phs):
            raise Unrunnable(f"{call.key} returns one of its inputs unchanged; nothing to compile")
    if call.fixed:  # the compute reads its own placeholders: they are the kernel's arguments
        phs = list(call.inputs)
    func = te.create_prim_func([*phs, *outs])
    exe = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
    return Kernel(
        exe["main"],
        tuple(shapes),
        tuple(dtypes),
        tuple(tuple(int(s) for s in o.shape) for o in outs),
        tuple(str(o.dtype) for o in outs),
    )


def run_call(call: Call, arrays: Sequence[np.ndarray], cache: KernelCache | None = None) -> list[np.ndarray]:
    """Run ``call`` on numpy ``arrays`` (one per tensor input) with a kernel built at their shapes."""
    cache = cache or _DEFAULT_CACHE
    arrays = [np.asarray(a) for a in arrays]
    k = cache.get(call, [a.shape for a in arrays], [str(a.dtype) for a in arrays])
    return k(*arrays)


def run_reshape(call: Call, x: np.ndarray, target: Sequence[int], cache: KernelCache | None = None) -> list[np.ndarray]:
    """Run a reshape op with its target shape replaced by ``target`` (a device's local target shape)."""
    pos = call.reshape_arg
    if pos is None:
        raise ValueError(f"{call.key} is not a reshape op")
    return run_call(call.with_arg(pos, [int(s) for s in target]), [x], cache)


# -- discovery ------------------------------------------------------------------


_FLOAT_KINDS = "fc"


def discovery_dtype(dtype: str) -> np.dtype:
    d = np.dtype(dtype) if dtype != "bfloat16" else np.dtype("float32")
    if d.kind == "f":
        return np.dtype("float64")
    if d.kind == "c":
        return np.dtype("complex128")
    return d


def spec_for_call(
    call: Call, examples: Sequence[np.ndarray], out_shape: Sequence[int] | None = None, cache: KernelCache | None = None
) -> OpSpec:
    """An OpSpec running ``call`` on numpy inputs; a reshape op gets its ``reshape_fn``."""
    cache = cache or _DEFAULT_CACHE
    examples = _runnable_examples(call, list(examples), cache)

    def fn(*xs):
        outs = run_call(call, xs, cache)
        return outs[0] if len(outs) == 1 else tuple(outs)

    if call.reshape_arg is not None:
        if out_shape is None:
            out_shape = tuple(cache.get(call, [examples[0].shape], [str(examples[0].dtype)]).out_shapes[0])

        def reshape_fn(x, target):
            return run_reshape(call, x, target, cache)[0]

        return OpSpec(fn, list(examples), call.key, reshape_fn=reshape_fn, out_shape=tuple(out_shape))
    return OpSpec(fn, list(examples), call.key)


def _runnable_examples(call: Call, examples: list[np.ndarray], cache: KernelCache) -> list[np.ndarray]:
    """The examples, in float64 when the op builds in float64, else in float32.

    Some TOPI operators refuse float64 (``layer_norm`` in TVM 0.27 takes only
    float32 and float16): those are discovered in float32, with
    ShardCombine's float32 tolerance.
    """
    try:
        cache.get(call, [x.shape for x in examples], [str(x.dtype) for x in examples])
        return examples
    except Exception as e64:
        if not any(x.dtype == np.float64 for x in examples):
            raise
        low = [x.astype(np.float32) if x.dtype == np.float64 else x for x in examples]
        try:
            cache.get(call, [x.shape for x in low], [str(x.dtype) for x in low])
        except Exception:
            raise e64 from None
        log.debug("%s does not build in float64 (%s); discovering it in float32", call.key, e64)
        return low


def _example(shape: Sequence[int], dtype: str, rng: np.random.Generator) -> np.ndarray:
    d = discovery_dtype(dtype)
    if d.kind in _FLOAT_KINDS:
        return rng.standard_normal(tuple(shape)).astype(d)
    if d.kind == "b":
        return rng.random(tuple(shape)) < 0.5
    return rng.integers(0, 4, size=tuple(shape)).astype(d)


def op_spec(op: MetaOp, graph: MetaIR, seed: int = 0) -> OpSpec:
    """The OpSpec of a traced TE op: its call, run in float64 on random examples at the op's shapes."""
    call = op.payload
    if not isinstance(call, Call):
        raise Unrunnable(f"{op.key} ({op.id}) carries no TE call to rebuild; trace the graph in this process")
    if call.opaque:
        raise Unrunnable(f"{op.key} cannot be rebuilt at shard shapes: {call.opaque}")
    hint = getattr(graph, "proxy_sizes", None)
    if hint:  # the op at proxy sizes (metadist_core.discovery.patterns.proxy_op): its static arguments follow
        call = proxied_call(call, hint["map"], hint["small"])
    rng = np.random.default_rng(seed)
    examples = [_example(graph.vars[v].shape, graph.vars[v].dtype, rng) for v in op.inputs]
    out_shape = graph.vars[op.outputs[0]].shape if call.reshape_arg is not None else None
    return spec_for_call(call, examples, out_shape)


def _proxied(value: Any, sizes: dict, small: int) -> Any:
    """A static argument with every integer rewritten by :func:`proxy_int` (lists, tuples, dicts and TVM
    integer immediates walked); NoProxy for a value of another kind that may hold a size."""
    if isinstance(value, Slot) or value is None or isinstance(value, (bool, float, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(proxy_int(int(value), sizes, small))
    if isinstance(value, tvm.tirx.IntImm):
        return tvm.tirx.IntImm(value.dtype, proxy_int(int(value.value), sizes, small))
    if isinstance(value, tvm.tirx.FloatImm):
        return value
    if isinstance(value, (list, tuple, tvm.ir.Array)):
        items = [_proxied(v, sizes, small) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, (dict, tvm.ir.Map)):
        return {k: _proxied(v, sizes, small) for k, v in value.items()}
    raise NoProxy(f"a static argument of type {type(value).__name__} may hold sizes")


def proxied_call(call: Call, sizes: dict, small: int) -> Call:
    """``call`` for its op at proxy sizes: size-bearing static arguments (a reshape's new shape, a split's
    sections, strided slice bounds) rewritten by value, as proxy_op rewrote the op's attrs. A rebuilt
    compute follows its new input shapes by itself (an axis it cannot move refuses, and the op is then
    discovered at its real shapes); a call fixed to its own placeholders cannot be moved at all."""
    if call.fixed:
        raise NoProxy("it computes on its own placeholders, at their shapes")
    sizes = {int(k): int(v) for k, v in sizes.items()}
    return dataclasses.replace(
        call, args=_proxied(call.args, sizes, small), kwargs=_proxied(dict(call.kwargs), sizes, small)
    )


def op_cost(op: MetaOp, graph: MetaIR) -> tuple[float, float]:
    """(flops, bytes) of a TE op: 2*M*N*K style counts for contractions, one flop per element otherwise."""
    ins = [graph.vars[v] for v in op.inputs]
    outs = [graph.vars[v] for v in op.outputs]
    nbytes = float(sum(v.nbytes for v in ins + outs))
    out_elems = sum(v.numel for v in outs)
    k = op.key
    if k in ("te.topi.nn.dense", "te.topi.nn.matmul", "te.topi.nn.batch_matmul", "te.topi.matmul") and ins:
        call = op.payload
        ta = isinstance(call, Call) and bool(call.kwargs.get("transpose_a", False))
        red = ins[0].shape[-2] if ta else ins[0].shape[-1]
        return 2.0 * out_elems * red, nbytes
    call = op.payload
    if isinstance(call, Call) and isinstance(call.fn, ComputeRebuilder):  # a plain compute: its loops
        rb = call.fn
        red = 1
        for e in rb.extents[rb.n_axis :]:
            red *= e
        return (2.0 * out_elems * red if red > 1 else float(sum(v.numel for v in ins) + out_elems)), nbytes
    if k.startswith("te.topi.nn.conv") and len(ins) >= 2:
        w = ins[1].shape
        per_out = 1
        for s in w[1:]:
            per_out *= s
        return 2.0 * out_elems * per_out, nbytes
    return float(sum(v.numel for v in ins) + out_elems), nbytes


# -- rules_for ------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    return hasattr(x, "__dlpack__") and hasattr(x, "shape") and not isinstance(x, te.Tensor)


def call_from(builder: Any, example_inputs: Sequence[Any], kwargs: dict | None = None) -> tuple[Call, list[np.ndarray]]:
    """A Call and float64/int numpy examples from a builder (or a recorded te.Tensor) and example inputs."""
    if isinstance(builder, te.Tensor):
        call = plain_call(builder)
        if call.opaque:
            raise ValueError(f"{call.key} cannot be rebuilt at other shapes, so it has no split: {call.opaque}")
        if example_inputs:
            arrays = [np.asarray(x) for x in example_inputs]
        else:
            rng = np.random.default_rng(0)
            arrays = [_example([int(s) for s in t.shape], str(t.dtype), rng) for t in call.inputs]
        if len(arrays) != call.n_inputs:
            raise ValueError(f"{call.key} takes {call.n_inputs} tensor inputs, got {len(arrays)} examples")
        return call, [np.asarray(a, dtype=discovery_dtype(str(a.dtype))) for a in arrays]
    if not callable(builder):
        raise TypeError(
            f"rules_for takes a TE builder (a tvm.topi operator or a function returning te tensors) "
            f"or a recorded te.Tensor, got {type(builder).__name__}"
        )
    key = getattr(builder, "__metadist_key__", None)
    fn = getattr(builder, "__wrapped__", builder) if key else builder
    if key is None:
        mod = getattr(fn, "__module__", "") or ""
        name = getattr(fn, "__name__", "builder")
        if mod.startswith("tvm.topi.nn"):
            key = f"te.topi.nn.{name}"
        elif mod.startswith("tvm.topi"):
            key = f"te.topi.{name}"
        else:
            key = f"te.{name}"
    found: list = []
    args = template(tuple(example_inputs), _is_array, found)
    kw = template(dict(kwargs or {}), _is_array, found)
    arrays = [np.asarray(x) for x in found]
    arrays = [a.astype(discovery_dtype(str(a.dtype))) for a in arrays]
    return Call(key, fn, args, kw, len(arrays)), arrays


def rules_for(builder: Any, *example_inputs: Any, axis_size: int = 2, **kwargs: Any) -> list[ShardingRule]:
    """The verified one-axis ShardingRules of a TE op, found by ShardCombine on TVM kernels (in float64)."""
    call, arrays = call_from(builder, example_inputs, kwargs)
    return discover_rules(spec_for_call(call, arrays), axis_size)
