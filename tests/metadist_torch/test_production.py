"""Training as in production: bf16 autocast, fp16 with a GradScaler, compressed gradients, checkpoints.

Fast tests run at world size 1 or plan only. One slow test makes two torchrun
launches (worker: ``production_worker.py``): 4 ranks on mesh (4,) (autocast
against eager autocast, fp16 + GradScaler with an overflow on one device's piece
under ``strategy="ddp"`` and with split weights, DDP with and without bf16 gradient compression over 50
steps, a checkpoint saved from sharded state), then 2 ranks on mesh (2,) (that
checkpoint loaded before and after the first compiled call), and finally this
process loads it at world size 1; each resumed run must give the numbers of
the run that never stopped.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "torch"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun

import mlp  # noqa: E402
import production_worker as W  # noqa: E402
from _torchrun import launch  # noqa: E402

from metadist_core.cost.compression import wire_dtypes  # noqa: E402
from metadist_core.config import compression_dtype  # noqa: E402
from metadist_core.config import load_settings  # noqa: E402
from metadist_core.driver.compile import plan_graph  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_torch import load_checkpoint, metadist_compile, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rules"))


def test_bf16_autocast_step_matches_eager_autocast_on_one_device():
    batches = [mlp.batch(W.AMP_CFG, s) for s in range(3)]
    m_ref, o_ref = mlp.build(W.AMP_CFG)
    ref = [float(W.autocast_step(m_ref, o_ref, *b)) for b in batches]
    m, o = mlp.build(W.AMP_CFG)
    step = metadist_compile()(W.autocast_step)
    got = [float(step(m, o, *b)) for b in batches]
    errors: list[str] = []
    W.compare_losses("autocast@1", got, ref, W.BF16_TOL, errors)
    W.compare_state("autocast@1", m, m_ref, W.BF16_TOL, errors)
    assert not errors, "\n".join(errors)
    assert "bfloat16" in {v.dtype for v in step.graph.vars.values()}


def test_every_parameter_gradient_is_marked_once():
    for fn in (mlp.train_step, W.autocast_step):
        m, o = mlp.build(W.AMP_CFG)
        g = W.graph_of(fn, m, o, mlp.batch(W.AMP_CFG))
        grads = sorted(g.vars[v].shape for v in g.vars if g.vars[v].role == "gradient")
        params = sorted(g.vars[v].shape for v in g.inputs if g.vars[v].role == "parameter")
        assert grads == params, fn.__name__
        assert all(g.vars[v].dtype == "float32" for v in g.vars if g.vars[v].role == "gradient")


def test_grad_compression_prices_half_the_gradient_bytes(rules):
    m, o = mlp.build(W.DDP_CFG)
    g = W.graph_of(mlp.train_step, m, o, mlp.batch(W.DDP_CFG))
    grads = set(wire_dtypes(g, "bf16"))
    mesh = Mesh((4,))
    got = {}
    for mode in (None, "bf16", "fp16"):
        res = plan_graph(g, mesh, strategy="ddp", cache_dir=rules, progress=False, grad_compression=mode)
        got[mode] = (W.predicted_bytes(res.plan), W.predicted_bytes(res.plan, grads), res.plan)
    total, grad, plan = got[None]
    reduced = {e.var for e in plan.edges for c in e.collectives if c.kind == "all_reduce"}
    marked = [v for v in g.vars if g.vars[v].role == "gradient"]
    assert all(any(v in reduced for v in _chain_of(g, m_)) for m_ in marked), "DDP: every gradient all-reduced"
    for mode in ("bf16", "fp16"):
        t, gb, p = got[mode]
        assert gb * 2 == grad > 0
        assert t - gb == total - grad  # nothing else changes
        assert p.comm_seconds < plan.comm_seconds


def _chain_of(g, v):
    out = [v]
    op = g.producer(v)
    while op is not None and len(op.inputs) == 1 and g.vars[op.inputs[0]].numel == g.vars[v].numel:
        out.append(op.inputs[0])
        op = g.producer(op.inputs[0])
    return out


def test_grad_compression_setting():
    assert load_settings(grad_compression="bf16").grad_compression == "bf16"
    assert load_settings(grad_compression="float16").grad_compression == "fp16"
    assert load_settings(grad_compression="none").grad_compression is None
    assert compression_dtype("bf16") == "bfloat16"
    with pytest.raises(ValueError, match="grad_compression must be None, 'bf16' or 'fp16', got 'int8'"):
        load_settings(grad_compression="int8")


def test_fp16_grad_scaler_step_matches_eager_on_one_device():
    errors: list[str] = []
    report: dict = {}
    W.check_scaler("scaler@1", None, errors, report)  # 5 steps; step 2 overflows and is skipped
    assert not errors, "\n".join(errors)
    scales = report["scaler@1"]["scales"]
    assert scales[W.OVERFLOW_STEP] == scales[W.OVERFLOW_STEP - 1] / 2 and scales[-1] == 2 * scales[-2]


def test_grad_scaler_with_a_plain_optimizer_names_the_fix():
    from metadist_torch.trace.amp import ScalerError

    m, _ = mlp.build(W.FP16_CFG)
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(ScalerError, match=r"AdamW \(not fused\).*\.item\(\).*fused=True"):
        metadist_compile()(W.scaled_step)(m, opt, torch.amp.GradScaler("cpu"), *mlp.batch(W.FP16_CFG))
    disabled = torch.amp.GradScaler("cpu", enabled=False)  # a disabled scaler is a plain optimizer step
    loss = metadist_compile()(W.scaled_step)(m, opt, disabled, *mlp.batch(W.FP16_CFG))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("op", ["isnan", "isfinite"])
@pytest.mark.parametrize("shape", [(), (8,)])
def test_finiteness_tests_never_take_one_piece_for_the_whole(op, shape):
    """found_inf: a rule that made each device's own answer the replicated one passes on finite data
    (False everywhere); the nonfinite draws (inf/NaN in one piece) must reject it."""
    from metadist_core.ir.placement import Partial, Replicate
    from metadist_torch import rules_for

    rules = rules_for(getattr(torch.ops.aten, op).default, torch.randn(shape), axis_size=2)
    assert rules
    for r in rules:
        if isinstance(r.inputs[0], Partial):
            assert not isinstance(r.outputs[0], Replicate), f"{op}: {r.inputs} -> {r.outputs}"


def test_checkpoint_resumes_at_world_size_1_before_and_after_compile(tmp_path):
    cfg = W.CKPT_CFG
    batches = [mlp.batch(cfg, s) for s in range(6)]
    m_ref, o_ref = mlp.build(cfg)
    ref = [float(mlp.train_step(m_ref, o_ref, *b)) for b in batches]
    m, o = mlp.build(cfg)
    step = metadist_compile()(mlp.train_step)
    losses = [float(step(m, o, *b)) for b in batches[:3]]
    save_checkpoint(tmp_path / "ckpt", m, o)
    for after_compile in (False, True):
        m2, o2 = mlp.build(dataclasses.replace(cfg, seed=11))
        step2 = metadist_compile()(mlp.train_step)
        if after_compile:
            step2(m2, o2, *batches[5])
        load_checkpoint(tmp_path / "ckpt", m2, o2)
        got = losses + [float(step2(m2, o2, *b)) for b in batches[3:]]
        errors: list[str] = []
        W.compare_losses(f"resume@1 after_compile={after_compile}", got, ref, W.RTOL, errors)
        W.compare_state(f"resume@1 after_compile={after_compile}", m2, m_ref, W.RTOL, errors)
        assert not errors, "\n".join(errors)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        load_checkpoint(tmp_path / "missing", m, o)


def _launch(nproc: int, mode: str, out: Path, cache: Path) -> dict:
    res = launch(
        Path(__file__).parent / "production_worker.py",
        nproc,
        [mode, str(out)],
        out=out / f"{mode}.json",
        METADIST_CACHE_DIR=str(cache),
        METADIST_SOLVER="ilp",
    )
    assert not res["errors"], "\n".join(res["errors"])
    return res["report"]


@pytest.mark.slow
def test_production_features_under_torchrun(tmp_path):
    four = _launch(4, "four", tmp_path, tmp_path / "rules")
    for name in ("scaler_ddp", "scaler_sharded"):  # fp16 + GradScaler: one step overflows on one device only
        scales = four[name]["scales"]
        assert scales[W.OVERFLOW_STEP] == scales[W.OVERFLOW_STEP - 1] / 2, name
    comp = four["compression"]
    assert comp["gradient_bytes_per_step"]["bf16"] * 2 == comp["gradient_bytes_per_step"]["none"]
    assert abs(comp["loss_20"]["bf16"] - comp["loss_20"]["none"]) <= 0.01 * abs(comp["loss_20"]["none"])
    two = _launch(2, "two", tmp_path, tmp_path / "rules")
    assert set(two) >= {"resume_before_compile", "resume_after_compile"}
    # world size 1, this process: the checkpoint saved on 4 ranks, 3 more steps
    done = torch.load(tmp_path / "uninterrupted.pt")
    batches = [mlp.batch(W.CKPT_CFG, s) for s in range(6)]
    m, o = mlp.build(dataclasses.replace(W.CKPT_CFG, seed=11))
    load_checkpoint(tmp_path / "ckpt", m, o)
    step = metadist_compile()(mlp.train_step)
    losses = [float(step(m, o, *b)) for b in batches[3:]]
    errors: list[str] = []
    W.compare_losses("resume@1", losses, done["losses"][3:], W.RTOL, errors)
    for k, v in m.state_dict().items():
        if not W.close(v, done["state"][k], W.RTOL):
            errors.append(f"resume@1: {k} differs from the uninterrupted 4-rank run")
    assert not errors, "\n".join(errors)
