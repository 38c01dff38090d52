"""Pipeline stages in the core: the cut-point DP against brute force, the stages of a small training graph
(what each stage runs, owns, receives and sends), the checks, and the plan's record of its stages."""

from __future__ import annotations

import itertools
import random

import pytest

from metadist_core.ir.ir import MetaIR
from metadist_core.driver.pipeplan import check_stages
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.ir import forward_ops
from metadist_core.plan.stage import Stage, StageError, bubble_fraction
from metadist_core.levers.stages import best_cuts, brute_force_cuts, build_stages, crossing_bytes, evaluate_cuts


def mlp_step(layers: int = 4, b: int = 8, w: int = 4) -> MetaIR:
    """x -> (mm W_i, relu)*layers -> loss; backward ops reading forward values; SGD updates: a traced step's
    shape (tied weight: W0 is read again by the last layer)."""
    g = MetaIR("mlp")
    g.add_input("x", (b, w), "float32", "input")
    g.add_input("y", (b, w), "float32", "input")
    for i in range(layers):
        g.add_input(f"W{i}", (w, w), "float32", "parameter")
    h = "x"
    acts = []
    for i in range(layers):
        g.add_op("aten.mm.default", [h, f"W{i}"], [(f"m{i}", (b, w), "float32")], id=f"mm{i}")
        g.add_op("aten.relu.default", [f"m{i}"], [(f"h{i}", (b, w), "float32")], id=f"relu{i}")
        acts.append(h)
        h = f"h{i}"
    g.add_op("aten.full.default", [], [("one", (b, w), "float32")], id="full")
    g.add_op("aten.mm.default", [h, "W0"], [("tied", (b, w), "float32")], id="mm_tied")
    g.add_op("aten.sub.Tensor", ["tied", "y"], [("d", (b, w), "float32")], id="sub")
    g.add_op("aten.mul.Tensor", ["d", "one"], [("d1", (b, w), "float32")], id="mul")
    g.add_op("aten.sum.default", ["d1"], [("loss", (), "float32")], id="loss")
    gr = "d"
    for i in reversed(range(layers)):  # a stand-in backward: gradient of each W from its input and gr
        g.add_op("aten.mm.default", [acts[i], gr], [(f"gW{i}", (w, w), "float32")], id=f"bw{i}")
        g.add_op("aten.mul.Tensor", [gr, f"h{i}"], [(f"g{i}", (b, w), "float32")], id=f"bg{i}")
        gr = f"g{i}"
    for i in range(layers):
        g.add_op("aten.sub.Tensor", [f"W{i}", f"gW{i}"], [(f"W{i}_new", (w, w), "float32")], id=f"upd{i}")
    g.set_outputs(["loss"] + [f"W{i}_new" for i in range(layers)])
    for i in range(layers):
        g.alias(f"W{i}", f"W{i}_new")
    g.validate()
    return g


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("p", [2, 3, 4])
def test_dp_matches_brute_force_over_cut_points(seed, p):
    rnd = random.Random(seed * 10 + p)
    n = rnd.randint(p, 9)
    t = [rnd.uniform(0.1, 2.0) for _ in range(n)]
    cut = [0.0] + [rnd.uniform(0.0, 1.0) for _ in range(n - 1)] + [0.0]
    om = [rnd.uniform(0, 10) for _ in range(n)]
    am = [rnd.uniform(0, 5) for _ in range(n)]
    for budget in (None, rnd.uniform(15, 40)):
        for sched in ("1f1b", "gpipe"):
            kw = dict(op_memory=om, act_memory=am, budget=budget, schedule=sched)
            dp = best_cuts(t, cut, p, 4, **kw)
            bf = brute_force_cuts(t, cut, p, 4, **kw)
            assert (dp is None) == (bf is None)
            if dp is None:
                continue
            assert dp.bottleneck == pytest.approx(bf.bottleneck)
            assert sum(dp.stage_times) == pytest.approx(sum(bf.stage_times))
            again = evaluate_cuts(t, cut, dp.cuts, 4, **kw)  # the DP's own figures are those of its cuts
            assert again.bottleneck == pytest.approx(dp.bottleneck)
            assert dp.step_time == pytest.approx((4 + p - 1) * dp.bottleneck)
            if budget is not None:
                assert max(dp.stage_memory) <= budget


