"""Pipelined steps for torch on torch.distributed.pipelining (PipelineStage + ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B): MetaDist builds the stage programs, torch runs the schedule and its P2P.

Design (stage modules, autograd through them): the per-micro-batch part of the
traced step (:func:`metadist_core.levers.microbatch.cut_at_gradients`) has its
*forward* cut into contiguous stages (:mod:`metadist_core.levers.stages`). Each stage
is an ``nn.Module`` whose ``forward`` runs that stage's aten ops eagerly, with
autograd, so that the schedule's backward (``stage_backward``) differentiates
it: there is no hand-cut backward graph to keep consistent with the forward
(tied weights, values read several stages later and saved activations all come
from autograd). Within a stage, on the remaining mesh axes (the sub-mesh), the
stage's ops run on DTensors whose parameters are laid out as the intra-op plan
solved on the sub-mesh says (``Shard``/``Replicate``); DTensor's own
propagation and autograd give the split forward and backward. Values crossing
a cut travel whole (``Replicate``) between the same sub-mesh coordinates of
neighbouring stages. After the last micro-batch each stage's ranks run the
stage's slice of the traced optimizer update (the update part of the cut)
eagerly on the stage's parameters and optimizer state, and the new state is
broadcast from the stage to every rank, so the model and optimizer hold the
step's values everywhere (one broadcast of the state per step).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from metadist_core.driver.frontend import NotSupported
from metadist_core.ir.ir import MetaIR
from metadist_core.levers.microbatch import GradientCut, combine
from metadist_core.plan.stage import Stage
from metadist_core.levers.stages import stage_devices

from ..trace.calls import STRIDE_FREE, TORCH_DTYPES, rebuild, resolve_target
from ..runtime.engine import Engine
from .pipeline import _no_lasting_grads, split_batch
from .program import user_tensors
from ..trace.trace import TracedStep

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def _select(out: Any, idx: Sequence[int]) -> list:
    items: list = []
    for o in out if isinstance(out, (tuple, list)) else [out]:
        items.extend(o if isinstance(o, (tuple, list)) else [o])
    return [items[i] for i in idx]


def run_op(op: Any, ins: list, reshape_views: bool = False) -> list:
    """One aten op of the graph on real (or DTensor) values, eagerly (autograd records it).
    ``reshape_views``: run ``view`` as ``reshape`` (the same values; its backward copes with the
    non-contiguous gradients that split layouts produce)."""
    args = rebuild(op.attrs.get("args", []), ins)
    kwargs = rebuild(op.attrs.get("kwargs", {}), ins)
    fn = STRIDE_FREE[op.key] if reshape_views and op.key in STRIDE_FREE else resolve_target(op.key)
    out = fn(*args, **kwargs)
    select = op.attrs.get("select")
    if select is None:
        return [out]
    return _select(out, list(select))


class SubMesh:
    """How a stage's values live on the sub-mesh (mesh axes 1..): plain tensors on one device, else DTensors."""

    def __init__(self, device_mesh: Any) -> None:
        self.dm = device_mesh
        self.ran: dict[str, int] = {"dtensor": 0, "whole": 0}  # ops run split (DTensor) or whole (no rule)

    def wrap(self, x: Any, placements: Any = None) -> Any:
        if self.dm is None or not isinstance(x, torch.Tensor):
            return x
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(x, DTensor):
            return x
        rep = [Replicate()] * self.dm.ndim
        dt = DTensor.from_local(x, self.dm, rep, run_check=False)
        return dt if placements is None else dt.redistribute(self.dm, placements)

    def layout(self, x: Any, placements: Any) -> Any:
        """``x`` laid out as the plan says (DTensor chose its own layout for an op's output)."""
        from torch.distributed.tensor import DTensor

        if placements is None or not isinstance(x, DTensor) or tuple(x.placements) == tuple(placements):
            return x
        try:
            return x.redistribute(self.dm, placements)
        except (NotImplementedError, RuntimeError, ValueError):  # a layout DTensor cannot reach: keep its own
            return x

    def unwrap(self, x: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        if self.dm is not None and isinstance(x, DTensor):
            return x.redistribute(self.dm, [Replicate()] * self.dm.ndim).to_local()
        return x

    def run(self, op: Any, ins: list) -> list:
        if self.dm is None:
            return run_op(op, ins, reshape_views=True)  # a value sent on is contiguous where the trace's was not
        try:
            outs = run_op(op, ins, reshape_views=True)
            self.ran["dtensor"] += 1
        except (NotImplementedError, RuntimeError, AssertionError, TypeError, ValueError):
            outs = run_op(op, [self.unwrap(x) for x in ins])  # no DTensor rule: run it whole (replicated)
            self.ran["whole"] += 1
        # every gradient flowing back through a split op made contiguous (DTensor's backward views need it)
        return [
            _ContiguousGrad.apply(o) if isinstance(o, torch.Tensor) and o.requires_grad else o
            for o in (self.wrap(o) for o in outs)
        ]


class _ContiguousGrad(torch.autograd.Function):
    """The identity whose backward makes the gradient contiguous (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


class _Anchor(torch.autograd.Function):
    """``out`` unchanged; its backward also gives zero gradients to ``ins``, so that a value a stage
    receives always sends a gradient back (the schedule expects one for every value that requires grad)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *ins: torch.Tensor) -> torch.Tensor:
        ctx.metas = [(x.shape, x.dtype, x.device) for x in ins]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return (g, *[torch.zeros(s, dtype=d, device=dv) for s, d, dv in ctx.metas])


