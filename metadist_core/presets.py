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
  (sequence-parallel norms where that is cheaper).
- ``tp+dp``: tp on the last mesh axis, ddp on the others.

Optimizer state follows the parameter it belongs to where a preset does not
say otherwise. A dim that does not divide evenly stays replicated, and a pin
no rule allows is left out; both are listed in ``PresetConstraints.notes``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .constraints import Constraint, Forbid, Pin, annotation_pins, apply_constraints, pins_by_name, var_name
from .placement import Partial, Placement, Replicate, Shard, Sharding

if TYPE_CHECKING:  # pragma: no cover
    from .problem import ShardingProblem

PRESETS: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "tp+dp")
ALIASES = {"fsdp": "zero3"}
STRATEGIES: tuple[str, ...] = ("auto",) + PRESETS
MATMULS = frozenset({"mm", "addmm", "linear", "matmul"})
PASS_WEIGHT = frozenset({"t", "transpose", "permute", "_to_copy", "clone", "contiguous", "alias", "view",
                         "_unsafe_view", "reshape", "detach", "convert_element_type"})
NOT_ELEMENTWISE = frozenset({"native_layer_norm", "layer_norm", "_softmax", "softmax", "_log_softmax",
                             "log_softmax", "rms_norm", "_fused_rms_norm", "native_group_norm", "sum", "mean",
                             "amax", "cat", "split", "split_with_sizes", "embedding", "bmm", "var_mean"})


def check_strategy(name: str) -> str:
    """``name`` as a strategy setting ("auto" or a preset); an unknown name is a ValueError listing them."""
    key = str(name).strip().lower()
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} "
                         f"(fsdp is zero3; a preset is a set of constraints on the same plan search)")
    return key


@dataclass
class PresetConstraints:
    """What a preset pins on one problem, and what it could not pin (with why)."""

    name: str
    pins: list[Constraint]
    notes: list[str] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)   # tp: (column weight, row weight) var ids
    gradients: dict[str, str] = field(default_factory=dict)       # zero2: gradient var -> parameter var


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
        seen: set[int] = set()
        todo = [self.producer[v] for v in vars_ if v in self.producer]
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            todo += [self.producer[v] for v in self.prob.nodes[i].inputs if v in self.producer]
        return seen

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
            starts = [upd] + [self.prob.aliases[s] for s, o in self.owner.items()
                              if o == p and s in self.prob.aliases]
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
                        todo.append(self.producer[v])   # the value it is computed from may be the gradient
                elif d & ~1:   # still inside the optimizer's update: keep walking
                    todo.append(self.producer[v])
        found = [v for v in seen if v in marked]
        if found:
            return max(found, key=self.producer.__getitem__)
        return min(summable, key=self.producer.__getitem__) if summable else best

    def _summable(self, v: str) -> bool:
        """Can ``v`` be made as a partial sum on every mesh axis (some option of its definer gives it)?"""
        i, s = self.prob.definer(v)
        return any(all(p.is_partial() and p.reduce == "sum" for p in o.outputs[s])
                   for o in self.prob.nodes[i].options)


# -- shardings -------------------------------------------------------------------------------------


def split_on(shape: Sequence[int] | None, dim: int, axes: Sequence[int], mesh_shape: Sequence[int]
             ) -> Sharding | None:
    """``Shard(dim)`` on ``axes`` and Replicate elsewhere, or None when the dim does not divide evenly."""
    if not shape or not axes or dim >= len(shape):
        return None
    if shape[dim] % math.prod(mesh_shape[a] for a in axes):
        return None
    return Sharding(tuple(Shard(dim) if a in axes else Replicate() for a in range(len(mesh_shape))))


class _Pins:
    def __init__(self, prob: "ShardingProblem", name: str) -> None:
        self.prob, self.out = prob, PresetConstraints(name, [])
        self.done: set[str] = set()

    def pin(self, var: str, sh: Sharding | None, why: str = "") -> None:
        if var in self.done:
            return
        self.done.add(var)
        if sh is None:
            sh = Sharding.replicated(self.prob.mesh.ndim)
            if why:
                self.out.notes.append(f"{var_name(self.prob, var)} {self.prob.vars[var]['shape']}: {why}; "
                                      f"kept replicated")
        i, s = self.prob.definer(var)
        if not any(o.outputs[s] == sh for o in self.prob.nodes[i].options):
            self.out.notes.append(f"{var_name(self.prob, var)}: no rule gives {sh}; left to the solver")
            return
        self.out.pins.append(Pin(var, sh))


