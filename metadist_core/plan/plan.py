"""ShardingPlan: what a solver writes and a frontend lowers.

A plan holds a Sharding for every value, the strategy (option index) of every
op, and for every edge (producer value -> consumer op input slot, graph output,
updated state) the exact list of collectives that the cost model priced.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import numpy as np

from metadist_core.cost.model import Collective
from metadist_core.cost.reshard import reshard
from metadist_core.ir.placement import Sharding
from metadist_core.cost.phases import reshard_key
from metadist_core.problem.problem import OUTPUT, ShardingProblem
from metadist_core.discovery.rules import Strategy
from metadist_core.plan.explain import explain_plan
from metadist_core.plan.planstats import PlanStats
from metadist_core.plan.stage import Stage, describe


@dataclass
class PlanEdge:
    """Value ``var`` from ``src`` (a node id) to ``dst`` (op id, ``<output>``, or the state input it updates)."""

    var: str
    src: str
    dst: str
    slot: int  # input slot of dst; -1 for output and state edges
    src_sharding: Sharding
    dst_sharding: Sharding
    collectives: list[Collective]

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.collectives)

    def to_json(self) -> dict:
        return {
            "var": self.var,
            "src": self.src,
            "dst": self.dst,
            "slot": self.slot,
            "src_sharding": self.src_sharding.to_json(),
            "dst_sharding": self.dst_sharding.to_json(),
            "collectives": [c.to_json() for c in self.collectives],
        }

    @classmethod
    def from_json(cls, d) -> "PlanEdge":
        return cls(
            d["var"],
            d["src"],
            d["dst"],
            d["slot"],
            Sharding.from_json(d["src_sharding"]),
            Sharding.from_json(d["dst_sharding"]),
            [Collective.from_json(c) for c in d["collectives"]],
        )


@dataclass
class ShardingPlan:
    """The solver's answer: shardings, strategies, collectives per edge, and the figures of the solve."""

    mesh_shape: tuple[int, ...]
    var_shardings: dict[str, Sharding]
    op_strategies: dict[str, int]  # op id -> option index in the problem
    input_shardings: dict[str, Sharding]  # graph input -> how it is stored
    strategies: dict[str, Strategy]  # op id -> the chosen Strategy (input and output shardings)
    edges: list[PlanEdge]
    objective: float  # seconds per step under the cost model
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    memory_per_device: int = 0  # peak bytes per device over the step
    lower_bound: float | None = None  # from the solver, when it has one
    solver: str = ""
    solve_seconds: float = 0.0
    choices: list[int] = field(default_factory=list)
    stats: PlanStats = field(default_factory=PlanStats)  # the figures beside the choices (planstats.py)
    labels: dict[str, str] = field(default_factory=dict)  # parameter var -> the user's name of it
    problem: ShardingProblem | None = field(default=None, repr=False, compare=False)  # not serialised
    stages: list = field(default_factory=list)  # pipeline stages (metadist_core.plan.stage.Stage); empty: none
    recompute: list[str] = field(default_factory=list)  # forward op ids recomputed for the backward (recompute.py)

    @property
    def gap(self) -> float | None:
        """Relative gap between objective and lower bound (0 = proven optimal)."""
        if self.lower_bound is None:
            return None
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.lower_bound) / self.objective)

    # -- building -----------------------------------------------------------
    @classmethod
    def from_choices(
        cls,
        problem: ShardingProblem,
        choices: Union[Sequence[int], Mapping[str, int], np.ndarray],
        *,
        solver: str = "",
        solve_seconds: float = 0.0,
        lower_bound: float | None = None,
        stats: Mapping[str, Any] | PlanStats | None = None,
    ) -> "ShardingPlan":
        """The plan in which node ``i`` takes option ``choices[i]`` (or a dict node id -> option)."""
        if isinstance(choices, Mapping):
            base = problem.replicated_choice()
            for i, n in enumerate(problem.nodes):
                if n.id in choices:
                    base[i] = int(choices[n.id])
            ch = base
        else:
            ch = np.asarray(choices, dtype=np.int64)
        if len(ch) != len(problem.nodes):
            raise ValueError(f"a plan needs one choice per node: got {len(ch)} for {len(problem.nodes)} nodes")
        for i, (n, k) in enumerate(zip(problem.nodes, ch)):
            if not 0 <= k < len(n.options):
                raise ValueError(f"choice {k} for {n.kind} {n.id!r} is out of range: it has {len(n.options)} options")
            if not problem.allowed[i][k]:
                raise ValueError(f"choice {k} ({n.options[k]}) for {n.kind} {n.id!r} breaks a constraint")
        terms = problem.terms()
        var_sh: dict[str, Sharding] = {}
        op_str: dict[str, int] = {}
        in_sh: dict[str, Sharding] = {}
        strategies: dict[str, Strategy] = {}
        compute = 0.0
        for i, (n, k) in enumerate(zip(problem.nodes, ch)):
            opt = n.options[k]
            for v, s in zip(n.outputs, opt.outputs):
                var_sh[v] = s
            if n.kind == "op":
                op_str[n.id] = int(k)
                strategies[n.id] = opt
            else:
                in_sh[n.id] = opt.outputs[0]
            compute += float(problem.compute[i][k])
        edges = []
        comm = 0.0
        priced: set = set()
        mesh = problem.mesh
        for e in problem.edges:
            src_node = problem.nodes[e.src]
            a = src_node.options[ch[e.src]].outputs[e.src_slot]
            if e.dst < 0:
                b, dst, slot = Sharding.replicated(mesh.ndim), OUTPUT, -1
            elif e.dst_slot < 0:
                dn = problem.nodes[e.dst]
                b, dst, slot = dn.options[ch[e.dst]].outputs[0], dn.id, -1
            else:
                dn = problem.nodes[e.dst]
                b, dst, slot = dn.options[ch[e.dst]].inputs[e.dst_slot], dn.id, e.dst_slot
            info = problem.vars[e.var]
            local = a == b or info["shape"] is None or problem.sliced(e.var)
            colls = [] if local else reshard(a, b, info["shape"], info.get("comm_dtype", info["dtype"]), mesh)
            pe = PlanEdge(e.var, src_node.id, dst, slot, a, b, colls)
            k = reshard_key(e.var, a, b, dst, problem.phases)
            if k not in priced:  # one reshard per (value, target, reader phase), as the lowering runs it
                priced.add(k)
                comm += problem.price(e.var, colls)
            edges.append(pe)
        labels = {
            v: info["label"] for v, info in problem.vars.items() if info.get("label") and info["role"] == "parameter"
        }
        return cls(
            tuple(mesh.shape),
            var_sh,
            op_str,
            in_sh,
            strategies,
            edges,
            compute + comm,
            compute,
            comm,
            terms.peak_memory(ch),
            lower_bound,
            solver,
            solve_seconds,
            [int(x) for x in ch],
            PlanStats.from_json(stats),
            labels,
            problem,
        )

    @classmethod
    def replicated(cls, problem: ShardingProblem, **kw) -> "ShardingPlan":
        """Everything replicated: the plan that needs no communication but the final one."""
        return cls.from_choices(problem, problem.replicated_choice(), solver=kw.pop("solver", "replicated"), **kw)

    # -- queries ------------------------------------------------------------
    def collectives(self) -> list[tuple[PlanEdge, Collective]]:
        """Every collective of the plan with its edge, in edge order."""
        return [(e, c) for e in self.edges for c in e.collectives]

    def edge_index(self) -> tuple[dict[tuple[str, int], PlanEdge], dict[tuple[str, str], PlanEdge]]:
        """The edges by consumer: ``{(op id, input slot): edge}`` and, for the final reshard of a graph
        output or of updated state, ``{(var, dst): edge}`` with dst ``<output>`` or the state input."""
        inputs: dict[tuple[str, int], PlanEdge] = {}
        finals: dict[tuple[str, str], PlanEdge] = {}
        for e in self.edges:
            if e.slot >= 0:
                inputs[(e.dst, e.slot)] = e
            else:
                finals[(e.var, e.dst)] = e
        return inputs, finals

    def edge_collectives(self, var: str, dst: str, slot: int = -1) -> list[Collective]:
        """The collectives between value ``var`` and consumer ``dst`` (op id, ``<output>`` or state input)."""
        for e in self.edges:
            if e.var == var and e.dst == dst and (slot < 0 or e.slot == slot):
                return e.collectives
        raise KeyError(f"the plan has no edge from {var!r} to {dst!r}")

    def digest(self) -> str:
        """A digest of what the plan does (shardings, strategies, collectives), not of how long it took."""
        d = self.to_json()
        core = {k: d[k] for k in ("mesh_shape", "var_shardings", "op_strategies", "input_shardings", "edges")}
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()

    def summary(self) -> str:
        n_coll = sum(1 for _, c in self.collectives() if not c.is_free)
        gap = "" if self.gap is None else f", gap {self.gap:.2%}"
        return (
            f"{self.solver or 'plan'} on mesh {'x'.join(map(str, self.mesh_shape))}: "
            f"{self.objective * 1e3:.3f} ms/step (compute {self.compute_seconds * 1e3:.3f}, "
            f"comm {self.comm_seconds * 1e3:.3f}){gap}, {n_coll} collectives, "
            f"{self.memory_per_device / 2**20:.1f} MiB/device, solved in {self.solve_seconds:.2f} s"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        rows = [("value", "sharding", "then", "collectives")]
        by_var: dict[str, list[PlanEdge]] = {}
        for e in self.edges:
            by_var.setdefault(e.var, []).append(e)
        for v, s in self.var_shardings.items():
            es = [e for e in by_var.get(v, []) if e.collectives]
            if s.is_fully_replicated() and not es:
                continue
            if not es:
                rows.append((v, str(s), "", ""))
            for e in es:
                rows.append(
                    (
                        v,
                        str(s),
                        f"-> {e.dst}[{e.slot}] {e.dst_sharding}" if e.slot >= 0 else f"-> {e.dst} {e.dst_sharding}",
                        "; ".join(str(c) for c in e.collectives if not c.is_free) or "local",
                    )
                )
        shown = rows[:80]
        w = [max(len(r[c]) for r in shown) for c in range(3)]
        lines += ["  ".join(r[c].ljust(w[c]) for c in range(3)) + "  " + r[3] for r in shown]
        if len(rows) > len(shown):
            lines.append(
                f"... {len(rows) - len(shown)} more rows (values not shown are replicated with no collectives)"
            )
        if self.recompute:
            segs = (self.stats.recompute or {}).get("segments")
            lines.append(
                f"recomputed for the backward: {len(self.recompute)} forward ops"
                + (f" in {segs} segments" if segs else "")
                + ": "
                + ", ".join(self.recompute[:12])
                + (" ..." if len(self.recompute) > 12 else "")
            )
        if self.stats.autotune:
            lines.append(describe_autotune(self.stats.autotune))
        if self.stages:
            pl = self.stats.pipeline or {}
            lines.append(describe(self.stages, pl.get("schedule", "1f1b"), pl.get("micro_batches", 1)))
        return "\n".join(lines)

    def placements(self) -> dict[str, tuple]:
        """``{parameter name: its Placements, one per mesh axis}`` as stored (metadist Placements; torch
        DTensor placements come from ``metadist_torch.to_dtensor_placements(plan)``)."""
        return {
            self.labels.get(v, v): tuple(s)
            for v, s in self.input_shardings.items()
            if v in self.labels or (self.problem is not None and self.problem.vars[v]["role"] == "parameter")
        }

    def explain(self, *, presets: bool = True, solver: str | None = None) -> str:
        """Per parameter its placement, bytes per device and why (against the best alternative), per
        collective its kind, axis, bytes and time, the totals, and the presets' prices beside this plan's
        (see :mod:`metadist_core.plan.explain`)."""
        return explain_plan(self, presets=presets, solver=solver)

    # -- JSON ---------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": "metadist.ShardingPlan/1",
            "mesh_shape": list(self.mesh_shape),
            "var_shardings": {k: v.to_json() for k, v in self.var_shardings.items()},
            "op_strategies": self.op_strategies,
            "input_shardings": {k: v.to_json() for k, v in self.input_shardings.items()},
            "strategies": {k: v.to_json() for k, v in self.strategies.items()},
            "edges": [e.to_json() for e in self.edges],
            "objective": self.objective,
            "compute_seconds": self.compute_seconds,
            "comm_seconds": self.comm_seconds,
            "memory_per_device": self.memory_per_device,
            "lower_bound": self.lower_bound,
            "solver": self.solver,
            "solve_seconds": self.solve_seconds,
            "choices": self.choices,
            "stats": self.stats.to_json(),
            **({"labels": self.labels} if self.labels else {}),
            **({"stages": [st.to_json() for st in self.stages]} if self.stages else {}),
            **({"recompute": list(self.recompute)} if self.recompute else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "ShardingPlan":
        if d.get("format") != "metadist.ShardingPlan/1":
            raise ValueError(f"not a ShardingPlan JSON (format {d.get('format')!r})")
        return cls(
            tuple(d["mesh_shape"]),
            {k: Sharding.from_json(v) for k, v in d["var_shardings"].items()},
            {k: int(v) for k, v in d["op_strategies"].items()},
            {k: Sharding.from_json(v) for k, v in d["input_shardings"].items()},
            {k: Strategy.from_json(v) for k, v in d["strategies"].items()},
            [PlanEdge.from_json(e) for e in d["edges"]],
            float(d["objective"]),
            float(d.get("compute_seconds", 0.0)),
            float(d.get("comm_seconds", 0.0)),
            int(d.get("memory_per_device", 0)),
            d.get("lower_bound"),
            d.get("solver", ""),
            float(d.get("solve_seconds", 0.0)),
            list(d.get("choices", [])),
            PlanStats.from_json(d.get("stats")),
            dict(d.get("labels", {})),
            stages=_stages_from_json(d.get("stages", [])),
            recompute=list(d.get("recompute", [])),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


def describe_autotune(figures: dict) -> str:
    """One line: the plans timed and the one kept (for ``str(plan)`` and the CLI)."""

    def label(d: dict) -> str:
        return f"{d['strategy']} ({d['lowering']})" if d.get("lowering") else str(d["strategy"])

    parts = [
        f"{label(c)} {c['measured_ms']:.1f} ms (predicted {c['predicted_ms']:.1f})"
        for c in figures.get("candidates", [])
    ]
    kept = label({"strategy": figures.get("chosen"), "lowering": figures.get("lowering")})
    return f"autotuned: {', '.join(parts)}; running {kept}"


def _stages_from_json(items: list) -> list:
    if not items:
        return []
    return [Stage.from_json(d) for d in items]
