"""Read a recorded training-step graph (the JSON files of ``tests/data/graphs``) into MetaIR.

The files hold a whole GPT-2 step (forward, backward, AdamW) traced by torch's
``make_fx``: ``inputs`` (parameters, then the two AdamW moment lists, then the
token ids), ``nodes`` in topological order and ``outputs`` (the loss, the new
parameters, the new moments). This module knows no framework; it only turns
that JSON into MetaVars and MetaOps.

How a node becomes a MetaOp (the *attrs encoding*, shared with the torch
frontend's op runner):

- ``op.key`` is the node's aten overload name, e.g. ``aten.mm.default``.
- Every tensor-valued ``{"var": NAME}`` argument, at any depth (a list of
  tensors as in ``cat`` gives one input per tensor), becomes one entry of
  ``op.inputs``, in the order met walking ``args`` then ``kwargs``.
- ``op.attrs = {"args": [...], "kwargs": {...}}`` holds the call with each
  tensor replaced by ``{"$in": i}`` (i indexes ``op.inputs``). Other typed
  values are tagged too: ``{"$dtype": "float32"}`` (canonical dtype string),
  ``{"$device": "cpu"}``, ``{"$torch": "contiguous_format"}`` (any other
  ``torch.<name>`` constant: memory formats, layouts). Everything else is
  plain JSON (numbers, bools, None, strings, lists).
- A node that returns a tuple or list (``native_layer_norm``, ``split``,
  ``nll_loss_forward``...) is followed in the file by ``getitem`` nodes. These
  are folded into the producing op: its outputs are the getitem results in
  index order and ``attrs["select"]`` lists which tuple positions they are.
  A graph therefore has ``n_nodes - n_getitem`` ops.
- ``_tensor_constant*`` values that the trace refers to without defining them
  (they feed ``lift_fresh_copy``) become extra graph inputs with role
  ``buffer``, after the inputs of the file, shaped like what reads them.

Roles and aliasing: parameters are ``parameter``, the moments
``optimizer_state``, the token ids ``input``; each parameter and moment is
aliased to its updated output, checked by shape and by a short dataflow path.
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any, Mapping

from metadist_core.ir.ir import MetaIR, canonical_dtype

GETITEM_OPS = ("<built-in function getitem>", "_operator.getitem", "operator.getitem", "getitem")
# the most consumer hops from a state input to its updated value (AdamW: 2)
_MAX_UPDATE_HOPS = 6


def is_getitem(op_name: str) -> bool:
    return op_name in GETITEM_OPS or op_name.endswith(".getitem") or "function getitem" in op_name


def _is_var_ref(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == {"var"}


def encode_constant(value: Any, key: str | None = None) -> Any:
    """A non-tensor argument as JSON-able attrs: ``torch.*`` strings and devices become tagged dicts."""
    if isinstance(value, str):
        if value.startswith("torch."):
            name = value[len("torch.") :]
            try:
                return {"$dtype": canonical_dtype(name)}
            except ValueError:
                return {"$torch": name}
        if key == "device":
            return {"$device": value}
        return value
    if isinstance(value, (list, tuple)):
        return [encode_constant(v) for v in value]
    return value


def _shape(out: Any) -> tuple[tuple[int, ...], str] | None:
    if isinstance(out, Mapping) and "shape" in out and out.get("shape") is not None:
        return tuple(int(s) for s in out["shape"]), canonical_dtype(out.get("dtype", "float32"))
    return None


def recorded_graph_from_json(data: Mapping[str, Any], name: str = "recorded") -> MetaIR:
    """Build a MetaIR from the parsed JSON of a recorded step (see the module docstring)."""
    for k in ("inputs", "nodes", "outputs"):
        if k not in data:
            raise ValueError(f"recorded graph {name!r} has no {k!r} list; is it one of tests/data/graphs/*.json?")
    inputs, nodes, outputs = data["inputs"], data["nodes"], data["outputs"]
    g = MetaIR(name)

    # -- roles: parameters, two moment lists, then the rest (token ids) -------------
    if (len(outputs) - 1) % 3:
        raise ValueError(
            f"recorded graph {name!r}: {len(outputs)} outputs is not 1 loss + params + 2 moment lists of equal length"
        )
    n_par = (len(outputs) - 1) // 3
    if len(inputs) < 3 * n_par:
        raise ValueError(
            f"recorded graph {name!r}: {len(outputs)} outputs say {n_par} parameters, but only "
            f"{len(inputs)} inputs for parameters + 2 moment lists"
        )
    for i, inp in enumerate(inputs):
        role = "parameter" if i < n_par else "optimizer_state" if i < 3 * n_par else "input"
        g.add_input(inp["var"], inp["shape"], inp["dtype"], role)

    # -- pass 1: what getitem nodes take from tuple-valued nodes; undefined constants --
    out_of = {n["name"]: n.get("out") for n in nodes}
    picks: dict[str, dict[int, str]] = {}  # tuple node -> index -> first getitem node taking it
    rename: dict[str, str] = {}  # a repeated getitem -> the first one with the same index
    for n in nodes:
        if is_getitem(n["op"]):
            src, idx = n["args"][0], n["args"][1]
            if not _is_var_ref(src) or not isinstance(idx, int):
                raise ValueError(
                    f"recorded graph {name!r}: getitem node {n['name']!r} has args {n['args']!r}; "
                    f"expected [{{'var': NAME}}, int]"
                )
            got = picks.setdefault(src["var"], {})
            if idx in got:
                rename[n["name"]] = got[idx]
            else:
                got[idx] = n["name"]
    defined = set(g.vars)
    constants: dict[str, tuple[tuple[int, ...], str]] = {}

    def find_undefined(x: Any, node: Mapping) -> None:
        if _is_var_ref(x):
            v = x["var"]
            if v not in defined and v not in constants:
                meta = _shape(node.get("out"))
                if not (node["op"].startswith("aten.lift_fresh") and meta is not None):
                    raise ValueError(
                        f"recorded graph {name!r}: node {node['name']!r} ({node['op']}) reads "
                        f"{v!r}, which is neither a graph input nor an earlier node"
                    )
                constants[v] = meta
        elif isinstance(x, Mapping):
            for y in x.values():
                find_undefined(y, node)
        elif isinstance(x, (list, tuple)):
            for y in x:
                find_undefined(y, node)

    for n in nodes:
        find_undefined(n["args"], n)
        find_undefined(n["kwargs"], n)
        defined.add(n["name"])
    for v, (shape, dtype) in constants.items():
        g.add_input(v, shape, dtype, "buffer")

    # -- pass 2: the ops ---------------------------------------------------------------
    for n in nodes:
        if is_getitem(n["op"]):
            continue
        op_inputs: list[str] = []

        def encode(x: Any, key: str | None = None) -> Any:
            if _is_var_ref(x):
                v = rename.get(x["var"], x["var"])
                if v not in g.vars:
                    why = "a tuple-valued node; only getitem may read it" if v in out_of else "not defined before it"
                    raise ValueError(
                        f"recorded graph {name!r}: node {n['name']!r} ({n['op']}) reads {v!r}, which is {why}"
                    )
                if not g.vars[v].is_tensor:
                    raise ValueError(f"recorded graph {name!r}: node {n['name']!r} reads non-tensor {v!r}")
                op_inputs.append(v)
                return {"$in": len(op_inputs) - 1}
            if isinstance(x, (list, tuple)):
                return [encode(y) for y in x]
            if isinstance(x, Mapping):
                raise ValueError(f"recorded graph {name!r}: node {n['name']!r} has an unexpected dict argument {x!r}")
            return encode_constant(x, key)

        args = [encode(a) for a in n["args"]]
        kwargs = {k: encode(v, k) for k, v in n["kwargs"].items()}
        attrs: dict[str, Any] = {"args": args, "kwargs": kwargs}
        meta = _shape(n.get("out"))
        if meta is not None:
            outs = [(n["name"], meta[0], meta[1])]
        else:
            taken = sorted(picks.get(n["name"], {}).items())
            outs = []
            for idx, gi in taken:
                gmeta = _shape(out_of[gi])
                if gmeta is None:
                    raise ValueError(f"recorded graph {name!r}: {gi!r} = {n['name']!r}[{idx}] is not a tensor")
                outs.append((gi, gmeta[0], gmeta[1]))
            attrs["select"] = [idx for idx, _ in taken]
        g.add_op(n["op"], op_inputs, outs, attrs, id=n["name"])

    # -- outputs and state aliases --------------------------------------------------
    out_ids = []
    for o in outputs:
        if not _is_var_ref(o):
            raise ValueError(f"recorded graph {name!r}: output {o!r} is not {{'var': NAME}}")
        out_ids.append(rename.get(o["var"], o["var"]))
    g.set_outputs(out_ids)
    for i in range(3 * n_par):
        state, new = g.inputs[i], out_ids[1 + i]
        if g.vars[state].shape != g.vars[new].shape:
            raise ValueError(
                f"recorded graph {name!r}: state input {i} {state!r} has shape "
                f"{g.vars[state].shape} but output {1 + i} {new!r}, its updated value by the "
                f"file's order, has shape {g.vars[new].shape}"
            )
        if not _reaches(g, state, new, _MAX_UPDATE_HOPS):
            raise ValueError(
                f"recorded graph {name!r}: output {1 + i} {new!r} does not follow from state "
                f"input {state!r} within {_MAX_UPDATE_HOPS} ops; the outputs are not in the "
                f"order loss, parameters, moments"
            )
        g.alias(state, new)
    g.validate()
    return g


def _reaches(g: MetaIR, src: str, dst: str, max_hops: int) -> bool:
    """Is ``dst`` computed from ``src`` through at most ``max_hops`` ops?"""
    seen = {src}
    frontier = deque([(src, 0)])
    while frontier:
        v, d = frontier.popleft()
        if v == dst:
            return True
        if d == max_hops:
            continue
        for op_id in g.vars[v].consumers:
            for o in g.op(op_id).outputs:
                if o not in seen:
                    seen.add(o)
                    frontier.append((o, d + 1))
    return False


def load_recorded_graph(path: str | os.PathLike) -> MetaIR:
    """Load one recorded step (``tests/data/graphs/*.json``) as a MetaIR named after the file."""
    p = Path(path)
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no recorded graph at {str(p)!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(p)!r} is not valid JSON: {e}") from None
    name = p.name[:-5] if p.name.endswith(".json") else p.name
    return recorded_graph_from_json(data, name)


__all__ = ["load_recorded_graph", "recorded_graph_from_json", "encode_constant", "is_getitem"]
