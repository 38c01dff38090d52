"""Graph-level discovery: a RuleBook entry for every op **pattern** of a MetaIR, per mesh axis size.

Ops of one pattern (see :mod:`metadist_core.discovery.patterns`) share their rules, so a
12-layer model costs no more discovery than a 2-layer one, and a wide model no
more than a narrow one: each pattern runs once, at small proxy sizes, twice
(two proxy instances; a rule must hold at both), on every axis size of the
mesh, the smallest axis first: on a larger axis the first proxy instance tries
the input placements of the rules the smaller one verified (:func:`seed_combos`).
Views, reshapes, copies, transposes and expands take their rules from their dim
algebra at their own sizes, without a run (:mod:`metadist_core.discovery.algebra`). An
op the frontend cannot run at proxy sizes (or whose pattern a proxy cannot keep)
is discovered at its real shapes; a slice, split or concatenation takes its
rules from its dim algebra there. Patterns already in the RuleBook
(the on-disk cache) are not run again. An op whose frontend cannot run it in
isolation, or for which no rule verifies, is recorded as running replicated,
with one warning naming the op.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Sequence

import numpy as np

from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.discovery.patterns import NoProxy, Pattern, op_numel, op_pattern, proxy_op
from metadist_core.progress import Progress
from metadist_core.discovery.rules import OpRules, RuleBook, ShardingRule
from metadist_core.discovery.shardcombine import DRAWS, DiscoveryStats, OpSpec, RandomOp, Unrunnable, discover_rules
from metadist_core.discovery.verify import scalars_of
from metadist_core.discovery.forkpool import discover_forked
from metadist_core.discovery.algebra import FIRST as ALGEBRA_FIRST, algebra_rules
from metadist_core.discovery.moe_dispatch import declared_rules
import multiprocessing
import os

log = logging.getLogger("metadist.discover")

MIN_PARALLEL = 12  # fewer patterns than this are discovered in this process: a fork costs more than it saves
#: the most processes discovery forks when asked for one per CPU core
MAX_WORKERS = 8
#: an op whose inputs and outputs hold more elements than this is not discovered at its real shapes (it runs
#: replicated) where the caller names no limit (the max_real_discovery setting's default)
MAX_REAL = 2**24


def _proxies_ok(ops: Any, op: MetaOp) -> bool:
    """Does the frontend of ``op`` build its OpSpec from the graph's shapes and ``op.attrs`` alone?"""
    owner = getattr(ops, "owner", None)
    fe = owner(op) if owner is not None else None
    return bool(getattr(getattr(fe, "traits", None), "proxy_shapes", False))


