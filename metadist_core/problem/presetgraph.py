"""What the strategy presets read of a ShardingProblem, and how they record pins.

:class:`GraphView` gives the def-use structure (producers, readers, roles, the
forward, the optimizer's gradients); :class:`Pins` collects a preset's pins and
the notes on what it could not pin; :func:`split_on` is the one sharding a
preset asks for. :mod:`metadist_core.problem.presets` and
:mod:`metadist_core.problem.tensor_parallel` build on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from metadist_core.problem.constraints import Constraint, Pin, var_name
from metadist_core.ir.walk import walk_upstream
from metadist_core.ir.placement import Replicate, Shard, Sharding

if TYPE_CHECKING:  # pragma: no cover
    from metadist_core.problem.problem import ShardingProblem

MATMULS = frozenset({"mm", "addmm", "linear", "matmul"})
PASS_WEIGHT = frozenset(
    {
        "t",
        "transpose",
        "permute",
        "_to_copy",
        "clone",
        "contiguous",
        "alias",
        "view",
        "_unsafe_view",
        "reshape",
        "detach",
        "convert_element_type",
    }
)
NOT_ELEMENTWISE = frozenset(
    {
        "native_layer_norm",
        "layer_norm",
        "_softmax",
        "softmax",
        "_log_softmax",
        "log_softmax",
        "rms_norm",
        "_fused_rms_norm",
        "native_group_norm",
        "sum",
        "mean",
        "amax",
        "cat",
        "split",
        "split_with_sizes",
        "embedding",
        "bmm",
        "var_mean",
    }
)


@dataclass
class PresetConstraints:
    """What a preset pins on one problem, and what it could not pin (with why)."""

    name: str
    pins: list[Constraint]
    notes: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)  # tp: (column weight, row weight) var ids
    gradients: dict[str, str] = field(default_factory=dict)  # zero2: gradient var -> parameter var


def op_name(key: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``jax.lax.dot_general`` -> ``dot_general``."""
    parts = key.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]


