"""Placements, Shardings, and the local shape and piece of a tensor on each device of a Mesh.

A ``Placement`` says how one tensor lies along one mesh **axis**:
``Shard(dim)`` splits tensor **dim** ``dim`` across the axis, ``Replicate()``
keeps a full copy on every device of the axis, ``Partial(reduce)`` keeps a
per-device value whose reduction (sum, avg, max, min) over the axis is the
full value. A ``Sharding`` holds one Placement per mesh axis.

Uneven splits follow ``torch.chunk``: every device but the last few holds
``ceil(size / n)`` elements, so some trailing devices may hold fewer or none.
"""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover - types only
    from metadist_core.ir.mesh import Mesh

REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")


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
            raise ValueError(f"Partial(reduce) takes one of {', '.join(REDUCE_OPS)}; got {self.reduce!r}")

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


def shard_shape(
    shape: Sequence[int],
    sharding: Sharding,
    mesh: Mesh,
    coords: Sequence[int] | None = None,
    *,
    even: bool = False,
) -> tuple[int, ...]:
    """Local shape of a tensor of ``shape`` under ``sharding`` on ``mesh``.

    ``coords`` picks a device (default: the first device, which holds the
    largest piece). With ``even=True`` a dim that does not divide raises
    :class:`IndivisibleError` naming the axis, the split, the dim and the shape.
    """
    if len(sharding) != mesh.ndim:
        raise ValueError(f"sharding {sharding} has {len(sharding)} placements for a {mesh.ndim}-axis mesh {mesh}")
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


def largest_local_shape(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...] | None:
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


def group_extents(
    shape: Sequence[int], sharding: Sharding, mesh: Mesh, coords: Sequence[int], axis: int, dim: int
) -> list[int]:
    """The extent of ``dim`` on each device of this device's group along ``axis`` (they differ only there),
    under ``sharding``: what an all_gather or all_to_all over ``axis`` receives from each member."""
    out = []
    for i in range(mesh.shape[axis]):
        c = list(coords)
        c[axis] = i
        out.append(shard_shape(shape, sharding, mesh, tuple(c))[dim % len(shape)])
    return out


def local_piece(
    x: Any, sharding: Sharding, mesh: Mesh, coords: Sequence[int], zeros_like: Callable[[Any], Any] | None = None
) -> Any:
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
                zeros_like = np.zeros_like
            x = zeros_like(x)
    return x
