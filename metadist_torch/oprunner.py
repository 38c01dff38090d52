"""Run one aten op on numpy arrays for ShardCombine, and count its cost.

An aten MetaOp carries its call in ``attrs`` (see :mod:`metadist_core.recorded`
for the encoding): ``{"args": [...], "kwargs": {...}}`` with ``{"$in": i}``
where tensor input ``i`` goes, ``{"$dtype": ...}``, ``{"$device": ...}`` and
``{"$torch": ...}`` for torch constants, and ``"select"`` (for ops returning a
tuple or list) naming which positions are the op's outputs. :func:`op_spec`
rebuilds that call around ``torch.ops.aten.<name>.<overload>`` as a
numpy -> numpy function; :func:`op_cost` counts its FLOPs and bytes.

Discovery runs every float op in float64 (inputs upcast, float dtype
arguments too), so that ShardCombine's tolerance stays tight; integer and bool
inputs keep their dtype. Index-like integer inputs (embedding indices, loss
targets, gather/scatter indices) are drawn inside their valid range.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from metadist_core.ir import MetaIR, MetaOp, canonical_dtype
from metadist_core.rules import ShardingRule
from metadist_core.shardcombine import OpSpec, Unrunnable, discover_rules

_LOW_FLOATS = ("float32", "float16", "bfloat16")
_FLOATS = _LOW_FLOATS + ("float64",)
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
}
# numpy dtype used during discovery, per canonical dtype
_DISCOVERY_NP: dict[str, Any] = {
    "float64": np.float64, "float32": np.float64, "float16": np.float64, "bfloat16": np.float64,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "bool": np.bool_, "complex64": np.complex128, "complex128": np.complex128,
}

# pure reshapes whose second argument is the target shape: discovery runs them at the local target shape
RESHAPE_OPS = frozenset({"view", "_unsafe_view", "reshape", "view_copy", "_reshape_copy"})
# ops that hand back uninitialised memory: run as zeros for discovery
EMPTY_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"})
# random ops that are deterministic when their dropout probability is 0 (or train is False)
_DROPOUT_ARGS = ("dropout_p", "p")
# inputs whose domain is positive (sqrt, log...): drawn positive so that results stay finite
_POSITIVE_INPUT_OPS = frozenset({"sqrt", "rsqrt", "log", "log2", "log10", "lgamma", "digamma", "acosh"})
# divisors: drawn nonzero, so that integer-valued draws stay finite
_NONZERO_SECOND_INPUT_OPS = frozenset({"div", "remainder", "fmod", "floor_divide", "true_divide"})


# -- resolving and checking the op ------------------------------------------------


def resolve_overload(key: str) -> torch._ops.OpOverload:
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default``; Unrunnable for anything not an aten overload."""
    parts = key.split(".")
    if len(parts) not in (2, 3) or parts[0] != "aten":
        ns = parts[0] if parts else key
        kind = "a profiler op" if ns == "profiler" else "a custom op" if len(parts) == 3 else "not an aten op key"
        raise Unrunnable(f"{key} is {kind}; only aten ops run in isolation for discovery")
    name, overload = parts[1], parts[2] if len(parts) == 3 else "default"
    try:
        packet = getattr(torch.ops.aten, name)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        raise Unrunnable(f"{key}: torch {torch.__version__} has no op torch.ops.aten.{name}.{overload}") from None


