"""Explain a plan: per parameter what was chosen and why, per collective what it moves and costs, the
totals, and the strategy presets' prices beside the plan's; and the same as a picture.

"Why" is read from the problem's own cost tables: for every other storage of a
parameter, its consumers and the op that makes its update are re-chosen at
their best (everything else as planned), and the difference in step time and
in bytes per device is reported against the best of those alternatives.
Presets are solved on the same problem (:mod:`metadist_core.problem.presets`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import numpy as np

from metadist_core.cost.model import Collective, local_bytes
from metadist_core.config import PRESETS
from metadist_core.ir.placement import Sharding
from metadist_core.plan.planstats import PlanStats
from metadist_core.problem.presets import constrain, preset_constraints
from metadist_core.plugins import PluginManager
from pathlib import Path

if TYPE_CHECKING:  # pragma: no cover
    from metadist_core.plugins import PluginManager
    from metadist_core.problem.problem import ShardingProblem

log = logging.getLogger("metadist.explain")
# fsdp is zero3; the cp presets pin the sequence split, which only a model with causal attention can take
COMPARED = tuple(p for p in PRESETS if p != "fsdp" and not p.endswith("cp"))


class PlanView(Protocol):
    """What explaining reads of a plan: a :class:`~metadist_core.plan.plan.ShardingPlan` is one (its module
    imports this one for ``ShardingPlan.explain``, so this one names the type it reads, not the class)."""

    @property
    def mesh_shape(self) -> tuple[int, ...]: ...
    @property
    def choices(self) -> Sequence[int]: ...
    @property
    def input_shardings(self) -> Mapping[str, Sharding]: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def objective(self) -> float: ...
    @property
    def compute_seconds(self) -> float: ...
    @property
    def comm_seconds(self) -> float: ...
    @property
    def memory_per_device(self) -> int: ...
    @property
    def solver(self) -> str: ...
    @property
    def stats(self) -> PlanStats: ...
    @property
    def problem(self) -> "ShardingProblem | None": ...
    @property
    def strategies(self) -> Mapping[str, Any]: ...
    def collectives(self) -> Sequence[tuple[Any, Collective]]: ...


@dataclass
class ParamWhy:
    """One parameter of a plan: its placement, bytes per device and its best alternative."""

    var: str
    name: str
    shape: tuple
    sharding: Any
    nbytes: int
    alt: Any = None  # the best other storage, or None when there is none
    alt_dt: float = 0.0  # seconds per step the alternative adds (negative: it would be faster)
    alt_dbytes: int = 0  # bytes per device it adds
    pinned: bool = False  # a constraint or preset leaves no other choice


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


class _Local:
    """Step-time changes of re-choosing one node and its neighbours, from the problem's cost tables."""

    def __init__(self, prob: "ShardingProblem", choices: Sequence[int]) -> None:
        self.t = prob.terms()
        self.ch = np.asarray(choices, dtype=np.int64).copy()
        self.by_node: dict[int, list[int]] = {}
        for k, e in enumerate(self.t.edges):
            self.by_node.setdefault(e.src, []).append(k)
            self.by_node.setdefault(e.dst, []).append(k)
        self.shared_by_node: dict[int, list[int]] = {}  # values read by several ops: paid once per target
        for k, g in enumerate(self.t.shared):
            for n in {g.src, *(r for r, _ in g.readers)} - {-1}:
                self.shared_by_node.setdefault(n, []).append(k)

    def cost(self, nodes: set[int], ch: np.ndarray) -> float:
        total = sum(float(self.t.unary[i][ch[i]]) for i in nodes)
        total += sum(self.t.shared[k].cost(ch) for k in {k for i in nodes for k in self.shared_by_node.get(i, [])})
        for k in {k for i in nodes for k in self.by_node.get(i, [])}:
            e = self.t.edges[k]
            total += float(e.table[e.src_map[ch[e.src]], e.dst_map[ch[e.dst]]])
        return total

    def alternative(self, i: int, k: int) -> float:
        """Seconds added by node ``i`` taking option ``k``, its neighbours re-chosen at their best."""
        nb = {e for kk in self.by_node.get(i, []) for e in (self.t.edges[kk].src, self.t.edges[kk].dst)} - {i}
        for kk in self.shared_by_node.get(i, []):
            g = self.t.shared[kk]
            nb |= {g.src, *(r for r, _ in g.readers)} - {i, -1}
        region = {i} | nb
        ch = self.ch.copy()
        ch[i] = k
        for j in sorted(nb):
            opts = np.flatnonzero(self.t.allowed[j])
            best, best_m = math.inf, ch[j]
            for m in opts:
                ch[j] = m
                c = self.cost({j}, ch)
                if c < best:
                    best, best_m = c, m
            ch[j] = best_m
        return self.cost(region, ch) - self.cost(region, self.ch)


