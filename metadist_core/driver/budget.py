"""The memory budget a plan must fit in: the user's ``memory_budget``, else the device's own memory.

With no ``memory_budget`` set, a plan still has to fit the device it will run on: on CUDA the device's
memory (the frontend reads it into :attr:`~metadist_core.driver.frontend.Resolved.device_memory`), in a
plan-only run the memory of the device preset it is priced on (``a100``, ``h100``, ``h200``), in both
less ``device_reserve_mb`` for what the plan does not hold (the CUDA context, library workspaces, NCCL's
buffers, the allocator's slack). A CPU has no default budget. :func:`plan_budget` says which budget
holds and where it came from; the plan records it (``plan.stats.budget``) and ``explain`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metadist_core.config import Settings
from metadist_core.cost.model import DEVICE_PRESETS, DeviceSpec

#: what else to change when no plan fits the budget (besides the budget itself)
WHAT_TO_CHANGE = "plan on more devices (a larger mesh), cut the batch per step (micro_batches), or offload='optimizer'"


@dataclass(frozen=True)
class Budget:
    """Bytes per device a plan must fit in (None: no limit), where that figure came from, and whether the
    user set it (an explicit budget is the solver's from the start; a default one only where the plan
    without it does not fit)."""

    bytes: int | None
    source: str
    explicit: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "source": self.source, "explicit": self.explicit}


def _gib(n: float) -> str:
    return f"{int(n):,} bytes ({n / 2**30:.1f} GiB)"


def plan_budget(settings: Settings, device: DeviceSpec | None = None, device_memory: int | None = None) -> Budget:
    """The budget of a plan priced on ``device`` (its cost model's DeviceSpec) and run on a device of
    ``device_memory`` bytes (CUDA; None: not known): the ``memory_budget`` setting where set; else that
    memory, or the device preset's, less the ``device_reserve_mb`` setting; else none (a CPU)."""
    if settings.memory_budget is not None:
        return Budget(int(settings.memory_budget), "memory_budget, as set", True)
    reserve = int(settings.device_reserve_mb * 2**20)
    if device_memory:
        return Budget(
            max(0, int(device_memory) - reserve),
            f"the CUDA device's memory, {_gib(device_memory)}, less {_gib(reserve)} reserved (device_reserve_mb)",
        )
    name = getattr(device, "name", None)
    if device is not None and name in DEVICE_PRESETS and name != "cpu":
        return Budget(
            max(0, int(device.memory_bytes) - reserve),
            f"device preset {name}'s memory, {_gib(device.memory_bytes)}, less {_gib(reserve)} reserved "
            f"(device_reserve_mb)",
        )
    return Budget(None, "none: memory_budget is not set and the device is a CPU (or its memory is not known)")


def unfit_advice(budget: Budget) -> str:
    """What a no-plan-fits error adds: where the budget came from and what else to change."""
    if budget.explicit:
        return f" (the budget: {budget.source}); or {WHAT_TO_CHANGE}"
    return (
        f" (the budget: {budget.source}); {WHAT_TO_CHANGE}, or set memory_budget to plan for a device with more memory"
    )


__all__ = ["Budget", "plan_budget", "unfit_advice", "WHAT_TO_CHANGE"]
