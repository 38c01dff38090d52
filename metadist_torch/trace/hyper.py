"""The numbers of the optimizers' param groups as run-time inputs of a traced step.

A learning-rate schedule, a OneCycle momentum cycle or a weight decay edited
by hand changes a number in ``optimizer.param_groups`` between calls; the
compiled step must read it at every call, never keep the first call's value.

While tracing, each such number (lr, weight_decay, betas, eps, momentum, ...;
:func:`hyper_slots`) is a symbolic float or int of the fake mode's ShapeEnv
(:func:`symbolic_values`): the optimizer's Python arithmetic on it becomes
graph nodes, and every branch its code takes on a value (``if weight_decay !=
0``) becomes a ShapeEnv guard. After tracing, :func:`lift` turns each symbol
into a 0-d CPU tensor that the graph reads as a constant (``get_attr``), its
arithmetic into aten ops on such tensors (float64 for floats: the same double
arithmetic Python does), and each place where an op took the number into
``aten._local_scalar_dense`` of its tensor, so that the op receives exactly
the number eager torch passes it. :class:`Hyperparameters` fills those
tensors from the param groups before every run and checks the branch guards.

A number the step reads from one of its own tensors (``step_t.item()``: an
optimizer's step counter on its default path) is lifted the same way: its
arithmetic becomes the same float64 ops on that 0-d tensor, so a bias
correction is the double eager torch computes from the counter it holds.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

aten = torch.ops.aten
ITEM = aten._local_scalar_dense.default  # a 0-d tensor's number, as an op argument
ATTR_PREFIX = "_metadist_hyper"

# Python arithmetic on symbolic numbers -> the aten op computing it on 0-d tensors
_BINARY = {
    operator.add: aten.add.Tensor,
    operator.sub: aten.sub.Tensor,
    operator.mul: aten.mul.Tensor,
    operator.truediv: aten.div.Tensor,
    operator.pow: aten.pow.Tensor_Tensor,
    operator.floordiv: aten.floor_divide.default,
    operator.mod: aten.remainder.Tensor,
    operator.eq: aten.eq.Tensor,
    operator.ne: aten.ne.Tensor,
    operator.lt: aten.lt.Tensor,
    operator.le: aten.le.Tensor,
    operator.gt: aten.gt.Tensor,
    operator.ge: aten.ge.Tensor,
    torch.sym_max: aten.maximum.default,
    torch.sym_min: aten.minimum.default,
}
_UNARY = {
    operator.neg: aten.neg.default,
    operator.abs: aten.abs.default,
    operator.pos: None,
    torch._sym_sqrt: aten.sqrt.default,
    math.sqrt: aten.sqrt.default,
    torch.sym_float: None,
}


@dataclass(frozen=True)
class HyperSlot:
    """One number of a param group: ``optimizers[opt].param_groups[group][key]`` (``[item]`` of a tuple such
    as ``betas``); ``kind`` is "float" or "int", the type it had when traced."""

    opt: int
    group: int
    key: str
    item: int | None
    kind: str

    @property
    def name(self) -> str:
        return f"opt{self.opt}.group{self.group}.{self.key}" + ("" if self.item is None else f"[{self.item}]")

    def read(self, optimizers: Sequence[torch.optim.Optimizer]) -> Any:
        v = optimizers[self.opt].param_groups[self.group][self.key]
        return v if self.item is None else v[self.item]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_fed(v: Any) -> bool:
    """Is this param-group entry fed as run-time numbers: a number, or a tuple of numbers (``betas``)?"""
    return _is_number(v) or (isinstance(v, (tuple, list)) and bool(v) and all(_is_number(x) for x in v))


def hyper_slots(optimizers: Sequence[torch.optim.Optimizer]) -> list[HyperSlot]:
    """Every number (int or float, not bool) of every param group, tuples of numbers element by element."""
    out: list[HyperSlot] = []
    for oi, opt in enumerate(optimizers):
        for gi, g in enumerate(opt.param_groups):
            for key in sorted(g):
                v = g[key]
                if key == "params":
                    continue
                if _is_number(v):
                    out.append(HyperSlot(oi, gi, key, None, type(v).__name__))
                elif is_fed(v):
                    out.extend(HyperSlot(oi, gi, key, i, type(x).__name__) for i, x in enumerate(v))
    return out


def symbolic_values(
    slots: Sequence[HyperSlot], optimizers: Sequence[torch.optim.Optimizer], shape_env: Any
) -> list[Any]:
    """A symbolic float or int of ``shape_env`` per slot, hinted by its value now (no two share a symbol)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    out = []
    for i, s in enumerate(slots):
        v = s.read(optimizers)
        src = ConstantSource(f"hyper{i}")
        sym = shape_env.create_unspecified_symbol(v, source=src, dynamic_dim=DimDynamic.DYNAMIC)
        out.append(
            shape_env.create_symfloatnode(sym, hint=float(v), source=src)
            if s.kind == "float"
            else shape_env.create_symintnode(sym, hint=int(v), source=src)
        )
    return out


