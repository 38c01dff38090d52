"""ShardingProblem: what a solver reads (built from MetaIR + RuleBook + Mesh by :mod:`metadist_core.problem.build`).

A problem has one **node** per decision: one per graph input tensor (how it is
stored: parameters and optimizer state may live sharded, the batch may be split
on entry) and one per op (which N-D strategy it runs). Each node has
**options**: the input and output Shardings of that choice. Edges carry the
resharding cost from a value's producer to each reader; graph outputs are
returned whole (priced as a reshard to Replicate), and an updated state output
reshards back to its state input's sharding. Memory terms give the bytes per
device of every value under each option, over its liveness.

The problem is self-contained: :meth:`ShardingProblem.to_json` keeps the mesh,
value shapes, options and all cost tables, so recorded problems re-solve
without the MetaIR.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from metadist_core.cost.buckets import bucketed_step
from metadist_core.cost.model import DeviceSpec, local_bytes
from metadist_core.cost.phases import FORWARD, phase_of, share_phase
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding
from metadist_core.problem.elements import Constraint, Edge, Node, parse_constraints
from metadist_core.problem.terms import EdgeTerm, MemTerm, SharedTerm, Terms
import copy

log = logging.getLogger("metadist.problem")

OUTPUT = "<output>"  # consumer name of the final reshard of a graph output

# the part of the latency a bucketed parameter gather saves that the solver counts on (ShardingProblem.price):
# GATHER_SHARE without a memory budget, where a plan gathers few inputs and a lone one pays a whole latency;
# BUDGET_GATHER_SHARE under one, where the plans that meet it gather every layer's parameters, a bucket per
# layer, as FSDP does (priced whole, each of those many gathers a latency, the solver would keep a
# tensor-parallel plan that runs slower than gathering)
GATHER_SHARE = 0.01
BUDGET_GATHER_SHARE = 1.0


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget."""

    # the budget the leanest plan needs with its collectives' buffers, priced when called: set by the driver
    # where the solve that raised the error can count them (metadist_core.levers.recompute.needed)
    need_with_buffers: Callable[[], int] | None = None

    def __init__(self, budget: int, needed: int, mesh: Mesh, how: str = "needs") -> None:
        self.budget, self.needed = int(budget), int(needed)
        super().__init__(
            f"memory budget of {self.budget:,} bytes per device ({self.budget / 2**30:.3f} GiB) cannot be met "
            f"on mesh {mesh}: the plan with the least memory {how} {self.needed:,} bytes per device "
            f"({self.needed / 2**30:.3f} GiB); raise memory_budget to at least {self.needed:,} "
            f"or use more devices"
        )


