"""The JAX frontend times its matmuls at a strategy's local shapes, every device of the mesh at once
(:mod:`metadist_jax.localtime`), for :mod:`metadist_core.localtime` to price them.

On a traced MLP step: the frontend takes its dot_generals and no elementwise op; timed on the 8 devices,
a matmul of a quarter of the rows takes less than the whole one and more than a tenth of it (the work is
a quarter; the rate of a kernel changes with its shape, not by 2.5x here), and the rates come back from
the same rounds.
"""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.placement import Mesh  # noqa: E402
from metadist_jax.plugin import JaxFrontend  # noqa: E402

from _jax_models import mlp_case  # noqa: E402


def test_matmuls_are_timed_at_their_local_shapes(devices8):
    mlp, opt, params, state, batch = mlp_case()
    fe = JaxFrontend()
    g = fe.trace(mlp.make_step(opt), (params, state, batch), {}).graph
    dots = [op for op in g.ops if fe.times_local(op)]
    assert dots and all(op.payload.name == "dot_general" for op in dots)
    assert not any(fe.times_local(op) for op in g.ops if op.payload is not None and op.payload.name == "add")
    m, k, n = 512, 256, 256
    op = next(o for o in dots if len([v for v in o.inputs if g.vars[v].is_tensor]) == 2)
    dims = op.payload.params["dimension_numbers"]
    assert dims == (((1,), (0,)), ((), ())), "the test needs a plain (m,k)@(k,n) matmul"
    reqs = [(op, ((m, k), (k, n)), ("float32", "float32")), (op, ((m // 4, k), (k, n)), ("float32", "float32")),
            (op, ((m, k), (k + 1, n)), ("float32", "float32"))]   # shapes a matmul refuses
    secs, rates = fe.local_op_times(reqs, Mesh((8,)))
    whole, quarter, refused = secs
    assert refused is None
    assert whole > 0 and quarter > 0
    assert whole / 10 < quarter < whole
    assert rates.peak_flops > 1e8 and rates.mem_bandwidth > 1e8