class StageModule(torch.nn.Module):
    """One stage: ``forward(*received)`` runs the stage's forward ops and returns what it sends on
    (the last stage: the loss, its other returned values kept aside per micro-batch)."""

    def __init__(
        self,
        graph: MetaIR,
        stage: Stage,
        params: dict[str, torch.Tensor],
        consts: dict[str, Any],
        placements: dict[str, Any],
        sub: SubMesh,
        last: bool,
        user_outputs: list[str],
    ) -> None:
        super().__init__()
        self.graph, self.stage, self.sub, self.last = graph, stage, sub, last
        self.consts, self.placements, self.user_outputs = consts, placements, user_outputs
        self.names = list(params)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(t.detach(), requires_grad=t.dtype.is_floating_point) for t in params.values()]
        )
        self.kept: list[list[torch.Tensor]] = []

    def forward(self, *received: torch.Tensor) -> Any:
        env: dict[str, Any] = {v: self.sub.wrap(c) for v, c in self.consts.items()}
        for v, w in zip(self.names, self.weights):
            env[v] = self.sub.wrap(w, self.placements.get(v))
        for v, x in zip(self.stage.inputs, received):
            env[v] = self.sub.wrap(_ContiguousGrad.apply(x) if x.requires_grad else x, self.placements.get(v))
        for i in self.stage.ops:
            op = self.graph.op(i)
            outs = self.sub.run(op, [env[v] for v in op.inputs])
            env.update((v, self.sub.layout(o, self.placements.get(v))) for v, o in zip(op.outputs, outs))
        outs = [self.sub.unwrap(env[v]).contiguous() for v in self.stage.outputs]  # P2P sends need it
        needs = [x for x in received if x.requires_grad]
        j = next((j for j, o in enumerate(outs) if o.requires_grad), None)
        if needs and j is not None:  # every received value that requires grad gets one (zeros if unused)
            outs[j] = _Anchor.apply(outs[j], *needs)
        if self.last:
            self.kept.append([x.detach() for x in outs])
            return outs[0]
        return tuple(outs)


