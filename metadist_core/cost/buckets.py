"""Which collective of a gradient's reshard runs in a bucket: the one rule every pricer follows.

The lowering (:func:`metadist_torch.lower.coalesce.coalesce_all_reduces`) merges the
all_reduces, and the reduce_scatters, of gradient values (``vars[v]["bucketed"]``,
:func:`metadist_core.cost.compression.gradient_chain`) into buckets, as DDP and FSDP
do. A collective can join a bucket only when its input is the gradient itself:
the first paid collective of the reshard. A later one (the all_reduce on axis 1
of a reduce_scatter on axis 0, all_reduce on axis 1, all_gather on axis 0 that
makes a Partial over a (2, 2) mesh whole) reads the result of the one before,
which the program has only where that gradient's reshard runs, so it never
shares a bucket with another gradient's and runs alone. A reduce_scatter sent
compressed (``comm_dtype``) is not bucketed either.

:func:`bucketed_step` says which collective of an edge that is, or None; the
solver's prices (:meth:`metadist_core.problem.problem.ShardingProblem.price`), the step
replay (:func:`metadist_core.plan.overlap.predict`) and the memory model
(:mod:`metadist_core.plan.memprofile`) all ask it, and a test checks the lowering's
buckets against it on a one- and a two-axis mesh.
"""

from __future__ import annotations

from typing import Any, Sequence


def bucketed_step(problem: Any, var: str, collectives: Sequence[Any]) -> int | None:
    """Index in ``collectives`` (the reshard of ``var``) of the collective the lowering runs in a bucket:
    the first paid one, when it is an all_reduce and ``problem.bucket_bytes`` is set, or a reduce_scatter
    and ``problem.shard_bucket_bytes`` is set and ``var`` travels uncompressed; None when none is."""
    info = problem.vars[var]
    if not info.get("bucketed"):
        return None
    for i, c in enumerate(collectives):
        if c.is_free:
            continue
        if c.kind == "all_reduce" and problem.bucket_bytes:
            return i
        if c.kind == "reduce_scatter" and getattr(problem, "shard_bucket_bytes", None) and "comm_dtype" not in info:
            return i
        return None
    return None


def bucket_key(problem: Any, var: str, collective: Any) -> tuple:
    """The bucket group ``collective`` (the bucketed step of ``var``'s reshard) joins: the lowering buckets
    per kind, mesh axis, reduce op and the dtype the value travels in."""
    info = problem.vars[var]
    return (collective.kind, collective.axis, collective.reduce, info.get("comm_dtype", info["dtype"]))


__all__ = ["bucketed_step", "bucket_key"]
