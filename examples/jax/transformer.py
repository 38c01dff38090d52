"""A small decoder-only transformer in flax (linen), trained with optax adam and parallelized by MetaDist.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/jax/transformer.py --mesh 2x4

`metadist_compile` traces the whole step (forward, backward, adam), discovers
how every primitive splits, solves for the cheapest plan on the mesh and runs
it under jax.shard_map with the plan's collectives.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    width: int = 64
    heads: int = 4
    layers: int = 2
    hidden: int = 256
    seq: int = 16


# the size the tests use on a 2-core machine
TEST_CONFIG = Config(vocab=64, width=32, heads=2, layers=1, hidden=128, seq=8)


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        b, t, _ = x.shape
        h = nn.LayerNorm(name="ln1")(x)
        qkv = nn.Dense(3 * c.width, use_bias=False, name="qkv")(
            h
        )  # a k bias gets no gradient: adam would amplify rounding noise
        q, k, v = jnp.split(qkv.reshape(b, t, 3, c.heads, c.width // c.heads), 3, axis=2)
        q, k, v = (a[:, :, 0] for a in (q, k, v))  # (b, t, heads, head_dim)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.width // c.heads)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, c.width)
        x = x + nn.Dense(c.width, name="proj")(y)
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(c.width, name="down")(nn.gelu(nn.Dense(c.hidden, name="up")(h)))
        return x + h


class Transformer(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        x = nn.Embed(c.vocab, c.width, name="embed")(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (c.seq, c.width))[None, : tokens.shape[1]]
        for i in range(c.layers):
            x = Block(c, name=f"block{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(c.vocab, name="head")(x)


def make_step(model: Transformer, optimizer: optax.GradientTransformation):
    """The pure training step: next-token cross-entropy, adam update."""

    def loss_fn(params, tokens, targets):
        logits = model.apply(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def train_step(params, opt_state, batch):
        tokens, targets = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def make_batch(seed: int, cfg: Config, batch: int = 8):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, size=(batch, cfg.seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def init(cfg: Config, seed: int = 0):
    model = Transformer(cfg)
    params = model.init(jax.random.key(seed), jnp.zeros((1, cfg.seq), jnp.int32))
    return model, params


def main(argv=None) -> None:
    from metadist_jax import metadist_compile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None, help="mesh shape such as 8 or 2x4 (default: all devices)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--solver", default=None)
    args = ap.parse_args(argv)
    mesh = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else None

    cfg = Config()
    model, params = init(cfg)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)
    step = metadist_compile(make_step(model, optimizer), mesh=mesh, solver=args.solver)
    for i in range(args.steps):
        loss, params, opt_state = step(params, opt_state, make_batch(i, cfg))
        print(f"step {i}: loss {float(loss):.5f}")
    print(step.plan.summary())
    print("compile: " + ", ".join(f"{k} {v:.2f} s" for k, v in step.timings.items()))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if leaf.size >= 4096:
            print(f"{jax.tree_util.keystr(path)}: {leaf.shape} as {leaf.sharding.spec}")


if __name__ == "__main__":
    main()
