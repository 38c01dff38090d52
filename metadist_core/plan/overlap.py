"""What a plan costs as the lowering runs it: one reshard per value and target, whole buckets, overlap.

The solver's objective (``ShardingPlan.objective``) is a sum of per-op and
per-value prices that an ILP can optimise. :func:`predict` replays the plan the
way every lowering runs it and gives the step time the benchmarks print beside
the measured one:

- a reshard runs once per (value, target sharding, reader phase) however many
  ops read it (:func:`metadist_core.plan.interpret.interpret`, :mod:`metadist_core.cost.phases`);
- the all_reduces of gradient values (``vars[v]["bucketed"]``; of each reshard, the collective
  :func:`metadist_core.cost.buckets.bucketed_step` names, and the ones after it once its bucket is done) run in buckets of
  ``problem.bucket_bytes`` per (axis, reduce, dtype), filled in the order the gradients are made,
  the first of each up to ``problem.first_bucket_bytes`` (:func:`metadist_core.cost.gathers.bucket_cap`:
  it closes early, so its all_reduce overlaps the rest of the backward, as DDP's first bucket), their reduce_scatters in buckets
  of ``problem.shard_bucket_bytes``, one latency per bucket, a bucket issued when its
  last member is computed;
- all_reduces and reduce_scatters are issued as soon as their input exists and waited for just before
  their first reader (the torch lowering defers their wait), so they overlap with
  the compute in between: gradients with the rest of the backward, as DDP does.
  One collective runs at a time per mesh axis;
- an asynchronous collective (those above, and a prefetched bucket of gathers) slows the compute
  beside it by the part of its time the device does not hide (``problem.device.overlap``, measured
  on the live ranks: about 0 for gloo ranks sharing cores, whose collectives need those cores;
  1, the default, where the link has its own engine);
- the other collectives run where their first reader is, and the compute waits;
  the all_gathers of graph inputs run in buckets (:mod:`metadist_core.cost.gathers`),
  one collective per bucket, the first where its first member's reader is and each later one as
  the program waits for the one before (FSDP's prefetch), so that it overlaps those readers' compute.

:func:`priced_collectives` lists the collectives priced, one per (value, target, phase),
in the order the lowering issues them (kind, axis, bytes): the lowering's list
must be the same (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metadist_core.cost.buckets import bucket_key, bucketed_step
from metadist_core.cost.model import Collective, collective_cost
from metadist_core.cost.gathers import bucket_cap, gather_buckets
from metadist_core.cost.phases import reshard_key

OUTPUT = "<output>"


@dataclass
class Prediction:
    """Seconds of one step under the cost model, and how they split."""

    step: float  # wall time of the step: compute plus the communication it waits for
    compute: float  # sum of the ops' compute
    comm: float  # sum of the collectives' time (buckets: one latency each)
    exposed_comm: float  # the part of comm the compute waits for
    comm_bytes: int  # bytes the collectives move per device (per the cost model's buffers)
    n_collectives: int  # collectives as priced (before bucketing)
    n_buckets: int  # bucketed all_reduce calls
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "compute": self.compute,
            "comm": self.comm,
            "exposed_comm": self.exposed_comm,
            "comm_bytes": self.comm_bytes,
            "n_collectives": self.n_collectives,
            "n_buckets": self.n_buckets,
        }


def priced_collectives(plan: Any) -> list[tuple[str, Collective]]:
    """``(var, collective)`` for every non-free collective the plan prices, once per (value, target, reader
    phase), in the order the interpreter runs them (op order, then outputs, then state)."""
    out, seen = [], set()
    incoming, finals = plan.edge_index()
    problem = plan.problem
    phases = problem.phases if problem is not None else {}
    order = [n.id for n in problem.nodes if n.kind == "op"] if problem is not None else list(plan.op_strategies)
    by_dst: dict[str, list] = {}
    for (op, _slot), e in sorted(incoming.items(), key=lambda kv: kv[0][1]):
        by_dst.setdefault(op, []).append(e)
    edges = [e for op in order for e in by_dst.get(op, [])]
    edges += [e for (v, d), e in finals.items() if d == OUTPUT] + [e for (v, d), e in finals.items() if d != OUTPUT]
    for e in edges:
        key = reshard_key(e.var, e.src_sharding, e.dst_sharding, e.dst, phases)
        if not e.collectives or key in seen:
            continue
        seen.add(key)
        out += [(e.var, c) for c in e.collectives if not c.is_free]
    return out


def predict(plan: Any, problem: Any = None) -> Prediction:
    """Replay ``plan`` (with its problem: compute per option, mesh, buckets) as the lowering runs it."""
    problem = problem or plan.problem
    if problem is None:
        raise ValueError("predict needs the plan's ShardingProblem (plan.problem is None: pass problem=)")
    mesh = problem.mesh
    choice = plan.choices
    incoming, finals = plan.edge_index()
    comp_of = {n.id: float(problem.compute[i][choice[i]]) for i, n in enumerate(problem.nodes) if n.kind == "op"}
    bucket = problem.bucket_bytes
    t = 0.0  # the compute stream
    ready: dict[str, float] = {v: 0.0 for v in problem.outputs}  # value -> when its producer finished
    for _i, n in enumerate(problem.nodes):
        if n.kind == "input":
            ready[n.outputs[0]] = 0.0
    axis_free = [0.0] * mesh.ndim  # one collective at a time per mesh axis
    done: dict[tuple, float | None] = {}  # (var, src, dst, phase) -> when the moved value is there
    pending: dict[tuple, dict] = {}  # open gradient bucket per (axis, reduce, dtype)
    opened: dict[tuple, int] = {}  # buckets opened per (kind, axis, reduce, dtype)
    buckets: list[list[str]] = []  # the values of each bucket, as they run
    stats = {"compute": 0.0, "comm": 0.0, "bytes": 0, "n": 0, "buckets": 0, "gather_buckets": 0}

    hidden = min(1.0, max(0.0, float(getattr(getattr(problem, "device", None), "overlap", 1.0))))
    busy: list[tuple[float, float]] = []  # (start, end) of the asynchronous collectives not over yet

    idle = 0.0  # where the compute stream last stopped waiting

    def contend(start: float, end: float) -> None:
        """An asynchronous collective running from ``start`` to ``end``: compute at that time is slowed. One
        that started in the past (a gradient bucket found full only when the next gradient came) slowed the
        compute that ran since: that is charged now, and the rest of it runs that much later."""
        nonlocal t
        if hidden >= 1.0 or end <= start:
            return
        past = max(0.0, min(end, t) - max(start, idle))
        debt = (1.0 - hidden) * past
        if end > t:
            busy.append((t + debt, end + debt))
        t += debt

    def work(d: float) -> None:
        """Advance the compute stream by ``d`` seconds of compute: at full speed where no asynchronous
        collective runs, at ``hidden`` of it where one does (``DeviceSpec.overlap``: 0 where the
        collective needs the cores the compute runs on; time the compute waits costs nothing more)."""
        nonlocal t
        busy[:] = [b for b in busy if b[1] > t]
        for s, e in _union(busy):
            s = max(s, t)
            if s >= t + d:
                break
            d -= s - t  # full speed up to the collective
            if hidden > 0 and (e - s) * hidden >= d:
                t = s + d / hidden
                return
            d -= (e - s) * hidden
            t = e
        t += d

    def run_comm(c: Collective, start: float, asynchronous: bool = False) -> float:
        s = max(start, axis_free[c.axis])
        axis_free[c.axis] = s + c.cost
        stats["comm"] += c.cost
        if asynchronous:
            contend(s, s + c.cost)
        return s + c.cost

    caps = {"all_reduce": bucket, "reduce_scatter": getattr(problem, "shard_bucket_bytes", None)}

    def run_bucket(
        kind: str, axis: int, nbytes: int, start: float, members: list, counter: str, asynchronous: bool = True
    ) -> None:
        """One ``kind`` collective for a whole bucket on ``axis``: its members are there when it ends."""
        cost = collective_cost(kind, nbytes, mesh.shape[axis], *mesh.link(axis, kind))
        s = max(start, axis_free[axis])
        axis_free[axis] = s + cost
        stats["comm"] += cost
        stats[counter] += 1
        if asynchronous:
            contend(s, s + cost)
        for k in members:
            done[k] = s + cost

    def flush(key: tuple) -> None:
        b = pending.pop(key)
        run_bucket(key[0], key[1], b["bytes"], b["ready"], b["members"], "buckets")
        buckets.append(b["vars"])

    def issue(var: str, e: Any) -> None:
        """Issue the edge's collectives: a gradient all_reduce or reduce_scatter joins a bucket; others run now."""
        key = reshard_key(var, e.src_sharding, e.dst_sharding, e.dst, problem.phases)
        if key in done or key in pending_members:
            return
        colls = [c for c in e.collectives if not c.is_free]
        stats["n"] += len(colls)
        stats["bytes"] += sum(c.nbytes for c in colls)
        step = bucketed_step(problem, var, e.collectives)  # the one that joins a bucket (metadist_core.cost.buckets)
        if step is not None:
            c = e.collectives[step]
            rest = [x for x in e.collectives[step + 1 :] if not x.is_free]
            if rest:  # they read the bucket's result: they run once it is there (wait)
                after[key] = rest
            bk = bucket_key(problem, var, c)
            first = getattr(problem, "first_bucket_bytes", None) if c.kind == "all_reduce" else None
            if bk in pending and pending[bk]["bytes"] + c.nbytes > bucket_cap(caps[c.kind], first, opened[bk]):
                flush(bk)
            if bk not in pending:
                opened[bk] = opened.get(bk, 0) + 1
            b = pending.setdefault(bk, {"bytes": 0, "ready": 0.0, "members": [], "vars": []})
            b["vars"].append(var)
            b["bytes"] += c.nbytes
            b["ready"] = max(b["ready"], ready.get(var, 0.0))
            b["members"].append(key)
            pending_members[key] = bk
            return
        if all(c.kind in ("all_reduce", "reduce_scatter") for c in colls):  # deferred wait: issued at the producer
            at = ready.get(var, 0.0)
            for c in colls:
                at = run_comm(c, at, asynchronous=True)
            done[key] = at
        else:
            done[key] = None  # runs where its first reader is

    pending_members: dict[tuple, tuple] = {}
    after: dict[tuple, list] = {}  # the collectives of an edge after its bucketed one
    gather_seq = gather_buckets(problem, choice)  # metadist_core.cost.gathers, in the order the program runs them
    gather_of = {g.key: i for i, b in enumerate(gather_seq) for g in b}
    gathered: set[int] = set()

    def run_gathers(i: int) -> None:
        """Bucket ``i`` of input gathers where its first member's reader is (unless issued already), and
        bucket ``i + 1`` with it: the lowering issues the next bucket as this one is waited for
        (metadist_torch.lower.schedule.prefetch_gathers, FSDP's prefetch), so it runs while these ops compute."""
        for j in (i, i + 1):
            if j < len(gather_seq) and j not in gathered:
                gathered.add(j)
                members = gather_seq[j]
                run_bucket(
                    "all_gather",
                    members[0].axis,
                    sum(g.nbytes for g in members),
                    t,
                    [g.key for g in members],
                    "gather_buckets",
                    asynchronous=j > i,
                )

    def wait(var: str, e: Any) -> None:
        nonlocal t, idle
        if e is None or not e.collectives:
            return
        key = reshard_key(var, e.src_sharding, e.dst_sharding, e.dst, problem.phases)
        if key in pending_members:
            bk = pending_members.pop(key)
            if bk in pending:
                flush(bk)
        if key in after:  # async ones start as the bucket ends; the others where the reader is
            at = done[key]
            if at is None:  # its bucket ran (flushed above, or by a member waited for before)
                raise RuntimeError(f"the bucket of {key} has not run before its reader")
            for c in after.pop(key):
                early = c.kind in ("all_reduce", "reduce_scatter")
                at = run_comm(c, at if early else max(at, t), asynchronous=early)
            done[key] = at
        if key in gather_of:  # a bucket of input gathers, one collective (unless prefetched), and the next
            run_gathers(gather_of[key])
        at = done.get(key)
        if at is None:  # synchronous: the compute runs it
            at = t
            for c in e.collectives:
                if not c.is_free:
                    at = run_comm(c, at)
            done[key] = at
        if at > t:
            t = idle = at

    ops = [n for n in problem.nodes if n.kind == "op"]
    # the lowering issues each all_reduce right after its input exists: walk producers first
    readers: dict[str, list] = {}
    for e in incoming.values():
        readers.setdefault(e.var, []).append(e)
    for (v, _d), e in finals.items():
        readers.setdefault(v, []).append(e)
    for n in problem.nodes:
        if n.kind == "input":
            for e in readers.get(n.outputs[0], []):
                issue(e.var, e)
    for n in ops:
        for slot, v in enumerate(n.inputs):
            wait(v, incoming.get((n.id, slot)))
        work(comp_of[n.id])
        stats["compute"] += comp_of[n.id]
        for v in n.outputs:
            ready[v] = t
            for e in readers.get(v, []):
                issue(v, e)
    for (v, _d), e in finals.items():
        wait(v, e)
    for bk in list(pending):
        flush(bk)
    end = max([t] + axis_free)
    exposed = end - stats["compute"]  # what the compute waited, and the slowdown beside collectives
    return Prediction(
        end,
        stats["compute"],
        stats["comm"],
        exposed,
        int(stats["bytes"]),
        int(stats["n"]),
        int(stats["buckets"]),
        {"gather_buckets": stats["gather_buckets"], "buckets": buckets},
    )


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of time spans, as disjoint spans in order."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def buckets_latency(nbytes: list[int], bucket_bytes: int) -> int:
    """How many buckets the lowering makes of all_reduces of ``nbytes`` (in order) with ``bucket_bytes``."""
    count, cur = 0, None
    for b in nbytes:
        if cur is None or cur + b > bucket_bytes:
            count += 1
            cur = b
        else:
            cur += b
    return count if nbytes else 0


__all__ = ["Prediction", "predict", "priced_collectives", "buckets_latency"]