def _schema_arg(overload, args: Sequence[Any], kwargs: Mapping[str, Any], name: str, default: Any = None) -> Any:
    for i, a in enumerate(overload._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            return kwargs.get(name, default)
    return default


def check_runnable(overload, args: Sequence[Any], kwargs: Mapping[str, Any], bool_inputs: set[int]) -> None:
    """Raise Unrunnable for random ops, ops with data-dependent outputs and ops that read data-dependent shapes."""
    key = f"aten.{overload._schema.name.split('::')[-1]}.{overload._overloadname}"
    tags = set(overload.tags)
    name = overload._schema.name.split("::")[-1]
    if name.startswith("_record_function"):
        raise Unrunnable(f"{key} is a profiler op")
    if torch.Tag.nondeterministic_seeded in tags:
        p = next((_schema_arg(overload, args, kwargs, a) for a in _DROPOUT_ARGS
                  if any(s.name == a for s in overload._schema.arguments)), None)
        train = _schema_arg(overload, args, kwargs, "train", True)
        if not ((isinstance(p, (int, float)) and p == 0) or train is False):
            raise Unrunnable(f"{key} is a random op; its results differ from run to run")
    if torch.Tag.data_dependent_output in tags:
        raise Unrunnable(f"{key} turns tensor data into a Python value (a host sync)")
    if torch.Tag.dynamic_output_shape in tags:
        if name == "index" and not bool_inputs:
            return  # integer indexing has a static output shape
        if name == "one_hot" and isinstance(_schema_arg(overload, args, kwargs, "num_classes", -1), int) \
                and _schema_arg(overload, args, kwargs, "num_classes", -1) > 0:
            return
        raise Unrunnable(f"{key} has an output shape that depends on the input data")


# -- rebuilding the call ----------------------------------------------------------


def rebuild(template: Any, tensors: Sequence[Any], *, upcast: bool = False, device: Any = None) -> Any:
    """Put ``tensors`` and torch constants back where ``template`` marks them.

    ``upcast`` turns float32/float16/bfloat16 dtype arguments into float64 (as
    in discovery); ``device`` replaces every ``{"$device"}`` when given.
    """
    if isinstance(template, dict):
        if "$in" in template:
            return tensors[template["$in"]]
        if "$dtype" in template:
            dt = template["$dtype"]
            return _TORCH_DTYPES["float64" if upcast and dt in _LOW_FLOATS else dt]
        if "$device" in template:
            return torch.device(device if device is not None else template["$device"])
        if "$torch" in template:
            return getattr(torch, template["$torch"])
        return {k: rebuild(v, tensors, upcast=upcast, device=device) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return [rebuild(v, tensors, upcast=upcast, device=device) for v in template]
    return template


def _find_inputs(template: Any, out: list[int]) -> list[int]:
    if isinstance(template, dict):
        if "$in" in template:
            out.append(template["$in"])
        else:
            for v in template.values():
                _find_inputs(v, out)
    elif isinstance(template, (list, tuple)):
        for v in template:
            _find_inputs(v, out)
    return out


def _in_index(x: Any) -> int | None:
    return x["$in"] if isinstance(x, dict) and "$in" in x else None


def _to_torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True))


def _to_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.to(torch.float64)
        return x.cpu().resolve_conj().resolve_neg().numpy()
    return x


def _flatten_outputs(out: Any) -> list[Any]:
    if isinstance(out, (tuple, list)):
        flat = []
        for o in out:
            flat.extend(_flatten_outputs(o) if isinstance(o, (tuple, list)) else [o])
        return flat
    return [out]


@dataclass
class _InputMeta:
    shape: tuple[int, ...]
    dtype: str   # canonical


