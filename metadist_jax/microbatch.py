"""Micro-batched JAX steps: every micro-batch inside one ``shard_map``.

The batch leaves enter stacked as ``(m, micro-batch, ...)`` (a leading
unsplit dim before the plan's layout), so that ``x[i]`` in the body is this
device's piece of micro-batch ``i``. The body walks the gradient part of
:func:`metadist_core.levers.microbatch.cut_at_gradients` once per micro-batch with the
core's interpreter, sums or averages the gradients in the plan's layout (a
Partial gradient stays Partial until the update reads it, so its all-reduce
runs once), then walks the update part once. Outputs leave as the whole
step's plan says (state as its input is stored, the loss replicated).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from metadist_core.driver.frontend import BatchLeaves
from metadist_core.plan.interpret import interpret
from metadist_core.levers.microbatch import GradientCut, combine, micro_batch_size
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding

from .engine import put
from .lower import JaxCollectives, check_even, local_op_runner, moves_only, output_shardings, partition_spec


def batch_leaf_positions(args: tuple, kwargs: dict) -> tuple[list, Any, list[int]]:
    """The flat leaves of a call, its treedef, and which leaves are the batch (``args[2:]`` and kwargs)."""
    flat, tree = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))
    pos = []
    for i, (path, x) in enumerate(flat):
        top = path[0].idx if hasattr(path[0], "idx") else None
        is_batch = top == 1 or (top == 0 and len(path) > 1 and getattr(path[1], "idx", 0) >= 2)
        if is_batch and getattr(x, "ndim", 0) >= 1:
            pos.append(i)
    return [x for _, x in flat], tree, pos


def batch_leaves(args: tuple, kwargs: dict) -> BatchLeaves:
    """The call's leaves; the batch leaves are those of ``args[2:]`` and kwargs with a dim 0."""
    leaves, tree, pos = batch_leaf_positions(args, kwargs)

    def rebuild(lv: list) -> tuple[tuple, dict]:
        a, kw = jax.tree_util.tree_unflatten(tree, lv)
        return tuple(a), kw

    return BatchLeaves(leaves, pos, rebuild, "batch leaf")


class MicroBatchedStep:
    """A micro-batched step called with the user's whole-batch pytrees."""

    def __init__(self, fn: Any, context: Any, in_shardings: list, batch_ids: set[str], m: int) -> None:
        self.fn, self.context, self.in_shardings, self.m = fn, context, in_shardings, m
        self.batch_idx = {i for i, v in enumerate(context.input_ids) if v in batch_ids}
        n = len(context.input_ids)
        self.consts = [put(context.const_values[v], in_shardings[n + k]) for k, v in enumerate(context.const_ids)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self.context.in_tree:
            raise TypeError(f"the step was compiled for arguments shaped {self.context.in_tree}, got {tree}")
        leaves = self.context.dynamic(leaves)  # static leaves are fixed in the trace
        placed = []
        for i, (x, s) in enumerate(zip(leaves, self.in_shardings)):
            if i in self.batch_idx:
                b = x.shape[0]
                micro_batch_size([(f"batch leaf {i}", int(b))], self.m)
                x = jnp.reshape(jnp.asarray(x), (self.m, b // self.m, *x.shape[1:]))
            placed.append(put(x, s))
        outs = self.fn(*placed, *self.consts)
        return jax.tree_util.tree_unflatten(self.context.out_tree, list(outs))


def lower_micro_batches(
    graph: Any, context: Any, cut: GradientCut, plans: tuple, plan: Any, mesh: Mesh, jax_mesh: Any, m: int
) -> MicroBatchedStep:
    """One jitted shard_map running ``m`` micro-batches of ``cut`` under the whole step's ``plan``."""
    names = list(jax_mesh.axis_names)
    mesh = Mesh(mesh.shape, names, mesh.alpha, mesh.beta, mesh.links or None)
    check_even(plan, graph, mesh)
    rep = Sharding.replicated(mesh.ndim)
    batch_ids = {v for v in graph.inputs if graph.vars[v].role == "input" and graph.vars[v].shape}
    in_specs = []
    for v in graph.inputs:
        spec = partition_spec(plan.input_shardings.get(v, rep), graph.vars[v].ndim, names)
        in_specs.append(
            PartitionSpec(None, *spec, *([None] * (graph.vars[v].ndim - len(spec)))) if v in batch_ids else spec
        )
    out_ids = list(context.output_ids)
    out_specs = [
        partition_spec(s, graph.vars[v].ndim, names)
        for v, s in zip(out_ids, output_shardings(graph, plan, mesh, out_ids))
    ]
    state_of = {o: s for s, o in graph.aliases.items()}
    run_grad = local_op_runner(cut.grad_graph, mesh)
    run_update = local_op_runner(cut.update_graph, mesh)

    def body(*inputs: Any) -> tuple:
        env = dict(zip(graph.inputs, inputs))
        sums: dict[str, Any] = {}
        per_out: dict[str, list] = {o: [] for o in cut.user_outputs}
        for i in range(m):
            g_in = {
                v: None if v in cut.acc_of else env[v][i] if v in batch_ids else env[v] for v in cut.grad_graph.inputs
            }
            res = interpret(
                cut.grad_graph, plans[0], mesh, g_in, run_grad, JaxCollectives(mesh), reduce_after=moves_only
            )
            for s_in, x in res.state.items():
                if s_in in cut.acc_of:
                    g = cut.acc_of[s_in]
                    sums[g] = x if g not in sums else sums[g] + x
                else:
                    env[s_in] = x  # a buffer: the next micro-batch reads its new value
            for o in cut.user_outputs:
                per_out[o].append(res.outputs[o])
        scale = 1.0 / m if cut.reduction == "mean" else 1.0
        u_in = {v: (sums[v] * scale if v in sums else env[v]) for v in cut.update_graph.inputs}
        res_u = interpret(
            cut.update_graph, plans[1], mesh, u_in, run_update, JaxCollectives(mesh), reduce_after=moves_only
        )
        outs = []
        for o in out_ids:
            s_in = state_of.get(o)
            if s_in is not None:
                outs.append(res_u.state[s_in] if s_in in res_u.state else env[s_in])
            else:
                outs.append(combine(per_out[o], cut.combine_mode(o), lambda xs: jnp.concatenate(xs, axis=0)))
        return tuple(outs)

    mapped = jax.shard_map(body, mesh=jax_mesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs), check_vma=False)
    in_shardings = [NamedSharding(jax_mesh, s) for s in in_specs]
    return MicroBatchedStep(jax.jit(mapped), context, in_shardings, batch_ids, m)


__all__ = ["MicroBatchedStep", "batch_leaves", "lower_micro_batches"]
