"""ShardCombine: find how one op may be split on one mesh axis by running it on pieces.

For every combination of candidate input placements (Replicate, Shard(dim) for
each dim, Partial(reduce) for sum/avg/max/min) the op is run once per simulated
device on that device's piece of every input; the per-device outputs are then
tried against every way of combining them (identity, concat along a dim, sum,
avg, max, min; logical or/and for booleans, as max/min). A combination becomes a
:class:`~metadist_core.discovery.rules.ShardingRule` only if the same combine reproduces
the full op's result on every verification draw of every family in
:mod:`metadist_core.discovery.verify` (random, integer-valued and matched exactly, wide,
straddling each scalar argument, sparse, constant, wide integers, an integer
argument on one shard only): data chosen against the ways a rule holds by luck.

The op itself comes from a frontend as an :class:`OpSpec` working on numpy arrays. This module
chooses the input combinations, makes the pieces and runs the op; :mod:`metadist_core.discovery.combine` puts
the outputs together and judges them.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from metadist_core.discovery.combine import is_array, is_float, output_combines, same_result, valid_combines
from metadist_core.ir.placement import REDUCE_OPS, Partial, Placement, Replicate, Shard, chunk_bounds, splits_nonempty
from metadist_core.discovery.reshape import reshape_local_shape
from metadist_core.discovery.rules import ShardingRule
from metadist_core.discovery.verify import families, partial_pieces

log = logging.getLogger("metadist.shardcombine")

#: random draws that verify each candidate rule where the caller names none (the verify_draws setting's default)
DRAWS = 2
#: [low, high) of the integer-valued floats drawn where a draw must hold whole numbers
INTEGER_RANGE = (-4, 5)
#: a float input of fewer elements than this (a scalar loss gradient, a total weight) carries little evidence
#: per draw: a rule that depends on its sign could pass a few draws by luck ...
TINY_INPUT = 16
#: ... so an op with one is verified on at least this many draws
TINY_INPUT_DRAWS = 12


class Unrunnable(Exception):
    """An op that cannot be run in isolation for discovery (random, data-dependent, custom)."""


class RandomOp(Unrunnable):
    """An op that gives different results on the same inputs (random or stateful)."""


@dataclass
class OpSpec:
    """One op made runnable on numpy arrays.

    ``fn(*tensors)`` returns one value or a tuple/list of values (numpy arrays
    or Python scalars). ``example_inputs`` fixes the shapes and dtypes and is
    the first verification draw. For a reshape/view op set ``reshape_fn(x,
    target_shape)`` and ``out_shape``: a sharded input is then run at the local
    target shape found by shape analysis. ``sampler(rng, integer_valued)`` may
    replace the default random draws (say, to keep indices in range).
    """

    fn: Callable[..., Any]
    example_inputs: Sequence[np.ndarray]
    name: str = "op"
    reshape_fn: Callable[[np.ndarray, tuple[int, ...]], Any] | None = None
    out_shape: tuple[int, ...] | None = None
    sampler: Callable[[np.random.Generator, bool], list[np.ndarray]] | None = None
    partial_inputs: bool = True  # False prunes all Partial input candidates (say, for index inputs)
    static_args: Any = None  # the op's non-tensor arguments, where a caller wants them at hand


@dataclass
class DiscoveryStats:
    candidates: int = 0
    screened_out: int = 0
    raised: int = 0
    runs: int = 0
    seconds: float = 0.0


def _as_list(out: Any) -> list[Any]:
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    return [np.asarray(x) if isinstance(x, np.generic) else x for x in items]


# -- candidate input placements and the pieces they give ------------------------


def input_candidates(x: np.ndarray, n: int, allow_partial: bool) -> list[Placement]:
    cands: list[Placement] = [Replicate()]
    if is_array(x):
        cands += [Shard(d) for d in range(x.ndim) if splits_nonempty(x.shape[d], n)]
        if allow_partial and is_float(x) and x.size > 0:
            cands += [Partial(r) for r in REDUCE_OPS]
    return cands


def split_input(x: np.ndarray, p: Placement, n: int, rng: np.random.Generator, integer: bool) -> list[np.ndarray]:
    """The ``n`` per-device pieces of a full input ``x`` under placement ``p``."""
    if isinstance(p, Replicate) or not is_array(x):
        return [x] * n
    if isinstance(p, Shard):
        return [x[(slice(None),) * p.dim + (slice(*chunk_bounds(x.shape[p.dim], n, r)),)] for r in range(n)]
    assert isinstance(p, Partial)
    return partial_pieces(x, p.reduce, n, rng, integer)


# -- draws ------------------------------------------------------------------


def _integral(x: Any) -> bool:
    if is_array(x):
        if not is_float(x):
            return True
        fin = x[np.isfinite(x)]
        return bool(np.all(fin == np.round(fin)))
    return isinstance(x, (int, bool, np.integer))


def default_sampler(examples: Sequence[np.ndarray]) -> Callable[[np.random.Generator, bool], list[np.ndarray]]:
    """Random inputs like the examples: normal (or small integer-valued) floats; integers
    drawn from the example's own range, so indices stay valid; random bools."""

    def sample(rng: np.random.Generator, integer: bool) -> list[np.ndarray]:
        out = []
        for x in examples:
            if not is_array(x):
                out.append(x)
            elif is_float(x):
                if integer:
                    out.append(rng.integers(*INTEGER_RANGE, size=x.shape).astype(x.dtype))
                else:
                    out.append(rng.standard_normal(x.shape).astype(x.dtype))
            elif x.dtype == np.bool_:
                out.append(rng.random(x.shape) < 0.5)
            elif x.size == 0:
                out.append(x.copy())
            else:
                lo, hi = int(x.min()), int(x.max())
                out.append(rng.integers(lo, hi + 1, size=x.shape).astype(x.dtype))
        return out

    return sample