@contextlib.contextmanager
def swapped_values(
    slots: Sequence[HyperSlot], optimizers: Sequence[torch.optim.Optimizer], values: Sequence[Any]
) -> Iterator[None]:
    """The param groups hold ``values`` (the symbolic numbers) inside the block."""
    saved = [
        (g, k, g[k])
        for g, k in {
            (id(optimizers[s.opt].param_groups[s.group]), s.key): (optimizers[s.opt].param_groups[s.group], s.key)
            for s in slots
        }.values()
    ]
    try:
        for s, v in zip(slots, values):
            g = optimizers[s.opt].param_groups[s.group]
            if s.item is None:
                g[s.key] = v
            else:
                cur = list(g[s.key])
                cur[s.item] = v
                g[s.key] = type(g[s.key])(cur)
        yield
    finally:
        for g, k, v in saved:
            g[k] = v


def _dtype(val: Any) -> torch.dtype:
    if isinstance(val, (torch.SymBool, bool)):
        return torch.bool
    if isinstance(val, (torch.SymInt, int)):
        return torch.int64
    return torch.float64


class UnliftableNumber(RuntimeError):
    """A computation on a number read from a tensor has no aten counterpart (it cannot be folded either)."""


@dataclass
class Lifted:
    """What :func:`lift` made: (slot index, tensor) of each number the graph reads, and the slots whose value
    a folded computation needed (``{slot index: traced value}``: each a guard on that value)."""

    feeds: list[tuple[int, torch.Tensor]]
    pinned: dict[int, Any] = field(default_factory=dict)