def test_a_budget_no_cut_meets_gives_none_and_gpipe_keeps_more_in_flight():
    t, cut = [1.0] * 4, [0.0] * 5
    assert best_cuts(t, cut, 2, 4, op_memory=[10] * 4, budget=15) is None
    one = best_cuts(t, cut, 2, 4, act_memory=[1] * 4, schedule="1f1b")
    gp = best_cuts(t, cut, 2, 4, act_memory=[1] * 4, schedule="gpipe")
    assert one.stage_memory == [4, 2]  # 1F1B: stage s holds min(m, p - s) micro-batches
    assert gp.stage_memory == [8, 8]  # GPipe: all m
    assert bubble_fraction(4, 2) == pytest.approx(1 / 5)


def test_stages_of_a_training_graph():
    g = mlp_step()
    ops = forward_ops(g)
    assert "bw0" not in ops and "upd0" not in ops and {"mm0", "loss", "full"} <= set(ops)
    core = [i for i in ops if i != "full"]
    n = len(core)
    cross = crossing_bytes(g, ops)
    for cuts in itertools.combinations(range(1, n), 2):
        stages = build_stages(g, ops, list(cuts))
        assert [s.index for s in stages] == [0, 1, 2]
        ran = [i for s in stages for i in s.ops if i != "full"]
        assert ran == core  # contiguous, each op once (free ops aside)
        assert stages[0].inputs == ["x", "y"]  # the batch enters stage 0
        assert stages[-1].outputs == ["loss"]
        for a, b in zip(stages, stages[1:]):
            assert a.outputs == b.inputs  # what one stage sends the next receives
            sent = sum(g.vars[v].nbytes for v in a.outputs)
            assert sent == cross[cuts[a.index]]  # the DP's price of the cut is what is sent
        owned = [p for s in stages for p in s.params]
        assert sorted(owned) == ["W0", "W1", "W2", "W3"]  # each parameter lives in one stage
        assert "W0" in stages[0].params
        last = stages[-1]
        if "mm_tied" in last.ops and "mm0" not in last.ops:
            assert "W0" in last.inputs  # a tied weight travels like an activation
        for s in stages:  # every value a stage reads is there
            have = set(s.inputs) | set(s.params) | {o for i in s.ops for o in g.op(i).outputs}
            need = {v for i in s.ops for v in g.op(i).inputs}
            assert need <= have, (cuts, s.index, need - have)


def test_bad_combinations_are_clear_errors():
    g = mlp_step(layers=1)
    ops = forward_ops(g)
    n = len([i for i in ops if i != "full"])
    with pytest.raises(StageError, match=rf"pipeline_stages={n + 1} needs at least {n + 1} forward ops.*has {n}"):
        build_stages(g, ops, list(range(1, n + 1)))
    with pytest.raises(StageError, match=r"pipeline_stages=3 puts the stages on mesh axis 0, which has 4 devices"):
        check_stages(3, Mesh((4,)), "1f1b")
    with pytest.raises(StageError, match="pipeline_stages=2"):
        check_stages(2, Mesh((4, 2)), "gpipe")
    with pytest.raises(StageError, match=r"micro_batches=1 < pipeline_stages=2; use micro_batches >= 2"):
        check_stages(2, Mesh((2, 2)), "1f1b")
    check_stages(2, Mesh((2, 2)), "1f1b", micro_batches=2)
    check_stages(2, Mesh((2, 2)), "gpipe", micro_batches=1)


def test_plan_records_its_stages_in_json_and_str():
    from metadist_core.driver.compile import replicated_plan
    from metadist_core.plan.plan import ShardingPlan

    g = mlp_step()
    plan, _ = replicated_plan(g, Mesh((1,)))
    assert plan.stages == []
    plan.stages = build_stages(g, forward_ops(g), [3, 6])
    plan.stats.pipeline = {"schedule": "gpipe", "micro_batches": 4}
    back = ShardingPlan.from_json(plan.to_json())
    assert [s.to_json() for s in back.stages] == [s.to_json() for s in plan.stages]
    assert isinstance(back.stages[0], Stage)
    text = str(back)
    assert "pipeline: 3 stages along mesh axis 0, schedule gpipe, 4 micro-batches" in text
    assert "stage 2 on devices" in text
