"""``grad_compression`` for torch: gradient collectives travel as bf16 or fp16, decompressed right after.

    step = metadist_compile(grad_compression="bf16")(train_step)

Which values are gradients is decided once, in the core
(:func:`metadist_core.cost.compression.wire_dtypes`, from the MetaIR role
``"gradient"`` the tracer sets); the cost model prices those values'
collectives at the compressed itemsize and the lowering
(:class:`metadist_torch.lower.collectives.AxisComm`) runs them through :func:`compressed`:
cast to the wire dtype, run the collective, cast back to the value's own
dtype. An ``avg`` reduction divides before the cast (as DDP's fp16 hook does),
so that fp16 sums overflow no sooner than the mean would. The counted bytes
(:class:`~metadist_torch.runtime.stats.CommStats`) are those of the wire tensors.
"""

from __future__ import annotations

from typing import Callable

import torch

from metadist_core.cost.compression import wire_dtypes
from metadist_core.ir.ir import MetaIR

TORCH_WIRE: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def wire_map(graph: MetaIR, mode: str | None) -> dict[str, torch.dtype]:
    """Value id -> the torch dtype its collectives travel in (empty without compression)."""
    return {v: TORCH_WIRE[d] for v, d in wire_dtypes(graph, mode).items()}


def compressed(
    x: torch.Tensor, wire: torch.dtype | None, run: Callable[[torch.Tensor], torch.Tensor], divide: int = 1
) -> torch.Tensor:
    """``run`` (a collective) on ``x`` sent as ``wire``; the result back in ``x``'s dtype.

    ``divide`` > 1: ``x / divide`` is what travels (an ``avg`` done as a sum of pre-divided values).
    """
    if divide > 1:
        x = x / divide
    if wire is None or x.dtype == wire or not x.dtype.is_floating_point:
        return run(x)
    return run(x.to(wire)).to(x.dtype)


__all__ = ["TORCH_WIRE", "wire_map", "compressed"]
