"""A pipeline stage as a plan holds it: the ops, parameters and values one slice of mesh axis 0 runs,
and the lines ``str(plan)`` shows for a pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


class StageError(ValueError):
    """A pipeline cannot be built as asked (names the numbers and what to do)."""


@dataclass
class Stage:
    """One pipeline stage: a contiguous run of forward ops on one slice of mesh axis 0."""

    index: int
    ops: list[str]  # op ids of the forward, in graph order (free ops included)
    params: list[str]  # parameter/buffer input vars this stage owns (first reader)
    inputs: list[str]  # values received from the previous stage (stage 0: the batch inputs)
    outputs: list[str]  # values sent to the next stage (the last stage: the step's outputs)
    devices: list[int] = field(default_factory=list)  # global ranks of this stage
    cost: float = 0.0  # seconds per micro-batch (forward + backward + send), cost model
    memory: int = 0  # bytes per device, cost model

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "ops": list(self.ops),
            "params": list(self.params),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "devices": list(self.devices),
            "cost": self.cost,
            "memory": self.memory,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Stage":
        return cls(
            int(d["index"]),
            list(d["ops"]),
            list(d["params"]),
            list(d["inputs"]),
            list(d["outputs"]),
            list(d.get("devices", [])),
            float(d.get("cost", 0.0)),
            int(d.get("memory", 0)),
        )

    def __str__(self) -> str:
        return (
            f"stage {self.index} on devices {self.devices}: {len(self.ops)} ops, {len(self.params)} "
            f"parameters, receives {len(self.inputs)} values, sends {len(self.outputs)}; "
            f"{self.cost * 1e3:.3f} ms/micro-batch, {self.memory / 2**20:.1f} MiB/device"
        )


def bubble_fraction(m: int, p: int) -> float:
    """The idle share of a synchronous schedule with balanced stages: ``(p-1)/(m+p-1)``."""
    return (p - 1) / (m + p - 1)


def describe(stages: Sequence[Stage], schedule: str, m: int) -> str:
    """The lines ``str(plan)`` shows for a pipeline."""
    if not stages:
        return ""
    p = len(stages)
    lines = [
        f"pipeline: {p} stages along mesh axis 0, schedule {schedule}, {m} micro-batches "
        f"(bubble {bubble_fraction(m, p):.0%} = (p-1)/(m+p-1))"
    ]
    lines += ["  " + str(s) for s in stages]
    return "\n".join(lines)


__all__ = ["Stage", "StageError", "bubble_fraction", "describe"]
