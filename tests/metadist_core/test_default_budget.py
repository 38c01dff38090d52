"""With no memory_budget a plan fits the device it runs on: the CUDA device's memory (read by the frontend into
``Resolved.device_memory``; here a substituted query), the device preset's in a plan-only run, none on a CPU;
an explicit budget wins, the plan records which budget held and where it came from, and a budget nothing fits
is an error naming both."""

from __future__ import annotations

import dataclasses
import json

import pytest

from metadist_core.config import load_settings
from metadist_core.cost.model import DEVICE_PRESETS
from metadist_core.cost.profile import MeshProfile
from metadist_core.driver import planonly
from metadist_core.driver.budget import plan_budget
from metadist_core.driver.compile import compile_step
from metadist_core.plan.explain import explain_plan
from metadist_core.plugins import PluginManager
from metadist_core.problem.problem import InfeasibleBudgetError
from metadist_core.reference.plugin import ReferenceFrontend, transformer_block

SIZES = {"batch": 8, "seq": 32, "width": 64, "hidden": 256}
PLAIN_PEAK = 360_448  # bytes per device of the plan without a budget of this block on (2,) (measured below)


class OnDevice(ReferenceFrontend):
    """The reference frontend on a device of ``memory`` bytes: the memory query a CUDA frontend makes."""

    memory: int | None = None

    def resolve_mesh(self, mesh, profile):
        return dataclasses.replace(super().resolve_mesh(mesh, profile), device_memory=self.memory)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One rule cache for the module: the block's rules are discovered once."""
    return tmp_path_factory.mktemp("rules")


def _compile(cache, memory: int | None, **settings):
    fe = OnDevice()
    fe.memory = memory
    s = load_settings(cache_dir=str(cache), progress=False, device_reserve_mb=0, **settings)
    return compile_step(fe, transformer_block, (), SIZES, s, mesh=(2,), plugins=PluginManager())


def test_on_a_cpu_no_budget_binds_and_explain_says_so(cache):
    res = _compile(cache, None)
    assert res.plan.stats.peak_with_buffers == PLAIN_PEAK
    assert res.plan.stats.budget["bytes"] is None and "CPU" in res.plan.stats.budget["source"]
    assert "memory budget: no limit, from none" in explain_plan(res.plan, presets=False, problem=res.problem)


def test_the_device_memory_is_the_budget_when_none_is_set(cache):
    memory = 355_000  # below the plain plan's peak, above the leanest plan's
    res = _compile(cache, memory)
    b = res.plan.stats.budget
    assert b["bytes"] == memory and not b["explicit"] and "CUDA device's memory" in b["source"]
    assert res.plan.stats.peak_with_buffers <= memory < PLAIN_PEAK
    text = explain_plan(res.plan, presets=False, problem=res.problem)
    assert "memory budget: " in text and "CUDA device's memory" in text


def test_a_device_with_room_keeps_the_plan_without_a_budget(cache):
    res = _compile(cache, 10 * PLAIN_PEAK)
    assert res.plan.stats.peak_with_buffers == PLAIN_PEAK  # the same plan as with no budget at all
    assert res.plan.stats.budget["bytes"] == 10 * PLAIN_PEAK


def test_an_explicit_budget_wins_over_the_device(cache):
    res = _compile(cache, 355_000, memory_budget=10 * PLAIN_PEAK)
    assert res.plan.stats.budget == {"bytes": 10 * PLAIN_PEAK, "source": "memory_budget, as set", "explicit": True}


def test_no_plan_fits_the_device_an_error_with_the_least_memory_and_what_to_change(cache):
    with pytest.raises(InfeasibleBudgetError) as err:
        _compile(cache, 200_000)
    msg = str(err.value)
    assert "200,000" in msg and "the plan with the least memory needs" in msg
    assert "CUDA device's memory" in msg and "larger mesh" in msg and "offload='optimizer'" in msg
    assert "micro_batches" in msg


def test_plan_only_takes_the_device_presets_memory(cache, tmp_path):
    small_a100 = dataclasses.replace(DEVICE_PRESETS["a100"], memory_bytes=355_000)
    prof = tmp_path / "a100.json"
    prof.write_text(json.dumps(MeshProfile(device=small_a100).to_json()))
    out = tmp_path / "p.plan.json"
    fe = ReferenceFrontend()
    req = planonly.PlanOnly(mesh=(2,), out=str(out), cache_dir=str(cache), profile=str(prof))
    with planonly.plan_only(req), pytest.raises(planonly.PlanOnlyDone):
        compile_step(fe, transformer_block, (), SIZES, load_settings(progress=False, device_reserve_mb=0))
    stats = json.loads(out.read_text())["stats"]
    assert stats["budget"]["bytes"] == 355_000 and "device preset a100" in stats["budget"]["source"]
    assert stats["peak_with_buffers"] <= 355_000


def test_the_reserve_comes_off_the_device_and_presets_but_not_a_cpu():
    s = load_settings(progress=False)
    reserve = int(s.device_reserve_mb * 2**20)
    assert plan_budget(s, None, 80 * 2**30).bytes == 80 * 2**30 - reserve
    assert plan_budget(s, DEVICE_PRESETS["h100"]).bytes == DEVICE_PRESETS["h100"].memory_bytes - reserve
    assert plan_budget(s, DEVICE_PRESETS["cpu"]).bytes is None
    measured = dataclasses.replace(DEVICE_PRESETS["a100"], name="measured-cuda")  # its memory_bytes is a default
    assert plan_budget(s, measured).bytes is None
    assert plan_budget(load_settings(memory_budget=123, progress=False), DEVICE_PRESETS["h100"], 2**40).bytes == 123


def test_a_budget_is_solved_under_its_headroom_first(cache, monkeypatch):
    """The solver is asked for the budget less the headroom the plan must leave free (a plan filling the whole
    budget would be solved again); a plan without buffers at its peak is then solved once, and an error still
    names the budget as set."""
    from metadist_core.driver import planner
    from metadist_core.plan.memprofile import HEADROOM

    asked = []
    real = planner.GraphPlanner._solve
    monkeypatch.setattr(planner.GraphPlanner, "_solve", lambda self, p: asked.append(p.memory_budget) or real(self, p))
    budget = 355_000
    res = _compile(cache, None, memory_budget=budget)
    assert asked == [int(budget * (1 - HEADROOM))]
    assert res.plan.stats.peak_with_buffers <= budget * (1 - HEADROOM)
    with pytest.raises(InfeasibleBudgetError) as err:
        _compile(cache, None, memory_budget=200_000)
    assert "200,000" in str(err.value) and str(int(200_000 * (1 - HEADROOM))) not in str(err.value).replace(",", "")