def lift(gm: fx.GraphModule, placeholders: Sequence[fx.Node], hints: Sequence[Any]) -> Lifted:
    """Turn the symbolic-number placeholders of ``gm`` into 0-d tensor constants, as the module docstring says.

    The graph is changed in place (not recompiled). A computation on the numbers with no aten counterpart is
    folded to its traced value, and the slots it reads are returned as ``pinned`` (guards); where it reads a
    number of a tensor (``.item()``) it cannot be folded, and :class:`UnliftableNumber` says which.
    """
    g = gm.graph
    mode = _fake_mode(gm)
    first_op = next(n for n in g.nodes if n.op != "placeholder")
    tensor_of: dict[fx.Node, fx.Node] = {}
    source: dict[fx.Node, set[int]] = {}
    lifted = Lifted([])
    for i, (ph, hint) in enumerate(zip(placeholders, hints)):
        if not ph.users:
            continue
        t = torch.zeros((), dtype=_dtype(ph.meta.get("val", hint)))
        attr = f"{ATTR_PREFIX}{i}"
        gm.register_buffer(attr, t, persistent=False)
        with g.inserting_before(first_op):
            n = g.get_attr(attr)
        n.meta["val"] = _fake(mode, t)
        tensor_of[ph] = n
        source[ph] = {i}
        lifted.feeds.append((i, t))

    cast: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

    def as_tensor(a: Any, dtype: torch.dtype, before: fx.Node) -> Any:
        if isinstance(a, fx.Node):
            t = tensor_of[a]
            if t.meta["val"].dtype != dtype:
                if (t, dtype) not in cast:
                    with g.inserting_before(before):
                        cast[t, dtype] = g.call_function(aten._to_copy.default, (t,), {"dtype": dtype})
                    cast[t, dtype].meta["val"] = _fake(mode, torch.zeros((), dtype=dtype))
                t = cast[t, dtype]
            return t
        with g.inserting_before(before):
            t = g.call_function(aten.scalar_tensor.default, (a,), {"dtype": dtype, "device": torch.device("cpu")})
        t.meta["val"] = _fake(mode, torch.zeros((), dtype=dtype))
        return t

    dead: list[fx.Node] = []
    from_data: set[fx.Node] = set()  # numbers computed from a number read from a tensor
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is ITEM and isinstance(n.meta.get("val"), _SYM) and isinstance(n.args[0], fx.Node):
            tensor_of[n] = n.args[0]  # a tensor's number (a step counter's .item()): read from that tensor
            source[n] = set()
            from_data.add(n)
            dead.append(n)
            continue
        reads = [a for a in _flat_nodes((n.args, n.kwargs)) if a in tensor_of]
        if not reads:
            continue
        if not isinstance(n.target, torch._ops.OpOverload):  # arithmetic on the numbers themselves
            source[n] = set().union(*(source[a] for a in reads))
            if any(a in from_data for a in reads):
                from_data.add(n)
            dtype = _dtype(n.meta.get("val"))
            table = _BINARY if len(n.args) == 2 and not n.kwargs else _UNARY if len(n.args) == 1 else {}
            if n.target not in table and n in from_data:
                raise UnliftableNumber(f"{n.name} = {n.target}(...) on a number read from a tensor")
            if n.target not in table:
                for i in source[n]:  # no aten counterpart: folded to its traced value, a guard
                    lifted.pinned[i] = hints[i]
                tensor_of[n] = as_tensor(_hint(n.meta.get("val")), dtype, n)
            elif table[n.target] is None:  # +x, float(x): the same number, in the result's dtype
                tensor_of[n] = as_tensor(n.args[0], dtype, n)
            else:
                op = table[n.target]
                work = (
                    dtype
                    if dtype != torch.bool
                    else max(
                        (_dtype(a.meta.get("val")) if isinstance(a, fx.Node) else _dtype(a) for a in n.args),
                        key=lambda d: d.is_floating_point,
                    )
                )
                ins = [as_tensor(a, work, n) for a in n.args]
                with g.inserting_before(n):
                    t = g.call_function(op, tuple(ins))
                t.meta["val"] = _fake(mode, torch.zeros((), dtype=dtype))
                tensor_of[n] = t
            dead.append(n)
            continue
        # an op taking a number: the number of its tensor, at run time
        items: dict[fx.Node, fx.Node] = {}
        for a in reads:
            with g.inserting_before(n):
                items[a] = g.call_function(ITEM, (tensor_of[a],))
            items[a].meta["val"] = _hint(a.meta.get("val"))
        n.args = fx.node.map_arg(n.args, lambda a: items.get(a, a))
        n.kwargs = fx.node.map_arg(n.kwargs, lambda a: items.get(a, a))
    for n in reversed(dead):
        if n.users:
            n.replace_all_uses_with(tensor_of[n])
        g.erase_node(n)
    for ph in placeholders:
        if ph.users:
            ph.replace_all_uses_with(tensor_of[ph])
        g.erase_node(ph)
    return lifted


_SYM = (torch.SymFloat, torch.SymInt, torch.SymBool)


