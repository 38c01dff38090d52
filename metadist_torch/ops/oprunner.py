"""Run one aten op on numpy arrays for ShardCombine, and count its cost (the frontend's ``runner_module``).

An aten MetaOp carries its call in ``attrs`` (the encoding of
:mod:`metadist_torch.trace.calls`) and, for ops returning a tuple or list,
``"select"`` naming which positions are the op's outputs. :func:`op_spec`
rebuilds that call around ``torch.ops.aten.<name>.<overload>`` as a
numpy -> numpy function (inputs drawn by :mod:`metadist_torch.ops.sampling`,
fragile kernels checked by :mod:`metadist_torch.ops.guards`); :func:`op_cost`
(:mod:`metadist_torch.ops.opcost`) counts its FLOPs and bytes.

Discovery runs every float op in float64 (inputs upcast, float dtype
arguments too), so that ShardCombine's tolerance stays tight; integer and bool
inputs keep their dtype. Index-like integer inputs (embedding indices, loss
targets, gather/scatter indices) are drawn inside their valid range.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from metadist_core.ir.ir import MetaIR, MetaOp, canonical_dtype
from metadist_core.discovery.rules import ShardingRule
from metadist_core.discovery.verify import scalars_of
from metadist_core.discovery.shardcombine import OpSpec, Unrunnable, discover_rules

from ..trace.calls import FLOATS, LOW_FLOATS, find_inputs, in_index, rebuild, resolve_overload, schema_arg
from .guards import checked_call, shape_guard
from .opcost import op_cost
from .sampling import InputMeta, int_ranges, make_sampler, positive_inputs

# pure reshapes whose second argument is the target shape: discovery runs them at the local target shape
RESHAPE_OPS = frozenset({"view", "_unsafe_view", "reshape", "view_copy", "_reshape_copy"})
# ops that hand back uninitialised memory: run as zeros for discovery
EMPTY_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"})
# backward ops whose second argument is the forward input's full size (the output shape): a piece of the
# gradient gives a piece of that size (every dim but the sliced or selected one follows the gradient)
GRAD_SIZE_OPS = frozenset({"slice_backward", "select_backward"})
# random ops that are deterministic when their dropout probability is 0 (or train is False)
DROPOUT_ARGS = ("dropout_p", "p")


# -- checking the op ----------------------------------------------------------------


def check_runnable(overload, args: Sequence[Any], kwargs: Mapping[str, Any], bool_inputs: set[int]) -> None:
    """Raise Unrunnable for random ops, ops with data-dependent outputs and ops that read data-dependent shapes."""
    key = f"aten.{overload._schema.name.split('::')[-1]}.{overload._overloadname}"
    tags = set(overload.tags)
    name = overload._schema.name.split("::")[-1]
    if name.startswith("_record_function"):
        raise Unrunnable(f"{key} is a profiler op")
    if torch.Tag.nondeterministic_seeded in tags:
        p = next(
            (
                schema_arg(overload, args, kwargs, a)
                for a in DROPOUT_ARGS
                if any(s.name == a for s in overload._schema.arguments)
            ),
            None,
        )
        train = schema_arg(overload, args, kwargs, "train", True)
        if not ((isinstance(p, (int, float)) and p == 0) or train is False):
            raise Unrunnable(f"{key} is a random op; its results differ from run to run")
    if torch.Tag.data_dependent_output in tags:
        raise Unrunnable(f"{key} turns tensor data into a Python value (a host sync)")
    if torch.Tag.dynamic_output_shape in tags:
        if name == "index" and not bool_inputs:
            return  # integer indexing has a static output shape
        if (
            name == "one_hot"
            and isinstance(schema_arg(overload, args, kwargs, "num_classes", -1), int)
            and schema_arg(overload, args, kwargs, "num_classes", -1) > 0
        ):
            return
        raise Unrunnable(f"{key} has an output shape that depends on the input data")


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


# -- the OpSpec -------------------------------------------------------------------


def build_spec(
    call: Callable[..., Any],
    args_t: Sequence[Any],
    kwargs_t: Mapping[str, Any],
    metas: Sequence[InputMeta],
    *,
    name: str,
    overload=None,
    select: Sequence[int] | None = None,
    examples: Sequence[np.ndarray] | None = None,
    out_shape: Sequence[int] | None = None,
    seed: int = 0,
) -> OpSpec:
    """An OpSpec around ``call(*rebuild(args_t), **rebuild(kwargs_t))`` (shared by op_spec and rules_for)."""
    op_name = overload._schema.name.split("::")[-1] if overload is not None else ""
    if overload is not None:
        bool_inputs = {i for i, m in enumerate(metas) if m.dtype == "bool"}
        check_runnable(overload, args_t, kwargs_t, bool_inputs)
    zero_after = op_name in EMPTY_OPS
    args_t, kwargs_t = list(args_t), dict(kwargs_t)
    if op_name == "expand" and len(args_t) >= 2 and isinstance(args_t[1], list) and in_index(args_t[0]) is not None:
        # keep non-broadcast dims as -1 so that a sharded piece expands to its own size
        in_shape = metas[in_index(args_t[0])].shape
        size = list(args_t[1])
        lead = len(size) - len(in_shape)
        for d, s in enumerate(in_shape):
            if isinstance(size[lead + d], int) and size[lead + d] == s:
                size[lead + d] = -1
        args_t[1] = size

    guard = shape_guard(overload, args_t, kwargs_t) if overload is not None else None
    call = checked_call(overload, call)
    sizes_of = _grad_sizes(op_name, args_t)

    def fn(*arrays: np.ndarray) -> Any:
        if guard is not None:
            guard(arrays)
        tensors = [_to_torch(a) for a in arrays]
        args = rebuild(args_t, tensors, upcast=True, device="cpu")
        if sizes_of is not None:
            args[1] = sizes_of(tuple(tensors[0].shape))
        out = call(*args, **rebuild(kwargs_t, tensors, upcast=True, device="cpu"))
        if zero_after and isinstance(out, torch.Tensor):
            out = out.zero_()
        if select is not None:
            items = _flatten_outputs(out)
            return tuple(_to_numpy(items[i]) for i in select)
        if isinstance(out, (tuple, list)):
            return tuple(_to_numpy(o) for o in _flatten_outputs(out))
        return _to_numpy(out)

    ranges = int_ranges(op_name, overload, args_t, kwargs_t, metas) if overload is not None else {}
    positive = positive_inputs(op_name, overload, args_t, kwargs_t)
    if examples is not None:
        # user examples (rules_for): other integer inputs are drawn inside the examples' own range
        for i, (m, x) in enumerate(zip(metas, examples)):
            if (
                i not in ranges
                and m.dtype not in FLOATS
                and m.dtype != "bool"
                and not m.dtype.startswith("complex")
                and x.size
            ):
                ranges[i] = (int(x.min()), int(x.max()) + 1)
    sampler = make_sampler(metas, ranges, positive)
    if examples is None:
        examples = sampler(np.random.default_rng(seed + 7919), False)

    reshape_fn = None
    if op_name in RESHAPE_OPS and len(args_t) >= 2 and in_index(args_t[0]) == 0 and len(metas) == 1:
        if out_shape is None:
            out_shape = tuple(np.shape(fn(*examples)))

        def reshape_fn(x: np.ndarray, target: tuple[int, ...]) -> Any:
            t = _to_torch(x)
            return _to_numpy(call(t, list(target), *rebuild(args_t[2:], [t]), **rebuild(kwargs_t, [t])))

    return OpSpec(
        fn=fn,
        example_inputs=list(examples),
        name=name,
        reshape_fn=reshape_fn,
        out_shape=None if reshape_fn is None else tuple(out_shape),
        sampler=sampler,
    )


def _grad_sizes(op_name: str, args_t: Sequence[Any]) -> Callable[[tuple[int, ...]], list[int]] | None:
    """For slice_backward/select_backward: the forward input's size given the gradient piece's shape."""
    if (
        op_name not in GRAD_SIZE_OPS
        or len(args_t) < 3
        or in_index(args_t[0]) != 0
        or not isinstance(args_t[1], (list, tuple))
        or not isinstance(args_t[2], int)
    ):
        return None
    full = [int(x) for x in args_t[1]]
    dim = args_t[2] % len(full)
    if op_name == "slice_backward":
        return lambda g: [full[d] if d == dim else g[d] for d in range(len(full))]
    return lambda g: list(g[:dim]) + [full[dim]] + list(g[dim:])


def op_spec(op: MetaOp, graph: MetaIR) -> OpSpec:
    """The OpSpec of an ``aten.*`` MetaOp of ``graph``; raises Unrunnable for ops that cannot run alone."""
    overload = resolve_overload(op.key)
    if "args" not in op.attrs:  # a bare op (say from `metadist rules`): its tensor inputs, in order, are the call
        op = MetaOp(
            op.id,
            op.key,
            list(op.inputs),
            list(op.outputs),
            {**op.attrs, "args": [{"$in": i} for i in range(len(op.inputs))], "kwargs": {}},
        )
    metas = []
    for v in op.inputs:
        mv = graph.vars[v]
        if not mv.is_tensor:
            raise Unrunnable(f"{op.key} ({op.id}) reads non-tensor value {v!r}")
        metas.append(InputMeta(mv.shape, mv.dtype))
    args_t, kwargs_t = op.attrs["args"], op.attrs.get("kwargs", {})
    found = sorted(find_inputs([args_t, kwargs_t], []))
    if found != list(range(len(op.inputs))):
        raise Unrunnable(f"{op.key} ({op.id}): attrs mark inputs {found} but the op has {len(op.inputs)} inputs")
    select = op.attrs.get("select")
    if select is not None and not select:
        raise Unrunnable(f"{op.key} ({op.id}) has no output the graph uses")
    out_shape = None
    if len(op.outputs) == 1 and graph.vars[op.outputs[0]].is_tensor:
        out_shape = graph.vars[op.outputs[0]].shape
    seed = int.from_bytes(op.signature(graph).encode()[-8:], "little") % (2**31)
    return build_spec(
        overload, args_t, kwargs_t, metas, name=op.key, overload=overload, select=select, out_shape=out_shape, seed=seed
    )


def rules_for(op: Any, *example_inputs: Any, axis_size: int = 2) -> list[ShardingRule]:
    """The verified one-axis ShardingRules of ``op`` (an OpOverload or a callable) on these example inputs.

    Every tensor among ``example_inputs`` (also inside list arguments) is one
    input of the rules, in order; the other arguments stay fixed.
    """
    spec = rules_for_spec(op, *example_inputs)
    return discover_rules(spec, axis_size, scalars=scalars_of({"args": spec.static_args}))


def rules_for_spec(op: Any, *example_inputs: Any) -> OpSpec:
    """The OpSpec that :func:`rules_for` discovers on: ``op`` on numpy arrays (floats in float64)."""
    metas: list[InputMeta] = []
    arrays: list[np.ndarray] = []

    def encode(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dt = canonical_dtype(x.dtype)
            metas.append(InputMeta(tuple(x.shape), dt))
            t = x.detach().cpu()
            if dt in LOW_FLOATS:
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
    spec = build_spec(
        overload if overload is not None else op, args_t, {}, metas, name=name, overload=overload, examples=arrays
    )
    spec.static_args = args_t
    return spec


__all__ = [
    "op_spec",
    "op_cost",
    "rules_for",
    "resolve_overload",
    "rebuild",
    "build_spec",
    "make_sampler",
    "check_runnable",
    "rules_for_spec",
    "RESHAPE_OPS",
    "EMPTY_OPS",
    "GRAD_SIZE_OPS",
]
