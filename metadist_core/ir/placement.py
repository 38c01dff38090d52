"""Placements, Shardings and the device Mesh.

A ``Placement`` says how one tensor lies along one mesh **axis**:
``Shard(dim)`` splits tensor **dim** ``dim`` across the axis, ``Replicate()``
keeps a full copy on every device of the axis, ``Partial(reduce)`` keeps a
per-device value whose reduction (sum, avg, max, min) over the axis is the
full value. A ``Sharding`` holds one Placement per mesh axis.

Uneven splits follow ``torch.chunk``: every device but the last few holds
``ceil(size / n)`` elements, so some trailing devices may hold fewer or none.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, Union

REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")

# Default per-axis link cost: a 25 GB/s link with 10 microseconds latency.
DEFAULT_ALPHA = 1e-5
DEFAULT_BETA = 1.0 / 25e9


class IndivisibleError(ValueError):
    """A tensor dim does not divide evenly over a mesh axis where that is required."""


class Placement:
    """Base of Shard, Replicate and Partial; placements are immutable values."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def to_json(self) -> str:
        return str(self)

    @staticmethod
    def from_json(text: str) -> "Placement":
        return parse_placement(text)


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCE_OPS:
            raise ValueError(
                f"Partial(reduce) takes one of {', '.join(REDUCE_OPS)}; got {self.reduce!r}"
            )

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"P({self.reduce})"

    def __repr__(self) -> str:
        return f"Partial({self.reduce!r})"


def parse_placement(text: str) -> Placement:
    """Parse the short form written by ``str(placement)``: ``R``, ``S(0)``, ``P(sum)``."""
    t = text.strip()
    if t == "R":
        return Replicate()
    if t.startswith("S(") and t.endswith(")"):
        return Shard(int(t[2:-1]))
    if t.startswith("P(") and t.endswith(")"):
        return Partial(t[2:-1])
    raise ValueError(f"not a placement: {text!r} (expected R, S(<dim>) or P(<reduce>))")


@dataclass(frozen=True)
class Sharding:
    """One Placement per mesh axis, in mesh axis order."""

    placements: tuple[Placement, ...]

    def __init__(self, placements: Iterable[Placement]) -> None:
        object.__setattr__(self, "placements", tuple(placements))
        for p in self.placements:
            if not isinstance(p, Placement):
                raise TypeError(f"Sharding takes Placements, got {p!r}")

    @classmethod
    def replicated(cls, ndim_mesh: int) -> "Sharding":
        return cls((Replicate(),) * ndim_mesh)

    def __len__(self) -> int:
        return len(self.placements)

    def __iter__(self):
        return iter(self.placements)

    def __getitem__(self, axis: int) -> Placement:
        return self.placements[axis]

    def is_fully_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)

    def has_partial(self) -> bool:
        return any(p.is_partial() for p in self.placements)

    def sharded_dims(self) -> dict[int, list[int]]:
        """Tensor dim -> mesh axes that split it, in mesh axis order."""
        out: dict[int, list[int]] = {}
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard):
                out.setdefault(p.dim, []).append(axis)
        return out

    def __str__(self) -> str:
        return "[" + ", ".join(str(p) for p in self.placements) + "]"

    def __repr__(self) -> str:
        return f"Sharding({list(self.placements)!r})"

    def to_json(self) -> list[str]:
        return [str(p) for p in self.placements]

    @classmethod
    def from_json(cls, data: Sequence[str]) -> "Sharding":
        return cls(parse_placement(x) for x in data)