def _int_ranges(name: str, overload, args: Sequence[Any], kwargs: Mapping[str, Any],
                metas: Sequence[_InputMeta]) -> dict[int, tuple[int, ...]]:
    """``(lo, hi)`` of the valid values of each index-like integer input, from the other inputs' shapes;
    ``(lo, hi, special)`` where the op also takes one value apart (a loss's ignore_index)."""
    ranges: dict[int, tuple[int, ...]] = {}

    def arg(n: str, default: Any = None) -> Any:
        return _schema_arg(overload, args, kwargs, n, default)

    def shape_of(n: str) -> tuple[int, ...] | None:
        i = _in_index(arg(n))
        return None if i is None else metas[i].shape

    def put(n: str, hi: int | None) -> None:
        i = _in_index(arg(n))
        if i is not None and hi is not None and hi > 0:
            ranges[i] = (0, int(hi))

    def dim_size(shape: tuple[int, ...] | None, dim: Any) -> int | None:
        if shape is None or not isinstance(dim, int):
            return None
        if not shape:
            return 1
        return shape[dim % len(shape)]

    if name == "embedding":
        w = shape_of("weight")
        put("indices", w[0] if w else None)
    elif name in ("embedding_dense_backward", "embedding_backward", "_embedding_bag_dense_backward"):
        put("indices", arg("num_weights"))
    elif name in ("nll_loss_forward", "nll_loss", "nll_loss_nd", "nll_loss_backward", "cross_entropy_loss",
                  "nll_loss2d_forward", "nll_loss2d", "nll_loss2d_backward"):
        s = shape_of("self")
        put("target", None if s is None else (s[1] if len(s) >= 2 else s[0] if s else None))
        # some targets hit ignore_index: a mean over the kept targets is not an average of local means
        i, ignore = _in_index(arg("target")), arg("ignore_index", -100)
        if i in ranges and isinstance(ignore, int):
            ranges[i] = ranges[i] + (ignore,)
    elif name in ("gather", "scatter", "scatter_add", "scatter_reduce", "index_select", "index_add",
                  "index_copy", "index_fill", "index_reduce"):
        put("index", dim_size(shape_of("self"), arg("dim")))
    elif name == "take_along_dim":
        s = shape_of("self")
        d = arg("dim")
        put("indices", math.prod(s) if s is not None and d is None else dim_size(s, d))
    elif name in ("index", "index_put", "_index_put_impl", "_unsafe_index", "_unsafe_index_put"):
        s = shape_of("self")
        idx = arg("indices")
        if s is not None and isinstance(idx, list):
            for k, t in enumerate(idx):
                i = _in_index(t)
                if i is not None and k < len(s) and s[k] > 0:
                    ranges[i] = (0, s[k])
    elif name == "one_hot":
        put("self", arg("num_classes"))
    return ranges


