"""Lower a ShardingPlan to a per-rank torch.fx program with torch's functional collectives.

The program is built by the one plan interpreter
(:func:`metadist_core.interpret.interpret`) with fx Nodes as its values, so a
plan means here exactly what it means in :mod:`metadist_core.simulate`:

- graph inputs are placeholders holding this rank's local pieces under
  ``plan.input_shardings``;
- each op becomes a call of its aten overload on local tensors (:func:`op_node`);
  ops whose attrs carry the full output shape (view, reshape, expand...) get
  the local shape ``shard_shape(full, output sharding, mesh, coords)``;
- each edge's collectives become calls of :class:`AxisComm` over the process
  group of their mesh axis (:class:`TorchCollectives`): ``all_reduce``,
  ``all_gather`` (``all_gather_single``), ``reduce_scatter``
  (``reduce_scatter_single``), ``all_to_all`` (``all_to_all_single``), each
  followed by ``wait_tensor``, and the free ``local_split``/``local_partial``.

Uneven splits follow ``torch.chunk``: gathers and reduce-scatters pad to the
chunk size and cut the padding off again (each member's extent from
:func:`metadist_core.placement.group_extents`). gloo has no AVG reduction:
``avg`` is the sum divided by the axis size, as in every engine. Every
collective adds its bytes to a :class:`~metadist_torch.stats.CommStats`.
Independent all_reduces of one axis are then merged into buckets
(``settings.coalesce``, up to ``settings.bucket_bytes`` each), and so are the
all_gathers of graph inputs (parameters), up to ``settings.shard_bucket_bytes``
each, by the rule of :mod:`metadist_core.gathers` (:func:`coalesce_all_gathers`).
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from metadist_core.cost import Collective
from metadist_core.gathers import bucket_in_order
from metadist_core.interpret import Collectives, interpret
from metadist_core.ir import DTYPE_BYTES, MetaIR, MetaOp
from metadist_core.placement import Mesh, Sharding, chunk_bounds, chunk_sizes, group_extents, shard_shape

from .calls import rebuild, resolve_target
from .compression import compressed
from .stats import CommStats

# ops whose second argument is the full output shape: lowered with the local output shape
SHAPE_ARG_OPS = frozenset({"view", "_unsafe_view", "reshape", "view_copy", "_reshape_copy", "expand",
                           "expand_copy", "_reshape_alias"})
DTYPE_META = "metadist_dtype"   # fx node meta: the canonical dtype of the value a node holds
VAR_META = "metadist_var"       # fx node meta: the MetaIR value a node holds (a collective's: the value it moves)
ASYNC_KINDS = frozenset({"all_reduce", "reduce_scatter", "all_reduce_bucket", "reduce_scatter_bucket"})
WIRE_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})   # take a wire dtype


def _ops():
    """torch's functional collective ops themselves: plain tensors in and out, no ``AsyncCollectiveTensor``
    subclass (whose Python dispatch on every later op cost ~10 ms a step on the GPT example)."""
    return torch.ops._c10d_functional


def _group_name(group: Any) -> str:
    import torch.distributed._functional_collectives as fc
    try:
        return fc._group_or_group_name(fc._resolve_group(group, ""))
    except (AttributeError, TypeError):   # the helpers moved: a ProcessGroup names itself
        return group.group_name


class Pending:
    """A collective in flight: its raw result (not yet safe to read) and what to make of it once waited for.

    :meth:`wait` waits once (``_c10d_functional.wait_tensor``) and applies ``post`` (cut padding, divide an
    ``avg``, cast back from the wire dtype, split a bucket). ``pending[i]`` is member ``i`` of a bucket's
    tuple, waited for with the whole bucket. The rank program calls :func:`md_done` on it just before the
    first op that reads the value (:mod:`metadist_torch.schedule`)."""

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


class _Member:
    __slots__ = ("bucket", "i")

    def __init__(self, bucket: Pending, i: int) -> None:
        self.bucket, self.i = bucket, i

    def wait(self) -> torch.Tensor:
        return self.bucket.wait()[self.i]


def md_done(p: Any) -> Any:
    """The value of a pending collective (waited for here); anything else as it is."""
    return p.wait() if isinstance(p, (Pending, _Member)) else p


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _send(x: torch.Tensor, wire: torch.dtype | None, divide: int = 1) -> tuple[torch.Tensor, torch.dtype | None]:
    """What travels for ``x`` (:func:`~metadist_torch.compression.compressed`'s rule, split so the cast back can
    wait for the collective): ``x / divide`` when ``divide`` > 1, in ``wire`` when it is a float of another
    dtype; and the dtype to cast the result back to (None: none)."""
    if divide > 1:
        x = x / divide
    if wire is None or x.dtype == wire or not x.dtype.is_floating_point:
        return x, None
    return x.to(wire), x.dtype


class AxisComm:
    """The collectives of one mesh axis for this rank, run on tensors: group, size and coordinate on it.

    All_reduces and reduce_scatters (and their buckets) start asynchronously: ``start_*`` returns a
    :class:`Pending`; the plain methods wait at once. The others are synchronous."""

    def __init__(self, axis: int, group: Any, n: int, coord: int, stats: CommStats) -> None:
        self.axis, self.group, self.n, self.coord, self.stats = axis, group, n, coord, stats
        self._gname: str | None = None

    @property
    def gname(self) -> str:
        if self._gname is None:
            self._gname = _group_name(self.group)
        return self._gname

    def _finish(self, back: torch.dtype | None, divide: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def post(y: torch.Tensor) -> torch.Tensor:
            if back is not None:
                y = y.to(back)
            return y / self.n if divide else y
        return post

    def start_all_reduce(self, x: torch.Tensor, reduce: str, wire: torch.dtype | None = None) -> Pending:
        """``wire``: the dtype the value travels in (grad_compression), cast back after; None: its own."""
        pre = wire is not None and reduce == "avg"     # a compressed avg travels pre-divided
        t, back = _send(x, wire, self.n if pre else 1)
        self.stats.add("all_reduce", _nbytes(t))
        raw = _ops().all_reduce(t.contiguous(), "sum" if reduce == "avg" else reduce, self.gname)
        return Pending(raw, self._finish(back, reduce == "avg" and not pre))

    def all_reduce(self, x: torch.Tensor, reduce: str, wire: torch.dtype | None = None) -> torch.Tensor:
        return self.start_all_reduce(x, reduce, wire).wait()

    def start_all_reduce_bucket(self, xs: Sequence[torch.Tensor], reduce: str,
                                wire: torch.dtype | None = None) -> Pending:
        """Several independent all_reduces of one dtype as one call on a flat buffer (same bytes, one latency)."""
        shapes = [x.shape for x in xs]
        numels = [x.numel() for x in xs]
        pre = wire is not None and reduce == "avg"
        t, back = _send(torch.cat([x.reshape(-1) for x in xs]), wire, self.n if pre else 1)
        self.stats.add("all_reduce", _nbytes(t), calls=len(xs))   # calls count the plan's collectives
        raw = _ops().all_reduce(t, "sum" if reduce == "avg" else reduce, self.gname)
        finish = self._finish(back, reduce == "avg" and not pre)
        return Pending(raw, lambda y: tuple(p.view(sh) for p, sh in zip(finish(y).split(numels), shapes)))

    def all_reduce_bucket(self, xs: Sequence[torch.Tensor], reduce: str, wire: torch.dtype | None = None) -> tuple:
        return self.start_all_reduce_bucket(xs, reduce, wire).wait()

    def _gather_raw(self, t: torch.Tensor) -> torch.Tensor:
        """All members' ``t`` stacked on dim 0 (every member sends the same shape), waited for."""
        ops = _ops()
        return ops.wait_tensor(ops.all_gather_into_tensor(t.contiguous(), self.n, self.gname))

    def all_gather(self, x: torch.Tensor, dim: int, sizes: Sequence[int],
                   wire: torch.dtype | None = None) -> torch.Tensor:
        """Concatenate the members' pieces along ``dim``; member ``i`` holds ``sizes[i]`` of it."""
        c = max(sizes)

        def run(t: torch.Tensor) -> torch.Tensor:
            y = self._gather_raw(_pad(t, dim, c))
            if dim != 0 or any(s != c for s in sizes):
                pieces = y.chunk(self.n, 0)
                y = torch.cat([pieces[i].narrow(dim, 0, s) for i, s in enumerate(sizes) if s], dim=dim)
            self.stats.add("all_gather", _nbytes(y))
            return y
        return compressed(x, wire, run)

    def all_gather_bucket(self, xs: Sequence[torch.Tensor], dims: Sequence[int],
                          sizes: Sequence[Sequence[int]]) -> tuple:
        """Several all_gathers as one call on a flat buffer: each piece padded to its chunk, flattened and
        concatenated; the gathered buffer is cut back into each member's pieces, concatenated along its
        ``dims[i]`` (member ``i``'s ranks hold ``sizes[i]`` of it). Same values as one all_gather each."""
        padded = [_pad(x, d, max(s)).contiguous() for x, d, s in zip(xs, dims, sizes)]
        y = self._gather_raw(torch.cat([p.reshape(-1) for p in padded])).view(self.n, -1)
        outs, off = [], 0
        for p, d, s in zip(padded, dims, sizes):
            k = p.numel()
            pieces = y[:, off:off + k].reshape(self.n, *p.shape)
            outs.append(torch.cat([pieces[i].narrow(d, 0, c) for i, c in enumerate(s) if c], dim=d))
            off += k
        self.stats.add("all_gather", sum(_nbytes(o) for o in outs), calls=len(xs))
        return tuple(outs)

    def start_reduce_scatter(self, x: torch.Tensor, reduce: str, dim: int,
                             wire: torch.dtype | None = None) -> Pending:
        n = self.n
        sizes = chunk_sizes(x.shape[dim], n)
        c = max(sizes)
        pre = wire is not None and reduce == "avg"
        t, back = _send(x, wire, n if pre else 1)
        self.stats.add("reduce_scatter", _nbytes(t))
        t = _pad(t, dim, c * n)
        if dim != 0:   # this rank's chunk along dim is what reduce_scatter_tensor leaves along dim 0
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
        chunks, shapes, keep = [], [], []
        for x, d in zip(xs, dims):
            sizes = chunk_sizes(x.shape[d], n)
            c = max(sizes)
            parts = _pad(x, d, c * n).contiguous().chunk(n, dim=d)
            chunks.append([p.reshape(-1) for p in parts])
            shapes.append(parts[0].shape)
            keep.append((d, sizes[self.coord], c))
        flat = torch.cat([chunks[m][r] for r in range(n) for m in range(len(xs))])
        self.stats.add("reduce_scatter", sum(_nbytes(x) for x in xs), calls=len(xs))
        raw = _ops().reduce_scatter_tensor(flat, "sum" if reduce == "avg" else reduce, n, self.gname)

        def post(y: torch.Tensor) -> tuple:
            if reduce == "avg":
                y = y / n
            outs = []
            for piece, shape, (d, size, c) in zip(y.split([math.prod(s) for s in shapes]), shapes, keep):
                piece = piece.view(shape)
                outs.append(piece.narrow(d, 0, size) if size != c else piece)
            return tuple(outs)
        return Pending(raw, post)

    def reduce_scatter_bucket(self, xs: Sequence[torch.Tensor], reduce: str, dims: Sequence[int]) -> tuple:
        return self.start_reduce_scatter_bucket(xs, reduce, dims).wait()

    def all_to_all(self, x: torch.Tensor, src: int, dst: int, src_sizes: Sequence[int],
                   wire: torch.dtype | None = None) -> torch.Tensor:
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


