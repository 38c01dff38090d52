"""Canonical operator names: one name for the same operator across frontends.

``aten.mm.default``, ``jax.lax.dot_general`` contracting dim 1 of a 2-D lhs
with dim 0 of a 2-D rhs, ``te.topi.nn.matmul`` without transposes and the
reference ``np.matmul`` on 2-D inputs all compute ``A @ B``: their canonical
name is ``matmul``, and the ShardingRules ShardCombine finds for them must
agree (a test checks it). :func:`canonical_name` answers only where the
operator really is the same for these inputs and attributes, and None
everywhere else; it never guesses.

Attributes are read in the frontends' encodings: ``{"args": [...], "kwargs":
{...}}`` with ``{"$in": i}`` for tensor input ``i`` (aten and TE ops), or
named parameters (``{"params": {"dimension_numbers": ...}}`` of a lax primitive).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

Shapes = Sequence[Sequence[int] | None]


def encoded_arg(attrs: Mapping[str, Any] | None, pos: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (positional ``pos`` of the call) from a frontend's attrs."""
    attrs = attrs or {}
    args = attrs.get("args")
    if isinstance(args, (list, tuple)) and pos < len(args):
        return args[pos]
    kwargs = attrs.get("kwargs")
    if isinstance(kwargs, Mapping) and name in kwargs:
        return kwargs[name]
    return attrs.get(name, default)


def _ranks(shapes: Shapes) -> list[int | None]:
    return [None if s is None else len(s) for s in shapes]


def _tensors_are(shapes: Shapes, *ranks: int) -> bool:
    return _ranks(shapes) == list(ranks)


def _as_tuple(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_as_tuple(v) for v in x)
    return x


def _dot_general(attrs: Mapping[str, Any] | None, shapes: Shapes) -> str | None:
    attrs = attrs or {}
    given = attrs.get("params")
    params = given if isinstance(given, Mapping) else attrs
    dn = _as_tuple(params.get("dimension_numbers"))
    if not _tensors_are(shapes, 2, 2) or dn is None:
        return None
    if dn == (((1,), (0,)), ((), ())):
        return "matmul"
    if dn == (((1,), (1,)), ((), ())):
        return "matmul_nt"
    return None


def _te_matmul(attrs: Mapping[str, Any] | None, shapes: Shapes) -> str | None:
    # tvm.topi.nn.matmul(a, b, bias=None, out_dtype=None, transpose_a=False, transpose_b=False)
    if not _tensors_are(shapes, 2, 2) or encoded_arg(attrs, 2, "bias") is not None:
        return None
    ta, tb = bool(encoded_arg(attrs, 4, "transpose_a", False)), bool(encoded_arg(attrs, 5, "transpose_b", False))
    return {(False, False): "matmul", (False, True): "matmul_nt"}.get((ta, tb))


def _te_dense(attrs: Mapping[str, Any] | None, shapes: Shapes) -> str | None:
    # tvm.topi.nn.dense(data, weight, bias=None): data @ weight.T
    if not _tensors_are(shapes, 2, 2) or encoded_arg(attrs, 2, "bias") is not None:
        return None
    return "matmul_nt"


def _aten_linear(attrs: Mapping[str, Any] | None, shapes: Shapes) -> str | None:
    return "matmul_nt" if _tensors_are(shapes, 2, 2) else None


def _two_2d(name: str) -> Callable[[Any, Shapes], str | None]:
    return lambda attrs, shapes: name if _tensors_are(shapes, 2, 2) else None


def _same_shapes(name: str) -> Callable[[Any, Shapes], str | None]:
    def rule(attrs: Any, shapes: Shapes) -> str | None:
        if not shapes or any(s is None for s in shapes) or len({tuple(s) for s in shapes}) != 1:  # type: ignore[arg-type]
            return None
        return name

    return rule