def _positive_inputs(name: str, overload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> set[int]:
    """Inputs that only ever hold positive values (the argument of sqrt/log..., a loss's total_weight);
    ``-1 - i`` for an input ``i`` that must only be nonzero (a divisor)."""
    if overload is not None and name.startswith("nll_loss") and name.endswith("backward"):
        i = _in_index(_schema_arg(overload, args, kwargs, "total_weight"))
        return {i} if i is not None else set()
    if name in _NONZERO_SECOND_INPUT_OPS and len(args) >= 2 and _in_index(args[1]) is not None:
        return {-1 - _in_index(args[1])}  # negative: nonzero, not positive (see make_sampler)
    if name in _POSITIVE_INPUT_OPS:
        i = _in_index(args[0]) if args else None
        return {i} if i is not None else set()
    if name == "pow" and len(args) >= 2 and isinstance(args[1], float) and not float(args[1]).is_integer():
        i = _in_index(args[0])
        return {i} if i is not None else set()
    return set()


def make_sampler(metas: Sequence[_InputMeta], int_ranges: Mapping[int, tuple[int, ...]],
                 positive: set[int] | frozenset = frozenset()) -> Callable[[np.random.Generator, bool], list[np.ndarray]]:
    """Random inputs at the given shapes (discovery dtypes): normal or small integer-valued floats
    (positive where the op needs it), integers in their valid range ([0, 2) when unknown; one in eight
    set to the special value where there is one), random bools."""

    def sample(rng: np.random.Generator, integer: bool) -> list[np.ndarray]:
        out = []
        for i, m in enumerate(metas):
            npdt = _DISCOVERY_NP[m.dtype]
            if m.dtype in _FLOATS or m.dtype.startswith("complex"):
                if integer:
                    if i in positive:
                        a = rng.integers(1, 5, size=m.shape)
                    elif -1 - i in positive:  # nonzero
                        a = rng.integers(1, 5, size=m.shape) * rng.choice([-1, 1], size=m.shape)
                    else:
                        a = rng.integers(-4, 5, size=m.shape)
                else:
                    a = rng.standard_normal(m.shape)
                    if i in positive:
                        a = np.abs(a) + 0.5
                out.append(np.asarray(a, dtype=npdt))
            elif m.dtype == "bool":
                out.append(np.asarray(rng.random(m.shape) < 0.5))
            else:
                lo, hi, *special = int_ranges.get(i, (0, 2))
                a = rng.integers(lo, hi, size=m.shape)
                if special:  # a value outside [lo, hi) that the op treats apart (ignore_index)
                    a = np.where(rng.random(m.shape) < 0.125, special[0], a)
                out.append(np.asarray(a, dtype=npdt))
        return out

    return sample


# -- shape guards: kernels that read out of bounds instead of checking shapes --------


def _attention_guard(overload, args_t: Sequence[Any], kwargs_t: Mapping[str, Any]):
    """The CPU attention kernels trust their shapes: a key piece shorter than the value piece reads
    past its end (seen to crash the process). Check what they assume before calling them."""
    names = {a.name for a in overload._schema.arguments}
    if not {"query", "key", "value"} <= names:
        return None
    pos = {n: _in_index(_schema_arg(overload, args_t, kwargs_t, n)) for n in
           ("query", "key", "value", "out", "grad_out", "logsumexp", "attn_mask")}
    gqa = _schema_arg(overload, args_t, kwargs_t, "enable_gqa", False) is True

    def check(arrays: Sequence[np.ndarray]) -> None:
        q, k, v = (arrays[pos[n]].shape for n in ("query", "key", "value"))
        ok = len(q) == len(k) == len(v) >= 2 and k[:-1] == v[:-1] and q[-1] == k[-1]
        if ok and len(q) > 2:
            if gqa:
                ok = q[:-3] == k[:-3] and k[-3] > 0 and q[-3] % k[-3] == 0
            else:
                ok = q[:-2] == k[:-2]
        want_out = q[:-1] + v[-1:]
        for n, want in (("out", want_out), ("grad_out", want_out), ("logsumexp", q[:-1])):
            if ok and pos[n] is not None:
                ok = arrays[pos[n]].shape == want
        if ok and pos["attn_mask"] is not None:
            try:
                np.broadcast_shapes(arrays[pos["attn_mask"]].shape, q[:-1] + k[-2:-1])
            except ValueError:
                ok = False
        if not ok:
            raise ValueError(f"{overload}: query/key/value/out shapes do not fit: "
                             f"{[tuple(a.shape) for a in arrays]}")

    return check


POOL_BACKWARD = {"_adaptive_avg_pool2d_backward": 2, "_adaptive_avg_pool3d_backward": 3, "avg_pool2d_backward": 2,
                 "avg_pool3d_backward": 3, "adaptive_max_pool2d_backward": 2, "adaptive_max_pool3d_backward": 3}


def _pool_backward_guard(overload, args_t: Sequence[Any], kwargs_t: Mapping[str, Any]):
    """The CPU pooling backward kernels loop over the input's batch and channel dims and read the
    gradient (and indices) at the same positions unchecked: a gradient piece with fewer channels
    corrupts the heap (seen: "free(): corrupted unsorted chunks"). Check the leading dims agree."""
    spatial = POOL_BACKWARD.get(overload._schema.name.split("::")[-1])
    if spatial is None:
        return None
    pos = [p for p in (_in_index(_schema_arg(overload, args_t, kwargs_t, n)) for n in ("grad_output", "self", "indices"))
           if p is not None]

    def check(arrays: Sequence[np.ndarray]) -> None:
        lead = {tuple(arrays[p].shape[:-spatial]) for p in pos}
        if len(lead) != 1:
            raise ValueError(f"{overload}: batch/channel dims of grad, input and indices differ: "
                             f"{[tuple(arrays[p].shape) for p in pos]}")

    return check


def _batch_norm_guard(overload, args_t: Sequence[Any], kwargs_t: Mapping[str, Any]):
    """The CPU batch-norm kernels (forward and backward) trust that every per-channel tensor (weight,
    bias, running stats, saved mean/invstd) has one entry per channel of the input; a shorter piece
    corrupts the heap (seen: "double free or corruption"). Check that before calling them.
    (Added by the metadist_compile helper.)"""
    if "batch_norm" not in overload._schema.name:
        return None
    names = [a.name for a in overload._schema.arguments]
    pos = {n: _in_index(_schema_arg(overload, args_t, kwargs_t, n)) for n in names}
    x = pos.get("input")
    if x is None:
        return None
    per_channel = [pos[n] for n in ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd",
                                    "mean", "invstd") if pos.get(n) is not None]
    same = [pos[n] for n in ("grad_out", "grad_output") if pos.get(n) is not None]

    def check(arrays: Sequence[np.ndarray]) -> None:
        shape = arrays[x].shape
        c = shape[1] if len(shape) >= 2 else (shape[0] if shape else 1)
        ok = all(arrays[i].shape == (c,) for i in per_channel) and all(arrays[i].shape == shape for i in same)
        if not ok:
            raise ValueError(f"{overload}: per-channel shapes do not fit input {shape}: "
                             f"{[tuple(a.shape) for a in arrays]}")

    return check


