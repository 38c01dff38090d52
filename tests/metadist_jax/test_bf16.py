"""bf16 in a JAX step: bf16 compute on float32 parameters, and bf16 parameters and optimizer state.

The compiled step on 8 virtual CPU devices matches the single-device jitted
step within bf16 tolerance over 3 steps, with the plan really splitting it.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

from metadist_jax import metadist_compile  # noqa: E402

from _jax_models import load_example, side_by_side  # noqa: E402

BF16_TOL = 2e-2
SIZES = (32, 256, 256, 16)


def bf16_compute_loss(params, x, y):
    """float32 master weights, bf16 matmuls (as flax's ``dtype=jnp.bfloat16``), float32 loss."""
    h = x.astype(jnp.bfloat16)
    n = len(params)
    for i in range(n):
        w, b = params[f"layer{i}"]["w"].astype(jnp.bfloat16), params[f"layer{i}"]["b"].astype(jnp.bfloat16)
        h = h @ w + b
        if i < n - 1:
            h = jax.nn.relu(h)
    logp = jax.nn.log_softmax(h.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def assert_mostly_close(ref, got, rtol=BF16_TOL, atol=2e-4, share=0.01):
    """Every leaf within bf16 tolerance but for at most ``share`` of its elements.

    Adam moves each weight by about ``lr`` whatever the gradient's size, so a
    gradient near zero that bf16 rounds to the other sign moves a weight by
    ``2 lr`` the other way: a few such elements are bf16's, a wrong plan
    changes most of them.
    """
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree_util.tree_leaves(got)):
        a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
        bad = ~np.isclose(b, a, rtol=rtol, atol=atol)
        assert bad.mean() <= share, f"leaf {jax.tree_util.keystr(path)}: {bad.sum()} of {bad.size} elements differ"


def make_step(loss_fn, optimizer):
    def train_step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def _run(step_fn, params, mesh, rule_cache, opt):
    opt_state = opt.init(params)
    step = metadist_compile(step_fn, mesh=mesh, cache_dir=rule_cache)
    mlp = load_example("mlp")
    batches = [mlp.make_batch(i, **mlp.TEST_BATCH) for i in range(3)]
    return step, side_by_side(step_fn, step, params, opt_state, batches)


@pytest.mark.parametrize(
    "mesh", [(8,), pytest.param((2, 4), marks=pytest.mark.slow)], ids=lambda m: "x".join(map(str, m))
)
def test_bf16_compute_matches_single_device(devices8, rule_cache, mesh):
    mlp = load_example("mlp")
    opt = optax.adam(1e-3)
    params = mlp.init_params(jax.random.key(0), SIZES)
    step, ((lr, pr, sr), (lm, pm, sm)) = _run(make_step(bf16_compute_loss, opt), params, mesh, rule_cache, opt)
    np.testing.assert_allclose(lm, lr, rtol=BF16_TOL)
    assert_mostly_close(pr, pm)
    assert "bfloat16" in {v.dtype for v in step.graph.vars.values()}
    assert any(not c.is_free for _, c in step.plan.collectives()), step.plan.summary()


def test_bf16_parameters_and_state_match_single_device(devices8, rule_cache):
    mlp = load_example("mlp")
    opt = optax.adam(1e-3)
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), mlp.init_params(jax.random.key(0), SIZES))
    step, ((lr, pr, sr), (lm, pm, sm)) = _run(make_step(mlp.loss_fn, opt), params, (8,), rule_cache, opt)
    np.testing.assert_allclose(lm, lr, rtol=BF16_TOL)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree_util.tree_leaves(pm))
    assert_mostly_close(pr, pm)
    big = max(
        (v for v in step.graph.inputs if step.graph.vars[v].role == "parameter"), key=lambda v: step.graph.vars[v].numel
    )
    assert step.graph.vars[big].dtype == "bfloat16"
