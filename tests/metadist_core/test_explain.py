"""plan.explain(), the picture and `metadist explain` on a small training step of reference ops."""

from __future__ import annotations

import json

import pytest

from metadist_core.driver import cli
from metadist_core.plan.explain import compare_presets, parameter_reasons, problem_path
from metadist_core.plan.picture import draw_plan, layer_of
from metadist_core.driver.compile import plan_graph
from metadist_core.ir.mesh import Mesh
from metadist_core.plan.plan import ShardingPlan

from test_presets import mlp_step


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    ir, _, _ = mlp_step()
    return plan_graph(ir, Mesh((2, 2)), cache_dir=str(tmp_path_factory.mktemp("rules")), progress=False)


def test_explain_names_every_parameter_its_reason_the_collectives_and_the_presets(planned):
    text = planned.plan.explain()
    for name in ("mlp.fc1.weight", "mlp.fc2.weight"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(name))
        assert "next best" in line or "faster" in line or "only storage" in line, line
    assert "totals per device" in text and "communication" in text
    for preset in ("ddp", "zero1", "zero2", "zero3", "tp", "tp+dp"):
        assert f"\n  {preset} " in text, text
    kinds = {c.kind for _, c in planned.plan.collectives() if not c.is_free}
    assert all(k in text for k in kinds)


def test_the_reasons_agree_with_the_cost_tables(planned):
    """The chosen storage is never worse than its best alternative by the tables (the plan is optimal)."""
    whys = parameter_reasons(planned.plan, planned.problem)
    assert [w.name for w in whys] == ["mlp.fc1.weight", "mlp.fc2.weight"]
    assert all(w.alt is not None and w.alt_dt >= -1e-12 for w in whys)


def test_presets_are_priced_on_the_same_problem(planned):
    rows = {r["strategy"]: r for r in compare_presets(planned.problem)}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3", "tp", "tp+dp"}
    for r in rows.values():  # nothing beats the unconstrained optimum
        assert r["objective"] >= planned.plan.objective * (1 - 1e-9)


def test_the_picture_is_written(planned, tmp_path):
    mpimg = pytest.importorskip("matplotlib.image")
    out = draw_plan(planned.plan, str(tmp_path / "plan.png"))
    img = mpimg.imread(out)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 100
    assert layer_of("transformer.h.3.mlp.c_fc.weight") == "transformer.h.3"
    assert layer_of("lm_head.weight") == "lm_head"


def test_metadist_explain_reads_the_plan_and_its_problem(planned, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plan_file = tmp_path / "mlp.plan.json"
    plan_file.write_text(json.dumps(planned.plan.to_json()))
    back = ShardingPlan.from_json(json.loads(plan_file.read_text()))
    assert back.labels == {"w1": "mlp.fc1.weight", "w2": "mlp.fc2.weight"}
    # without its problem: placements and collectives, and a note
    assert cli.main(["explain", str(plan_file)]) == 0
    assert "reasons need the plan's problem" in capsys.readouterr().out
    (tmp_path / "mlp.problem.json").write_text(planned.problem.dumps())
    assert problem_path(str(plan_file)) == str(tmp_path / "mlp.problem.json")
    assert cli.main(["explain", str(plan_file), "--png", str(tmp_path / "p.png"), "--no-presets"]) == 0
    out = capsys.readouterr().out
    assert "mlp.fc1.weight" in out and "next best" in out and (tmp_path / "p.png").is_file()
    assert cli.main(["explain", str(tmp_path / "missing.json")]) == 2


def test_expert_ranges_follow_the_mesh_axes_outermost_first():
    from metadist_core.ir.placement import Replicate, Shard, Sharding
    from metadist_core.plan.explain import expert_ranges

    assert expert_ranges(Sharding((Shard(0),)), 8, (4,)) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # split over axis 0 of (2, 2): ranks 0 and 1 share a row of the mesh, so they hold the same experts
    assert expert_ranges(Sharding((Shard(0), Replicate())), 8, (2, 2)) == [(0, 3), (0, 3), (4, 7), (4, 7)]
    assert expert_ranges(Sharding((Replicate(), Shard(0))), 8, (2, 2)) == [(0, 3), (4, 7), (0, 3), (4, 7)]
    assert expert_ranges(Sharding((Shard(0), Shard(0))), 8, (2, 2)) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert expert_ranges(Sharding((Replicate(),)), 8, (4,)) == [(0, 7)] * 4
