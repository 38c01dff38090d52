"""User constraints on a ShardingProblem: pin a value's sharding, forbid a placement."""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any, Iterable, Mapping

import numpy as np

from metadist_core.ir.placement import Placement, Sharding, parse_placement
from metadist_core.problem.elements import Constraint, Forbid, Pin, UseImpl, parse_constraints
from metadist_core.problem.problem import ShardingProblem


def apply_constraints(prob: ShardingProblem) -> None:
    """Narrow ``prob.allowed`` by ``prob.constraints``; raise when a node is left without any option."""
    users: dict[str, list[int]] | None = None
    for c in prob.constraints:
        if isinstance(c, Pin):
            if c.var not in prob.vars:
                raise KeyError(f"constraint pins {c.var!r}, which is not a value of {prob.name!r}")
            if len(c.sharding) != prob.mesh.ndim:
                raise ValueError(
                    f"pin of {c.var!r}: sharding {c.sharding} has {len(c.sharding)} placements "
                    f"for the {prob.mesh.ndim}-axis mesh {prob.mesh}"
                )
            i, s = prob.definer(c.var)
            mask = np.array([o.outputs[s] == c.sharding for o in prob.nodes[i].options])
            _narrow(prob, i, mask, c)
        elif isinstance(c, UseImpl):
            if not 0 <= c.axis < prob.mesh.ndim:
                raise ValueError(f"{c}: mesh {prob.mesh} has axes 0 to {prob.mesh.ndim - 1}")
            for i, n in enumerate(prob.nodes):
                if n.kind == "op" and any(c.hits(o.impls) for o in n.options):
                    _narrow(prob, i, np.array([c.hits(o.impls) for o in n.options], dtype=bool), c)
        else:
            if c.var is None:
                where: Iterable[int] = range(len(prob.nodes))
            else:  # only the nodes that read or write the value: a preset forbids per value, thousands of them
                users = _users(prob) if users is None else users
                where = users.get(c.var, ())
            for i in where:
                n = prob.nodes[i]
                at = [j for j, var in enumerate((*n.inputs, *n.outputs)) if c.var is None or c.var == var]
                mask = np.array(
                    [not any(c.hits(sh) for j, sh in enumerate((*o.inputs, *o.outputs)) if j in at) for o in n.options],
                    dtype=bool,
                )
                _narrow(prob, i, mask, c)


def _users(prob: ShardingProblem) -> dict[str, list[int]]:
    """Each value's nodes (that define or read it), in node order."""
    out: dict[str, list[int]] = {}
    for i, n in enumerate(prob.nodes):
        for var in dict.fromkeys(list(n.inputs) + list(n.outputs)):
            out.setdefault(var, []).append(i)
    return out


def _narrow(prob: ShardingProblem, i: int, mask: np.ndarray, c: Constraint) -> None:
    new = prob.allowed[i] & mask
    if not new.any():
        n = prob.nodes[i]
        choices = sorted({str(o) for o in n.options})[:6]
        raise ValueError(
            f"constraint {c} leaves {n.kind} {n.id!r} ({n.key}) without any allowed sharding; "
            f"its options are {choices}{' ...' if len(n.options) > 6 else ''}; relax the constraint"
        )
    prob.allowed[i] = new


# -- constraints by name: {parameter name or glob: placements}, and annotations ---------------------------


def _is_json_constraint(c: Any) -> bool:
    return isinstance(c, Mapping) and ("pin" in c or "forbid" in c or ("impl" in c and "axis" in c))


def as_constraint_list(constraints: Any) -> list:
    """The user's ``constraints=`` as a list: Pin/Forbid/UseImpl objects or their JSON, and name mappings
    (``{"lm_head.weight": Replicate()}``) kept whole as one item each."""
    if constraints is None:
        return []
    if isinstance(constraints, Mapping):
        return [dict(constraints)]
    if isinstance(constraints, (Pin, Forbid, UseImpl)):
        return [constraints]
    return list(constraints)


def split_constraints(constraints: Any) -> tuple[list[Constraint], dict[str, Any]]:
    """Plain constraints (Pin/Forbid/UseImpl, parsed) and the named ones ``{name or glob: placements}``, merged."""
    plain: list = []
    named: dict[str, Any] = {}
    for c in as_constraint_list(constraints):
        if isinstance(c, Mapping) and not _is_json_constraint(c):
            named.update(c)
        else:
            plain.append(c)
    return parse_constraints(plain), named


