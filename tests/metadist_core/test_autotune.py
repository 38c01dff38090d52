"""metadist_core.driver.autotune: plans timed side by side, the solver's kept unless another is clearly faster."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from unittest import mock

import pytest

from metadist_core.driver import autotune
from metadist_core.driver.autotune import Candidate, Trial, pick, skip_reason, time_trials, tune
from metadist_core.config import load_settings
from metadist_core.plan.planstats import PlanStats


@dataclass
class FakePlan:
    name: str
    objective: float = 0.010
    stats: PlanStats = field(default_factory=PlanStats)
    stages: list = field(default_factory=list)
    recompute: list = field(default_factory=list)


@dataclass
class FakeResult:
    plan: FakePlan


def _sleeper(seconds: float, calls: list, name: str) -> Trial:
    def run():
        calls.append(name)
        time.sleep(seconds)

    return Trial(run, runnable=name)


def test_the_preset_that_runs_faster_is_kept_and_its_figures_recorded():
    calls: list = []
    auto = FakeResult(FakePlan("auto", 0.005))
    presets = {"ddp": FakeResult(FakePlan("ddp", 0.020)), "fsdp": FakeResult(FakePlan("fsdp", 0.006))}
    slow = {"auto": 0.012, "ddp": 0.002, "fsdp": 0.008}  # the model ranks them the other way round
    chosen, trial = tune(
        auto, presets.__getitem__, lambda p: _sleeper(slow[p.name], calls, p.name), lambda p: p.name, rounds=3
    )
    assert chosen is presets["ddp"] and trial.runnable == "ddp"
    fig = chosen.plan.stats.autotune
    assert fig["chosen"] == "ddp"
    got = {c["strategy"]: c for c in fig["candidates"]}
    assert set(got) == {"auto", "ddp", "fsdp"}
    assert got["ddp"]["measured_ms"] < got["fsdp"]["measured_ms"] < got["auto"]["measured_ms"]
    assert got["ddp"]["predicted_ms"] == pytest.approx(20.0)
    # one warm-up each, then 3 rounds of all three
    assert sorted(calls.count(n) for n in ("auto", "ddp", "fsdp")) == [4, 4, 4]
    assert auto.plan.stats.autotune is None


def test_the_solvers_plan_stays_within_the_margin():
    a, b = Candidate("auto", None, seconds=0.100), Candidate("ddp", None, seconds=0.097)
    assert pick([a, b], margin=0.05) is a
    b.seconds = 0.090
    assert pick([a, b], margin=0.05) is b
    assert pick([Candidate("auto", None)]).name == "auto"


def test_a_plan_seen_before_or_a_preset_without_a_plan_is_not_timed_twice():
    calls: list = []
    auto = FakeResult(FakePlan("same"))

    def solve(name):
        if name == "fsdp":
            raise RuntimeError("no plan fits")
        return FakeResult(FakePlan("same"))  # ddp gives the solver's plan

    chosen, trial = tune(auto, solve, lambda p: _sleeper(0.0, calls, p.name), lambda p: p.name)
    assert chosen is auto and calls == [] and trial.runnable == "same"
    assert auto.plan.stats.autotune is None


def test_nothing_is_solved_when_the_frontend_cannot_time_a_plan():
    solved: list = []
    auto = FakeResult(FakePlan("auto"))
    chosen, trial = tune(auto, lambda n: solved.append(n), lambda p: None, lambda p: p.name)
    assert chosen is auto and trial is None and solved == []


def test_rounds_alternate_their_order():
    calls: list = []
    trials = [_sleeper(0.0, calls, n) for n in "abc"]
    ticks = iter(range(1000))
    out = time_trials(trials, rounds=2, clock=lambda: next(ticks))
    assert calls == list("abc") + list("abc") + list("cba")
    assert out == [1, 1, 1]


class _Scripted:
    """Trials on a simulated clock: each run of trial ``name`` advances it by the next of its ``durations``."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now, self.calls, self.left = 0.0, [], {k: list(v) for k, v in durations.items()}

    def clock(self) -> float:
        return self.now

    def trial(self, name: str) -> Trial:
        def run():
            self.calls.append(name)
            self.now += self.left[name].pop(0)

        return Trial(run, runnable=name)


def test_near_ties_are_timed_again_and_decided_on_all_their_rounds():
    """After the rounds, the trials within ``refine_within`` of the fastest run ``refine_rounds`` more among
    themselves; a trial far behind runs no more. Here b looks 1 % faster than a in the first three rounds
    and is 4 % slower in the three after: over all six rounds a is the faster."""
    s = _Scripted({"a": [9.0] + [1.00] * 6, "b": [9.0] + [0.99] * 3 + [1.04] * 3, "c": [9.0] + [2.0] * 3})
    trials = [s.trial(n) for n in "abc"]
    runs: list = []
    out = time_trials(trials, rounds=3, clock=s.clock, refine_rounds=3, refine_within=0.08, counts=runs)
    assert [s.calls.count(n) for n in "abc"] == [1 + 3 + 3, 1 + 3 + 3, 1 + 3] and runs == [6, 6, 3]
    assert s.calls[-6:] == list("ab") + list("ba") + list("ab")  # the extra rounds alternate too
    assert out[0] == pytest.approx(1.00) and out[1] == pytest.approx((0.99 + 1.04) / 2) and out[2] == 2.0
    assert out[0] < out[1]

    s = _Scripted({"a": [9.0] + [1.0] * 3, "b": [9.0] + [1.2] * 3})  # no near-tie: nothing more is run
    out = time_trials([s.trial("a"), s.trial("b")], rounds=3, clock=s.clock, refine_rounds=3, refine_within=0.08)
    assert len(s.calls) == 2 + 6 and out == pytest.approx([1.0, 1.2])


