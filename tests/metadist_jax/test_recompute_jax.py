"""Activation recomputation through the JAX frontend: under a budget only recomputation meets, the flax
transformer's compiled step (mesh (8,), 8 virtual devices) recomputes and keeps the single-device numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.config import load_settings  # noqa: E402
from metadist_core.driver.compile import plan_graph  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.levers.recompute import RecomputeBudgetError  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.plugin import JaxFrontend  # noqa: E402

from _jax_models import assert_trees_close, load_example, side_by_side  # noqa: E402


@pytest.mark.slow
def test_flax_transformer_recomputes_with_single_device_numbers(devices8, rule_cache):
    T = load_example("transformer")
    # activations must outweigh the gathered parameters for recomputation to lower the peak: with the
    # test config's 8 tokens the collectives' buffers make every recomputing plan heavier than the leanest
    # plan without it (measured: 93,749 against 102,970 bytes per device)
    cfg = dataclasses.replace(T.TEST_CONFIG, seq=32)
    model, params = T.init(cfg)
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    step_fn = T.make_step(model, opt)
    batches = [T.make_batch(i, cfg, batch=16) for i in range(3)]
    fe = JaxFrontend()
    graph = fe.trace(step_fn, (params, opt_state, batches[0]), {}).graph
    with pytest.raises(RecomputeBudgetError) as e:  # priced as the compile prices it: the JAX lowering's buffers
        plan_graph(graph, Mesh((8,)), settings=load_settings(memory_budget=1, cache_dir=rule_cache), traits=fe.traits)
    without, lean = e.value.without, e.value.with_recompute
    assert without > lean > 0, (without, lean)
    # both figures are the solver's leanest plans measured with their buffers, upper bounds of the least
    # peak (another solve can land a few % off): a budget near the one without recomputation
    budget = without - (without - lean) // 5
    step = metadist_compile(step_fn, mesh=(8,), cache_dir=rule_cache, memory_budget=budget)
    (lr, pr, sr), (lm, pm, sm) = side_by_side(step_fn, step, params, opt_state, batches)
    assert step.plan.recompute, f"no recomputation under {budget:,} bytes (leanest without: {without:,})"
    assert step.plan.memory_per_device <= budget
    assert sum(op.id.endswith("@rc") for op in step.graph.ops) == len(step.plan.recompute)  # the graph that ran
    np.testing.assert_allclose(lm, lr, rtol=1e-4)
    # Adam divides each gradient by its own running size: a gradient near zero whose float32 sum runs in
    # another order moves its weight by a visible part of the learning rate (1e-3); measured 3.4e-5 on
    # one element of 4,096 after 3 steps
    assert_trees_close(pr, pm, atol=5e-5)
    assert_trees_close(sr, sm, atol=1e-7)
