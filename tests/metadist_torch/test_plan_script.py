"""`metadist plan SCRIPT`: the script runs until its first compiled step, which is planned for the mesh asked."""

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from metadist_core.driver import cli  # noqa: E402
from metadist_core.plan.plan import ShardingPlan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_plan_a_torch_script_for_a_mesh_larger_than_this_machine(tmp_path, capsys):
    out = tmp_path / "mlp.plan.json"
    assert (
        cli.main(
            ["plan", str(REPO / "examples/torch/mlp.py"), "--mesh", "2x4", "--out", str(out), "--", "--steps", "1"]
        )
        == 0
    )
    plan = ShardingPlan.from_json(json.loads(out.read_text()))
    assert plan.mesh_shape == (2, 4)
    assert any(not s.is_fully_replicated() for s in plan.var_shardings.values())
    assert "planned on mesh 2x4" in capsys.readouterr().out


def test_a_script_without_a_compiled_step_is_an_error(tmp_path, capsys):
    script = tmp_path / "nothing.py"
    script.write_text("print('no step here')\n")
    assert cli.main(["plan", str(script), "--mesh", "2"]) == 2
    assert "without calling a metadist_compile'd step" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_gpt2_small_at_its_real_size(tmp_path, capsys):
    """transformers' GPT-2 small as released (12 layers, width 768, vocabulary 50,257, batch 8 x 1024),
    forward, backward and AdamW, planned for a (2, 4) mesh in plan-only mode: discovery runs per op pattern
    at proxy sizes, so this takes seconds to a minute on 2 cores, not hours (no timing is asserted)."""
    pytest.importorskip("transformers")
    out = tmp_path / "gpt2-small.plan.json"
    assert (
        cli.main(
            [
                "plan",
                str(REPO / "examples/torch/gpt2_hf.py"),
                "--mesh",
                "2x4",
                "--out",
                str(out),
                "--cache-dir",
                str(tmp_path / "rules"),
                "--",
                "--size",
                "small",
                "--seq",
                "1024",
            ]
        )
        == 0
    )
    plan = ShardingPlan.from_json(json.loads(out.read_text()))
    assert plan.mesh_shape == (2, 4)
    text = capsys.readouterr().out
    assert "planned on mesh 2x4" in text and "discover" in text
    # the 50,257 x 768 embedding is too big to keep whole on every device in a good plan
    assert any(not s.is_fully_replicated() for s in plan.input_shardings.values())
