"""Which values of a MetaIR share storage with another (views), for the memory terms.

A view op (``view``, ``t``, ``transpose``, ``expand``, ``split``...) returns a
tensor over its input's storage: it takes no bytes of its own, and it keeps
its input's storage alive for as long as the view is read. The memory model
(:mod:`metadist_core.problem.problem`'s memory terms, ``Terms.peak_memory``) therefore
charges a view nothing and extends the liveness of the value it views (its
*base*, followed through chains of views) to the view's last reader -- what a
runtime that frees a storage when its last tensor dies really holds. Counting
views as copies over-predicts a training step's peak (many transposed weights
and reshaped activations are alive at once).

An op is a view when the frontend marks it (``op.attrs["view"] = True``) or,
for aten ops, when its name is one of :data:`VIEW_OPS`.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Mapping

from metadist_core.ir.ir import MetaIR, MetaOp

# aten ops whose every output is a view of their first input (functionalized graphs keep them as views)
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "t",
        "transpose",
        "permute",
        "expand",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "narrow",
        "alias",
        "detach",
        "as_strided",
        "diagonal",
        "unflatten",
        "movedim",
        "view_as",
        "expand_as",
        "numpy_T",
        "swapaxes",
        "swapdims",
        "unfold",
    }
)


def is_view(op: MetaOp) -> bool:
    """True when every output of ``op`` shares its first input's storage."""
    mark = op.attrs.get("view") if isinstance(op.attrs, dict) else None
    if mark is not None:
        return bool(mark)
    parts = op.key.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1] in VIEW_OPS and bool(op.inputs)


def view_bases(graph: MetaIR) -> dict[str, str]:
    """view value id -> the value whose storage it shares (the root of a chain of views)."""
    base: dict[str, str] = {}
    for op in graph.ops:
        if not is_view(op):
            continue
        src = op.inputs[0]
        root = base.get(src, src)
        for v in op.outputs:
            base[v] = root
    return base


def alias_liveness(graph: MetaIR, live: Mapping[str, tuple[int, int]]) -> tuple[dict[str, list[int]], set[str]]:
    """``(liveness, views)``: ``live`` with every base held until its views' last reader, and the view ids."""
    out = {k: list(v) for k, v in live.items()}
    base = view_bases(graph)
    for v, b in base.items():
        if v in out and b in out:
            out[b][1] = max(out[b][1], out[v][1])
    return out, set(base)


def inplace_state_liveness(
    graph: MetaIR, live: dict[str, list[int]], views: AbstractSet[str] = frozenset()
) -> dict[str, list[int]]:
    """``live`` with each new state value dying where it is written into its state's storage.

    The lowering copies a new parameter / optimizer state value into the old one's storage as soon as the
    old value's last reader has run (``metadist_torch.lower.lower.write_state_in_place``), so the new value
    lives from its producer to ``max(producer, last reader of the old or new value)``, not to the end of the
    step. A new state value the step also returns, or one that is a view, keeps its liveness."""
    readers: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for v in op.inputs:
            readers[v] = i
    state_outs = set(graph.aliases.values())
    returned = {o for o in graph.outputs if o not in state_outs}
    for s, o in graph.aliases.items():
        if o == s or o in returned or o in views or o not in live or o in graph.inputs:
            continue
        live[o][1] = max(live[o][0], readers.get(s, -1), readers.get(o, -1))
    return live


__all__ = ["VIEW_OPS", "is_view", "view_bases", "alias_liveness", "inplace_state_liveness"]
