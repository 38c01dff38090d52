"""Measured choice of plan: the solver's plan timed beside the strategy presets' plans on the live mesh.

The cost model ranks plans by their price. Where the price is wrong (JAX on
virtual CPU devices: XLA fuses what the model prices op by op), the solver's
plan can run slower than a preset the user would have picked. With
``autotune`` on and costs measured (``measure_links``), the driver also solves
the presets of :data:`PRESETS` on the same problem, asks the frontend for a
:class:`Trial` of every distinct plan (lowered, run on the step's own
arguments, nothing kept; a frontend with several lowerings gives one trial
for each: JAX runs a plan as a manual shard_map or, two ways, through GSPMD), times them
in interleaved rounds, times the near-ties again among themselves
(:data:`REFINE_WITHIN`, :data:`REFINE_ROUNDS`) and keeps the fastest. The
solver's plan in the frontend's first lowering stays unless another is faster
by more than :data:`MARGIN` (the rounds' noise on shared cores).

Only frontends that can run a plan on the planning process alone take part
(``Frontend.lower`` of :class:`~metadist_core.driver.frontend.Trials`): JAX in one process. The
figures are kept in ``plan.stats.autotune`` and shown by ``str(plan)``'s
summary line.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence
import dataclasses
from metadist_core.progress import Ticker

log = logging.getLogger("metadist.autotune")

#: the presets timed beside the solver's plan (metadist_core.problem.presets): what a user would write by hand.
#: zero1 (parameters replicated, optimizer state split): each device updates only its share of the state, so
#: its program can beat jax.jit's data parallelism, where the ddp plan can only tie it
PRESETS = ("ddp", "zero1", "fsdp")
#: a preset replaces the solver's plan only when it is this much faster (relative, medians of the rounds)
MARGIN = 0.05
#: timed rounds; each runs every trial once, in alternating order (too few rounds let the noise of shared
#: cores pick a slower plan)
ROUNDS = 10
#: rounds run however long they take (past them, a spent ``autotune_seconds`` stops the timing)
MIN_ROUNDS = 3
#: after the rounds, the trials whose median is within this of the fastest's are timed again, alone together
#: (near-ties within the rounds' noise are decided on more timings)
REFINE_WITHIN = 0.08
#: the rounds those near-ties get on top (their medians are then taken over all their rounds)
REFINE_ROUNDS = 10


@dataclass
class Trial:
    """One plan made runnable for timing: ``run()`` runs one step and returns when it is done, leaving the
    user's arguments as they were; ``runnable`` is what the frontend's ``lower`` gives for the plan (the
    driver keeps it when the plan wins, so the winner is not lowered twice), or None."""

    run: Callable[[], Any]
    runnable: Callable | None = None
    lowering: str = ""  # which of the frontend's lowerings of the plan (JAX: shard_map, gspmd)


@dataclass
class Candidate:
    """A plan in the running: where it came from (``"auto"`` or a preset) and, once timed, its step."""

    name: str
    result: Any  # the CompileResult of its solve
    trial: Trial | None = None
    seconds: float | None = None
    runs: int = 0  # its timed runs (near-ties get more: REFINE_ROUNDS)

    @property
    def label(self) -> str:
        low = self.trial.lowering if self.trial is not None else ""
        return f"{self.name} ({low})" if low else self.name

    def runnable(self) -> Trial:
        """Its trial, which every candidate handed to the timing has."""
        if self.trial is None:
            raise RuntimeError(
                f"autotune candidate {self.label!r} has no trial to time; candidates are made "
                "from trials, so this is a bug in metadist_core.driver.autotune"
            )
        return self.trial

    def measured(self) -> float:
        """Its median seconds, which every candidate kept after the timing has."""
        if self.seconds is None:
            raise RuntimeError(
                f"autotune candidate {self.label!r} was kept without a time; only timed "
                "candidates are kept, so this is a bug in metadist_core.driver.autotune"
            )
        return self.seconds


def _as_trials(made: Any) -> list[Trial]:
    """What ``make_trial`` gave, as a list: a Trial, several (one per lowering of the plan), or None."""
    if made is None:
        return []
    return list(made) if isinstance(made, (list, tuple)) else [made]


def skip_reason(settings: Any, plan: Any, user_constraints: Sequence[Any]) -> str | None:
    """Why the plans are not timed for this compile (None: they are)."""
    s = settings
    if not s.autotune:
        return "autotune=False"
    if not s.measure_links:
        return "costs are not measured (measure_links=False)"
    if s.strategy != "auto":
        return f"the user chose strategy={s.strategy!r}"
    if user_constraints:
        return f"the user gave {len(user_constraints)} constraints"
    if s.micro_batches > 1 or getattr(plan, "stages", None) or getattr(plan, "recompute", None) or s.offload:
        return "the plan accumulates micro-batches, pipelines, recomputes or offloads"
    return None


def time_trials(
    trials: Sequence[Trial],
    rounds: int = ROUNDS,
    clock: Callable[[], float] | None = None,
    budget: float | None = None,
    refine_rounds: int = 0,
    refine_within: float = REFINE_WITHIN,
    counts: list[int] | None = None,
) -> list[float | None]:
    """Median seconds of one step of each trial: one untimed run each (compiles, warms), then ``rounds``
    rounds that run every trial once, forwards and backwards in turn so none always goes first. A trial that
    raises is left out from then on (None): a lowering the engine refuses is not the user's error.

    ``refine_rounds``: then the trials whose median is within ``refine_within`` (relative) of the fastest's,
    where there are two or more, run that many rounds more among themselves, and their medians are taken over
    all their rounds: a choice between near-ties rests on twice the timings, the slower trials cost no more.
    ``counts``, where given, receives how many timed runs each trial had.

    ``budget`` (seconds, from this call): once spent, trials not yet warmed up are left out (the first
    always runs: it is the solver's plan) and no round starts past :data:`MIN_ROUNDS`, so that a model
    whose programs take long to compile is not held up by a dozen of them."""
    timer = _TrialTimer(trials, clock or time.perf_counter, budget)
    timer.warm_up()
    timer.run_rounds(list(range(len(trials))), rounds)
    med = timer.medians()
    timed = [m for m in med if m is not None]
    if refine_rounds > 0 and timed and not timer.spent():
        near = [i for i, m in enumerate(med) if m is not None and m <= min(timed) * (1.0 + refine_within)]
        if len(near) > 1:
            log.info(
                "autotune: %d programs within %.0f %% of the fastest, timed %d rounds more",
                len(near),
                refine_within * 100,
                refine_rounds,
            )
            timer.run_rounds(near, refine_rounds)
            med = timer.medians()
    if counts is not None:
        counts[:] = [len(x) for x in timer.times]
    return med


class _TrialTimer:
    """The runs of :func:`time_trials`: which trials still run, each one's timed seconds, the budget."""

    def __init__(self, trials: Sequence[Trial], clock: Callable[[], float], budget: float | None) -> None:
        self.trials, self.clock, self.budget = trials, clock, budget
        self.ok = [True] * len(trials)
        self.times: list[list[float]] = [[] for _ in trials]
        self.start = clock()

    def spent(self) -> bool:
        return self.budget is not None and self.clock() - self.start > self.budget

    def attempt(self, i: int) -> bool:
        """Run trial ``i`` once; one that raises is left out from then on."""
        try:
            self.trials[i].run()
            return True
        except Exception as e:
            log.warning(
                "autotune: a trial (%s) failed and is left out: %s: %s",
                self.trials[i].lowering or "plan",
                type(e).__name__,
                e,
            )
            self.ok[i] = False
            return False

    def warm_up(self) -> None:
        """One untimed run of each trial (the first always; the others while the budget lasts)."""
        n = len(self.trials)
        for i in range(n):
            if i > 0 and self.spent():
                log.warning(
                    "autotune: %d of %d programs left untimed: autotune_seconds ran out (%.0f s of it were "
                    "left for compiling and timing them once the other plans were solved and lowered; raise "
                    "autotune_seconds to time them all)",
                    n - i,
                    n,
                    self.budget,
                )
                self.ok[i:] = [False] * (n - i)
                break
            self.attempt(i)

    def run_rounds(self, which: list[int], n: int) -> None:
        """``n`` timed rounds over ``which``, forwards and backwards in turn."""
        for r in range(n):
            if r >= MIN_ROUNDS and self.spent():
                log.info("autotune: timing stopped after %d of %d rounds (autotune_seconds spent)", r, n)
                break
            for i in which if r % 2 == 0 else which[::-1]:
                if not self.ok[i]:
                    continue
                t0 = self.clock()
                if self.attempt(i):
                    self.times[i].append(self.clock() - t0)

    def medians(self) -> list[float | None]:
        return [statistics.median(x) if self.ok[i] and x else None for i, x in enumerate(self.times)]


def _trials_of(make_trial: Callable[[Any], Any], plan: Any, name: str) -> list[Trial]:
    """The trials of ``plan``; none where the frontend cannot make them (logged: the plan is left out)."""
    try:
        return _as_trials(make_trial(plan))
    except Exception as e:
        log.warning("autotune: plan %r could not be made runnable and is left out: %s: %s", name, type(e).__name__, e)
        return []


def pick(candidates: Sequence[Candidate], margin: float = MARGIN) -> Candidate:
    """The solver's plan in the frontend's first lowering (the first candidate) unless a timed one is faster
    than it by more than ``margin``."""
    timed = [c for c in candidates if c.seconds is not None]
    if not timed:
        return candidates[0]
    best = min(timed, key=lambda c: c.measured())
    first = candidates[0]
    if first.seconds is None or best is first or best.measured() < first.seconds * (1.0 - margin):
        return best
    return first


def _figures(
    chosen: Candidate, cands: Sequence[Candidate], margin: float, rounds: int, t_start: float
) -> dict[str, Any]:
    """What ``plan.stats.autotune`` records: the candidates timed and the one kept."""
    return {
        "chosen": chosen.name,
        "lowering": chosen.runnable().lowering,
        "margin": margin,
        "rounds": rounds,
        "refine_rounds": REFINE_ROUNDS,
        "refine_within": REFINE_WITHIN,
        "seconds": time.perf_counter() - t_start,
        "candidates": [
            {
                "strategy": c.name,
                "lowering": c.runnable().lowering,
                "measured_ms": c.measured() * 1e3,
                "predicted_ms": c.result.plan.objective * 1e3,
                "runs": c.runs,
            }
            for c in cands
        ],
    }


def _distinct_presets(
    auto: Any, solve_preset: Callable[[str], Any], digest: Callable[[Any], str], presets: Sequence[str]
) -> list[Candidate]:
    """The presets' results worth timing beside the solver's: each solved, plain (no pipeline, no recompute),
    and a plan no earlier candidate has."""
    seen = {digest(auto.plan)}
    out = []
    for name in presets:
        try:
            res = solve_preset(name)
        except Exception as e:  # a preset that does not fit the budget, or has no plan on this mesh
            log.info("autotune: preset %r left out: %s", name, e)
            continue
        if res.plan.stages or res.plan.recompute:
            log.info("autotune: preset %r left out: its plan pipelines or recomputes", name)
            continue
        d = digest(res.plan)
        if d in seen:
            log.info("autotune: preset %r gives the solver's plan (or an earlier preset's)", name)
            continue
        seen.add(d)
        out.append(Candidate(name, res))
    return out


def tune(
    auto: Any,
    solve_preset: Callable[[str], Any],
    make_trial: Callable[[Any], Trial | None],
    digest: Callable[[Any], str],
    presets: Sequence[str] = PRESETS,
    rounds: int = ROUNDS,
    margin: float = MARGIN,
    seconds: float | None = None,
) -> tuple[Any, Trial | None]:
    """The CompileResult to run, among the solver's (``auto``) and the presets', and its trial.

    ``solve_preset(name)`` solves the same problem under a preset (an exception: that preset is left out);
    ``make_trial(plan)`` gives the plan's Trial or None (the frontend cannot time it: nothing is tuned);
    ``digest(plan)`` says which plans are the same. ``seconds``: the time autotune may take in all (the
    presets' solves included; see :func:`time_trials`). The figures go to ``plan.stats.autotune`` of the
    plan kept.
    """
    t_start = time.perf_counter()
    first = _trials_of(make_trial, auto.plan, "auto")
    if not first:  # asked first, so that no preset is solved for nothing
        log.info("autotune: the frontend cannot time a plan here; keeping the solver's plan")
        return auto, None
    cands = [Candidate("auto", auto, t) for t in first]
    plans = [Candidate("auto", auto)] + _distinct_presets(auto, solve_preset, digest, presets)
    for c in plans[1:]:
        made = _trials_of(make_trial, c.result.plan, c.name)
        if not made:
            log.info("autotune: the frontend cannot time plan %r here; left out", c.name)
        cands += [Candidate(c.name, c.result, t) for t in made]
    if len(cands) == 1:
        return auto, cands[0].trial
    left = None if seconds is None else max(0.0, seconds - (time.perf_counter() - t_start))
    runs: list[int] = []
    secs = time_trials([c.runnable() for c in cands], rounds, budget=left, refine_rounds=REFINE_ROUNDS, counts=runs)
    for c, sec, n in zip(cands, secs, runs):
        c.seconds, c.runs = sec, n
    cands = [c for c in cands if c.seconds is not None] or cands[:1]
    if cands[0].seconds is None:  # nothing ran: the driver lowers the solver's plan as it would have
        return auto, None
    chosen = pick(cands, margin)
    chosen.result.plan.stats.autotune = _figures(chosen, cands, margin, rounds, t_start)
    log.info(
        "autotune: %s",
        "; ".join(
            f"{c.label} {c.measured() * 1e3:.2f} ms measured ({c.result.plan.objective * 1e3:.2f} predicted)"
            for c in cands
        )
        + f"; running {chosen.label!r}",
    )
    return chosen.result, chosen.trial


def autotune_result(
    res: Any,
    mesh: Any,
    s: Any,
    user_constraints: Sequence[Any],
    solve_on: Callable[..., Any],
    make_trials: Callable[[Any], Any],
    timings: dict[str, float],
) -> tuple[Any, Trial | None]:
    """For the driver (:func:`metadist_core.driver.compile.compile_step`): the solver's CompileResult ``res``, or a
    preset's that ran faster when both were timed, and the kept plan's trial (None when nothing was timed).
    ``solve_on(mesh, settings)`` solves the compile's problem under other settings; ``make_trials(plan)``
    gives the frontend's trials of a plan (its ``lower`` of :class:`~metadist_core.driver.frontend.Trials`)."""

    why = skip_reason(s, res.plan, user_constraints) if mesh.size > 1 else "one device"
    if why is not None:
        log.debug("autotune: not timing plans: %s", why)
        return res, None
    t = time.perf_counter()
    # a preset that only fits the budget by recomputing is left out (autotune skips recomputing plans), so it
    # is solved without the segment search
    with Ticker("autotune (solving the presets, timing the plans)", enabled=s.progress):
        chosen, trial = tune(
            res,
            lambda name: solve_on(mesh, dataclasses.replace(s, strategy=name, recompute=False)),
            make_trials,
            lambda p: p.digest(),
            seconds=s.autotune_seconds,
        )
    timings["autotune"] = time.perf_counter() - t
    return chosen, trial


__all__ = [
    "Candidate",
    "MARGIN",
    "MIN_ROUNDS",
    "PRESETS",
    "REFINE_ROUNDS",
    "REFINE_WITHIN",
    "ROUNDS",
    "Trial",
    "autotune_result",
    "pick",
    "skip_reason",
    "time_trials",
    "tune",
]