# Kernels that size their loops by one input and read the others without checking them: on
# mismatched pieces they read past the end (native_layer_norm_backward with a shorter mean/rstd or
# grad, _log_softmax_backward_data with a shorter grad, both checked here on torch 2.13), which now
# and then crashes the process. During discovery each call first goes through torch's reference
# decomposition, which is the same computation in checked ops and raises on such pieces; only
# then does the native kernel run (its own checks, such as a bias matching normalized_shape, still
# apply, and its result is the one verified).
DECOMPOSE_FOR_DISCOVERY = {"native_layer_norm_backward", "_log_softmax_backward_data", "_softmax_backward_data",
                           "native_group_norm_backward",
                           # writes through indices taken from the whole input: a row piece corrupts the heap
                           "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward"}


def _checked_call(overload, call: Callable[..., Any]) -> Callable[..., Any]:
    if overload is None or overload._schema.name.split("::")[-1] not in DECOMPOSE_FOR_DISCOVERY:
        return call
    from torch._decomp import decomposition_table
    reference = decomposition_table.get(overload)
    if reference is None:
        return call

    def checked(*args: Any, **kwargs: Any) -> Any:
        reference(*args, **kwargs)  # raises where the native kernel would read past an input
        return call(*args, **kwargs)

    return checked


# -- the OpSpec -------------------------------------------------------------------


def build_spec(call: Callable[..., Any], args_t: Sequence[Any], kwargs_t: Mapping[str, Any],
               metas: Sequence[_InputMeta], *, name: str, overload=None, select: Sequence[int] | None = None,
               examples: Sequence[np.ndarray] | None = None, out_shape: Sequence[int] | None = None,
               seed: int = 0) -> OpSpec:
    """An OpSpec around ``call(*rebuild(args_t), **rebuild(kwargs_t))`` (shared by op_spec and rules_for)."""
    op_name = overload._schema.name.split("::")[-1] if overload is not None else ""
    if overload is not None:
        bool_inputs = {i for i, m in enumerate(metas) if m.dtype == "bool"}
        check_runnable(overload, args_t, kwargs_t, bool_inputs)
    zero_after = op_name in EMPTY_OPS
    args_t, kwargs_t = list(args_t), dict(kwargs_t)
    if op_name == "expand" and len(args_t) >= 2 and isinstance(args_t[1], list) and _in_index(args_t[0]) is not None:
        # keep non-broadcast dims as -1 so that a sharded piece expands to its own size
        in_shape = metas[_in_index(args_t[0])].shape
        size = list(args_t[1])
        lead = len(size) - len(in_shape)
        for d, s in enumerate(in_shape):
            if isinstance(size[lead + d], int) and size[lead + d] == s:
                size[lead + d] = -1
        args_t[1] = size

    guard = (_attention_guard(overload, args_t, kwargs_t) or _batch_norm_guard(overload, args_t, kwargs_t)
             or _pool_backward_guard(overload, args_t, kwargs_t)) if overload is not None else None
    call = _checked_call(overload, call)

    def fn(*arrays: np.ndarray) -> Any:
        if guard is not None:
            guard(arrays)
        tensors = [_to_torch(a) for a in arrays]
        out = call(*rebuild(args_t, tensors, upcast=True, device="cpu"),
                   **rebuild(kwargs_t, tensors, upcast=True, device="cpu"))
        if zero_after and isinstance(out, torch.Tensor):
            out = out.zero_()
        if select is not None:
            items = _flatten_outputs(out)
            return tuple(_to_numpy(items[i]) for i in select)
        if isinstance(out, (tuple, list)):
            return tuple(_to_numpy(o) for o in _flatten_outputs(out))
        return _to_numpy(out)

    ranges = _int_ranges(op_name, overload, args_t, kwargs_t, metas) if overload is not None else {}
    positive = _positive_inputs(op_name, overload, args_t, kwargs_t)
    if examples is not None:
        # user examples (rules_for): other integer inputs are drawn inside the examples' own range
        for i, (m, x) in enumerate(zip(metas, examples)):
            if i not in ranges and m.dtype not in _FLOATS and m.dtype != "bool" \
                    and not m.dtype.startswith("complex") and x.size:
                ranges[i] = (int(x.min()), int(x.max()) + 1)
    sampler = make_sampler(metas, ranges, positive)
    if examples is None:
        examples = sampler(np.random.default_rng(seed + 7919), False)

    reshape_fn = None
    if op_name in RESHAPE_OPS and len(args_t) >= 2 and _in_index(args_t[0]) == 0 and len(metas) == 1:
        if out_shape is None:
            out_shape = tuple(np.shape(fn(*examples)))

        def reshape_fn(x: np.ndarray, target: tuple[int, ...]) -> Any:
            t = _to_torch(x)
            return _to_numpy(call(t, list(target), *rebuild(args_t[2:], [t]), **rebuild(kwargs_t, [t])))
    return OpSpec(fn=fn, example_inputs=list(examples), name=name, reshape_fn=reshape_fn,
                  out_shape=None if reshape_fn is None else tuple(out_shape), sampler=sampler)


