"""Trace a whole training step (forward, backward, optimizer step, zero_grad) into one functional graph.

How (torch 2.13):

1. The step's state is collected from its arguments: every ``nn.Module``
   (parameters, buffers) and every ``torch.optim.Optimizer`` (its per-parameter
   state). Optimizer state is created lazily on the first ``step()``, so it is
   made eagerly first (:func:`metadist_torch.trace.state.init_optimizer_state`): zero grads, ``lr=0`` and
   ``weight_decay=0``, one ``step()``, every ``step`` counter back to 0.
2. The step runs as a flat function ``(params, buffers, state, *inputs) ->
   (outputs, new params, new buffers, new state)`` under ``make_fx`` with fake
   tensors: the parameters are swapped in with ``_reparametrize_module`` as
   fresh leaves that require grad, the optimizer's ``param_groups`` and
   ``state`` are pointed at the traced tensors. Optimizers run the path eager
   torch runs: a step counter's ``.item()`` is a number of the graph, and
   :func:`metadist_torch.trace.hyper.lift` turns the Python arithmetic on it into the
   same float64 ops on the counter's 0-d tensor, so the float32 update gets
   eager's numbers, bit for bit. Where that path branches on a counter's value
   the step is traced again with ``capturable=True`` (CPU included, by patching
   ``_get_capturable_supported_devices``): counters stay tensors.
3. The captured graph (which still holds in-place updates) is functionalized:
   in one pass over its nodes where aliasing allows (:mod:`metadist_torch.trace.functional`), else
   by tracing it again under ``torch.func.functionalize``; profiler nodes and
   the trailing ``copy_`` into placeholders are dropped (the updated values are
   returned anyway).
4. The fx graph becomes MetaIR (:mod:`metadist_torch.trace.to_ir`) with the attrs encoding of
   :mod:`metadist_core.ir.recorded`, roles parameter / buffer / optimizer_state /
   input, and aliases from each state input to its updated value.

Caveat: SGD with ``dampening != 0`` starts its momentum buffer by a clone of
the first gradient; the traced step always runs the later-step formula, which
differs on the very first step. A warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from metadist_core.ir.ir import MetaIR

from .sideeffects import arguments_unchanged
from ..moe.moe import capacity_dispatch, world_mesh
from .hyper import (
    Hyperparameters,
    hyper_slots,
    swapped_values,
)
from .state import (
    OptimizerParamHolder,
    StepState,
    collect_state,
    init_optimizer_state,
    optimizers_in,
    swapped_optimizer,
)
from .gradients import capture_gradients
from .to_ir import TraceError, to_meta_ir
from .capture import _BranchOnTensorNumber, _capture, functionalize_graph
from .fxclean import merge_step_counters

log = logging.getLogger("metadist.torch.trace")


@dataclass
class TracedStep:
    """A traced, functional step: the fx graph, its MetaIR and how to feed and read it."""

    gm: fx.GraphModule  # (params, buffers, states, inputs, constants) -> flat outputs
    graph: MetaIR
    state: StepState
    n_inputs: int  # user tensor inputs, then the .grad of each parameter of ``grad_in``
    out_spec: Any  # pytree spec of the user's return value
    n_outputs: int  # flat user outputs (tensors and constants)
    n_tensor_outputs: int  # of which tensors (the graph's first outputs)
    out_consts: dict[int, Any]  # flat output index -> non-tensor value
    in_names: list[str]  # placeholder (MetaIR input) ids, in call order
    constants: list[torch.Tensor]  # values of get_attr tensor constants, fed after the user inputs
    state_out: list[int | None]  # per state slot: index into flat outputs of its new value, or None (unchanged)
    out_vars: list[str | None]  # per flat graph output: MetaIR var id (None for constants)
    random_ops: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    example_inputs: list[torch.Tensor] = field(default_factory=list)  # the traced call's user tensors
    hyper: Hyperparameters = field(default_factory=Hyperparameters.none)  # the param groups' numbers, fed
    grad_in: list[int] = field(default_factory=list)  # parameters whose .grad the step reads (inputs, last)
    grad_out: list[int] = field(default_factory=list)  # parameters holding a .grad after it (outputs, last)
    merged_counters: dict[int, int] = field(default_factory=dict)  # optimizer state slot -> the one read for it

    def refresh(self) -> None:
        """Feed the param groups' numbers now (learning rate, betas, ...) to the program: before every run."""
        self.hyper.refresh(self.state.optimizers)

    def constant_on(self, k: int, device: Any) -> torch.Tensor:
        """Graph constant ``k`` on ``device``; the param groups' numbers stay the CPU tensors :meth:`refresh`
        fills (the program reads them as numbers, or in arithmetic among themselves)."""
        t = self.constants[k]
        return t if any(t is h for h in self.hyper.tensors) else t.to(device)

    def inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The program's user inputs for a call: the call's tensors, then the .grad each parameter of
        ``grad_in`` holds now (whole)."""
        user = [t.detach() for t in _flat_user_inputs(args, kwargs)[0]]
        return user + [_whole(self.state.params[i].get().grad) for i in self.grad_in]

    def unflatten_outputs(self, outs: Sequence[Any]) -> Any:
        """The user's return value from the tensor outputs of one run (constants put back in place); the
        gradients that outlive the step (the outputs after the user's) are stored in the parameters' .grad,
        as eager torch leaves them."""
        outs = list(outs)
        if self.grad_in or self.grad_out:
            cut = len(outs) - len(self.grad_out)
            _store_grads(self.state, self.grad_in, self.grad_out, outs[cut:])
            outs = outs[:cut]
        it = iter(outs)
        leaves = [self.out_consts[i] if i in self.out_consts else next(it) for i in range(self.n_outputs)]
        return pytree.tree_unflatten(leaves, self.out_spec)


def _flat_user_inputs(args: Sequence[Any], kwargs: dict) -> tuple[list[torch.Tensor], Any, list[Any]]:
    """The tensors among the user's arguments (modules and optimizers left out), and how to put them back."""
    leaves, spec = pytree.tree_flatten((list(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return tensors, spec, leaves


def trace_step(
    fn: Callable,
    args: Sequence[Any],
    kwargs: dict | None = None,
    *,
    name: str | None = None,
    state: StepState | None = None,
    example_state: Sequence[torch.Tensor] | None = None,
    moe_capacity_factor: float | None = None,
    mesh_shape: tuple[int, ...] | None = None,
) -> TracedStep:
    """Trace ``fn(*args, **kwargs)`` (forward, backward, optimizer step) into a functional TracedStep.

    ``example_state`` (same order as ``state.slots``) gives the full-size
    values to trace with when the live state is sharded (retracing). Mixture-of-experts layers trace as a
    capacity-padded dispatch (:mod:`metadist_torch.moe.moe`) with ``moe_capacity_factor``, its tokens in a group per
    device of ``mesh_shape`` (None: the world as one axis).
    """
    from torch.nn.utils.stateless import _reparametrize_module

    kwargs = dict(kwargs or {})
    t0 = time.perf_counter()
    if state is None:
        init_optimizer_state(optimizers_in(args, kwargs))
        state = collect_state(args, kwargs)
    slots = state.slots
    n_p, n_b, n_s = len(state.params), len(state.buffers), len(state.opt_states)
    user_tensors, in_spec, leaves = _flat_user_inputs(args, kwargs)
    trainable = [bool(s.get().requires_grad) for s in state.params]
    # gradients that live across calls: the .grad a parameter holds now is an input (backward accumulates into
    # it, or the step reads it), and the .grad it holds after the step an output
    grad_in = [i for i, s in enumerate(state.params) if s.get().grad is not None]
    n_user = len(user_tensors)
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    out_box: dict[str, Any] = {}
    owners = [s.owner for s in state.params if isinstance(s.owner, torch.nn.Module)]

    def flat(*values: Any):
        pv, bv, sv = values[:n_p], values[n_p : n_p + n_b], values[n_p + n_b : n_p + n_b + n_s]
        uv = values[n_p + n_b + n_s : n_p + n_b + n_s + n_user]
        gv = values[n_p + n_b + n_s + n_user : len(values) - len(hyper)]
        hv = values[len(values) - len(hyper) :]
        # a frozen parameter (requires_grad=False) gets no gradient, so the optimizer skips it, as in eager
        new_params = [
            v.detach().requires_grad_(v.dtype.is_floating_point or v.dtype.is_complex) if f else v
            for v, f in zip(pv, trainable)
        ]
        for i, g in zip(grad_in, gv):
            new_params[i].grad = g
        groups: dict[int, tuple[torch.nn.Module, dict]] = {}
        for slot, v in zip(state.params + state.buffers, list(new_params) + list(bv)):
            mod = slot.owner
            groups.setdefault(id(mod), (mod, {}))[1][slot.key] = v
        for mod, k, i in state.tied:
            groups.setdefault(id(mod), (mod, {}))[1][k] = new_params[i]
        # optimizer state dicts point at the traced values
        saved_state_vals = [(s.owner, s.key, s.owner[s.key]) for s in state.opt_states]
        for s, v in zip(state.opt_states, sv):
            s.owner[s.key] = v
        lv = list(leaves)
        for i, v in zip(tensor_pos, uv):
            lv[i] = v
        a, kw = pytree.tree_unflatten(lv, in_spec)
        try:
            with contextlib.ExitStack() as stack:
                for mod, d in groups.values():
                    if isinstance(mod, OptimizerParamHolder):
                        continue
                    stack.enter_context(_reparametrize_module(mod, dict(d), strict=False))
                for opt in state.optimizers:
                    stack.enter_context(swapped_optimizer(opt, state.param_objs, new_params))
                stack.enter_context(swapped_values(hyper, state.optimizers, hv))
                stack.enter_context(capacity_dispatch(owners, mesh_shape or world_mesh(), moe_capacity_factor))
                grads = stack.enter_context(capture_gradients(state.optimizers, new_params))
                out = fn(*a, **kw)
                arguments_unchanged(fn, a, kw, in_spec, lv)  # a container argument filled in: an error naming it
                new_state = [s.owner[s.key] for s in state.opt_states]
                left = [(i, p.grad) for i, p in enumerate(new_params) if isinstance(p.grad, torch.Tensor)]
        finally:
            for owner, k, v in saved_state_vals:
                owner[k] = v
        flat_out, spec = pytree.tree_flatten(out)
        out_box["spec"] = spec
        out_box["consts"] = {i: o for i, o in enumerate(flat_out) if not isinstance(o, torch.Tensor)}
        tensors_out = [o for o in flat_out if isinstance(o, torch.Tensor)]
        out_box["n_tensor_out"] = len(tensors_out) + len(left)
        out_box["grad_out"] = [i for i, _ in left]
        tensors_out += [g for _, g in left]
        out_box["n_grads"] = len(grads)  # the gradients the optimizers read, as extra outputs (stripped below)
        # buffers were updated in place (BatchNorm running stats): functionalization turns that into new values
        return (
            *[o.detach() for o in tensors_out],
            *[p.detach() for p in new_params],
            *bv,
            *new_state,
            *[grads[i] for i in sorted(grads)],
        )

    if example_state is None:
        example_state = [s.get() for s in slots]
    example_state = [_plain(t) for t in example_state]
    user_tensors = [t.detach() for t in user_tensors] + [_plain(state.params[i].get().grad) for i in grad_in]
    hyper = hyper_slots(state.optimizers)  # the param groups' numbers: symbolic while tracing (trace/hyper.py)
    values = list(example_state) + user_tensors
    try:  # the optimizers' own path: the formula eager torch runs
        cap = _capture(flat, values, hyper, state, out_box, fn, capturable=False)
    except _BranchOnTensorNumber as e:  # a branch on a step counter's value: the capturable path has none
        log.debug("tracing the optimizers' capturable path: %s", e)
        cap = _capture(flat, values, hyper, state, out_box, fn, capturable=True)
    gm, lifted, guards, pinned, grad_names, t1 = cap
    merged = merge_step_counters(gm, state)  # in place: names kept, merged duplicates gone
    gm.recompile()  # once: every pass above changed the graph only (a large graph's Python code is slow to make)
    grad_names = [n.name for n in gm.graph.nodes if n.name in grad_names]
    t2 = time.perf_counter()
    n_user_out = out_box["n_tensor_out"]
    spec, consts = out_box["spec"], out_box["consts"]
    conv = to_meta_ir(gm, state, len(user_tensors), n_user_out, name or getattr(fn, "__name__", "step"))
    for v in grad_names:  # role "gradient": what grad_compression compresses (metadist_core.cost.compression)
        if v in conv.graph.vars and conv.graph.vars[v].role == "intermediate":
            conv.graph.vars[v].role = "gradient"
    timings = {"make_fx": t1 - t0, "functionalize": t2 - t1, "to_meta_ir": time.perf_counter() - t2}
    traced = TracedStep(
        gm,
        conv.graph,
        state,
        len(user_tensors),
        spec,
        n_user_out - len(out_box["grad_out"]) + len(consts),
        n_user_out,
        consts,
        conv.in_names,
        conv.constants,
        conv.state_out,
        conv.out_vars,
        conv.random_ops,
        timings,
        user_tensors,
        Hyperparameters(hyper, lifted.feeds, guards, {**pinned, **lifted.pinned}),
        grad_in,
        out_box["grad_out"],
        merged,
    )
    traced.refresh()
    return traced


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor's whole value as a plain tensor (a DTensor's gathered)."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


def _store_grads(state: StepState, grad_in: Sequence[int], grad_out: Sequence[int], grads: Sequence[Any]) -> None:
    """Each parameter's .grad after the step: the new whole gradients (as a replicated DTensor where the
    parameter is a DTensor), None where the step cleared it."""
    for i in set(grad_in) - set(grad_out):
        state.params[i].get().grad = None
    for i, g in zip(grad_out, grads):
        p = state.params[i].get()
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            g = DTensor.from_local(g.to(p.to_local().device), mesh, [Replicate()] * mesh.ndim, run_check=False)
        p.grad = g


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the full shape for tracing (DTensors are traced by their global shape)."""
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    except ImportError:  # pragma: no cover
        pass
    return t.detach()


__all__ = ["TracedStep", "TraceError", "trace_step", "functionalize_graph"]