# -- the search -------------------------------------------------------------


def _combos(cands: list[list[Placement]], examples: Sequence[Any] = ()) -> list[tuple[Placement, ...]]:
    """The input combinations worth trying: all replicated; Replicate or one same Partial on every
    input; Replicate or a Shard on every input, the dims split together all of one size (one logical
    dim: at proxy sizes distinct dims have distinct sizes); for ops of three inputs, each of those
    splitting two inputs again with the third Partial(sum) when it has fewer dims (addmm's bias)."""
    rep = Replicate()
    out: list[tuple[Placement, ...]] = [tuple(rep for _ in cands)]
    reduces = sorted({p.reduce for c in cands for p in c if isinstance(p, Partial)})
    for r in reduces:
        # one, two or every input Partial (the others Replicate): a linear op of many inputs takes all of
        # them partial, a product one of them; the many mixed combinations in between are not tried
        slots = [i for i, c in enumerate(cands) if any(isinstance(p, Partial) and p.reduce == r for p in c)]
        picks = [(i,) for i in slots] + list(itertools.combinations(slots, 2)) + [tuple(slots)]
        for pick in dict.fromkeys(picks):
            out.append(tuple(Partial(r) if i in pick else rep for i in range(len(cands))))
    shard_sizes: dict[Any, list[list[Placement]]] = {}
    for i, c in enumerate(cands):
        for p in c:
            if isinstance(p, Shard):
                size = examples[i].shape[p.dim] if examples else None
                shard_sizes.setdefault(size, [[] for _ in cands])[i].append(p)
    psum = Partial("sum")
    for shards in shard_sizes.values():
        per = [[rep] + sh for sh in shards]
        split = [c for c in itertools.product(*per) if any(isinstance(p, Shard) for p in c)]
        out += split
        if len(cands) == 3 and examples:
            # a fused op with an added, broadcast operand (addmm's bias) split on its contraction dim needs
            # that operand as a partial sum: where two inputs are split together, the third Partial(sum)
            # when it has fewer dims than they have
            nd = [np.ndim(x) for x in examples]
            can = [psum in c and nd[i] < max(nd) for i, c in enumerate(cands)]
            for cmb in split:
                if sum(isinstance(p, Shard) for p in cmb) >= 2 and any(p == rep and can[i] for i, p in enumerate(cmb)):
                    out.append(tuple(psum if p == rep and can[i] else p for i, p in enumerate(cmb)))
    out += _grouped_combos(cands, examples)
    return list(dict.fromkeys(out))


