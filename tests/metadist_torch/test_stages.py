"""Pipeline parallelism for torch on torch.distributed.pipelining: stages along mesh axis 0, each split on the
other axes by its own plan; GPipe, 1F1B and interleaved 1F1B; the planner pipelining under a memory budget.

One torchrun launch on 4 gloo ranks (slow) checks, on the GPT example and on transformers' GPT-2 (AdamW, tied
embeddings), that every pipelined step equals the single-device step over 3 steps (loss, parameters, optimizer
state; rtol 1e-4; GPT-2's zero-gradient key biases masked as in test_third_party). At world size 1 a pipeline
is a clear error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from metadist_torch import metadist_compile  # noqa: E402

from test_compile_single import gpt, mlp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
from _torchrun import launch  # noqa: E402


def test_a_pipeline_needs_a_first_axis_of_that_many_devices():
    c = mlp.MLPConfig(hidden=8, batch=4, layers=1)
    model, opt = mlp.build(c)
    with pytest.raises(ValueError, match=r"pipeline_stages=2 puts the stages on mesh axis 0, which has 1 devices"):
        metadist_compile(pipeline_stages=2)(mlp.train_step)(model, opt, *mlp.batch(c, 0))


def test_stages_meet_a_budget_that_the_whole_step_on_one_device_misses(tmp_path):
    """The planner solves the sub-mesh's plan (here one device per stage) under the budget of all stages
    together and holds each stage to the budget by the cut. It had solved the sub-mesh under the budget
    itself, so a step pipelined because it does not fit could only pipeline when it fit one device whole."""
    from metadist_core.config import load_settings
    from metadist_core.driver.pipeplan import pipeline_plan
    from metadist_core.ir.mesh import Mesh
    from metadist_core.driver.planner import plan_graph
    from metadist_core.plugins import PluginManager
    from metadist_core.problem.problem import InfeasibleBudgetError

    c = gpt.GPTConfig(vocab=96, seq=16, width=64, heads=2, layers=2, batch=8)
    model, opt = gpt.build(c)
    pm = PluginManager()
    graph = pm.frontend("torch").trace(gpt.train_step, (model, opt, *gpt.batch(c, 0)), {}).graph
    cache = str(tmp_path / "rules")
    with pytest.raises(InfeasibleBudgetError) as least:  # what one device needs at least, recomputing
        plan_graph(
            graph,
            Mesh((1,)),
            plugins=pm,
            settings=load_settings(cache_dir=cache, progress=False, memory_budget=1 << 16),
        )
    budget = int(0.97 * least.value.needed)
    s = load_settings(cache_dir=cache, progress=False, memory_budget=budget, micro_batches=4)
    with pytest.raises(InfeasibleBudgetError):  # one device cannot hold the step under it
        plan_graph(graph, Mesh((1,)), plugins=pm, settings=s)
    res = pipeline_plan(graph, Mesh((4,)), s, lambda m, st: plan_graph(graph, m, plugins=pm, settings=st), None)
    assert res is not None and len(res.plan.stages) == 4
    assert max(st.memory for st in res.plan.stages) <= budget, [st.memory for st in res.plan.stages]


@pytest.mark.slow
def test_pipelines_match_single_device_on_4_gloo_ranks(tmp_path):
    res = launch(
        Path(__file__).parent / "_stages_worker.py",
        4,
        out=tmp_path / "out.json",
        METADIST_CACHE_DIR=str(tmp_path / "rules"),
    )
    assert not res["errors"], "\n".join(res["errors"])
    by = {r["name"]: r for r in res["report"]}
    assert set(by) == {
        "gpt-pp2-1f1b-tp@2x2",
        "gpt-pp2-gpipe@2x2",
        "gpt-pp4-1f1b@4",
        "gpt-pp4-interleaved@4",
        "gpt-auto-budget@4",
        "gpt2-pp2-1f1b@2x2",
        "gpt2-pp2-gpipe@2x2",
        "gpt2-pp4-1f1b@4",
    }
    assert by["gpt2-pp4-1f1b@4"]["stages"] == 4 and by["gpt2-pp2-gpipe@2x2"]["devices"] == [[0, 1], [2, 3]]
    assert by["gpt-pp2-1f1b-tp@2x2"]["devices"] == [[0, 1], [2, 3]]
    assert by["gpt-pp2-1f1b-tp@2x2"]["plan_mesh"] == [2]  # each stage's own plan on the other axis
    assert by["gpt-pp2-1f1b-tp@2x2"]["sharded_values"] > 0  # ... which splits values within the stage
    assert by["gpt-pp2-1f1b-tp@2x2"]["ran"]["dtensor"] > 0
    assert by["gpt-pp4-1f1b@4"]["devices"] == [[0], [1], [2], [3]]
    assert by["gpt-pp4-interleaved@4"]["stages"] == 8  # two stages per device
    assert by["gpt-auto-budget@4"]["stages"] == 4  # the planner chose to pipeline
    assert all(r["text"][0].startswith("pipeline:") for r in res["report"])