def _named(name: str, fn: Callable, stats: CommStats | None = None, kind: str = "") -> Callable:
    """A plain function called ``name`` (fx prints call targets by name) around ``fn``, timed into ``stats``."""
    def f(*a):
        t0 = time.perf_counter()
        out = fn(*a)
        if stats is not None:
            stats.timed(kind, t0)
        return out
    f.__name__ = f.__qualname__ = name
    return f


class TorchCollectives(Collectives):
    """The plan's collectives as fx nodes: each call adds a node calling this rank's :class:`AxisComm`."""

    def __init__(self, g: fx.Graph, mesh: Mesh, coords: Sequence[int], groups: Sequence[Any] | None,
                 stats: CommStats, wire: Mapping[str, torch.dtype] | None = None) -> None:
        self.g, self.mesh, self.coords, self.stats = g, mesh, tuple(int(c) for c in coords), stats
        self.wire = dict(wire or {})   # value id -> the dtype its collectives travel in (grad_compression)
        self.comms = [AxisComm(a, None if groups is None else groups[a], mesh.shape[a], self.coords[a], stats)
                      for a in range(mesh.ndim)]
        self.fns: dict[tuple[int, str], Callable] = {}
        self.reduces: dict[fx.Node, tuple] = {}   # all_reduce / reduce_scatter node -> (kind, axis, reduce, dtype,
        #                                           bytes): for bucketing
        self.gathers: dict[fx.Node, tuple] = {}   # all_gather of a placeholder -> (axis, dtype, bytes): buckets

    def fn(self, axis: int, kind: str) -> Callable:
        k = (axis, kind)
        if k not in self.fns:
            method = getattr(self.comms[axis], f"start_{kind}" if kind in ASYNC_KINDS else kind)
            self.fns[k] = _named(f"md_{kind}_axis{axis}", method, self.stats, kind.removesuffix("_bucket"))
        return self.fns[k]

    def _call(self, x: fx.Node, c: Collective, *args: Any) -> fx.Node:
        wire = self.wire.get(x.meta.get(VAR_META)) if c.kind in WIRE_KINDS else None
        node = self.g.call_function(self.fn(c.axis, c.kind), (x, *args) + ((wire,) if wire is not None else ()))
        node.meta[DTYPE_META] = x.meta.get(DTYPE_META, "float32")
        node.meta[VAR_META] = x.meta.get(VAR_META)
        return node

    def _done(self, node: fx.Node) -> fx.Node:
        """The value of an async collective: an :func:`md_done` node right after it (before its first reader);
        :func:`metadist_torch.schedule.issue_early` then moves the collective itself up."""
        done = self.g.call_function(md_done, (node,))
        done.meta.update(node.meta)
        return done

    def all_reduce(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        node = self._call(x, c, c.reduce)
        dtype = node.meta[DTYPE_META]
        wire = node.args[2] if len(node.args) > 2 else None   # buckets hold one dtype, sent one way
        size = DTYPE_BYTES.get(dtype, 4) if wire is None else wire.itemsize
        self.reduces[node] = ("all_reduce", c.axis, c.reduce, dtype if wire is None else f"{dtype}->{wire}",
                              math.prod(shape) * size)
        return self._done(node)

    def all_gather(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        d = c.dims[0]
        node = self._call(x, c, d, group_extents(shape, c.before, self.mesh, self.coords, c.axis, d))
        if x.op == "placeholder" and len(node.args) == 3:   # an input, sent in its own dtype: may be bucketed
            self.gathers[node] = (c.axis, node.meta[DTYPE_META], int(c.nbytes))
        return node

    def reduce_scatter(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        node = self._call(x, c, c.reduce, c.dims[0])
        if len(node.args) == 3:   # sent in its own dtype: may be bucketed
            self.reduces[node] = ("reduce_scatter", c.axis, c.reduce, node.meta[DTYPE_META], int(c.nbytes))
        return self._done(node)

    def all_to_all(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        src, dst = c.dims
        return self._call(x, c, src, dst, group_extents(shape, c.before, self.mesh, self.coords, c.axis, src))

    def local_split(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        return self._call(x, c, c.dims[0])

    def local_partial(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        return self._call(x, c, c.reduce)


def _select(out: Any, idx: Sequence[int]) -> tuple:
    items: list = []
    for o in (out if isinstance(out, (tuple, list)) else [out]):
        items.extend(o if isinstance(o, (tuple, list)) else [o])
    return tuple(items[i] for i in idx)


md_select = _named("md_select", _select)


def op_node(g: fx.Graph, graph: MetaIR, op: MetaOp, ins: Sequence[fx.Node], out_sh: Sequence[Sharding],
            mesh: Mesh, coords: Sequence[int], name: str) -> list[fx.Node]:
    """The fx node(s) of one aten op on local tensors: one per op output."""
    args = rebuild(op.attrs.get("args", []), ins)
    kwargs = rebuild(op.attrs.get("kwargs", {}), ins)
    if op.key.split(".")[1] in SHAPE_ARG_OPS and len(args) >= 2 and isinstance(args[1], (list, tuple)) \
            and len(op.outputs) == 1:
        args[1] = list(shard_shape(graph.vars[op.outputs[0]].shape, out_sh[0], mesh, coords))
    node = g.create_node("call_function", resolve_target(op.key), tuple(args), kwargs, name=name)
    select = op.attrs.get("select")
    if select is None:
        outs = [node]
    else:
        picked = g.call_function(md_select, (node, list(select)))
        outs = [g.call_function(operator.getitem, (picked, i)) for i in range(len(op.outputs))]
    for o, v in zip(outs, op.outputs):
        o.meta[DTYPE_META] = graph.vars[v].dtype
        o.meta[VAR_META] = v
    return outs


@dataclass
class RankGraph:
    """This rank's program: ``gm(*local inputs in graph.inputs order)`` returns the whole graph outputs
    (``output_vars``), then the new local pieces of the updated state (``state_inputs``)."""

    gm: fx.GraphModule
    input_vars: list[str]
    output_vars: list[str]
    state_inputs: list[str]
    stats: CommStats = field(default_factory=CommStats)
    n_collectives: int = 0

    def __call__(self, *local_inputs: torch.Tensor) -> tuple:
        return self.gm(*local_inputs)


def coalesce_all_reduces(g: fx.Graph, reduces: dict, bucket_fn: Callable[[str, int], Callable],
                         caps: Mapping[str, int]) -> None:
    """Merge all_reduces (and reduce_scatters) that are independent of each other into buckets, as DDP
    (and FSDP) do with gradients.

    Walking the program in order, a collective joins an open bucket of the same
    kind, axis, reduce op and dtype when its input is computed before the bucket's
    first member and the bucket stays within ``caps[kind]`` bytes (a kind without
    a cap is not bucketed); the bucket then runs at that first member's place, as
    one collective of the concatenated inputs. Values and bytes are unchanged.
    """
    order = {n: i for i, n in enumerate(g.nodes)}
    buckets: list[dict] = []
    for n in [n for n in g.nodes if n in reduces]:
        kind, axis, reduce, dtype, nbytes = reduces[n]
        if not caps.get(kind):
            continue
        src = n.args[0]
        for b in buckets:
            if b["key"] == (kind, axis, reduce, dtype) and b["bytes"] + nbytes <= caps[kind] \
                    and order[src] < order[b["anchor"]]:
                b["members"].append(n)
                b["bytes"] += nbytes
                break
        else:
            buckets.append({"key": (kind, axis, reduce, dtype), "anchor": n, "members": [n], "bytes": nbytes})
    for b in buckets:
        if len(b["members"]) < 2:
            continue
        kind, axis, reduce, _ = b["key"]
        extra = [[m.args[2] for m in b["members"]]] if kind == "reduce_scatter" else b["anchor"].args[2:]
        with g.inserting_before(b["anchor"]):
            call = g.call_function(bucket_fn(kind, axis), ([m.args[0] for m in b["members"]], reduce,
                                                           *extra))   # the dims; an all_reduce's wire dtype
            outs = [g.call_function(operator.getitem, (call, i)) for i in range(len(b["members"]))]
        for m, o in zip(b["members"], outs):
            m.replace_all_uses_with(o)
            g.erase_node(m)


def coalesce_all_gathers(g: fx.Graph, gathers: dict, bucket_fn: Callable[[int], Callable], cap: int
                         ) -> list[list[fx.Node]]:
    """Merge the all_gathers of graph inputs into buckets by :func:`metadist_core.gathers.bucket_in_order`.

    A gather counts when its input is a placeholder and only ops read its result (an edge of exactly one
    all_gather, what :func:`metadist_core.gathers.gathers` finds in the plan). Each bucket of two or more
    runs as one :meth:`AxisComm.all_gather_bucket` where its first member was. Returns the buckets made.
    """
    def only_ops_read(n: fx.Node) -> bool:
        return all(u.op == "call_function" and not getattr(u.target, "__name__", "").startswith("md_")
                   for u in n.users)
    order = [n for n in g.nodes if n in gathers and only_ops_read(n)]
    buckets = bucket_in_order([(n, gathers[n][:2], gathers[n][2]) for n in order], cap)
    made = []
    for b in buckets:
        if len(b) < 2:
            continue
        with g.inserting_before(b[0]):
            call = g.call_function(bucket_fn(gathers[b[0]][0]), ([m.args[0] for m in b], [m.args[1] for m in b],
                                                                   [m.args[2] for m in b]))
            outs = [g.call_function(operator.getitem, (call, i)) for i in range(len(b))]
        for m, o in zip(b, outs):
            o.meta.update(m.meta)
            m.replace_all_uses_with(o)
            g.erase_node(m)
        made.append(outs)
    return made


def lower_plan(graph: MetaIR, plan: Any, mesh: Mesh, *, coords: Sequence[int], groups: Sequence[Any] | None,
               stats: CommStats | None = None, coalesce: bool = True, bucket_bytes: int = 25 * 2**20,
               shard_bucket_bytes: int = 0,
               wire: Mapping[str, torch.dtype] | None = None, inplace_state: bool = False) -> RankGraph:
    """Build this rank's fx program for ``plan`` (``groups[axis]``: the process group of each mesh axis).

    ``coalesce`` merges independent all_reduces of one axis into buckets of up to ``bucket_bytes``, and
    the all_gathers of inputs and the reduce_scatters into buckets of up to ``shard_bucket_bytes`` (0: each
    on its own).
    ``wire`` (value id -> torch dtype, :func:`metadist_torch.compression.wire_map`): the values whose
    collectives travel compressed. ``inplace_state``: each new state value is copied into its input's
    storage as soon as the old value's last reader has run, so the new one dies there (what the memory
    model prices, :func:`metadist_core.aliasing.inplace_state_liveness`); the program then returns the
    updated inputs themselves.
    """
    stats = stats if stats is not None else CommStats()
    coords = tuple(int(c) for c in coords)
    g = fx.Graph()
    inputs = {}
    for v in graph.inputs:
        inputs[v] = g.placeholder(_safe(v))
        inputs[v].meta[DTYPE_META] = graph.vars[v].dtype
        inputs[v].meta[VAR_META] = v
    colls = TorchCollectives(g, mesh, coords, groups, stats, wire)

    def run_op(op: MetaOp, ins: list, out_sh: list[Sharding]) -> list[fx.Node]:
        return op_node(g, graph, op, ins, out_sh, mesh, coords, _safe(op.id))

    res = interpret(graph, plan, mesh, inputs, run_op, colls)
    output_vars, state_inputs = list(res.outputs), list(res.state)
    g.output(tuple([res.outputs[v] for v in output_vars] + [res.state[s] for s in state_inputs]))
    g.eliminate_dead_code()
    gather_buckets: list[list[fx.Node]] = []
    if coalesce:
        coalesce_all_reduces(g, colls.reduces, lambda kind, axis: colls.fn(axis, f"{kind}_bucket"),
                             {"all_reduce": bucket_bytes, "reduce_scatter": shard_bucket_bytes})
        if shard_bucket_bytes:
            gather_buckets = coalesce_all_gathers(g, colls.gathers, lambda axis: colls.fn(axis, "all_gather_bucket"),
                                                  shard_bucket_bytes)
    if inplace_state:
        write_state_in_place(g, [inputs[v] for v in state_inputs], len(output_vars))
    from .schedule import issue_early
    issue_early(g)   # all_reduces issued as soon as their input exists, waited for at their first reader
    n_coll = sum(1 for _, c in res.collectives if not c.is_free)
    rg = RankGraph(fx.GraphModule(torch.nn.Module(), g), list(graph.inputs), output_vars, state_inputs, stats,
                   n_coll)
    rg.collectives = [(v, c) for v, c in res.collectives if not c.is_free]   # as run, before bucketing
    rg.gather_buckets = [[o.meta.get(VAR_META) for o in outs] for outs in gather_buckets]   # values per bucket
    return rg


def write_state_in_place(g: fx.Graph, placeholders: Sequence[fx.Node], n_outputs: int) -> int:
    """Copy each new state value (the output after the first ``n_outputs``) into its placeholder right after
    the old value's last reader (and after the new value exists), and return the placeholder instead.

    A collective reading the old value whose result is not read before the copy may still be reading it
    asynchronously: it is waited for first.
    Returns how many state values are written in place."""
    from .schedule import md_wait
    out = next(n for n in g.nodes if n.op == "output")
    vals = list(out.args[0])
    order = {n: i for i, n in enumerate(g.nodes)}
    user_outs = set(vals[:n_outputs])
    done = 0
    for k, ph in enumerate(placeholders):
        new = vals[n_outputs + k]
        if not isinstance(new, fx.Node) or new is ph or new in user_outs or new.op == "placeholder":
            continue
        readers = [u for u in ph.users if u is not out]
        last = max([new, *readers], key=lambda n: order[n])
        # a collective reading the old value whose result nothing has read by then may still be reading it:
        # wait for it first (a collective whose result was read was waited for there; waiting again at the
        # copy would keep its result, a gathered parameter, alive to the end of the step)
        colls = [u for u in readers if u.op == "call_function" and getattr(u.target, "__name__", "").startswith("md_")
                 and not any(order[x] <= order[last] for x in _value_readers(u))]
        with g.inserting_after(last):
            c = g.call_function(torch.ops.aten.copy_.default, (ph, new))
        if colls:
            with g.inserting_before(c):
                g.call_function(md_wait, tuple(colls))
        vals[n_outputs + k] = ph
        done += 1
    out.args = (tuple(vals),)
    return done


def _value_readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read a collective's value: through its ``md_done`` (which moves to its first reader)."""
    out: list[fx.Node] = []
    for u in node.users:
        through = u.op == "call_function" and (u.target is md_done or u.target is operator.getitem)
        out.extend(_value_readers(u) if through else [u])
    return out


def _safe(name: str) -> str:
    s = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return s if s and not s[0].isdigit() else "v_" + s


__all__ = ["lower_plan", "RankGraph", "AxisComm", "TorchCollectives", "coalesce_all_reduces", "op_node",
           "SHAPE_ARG_OPS", "CommStats"]