def parameter_reasons(plan: PlanView, prob: "ShardingProblem") -> list[ParamWhy]:
    """Every parameter of ``prob`` with its placement in ``plan`` and its best alternative."""
    local = _Local(prob, plan.choices) if len(plan.choices) == len(prob.nodes) else None
    out = []
    for i, n in enumerate(prob.nodes):
        if n.kind != "input" or prob.vars[n.id]["role"] != "parameter":
            continue
        info = prob.vars[n.id]
        sh = plan.input_shardings[n.id]
        why = ParamWhy(
            n.id,
            info.get("label") or n.id,
            tuple(info["shape"] or ()),
            sh,
            local_bytes(info["shape"], info["dtype"], sh, prob.mesh),
        )
        if local is not None:
            k0 = int(plan.choices[i])
            alts = [k for k in range(len(n.options)) if k != k0]
            why.pinned = int(prob.allowed[i].sum()) <= 1
            best = None
            for k in alts:
                dt = local.alternative(i, k)
                if best is None or dt < best[1]:
                    best = (k, dt)
            if best is not None:
                alt = n.options[best[0]].outputs[0]
                why.alt, why.alt_dt = alt, best[1]
                why.alt_dbytes = local_bytes(info["shape"], info["dtype"], alt, prob.mesh) - why.nbytes
        out.append(why)
    return out


def _reason(w: ParamWhy, budget: int | None) -> str:
    if w.alt is None:
        return "the only storage that splits evenly"
    tail = (
        f"{w.alt}: {'+' if w.alt_dt >= 0 else ''}{w.alt_dt * 1e6:.1f} us, "
        f"{'+' if w.alt_dbytes >= 0 else ''}{_fmt_bytes(w.alt_dbytes)}/device"
    )
    if w.pinned:
        return f"pinned (strategy or constraint); unpinned best {tail}"
    if w.alt_dt >= 0:
        return f"cheapest; next best {tail}"
    return (
        f"fits memory{' budget ' + _fmt_bytes(budget) if budget else ''} / keeps the plan's total lowest; "
        f"locally faster {tail}"
    )


def expert_ranges(sharding: Sharding, experts: int, mesh_shape: Sequence[int]) -> list[tuple[int, int]]:
    """Per device (ranks in row-major mesh order): the experts ``[first, last]`` it holds of a weight whose dim
    0 indexes ``experts`` experts and which is stored with ``sharding``."""
    axes = [a for a, p in enumerate(sharding) if p.is_shard() and p.dim == 0]
    blocks = math.prod(mesh_shape[a] for a in axes)
    per = experts // blocks if blocks and experts % blocks == 0 else experts
    out = []
    for rank in range(math.prod(mesh_shape)):
        coord = np.unravel_index(rank, tuple(mesh_shape))
        b = 0
        for a in axes:  # dim 0 split over the axes in order, the first the outermost
            b = b * mesh_shape[a] + int(coord[a])
        first = b * per if per < experts else 0
        out.append((first, first + per - 1))
    return out


def expert_lines(plan: PlanView, prob: "ShardingProblem") -> list[str]:
    """Where each expert of each mixture-of-experts weight lives (none: no lines)."""
    rows = []
    for v, info in prob.vars.items():
        n = info.get("experts")
        if not n or info["role"] != "parameter" or v not in plan.input_shardings:
            continue
        ranges = expert_ranges(plan.input_shardings[v], n, plan.mesh_shape)
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, rg in enumerate(ranges):
            groups.setdefault(rg, []).append(rank)
        where = "; ".join(
            f"{'expert' if a == b else 'experts'} {a}{'' if a == b else f'-{b}'} on rank{'s' if len(rs) > 1 else ''} "
            f"{','.join(map(str, rs))}"
            for (a, b), rs in groups.items()
        )
        rows.append(f"  {info.get('label') or v} ({n} experts, {plan.input_shardings[v]}): {where}")
    return ["", "experts"] + rows if rows else []