def test_tune_times_near_ties_again():
    """``tune`` refines: the preset timed 2 % behind the solver's plan in the first rounds, and ahead of it
    by 10 % over all of them, is kept, with the refinement recorded in the figures."""
    auto = FakeResult(FakePlan("auto"))
    presets = {"ddp": FakeResult(FakePlan("ddp")), "fsdp": FakeResult(FakePlan("fsdp"))}
    rounds, more = 10, 10
    s = _Scripted(
        {
            "auto": [9.0] + [1.0] * (rounds + more),
            "ddp": [9.0] + [1.02] * rounds + [0.5] * more,
            "fsdp": [9.0] + [3.0] * rounds,
        }
    )
    with mock.patch.object(autotune.time, "perf_counter", s.clock):
        chosen, trial = tune(
            auto, presets.__getitem__, lambda p: s.trial(p.name), lambda p: p.name, rounds=rounds, seconds=None
        )
    assert chosen is presets["ddp"] and trial.runnable == "ddp"
    fig = chosen.plan.stats.autotune
    assert fig["refine_rounds"] == autotune.REFINE_ROUNDS == more
    assert s.calls.count("fsdp") == 1 + rounds and s.calls.count("ddp") == 1 + rounds + more
    assert {c["strategy"]: c["runs"] for c in fig["candidates"]} == {
        "auto": rounds + more,
        "ddp": rounds + more,
        "fsdp": rounds,
    }


def test_a_spent_time_budget_leaves_the_rest_untimed_but_the_solvers_plan():
    """``autotune_seconds``: a trial not yet compiled when the budget is spent is left out, and no round
    starts past the third; the first trial (the solver's plan) always runs."""
    calls: list = []
    trials = [_sleeper(0.0, calls, n) for n in "abcd"]
    now = [0.0]

    def clock() -> float:  # each reading moves it by 4 s: by the third warm-up 8 s of the 6 s budget are gone
        now[0] += 4.0
        return now[0]

    out = time_trials(trials, rounds=10, clock=clock, budget=6.0)
    assert out[2:] == [None, None] and out[0] is not None and out[1] is not None
    assert calls[:2] == ["a", "b"] and set(calls) == {"a", "b"}
    assert calls.count("a") == 1 + 3  # its warm-up, then three rounds only

    calls.clear()
    out = time_trials(trials, rounds=2, clock=lambda: 0.0, budget=10.0)  # within it: every trial, every round
    assert all(t is not None for t in out) and len(calls) == 4 * 3


def test_the_time_budget_must_be_positive():
    with pytest.raises(ValueError, match="autotune_seconds"):
        load_settings(autotune_seconds=0)
    assert load_settings().autotune_seconds == 60.0


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(autotune=False), "autotune=False"),
        (dict(measure_links=False), "measure_links=False"),
        (dict(strategy="fsdp"), "strategy='fsdp'"),
        (dict(micro_batches=2), "micro-batches"),
    ],
)
def test_a_users_own_choice_is_never_second_guessed(change, why):
    base = dict(autotune=True, measure_links=True)
    s = load_settings(**{**base, **change})
    assert why in skip_reason(s, FakePlan("p"), [])
    assert skip_reason(load_settings(**base), FakePlan("p"), []) is None
    assert "constraints" in skip_reason(load_settings(**base), FakePlan("p"), ["w: S(0)"])
    assert "recomputes" in skip_reason(load_settings(**base), FakePlan("p", recompute=["op"]), [])


def test_a_plan_the_engine_refuses_is_left_out_not_raised():
    calls: list = []
    auto = FakeResult(FakePlan("auto"))
    presets = {"ddp": FakeResult(FakePlan("ddp")), "fsdp": FakeResult(FakePlan("fsdp"))}

    def make(plan):
        if plan.name == "fsdp":
            raise RuntimeError("cannot lower this plan")
        if plan.name == "ddp":

            def boom():
                raise RuntimeError("XLA refused it")

            return [_sleeper(0.004, calls, "ddp-ok"), Trial(boom, runnable="ddp-bad", lowering="other")]
        return _sleeper(0.008, calls, "auto")

    chosen, trial = tune(auto, presets.__getitem__, make, lambda p: p.name, rounds=3)
    assert chosen is presets["ddp"] and trial.runnable == "ddp-ok"
    got = [(c["strategy"], c["lowering"]) for c in chosen.plan.stats.autotune["candidates"]]
    assert got == [("auto", ""), ("ddp", "")]  # the failing lowering and the unlowerable preset are gone


def test_when_nothing_runs_the_solvers_plan_is_lowered_as_before():
    def boom():
        raise RuntimeError("no")

    auto = FakeResult(FakePlan("auto"))
    chosen, trial = tune(auto, lambda n: FakeResult(FakePlan(n)), lambda p: Trial(boom), lambda p: p.name, rounds=2)
    assert chosen is auto and trial is None and auto.plan.stats.autotune is None
