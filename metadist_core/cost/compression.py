"""Gradient compression (``grad_compression``): which values travel in which dtype.

A frontend that knows which values are parameter gradients marks them with
the role ``"gradient"`` (the torch frontend does: the ``.grad`` every
optimizer reads). Under ``grad_compression="bf16"`` or ``"fp16"`` every
collective on a gradient travels in that dtype and is decompressed right
after (DDP's fp16/bf16 comm hooks, AutoDist's compressors, in our words).

The collective that reduces a gradient may sit a few ops before the value the
optimizer reads: a weight gradient is ``mm`` -> ``t`` (-> ``_to_copy`` under
autocast), a bias gradient ``sum`` -> ``view``, and the plan may all-reduce
any of them. :func:`wire_dtypes` therefore follows each gradient back through
ops that have one tensor input of the same number of elements (views,
transposes, casts, copies) and compresses that whole chain. The cost model
(:func:`metadist_core.problem.problem.build_problem`) prices those values' collectives
at the compressed itemsize, and the lowering casts exactly those, so the bytes
a plan predicts are the bytes the collectives count.

Values already as small as the wire dtype (a bf16 gradient under "fp16")
travel as they are. The numbers are approximate: the sum of the members'
rounded gradients, not the rounded sum (see the README for the measured drift).
"""

from __future__ import annotations

from metadist_core.ir.ir import DTYPE_BYTES, MetaIR, MetaOp
from metadist_core.config import compression_dtype

ROLE_GRADIENT = "gradient"


def gradient_chain(graph: MetaIR) -> set[str]:
    """The gradient values of ``graph`` and the values they are views, casts or copies of."""

    def arrays(op: MetaOp) -> list[str]:  # the op's inputs that are tensors of at least one dim
        return [u for u in op.inputs if graph.vars[u].is_tensor and graph.vars[u].ndim > 0]

    def same_values(op: MetaOp) -> bool:  # a view, cast or copy of one computed value
        ins = arrays(op)
        return (
            len(ins) == 1
            and len(op.outputs) == 1
            and graph.vars[ins[0]].numel == graph.vars[op.outputs[0]].numel
            and graph.vars[ins[0]].role not in ("parameter", "optimizer_state", "buffer", "input", "hyperparameter")
        )

    grads = [v for v, mv in graph.vars.items() if mv.role == ROLE_GRADIENT]
    return graph.upstream(grads, through=same_values, reads=arrays).values


def wire_dtypes(graph: MetaIR, mode: str | None) -> dict[str, str]:
    """Value id -> the dtype its collectives travel in, for every value that ``mode`` compresses."""
    wire = compression_dtype(mode)
    if wire is None:
        return {}
    size = DTYPE_BYTES[wire]
    return {
        v: wire
        for v in sorted(gradient_chain(graph))
        if graph.vars[v].dtype.startswith("float") and DTYPE_BYTES.get(graph.vars[v].dtype, 4) > size
    }


__all__ = ["ROLE_GRADIENT", "gradient_chain", "wire_dtypes"]
