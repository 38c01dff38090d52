"""Planning a pipeline: the sub-mesh plan, the stage cut, and whether to pipeline at all.

Called by the driver (:func:`metadist_core.driver.compile.compile_step`) on the
planning process. With ``pipeline_stages=k`` the step is planned on the
sub-mesh (mesh axes 1..; a mesh of one axis: one device, replicated) and its
forward cut into ``k`` stages by :func:`metadist_core.levers.stages.best_cuts`; with
``None`` the same pipeline is priced beside the unpipelined plan of the whole
mesh and kept only when the unpipelined plan misses the memory budget or the
pipeline is cheaper under the cost model (:func:`metadist_core.levers.stages.choose_pipeline`).
The stages travel in ``plan.stages`` (the plan is the sub-mesh's).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from metadist_core.ir.ir import MetaIR
from metadist_core.levers.microbatch import cut_at_gradients
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding, shard_shape
from metadist_core.ir.ir import DTYPE_BYTES
from metadist_core.ir.ir import STATE_ROLES, forward_ops
from metadist_core.plan.stage import StageError, describe
from metadist_core.levers.stages import (
    CutChoice,
    best_cuts,
    build_stages,
    crossing_bytes,
    owner_positions,
    positions,
    stage_devices,
)
from metadist_core.cost.model import send_recv_cost
from metadist_core.driver.planner import CompileResult, plan_graph, replicated_plan
from metadist_core.discovery.rules import RuleBook
from metadist_core.driver.pricing import Solver

if TYPE_CHECKING:
    from metadist_core.config import Settings
    from metadist_core.driver.frontend import Frontend
    from metadist_core.driver.planner import CompileResult

log = logging.getLogger("metadist.pipeplan")


@dataclass
class StageCosts:
    """Per non-free forward op: seconds per micro-batch and bytes kept; per cut: seconds of the send."""

    core: list[str]
    op_time: list[float]
    cut_cost: list[float]
    op_memory: list[float]
    act_memory: list[float]


def stage_costs(graph: MetaIR, problem: Any, plan: Any, alpha: float, beta: float) -> StageCosts:
    """Costs of each forward op under ``plan`` (solved on the sub-mesh): the op's chosen compute time plus
    the collectives of its input edges, plus those of the backward and update ops assigned to it (a
    backward op goes with the latest forward op whose value it reads); state bytes (parameters and
    optimizer state, as the stage's update keeps them whole) to the first reader of each parameter;
    activation bytes (each forward value, per device under the plan) to its producer. A cut costs
    ``send_recv_cost(bytes, alpha, beta)`` of the whole values crossing it, forward and back."""

    ops = forward_ops(graph)
    core, pos = positions(graph, ops)
    n = len(core)
    op_time = _op_times(graph, problem, plan, ops, core, pos)
    op_memory = _state_bytes(graph, core)
    act = _activation_bytes(graph, plan, pos, n)
    cross = crossing_bytes(graph, ops)
    # crossing values travel whole (metadist_torch.lower.stages), forward and their gradients back
    cut_cost = [send_recv_cost(b, alpha, beta) * 2 if 0 < c < n else 0.0 for c, b in enumerate(cross)]
    return StageCosts(core, op_time, cut_cost, op_memory, act)


def _op_times(graph: MetaIR, problem: Any, plan: Any, ops: list, core: list, pos: dict[str, int]) -> list[float]:
    """Each forward op's chosen compute time and input collectives, plus those of the backward and update
    ops it takes."""
    index = {nd.id: j for j, nd in enumerate(problem.nodes)} if problem is not None else {}
    edge_cost: dict[str, float] = {}
    for e in getattr(plan, "edges", []):
        edge_cost[e.dst] = edge_cost.get(e.dst, 0.0) + e.cost

    def cost(op_id: str) -> float:
        j = index.get(op_id)
        c = 0.0
        if j is not None and op_id in plan.op_strategies:
            c = float(problem.compute[j][plan.op_strategies[op_id]])
        return c + edge_cost.get(op_id, 0.0)

    n = len(core)
    op_time = [cost(i) for i in core]
    home: dict[str, int] = dict(pos)
    for v, c in owner_positions(graph, core).items():
        home[v] = c
    fwd = set(ops)
    fwd_home = dict(home)
    for op in graph.ops:  # backward and update ops: with the latest forward value (or parameter) they read,
        if op.id in fwd:  # else with the earliest gradient they read (gradients flow towards stage 0)
            continue
        where = [fwd_home[v] for v in op.inputs if v in fwd_home]
        back = [home[v] for v in op.inputs if v in home and v not in fwd_home]
        k = max(where) if where else min(back) if back else n - 1
        op_time[k] += cost(op.id)
        for v in op.outputs:
            home.setdefault(v, k)
    return op_time


def _state_bytes(graph: MetaIR, core: list) -> list[float]:
    """Per forward op, the state bytes of the parameters it reads first: the value, its gradient and its
    optimizer state, kept whole."""
    op_memory = [0.0] * len(core)
    p_bytes = sum(graph.vars[v].nbytes for v in graph.inputs if graph.vars[v].role == "parameter")
    s_bytes = sum(graph.vars[v].nbytes for v in graph.inputs if graph.vars[v].role == "optimizer_state")
    ratio = s_bytes / p_bytes if p_bytes else 0.0  # optimizer state per parameter byte (Adam: ~2)
    for v, c in owner_positions(graph, core).items():
        if graph.vars[v].role in STATE_ROLES:  # the value, its gradient, its optimizer state, kept whole
            op_memory[c] += (
                (2 + ratio) * graph.vars[v].nbytes if graph.vars[v].role == "parameter" else graph.vars[v].nbytes
            )
    return op_memory


def _activation_bytes(graph: MetaIR, plan: Any, pos: dict[str, int], n: int) -> list[float]:
    """Per forward op, the bytes per device of the values it produces under ``plan``."""

    mesh_shape = tuple(plan.mesh_shape)
    mesh = Mesh(mesh_shape)
    rep = Sharding.replicated(len(mesh_shape))

    def local_bytes(v: str) -> int:
        mv = graph.vars[v]
        sh = plan.var_shardings.get(v, plan.input_shardings.get(v, rep))
        try:
            shape = shard_shape(tuple(mv.shape or ()), sh, mesh, (0,) * len(mesh_shape))
        except Exception:  # pragma: no cover - a sharding the shape cannot take: count it whole
            shape = tuple(mv.shape or ())
        return int(math.prod(shape)) * DTYPE_BYTES.get(mv.dtype, 4)

    act = [0.0] * n
    for v, c in pos.items():
        act[c] += local_bytes(v)
    return act


def choose_pipeline(
    flat_time: float,
    flat_memory: float,
    costs: StageCosts,
    p: int,
    m: int,
    *,
    budget: float | None,
    schedule: str = "1f1b",
) -> CutChoice | None:
    """The pipeline with ``p`` stages to run, or None to run unpipelined (``flat_time``/``flat_memory``: the
    step on the whole mesh, all ``m`` micro-batches). Unpipelined wins unless it misses the budget or the
    pipeline's step time is lower."""
    choice = best_cuts(
        costs.op_time,
        costs.cut_cost,
        p,
        m,
        op_memory=costs.op_memory,
        act_memory=costs.act_memory,
        budget=budget,
        schedule=schedule,
    )
    if choice is None:
        return None
    flat_fits = budget is None or flat_memory <= budget
    if flat_fits and flat_time <= choice.step_time:
        return None
    return choice


def check_stages(k: int, mesh: Mesh, schedule: str, micro_batches: int = 1) -> None:
    """``pipeline_stages=k`` must match mesh axis 0, and 1F1B schedules need at least ``k`` micro-batches
    (torch.distributed.pipelining's rule): clear errors quoting the numbers."""
    n0 = mesh.shape[0]
    if k != n0:
        raise StageError(
            f"pipeline_stages={k} puts the stages on mesh axis 0, which has {n0} devices "
            f"(mesh {'x'.join(map(str, mesh.shape))}); use a mesh whose first axis has {k} devices, "
            f"or pipeline_stages={n0}"
        )
    if schedule in ("1f1b", "interleaved") and micro_batches < k:
        raise StageError(
            f"schedule={schedule!r} needs at least as many micro-batches as stages: micro_batches="
            f"{micro_batches} < pipeline_stages={k}; use micro_batches >= {k} or schedule='gpipe'"
        )


def sub_mesh(mesh: Mesh) -> Mesh:
    """The mesh one stage runs on: axes 1.. of ``mesh`` (one device when ``mesh`` has one axis)."""
    if len(mesh.shape) == 1:
        return Mesh((1,), ("stage",))
    return Mesh(mesh.shape[1:], mesh.axis_names[1:], mesh.alpha[1:], mesh.beta[1:], mesh.links[1:] or None)


def has_gradients(graph: MetaIR) -> bool:
    return any(graph.vars[s].role == "optimizer_state" for s in graph.aliases) or any(
        v.role == "gradient" for v in graph.vars.values()
    )


def pipeline_plan(
    graph: MetaIR, mesh: Mesh, settings: Any, solve: Callable[[Mesh, Any], Any], k: int | None, flat: Any = None
) -> Any:
    """The sub-mesh CompileResult whose plan has ``plan.stages`` set, or None (no pipeline chosen).

    ``solve(mesh, settings)`` returns a :class:`~metadist_core.driver.planner.CompileResult` for ``graph`` on ``mesh``;
    ``k`` is the user's stage count (None: the planner decides, with ``flat``, the whole-mesh result,
    as the alternative; ``flat`` None means no unpipelined plan met the budget).
    """
    p = k or mesh.shape[0]
    m = settings.micro_batches
    if k is None and settings.schedule != "gpipe" and m < p:
        return None  # the planner pipelines only where the schedule can run (1F1B: m >= p)
    virtual = 2 if settings.schedule == "interleaved" else 1
    sub = sub_mesh(mesh)
    budget = settings.memory_budget
    # the sub-mesh's plan is every stage's: the devices of one stage hold a piece of it, so it is solved under
    # the budget of all p stages together and the cut holds each stage to the budget (best_cuts). Under the
    # budget itself the whole step would have to fit one stage's devices, and a step that does not could
    # not pipeline at all
    res = solve(sub, settings if budget is None else dataclasses.replace(settings, memory_budget=int(budget * p)))
    plan, problem = res.plan, res.problem
    batch_shape = next(
        (graph.vars[v].shape for v in graph.inputs if graph.vars[v].role == "input" and graph.vars[v].shape), None
    )
    cut = cut_at_gradients(graph, batch_shape[0] if batch_shape else None)
    alpha = mesh.alpha[0] if mesh.alpha else 1e-5
    beta = mesh.beta[0] if mesh.beta else 1e-9
    costs = stage_costs(cut.grad_graph, problem, plan, alpha, beta)
    n_pieces = p * virtual
    if len(costs.core) < n_pieces:
        raise StageError(
            f"pipeline_stages={p}{' (interleaved: 2 per device)' if virtual > 1 else ''} needs "
            f"{n_pieces} pieces of forward to cut, but the step's forward has {len(costs.core)} ops; "
            f"use fewer stages or a deeper model"
        )
    if k is None:
        flat_time = m * flat.plan.objective if flat is not None else float("inf")
        flat_mem = flat.plan.memory_per_device if flat is not None else float("inf")
        choice = choose_pipeline(flat_time, flat_mem, costs, n_pieces, m, budget=budget, schedule=settings.schedule)
        if choice is None:
            return None
    else:
        choice = _cuts_for(costs, n_pieces, m, budget, settings.schedule)
    stages = _place_stages(cut.grad_graph, choice, mesh, p)
    plan.stages = stages
    plan.stats.pipeline = {
        "stages": p,
        "pieces": n_pieces,
        "schedule": settings.schedule,
        "micro_batches": m,
        "bottleneck": choice.bottleneck,
        "step_time": choice.step_time,
        "bubble": choice.bubble,
        "mesh": list(mesh.shape),
    }
    log.info("%s", describe(stages, settings.schedule, m))
    return res


def _cuts_for(costs: Any, n_pieces: int, m: int, budget: int | None, schedule: str) -> Any:
    """The cut into the user's ``n_pieces`` pieces: within the memory budget where one exists, else the fastest."""
    kw = dict(op_memory=costs.op_memory, act_memory=costs.act_memory, schedule=schedule)
    choice = best_cuts(costs.op_time, costs.cut_cost, n_pieces, m, budget=budget, **kw) or best_cuts(
        costs.op_time, costs.cut_cost, n_pieces, m, **kw
    )
    if choice is None:
        raise RuntimeError(
            f"no cut of {len(costs.core)} forward ops into {n_pieces} pipeline pieces, even "
            "without a memory budget; this is a bug in metadist_core.levers.stages.best_cuts"
        )
    return choice


def _place_stages(graph: MetaIR, choice: Any, mesh: Mesh, p: int) -> list:
    """The stages of ``choice``'s cuts of ``graph``, each on its slice of mesh axis 0 with its priced time and memory."""
    stages = build_stages(graph, forward_ops(graph), choice.cuts)
    for st, t, mem in zip(stages, choice.stage_times, choice.stage_memory):
        st.devices = stage_devices(mesh.shape, st.index % p)
        st.cost, st.memory = t, mem
    return stages


def plan_only_pipeline(
    graph: MetaIR, mesh: Mesh, settings: Any, plugins: Any, solver_options: Any, constraints: list
) -> Any:
    """``metadist plan`` with ``pipeline_stages=k``: the stages priced on ``mesh`` (no engine needed)."""
    check_stages(settings.pipeline_stages, mesh, settings.schedule, settings.micro_batches)

    def solve(m: Mesh, st: Any) -> Any:
        if m.size == 1:
            p1, pr1 = replicated_plan(graph, m)
            return CompileResult(graph, RuleBook(), pr1, p1)
        return plan_graph(
            graph, m, plugins=plugins, settings=st, solver_options=solver_options, constraints=constraints
        )

    return pipeline_plan(graph, mesh, settings, solve, settings.pipeline_stages)


def plan_with_pipeline(
    graph: MetaIR, mesh: Mesh, s: Settings, solve_on: Solver, frontend: Frontend
) -> CompileResult | None:
    """The result whose plan is pipelined (``plan.stages`` set) when ``pipeline_stages=k`` asks for one
    or, with ``None``, when no unpipelined plan meets the memory budget and a pipeline does (training
    steps on a frontend that runs pipelines); with ``None`` and a fitting plan, that result; else None."""
    k = s.pipeline_stages
    if k is not None and k > 1:
        return pipeline_plan(graph, mesh, s, solve_on, k)
    if (
        k is not None
        or s.memory_budget is None
        or mesh.shape[0] < 2
        or not has_gradients(graph)
        or not frontend.traits.pipelines
        or s.offload
    ):  # stage programs do not offload (yet)
        return None
    flat: CompileResult | None
    try:
        flat = solve_on(mesh)
        if flat.plan.memory_per_device > s.memory_budget:
            flat = None
    except Exception as e:  # no unpipelined plan meets the budget: a pipeline may
        log.info("no unpipelined plan: %s", e)
        flat = None
    if flat is not None and not flat.plan.recompute:  # the unpipelined plan meets the budget as it is
        return flat
    if flat is None:
        return pipeline_plan(graph, mesh, s, solve_on, None, flat=None)
    try:  # it meets the budget by recomputing: a pipeline may be cheaper
        piped = pipeline_plan(graph, mesh, s, solve_on, None, flat=None)
    except Exception as e:
        log.info("no pipeline beside the recomputing plan: %s", e)
        return flat
    return piped if piped is not None and piped.plan.objective < flat.plan.objective else flat


__all__ = [
    "StageCosts",
    "stage_costs",
    "choose_pipeline",
    "plan_only_pipeline",
    "pipeline_plan",
    "check_stages",
    "sub_mesh",
    "has_gradients",
    "plan_with_pipeline",
]
