"""pipeline_stages for JAX: `metadist plan` prices the stages (plan-only mode, for any frontend); running a
pipelined JAX step is a clear "not yet for JAX" error, raised before any planning."""

from __future__ import annotations

import json

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.driver import planonly  # noqa: E402
from metadist_core.driver.frontend import NotSupported  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402

from _jax_models import mlp_case  # noqa: E402


def test_running_a_pipelined_jax_step_is_a_clear_error(devices8, rule_cache):
    mlp, opt, params, state, batch = mlp_case()
    step = metadist_compile(mlp.make_step(opt), mesh=(2, 4), cache_dir=rule_cache, pipeline_stages=2)
    with pytest.raises(NotSupported, match="pipeline_stages > 1 is not yet for the jax frontend"):
        step(params, state, batch)


def test_metadist_plan_prices_jax_stages(devices8, rule_cache, tmp_path, monkeypatch, capsys):
    mlp, opt, params, state, batch = mlp_case()
    out = tmp_path / "p.json"
    step = metadist_compile(mlp.make_step(opt), cache_dir=rule_cache, pipeline_stages=2, micro_batches=2)
    with planonly.plan_only(planonly.PlanOnly(mesh=(2, 4), out=str(out), cache_dir=str(rule_cache))):
        with pytest.raises(planonly.PlanOnlyDone):
            step(params, state, batch)
    text = capsys.readouterr().out
    assert "pipeline: 2 stages along mesh axis 0" in text
    plan = json.loads(out.read_text())
    assert [s["devices"] for s in plan["stages"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan["mesh_shape"] == [4]  # each stage planned on the other axis
    assert sum(len(s["params"]) for s in plan["stages"]) > 0