def op_spec(op: MetaOp, graph: MetaIR) -> OpSpec:
    """The OpSpec of an ``aten.*`` MetaOp of ``graph``; raises Unrunnable for ops that cannot run alone."""
    overload = resolve_overload(op.key)
    if "args" not in op.attrs:  # a bare op (say from `metadist rules`): its tensor inputs, in order, are the call
        op = MetaOp(op.id, op.key, list(op.inputs), list(op.outputs),
                    {**op.attrs, "args": [{"$in": i} for i in range(len(op.inputs))], "kwargs": {}})
    metas = []
    for v in op.inputs:
        mv = graph.vars[v]
        if not mv.is_tensor:
            raise Unrunnable(f"{op.key} ({op.id}) reads non-tensor value {v!r}")
        metas.append(_InputMeta(mv.shape, mv.dtype))
    args_t, kwargs_t = op.attrs["args"], op.attrs.get("kwargs", {})
    found = sorted(_find_inputs([args_t, kwargs_t], []))
    if found != list(range(len(op.inputs))):
        raise Unrunnable(f"{op.key} ({op.id}): attrs mark inputs {found} but the op has {len(op.inputs)} inputs")
    select = op.attrs.get("select")
    if select is not None and not select:
        raise Unrunnable(f"{op.key} ({op.id}) has no output the graph uses")
    out_shape = None
    if len(op.outputs) == 1 and graph.vars[op.outputs[0]].is_tensor:
        out_shape = graph.vars[op.outputs[0]].shape
    seed = int.from_bytes(op.signature(graph).encode()[-8:], "little") % (2 ** 31)
    return build_spec(overload, args_t, kwargs_t, metas, name=op.key, overload=overload, select=select,
                      out_shape=out_shape, seed=seed)


