"""Activation recomputation, the graph side: the forward's segments, and the graph that recomputes some.

A training step keeps, from its forward until its backward, every forward
value the backward reads (the *saved activations*). Recomputing trades those
bytes for compute: the value dies after its last forward reader and a copy of
the ops that made it runs again just before its first backward reader.

- :func:`segments` cuts the forward into **segments** at its thin points: the
  cuts across which the fewest forward tensors stay alive (in a transformer,
  only the residual stream between blocks and between a block's two halves).
  A segment's values that cross into a later segment are its *checkpoints* and
  stay kept; what the backward reads of its other values is recomputed from
  them. Decisions are per segment (all of a repeated layer's internals, or
  none), as in ``torch.utils.checkpoint`` around each block.
- :func:`rewrite` gives the graph with chosen ops duplicated (ids and values
  with :data:`SUFFIX`) right before the backward op that first needs them, and
  the backward reading the copies. The sharding problem of that graph prices
  both sides exactly: the copies' compute (under their own sharding) and the
  shorter liveness of the originals.

Which segments to recompute is chosen in :mod:`metadist_core.levers.recompute`.
Random ops (dropout masks) are never recomputed: their outputs are kept, so a
recomputed value reads the very mask the forward drew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from metadist_core.ir.ir import RECOMPUTED_SUFFIX, MetaIR
from metadist_core.ir.ir import forward_ops
from metadist_core.levers.stages import positions

SUFFIX = RECOMPUTED_SUFFIX
#: Substrings of op keys that draw random numbers: never recomputed (their outputs are kept).
RANDOM_MARKERS = (
    "rand",
    "dropout",
    "bernoulli",
    "normal",
    "uniform",
    "multinomial",
    "randperm",
    "poisson",
    "exponential",
    "rng",
    "threefry",
)


#: a forward value read over more than this share of the forward's ops is not counted where the forward is cut
#: (it is kept across every cut it spans either way)
LONG_LIVED = 0.5


class RecomputeError(ValueError):
    """Recomputation cannot be applied as asked (names the op, and what to do)."""


@dataclass
class Segment:
    """A run of forward ops between two thin cuts, and what recomputing it means."""

    index: int
    ops: list[str]  # the segment's (non-free) forward ops, graph order
    recompute: list[str]  # the ops duplicated when it is recomputed (ancestors of what the backward reads)
    saved: list[str]  # values the backward reads that stop being kept
    saved_bytes: int  # their full (unsharded) bytes
    flops: float = 0.0  # the recomputed ops' FLOPs (0 when unknown)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "ops": len(self.ops),
            "recompute": list(self.recompute),
            "saved": list(self.saved),
            "saved_bytes": self.saved_bytes,
            "flops": self.flops,
        }


def is_random(key: str) -> bool:
    """Does the op with this key draw random numbers?"""
    k = key.lower()
    return any(m in k for m in RANDOM_MARKERS)


def segments(graph: MetaIR, flops: dict[str, float] | None = None) -> list[Segment]:
    """The forward cut at its thinnest points; segments with nothing to recompute are left out."""
    fwd = forward_ops(graph)
    fwd_set = set(fwd)
    core, pos = positions(graph, fwd)
    if len(core) < 2:
        return []
    # last forward reader (position in core) of each core value; a value crosses cut k if pos < k <= last
    last: dict[str, int] = {}
    for k, i in enumerate(core):
        for v in graph.op(i).inputs:
            if v in pos:
                last[v] = k
    diff = [0] * (len(core) + 1)
    learned = _learned(graph, core)
    for v, p in pos.items():
        # a side table (rotary cos/sin, masks, position ids: no parameter in it, made once, read by every layer)
        # or a value alive over most of the forward crosses every cut there alike and tells none apart; counted,
        # it made the layers' cuts thicker than the few before it was made: all of LLaMA's layers but the last
        # were one segment
        if (
            graph.vars[v].shape is not None
            and p < last.get(v, -1)
            and last[v] - p <= LONG_LIVED * len(core)
            and (learned is None or v in learned)
        ):
            diff[p + 1] += 1
            diff[last[v] + 1] -= 1
    crossing, run = [0] * len(core), 0
    for k in range(len(core)):
        run += diff[k]
        crossing[k] = run
    inner = [c for c in crossing[1:] if c > 0]
    if not inner:
        return []
    thin = min(inner)
    cuts = [0] + [k for k in range(1, len(core)) if crossing[k] == thin] + [len(core)]
    out_vars = set(graph.outputs) | set(graph.aliases.values())
    backward_reads: dict[str, bool] = {}
    for op in graph.ops:
        if op.id not in fwd_set:
            for v in op.inputs:
                backward_reads[v] = True
    result: list[Segment] = []
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        seg_ops = core[a:b]
        made = {v: i for i in seg_ops for v in graph.op(i).outputs}
        kept = {v for v in made if last.get(v, -1) >= b or v in out_vars}  # checkpoints and outputs
        kept |= {v for i in seg_ops if is_random(graph.op(i).key) for v in graph.op(i).outputs}
        saved = [v for v in made if v not in kept and backward_reads.get(v) and graph.vars[v].shape is not None]
        if not saved:
            continue
        need: set[str] = set()
        todo = list(saved)
        while todo:  # the segment's ops the saved values are computed from, stopping at kept values
            v = todo.pop()
            maker = made.get(v)
            if maker is None or maker in need or v in kept:
                continue
            need.add(maker)
            todo.extend(graph.op(maker).inputs)
        rec = [i for i in seg_ops if i in need]
        fl = sum((flops or {}).get(i, 0.0) for i in rec)
        result.append(Segment(len(result), seg_ops, rec, saved, sum(graph.vars[v].nbytes for v in saved), fl))
    return result


def _learned(graph: MetaIR, core: Sequence[str]) -> set[str] | None:
    """The values of the ``core`` forward ops computed from a parameter (None: the graph has no parameter)."""
    params = {v for v in graph.inputs if graph.vars[v].role == "parameter"}
    if not params:
        return None
    out = set(params)
    for i in core:
        op = graph.op(i)
        if any(v in out for v in op.inputs):
            out.update(op.outputs)
    return out


def order(segs: Sequence[Segment]) -> list[Segment]:
    """Segments in the order they are recomputed: most bytes saved per FLOP first (earlier on ties)."""
    return sorted(segs, key=lambda s: (-s.saved_bytes / (s.flops + 1.0), s.index))


def rewrite(graph: MetaIR, op_ids: Sequence[str]) -> MetaIR:
    """``graph`` with ``op_ids`` (forward ops) recomputed for the backward; the same graph when empty.

    Each op is copied (id and outputs + :data:`SUFFIX`) right before the first
    backward op that reads its outputs, directly or through other copies;
    backward ops read the copies, forward ops keep reading the originals.
    """
    if not op_ids:
        return graph
    fwd_set = set(forward_ops(graph))
    wanted = set(op_ids)
    rec = [op.id for op in graph.ops if op.id in wanted]
    unknown = sorted(wanted - set(rec))
    bad = [i for i in rec if i not in fwd_set or is_random(graph.op(i).key)]
    if unknown or bad:
        raise RecomputeError(
            f"cannot recompute {(unknown or bad)[:3]}: "
            + ("no such op in the graph" if unknown else "not a deterministic forward op")
            + "; the plan was made for another graph, re-plan it"
        )
    copy_of = {v: v + SUFFIX for i in rec for v in graph.op(i).outputs}
    index = {op.id: k for k, op in enumerate(graph.ops)}
    need: dict[str, int] = {}  # copied op -> position of the first op that needs the copy
    for i in reversed(rec):
        first = len(graph.ops)
        for v in graph.op(i).outputs:
            for r in graph.vars[v].consumers:
                if r not in fwd_set:
                    first = min(first, index[r])
                elif r in need:
                    first = min(first, need[r])
        need[i] = first
    at: dict[int, list[str]] = {}
    for i in rec:
        if need[i] < len(graph.ops):
            at.setdefault(need[i], []).append(i)
    g = MetaIR(graph.name)
    for v in graph.inputs:
        mv = graph.vars[v]
        g.add_input(v, mv.shape, mv.dtype, mv.role)
    done: set[str] = set()

    def add(op, ins, suffix: str = "") -> None:
        outs = [(v + suffix, graph.vars[v].shape, graph.vars[v].dtype) for v in op.outputs]
        g.add_op(op.key, ins, outs, op.attrs, id=op.id + suffix, payload=op.payload)
        for v in op.outputs:
            g.vars[v + suffix].role = graph.vars[v].role

    for k, op in enumerate(graph.ops):
        for i in at.get(k, []):
            c = graph.op(i)
            add(c, [copy_of[v] if v in copy_of and v in done else v for v in c.inputs], SUFFIX)
            done.update(c.outputs)
        backward = op.id not in fwd_set
        add(op, [copy_of[v] if backward and v in done else v for v in op.inputs])
    g.set_outputs(list(graph.outputs))
    for s, v in graph.aliases.items():
        g.alias(s, v)
    g.payload = graph.payload
    g.annotations = dict(graph.annotations)
    g.validate()
    return g


__all__ = ["RANDOM_MARKERS", "SUFFIX", "RecomputeError", "Segment", "is_random", "order", "rewrite", "segments"]
