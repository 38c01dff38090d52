"""TE graphs used by the TVM frontend tests, with their numpy references."""

from __future__ import annotations

import numpy as np
from tvm import te

from metadist_tvm import topi


def mlp(batch: int = 8, d_in: int = 16, hidden: int = 32, d_out: int = 8):
    """dense -> relu -> dense -> softmax: (placeholders, output)."""
    x = te.placeholder((batch, d_in), name="x")
    w1 = te.placeholder((hidden, d_in), name="w1")
    w2 = te.placeholder((d_out, hidden), name="w2")
    y = topi.nn.softmax(topi.nn.dense(topi.nn.relu(topi.nn.dense(x, w1)), w2))
    return [x, w1, w2], y


def mlp_ref(x, w1, w2):
    h = np.maximum(x @ w1.T, 0) @ w2.T
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def convnet(batch: int = 4, c_in: int = 4, c_out: int = 8, size: int = 8):
    """conv2d_nchw (3x3, pad 1) -> relu -> 2x2 max pool: (placeholders, output)."""
    x = te.placeholder((batch, c_in, size, size), name="x")
    w = te.placeholder((c_out, c_in, 3, 3), name="w")
    y = topi.nn.pool2d(topi.nn.relu(topi.nn.conv2d_nchw(x, w, 1, 1, 1)), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "max")
    return [x, w], y


def conv_ref(x, w):
    n, c, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd), dtype=np.float64)
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i : i + h, j : j + wd], w[:, :, i, j])
    r = np.maximum(out, 0)
    return r.reshape(n, w.shape[0], h // 2, 2, wd // 2, 2).max(axis=(3, 5))


def plain_mlp(batch: int = 8, d_in: int = 16, hidden: int = 32, d_out: int = 12):
    """Plain tvm.topi and te.compute, no wrappers: dense + bias -> relu -> constant-extent matmul -> softmax."""
    import tvm.topi as plain

    x = te.placeholder((batch, d_in), name="X")
    w1 = te.placeholder((hidden, d_in), name="W1")
    b1 = te.placeholder((hidden,), name="b1")
    w2 = te.placeholder((hidden, d_out), name="W2")
    h = plain.nn.relu(plain.add(plain.nn.dense(x, w1), b1))
    k = te.reduce_axis((0, hidden), name="k")
    m = te.compute((batch, d_out), lambda i, j: te.sum(h[i, k] * w2[k, j], axis=k), name="mm")
    return [x, w1, b1, w2], plain.nn.softmax(m)


def plain_mlp_ref(x, w1, b1, w2):
    h = np.maximum(x @ w1.T + b1, 0) @ w2
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def plain_convnet(batch: int = 4, c_in: int = 4, c_out: int = 8, size: int = 8):
    """convnet() from plain tvm.topi (its pad, conv, relu and pool computes are rebuilt one by one)."""
    import tvm.topi as plain

    x = te.placeholder((batch, c_in, size, size), name="x")
    w = te.placeholder((c_out, c_in, 3, 3), name="w")
    y = plain.nn.pool2d(plain.nn.relu(plain.nn.conv2d_nchw(x, w, 1, 1, 1)), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "max")
    return [x, w], y


def draw(placeholders, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([int(s) for s in p.shape]).astype(str(p.dtype)) for p in placeholders]
