"""How a compile prices its plans: the mesh profile (measured links and device, cached per host), the
ops' measured slowdowns and the local timer, for :func:`metadist_core.driver.compile.compile_step`."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Mapping

from metadist_core.config import Settings
from metadist_core.cost.localtime import LocalTimer
from metadist_core.cost.profile import MeshProfile
from metadist_core.driver.frontend import Frontend, Resolved, Traced
from metadist_core.ir.ir import MetaIR
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.mesh import DEFAULT_ALPHA, DEFAULT_BETA
from metadist_core.cost.profile import profile_for
from metadist_core.cost.profile import beside_profile
from metadist_core.cost.model import DEVICE_PRESETS
from metadist_core.cost.optimes import whole_slowdowns
from metadist_core.discovery.rules import RuleBook
from metadist_core.driver.job import Job
from metadist_core.driver.planner import CompileResult, plan_graph, replicated_plan


@dataclass
class Pricing:
    """How a compile prices its plans: the profile its links and device come from (None: the built-in
    costs on one device), the device of a one-device step the frontend measured, and the ops' timers."""

    profile: MeshProfile | None = None
    one_device: Any = None
    op_times: "OpTimer | None" = None
    local_timer: LocalTimer | None = None
    device_memory: int | None = None  # bytes of the device the step runs on (Resolved.device_memory)


@dataclass
class OpTimer:
    """The ops' measured slowdowns at their whole shapes (:mod:`metadist_core.cost.optimes`) from the
    frontend's ``time_ops``, timed once per compile (every mesh a pipeline search tries reads them)."""

    frontend: Frontend
    resolved: Resolved
    traced: Traced
    cache_file: str | None = None
    measured: dict[str, float] | None = None

    def __call__(self, graph: MetaIR, costs: dict) -> Mapping[str, float]:
        if self.measured is None:
            traced = self.traced if self.traced.graph is graph else None

            def time_ops(requests: list, program: bool) -> Any:
                return self.frontend.time_ops(requests, self.resolved, traced, program)

            self.measured = dict(
                whole_slowdowns(
                    graph,
                    costs,
                    time_ops,
                    self.cache_file,
                    skip=self.frontend.traits.times_local,
                    program=traced is not None,
                )
                or {}
            )
        return self.measured


def _own_link_costs(mesh: Any) -> bool:
    """Is ``mesh`` a metadist Mesh whose link costs differ from the built-in ones (set by its maker)?"""
    return isinstance(mesh, Mesh) and (
        any(a != DEFAULT_ALPHA for a in mesh.alpha) or any(b != DEFAULT_BETA for b in mesh.beta) or bool(mesh.links)
    )


def price(job: Job, traced: Traced, resolved: Resolved, mesh_arg: Any) -> tuple[Pricing, Resolved]:
    """How this compile prices plans (:class:`Pricing`) and the mesh priced so: costs measured by default
    on several devices, cached per host, world size and device kind. A metadist Mesh given as ``mesh_arg``
    with link costs of its own keeps them (a mesh built from a calibrated profile is priced with that
    profile's costs, even when the frontend measures none); one with the built-in costs takes the measured
    ones."""
    s, fe = job.settings, job.frontend
    pricing = Pricing(device_memory=resolved.device_memory)
    if resolved.mesh.size > 1:
        t = time.perf_counter()
        pricing.profile = profile_for(fe, resolved, s)
        if not _own_link_costs(mesh_arg):
            resolved = resolved.priced(pricing.profile.mesh(resolved.mesh.shape, resolved.mesh.axis_names))
        job.timings["profile"] = time.perf_counter() - t
    elif not replicated_only(resolved.mesh, s):
        measured = fe.measure_profile(resolved, None, traced)  # a one-device step's own device (a GPU)
        pricing.one_device = measured.device if measured is not None else None
    is_measured = getattr(pricing.profile, "measured", False)
    key = getattr(pricing.profile, "key", None)
    if is_measured or pricing.one_device is not None:  # measured costs price the ops as measured too
        pricing.op_times = OpTimer(fe, resolved, traced, _beside(s, key, "-ops.json"))
    if is_measured and s.local_time_seconds > 0:  # one timer for every plan of this compile
        pricing.local_timer = LocalTimer(
            fe.traits.times_local,
            functools.partial(_local_times, fe, resolved),
            cache_file=_beside(s, key, "-local.json"),
            budget=s.local_time_seconds,
        )
    return pricing, resolved


def _beside(s: Settings, key: dict | None, suffix: str) -> str | None:
    """A file kept beside this machine's cached profile (None: the profile is not one kept by key)."""
    return str(beside_profile(s.cache_dir, key, suffix)) if key else None


def _local_times(frontend: Frontend, resolved: Resolved, requests: list, mesh: Mesh) -> tuple[list, Any]:
    """The frontend's seconds of each request at its local shapes on ``mesh``, and the rates measured."""
    where = (
        resolved if (mesh.shape, mesh.axis_names) == (resolved.mesh.shape, resolved.mesh.axis_names) else Resolved(mesh)
    )
    got = frontend.time_ops(requests, where)
    if got is None:
        return [None] * len(requests), DEVICE_PRESETS["cpu"]
    return list(got.seconds), got.device


def replicated_only(m: Mesh, s: Settings) -> bool:
    """One device and nothing to plan: no budget that may ask to recompute, no optimizer on the host."""
    return m.size == 1 and s.memory_budget is None and not s.offload


@dataclass
class Solver:
    """Solves the compile's graph on a mesh (another preset's settings where given): what the pipeline
    search and autotune call for every mesh and preset they try."""

    job: Job
    graph: MetaIR
    pricing: Pricing

    def __call__(self, m: Mesh, settings: Settings | None = None) -> CompileResult:
        st, p = settings or self.job.settings, self.pricing
        if replicated_only(m, st):
            p1, pr1 = replicated_plan(self.graph, m)
            return CompileResult(self.graph, RuleBook(), pr1, p1)
        own = p.one_device if p.profile is None and m.size == 1 else None
        return plan_graph(
            self.graph,
            m,
            plugins=self.job.plugins,
            settings=st,
            solver_options=self.job.solver_options,
            constraints=self.job.constraints_on(self.graph, m),
            device=p.profile.device if p.profile is not None else own,
            traits=self.job.frontend.traits,
            op_slowdowns=p.op_times,
            local_timer=p.local_timer if m.size > 1 else None,
            device_memory=p.device_memory,
        )


__all__ = ["Pricing", "OpTimer", "Solver", "price", "replicated_only"]