def sharding_of(spec: Any, ndim: int, what: str) -> Sharding:
    """A Sharding from a user's placements: one Placement (the same on every mesh axis), or one per axis
    (Placements or their short forms ``"R"``, ``"S(0)"``), or a Sharding."""
    if isinstance(spec, Sharding):
        items = list(spec)
    elif isinstance(spec, (Placement, str)):
        items = [spec] * ndim
    elif isinstance(spec, (tuple, list)):
        items = list(spec)
    else:
        raise TypeError(
            f"{what}: {spec!r} is not a placement; write Shard(d), Replicate(), or a tuple of them, one per mesh axis"
        )
    try:
        out = tuple(parse_placement(p) if isinstance(p, str) else p for p in items)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    if any(not isinstance(p, Placement) for p in out):
        raise TypeError(f"{what}: {spec!r} holds something that is not a Placement")
    if len(out) != ndim:
        raise ValueError(
            f"{what}: {len(out)} placements {tuple(map(str, out))} for a {ndim}-axis mesh; "
            f"give one Placement (used on every axis) or exactly {ndim}, one per axis"
        )
    return Sharding(out)


def var_name(prob: ShardingProblem, var: str) -> str:
    """The user's name of a value (its label), else its id."""
    return prob.vars.get(var, {}).get("label") or var


def check_pin(prob: ShardingProblem, var: str, sharding: Sharding, what: str) -> None:
    """Raise a ValueError naming ``what`` when no option of the node defining ``var`` gives ``sharding``."""
    i, s = prob.definer(var)
    options = sorted({str(o.outputs[s]) for o in prob.nodes[i].options})
    if not any(o.outputs[s] == sharding for o in prob.nodes[i].options):
        shape = prob.vars[var]["shape"]
        raise ValueError(
            f"{what}: no rule allows {sharding} for {var_name(prob, var)} (shape {shape}) on mesh "
            f"{prob.mesh}; it may be {', '.join(options[:8])}{' ...' if len(options) > 8 else ''} "
            f"(a split dim must divide by the axis size)"
        )


def pins_by_name(prob: ShardingProblem, named: Mapping[str, Any]) -> list[Pin]:
    """Pins from ``{name or glob: placements}``: names are the values' labels (``blocks.0.fc.weight``,
    ``blocks.0.fc.weight.exp_avg``) or ids; a glob (``*.fc.weight``) pins every value it matches.
    A name that matches nothing, or a placement no rule allows, is a ValueError naming it."""
    labels = {v: info["label"] for v, info in prob.vars.items() if info.get("label")}
    inputs = {n.id for n in prob.nodes if n.kind == "input"}
    for v in inputs:
        labels.setdefault(v, v)  # a frontend that names its inputs by path (JAX: params/layer/w)
    pins: list[Pin] = []
    for pattern, spec in named.items():
        if not isinstance(pattern, str):
            raise TypeError(f"constraint key {pattern!r} is not a name; write {{'blocks.0.fc.weight': Shard(0)}}")
        what = f"constraint {pattern!r}"
        sh = sharding_of(spec, prob.mesh.ndim, what)
        if pattern in prob.vars and pattern not in labels.values():
            hits = [pattern]
        else:
            hits = [v for v, name in labels.items() if name == pattern or fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            names = sorted(labels.get(v, v) for v in inputs if prob.vars[v]["role"] == "parameter")
            close = difflib.get_close_matches(pattern, list(labels.values()), n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
            raise ValueError(
                f"{what} names no value of {prob.name!r}: {hint}its {len(names)} parameters are "
                f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''} "
                f"(globs use * and ?, as in '*.fc.weight')"
            )
        for v in hits:
            check_pin(prob, v, sh, f"{what} on {labels.get(v, v)}")
            pins.append(Pin(v, sh))
    return pins


def annotation_pins(prob: ShardingProblem, annotations: Mapping[str, Any]) -> list[Pin]:
    """Pins from the values a user annotated inside the step (``metadist_torch.annotate``)."""
    pins = []
    for var, spec in annotations.items():
        if var not in prob.vars:
            raise ValueError(f"annotate(...) names value {var!r}, which is not in the step {prob.name!r}")
        what = f"annotate(..., {', '.join(map(str, spec))}) on value {var!r} (shape {prob.vars[var]['shape']})"
        sh = sharding_of(tuple(spec) if len(spec) > 1 else spec[0], prob.mesh.ndim, what)
        check_pin(prob, var, sh, what)
        pins.append(Pin(var, sh))
    return pins
