"""Strategy presets: named sets of constraints on the same ShardingProblem, recognised from the graph.

A preset never takes another code path: it pins where values live (``Pin``)
and the solver prices and plans the rest exactly as it plans ``"auto"``, so
a preset's price and its numbers come from the same machinery.

- ``ddp``: parameters, optimizer state and buffers replicated; every batch
  input split on dim 0 over every mesh axis; each gradient made as a partial
  sum on every device and read whole by the update (all-reduced); the update
  itself (every value computed from the optimizer state) runs whole on every
  device, as DDP runs it.
- ``zero1``: as ddp, with optimizer state split on dim 0 over every axis
  (gradients partial sums, reduced as the solver finds cheapest).
- ``zero2``: as zero1, with the gradients read split (reduce-scatter).
  Gradients are the values the optimizer update reads besides the parameter
  and its state (role ``gradient`` where the frontend marks them).
- ``zero3`` (alias ``fsdp``): parameters and optimizer state split on dim 0.
- ``tp``: Megatron tensor parallelism on every axis: a weight whose matmul
  output feeds, through elementwise ops but not across a residual add, the
  matmul of another weight is split by columns, that other one by rows (the
  MLP hidden dim); attention inputs and output are split by heads, the q/k/v
  projections that feed them alone by columns and the output projection by
  rows; other parameters replicated, the batch whole. A split weight is read
  only in its split (never gathered); the solver places the activations
  (sequence-parallel norms where that is cheaper). An attention, or a column/row pair, one of whose weights
  the user pins unsplit (constraints by name) is left to the solver whole: Megatron on the MLPs alone.
- ``tp+dp``: tp on the last mesh axis, ddp on the others.
- ``ep``: expert parallelism. Every mixture-of-experts weight (a parameter
  the frontend marks with its number of experts) is split on its expert dim
  over mesh axis 0 and replicated on the others; the other parameters are
  replicated, the batch split on dim 0 over every axis and their gradients
  all-reduced, as ddp. A dropless experts layer runs its expert-parallel
  implementation on axis 0 (its tokens sent to their experts by uneven
  all_to_all inside the op, :mod:`metadist_core.discovery.moe_dispatch`); a
  capacity-padded one leaves the tokens to the solver, grouped by expert where
  the experts live, which the lowering moves by all_to_all.
- ``cp``: context parallelism on the last mesh axis. Every batch input is split on its sequence dim (1)
  over the last axis and on dim 0 over the others, and every causal attention runs its distributed
  implementation on the last axis (:class:`~metadist_core.problem.elements.UseImpl`: K/V all-gathered inside
  the op, partial results merged by log-sum-exp); the solver places everything else.
- ``zero3+cp`` (alias ``fsdp+cp``): cp, with parameters and optimizer state split on dim 0 over every axis
  as zero3 splits them.

Optimizer state follows the parameter it belongs to where a preset does not
say otherwise. A dim that does not divide evenly stays replicated, and a pin
no rule allows is left out; both are listed in ``PresetConstraints.notes``.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from metadist_core.problem.constraints import (
    Constraint,
    Forbid,
    Pin,
    annotation_pins,
    apply_constraints,
    pins_by_name,
    var_name,
)
from metadist_core.discovery import cp_attention, moe_dispatch
from metadist_core.problem.elements import UseImpl
from metadist_core.ir.placement import Partial, Placement, Replicate, Shard, Sharding
from metadist_core.problem.presetgraph import GraphView, Pins, PresetConstraints, op_name, split_on
from metadist_core.problem.tensor_parallel import tensor_parallel
from metadist_core.config import ALIASES, check_strategy

if TYPE_CHECKING:  # pragma: no cover
    from metadist_core.problem.problem import ShardingProblem

log = logging.getLogger("metadist.presets")


def gathers_parameters(strategy: str) -> bool:
    """Does every plan of ``strategy`` gather the parameters where they are read (zero3/fsdp pins them split)?
    The solver then prices their gathers as the lowering buckets them, a bucket per layer, as under a memory
    budget (:data:`metadist_core.problem.problem.BUDGET_GATHER_SHARE`): priced each at a whole latency, the fsdp
    preset's objective would be far over what its plan takes, and it would choose all-reduces and
    all_to_alls over FSDP's reduce-scatters."""
    key = str(strategy).strip().lower()
    return ALIASES.get(key, key) in ("zero3", "zero3+cp")


def _forbid_readers(g: GraphView, pins: Pins, var: str, placements: list[Placement]) -> None:
    """Forbid ``placements`` (on any axis) where ``var`` is read, when every reader keeps an option."""

    def ok(sh: Sharding) -> bool:
        return not any(p in placements for p in sh)

    for i, slot in g.readers.get(var, []):
        if not any(ok(o.inputs[slot]) for o in g.prob.nodes[i].options):
            pins.out.notes.append(f"{var_name(g.prob, var)}: a reader cannot avoid {placements}; left open")
            return
    pins.out.pins.extend(Forbid(p, var=var) for p in placements)


