"""The rank program compiled by torch.compile (``backend``): the pass that makes it one graph, and compiled
steps against the eager lowering and the single-device step (rtol 1e-4) with zero graph breaks.

World size 1 runs here; several ranks run ``_compiled_worker.py`` under torchrun on gloo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from metadist_core.config import load_settings
from metadist_core.driver.frontend import NotSupported
from metadist_torch import metadist_compile
from metadist_torch.lower.compiled import check_backend, compilable, scalars_as_tensors

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # tests/: _torchrun; this folder: the worker
from _torchrun import launch  # noqa: E402

aten = torch.ops.aten
ITEM = aten._local_scalar_dense.default
RTOL = 1e-4


def _numbers_graph() -> fx.GraphModule:
    """An optimizer-like update reading two numbers as ``_local_scalar_dense`` of 0-d float64 tensors, in every
    form the traced optimizers pass them: a Tensor argument, a ``.Scalar`` overload, ``alpha=``, ``value=``,
    and a number as ``self`` of ``pow.Scalar``."""
    g = fx.Graph()
    p, grad, m, lr, beta = (g.placeholder(n) for n in ("p", "grad", "m", "lr", "beta"))
    s_lr, s_beta = g.call_function(ITEM, (lr,)), g.call_function(ITEM, (beta,))
    m1 = g.call_function(aten.lerp.Scalar, (m, grad, s_beta))
    v = g.call_function(aten.addcmul.default, (m1, grad, grad), {"value": s_beta})
    corr = g.call_function(aten.pow.Scalar, (s_beta, g.call_function(aten.abs.default, (m1,))))
    step = g.call_function(aten.mul.Tensor, (g.call_function(aten.div.Tensor, (v, corr)), s_lr))
    out = g.call_function(aten.add.Tensor, (p, step), {"alpha": s_lr})
    g.output((out, m1))
    for n in g.nodes:  # the dtype of every value, as the lowering records it
        if n.op != "output" and n.target is not ITEM and n.name not in ("lr", "beta"):
            n.meta["metadist_dtype"] = "float32"
    return fx.GraphModule(torch.nn.Module(), g)


def test_numbers_become_tensors_with_the_same_values():
    gm = _numbers_graph()
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(5, 4, generator=gen) for _ in range(3)]
    args += [torch.tensor(1e-3, dtype=torch.float64), torch.tensor(0.9, dtype=torch.float64)]
    want = gm(*args)
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    assert scalars_as_tensors(g) == 0
    assert not any(n.target is ITEM for n in g.nodes)
    got = fx.GraphModule(torch.nn.Module(), g)(*args)
    for a, b in zip(want, got):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_flattened_program_is_one_graph_of_aten_ops():
    gm = _numbers_graph()
    args = [torch.randn(5, 4) for _ in range(3)] + [torch.tensor(1e-3, dtype=torch.float64)] * 2
    prog = compilable(gm, args)
    assert prog.numbers_left == 0
    targets = [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]
    assert targets and all(isinstance(t, torch._ops.OpOverload) for t in targets)
    for a, b in zip(gm(*args), prog.gm(*args)):
        torch.testing.assert_close(b, a)


def test_backend_names_and_compile_options():
    assert check_backend("eager") == "eager"
    assert check_backend("inductor") == "inductor"
    with pytest.raises(ValueError, match="unknown backend 'inductr'.*inductor"):
        check_backend("inductr")
    s = load_settings(backend="inductor", compile_options='{"mode": "max-autotune-no-cudagraphs"}')
    assert s.compile_options == {"mode": "max-autotune-no-cudagraphs"}
    with pytest.raises(ValueError, match="compile_options must be a JSON object"):
        load_settings(compile_options="mode=default")
    # at decoration, before any trace: an unknown backend, and an option that cannot be compiled yet
    with pytest.raises(ValueError, match="unknown backend 'inductr'"):
        metadist_compile(backend="inductr")(lambda: None)
    with pytest.raises(NotSupported, match="cannot compile a step with offload='optimizer' yet"):
        metadist_compile(backend="inductor", offload="optimizer")(lambda: None)
    with pytest.raises(NotSupported, match="pipeline_stages=2"):
        metadist_compile(backend="inductor", pipeline_stages=2)(lambda: None)


def _world_size_one(name: str) -> dict:
    import _compiled_worker as w

    from metadist_torch import metadist_compile

    m0, batches, step = w.build(name)
    ref_losses, ref, _ = w.run(m0, batches, step, None)
    out = {}
    for backend in ("eager", "inductor"):
        losses, params, fn = w.run(m0, batches, step, metadist_compile(backend=backend))
        out[backend] = (losses, params, fn)
        assert losses == pytest.approx(ref_losses, rel=RTOL), backend
        torch.testing.assert_close(params, ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()))
    torch.testing.assert_close(out["inductor"][1], out["eager"][1], rtol=RTOL, atol=RTOL * float(ref.abs().max()))
    return out["inductor"][2]


def test_inductor_at_world_size_one_gpt_example():
    """The GPT example with AdamW and an LR schedule: Inductor compiles the whole step (kernels generated,
    no graph break), and the step equals the eager one and the single-device step."""
    fn = _world_size_one("gpt")
    report = fn.plan.stats.compile
    assert report["backend"] == "inductor" and report["graph_breaks"] == 0 and report["kernels"] > 0
    assert fn.timings["compile"] == report["seconds"] > 0
    assert fn.memory["method"] == "not measured"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_inductor_at_world_size_one_transformers(name):
    report = _world_size_one(name).plan.stats.compile
    assert report["graph_breaks"] == 0 and report["kernels"] > 0


def _ranks(tmp_path, nproc: int, models: str, strategy: str, *opts: str, exact: bool = True) -> dict:
    """Run the worker; every run equals the single-device step (``exact``; else the compiled one equals the
    eager lowering), with no graph break and the eager program's communication figures."""
    res = launch(
        HERE / "_compiled_worker.py",
        nproc,
        [models, strategy, *opts],
        out=tmp_path / "out.json",
        METADIST_CACHE_DIR=str(tmp_path / "rules"),
        timeout=1800,
    )
    same_plan = 0
    for name, rec in res.items():
        assert rec["inductor_vs_eager"] < RTOL, (name, rec)
        for backend in ("eager", "inductor") if exact else ():
            assert rec[backend]["loss_diff"] < RTOL, (name, backend, rec[backend])
            assert rec[backend]["param_diff"] < RTOL, (name, backend, rec[backend])
        assert rec["inductor"]["compile"]["graph_breaks"] == 0, (name, rec["inductor"]["compile"])
        assert rec["inductor"]["compile"]["kernels"] > 0
        assert sum(rec["inductor"]["comm"].values()) > 0
        # what the collectives moved is counted from the compiled graph: the eager program's figures, where both
        # run the same plan (the planner prices a compiled update as one fused loop, so it may choose another)
        if rec["inductor"]["plan"] == rec["eager"]["plan"]:
            assert rec["inductor"]["comm"] == rec["eager"]["comm"], name
            same_plan += 1
    assert same_plan, "no model ran the same plan compiled and eager: the counts were not compared"
    return res


