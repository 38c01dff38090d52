"""Mixture-of-experts layers traced with static shapes: one dropless op, or a capacity-padded dispatch.

transformers (5.x) computes a layer's experts with a data-dependent program: an
eager loop over the experts hit (``nonzero``, ``torch.where``, ``index_add_``),
or ``torch._grouped_mm`` on tokens sorted by expert, whose group sizes are
data. Neither has a shape a fake-tensor trace can know. While a step is traced,
every experts module that transformers' ``use_experts_implementation`` made
(``num_experts``, 3-D ``gate_up_proj``/``up_proj`` and ``down_proj``) runs
:func:`capacity_experts_forward` instead:

- a gated feed-forward without biases, with no capacity factor set, is one op,
  ``metadist::moe_dropless`` (:mod:`metadist_torch.moe.dropless`): every token
  through its experts, none dropped, the routed sizes inside the op;
- any other experts module, or any with ``moe_capacity_factor`` set, runs GShard's
  formulation: the tokens are cut into groups, one per device (the mesh's shape,
  where its size divides the token count), and each expert takes up to ``C``
  tokens of each group; a one-hot dispatch ``[*G, T/G, E, C]`` built from the
  router's ``top_k_index`` (compare, cumsum) moves the tokens into
  ``[*G, E, C, H]`` by an einsum; the experts run on their filled slots
  (``metadist::experts_ffn``, :mod:`metadist_torch.moe.experts_ffn`, for a gated
  feed-forward without biases) or as batched matmuls over every slot, and a
  combine tensor carrying the routing weights brings them back to ``[T, H]``.

In the padded dispatch every shape is static, so ShardCombine discovers the
rules of each op as of any other (expert weights split on the expert dim,
tokens grouped by expert), and the planner's Shard(G) -> Shard(E) reshard is an
all_to_all. A group dim per mesh axis lets the tokens leave their group on one
axis (to the experts split over it) while they stay split on the others.
``moe_capacity_factor`` sets ``C = ceil(factor * top_k * T/G / E)`` (at most
``T/G``): tokens past an expert's capacity in their group are dropped, first
choices before second choices, as in GShard. Without dropping (``C = T/G``) the
dispatch, the combine and the all_to_all work on ``E / top_k`` times the routed
tokens, and the dispatch mask holds ``top_k * T * E * C`` elements.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.nn as nn

from . import dropless  # noqa: F401  (registers metadist::moe_dropless)
from .experts_ffn import plain_gated


def is_experts_module(m: nn.Module) -> bool:
    """A transformers experts module (made by ``use_experts_implementation``): its experts' weights stacked
    on dim 0 of 3-D parameters."""
    up = getattr(m, "gate_up_proj", None) if getattr(m, "has_gate", False) else getattr(m, "up_proj", None)
    down = getattr(m, "down_proj", None)
    return (
        hasattr(m, "_apply_gate")
        and isinstance(getattr(m, "num_experts", None), int)
        and isinstance(up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and up.dim() == 3
        and down.dim() == 3
        and up.shape[0] == down.shape[0] == m.num_experts
    )


def capacity(tokens_per_group: int, top_k: int, num_experts: int, factor: float | None) -> int:
    """Slots per expert and group: every token of the group (``factor`` None: none dropped), else
    ``ceil(factor * top_k * tokens_per_group / num_experts)``, at most the group."""
    if factor is None:
        return tokens_per_group
    if factor <= 0:
        raise ValueError(f"moe_capacity_factor must be positive, got {factor}")
    return max(1, min(tokens_per_group, math.ceil(factor * top_k * tokens_per_group / num_experts)))


def token_groups(tokens: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the groups the tokens are cut into: the mesh's shape where its size divides ``tokens``,
    else one dim, the largest divisor of ``tokens`` not above the mesh's size."""
    world = math.prod(mesh_shape)
    if world > 0 and tokens % world == 0:
        return tuple(mesh_shape)
    return (max(d for d in range(1, max(1, min(tokens, world)) + 1) if tokens % d == 0),)


def world_mesh() -> tuple[int, ...]:
    """The mesh a trace plans for when the step was given none: the world (of the process group, or
    torchrun's ``WORLD_SIZE``) as one axis."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (dist.get_world_size(),)
    return (int(os.environ.get("WORLD_SIZE", "1")),)


def dropped_tokens(
    top_k_index: torch.Tensor, num_experts: int, mesh_shape: tuple[int, ...], capacity_factor: float | None
) -> int:
    """How many (token, expert) choices of a layer's routing ``top_k_index [T, k]`` the capacity-padded
    dispatch drops, with its groups for ``mesh_shape`` and ``capacity_factor`` (0 when the factor is None)."""
    tokens, k = top_k_index.shape
    g = token_groups(tokens, mesh_shape)
    tg = tokens // math.prod(g)
    c = capacity(tg, k, num_experts, capacity_factor)
    per_group = top_k_index.reshape(-1, tg * k)
    counts = torch.stack([torch.bincount(row, minlength=num_experts) for row in per_group])
    return int((counts - c).clamp(min=0).sum())


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``x [*G, E, C, in]`` through the experts' weights ``w [E, out, in]`` (``[E, in, out]`` if transposed)."""
    y = torch.einsum("...eci,eio->...eco", x, w) if transposed else torch.einsum("...eci,eoi->...eco", x, w)
    if bias is not None:
        y = y + bias[:, None, :]
    return y


