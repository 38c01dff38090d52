"""Graph-level discovery: a RuleBook entry for every distinct op signature of a MetaIR.

Signatures already in the RuleBook (loaded from the on-disk cache) are not run
again. An op whose frontend cannot run it in isolation, or for which no rule
verifies, is recorded as running replicated, with one warning naming the op.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from .ir import MetaIR, MetaOp
from .progress import Progress
from .rules import OpRules, RuleBook, ShardingRule
from .shardcombine import DiscoveryStats, Unrunnable, discover_rules

log = logging.getLogger("metadist.discover")


def _n_tensor_io(op: MetaOp, graph: MetaIR) -> tuple[int, int]:
    return len(op.inputs), len(op.outputs)


def discover(graph: MetaIR, ops: Any, rulebook: RuleBook | None = None, *, axis_size: int = 2,
             save: bool = True, progress: bool | None = None, draws: int = 2) -> RuleBook:
    """Fill ``rulebook`` with rules for every distinct op signature in ``graph``.

    ``ops`` answers ``op_spec(op, graph)`` (a ``PluginManager``: the frontend that
    owns the op). Rules found are saved to the rulebook's cache file when
    ``save`` is true and the rulebook has a cache dir.
    """
    book = rulebook if rulebook is not None else RuleBook()
    sigs = graph.unique_signatures()
    todo = {s: op for s, op in sigs.items() if s not in book}
    book.cache_hits += len(sigs) - len(todo)
    if todo:
        log.info("discovering rules for %d of %d op signatures (%d cached)", len(todo), len(sigs), len(sigs) - len(todo))
    warned: set[str] = set()
    show = False if not todo else progress  # None: the bar decides from the terminal and METADIST_PROGRESS
    with Progress(len(todo), "discover", enabled=show) as bar:
        for sig, op in todo.items():
            book.add(sig, discover_op(op, graph, ops, axis_size, warned, draws=draws))
            book.discovered += 1
            bar.update(1, op.key)
    if todo and save:
        book.save()
    return book


def discover_op(op: MetaOp, graph: MetaIR, ops: Any, axis_size: int = 2, warned: set[str] | None = None, *,
                draws: int = 2) -> OpRules:
    """Rules for one op; never raises for a bad op (it runs replicated instead)."""
    warned = warned if warned is not None else set()
    n_in, n_out = _n_tensor_io(op, graph)
    t0 = time.perf_counter()
    try:
        spec = ops.op_spec(op, graph)
        if spec is None:
            raise Unrunnable(f"no loaded frontend runs ops with key {op.key!r}")
        stats = DiscoveryStats()
        rules = discover_rules(spec, axis_size, stats=stats, draws=draws)
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
    return OpRules(op.key, [ShardingRule.replicated(n_in, n_out)], axis_size, "replicated", reason,
                   time.perf_counter() - t0)


def _check_arity(op: MetaOp, rules: list[ShardingRule], n_in: int, n_out: int) -> None:
    for r in rules:
        if len(r.inputs) != n_in or len(r.outputs) != n_out:
            raise ValueError(f"rule {r} for {op.key} has {len(r.inputs)} inputs/{len(r.outputs)} outputs, "
                             f"the op has {n_in}/{n_out}")
