"""``metadist_compile``: trace a training step once per input signature, plan it, run it on every rank.

    @metadist_compile()
    def train_step(model, optimizer, inputs, labels):
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss

On each call the step's signature (tensor shapes, dtypes and devices, the
other arguments by value, modules and optimizers by identity) picks a compiled
entry; a new signature traces and plans once. Compiling goes
trace (rank 0, through the frontend hook) -> discover and solve (rank 0,
through ``metadist_core.pipeline.plan_graph``) -> one broadcast of the graph
(MetaIR JSON), the plan (ShardingPlan JSON) and what the runner needs of the
trace, so that every rank runs the same plan -> lower (every rank, through
the frontend hook). No other service is involved.

State lives sharded: parameters become DTensor ``nn.Parameter``s over the
torch DeviceMesh with the plan's storage placements, optimizer state entries
become DTensors, buffers too, so that ``torch.distributed.checkpoint`` can save
them; each call feeds their local shards to the per-rank program and writes
the new shards back in place. Inputs are split on entry (every rank passes the
whole batch), returned values are whole on every rank. At world size 1 the
traced functional graph runs directly on plain tensors.

Random ops run replicated; at the first compile every rank takes rank 0's
random state, so all ranks (and a single-device run seeded the same way)
draw the same numbers.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from metadist_core.config import load_settings
from metadist_core.placement import Sharding

from .engine import Engine, make_engine
from .lower import CommStats, LoweredStep, local_piece
from .trace import ROLE_BUFFER, ROLE_PARAM, TracedStep, collect_state, init_optimizer_state, trace_step

log = logging.getLogger("metadist.torch")


def _sig_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), str(x.dtype), str(x.device), bool(x.requires_grad))
    if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        return ("O", id(x))
    if isinstance(x, (int, float, bool, str, type(None))):
        return ("V", type(x).__name__, x)
    return ("R", type(x).__name__, repr(x))


def signature(args: tuple, kwargs: dict) -> tuple:
    """The cache key of a call: argument structure, tensor metadata, other values."""
    leaves, spec = pytree.tree_flatten((list(args), dict(kwargs)), is_leaf=lambda x: isinstance(
        x, (torch.nn.Module, torch.optim.Optimizer)))
    return (str(spec), tuple(_sig_leaf(x) for x in leaves))


@dataclass
class CompiledEntry:
    """One compiled signature: the trace, the plan and this rank's program."""

    traced: TracedStep
    plan: Any
    runner: Callable
    timings: dict[str, float] = field(default_factory=dict)
    problem: Any = None


