"""MetaDist's PyTorch frontend."""

from __future__ import annotations

from typing import Any

from metadist_core.driver.sideeffects import SideEffectError


def rules_for(op: Any, *example_inputs: Any, axis_size: int = 2):
    """The verified one-axis ``ShardingRule``s of ``op`` (an ``OpOverload`` or a callable).

    ``example_inputs`` are the op's positional arguments, tensors and others
    alike; each tensor, also each tensor inside a list argument (as for
    ``cat``), is one input of the rules, in order. Floats run in float64 during
    discovery. Raises ``metadist_core.discovery.shardcombine.Unrunnable`` for an op that
    cannot be run in isolation (random, data-dependent).

    >>> rules_for(torch.ops.aten.mm.default, torch.randn(8, 4), torch.randn(4, 6))  # doctest: +SKIP
    """
    from .ops.oprunner import rules_for as _rules_for

    return _rules_for(op, *example_inputs, axis_size=axis_size)


def metadist_compile(
    mesh: Any = None,
    solver: str | None = None,
    memory_budget: int | None = None,
    cache_dir: str | None = None,
    *,
    constraints: Any = None,
    plugins: Any = None,
    **options: Any,
):
    """Decorate a training step so that MetaDist traces, plans and runs it split over ``mesh``.

    See :func:`metadist_torch.compile.metadist_compile` (``options``: micro_batches, pipeline_stages, schedule).
    """
    from .compile import metadist_compile as _metadist_compile

    return _metadist_compile(
        mesh=mesh,
        solver=solver,
        memory_budget=memory_budget,
        cache_dir=cache_dir,
        constraints=constraints,
        plugins=plugins,
        **options,
    )


def annotate(tensor: Any, *placements: Any) -> Any:
    """Pin how ``tensor`` is split inside a compiled step (one Placement for every mesh axis, or one per
    axis); the identity on the numbers. See :mod:`metadist_torch.trace.annotate`."""
    from .trace.annotate import annotate as _annotate

    return _annotate(tensor, *placements)


def to_dtensor_placements(plan: Any) -> dict:
    """``{parameter name: torch.distributed.tensor placements}`` of a ShardingPlan."""
    from .trace.annotate import to_dtensor_placements as _to

    return _to(plan)


def save_checkpoint(path: Any, model: Any, optimizer: Any = None, **kwargs: Any) -> float:
    """Save ``model`` (and ``optimizer``; ``scheduler=``, ``extra=``, ``rng=``, ``step=``) to the folder
    ``path`` through torch.distributed.checkpoint, atomically. Layout-independent: see
    :func:`metadist_torch.checkpoint.checkpoint.save_checkpoint`."""
    from .checkpoint.checkpoint import save_checkpoint as _save

    return _save(path, model, optimizer, **kwargs)  # seconds taken


def load_checkpoint(path: Any, model: Any, optimizer: Any = None, **kwargs: Any) -> float:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and ``optimizer``; ``scheduler=``,
    ``extra=``, ``rng=``), in place, on any mesh or at world size 1; a partial or corrupt one is refused.
    See :func:`metadist_torch.checkpoint.checkpoint.load_checkpoint`."""
    from .checkpoint.checkpoint import load_checkpoint as _load

    return _load(path, model, optimizer, **kwargs)  # seconds taken


def latest_checkpoint(root: Any) -> str | None:
    """The newest complete checkpoint folder under ``root`` (None: there is none): where a restart resumes."""
    from .checkpoint.checkpoint import latest_checkpoint as _latest

    return _latest(root)


__all__ = [
    "rules_for",
    "metadist_compile",
    "annotate",
    "to_dtensor_placements",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "SideEffectError",
]
