"""flax.nnx steps under metadist_compile on mesh (2, 4) of 8 virtual CPU devices, beside nnx.jit on one device.

Every step is written as flax documents it (objects updated in place, ``optimizer.update(model, grads)``).
After each call the losses agree and, at the end, every Variable of the objects (parameters, AdamW's
moments and counts, the optimizer's step, batch statistics, RNG keys and counters, metric totals) equals
nnx.jit's. Tolerance rtol 1e-5, atol 1e-6: the split program sums its matmuls and means in another order
than one device does (float32 rounding, ~1e-7 relative), and AdamW divides each update by the root of
the gradient's second moment, so an element whose gradient is near zero turns that rounding into a
visible share of its step: in the transformer one query-kernel element ends 1.2e-6 from nnx.jit's after
3 steps at learning rate 1e-3 (1.2e-5 at 1e-2: it scales with the step, not with the split).
Integer Variables (counts, steps, RNG counters) and the RNG keys are compared exactly.

A step that changes what its program cannot carry back is an error naming it: a plain attribute of a
Module, a new attribute holding an array, an argument that is not a pytree, a Python global.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

from metadist_core.ir.placement import Replicate, Shard, Sharding  # noqa: E402
from metadist_core.problem.constraints import Pin  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.effects import UncarriedChangeError  # noqa: E402

import _nnx_models as models  # noqa: E402

MESH = (2, 4)
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6


def _side_by_side(rule_cache, step_fn, make, batches, **compile_kw):
    """Two copies of ``make()``'s objects: one stepped by nnx.jit, one by metadist_compile; both losses."""
    ref_objs, md_objs = make(), make()
    ref = nnx.jit(step_fn)
    md = metadist_compile(step_fn, mesh=MESH, cache_dir=rule_cache, **compile_kw)
    ref_losses, md_losses = [], []
    for b in batches:
        ref_losses.append(ref(*ref_objs, b))
        md_losses.append(md(*md_objs, b))
    return md, (ref_objs, ref_losses), (md_objs, md_losses)


def _assert_same(ref_objs, md_objs):
    ref, got = models.leaves(*ref_objs), models.leaves(*md_objs)
    for (path, x), (_, y) in zip(ref, got):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=path)
    models.compare(ref, got, RTOL, ATOL)


def test_mlp_matches_nnx_jit(devices8, rule_cache):
    batches = [models.classify_batch(i) for i in range(STEPS)]
    md, (ref_objs, ref_l), (md_objs, md_l) = _side_by_side(
        rule_cache, models.train_step, lambda: models.with_optimizer(models.MLP(nnx.Rngs(0))), batches
    )
    np.testing.assert_allclose(np.asarray(md_l), np.asarray(ref_l), rtol=RTOL)
    _assert_same(ref_objs, md_objs)
    assert int(md_objs[1].step[...]) == STEPS
    # the values are named by argument and attribute, and the roles come from the Variable types
    roles = {v: md.graph.vars[v].role for v in md.graph.inputs}
    assert roles["model/hidden/kernel"] == "parameter"
    assert roles["optimizer/opt_state/0/mu/hidden/kernel"] == "optimizer_state"
    assert roles["batch/image"] == "input"
    assert len(md.cache) == 1  # one compile for the three calls
    # the updated objects are ordinary nnx objects: called eagerly they give one device's numbers
    x = batches[0]["image"]
    np.testing.assert_allclose(md_objs[0](x), ref_objs[0](x), rtol=RTOL, atol=ATOL)


@pytest.mark.slow  # a cold discovery of its attention (about 150 s of CPU); CI runs the MLP, BatchNorm and metrics
def test_transformer_matches_nnx_jit(devices8, rule_cache):
    batches = [models.token_batch(i) for i in range(STEPS)]
    md, (ref_objs, ref_l), (md_objs, md_l) = _side_by_side(
        rule_cache,
        models.train_step,
        lambda: models.with_optimizer(models.Transformer(nnx.Rngs(0))),
        batches,
        # the MLP's up-projection stored split on mesh axis 0, so that the split lowering is exercised whatever
        # the cost model prefers for a model this small; the rest is the solver's choice
        constraints=[Pin("model/block/up/kernel", Sharding([Shard(1), Replicate()]))],
    )
    np.testing.assert_allclose(np.asarray(md_l), np.asarray(ref_l), rtol=RTOL)
    _assert_same(ref_objs, md_objs)
    kernel = md_objs[0].block.up.kernel[...]
    assert not kernel.sharding.is_fully_replicated, str(md.plan)


