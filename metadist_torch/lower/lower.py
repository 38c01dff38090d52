"""Lower a ShardingPlan to a per-rank torch.fx program with torch's functional collectives.

The program is built by the one plan interpreter
(:func:`metadist_core.plan.interpret.interpret`) with fx Nodes as its values, so a
plan means here exactly what it means in :mod:`metadist_core.plan.simulate`:

- graph inputs are placeholders holding this rank's local pieces under
  ``plan.input_shardings``;
- each op becomes a call of its aten overload on local tensors (:func:`op_node`);
  ops whose attrs carry the full output shape (view, reshape, expand...) get
  the local shape ``shard_shape(full, output sharding, mesh, coords)``;
- each edge's collectives become calls of :class:`~metadist_torch.lower.collectives.AxisComm` over the process
  group of their mesh axis (:class:`TorchCollectives`): ``all_reduce``,
  ``all_gather`` (``all_gather_single``), ``reduce_scatter``
  (``reduce_scatter_single``), ``all_to_all`` (``all_to_all_single``), each
  followed by ``wait_tensor``, and the free ``local_split``/``local_partial``.

Uneven splits follow ``torch.chunk``: gathers and reduce-scatters pad to the
chunk size and cut the padding off again (each member's extent from
:func:`metadist_core.ir.placement.group_extents`). gloo has no AVG reduction:
``avg`` is the sum divided by the axis size, as in every engine. Every
collective adds its bytes to a :class:`~metadist_torch.runtime.stats.CommStats`.
Independent all_reduces of one axis are then merged into buckets
(``settings.coalesce``, up to ``settings.bucket_bytes`` each), and so are the
all_gathers of graph inputs (parameters), up to ``settings.shard_bucket_bytes``
each, by the rule of :mod:`metadist_core.cost.gathers` (:func:`coalesce_all_gathers`).
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from metadist_core.cost.compression import gradient_chain
from metadist_core.cost.model import Collective
from metadist_core.plan.interpret import Collectives, interpret
from metadist_core.ir.ir import DTYPE_BYTES, MetaIR, MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding, group_extents, shard_shape

from ..trace.calls import STRIDE_FREE, rebuild, resolve_target
from .collectives import AxisComm, md_done
from .implcall import impl_node
from ..ops.distimpls import torch_impls
from .reinplace import reinplace_updates
from .schedule import issue_early, md_wait, prefetch_gathers
from ..runtime.stats import CommStats
from .coalesce import coalesce_all_reduces, coalesce_all_gathers, DTYPE_META, VAR_META

# ops whose second argument is the full output shape: lowered with the local output shape
SHAPE_ARG_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "view_copy",
        "_reshape_copy",
        "expand",
        "expand_copy",
        "_reshape_alias",
        "slice_backward",
        "select_backward",
        "new_empty_strided",
    }
)
ASYNC_KINDS = frozenset(
    {"all_reduce", "reduce_scatter", "all_reduce_bucket", "reduce_scatter_bucket", "all_gather_bucket"}
)
WIRE_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})  # take a wire dtype


def _named(name: str, fn: Callable) -> Callable:
    """A plain function called ``name`` (fx prints call targets by name) around ``fn``."""

    def f(*a):
        return fn(*a)

    f.__name__ = f.__qualname__ = name
    return f


class TorchCollectives(Collectives):
    """The plan's collectives as fx nodes: each call adds a node calling this rank's :class:`AxisComm`."""

    def __init__(
        self,
        g: fx.Graph,
        mesh: Mesh,
        coords: Sequence[int],
        groups: Sequence[Any] | None,
        stats: CommStats,
        wire: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.g, self.mesh, self.coords, self.stats = g, mesh, tuple(int(c) for c in coords), stats
        self.wire = dict(wire or {})  # value id -> the dtype its collectives travel in (grad_compression)
        self.comms = [
            AxisComm(a, None if groups is None else groups[a], mesh.shape[a], self.coords[a], stats)
            for a in range(mesh.ndim)
        ]
        self.fns: dict[tuple[int, str], Callable] = {}
        self.reduces: dict[fx.Node, tuple] = {}  # all_reduce / reduce_scatter node -> (kind, axis, reduce, dtype,
        #                                           bytes): for bucketing
        self.gathers: dict[fx.Node, tuple] = {}  # all_gather of a placeholder -> (axis, dtype, bytes): buckets

    def fn(self, axis: int, kind: str) -> Callable:
        k = (axis, kind)
        if k not in self.fns:
            method = getattr(self.comms[axis], f"start_{kind}" if kind in ASYNC_KINDS else kind)
            self.fns[k] = _named(f"md_{kind}_axis{axis}", method)
        return self.fns[k]

    def _call(self, x: fx.Node, c: Collective, *args: Any) -> fx.Node:
        wire = self.wire.get(x.meta.get(VAR_META)) if c.kind in WIRE_KINDS else None
        node = self.g.call_function(self.fn(c.axis, c.kind), (x, *args) + ((wire,) if wire is not None else ()))
        node.meta[DTYPE_META] = x.meta.get(DTYPE_META, "float32")
        node.meta[VAR_META] = x.meta.get(VAR_META)
        return node

    def _done(self, node: fx.Node) -> fx.Node:
        """The value of an async collective: an :func:`md_done` node right after it (before its first reader);
        :func:`metadist_torch.lower.schedule.issue_early` then moves the collective itself up."""
        done = self.g.call_function(md_done, (node,))
        done.meta.update(node.meta)
        return done

    def all_reduce(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        node = self._call(x, c, c.reduce)
        dtype = node.meta[DTYPE_META]
        wire = node.args[2] if len(node.args) > 2 else None  # buckets hold one dtype, sent one way
        size = DTYPE_BYTES.get(dtype, 4) if wire is None else wire.itemsize
        self.reduces[node] = (
            "all_reduce",
            c.axis,
            c.reduce,
            dtype if wire is None else f"{dtype}->{wire}",
            math.prod(shape) * size,
        )
        return self._done(node)

    def all_gather(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        d = c.dims[0]
        node = self._call(x, c, d, group_extents(shape, c.before, self.mesh, self.coords, c.axis, d))
        if x.op == "placeholder" and len(node.args) == 3:  # an input, sent in its own dtype: may be bucketed
            self.gathers[node] = (c.axis, node.meta[DTYPE_META], int(c.nbytes))
        return node

    def reduce_scatter(self, x: fx.Node, c: Collective, shape: tuple[int, ...]) -> fx.Node:
        node = self._call(x, c, c.reduce, c.dims[0])
        if len(node.args) == 3:  # sent in its own dtype: may be bucketed
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
    for o in out if isinstance(out, (tuple, list)) else [out]:
        items.extend(o if isinstance(o, (tuple, list)) else [o])
    return tuple(items[i] for i in idx)


md_select = _named("md_select", _select)


def op_node(
    g: fx.Graph,
    graph: MetaIR,
    op: MetaOp,
    ins: Sequence[fx.Node],
    out_sh: Sequence[Sharding],
    mesh: Mesh,
    coords: Sequence[int],
    name: str,
) -> list[fx.Node]:
    """The fx node(s) of one aten op on local tensors: one per op output."""

    def item(x: fx.Node) -> fx.Node:  # a 0-d tensor input passed as its number
        return g.call_function(torch.ops.aten._local_scalar_dense.default, (x,))

    args = rebuild(op.attrs.get("args", []), ins, item=item)
    kwargs = rebuild(op.attrs.get("kwargs", {}), ins, item=item)
    if (
        op.key.split(".")[1] in SHAPE_ARG_OPS
        and len(args) >= 2
        and isinstance(args[1], (list, tuple))
        and len(op.outputs) == 1
    ):
        args[1] = list(shard_shape(graph.vars[op.outputs[0]].shape, out_sh[0], mesh, coords))
        if op.key.split(".")[1] == "new_empty_strided" and len(args) >= 3:  # contiguous (its rules ask it)
            args[2] = [int(s) for s in torch.empty(args[1], device="meta").stride()]
    target = STRIDE_FREE.get(op.key) or resolve_target(op.key)
    node = g.create_node("call_function", target, tuple(args), kwargs, name=name)
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


def impl_op_node(
    g: fx.Graph, graph: MetaIR, op: MetaOp, ins: Sequence[fx.Node], placed: tuple[int, str], comm: AxisComm, name: str
) -> list[fx.Node]:
    """The fx node(s) of an op a distributed implementation runs on mesh axis ``placed[0]``: one per op output."""

    def item(x: fx.Node) -> fx.Node:
        return g.call_function(torch.ops.aten._local_scalar_dense.default, (x,))

    _, outs = impl_node(g, op, ins, placed[1], comm, torch_impls()[0], name, md_select, item)
    for o, v in zip(outs, op.outputs):
        o.meta[DTYPE_META] = graph.vars[v].dtype
        o.meta[VAR_META] = v
    return outs


@dataclass
class RankGraph:
    """This rank's program: ``gm(*local inputs in graph.inputs order, *input_pieces' slices)`` returns the whole
    graph outputs (``output_vars``), then the new local pieces of the updated state (``state_inputs``).
    ``input_pieces``: (user input, layout) of each user input the plan also reads in a layout other than the
    one it is stored in: this rank's slice of the whole input (``metadist_torch.lower.program.input_pieces``)."""

    gm: fx.GraphModule
    input_vars: list[str]
    output_vars: list[str]
    state_inputs: list[str]
    stats: CommStats = field(default_factory=CommStats)
    n_collectives: int = 0
    input_pieces: list[tuple[str, Sharding]] = field(default_factory=list)
    inplace_updates: list[str] = field(default_factory=list)  # states updated in their own storage (reinplace)
    compiled: Callable | None = None  # gm compiled (metadist_torch.lower.compiled), run in its place

    def __call__(self, *local_inputs: torch.Tensor) -> tuple:
        return (self.compiled or self.gm)(*local_inputs)


