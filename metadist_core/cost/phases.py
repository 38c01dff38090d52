"""Reshard phases: a value the forward reads is moved again for the readers after it.

The lowering runs a reshard once per (value, target sharding) however many ops
read it. Across a whole training step that keeps the moved copy alive from the
forward to the backward: a sharded weight gathered for its matmul stays whole
until its gradient is computed, an activation gathered in the forward stays
until the backward reads it. FSDP instead re-gathers a layer's parameters in
the backward. So the readers of a value fall into two **phases**: the forward
(the ops the loss, the other returned values and the new buffers are computed
from) and everything after it (backward, recomputed copies, optimizer, the
step's outputs and state write-back). A reshard runs once per (value, target,
phase): the forward's copy dies after the forward's last reader.

A reshard from a Partial sharding is made as soon as its input exists (the
torch lowering issues all_reduces early), so moving it twice would only pay
twice: its readers share one result whatever their phase (:func:`share_phase`).
A graph whose every op feeds the returned values (inference) has one phase.

The same rule is read by the plan interpreter (what runs), the problem's cost
terms (what is priced) and the memory profile (what is held).
"""

from __future__ import annotations

from typing import Mapping

from metadist_core.ir.ir import MetaIR, forward_ops
from metadist_core.ir.placement import Sharding

FORWARD, LATER = 0, 1


def reader_phases(graph: MetaIR) -> dict[str, int]:
    """Op id -> :data:`FORWARD` or :data:`LATER`; empty when the graph has one phase."""
    fwd = set(forward_ops(graph))
    if len(fwd) == len(graph.ops) or not fwd:
        return {}
    return {op.id: FORWARD if op.id in fwd else LATER for op in graph.ops}


def phase_of(phases: Mapping[str, int], reader: str) -> int:
    """The phase of ``reader`` (an op id; anything else, a graph output or a state write-back, is LATER)."""
    if not phases:
        return FORWARD
    return phases.get(reader, LATER)


def share_phase(phases: Mapping[str, int], reader: str, source: Sharding) -> int:
    """The phase part of a reshard's key: the reader's phase, or FORWARD for every reader of a Partial
    source (one early all_reduce serves them all)."""
    return FORWARD if source.has_partial() else phase_of(phases, reader)


def reshard_key(var: str, source: Sharding, target: Sharding, reader: str, phases: Mapping[str, int]) -> tuple:
    """Reshards with equal keys are one collective: the value, both shardings and the phase it is shared in."""
    return (var, source, target, share_phase(phases, reader, source))


__all__ = ["FORWARD", "LATER", "reader_phases", "phase_of", "share_phase", "reshard_key"]