def _grouped_combos(cands: list[list[Placement]], examples: Sequence[Any]) -> list[tuple[Placement, ...]]:
    """Inputs split on the same dim where their sizes differ by whole factors: grouped-query attention's
    query heads (32) over its key/value heads (8), every device holding a query group with its key/value
    head. Only dims whose sizes are not all equal (those are tried above), at least two inputs split."""
    if not examples or len(cands) < 2:
        return []
    out: list[tuple[Placement, ...]] = []
    rep = Replicate()
    for d in sorted({p.dim for c in cands for p in c if isinstance(p, Shard)}):
        sizes = [examples[i].shape[d] if Shard(d) in c else None for i, c in enumerate(cands)]
        have = [s for s in sizes if s is not None]
        if len(set(have)) < 2 or any(s % min(have) for s in have):
            continue
        per = [[rep, Shard(d)] if s is not None else [rep] for s in sizes]
        for c in itertools.product(*per):
            split = {sizes[i] for i, p in enumerate(c) if isinstance(p, Shard)}
            if len(split) >= 2:
                out.append(c)
    return out


class _Runner:
    def __init__(self, spec: OpSpec, n: int, stats: DiscoveryStats) -> None:
        self.spec, self.n, self.stats = spec, n, stats
        self._pieces: dict[tuple, tuple[Any, list]] = {}  # (id of input, placement, integer) -> (input, its pieces)

    def _split(self, x: Any, p: Placement, rng: np.random.Generator, integer: bool, first: bool) -> list:
        """The pieces of ``x`` under ``p``; on the first draw (which every candidate runs) made once and shared
        by every candidate using them, on later draws (survivors only) made afresh, so memory stays bounded."""
        if not first:
            return split_input(x, p, self.n, rng, integer)
        key = (id(x), p, integer)
        hit = self._pieces.get(key)
        if hit is None or hit[0] is not x:
            hit = self._pieces[key] = (x, split_input(x, p, self.n, rng, integer))
        return hit[1]

    def full(self, inputs: Sequence[np.ndarray]) -> list[Any]:
        self.stats.runs += 1
        with np.errstate(all="ignore"):  # wide draws overflow exp and friends on purpose
            return _as_list(self.spec.fn(*inputs))

    def pieces(
        self,
        combo: tuple[Placement, ...],
        inputs: Sequence[np.ndarray],
        rng: np.random.Generator,
        integer: bool,
        first: bool = False,
    ) -> list[list[Any]] | None:
        """Run the op on each device's pieces; per output, the list of per-device values. None if it raised."""
        split = [self._split(x, p, rng, integer, first) for x, p in zip(inputs, combo)]
        # every input whole on every device: each device computes what the first does (the op gave the
        # same result twice on the same inputs, checked on every draw before any candidate runs)
        same = all(isinstance(p, Replicate) for p in combo) and self.spec.reshape_fn is None
        per_rank = []
        for r in range(1 if same else self.n):
            local = [s[r] for s in split]
            try:
                self.stats.runs += 1
                if self.spec.reshape_fn is not None:
                    target = reshape_local_shape(inputs[0].shape, self.spec.out_shape, combo[0], self.n, r)
                    if target is None:
                        return None
                    out = _as_list(self.spec.reshape_fn(local[0], target))
                else:
                    with np.errstate(all="ignore"):
                        out = _as_list(self.spec.fn(*local))
            except Exception:  # a candidate the op refuses is a rejected candidate, never a crash
                self.stats.raised += 1
                return None
            per_rank.append(out)
        if same:
            per_rank *= self.n
        if len({len(o) for o in per_rank}) != 1:
            return None
        return [[o[i] for o in per_rank] for i in range(len(per_rank[0]))]


