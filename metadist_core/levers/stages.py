"""Pipeline stages: the forward of a step cut into contiguous pieces, and where to cut (Alpa-style DP).

A pipelined step runs its forward as ``k`` **stages** along mesh axis 0; the
backward follows the forward through autograd and the optimizer update runs,
per stage, on that stage's parameters after the last micro-batch
(:mod:`metadist_torch.lower.stages`). This module is the framework-free half:

- :func:`forward_ops` -- the ops of the per-micro-batch part that compute the
  step's returned values (the loss) and new buffers: what the stages run;
- :func:`free_values` -- values computed from constants alone (``arange``,
  ``full``): recomputed in every stage that reads them, never sent;
- :func:`build_stages` -- given cut positions in the (non-free) forward op list,
  the :class:`Stage` list: ops, parameters, devices, and the values each stage
  receives and sends (a value read past the next stage is passed through);
- :func:`crossing_bytes` / :func:`best_cuts` -- the dynamic program over
  contiguous cut points: a stage's time is the sum of its ops' solved intra-op
  costs on the sub-mesh (forward and the backward assigned to it) plus the
  send/recv of what crosses its cut; the step is ``(m + p - 1)`` times the
  slowest stage (the schedule's bubble is ``(p-1)/(m+p-1)`` of it) under a
  per-device memory budget with the micro-batches in flight;
(:mod:`metadist_core.driver.pipeplan` prices each op under the sub-mesh plan and decides whether to pipeline.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from metadist_core.ir.ir import STATE_ROLES, MetaIR, new_buffers
from metadist_core.plan.stage import Stage, StageError, bubble_fraction
import itertools


def free_values(graph: MetaIR, ops: Iterable[str]) -> set[str]:
    """Values of ``ops`` computed from no graph input (constants only): every stage recomputes them."""
    free: set[str] = set()
    for i in ops:
        op = graph.op(i)
        if all(v in free for v in op.inputs):
            free.update(op.outputs)
    return free


def positions(graph: MetaIR, ops: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """The non-free forward ops (those cut points fall between) and each value's producer position there."""
    free = free_values(graph, ops)
    core = [i for i in ops if not all(v in free for v in graph.op(i).outputs)]
    pos = {v: k for k, i in enumerate(core) for v in graph.op(i).outputs}
    return core, pos


def owner_positions(graph: MetaIR, core: Sequence[str]) -> dict[str, int]:
    """For each graph input read by ``core`` ops: the position of its first reader (where it lives)."""
    first: dict[str, int] = {}
    inputs = set(graph.inputs)
    for k, i in enumerate(core):
        for v in graph.op(i).inputs:
            if v in inputs and v not in first:
                first[v] = k
    return first


def crossing_bytes(graph: MetaIR, ops: Sequence[str]) -> list[int]:
    """``out[c]``: bytes that a cut before non-free op ``c`` sends (``c`` in 1..n-1; out[0] = out[n] = 0).

    A value crosses cut ``c`` when it is made (or, for a graph input other than the batch, first read)
    before ``c`` and read at or after it; values read several stages later cross every cut in between.
    Batch inputs enter at stage 0 and cross like any value."""
    core, pos = positions(graph, ops)
    n = len(core)
    born = dict(pos)
    for v, k in owner_positions(graph, core).items():
        born[v] = 0 if graph.vars[v].role == "input" else k
    last: dict[str, int] = {}
    for k, i in enumerate(core):
        for v in graph.op(i).inputs:
            if v in born:
                last[v] = k
    diff = [0] * (n + 2)
    for v, b in born.items():
        e = last.get(v, b)
        if e > b:
            diff[b + 1] += graph.vars[v].nbytes
            diff[e + 1] -= graph.vars[v].nbytes
    out, acc = [0] * (n + 1), 0
    for c in range(n + 1):
        acc += diff[c]
        out[c] = acc if 0 < c < n else 0
    return out


