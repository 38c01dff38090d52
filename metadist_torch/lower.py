"""Lower a ShardingPlan to a per-rank torch.fx program with torch's functional collectives.

The program is exactly what :func:`metadist_core.simulate.simulate` does on
simulated devices, on this rank's pieces only:

- graph inputs come in as this rank's local pieces under ``plan.input_shardings``;
- before each op input, the plan edge's collectives run in order
  (``all_reduce``, ``all_gather`` (``all_gather_single``), ``reduce_scatter``
  (``reduce_scatter_single``), ``all_to_all`` (``all_to_all_single``),
  ``local_split``, ``local_partial``), each over the process group of its mesh
  axis, followed by ``wait_tensor``; the same collectives on the same value
  are run once and shared between readers;
- each op calls its aten overload on local tensors; ops whose attrs carry the
  full output shape (view, reshape, expand...) get the local shape from
  ``shard_shape(full, output sharding, mesh, coords)``, as the simulator and
  ShardCombine do;
- graph outputs get their ``<output>`` collectives (whole on every rank),
  updated state its state edge's collectives (back to the state's storage
  sharding).

Uneven splits follow ``torch.chunk``: gathers and reduce-scatters pad to the
chunk size and cut the padding off again. gloo has no AVG reduction: an avg
all_reduce is a sum divided by the axis size. Every collective adds its bytes
(the per-device buffer the cost model priced) to ``CommStats``.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from metadist_core.cost import UnknownCollectiveError
from metadist_core.ir import MetaIR
from metadist_core.placement import Mesh, Sharding, chunk_bounds, chunk_sizes, shard_shape

from .oprunner import rebuild, resolve_overload

# ops whose second argument is the full output shape: lowered with the local output shape
SHAPE_ARG_OPS = frozenset({"view", "_unsafe_view", "reshape", "view_copy", "_reshape_copy", "expand",
                           "expand_copy", "_reshape_alias"})
OUTPUT = "<output>"


@dataclass
class CommStats:
    """Bytes and calls counted at the collectives, by kind."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def timed(self, kind: str, t0: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()


def _funcol():
    import torch.distributed._functional_collectives as fc
    ag = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    rs = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
    return fc, ag, rs


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


