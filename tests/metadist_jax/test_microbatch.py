"""micro_batches for JAX on 8 virtual CPU devices: the batch cut into equal parts inside one shard_map gives
the single-device whole-batch step's loss, parameters and optimizer state over 3 steps (rtol 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.levers.microbatch import MicroBatchError  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402

from _jax_models import assert_trees_close, load_example, side_by_side  # noqa: E402

STEPS = 3


@pytest.mark.parametrize(
    "mesh,m", [((8,), 4), pytest.param((2, 4), 2, marks=pytest.mark.slow)], ids=["8-mb4", "2x4-mb2"]
)
def test_mlp_micro_batches_match_the_whole_batch(devices8, rule_cache, mesh, m):
    mlp = load_example("mlp")
    opt = optax.adam(1e-3)
    params = mlp.init_params(jax.random.key(0), mlp.TEST_SIZES)
    opt_state = opt.init(params)
    step_fn = mlp.make_step(opt)
    step = metadist_compile(step_fn, mesh=mesh, cache_dir=rule_cache, micro_batches=m)
    batches = [mlp.make_batch(i, **{**mlp.TEST_BATCH, "batch": 64}) for i in range(STEPS)]
    (lr, pr, sr), (lm, pm, sm) = side_by_side(step_fn, step, params, opt_state, batches)
    np.testing.assert_allclose(lm, lr, rtol=1e-4)
    # atol 1e-5 (params are ~0.1): the micro-batch sums add in another order, and Adam turns the rounding of a
    # gradient element near zero into a step of up to lr
    assert_trees_close(pr, pm, atol=1e-5)
    assert_trees_close(sr, sm, atol=1e-5)
    # the plan was made for one micro-batch
    batch_in = [v for v in step.graph.inputs if step.graph.vars[v].role == "input"]
    assert step.graph.vars[batch_in[0]].shape[0] == 64 // m


def test_batch_that_micro_batches_does_not_divide_is_a_clear_error(devices8, rule_cache):
    mlp = load_example("mlp")
    opt = optax.sgd(1e-2)
    params = mlp.init_params(jax.random.key(0), mlp.TEST_SIZES)
    step = metadist_compile(mlp.make_step(opt), mesh=(8,), cache_dir=rule_cache, micro_batches=3)
    with pytest.raises(MicroBatchError, match=r"batch of 32 .* micro_batches=3"):
        step(params, opt.init(params), mlp.make_batch(0, **mlp.TEST_BATCH))