def gradient_params(graph: MetaIR) -> dict[str, str]:
    """Gradient value (role ``gradient``: what the optimizer reads) -> the parameter whose gradient it is."""
    out: dict[str, str] = {}
    for g in [v for v, mv in graph.vars.items() if mv.role == "gradient"]:
        dep = graph.downstream([g]).values
        ps = [p for p, o in graph.aliases.items() if o in dep and graph.vars[p].role == "parameter"]
        if len(ps) != 1:
            raise NotSupported(
                f"gradient {g} feeds the update of {len(ps)} parameters ({', '.join(ps[:4])}), "
                f"as clipping by global norm does; pipeline_stages needs one gradient per "
                f"parameter: leave it out or use pipeline_stages=1"
            )
        out[g] = ps[0]
    return out


def update_slices(
    graph: MetaIR, grad_param: dict[str, str], owner: dict[str, int], k: int
) -> tuple[list[list[str]], list[list[str]], set[str]]:
    """Per stage: the optimizer-update ops it runs (from the gradients on) and the state inputs it writes
    (its parameters and their optimizer state); state whose update reads no gradient, such as a shared
    step counter, is written by every stage (the third result)."""
    stage_of_grad = {g: owner[p] for g, p in grad_param.items()}
    stop = set(grad_param)
    per_targets: list[list[str]] = [[] for _ in range(k)]
    shared: list[str] = []
    need_of: dict[str, set[str]] = {}
    for s_in, out in graph.aliases.items():
        if graph.vars[s_in].role not in ("parameter", "optimizer_state"):
            continue
        need = need_of[s_in] = graph.upstream([out], stop=stop).values
        batch = [v for v in need if graph.vars[v].role == "input"]
        if batch:
            raise NotSupported(
                f"the optimizer update of {s_in} reads the batch ({batch[0]}) other than through "
                f"gradients; pipeline_stages cannot run it: use pipeline_stages=1"
            )
        st = {stage_of_grad[g] for g in need if g in stage_of_grad}
        if len(st) > 1:
            raise NotSupported(
                f"the optimizer update of {s_in} reads the gradients of parameters in several "
                f"pipeline stages (as clipping by global norm does); pipeline_stages cannot run "
                f"it yet: leave it out or use pipeline_stages=1"
            )
        if st:
            per_targets[st.pop()].append(s_in)
        elif s_in in owner:
            per_targets[owner[s_in]].append(s_in)
        else:
            shared.append(s_in)
    ops, writes = [], []
    for s in range(k):
        targets = per_targets[s] + shared
        need: set[str] = set()
        for t in targets:
            need |= need_of[t]
        ops.append([op.id for op in graph.ops if any(o in need and o not in stop for o in op.outputs)])
        writes.append(targets)
    return ops, writes, set(shared)