@pytest.mark.slow
@pytest.mark.ci
def test_inductor_on_two_ranks_sharded(tmp_path):
    """2 gloo ranks, parameters and optimizer state sharded (fsdp): all_gathers and reduce_scatters in buckets,
    compiled with the rest of the step."""
    _ranks(tmp_path, 2, "gpt", "fsdp")


@pytest.mark.slow
def test_inductor_on_four_ranks_transformers(tmp_path):
    """4 gloo ranks on a (2, 2) mesh, tensor parallel inside data parallel: GPT example, GPT-2 and LLaMA."""
    _ranks(tmp_path, 4, "gpt,gpt2,llama", "tp+dp", "mesh=[2, 2]")


@pytest.mark.slow
def test_inductor_with_micro_batches(tmp_path):
    _ranks(tmp_path, 2, "gpt", "ddp", "micro_batches=2")


@pytest.mark.slow
def test_inductor_with_grad_compression(tmp_path):
    """Gradients all-reduced in bf16 (approximate by design): the compiled program equals the eager one."""
    _ranks(tmp_path, 2, "gpt", "ddp", 'grad_compression="bf16"', exact=False)


@pytest.mark.slow
def test_inductor_with_bf16_autocast_and_fp16_grad_scaler():
    """AMP compiled: bf16 autocast against eager autocast, and fp16 with a GradScaler whose third step
    overflows and is skipped, against eager (the tolerances of test_production)."""
    import production_worker as W

    sys.path.insert(0, str(HERE.parents[1] / "examples" / "torch"))
    import mlp

    errors: list[str] = []
    batches = [mlp.batch(W.AMP_CFG, s) for s in range(3)]
    m_ref, o_ref = mlp.build(W.AMP_CFG)
    ref = [float(W.autocast_step(m_ref, o_ref, *b)) for b in batches]
    m, o = mlp.build(W.AMP_CFG)
    step = metadist_compile(backend="inductor")(W.autocast_step)
    got = [float(step(m, o, *b)) for b in batches]
    W.compare_losses("autocast", got, ref, W.BF16_TOL, errors)
    W.compare_state("autocast", m, m_ref, W.BF16_TOL, errors)
    assert step.plan.stats.compile["graph_breaks"] == 0
    report: dict = {}
    scaled = W.check_scaler("scaler", None, errors, report, backend="inductor")
    assert not errors, "\n".join(errors)
    scales = report["scaler"]["scales"]
    assert scales[W.OVERFLOW_STEP] == scales[W.OVERFLOW_STEP - 1] / 2
    assert scaled.plan.stats.compile["graph_breaks"] == 0


