"""MetaDist's JAX frontend: ``metadist_compile`` for pure and flax.nnx steps, ``rules_for`` for one primitive.

>>> from metadist_jax import metadist_compile
>>> @metadist_compile(mesh=(2, 4))                       # doctest: +SKIP
... def train_step(params, opt_state, batch): ...
"""

from __future__ import annotations

from typing import Any


def metadist_compile(fn: Any = None, **kwargs: Any) -> Any:
    """Parallelize a pure JAX step ``(params, opt_state, batch) -> (loss, params, opt_state)``, or a flax.nnx
    step over nnx objects whose Variables are written back after each call (as ``nnx.jit`` does).

    ``metadist_compile(mesh=None, solver=None, memory_budget=None, cache_dir=None, constraints=None,
    solver_options=None, progress=None, plugins=None)`` returns a :class:`metadist_jax.compile.JaxStep`;
    see :func:`metadist_jax.compile.metadist_compile`.
    """
    from . import compile as jax_compile

    return jax_compile.metadist_compile(fn, **kwargs)


def rules_for(op: Any, *example_inputs: Any, axis_size: int = 2, **params: Any):
    """The verified one-axis ``ShardingRule``s of a JAX primitive (params as keywords) or callable.

    ``example_inputs`` are the positional arguments; every array among them
    (also inside lists) is one input of the rules, in order. Floats run in float64.

    >>> rules_for(jax.numpy.matmul, np.ones((8, 4)), np.ones((4, 6)))   # doctest: +SKIP
    """
    from . import oprunner

    return oprunner.rules_for(op, *example_inputs, axis_size=axis_size, **params)


__all__ = ["metadist_compile", "rules_for"]