class GraphView:
    """Def-use structure of a ShardingProblem: who makes each value, who reads it, what depends on what."""

    def __init__(self, prob: "ShardingProblem") -> None:
        self.prob = prob
        self.producer: dict[str, int] = {}
        self.readers: dict[str, list[tuple[int, int]]] = {}
        for i, n in enumerate(prob.nodes):
            for v in n.outputs:
                self.producer[v] = i
            for slot, v in enumerate(n.inputs):
                self.readers.setdefault(v, []).append((i, slot))
        self.inputs = [n.id for n in prob.nodes if n.kind == "input"]
        self.role = {v: prob.vars[v]["role"] for v in self.inputs}
        self.params = [v for v in self.inputs if self.role[v] == "parameter"]
        self.states = [v for v in self.inputs if self.role[v] == "optimizer_state"]
        self.batch = [v for v in self.inputs if self.role[v] == "input" and self.shape(v)]
        self.buffers = [v for v in self.inputs if self.role[v] == "buffer"]
        updated = set(prob.aliases.values())
        self.user_outputs = [o for o in prob.outputs if o not in updated]
        self._deps()
        self.forward = self._ancestors(self.user_outputs)
        self.owner = self._owners()

    def shape(self, v: str) -> tuple[int, ...] | None:
        return self.prob.vars[v]["shape"]

    def tensor_shape(self, v: str) -> tuple[int, ...]:
        """:meth:`shape` of a value that must be a tensor (a matmul's weight or activation)."""
        s = self.shape(v)
        if s is None:
            raise ValueError(f"{v!r} of {self.prob.name!r} has no shape: not a tensor")
        return s

    def name(self, i: int) -> str:
        n = self.prob.nodes[i]
        return op_name(n.key) if n.kind == "op" else ""

    def _deps(self) -> None:
        """Per value, a bit mask of the optimizer-state inputs it depends on, and whether it reads the batch."""
        bit = {v: 1 << (k + 1) for k, v in enumerate(self.states)}
        batch = set(self.batch)
        self.dep: dict[str, int] = {}
        for n in self.prob.nodes:
            if n.kind == "input":
                self.dep[n.id] = bit.get(n.id, 0) | (1 if n.id in batch else 0)
                continue
            m = 0
            for v in n.inputs:
                m |= self.dep.get(v, 0)
            for v in n.outputs:
                self.dep[v] = m
        self.state_bits = bit

    def _ancestors(self, vars_: Iterable[str]) -> set[int]:
        """Positions of the nodes ``vars_`` are computed from (their producers included)."""
        return walk_upstream(vars_, self.producer.get, lambda i: self.prob.nodes[i].inputs).ops

    def _owners(self) -> dict[str, str]:
        """Optimizer state -> the one parameter whose update reads it (shared step counters have none)."""
        readers: dict[str, list[str]] = {}
        for p in self.params:
            upd = self.prob.aliases.get(p)
            if upd is None:
                continue
            m = self.dep.get(upd, 0)
            for s in self.states:
                if m & self.state_bits[s]:
                    readers.setdefault(s, []).append(p)
        return {s: ps[0] for s, ps in readers.items() if len(ps) == 1}

    def gradients(self) -> dict[str, str]:
        """Gradient value -> parameter: marked ``gradient`` by the frontend, else the last value of the
        parameter's shape that the update reads, that depends on the batch and on no optimizer state."""
        marked = [v for v, info in self.prob.vars.items() if info["role"] == "gradient"]
        out: dict[str, str] = {}
        for p in self.params:
            upd = self.prob.aliases.get(p)
            if upd is None or upd not in self.producer:
                continue
            starts = [upd] + [self.prob.aliases[s] for s, o in self.owner.items() if o == p and s in self.prob.aliases]
            found = self._grad_of(p, starts, set(marked))
            if found is not None:
                out[found] = p
        return out

    def _grad_of(self, p: str, starts: list[str], marked: set[str]) -> str | None:
        """The gradient of ``p``: the last marked value the update reads; unmarked, the earliest candidate
        that can be a partial sum (the gradient itself: Adam reads ``(1-b1)*g`` and ``g*g``, and only ``g``
        is the one both come from; ``g*g`` cannot be summed across devices), else the last candidate."""
        shape, best, seen = self.shape(p), None, set(starts)
        summable: list[str] = []
        todo = [self.producer[v] for v in starts if v in self.producer]
        visited: set[int] = set()
        while todo:
            i = todo.pop()
            if i in visited:
                continue
            visited.add(i)
            for v in self.prob.nodes[i].inputs:
                if v in seen or v not in self.producer:
                    continue
                seen.add(v)
                d = self.dep.get(v, 0)
                if v in marked or (self.shape(v) == shape and d & 1 and not d & ~1):
                    if best is None or self.producer[v] > self.producer[best]:
                        best = v
                    if v not in marked:
                        if self._summable(v):
                            summable.append(v)
                        todo.append(self.producer[v])  # the value it is computed from may be the gradient
                elif d & ~1:  # still inside the optimizer's update: keep walking
                    todo.append(self.producer[v])
        found = [v for v in seen if v in marked]
        if found:
            return max(found, key=self.producer.__getitem__)
        return min(summable, key=self.producer.__getitem__) if summable else best

    def _summable(self, v: str) -> bool:
        """Can ``v`` be made as a partial sum on every mesh axis (some option of its definer gives it)?"""
        i, s = self.prob.definer(v)
        return any(all(p.is_partial() and p.reduce == "sum" for p in o.outputs[s]) for o in self.prob.nodes[i].options)


# -- shardings -------------------------------------------------------------------------------------


def split_on(shape: Sequence[int] | None, dim: int, axes: Sequence[int], mesh_shape: Sequence[int]) -> Sharding | None:
    """``Shard(dim)`` on ``axes`` and Replicate elsewhere, or None when the dim does not divide evenly."""
    if not shape or not axes or dim >= len(shape):
        return None
    if shape[dim] % math.prod(mesh_shape[a] for a in axes):
        return None
    return Sharding(tuple(Shard(dim) if a in axes else Replicate() for a in range(len(mesh_shape))))


class Pins:
    """The pins and notes of one preset on one problem; ``pin`` says whether it added a pin."""

    def __init__(self, prob: "ShardingProblem", name: str) -> None:
        self.prob, self.out = prob, PresetConstraints(name, [])
        self.done: set[str] = set()

    def pin(self, var: str, sh: Sharding | None, why: str = "") -> bool:
        """Pin ``var`` to ``sh`` (None: replicated, noting ``why``) unless an earlier pin holds it or no rule
        gives ``sh`` (noted); True when this call added the pin."""
        if var in self.done:
            return False
        self.done.add(var)
        if sh is None:
            sh = Sharding.replicated(self.prob.mesh.ndim)
            if why:
                self.out.notes.append(
                    f"{var_name(self.prob, var)} {self.prob.vars[var]['shape']}: {why}; kept replicated"
                )
        i, s = self.prob.definer(var)
        if not any(o.outputs[s] == sh for o in self.prob.nodes[i].options):
            self.out.notes.append(f"{var_name(self.prob, var)}: no rule gives {sh}; left to the solver")
            return False
        self.out.pins.append(Pin(var, sh))
        return True


__all__ = ["MATMULS", "PASS_WEIGHT", "NOT_ELEMENTWISE", "PresetConstraints", "GraphView", "Pins", "op_name", "split_on"]
