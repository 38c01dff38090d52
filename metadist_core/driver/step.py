"""The compiled step a user calls: each new call signature is traced, planned and lowered once through
:func:`~metadist_core.driver.compile.compile_step`; guards choose among the programs kept."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, Hashable, Iterable

from metadist_core.config import load_settings
from metadist_core.driver.frontend import (
    Frontend,
)

# planning a traced graph (re-exported: tools, benchmarks and tests import these from here)
from metadist_core.driver.planner import CompileResult
from metadist_core.ir.ir import MetaIR
from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager
from metadist_core.problem.constraints import as_constraint_list
from metadist_core.driver.compile import compile_step

log = logging.getLogger("metadist.pipeline")


class CompiledStep:
    """A step compiled by MetaDist for one frontend: call it like the original step.

    Each new call signature (as the frontend defines it) is traced, planned and
    lowered once through :func:`compile_step`. ``.plan``, ``.graph``,
    ``.timings``, ``.problem`` and ``.mesh`` describe the last compile used.
    """

    def __init__(
        self,
        frontend: Frontend,
        fn: Callable | None,
        *,
        mesh: Any = None,
        constraints: Iterable[Any] | None = None,
        solver_options: dict | None = None,
        plugins: PluginManager | None = None,
        **settings: Any,
    ) -> None:
        if fn is not None:
            functools.update_wrapper(self, fn)
        self.fn = fn
        self.frontend = frontend
        self.mesh_arg = mesh
        self.constraints = as_constraint_list(constraints)
        self.solver_options = dict(solver_options or {})
        self.plugins = plugins
        self.settings = load_settings(**settings)
        (plugins or PluginManager()).solver(self.settings.solver)  # an unknown solver fails at decoration
        # per call signature: its compiled programs, the one run last first (at most settings.guard_cache)
        self.cache: dict[Hashable, list[CompileResult]] = {}
        self.last: CompileResult | None = None
        self.replans = 0  # compiles made because a guard failed (not for a new signature)
        self.replan_reasons: list[str] = []

    def compile(self, *args: Any, **kwargs: Any) -> CompileResult:
        """The compiled program for these arguments, without running it: the one of their signature whose
        guards hold (every process deciding alike), else a new trace, plan and lowering."""
        key = self.frontend.signature(args, kwargs)
        entries = self.cache.setdefault(key, [])
        choice, reason = self._choose(entries, args, kwargs)
        if choice >= 0:
            hit = entries.pop(choice)
        else:
            if entries:
                self._replanned(reason or "a guard failed")
            hit = compile_step(
                self.frontend,
                self.fn,
                args,
                kwargs,
                self.settings,
                mesh=self.mesh_arg,
                plugins=self.plugins,
                constraints=self.constraints,
                solver_options=self.solver_options,
            )
        entries.insert(0, hit)
        del entries[self.settings.guard_cache :]
        self.last = hit
        return hit

    def _choose(self, entries: list[CompileResult], args: tuple, kwargs: dict) -> tuple[int, str | None]:
        """The index of the first entry whose guards hold (-1: none) and, where one failed, what changed.
        Every process takes the same decision or raises (``sync_guards``)."""
        choice, reason = -1, None
        for i, res in enumerate(entries):
            why = res.watch.failed(args, kwargs, res is not self.last) if res.watch is not None else None
            if why is None:
                choice = i
                break
            reason = reason or why
        if entries and entries[0].watch is not None and self.settings.sync_guards:
            entries[0].watch.agree((choice, len(entries)))
        return choice, reason

    def _replanned(self, reason: str) -> None:
        name = getattr(self.fn, "__name__", "step")
        self.replans += 1
        self.replan_reasons.append(reason)
        log.info("re-planning %s: %s", name, reason)
        if self.replans == self.settings.max_replans + 1:
            warnings.warn(
                f"metadist: {name} has re-planned {self.replans} times (max_replans="
                f"{self.settings.max_replans}): the loop changes what the compiled program depends on "
                f"between calls, and each change costs a new plan. The guard that failed last: {reason}. "
                f"Keep it fixed between calls, or raise max_replans to silence this.",
                stacklevel=3,
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        res = self.compile(*args, **kwargs)
        if res.runnable is None:
            raise RuntimeError(
                f"the compile of {getattr(self.fn, '__name__', 'the step')} gave a plan but no "
                "runnable program (a plan-only compile); call compile() for the plan, or run "
                "without plan-only mode to run the step"
            )
        return res.runnable(*args, **kwargs)

    @property
    def plan(self) -> Any:
        """The ShardingPlan of the last compile (None before the first call)."""
        return None if self.last is None else self.last.plan

    @property
    def graph(self) -> MetaIR | None:
        return None if self.last is None else self.last.graph

    @property
    def problem(self) -> Any:
        return None if self.last is None else self.last.problem

    @property
    def mesh(self) -> Mesh | None:
        return None if self.last is None else self.last.mesh

    @property
    def runnable(self) -> Callable | None:
        return None if self.last is None else self.last.runnable

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of the last compile: trace, discover, build_problem, solve, share, lower."""
        return {} if self.last is None else dict(self.last.timings)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", "step")
        n = sum(len(v) for v in self.cache.values())
        return f"<CompiledStep {name} ({self.frontend.name}), {n} compiled, {self.replans} re-planned>"


__all__ = ["CompiledStep"]
