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
    step(params, opt_state, batch)   # plans it
    plan, graph, ctx = step.plan, step.graph, step.last.traced.context
    sharded = [v for v, s in plan.input_shardings.items() if not s.is_fully_replicated()
               and graph.vars[v].role == "parameter"]
    assert sharded, str(plan)        # a plan that splits parameters, so that the layouts matter

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
