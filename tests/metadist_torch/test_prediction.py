"""The torch lowering runs exactly the collectives the plan prices, and issues all_reduces early.

One process: the GPT example is traced, planned on a (2, 2) mesh (auto and the
ddp and tp presets) and lowered for every rank's coordinates without running
(no process group is needed to build a rank program).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import operator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from metadist_core.cost.buckets import bucketed_step  # noqa: E402
from metadist_core.config import load_settings  # noqa: E402
from metadist_core.plan.overlap import predict, priced_collectives  # noqa: E402
from metadist_core.driver.compile import plan_graph  # noqa: E402
from metadist_core.driver.frontend import FrontendTraits  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_torch.lower.lower import lower_plan  # noqa: E402
from metadist_torch.plugin import TorchFrontend  # noqa: E402
from metadist_torch.lower.schedule import is_async, is_done, is_gather_bucket  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traced():
    spec = importlib.util.spec_from_file_location("example_gpt", REPO / "examples" / "torch" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["example_gpt"] = gpt  # its dataclasses look their module up
    spec.loader.exec_module(gpt)
    cfg = gpt.GPTConfig(vocab=64, width=32, layers=1, heads=2, seq=8, batch=4)
    model, opt = gpt.build(cfg)
    fe = TorchFrontend()
    return fe, fe.trace(gpt.train_step, (model, opt, *gpt.batch(cfg, 0)), {})


@pytest.mark.parametrize(
    "strategy", ["auto", pytest.param("ddp", marks=pytest.mark.slow), pytest.param("tp", marks=pytest.mark.slow)]
)
def test_lowered_collectives_are_the_priced_ones(traced, strategy, tmp_path_factory):
    fe, tr = traced
    mesh = Mesh((2, 2), alpha=[2e-4, 2e-4], beta=[1e-9, 1e-9])
    s = load_settings(progress=False, strategy=strategy)
    res = plan_graph(tr.graph, mesh, settings=s, constraints=fe.constraints(tr.graph, mesh))
    plan = res.plan
    priced = [(v, c.kind, c.axis, c.nbytes) for v, c in priced_collectives(plan)]
    if strategy != "auto":
        assert priced, f"the {strategy} preset on (2, 2) should communicate"
    for coords in [(0, 0), (1, 1)]:
        rg = lower_plan(tr.graph, plan, mesh, coords=coords, groups=None, bucket_bytes=s.bucket_bytes)
        lowered = [(v, c.kind, c.axis, c.nbytes) for v, c in rg.collectives]
        assert sorted(lowered) == sorted(priced)
        # every async all_reduce sits right after the last value it reads (issued as early as possible)
        nodes = list(rg.gm.graph.nodes)
        for i, n in enumerate(nodes):
            if is_async(n):
                last = max(nodes.index(a) for a in n.all_input_nodes)
                between = [
                    m
                    for m in nodes[last + 1 : i]
                    if not is_async(m) and not (m.target is operator.getitem and is_async(m.args[0]))
                ]
                assert not between, f"{n.name} waits behind {[m.name for m in between]}"
            if is_done(n):  # waited for just before the first node that reads the value (behind other waits)
                j = i + 1
                while is_done(nodes[j]):
                    j += 1
                assert nodes[j] in n.users or any(nodes[j] in m.users for m in nodes[i + 1 : j]), (
                    f"{n.name} waits before {nodes[j].name}, which does not read it"
                )
    pr = predict(plan)
    assert pr.n_collectives == len(priced) and pr.comm_bytes == sum(b for *_, b in priced)
    assert pr.step >= pr.compute - 1e-12


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_lowered_gather_buckets_are_the_planned_ones(traced, mesh_shape):
    """Under the zero3 preset every parameter is all-gathered; with small gather buckets the lowering makes
    the buckets metadist_core.cost.gathers plans (same members, same order), and the prediction pays one
    collective per bucket."""
    from metadist_core.cost.gathers import gather_buckets, gathers

    fe, tr = traced
    mesh = Mesh(mesh_shape, alpha=[2e-4] * len(mesh_shape), beta=[1e-9] * len(mesh_shape))
    s = load_settings(progress=False, strategy="zero3", shard_bucket_mb=0.01)  # 10 KiB: several buckets
    res = plan_graph(
        tr.graph,
        mesh,
        settings=s,
        constraints=fe.constraints(tr.graph, mesh),
        traits=FrontendTraits(shard_buckets=True),
    )
    plan, problem = res.plan, res.problem
    assert problem.shard_bucket_bytes == s.shard_bucket_bytes
    planned = gather_buckets(problem, plan.choices)
    if len(mesh_shape) == 1:  # on (2, 2) zero3 shards a parameter over both axes: two gathers, not bucketed
        assert planned, "zero3 on the GPT example should gather its parameters in buckets"
    members = [g for g in gathers(problem, plan.choices)]
    assert all(sum(g.nbytes for g in b) <= s.shard_bucket_bytes for b in planned)
    assert sum(len(b) for b in planned) <= len(members)
    for coords in ([0], [1]) if len(mesh_shape) == 1 else ([0, 0], [1, 1]):
        rg = lower_plan(
            tr.graph,
            plan,
            mesh,
            coords=coords,
            groups=None,
            bucket_bytes=s.bucket_bytes,
            shard_bucket_bytes=s.shard_bucket_bytes,
        )
        assert rg.gather_buckets == [[g.var for g in b] for b in planned]
        # each bucket after the first is issued before the program waits for the one before it (prefetch)
        nodes = list(rg.gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        calls = [n for n in nodes if is_gather_bucket(n)]
        assert len(calls) == len(planned)
        for prev, nxt in zip(calls, calls[1:]):
            waits = [pos[d] for it in prev.users for d in it.users if is_done(d)]
            assert waits and pos[prev] < pos[nxt] < min(waits), (prev.name, nxt.name)
        lowered = [(v, c.kind, c.axis, c.nbytes) for v, c in rg.collectives]
        assert sorted(lowered) == sorted((v, c.kind, c.axis, c.nbytes) for v, c in priced_collectives(plan))
    unbucketed = predict(plan, dataclasses.replace(problem, shard_bucket_bytes=None))
    pr = predict(plan)
    assert pr.details["gather_buckets"] == len(planned)
    saved = sum((len(b) - 1) * (mesh.shape[b[0].axis] - 1) * mesh.alpha[b[0].axis] for b in planned)
    assert pr.comm == pytest.approx(unbucketed.comm - saved, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("first_mb", [0.004, 0.0])
def test_lowered_gradient_buckets_are_the_priced_ones(traced, first_mb):
    """Under the ddp preset with small buckets the lowering fills its all_reduce buckets in the order the
    backward makes the gradients, the first up to ``first_bucket_mb`` (as DDP's first bucket), and they
    are the buckets the prediction prices: same values, same grouping. The first bucket holds the
    earliest gradients, so its all_reduce can run while the rest of the backward computes."""
    fe, tr = traced
    mesh = Mesh((2,), alpha=[2e-4], beta=[1e-9])
    s = load_settings(progress=False, strategy="ddp", bucket_mb=0.016, first_bucket_mb=first_mb)
    res = plan_graph(tr.graph, mesh, settings=s, constraints=fe.constraints(tr.graph, mesh))
    plan, problem = res.plan, res.problem
    assert problem.first_bucket_bytes == (s.first_bucket_bytes if first_mb else s.bucket_bytes)
    priced = predict(plan).details["buckets"]
    grads = [v for b in priced for v in b]
    assert len(priced) >= 3, f"16 KiB buckets should split the example's gradients, got {priced}"
    rg = lower_plan(
        tr.graph,
        plan,
        mesh,
        coords=(0,),
        groups=None,
        bucket_bytes=s.bucket_bytes,
        first_bucket_bytes=problem.first_bucket_bytes,
    )
    assert rg.reduce_buckets == [b for b in priced if len(b) > 1]
    # another rank holds the plan as shared from rank 0, without its problem: the same buckets
    shared = type(plan).from_json(plan.to_json())
    assert shared.problem is None
    other = lower_plan(
        tr.graph,
        shared,
        mesh,
        coords=(1,),
        groups=None,
        bucket_bytes=s.bucket_bytes,
        first_bucket_bytes=problem.first_bucket_bytes,
    )
    assert other.reduce_buckets == rg.reduce_buckets
    nbytes = {v: c.nbytes for v, c in priced_collectives(plan) if c.kind == "all_reduce"}
    first_cap = s.first_bucket_bytes if first_mb else s.bucket_bytes
    for i, b in enumerate(priced):  # each bucket within its cap (a gradient larger than the cap: alone)
        assert sum(nbytes[v] for v in b) <= (first_cap if i == 0 else s.bucket_bytes) or len(b) == 1
    # the first bucket closed because the next gradient would overflow its cap: 4 KiB, or 16 KiB without one
    assert sum(nbytes[v] for v in priced[0]) + nbytes[priced[1][0]] > first_cap
    assert len(priced[0]) == (1 if first_mb else 4), priced[0]
    made = {v: i for i, op in enumerate(tr.graph.ops) for v in op.outputs}
    assert [made[v] for v in grads] == sorted(made[v] for v in grads), "buckets out of the backward's order"


def test_gradients_reduced_then_split_are_priced_in_the_lowerings_buckets(traced, traced_wide):
    """Where a reduce_scatter costs more than an all_reduce (gloo here: 8-11 ms against 4-5 ms on 4 ranks),
    a sharded layout makes a gradient's Partial -> Shard as an all_reduce and a free local split. The
    lowering buckets those all_reduces like any gradient's, so the prediction must too: it priced each
    alone, and MetaDist's zero3 layout of the GPT example was predicted at 223 ms against 33 ms measured."""
    fe, tr = traced_wide  # links cheap against compute, so that zero3 splits the batch and reduces gradients
    mesh = Mesh((2,), alpha=[1e-7], beta=[1e-12], links=[{"reduce_scatter": (1e-5, 1e-12)}])
    s = load_settings(progress=False, strategy="zero3", bucket_mb=0.016)
    res = plan_graph(tr.graph, mesh, settings=s, constraints=fe.constraints(tr.graph, mesh))
    plan, problem = res.plan, res.problem
    split = [v for v, c in priced_collectives(plan) if problem.vars[v].get("bucketed") and c.kind == "all_reduce"]
    assert len(split) >= 4, "zero3 under a dear reduce_scatter should all_reduce its gradients, then split them"
    assert not [c for _, c in priced_collectives(plan) if c.kind == "reduce_scatter"]
    pr = predict(plan)
    rg = lower_plan(
        tr.graph,
        plan,
        mesh,
        coords=(0,),
        groups=None,
        bucket_bytes=s.bucket_bytes,
        first_bucket_bytes=problem.first_bucket_bytes,
    )
    assert rg.reduce_buckets, "the lowering should bucket the gradients' all_reduces"
    assert rg.reduce_buckets == [b for b in pr.details["buckets"] if len(b) > 1]
    assert pr.n_buckets == len(pr.details["buckets"]) < len(split)


def test_a_gradient_reduced_over_two_axes_is_bucketed_as_the_lowering_buckets_it(traced):
    """On a (2, 2) mesh DDP's layout makes each gradient whole as a reduce_scatter on axis 0, an all_reduce on
    axis 1 and an all_gather on axis 0. Only the first reads the gradient itself, so only it can join a bucket
    (metadist_core.cost.buckets); the all_reduce reads that gradient's own reduce_scatter and runs alone. The
    solver charged it a bucket's share of the latency, which the lowering never runs."""
    fe, tr = traced
    mesh = Mesh((2, 2), alpha=[1e-5, 1e-5], beta=[1e-9, 1e-9])
    for shard_mb in (0.0, 0.016):  # the reduce_scatters on their own, then in buckets
        s = load_settings(progress=False, strategy="ddp", bucket_mb=0.016, shard_bucket_mb=shard_mb)
        res = plan_graph(
            tr.graph,
            mesh,
            settings=s,
            constraints=fe.constraints(tr.graph, mesh),
            traits=FrontendTraits(shard_buckets=True),
        )
        plan, problem = res.plan, res.problem
        chains = [
            e
            for e in plan.edges
            if problem.vars[e.var].get("bucketed") and len([c for c in e.collectives if not c.is_free]) > 1
        ]
        assert len(chains) >= 8, "ddp on (2, 2) should make each gradient whole in several steps"
        for e in chains:  # priced alone, at full latency, but the first when it can be bucketed
            first = bucketed_step(problem, e.var, e.collectives)
            assert first == (0 if shard_mb else None), (e.var, [str(c) for c in e.collectives])
            rest = sum(c.cost for c in e.collectives[1:])
            head = problem.price(e.var, e.collectives[:1])
            if first is None:
                assert head == pytest.approx(e.collectives[0].cost)
            else:  # a bucket's share of the latency (these gradients are far below the 16 KB cap)
                assert head < e.collectives[0].cost
            assert problem.price(e.var, e.collectives) == pytest.approx(head + rest)
        pr = predict(plan)
        rg = lower_plan(
            tr.graph,
            plan,
            mesh,
            coords=(0, 0),
            groups=None,
            bucket_bytes=s.bucket_bytes,
            shard_bucket_bytes=problem.shard_bucket_bytes or 0,
            first_bucket_bytes=problem.first_bucket_bytes,
        )
        assert rg.reduce_buckets == [b for b in pr.details["buckets"] if len(b) > 1]
        assert bool(rg.reduce_buckets) == bool(shard_mb), rg.reduce_buckets


def test_collectives_the_device_cannot_hide_slow_the_compute_beside_them(traced):
    """DeviceSpec.overlap: the part of an asynchronous collective's time the compute beside it hides. Where it
    is 0 (4 gloo ranks sharing 2 cores: measure_overlap found an all_reduce and compute together as slow as
    one after the other), DDP's and ZeRO-3's gradient buckets and prefetched gathers overlap nothing, and the
    step is its compute plus its communication; where it is 1 the backward hides them."""
    fe, tr = traced
    mesh = Mesh((2,), alpha=[1e-6], beta=[1e-11])  # links cheap against compute: there is compute to hide in
    for strategy in ("ddp", "zero3"):
        s = load_settings(
            progress=False, strategy=strategy, bucket_mb=0.004, first_bucket_mb=0.004, shard_bucket_mb=0.01
        )  # buckets that run during the backward
        res = plan_graph(
            tr.graph,
            mesh,
            settings=s,
            constraints=fe.constraints(tr.graph, mesh),
            traits=FrontendTraits(shard_buckets=True),
        )
        steps = {}
        for hidden in (0.0, 0.5, 1.0):
            problem = dataclasses.replace(res.problem, device=dataclasses.replace(res.problem.device, overlap=hidden))
            steps[hidden] = pr = predict(res.plan, problem)
            assert pr.comm > 0
        serial = steps[0.0].compute + steps[0.0].comm
        assert steps[0.0].step == pytest.approx(serial, rel=1e-9), strategy
        assert steps[1.0].step < steps[0.5].step < serial, strategy


@pytest.mark.parametrize("strategy,shape", [("tp", (2,)), ("tp+dp", (2, 2))])
def test_tensor_parallel_presets_never_move_a_weight(traced, strategy, shape):
    """Megatron keeps each weight where the preset put it: no collective moves a parameter or a transpose or
    view of one (the row-parallel Linears take their bias as a partial sum). Pinning the stored weights
    alone let the solver gather them and split the batch instead: ZeRO-3's program priced as "tp"."""
    fe, tr = traced
    g = tr.graph
    mesh = Mesh(shape, alpha=[2e-4] * len(shape), beta=[1e-9] * len(shape))
    res = plan_graph(
        g, mesh, settings=load_settings(progress=False, strategy=strategy), constraints=fe.constraints(g, mesh)
    )
    weights = {v for v in g.inputs if g.vars[v].role == "parameter" and g.vars[v].ndim == 2}
    for op in g.ops:  # what the matmuls read: transposes and views of a weight
        if op.key.split(".")[1] in ("t", "transpose", "view", "_unsafe_view") and op.inputs[0] in weights:
            weights.update(op.outputs)
    moved = sorted(
        {g.vars[e.var].label or e.var for e, c in res.plan.collectives() if not c.is_free and e.var in weights}
    )
    assert not moved, f"{strategy} moves weights: {moved}"
    assert any(c.kind == "all_reduce" and not c.is_free for _, c in res.plan.collectives())


@pytest.fixture(scope="module")
def traced_wide():
    """The GPT example with logits large enough (vocabulary 512) that the loss is computed split."""
    gpt = sys.modules["example_gpt"]
    cfg = gpt.GPTConfig(vocab=512, width=32, layers=1, heads=2, seq=16, batch=8)
    model, opt = gpt.build(cfg)
    fe = TorchFrontend()
    return fe, fe.trace(gpt.train_step, (model, opt, *gpt.batch(cfg, 0)), {})


def test_the_loss_syncs_once_at_the_end(traced, traced_wide):
    """The exact mean loss all_reduces the summed loss (and, where the targets are split, their count). With
    the whole batch on every rank (torch: ``whole_inputs``) an input read in another layout is sliced from it:
    no collective on any input, and never more collectives than without. A scalar whose input comes from the
    step's inputs alone (the count) is issued before the forward's first matmul; the loss's all_reduce, read
    only by the step's result, is waited for after every collective is issued, not between the forward and
    the backward. Lowered = priced in both."""
    from metadist_torch.lower.coalesce import VAR_META

    fe, tr = traced_wide
    mesh = Mesh((2,))
    s = load_settings(progress=False, strategy="ddp")
    count = {}
    for whole in (True, False):
        plan = plan_graph(
            tr.graph,
            mesh,
            settings=s,
            constraints=fe.constraints(tr.graph, mesh),
            traits=FrontendTraits(whole_inputs=whole),
        ).plan
        priced = [(v, c.kind, c.axis, c.nbytes) for v, c in priced_collectives(plan)]
        count[whole] = len(priced)
        if whole:
            assert not [p for p in priced if tr.graph.vars[p[0]].role == "input"], priced
        rg = lower_plan(tr.graph, plan, mesh, coords=(1,), groups=None, bucket_bytes=s.bucket_bytes)
        assert sorted((v, c.kind, c.axis, c.nbytes) for v, c in rg.collectives) == sorted(priced)
        nodes = list(rg.gm.graph.nodes)
        scalar = [
            n
            for n in nodes
            if is_async(n)
            and n.meta.get(VAR_META) in tr.graph.vars  # (not a bucket)
            and tr.graph.vars[n.meta[VAR_META]].numel == 1
        ]
        assert scalar, "the mean loss is summed over the ranks"
        first_mm = next(i for i, n in enumerate(nodes) if n.op == "call_function" and "mm" in str(n.target))
        for n in scalar:
            if nodes.index(n) < first_mm:
                continue  # from the inputs alone: hoisted
            done = next(u for u in n.users if is_done(u))
            assert all(nodes.index(done) > nodes.index(m) for m in nodes if is_async(m)), f"{n.name} waits mid-step"
    assert count[True] <= count[False]
