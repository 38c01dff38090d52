"""The example models, loaded from examples/jax by path, and a side-by-side runner."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "jax"


def load_example(name: str):
    mod_name = f"metadist_example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def mlp_case():
    """The MLP example at its test sizes with optax adam: (module, optimizer, params, state, batch)."""
    import jax
    import optax

    mlp = load_example("mlp")
    opt = optax.adam(1e-3)
    params = mlp.init_params(jax.random.key(0), mlp.TEST_SIZES)
    return mlp, opt, params, opt.init(params), mlp.make_batch(0, **mlp.TEST_BATCH)


def side_by_side(step_fn, compiled, params, opt_state, batches):
    """Run the single-device jitted step and the compiled step on the same batches; both trajectories."""
    import jax

    ref = jax.jit(step_fn)
    pr, sr, pm, sm = params, opt_state, params, opt_state
    losses_ref, losses_md = [], []
    for b in batches:
        lr, pr, sr = ref(pr, sr, b)
        lm, pm, sm = compiled(pm, sm, b)
        losses_ref.append(float(lr))
        losses_md.append(float(lm))
    return (np.asarray(losses_ref), pr, sr), (np.asarray(losses_md), pm, sm)


def assert_trees_close(a, b, rtol=1e-4, atol=1e-6):
    import jax

    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb = jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for (path, x), y in zip(la, lb):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=f"leaf {jax.tree_util.keystr(path)}"
        )