def chunk_sizes(size: int, n: int) -> list[int]:
    """Sizes of the ``n`` pieces of a dim of ``size`` under ``torch.chunk`` semantics."""
    if n <= 0:
        raise ValueError(f"cannot split into {n} pieces")
    c = -(-size // n) if size else 0
    return [max(0, min(c, size - i * c)) for i in range(n)]


def splits_nonempty(size: int, n: int) -> bool:
    """Does ``torch.chunk`` of a dim of ``size`` into ``n`` leave every piece non-empty? (12 into 8 leaves
    two empty: chunks of 2.) A placement that leaves a device nothing is never planned nor discovered:
    some kernels trap on an empty dim."""
    if n <= 1:
        return size >= 1
    return size >= n and -(-size // n) * (n - 1) < size


def chunk_bounds(size: int, n: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece ``index`` of ``n`` of a dim of ``size``."""
    c = -(-size // n) if size else 0
    start = min(size, index * c)
    return start, min(size, start + c)



def link_costs(links: tuple, axis: int, kind: str, alpha: float, beta: float, numel: int | None = None,
               n: int = 0) -> tuple[float, float]:
    """``(alpha, beta)`` of a ``kind`` collective on ``axis`` from a mesh's ``links`` (see
    :meth:`~metadist_core.ir.placement.Mesh.link`), else the axis's own ``alpha``/``beta``."""
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
    links: tuple = ()   # per axis: a sorted tuple of (kind, alpha, beta); () when no kind is measured apart

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
        names = tuple(axis_names) if axis_names is not None else tuple(
            ("dp", "tp", "pp")[i] if len(shp) <= 3 else f"axis{i}" for i in range(len(shp))
        )
        if len(names) != len(shp):
            raise ValueError(
                f"mesh shape {shp} has {len(shp)} axes but {len(names)} axis names {names}"
            )
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


def shard_shape(
    shape: Sequence[int], sharding: Sharding, mesh: Mesh, coords: Sequence[int] | None = None,
    *, even: bool = False,
) -> tuple[int, ...]:
    """Local shape of a tensor of ``shape`` under ``sharding`` on ``mesh``.

    ``coords`` picks a device (default: the first device, which holds the
    largest piece). With ``even=True`` a dim that does not divide raises
    :class:`IndivisibleError` naming the axis, the split, the dim and the shape.
    """
    if len(sharding) != mesh.ndim:
        raise ValueError(
            f"sharding {sharding} has {len(sharding)} placements for a {mesh.ndim}-axis mesh {mesh}"
        )
    coords = tuple(coords) if coords is not None else (0,) * mesh.ndim
    local = list(shape)
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            if not -len(shape) <= p.dim < len(shape):
                raise ValueError(
                    f"{p!r} on mesh axis {mesh.axis_names[axis]!r} names dim {p.dim} "
                    f"of a {len(shape)}-dim tensor of shape {tuple(shape)}"
                )
            d = p.dim % len(shape)
            n = mesh.shape[axis]
            if even and local[d] % n:
                raise IndivisibleError(
                    f"mesh axis {mesh.axis_names[axis]!r} splits {n} ways, but dim {d} of "
                    f"shape {tuple(shape)} has {local[d]} elements here, which {n} does not divide; "
                    f"pick a size divisible by {n} or another placement"
                )
            lo, hi = chunk_bounds(local[d], n, coords[axis])
            local[d] = hi - lo
    return tuple(local)


def largest_local_shape(shape: Sequence[int], placements: Sequence[Placement],
                        mesh_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The largest device's local shape under per-axis ``placements`` (what memory and compute are priced
    on); None when some device would get an empty piece."""
    local = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % len(local)
            n = mesh_shape[axis]
            if local[d] < n:
                return None
            local[d] = -(-local[d] // n)
    return tuple(local)


def group_extents(shape: Sequence[int], sharding: Sharding, mesh: Mesh, coords: Sequence[int], axis: int,
                  dim: int) -> list[int]:
    """The extent of ``dim`` on each device of this device's group along ``axis`` (they differ only there),
    under ``sharding``: what an all_gather or all_to_all over ``axis`` receives from each member."""
    out = []
    for i in range(mesh.shape[axis]):
        c = list(coords)
        c[axis] = i
        out.append(shard_shape(shape, sharding, mesh, tuple(c))[dim % len(shape)])
    return out


def local_piece(x: Any, sharding: Sharding, mesh: Mesh, coords: Sequence[int],
                zeros_like: Callable[[Any], Any] | None = None) -> Any:
    """This device's piece of a whole array ``x`` (numpy, torch, jax: anything sliceable) under ``sharding``.

    Shard(d) takes the ``torch.chunk`` piece of dim d at this device's coordinate
    on that axis; Partial(sum) keeps the value on coordinate 0 and zeros elsewhere
    (``zeros_like``, default numpy's); Replicate and the other Partials keep it.
    """
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            d = p.dim % len(x.shape)
            lo, hi = chunk_bounds(x.shape[d], mesh.shape[axis], coords[axis])
            x = x[(slice(None),) * d + (slice(lo, hi),)]
        elif isinstance(p, Partial) and p.reduce == "sum" and coords[axis] != 0:
            if zeros_like is None:
                import numpy as np
                zeros_like = np.zeros_like
            x = zeros_like(x)
    return x