class AxisComm:
    """The collectives of one mesh axis for this rank: group, size and this rank's coordinate on it."""

    def __init__(self, axis: int, group: Any, n: int, coord: int, stats: CommStats) -> None:
        self.axis, self.group, self.n, self.coord, self.stats = axis, group, n, coord, stats

    # Each method is a collective kind of metadist_core.cost; see simulate.apply_collective.
    def all_reduce(self, x: torch.Tensor, reduce: str) -> torch.Tensor:
        fc, _, _ = _funcol()
        self.stats.add("all_reduce", _nbytes(x))
        op = "sum" if reduce == "avg" else reduce
        y = fc.wait_tensor(fc.all_reduce(x.contiguous(), op, self.group))
        return y / self.n if reduce == "avg" else y

    def all_reduce_bucket(self, xs: Sequence[torch.Tensor], reduce: str) -> tuple:
        """Several independent all_reduces of one dtype as one call on a flat buffer (same bytes, one latency)."""
        fc, _, _ = _funcol()
        flat = torch.cat([x.reshape(-1) for x in xs])
        self.stats.add("all_reduce", _nbytes(flat))
        self.stats.calls["all_reduce"] += len(xs) - 1   # calls count the plan's collectives
        op = "sum" if reduce == "avg" else reduce
        y = fc.wait_tensor(fc.all_reduce(flat, op, self.group))
        if reduce == "avg":
            y = y / self.n
        return tuple(p.view(x.shape) for p, x in zip(y.split([x.numel() for x in xs]), xs))

    def all_gather(self, x: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        fc, ag, _ = _funcol()
        sizes = chunk_sizes(total, self.n)
        c = max(sizes)
        xp = _pad(x, dim, c).contiguous()
        self.stats.add("all_gather", _nbytes(x) * total // max(1, x.shape[dim]) if x.shape[dim] else 0)
        y = fc.wait_tensor(ag(xp, dim, self.group))
        if all(s == c for s in sizes):
            return y
        return torch.cat([y.narrow(dim, i * c, s) for i, s in enumerate(sizes) if s], dim=dim)

    def reduce_scatter(self, x: torch.Tensor, reduce: str, dim: int) -> torch.Tensor:
        fc, _, rs = _funcol()
        total = x.shape[dim]
        sizes = chunk_sizes(total, self.n)
        c = max(sizes)
        self.stats.add("reduce_scatter", _nbytes(x))
        op = "sum" if reduce == "avg" else reduce
        y = fc.wait_tensor(rs(_pad(x, dim, c * self.n).contiguous(), op, dim, self.group))
        if sizes[self.coord] != c:
            y = y.narrow(dim, 0, sizes[self.coord])
        return y / self.n if reduce == "avg" else y

    def all_to_all(self, x: torch.Tensor, src: int, dst: int, src_total: int) -> torch.Tensor:
        fc, _, _ = _funcol()
        n = self.n
        src_sizes = chunk_sizes(src_total, n)
        dst_sizes = chunk_sizes(x.shape[dst], n)
        cs, cd = max(src_sizes), max(dst_sizes)
        self.stats.add("all_to_all", _nbytes(x))
        xp = _pad(_pad(x, src, cs), dst, cd * n)
        send = torch.stack(xp.split(cd, dim=dst), dim=0).contiguous()
        recv = fc.wait_tensor(fc.all_to_all_single(send, None, None, self.group))
        pieces = []
        for i in range(n):
            p = recv[i]
            if src_sizes[i] == 0:
                continue
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


def _select(out: Any, idx: Sequence[int]) -> tuple:
    items: list = []
    for o in (out if isinstance(out, (tuple, list)) else [out]):
        items.extend(o if isinstance(o, (tuple, list)) else [o])
    return tuple(items[i] for i in idx)


@dataclass
class LoweredStep:
    """The per-rank program: ``gm(*local inputs in graph.inputs order)`` returns the whole graph outputs
    (``output_vars``), then the new local pieces of the updated state (``state_inputs``)."""

    gm: fx.GraphModule
    input_vars: list[str]
    output_vars: list[str]
    state_inputs: list[str]
    stats: CommStats
    n_collectives: int = 0

    def __call__(self, *local_inputs: torch.Tensor) -> tuple:
        return self.gm(*local_inputs)


def _timed(stats: CommStats, kind: str, fn: Callable) -> Callable:
    def f(*a):
        t0 = time.perf_counter()
        out = fn(*a)
        stats.timed(kind, t0)
        return out
    return f


def _bound(name: str, fn: Callable) -> Callable:
    """A plain function (fx prints call targets by name) around a bound method."""
    def f(*a):
        return fn(*a)
    f.__name__ = f.__qualname__ = name
    return f


def _coalesce_all_reduces(g: fx.Graph, reduces: dict, bucket_fn: Callable, bucket_bytes: int) -> None:
    """Merge all_reduces that are independent of each other into buckets (as DDP does with gradients).

    Walking the program in order, an all_reduce joins an open bucket of the same
    axis, reduce op and dtype when its input is computed before the bucket's
    first member; the bucket then runs at that first member's place, as one
    all_reduce of the concatenated inputs. Values and bytes are unchanged.
    """
    order = {n: i for i, n in enumerate(g.nodes)}
    buckets: list[dict] = []
    for n in [n for n in g.nodes if n in reduces]:
        axis, reduce, dtype, nbytes = reduces[n]
        src = n.args[0]
        for b in buckets:
            if b["key"] == (axis, reduce, dtype) and b["bytes"] + nbytes <= bucket_bytes \
                    and order[src] < order[b["anchor"]]:
                b["members"].append(n)
                b["bytes"] += nbytes
                break
        else:
            buckets.append({"key": (axis, reduce, dtype), "anchor": n, "members": [n], "bytes": nbytes})
    for b in buckets:
        if len(b["members"]) < 2:
            continue
        axis, reduce, _ = b["key"]
        with g.inserting_before(b["anchor"]):
            call = g.call_function(bucket_fn(axis), ([m.args[0] for m in b["members"]], reduce))
            outs = [g.call_function(operator.getitem, (call, i)) for i in range(len(b["members"]))]
        for m, o in zip(b["members"], outs):
            m.replace_all_uses_with(o)
            g.erase_node(m)


def lower_plan(graph: MetaIR, plan: Any, mesh: Mesh, *, coords: Sequence[int], groups: Sequence[Any] | None,
               stats: CommStats | None = None, coalesce: bool | None = None,
               bucket_bytes: int = 25 * 2**20) -> LoweredStep:
    """Build this rank's fx program for ``plan`` (``groups[axis]``: the process group of each mesh axis).

    ``coalesce`` (default: on unless ``METADIST_COALESCE=0``) merges independent
    all_reduces of one axis into buckets of up to ``bucket_bytes``.
    """
    if coalesce is None:
        import os
        coalesce = os.environ.get("METADIST_COALESCE", "1").strip().lower() not in ("0", "false", "no", "off")
    stats = stats if stats is not None else CommStats()
    coords = tuple(int(c) for c in coords)
    comms = [AxisComm(a, None if groups is None else groups[a], mesh.shape[a], coords[a], stats)
             for a in range(mesh.ndim)]
    coll_fns: dict[tuple[int, str], Callable] = {}

    def coll_fn(axis: int, kind: str) -> Callable:
        k = (axis, kind)
        if k not in coll_fns:
            coll_fns[k] = _bound(f"md_{kind}_axis{axis}", _timed(stats, kind, getattr(comms[axis], kind)))
        return coll_fns[k]

    select_fn = _bound("md_select", _select)
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for v in graph.inputs:
        env[v] = g.placeholder(_safe(v))
    incoming, finals = plan.edge_index()
    shared: dict[tuple, fx.Node] = {}
    reduces: dict[fx.Node, tuple] = {}
    n_coll = 0

    def apply(var: str, edge: Any) -> fx.Node:
        nonlocal n_coll
        node = env[var]
        if edge is None or not edge.collectives:
            return node
        key = (var, tuple((c.kind, c.axis, c.dims, c.reduce, str(c.before), str(c.after)) for c in edge.collectives))
        if key in shared:
            return shared[key]
        shape = graph.vars[var].shape
        for c in edge.collectives:
            if c.kind == "all_reduce":
                node = g.call_function(coll_fn(c.axis, "all_reduce"), (node, c.reduce))
                reduces[node] = (c.axis, c.reduce, graph.vars[var].dtype, graph.vars[var].nbytes)
            elif c.kind == "all_gather":
                total = shard_shape(shape, c.after, mesh, coords)[c.dims[0]]
                node = g.call_function(coll_fn(c.axis, "all_gather"), (node, c.dims[0], total))
            elif c.kind == "reduce_scatter":
                node = g.call_function(coll_fn(c.axis, "reduce_scatter"), (node, c.reduce, c.dims[0]))
            elif c.kind == "all_to_all":
                src_total = shard_shape(shape, c.after, mesh, coords)[c.dims[0]]
                node = g.call_function(coll_fn(c.axis, "all_to_all"), (node, c.dims[0], c.dims[1], src_total))
            elif c.kind == "local_split":
                node = g.call_function(coll_fn(c.axis, "local_split"), (node, c.dims[0]))
            elif c.kind == "local_partial":
                node = g.call_function(coll_fn(c.axis, "local_partial"), (node, c.reduce))
            else:
                raise UnknownCollectiveError(c.kind, "the torch lowering")
            if not c.is_free:
                n_coll += 1
        shared[key] = node
        return node

    rep = Sharding.replicated(mesh.ndim)
    for op in graph.ops:
        ins = [apply(v, incoming.get((op.id, slot))) for slot, v in enumerate(op.inputs)]
        overload = resolve_overload(op.key)
        args = rebuild(op.attrs.get("args", []), ins)
        kwargs = rebuild(op.attrs.get("kwargs", {}), ins)
        name = op.key.split(".")[1]
        strategy = plan.strategies.get(op.id)
        out_sh = list(strategy.outputs) if strategy is not None else [rep] * len(op.outputs)
        if name in SHAPE_ARG_OPS and len(args) >= 2 and isinstance(args[1], (list, tuple)) and len(op.outputs) == 1:
            full = graph.vars[op.outputs[0]].shape
            args[1] = list(shard_shape(full, out_sh[0], mesh, coords))
        node = g.create_node("call_function", overload, tuple(args), kwargs, name=_safe(op.id))
        select = op.attrs.get("select")
        if select is not None:
            picked = g.call_function(select_fn, (node, list(select)))
            for i, o in enumerate(op.outputs):
                env[o] = g.call_function(operator.getitem, (picked, i))
        else:
            env[op.outputs[0]] = node
    alias_targets = set(graph.aliases.values())
    output_vars = [o for o in graph.outputs if o not in alias_targets]
    outs = [apply(o, finals.get((o, OUTPUT))) for o in output_vars]
    state_inputs = list(graph.aliases)
    outs += [apply(graph.aliases[s], finals.get((graph.aliases[s], s))) for s in state_inputs]
    g.output(tuple(outs))
    g.eliminate_dead_code()
    if coalesce:
        _coalesce_all_reduces(g, reduces, lambda axis: coll_fn(axis, "all_reduce_bucket"), bucket_bytes)
    gm = fx.GraphModule(torch.nn.Module(), g)
    return LoweredStep(gm, list(graph.inputs), output_vars, state_inputs, stats, n_coll)


def _safe(name: str) -> str:
    s = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return s if s and not s[0].isdigit() else "v_" + s


def local_piece(x: torch.Tensor, sharding: Sharding, mesh: Mesh, coords: Sequence[int]) -> torch.Tensor:
    """This rank's piece of a whole tensor under ``sharding`` (Shard by torch.chunk; Partial(sum) on coord 0)."""
    for axis, p in enumerate(sharding):
        if p.is_shard():
            d = p.dim % x.dim()
            lo, hi = chunk_bounds(x.shape[d], mesh.shape[axis], coords[axis])
            x = x.narrow(d, lo, hi - lo)
        elif p.is_partial() and p.reduce == "sum" and coords[axis] != 0:
            x = torch.zeros_like(x)
    return x


__all__ = ["lower_plan", "LoweredStep", "CommStats", "AxisComm", "local_piece", "SHAPE_ARG_OPS"]
