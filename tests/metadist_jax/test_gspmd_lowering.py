"""A plan lowered through GSPMD (metadist_jax.gspmd) gives the single-device numbers and keeps the plan's
stored layouts, on meshes (8,) and (2, 4)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.gspmd import lower_gspmd  # noqa: E402
from metadist_jax.lower import LoweredStep  # noqa: E402

from _jax_models import assert_trees_close, mlp_case, side_by_side  # noqa: E402


@pytest.mark.parametrize("mesh, strategy", [((8,), "auto"), ((2, 4), "fsdp")], ids=["8-auto", "2x4-fsdp"])
def test_a_plan_through_gspmd_matches_one_device(devices8, rule_cache, mesh, strategy):
    mlp, opt, params, opt_state, batch = mlp_case()
    step_fn = mlp.make_step(opt)
    step = metadist_compile(step_fn, mesh=mesh, cache_dir=rule_cache, strategy=strategy)
    step(params, opt_state, batch)  # plans it
    plan, graph, ctx = step.plan, step.graph, step.last.traced.context
    sharded = [
        v for v, s in plan.input_shardings.items() if not s.is_fully_replicated() and graph.vars[v].role == "parameter"
    ]
    assert sharded, str(plan)  # a plan that splits parameters, so that the layouts matter

    run = LoweredStep(lower_gspmd(graph, plan, step.mesh, step.jax_mesh, ctx.output_ids), ctx)
    batches = [mlp.make_batch(i, **mlp.TEST_BATCH) for i in range(3)]
    (lr, pr, sr), (lm, pm, sm) = side_by_side(step_fn, run, params, opt_state, batches)
    np.testing.assert_allclose(lm, lr, rtol=1e-4)
    assert_trees_close(pr, pm, atol=1e-5)
    assert_trees_close(sr, sm, atol=1e-5)

    # the state comes back stored as the plan stores it, as from the shard_map lowering
    ins, _ = step.shardings()
    same = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), pm, ins[0][0])
    assert all(jax.tree.leaves(same)), same


def test_the_data_parallel_plan_held_at_its_ends_is_jax_jits_data_parallelism(devices8, rule_cache):
    """``gspmd-io`` on the ddp plan compiles to the program a user writes with jax.jit and data-parallel
    shardings: the same collectives (kind and bytes) and as many HLO instructions, with one device's numbers.

    At this size (the benchmark's width, one layer) holding the plan's split activations makes XLA split the
    embedding gradient by columns instead (an all_to_all and four all_gathers beside the all_reduce)."""
    import re

    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from _jax_models import load_example
    from metadist_jax.hlo import collectives

    tf = load_example("transformer")
    opt = optax.adam(1e-3)
    cfg = tf.Config(vocab=256, width=128, heads=4, layers=1, hidden=512, seq=32)
    model, params = tf.init(cfg)
    step_fn, opt_state = tf.make_step(model, opt), opt.init(params)
    batches = [tf.make_batch(i, cfg, batch=32) for i in range(2)]
    step = metadist_compile(step_fn, mesh=(8,), cache_dir=rule_cache, strategy="ddp")
    step(params, opt_state, batches[0])
    plan, graph, ctx = step.plan, step.graph, step.last.traced.context
    run = LoweredStep(lower_gspmd(graph, plan, step.mesh, step.jax_mesh, ctx.output_ids, hold_layouts=False), ctx)
    (lr, pr, _), (lm, pm, _) = side_by_side(step_fn, run, params, opt_state, batches)
    np.testing.assert_allclose(lm, lr, rtol=1e-4)
    assert_trees_close(pr, pm, atol=1e-5)

    rep, split = NamedSharding(step.jax_mesh, P()), NamedSharding(step.jax_mesh, P(tuple(step.jax_mesh.axis_names)))
    dp_in = (
        jax.tree.map(lambda _: rep, params),
        jax.tree.map(lambda _: rep, opt_state),
        jax.tree.map(lambda _: split, batches[0]),
    )
    hand = jax.jit(step_fn, in_shardings=dp_in, out_shardings=(rep, dp_in[0], dp_in[1]))
    hand_hlo = (
        hand.lower(*[jax.device_put(a, s) for a, s in zip((params, opt_state, batches[0]), dp_in)]).compile().as_text()
    )
    ours_hlo = run.compiled_text(params, opt_state, batches[0])

    def instructions(text: str) -> int:
        entry = text[text.index("ENTRY") :]
        return len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", entry, re.M))

    ours = sorted(collectives(ours_hlo))
    assert ours == sorted(collectives(hand_hlo)) and {kind for kind, _ in ours} == {"all_reduce"}, ours
    assert instructions(ours_hlo) == instructions(hand_hlo)