def rules_for(op: Any, *example_inputs: Any, axis_size: int = 2) -> list[ShardingRule]:
    """The verified one-axis ShardingRules of ``op`` (an OpOverload or a callable) on these example inputs.

    Every tensor among ``example_inputs`` (also inside list arguments) is one
    input of the rules, in order; the other arguments stay fixed.
    """
    metas: list[_InputMeta] = []
    arrays: list[np.ndarray] = []

    def encode(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dt = canonical_dtype(x.dtype)
            metas.append(_InputMeta(tuple(x.shape), dt))
            t = x.detach().cpu()
            if dt in _LOW_FLOATS:
                t = t.to(torch.float64)
            elif dt == "complex64":
                t = t.to(torch.complex128)
            arrays.append(t.resolve_conj().resolve_neg().numpy().copy())
            return {"$in": len(metas) - 1}
        if isinstance(x, (list, tuple)):
            return [encode(y) for y in x]
        if isinstance(x, torch.dtype):
            return {"$dtype": canonical_dtype(x)}
        if isinstance(x, torch.device):
            return {"$device": str(x)}
        if isinstance(x, (torch.memory_format, torch.layout)):
            return {"$torch": str(x).split(".")[-1]}
        return x

    args_t = [encode(a) for a in example_inputs]
    overload = op if isinstance(op, torch._ops.OpOverload) else None
    if overload is None and isinstance(op, torch._ops.OpOverloadPacket):
        overload = op.default
    name = str(overload) if overload is not None else getattr(op, "__name__", repr(op))
    spec = build_spec(overload if overload is not None else op, args_t, {}, metas, name=name,
                      overload=overload, examples=arrays)
    return discover_rules(spec, axis_size)


# -- cost -------------------------------------------------------------------------


def _sdpa_cpu_flops(shapes: Sequence[tuple[int, ...]], backward: bool) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    if backward:
        return int(sdpa_backward_flop_count(shapes[0], shapes[1], shapes[2], shapes[3]))
    return int(sdpa_flop_count(shapes[0], shapes[1], shapes[2]))


_CUSTOM_FLOPS: dict[str, Callable[[Sequence[tuple[int, ...]]], int]] = {
    "_scaled_dot_product_flash_attention_for_cpu": lambda s: _sdpa_cpu_flops(s, False),
    "_scaled_dot_product_flash_attention_for_cpu_backward": lambda s: _sdpa_cpu_flops(s, True),
}


def _is_view(overload) -> bool:
    """Does the op return an alias of an input without writing (view, t, transpose, slice...)?"""
    rets = overload._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


@functools.lru_cache(maxsize=4096)
def _counted_flops(key: str, shapes: tuple, dtypes: tuple, attrs_json: str) -> int | None:
    """FLOPs of one call from torch's flop formulas, run on meta tensors; None when torch has no formula."""
    import json
    from torch.utils.flop_counter import FlopCounterMode, flop_registry
    overload = resolve_overload(key)
    name = overload._schema.name.split("::")[-1]
    if name in _CUSTOM_FLOPS:
        return _CUSTOM_FLOPS[name](shapes)
    if overload.overloadpacket not in flop_registry:
        return None
    attrs = json.loads(attrs_json)
    tensors = [torch.empty(s, dtype=_TORCH_DTYPES[d], device="meta") for s, d in zip(shapes, dtypes)]
    with FlopCounterMode(display=False) as counter:
        overload(*rebuild(attrs.get("args", []), tensors, device="meta"),
                 **rebuild(attrs.get("kwargs", {}), tensors, device="meta"))
    return int(counter.get_total_flops())


def op_cost(op: MetaOp, graph: MetaIR) -> tuple[int, int]:
    """``(flops, bytes_moved)`` of the whole op.

    FLOPs come from torch's registered formulas (mm, bmm, addmm, convolution,
    attention...), counted on meta tensors; any other op counts one FLOP per
    element of its largest input or of its outputs (elementwise ops,
    reductions). Bytes are the input plus output tensor bytes at their real
    dtype. Pure views (the output aliases an input: view, t, transpose,
    slice...) cost nothing.
    """
    import json
    tensors_in = [graph.vars[v] for v in op.inputs]
    tensors_out = [graph.vars[v] for v in op.outputs if graph.vars[v].is_tensor]
    nbytes = sum(v.nbytes for v in tensors_in) + sum(v.nbytes for v in tensors_out)
    try:
        overload = resolve_overload(op.key)
    except Unrunnable:
        overload = None
    if overload is not None and _is_view(overload):
        return 0, 0
    flops = None
    if overload is not None:
        try:
            flops = _counted_flops(op.key, tuple(v.shape for v in tensors_in), tuple(v.dtype for v in tensors_in),
                                   json.dumps(op.attrs, sort_keys=True, default=str))
        except Exception:  # no meta kernel, odd attrs: fall back to the element count
            flops = None
    if flops is None:
        flops = max([v.numel for v in tensors_out] + [v.numel for v in tensors_in] + [0]) if tensors_in else 0
    return int(flops), int(nbytes)


__all__ = ["op_spec", "op_cost", "rules_for", "resolve_overload", "rebuild", "build_spec", "make_sampler",
           "RESHAPE_OPS", "EMPTY_OPS"]