def test_batch_norm_and_dropout_write_back(devices8, rule_cache):
    """Batch statistics and the dropout stream's counter come back as nnx.jit leaves them."""
    batches = [models.classify_batch(10 + i) for i in range(STEPS)]
    _, (ref_objs, ref_l), (md_objs, md_l) = _side_by_side(
        rule_cache,
        models.train_step,
        lambda: models.with_optimizer(models.NormDropMLP(nnx.Rngs(0, dropout=1))),
        batches,
    )
    np.testing.assert_allclose(np.asarray(md_l), np.asarray(ref_l), rtol=RTOL)
    _assert_same(ref_objs, md_objs)
    model = md_objs[0]
    assert int(model.drop.rngs.count[...]) == STEPS
    assert not np.allclose(np.asarray(model.norm.mean[...]), 0.0)


def test_documented_step_with_metrics(devices8, rule_cache):
    """flax's documented step: it returns nothing and updates a MultiMetric, the model and the optimizer."""

    def make():
        model, optimizer = models.with_optimizer(models.MLP(nnx.Rngs(0)))
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        return model, optimizer, metrics

    batches = [models.classify_batch(20 + i) for i in range(STEPS)]
    _, (ref_objs, _), (md_objs, md_out) = _side_by_side(rule_cache, models.documented_train_step, make, batches)
    assert md_out == [None] * STEPS
    _assert_same(ref_objs, md_objs)
    ref_m, md_m = ref_objs[2].compute(), md_objs[2].compute()
    assert md_m.keys() == ref_m.keys()
    for k in ref_m:
        np.testing.assert_allclose(float(md_m[k]), float(ref_m[k]), rtol=RTOL)


# --- what the compiled program cannot carry back: each an error naming it ------------------------------


class Counting(models.MLP):
    def __call__(self, x):
        self.calls += 1  # a plain Python int
        return super().__call__(x)


class Caching(models.MLP):
    def __call__(self, x):
        self.cache = x  # a new attribute holding a traced array
        return super().__call__(x)


def _compile_error(rule_cache, step_fn, *args) -> str:
    step = metadist_compile(step_fn, mesh=MESH, cache_dir=rule_cache)
    with pytest.raises(UncarriedChangeError) as info:
        step(*args)
    return str(info.value)


def test_plain_attribute_is_an_error(devices8, rule_cache):
    model = Counting(nnx.Rngs(0))
    model.calls = 0
    msg = _compile_error(rule_cache, models.train_step, *models.with_optimizer(model), models.classify_batch(0))
    assert "`model.calls`" in msg and "nnx.Variable" in msg, msg
    assert model.calls == 0


def test_new_array_attribute_is_an_error(devices8, rule_cache):
    model = Caching(nnx.Rngs(0))
    msg = _compile_error(rule_cache, models.train_step, *models.with_optimizer(model), models.classify_batch(0))
    assert "`model.cache`" in msg and "new attribute" in msg and "nnx.Variable" in msg, msg


class Logger:  # a plain Python object: no pytree
    def __init__(self) -> None:
        self.last = None


def test_non_pytree_argument_is_an_error(devices8, rule_cache):
    def step(model, optimizer, batch, log):
        log.last = models.train_step(model, optimizer, batch)

    args = (*models.with_optimizer(models.MLP(nnx.Rngs(0))), models.classify_batch(0), Logger())
    msg = _compile_error(rule_cache, step, *args)
    assert "`log`" in msg and "Logger" in msg and "pytree" in msg, msg


LOSSES: list = []


def test_python_global_is_an_error(devices8, rule_cache):
    def step(model, optimizer, batch):
        LOSSES.append(models.train_step(model, optimizer, batch))

    try:
        msg = _compile_error(
            rule_cache, step, *models.with_optimizer(models.MLP(nnx.Rngs(0))), models.classify_batch(0)
        )
    finally:
        LOSSES.clear()
    assert "`LOSSES`" in msg and "Return the value from the step" in msg, msg


def test_argument_changed_in_place_is_an_error(devices8, rule_cache):
    def step(model, optimizer, batch):
        batch["loss"] = models.train_step(model, optimizer, batch)

    batch = models.classify_batch(0)
    msg = _compile_error(rule_cache, step, *models.with_optimizer(models.MLP(nnx.Rngs(0))), batch)
    assert "in place" in msg and "Return the new value" in msg, msg
    assert "loss" not in batch
