"""Op patterns and proxy shapes: what an op's sharding rules depend on, and small shapes that keep it.

A rule found for one op serves every op of the same **pattern**: the same op
key (canonical where :mod:`metadist_core.discovery.canonical` maps it), dtypes, ranks,
static attributes that are not sizes, which dims are small (and their exact
size: 1 stays 1, a kernel of 3 stays 3), which large sizes are equal, which are
products or small multiples of others (what a view or a split needs), and the
remainder of each large size divided by the mesh axis size. Everything else —
the width, the sequence, the vocabulary, the batch — is free, so discovery runs
each pattern once at small **proxy** sizes and the rules serve every model size.

:func:`op_pattern` reads the pattern of an op; :func:`proxy_op` builds the same
op at proxy sizes (instance 0 or 1: two different proxies, so that a rule must
hold at two sizes). Size-bearing static arguments (view shapes, split sizes,
slice bounds, arange ends...) are rewritten by value: every integer in the
attributes that equals a large size of the op becomes its proxy. An integer
that is large but is no size of the op (a slice bound in the middle of a dim,
an index) cannot be rewritten: such an op is discovered at its real shapes
(:class:`NoProxy` says why), never silently wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.placement import splits_nonempty
from metadist_core.discovery.canonical import canonical_name

SMALL = 4  # sizes up to this stay exactly as they are (1, pairs, kernels of 3, RGB...)
MAX_MULTIPLE = 4  # a large size that is k x another (k <= this) keeps that relation (a fused qkv is 3 x width)
SENTINEL = 2**31  # integers this large in attributes mean "to the end" (slice ends), not sizes
PROXY_BUDGET = 2**22  # elements over all of a proxy op's tensors; a larger proxy stands for nothing useful


class NoProxy(Exception):
    """An op whose pattern cannot be kept at proxy sizes; it is discovered at its real shapes."""


@dataclass(frozen=True)
class Pattern:
    """The pattern of one op on an axis of ``axis_size`` devices; ``key`` names it in the RuleBook."""

    key: str
    axis_size: int
    proxied: bool  # False: the key is the op's exact signature (discovered at real shapes)
    multiples: bool = False  # large sizes that are small multiples of others keep that relation
    basis: tuple[tuple[int, str], ...] = ()  # large size -> its symbol ("a0", "3*a0", "a0*a1")
    reason: str = ""  # why not proxied


def _shapes(op: MetaOp, graph: MetaIR) -> list[tuple[int, ...] | None]:
    return [None if (s := graph.vars[v].shape) is None else tuple(s) for v in op.inputs + op.outputs]


def view_relations(shapes: Sequence[Sequence[int] | None]) -> dict[int, tuple[int, ...]]:
    """Sizes that a view or reshape merges or splits: ``{merged size: the sizes it is the product of}``.

    For every two shapes of the op with the same number of elements, dims are
    grouped where their running products meet (as a reshape moves them); a
    group of one dim on one side and several on the other ties that size to
    their product. Products that only happen to hold (64 = 8 x 8) are not kept.
    """
    rel: dict[int, tuple[int, ...]] = {}
    full = [tuple(s) for s in shapes if s is not None and len(s) and 0 not in s]
    for a in full:
        for b in full:
            if a == b or math.prod(a) != math.prod(b):
                continue
            i = j = 0
            pa = pb = 1
            ga: list[int] = []
            gb: list[int] = []
            while i < len(a) or j < len(b):
                if (pa <= pb and i < len(a)) or j >= len(b):
                    pa *= a[i]
                    ga.append(a[i])
                    i += 1
                else:
                    pb *= b[j]
                    gb.append(b[j])
                    j += 1
                if pa == pb:
                    xa, xb = [x for x in ga if x != 1], [x for x in gb if x != 1]
                    if len(xa) == 1 and len(xb) > 1:
                        rel.setdefault(xa[0], tuple(xb))
                    elif len(xb) == 1 and len(xa) > 1:
                        rel.setdefault(xb[0], tuple(xa))
                    ga, gb = [], []
    return rel


def exact_below(axis_size: int) -> int:
    """Sizes up to this stay exactly as they are on an axis of ``axis_size``: the small ones (SMALL), and
    every size below the axis size (a split of it leaves devices empty whatever it is; a proxy of it would
    be larger than the size itself: on an axis of 16, GPT-2 XL's batch of 8 and 25 heads made proxies of
    the attention ops larger than the real ops)."""
    return max(SMALL, axis_size - 1)


def size_basis(shapes: Sequence[Sequence[int] | None], multiples: bool = False, small: int = SMALL) -> dict[int, tuple]:
    """Each large size (> ``small``) of the op's ``shapes`` as an expression over base sizes, smallest first.

    ``("base", i)`` is the i-th base; ``("prod", s1, s2, ...)`` is the product a view needs
    (:func:`view_relations`); with ``multiples``, ``("mul", k, s)`` is k x size s (k <= MAX_MULTIPLE:
    what a concat or a fused qkv split needs) and ``("add", s, k)`` is size s + k (k <= SMALL: a
    sequence shifted for next-token targets); these are tried only when the op fails without them,
    because such relations also hold by chance, and every chance relation is another pattern.
    """
    rel = view_relations(shapes)
    sizes = {int(d) for s in shapes if s is not None for d in s}
    # sizes that stand at the same dim (counted from the last) of two tensors: what a concat, a slice or a
    # split relates; sizes in different dims are related only by chance
    aligned: set[tuple[int, int]] = set()
    full = [tuple(int(d) for d in s) for s in shapes if s is not None]
    for a in full:
        for b in full:
            for x, y in zip(reversed(a), reversed(b)):
                if x != y:
                    aligned.add((x, y))
    out: dict[int, tuple] = {}
    n_base = 0
    for s in sorted(x for x in sizes if x > small):
        expr = None
        factors = rel.get(s)
        if factors is not None and all(f <= small or f in out for f in factors):
            expr = ("prod", *factors)
        if expr is None and multiples:  # a size next to another (a shifted sequence: 513 tokens, 512 targets)
            for k in range(1, SMALL + 1):
                if s - k in out and (s, s - k) in aligned:
                    expr = ("add", s - k, k)
                    break
        if expr is None and multiples:
            for t in sorted(out):
                if s % t == 0 and 2 <= s // t <= MAX_MULTIPLE and (s, t) in aligned:
                    expr = ("mul", s // t, t)
                    break
        if expr is None:
            expr = ("base", n_base)
            n_base += 1
        out[s] = expr
    # name the bases by where they first stand in the shapes, not by their size: which of two independent
    # sizes is larger says nothing about how the op splits, so it must not make another pattern
    order: dict[int, int] = {}
    for shp in shapes:
        for d in shp or ():
            e = out.get(int(d))
            if e is not None and e[0] == "base" and e[1] not in order:
                order[e[1]] = len(order)
    return {k: (("base", order.get(e[1], e[1])) if e[0] == "base" else e) for k, e in out.items()}


def _symbol(s: int, basis: Mapping[int, tuple], n: int) -> str:
    if s not in basis:  # an exact size
        return str(s)
    e = basis[s]
    if e[0] == "base":  # its remainder, and whether a split over the axis leaves a device empty ("e")
        return f"a{e[1]}%{s % n}" + ("" if splits_nonempty(s, n) else "e")
    if e[0] == "mul":
        return f"{e[1]}*({_symbol(e[2], basis, n)})"
    if e[0] == "add":
        return f"({_symbol(e[1], basis, n)})+{e[2]}"
    return "*".join(f"({_symbol(f, basis, n)})" for f in e[1:])


def _map_attrs(x: Any, fn) -> Any:
    """``x`` with ``fn`` applied to every integer (not bool) inside lists, tuples and dicts; references to
    tensor inputs (``{"$in": i}``, ``{"var": name}``) are left alone."""
    if isinstance(x, bool):
        return x
    if isinstance(x, dict) and len(x) == 1 and next(iter(x)) in ("$in", "$item", "var"):
        return x
    if isinstance(x, int):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_attrs(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_attrs(v, fn) for k, v in x.items()}
    return x


def _attr_ints(x: Any) -> list[int]:
    found: list[int] = []

    def keep(v: int) -> int:
        found.append(v)
        return v

    _map_attrs(x, keep)
    return found


def op_pattern(op: MetaOp, graph: MetaIR, axis_size: int, proxies: bool = True, multiples: bool = False) -> Pattern:
    """The pattern of ``op`` on an axis of ``axis_size`` devices (``proxies=False``: its exact signature)."""
    shapes = _shapes(op, graph)
    dtypes = [graph.vars[v].dtype for v in op.inputs + op.outputs]
    exact = Pattern(f"exact|{op.signature(graph)}|n={axis_size}", axis_size, False)
    if not proxies:
        return exact
    small = exact_below(axis_size)
    basis = size_basis(shapes, multiples, small)
    attrs = {k: v for k, v in (op.attrs or {}).items() if not k.startswith("_")}
    bad = [v for v in _attr_ints(attrs) if v > small and v < SENTINEL and v not in basis]
    if bad:
        return Pattern(
            exact.key,
            axis_size,
            False,
            reason=f"its static argument {bad[0]} is larger than {small} but no size of its tensors",
        )
    sym_attrs = _map_attrs(attrs, lambda v: f"<{_symbol(v, basis, axis_size)}>" if small < v < SENTINEL else v)
    try:
        attr_text = json.dumps(sym_attrs, sort_keys=True, default=str)
    except (TypeError, ValueError) as e:
        return Pattern(exact.key, axis_size, False, reason=f"its attributes are not plain data ({e})")
    canon = canonical_name(op.key, op.attrs, [s for s in shapes[: len(op.inputs)]])
    name = canon or op.key
    if canon is not None:  # the canonical name says all the attributes say: one pattern for every frontend
        attr_text = ""
    dims = ";".join("-" if s is None else ",".join(_symbol(d, basis, axis_size) for d in s) or "()" for s in shapes)
    digest = hashlib.sha1(f"{dims}|{attr_text}".encode()).hexdigest()[:16]
    key = f"{name}|{','.join(dtypes)}|{len(op.inputs)}>{len(op.outputs)}|{digest}|n={axis_size}"
    if multiples:
        key += "|mul"
    return Pattern(key, axis_size, True, multiples, tuple(sorted((s, _symbol(s, basis, axis_size)) for s in basis)))


def proxy_sizes(basis: Mapping[int, tuple], axis_size: int, instance: int = 0) -> dict[int, int]:
    """Small sizes for the large ones of ``basis``: each base keeps its remainder mod ``axis_size``, bases
    stay distinct, products and multiples stay products and multiples.

    Instance 0 gives the bases the smallest such sizes, apart by more than ``SMALL``. Instance 1 gives
    each base another of those same sizes (rotated among the bases of one remainder; a base alone in
    its remainder moves up), so every size changes, the order of the bases changes, and the proxy is no
    larger. Instances 2 and up lie above every size instance 0 uses: sizes discovery never ran.
    """
    if instance == 1:
        first = _assign(basis, axis_size, 0)
        rotated = _rotated(basis, axis_size, first)
        if rotated is not None:
            return rotated
        return _assign(basis, axis_size, 1)
    if instance >= 2:
        first = _assign(basis, axis_size, 0)
        top = max([v for s, v in first.items() if basis[s][0] == "base"] + [0])
        return _assign(basis, axis_size, 0, floor=top + SMALL + 1 + (instance - 2) * axis_size)
    return _assign(basis, axis_size, instance)


def _derived(basis: Mapping[int, tuple], out: dict[int, int], s: int) -> int:
    e = basis[s]
    if e[0] == "mul":
        return e[1] * out[e[2]]
    if e[0] == "add":
        return out[e[1]] + e[2]
    return math.prod(out.get(f, f) for f in e[1:])


def _assign(basis: Mapping[int, tuple], axis_size: int, instance: int, floor: int = 0) -> dict[int, int]:
    n = axis_size
    floor = max(SMALL + 1, n, floor)  # every device of the axis holds a piece
    used: set[int] = set()
    out: dict[int, int] = {}
    for s in sorted(basis):
        if basis[s][0] != "base":
            out[s] = _derived(basis, out, s)
        else:
            r = s % n
            p = n * (-(-floor // n) + instance) + r
            # distinct bases stay apart by more than any "size + k" relation; a size whose split over the
            # axis leaves a device empty stays one that does, and one that does not stays one that does not
            while (
                any(abs(p - u) <= SMALL for u in used)
                or p < floor
                or p <= SMALL
                or splits_nonempty(p, n) != splits_nonempty(s, n)
            ):
                p += n
                if p > max(s, floor) + 16 * n * (SMALL + 1):  # only a few small sizes leave a device empty
                    raise NoProxy(f"no proxy for its size {s} keeps which devices of an axis of {n} get none")
            out[s] = p
        used.add(out[s])
    return out


def _rotated(basis: Mapping[int, tuple], n: int, first: dict[int, int]) -> dict[int, int] | None:
    """Instance 0's base sizes handed round within each remainder class (a lone base moves up by ``n``
    where a size keeps its empty-piece class); None when the result breaks a rule of the proxy (two sizes
    too close, a size repeated)."""
    bases = [s for s in sorted(basis) if basis[s][0] == "base"]
    groups: dict[int, list[int]] = {}
    for s in bases:
        groups.setdefault(first[s] % n, []).append(s)
    out: dict[int, int] = {}
    for members in groups.values():  # classes of several bases: hand their sizes round
        if len(members) > 1:
            vals = [first[s] for s in members]
            for k, s in enumerate(members):
                out[s] = vals[(k + 1) % len(vals)]
    for members in groups.values():  # a lone base: up by n, clear of every size placed or still to move
        if len(members) == 1:
            s0 = members[0]
            v = first[s0] + n
            while any(abs(v - out.get(t, first[t])) <= SMALL for t in bases if t != s0) or splits_nonempty(
                v, n
            ) != splits_nonempty(s0, n):
                v += n
                if v > first[s0] + 16 * n * (SMALL + 1):  # no other size keeps its class: it stays
                    v = first[s0]
                    break
            out[s0] = v
    for s in sorted(basis):
        if basis[s][0] != "base":
            out[s] = _derived(basis, out, s)
    if any(splits_nonempty(out[s], n) != splits_nonempty(s, n) for s in bases):
        return None
    values = [out[s] for s in sorted(basis)]
    if len(set(values)) != len(values):
        return None
    for s in bases:
        if any(t != s and abs(out[s] - out[t]) <= SMALL for t in basis):
            return None
    return out


def proxy_int(v: int, sizes: Mapping[int, int], small: int) -> int:
    """An integer static argument at proxy sizes: a large size (above ``small``) becomes its proxy; a small
    one or a sentinel ("to the end") stays; a large one that is no size of the op cannot be kept (NoProxy)."""
    if small < v < SENTINEL:
        if v not in sizes:
            raise NoProxy(f"its static argument {v} is no size of its tensors")
        return sizes[v]
    return v


def op_numel(op: MetaOp, graph: MetaIR) -> int:
    """Elements of the op's tensors (inputs and outputs) in ``graph``."""
    return sum(graph.vars[v].numel for v in op.inputs + op.outputs if graph.vars[v].is_tensor)