def _forbid_readers(g: GraphView, pins: _Pins, var: str, placements: list[Placement]) -> None:
    """Forbid ``placements`` (on any axis) where ``var`` is read, when every reader keeps an option."""
    def ok(sh: Sharding) -> bool:
        return not any(p in placements for p in sh)
    for i, slot in g.readers.get(var, []):
        if not any(ok(o.inputs[slot]) for o in g.prob.nodes[i].options):
            pins.out.notes.append(f"{var_name(g.prob, var)}: a reader cannot avoid {placements}; left open")
            return
    pins.out.pins.extend(Forbid(p, var=var) for p in placements)


def _replicated_update(g: GraphView, pins: _Pins, grads: Iterable[str]) -> None:
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


def preset_constraints(prob: "ShardingProblem", name: str) -> PresetConstraints:
    """The constraints of preset ``name`` on ``prob``."""
    key = ALIASES.get(check_strategy(name), check_strategy(name))
    if key == "auto":
        return PresetConstraints("auto", [])
    g = GraphView(prob)
    nd, shape = prob.mesh.ndim, prob.mesh.shape
    every = list(range(nd))
    tp_axes = every if key == "tp" else ([nd - 1] if key == "tp+dp" else [])
    dp_axes = [a for a in every if a not in tp_axes]
    pins = _Pins(prob, name)
    if tp_axes:
        _tensor_parallel(g, pins, tp_axes)
    for v in g.batch:
        pins.pin(v, split_on(g.shape(v), 0, dp_axes, shape) if dp_axes else None,
                 f"batch dim 0 does not divide by {math.prod(shape[a] for a in dp_axes)}" if dp_axes else "")
    shard_state = key in ("zero1", "zero2", "zero3")
    shard_params = key == "zero3"
    if key in ("ddp", "zero1", "zero2"):   # each device's gradient is a partial sum, reduced for the update
        grads = g.gradients()
        pins.out.gradients = grads
        if not grads:
            pins.out.notes.append("no gradients recognised (no optimizer update reads a batch-dependent value)")
        partial = Sharding(tuple(Partial("sum") for _ in every))
        for v in grads:
            pins.pin(v, partial, "")
            if pins.out.pins and pins.out.pins[-1].var == v:
                if key == "ddp":     # read whole: all-reduced
                    _forbid_readers(g, pins, v, [Shard(d) for d in range(len(g.shape(v) or ()))])
                elif key == "zero2" and split_on(g.shape(v), 0, every, shape) is not None:
                    _forbid_readers(g, pins, v, [Replicate()])   # read split: reduce-scattered
    if key == "ddp":
        _replicated_update(g, pins, pins.out.gradients)
    for p in g.params:
        pins.pin(p, split_on(g.shape(p), 0, every, shape) if shard_params else None,
                 f"dim 0 does not divide by {prob.mesh.size}" if shard_params else "")
    for s in g.states:
        if shard_state:
            pins.pin(s, split_on(g.shape(s), 0, every, shape),
                     f"dim 0 does not divide by {prob.mesh.size}" if g.shape(s) else "")
        else:   # state lives like its parameter
            owner = g.owner.get(s)
            pinned = {c.var: c.sharding for c in pins.out.pins if isinstance(c, Pin)}
            sh = pinned.get(owner) if owner is not None and g.shape(owner) == g.shape(s) else None
            pins.pin(s, sh)
    for b in g.buffers:
        pins.pin(b, None)
    return pins.out


# -- tensor parallelism: column/row pairs and attention heads -------------------------------------------


def _weight_of(g: GraphView, var: str, dims: tuple[int, int] = (0, 1), depth: int = 6
               ) -> tuple[str, tuple[int, int]] | None:
    """The 2-D parameter ``var`` comes from through transposes/casts/views, and which of its dims are
    ``var``'s dims 0 and 1."""
    for _ in range(depth):
        if var in g.role:
            return (var, dims) if g.role[var] == "parameter" and len(g.shape(var) or ()) == 2 else None
        i = g.producer.get(var)
        if i is None or g.name(i) not in PASS_WEIGHT:
            return None
        n = g.prob.nodes[i]
        src = n.inputs[0] if n.inputs else None
        if src is None or len(g.shape(src) or ()) != 2 or len(g.shape(var) or ()) != 2:
            return None
        if g.name(i) in ("t", "transpose", "permute"):
            dims = (dims[1], dims[0])
        var = src
    return None