def _replicated_update(g: GraphView, pins: Pins, grads: Iterable[str]) -> None:
    """DDP updates every replica whole: no value computed from the optimizer state or from a (reduced)
    gradient is split. (Left free, the solver split Adam's update of the replicated state and gathered the
    results, which is ZeRO's program with replicated storage, not DDP's, and the ddp preset priced that.)"""
    after: set[str] = set()
    todo = list(grads)
    while todo:
        v = todo.pop()
        for i, _ in g.readers.get(v, []):
            for o in g.prob.nodes[i].outputs:
                if o not in after:
                    after.add(o)
                    todo.append(o)
    for n in g.prob.nodes:
        if n.kind != "op":
            continue
        for s, v in enumerate(n.outputs):
            shape = g.shape(v)
            if not shape or not (g.dep.get(v, 0) & ~1 or v in after):
                continue
            if not any(not any(p.is_shard() for p in o.outputs[s]) for o in n.options):
                pins.out.notes.append(f"{var_name(g.prob, v)}: no rule computes it unsplit; left to the solver")
                continue
            pins.out.pins.extend(Forbid(Shard(d), var=v) for d in range(len(shape)))


def _expert_pins(g: GraphView, pins: Pins) -> None:
    """The ep preset's experts: each expert weight split on its expert dim (0) over mesh axis 0."""
    shape = g.prob.mesh.shape
    experts = [p for p in g.params if g.prob.vars[p].get("experts")]
    if not experts:
        pins.out.notes.append("no mixture-of-experts weights in the graph: ep is ddp here")
    for p in experts:
        n = g.prob.vars[p]["experts"]
        pins.pin(p, split_on(g.shape(p), 0, [0], shape), f"its {n} experts do not divide by mesh axis 0 ({shape[0]})")
    pins.out.pins.append(UseImpl(moe_dispatch.EP, 0))  # the tokens travel to the experts inside the layer's op
    for op_id, why in sorted(_refusals(g, moe_dispatch.OP_KEYS).items()):
        pins.out.notes.append(f"{op_id} runs without expert parallelism on mesh axis 0: {why}")


def _refusals(g: GraphView, keys: frozenset[str]) -> dict[str, str]:
    """Why no distributed implementation serves each op of these keys that has one registered."""
    key = {n.id: n.key for n in g.prob.nodes}
    return {op_id: why for op_id, why in g.prob.impl_refusals.items() if key.get(op_id) in keys}


SEQ_DIM = 1  # the sequence dim of a batch input (batch first)
CP_IMPLS = "cp_attention"  # the prefix of the distributed implementations context parallelism runs
CP_KEYS = frozenset({cp_attention.CPU_FORWARD, cp_attention.CPU_BACKWARD})


def _context_parallel(g: GraphView, pins: Pins, axis: int) -> None:
    """The cp presets' pins: each batch input split on its sequence dim over ``axis`` and on dim 0 over the
    other axes (a dim that does not divide stays whole there), and causal attention split on ``axis``."""
    shape = g.prob.mesh.shape
    for v in g.batch:
        s = g.shape(v) or ()
        places: list[Placement] = []
        for a, n in enumerate(shape):
            d = SEQ_DIM if a == axis else 0
            places.append(Shard(d) if n > 1 and len(s) > d and s[d] % n == 0 else Replicate())
        pins.pin(v, Sharding(tuple(places)))
        if len(s) <= SEQ_DIM or s[SEQ_DIM] % shape[axis]:
            pins.out.notes.append(
                f"batch input {var_name(g.prob, v)} of shape {tuple(s)}: no sequence dim {SEQ_DIM} that divides by "
                f"mesh axis {axis} ({shape[axis]}); it stays whole on that axis"
            )
    pins.out.pins.append(UseImpl(CP_IMPLS, axis))
    by_reason: dict[str, list[str]] = {}
    for op_id, why in sorted(_refusals(g, CP_KEYS).items()):
        pins.out.notes.append(f"{op_id} keeps its sequence whole on mesh axis {axis}: {why}")
        by_reason.setdefault(why, []).append(op_id)
    for why, ops in by_reason.items():
        log.warning(
            "metadist: %s: %d op(s) (%s%s) keep their sequence whole: %s",
            pins.out.name,
            len(ops),
            ", ".join(ops[:3]),
            " ..." if len(ops) > 3 else "",
            why,
        )