class PipelineProgram:
    """One step on this rank as a pipeline: torch.distributed.pipelining runs the stage modules over the
    micro-batches, then this rank's stage runs its optimizer update, then the state is broadcast."""

    def __init__(
        self,
        traced: TracedStep,
        cut: GradientCut,
        stages: list[Stage],
        placements: dict[str, Any],
        engine: Engine,
        m: int,
        schedule: str,
    ) -> None:
        import torch.distributed as dist
        from torch.distributed import pipelining as pp

        random = [r for r in traced.random_ops if "scaled_dot_product" not in r]  # attention: dropout_p 0
        if random:
            raise NotSupported(
                f"pipeline_stages: the step draws random numbers ({random[0]}); "
                f"stages cannot replay them yet (set dropout to 0 or use pipeline_stages=1)"
            )
        g = cut.grad_graph
        bufs = [s for s in g.aliases if g.vars[s].role == "buffer" and s not in cut.acc_of]
        if bufs:
            raise NotSupported(
                f"pipeline_stages: the step updates buffers ({bufs[0]}, BatchNorm's running "
                f"statistics); not yet with a pipeline: use pipeline_stages=1"
            )
        _no_lasting_grads(traced, "pipeline_stages")
        self.traced, self.cut, self.stages, self.engine, self.m = traced, cut, stages, engine, m
        self.schedule_name = schedule
        mesh_shape = engine.mesh.shape
        p = mesh_shape[0]
        v = len(stages) // p  # stages per rank (interleaved: 2)
        n_s = len(traced.state.slots)
        self.slot_of = {traced.in_names[i]: i for i in range(n_s)}
        self.user_in = [traced.in_names[n_s + j] for j in range(traced.n_inputs)]
        consts = {
            name: traced.constant_on(k, engine.device)
            for k, name in enumerate(traced.in_names[n_s + traced.n_inputs :])
        }
        dm = engine.device_mesh
        sub = SubMesh(None if dm is None or len(mesh_shape) == 1 else dm[tuple(engine.mesh.axis_names[1:])])
        c0 = engine.coords[0]
        self.mine = [c0 + j * p for j in range(v)]
        owner = {pv: st.index for st in stages for pv in st.params}
        self.owner = owner
        self.modules: dict[int, StageModule] = {}
        pstages = []
        group = dm.get_group(0) if dm is not None else None
        for si in self.mine:
            st = stages[si]
            params = {pv: self._slot(pv) for pv in st.params if pv in self.slot_of}  # constants: below
            mod = StageModule(g, st, params, consts, placements, sub, si == len(stages) - 1, cut.user_outputs)
            self.modules[si] = mod
            last = si == len(stages) - 1
            ins = tuple(_example(g, x) for x in st.inputs)
            outs = _example(g, st.outputs[0]) if last else tuple(_example(g, x) for x in st.outputs)
            pstages.append(
                pp.PipelineStage(mod, si, len(stages), engine.device, input_args=ins, output_args=outs, group=group)
            )
        cls = getattr(pp, SCHEDULES[schedule])
        loss_fn = _first
        if schedule == "interleaved":
            self.sched = cls(pstages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        else:
            self.sched = cls(pstages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
        self.grad_param = gradient_params(traced.graph)
        self.param_grad = {p_: g_ for g_, p_ in self.grad_param.items()}
        self.update_ops, self.update_writes, self.shared = update_slices(
            traced.graph, self.grad_param, owner, len(stages)
        )
        self.consts = consts
        self.dist = dist
        self.stats = None

    def _slot(self, var: str) -> torch.Tensor:
        return self.traced.state.slots[self.slot_of[var]].get()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.traced.refresh()
        user = user_tensors(args, kwargs)
        split_batch(args, kwargs, self.m)  # a batch m does not divide: the clear error, before any send
        for mod in self.modules.values():
            mod.kept.clear()
            for w in mod.weights:
                w.grad = None
        first, last = 0 in self.mine, len(self.stages) - 1 in self.mine
        by_var = dict(zip(self.user_in, user))
        stage_args = [by_var[x].to(self.engine.device) for x in self.stages[0].inputs] if first else []
        target = torch.zeros(user[0].shape[0]) if last else None
        kw = {"target": target} if last else {}
        self.sched.step(*stage_args, return_outputs=False, **kw)
        scale = 1.0 / self.m if self.cut.reduction == "mean" else 1.0
        with torch.no_grad():
            new = [w for si in self.mine for w in self._update(si, scale)]  # all read, then all written:
            for s_in, x in new:  # a shared step counter once
                self._slot(s_in).copy_(x)
        self._broadcast_state()
        return self._outputs(last)

    def _update(self, si: int, scale: float) -> list[tuple[str, torch.Tensor]]:
        """Stage ``si``'s optimizer update on its accumulated gradients: ``(state input, new value)``s."""
        mod = self.modules[si]
        ug = self.traced.graph
        env: dict[str, Any] = dict(self.consts)
        for pv, w in zip(mod.names, mod.weights):
            gv = self.param_grad.get(pv)
            if gv is not None:
                gr = w.grad if w.grad is not None else torch.zeros_like(w)
                env[gv] = gr * scale if scale != 1.0 else gr
        for v in ug.inputs:
            if v not in env and v in self.slot_of:
                env[v] = self._slot(v)
        for i in self.update_ops[si]:
            op = ug.op(i)
            env.update(zip(op.outputs, run_op(op, [env[x] for x in op.inputs])))
        return [(s_in, env[ug.aliases[s_in]]) for s_in in self.update_writes[si]]

    def _broadcast_state(self) -> None:
        if not self.engine.distributed:
            return
        shape = self.engine.mesh.shape
        with torch.no_grad():
            for st in self.stages:
                src = stage_devices(shape, st.index % shape[0])[0]
                for s_in in self.update_writes[st.index]:
                    if s_in not in self.shared:  # shared state (a step counter) is the same everywhere
                        self.dist.broadcast(self._slot(s_in), src=src)

    def _outputs(self, last: bool) -> Any:
        """The user's returned values, combined over the micro-batches, on every rank (from the last stage)."""
        tr = self.traced
        out_vars = tr.out_vars[: tr.n_tensor_outputs]
        mod = self.modules.get(len(self.stages) - 1)
        vals = []
        for v in out_vars:
            k = self.cut.user_outputs.index(v)
            if mod is not None:
                x = combine([o[k] for o in mod.kept], self.cut.combine_mode(v), lambda xs: torch.cat(xs, dim=0))
                x = x.contiguous()
            else:
                mv = self.cut.grad_graph.vars[v]
                shape = list(mv.shape or ())
                if self.cut.combine_mode(v) == "concat" and shape:
                    shape[0] *= self.m
                x = torch.empty(shape, dtype=TORCH_DTYPES.get(mv.dtype, torch.float32), device=self.engine.device)
            if self.engine.distributed:
                src = stage_devices(self.engine.mesh.shape, self.engine.mesh.shape[0] - 1)[0]
                self.dist.broadcast(x, src=src)
            vals.append(x)
        return tr.unflatten_outputs(vals)


def _example(graph: MetaIR, v: str) -> torch.Tensor:
    """A meta tensor of value ``v``'s whole (one micro-batch) shape: what a stage receives or sends."""
    mv = graph.vars[v]
    dt = TORCH_DTYPES.get(mv.dtype, torch.float32)
    return torch.empty(tuple(mv.shape or ()), dtype=dt, device="meta", requires_grad=dt.is_floating_point)


def _first(output: Any, target: Any) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the loss."""
    return output[0] if isinstance(output, (tuple, list)) else output


def stage_placements(plan: Any) -> dict[str, Any]:
    """DTensor placements of every value of ``plan`` (solved on the sub-mesh): ``Shard`` as planned,
    ``Replicate`` otherwise (a planned ``Partial`` is left to DTensor, which keeps its own)."""
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    for v, sh in {**plan.var_shardings, **plan.input_shardings}.items():
        if any(type(p).__name__ == "Partial" for p in sh):
            continue
        out[v] = [Shard(p.dim) if getattr(p, "dim", None) is not None else Replicate() for p in sh]
    return out


def lower_stages(
    traced: TracedStep, cut: GradientCut, stages: list[Stage], sub_plan: Any, engine: Engine, settings: Any
) -> PipelineProgram:
    """The :class:`PipelineProgram` of a traced step cut into ``stages`` on ``engine``."""
    if not engine.distributed:
        raise NotSupported("pipeline_stages > 1 needs one process per device (torchrun); this is world size 1")
    placements = stage_placements(sub_plan) if sub_plan is not None and len(engine.mesh.shape) > 1 else {}
    return PipelineProgram(traced, cut, stages, placements, engine, settings.micro_batches, settings.schedule)


__all__ = [
    "PipelineProgram",
    "StageModule",
    "lower_stages",
    "gradient_params",
    "update_slices",
    "stage_placements",
    "run_op",
]
