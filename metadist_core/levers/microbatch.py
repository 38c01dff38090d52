"""Gradient accumulation over micro-batches: the whole-step graph cut at its gradients.

A traced training step holds forward, backward and the optimizer update in one
graph. With ``micro_batches=m`` the step is traced on one micro-batch (the
batch, dim 0 of every tensor input, cut into m equal parts) and planned once;
:func:`cut_at_gradients` then splits that graph in two parts that reuse the
plan's layouts:

- the **gradient part** (run once per micro-batch): every op that depends on
  the batch but not on optimizer state: forward, loss, backward. It returns
  the user's outputs, the new buffers (chained from one micro-batch to the
  next, as eager gradient accumulation does) and the **gradients**: the values
  it hands to the update, each left in the layout the plan gave it (kept as a
  pseudo state value ``<var>.acc`` so that no lowering gathers it);
- the **update part** (run once, after the last micro-batch): the optimizer
  step, from the parameters, the optimizer state and the gradients summed (a
  sum-reduced loss) or averaged (a mean-reduced loss) over the micro-batches.

Averaging is exact for every layout, Partial included, because it is linear;
it is exact for the step because the cut values are linear in the per-sample
gradients (an L2 term ``g + wd * p`` and SGD's ``p - lr * g`` stay affine).
What is *not* linear and sits between backward and ``optimizer.step()`` without
optimizer state, such as gradient clipping by global norm, runs per micro-batch:
documented, not detected.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from metadist_core.ir.ir import ACC_SUFFIX, RECOMPUTED_SUFFIX, UPDATE_ROLES, MetaIR
from metadist_core.ir.placement import Sharding
from metadist_core.plan.plan import PlanEdge
from metadist_core.problem.problem import OUTPUT

log = logging.getLogger("metadist.microbatch")


class MicroBatchError(ValueError):
    """Micro-batching cannot apply to this step as written (names the value and what to do)."""


def micro_batch_size(sizes: Sequence[tuple[str, int]], m: int) -> int:
    """The micro-batch size for batch dims ``sizes`` (``(input name, dim-0 size)``); a clear error if
    ``m`` is not a positive integer, the inputs disagree, or ``m`` does not divide the batch."""
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise MicroBatchError(f"micro_batches must be a positive integer, got {m!r}")
    if not sizes:
        raise MicroBatchError(
            f"micro_batches={m} cuts the batch (dim 0 of every tensor input), but the step "
            f"has no tensor input with a dim 0"
        )
    name0, b = sizes[0]
    for name, s in sizes[1:]:
        if s != b:
            raise MicroBatchError(
                f"micro_batches={m}: the tensor inputs disagree on the batch size (dim 0): "
                f"{name0} has {b}, {name} has {s}; every tensor input must share dim 0"
            )
    if b % m:
        raise MicroBatchError(
            f"a batch of {b} (dim 0 of {name0}) does not divide into micro_batches={m}; "
            f"pick a micro_batches that divides {b} or a batch that {m} divides"
        )
    return b // m


def _subgraph(
    graph: MetaIR,
    name: str,
    op_ids: Sequence[str],
    extra_inputs: Sequence[str],
    outputs: Sequence[str],
    aliases: dict[str, str],
    acc: dict[str, str],
) -> MetaIR:
    """A MetaIR of ``op_ids`` keeping every id (so the plan's strategies and edges still name them)."""
    g = MetaIR(name)
    ops = [graph.op(i) for i in op_ids]
    made = {v for op in ops for v in op.outputs}
    read = {v for op in ops for v in op.inputs} | set(outputs) | set(aliases)
    for v in graph.inputs:
        if v in read:
            mv = graph.vars[v]
            g.add_input(v, mv.shape, mv.dtype, mv.role)
    for v in extra_inputs:
        mv = graph.vars[v]
        g.add_input(v, mv.shape, mv.dtype, "input")
    for a, v in acc.items():
        mv = graph.vars[v]
        g.add_input(a, mv.shape, mv.dtype, "buffer")
    for op in ops:
        g.add_op(
            op.key,
            op.inputs,
            [(v, graph.vars[v].shape, graph.vars[v].dtype) for v in op.outputs],
            op.attrs,
            id=op.id,
            payload=op.payload,
        )
    missing = [v for v in outputs if v not in made and v not in g.vars]
    if missing:
        raise MicroBatchError(f"{name}: outputs {missing} are not computed by it")
    g.set_outputs(list(outputs))
    for s, v in {**aliases, **acc}.items():
        g.alias(s, v)
    g.payload = graph.payload
    g.validate()
    return g


def loss_reduction(graph: MetaIR) -> str:
    """``"sum"`` when the step's first scalar output is made by a sum (``aten.sum``, ``reduce_sum``,
    a loss with ``reduction=2``), else ``"mean"``: how gradients and losses combine over micro-batches."""
    state_outs = set(graph.aliases.values())
    for o in graph.outputs:
        mv = graph.vars[o]
        if o in state_outs or mv.shape is None or mv.shape != ():
            continue
        op = graph.producer(o)
        while op is not None and op.key.split(".")[-2:-1] in (
            ["clone"],
            ["detach"],
            ["copy"],
            ["convert_element_type"],
        ):
            op = graph.producer(op.inputs[0]) if op.inputs else None
        if op is None:
            return "mean"
        short = op.key.split(".")[1] if op.key.count(".") >= 2 else op.key
        if "sum" in short.lower():
            return "sum"
        if "loss" in short:
            args = op.attrs.get("args", [])
            ints = [a for a in args[2:] if isinstance(a, int) and not isinstance(a, bool)]
            if ints and ints[0] == 2:  # aten's Reduction enum: 0 none, 1 mean, 2 sum
                return "sum"
        return "mean"
    return "mean"


@dataclass
class GradientCut:
    """A step cut at its gradients: what runs per micro-batch and what runs once."""

    grad_graph: MetaIR  # per micro-batch: user outputs, new buffers, gradients (pseudo state)
    update_graph: MetaIR  # once: new parameters and optimizer state
    gradients: list[str]  # the cut values, as the update reads them
    acc_of: dict[str, str]  # pseudo state input of the gradient part -> its gradient
    user_outputs: list[str]  # the whole graph's non-state outputs, in order
    reduction: str  # "mean" | "sum": how gradients and scalar outputs combine
    concat_outputs: set[str] = field(default_factory=set)  # outputs with the micro-batch on dim 0: concatenated
    batch_stats: bool = False  # the forward normalises with batch statistics (BatchNorm)

    def combine_mode(self, var: str) -> str:
        """How the micro-batches' values of user output ``var`` combine: concat, mean or sum."""
        return "concat" if var in self.concat_outputs else self.reduction


def cut_at_gradients(graph: MetaIR, micro_batch: int | None = None) -> GradientCut:
    """Cut the traced whole step ``graph`` at its gradients (see the module docstring).

    ``micro_batch`` is dim 0 of the traced (micro-batch) inputs; outputs with
    that dim 0 that depend on the batch are concatenated, the others combine
    like the loss.
    """
    inputs_by_role = {
        r: [v for v in graph.inputs if graph.vars[v].role == r]
        for r in ("input", "parameter", "optimizer_state", "buffer")
    }
    if not inputs_by_role["input"]:
        raise MicroBatchError("micro_batches needs a batch: the step has no tensor input")
    batch = graph.downstream(inputs_by_role["input"]).values
    stateful = graph.downstream(inputs_by_role["optimizer_state"]).values
    update_aliases = {s: o for s, o in graph.aliases.items() if graph.vars[s].role in UPDATE_ROLES}
    region = {
        op.id for op in graph.ops if any(v in batch for v in op.outputs) and not any(v in stateful for v in op.outputs)
    }
    # Forward values: the batch and what the returned values (the loss) and new buffers are computed from.
    # A value of the region is past the backward pass when nothing computed from it in the region reads a
    # forward value again: the gradients are the first such values (``mm(x.T, dy)``); whatever the region
    # computes from them alone (Adam's ``g * g``, a global-norm clip) is the optimizer's and runs once, on
    # the accumulated gradients (a square of a sum is not a sum of squares).
    state_outs0 = set(graph.aliases.values())
    fwd_roots = [o for o in graph.outputs if o not in state_outs0] + [
        o for s, o in graph.aliases.items() if s not in update_aliases
    ]
    forward = (graph.upstream(fwd_roots).values & batch) | set(inputs_by_role["input"])
    forward |= {v for v in batch if v.endswith(RECOMPUTED_SUFFIX)}  # forward values recomputed for the backward
    consumers: dict[str, list[str]] = {}
    for op in graph.ops:
        if op.id in region:
            for v in op.inputs:
                consumers.setdefault(v, []).append(op.id)
    bad: dict[str, bool] = {}
    for op in reversed(graph.ops):
        if op.id in region:
            bad[op.id] = any(v in forward for v in op.inputs) or any(
                bad.get(c, False) for v in op.outputs for c in consumers.get(v, [])
            )
    post_fwd = {
        v
        for op in graph.ops
        if op.id in region
        for v in op.outputs
        if v not in forward and not any(bad.get(c, False) for c in consumers.get(v, []))
    }
    post: set[str] = set()
    for op in graph.ops:
        if op.id in region and op.outputs and all(v in post_fwd for v in op.outputs):
            b_in = [v for v in op.inputs if v in batch]
            if b_in and all(v in post_fwd for v in b_in):
                post.update(op.outputs)
    grad_ops = {op.id for op in graph.ops if op.id in region and not any(v in post for v in op.outputs)}
    made_by_grad = {v for op in graph.ops if op.id in grad_ops for v in op.outputs}

    buffer_aliases = {s: o for s, o in graph.aliases.items() if s not in update_aliases}
    state_outs = set(graph.aliases.values())
    user_outputs = [o for o in graph.outputs if o not in state_outs]

    update_ops = graph.ops_computing(update_aliases.values(), made_by_grad)
    needed = {v for i in update_ops for v in graph.op(i).inputs} | set(update_aliases.values())
    gradients = [v for v in graph.vars if v in made_by_grad and v in needed]
    raw = [v for i in update_ops for v in graph.op(i).inputs if v in inputs_by_role["input"]]
    if raw:
        raise MicroBatchError(
            f"the optimizer update reads the batch input {raw[0]} directly, not through "
            f"gradients; micro_batches cannot accumulate such a step (use micro_batches=1)"
        )
    acc_of = {f"{g}{ACC_SUFFIX}": g for g in gradients}
    grad_targets = user_outputs + list(buffer_aliases.values()) + gradients
    grad_ops_needed = graph.ops_computing(grad_targets)
    mixed = [i for i in grad_ops_needed if i not in grad_ops and any(v in batch for v in graph.op(i).outputs)]
    if mixed:
        op = graph.op(mixed[0])
        raise MicroBatchError(
            f"the step returns or keeps a value computed by the optimizer update from the batch "
            f"(op {op.id}, {op.key}); micro_batches cannot accumulate such a step"
        )
    grad_graph = _subgraph(
        graph, f"{graph.name}.gradients", grad_ops_needed, [], user_outputs + gradients, buffer_aliases, acc_of
    )
    update_graph = _subgraph(graph, f"{graph.name}.update", update_ops, gradients, [], update_aliases, {})
    concat = set()
    if micro_batch is not None:
        concat = {o for o in user_outputs if o in batch and (shp := graph.vars[o].shape) and shp[0] == micro_batch}
    bn = any("batch_norm" in op.key for op in graph.ops) or any(o in batch for o in buffer_aliases.values())
    cut = GradientCut(grad_graph, update_graph, gradients, acc_of, user_outputs, loss_reduction(graph), concat, bn)
    log.info(
        "cut %s at %d gradients: %d ops per micro-batch, %d ops once; %s-reduced loss",
        graph.name,
        len(gradients),
        len(grad_graph.ops),
        len(update_graph.ops),
        cut.reduction,
    )
    return cut


def part_plan(plan: Any, part: MetaIR, acc_of: dict[str, str] | None = None) -> Any:
    """The plan of the whole step restricted to ``part``: the same layouts and collectives; inputs that the
    whole step computes (gradients) arrive as the plan made them, pseudo state leaves as it is."""

    acc_of = acc_of or {}
    rep = Sharding.replicated(len(plan.mesh_shape))
    ops = {op.id for op in part.ops}
    in_sh = {}
    for v in part.inputs:
        if v in acc_of:
            in_sh[v] = plan.var_shardings.get(acc_of[v], rep)
        else:
            in_sh[v] = plan.input_shardings.get(v, plan.var_shardings.get(v, rep))
    outs = set(part.outputs)
    edges = []
    for e in plan.edges:
        if e.slot >= 0 and e.dst in ops:
            edges.append(e)
        elif e.slot < 0 and e.dst == OUTPUT and e.var in outs:
            edges.append(e)
        elif e.slot < 0 and part.aliases.get(e.dst) == e.var:
            edges.append(e)
    for a, g in acc_of.items():
        sh = plan.var_shardings.get(g, rep)
        edges.append(PlanEdge(g, part.vars[g].producer or g, a, -1, sh, sh, []))
    return replace(
        plan,
        op_strategies={k: v for k, v in plan.op_strategies.items() if k in ops},
        strategies={k: v for k, v in plan.strategies.items() if k in ops},
        input_shardings=in_sh,
        edges=edges,
    )


def combine(values: Sequence[Any], mode: str, concat: Any = None) -> Any:
    """The micro-batches' values of one output or gradient combined: ``sum``, ``mean`` (sum / m) or
    ``concat`` (``concat(values)``, the frontend's concatenation along dim 0)."""
    if mode == "concat":
        return concat(list(values))
    acc = values[0]
    for x in values[1:]:
        acc = acc + x
    return acc * (1.0 / len(values)) if mode == "mean" else acc


_WARNED: set[str] = set()


def warn_batch_stats(cut: GradientCut, m: int, name: str) -> None:
    """Say once per step name that batch statistics (BatchNorm) are per micro-batch under micro_batches."""
    if not cut.batch_stats or name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(
        f"metadist: {name} normalises with batch statistics (BatchNorm): with micro_batches={m} they "
        f"are computed per micro-batch, not over the whole batch, so its numbers differ from one "
        f"whole-batch step (running statistics are updated once per micro-batch, as in eager gradient "
        f"accumulation)",
        stacklevel=3,
    )


def split_batch(
    args: tuple, kwargs: dict, m: int, batch_leaves: Callable[[tuple, dict], Any] | None, frontend: str = "this"
) -> list[tuple[tuple, dict]]:
    """The call cut into ``m`` micro-batches, each ``(args, kwargs)`` holding the ``j``-th equal part along
    dim 0 of every batch leaf (``batch_leaves(args, kwargs)``: a frontend's
    :class:`~metadist_core.driver.frontend.BatchLeaves`), the other leaves whole; a batch ``m`` does not
    divide is an error quoting both (:func:`micro_batch_size`)."""
    if batch_leaves is None:
        raise MicroBatchError(
            f"the {frontend} frontend cannot cut a batch into micro-batches "
            f"(micro_batches={m}); run with micro_batches=1"
        )
    flat = batch_leaves(tuple(args), dict(kwargs))
    leaves = flat.leaves
    scalars = [k for k, i in enumerate(flat.batch) if getattr(leaves[i], "ndim", 1) == 0]
    if scalars:
        raise MicroBatchError(
            f"micro_batches={m} cuts dim 0 of every tensor input, but {flat.what} {scalars[0]} "
            f"is a 0-d tensor; pass it as a Python number or give it a batch dim"
        )
    mb = micro_batch_size([(f"{flat.what} {k}", int(leaves[i].shape[0])) for k, i in enumerate(flat.batch)], m)
    out = []
    for j in range(m):
        lv = list(leaves)
        for i in flat.batch:
            lv[i] = leaves[i][j * mb : (j + 1) * mb]
        out.append(flat.rebuild(lv))
    return out


def micro_batch_program(traced: Any, plan: Any, settings: Any) -> tuple[GradientCut, tuple]:
    """``traced.graph`` cut at its gradients and the plans of both parts under ``plan`` (and ``plan``
    itself): what a frontend lowers for ``micro_batches > 1``
    (:class:`~metadist_core.driver.frontend.MicroBatches`)."""
    graph = traced.graph
    batch_in = [v for v in graph.inputs if graph.vars[v].role == "input" and graph.vars[v].shape]
    cut = cut_at_gradients(graph, graph.vars[batch_in[0]].shape[0] if batch_in else None)
    warn_batch_stats(cut, settings.micro_batches, graph.name)
    plans = (part_plan(plan, cut.grad_graph, cut.acc_of), part_plan(plan, cut.update_graph), plan)
    return cut, plans


__all__ = [
    "GradientCut",
    "MicroBatchError",
    "cut_at_gradients",
    "part_plan",
    "micro_batch_size",
    "combine",
    "micro_batch_program",
    "split_batch",
    "loss_reduction",
    "warn_batch_stats",
]
