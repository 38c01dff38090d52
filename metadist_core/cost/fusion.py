"""The optimizer's update as a compiler fuses it: one loop per parameter, its intermediates never in memory.

An optimizer's update is a chain of elementwise ops per parameter (Adam: the new m and v, their bias
corrections, the square root, the step, the new parameter; a dozen ops). Run op by op, as eager torch
runs it, every intermediate is written to memory and read back. XLA (the JAX frontend) fuses the chain
into one loop that reads the parameter, its gradient and its state once and writes the new ones once.
Priced op by op, the data-parallel plan's replicated update on whole parameters is priced far over what it
takes, and the solver would not choose it.

:func:`update_regions` finds the update: the elementwise ops after the forward that read a parameter or
optimizer state, the elementwise ops after them, and the elementwise producers that only they read; each
writing values of a parameter's or state's shape (or scalars), so that no activation-sized op of the
backward is taken in.
:func:`fused_bytes` gives each such op the bytes it moves inside its loop: the values it reads from
outside the loop (each once per loop), and the values it writes that something outside reads or the
step returns. The forward and backward stay priced op by op: what XLA fuses there depends on more than
the op kinds, and op-by-op pricing of them comes closer to the step than any fused pricing tried.

The core knows no op kinds: the frontend whose compiler fuses says which of its ops are elementwise
(:meth:`metadist_core.driver.frontend.Frontend.fuses`).
"""

from __future__ import annotations

from typing import Callable

from metadist_core.ir.ir import UPDATE_ROLES, MetaIR, MetaOp, forward_ops


def update_regions(graph: MetaIR, elementwise: Callable[[MetaOp], bool]) -> list[list[str]]:
    """The optimizer update's fused loops: lists of op ids (graph order), one per connected chain."""
    fusable = {op.id for op in graph.ops if elementwise(op)}
    if not fusable:
        return []  # a frontend whose ops run one by one
    fwd = set(forward_ops(graph))
    if len(fwd) == len(graph.ops):
        return []  # inference: no update
    state = {v for v in graph.inputs if graph.vars[v].role in UPDATE_ROLES}
    outputs = set(graph.outputs)
    shapes = {graph.vars[v].shape for v in state}

    def update_shaped(i: str) -> bool:  # the update works on its state's shapes (and scalars)
        return all(graph.vars[v].numel <= 1 or graph.vars[v].shape in shapes for v in graph.op(i).outputs)

    ok = {i for i in fusable - fwd if update_shaped(i)}
    region = graph.downstream(state, through=lambda op: op.id in ok).ops  # what the update computes from them
    grew = True
    while grew:  # producers that only the update reads (Adam's (1 - b1) * g): in the same loop
        grew = False
        for i in list(region):
            for v in graph.op(i).inputs:
                p = graph.vars[v].producer
                if p is None or p in region or p not in ok:
                    continue
                outs = graph.op(p).outputs
                if all(r in region for o in outs for r in graph.vars[o].consumers) and not outputs.intersection(outs):
                    region.add(p)
                    grew = True
    # connected chains: ops joined by a value of more than one element that one writes and another reads
    parent = {i: i for i in region}

    def find(i: str) -> str:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in region:
        for v in graph.op(i).outputs:
            if graph.vars[v].numel > 1:
                for r in graph.vars[v].consumers:
                    if r in region:
                        parent[find(r)] = find(i)
    groups: dict[str, list[str]] = {}
    for op in graph.ops:
        if op.id in region:
            groups.setdefault(find(op.id), []).append(op.id)
    return list(groups.values())


def fused_bytes(graph: MetaIR, elementwise: Callable[[MetaOp], bool]) -> dict[str, float]:
    """Op id -> the bytes it moves inside its fused update loop (only the update's ops are keys)."""
    outputs = set(graph.outputs)
    out: dict[str, float] = {}
    for loop in update_regions(graph, elementwise):
        inside = set(loop)
        seen: set[str] = set()
        for i in loop:
            op = graph.op(i)
            b = 0.0
            for v in op.inputs:
                mv = graph.vars[v]
                if mv.is_tensor and mv.producer not in inside and v not in seen:
                    seen.add(v)  # read once per loop however many of its ops read it
                    b += mv.nbytes
            for v in op.outputs:
                mv = graph.vars[v]
                if mv.is_tensor and (v in outputs or any(r not in inside for r in mv.consumers)):
                    b += mv.nbytes
            out[i] = b
    return out


__all__ = ["fused_bytes", "update_regions"]