def _padded_experts(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every slot of ``x [*G, E, C, H]``, as batched matmuls (any experts module)."""
    if getattr(self, "has_gate", True):
        h = _linear(x, self.gate_up_proj, getattr(self, "gate_up_proj_bias", None), self.is_transposed)
        h = self._apply_gate(h)
    else:
        h = self.act_fn(_linear(x, self.up_proj, getattr(self, "up_proj_bias", None), self.is_transposed))
    y = _linear(h, self.down_proj, getattr(self, "down_proj_bias", None), self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return y


def capacity_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    mesh_shape: tuple[int, ...] = (1,),
    capacity_factor: float | None = None,
) -> torch.Tensor:
    """transformers' experts forward ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` as
    the dropless op or a capacity-padded dispatch (the module docstring)."""
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError(
            f"{type(self).__name__} is set up for transformers' own expert parallelism; "
            "metadist plans expert parallelism itself: load the model without a tp_plan/ep_plan"
        )
    act = plain_gated(self)
    if capacity_factor is None and act is not None:  # dropless: one op, sorted by expert (moe/dropless.py)
        return torch.ops.metadist.moe_dropless(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, act
        )
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    e = self.num_experts
    g = token_groups(tokens, mesh_shape)
    tg = tokens // math.prod(g)
    c = capacity(tg, k, e, capacity_factor)
    dev = hidden_states.device
    chosen = top_k_index.reshape(*g, tg, k, 1) == torch.arange(e, device=dev)  # [*G, Tg, k, E]
    # slot-major order: every token's first choice takes a slot before any second choice
    slot_major = chosen.transpose(-3, -2).reshape(*g, k * tg, e).to(torch.int32)
    position = torch.cumsum(slot_major, dim=-2) - 1  # [*G, k*Tg, E]: the slot each choice would take
    placed = (position.unsqueeze(-1) == torch.arange(c, device=dev)) & slot_major.bool().unsqueeze(-1)
    placed = placed.reshape(*g, k, tg, e, c)  # a choice past the capacity is in no slot
    dispatch = placed.any(dim=-4).to(hidden_states.dtype)  # [*G, Tg, E, C]: a token is in one slot of an expert
    weights = top_k_weights.reshape(*g, tg, k)
    combine = torch.einsum("...ktec,...tk->...tec", placed.to(weights.dtype), weights)
    x = torch.einsum("...tec,...th->...ech", dispatch, hidden_states.reshape(*g, tg, hidden))  # [*G, E, C, H]
    if act is not None:  # the filled slots only (metadist_torch.moe.experts_ffn)
        counts = placed.any(dim=-4).sum(dim=(-3, -1))  # [*G, E]: slots fill in order, from the first
        fill = min(1.0, k * tg / (e * c))
        y = torch.ops.metadist.experts_ffn(x, counts, self.gate_up_proj, self.down_proj, act, fill)
    else:
        y = _padded_experts(self, x)
    dt = torch.promote_types(y.dtype, combine.dtype)
    out = torch.einsum("...tec,...ech->...th", combine.to(dt), y.to(dt))
    return out.reshape(tokens, hidden).to(hidden_states.dtype)


def experts_modules(roots: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every experts module under ``roots``, with its qualified name, each once."""
    seen: set[int] = set()
    out = []
    for root in roots:
        for name, m in root.named_modules():
            if id(m) not in seen and is_experts_module(m):
                seen.add(id(m))
                out.append((name, m))
    return out


@contextlib.contextmanager
def capacity_dispatch(
    modules: list[nn.Module], mesh_shape: tuple[int, ...], capacity_factor: float | None = None
) -> Iterator[None]:
    """While inside, every experts module of ``modules`` runs :func:`capacity_experts_forward`."""
    saved: list[tuple[nn.Module, Any]] = []
    for m in {id(m): m for m in modules if is_experts_module(m)}.values():
        saved.append((m, m.__dict__.get("forward")))

        def fwd(h: torch.Tensor, i: torch.Tensor, w: torch.Tensor, _m: nn.Module = m) -> torch.Tensor:
            return capacity_experts_forward(_m, h, i, w, mesh_shape=mesh_shape, capacity_factor=capacity_factor)

        m.forward = fwd  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m, f in saved:
            if f is None:
                del m.forward
            else:
                m.forward = f  # type: ignore[method-assign]


__all__ = [
    "capacity",
    "capacity_dispatch",
    "capacity_experts_forward",
    "dropped_tokens",
    "experts_modules",
    "is_experts_module",
    "token_groups",
    "world_mesh",
]
