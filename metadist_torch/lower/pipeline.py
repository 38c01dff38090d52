"""Micro-batched steps for torch: the gradient part per micro-batch, the optimizer update once.

:func:`split_batch` cuts a call's tensors along dim 0; :class:`MicroBatchProgram`
runs the two parts of :func:`metadist_core.levers.microbatch.cut_at_gradients`, each
lowered to this rank's fx program by :func:`metadist_torch.lower.lower.lower_plan`
under the one plan of the whole step (so a micro-batch runs exactly the
collectives the plan priced, and gradients stay in the plan's layout, Partial
included, until the update reads them). Buffers are written back after every
micro-batch (BatchNorm's running statistics chain as in eager accumulation);
parameters and optimizer state once, after the update.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from metadist_core.driver.frontend import BatchLeaves
from metadist_core.levers.microbatch import GradientCut, combine
from metadist_core.levers.microbatch import split_batch as core_split_batch
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding, local_piece

from ..runtime.engine import Engine
from .lower import lower_plan
from .program import _TOKENS, claim_layout, input_pieces, local_of, moved_once, place_state, user_tensors
from ..runtime.stats import CommStats
from ..trace.trace import TracedStep


def batch_leaves(args: tuple, kwargs: dict) -> BatchLeaves:
    """The call's leaves; every tensor among them is a batch leaf."""
    leaves, spec = pytree.tree_flatten((list(args), dict(kwargs)))

    def rebuild(lv: list) -> tuple[tuple, dict]:
        a, kw = pytree.tree_unflatten(lv, spec)
        return tuple(a), kw

    return BatchLeaves(
        leaves, [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)], rebuild, "tensor input"
    )


