"""PlanStats: typed fields for what the driver records, solver figures in ``extra``, one flat dict in JSON."""

from __future__ import annotations

import json

from metadist_core.ir.mesh import Mesh
from metadist_core.plan.plan import ShardingPlan
from metadist_core.plan.planstats import PlanStats
from metadist_core.problem.build import build_problem

from _small_graphs import linear_step, rulebook


def _plan(stats: dict | None = None) -> ShardingPlan:
    g = linear_step()
    p = build_problem(g, rulebook(g), Mesh((2,)))
    return ShardingPlan.from_choices(p, p.replicated_choice(), stats=stats)


def test_solver_figures_go_to_extra_and_known_keys_to_fields():
    st = PlanStats.from_json({"status": "optimal", "toggles_on": [1], "cached": 0, "first_bucket_mb": 1.5})
    assert st.status == "optimal" and st.toggles_on == [1] and st.first_bucket_mb == 1.5
    assert st.extra == {"cached": 0}
    assert st.to_json() == {"first_bucket_mb": 1.5, "status": "optimal", "toggles_on": [1], "cached": 0}


def test_an_old_plan_json_with_a_stats_dict_loads_and_round_trips():
    old = _plan().to_json()
    old["stats"] = {
        "strategy": "ddp",
        "first_bucket_mb": 0.0,
        "peak_with_buffers": 123,
        "sizes": [3, 2],
        "autotune": {"chosen": "ddp", "lowering": None, "candidates": []},
    }
    plan = ShardingPlan.from_json(json.loads(json.dumps(old)))
    assert plan.stats.strategy == "ddp" and plan.stats.first_bucket_mb == 0.0
    assert plan.stats.peak_with_buffers == 123 and plan.stats.extra == {"sizes": [3, 2]}
    assert ShardingPlan.from_json(json.loads(plan.dumps())).to_json() == plan.to_json()
    assert plan.to_json()["stats"] == old["stats"]


def test_the_plan_prints_its_autotune_line_from_the_typed_field():
    plan = _plan({"strategy": "ddp"})
    plan.stats.autotune = {
        "chosen": "ddp",
        "lowering": None,
        "candidates": [{"strategy": "ddp", "lowering": None, "measured_ms": 2.0, "predicted_ms": 1.0}],
    }
    assert "autotuned: ddp 2.0 ms (predicted 1.0); running ddp" in str(plan)