def _binary(name: str) -> Callable[[Any, Shapes], str | None]:
    """``name`` for two tensors of one shape; a tensor and a Python scalar (``mul(x, 0)``, ``mul(x, -1)``) keeps
    its op key and its scalar in the pattern: the scalar decides the rules (x * 0 is the same on every device,
    x * -1 turns Partial(max) into Partial(min))."""
    same = _same_shapes(name)
    return lambda attrs, shapes: same(attrs, shapes) if len(shapes) == 2 else None


def _aten_add(attrs: Mapping[str, Any] | None, shapes: Shapes) -> str | None:
    alpha = encoded_arg(attrs, 2, "alpha", 1)
    return _binary("add")(attrs, shapes) if alpha in (1, 1.0, None) else None


def _softmax_last(axis_pos: int, axis_name: str) -> Callable[[Any, Shapes], str | None]:
    def rule(attrs: Any, shapes: Shapes) -> str | None:
        if len(shapes) != 1 or shapes[0] is None:
            return None
        axis = encoded_arg(attrs, axis_pos, axis_name, -1)
        nd = len(shapes[0])
        if isinstance(axis, int) and nd and axis % nd == nd - 1:
            if axis_name == "dim" and encoded_arg(attrs, 2, "half_to_float", False):
                return None
            return "softmax"
        return None

    return rule


# op key -> rule(attrs, input shapes) -> canonical name or None
CANONICAL: dict[str, Callable[[Any, Shapes], str | None]] = {
    # matmul: A @ B on 2-D inputs
    "np.matmul": _two_2d("matmul"),
    "te.matmul": _two_2d("matmul"),
    "te.topi.nn.matmul": _te_matmul,
    "aten.mm.default": _two_2d("matmul"),
    "aten.mm": _two_2d("matmul"),
    "aten.matmul.default": _two_2d("matmul"),
    "jax.lax.dot_general": _dot_general,
    "jax.dot_general": _dot_general,
    # A @ B.T on 2-D inputs (a dense / linear layer without bias)
    "te.topi.nn.dense": _te_dense,
    "aten.linear.default": _aten_linear,
    # elementwise, same shapes
    "np.add": _binary("add"),
    "te.topi.add": _binary("add"),
    "aten.add.Tensor": _aten_add,
    "jax.lax.add": _binary("add"),
    "np.mul": _binary("mul"),
    "te.topi.multiply": _binary("mul"),
    "aten.mul.Tensor": _binary("mul"),
    "jax.lax.mul": _binary("mul"),
    "np.relu": _same_shapes("relu"),
    "te.topi.nn.relu": _same_shapes("relu"),
    "aten.relu.default": _same_shapes("relu"),
    "np.exp": _same_shapes("exp"),
    "te.topi.exp": _same_shapes("exp"),
    "aten.exp.default": _same_shapes("exp"),
    "jax.lax.exp": _same_shapes("exp"),
    # softmax over the last dim
    "np.softmax": _softmax_last(0, "dim"),
    "te.topi.nn.softmax": _softmax_last(1, "axis"),
    "aten._softmax.default": _softmax_last(1, "dim"),
}


def canonical_name(key: str, attrs: Mapping[str, Any] | None, input_shapes: Shapes) -> str | None:
    """The shared name of op ``key`` with these static ``attrs`` on inputs of ``input_shapes``, or None.

    >>> canonical_name("aten.mm.default", {}, [(8, 4), (4, 6)])
    'matmul'
    >>> canonical_name("jax.lax.dot_general", {"params": {"dimension_numbers": [[[1], [0]], [[], []]]}}, [(8, 4), (4, 6)])
    'matmul'
    >>> canonical_name("te.topi.nn.matmul", {"args": [{"$in": 0}, {"$in": 1}]}, [(8, 4), (4, 6)])
    'matmul'
    """
    rule = CANONICAL.get(key)
    if rule is None:
        return None
    try:
        return rule(attrs, list(input_shapes))
    except (TypeError, ValueError, KeyError, IndexError):
        return None
