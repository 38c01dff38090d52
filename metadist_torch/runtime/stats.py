"""CommStats: what a lowered step's collectives moved, counted where they run (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Bytes and calls counted at the collectives, by kind."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, calls: int = 1) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.calls[kind] = self.calls.get(kind, 0) + int(calls)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


__all__ = ["CommStats"]
