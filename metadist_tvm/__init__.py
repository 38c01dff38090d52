"""MetaDist's TVM Tensor Expression frontend.

Build a TE graph with plain ``tvm.topi`` and ``te.compute`` (each compute's
body is rebuilt at the shard shapes), with ``metadist_tvm.topi`` (``tvm.topi``
with every operator recording its call: one op per call) or with builders
decorated by ``@metadist_tvm.op``, then::

    f = metadist_tvm.parallelize([x, w1, w2], y, mesh=(4,))
    out = f(x_np, w1_np, w2_np)          # numpy in, numpy out, split over the mesh

``rules_for(builder, *example_inputs, axis_size=2)`` returns the verified
one-axis ShardingRules of one TE operator.
"""

from __future__ import annotations

from typing import Any


def rules_for(op: Any, *example_inputs: Any, axis_size: int = 2, **kwargs: Any):
    """The verified one-axis ``ShardingRule``s of a TE operator, found by ShardCombine on TVM kernels.

    ``op`` is a builder (a ``tvm.topi`` operator such as ``tvm.topi.nn.dense``,
    the same from ``metadist_tvm.topi``, or any function returning te tensors)
    or a te.Tensor (a recorded call's output, or a plain compute's: its body is
    rebuilt, input shapes from its input tensors). ``example_inputs`` are the
    builder's positional arguments: numpy arrays become tensor inputs (in
    order, also inside lists), anything else is passed as is; keyword
    arguments are passed to the builder too. Float ops run in float64
    (float32 for the few TOPI operators that refuse float64, such as
    ``layer_norm``).

    >>> rules_for(tvm.topi.nn.matmul, np.ones((8, 4)), np.ones((4, 6)))  # doctest: +SKIP
    """
    from .oprunner import rules_for as _rules_for

    return _rules_for(op, *example_inputs, axis_size=axis_size, **kwargs)


def parallelize(inputs, outputs, mesh=None, **kwargs):
    """Split a TE graph over ``mesh`` and return a callable running it; see :func:`metadist_tvm.execute.parallelize`."""
    from .execute import parallelize as _parallelize

    return _parallelize(inputs, outputs, mesh, **kwargs)


def __getattr__(name: str) -> Any:  # tvm is imported only when the TE parts are used
    if name in ("topi", "op", "clear_records"):
        from . import record

        return getattr(record, name)
    if name == "kernel_cache":
        from .oprunner import kernel_cache

        return kernel_cache
    raise AttributeError(f"module 'metadist_tvm' has no attribute {name!r}")


__all__ = ["parallelize", "rules_for", "topi", "op", "kernel_cache", "clear_records"]
