"""Parameter all_gathers in buckets: one collective for several gathered inputs, as FSDP gathers a layer.

A reshard of a graph input (a parameter, an optimizer state) that is exactly one
``all_gather`` depends on nothing the step computes, so a lowering may run
several of them as one collective on a flat buffer: one latency instead of one
per tensor. Walking the gathers in the order the plan interpreter issues them
(first reader's op position, then its input slot), a gather joins the open
bucket of its (mesh axis, dtype) while the bucket's gathered bytes stay within
``problem.shard_bucket_bytes``; otherwise it opens the next one. A bucket runs
where its first member would have run, so its later members are gathered early:
at most a bucket's bytes more live memory, which :mod:`metadist_core.plan.memprofile`
counts.

:func:`bucket_in_order` is the rule; the torch lowering applies it to its fx
program (:func:`metadist_torch.lower.coalesce.coalesce_all_gathers`), and
:func:`gather_buckets` applies it to a plan for :func:`metadist_core.plan.overlap.predict`
and the memory model. A test checks that both give the same buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence, TypeVar

import numpy as np

from metadist_core.cost.model import local_bytes
from metadist_core.cost.reshard import reshard
from metadist_core.cost.phases import reshard_key
from metadist_core.ir.placement import Sharding


def bucket_cap(cap: int, first_cap: int | None, opened: int) -> int:
    """The byte cap of a group's bucket when ``opened`` buckets of the group exist, counting it: the first
    bucket is held to ``first_cap`` (DDP closes a small first gradient bucket, so that its all_reduce starts
    early in the backward and overlaps the rest), every later one to ``cap``."""
    return first_cap if first_cap and opened <= 1 else cap


_Id = TypeVar("_Id", bound=Hashable)


def bucket_in_order(
    items: Sequence[tuple[_Id, Hashable, int]], cap: int, first_cap: int | None = None
) -> list[list[_Id]]:
    """Greedy buckets of ``(id, group, nbytes)`` in issue order: an item joins the open bucket of its group
    while the bucket stays within its cap (:func:`bucket_cap`), else opens a new one (the group's previous
    one closes). Buckets come in the order of their first member; a bucket of one is a plain collective."""
    out: list[list[_Id]] = []
    open_: dict[Hashable, tuple[int, int, int]] = {}  # group -> (index in out, bytes, buckets opened)
    for ident, group, nbytes in items:
        cur = open_.get(group)
        if cur is not None and cur[1] + nbytes <= bucket_cap(cap, first_cap, cur[2]):
            out[cur[0]].append(ident)
            open_[group] = (cur[0], cur[1] + nbytes, cur[2])
        else:
            out.append([ident])
            open_[group] = (len(out) - 1, nbytes, (cur[2] if cur else 0) + 1)
    return out


@dataclass(frozen=True)
class Gather:
    """One bucketable reshard: input value ``var`` all-gathered on mesh ``axis`` for its readers of one phase."""

    key: tuple  # :func:`metadist_core.cost.phases.reshard_key`
    var: str
    axis: int
    dtype: str
    nbytes: int  # the collective's bytes (Collective.nbytes): what fills a bucket
    gathered: int  # bytes per device of the gathered value
    local: int  # bytes per device of the piece sent
    first: int  # op position of its first reader


def _single_gather(src: Sharding, dst: Sharding, shape: Sequence[int], dtype: str, mesh: Any) -> Any:
    """The one all_gather that takes ``src`` to ``dst``, or None when the reshard is anything else."""
    colls = reshard(src, dst, shape, dtype, mesh)
    return colls[0] if len(colls) == 1 and colls[0].kind == "all_gather" and not colls[0].is_free else None


def gathers(problem: Any, choice: Sequence[int] | np.ndarray) -> list[Gather]:
    """The bucketable gathers of plan ``choice`` in issue order (none when the problem has no
    ``shard_bucket_bytes``): reshards of graph inputs that are exactly one all_gather, read by ops."""
    if not getattr(problem, "shard_bucket_bytes", None):
        return []
    n_in = sum(1 for n in problem.nodes if n.kind == "input")
    own: dict[str, Sharding] = {}
    for i, n in enumerate(problem.nodes):
        if n.kind == "input":
            own[n.outputs[0]] = n.options[int(choice[i])].outputs[0]
    found: dict[tuple, list] = {}  # key -> [(first pos, slot), var, target]
    for e in problem.edges:
        if e.var not in own or e.dst < 0 or e.dst_slot < 0 or not problem.vars[e.var].get("gather_bucketed"):
            continue
        dst = problem.nodes[e.dst]
        tgt = dst.options[int(choice[e.dst])].inputs[e.dst_slot]
        if tgt == own[e.var]:
            continue
        key = reshard_key(e.var, own[e.var], tgt, dst.id, problem.phases)
        rec = found.setdefault(key, [(e.dst - n_in, e.dst_slot), e.var, tgt])
        rec[0] = min(rec[0], (e.dst - n_in, e.dst_slot))
    out = []
    for key, ((pos, _), var, tgt) in sorted(found.items(), key=lambda kv: kv[1][0]):
        info = problem.vars[var]
        c = _single_gather(own[var], tgt, info["shape"], info["dtype"], problem.mesh)
        if c is None:
            continue
        out.append(
            Gather(
                key,
                var,
                c.axis,
                info["dtype"],
                int(c.nbytes),
                local_bytes(info["shape"], info["dtype"], tgt, problem.mesh),
                local_bytes(info["shape"], info["dtype"], own[var], problem.mesh),
                pos,
            )
        )
    return out


def gather_buckets(problem: Any, choice: Sequence[int] | np.ndarray) -> list[list[Gather]]:
    """The buckets of two or more gathers the lowering makes for plan ``choice``, in issue order."""
    gs = gathers(problem, choice)
    by_key = {g.key: g for g in gs}
    groups = bucket_in_order([(g.key, (g.axis, g.dtype), g.nbytes) for g in gs], problem.shard_bucket_bytes)
    return [[by_key[k] for k in b] for b in groups if len(b) > 1]


__all__ = ["Gather", "bucket_cap", "bucket_in_order", "gathers", "gather_buckets"]