@pytest.mark.slow
def test_inductor_replans_a_frozen_layer_and_compiles_again():
    """A layer frozen between calls fails a guard: the step is planned, lowered and compiled again, and
    still equals the single-device step; the learning rate a schedule changes never recompiles."""
    import _compiled_worker as w

    m0, batches, step = w.build("gpt")
    batches = batches * 2

    def run(compiled):
        import copy

        m = copy.deepcopy(m0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        fn = step if compiled is None else compiled(step)
        for i, b in enumerate(batches):
            if i == 3:
                m.blocks[0].fc.weight.requires_grad_(False)
            fn(m, opt, *b)
            sched.step()
        return torch.cat([p.detach().flatten() for p in m.parameters()]), fn

    ref, _ = run(None)
    got, fn = run(metadist_compile(backend="inductor"))
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()))
    assert fn.replans == 1, fn.replan_reasons
    assert fn.plan.stats.compile["graph_breaks"] == 0 and fn.timings["compile"] > 0


@pytest.mark.slow
def test_inductor_draws_the_dropout_masks_of_the_single_device_step():
    sys.path.insert(0, str(HERE.parents[1] / "examples" / "torch"))
    import gpt

    c = gpt.GPTConfig(layers=2, width=64, seq=32, vocab=128, batch=8, dropout=0.2)
    runs = []
    for compiled in (None, metadist_compile(backend="inductor")):
        m, opt = gpt.build(c)
        torch.manual_seed(5)
        fn = gpt.train_step if compiled is None else compiled(gpt.train_step)
        runs.append([float(fn(m, opt, *gpt.batch(c, s))) for s in range(3)])
    assert runs[1] == pytest.approx(runs[0], rel=RTOL)


@pytest.mark.slow
def test_inductor_runs_a_plan_that_recomputes_under_a_budget():
    """Under a budget halfway between the leanest plan with and without recomputation the plan recomputes
    forward segments; compiled, the step still equals the single-device step."""
    import _compiled_worker as w

    from metadist_core.levers.recompute import RecomputeBudgetError

    m0, batches, step = w.build("gpt")
    with pytest.raises(RecomputeBudgetError) as e:
        w.run(m0, batches, step, metadist_compile(memory_budget=1))
    budget = (e.value.without + e.value.with_recompute) // 2
    _, ref, _ = w.run(m0, batches, step, None)
    _, got, fn = w.run(m0, batches, step, metadist_compile(backend="inductor", memory_budget=budget))
    assert fn.plan.recompute, "the plan meets the budget without recomputing?"
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()))
    assert fn.plan.stats.compile["graph_breaks"] == 0
