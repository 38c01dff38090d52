"""Gradient and parameter buckets in the rank program: all_reduces (and reduce_scatters) merged into one
flat collective per bucket, parameter all_gathers per bucket, the way the cost model prices them
(:mod:`metadist_core.cost.buckets`, :mod:`metadist_core.cost.gathers`); and the fx meta keys the lowering's
passes read."""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping

import torch.fx as fx

from metadist_core.cost.gathers import bucket_cap, bucket_in_order

from .collectives import md_done

# ops whose second argument is the full output shape: lowered with the local output shape

DTYPE_META = "metadist_dtype"  # fx node meta: the canonical dtype of the value a node holds
VAR_META = "metadist_var"  # fx node meta: the MetaIR value a node holds (a collective's: the value it moves)


def coalesce_all_reduces(
    g: fx.Graph,
    reduces: dict,
    bucket_fn: Callable[[str, int], Callable],
    caps: Mapping[str, int],
    first_cap: int | None = None,
    only: Callable[[fx.Node], bool] | None = None,
) -> list[list[Any]]:
    """Merge all_reduces (and reduce_scatters) that are independent of each other into buckets, as DDP
    (and FSDP) do with gradients.

    The collectives are taken in the order their inputs are computed (a gradient's all_reduce in the
    order the backward makes the gradients) and each joins the open bucket of its kind, axis, reduce op
    and dtype while the bucket stays within its cap (``caps[kind]``; the first all_reduce bucket of a group
    ``first_cap``, :func:`metadist_core.cost.gathers.bucket_cap`) and no member's input is computed after
    another member's place in the program; else it opens the next bucket. A kind without a cap, and a
    collective ``only`` rejects, is not bucketed. A bucket runs at its earliest member's place, as one
    collective of the concatenated inputs (:func:`metadist_torch.lower.schedule.issue_early` then moves it to
    right after its last input): the buckets :func:`metadist_core.plan.overlap.predict` and
    :mod:`metadist_core.plan.memprofile` price. A collective whose input is an earlier collective of the same
    reshard never meets that condition with another gradient's, so only the first of a reshard joins a
    bucket (:func:`metadist_core.cost.buckets.bucketed_step`, the rule the pricers follow). Values and bytes are unchanged. Returns the values (``VAR_META``)
    of each bucket of two or more members, in the order the buckets were opened.
    """
    order = {n: i for i, n in enumerate(g.nodes)}
    todo = sorted(
        (n for n in g.nodes if n in reduces and caps.get(reduces[n][0]) and (only is None or only(n))),
        key=lambda n: (order[n.args[0]], order[n]),
    )
    buckets: list[dict] = []
    open_: dict[tuple, dict] = {}
    opened: dict[tuple, int] = {}
    for n in todo:
        kind, axis, reduce, dtype, nbytes = reduces[n]
        key = (kind, axis, reduce, dtype)
        b = open_.get(key)
        cap = bucket_cap(caps[kind], first_cap if kind == "all_reduce" else None, opened.get(key, 0))
        src, at = order[n.args[0]], order[n]
        if b is not None and b["bytes"] + nbytes <= cap and max(b["src"], src) < min(b["at"], at):
            b["members"].append(n)
            b["bytes"] += nbytes
            b["src"], b["at"] = max(b["src"], src), min(b["at"], at)
        else:
            b = open_[key] = {"key": key, "members": [n], "bytes": nbytes, "src": src, "at": at}
            buckets.append(b)
            opened[key] = opened.get(key, 0) + 1
    made = []
    for b in buckets:
        if len(b["members"]) < 2:
            continue
        kind, axis, reduce, _ = b["key"]
        anchor = min(b["members"], key=lambda m: order[m])
        extra = [[m.args[2] for m in b["members"]]] if kind == "reduce_scatter" else anchor.args[2:]
        with g.inserting_before(anchor):
            call = g.call_function(
                bucket_fn(kind, axis), ([m.args[0] for m in b["members"]], reduce, *extra)
            )  # the dims; an all_reduce's wire dtype
            outs = [g.call_function(operator.getitem, (call, i)) for i in range(len(b["members"]))]
        made.append([m.meta.get(VAR_META) for m in b["members"]])
        for m, o in zip(b["members"], outs):
            m.replace_all_uses_with(o)
            g.erase_node(m)
    return made


def coalesce_all_gathers(
    g: fx.Graph, gathers: dict, bucket_fn: Callable[[int], Callable], cap: int
) -> list[list[fx.Node]]:
    """Merge the all_gathers of graph inputs into buckets by :func:`metadist_core.cost.gathers.bucket_in_order`.

    A gather counts when its input is a placeholder and only ops read its result (an edge of exactly one
    all_gather, what :func:`metadist_core.cost.gathers.gathers` finds in the plan). Each bucket of two or more
    runs as one :meth:`AxisComm.start_all_gather_bucket` where its first member was, each member's value an
    ``md_done`` of it (:func:`metadist_torch.lower.schedule.prefetch_gathers` then issues each bucket while the one
    before it is read). Returns the buckets made (the members' values).
    """

    def only_ops_read(n: fx.Node) -> bool:
        return all(u.op == "call_function" and not getattr(u.target, "__name__", "").startswith("md_") for u in n.users)

    order = [n for n in g.nodes if n in gathers and only_ops_read(n)]
    buckets = bucket_in_order([(n, gathers[n][:2], gathers[n][2]) for n in order], cap)
    made = []
    for b in buckets:
        if len(b) < 2:
            continue
        with g.inserting_before(b[0]):
            call = g.call_function(
                bucket_fn(gathers[b[0]][0]), ([m.args[0] for m in b], [m.args[1] for m in b], [m.args[2] for m in b])
            )
            items = [g.call_function(operator.getitem, (call, i)) for i in range(len(b))]
            outs = [g.call_function(md_done, (it,)) for it in items]
        for m, it, o in zip(b, items, outs):
            it.meta.update(m.meta)
            o.meta.update(m.meta)
            m.replace_all_uses_with(o)
            g.erase_node(m)
        made.append(outs)
    return made


__all__ = ["DTYPE_META", "VAR_META", "coalesce_all_gathers", "coalesce_all_reduces"]
