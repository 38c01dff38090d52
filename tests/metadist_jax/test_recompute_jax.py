"""Activation recomputation through the JAX frontend: under a budget only recomputation meets, the flax
transformer's compiled step (mesh (8,), 8 virtual devices) recomputes and keeps the single-device numbers."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.config import load_settings  # noqa: E402
from metadist_core.pipeline import plan_graph  # noqa: E402
from metadist_core.placement import Mesh  # noqa: E402
from metadist_core.recompute import RecomputeBudgetError  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.plugin import JaxFrontend  # noqa: E402

from _jax_models import assert_trees_close, load_example, side_by_side  # noqa: E402


@pytest.mark.slow
def test_flax_transformer_recomputes_with_single_device_numbers(devices8, rule_cache):
    T = load_example("transformer")
    cfg = T.TEST_CONFIG
    model, params = T.init(cfg)
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    step_fn = T.make_step(model, opt)
    batches = [T.make_batch(i, cfg) for i in range(3)]
    graph = JaxFrontend().trace(step_fn, (params, opt_state, batches[0]), {}).graph
    with pytest.raises(RecomputeBudgetError) as e:
        plan_graph(graph, Mesh((8,)), settings=load_settings(memory_budget=1, cache_dir=rule_cache))
    without, lean = e.value.without, e.value.with_recompute
    assert without > lean > 0, (without, lean)
    budget = (without + lean) // 2
    step = metadist_compile(step_fn, mesh=(8,), cache_dir=rule_cache, memory_budget=budget)
    (lr, pr, sr), (lm, pm, sm) = side_by_side(step_fn, step, params, opt_state, batches)
    assert step.plan.recompute, f"no recomputation under {budget:,} bytes (leanest without: {without:,})"
    assert step.plan.memory_per_device <= budget
    assert sum(op.id.endswith("@rc") for op in step.graph.ops) == len(step.plan.recompute)   # the graph that ran
    np.testing.assert_allclose(lm, lr, rtol=1e-4)
    assert_trees_close(pr, pm)
    assert_trees_close(sr, sm, atol=1e-7)