def lower_plan(
    graph: MetaIR,
    plan: Any,
    mesh: Mesh,
    *,
    coords: Sequence[int],
    groups: Sequence[Any] | None,
    stats: CommStats | None = None,
    coalesce: bool = True,
    bucket_bytes: int = 25 * 2**20,
    shard_bucket_bytes: int = 0,
    first_bucket_bytes: int = 0,
    wire: Mapping[str, torch.dtype] | None = None,
    inplace_state: bool = False,
) -> RankGraph:
    """Build this rank's fx program for ``plan`` (``groups[axis]``: the process group of each mesh axis).

    ``coalesce`` merges independent all_reduces of one axis into buckets of up to ``bucket_bytes`` (the
    first of each group up to ``first_bucket_bytes``; 0: ``bucket_bytes``), and
    the all_gathers of inputs and the reduce_scatters into buckets of up to ``shard_bucket_bytes`` (0: each
    on its own). Only gradients and what they are views, casts or copies of
    (:func:`metadist_core.cost.compression.gradient_chain`, the values ``build_problem`` marks ``bucketed``) are
    bucketed, so the program runs the buckets the prediction prices.
    ``wire`` (value id -> torch dtype, :func:`metadist_torch.lower.compression.wire_map`): the values whose
    collectives travel compressed. ``inplace_state``: each state update runs in its input's storage where
    it can (:func:`metadist_torch.lower.reinplace.reinplace_updates`), and each other new state value is copied into
    its input's storage as soon as the old value's last reader has run, so the new one dies there (what the memory
    model prices, :func:`metadist_core.ir.aliasing.inplace_state_liveness`); the program then returns the
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
        strategy = plan.strategies.get(op.id)
        placed = strategy.impl_axis() if strategy is not None else None
        if placed is None:
            return op_node(g, graph, op, ins, out_sh, mesh, coords, _safe(op.id))
        return impl_op_node(g, graph, op, ins, placed, colls.comms[placed[0]], _safe(op.id))

    pieces: list[tuple[str, Sharding]] = []
    last_ph = [list(inputs.values())[-1] if inputs else None]

    def whole(v: str, sh: Sharding) -> fx.Node:
        """A user input read in another layout: one more placeholder, fed this rank's slice of it."""
        with g.inserting_after(last_ph[0]) if last_ph[0] is not None else contextlib.nullcontext():
            ph = g.placeholder(_safe(f"{v}_as_{len(pieces)}"))
        ph.meta[DTYPE_META] = graph.vars[v].dtype
        ph.meta[VAR_META] = v
        last_ph[0] = ph
        pieces.append((v, sh))
        return ph

    res = interpret(graph, plan, mesh, inputs, run_op, colls, whole=whole)
    output_vars, state_inputs = list(res.outputs), list(res.state)
    g.output(tuple([res.outputs[v] for v in output_vars] + [res.state[s] for s in state_inputs]))
    g.eliminate_dead_code()
    gather_buckets: list[list[fx.Node]] = []
    reduce_buckets: list[list[Any]] = []
    inplace: list[int] = []
    if coalesce:
        # the values every rank's prediction buckets (ShardingProblem.vars[v]["bucketed"]): from the graph, the
        # same on every rank (a plan shared from rank 0 carries no problem)
        grads = gradient_chain(graph)
        reduce_buckets = coalesce_all_reduces(
            g,
            colls.reduces,
            lambda kind, axis: colls.fn(axis, f"{kind}_bucket"),
            {"all_reduce": bucket_bytes, "reduce_scatter": shard_bucket_bytes},
            first_bucket_bytes,
            lambda n: n.meta.get(VAR_META) in grads,
        )
        if shard_bucket_bytes:
            gather_buckets = coalesce_all_gathers(
                g, colls.gathers, lambda axis: colls.fn(axis, "all_gather_bucket"), shard_bucket_bytes
            )
    if inplace_state:
        n_out = len(output_vars)

        def layout(n: fx.Node) -> tuple | None:
            v, dt = n.meta.get(VAR_META), n.meta.get(DTYPE_META)
            return (tuple(graph.vars[v].shape), dt) if v in graph.vars and dt is not None else None

        # updates that can run in the state's own storage do (metadist_torch.lower.reinplace); the rest are copied
        # into it as soon as the old value's last reader has run
        inplace = reinplace_updates(
            g, [(inputs[v], n_out + i) for i, v in enumerate(state_inputs)], range(n_out), layout
        )
        write_state_in_place(g, [inputs[v] for v in state_inputs], n_out)

    def numel(n: fx.Node) -> int | None:
        v = n.meta.get(VAR_META)
        return graph.vars[v].numel if v in graph.vars else None

    # all_reduces issued as soon as their input exists (a loss's token count: at the start), waited for at their
    # first reader (one only the outputs read: at the end)
    issue_early(g, numel)
    prefetch_gathers(g)  # the next bucket of parameters gathered while the ops reading this one run
    n_coll = sum(1 for _, c in res.collectives if not c.is_free)
    rg = RankGraph(fx.GraphModule(torch.nn.Module(), g), list(graph.inputs), output_vars, state_inputs, stats, n_coll)
    rg.collectives = [(v, c) for v, c in res.collectives if not c.is_free]  # as run, before bucketing
    rg.gather_buckets = [[o.meta.get(VAR_META) for o in outs] for outs in gather_buckets]  # values per bucket
    rg.reduce_buckets = reduce_buckets  # values per all_reduce / reduce_scatter bucket
    rg.inplace_updates = [state_inputs[k - len(output_vars)] for k in inplace]
    rg.input_pieces = pieces
    return rg


def write_state_in_place(g: fx.Graph, placeholders: Sequence[fx.Node], n_outputs: int) -> int:
    """Copy each new state value (the output after the first ``n_outputs``) into its placeholder right after
    the old value's last reader (and after the new value exists), and return the placeholder instead.

    A collective reading the old value whose result is not read before the copy may still be reading it
    asynchronously: it is waited for first.
    Returns how many state values are written in place."""
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
        colls = [
            u
            for u in readers
            if u.op == "call_function"
            and getattr(u.target, "__name__", "").startswith("md_")
            and not any(order[x] <= order[last] for x in _value_readers(u))
        ]
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


__all__ = [
    "lower_plan",
    "RankGraph",
    "AxisComm",
    "TorchCollectives",
    "op_node",
    "SHAPE_ARG_OPS",
    "CommStats",
]
