"""The one plan interpreter: walk a ShardingPlan, run each op through a callback, each edge's
collectives through a :class:`Collectives` object.

It serves the numpy simulator (values are dicts of per-device arrays) and the
three lowerings (torch fx nodes, JAX values inside ``shard_map``, torch tensors
for TVM kernels): each supplies only its op runner and its collectives, so a
plan means the same thing everywhere.

What it fixes for every engine:

- graph inputs arrive as this engine's local values under ``plan.input_shardings``; a user input that
  every process holds whole (``ShardingProblem.whole_inputs``) is read in another layout through the
  engine's ``whole(var, sharding)``: its local slice, with no collective (the plan has none there);
- before an op reads a value, that edge's collectives run in order; the same
  collectives on the same value run **once** per reader phase however many ops
  read it (the cost model charges them so too; :mod:`metadist_core.cost.phases`);
- a graph output leaves whole (its ``<output>`` edge must end replicated),
  updated state leaves with its state edge's collectives, stored as its input
  is (both checked on the plan before anything runs);
- the reduce of a mixed-Partial Sharding is applied axis by axis from the last
  mesh axis to the first (:func:`metadist_core.plan.simulate.assemble`);
- with ``reduce_after(op)`` (an engine's choice), an op that only permutes dims (a transpose) and is the
  sole reader of a value reduced before it runs on the Partial value and the edge's collectives on its
  result (:func:`late_reduces` says on which dims): the same collectives on as many bytes, recorded under
  the value they were planned for. XLA folds a transpose into the dot that feeds it only when no
  collective stands between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

from metadist_core.cost.model import Collective, UnknownCollectiveError
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.cost.phases import reader_phases, share_phase
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Shard, Sharding

V = TypeVar("V")
OUTPUT = "<output>"
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_split", "local_partial")


class PlanError(ValueError):
    """The plan cannot run as it stands: names the value, the edge and the shardings."""


class Collectives(Generic[V]):
    """The collectives of one engine. Each method takes this engine's value of a tensor, the
    cost-model :class:`~metadist_core.cost.model.Collective` to apply (kind, mesh axis, dims, reduce,
    Shardings before and after) and the tensor's whole shape, and returns the new value.

    Semantics (exactly those of :func:`metadist_core.plan.simulate.apply_collective`):
    ``all_reduce`` Partial -> Replicate (``avg`` is the sum divided by the axis size);
    ``all_gather`` Shard(d) -> Replicate (``torch.chunk`` pieces, uneven allowed);
    ``reduce_scatter`` Partial -> Shard(d); ``all_to_all`` Shard(src) -> Shard(dst);
    ``local_split`` Replicate -> Shard(d) (no communication); ``local_partial``
    Replicate -> Partial (``sum`` keeps the value on coordinate 0, zeros elsewhere).
    """

    def all_reduce(self, x: V, c: Collective, shape: tuple[int, ...]) -> V:
        raise UnknownCollectiveError("all_reduce", type(self).__name__)

    def all_gather(self, x: V, c: Collective, shape: tuple[int, ...]) -> V:
        raise UnknownCollectiveError("all_gather", type(self).__name__)

    def reduce_scatter(self, x: V, c: Collective, shape: tuple[int, ...]) -> V:
        raise UnknownCollectiveError("reduce_scatter", type(self).__name__)

    def all_to_all(self, x: V, c: Collective, shape: tuple[int, ...]) -> V:
        raise UnknownCollectiveError("all_to_all", type(self).__name__)

    def local_split(self, x: V, c: Collective, shape: tuple[int, ...]) -> V:
        raise UnknownCollectiveError("local_split", type(self).__name__)

    def local_partial(self, x: V, c: Collective, shape: tuple[int, ...]) -> V:
        raise UnknownCollectiveError("local_partial", type(self).__name__)


# run_op(op, local input values, output shardings) -> list of local output values, one per op.outputs
OpRunner = Callable[[MetaOp, list, list[Sharding]], Sequence]


@dataclass
class Interpretation(Generic[V]):
    """What one walk of the plan produced."""

    outputs: dict[str, V]  # graph output (not state) -> value, whole
    state: dict[str, V]  # state input -> its updated value, stored as the input is
    values: dict[str, V] = field(default_factory=dict)  # every op output, local, before any edge
    collectives: list[tuple[str, Collective]] = field(default_factory=list)  # (var, collective) as run


def edge_key(var: str, collectives: Sequence[Collective], phase: int = 0) -> tuple:
    """Two edges with equal keys move the same value the same way in the same phase: they share one result."""
    return (var, phase, tuple((c.kind, c.axis, c.dims, c.reduce, str(c.before), str(c.after)) for c in collectives))


def op_output_shardings(plan: Any, op: MetaOp, mesh: Mesh) -> list[Sharding]:
    """The Shardings of ``op``'s outputs under ``plan`` (replicated when the plan chose no strategy)."""
    st = plan.strategies.get(op.id)
    return list(st.outputs) if st is not None else [Sharding.replicated(mesh.ndim)] * len(op.outputs)