def proxy_op(
    op: MetaOp, graph: MetaIR, axis_size: int, instance: int = 0, multiples: bool = False
) -> tuple[MetaOp, MetaIR]:
    """``op`` alone in a new graph whose large sizes are proxies (size-bearing attributes rewritten)."""
    shapes = _shapes(op, graph)
    small = exact_below(axis_size)
    basis = size_basis(shapes, multiples, small)
    if not basis:
        raise NoProxy("it has no size larger than the proxy threshold")
    sizes = proxy_sizes(basis, axis_size, instance)

    attrs = {
        k: (v if k.startswith("_") else _map_attrs(v, lambda v: proxy_int(v, sizes, small)))
        for k, v in (op.attrs or {}).items()
    }
    g = MetaIR(f"proxy:{op.key}")
    # for frontends whose op runs from a payload the attrs only describe (a jaxpr primitive's params): the
    # same rewrite, by value (sizes above ``small`` not in ``map`` cannot be kept: NoProxy there)
    g.proxy_sizes = {"small": small, "map": {int(k): int(v) for k, v in sizes.items()}}
    names = []
    for v in op.inputs:
        mv = graph.vars[v]
        if v in g.vars:
            names.append(v)
            continue
        shape = None if mv.shape is None else tuple(sizes.get(d, d) for d in mv.shape)
        g.add_input(v, shape, mv.dtype, mv.role)
        names.append(v)
    outs = []
    for v in op.outputs:
        mv = graph.vars[v]
        outs.append((v, None if mv.shape is None else tuple(sizes.get(d, d) for d in mv.shape), mv.dtype))
    new = g.add_op(op.key, names, outs, attrs, id=op.id, payload=op.payload)
    numel = sum(math.prod(s) for v in list(new.inputs) + list(new.outputs) if (s := g.vars[v].shape))
    if numel > PROXY_BUDGET:  # chance relations multiplied the sizes up: too big to be a proxy
        raise NoProxy(f"its proxy holds {numel:,} elements (more than {PROXY_BUDGET:,})")
    return new, g


def pattern_candidates(op: MetaOp, graph: MetaIR, axis_size: int, proxies: bool = True) -> list[Pattern]:
    """The patterns discovery tries for ``op``, most general first: independent sizes, then with
    small multiples kept, then the exact signature (real shapes)."""
    exact = op_pattern(op, graph, axis_size, proxies=False)
    if not proxies:
        return [exact]
    out = [op_pattern(op, graph, axis_size), op_pattern(op, graph, axis_size, multiples=True)]
    out = [p for p in out if p.proxied]
    return list({p.key: p for p in out + [exact]}.values())


def proxy_numel(op: MetaOp, graph: MetaIR, axis_size: int) -> int:
    """Elements of the op's tensors at proxy instance 1 (the larger): what discovery will handle."""
    try:
        p, g = proxy_op(op, graph, axis_size, 1)
    except NoProxy:
        return op_numel(op, graph)
    return op_numel(p, g)


__all__ = [
    "Pattern",
    "NoProxy",
    "op_pattern",
    "proxy_op",
    "proxy_int",
    "op_numel",
    "proxy_sizes",
    "size_basis",
    "exact_below",
    "SMALL",
]