def discover_rules(
    spec: OpSpec,
    axis_size: int = 2,
    *,
    draws: int = DRAWS,
    seed: int = 0,
    stats: DiscoveryStats | None = None,
    scalars: Sequence[float] = (),
    only: Sequence[tuple[Placement, ...]] | None = None,
    sharded: bool | None = None,
) -> list[ShardingRule]:
    """Every verified one-axis ShardingRule of the op in ``spec`` on an axis of ``axis_size`` devices.

    ``scalars`` are the op's scalar static arguments (bounds, thresholds, ignore
    indices): verification draws straddle and exceed them. ``sharded``: True
    tries only the input combinations that shard some input, False only the
    others (Replicate and Partial inputs), None all. Raises
    :class:`Unrunnable` when the op cannot be run on its examples, and
    :class:`RandomOp` when it does not give the same result twice.
    """
    t0 = time.perf_counter()
    stats = stats if stats is not None else DiscoveryStats()
    n = axis_size
    if n < 2:
        raise ValueError(f"discovery needs an axis of at least 2 devices, got {axis_size}")
    examples = list(spec.example_inputs)
    runner = _Runner(spec, n, stats)
    rng = np.random.default_rng(seed)
    sampler = spec.sampler or default_sampler(examples)

    # a tiny float input carries little evidence per draw: take more (TINY_INPUT)
    if any(is_array(x) and is_float(x) and 0 < x.size < TINY_INPUT for x in examples):
        draws = max(draws, TINY_INPUT_DRAWS)
    draw_inputs: list[tuple[list[np.ndarray], bool]] = []
    fulls = []
    try:  # a predicate on floats (isnan, isfinite...) is also verified on inf and NaN (verify.py)
        predicate = any(is_array(o) and o.dtype == np.bool_ for o in runner.full(examples))
    except Exception:  # raised again, with the reason, on the examples below
        predicate = False
    for family, inputs, integer in families(examples, sampler, rng, scalars, draws, predicate):
        try:
            out = runner.full(inputs)
            again = runner.full(inputs)
        except Exception as e:
            if family == "examples":
                raise Unrunnable(f"{spec.name} raised on its example inputs: {type(e).__name__}: {e}") from e
            continue  # a family this op does not accept (say, an index out of range): not evidence
        if len(out) != len(again) or not all(same_result(a, b, True) for a, b in zip(out, again)):
            raise RandomOp(f"{spec.name} gives different results on the same inputs (random or stateful)")
        # an integer-valued draw is checked exactly only where the full result stays integral
        draw_inputs.append((inputs, integer))
        fulls.append((out, integer and all(_integral(o) for o in out)))

    cands = [input_candidates(x, n, spec.partial_inputs) for x in examples]
    if spec.reshape_fn is not None:
        cands[0] = [
            p
            for p in cands[0]
            if not isinstance(p, Shard) or reshape_local_shape(examples[0].shape, spec.out_shape, p, n, 0) is not None
        ]
    combos = _combos(cands, examples)
    if only is not None:  # re-verify these input combinations only (found at another proxy size)
        keep = set(only)
        combos = [c for c in combos if c in keep]
    if sharded is not None:
        combos = [c for c in combos if any(isinstance(p, Shard) for p in c) == sharded]
    stats.candidates += len(combos)

    rules: list[ShardingRule] = []
    for combo in combos:
        allowed: list[set[Placement]] | None = None
        for k_draw, ((inputs, integer), (full, exact)) in enumerate(zip(draw_inputs, fulls)):
            outs = runner.pieces(combo, inputs, rng, integer, first=k_draw == 0)
            if outs is None or len(outs) != len(full):
                allowed = None
                break
            ok = [
                valid_combines(p, f, exact, None if allowed is None else allowed[k])
                for k, (p, f) in enumerate(zip(outs, full))
            ]
            allowed = ok if allowed is None else [a & b for a, b in zip(allowed, ok)]
            if any(not a for a in allowed):
                allowed = None
                break
        if allowed is None:
            stats.screened_out += 1
            continue
        outputs = []
        for a, f in zip(allowed, fulls[0][0]):
            order = output_combines(f.ndim if is_array(f) else None)
            outputs.append(next(p for p in order if p in a))
        rules.append(ShardingRule(combo, tuple(outputs)))
    stats.seconds += time.perf_counter() - t0
    return rules