def discover(
    graph: MetaIR,
    ops: Any,
    rulebook: RuleBook | None = None,
    *,
    axis_sizes: Sequence[int] = (2,),
    save: bool = True,
    progress: bool | None = None,
    draws: int = DRAWS,
    axis_size: int | None = None,
    max_real: int = MAX_REAL,
    workers: int = 0,
) -> RuleBook:
    """Fill ``rulebook`` with the rules of every op pattern of ``graph`` on axes of ``axis_sizes`` devices.

    ``ops`` answers ``op_spec(op, graph)`` (a ``PluginManager``: the frontend that
    owns the op). Rules found are saved to the rulebook's cache file when
    ``save`` is true and the rulebook has a cache dir. ``workers``: processes
    that discover patterns side by side (0: one per CPU core when there are
    enough patterns and every frontend involved can fork; 1: this process only).
    """
    book = rulebook if rulebook is not None else RuleBook()
    sizes = sorted({int(n) for n in ([axis_size] if axis_size else axis_sizes) if int(n) > 1})
    todo: dict[str, tuple[MetaOp, Pattern]] = {}
    seen: set[str] = set()
    memo: dict[tuple[str, int, bool], Pattern] = {}
    for n in sizes:
        for op in graph.ops:
            proxies = _proxies_ok(ops, op)
            mk = (op.signature(graph), n, proxies)
            pat = memo.get(mk)
            if pat is None:  # a view or a copy: its rules from its dims at its own sizes, no proxy run
                exact = op.key in ALGEBRA_FIRST and algebra_rules(op, graph, n) is not None
                pat = memo[mk] = op_pattern(op, graph, n, proxies and not exact)
            if pat.key in seen:
                continue
            seen.add(pat.key)
            if book.lookup(op, graph, n) is None:
                todo[pat.key] = (op, pat)
    book.cache_hits += len(seen) - len(todo)
    if todo:
        log.info(
            "discovering rules for %d of %d op patterns (%d cached) on axes of %s devices",
            len(todo),
            len(seen),
            len(seen) - len(todo),
            "/".join(map(str, sizes)),
        )
    warned: set[str] = set()
    show = False if not todo else progress  # None: the bar decides from the terminal and the progress setting
    owner = getattr(ops, "owner", None)
    fronts = {id(fe): fe for op, _ in todo.values() if owner is not None and (fe := owner(op)) is not None}
    n_workers = worker_count(
        workers,
        len(todo),
        list(fronts.values()),
        all_owned=owner is not None and all(owner(op) is not None for op, _ in todo.values()),
    )
    desc = f"discover ({len(todo)} op patterns" + (f", {n_workers} processes)" if n_workers > 1 else ")")
    with contextlib.ExitStack() as stack, Progress(len(todo), desc, enabled=show) as bar:
        for fe in fronts.values():
            stack.enter_context(fe.traits.discovering())
        for n in sizes:  # the smallest axis first: its rules seed the search on the larger ones
            jobs = [(op, pat) for op, pat in todo.values() if pat.axis_size == n]
            seeds = {
                i: s
                for i, (op, _) in enumerate(jobs)
                if (s := seed_combos(book, op, graph, [m for m in sizes if m < n])) is not None
            }
            k = min(n_workers, worker_count(workers, len(jobs), list(fronts.values()))) if n_workers > 1 else 1
            if k > 1:
                done = discover_forked(
                    jobs,
                    graph,
                    ops,
                    k,
                    warned,
                    bar,
                    discover=discover_pattern,
                    draws=draws,
                    max_real=max_real,
                    seeds=seeds,
                )
            else:
                done = {}
            for i, (op, pat) in enumerate(jobs):
                if i in done:
                    entry, used = done[i]
                else:  # in this process
                    entry, used = discover_pattern(
                        op, graph, ops, pat, warned, draws=draws, max_real=max_real, seed=seeds.get(i)
                    )
                    bar.update(1, op.key)
                book.add(used, entry)
                book.discovered += 1
    if todo and save:
        book.save()
    return book


def seed_combos(book: RuleBook, op: MetaOp, graph: MetaIR, smaller: Sequence[int]) -> list[tuple] | None:
    """The input placements of ``op``'s verified rules on the largest of the ``smaller`` axis sizes that
    has them (None: none has). Discovery on a larger axis tries these combinations first: every rule is
    still verified there, on two proxy instances, so a seed never admits a rule; it may miss one that holds
    on the larger axis only (when the seeded search finds nothing, the whole search runs)."""
    for m in sorted(smaller, reverse=True):
        e = book.lookup(op, graph, m)
        if e is not None and e.status == "ok" and e.rules:
            return [r.inputs for r in e.rules]
    return None


def worker_count(requested: int, n_patterns: int, frontends: Sequence[Any], all_owned: bool = True) -> int:
    """How many processes discover ``n_patterns`` patterns: ``requested`` (0: one per usable CPU core, at
    most :data:`MAX_WORKERS`), but 1 when there are few patterns, the platform cannot fork, or a frontend
    involved cannot run its ops in a forked child (``FrontendTraits.can_fork_discovery``)."""
    if requested == 1 or n_patterns < 2:
        return 1
    if "fork" not in multiprocessing.get_all_start_methods() or not frontends or not all_owned:
        return 1
    if not all(fe.traits.can_fork_discovery() for fe in frontends):
        return 1
    if requested <= 0:
        if n_patterns < MIN_PARALLEL:
            return 1
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        requested = min(cores, MAX_WORKERS)
    return max(1, min(requested, n_patterns))