def split_batch(args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
    """``m`` calls, each with every tensor argument's ``i``-th equal part along dim 0 (others unchanged)."""
    return core_split_batch(args, kwargs, m, batch_leaves, "torch")


class MicroBatchProgram:
    """One step as ``m`` micro-batches on this rank: ``cut.grad_graph`` per micro-batch, gradients summed or
    averaged in the plan's layout, ``cut.update_graph`` once; state written back in place."""

    def __init__(
        self,
        traced: TracedStep,
        cut: GradientCut,
        plans: tuple,
        mesh: Mesh,
        engine: Engine,
        m: int,
        *,
        coalesce: bool = True,
        bucket_bytes: int = 25 * 2**20,
        shard_bucket_bytes: int = 0,
        first_bucket_bytes: int = 0,
    ) -> None:
        self.traced, self.cut, self.plans, self.engine, self.m = traced, cut, plans, engine, m
        self.stats = CommStats()
        kw = dict(
            coords=engine.coords,
            groups=engine.groups(),
            stats=self.stats,
            coalesce=coalesce,
            bucket_bytes=bucket_bytes,
            shard_bucket_bytes=shard_bucket_bytes,
            first_bucket_bytes=first_bucket_bytes,
        )
        self.grad = lower_plan(cut.grad_graph, plans[0], mesh, **kw)
        self.update = lower_plan(cut.update_graph, plans[1], mesh, **kw)
        n_s = len(traced.state.slots)
        self.slot_of = {traced.in_names[i]: i for i in range(n_s)}
        self.user_in = {traced.in_names[n_s + j]: j for j in range(traced.n_inputs)}
        self.consts = {
            name: traced.constant_on(k, engine.device)
            for k, name in enumerate(traced.in_names[n_s + traced.n_inputs :])
        }
        rep = Sharding.replicated(mesh.ndim)
        self.rep = rep
        out_vars = traced.out_vars[: traced.n_tensor_outputs]
        missing = [v for v in out_vars if v not in self.grad.output_vars]
        if missing:
            raise ValueError(
                f"with micro_batches the step must return values of the forward and backward "
                f"(the loss); it returns {', '.join(map(str, missing))}, which the optimizer update "
                f"or the state holds: return a copy (.clone()) of a forward value instead"
            )
        self.out_pos = [self.grad.output_vars.index(v) for v in out_vars]
        self.layout = next(_TOKENS)
        claim_layout(traced, plans[2], engine, self.layout)

    def _inputs(self, rank_graph: Any, plan: Any, user: list[torch.Tensor], extra: dict[str, Any]) -> list:
        slots = self.traced.state.slots
        mesh, coords, dev = self.engine.mesh, self.engine.coords, self.engine.device
        whole = moved_once(user, self.user_in, dev)
        local = []
        for v in rank_graph.input_vars:
            sh = plan.input_shardings.get(v, self.rep)
            if v in extra:
                local.append(extra[v])
            elif v in self.slot_of:
                local.append(local_of(slots[self.slot_of[v]].get()))
            elif v in self.user_in:
                local.append(local_piece(whole(v), sh, mesh, coords, zeros_like=torch.zeros_like))
            else:
                local.append(local_piece(self.consts[v], sh, mesh, coords, zeros_like=torch.zeros_like))
        return local + input_pieces(rank_graph, whole, self.engine)

    def _write(self, rank_graph: Any, outs: tuple) -> dict[str, torch.Tensor]:
        """Write updated state slots in place; return the pseudo-state (gradient) values by gradient var."""
        slots = self.traced.state.slots
        n_out = len(rank_graph.output_vars)
        grads = {}
        for k, s_in in enumerate(rank_graph.state_inputs):
            x = outs[n_out + k]
            if s_in in self.cut.acc_of:
                grads[self.cut.acc_of[s_in]] = x
            else:
                local_of(slots[self.slot_of[s_in]].get()).copy_(x)
        return grads

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.traced.refresh()
        claim_layout(self.traced, self.plans[2], self.engine, self.layout)
        parts = split_batch(args, kwargs, self.m)
        dummy = {a: torch.empty(0) for a in self.cut.acc_of}
        sums: dict[str, torch.Tensor] = {}
        per_out: list[list[torch.Tensor]] = [[] for _ in self.out_pos]
        with torch.no_grad():
            for a, kw in parts:
                outs = self.grad(*self._inputs(self.grad, self.plans[0], user_tensors(a, kw), dummy))
                for g, x in self._write(self.grad, outs).items():
                    sums[g] = x if g not in sums else sums[g] + x
                for lst, k in zip(per_out, self.out_pos):
                    lst.append(outs[k])
            scale = 1.0 / self.m if self.cut.reduction == "mean" else 1.0
            grads = {g: x * scale if scale != 1.0 else x for g, x in sums.items()}
            self._write(self.update, self.update(*self._inputs(self.update, self.plans[1], [], grads)))
        traced_out = self.traced.out_vars[: self.traced.n_tensor_outputs]
        results = [
            combine(vals, self.cut.combine_mode(v), lambda xs: torch.cat(xs, dim=0))
            for v, vals in zip(traced_out, per_out)
        ]
        return self.traced.unflatten_outputs(results)


def lower_micro_batches(
    traced: TracedStep, cut: GradientCut, plans: tuple, mesh: Mesh, engine: Engine, settings: Any
) -> MicroBatchProgram:
    """The :class:`MicroBatchProgram` of a traced step on ``engine`` (state placed as the plan stores it)."""
    _no_lasting_grads(traced, f"micro_batches={settings.micro_batches}")
    if engine.distributed:
        place_state(traced, plans[2], engine)
    if traced.random_ops:
        engine.sync_rng()
    return MicroBatchProgram(
        traced,
        cut,
        plans,
        mesh,
        engine,
        settings.micro_batches,
        coalesce=settings.coalesce,
        bucket_bytes=settings.bucket_bytes,
        shard_bucket_bytes=settings.shard_bucket_bytes,
        first_bucket_bytes=settings.first_bucket_bytes,
    )


def _no_lasting_grads(traced: TracedStep, option: str) -> None:
    """Gradients that live across calls run in one program, not with ``option`` (a clear error)."""
    if traced.grad_in or traced.grad_out:
        from metadist_core.driver.frontend import NotSupported

        which = traced.state.params[(traced.grad_out or traced.grad_in)[0]].name
        raise NotSupported(
            f"{option}: the step leaves or reads parameters' .grad across calls ({which}.grad; "
            f"accumulating in the caller's loop); not yet with {option}: call optimizer.zero_grad() "
            f"inside the step after optimizer.step(), or use the default of this option"
        )


__all__ = ["MicroBatchProgram", "split_batch", "lower_micro_batches"]