def _matmul_weight(g: GraphView, i: int) -> tuple[int, str, int, int, str | None] | None:
    """For a forward matmul node: (activation slot, weight, its output-feature dim, contraction dim, bias)."""
    n, name = g.prob.nodes[i], g.name(i)
    if name not in MATMULS or i not in g.forward:
        return None
    if name == "linear" and len(n.inputs) >= 2:
        w = _weight_of(g, n.inputs[1])
        if w is None:
            return None
        bias = n.inputs[2] if len(n.inputs) > 2 and g.role.get(n.inputs[2]) == "parameter" else None
        return 0, w[0], w[1][0], w[1][1], bias
    a, b = (1, 2) if name == "addmm" else (0, 1)
    if len(n.inputs) <= b:
        return None
    w = _weight_of(g, n.inputs[b])
    if w is None:
        return None
    bias = None
    if name == "addmm":
        bw = n.inputs[0]
        bias = bw if g.role.get(bw) == "parameter" and len(g.shape(bw) or ()) == 1 else None
    return a, w[0], w[1][1], w[1][0], bias   # B = W^T-ish: B's dim 1 is the output feature dim


def _follow(g: GraphView, var: str, width: int, depth: int = 12) -> list[int]:
    """Forward matmul nodes that ``var`` reaches (as their activation) through ops keeping its last dim."""
    hits, seen, todo = [], set(), [(var, 0)]
    while todo:
        v, d = todo.pop()
        for i, slot in g.readers.get(v, []):
            if i in seen or i not in g.forward:
                continue
            seen.add(i)
            mw = _matmul_weight(g, i)
            if mw is not None:
                if mw[0] == slot:
                    hits.append(i)
                continue
            if d >= depth or g.name(i) in NOT_ELEMENTWISE or _residual(g, i, v):
                continue
            for o in g.prob.nodes[i].outputs:
                s = g.shape(o)
                if s and s[-1] == width:
                    todo.append((o, d + 1))
    return hits


def _back_to_matmuls(g: GraphView, var: str, depth: int = 10) -> list[int]:
    """The forward matmuls whose outputs reach ``var`` through other ops (views, rotary embeddings)."""
    hits, seen, todo = [], set(), [(var, 0)]
    while todo:
        v, d = todo.pop()
        i = g.producer.get(v)
        if i is None or i in seen or i not in g.forward:
            continue
        seen.add(i)
        if _matmul_weight(g, i) is not None:
            hits.append(i)
        elif d < depth and (g.name(i) not in NOT_ELEMENTWISE or g.name(i) == "cat"):   # cat: a KV cache
            todo += [(u, d + 1) for u in g.prob.nodes[i].inputs if g.role.get(u) is None]
    return hits


def _residual(g: GraphView, i: int, v: str) -> bool:
    """Is node ``i`` an add of ``v`` and another activation of its shape (a residual connection)? A column
    split does not cross one: LLaMA's o_proj output reaches the next q_proj through the residual stream and
    the RMSNorm's elementwise ops, and is no column/row pair with it."""
    if g.name(i) not in ("add", "sub"):
        return False
    return any(u != v and g.shape(u) == g.shape(v) and g.role.get(u) != "parameter"
               for u in g.prob.nodes[i].inputs)


def _tensor_parallel(g: GraphView, pins: _Pins, axes: list[int]) -> None:
    shape = g.prob.mesh.shape
    n_tp = math.prod(shape[a] for a in axes)
    how = f"does not divide by {n_tp}"

    def split(var: str, dim: int, role: str) -> None:
        if var in pins.done:   # pinned by an earlier role (the first one holds)
            return
        sh = split_on(g.shape(var), dim, axes, shape)
        pins.pin(var, sh, f"{role} dim {dim} {how}")
        if sh is not None and role.endswith("weight") and pins.out.pins and pins.out.pins[-1].var == var:
            _read_split(g, pins, var, dim, axes)

    # attention: inputs and output split by heads (dim 1 of [batch, heads, seq, head dim])
    for i in sorted(g.forward):
        n = g.prob.nodes[i]
        if n.kind != "op" or "scaled_dot_product" not in n.key or "backward" in n.key:
            continue
        for v in list(n.inputs[:3]) + list(n.outputs[:1]):
            if len(g.shape(v) or ()) == 4:
                split(v, 1, "attention heads")
        for v in n.inputs[:3]:   # q/k/v projections: column-parallel (a fused qkv weight is left whole)
            shp = g.shape(v) or ()
            for j in _back_to_matmuls(g, v) if len(shp) == 4 else []:
                _, w, out_dim, _, bias = _matmul_weight(g, j)
                if g.shape(w)[out_dim] == shp[1] * shp[3]:
                    split(w, out_dim, "column-parallel weight")
                    if bias is not None:
                        split(bias, 0, "column-parallel bias")
        for j in _follow_any(g, n.outputs[0]):
            _, w, out_dim, in_dim, _ = _matmul_weight(g, j)
            pins.out.pairs.append(("<attention>", w))
            split(w, in_dim, "row-parallel weight")
    # MLP-like chains: column split, then row split
    for i in sorted(g.forward):
        mw = _matmul_weight(g, i)
        if mw is None:
            continue
        _, w1, out1, in1, bias = mw
        width = g.shape(w1)[out1]
        for j in _follow(g, g.prob.nodes[i].outputs[0], width):
            _, w2, out2, in2, _ = _matmul_weight(g, j)
            if w2 == w1 or g.shape(w2)[in2] != width:
                continue
            pins.out.pairs.append((w1, w2))
            split(w1, out1, "column-parallel weight")
            if bias is not None:
                split(bias, 0, "column-parallel bias")
            split(w2, in2, "row-parallel weight")
    if not pins.out.pairs:
        pins.out.notes.append("no column/row matmul pairs or attention found: every parameter stays replicated")


