"""Small flax.nnx models and the training step as flax documents it, for tests/metadist_jax/test_nnx.py."""

from __future__ import annotations

import jax
import optax
from flax import nnx

VOCAB, WIDTH, HEADS, SEQ = 32, 32, 2, 8


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, sizes=(16, 64, 8)) -> None:
        self.hidden = nnx.Linear(sizes[0], sizes[1], rngs=rngs)
        self.out = nnx.Linear(sizes[1], sizes[2], rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


class NormDropMLP(nnx.Module):
    """An MLP with BatchNorm (batch statistics) and Dropout (its own RNG stream)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.norm(self.hidden(x)))))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        # no projection biases: the key bias gets no gradient (softmax ignores what is added to every key),
        # only rounding noise, which AdamW would turn into full-size steps of no meaning
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, use_bias=False, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    """A small decoder: embedding, one attention + MLP block with LayerNorms, a vocabulary head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.block = Block(rngs)
        self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        return self.head(self.ln(self.block(self.embed(tokens), mask)))


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def train_step(model, optimizer, batch):
    """Update the model in place; return the loss."""
    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return loss


def documented_train_step(model, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


def classify_batch(seed: int, batch: int = 16, features: int = 16, classes: int = 8) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "image": jax.random.normal(k1, (batch, features)),
        "label": jax.random.randint(k2, (batch,), 0, classes),
    }


def token_batch(seed: int, batch: int = 8) -> dict:
    tokens = jax.random.randint(jax.random.key(seed), (batch, SEQ + 1), 0, VOCAB)
    return {"image": tokens[:, :-1], "label": tokens[:, 1:]}


def with_optimizer(model: nnx.Module, lr: float = 1e-3) -> tuple:
    return model, nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)


def leaves(*objects) -> list:
    """Every Variable's value of ``objects``, by nnx path, as numpy-comparable arrays (keys as key data)."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(objects))[0]:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append((jax.tree_util.keystr(path), x))
    return out


def compare(a: list, b: list, rtol: float, atol: float) -> None:
    import numpy as np

    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=path)


__all__ = [
    "MLP",
    "NormDropMLP",
    "Transformer",
    "classify_batch",
    "compare",
    "documented_train_step",
    "leaves",
    "loss_fn",
    "token_batch",
    "train_step",
    "with_optimizer",
]
