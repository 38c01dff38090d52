"""Build the ShardingProblem of a MetaIR on a mesh from the rules discovery found.

One node per graph input (its storage options) and per op (its strategies, the rules expanded to the
N-D mesh, dominated ones pruned), the compute cost of every option (the frontend's FLOPs and bytes on
the device's roofline, times a measured slowdown where the frontend timed the op), the memory terms
over the values' liveness, the user's constraints, and one cost table per edge: the reshards a value
takes from its producer's sharding to each reader's, priced as the lowering runs them
(:meth:`metadist_core.problem.problem.ShardingProblem.price`).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from metadist_core.ir.aliasing import alias_liveness, inplace_state_liveness
from metadist_core.problem.constraints import Constraint, apply_constraints, parse_constraints
from metadist_core.cost.model import DeviceSpec, DEVICE_PRESETS, compute_cost, compute_dtype, itemsize, strategy_split
from metadist_core.problem.distimpls import impl_rules, impl_seconds, impl_workspace
from metadist_core.ir.ir import MetaIR
from metadist_core.cost.phases import reader_phases
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Replicate, Shard, Sharding, largest_local_shape
from metadist_core.problem.problem import (
    BUDGET_GATHER_SHARE,
    GATHER_SHARE,
    Edge,
    Node,
    ShardingProblem,
    _distinct,
    gathers_bucketed,
)
from metadist_core.problem.prune import useful_rules
from metadist_core.cost.reshard import reshard, reshard_costs
from metadist_core.discovery.rules import RuleBook, Strategy, expand_rules
from metadist_core.cost.compression import wire_dtypes
from metadist_core.cost.compression import gradient_chain
from metadist_core.cost.localtime import apply

if TYPE_CHECKING:
    from metadist_core.cost.localtime import LocalTimer
    from metadist_core.discovery.distimpl import DistImplRegistry

log = logging.getLogger("metadist.problem")


def estimate_op_cost(op, graph: MetaIR) -> tuple[float, float]:
    """(flops, bytes) of an op from its tensor sizes when no frontend reports them."""
    ins = [graph.vars[v] for v in op.inputs if graph.vars[v].is_tensor]
    outs = [graph.vars[v] for v in op.outputs if graph.vars[v].is_tensor]
    nbytes = float(sum(v.nbytes for v in ins + outs))
    out_numel = float(sum(v.numel for v in outs))
    name = op.key.split(".")[1] if op.key.count(".") >= 1 else op.key
    if name in ("mm", "addmm", "bmm", "matmul", "dot_general", "linear") and ins and outs and ins[-1].shape:
        k_shape = ins[0].shape if name != "addmm" else ins[1].shape
        if k_shape is None:  # ins holds tensors only
            raise ValueError(f"op {op.id} ({op.key}): a tensor input without a shape")
        k = k_shape[-1]
        return 2.0 * out_numel * k, nbytes
    return out_numel, nbytes


def input_options(shape: tuple[int, ...] | None, mesh: Mesh) -> list[Strategy]:
    """Storage choices of a graph input: every Replicate/Shard combination that splits evenly enough."""
    if shape is None:
        return [Strategy((), (Sharding.replicated(mesh.ndim),))]
    per_axis = [[Replicate()] + ([Shard(d) for d in range(len(shape))] if n > 1 else []) for n in mesh.shape]
    out = []
    for combo in itertools.product(*per_axis):
        if largest_local_shape(tuple(shape), combo, mesh.shape) is not None:
            out.append(Strategy((), (Sharding(combo),)))
    return out


def build_problem(
    graph: MetaIR,
    rulebook: RuleBook,
    mesh: Mesh,
    *,
    op_costs: Mapping[str, tuple[float, float] | tuple[float, float, float]] | None = None,
    constraints: Iterable[Constraint | Mapping] | None = None,
    memory_budget: int | None = None,
    device: DeviceSpec | None = None,
    prune: bool = True,
    grad_compression: str | None = None,
    bucket_bytes: int | None = None,
    bucket_copies: int = 0,
    shard_bucket_bytes: int | None = None,
    phased: bool = True,
    first_bucket_bytes: int | None = None,
    whole_inputs: bool = False,
    gather_share: float | None = None,
    local_timer: "LocalTimer | None" = None,
    dist_impls: "DistImplRegistry | None" = None,
    frontend: str = "",
) -> ShardingProblem:
    """Build the ShardingProblem of ``graph`` on ``mesh`` from the rules in ``rulebook``.

    ``op_costs`` maps op id -> (flops, bytes) as a frontend reports them, or (flops, bytes, slowdown)
    with the op's measured slowdown over its roofline (:func:`metadist_core.cost.model.compute_cost`; missing
    ops are estimated from tensor sizes). ``constraints`` pin a
    value's sharding or forbid a placement. ``memory_budget`` is bytes per device.
    ``prune`` drops dominated rules first (:mod:`metadist_core.problem.prune`); the
    optimum does not change, the problem gets smaller. ``grad_compression`` ("bf16" | "fp16") prices the
    collectives of gradient values at that dtype (``vars[v]["comm_dtype"]``, :mod:`metadist_core.cost.compression`).
    ``bucket_bytes``: the lowering buckets gradient all_reduces up to this size (:meth:`ShardingProblem.price`),
    the first bucket of each (axis, reduce op, dtype) up to ``first_bucket_bytes`` (:func:`metadist_core.cost.gathers.bucket_cap`).
    ``shard_bucket_bytes``: it gathers graph inputs in buckets up to this size (:mod:`metadist_core.cost.gathers`);
    the solver prices such a gather less a share of the latency its bucket-mates pay: ``gather_share``, by
    default :data:`GATHER_SHARE` without a memory budget and :data:`BUDGET_GATHER_SHARE` under one
    (:meth:`ShardingProblem.price`).
    ``whole_inputs``: every process receives each user input whole (the torch frontend), so reading one in a
    layout other than the one it is stored in is a local slice: priced at nothing, run without a collective.
    ``local_timer``: the ops the frontend times at each strategy's local shapes are priced so
    (:mod:`metadist_core.cost.localtime`).
    ``dist_impls``: distributed implementations (ops split with collectives inside them) offered as more rules
    of the ops they serve, where ``frontend`` can lower them (:mod:`metadist_core.problem.distimpls`).
    """
    device = device or DEVICE_PRESETS["cpu"]
    live, views = alias_liveness(graph, graph.liveness())  # a view takes no bytes and holds its base alive
    live = inplace_state_liveness(graph, live, views)  # new state is written into the old in place
    vars_: dict[str, dict[str, Any]]
    vars_ = {
        v.id: {"shape": v.shape, "dtype": v.dtype, "role": v.role, "live": list(live.get(v.id, (0, 0)))}
        for v in graph.vars.values()
    }
    for v in views:
        vars_[v]["view"] = True  # no memory term of its own (metadist_core.ir.aliasing)
    for mv in graph.vars.values():
        if mv.label:
            vars_[mv.id]["label"] = mv.label  # the user's name (explain, constraints by name)
        if mv.experts:
            vars_[mv.id]["experts"] = mv.experts  # a mixture-of-experts weight (the ep preset, explain)
    for v, wire in wire_dtypes(graph, grad_compression).items():
        vars_[v]["comm_dtype"] = wire
    if shard_bucket_bytes:  # inputs the lowering may gather in buckets (metadist_core.cost.gathers)
        for v in graph.inputs:
            if "comm_dtype" not in vars_[v]:
                vars_[v]["gather_bucketed"] = True
                vars_[v]["gather_priced"] = True  # and the solver prices them so (gathers_bucketed)
                vars_[v]["gather_share"] = (
                    float(gather_share)
                    if gather_share is not None
                    else GATHER_SHARE
                    if memory_budget is None
                    else BUDGET_GATHER_SHARE
                )
    if bucket_bytes:
        for v in gradient_chain(graph):
            vars_[v]["bucketed"] = True
    nodes: list[Node] = []
    compute: list[np.ndarray] = []
    strat_cache: dict[tuple, tuple[list[Strategy], list[int]]] = {}
    warned: set[str] = set()
    timed: list = []  # the ops local_timer may price at their local shapes
    by_impl: list = []  # the ops with strategies a distributed implementation runs, priced by its price
    refusals: dict[str, str] = {}  # op id -> why no implementation of its key serves it
    sizes = sorted({n for n in mesh.shape if n > 1})
    useful = (
        useful_rules(graph, rulebook, sizes)
        if prune
        else {op.id: {n: rulebook.rules_for(op, graph, n) for n in sizes} for op in graph.ops}
    )
    for v in graph.inputs:
        mv = graph.vars[v]
        opts = input_options(mv.shape, mesh)
        nodes.append(Node(v, "input", mv.role, [], [v], opts))
        compute.append(np.zeros(len(opts)))
    for pos, op in enumerate(graph.ops):
        t_in = [v for v in op.inputs if graph.vars[v].is_tensor]
        in_shapes = [graph.vars[v].shape for v in t_in]
        out_shapes = [graph.vars[v].shape for v in op.outputs]
        rules = {
            n: tuple(r for r in rs if len(r.inputs) == len(t_in) and len(r.outputs) == len(op.outputs))
            for n, rs in useful[op.id].items()
        }
        if dist_impls is not None and dist_impls.impls:
            why: dict[str, str] = {}
            for n in sizes:
                extra = impl_rules(dist_impls, frontend, op.key, op.attrs, in_shapes, len(op.outputs), n, why)
                if extra:
                    rules[n] = tuple(rules.get(n, ())) + tuple(extra)
            if why and not any(r.impl for rs in rules.values() for r in rs):
                refusals[op.id] = "; ".join(sorted(set(why.values())))
        sig = (op.signature(graph), tuple(sorted(rules.items())))
        if sig not in strat_cache:
            if not any(rules.values()) and op.key not in warned:
                warned.add(op.key)
                log.debug("op %s (%s) has no sharding rules here; it runs replicated", op.id, op.key)
            strats = expand_rules(rules, mesh, in_shapes, out_shapes)
            opts = [Strategy(s.inputs, s.outputs, impls=s.impls) for s in strats] or [
                Strategy(
                    tuple(Sharding.replicated(mesh.ndim) for _ in t_in),
                    tuple(Sharding.replicated(mesh.ndim) for _ in op.outputs),
                )
            ]
            splits = [strategy_split(o.inputs, o.outputs, mesh) for o in opts]
            strat_cache[sig] = (opts, splits)
        opts, splits = strat_cache[sig]
        flops, nbytes, *slow = (op_costs or {}).get(op.id) or estimate_op_cost(op, graph)
        dt = compute_dtype([graph.vars[v].dtype for v in t_in], [graph.vars[v].dtype for v in op.outputs])
        compute.append(np.array([compute_cost(flops, nbytes, s, device, dt, *slow) for s in splits]))
        if local_timer is not None:
            timed.append((len(compute) - 1, op, opts, splits, flops, nbytes, dt))
        if dist_impls is not None and any(o.impls for o in opts):
            by_impl.append((len(compute) - 1, pos, opts, splits, in_shapes, nbytes, dt, slow))
        nodes.append(Node(op.id, "op", op.key, t_in, list(op.outputs), list(opts)))
    if timed and local_timer is not None:  # timed holds ops only where there is a local_timer
        apply(local_timer, graph, mesh, device, timed, compute)
    workspace: dict[int, tuple[int, np.ndarray]] = {}
    for i, pos, opts, splits, shapes, nbytes, dt, slow in by_impl:  # after the timer: it times the op alone
        held = np.zeros(len(opts))
        for j, o in enumerate(opts):
            placed = o.impl_axis()
            if placed is not None and dist_impls is not None:
                size = itemsize(dt or "float32")
                impl = dist_impls.get(placed[1])
                compute[i][j] = impl_seconds(
                    impl, o, placed[0], shapes, size, nbytes, splits[j], mesh, device, dt, *slow
                )
                held[j] = impl_workspace(impl, o, placed[0], shapes, size, mesh)
        if held.any():
            workspace[i] = (pos, held)
    allowed = [np.ones(len(n.options), dtype=bool) for n in nodes]
    cons = parse_constraints(constraints or [])
    prob = ShardingProblem(
        graph.name,
        mesh,
        device,
        vars_,
        nodes,
        compute,
        [],
        allowed,
        len(graph.ops),
        memory_budget,
        cons,
        list(graph.outputs),
        dict(graph.aliases),
        int(bucket_bytes) if bucket_bytes else None,
        reader_phases(graph) if phased else {},
        int(bucket_copies),
        int(shard_bucket_bytes) if shard_bucket_bytes else None,
        first_bucket_bytes=int(first_bucket_bytes) if bucket_bytes and first_bucket_bytes else None,
        whole_inputs=whole_inputs,
        impl_refusals=refusals,
        workspace=workspace,
    )
    apply_constraints(prob)
    prob.edges = _build_edges(prob)
    return prob


def _build_edges(prob: ShardingProblem) -> list[Edge]:
    mesh = prob.mesh
    table_cache: dict[tuple, np.ndarray] = {}
    src_info: dict[str, tuple[int, int, list[Sharding], np.ndarray]] = {}

    def source(var: str):
        if var not in src_info:
            i, s = prob.definer(var)
            uniq, m = _distinct([o.outputs[s] for o in prob.nodes[i].options])
            src_info[var] = (i, s, uniq, m)
        return src_info[var]

    def table(var: str, srcs: list[Sharding], dsts: list[Sharding]) -> np.ndarray:
        info = prob.vars[var]
        dtype = info.get("comm_dtype", info["dtype"])  # what the collectives move (grad_compression)
        # priced as ShardingProblem.price does: gradients' all_reduces in buckets, and inputs the lowering may
        # gather in buckets (metadist_core.cost.gathers) under a whole latency (their share of a bucket's under a
        # memory budget, a little under otherwise: ShardingProblem.price); a plain cost table would make
        # gathering a parameter cost what gathering its transpose does, and the lowering can bucket only the
        # former. The gradient buckets' memory (a reduce_scatter's concatenation held in flight, the copies
        # its chunks are made through) is counted by memprofile
        bucketed = (
            bool(prob.bucket_bytes and info.get("bucketed")),
            gathers_bucketed(prob, var),
            info.get("gather_share"),
        )
        local = prob.sliced(var)
        key = (info["shape"], dtype, tuple(srcs), tuple(dsts), bucketed, local)
        if key not in table_cache:
            t = np.zeros((len(srcs), len(dsts)))
            for r, a in enumerate(srcs if not local else ()):
                if any(bucketed):
                    for c, b in enumerate(dsts):
                        t[r, c] = prob.price(var, reshard(a, b, info["shape"], dtype, mesh)) if a != b else 0.0
                else:
                    t[r, :] = reshard_costs(a, dsts, info["shape"], dtype, mesh)
            table_cache[key] = t
        return table_cache[key]

    edges: list[Edge] = []
    for j, n in enumerate(prob.nodes):
        if n.kind != "op":
            continue
        for slot, var in enumerate(n.inputs):
            i, s, srcs, smap = source(var)
            dsts, dmap = _distinct([o.inputs[slot] for o in n.options])
            edges.append(Edge(i, s, j, slot, var, smap, dmap, table(var, srcs, dsts)))
    rep = Sharding.replicated(mesh.ndim)
    aliased_outputs = set(prob.aliases.values())
    for var in prob.outputs:
        if var in aliased_outputs or prob.vars[var]["shape"] is None:
            continue
        i, s, srcs, smap = source(var)
        edges.append(Edge(i, s, -1, -1, var, smap, np.zeros(1, dtype=np.int32), table(var, srcs, [rep])))
    for state, updated in prob.aliases.items():
        if prob.vars[state]["shape"] is None:
            continue
        i, s, srcs, smap = source(updated)
        j = prob.definer(state)[0]
        dsts, dmap = _distinct([o.outputs[0] for o in prob.nodes[j].options])
        edges.append(Edge(i, s, j, -1, updated, smap, dmap, table(updated, srcs, dsts)))
    return edges