def _read_split(g: GraphView, pins: _Pins, weight: str, dim: int, axes: list[int]) -> None:
    """Megatron never moves a weight: on the tp ``axes``, ``weight`` (split on ``dim``) and the transposes,
    views and casts made of it are read only in that split wherever they are read. (Pinning the stored
    weight alone let the solver gather it and split the batch instead: ZeRO-3's program priced as "tp".)"""
    chain, todo, seen = [], [(weight, dim)], {weight}
    while todo:
        v, d = todo.pop()
        chain.append((v, d))
        for i, _ in g.readers.get(v, []):
            if g.name(i) not in PASS_WEIGHT:
                continue
            for o in g.prob.nodes[i].outputs:
                if o in seen or len(g.shape(o) or ()) != 2:
                    continue
                seen.add(o)
                if g.name(i) in ("t", "transpose", "permute"):
                    todo.append((o, 1 - d))
                elif g.shape(o) == g.shape(v):
                    todo.append((o, d))
    for v, d in chain:
        if not all(any(all(o.inputs[slot][a] == Shard(d) for a in axes) for o in g.prob.nodes[i].options)
                   for i, slot in g.readers.get(v, [])):
            pins.out.notes.append(f"{var_name(g.prob, v)}: a reader cannot take it split on dim {d}; "
                                  f"it may be moved")
            continue
        others = [Replicate()] + [Shard(k) for k in range(len(g.shape(v) or ())) if k != d]
        pins.out.pins.extend(Forbid(p, var=v, axis=a) for p in others for a in axes)


def _follow_any(g: GraphView, var: str, depth: int = 8) -> list[int]:
    """The first forward matmuls ``var`` reaches as their activation, through any ops but matmuls."""
    hits, seen, todo = [], set(), [(var, 0)]
    while todo:
        v, d = todo.pop()
        for i, slot in g.readers.get(v, []):
            if i in seen or i not in g.forward:
                continue
            seen.add(i)
            mw = _matmul_weight(g, i)
            if mw is not None:
                if mw[0] == slot:
                    hits.append(i)
            elif d < depth and g.name(i) in PASS_WEIGHT:
                todo += [(o, d + 1) for o in g.prob.nodes[i].outputs]
    return hits


# -- applying constraints ------------------------------------------------------------------------------


def constrain(prob: "ShardingProblem", extra: Sequence[Constraint]) -> "ShardingProblem":
    """A copy of ``prob`` with ``extra`` constraints added (tables shared, allowed options narrowed)."""
    if not extra:
        return prob
    p = copy.copy(prob)
    p.__dict__.pop("_terms_cache", None)
    p.allowed = [a.copy() for a in prob.allowed]
    p.constraints = list(prob.constraints) + list(extra)
    p.unsteered = getattr(prob, "unsteered", prob)   # what explain and --compare solve the presets on
    apply_constraints(p)
    return p


def steer(prob: "ShardingProblem", strategy: str = "auto", named: Mapping[str, Any] | None = None,
          annotations: Mapping[str, Any] | None = None) -> "ShardingProblem":
    """``prob`` under the user's steering: annotations, constraints by name, then the strategy preset
    (the user's own pins win over the preset's on the same value)."""
    extra: list[Constraint] = []
    if annotations:
        extra += annotation_pins(prob, annotations)
    if named:
        extra += pins_by_name(prob, named)
    if strategy and strategy != "auto":
        mine = {c.var for c in extra}
        extra += [c for c in preset_constraints(prob, strategy).pins if c.var not in mine]
    return constrain(prob, extra)


__all__ = ["PRESETS", "STRATEGIES", "PresetConstraints", "GraphView", "check_strategy", "preset_constraints",
           "constrain", "steer", "split_on", "op_name"]