def build_stages(graph: MetaIR, ops: Sequence[str], cuts: Sequence[int]) -> list[Stage]:
    """The stages for cut positions ``cuts`` (sorted, in 1..n-1 over the non-free forward ops)."""
    core, pos = positions(graph, ops)
    n, k = len(core), len(cuts) + 1
    if n < k:
        raise StageError(
            f"pipeline_stages={k} needs at least {k} forward ops to cut between, but the step's "
            f"forward has {n}; use fewer stages (pipeline_stages <= {n})"
        )
    if list(cuts) != sorted(set(cuts)) or any(c <= 0 or c >= n for c in cuts):
        raise StageError(f"cut points {list(cuts)} must be increasing and within 1..{n - 1}")
    bounds = [0, *cuts, n]
    stage_at = [0] * n
    for s in range(k):
        for c in range(bounds[s], bounds[s + 1]):
            stage_at[c] = s
    free = free_values(graph, ops)
    owner = {v: stage_at[c] for v, c in owner_positions(graph, core).items()}
    made_in = {v: stage_at[c] for v, c in pos.items()}
    for v, role in ((v, graph.vars[v].role) for v in owner):
        if role == "input":
            made_in[v] = -1  # the batch enters stage 0 from outside
    readers: dict[str, set[int]] = {}
    for c, i in enumerate(core):
        for v in graph.op(i).inputs:
            readers.setdefault(v, set()).add(stage_at[c])
    state_outs = set(graph.aliases.values())
    final = [o for o in graph.outputs if o not in state_outs] + new_buffers(graph)
    for o in final:
        readers.setdefault(o, set()).add(k)  # the step's outputs leave the last stage
    stages = []
    for s in range(k):
        sops = set(core[bounds[s] : bounds[s + 1]])
        # free ops a stage reads are recomputed there
        need_free = {v for i in sops for v in graph.op(i).inputs if v in free}
        todo = list(need_free)
        while todo:
            v = todo.pop()
            p = graph.vars[v].producer
            if p is not None and p not in sops:
                sops.add(p)
                todo.extend(x for x in graph.op(p).inputs if x in free)
        params = sorted(
            (v for v, o in owner.items() if o == s and graph.vars[v].role in STATE_ROLES), key=graph.inputs.index
        )
        ins, outs = [], []
        for v in list(made_in):
            src = made_in[v] if made_in[v] >= 0 else 0
            rd = readers.get(v, set())
            if not rd:
                continue
            if made_in[v] == -1 and s == 0:
                ins.append(v)
            elif src < s <= max(rd):
                ins.append(v)
            if src <= s < max(rd):
                outs.append(v)
        for v in owner:  # a parameter read by a later stage (tied weights) is sent like an activation
            if graph.vars[v].role in STATE_ROLES and owner[v] < s <= max(readers.get(v, {0})):
                ins.append(v)
            if graph.vars[v].role in STATE_ROLES and owner[v] <= s < max(readers.get(v, {0})):
                outs.append(v)
        ordered = [op.id for op in graph.ops if op.id in sops]
        if s == k - 1:
            outs = list(final)
        stages.append(Stage(s, ordered, params, _unique(ins), _unique(outs)))
    return stages


def _unique(xs: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(xs))


@dataclass
class CutChoice:
    """The DP's answer: where to cut, the slowest stage, the step time and each stage's figures."""

    cuts: list[int]
    stage_times: list[float]
    stage_memory: list[int]
    bottleneck: float
    step_time: float
    bubble: float

    @property
    def stages(self) -> int:
        return len(self.cuts) + 1


def in_flight(schedule: str, m: int, p: int, s: int) -> int:
    """Micro-batches whose activations stage ``s`` holds at once: GPipe all ``m``; 1F1B ``min(m, p - s)``."""
    if schedule == "gpipe":
        return m
    return max(1, min(m, p - s))