def final_sharding(plan: Any, var: str, edge: Any, mesh: Mesh) -> Sharding:
    if edge is not None:
        return edge.dst_sharding
    return plan.var_shardings.get(var, Sharding.replicated(mesh.ndim))


def check_plan_ends(graph: MetaIR, plan: Any, mesh: Mesh) -> None:
    """Graph outputs must end whole and updated state as its input is stored; raise PlanError if not."""
    _, finals = plan.edge_index()
    state_outs = set(graph.aliases.values())
    rep = Sharding.replicated(mesh.ndim)
    for o in graph.outputs:
        if o in state_outs:
            continue
        sh = final_sharding(plan, o, finals.get((o, OUTPUT)), mesh)
        if not sh.is_fully_replicated():
            raise PlanError(
                f"graph output {o} ends as {sh}, not whole on every device; the plan needs an "
                f"<output> edge that gathers it"
            )
    for s_in, s_out in graph.aliases.items():
        sh = final_sharding(plan, s_out, finals.get((s_out, s_in)), mesh)
        want = plan.input_shardings.get(s_in, rep)
        if sh != want:
            raise PlanError(f"updated state {s_out} ends as {sh}, but its input {s_in} is stored as {want}")


def late_reduces(
    graph: MetaIR, plan: Any, incoming: Mapping, mesh: Mesh, permutes: Callable[[MetaOp], Sequence[int] | None]
) -> dict[str, dict[int, int]]:
    """Op id -> {planned dim: dim of the op's output it acts on} for the ops whose input's collectives run
    after them instead (the module doc): one input, ``permutes(op)`` gives its permutation, the input read by
    this op alone through collectives that begin with a reduce of a Sharding with no Shard and end
    replicated, and the op's output left replicated.

    Such an edge splits a dim only on the way to replicated, so any dim that divides as evenly serves: the
    planned dim itself where the output's divides by the whole mesh (XLA's CPU reduce-scatter runs far
    faster on a leading dim than on a permuted one), else the dim the permutation moves it to."""
    readers: dict[str, int] = {}
    for op in graph.ops:
        for v in op.inputs:
            readers[v] = readers.get(v, 0) + 1
    ends = set(graph.outputs) | set(graph.aliases.values())
    late = {}
    for op in graph.ops:
        if len(op.inputs) != 1 or len(op.outputs) != 1:
            continue
        perm = permutes(op)
        v = op.inputs[0]
        edge = incoming.get((op.id, 0))
        st = plan.strategies.get(op.id)
        if perm is None or edge is None or not edge.collectives or readers.get(v) != 1 or v in ends or st is None:
            continue
        if (
            edge.collectives[0].kind in ("all_reduce", "reduce_scatter")
            and all(c.kind in ("all_reduce", "reduce_scatter", "all_gather") for c in edge.collectives)
            and not any(p.is_shard() for p in edge.src_sharding)
            and edge.dst_sharding.is_fully_replicated()
            and all(sh.is_fully_replicated() for sh in st.outputs)
        ):
            out_shape = tuple(graph.vars[op.outputs[0]].shape or ())
            used = {d for c in edge.collectives for d in c.dims}
            if all(d < len(out_shape) and out_shape[d] % mesh.size == 0 for d in used):
                late[op.id] = {d: d for d in used}
            else:
                late[op.id] = {d: list(perm).index(d) for d in used}
    return late


def redimmed(c: Collective, dims: Mapping[int, int]) -> Collective:
    """``c`` acting on dims ``dims[d]`` where it was planned on dims ``d`` (its Shardings alike)."""

    def sh(s: Sharding) -> Sharding:
        return Sharding([Shard(dims.get(p.dim, p.dim)) if isinstance(p, Shard) else p for p in s])

    return replace(c, dims=tuple(dims[d] for d in c.dims), before=sh(c.before), after=sh(c.after))