@dataclass
class ShardingProblem:
    """Candidate strategies per node, reshard tables per edge, memory terms and constraints."""

    name: str
    mesh: Mesh
    device: DeviceSpec
    vars: dict[str, dict]  # id -> {"shape", "dtype", "role", "live": [start, end]}
    nodes: list[Node]
    compute: list[np.ndarray]  # seconds per option
    edges: list[Edge]  # dst -1: final output reshard
    allowed: list[np.ndarray]
    n_steps: int
    memory_budget: int | None = None
    constraints: list[Constraint] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    bucket_bytes: int | None = None  # the lowering buckets gradient all_reduces up to this size (None: off)
    phases: dict[str, int] = field(default_factory=dict)  # op id -> reader phase (metadist_core.cost.phases)
    bucket_copies: int = 0  # extra copies of a gradient bucket where it runs (metadist_core.plan.memprofile)
    shard_bucket_bytes: int | None = None  # the lowering gathers inputs in buckets up to this size (gathers.py)
    toggles: list = field(default_factory=list)  # terms.Toggle: yes/no decisions priced beside (recompute.py)
    step_map: list[int] | None = None  # op position -> position in the toggles' graph (its last: the step count)
    first_bucket_bytes: int | None = None  # the first gradient all_reduce bucket per group (None: bucket_bytes)
    # every process holds each user input ("input" role) whole: any layout of one is a local slice, no collective
    whole_inputs: bool = False
    # op id -> why no registered distributed implementation serves it, for the ops of keys one serves elsewhere
    impl_refusals: dict[str, str] = field(default_factory=dict)
    # node -> (its op's position, bytes per option held inside the op: a distributed implementation's gathers)
    workspace: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)

    # -- structure ----------------------------------------------------------
    def __post_init__(self) -> None:
        self._index = {n.id: i for i, n in enumerate(self.nodes) if n.kind == "op"}
        self._definer: dict[str, tuple[int, int]] = {}
        for i, n in enumerate(self.nodes):
            for s, v in enumerate(n.outputs):
                self._definer[v] = (i, s)

    def output_bytes(self, node: int, slot: int) -> np.ndarray:
        """Bytes per device of output ``slot`` of ``node`` under each of its options."""
        info = self.vars[self.nodes[node].outputs[slot]]
        return np.array(
            [local_bytes(info["shape"], info["dtype"], o.outputs[slot], self.mesh) for o in self.nodes[node].options],
            dtype=float,
        )

    def sliced(self, var: str) -> bool:
        """Whether ``var`` is read in any layout by a local slice, with no collective: a user input every
        process holds whole (``whole_inputs``; interpret's ``whole``)."""
        return self.whole_inputs and self.vars[var]["role"] == "input"

    def op_node(self, op_id: str) -> int:
        """Node index of op ``op_id``."""
        return self._index[op_id]

    def definer(self, var: str) -> tuple[int, int]:
        """(node index, output slot) that defines ``var``."""
        return self._definer[var]

    def price(self, var: str, collectives: Sequence) -> float:
        """Seconds of ``collectives`` moving ``var`` as the lowering runs them.

        The all_reduce of a gradient value (``vars[var]["bucketed"]``) that joins a bucket
        (:func:`metadist_core.cost.buckets.bucketed_step`: the first paid collective of its reshard) runs in buckets of
        ``bucket_bytes`` that pay one latency each: each is charged its bytes in full and
        the latency ``2(n-1)alpha`` times ``min(1, nbytes / bucket_bytes)``, its share of a
        bucket. Summed over an axis that is ``total / bucket_bytes`` latencies, which is
        ``ceil(total / bucket_bytes)`` less at most one: an approximation that a solver can
        price per value (:func:`metadist_core.plan.overlap.predict` counts whole buckets). The
        reduce_scatters of gradient values pay the same way their share of the latency
        ``(n-1)alpha`` of a ``shard_bucket_bytes`` bucket. A graph input moved by exactly one
        all_gather, which the lowering gathers in buckets of ``shard_bucket_bytes``
        (:mod:`metadist_core.cost.gathers`), pays its latency less a share of the part its
        bucket-mates would pay (:func:`gathers_bucketed`; ``vars[var]["gather_share"]``). Without a
        memory budget that share is :data:`GATHER_SHARE`, small: a plan gathers few inputs or many,
        and a lone gather pays a whole latency (charged only its share, a plan that gathers a few small
        inputs one by one would be priced far under what it takes), while the small preference makes a
        parameter's gather, which can be bucketed,
        win over the same gather of its transpose, which cannot. Under a budget it is
        :data:`BUDGET_GATHER_SHARE`, the whole share, as a gradient's: the plans that meet a tight
        budget gather every layer's parameters, a bucket at a time.
        """

        def shared(c: Any, steps: int, cap: int | None, share: float = 1.0) -> float:  # less what bucket-mates pay
            if cap is None:  # a collective joins a bucket only where the problem has a bucket size
                raise ValueError(f"{c.kind} of {var!r} priced in a bucket, but the problem has no bucket size")
            latency = steps * (self.mesh.shape[c.axis] - 1) * self.mesh.link(c.axis, c.kind)[0]
            return c.cost - share * latency * (1.0 - min(1.0, c.nbytes / cap))

        if gathers_bucketed(self, var) and len(collectives) == 1 and collectives[0].kind == "all_gather":
            return shared(collectives[0], 1, self.shard_bucket_bytes, self.vars[var].get("gather_share", GATHER_SHARE))
        at = bucketed_step(
            self, var, collectives
        )  # the one collective that joins a bucket (metadist_core.cost.buckets)
        total = 0.0
        for i, c in enumerate(collectives):
            if i == at:
                total += (
                    shared(c, 2, self.bucket_bytes) if c.kind == "all_reduce" else shared(c, 1, self.shard_bucket_bytes)
                )
            else:
                total += c.cost
        return total

    def size(self) -> dict:
        return {
            "nodes": len(self.nodes),
            "options": int(sum(len(n.options) for n in self.nodes)),
            "edges": sum(1 for e in self.edges if e.dst >= 0),
            "edge_cells": int(sum(e.table.size for e in self.edges if e.dst >= 0)),
        }

    @property
    def terms_read(self) -> bool:
        """Have the problem's terms been built (and cached) already? Edits to its costs after that are not
        seen by :meth:`terms`."""
        return "_terms_cache" in self.__dict__

    def forget_terms(self) -> None:
        """Drop the cached terms (a copy whose allowed options or costs change builds its own)."""
        self.__dict__.pop("_terms_cache", None)
        self.__dict__.pop("_terms_memo", None)

    def terms_memo(self) -> dict:
        """A dict kept with the cached terms, for what a solver derives from them alone (a coarsening): shared
        by the copies that share the terms (:meth:`with_budget`), dropped with them (:meth:`forget_terms`)."""
        self.terms()
        return self.__dict__.setdefault("_terms_memo", {})

    def terms(self) -> Terms:
        """The numeric problem, uncoarsened; output reshards are folded into unary costs (cached)."""
        cached = self.__dict__.get("_terms_cache")
        if cached is None:
            cached = self.__dict__["_terms_cache"] = self._make_terms()
        t = copy.copy(cached)
        t.budget = self.memory_budget
        t.toggles = list(self.toggles)
        if self.step_map is not None:  # memory terms in the positions of the graph the toggles are priced on
            sm = self.step_map
            t.mem = [
                MemTerm(m.node, m.nbytes, sm[m.start] if m.start >= 0 else m.start, sm[m.end] if m.end >= 0 else m.end)
                for m in cached.mem
            ]
            t.n_steps = sm[-1]
        return t

    def _make_terms(self) -> Terms:
        unary = [c.astype(float).copy() for c in self.compute]
        edges = []
        readers: dict[str, list[Edge]] = {}
        for e in self.edges:
            readers.setdefault(e.var, []).append(e)
        shared = []
        for _var, es in readers.items():
            if len(es) > 1:  # read by several ends: one reshard per (value, target, phase), as the lowering runs it
                shared.append(self._shared_term(es))
                continue
            e = es[0]
            if e.dst < 0:
                unary[e.src] += e.table[e.src_map, 0]
            else:
                edges.append(EdgeTerm(e.src, e.dst, e.src_map, e.dst_map, e.table))
        mem = []
        for i, n in enumerate(self.nodes):
            for s, v in enumerate(n.outputs):
                info = self.vars[v]
                if info["shape"] is None or info.get("view") or info.get("host"):  # host: metadist_core.levers.offload
                    continue
                mem.append(MemTerm(i, self.output_bytes(i, s), info["live"][0], info["live"][1]))
        for i, (pos, nbytes) in sorted(self.workspace.items()):  # alive while its op runs, beside its values
            mem.append(MemTerm(i, nbytes, pos, pos))
        return Terms(
            unary,
            edges,
            mem,
            [a.copy() for a in self.allowed],
            self.n_steps,
            self.memory_budget,
            0.0,
            [n.id for n in self.nodes],
            str(self.mesh),
            shared,
        )

    def edge_targets(self, e: Edge) -> list[Sharding]:
        """The target Sharding of each column of ``e.table``."""
        if e.dst < 0:
            return [Sharding.replicated(self.mesh.ndim)]
        opts = self.nodes[e.dst].options
        return _distinct([o.outputs[0] if e.dst_slot < 0 else o.inputs[e.dst_slot] for o in opts])[0]

    def edge_phase(self, e: Edge, source: Sharding | None = None) -> int:
        """The reader phase of edge ``e`` (:mod:`metadist_core.cost.phases`; graph outputs and state are read last);
        with the ``source`` sharding, the phase its reshard is shared in (one for every reader of a Partial)."""
        reader = self.nodes[e.dst].id if e.dst >= 0 and e.dst_slot >= 0 else OUTPUT
        return phase_of(self.phases, reader) if source is None else share_phase(self.phases, reader, source)

    def edge_sources(self, e: Edge) -> list[Sharding]:
        """The source Sharding of each row of ``e.table``."""
        return _distinct([o.outputs[e.src_slot] for o in self.nodes[e.src].options])[0]

    def _shared_term(self, es: list[Edge]) -> SharedTerm:
        """The edges of one value as one SharedTerm over the union of their (target sharding, reader phase)
        columns; under a Partial source the phases of one target share a column (``merge``)."""
        cols: dict[tuple[Sharding, int], int] = {}
        colvals: dict[int, np.ndarray] = {}
        ends = []
        for e in es:
            ph = self.edge_phase(e)
            gmap = np.array([cols.setdefault((t, ph), len(cols)) for t in self.edge_targets(e)], dtype=np.int32)
            for c, gc in enumerate(gmap):
                colvals[int(gc)] = e.table[:, c]
            ends.append((-1, gmap[:1]) if e.dst < 0 else (e.dst, gmap[e.dst_map]))
        table = np.stack([colvals[c] for c in range(len(cols))], axis=1)
        merge = None
        if len({ph for _, ph in cols}) > 1:
            srcs = self.edge_sources(es[0])
            merge = np.tile(np.arange(len(cols), dtype=np.int32), (len(srcs), 1))
            for r, a in enumerate(srcs):
                if a.has_partial():  # one early all_reduce serves every phase (phases.share_phase)
                    for (t, _), c in cols.items():
                        merge[r, c] = cols.get((t, FORWARD), c)
        return SharedTerm(es[0].src, es[0].src_map, ends, table, merge)

    def replicated_choice(self) -> np.ndarray:
        """Per node, the index of its fully replicated option."""
        out = np.zeros(len(self.nodes), dtype=np.int64)
        for i, n in enumerate(self.nodes):
            for k, o in enumerate(n.options):
                if all(s.is_fully_replicated() for s in (*o.inputs, *o.outputs)):
                    out[i] = k
                    break
        return out

    def with_budget(self, budget: int | None) -> "ShardingProblem":
        """The same problem under another memory budget (shares all tables)."""
        p = copy.copy(self)
        p.memory_budget = budget
        return p

    # -- JSON ---------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": "metadist.ShardingProblem/1",
            "name": self.name,
            "mesh": self.mesh.to_json(),
            "device": self.device.to_json(),
            "vars": self.vars,
            "nodes": [n.to_json() for n in self.nodes],
            "compute": [c.tolist() for c in self.compute],
            "edges": [e.to_json() for e in self.edges],
            "allowed": [a.astype(int).tolist() for a in self.allowed],
            "n_steps": self.n_steps,
            "memory_budget": self.memory_budget,
            "constraints": [c.to_json() for c in self.constraints],
            "outputs": self.outputs,
            "aliases": self.aliases,
            **({"bucket_bytes": self.bucket_bytes} if self.bucket_bytes else {}),
            **({"phases": self.phases} if self.phases else {}),
            **({"bucket_copies": self.bucket_copies} if self.bucket_copies else {}),
            **({"shard_bucket_bytes": self.shard_bucket_bytes} if self.shard_bucket_bytes else {}),
            **({"first_bucket_bytes": self.first_bucket_bytes} if self.first_bucket_bytes else {}),
            **({"impl_refusals": self.impl_refusals} if self.impl_refusals else {}),
            **(
                {"workspace": {str(i): [pos, b.tolist()] for i, (pos, b) in self.workspace.items()}}
                if self.workspace
                else {}
            ),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "ShardingProblem":
        if d.get("format") != "metadist.ShardingProblem/1":
            raise ValueError(
                f"not a ShardingProblem JSON (format {d.get('format')!r}, expected 'metadist.ShardingProblem/1')"
            )
        vars_ = {k: {**v, "shape": None if v["shape"] is None else tuple(v["shape"])} for k, v in d["vars"].items()}
        return cls(
            d["name"],
            Mesh.from_json(d["mesh"]),
            DeviceSpec.from_json(d["device"]),
            vars_,
            [Node.from_json(n) for n in d["nodes"]],
            [np.asarray(c, dtype=float) for c in d["compute"]],
            [Edge.from_json(e) for e in d["edges"]],
            [np.asarray(a, dtype=bool) for a in d["allowed"]],
            int(d["n_steps"]),
            d.get("memory_budget"),
            parse_constraints(d.get("constraints") or []),
            list(d.get("outputs", [])),
            dict(d.get("aliases", {})),
            d.get("bucket_bytes"),
            dict(d.get("phases", {})),
            int(d.get("bucket_copies", 0)),
            d.get("shard_bucket_bytes"),
            first_bucket_bytes=d.get("first_bucket_bytes"),
            impl_refusals=dict(d.get("impl_refusals", {})),
            workspace={
                int(i): (int(pos), np.asarray(b, dtype=float)) for i, (pos, b) in d.get("workspace", {}).items()
            },
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "ShardingProblem":
        return cls.from_json(json.loads(text))


def _distinct(shardings: Sequence[Sharding]) -> tuple[list[Sharding], np.ndarray]:
    uniq: dict[Sharding, int] = {}
    idx = [uniq.setdefault(s, len(uniq)) for s in shardings]
    return list(uniq), np.asarray(idx, dtype=np.int32)


def gathers_bucketed(prob: ShardingProblem, var: str) -> bool:
    """Does the solver price ``var``'s all_gather as one the lowering may bucket (``vars[var]["gather_share"]``
    of the latency its bucket-mates pay taken off, :meth:`ShardingProblem.price`)? Yes for an input the lowering
    gathers in buckets."""
    return bool(prob.shard_bucket_bytes and prob.vars[var].get("gather_priced"))


__all__ = [
    "OUTPUT",
    "InfeasibleBudgetError",
    "ShardingProblem",
    "GATHER_SHARE",
    "BUDGET_GATHER_SHARE",
    "gathers_bucketed",
]
