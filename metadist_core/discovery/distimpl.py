"""Distributed implementations: ops split with collectives inside them, registered once and verified on pieces.

Some splits of an op need communication inside the op: causal attention along the sequence (K/V
all-gathered, partial results merged by log-sum-exp), a mixture-of-experts layer's tokens sent to their
experts. A :class:`DistImpl` records one such split on one mesh axis: the op keys and attributes it
applies to, the placement of every tensor input and output, the order the split dim's pieces lie in
(:class:`SeqLayout`), a price (bytes of its collectives and flops per device) and, per frontend, the
callables that simulate it (all ranks in one process) and lower it (one rank). The core stores the
callables; a frontend attaches them by name (:meth:`DistImplRegistry.attach`).

:func:`verify_impl` checks an implementation the way ShardCombine checks a rule: it splits data the
registration did not choose (the draw families of :mod:`metadist_core.discovery.verify`, over several
seeds) into per-rank pieces, runs the implementation on the pieces, joins the per-rank outputs and
compares them with the whole op, forward and, where asked, backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from metadist_core.discovery.combine import is_array, is_float
from metadist_core.discovery.shardcombine import default_sampler
from metadist_core.discovery.verify import families
from metadist_core.ir.placement import Placement, Replicate, Shard

#: float64 verification tolerance, relative to the largest magnitude of the whole op's result. A split that
#: reorders float64 sums (blocks merged by log-sum-exp) errs by a few ulps times the reduction length
#: (~1e-13 at test sizes, ~1e-12 at wide draws); a wrong split (a merge without its log-sum-exp weights, a
#: causal mask shifted by one chunk) errs by O(1) of that magnitude. 1e-9 sits three orders above the first
#: and eight below the second, so a tolerance cannot wave a wrong implementation through. A result that is zero
#: in exact arithmetic is compared on a floor of 1e-3 of the draw's largest result (see :func:`verify_impl`).
RTOL_FLOAT64 = 1e-9


@dataclass(frozen=True)
class SeqLayout:
    """The order the pieces of a split dim lie in: ``head_tail`` cuts the dim into ``2 * n`` chunks and gives
    rank r chunks r and 2n-1-r (the causal work balanced); ``contiguous`` gives rank r chunk r of ``n``."""

    kind: str = "contiguous"

    def __post_init__(self) -> None:
        if self.kind not in ("contiguous", "head_tail"):
            raise ValueError(f"SeqLayout kind is 'contiguous' or 'head_tail', got {self.kind!r}")

    def chunks_per_rank(self) -> int:
        return 2 if self.kind == "head_tail" else 1

    def chunks(self, rank: int, n: int) -> tuple[int, ...]:
        """The chunk indices (in sequence order, chunks of ``size // (n * chunks_per_rank())``) rank holds."""
        if not 0 <= rank < n:
            raise ValueError(f"rank {rank} is not in [0, {n})")
        return (rank, 2 * n - 1 - rank) if self.kind == "head_tail" else (rank,)

    def check(self, size: int, n: int) -> str | None:
        """Why a dim of ``size`` cannot be split ``n`` ways in this layout; None when it can."""
        k = n * self.chunks_per_rank()
        if size % k:
            return f"a {self.kind} split of {n} ways needs the dim divisible by {k}, got {size}; pad it to a multiple"
        return None

    def permutation(self, size: int, n: int) -> list[int]:
        """``perm[j]``: the position in sequence order of the j-th element of the split dim as the ranks hold
        it, ranks in order (what an all-gather of the pieces returns)."""
        reason = self.check(size, n)
        if reason is not None:
            raise ValueError(reason)
        c = size // (n * self.chunks_per_rank())
        return [i * c + t for r in range(n) for i in self.chunks(r, n) for t in range(c)]


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """``inv[perm[j]] == j``: indexing ranks-order data with it gives sequence order."""
    inv = [0] * len(perm)
    for j, p in enumerate(perm):
        inv[p] = j
    return inv


@dataclass(frozen=True)
class ImplPrice:
    """Per device: bytes its collectives move (received), floating-point operations (the busiest rank's), and
    how many collectives it issues (each pays the axis's latency per step)."""

    comm_bytes: float
    flops: float
    calls: int = 1


#: shapes of the op's tensor inputs (global), the element size in bytes, the axis size -> the price
PriceFn = Callable[[Sequence[Sequence[int]], int, int], ImplPrice]
#: shapes of the op's tensor inputs (one device's, before the implementation's own split), the element size, the
#: axis size -> the bytes the implementation holds inside the op beside its inputs and outputs (what it gathers)
WorkspaceFn = Callable[[Sequence[Sequence[int]], int, int], float]
#: attributes of the op (the frontend's call encoding), shapes of its tensor inputs, the axis size -> why the
#: implementation does not apply (a sentence naming what is unsupported), or None when it does
RefusalFn = Callable[[Mapping[str, Any], Sequence[Sequence[int]], int], "str | None"]


@dataclass(frozen=True)
class DistImpl:
    """One distributed implementation of an op on one mesh axis.

    ``inputs``/``outputs``: one Placement per tensor input/output (Shard or Replicate); a Shard's pieces
    lie in ``layout`` order (``shared`` ones in any order). ``grad_outputs``: the outputs whose gradient the backward takes (others, such as
    a log-sum-exp, carry none); ``backward``: the name of the implementation of the op's backward op.
    """

    name: str
    op_keys: tuple[str, ...]
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    price: PriceFn
    refusal: RefusalFn
    layout: SeqLayout = SeqLayout()
    grad_outputs: tuple[int, ...] = ()
    backward: str | None = None
    description: str = ""
    workspace: WorkspaceFn | None = None  # bytes held inside the op (None: none beyond its inputs and outputs)
    #: positions among ``inputs + outputs`` whose split dim other mesh axes may split too (values the
    #: implementation handles element by element, such as a layer's tokens); any other split dim is its alone
    shared: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for p in self.inputs + self.outputs:
            if not isinstance(p, (Shard, Replicate)):
                raise ValueError(f"{self.name}: placements are Shard or Replicate, got {p!r}")

    def applies(self, op_key: str, attrs: Mapping[str, Any], shapes: Sequence[Sequence[int]], n: int) -> str | None:
        """Why this implementation does not serve this op call on an axis of ``n``; None when it does."""
        if op_key not in self.op_keys:
            return f"{self.name} serves {', '.join(self.op_keys)}, not {op_key}"
        return self.refusal(attrs, shapes, n)


@dataclass
class DistImplRegistry:
    """Distributed implementations by name, and each frontend's hooks for them (by hook name)."""

    impls: dict[str, DistImpl] = field(default_factory=dict)
    hooks: dict[tuple[str, str, str], Callable[..., Any]] = field(default_factory=dict)

    def register(self, impl: DistImpl) -> DistImpl:
        """Add ``impl``; a second, different implementation under the same name is an error."""
        have = self.impls.get(impl.name)
        if have is not None and have is not impl:
            raise ValueError(f"a distributed implementation named {impl.name!r} is already registered; rename one")
        self.impls[impl.name] = impl
        return impl

    def get(self, name: str) -> DistImpl:
        if name not in self.impls:
            raise KeyError(f"no distributed implementation {name!r}; registered: {sorted(self.impls) or 'none'}")
        return self.impls[name]

    def attach(self, name: str, frontend: str, hook: str, fn: Callable[..., Any]) -> None:
        """Give implementation ``name`` the frontend's callable ``hook`` (say ``simulate`` or ``lower``)."""
        self.get(name)
        have = self.hooks.get((name, frontend, hook))
        if have is not None and have is not fn:
            raise ValueError(f"{frontend} already attached a {hook!r} hook to {name!r}; attach it once")
        self.hooks[(name, frontend, hook)] = fn

    def hook(self, name: str, frontend: str, hook: str) -> Callable[..., Any]:
        fn = self.hooks.get((name, frontend, hook))
        if fn is None:
            have = sorted(h for (n, f, h) in self.hooks if n == name and f == frontend)
            raise KeyError(f"{frontend} attached no {hook!r} hook to {name!r} (it has: {have or 'none'})")
        return fn

    def matching(
        self, op_key: str, attrs: Mapping[str, Any], shapes: Sequence[Sequence[int]], n: int
    ) -> tuple[list[DistImpl], dict[str, str]]:
        """The implementations serving this call on an axis of ``n``, and why each other one of the op's does not."""
        ok: list[DistImpl] = []
        why: dict[str, str] = {}
        for impl in self.impls.values():
            if op_key not in impl.op_keys:
                continue
            reason = impl.refusal(attrs, shapes, n)
            if reason is None:
                ok.append(impl)
            else:
                why[impl.name] = reason
        return ok, why


# -- verification -------------------------------------------------------------


@dataclass
class ImplVerdict:
    """What :func:`verify_impl` found: the draws run and, per failed comparison, a line saying where."""

    name: str
    draws: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.draws > 0 and not self.failures

    def __str__(self) -> str:
        head = f"{self.name}: {self.draws} draws, {len(self.failures)} failed"
        return head + "".join(f"\n  {f}" for f in self.failures[:10])


#: ``run_whole(inputs, cotangents)``: the whole op on the whole inputs; its outputs, then (with cotangents, one
#: per ``grad_outputs``) the gradient of every input, all numpy
WholeFn = Callable[[list[np.ndarray], "list[np.ndarray] | None"], Sequence[np.ndarray]]
#: ``run_pieces(inputs, cotangents)``: per rank, that rank's pieces in; per rank, its outputs (then gradients)
PiecesFn = Callable[[list[list[np.ndarray]], "list[list[np.ndarray]] | None"], Sequence[Sequence[np.ndarray]]]


def split(x: np.ndarray, p: Placement, n: int, layout: SeqLayout) -> list[np.ndarray]:
    """The ``n`` per-rank pieces of ``x`` under ``p`` (a Shard's chunks in ``layout`` order)."""
    if isinstance(p, Replicate):
        return [x] * n
    assert isinstance(p, Shard)
    d = p.dim % x.ndim
    order = np.asarray(layout.permutation(x.shape[d], n))
    return list(np.split(np.take(x, order, axis=d), n, axis=d))


def join(pieces: Sequence[np.ndarray], p: Placement, layout: SeqLayout) -> list[np.ndarray]:
    """The whole value the per-rank ``pieces`` stand for: a Shard's concatenation put back in sequence order;
    for Replicate, every rank's own value (each must equal the whole)."""
    if isinstance(p, Replicate):
        return list(pieces)
    assert isinstance(p, Shard)
    d = p.dim % pieces[0].ndim
    whole = np.concatenate(list(pieces), axis=d)
    inv = inverse_permutation(layout.permutation(whole.shape[d], len(pieces)))
    return [np.take(whole, np.asarray(inv), axis=d)]


def _mismatch(full: np.ndarray, got: np.ndarray, rtol: float, floor: float) -> str | None:
    """Why ``got`` is not ``full`` within ``rtol`` of the larger of its own largest magnitude and ``floor``."""
    if full.shape != got.shape:
        return f"shape {tuple(got.shape)}, want {tuple(full.shape)}"
    if not (np.isfinite(full).all() and np.isfinite(got).all()):
        return None if np.array_equal(full, got, equal_nan=True) else "non-finite values differ"
    scale = max(float(np.max(np.abs(full))) if full.size else 0.0, floor, 1e-300)
    err = float(np.max(np.abs(full - got))) if full.size else 0.0
    return None if err <= rtol * scale else f"max error {err:.3g} > {rtol:g} x scale {scale:.3g}"


def _magnitude(values: Sequence[np.ndarray]) -> float:
    finite = [np.abs(v[np.isfinite(v)]) for v in map(np.asarray, values) if v.size]
    return max((float(f.max()) for f in finite if f.size), default=0.0)


def verify_impl(
    impl: DistImpl,
    run_whole: WholeFn,
    run_pieces: PiecesFn,
    examples: Sequence[np.ndarray],
    axis_size: int,
    *,
    draws: int = 2,
    seeds: Sequence[int] = (0, 1, 2),
    backward: bool = False,
    rtol: float = RTOL_FLOAT64,
) -> ImplVerdict:
    """Run ``impl`` on pieces (``run_pieces``) against the whole op (``run_whole``) on every draw family of
    :func:`~metadist_core.discovery.verify.families` (random, integer-valued, uniform, wide, sparse, constant)
    for every seed. ``examples`` fix only shapes and dtypes (float64: ``rtol`` is justified at float64, see
    :data:`RTOL_FLOAT64`); their values are never used. With ``backward``, each draw also takes random
    cotangents for the outputs in ``impl.grad_outputs`` (placed as those outputs), and the gradients of every
    input, placed as that input, are compared too."""
    if len(examples) != len(impl.inputs):
        raise ValueError(f"{impl.name} takes {len(impl.inputs)} tensor inputs; {len(examples)} examples given")
    for i, x in enumerate(examples):
        if not is_array(x) or not is_float(x) or x.dtype != np.float64:
            raise ValueError(
                f"verify_impl runs in float64 (its tolerance {rtol:g} is set for it): example input {i} is "
                f"{getattr(x, 'dtype', type(x).__name__)}; pass numpy float64 arrays of the shapes to test"
            )
        for p in impl.inputs[i : i + 1]:
            if isinstance(p, Shard) and (reason := impl.layout.check(x.shape[p.dim % x.ndim], axis_size)):
                raise ValueError(f"{impl.name}: example input {i} of shape {x.shape}: {reason}")
    if backward and not impl.grad_outputs:
        raise ValueError(f"{impl.name} names no grad_outputs: there is no backward to verify")
    verdict = ImplVerdict(impl.name)
    n, lay = axis_size, impl.layout
    for seed in seeds:
        rng = np.random.default_rng(seed)
        for family, inputs, _ in families(examples, default_sampler(examples), rng, (), draws):
            if family == "examples":
                continue  # the registration's own values are not evidence
            where = f"seed {seed}, {family} draw"
            whole = list(run_whole(inputs, None))
            cots = [rng.standard_normal(whole[i].shape) for i in impl.grad_outputs] if backward else None
            if cots is not None:
                whole = list(run_whole(inputs, cots))
            pieces = [split(x, p, n, lay) for x, p in zip(inputs, impl.inputs)]
            per_rank_in = [[pc[r] for pc in pieces] for r in range(n)]
            per_rank_cot = None
            if cots is not None:
                cp = [split(c, impl.outputs[i], n, lay) for c, i in zip(cots, impl.grad_outputs)]
                per_rank_cot = [[c[r] for c in cp] for r in range(n)]
            got = [list(o) for o in run_pieces(per_rank_in, per_rank_cot)]
            verdict.draws += 1
            places = list(impl.outputs) + (list(impl.inputs) if backward else [])
            if len(got) != n or any(len(g) != len(places) for g in got) or len(whole) != len(places):
                verdict.failures.append(f"{where}: {len(places)} results per rank expected on {n} ranks")
                continue
            # a result that is zero in exact arithmetic (the gradients on constant data) holds only rounding
            # noise of the terms that cancelled in it: it is compared on a floor of 1e-3 of the draw's largest result
            floor = 1e-3 * _magnitude(whole)
            for k, p in enumerate(places):
                what = f"output {k}" if k < len(impl.outputs) else f"gradient of input {k - len(impl.outputs)}"
                for r, value in enumerate(join([np.asarray(g[k]) for g in got], p, lay)):
                    bad = _mismatch(np.asarray(whole[k]), value, rtol, floor)
                    if bad is not None:
                        rank = f" on rank {r}" if isinstance(p, Replicate) else ""
                        verdict.failures.append(f"{where}: {what}{rank}: {bad}")
    return verdict


__all__ = [
    "DistImpl",
    "DistImplRegistry",
    "ImplPrice",
    "ImplVerdict",
    "RTOL_FLOAT64",
    "SeqLayout",
    "inverse_permutation",
    "join",
    "split",
    "verify_impl",
]
