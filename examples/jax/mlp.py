"""An MLP trained with optax adam, parallelized by MetaDist over every JAX device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/jax/mlp.py --mesh 2x4

The step is a pure function (params, opt_state, batch) -> (loss, params,
opt_state); `metadist_compile` wraps it in a `JaxStep`, which traces it,
finds how each op splits, picks the cheapest plan and runs it with explicit
collectives under jax.shard_map.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax


# the sizes the tests use (small enough for a 2-core machine, one weight of 256x256)
TEST_SIZES = (32, 256, 256, 16)
TEST_BATCH = {"batch": 32, "features": 32, "classes": 16}


def init_params(key: jax.Array, sizes=(64, 512, 512, 16)) -> dict:
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, k = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
            "b": jnp.zeros((b,), jnp.float32),
        }
    return params


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    n = len(params)
    for i in range(n):
        h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        if i < n - 1:
            h = jax.nn.relu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def make_step(optimizer: optax.GradientTransformation):
    """The pure training step: loss, new parameters and new optimizer state."""

    def train_step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def make_batch(seed: int, batch: int = 64, features: int = 64, classes: int = 16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, features)).astype(np.float32)
    y = rng.integers(0, classes, size=(batch,)).astype(np.int32)
    return x, y


def main(argv=None) -> None:
    from metadist_jax import metadist_compile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None, help="mesh shape such as 8 or 2x4 (default: all devices)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--solver", default=None)
    args = ap.parse_args(argv)
    mesh = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else None

    optimizer = optax.adam(1e-3)
    params = init_params(jax.random.key(0))
    opt_state = optimizer.init(params)
    step = metadist_compile(make_step(optimizer), mesh=mesh, solver=args.solver)
    for i in range(args.steps):
        loss, params, opt_state = step(params, opt_state, make_batch(i))
        print(f"step {i}: loss {float(loss):.5f}")
    print(step.plan)
    print("compile: " + ", ".join(f"{k} {v:.2f} s" for k, v in step.timings.items()))
    w = params["layer1"]["w"]
    print(f"layer1.w: {w.shape} stored as {w.sharding.spec} on mesh {dict(w.sharding.mesh.shape)}")


if __name__ == "__main__":
    main()
