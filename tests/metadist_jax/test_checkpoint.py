"""JAX checkpoints through orbax-checkpoint (installed with flax): state saved sharded on mesh (8,) by the
compiled step restores on one device (or any other sharding) and training resumes with the same numbers."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
ocp = pytest.importorskip("orbax.checkpoint")

from metadist_jax import metadist_compile  # noqa: E402

from _jax_models import assert_trees_close, load_example  # noqa: E402


def test_orbax_checkpoint_of_sharded_state_resumes_on_one_device(devices8, rule_cache, tmp_path):
    mlp = load_example("mlp")
    opt = optax.adam(1e-3)
    step_fn = mlp.make_step(opt)
    params = mlp.init_params(jax.random.key(0), mlp.TEST_SIZES)
    state = opt.init(params)
    step = metadist_compile(step_fn, mesh=(8,), cache_dir=rule_cache)
    batches = [mlp.make_batch(i, **mlp.TEST_BATCH) for i in range(4)]
    for b in batches[:2]:
        _, params, state = step(params, state, b)
    assert not params["layer1"]["w"].sharding.is_fully_replicated  # saved as shards
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), {"params": params, "opt_state": state}
    )
    with ocp.StandardCheckpointer() as ck:
        restored = ck.restore(tmp_path / "ckpt", target)
    ref = jax.jit(step_fn)
    p1, s1, p2, s2 = params, state, restored["params"], restored["opt_state"]
    for b in batches[2:]:
        l1, p1, s1 = step(p1, s1, b)  # the run that never stopped
        l2, p2, s2 = ref(p2, s2, b)  # resumed on one device
        np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
    assert_trees_close(p1, p2)
    assert_trees_close(s1, s2)