def _flat_nodes(x: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(x, lambda a: out.append(a) or a)
    return out


def _hint(v: Any) -> Any:
    if isinstance(v, _SYM):
        return v.node.hint
    return v


def _fake_mode(gm: fx.GraphModule) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def _fake(mode: Any, t: torch.Tensor) -> Any:
    return mode.from_tensor(t) if mode is not None else t


class Hyperparameters:
    """The run-time inputs of a traced step: the param groups' numbers (``slots``), written into the graph's
    0-d tensors before each run (:meth:`refresh`), and the guards on them (:meth:`changed`).
    ``feeds``: (slot index, tensor) of each number the program reads."""

    def __init__(
        self,
        slots: Sequence[HyperSlot],
        feeds: Sequence[tuple[int, torch.Tensor]],
        guards: Sequence[tuple[str, Callable[[Sequence[Any]], bool]]],
        pinned: dict[int, Any],
    ) -> None:
        self.slots, self.feeds = list(slots), list(feeds)
        self.guards = list(guards)
        self.pinned = dict(pinned)

    @classmethod
    def none(cls) -> "Hyperparameters":
        return cls([], [], [], {})

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self.feeds]

    def values(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
        return [s.read(optimizers) for s in self.slots]

    def refresh(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Write the param groups' numbers now into the tensors the program reads."""
        for i, t in self.feeds:
            t.fill_(self.slots[i].read(optimizers))

    def changed(self, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
        """What makes the traced program wrong for the numbers now: a branch the optimizer took on them goes
        the other way, a folded number changed, or a number changed type; None when nothing does."""
        try:
            vals = self.values(optimizers)
        except (IndexError, KeyError, TypeError) as e:
            return f"the param groups no longer hold the traced numbers ({type(e).__name__}: {e})"
        for s, v in zip(self.slots, vals):
            if not _is_number(v) or (s.kind == "int") != isinstance(v, int):
                return f"{s.name} is {v!r}, traced as a {s.kind}"
        for i, v in self.pinned.items():
            if vals[i] != v:
                return f"{self.slots[i].name} changed from {v!r} to {vals[i]!r} (folded into the program)"
        for text, holds in self.guards:
            if not holds(vals):
                return (
                    f"the optimizer branched on {text}, which no longer holds "
                    f"({', '.join(f'{s.name}={v!r}' for s, v in zip(self.slots, vals) if s.name in text)})"
                )
        return None


def branch_guards(
    shape_env: Any, slots: Sequence[HyperSlot], symbols: Sequence[Any]
) -> tuple[list[tuple[str, Callable[[Sequence[Any]], bool]]], dict[int, Any]]:
    """The ShapeEnv's guards on the symbolic numbers as ``(readable text, holds(values) -> bool)``, and the
    slots it replaced by a constant (``{slot index: value}``: guards on equality)."""
    import sympy

    exprs = [getattr(s.node, "_expr", s.node.expr) for s in symbols]  # before replacements
    index = {e: i for i, e in enumerate(exprs) if isinstance(e, sympy.Symbol)}
    out: list[tuple[str, Callable[[Sequence[Any]], bool]]] = []
    for guard in getattr(shape_env, "guards", []):
        expr = guard.expr
        free = sorted((s for s in expr.free_symbols if s in index), key=lambda s: index[s])
        if not free:
            continue
        fn = sympy.lambdify(free, expr, modules="math")
        pos = [index[s] for s in free]
        text = str(expr.xreplace({s: sympy.Symbol(slots[index[s]].name) for s in free}))
        out.append((text, lambda vals, fn=fn, pos=pos: bool(fn(*[vals[i] for i in pos]))))
    pinned = {index[s]: symbols[index[s]].node.hint for s in getattr(shape_env, "replacements", {}) if s in index}
    return out, pinned


__all__ = [
    "HyperSlot",
    "Hyperparameters",
    "UnliftableNumber",
    "hyper_slots",
    "is_fed",
    "symbolic_values",
    "swapped_values",
    "lift",
    "branch_guards",
    "ITEM",
    "ATTR_PREFIX",
]
