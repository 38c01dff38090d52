"""Drop rules no plan can gain from, before they are expanded to N-D strategies.

A rule that takes an input as ``Partial(r)`` is worth having only if some op
can really *make* that value partial (a contraction split to Partial(sum), a
reduction over a split dim, ...). When no producer can, the input would have
to come from a replicated value by the free local step Replicate -> Partial,
and the op would then do all of its work on every device, exactly like its
replicated rule, and leave a value that still needs a reduction: dominated.
So a rule is kept when it has no Partial input, or when at least one of its
Partial inputs is *genuinely* reachable: produced as that Partial by a kept
rule of its producer, or when it splits another input (addmm's bias taken as
Partial beside a contraction split of its matmul: the work is split, the free
local step on the bias is what makes the row-parallel Linear). One pass in
topological order decides it.
"""

from __future__ import annotations

from typing import Sequence

from metadist_core.ir.ir import MetaIR
from metadist_core.ir.placement import Partial, Shard
from metadist_core.discovery.rules import RuleBook, ShardingRule


def useful_rules(
    graph: MetaIR, rulebook: RuleBook, axis_sizes: Sequence[int] = (2,)
) -> dict[str, dict[int, list[ShardingRule]]]:
    """op id -> axis size -> the rules verified at that size that are not dominated (see the module docstring)."""
    out: dict[str, dict[int, list[ShardingRule]]] = {op.id: {} for op in graph.ops}
    for n in sorted(set(axis_sizes)):
        for op_id, kept in _useful_at(graph, rulebook, n).items():
            out[op_id][n] = kept
    return out


def _useful_at(graph: MetaIR, rulebook: RuleBook, n: int) -> dict[str, list[ShardingRule]]:
    genuine: dict[str, set[str]] = {}  # var id -> reduce ops it can genuinely be partial in
    out: dict[str, list[ShardingRule]] = {}
    for op in graph.ops:
        rules = rulebook.rules_for(op, graph, n)
        t_in = [v for v in op.inputs if graph.vars[v].is_tensor]
        kept = []
        for r in rules:
            partial_slots = [(i, p.reduce) for i, p in enumerate(r.inputs) if isinstance(p, Partial)]
            if (
                partial_slots
                and not any(i < len(t_in) and reduce in genuine.get(t_in[i], ()) for i, reduce in partial_slots)
                and not any(isinstance(p, Shard) for p in r.inputs)
            ):
                continue
            kept.append(r)
            for v, p in zip(op.outputs, r.outputs):
                if isinstance(p, Partial):
                    genuine.setdefault(v, set()).add(p.reduce)
        out[op.id] = kept
    return out
