"""PlanStats: the figures a plan carries beside its choices.

The driver writes the typed fields (the strategy, the lowering hints every rank must agree on such as
``first_bucket_mb``, the recomputation, pipeline and autotune figures, the peak with the collectives'
buffers); solvers write ``status`` and ``toggles_on``, and their own figures (sizes, timings, ILP
counters) go to ``extra``, an open dict. In JSON the stats are one flat dict, as they always were:
the set fields under their names, then ``extra``'s keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class PlanStats:
    """What a plan records beside its choices; None: not recorded for this plan."""

    strategy: str | None = None  # preset or "auto" the plan was solved under (driver)
    first_bucket_mb: float | None = None  # first gradient bucket rank 0 priced; every rank lowers it
    peak_with_buffers: int | None = None  # peak bytes per device with the collectives' buffers
    budget: dict[str, Any] | None = None  # bytes, source, explicit: the budget the plan fits (driver/budget.py)
    recompute: dict[str, Any] | None = None  # segments, ops, chosen_by, saved_bytes
    recompute_chosen_by: str | None = None  # how the recomputation was chosen, until folded into recompute
    local_times: dict[str, Any] | None = None  # the local timer's figures (kernels timed, slowdowns)
    offload: dict[str, Any] | None = None  # host-link bytes and seconds (levers/offload.py)
    autotune: dict[str, Any] | None = None  # candidates timed, the one chosen (driver/autotune.py)
    pipeline: dict[str, Any] | None = None  # stages, schedule, micro_batches, bubble (driver/pipeplan.py)
    compile: dict[str, Any] | None = None  # backend, seconds, graph_breaks, kernels: the rank program compiled
    status: str | None = None  # the solver's word on how the solve ended
    toggles_on: list[int] | None = None  # toggles (recompute segments) the solver turned on
    extra: dict[str, Any] = field(default_factory=dict)  # solver-specific figures (sizes, timings, counters)

    def to_json(self) -> dict[str, Any]:
        """One flat dict: the fields that are set, then ``extra``."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "extra" and getattr(self, f.name) is not None
        }
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, d: "Mapping[str, Any] | PlanStats | None") -> "PlanStats":
        """From a flat dict (a plan's JSON or a solver's figures): known keys to fields, the rest to ``extra``."""
        if isinstance(d, PlanStats):
            return dataclasses.replace(d, extra=dict(d.extra))
        named = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        items = dict(d or {})
        return cls(
            **{k: v for k, v in items.items() if k in named}, extra={k: v for k, v in items.items() if k not in named}
        )


__all__ = ["PlanStats"]