def impl_lines(plan: PlanView) -> list[str]:
    """The ops a distributed implementation runs, grouped by implementation and mesh axis (none: no lines):
    for context parallelism, where the sequence is split."""
    groups: dict[tuple[str, int], list[str]] = {}
    for op_id, st in plan.strategies.items():
        placed = st.impl_axis()
        if placed is not None:
            groups.setdefault((placed[1], placed[0]), []).append(op_id)
    rows = [
        f"  {name} on mesh axis {axis} ({plan.mesh_shape[axis]} ways): {len(ops)} op(s): "
        f"{', '.join(ops[:4])}{' ...' if len(ops) > 4 else ''}"
        for (name, axis), ops in sorted(groups.items())
    ]
    return ["", "distributed implementations (collectives inside the op)"] + rows if rows else []


# -- presets ----------------------------------------------------------------------------------------


def compare_presets(
    prob: "ShardingProblem",
    solver: str = "ilp",
    plugins: "PluginManager | None" = None,
    options: dict | None = None,
    names: Sequence[str] = COMPARED,
) -> list[dict]:
    """Each preset solved on ``prob`` (its unsteered form): name, seconds, compute, comm, bytes per device,
    collectives, and a note (what could not be pinned, or why it has no plan)."""
    pm = plugins or PluginManager()
    base = getattr(prob, "unsteered", prob)
    if not any(i.get("experts") for i in base.vars.values()):
        names = [n for n in names if n != "ep"]  # without experts, ep is ddp
    rows = []
    for name in names:
        try:
            pc = preset_constraints(base, name)
            p = pm.solve(solver, constrain(base, pc.pins), dict(options or {}))
            rows.append(
                {
                    "strategy": name,
                    "objective": p.objective,
                    "compute": p.compute_seconds,
                    "comm": p.comm_seconds,
                    "memory": p.memory_per_device,
                    "collectives": sum(1 for _, c in p.collectives() if not c.is_free),
                    "note": f"{len(pc.notes)} pins left out" if pc.notes else "",
                }
            )
        except Exception as e:  # an infeasible preset is a row, not a failure of the whole comparison
            rows.append({"strategy": name, "objective": None, "note": f"no plan: {str(e).splitlines()[0][:90]}"})
    return rows


def preset_table(plan: PlanView, rows: Sequence[dict]) -> list[str]:
    """The comparison as text lines, the plan's own row first."""
    own = plan.stats.strategy or "auto"
    head = f"{'strategy':<10} {'ms/step':>9} {'compute':>9} {'comm':>9} {'MiB/device':>11} {'collectives':>11}  vs plan"
    lines = [head, "-" * len(head)]
    n_coll = sum(1 for _, c in plan.collectives() if not c.is_free)
    lines.append(
        f"{own + ' (plan)':<10} {_ms(plan.objective):>9} {_ms(plan.compute_seconds):>9} "
        f"{_ms(plan.comm_seconds):>9} {plan.memory_per_device / 2**20:>11.2f} {n_coll:>11}  1.00x"
    )
    for r in rows:
        if r.get("objective") is None:
            lines.append(f"{r['strategy']:<10} {'-':>9} {'-':>9} {'-':>9} {'-':>11} {'-':>11}  {r['note']}")
            continue
        ratio = r["objective"] / plan.objective if plan.objective > 0 else float("nan")
        lines.append(
            f"{r['strategy']:<10} {_ms(r['objective']):>9} {_ms(r['compute']):>9} {_ms(r['comm']):>9} "
            f"{r['memory'] / 2**20:>11.2f} {r['collectives']:>11}  {ratio:.2f}x"
            + (f"  ({r['note']})" if r["note"] else "")
        )
    return lines


# -- the text ----------------------------------------------------------------------------------------


