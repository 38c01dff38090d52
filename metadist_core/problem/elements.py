"""The sharding problem's graph: a node per decision (an op or a graph input) with its candidate
strategies, an edge per value with its reshard table; and the user's constraints on it, pins and forbids
(applied by :mod:`metadist_core.problem.constraints`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Union

import numpy as np

from metadist_core.discovery.rules import Strategy
from metadist_core.ir.placement import Placement, Sharding, parse_placement


@dataclass
class Node:
    """A decision: an op (``kind='op'``) or a graph input tensor (``kind='input'``)."""

    id: str
    kind: str
    key: str  # op key, or the input's role
    inputs: list[str]  # tensor input var per slot (op nodes)
    outputs: list[str]  # vars defined by this node
    options: list[Strategy]

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "kind": self.kind,
            "key": self.key,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "options": [o.to_json() for o in self.options],
        }

    @classmethod
    def from_json(cls, d) -> "Node":
        return cls(
            d["id"],
            d["kind"],
            d["key"],
            list(d["inputs"]),
            list(d["outputs"]),
            [Strategy.from_json(o) for o in d["options"]],
        )


@dataclass
class Edge:
    """Value ``var`` flows from node ``src`` (output ``src_slot``) to node ``dst`` (input ``dst_slot``).

    ``dst == -1`` is the final reshard of a graph output to Replicate (folded
    into the unary costs, kept for the plan). An alias edge goes from an
    updated state to its input node; its ``dst_slot`` is -1.
    """

    src: int
    src_slot: int
    dst: int
    dst_slot: int
    var: str
    src_map: np.ndarray
    dst_map: np.ndarray
    table: np.ndarray

    def to_json(self) -> dict:
        return {
            "src": self.src,
            "src_slot": self.src_slot,
            "dst": self.dst,
            "dst_slot": self.dst_slot,
            "var": self.var,
            "src_map": self.src_map.tolist(),
            "dst_map": self.dst_map.tolist(),
            "table": self.table.tolist(),
        }

    @classmethod
    def from_json(cls, d) -> "Edge":
        return cls(
            d["src"],
            d["src_slot"],
            d["dst"],
            d["dst_slot"],
            d["var"],
            np.asarray(d["src_map"], dtype=np.int32),
            np.asarray(d["dst_map"], dtype=np.int32),
            np.asarray(d["table"], dtype=float),
        )


@dataclass(frozen=True)
class Pin:
    """Value ``var`` must have exactly ``sharding`` where it is made (or stored, for a graph input)."""

    var: str
    sharding: Sharding

    def to_json(self) -> dict:
        return {"pin": self.var, "sharding": self.sharding.to_json()}


@dataclass(frozen=True)
class Forbid:
    """No value (or only ``var``) may take ``placement`` (on mesh axis ``axis``, or on any axis)."""

    placement: Placement
    var: str | None = None
    axis: int | None = None

    def to_json(self) -> dict:
        return {"forbid": str(self.placement), "var": self.var, "axis": self.axis}

    def hits(self, sharding: Sharding) -> bool:
        axes = range(len(sharding)) if self.axis is None else [self.axis]
        return any(sharding[a] == self.placement for a in axes)


@dataclass(frozen=True)
class UseImpl:
    """Every op that a distributed implementation whose name starts with ``prefix`` can run on mesh axis
    ``axis`` runs one there (say ``"cp_attention"``: causal attention split on the sequence over that axis)."""

    prefix: str
    axis: int

    def to_json(self) -> dict:
        return {"impl": self.prefix, "axis": self.axis}

    def hits(self, impls: tuple[str, ...]) -> bool:
        """Does a strategy running ``impls`` (one name per mesh axis) run such an implementation on the axis?"""
        return self.axis < len(impls) and impls[self.axis].startswith(self.prefix)


Constraint = Union[Pin, Forbid, UseImpl]


def parse_constraints(items: Iterable[Constraint | Mapping]) -> list[Constraint]:
    """Constraints from objects or their JSON form (``{"pin": var, "sharding": [...]}``, ``{"forbid": "P(sum)"}``)."""
    out: list[Constraint] = []
    for c in items:
        if isinstance(c, (Pin, Forbid, UseImpl)):
            out.append(c)
        elif isinstance(c, Mapping) and "pin" in c:
            sh = c["sharding"]
            out.append(Pin(c["pin"], sh if isinstance(sh, Sharding) else Sharding.from_json(sh)))
        elif isinstance(c, Mapping) and "impl" in c:
            out.append(UseImpl(str(c["impl"]), int(c["axis"])))
        elif isinstance(c, Mapping) and "forbid" in c:
            p = c["forbid"]
            out.append(Forbid(p if isinstance(p, Placement) else parse_placement(p), c.get("var"), c.get("axis")))
        else:
            raise ValueError(
                f"not a constraint: {c!r}; write Pin(var, sharding), Forbid(placement, var=None, axis=None), "
                f"UseImpl(prefix, axis) or their JSON dicts {{'pin': ..., 'sharding': [...]}} / "
                f"{{'forbid': 'P(sum)'}} / {{'impl': 'cp_attention', 'axis': 1}}"
            )
    return out


__all__ = ["Edge", "Node", "Pin", "Forbid", "UseImpl", "Constraint", "parse_constraints"]