class RankProgram:
    """Runs a LoweredStep on this rank: local shards in, whole outputs back, new shards written in place."""

    def __init__(self, traced: TracedStep, lowered: LoweredStep, plan: Any, engine: Engine) -> None:
        self.traced, self.lowered, self.plan, self.engine = traced, lowered, plan, engine
        g = traced.graph
        slots = traced.state.slots
        self.slot_of = {traced.in_names[i]: i for i in range(len(slots))}
        n_s = len(slots)
        self.user_in = {traced.in_names[n_s + j]: j for j in range(traced.n_inputs)}
        self.const_local = {}
        rep = Sharding.replicated(engine.mesh.ndim)
        for k, name in enumerate(traced.in_names[n_s + traced.n_inputs:]):
            sh = plan.input_shardings.get(name, rep)
            self.const_local[name] = local_piece(traced.constants[k].to(engine.device), sh, engine.mesh,
                                                 engine.coords)
        self.in_shardings = [plan.input_shardings.get(v, rep) for v in lowered.input_vars]
        self.out_index = {v: i for i, v in enumerate(lowered.output_vars)}
        self.state_write = [(len(lowered.output_vars) + i, self.slot_of[s]) for i, s in enumerate(lowered.state_inputs)]

    def __call__(self, user_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        slots = self.traced.state.slots
        mesh, coords = self.engine.mesh, self.engine.coords
        local = []
        for v, sh in zip(self.lowered.input_vars, self.in_shardings):
            i = self.slot_of.get(v)
            if i is not None:
                local.append(_local_of(slots[i].get()))
            elif v in self.user_in:
                local.append(local_piece(user_tensors[self.user_in[v]].to(self.engine.device), sh, mesh, coords))
            else:
                local.append(self.const_local[v])
        with torch.no_grad():
            outs = self.lowered(*local)
            for k, i in self.state_write:
                _local_of(slots[i].get()).copy_(outs[k])
        return [None if v is None else outs[self.out_index[v]] for v in self.traced.out_vars[:self.traced.n_outputs_t]]


def _local_of(t: torch.Tensor) -> torch.Tensor:
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t


class LocalProgram:
    """World size 1: the traced functional graph on plain tensors; new state swapped in with ``.data``."""

    def __init__(self, traced: TracedStep) -> None:
        self.traced = traced
        self.writes = [(k, o) for k, o in enumerate(traced.state_out) if o is not None]

    def __call__(self, user_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        slots = self.traced.state.slots
        vals = [s.get() for s in slots]
        with torch.no_grad():
            outs = self.traced.gm(*vals, *user_tensors)
            for k, o in self.writes:
                vals[k].data = outs[o]
        return list(outs[:self.traced.n_outputs_t])


class MetadistStep:
    """The decorated step: call it like the original; ``.plan`` is the ShardingPlan of its last compile."""

    def __init__(self, fn: Callable, mesh: Any = None, solver: str | None = None, memory_budget: int | None = None,
                 cache_dir: str | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.mesh_arg = mesh
        self.solver, self.memory_budget, self.cache_dir = solver, memory_budget, cache_dir
        self.cache: dict[tuple, CompiledEntry] = {}
        self.engine: Engine | None = None
        self.last: CompiledEntry | None = None
        self.comm_stats = CommStats()
        self._state_ready = False
        self._plan_fn: Callable | None = None   # (graph, mesh) -> ShardingPlan, run on rank 0 instead of solving

    # -- public -------------------------------------------------------------
    @property
    def plan(self):
        """The ShardingPlan of the last compile (None before the first call)."""
        return None if self.last is None else self.last.plan

    @property
    def graph(self):
        return None if self.last is None else self.last.traced.graph

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of the last compile: trace, discover, build_problem, solve, lower."""
        return {} if self.last is None else dict(self.last.timings)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature(args, kwargs)
        entry = self.cache.get(key)
        if entry is None:
            entry = self.compile(*args, **kwargs)
            self.cache[key] = entry
        self.last = entry
        leaves = pytree.tree_leaves((list(args), dict(kwargs)))
        user = [x.detach() for x in leaves if isinstance(x, torch.Tensor)]
        outs = entry.runner(user)
        return _unflatten_outputs(entry.traced, outs)

    # -- compiling ----------------------------------------------------------
    def compile(self, *args: Any, **kwargs: Any) -> CompiledEntry:
        from metadist_core import planonly
        from metadist_core.plugins import PluginManager
        if planonly.requested():  # `metadist plan SCRIPT`: trace here, plan for the mesh asked, stop the script
            pm = PluginManager()
            init_optimizer_state(_optimizers(args, kwargs))
            graph = pm.hook.metadist_trace(frontend="torch", fn=self.fn, args=args, kwargs=kwargs)
            planonly.finish(graph, plugins=pm)
        if self.engine is None:
            self.engine = make_engine(self.mesh_arg)
        eng = self.engine
        pm = PluginManager()
        pm.frontend("torch")
        if not self._state_ready:
            init_optimizer_state(_optimizers(args, kwargs))
        timings: dict[str, float] = {}
        settings = load_settings(solver=self.solver, memory_budget=self.memory_budget, cache_dir=self.cache_dir)
        pm.solver(settings.solver)  # an unknown solver name is an error on every rank, naming the known ones
        if not getattr(eng, "_profiled", False):
            # link costs per mesh axis from the mesh profile (`metadist calibrate`; built-in defaults otherwise)
            from metadist_core.profile import load_profile
            eng.mesh = load_profile(settings.mesh_profile).mesh(eng.mesh.shape, eng.mesh.axis_names)
            eng._profiled = True
        problem = None
        if eng.rank == 0 or not eng.distributed:
            t = time.perf_counter()
            try:
                graph = pm.hook.metadist_trace(frontend="torch", fn=self.fn, args=args, kwargs=kwargs)
            except Exception as e:
                if eng.distributed:  # tell the other ranks instead of leaving them waiting
                    eng.broadcast({"error": f"{type(e).__name__}: {e}"})
                raise
            traced: TracedStep = graph.payload
            timings["trace"] = time.perf_counter() - t
        if eng.mesh.size == 1:
            t = time.perf_counter()
            plan, problem = replicated_plan(graph, eng.mesh)
            timings["solve"] = time.perf_counter() - t
        else:
            # rank 0 traces and plans; the other ranks receive the graph and the plan (one broadcast)
            payload = None
            if eng.rank == 0:
                from metadist_core.pipeline import plan_graph
                try:
                    if self._plan_fn is not None:  # tests: a hand-made plan instead of the solver's
                        t = time.perf_counter()
                        plan = self._plan_fn(graph, eng.mesh)
                        res_timings = {"solve": time.perf_counter() - t}
                    else:
                        res = plan_graph(graph, eng.mesh, plugins=pm, settings=settings)
                        plan, res_timings, problem = res.plan, res.timings, res.problem
                    payload = {"plan": plan.to_json(), "graph": graph.to_json(), "traced": _traced_meta(traced),
                               "timings": {**timings, **res_timings}}
                except Exception as e:
                    payload = {"error": f"{type(e).__name__}: {e}"}
                    eng.broadcast(payload)
                    raise
            payload = eng.broadcast(payload)
            if "error" in payload:
                raise RuntimeError(f"rank 0 could not trace or plan the step: {payload['error']}")
            from metadist_core.plan import ShardingPlan
            plan = ShardingPlan.from_json(payload["plan"])
            timings.update(payload["timings"])
            if eng.rank != 0:
                from metadist_core.ir import MetaIR
                graph = MetaIR.from_json(payload["graph"])
                traced = _traced_from_meta(payload["traced"], graph, collect_state(args, kwargs), eng.rank)
                graph.payload = traced
        t = time.perf_counter()
        runner = pm.hook.metadist_lower(frontend="torch", graph=graph, plan=plan, mesh=eng.mesh,
                                        context={"traced": traced, "engine": eng, "stats": self.comm_stats})
        timings["lower"] = time.perf_counter() - t
        if traced.random_ops and not self._state_ready:
            eng.sync_rng()
        self._state_ready = True
        log.info("compiled %s on mesh %s: %s", getattr(self.fn, "__name__", "step"), eng.mesh,
                 ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
        return CompiledEntry(traced, plan, runner, timings, problem)


_META_FIELDS = ("n_inputs", "out_spec", "n_outputs", "out_consts", "in_names", "constants", "state_out", "out_vars",
                "random_ops", "n_outputs_t")


def _traced_meta(traced: TracedStep) -> dict:
    """What the other ranks need of rank 0's trace to lower and run the plan (the graph travels as JSON)."""
    meta = {k: getattr(traced, k) for k in _META_FIELDS}
    meta["constants"] = [c.detach().cpu() for c in traced.constants]
    return meta


def _traced_from_meta(meta: dict, graph, state, rank: int) -> TracedStep:
    slots = state.slots
    shapes = [graph.vars[v].shape for v in meta["in_names"][:len(slots)]]
    if len(slots) + meta["n_inputs"] + len(meta["constants"]) != len(meta["in_names"]) or \
            [tuple(s.shape) for s in slots] != [tuple(x) for x in shapes]:
        raise RuntimeError(f"rank {rank} holds other state than rank 0 traced ({len(slots)} tensors here); every "
                           f"rank must build the same model and optimizer")
    t = TracedStep(None, graph, state, meta["n_inputs"], meta["out_spec"], meta["n_outputs"], meta["out_consts"],
                   meta["in_names"], meta["constants"], meta["state_out"], meta["out_vars"], meta["random_ops"])
    t.n_outputs_t = meta["n_outputs_t"]
    return t


def _optimizers(args, kwargs) -> list:
    from .trace import _optimizers_in
    return _optimizers_in(args, kwargs)


def _unflatten_outputs(traced: TracedStep, outs: list) -> Any:
    leaves = []
    it = iter(outs)
    for i in range(traced.n_outputs):
        leaves.append(traced.out_consts[i] if i in traced.out_consts else next(it))
    return pytree.tree_unflatten(leaves, traced.out_spec)


def replicated_plan(graph, mesh):
    """The all-replicated plan (mesh of one device: nothing to discover or solve)."""
    from metadist_core.plan import ShardingPlan
    from metadist_core.problem import build_problem
    from metadist_core.rules import RuleBook
    problem = build_problem(graph, RuleBook(), mesh)
    return ShardingPlan.replicated(problem), problem


# -- the frontend hooks' work ---------------------------------------------------------


def trace_for_hook(fn: Callable, args: tuple, kwargs: dict):
    """metadist_trace: the MetaIR of the step, with the TracedStep as ``graph.payload``."""
    state = collect_state(args, kwargs)
    traced = trace_step(fn, args, kwargs, state=state)
    traced.n_outputs_t = sum(1 for i in range(traced.n_outputs) if i not in traced.out_consts)
    traced.graph.payload = traced
    return traced.graph


def lower_for_hook(graph, plan, mesh, context) -> Callable:
    """metadist_lower: this rank's runnable for ``plan``; places the state as the plan stores it."""
    traced: TracedStep = (context or {}).get("traced") or getattr(graph, "payload", None)
    engine: Engine | None = (context or {}).get("engine")
    stats = (context or {}).get("stats") or CommStats()
    if traced is None:
        raise ValueError("metadist_lower (torch) needs the TracedStep that metadist_trace left in graph.payload")
    if engine is None or not engine.distributed:
        return LocalProgram(traced)
    from .lower import lower_plan
    place_state(traced, plan, engine)
    lowered = lower_plan(graph, plan, mesh, coords=engine.coords, groups=engine.groups(), stats=stats)
    return RankProgram(traced, lowered, plan, engine)


def _placements(sh: Sharding):
    from torch.distributed.tensor import Replicate, Shard
    out = []
    for p in sh:
        if p.is_shard():
            out.append(Shard(p.dim))
        elif p.is_replicate():
            out.append(Replicate())
        else:
            raise ValueError(f"state cannot be stored as {p}; only Shard and Replicate")
    return out


def place_state(traced: TracedStep, plan: Any, engine: Engine) -> None:
    """Store every parameter, buffer and optimizer state tensor as a DTensor with the plan's placements.

    Parameters become DTensor ``nn.Parameter``s in their modules; every
    optimizer's param groups and state are re-keyed to them.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor
    dm = engine.device_mesh
    rep = Sharding.replicated(engine.mesh.ndim)
    st = traced.state
    new_param: dict[int, torch.nn.Parameter] = {}
    for k, slot in enumerate(st.slots):
        want = _placements(plan.input_shardings.get(traced.in_names[k], rep))
        cur = slot.get()
        if isinstance(cur, DTensor):
            if tuple(cur.placements) == tuple(want):
                continue
            with torch.no_grad():
                dt = cur.redistribute(dm, want)
            if slot.role == ROLE_PARAM:
                dt = dt.to_local()  # re-wrapped below
                dt = DTensor.from_local(dt, dm, want, run_check=False, shape=cur.shape, stride=cur.stride())
        else:
            with torch.no_grad():
                dt = distribute_tensor(cur.detach().to(engine.device), dm, want, src_data_rank=None)
        if slot.role == ROLE_PARAM:
            p = torch.nn.Parameter(dt, requires_grad=cur.requires_grad)
            new_param[id(cur)] = p
            slot.owner._parameters[slot.key] = p
        elif slot.role == ROLE_BUFFER:
            slot.owner._buffers[slot.key] = dt
        else:
            slot.owner[slot.key] = dt
    if new_param:
        for mod, k, i in st.tied:
            old_p = mod._parameters.get(k)
            if old_p is not None and id(old_p) in new_param:
                mod._parameters[k] = new_param[id(old_p)]
        for opt in st.optimizers:
            for g in opt.param_groups:
                g["params"] = [new_param.get(id(p), p) for p in g["params"]]
            old = opt.state
            from collections import defaultdict
            state = defaultdict(dict)
            for p, s in old.items():
                state[new_param.get(id(p), p)] = s
            opt.state = state
        st.param_objs = [new_param.get(id(p), p) for p in st.param_objs]


def metadist_compile(mesh: Any = None, solver: str | None = None, memory_budget: int | None = None,
                     cache_dir: str | None = None) -> Callable[[Callable], MetadistStep]:
    """Decorate a training step so that it runs split over the devices of ``mesh``.

    :param mesh: None (the whole world as one axis), a shape such as ``(2, 2)``,
        or a torch ``DeviceMesh``; its size must be the world size.
    :param solver: solver name (default from ``METADIST_SOLVER`` / pyproject / "ilp").
    :param memory_budget: bytes per device the plan must fit in.
    :param cache_dir: where the rule cache lives.
    The decorated step exposes ``.plan`` (ShardingPlan of its last compile) and
    ``.timings`` (trace, discover, build_problem, solve, lower seconds).
    """
    if callable(mesh) and not isinstance(mesh, (tuple, list)) and not hasattr(mesh, "shape"):
        raise TypeError("metadist_compile takes arguments: write @metadist_compile() with parentheses")

    def wrap(fn: Callable) -> MetadistStep:
        return MetadistStep(fn, mesh=mesh, solver=solver, memory_budget=memory_budget, cache_dir=cache_dir)

    return wrap


__all__ = ["metadist_compile", "MetadistStep", "signature", "place_state", "replicated_plan"]
