"""micro_batches for torch: gradients accumulate over equal parts of the batch inside one call, so the step
equals the eager whole-batch step (loss, parameters, optimizer state; 3 steps, rtol 1e-4).

In this process at world size 1, and (slow) under torchrun on 4 gloo ranks with meshes (4,) and (2, 2):
the GPT example, transformers' GPT-2 with AdamW, and a random plan (Partial gradients accumulate in place).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from metadist_core.levers.microbatch import MicroBatchError, cut_at_gradients  # noqa: E402
from metadist_torch import metadist_compile  # noqa: E402

from test_compile_single import _run_and_compare, cnn, gpt, mlp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
from _torchrun import launch  # noqa: E402

STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_mlp_micro_batches_match_the_whole_batch(optimizer):
    c = mlp.MLPConfig(hidden=16, batch=8, layers=2, optimizer=optimizer)
    step = _run_and_compare(
        lambda: mlp.build(c), [mlp.batch(c, s) for s in range(STEPS)], mlp.train_step, micro_batches=4
    )
    batch_in = [v for v in step.graph.inputs if step.graph.vars[v].role == "input"]
    assert step.graph.vars[batch_in[0]].shape[0] == 2  # traced and planned for one micro-batch


def test_gpt_example_micro_batches_match_the_whole_batch():
    c = gpt.GPTConfig(vocab=97, seq=16, width=32, heads=2, layers=1, batch=4)
    _run_and_compare(lambda: gpt.build(c), [gpt.batch(c, s) for s in range(STEPS)], gpt.train_step, micro_batches=2)


def test_sum_reduced_loss_sums_the_gradients_and_clipping_sees_the_whole_gradient():
    """A sum loss adds micro-batch gradients; a global-norm clip between backward and step runs once, on the
    accumulated gradient (the cut is at the backward's results, not at what the optimizer reads)."""

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def step_fn(model, opt, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=False)
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]
    step = _run_and_compare(build, batches, step_fn, micro_batches=4)
    assert step.runnable.cut.reduction == "sum"


def test_cut_puts_forward_and_backward_per_micro_batch_and_adam_once():
    from metadist_core.plugins import PluginManager

    c = mlp.MLPConfig(hidden=8, batch=4, layers=1, optimizer="adam")
    model, opt = mlp.build(c)
    traced = PluginManager().frontend("torch").trace(mlp.train_step, (model, opt, *mlp.batch(c, 0)), {})
    cut = cut_at_gradients(traced.graph, 4)
    roles = lambda g: {g.vars[v].role for v in g.inputs}  # noqa: E731
    assert "optimizer_state" not in roles(cut.grad_graph)  # no optimizer per micro-batch
    assert "input" in roles(cut.grad_graph)
    params = [v for v in traced.graph.inputs if traced.graph.vars[v].role == "parameter"]
    assert sorted(traced.graph.vars[g].numel for g in cut.gradients) == sorted(
        traced.graph.vars[p].numel for p in params
    )  # one gradient per parameter (a bias's (1, n))
    assert not any(traced.graph.vars[v].role == "input" for v in cut.update_graph.inputs)
    assert set(cut.update_graph.aliases) == {v for v in traced.graph.aliases if traced.graph.vars[v].role != "buffer"}


def test_batch_that_micro_batches_does_not_divide_is_a_clear_error():
    c = mlp.MLPConfig(hidden=8, batch=6, layers=1)
    model, opt = mlp.build(c)
    with pytest.raises(MicroBatchError, match=r"batch of 6 .* micro_batches=4"):
        metadist_compile(micro_batches=4)(mlp.train_step)(model, opt, *mlp.batch(c, 0))
    with pytest.raises(ValueError, match="micro_batches must be at least 1"):
        metadist_compile(micro_batches=0)(mlp.train_step)


def test_batchnorm_warns_once_that_statistics_are_per_micro_batch():
    c = cnn.CNNConfig(channels=4, image=8, batch=8)
    model, opt = cnn.build(c)
    step = metadist_compile(micro_batches=2)(cnn.train_step)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(model, opt, *cnn.batch(c, 0))
        step(model, opt, *cnn.batch(c, 1))
    hits = [x for x in w if "per micro-batch" in str(x.message)]
    assert len(hits) == 1, [str(x.message) for x in w]


def test_pipeline_stages_on_an_axis_of_another_size_is_a_clear_error():
    c = mlp.MLPConfig(hidden=8, batch=4, layers=1)
    model, opt = mlp.build(c)
    with pytest.raises(ValueError, match=r"pipeline_stages=2 .* axis 0, which has 1 devices"):
        metadist_compile(pipeline_stages=2)(mlp.train_step)(model, opt, *mlp.batch(c, 0))
    with pytest.raises(ValueError, match="unknown schedule"):
        metadist_compile(schedule="zigzag")(mlp.train_step)


@pytest.mark.slow
def test_micro_batches_match_single_device_on_4_gloo_ranks(tmp_path):
    res = launch(
        Path(__file__).parent / "_pipeline_worker.py",
        4,
        out=tmp_path / "out.json",
        METADIST_CACHE_DIR=str(tmp_path / "rules"),
    )
    assert not res["errors"], "\n".join(res["errors"])
    names = {r["name"] for r in res["report"]}
    assert names == {"gpt-mb4@4", "gpt-mb4@2x2", "mlp-adam-random-plan-mb2@2x2", "gpt2-adamw-mb4@2x2"}
    assert all(r["collectives"] > 0 for r in res["report"] if "random" in r["name"]), res["report"]