def explain_plan(
    plan: PlanView,
    *,
    presets: bool = True,
    solver: str | None = None,
    problem: "ShardingProblem | None" = None,
    max_collectives: int = 80,
) -> str:
    """The plan explained as text (see the module docstring). Without its problem (a plan read back from
    JSON alone) the reasons and the presets are left out, and said to be."""
    prob = problem if problem is not None else plan.problem
    mesh = "x".join(map(str, plan.mesh_shape))
    lines = [f"plan on mesh {mesh} ({plan.stats.strategy or 'auto'}, solver {plan.solver or '?'})", ""]
    names = dict(plan.labels)
    if prob is not None:
        names.update({v: i["label"] for v, i in prob.vars.items() if i.get("label")})
    lines.append("parameters")
    if prob is not None:
        whys = parameter_reasons(plan, prob)
        w0 = max([len(w.name) for w in whys] + [9])
        lines.append(f"  {'name':<{w0}}  {'shape':<14} {'placement':<14} {'bytes/device':>12}  why")
        for w in whys:
            lines.append(
                f"  {w.name:<{w0}}  {'x'.join(map(str, w.shape)) or '()':<14} {str(w.sharding):<14} "
                f"{_fmt_bytes(w.nbytes):>12}  {_reason(w, prob.memory_budget)}"
            )
    else:
        for v, name in names.items():
            lines.append(f"  {name:<40} {plan.input_shardings.get(v)}")
        lines.append(
            "  (reasons need the plan's problem: explain the plan in the process that made it, or pass "
            "its problem JSON)"
        )
    if prob is not None:
        lines += expert_lines(plan, prob)
    lines += impl_lines(plan)
    lines += ["", "collectives"]
    colls = [(e, c) for e, c in plan.collectives() if not c.is_free]
    lines.append(f"  {'value':<32} {'to':<18} {'kind':<15} {'axis':>4} {'bytes':>10} {'time ms':>9}")
    for e, c in colls[:max_collectives]:
        lines.append(
            f"  {names.get(e.var, e.var)[:32]:<32} {e.dst[:18]:<18} {c.kind:<15} {c.axis:>4} "
            f"{_fmt_bytes(c.nbytes):>10} {_ms(c.cost):>9}"
        )
    if len(colls) > max_collectives:
        lines.append(f"  ... {len(colls) - max_collectives} more")
    by_kind: dict[str, list[float]] = {}
    for _, c in colls:
        by_kind.setdefault(c.kind, [0, 0.0, 0.0])
        by_kind[c.kind][0] += 1
        by_kind[c.kind][1] += c.nbytes
        by_kind[c.kind][2] += c.cost
    for k, (n, b, t) in sorted(by_kind.items()):
        lines.append(f"  {k}: {int(n)} x, {_fmt_bytes(b)}, {_ms(t)} ms")
    lines += [
        "",
        "totals per device",
        f"  step {_ms(plan.objective)} ms = compute {_ms(plan.compute_seconds)} ms + communication "
        f"{_ms(plan.comm_seconds)} ms; peak memory {_fmt_bytes(plan.memory_per_device)}"
        + (f" (budget {_fmt_bytes(prob.memory_budget)})" if prob is not None and prob.memory_budget else ""),
        budget_line(plan),
    ]
    if presets and prob is not None and math.prod(plan.mesh_shape) > 1:
        lines += ["", "strategy presets on the same problem"]
        rows = compare_presets(prob, solver or _solver_name(plan))
        lines += ["  " + s for s in preset_table(plan, rows)]
    return "\n".join(lines)


def budget_line(plan: PlanView) -> str:
    """Which memory budget the plan was made to fit and where it came from (``plan.stats.budget``)."""
    b = getattr(getattr(plan, "stats", None), "budget", None)
    if not b:
        return "  memory budget: not recorded"
    size = "no limit" if b.get("bytes") is None else _fmt_bytes(b["bytes"])
    return f"  memory budget: {size}, from {b.get('source', '?')}"


def _solver_name(plan: PlanView) -> str:
    name = plan.solver or "ilp"
    return name if name in PluginManager().names("solver") else "ilp"


def problem_path(plan_path: str) -> str:
    """Where the problem of a saved plan lives: ``gpt.plan.json`` -> ``gpt.problem.json``."""
    p = str(plan_path)
    return p[: -len(".plan.json")] + ".problem.json" if p.endswith(".plan.json") else p + ".problem.json"


def report_plan_only(result: Any, request: dict, settings: Any, plugins: "PluginManager | None" = None) -> None:
    """After a plan-only run saved its plan: save the (unsteered) problem beside it, and with ``compare``
    print every preset priced on the same problem beside the plan."""

    prob, plan = result.problem, result.plan
    if prob is None or plan is None:
        return
    out = request.get("out") or f"{result.graph.name}.plan.json"
    Path(problem_path(out)).write_text(getattr(prob, "unsteered", prob).dumps())
    if request.get("compare"):
        rows = compare_presets(prob, settings.solver, plugins)
        print("strategy presets priced on the same problem:")
        print("\n".join(preset_table(plan, rows)))


__all__ = [
    "ParamWhy",
    "parameter_reasons",
    "compare_presets",
    "preset_table",
    "explain_plan",
    "problem_path",
    "report_plan_only",
]
