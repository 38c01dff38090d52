"""Autotune on JAX: the plans are timed on the 8 devices, the fastest kept, and it gives one device's numbers."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from metadist_core.cost.profile import MeshProfile  # noqa: E402
from metadist_core.driver.autotune import MARGIN  # noqa: E402
from metadist_core.driver.frontend import Trials  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402

from _jax_models import assert_trees_close, mlp_case, side_by_side  # noqa: E402


def test_timed_plans_keep_the_fastest_and_the_single_device_numbers(devices8, rule_cache, monkeypatch):
    monkeypatch.setenv("METADIST_MEASURE_LINKS", "1")  # autotune runs with measured costs only
    mlp, opt, params, opt_state, _ = mlp_case()
    step_fn = mlp.make_step(opt)
    before = jax.tree.map(np.asarray, params)
    step = metadist_compile(step_fn, mesh=(8,), cache_dir=rule_cache, autotune=True)
    batches = [mlp.make_batch(i, **mlp.TEST_BATCH) for i in range(3)]
    (lr, pr, sr), (lm, pm, sm) = side_by_side(step_fn, step, params, opt_state, batches)

    fig = step.plan.stats.autotune
    got = {(c["strategy"], c["lowering"]): c for c in fig["candidates"]}
    plans = {name for name, _ in got}
    assert "auto" in plans and len(plans) >= 2, fig  # the solver's plan and at least one preset's differ
    assert {low for name, low in got if name == "auto"} == {"shard_map", "gspmd", "gspmd-io"}, fig
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in got.values())
    kept = got[(fig["chosen"], fig["lowering"])]["measured_ms"]
    first = got[("auto", "shard_map")]["measured_ms"]
    assert kept <= first  # never slower than the solver's plan, as timed
    if (fig["chosen"], fig["lowering"]) != ("auto", "shard_map"):
        assert kept < first * (1 - MARGIN)
        assert kept == min(c["measured_ms"] for c in got.values())
    assert step.plan.stats.strategy == fig["chosen"]
    assert "autotuned:" in str(step.plan)

    # the trials left the user's arguments alone, and the kept plan gives the single-device numbers
    assert_trees_close(before, jax.tree.map(np.asarray, params), rtol=0, atol=0)
    np.testing.assert_allclose(lm, lr, rtol=1e-4)
    assert_trees_close(pr, pm, atol=1e-5)
    assert_trees_close(sr, sm, atol=1e-5)


def test_the_lowerings_of_one_plan_share_its_placed_arguments(devices8, rule_cache):
    """Autotune holds one placed copy of the arguments per plan, not one per lowering (three here)."""
    mlp, opt, params, opt_state, batch = mlp_case()
    step = metadist_compile(mlp.make_step(opt), mesh=(8,), cache_dir=rule_cache, strategy="fsdp")
    step(params, opt_state, batch)
    res = step.last
    leaves = len(jax.tree.leaves((params, opt_state, batch)))
    before = len(jax.live_arrays())
    resolved = step.frontend.resolve_mesh(res.mesh, MeshProfile())
    trials = step.frontend.lower(
        res.traced, Trials(res.plan, (params, opt_state, batch), {}), resolved, step.settings
    ).trials
    assert [t.lowering for t in trials] == ["shard_map", "gspmd", "gspmd-io"]
    placed = len(jax.live_arrays()) - before
    assert leaves <= placed < 2 * leaves, (placed, leaves)
    for t in trials:
        t.run()
