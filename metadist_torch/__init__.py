"""MetaDist's PyTorch frontend."""
from __future__ import annotations

from typing import Any


def rules_for(op: Any, *example_inputs: Any, axis_size: int = 2):
    """The verified one-axis ``ShardingRule``s of ``op`` (an ``OpOverload`` or a callable).

    ``example_inputs`` are the op's positional arguments, tensors and others
    alike; each tensor, also each tensor inside a list argument (as for
    ``cat``), is one input of the rules, in order. Floats run in float64 during
    discovery. Raises ``metadist_core.shardcombine.Unrunnable`` for an op that
    cannot be run in isolation (random, data-dependent).

    >>> rules_for(torch.ops.aten.mm.default, torch.randn(8, 4), torch.randn(4, 6))  # doctest: +SKIP
    """
    from .oprunner import rules_for as _rules_for
    return _rules_for(op, *example_inputs, axis_size=axis_size)


def metadist_compile(mesh: Any = None, solver: str | None = None, memory_budget: int | None = None,
                     cache_dir: str | None = None, *, constraints: Any = None, plugins: Any = None):
    """Decorate a training step so that MetaDist traces, plans and runs it split over ``mesh``.

    See :func:`metadist_torch.compile.metadist_compile`.
    """
    from .compile import metadist_compile as _metadist_compile
    return _metadist_compile(mesh=mesh, solver=solver, memory_budget=memory_budget, cache_dir=cache_dir,
                             constraints=constraints, plugins=plugins)


__all__ = ["rules_for", "metadist_compile"]
