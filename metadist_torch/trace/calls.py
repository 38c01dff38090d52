"""The aten call encoding of MetaOp attrs, rebuilt around real tensors (see :mod:`metadist_core.ir.recorded`).

An aten MetaOp carries its call in ``attrs``: ``{"args": [...], "kwargs": {...}}``
with ``{"$in": i}`` where tensor input ``i`` goes, ``{"$item": i}`` where it goes as its number
(a 0-d tensor of the param groups' numbers, :mod:`metadist_torch.trace.hyper`), ``{"$dtype": ...}``,
``{"$device": ...}`` and ``{"$torch": ...}`` for torch constants.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from metadist_core.discovery.shardcombine import Unrunnable

LOW_FLOATS = ("float32", "float16", "bfloat16")
FLOATS = LOW_FLOATS + ("float64",)
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}


# MetaDist's own ops that run in isolation for discovery like aten's (metadist_torch.moe.experts_ffn)
OWN_OPS = frozenset({"experts_ffn", "experts_ffn_backward", "moe_dropless", "moe_dropless_backward"})


def resolve_overload(key: str) -> torch._ops.OpOverload:
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default`` (and MetaDist's :data:`OWN_OPS`); Unrunnable for
    anything else."""
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "metadist" and parts[1] in OWN_OPS:
        from ..moe import dropless, experts_ffn  # noqa: F401  (registers them)

        return getattr(getattr(torch.ops.metadist, parts[1]), parts[2])
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


# views whose input may reach this rank in other strides than it had in the trace: a collective's result is
# contiguous, and an op's output can follow its input's layout (CPU flash attention's output follows the
# query's), so a view that was legal in the trace (the transposed attention output merged into one dim) may
# not be. They run as reshape: a view where the strides allow one, else a copy; the same values either way
# in the functional per-rank program.
STRIDE_FREE = {
    "aten.view.default": torch.ops.aten.reshape.default,
    "aten._unsafe_view.default": torch.ops.aten.reshape.default,
}


def resolve_target(key: str) -> torch._ops.OpOverload:
    """The overload a traced op key names, in any ``torch.ops`` namespace (``mylib.op.default`` for a
    ``torch.library.custom_op``): what the lowering calls, where discovery runs only aten ops."""
    parts = key.split(".")
    if len(parts) == 3 and parts[0] != "aten":
        try:
            return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        except (AttributeError, RuntimeError):
            raise ValueError(
                f"op {key} of the traced step is not registered in this process (torch.ops."
                f"{parts[0]}.{parts[1]}.{parts[2]}); import the module that defines it on every rank"
            ) from None
    return resolve_overload(key)


def schema_arg(overload, args: Sequence[Any], kwargs: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """The value of argument ``name`` in this call: given positionally or by keyword, else the schema's
    default (a traced call leaves defaulted arguments out: flash attention's ``dropout_p``), else ``default``."""
    for i, a in enumerate(overload._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            if name in kwargs:
                return kwargs[name]
            return a.default_value if a.has_default_value() and a.default_value is not None else default
    return default


def _item(t: Any) -> Any:
    """A 0-d tensor's number; a meta tensor's (shapes and FLOPs only) stands as 1."""
    if getattr(t, "device", None) is not None and t.device.type == "meta":
        return 1.0 if t.dtype.is_floating_point else 1
    return t.item()


def rebuild(
    template: Any,
    tensors: Sequence[Any],
    *,
    upcast: bool = False,
    device: Any = None,
    item: Callable[[Any], Any] = _item,
) -> Any:
    """Put ``tensors`` and torch constants back where ``template`` marks them.

    ``upcast`` turns float32/float16/bfloat16 dtype arguments into float64 (as
    in discovery); ``device`` replaces every ``{"$device"}`` when given;
    ``item(x)`` is what ``{"$item": i}`` (tensor ``i`` passed as a number) becomes.
    """
    if isinstance(template, dict):
        if "$in" in template:
            return tensors[template["$in"]]
        if "$item" in template:  # a tensor input passed as its number
            return item(tensors[template["$item"]])
        if "$dtype" in template:
            dt = template["$dtype"]
            return TORCH_DTYPES["float64" if upcast and dt in LOW_FLOATS else dt]
        if "$device" in template:
            return torch.device(device if device is not None else template["$device"])
        if "$torch" in template:
            return getattr(torch, template["$torch"])
        return {k: rebuild(v, tensors, upcast=upcast, device=device, item=item) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return [rebuild(v, tensors, upcast=upcast, device=device, item=item) for v in template]
    return template


def find_inputs(template: Any, out: list[int]) -> list[int]:
    if isinstance(template, dict):
        if "$in" in template or "$item" in template:
            out.append(template.get("$in", template.get("$item")))
        else:
            for v in template.values():
                find_inputs(v, out)
    elif isinstance(template, (list, tuple)):
        for v in template:
            find_inputs(v, out)
    return out


def in_index(x: Any) -> int | None:
    return x["$in"] if isinstance(x, dict) and "$in" in x else None


__all__ = [
    "resolve_overload",
    "resolve_target",
    "schema_arg",
    "rebuild",
    "find_inputs",
    "in_index",
    "TORCH_DTYPES",
    "LOW_FLOATS",
    "FLOATS",
]