def _check_proxy_shapes(spec: OpSpec, graph: MetaIR, op: MetaOp) -> None:
    """The proxy must be the same op: its outputs have the proxy graph's shapes (raises NoProxy)."""
    outs = spec.fn(*spec.example_inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for v, o in zip(op.outputs, outs):
        want = graph.vars[v].shape
        if want is not None and hasattr(o, "shape") and tuple(np.shape(o)) != tuple(want):
            raise NoProxy(f"at proxy sizes it makes {v} of shape {tuple(np.shape(o))}, not {tuple(want)}")


def _rules_at(
    spec: OpSpec,
    graph: MetaIR,
    op: MetaOp,
    n: int,
    draws: int,
    check_shapes: bool,
    only: Sequence[tuple] | None = None,
    sharded: bool | None = None,
) -> list[ShardingRule]:
    if check_shapes:
        _check_proxy_shapes(spec, graph, op)
    return discover_rules(spec, n, draws=draws, scalars=scalars_of(op.attrs), only=only, sharded=sharded)


def discover_pattern(
    op: MetaOp,
    graph: MetaIR,
    ops: Any,
    pattern: Pattern,
    warned: set[str] | None = None,
    *,
    draws: int = DRAWS,
    max_real: int = MAX_REAL,
    seed: Sequence[tuple] | None = None,
) -> tuple[OpRules, str]:
    """The rules of ``op``'s pattern and the RuleBook key they belong under (the exact signature's key
    when the op had to be discovered at its real shapes). ``seed``: input placements to try first
    (:func:`seed_combos`)."""
    n = pattern.axis_size
    declared = declared_rules(op, graph, n)  # an op that declares its rules (a dropless experts layer)
    if declared is not None:
        return OpRules(op.key, declared, n, "ok", "", 0.0), op_pattern(op, graph, n, proxies=False).key
    why = pattern.reason  # why its pattern keeps no proxy (empty: the frontend takes none, or one was tried)
    if pattern.proxied:
        variants = [pattern] if pattern.multiples else [pattern, op_pattern(op, graph, n, multiples=True)]
        for pat in variants:  # independent sizes first; then sizes that are small multiples of others kept
            if not pat.proxied:
                continue
            try:
                return _discover_proxied(op, graph, ops, pat, n, draws, seed)
            except RandomOp as e:  # random at any size: it runs replicated, no need to try it at full size
                if warned is not None and op.key not in warned:
                    warned.add(op.key)
                    log.warning("op %s (%s) runs replicated: %s", op.key, op.id, e)
                return (
                    OpRules(
                        op.key, [ShardingRule.replicated(len(op.inputs), len(op.outputs))], n, "replicated", str(e)
                    ),
                    pat.key,
                )
            except Exception as e:  # noqa: BLE001 - a proxy that cannot stand for the op: try the next
                log.debug("op %s (%s) at proxy sizes (%s): %s: %s", op.key, op.id, pat.key, type(e).__name__, e)
                why = f"{type(e).__name__}: {e}"
        pattern = op_pattern(op, graph, n, proxies=False)
    exact = algebra_rules(op, graph, n)  # a reshape or a copy: its rules from its dims, at its own sizes
    if exact is not None:
        log.debug("op %s (%s): rules from its dim algebra at its own sizes (%s)", op.key, op.id, why[:200])
        return OpRules(op.key, exact, n, "ok", "", 0.0), pattern.key
    numel = op_numel(op, graph)
    if why:  # the op, and why no proxy stands for it: a user can tell a size-bearing argument from a kernel
        log.info("op %s (%s) is discovered at its real shapes: %s", op.key, op.id, why[:200])
    if numel > max_real:  # discovery's memory must not grow with the model: such an op runs replicated
        reason = (
            f"its pattern could not be kept at proxy sizes and its tensors hold {numel:,} elements, more "
            f"than the {max_real:,} discovery runs at real size (the max_real_discovery setting)"
        )
        if warned is not None and op.key not in warned:
            warned.add(op.key)
            log.warning("op %s (%s) runs replicated: %s", op.key, op.id, reason)
        return (
            OpRules(op.key, [ShardingRule.replicated(len(op.inputs), len(op.outputs))], n, "replicated", reason),
            pattern.key,
        )
    return discover_op(op, graph, ops, n, warned, draws=draws), pattern.key


def _discover_proxied(
    op: MetaOp, graph: MetaIR, ops: Any, pattern: Pattern, n: int, draws: int, seed: Sequence[tuple] | None = None
) -> tuple[OpRules, str]:
    """Rules that hold at two proxy instances of ``pattern``; raises when the proxy cannot stand for the op.
    ``seed``: the first instance tries only these input placements, unless none of them holds."""
    t0 = time.perf_counter()
    found: list[list[ShardingRule]] = []
    proxies = [proxy_op(op, graph, n, instance, pattern.multiples) for instance in (0, 1)]  # NoProxy before a run
    for instance in (0, 1):
        p_op, p_graph = proxies[instance]
        spec = ops.op_spec(p_op, p_graph)
        if spec is None:
            raise NoProxy(f"no loaded frontend runs ops with key {op.key!r}")
        small = _unsharded_proxy(op, graph, ops, n, instance, pattern.multiples, op_numel(p_op, p_graph))
        # the second proxy re-verifies only what held at the first (a search there would find nothing more)
        only = (list(seed) if seed else None) if not found else [r.inputs for r in found[0]]

        def search(only: Sequence[tuple] | None) -> list[ShardingRule]:
            if small is None:
                return _rules_at(spec, p_graph, p_op, n, draws, True, only)
            return _rules_at(small[0], small[2], small[1], n, draws, False, only, sharded=False) + _rules_at(
                spec, p_graph, p_op, n, draws, True, only, sharded=True
            )

        got = search(only)
        if not found and seed and not got:  # nothing of the seed holds here: the whole search
            got = search(None)
        found.append(got)
    both = [r for r in found[0] if r in set(found[1])]  # a rule must hold at two proxy sizes
    if not both:
        raise NoProxy("no rule held at both proxy sizes")
    return OpRules(op.key, both, n, "ok", "", time.perf_counter() - t0), pattern.key


# on larger axes, combinations that shard no input are verified on the proxy of an axis of 2. From 4 on: the
# proxies of a larger axis are larger (every base at least the axis size), and the whole-size pieces of their
# Partial inputs grow with them
UNSHARDED_AT = 3


def _unsharded_proxy(
    op: MetaOp, graph: MetaIR, ops: Any, n: int, instance: int, multiples: bool, than: int
) -> tuple[OpSpec, MetaOp, MetaIR] | None:
    """The op at the (smaller) proxy sizes of an axis of 2, for the input combinations that shard nothing.

    Inputs whole or Partial give every device the whole shapes, so no size needs to split over ``n``
    devices: the sizes that keep an axis of ``n`` apart (each at least ``n``, remainders mod ``n``) only
    make the ``n`` whole-size pieces of every Partial input dearer. The pieces are still ``n``, the
    reductions over ``n`` devices. None on
    axes of ``UNSHARDED_AT`` devices or fewer, when that proxy cannot stand for the op or holds more than
    half of ``than`` elements (the caller verifies everything on the proxy of ``n``)."""
    if n <= UNSHARDED_AT:
        return None
    try:
        p_op, p_graph = proxy_op(op, graph, 2, instance, multiples)
        if 2 * op_numel(p_op, p_graph) > than:  # not worth running the op's draws twice
            return None
        spec = ops.op_spec(p_op, p_graph)
        if spec is None:
            return None
        _check_proxy_shapes(spec, p_graph, p_op)
    except Exception as e:  # noqa: BLE001 - the proxy of n stands for it instead
        log.debug("op %s (%s): no axis-2 proxy for its unsharded combinations: %s", op.key, op.id, e)
        return None
    return spec, p_op, p_graph


def discover_op(
    op: MetaOp, graph: MetaIR, ops: Any, axis_size: int = 2, warned: set[str] | None = None, *, draws: int = DRAWS
) -> OpRules:
    """Rules for one op at its own shapes; never raises for a bad op (it runs replicated instead)."""
    warned = warned if warned is not None else set()
    n_in, n_out = len(op.inputs), len(op.outputs)
    t0 = time.perf_counter()
    try:
        spec = ops.op_spec(op, graph)
        if spec is None:
            raise Unrunnable(f"no loaded frontend runs ops with key {op.key!r}")
        stats = DiscoveryStats()
        scalars = scalars_of(op.attrs)
        small = _real_size_unsharded(op, graph, ops, axis_size)
        if small:  # the combinations that shard nothing on the two axis-2 proxies (both must hold), the rest here
            held = [
                discover_rules(sp, axis_size, stats=stats, draws=draws, scalars=scalars, sharded=False) for sp in small
            ]
            rules = [r for r in held[0] if r in set(held[1])] + discover_rules(
                spec, axis_size, stats=stats, draws=draws, scalars=scalars, sharded=True
            )
        else:
            rules = discover_rules(spec, axis_size, stats=stats, draws=draws, scalars=scalars)
        if not rules:
            raise Unrunnable("no candidate placement reproduced the full result, not even replication")
        _check_arity(op, rules, n_in, n_out)
        return OpRules(op.key, rules, axis_size, "ok", "", time.perf_counter() - t0)
    except Unrunnable as e:
        reason = str(e)
    except Exception as e:  # a frontend bug on one op must not crash the compile
        reason = f"discovery failed: {type(e).__name__}: {e}"
    if op.key not in warned:
        warned.add(op.key)
        log.warning("op %s (%s) runs replicated: %s", op.key, op.id, reason)
    return OpRules(
        op.key, [ShardingRule.replicated(n_in, n_out)], axis_size, "replicated", reason, time.perf_counter() - t0
    )


def _real_size_unsharded(op: MetaOp, graph: MetaIR, ops: Any, n: int) -> list[OpSpec] | None:
    """For an op discovered at its real shapes on an axis of ``n`` (no proxy of ``n`` keeps its pattern), the
    op at the two proxy instances of an axis of 2, where its combinations that shard no input are verified
    (:func:`_unsharded_proxy`: their pieces are whole-size, so no size needs to split over ``n``). GPT-2's
    eager attention on an axis of 8: the scores' view (8,16,128,128) -> (128,128,128) keeps batch x heads =
    sequence only at its real sizes, where its Partial inputs' 8 whole-size pieces are dear. None
    when the frontend builds no proxies or either proxy cannot stand for the op."""
    if n <= UNSHARDED_AT or not _proxies_ok(ops, op):
        return None
    than = op_numel(op, graph)
    for multiples in (False, True):
        got = [_unsharded_proxy(op, graph, ops, n, instance, multiples, than) for instance in (0, 1)]
        specs = [g[0] for g in got if g is not None]
        if len(specs) == len(got):  # both proxies stand for the op
            return specs
    return None


def _check_arity(op: MetaOp, rules: list[ShardingRule], n_in: int, n_out: int) -> None:
    for r in rules:
        if len(r.inputs) != n_in or len(r.outputs) != n_out:
            raise ValueError(
                f"rule {r} for {op.key} has {len(r.inputs)} inputs/{len(r.outputs)} outputs, the op has {n_in}/{n_out}"
            )
