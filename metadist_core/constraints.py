"""User constraints on a ShardingProblem: pin a value's sharding, forbid a placement."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Union

import numpy as np

from .placement import Placement, Sharding, parse_placement

if TYPE_CHECKING:  # pragma: no cover
    from .problem import ShardingProblem


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


Constraint = Union[Pin, Forbid]


def parse_constraints(items: Iterable[Constraint | Mapping]) -> list[Constraint]:
    """Constraints from objects or their JSON form (``{"pin": var, "sharding": [...]}``, ``{"forbid": "P(sum)"}``)."""
    out: list[Constraint] = []
    for c in items:
        if isinstance(c, (Pin, Forbid)):
            out.append(c)
        elif isinstance(c, Mapping) and "pin" in c:
            sh = c["sharding"]
            out.append(Pin(c["pin"], sh if isinstance(sh, Sharding) else Sharding.from_json(sh)))
        elif isinstance(c, Mapping) and "forbid" in c:
            p = c["forbid"]
            out.append(Forbid(p if isinstance(p, Placement) else parse_placement(p), c.get("var"), c.get("axis")))
        else:
            raise ValueError(f"not a constraint: {c!r}; write Pin(var, sharding), Forbid(placement, var=None, "
                             f"axis=None) or their JSON dicts {{'pin': ..., 'sharding': [...]}} / {{'forbid': 'P(sum)'}}")
    return out


def apply_constraints(prob: "ShardingProblem") -> None:
    """Narrow ``prob.allowed`` by ``prob.constraints``; raise when a node is left without any option."""
    for c in prob.constraints:
        if isinstance(c, Pin):
            if c.var not in prob.vars:
                raise KeyError(f"constraint pins {c.var!r}, which is not a value of {prob.name!r}")
            if len(c.sharding) != prob.mesh.ndim:
                raise ValueError(f"pin of {c.var!r}: sharding {c.sharding} has {len(c.sharding)} placements "
                                 f"for the {prob.mesh.ndim}-axis mesh {prob.mesh}")
            i, s = prob.definer(c.var)
            mask = np.array([o.outputs[s] == c.sharding for o in prob.nodes[i].options])
            _narrow(prob, i, mask, c)
        else:
            for i, n in enumerate(prob.nodes):
                mask = np.ones(len(n.options), dtype=bool)
                for k, o in enumerate(n.options):
                    for var, sh in zip(list(n.inputs) + list(n.outputs), list(o.inputs) + list(o.outputs)):
                        if (c.var is None or c.var == var) and c.hits(sh):
                            mask[k] = False
                            break
                if c.var is not None and c.var not in n.outputs and c.var not in n.inputs:
                    continue
                _narrow(prob, i, mask, c)


def _narrow(prob: "ShardingProblem", i: int, mask: np.ndarray, c: Constraint) -> None:
    new = prob.allowed[i] & mask
    if not new.any():
        n = prob.nodes[i]
        choices = sorted({str(o) for o in n.options})[:6]
        raise ValueError(f"constraint {c} leaves {n.kind} {n.id!r} ({n.key}) without any allowed sharding; "
                         f"its options are {choices}{' ...' if len(n.options) > 6 else ''}; relax the constraint")
    prob.allowed[i] = new