def preset_constraints(
    prob: "ShardingProblem", name: str, user: Mapping[str, Sharding] | None = None
) -> PresetConstraints:
    """The constraints of preset ``name`` on ``prob``. ``user``: the user's own pins (value -> sharding), which
    the tp presets respect beyond the pinned values themselves (:func:`~metadist_core.problem.tensor_parallel.tensor_parallel`)."""
    key = ALIASES.get(check_strategy(name), check_strategy(name))
    if key == "auto":
        return PresetConstraints("auto", [])
    g = GraphView(prob)
    nd, shape = prob.mesh.ndim, prob.mesh.shape
    every = list(range(nd))
    pins = Pins(prob, name)
    cp = key in ("cp", "zero3+cp")
    if cp:
        _context_parallel(g, pins, nd - 1)
        if key == "cp":
            return pins.out
        key = "zero3"
    tp_axes = every if key == "tp" else ([nd - 1] if key == "tp+dp" else [])
    dp_axes = [a for a in every if a not in tp_axes]
    if tp_axes:
        tensor_parallel(g, pins, tp_axes, user)
    for v in [] if cp else g.batch:
        pins.pin(
            v,
            split_on(g.shape(v), 0, dp_axes, shape) if dp_axes else None,
            f"batch dim 0 does not divide by {math.prod(shape[a] for a in dp_axes)}" if dp_axes else "",
        )
    if key == "ep":
        _expert_pins(g, pins)
    shard_state = key in ("zero1", "zero2", "zero3")
    shard_params = key == "zero3"
    if key in ("ddp", "zero1", "zero2", "ep"):  # each device's gradient is a partial sum, reduced for the update
        grads = g.gradients()
        if key == "ep":  # an expert weight's gradient is made where its experts live
            grads = {v: p for v, p in grads.items() if not g.prob.vars[p].get("experts")}
        pins.out.gradients = grads
        if not grads:
            pins.out.notes.append("no gradients recognised (no optimizer update reads a batch-dependent value)")
        partial = Sharding(tuple(Partial("sum") for _ in every))
        for v in grads:
            if pins.pin(v, partial, ""):
                if key in ("ddp", "ep"):  # read whole: all-reduced
                    _forbid_readers(g, pins, v, [Shard(d) for d in range(len(g.shape(v) or ()))])
                elif key == "zero2" and split_on(g.shape(v), 0, every, shape) is not None:
                    _forbid_readers(g, pins, v, [Replicate()])  # read split: reduce-scattered
    if key == "ddp":
        _replicated_update(g, pins, pins.out.gradients)
    for p in g.params:
        pins.pin(
            p,
            split_on(g.shape(p), 0, every, shape) if shard_params else None,
            f"dim 0 does not divide by {prob.mesh.size}" if shard_params else "",
        )
    for s in g.states:
        if shard_state:
            pins.pin(
                s,
                split_on(g.shape(s), 0, every, shape),
                f"dim 0 does not divide by {prob.mesh.size}" if g.shape(s) else "",
            )
        else:  # state lives like its parameter
            owner = g.owner.get(s)
            pinned = {c.var: c.sharding for c in pins.out.pins if isinstance(c, Pin)}
            sh = pinned.get(owner) if owner is not None and g.shape(owner) == g.shape(s) else None
            pins.pin(s, sh)
    for b in g.buffers:
        pins.pin(b, None)
    return pins.out


# -- applying constraints ------------------------------------------------------------------------------


def constrain(prob: "ShardingProblem", extra: Sequence[Constraint]) -> "ShardingProblem":
    """A copy of ``prob`` with ``extra`` constraints added (tables shared, allowed options narrowed)."""
    if not extra:
        return prob
    p = copy.copy(prob)
    p.forget_terms()
    p.allowed = [a.copy() for a in prob.allowed]
    p.constraints = list(prob.constraints) + list(extra)
    # what explain and --compare solve the presets on; an attribute of steered copies only, not a dataclass field
    # (readers ask getattr(prob, "unsteered", prob)), which the type system cannot declare
    p.unsteered = getattr(prob, "unsteered", prob)  # type: ignore[attr-defined]
    apply_constraints(p)
    return p


def steer(
    prob: "ShardingProblem",
    strategy: str = "auto",
    named: Mapping[str, Any] | None = None,
    annotations: Mapping[str, Any] | None = None,
) -> "ShardingProblem":
    """``prob`` under the user's steering: annotations, constraints by name, then the strategy preset
    (the user's own pins win over the preset's on the same value)."""
    extra: list[Constraint] = []
    if annotations:
        extra += annotation_pins(prob, annotations)
    if named:
        extra += pins_by_name(prob, named)
    if strategy and strategy != "auto":
        user = {c.var: c.sharding for c in extra if isinstance(c, Pin)}  # annotations and names give pins only
        extra += [
            c for c in preset_constraints(prob, strategy, user).pins if isinstance(c, UseImpl) or c.var not in user
        ]
    return constrain(prob, extra)


__all__ = ["PresetConstraints", "GraphView", "preset_constraints", "constrain", "steer", "split_on", "op_name"]
