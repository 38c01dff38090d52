"""The collectives of one mesh axis for one rank, on torch process groups (:class:`AxisComm`).

All_reduces and reduce_scatters (and their buckets) start asynchronously through the raw
``torch.ops._c10d_functional`` ops and return a :class:`Pending`; :func:`md_done` waits for one where
the rank program first reads it (:mod:`metadist_torch.lower.schedule`); so do buckets of parameter
all_gathers, which the program issues one bucket ahead. Other all_gathers and all_to_alls wait at once. Uneven splits pad to ``torch.chunk``'s chunk size and cut the padding off again; gloo has no AVG,
so ``avg`` is the sum divided by the axis size. :mod:`metadist_torch.lower.lower` calls these from the
rank program it builds.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch

from metadist_core.ir.placement import chunk_bounds, chunk_sizes

from .compression import compressed
from ..runtime.stats import CommStats


_COUNTING: list[CommStats] = []  # while a program is traced for the compiler: where its collectives count


@contextlib.contextmanager
def counting_into(stats: CommStats) -> Iterator[None]:
    """Count every collective run inside into ``stats`` instead of its program's own, and leave buffers to the
    compiler (no storage is freed by hand): what tracing a program once for ``torch.compile`` needs."""
    _COUNTING.append(stats)
    try:
        yield
    finally:
        _COUNTING.pop()


def _ops():
    """torch's functional collective ops themselves: plain tensors in and out, no ``AsyncCollectiveTensor``
    subclass (whose Python dispatch on every later op costs more than the overlap gains)."""
    return torch.ops._c10d_functional


def _group_name(group: Any) -> str:
    import torch.distributed._functional_collectives as fc

    try:
        return fc._group_or_group_name(fc._resolve_group(group, ""))
    except (AttributeError, TypeError):  # the helpers moved: a ProcessGroup names itself
        return group.group_name


class Pending:
    """A collective in flight: its raw result (not yet safe to read) and what to make of it once waited for.

    :meth:`wait` waits once (``_c10d_functional.wait_tensor``) and applies ``post`` (cut padding, divide an
    ``avg``, cast back from the wire dtype, split a bucket). ``pending[i]`` is member ``i`` of a bucket's
    tuple, waited for with the whole bucket. The rank program calls :func:`md_done` on it just before the
    first op that reads the value (:mod:`metadist_torch.lower.schedule`)."""

    __slots__ = ("raw", "post", "_out")

    def __init__(self, raw: torch.Tensor, post: Callable[[torch.Tensor], Any]) -> None:
        self.raw, self.post, self._out = raw, post, None

    def wait(self) -> Any:
        if self.raw is not None:
            _ops().wait_tensor(self.raw)
            self._out = self.post(self.raw)
            self.raw = self.post = None
        return self._out

    def __getitem__(self, i: int) -> "_Member":
        return _Member(self, i)

    def take(self, i: int) -> Any:
        """Member ``i`` of a bucket's result, given up by the bucket where the result is a list (a gather
        bucket's members are tensors of their own: each dies after its own last reader, not the bucket's)."""
        out = self.wait()
        v = out[i]
        if isinstance(out, list):
            out[i] = None
        return v


class _Member:
    __slots__ = ("bucket", "i", "_v")

    def __init__(self, bucket: Pending, i: int) -> None:
        self.bucket, self.i, self._v = bucket, i, None

    def wait(self) -> torch.Tensor:
        if self.bucket is not None:
            self._v, self.bucket = self.bucket.take(self.i), None
        return self._v


def md_done(p: Any) -> Any:
    """The value of a pending collective (waited for here); anything else as it is."""
    return p.wait() if isinstance(p, (Pending, _Member)) else p


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _divide(y: torch.Tensor, n: int) -> torch.Tensor:
    """``y / n``; in place when ``y`` is a float (a collective's result, which nothing else holds)."""
    return y.div_(n) if y.is_floating_point() else y / n


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _flatten(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The members one after another in one new flat buffer, each copied straight in (``torch.cat`` of their
    ``reshape(-1)`` would first copy every non-contiguous member, beside the buffer). For the compiler it is
    that ``torch.cat``: copies into slices of one buffer become a scatter of the whole buffer per member
    there, and its concatenation writes each member into place once."""
    if _COUNTING:
        return torch.cat([x.reshape(-1) for x in xs])
    flat = xs[0].new_empty(sum(x.numel() for x in xs))
    off = 0
    for x in xs:
        flat[off : off + x.numel()].view(x.shape).copy_(x)
        off += x.numel()
    return flat


def _release(*ts: torch.Tensor) -> None:
    """Free the storage of buffers this rank's program no longer reads, once their collective has been waited
    for (FSDP frees its gather buffers so too). Dropping the last Python reference is not enough: gloo's
    thread holds a collective's tensors until it gets to run again, so a gather's output may live on after
    its last reader in some runs of a plan and not in others, and the step's peak with it. The output itself
    is the program's own value, which this cannot free; the buffers a gather copies out of are freed here."""
    if _COUNTING:
        return
    for t in ts:
        t.untyped_storage().resize_(0)


def _send(x: torch.Tensor, wire: torch.dtype | None, divide: int = 1) -> tuple[torch.Tensor, torch.dtype | None]:
    """What travels for ``x`` (:func:`~metadist_torch.lower.compression.compressed`'s rule, split so the cast back can
    wait for the collective): ``x / divide`` when ``divide`` > 1, in ``wire`` when it is a float of another
    dtype; and the dtype to cast the result back to (None: none)."""
    if divide > 1:
        x = x / divide
    if wire is None or x.dtype == wire or not x.dtype.is_floating_point:
        return x, None
    return x.to(wire), x.dtype


class AxisComm:
    """The collectives of one mesh axis for this rank, run on tensors: group, size and coordinate on it.

    All_reduces and reduce_scatters (and their buckets) and all_gather buckets start asynchronously:
    ``start_*`` returns a :class:`Pending`; the plain methods wait at once. The others are synchronous."""

    def __init__(self, axis: int, group: Any, n: int, coord: int, stats: CommStats) -> None:
        self.axis, self.group, self.n, self.coord, self._stats = axis, group, n, coord, stats
        self._gname: str | None = None

    @property
    def stats(self) -> CommStats:
        """Where this axis's collectives count (:func:`counting_into` redirects it)."""
        return _COUNTING[-1] if _COUNTING else self._stats

    @property
    def gname(self) -> str:
        if self._gname is None:
            self._gname = _group_name(self.group)
        return self._gname

    def _finish(self, back: torch.dtype | None, divide: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """Cast back from the wire dtype, divide an ``avg``: in the collective's own result buffer."""

        def post(y: torch.Tensor) -> torch.Tensor:
            if back is not None:
                y = y.to(back)
            return _divide(y, self.n) if divide else y

        return post

    def start_all_reduce(self, x: torch.Tensor, reduce: str, wire: torch.dtype | None = None) -> Pending:
        """``wire``: the dtype the value travels in (grad_compression), cast back after; None: its own."""
        pre = wire is not None and reduce == "avg"  # a compressed avg travels pre-divided
        t, back = _send(x, wire, self.n if pre else 1)
        self.stats.add("all_reduce", _nbytes(t))
        raw = _ops().all_reduce(t.contiguous(), "sum" if reduce == "avg" else reduce, self.gname)
        return Pending(raw, self._finish(back, reduce == "avg" and not pre))

    def all_reduce(self, x: torch.Tensor, reduce: str, wire: torch.dtype | None = None) -> torch.Tensor:
        return self.start_all_reduce(x, reduce, wire).wait()

    def start_all_reduce_bucket(
        self, xs: Sequence[torch.Tensor], reduce: str, wire: torch.dtype | None = None
    ) -> Pending:
        """Several independent all_reduces of one dtype as one call on a flat buffer (same bytes, one latency)."""
        shapes = [x.shape for x in xs]
        numels = [x.numel() for x in xs]
        pre = wire is not None and reduce == "avg"
        t, back = _send(_flatten(xs), wire, self.n if pre else 1)
        self.stats.add("all_reduce", _nbytes(t), calls=len(xs))  # calls count the plan's collectives
        # the flat buffer is this call's own: reduced in place (the functional all_reduce would copy it first),
        # but for the compiler, which only takes functional collectives (and reuses buffers itself)
        run = _ops().all_reduce if _COUNTING else _ops().all_reduce_
        raw = run(t, "sum" if reduce == "avg" else reduce, self.gname)
        finish = self._finish(back, reduce == "avg" and not pre)
        return Pending(raw, lambda y: tuple(p.view(sh) for p, sh in zip(finish(y).split(numels), shapes)))

    def all_reduce_bucket(self, xs: Sequence[torch.Tensor], reduce: str, wire: torch.dtype | None = None) -> tuple:
        return self.start_all_reduce_bucket(xs, reduce, wire).wait()

    def _gather_raw(self, t: torch.Tensor) -> torch.Tensor:
        """All members' ``t`` stacked on dim 0 (every member sends the same shape), waited for."""
        ops = _ops()
        return ops.wait_tensor(ops.all_gather_into_tensor(t.contiguous(), self.n, self.gname))

    def all_gather(
        self, x: torch.Tensor, dim: int, sizes: Sequence[int], wire: torch.dtype | None = None
    ) -> torch.Tensor:
        """Concatenate the members' pieces along ``dim``; member ``i`` holds ``sizes[i]`` of it."""
        c = max(sizes)

        def run(t: torch.Tensor) -> torch.Tensor:
            y = self._gather_raw(_pad(t, dim, c))
            if dim != 0 or any(s != c for s in sizes):
                pieces = y.chunk(self.n, 0)
                whole = torch.cat([pieces[i].narrow(dim, 0, s) for i, s in enumerate(sizes) if s], dim=dim)
                _release(y)  # the stacked pieces, copied out: not read again
                y = whole
            self.stats.add("all_gather", _nbytes(y))
            return y

        return compressed(x, wire, run)

    def start_all_gather_bucket(
        self, xs: Sequence[torch.Tensor], dims: Sequence[int], sizes: Sequence[Sequence[int]]
    ) -> Pending:
        """Several all_gathers as one call on a flat buffer: each piece padded to its chunk, flattened and
        concatenated; the gathered buffer is cut back into each member's pieces, concatenated along its
        ``dims[i]`` (member ``i``'s ranks hold ``sizes[i]`` of it). Same values as one all_gather each.
        Started here, cut when waited for: the rank program issues the next bucket while the ops reading
        this one run (:func:`metadist_torch.lower.schedule.prefetch_gathers`, FSDP's prefetch)."""
        padded = [_pad(x, d, max(s)) for x, d, s in zip(xs, dims, sizes)]
        shapes = [p.shape for p in padded]
        flat = _flatten(padded)
        del padded
        raw = _ops().all_gather_into_tensor(flat, self.n, self.gname)

        def post(y: torch.Tensor) -> list:
            y = y.view(self.n, -1)
            outs, off = [], 0
            for shape, d, s in zip(shapes, dims, sizes):
                k = math.prod(shape)
                pieces = y[:, off : off + k].reshape(self.n, *shape)
                outs.append(torch.cat([pieces[i].narrow(d, 0, c) for i, c in enumerate(s) if c], dim=d))
                off += k
            self.stats.add("all_gather", sum(_nbytes(o) for o in outs), calls=len(outs))
            _release(y, flat)  # every member is a new tensor (torch.cat): neither buffer is read again
            return outs  # a list: Pending.take hands each member over

        return Pending(raw, post)

    def all_gather_bucket(
        self, xs: Sequence[torch.Tensor], dims: Sequence[int], sizes: Sequence[Sequence[int]]
    ) -> tuple:
        return tuple(self.start_all_gather_bucket(xs, dims, sizes).wait())

    def start_reduce_scatter(self, x: torch.Tensor, reduce: str, dim: int, wire: torch.dtype | None = None) -> Pending:
        n = self.n
        sizes = chunk_sizes(x.shape[dim], n)
        c = max(sizes)
        pre = wire is not None and reduce == "avg"
        t, back = _send(x, wire, n if pre else 1)
        self.stats.add("reduce_scatter", _nbytes(t))
        t = _pad(t, dim, c * n)
        if dim != 0:  # this rank's chunk along dim is what reduce_scatter_tensor leaves along dim 0
            t = torch.cat(t.chunk(n, dim), dim=0)
        raw = _ops().reduce_scatter_tensor(t.contiguous(), "sum" if reduce == "avg" else reduce, n, self.gname)
        finish = self._finish(back, reduce == "avg" and not pre)
        mine = sizes[self.coord]
        return Pending(raw, lambda y: finish(y.narrow(dim, 0, mine) if mine != c else y))

    def reduce_scatter(self, x: torch.Tensor, reduce: str, dim: int, wire: torch.dtype | None = None) -> torch.Tensor:
        return self.start_reduce_scatter(x, reduce, dim, wire).wait()

    def start_reduce_scatter_bucket(self, xs: Sequence[torch.Tensor], reduce: str, dims: Sequence[int]) -> Pending:
        """Several reduce_scatters as one call: each member padded to whole chunks along its ``dims[i]``,
        the flat buffer laid out rank by rank (every member's chunk for rank 0, then rank 1...), so that
        this rank's part of the result holds its chunk of every member. Same values as one call each."""
        n = self.n
        shapes, keep = [], []
        for x, d in zip(xs, dims):
            sizes = chunk_sizes(x.shape[d], n)
            c = max(sizes)
            shape = list(x.shape)
            shape[d] = c
            shapes.append(torch.Size(shape))
            keep.append((d, sizes[self.coord], c))
        # each member's chunks copied straight into the flat buffer, rank by rank: no contiguous copy of each
        # chunk first (reshaping a chunk along a dim other than 0 copies it, and those copies would be alive
        # beside the buffer when it is made, over the predicted peak)
        numels = [math.prod(s) for s in shapes]

        def chunks(x: torch.Tensor, d: int, shape: torch.Size) -> torch.Tensor:
            return _pad(x, d, shape[d] * n).unflatten(d, (n, shape[d])).movedim(d, 0)  # a view, unless padded

        if _COUNTING:  # for the compiler: one concatenation (see _flatten)
            parts = [chunks(x, d, shape).reshape(n, -1) for x, d, shape in zip(xs, dims, shapes)]
            flat = torch.cat(parts, dim=1).reshape(-1)
        else:
            flat = xs[0].new_empty(n * sum(numels))
            rows, off = flat.view(n, -1), 0
            for x, d, shape, k in zip(xs, dims, shapes, numels):
                rows[:, off : off + k].view(n, *shape).copy_(chunks(x, d, shape))
                off += k
        self.stats.add("reduce_scatter", sum(_nbytes(x) for x in xs), calls=len(xs))
        raw = _ops().reduce_scatter_tensor(flat, "sum" if reduce == "avg" else reduce, n, self.gname)

        def post(y: torch.Tensor) -> tuple:
            if reduce == "avg":
                y = _divide(y, n)
            outs = []
            for piece, shape, (d, size, c) in zip(y.split([math.prod(s) for s in shapes]), shapes, keep):
                piece = piece.view(shape)
                outs.append(piece.narrow(d, 0, size) if size != c else piece)
            return tuple(outs)

        return Pending(raw, post)

    def reduce_scatter_bucket(self, xs: Sequence[torch.Tensor], reduce: str, dims: Sequence[int]) -> tuple:
        return self.start_reduce_scatter_bucket(xs, reduce, dims).wait()

    def all_to_all(
        self, x: torch.Tensor, src: int, dst: int, src_sizes: Sequence[int], wire: torch.dtype | None = None
    ) -> torch.Tensor:
        """Gather ``src`` (member ``i`` holds ``src_sizes[i]`` of it) while splitting ``dst``."""
        if wire is not None and x.dtype != wire and x.dtype.is_floating_point:
            return self.all_to_all(x.to(wire), src, dst, src_sizes).to(x.dtype)
        ops = _ops()
        n = self.n
        dst_sizes = chunk_sizes(x.shape[dst], n)
        cs, cd = max(src_sizes), max(dst_sizes)
        self.stats.add("all_to_all", _nbytes(x))
        xp = _pad(_pad(x, src, cs), dst, cd * n)
        send = torch.stack(xp.split(cd, dim=dst), dim=0).contiguous()
        recv = ops.wait_tensor(ops.all_to_all_single(send, [1] * n, [1] * n, self.gname))
        pieces = []
        for i in range(n):
            if src_sizes[i] == 0:
                continue
            p = recv[i]
            if src_sizes[i] != cs:
                p = p.narrow(src, 0, src_sizes[i])
            if dst_sizes[self.coord] != cd:
                p = p.narrow(dst, 0, dst_sizes[self.coord])
            pieces.append(p)
        return torch.cat(pieces, dim=src)

    def local_split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        lo, hi = chunk_bounds(x.shape[dim], self.n, self.coord)
        return x.narrow(dim, lo, hi - lo)

    def local_partial(self, x: torch.Tensor, reduce: str) -> torch.Tensor:
        if reduce == "sum" and self.coord != 0:
            return torch.zeros_like(x)
        return x


__all__ = ["AxisComm", "Pending", "md_done"]
