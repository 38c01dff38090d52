"""Rebuild a user's ``te.compute`` at other shapes, without the code that built it.

A ComputeOp is fixed to its shapes: its axes have constant extents and its
body loads from the tensors it was built on. :class:`ComputeRebuilder`
reads the body (a tree of TIR expressions: arithmetic, comparisons, casts,
selects, intrinsic calls, tensor loads, reductions) and writes it again on
new placeholders, with new iteration variables whose extents follow the new
input shapes.

Which extent follows which input dim is read from the body: an axis is
*free* when every use of its variable is a bare index ``x[.., v, ..]`` of a
tensor load, and its extent equals the size of every dim it so indexes; a
free axis takes the new size of those dims (they must agree). Any other axis
(one used in arithmetic, conditions, or computed indices such as
``x[i + r]``) keeps its extent, and an input dim read at computed indices
keeps its size: a shape that would change such a dim is refused with
:class:`NotRebuildable` (ShardCombine then rejects that split).

Before a rebuilder is trusted, :func:`verify` checks that the rebuilt kernel
at the original shapes gives the original compute's output.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tvm
import tvm.tirx as tx
from tvm import te

LOAD = "te.tensor_load"
BINARY = tuple(
    getattr(tx, n)
    for n in (
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Mod",
        "FloorDiv",
        "FloorMod",
        "Min",
        "Max",
        "EQ",
        "NE",
        "LT",
        "LE",
        "GT",
        "GE",
        "And",
        "Or",
    )
)


class NotRebuildable(ValueError):
    """A compute cannot be written again at the shapes asked for (names the compute and why)."""


def is_load(e: Any) -> bool:
    return isinstance(e, tvm.ir.Call) and getattr(e.op, "name", "") == LOAD


def shape_of(t: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


class ComputeRebuilder:
    """Writes ComputeOp ``op`` again on tensors of other shapes: ``rebuilder(*tensors)`` -> its outputs.

    ``tensors`` stand for ``op.input_tensors``, in that order.
    """

    def __init__(self, op: Any) -> None:
        if not isinstance(op, te.ComputeOp):
            raise NotRebuildable(f"{type(op).__name__} {op.name!r} is not a te.compute; it runs only at its own shapes")
        self.op = op
        self.inputs = list(op.input_tensors)
        self.in_shapes = [shape_of(t) for t in self.inputs]
        self.iter_vars = list(op.axis) + list(op.reduce_axis)
        self.n_axis = len(op.axis)
        self.extents = [int(iv.dom.extent) for iv in self.iter_vars]
        self.ties: list[set[tuple[int, int]]] = [set() for _ in self.iter_vars]  # (input, dim) bare-indexed
        self.other_use: set[int] = set()  # iter vars used anywhere but as a bare load index
        self.computed_dims: set[tuple[int, int]] = set()  # (input, dim) read at a computed index
        self.fingerprint = " ; ".join(self.describe(b) for b in op.body)
        self.free = [
            k not in self.other_use
            and int(iv.dom.min) == 0
            and all(self.in_shapes[i][d] == self.extents[k] for i, d in self.ties[k])
            for k, iv in enumerate(self.iter_vars)
        ]

    def __repr__(self) -> str:
        return f"compute.{self.op.name}"

    # -- reading the body ----------------------------------------------------------
    def var_index(self, v: Any) -> int | None:
        for k, iv in enumerate(self.iter_vars):
            if iv.var.same_as(v):
                return k
        return None

    def input_index(self, t: Any) -> int:
        for i, x in enumerate(self.inputs):
            if x.same_as(t):
                return i
        raise NotRebuildable(f"compute {self.op.name!r} loads {t.op.name!r}, which is not among its input tensors")

    def bare(self, ix: Any) -> int | None:
        """The iter var that index ``ix`` is (possibly cast), or None."""
        if isinstance(ix, tx.Cast):
            ix = ix.value
        return self.var_index(ix) if isinstance(ix, tx.Var) else None

    def describe(self, e: Any) -> str:
        """A canonical text of ``e`` (inputs by position, iter vars by number), noting ties on the way."""
        d = self.describe
        if is_load(e):
            i = self.input_index(e.args[0])
            parts = []
            for dim, ix in enumerate(e.args[1:]):
                k = self.bare(ix)
                if k is not None:
                    self.ties[k].add((i, dim))
                    parts.append(f"v{k}")
                else:
                    self.computed_dims.add((i, dim))
                    parts.append(d(ix))
            return f"in{i}.{e.args[0].value_index}[{', '.join(parts)}]"
        if isinstance(e, tx.Var):
            k = self.var_index(e)
            if k is None:
                return f"var {e.name}:{e.ty}"
            self.other_use.add(k)
            return f"v{k}"
        if isinstance(e, (tx.IntImm, tx.FloatImm)):
            return f"{e.ty}({e.value!r})"
        if isinstance(e, tvm.ir.StringImm):
            return repr(e.value)
        if isinstance(e, BINARY):
            return f"{type(e).__name__}({d(e.a)}, {d(e.b)})"
        if isinstance(e, tx.Not):
            return f"Not({d(e.a)})"
        if isinstance(e, tx.Cast):
            return f"Cast({e.ty}, {d(e.value)})"
        if isinstance(e, tx.Select):
            return f"Select({d(e.condition)}, {d(e.true_value)}, {d(e.false_value)})"
        if isinstance(e, tx.Let):
            return f"Let({e.var.name}, {d(e.value)}, {d(e.body)})"
        if isinstance(e, tvm.ir.Call):
            if e.attrs is not None or len(e.ty_args):
                raise NotRebuildable(f"compute {self.op.name!r} calls {e.op} with attributes")
            return f"{getattr(e.op, 'name', e.op)}:{e.ty}({', '.join(d(a) for a in e.args)})"
        if isinstance(e, tx.Reduce):
            for iv in e.axis:
                if self.var_index(iv.var) is None:
                    raise NotRebuildable(f"compute {self.op.name!r} reduces over an axis it does not declare")
            comb = e.combiner
            return (
                f"Reduce[{', '.join(str(r) for r in comb.result)} | {', '.join(str(x) for x in comb.identity_element)}]"
                f"({', '.join(d(s) for s in e.source)}; over {[self.var_index(iv.var) for iv in e.axis]}; "
                f"if {d(e.condition)}; init {[d(x) for x in e.init]}; #{e.value_index})"
            )
        raise NotRebuildable(
            f"compute {self.op.name!r} holds a {type(e).__name__} expression, which MetaDist cannot rewrite"
        )

    # -- new shapes ----------------------------------------------------------------
    def new_extents(self, shapes: Sequence[Sequence[int]]) -> list[int]:
        """The extent of every iter var (output axes, then reduce axes) for input ``shapes``."""
        shapes = [tuple(int(s) for s in shp) for shp in shapes]
        name = self.op.name
        if len(shapes) != len(self.inputs):
            raise NotRebuildable(f"compute {name!r} reads {len(self.inputs)} tensors, got {len(shapes)} shapes")
        for i, (new, old) in enumerate(zip(shapes, self.in_shapes)):
            if len(new) != len(old):
                raise NotRebuildable(f"input {i} of compute {name!r} has shape {old}; got rank-{len(new)} {new}")
            for dim, (a, b) in enumerate(zip(new, old)):
                if a == b:
                    continue
                movable = (i, dim) not in self.computed_dims and all(
                    self.free[k] for k, t in enumerate(self.ties) if (i, dim) in t
                )
                if not movable:
                    raise NotRebuildable(
                        f"compute {name!r} reads dim {dim} of input {i} (size {b}) at computed "
                        f"indices, so it cannot take size {a}"
                    )
        out = []
        for k, ext in enumerate(self.extents):
            if not self.free[k] or not self.ties[k]:
                out.append(ext)
                continue
            deltas = {shapes[i][d] - self.in_shapes[i][d] for i, d in self.ties[k]}
            if len(deltas) != 1:
                dims = ", ".join(f"input {i} dim {d} = {shapes[i][d]}" for i, d in sorted(self.ties[k]))
                raise NotRebuildable(
                    f"axis {self.iter_vars[k].var.name} of compute {name!r} indexes dims that must agree, got {dims}"
                )
            out.append(ext + deltas.pop())
        return out

    def __call__(self, *tensors: Any) -> list:
        exts = self.new_extents([shape_of(t) for t in tensors])
        raxes = [
            te.reduce_axis((0, exts[k]), name=self.iter_vars[k].var.name)
            for k in range(self.n_axis, len(self.iter_vars))
        ]

        def body(*out_vars: Any) -> Any:
            env: list[Any] = list(out_vars) + [r.var for r in raxes]
            outs = [self.rewrite(b, env, raxes, tensors) for b in self.op.body]
            return outs[0] if len(outs) == 1 else outs

        res = te.compute(tuple(exts[: self.n_axis]), body, name=self.op.name, tag=self.op.tag)
        return [res] if isinstance(res, te.Tensor) else list(res)

    def rewrite(self, e: Any, env: list, raxes: list, tensors: Sequence[Any]) -> Any:
        """``e`` with iter var ``k`` replaced by ``env[k]`` and loads of input ``i`` by loads of ``tensors[i]``."""

        def r(x: Any) -> Any:
            return self.rewrite(x, env, raxes, tensors)

        if is_load(e):
            t = tensors[self.input_index(e.args[0])]
            return t(*[r(ix) for ix in e.args[1:]])
        if isinstance(e, tx.Var):
            k = self.var_index(e)
            return e if k is None else env[k]
        if isinstance(e, (tx.IntImm, tx.FloatImm, tvm.ir.StringImm)):
            return e
        if isinstance(e, BINARY):
            return type(e)(r(e.a), r(e.b))
        if isinstance(e, tx.Not):
            return tx.Not(r(e.a))
        if isinstance(e, tx.Cast):
            return tx.Cast(e.ty, r(e.value))
        if isinstance(e, tx.Select):
            return tx.Select(r(e.condition), r(e.true_value), r(e.false_value))
        if isinstance(e, tx.Let):
            return tx.Let(e.var, r(e.value), r(e.body))
        if isinstance(e, tvm.ir.Call):
            return tvm.ir.Call(e.op, [r(a) for a in e.args], ret_ty=e.ty)
        if isinstance(e, tx.Reduce):
            rdom = [raxes[self.var_index(iv.var) - self.n_axis] for iv in e.axis]
            return tx.Reduce(
                e.combiner, [r(s) for s in e.source], rdom, r(e.condition), e.value_index, [r(x) for x in e.init]
            )
        raise NotRebuildable(f"compute {self.op.name!r} holds a {type(e).__name__} expression")


# -- checking a rebuilder against the original compute --------------------------------


def upstream_placeholders(tensors: Sequence[Any]) -> list:
    """The placeholders the tensors are computed from, in first-seen order."""
    seen: list = []
    found: list = []
    stack = list(tensors)
    while stack:
        t = stack.pop()
        if any(t.op.same_as(o) for o in seen):
            continue
        seen.append(t.op)
        if isinstance(t.op, te.PlaceholderOp):
            found.append(t)
        else:
            stack.extend(t.op.input_tensors)
    return found[::-1]


def compile_func(args: Sequence[Any]) -> Callable[..., Any]:
    func = te.create_prim_func(list(args))
    return tvm.compile(tvm.IRModule({"main": func}), target="llvm")["main"]


def random_value(shape: Sequence[int], dtype: str, rng: np.random.Generator) -> np.ndarray:
    d = np.dtype(dtype) if dtype != "bfloat16" else np.dtype("float32")
    if d.kind in "fc":
        return rng.standard_normal(tuple(shape)).astype(d)
    if d.kind == "b":
        return rng.random(tuple(shape)) < 0.5
    return rng.integers(0, 3, size=tuple(shape)).astype(d)


def verify(rebuilder: ComputeRebuilder, seed: int = 0) -> None:
    """Run the rebuilt compute at the original shapes on random inputs and compare with the original.

    The original runs over the placeholders upstream of it (its input tensors
    come out of the same kernel); raises NotRebuildable when they differ.
    """
    op = rebuilder.op
    outs = [op.output(i) for i in range(op.num_outputs)]
    phs = upstream_placeholders(outs)
    mids = [t for t in rebuilder.inputs if not isinstance(t.op, te.PlaceholderOp)]
    rng = np.random.default_rng(seed)
    dev = tvm.cpu()
    feed = [tvm.runtime.tensor(random_value(shape_of(p), str(p.dtype), rng), dev) for p in phs]
    mid_vals = [tvm.runtime.empty(shape_of(t), str(t.dtype), dev) for t in mids]
    want = [tvm.runtime.empty(shape_of(t), str(t.dtype), dev) for t in outs]
    compile_func([*phs, *mids, *outs])(*feed, *mid_vals, *want)

    new_phs = [te.placeholder(shape_of(t), dtype=str(t.dtype), name=f"in{i}") for i, t in enumerate(rebuilder.inputs)]
    new_outs = rebuilder(*new_phs)
    values = []
    for t in rebuilder.inputs:
        pool = [(p, v) for p, v in zip(phs, feed)] + [(m, v) for m, v in zip(mids, mid_vals)]
        values.append(next(v for p, v in pool if p.same_as(t)))
    got = [tvm.runtime.empty(shape_of(t), str(t.dtype), dev) for t in new_outs]
    compile_func([*new_phs, *new_outs])(*values, *got)
    for i, (a, b) in enumerate(zip(want, got)):
        a, b = a.numpy(), b.numpy()
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
            raise NotRebuildable(
                f"compute {op.name!r} rebuilt at its own shapes does not give its output {i} "
                f"(max difference {np.max(np.abs(a.astype(float) - b.astype(float))):.3g})"
            )
