"""Distributed implementations as strategies: the rules they add to an op, and what such a strategy costs.

A :class:`~metadist_core.discovery.distimpl.DistImpl` serves an op on one mesh axis with collectives inside
it. :func:`impl_rules` offers it to the planner as one more one-axis rule of the op (a
:class:`~metadist_core.discovery.rules.ShardingRule` naming the implementation), so it expands to N-D
strategies, is priced, pinned and chosen like every rule discovery found; only implementations the frontend
can lower (a ``lower`` hook attached for it) are offered. :func:`impl_seconds` prices such a strategy: the
busiest rank's flops at its local shapes and the implementation's own collectives on its axis.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from metadist_core.cost.model import DeviceSpec, compute_cost
from metadist_core.discovery.distimpl import DistImpl, DistImplRegistry
from metadist_core.discovery.rules import ShardingRule, Strategy
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Shard


def lowerable(registry: DistImplRegistry, frontend: str, name: str) -> bool:
    """Has ``frontend`` attached a ``lower`` hook to implementation ``name``?"""
    return (name, frontend, "lower") in registry.hooks


def impl_rules(
    registry: DistImplRegistry,
    frontend: str,
    op_key: str,
    attrs: Mapping[str, Any],
    shapes: Sequence[Sequence[int] | None],
    n_outputs: int,
    n: int,
    refused: dict[str, str] | None = None,
) -> list[ShardingRule]:
    """The one-axis rules the registered implementations give this op call on an axis of ``n``: one per
    implementation that serves it, that ``frontend`` can lower, and whose placements fit the call (its tensor
    inputs, and its outputs as the trace kept them: ``attrs["select"]`` picks some of the op's results), and
    whose pieces lie in contiguous chunks, as every other rule's do (a ``head_tail`` layout would need the
    whole sequence permuted before the first op, which no plan does yet).
    ``refused`` collects why each implementation of the op's key does not serve this call."""
    if any(s is None for s in shapes):
        return []
    ok, why = registry.matching(op_key, attrs, [tuple(s) for s in shapes if s is not None], n)
    if refused is not None:
        refused.update(why)
    out = []
    for impl in ok:
        if not lowerable(registry, frontend, impl.name) or len(impl.inputs) != len(shapes):
            continue
        if impl.layout.kind != "contiguous":  # the values around the op hold contiguous chunks (torch.chunk's)
            continue
        select = attrs.get("select")
        kept = list(range(len(impl.outputs))) if select is None else [i for i in select if i < len(impl.outputs)]
        if len(kept) != n_outputs:
            continue
        outs = tuple(impl.outputs[i] for i in kept)
        n_in = len(impl.inputs)  # a shared output's position follows the outputs the trace kept
        shared = tuple(p for p in impl.shared if p < n_in) + tuple(
            n_in + kept.index(p - n_in) for p in impl.shared if p >= n_in and p - n_in in kept
        )
        out.append(ShardingRule(impl.inputs, outs, impl=impl.name, shared=shared))
    return out


def local_shapes(
    strategy: Strategy, shapes: Sequence[Sequence[int]], mesh: Mesh, skip_axis: int
) -> list[tuple[int, ...]]:
    """``shapes`` as one device holds them under ``strategy`` on every mesh axis but ``skip_axis`` (the axis
    the implementation itself splits: its price takes the pieces of the other axes whole)."""
    out = []
    for shape, sh in zip(shapes, strategy.inputs):
        local = list(shape)
        for a, p in enumerate(sh):
            if a != skip_axis and isinstance(p, Shard):
                d = p.dim % len(local)
                local[d] = -(-local[d] // mesh.shape[a])
        out.append(tuple(local))
    return out


def impl_seconds(
    impl: DistImpl,
    strategy: Strategy,
    axis: int,
    shapes: Sequence[Sequence[int]],
    itemsize: int,
    nbytes: float,
    split: int,
    mesh: Mesh,
    device: DeviceSpec,
    dtype: str | None,
    slowdown: float = 1.0,
) -> float:
    """Seconds of an op run by ``impl`` on mesh ``axis`` under ``strategy``: the busiest rank's flops (the
    implementation's price at the local shapes of the other axes) on the device's roofline, and its
    collectives on the axis (``calls`` latencies of each ring step and the bytes each rank receives)."""
    n = mesh.shape[axis]
    price = impl.price(local_shapes(strategy, shapes, mesh, axis), itemsize, n)
    # the price is one rank's flops already (local shapes, its axis's share); compute_cost divides by ``split``
    work = compute_cost(price.flops * split, nbytes, split, device, dtype, slowdown)
    alpha, beta = mesh.link(axis, "all_gather")
    return work + price.calls * (n - 1) * alpha + price.comm_bytes * beta


def impl_workspace(
    impl: DistImpl, strategy: Strategy, axis: int, shapes: Sequence[Sequence[int]], itemsize: int, mesh: Mesh
) -> float:
    """Bytes per device ``impl`` holds inside the op under ``strategy`` (what it gathers along its axis), at the
    local shapes of the other axes; 0 where it declares none."""
    if impl.workspace is None:
        return 0.0
    return float(impl.workspace(local_shapes(strategy, shapes, mesh, axis), itemsize, mesh.shape[axis]))


__all__ = ["impl_rules", "impl_seconds", "impl_workspace", "local_shapes", "lowerable"]
