"""Steering from inside a step, and handing a plan to plain torch code.

``annotate(tensor, *placements)`` inside a compiled step pins how that value
is split (EPL's ``replicate``/``split`` in MetaDist's words)::

    h = annotate(F.gelu(self.fc(x)), Shard(0))          # one placement: the same on every mesh axis
    h = annotate(h, Shard(0), Replicate())              # or one per mesh axis

It is the identity on the numbers: traced, it becomes a pin on that value
(``metadist::annotate``, read by :mod:`metadist_torch.trace.to_ir`); run eagerly, it
returns its input. ``to_dtensor_placements(plan)`` gives each parameter's
``torch.distributed.tensor`` placements under a plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from metadist_core.ir.placement import Partial, Placement, Replicate, Shard, parse_placement

if TYPE_CHECKING:  # pragma: no cover
    from metadist_core.plan.plan import ShardingPlan


@torch.library.custom_op("metadist::annotate", mutates_args=())
def _annotate_op(x: torch.Tensor, placements: str) -> torch.Tensor:
    return x.clone()


@_annotate_op.register_fake
def _annotate_fake(x: torch.Tensor, placements: str) -> torch.Tensor:
    return torch.empty_like(x)


def _annotate_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return grad, None


_annotate_op.register_autograd(_annotate_backward)


def _encode(placements: tuple) -> str:
    if not placements:
        raise TypeError(
            "annotate(tensor, *placements) needs at least one placement, such as Shard(0) or "
            "Replicate() (one for every mesh axis, or one per axis)"
        )
    out = []
    for p in placements:
        if isinstance(p, str):
            p = parse_placement(p)
        if not isinstance(p, Placement):
            raise TypeError(
                f"annotate: {p!r} is not a placement; use metadist_core.ir.placement's Shard(dim), "
                f"Replicate() or Partial(reduce)"
            )
        out.append(str(p))
    return ",".join(out)


def annotate(tensor: torch.Tensor, *placements: Any) -> torch.Tensor:
    """Pin how ``tensor`` (any value inside a compiled step) is split: one Placement for every mesh axis,
    or one per axis. Returns the same values; use the result in place of ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"annotate takes a tensor, got {type(tensor).__name__}")
    text = _encode(tuple(placements))
    return torch.ops.metadist.annotate(tensor, text)


def to_dtensor_placements(plan: "ShardingPlan") -> dict[str, tuple]:
    """``{parameter name: tuple of torch.distributed.tensor placements, one per mesh axis}`` of ``plan``."""
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    def conv(p: Placement) -> Any:
        if isinstance(p, Shard):
            return TShard(p.dim)
        if isinstance(p, Replicate):
            return TReplicate()
        if isinstance(p, Partial):
            return TPartial(p.reduce)
        raise TypeError(f"no torch placement for {p!r}")

    return {name: tuple(conv(p) for p in ps) for name, ps in plan.placements().items()}


__all__ = ["annotate", "to_dtensor_placements"]
