"""Discovery in forked worker processes: op patterns are independent, so they run side by side.

The parent sets the work aside in a module global and forks; each child
inherits the graph, the frontends and their ``discovering()`` state (one
compute thread each), runs the ``discover`` function it is given on
the patterns it is handed, and sends back the rules (small, picklable) and the
log records it made. The parent re-emits those records once per op (the
serial run's "one warning naming the op"), so a user sees the same messages
either way. A pattern whose op kills its process (a kernel that traps on a
size) runs replicated, with one warning naming the op, and a fresh process
takes the next pattern: the compile goes on where an in-process run would die.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.discovery.patterns import Pattern, op_numel, proxy_numel
from metadist_core.discovery.rules import OpRules, ShardingRule
import ctypes
import faulthandler
import signal
import multiprocessing
from multiprocessing.connection import wait

log = logging.getLogger("metadist.discover")

_WORK: dict[str, Any] = {}  # set by the parent right before forking; read by the children


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def _run(i: int) -> tuple[int, Any, str, list[tuple[str, int, str]]]:
    """In a child: discover pattern ``i``; its rules, RuleBook key and the log records it made."""
    w = _WORK
    op, pat = w["jobs"][i]
    root = logging.getLogger("metadist")
    handler = _Collect()
    root.addHandler(handler)
    propagate, root.propagate = root.propagate, False  # the parent prints them, once
    try:
        entry, used = w["discover"](
            op, w["graph"], w["ops"], pat, set(), draws=w["draws"], max_real=w["max_real"], seed=w["seeds"].get(i)
        )
    finally:
        root.removeHandler(handler)
        root.propagate = propagate
    return i, entry, used, handler.records


def _cost(op: MetaOp, graph: MetaIR, pat: Pattern) -> int:
    """Elements discovery will handle for this pattern: the largest first balances the workers."""
    if pat.proxied:
        return proxy_numel(op, graph, pat.axis_size)
    return op_numel(op, graph)


def _keep_freed_pages() -> None:
    """Make glibc serve large arrays from the heap and keep freed pages, in this (child) process only.

    Discovery makes and drops arrays of a few MB thousands of times (the pieces of one op on 16 devices);
    by default glibc maps each afresh and unmaps it when freed, and every page is then faulted in and
    zeroed again, a large part of the time of making Partial pieces. The child's peak is
    unchanged; it only keeps what it freed until it exits. No-op where glibc is not the C library."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: allocations below 1 GiB come from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: freed heap memory stays mapped
    except (OSError, AttributeError):
        pass


def _serve(conn: Any) -> None:
    """A child's loop: a job index in, its result out, until None."""
    faulthandler.disable()  # a kernel that traps is reported by the parent, naming the op, not as a dump
    _keep_freed_pages()
    while True:
        i = conn.recv()
        if i is None:
            return
        conn.send(_run(i))


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.job: int | None = None

    def give(self, i: int) -> None:
        self.job = i
        self.conn.send(i)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def _crashed(op: MetaOp, pat: Pattern, exitcode: int | None) -> Any:
    """The rules of an op whose discovery killed its process: it runs replicated."""
    how = (
        f"signal {signal.Signals(-exitcode).name}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
    )
    where = "at proxy sizes" if pat.proxied else "at its real shapes"
    reason = f"running it {where} killed the discovery process ({how}) inside the framework"
    return OpRules(
        op.key, [ShardingRule.replicated(len(op.inputs), len(op.outputs))], pat.axis_size, "replicated", reason
    )


def discover_forked(
    jobs: Sequence[tuple[MetaOp, Pattern]],
    graph: MetaIR,
    ops: Any,
    workers: int,
    warned: set[str],
    bar: Any,
    *,
    discover: Callable[..., tuple[Any, str]],
    draws: int,
    max_real: int,
    seeds: dict[int, Any] | None = None,
) -> dict[int, tuple[Any, str]]:
    """``{job index: (OpRules, RuleBook key)}`` for every job, run by ``workers`` forked processes, the
    largest first; ``discover`` finds one pattern's rules in a child. A job that kills its process (a framework kernel that traps) runs replicated, with
    one warning naming the op; a fresh process takes the next job."""
    ctx = multiprocessing.get_context("fork")
    pending = sorted(range(len(jobs)), key=lambda i: -_cost(jobs[i][0], graph, jobs[i][1]))
    _WORK.update(
        discover=discover,
        jobs=list(jobs),
        graph=graph,
        ops=ops,
        draws=draws,
        max_real=max_real,
        seeds=dict(seeds or {}),
    )
    done: dict[int, tuple[Any, str]] = {}

    def finish(i: int, entry: Any, used: str, records: Sequence[tuple[str, int, str]]) -> None:
        done[i] = (entry, used)
        op = jobs[i][0]
        for name, level, msg in records:
            if level >= logging.WARNING:
                if op.key in warned:
                    continue
                warned.add(op.key)
            logging.getLogger(name).log(level, msg)
        bar.update(1, op.key)

    pool: list[_Worker] = []
    try:
        pool = [_Worker(ctx) for _ in range(min(workers, len(pending)))]
        for w in pool:
            w.give(pending.pop(0))
        while any(w.job is not None for w in pool):
            busy = [w for w in pool if w.job is not None]
            wait([w.conn for w in busy] + [w.proc.sentinel for w in busy])
            for k, w in enumerate(pool):
                if w.job is None or not (w.conn.poll() or not w.proc.is_alive()):
                    continue
                try:
                    i, entry, used, records = w.conn.recv()
                except (EOFError, OSError):  # the process died on this job
                    w.proc.join(1)
                    i = w.job
                    op, pat = jobs[i]
                    entry = _crashed(op, pat, w.proc.exitcode)
                    log_rec = [
                        ("metadist.discover", logging.WARNING, f"op {op.key} ({op.id}) runs replicated: {entry.note}")
                    ]
                    finish(i, entry, pat.key, log_rec)
                    w.job = None
                    if pending:
                        pool[k] = w = _Worker(ctx)
                    else:
                        continue
                else:
                    finish(i, entry, used, records)
                    w.job = None
                if pending:
                    w.give(pending.pop(0))
    finally:
        for w in pool:
            w.stop()
        _WORK.clear()
    return done


__all__ = ["discover_forked"]
