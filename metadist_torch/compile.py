"""``metadist_compile``: the core's step decorator bound to the torch frontend.

    @metadist_compile()
    def train_step(model, optimizer, inputs, labels):
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss

On each call the step's signature (tensor shapes, dtypes and devices, the
other arguments by value, modules and optimizers by identity) picks a compiled
entry; a new signature is traced, planned and lowered once by the one driver
(:func:`metadist_core.pipeline.compile_step`) through :class:`TorchFrontend`:
every rank traces, rank 0 discovers and solves, the plan is shared, every
rank lowers.

State lives sharded: parameters become DTensor ``nn.Parameter``s over the
torch DeviceMesh with the plan's storage placements, optimizer state entries
and buffers become DTensors, so that ``torch.distributed.checkpoint`` can save
them; each call feeds their local shards to the per-rank program and writes
the new shards back in place. Inputs are split on entry (every rank passes the
whole batch), returned values are whole on every rank. At world size 1 the
traced functional graph runs directly on plain tensors.

Random ops run replicated; at the first compile with random ops every rank
takes rank 0's random state, so all ranks (and a single-device run seeded the
same way) draw the same numbers.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from metadist_core.pipeline import CompiledStep
from metadist_core.plugins import PluginManager

from .plugin import TorchFrontend
from .stats import CommStats


class TorchStep(CompiledStep):
    """A training step compiled by MetaDist for torch: call it like the original step.

    ``.plan``, ``.graph``, ``.timings`` (trace, discover, build_problem, solve,
    share, lower seconds) describe its last compile; ``.comm_stats`` counts
    what the collectives of its last lowered program moved.
    """

    @property
    def comm_stats(self) -> CommStats:
        stats = getattr(self.runnable, "stats", None)
        return stats if isinstance(stats, CommStats) else CommStats()


def metadist_compile(mesh: Any = None, solver: str | None = None, memory_budget: int | None = None,
                     cache_dir: str | None = None, *, constraints: Iterable[Any] | None = None,
                     plugins: PluginManager | None = None) -> Callable[[Callable], TorchStep]:
    """Decorate a training step so that it runs split over the devices of ``mesh``.

    :param mesh: None (the whole world as one axis), a shape such as ``(2, 2)``,
        or a torch ``DeviceMesh``; its size must be the world size.
    :param solver: solver name (default from ``METADIST_SOLVER`` / pyproject / "ilp").
    :param memory_budget: bytes per device the plan must fit in.
    :param cache_dir: where the rule cache lives.
    :param constraints: ``Pin``/``Forbid`` constraints every plan must keep.
    :param plugins: the PluginManager to find solvers in (default: the installed plugins).
    """
    if callable(mesh) and not isinstance(mesh, (tuple, list)) and not hasattr(mesh, "shape"):
        raise TypeError("metadist_compile takes arguments: write @metadist_compile() with parentheses")

    def wrap(fn: Callable) -> TorchStep:
        return TorchStep(TorchFrontend(), fn, mesh=mesh, constraints=constraints, plugins=plugins, solver=solver,
                         memory_budget=memory_budget, cache_dir=cache_dir)

    return wrap


__all__ = ["metadist_compile", "TorchStep"]