def best_cuts(
    op_time: Sequence[float],
    cut_cost: Sequence[float],
    p: int,
    m: int,
    *,
    op_memory: Sequence[float] | None = None,
    act_memory: Sequence[float] | None = None,
    budget: float | None = None,
    schedule: str = "1f1b",
) -> CutChoice | None:
    """Cut ``n`` ops into ``p`` contiguous stages minimising the slowest stage (then the step time).

    ``op_time[i]``: seconds of op ``i`` per micro-batch (forward and its backward); ``cut_cost[c]``:
    seconds to send what crosses a cut before op ``c``; ``op_memory[i]``: bytes op ``i`` keeps for the
    whole step (its parameters and optimizer state); ``act_memory[i]``: bytes of activations it keeps
    per micro-batch in flight. A stage fits when ``state + in_flight * activations <= budget``. Returns
    None when no cut fits. O(p n^2) time.
    """
    n = len(op_time)
    if p < 1 or n < p:
        return None
    om = list(op_memory or [0.0] * n)
    am = list(act_memory or [0.0] * n)
    pre_t, pre_s, pre_a = [0.0], [0.0], [0.0]
    for i in range(n):
        pre_t.append(pre_t[-1] + op_time[i])
        pre_s.append(pre_s[-1] + om[i])
        pre_a.append(pre_a[-1] + am[i])

    def t(a: int, b: int) -> float:
        return pre_t[b] - pre_t[a] + (cut_cost[b] if b < n else 0.0) + (cut_cost[a] if a > 0 else 0.0)

    def mem(a: int, b: int, s: int) -> float:
        return pre_s[b] - pre_s[a] + in_flight(schedule, m, p, s) * (pre_a[b] - pre_a[a])

    INF = float("inf")

    def solve(score: Callable[[float, float], float], cap: float) -> tuple[float, list[int]] | None:
        """best[s][b]: the best score of stages 0..s-1 covering ops [0, b), every stage at most ``cap``."""
        best = [[INF] * (n + 1) for _ in range(p + 1)]
        arg = [[-1] * (n + 1) for _ in range(p + 1)]
        best[0][0] = 0.0
        for s in range(1, p + 1):
            for b in range(s, n - (p - s) + 1):
                for a in range(s - 1, b):
                    if best[s - 1][a] == INF or (budget is not None and mem(a, b, s - 1) > budget):
                        continue
                    ta = t(a, b)
                    if ta > cap:
                        continue
                    cand = score(best[s - 1][a], ta)
                    if cand < best[s][b]:
                        best[s][b], arg[s][b] = cand, a
        if best[p][n] == INF:
            return None
        cuts, b = [], n
        for s in range(p, 0, -1):
            cuts.append(arg[s][b])
            b = arg[s][b]
        return best[p][n], cuts

    # the slowest stage first (exact min-max), then the least total time among cuts that reach it
    first = solve(max, INF)
    if first is None:
        return None
    second = solve(lambda acc, x: acc + x, first[0] * (1 + 1e-12) + 1e-300)
    cuts = (second or first)[1]
    bounds = sorted(cuts)[1:] + [n]
    bounds = [0] + bounds
    times = [t(bounds[s], bounds[s + 1]) for s in range(p)]
    mems = [int(mem(bounds[s], bounds[s + 1], s)) for s in range(p)]
    T = max(times)
    return CutChoice(bounds[1:-1], times, mems, T, (m + p - 1) * T, bubble_fraction(m, p))


def brute_force_cuts(
    op_time: Sequence[float], cut_cost: Sequence[float], p: int, m: int, **kw: Any
) -> CutChoice | None:
    """:func:`best_cuts` by enumerating every cut (for tests; exponential)."""
    n = len(op_time)
    best: CutChoice | None = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        one = _evaluate(op_time, cut_cost, list(cuts), m, **kw)
        if one is not None and (
            best is None or (one.bottleneck, sum(one.stage_times)) < (best.bottleneck, sum(best.stage_times))
        ):
            best = one
    return best


def _evaluate(
    op_time: Sequence[float],
    cut_cost: Sequence[float],
    cuts: list[int],
    m: int,
    *,
    op_memory: Sequence[float] | None = None,
    act_memory: Sequence[float] | None = None,
    budget: float | None = None,
    schedule: str = "1f1b",
) -> CutChoice | None:
    n, p = len(op_time), len(cuts) + 1
    om = list(op_memory or [0.0] * n)
    am = list(act_memory or [0.0] * n)
    bounds = [0, *cuts, n]
    times, mems = [], []
    for s in range(p):
        a, b = bounds[s], bounds[s + 1]
        times.append(sum(op_time[a:b]) + (cut_cost[b] if b < n else 0.0) + (cut_cost[a] if a > 0 else 0.0))
        mems.append(sum(om[a:b]) + in_flight(schedule, m, p, s) * sum(am[a:b]))
        if budget is not None and mems[-1] > budget:
            return None
    T = max(times)
    return CutChoice(list(cuts), times, [int(x) for x in mems], T, (m + p - 1) * T, bubble_fraction(m, p))


def evaluate_cuts(
    op_time: Sequence[float], cut_cost: Sequence[float], cuts: Sequence[int], m: int, **kw: Any
) -> CutChoice | None:
    """The figures of given ``cuts`` (None when a stage passes the budget)."""
    return _evaluate(op_time, cut_cost, list(cuts), m, **kw)


def stage_devices(mesh_shape: Sequence[int], s: int) -> list[int]:
    """Global ranks (row-major) whose coordinate on mesh axis 0 is ``s``."""
    rest = math.prod(mesh_shape[1:])
    return list(range(s * rest, (s + 1) * rest))


__all__ = [
    "CutChoice",
    "free_values",
    "build_stages",
    "crossing_bytes",
    "best_cuts",
    "brute_force_cuts",
    "evaluate_cuts",
    "positions",
    "owner_positions",
    "in_flight",
    "stage_devices",
]
