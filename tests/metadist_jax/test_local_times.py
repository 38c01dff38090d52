"""The JAX frontend times its matmuls at a strategy's local shapes, every device of the mesh at once
(:mod:`metadist_jax.localtime`), for :mod:`metadist_core.cost.localtime` to price them.

On a traced MLP step: the frontend takes its dot_generals and no elementwise op; timed on the 8 devices,
a matmul of a quarter of the rows takes less than the whole one and more than a tenth of it (the work is
a quarter; the rate of a kernel changes with its shape, not by 2.5x here), and the rates come back from
the same rounds. A compile with measured costs times its matmuls, keeps them beside the profile, and
still gives the single-device numbers; ``local_time_seconds=0`` times none.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.config import load_settings  # noqa: E402
from metadist_core.cost.profile import MeshProfile  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.plugin import JaxFrontend  # noqa: E402

from _jax_models import assert_trees_close, mlp_case, side_by_side  # noqa: E402


def test_matmuls_are_timed_at_their_local_shapes(devices8):
    mlp, opt, params, state, batch = mlp_case()
    fe = JaxFrontend()
    g = fe.trace(mlp.make_step(opt), (params, state, batch), {}).graph
    dots = [op for op in g.ops if fe.traits.times_local(op)]
    assert dots and all(op.payload.name == "dot_general" for op in dots)
    assert not any(fe.traits.times_local(op) for op in g.ops if op.payload is not None and op.payload.name == "add")
    m, k, n = 512, 256, 256
    op = next(o for o in dots if len([v for v in o.inputs if g.vars[v].is_tensor]) == 2)
    dims = op.payload.params["dimension_numbers"]
    assert dims == (((1,), (0,)), ((), ())), "the test needs a plain (m,k)@(k,n) matmul"
    reqs = [
        (op, ((m, k), (k, n)), ("float32", "float32")),
        (op, ((m // 4, k), (k, n)), ("float32", "float32")),
        (op, ((m, k), (k + 1, n)), ("float32", "float32")),
    ]  # shapes a matmul refuses
    times = fe.time_ops(reqs, fe.resolve_mesh(Mesh((8,)), MeshProfile()))
    secs, rates = times.seconds, times.device
    whole, quarter, refused = secs
    assert refused is None
    assert whole > 0 and quarter > 0
    assert whole / 10 < quarter < whole
    assert rates.peak_flops > 1e8 and rates.mem_bandwidth > 1e8


def test_a_measured_compile_times_its_matmuls_and_keeps_the_numbers(devices8, tmp_path, monkeypatch):
    import metadist_jax.calibrate as cal

    real = cal.measure_live
    monkeypatch.setattr(cal, "measure_live", lambda jm, shape, cached=None, iters=5: real(jm, shape, cached, iters=2))
    monkeypatch.setenv("METADIST_MEASURE_LINKS", "1")
    mlp, opt, params, state, batch = mlp_case()
    step_fn = mlp.make_step(opt)
    step = metadist_compile(step_fn, mesh=(8,), cache_dir=str(tmp_path), autotune=False)
    batches = [mlp.make_batch(i, **mlp.TEST_BATCH) for i in range(3)]
    (lr, pr, sr), (lm, pm, sm) = side_by_side(step_fn, step, params, state, batches)
    stats = step.plan.stats.local_times
    assert stats["kernels_timed"] > 0 and stats["median_slowdown"] > 0
    assert list((tmp_path / "profiles").glob("*-local.json"))  # kept for the next compile on this machine
    assert_trees_close(lr, lm)
    assert_trees_close(pr, pm)

    monkeypatch.setenv("METADIST_LOCAL_TIME_SECONDS", "0")
    off = metadist_compile(step_fn, mesh=(8,), cache_dir=str(tmp_path), autotune=False)
    off(*off.place(params, state, batch))
    assert off.plan.stats.local_times is None


def test_the_local_time_budget_is_a_setting():
    assert load_settings().local_time_seconds == 10.0
    assert load_settings(local_time_seconds="2.5").local_time_seconds == 2.5
    with pytest.raises(ValueError, match="local_time_seconds"):
        load_settings(local_time_seconds=-1)