def interpret(
    graph: MetaIR,
    plan: Any,
    mesh: Mesh,
    inputs: Mapping[str, V],
    run_op: OpRunner,
    collectives: Collectives,
    *,
    keep_values: bool = False,
    whole: Callable[[str, Sharding], V] | None = None,
    reduce_after: Callable[[MetaOp], Sequence[int] | None] | None = None,
) -> Interpretation[V]:
    """Walk ``plan`` over ``graph``: ``inputs`` are the local values of the graph inputs; ``whole(var, sh)``
    gives user input ``var``'s local value under ``sh`` where the plan reads it so without a collective;
    ``reduce_after(op)``: the dim permutation of an op that only permutes its input's dims, else None: its
    input's reduce may run after it (the module doc, :func:`late_reduces`)."""
    check_plan_ends(graph, plan, mesh)
    incoming, finals = plan.edge_index()
    late = late_reduces(graph, plan, incoming, mesh, reduce_after) if reduce_after is not None else {}
    env: dict[str, Any] = dict(inputs)
    shared: dict[tuple, Any] = {}
    result: Interpretation[V] = Interpretation({}, {})
    # the phases the plan was priced with (a micro-batch or stage part keeps its whole step's; none where the
    # frontend's lowering moves a value once for every phase), else the graph's
    phases = getattr(getattr(plan, "problem", None), "phases", None)
    if phases is None:
        phases = reader_phases(graph)

    def run(var: str, x: Any, edge: Any, shape: tuple[int, ...], dims: Mapping[int, int] | None = None) -> Any:
        for c in edge.collectives:
            fn = getattr(collectives, c.kind, None) if c.kind in COLLECTIVE_KINDS else None
            if fn is None:
                raise UnknownCollectiveError(c.kind, type(collectives).__name__)
            x = fn(x, c if dims is None else redimmed(c, dims), shape)
            result.collectives.append((var, c))
        return x

    def move(var: str, edge: Any) -> Any:
        x = env[var]
        if (
            edge is not None
            and not edge.collectives
            and edge.src_sharding != edge.dst_sharding
            and graph.vars[var].role == "input"
        ):
            if whole is None:
                raise PlanError(
                    f"the plan reads input {var!r} as {edge.dst_sharding} (stored {edge.src_sharding}) "
                    f"by slicing it whole, and this engine has no whole inputs: plan with "
                    f"whole_inputs=False"
                )
            key = ("whole", var, edge.dst_sharding)
            if key not in shared:
                shared[key] = whole(var, edge.dst_sharding)
            return shared[key]
        if edge is None or not edge.collectives:
            return x
        key = edge_key(var, edge.collectives, share_phase(phases, edge.dst, edge.src_sharding))
        if key in shared:
            return shared[key]
        x = run(var, x, edge, tuple(graph.vars[var].shape or ()))
        shared[key] = x
        return x

    state_of: dict[str, list[str]] = {}
    for s_in, s_out in graph.aliases.items():
        state_of.setdefault(s_out, []).append(s_in)
    for op in graph.ops:
        if op.id in late:  # the op on the Partial value, then its input's collectives on its result
            outs = list(run_op(op, [env[op.inputs[0]]], op_output_shardings(plan, op, mesh)))
            outs = [
                run(
                    op.inputs[0],
                    outs[0],
                    incoming[(op.id, 0)],
                    tuple(graph.vars[op.outputs[0]].shape or ()),
                    late[op.id],
                )
            ]
        else:
            ins = [move(v, incoming.get((op.id, slot))) for slot, v in enumerate(op.inputs)]
            outs = list(run_op(op, ins, op_output_shardings(plan, op, mesh)))
        if len(outs) != len(op.outputs):
            raise RuntimeError(f"op {op.id} ({op.key}) gave {len(outs)} outputs, the graph has {len(op.outputs)}")
        for v, x in zip(op.outputs, outs):
            env[v] = x
            if keep_values:
                result.values[v] = x
        for v in op.outputs:  # new state goes to its stored layout at once: it can be written back early
            for s_in in state_of.get(v, ()):
                result.state[s_in] = move(v, finals.get((v, s_in)))
    state_outs = set(graph.aliases.values())
    for o in graph.outputs:
        if o not in state_outs:
            result.outputs[o] = move(o, finals.get((o, OUTPUT)))
    for s_in, s_out in graph.aliases.items():
        if s_in not in result.state:  # state the step returns unchanged (an input)
            result.state[s_in] = move(s_out, finals.get((s_out, s_in)))
    result.state = {s_in: result.state[s_in] for s_in in graph.aliases}  # the aliases' order
    return result


__all__ = [
    "Collectives",
    "Interpretation",
    "OpRunner",
    "PlanError",
    "interpret",
    "edge_key",
    "op_output_shardings",
    "check_plan_ends",
    "late_reduces",
    "redimmed",
    "COLLECTIVE_KINDS",
    "OUTPUT",
]
