"""The logical device mesh: its shape, axis names and the cost of a collective on each axis's links."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

# Default per-axis link cost: a 25 GB/s link with 10 microseconds latency.
DEFAULT_ALPHA = 1e-5
DEFAULT_BETA = 1.0 / 25e9


def link_costs(
    links: tuple, axis: int, kind: str, alpha: float, beta: float, numel: int | None = None, n: int = 0
) -> tuple[float, float]:
    """``(alpha, beta)`` of a ``kind`` collective on ``axis`` from a mesh's ``links`` (see
    :meth:`Mesh.link`), else the axis's own ``alpha``/``beta``."""
    if links and links[axis]:
        own = {k: (a, b) for k, a, b in links[axis]}
        if kind == "all_reduce" and numel is not None and numel < n and "all_reduce_tiny" in own:
            return own["all_reduce_tiny"]
        if kind in own:
            return own[kind]
    return alpha, beta


@dataclass(frozen=True)
class Mesh:
    """The logical device mesh: shape, axis names and per-axis link cost.

    ``alpha`` is the latency of one collective step on an axis (seconds) and
    ``beta`` the seconds per byte on its links; both are per axis. ``links``
    (optional, per axis): ``{kind: (alpha, beta)}`` for the collective kinds
    measured apart (``all_gather``, ``reduce_scatter``, ``all_to_all``, and
    ``all_reduce_tiny``: an all_reduce of fewer elements than the axis has
    devices, which gloo runs in far fewer steps than a ring); a kind not given
    takes the axis's ``alpha``/``beta``. See :meth:`link`.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    alpha: tuple[float, ...] = ()
    beta: tuple[float, ...] = ()
    links: tuple = ()  # per axis: a sorted tuple of (kind, alpha, beta); () when no kind is measured apart

    def __init__(
        self,
        shape: Union[int, Sequence[int]],
        axis_names: Sequence[str] | None = None,
        alpha: Union[float, Sequence[float], None] = None,
        beta: Union[float, Sequence[float], None] = None,
        links: Sequence[Any] | None = None,
    ) -> None:
        shp = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if not shp or any(s < 1 for s in shp):
            raise ValueError(f"a mesh shape needs one or more positive sizes, got {shape!r}")
        names = (
            tuple(axis_names)
            if axis_names is not None
            else tuple(("dp", "tp", "pp")[i] if len(shp) <= 3 else f"axis{i}" for i in range(len(shp)))
        )
        if len(names) != len(shp):
            raise ValueError(f"mesh shape {shp} has {len(shp)} axes but {len(names)} axis names {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be distinct, got {names}")
        object.__setattr__(self, "shape", shp)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "alpha", _per_axis(alpha, DEFAULT_ALPHA, len(shp), "alpha"))
        object.__setattr__(self, "beta", _per_axis(beta, DEFAULT_BETA, len(shp), "beta"))
        object.__setattr__(self, "links", _links(links, len(shp)))

    def link(self, axis: int, kind: str, numel: int | None = None) -> tuple[float, float]:
        """``(alpha, beta)`` that price a ``kind`` collective on ``axis``; ``numel``: the elements of an
        all_reduce's buffer (fewer than the axis's devices: the ``all_reduce_tiny`` figures, when measured)."""
        return link_costs(self.links, axis, kind, self.alpha[axis], self.beta[axis], numel, self.shape[axis])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, axis: Union[int, str]) -> int:
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise KeyError(f"no mesh axis {axis!r}; the axes are {self.axis_names}")
            return self.axis_names.index(axis)
        return axis

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of a flat (row-major) device rank."""
        if not 0 <= rank < self.size:
            raise IndexError(f"rank {rank} is outside a mesh of {self.size} devices")
        coords = []
        for s in reversed(self.shape):
            coords.append(rank % s)
            rank //= s
        return tuple(reversed(coords))

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "alpha": list(self.alpha),
            "beta": list(self.beta),
            **({"links": [{k: [a, b] for k, a, b in ax} for ax in self.links]} if self.links else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Mesh":
        return cls(data["shape"], data.get("axis_names"), data.get("alpha"), data.get("beta"), data.get("links"))

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """``"2x4"`` or ``"8"`` or ``"2,4"`` -> Mesh."""
        parts = text.replace(",", "x").replace("*", "x").split("x")
        try:
            return cls(tuple(int(p) for p in parts if p.strip()))
        except ValueError:
            raise ValueError(f"cannot read a mesh shape from {text!r}; write it like 8 or 2x4") from None


LINK_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "all_reduce_tiny", "local_copy")


def _links(value: Sequence[Any] | None, n: int) -> tuple:
    """Per axis a sorted tuple of ``(kind, alpha, beta)`` from dicts ``{kind: (alpha, beta)}`` (or such tuples)."""
    if not value:
        return ()
    value = list(value)
    if len(value) != n:
        raise ValueError(f"mesh has {n} axes but links gives {len(value)} entries")
    out = []
    for ax in value:
        items = ax.items() if isinstance(ax, dict) else [(k, (a, b)) for k, a, b in ax]
        row = []
        for k, ab in items:
            if k not in LINK_KINDS:
                raise ValueError(f"unknown collective kind {k!r} in mesh links; kinds: {', '.join(LINK_KINDS)}")
            a, b = ab
            row.append((str(k), float(a), float(b)))
        out.append(tuple(sorted(row)))
    return tuple(out) if any(out) else ()


def _per_axis(value, default: float, n: int, name: str) -> tuple[float, ...]:
    if value is None:
        return (default,) * n
    if isinstance(value, (int, float)):
        return (float(value),) * n
    vals = tuple(float(v) for v in value)
    if len(vals) != n:
        raise ValueError(f"mesh has {n} axes but {name} gives {len(vals)} values: {vals}")
    return vals
