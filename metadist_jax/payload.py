"""What runs one traced op: the primitive, its params and literals (:class:`OpPayload`), and how it binds.

Shared by tracing (integer examples), discovery (:mod:`metadist_jax.oprunner`)
and lowering (:mod:`metadist_jax.lower`), so that a rule verified on pieces is
run the same way inside the lowered program. A primitive whose params name
shapes (``reshape``, ``broadcast_in_dim``, ``slice``, ``dynamic_slice``,
``gather``) binds on a piece with those params localized from the piece's
shape (:func:`localize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from jax.extend import core as jcore

KEY_PREFIX = "jax.lax."
COPY_KEY = KEY_PREFIX + "copy"


@dataclass
class OpPayload:
    """What runs a MetaOp: the primitive, its params and where literals sit among its operands.

    ``layout`` has one entry per operand: an int (index into the op's tensor
    inputs) or ``("lit", value)``. ``prim`` is None for the identity copy.
    """

    prim: Any
    params: dict
    layout: list
    out_avals: tuple

    @property
    def name(self) -> str:
        return "copy" if self.prim is None else self.prim.name

    def has_jaxpr(self) -> bool:
        return any(holds_jaxpr(v) for v in self.params.values())

    def runs_in_float64(self) -> bool:
        """Can discovery run it in float64? Yes unless a jaxpr it carries is more than a scalar combiner
        (a scatter's ``update_jaxpr``, which :func:`x64_params` retypes; a scan's or a cond's body is typed)."""
        return all(scalar_combiner(v) for v in self.params.values() if holds_jaxpr(v))


IDENTITY = OpPayload(None, {}, [0], ())  # the payload of a copy op loaded without one


def holds_jaxpr(v: Any) -> bool:
    """Is ``v`` (or an element of it) a jaxpr?"""
    if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return True
    if isinstance(v, (tuple, list)):
        return any(holds_jaxpr(x) for x in v)
    return False


def scalar_combiner(v: Any) -> bool:
    """Is ``v`` a jaxpr of scalars in, scalars out and no constants (``add a b``: how a scatter combines)?"""
    if not isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return False
    j = v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v
    if (isinstance(v, jcore.ClosedJaxpr) and v.consts) or j.constvars:
        return False
    return all(getattr(x.aval, "shape", None) == () for x in list(j.invars) + list(j.outvars))


def _combiner_x64(v: Any) -> Any:
    """A scalar combiner retyped to float64 where it takes floats (traced again on float64 scalars)."""
    import jax

    j = v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v
    if not any(is_float_dtype(x.aval.dtype) for x in j.invars):
        return v
    args = [jax.ShapeDtypeStruct((), np.float64 if is_float_dtype(x.aval.dtype) else x.aval.dtype) for x in j.invars]
    fn = jcore.jaxpr_as_fun(v if isinstance(v, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(j, []))
    closed = jax.make_jaxpr(fn)(*args)
    return closed if isinstance(v, jcore.ClosedJaxpr) else closed.jaxpr


def is_float_dtype(dt: Any) -> bool:
    try:
        return np.issubdtype(np.dtype(dt), np.floating)
    except TypeError:
        return False


def x64_params(params: dict) -> dict:
    """Params with every floating dtype raised to float64 (``new_dtype``, ``preferred_element_type``...)."""
    out = {}
    for k, v in params.items():
        if (isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic))) and is_float_dtype(v):
            v = np.dtype(np.float64)
        elif scalar_combiner(v):  # a scatter's update_jaxpr: add of two float32 scalars -> of two float64
            v = _combiner_x64(v)
        out[k] = v
    return out


def localize(name: str, params: dict, full_shapes: Sequence[tuple], local_shapes: Sequence[tuple]) -> dict:
    """Params of primitive ``name`` for operands of ``local_shapes`` instead of ``full_shapes``.

    A dim kept whole by the op (a broadcast dim that is not expanded, a slice
    over the whole dim, a gather slice of the whole dim) follows the operand's
    local size; anything else keeps the full value, so a split the op cannot
    take fails (and ShardCombine rejects it).
    """
    if not full_shapes or list(full_shapes) == list(local_shapes):
        return params
    full, local = tuple(full_shapes[0]), tuple(local_shapes[0])
    p = dict(params)
    if name == "broadcast_in_dim":
        shape = list(p["shape"])
        for i, d in enumerate(p["broadcast_dimensions"]):
            if full[i] == shape[d]:
                shape[d] = local[i]
        p["shape"] = tuple(shape)
    elif name == "slice":
        lim = list(p["limit_indices"])
        strides = p.get("strides") or (1,) * len(lim)
        for d in range(len(lim)):
            if full[d] != local[d] and p["start_indices"][d] == 0 and lim[d] == full[d] and strides[d] == 1:
                lim[d] = local[d]
        p["limit_indices"] = tuple(lim)
    elif name in ("dynamic_slice", "gather"):
        sizes = list(p["slice_sizes"])
        for d in range(len(sizes)):
            if full[d] != local[d] and sizes[d] == full[d]:
                sizes[d] = local[d]
        p["slice_sizes"] = tuple(sizes)
    return p


def operand_shapes(payload: OpPayload, tensor_shapes: Sequence[tuple]) -> list[tuple]:
    """The shape of every operand (tensor inputs and literals, in operand order)."""
    return [tuple(tensor_shapes[l]) if isinstance(l, int) else tuple(np.shape(l[1])) for l in payload.layout]


def bind_payload(
    payload: OpPayload,
    tensors: Sequence[Any],
    *,
    full_shapes: Sequence[tuple] | None = None,
    reshape_to: tuple | None = None,
    x64: bool = False,
) -> list[Any]:
    """Bind the op's primitive on ``tensors`` (its tensor inputs, in order); a list of outputs.

    ``full_shapes`` are the unsplit input shapes (for :func:`localize`),
    ``reshape_to`` the local target shape of a reshape, ``x64`` raises floating
    literals and dtype params to float64.
    """
    operands = []
    for l in payload.layout:
        if isinstance(l, int):
            operands.append(tensors[l])
        else:
            lit = l[1]
            if x64 and is_float_dtype(lit.dtype):
                lit = lit.astype(np.float64)
            operands.append(lit)
    if payload.prim is None:
        return [operands[0]]
    params = x64_params(payload.params) if x64 else payload.params
    if reshape_to is not None and payload.name == "reshape":
        params = {**params, "new_sizes": tuple(int(s) for s in reshape_to), "dimensions": None}
    elif full_shapes is not None:
        local = [tuple(np.shape(t)) for t in tensors]
        params = localize(payload.name, params, operand_shapes(payload, full_shapes), operand_shapes(payload, local))
    out = payload.prim.bind(*operands, **params)
    return list(out) if payload.prim.multiple_results else [out]


__all__ = [
    "OpPayload",
    "IDENTITY",
    "KEY_PREFIX",
    "COPY_KEY",
    "bind_payload",
    "localize",
    "operand_shapes",
    "x64_params",
    "holds_jaxpr",
    "is_float_dtype",
    "scalar_combiner",
]
