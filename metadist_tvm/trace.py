"""Trace a graph of TE tensors into MetaIR by walking the compute DAG from its outputs.

Every tensor made by a recorded call (:mod:`metadist_tvm.record`: an operator
of ``metadist_tvm.topi`` or a builder decorated with ``metadist_tvm.op``)
becomes one MetaOp over that call's tensor arguments, however many computes
the call made inside (``softmax`` is one op, not four). Placeholders are the
graph inputs. Every other tensor (a plain ``te.compute`` or ``tvm.topi``
operator) is made by one ComputeOp, which becomes one MetaOp whose body is
rebuilt at the shard shapes (:mod:`metadist_tvm.plain`); an extern op, a scan
or a body that cannot be rebuilt runs replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from tvm import te

from metadist_core.ir.ir import MetaIR

from .plain import plain_call
from .record import Call


@dataclass
class Traced:
    """What tracing leaves for execution: the graph, and each op's call."""

    graph: MetaIR
    calls: dict[str, Call] = field(default_factory=dict)  # op id -> Call
    input_tensors: list = field(default_factory=list)  # the placeholders, in graph input order
    output_tensors: list = field(default_factory=list)
    single_output: bool = False  # the outputs were given as one tensor: the program returns one array


def _short(key: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", key.split(".")[-1]) or "op"


def trace(inputs: Sequence[te.Tensor], outputs: Sequence[te.Tensor] | te.Tensor, name: str = "te_graph") -> Traced:
    """MetaIR of the TE graph from placeholders ``inputs`` to tensors ``outputs`` (one tensor or a list).

    Raises ValueError naming the tensor when a placeholder that the outputs
    read is not among ``inputs``, or when a compute was built without being
    recorded and reads more than graph inputs.
    """
    single = isinstance(outputs, te.Tensor)
    inputs, outputs = list(inputs), ([outputs] if single else list(outputs))
    for i, t in enumerate(inputs):
        if not isinstance(t, te.Tensor) or not isinstance(t.op, te.PlaceholderOp):
            raise TypeError(f"inputs[{i}] must be a te.placeholder, got {t!r:.80}")
    for i, t in enumerate(outputs):
        if not isinstance(t, te.Tensor):
            raise TypeError(f"outputs[{i}] must be a te.Tensor, got {type(t).__name__}")
    g = MetaIR(name)
    out = Traced(g, input_tensors=inputs, output_tensors=outputs, single_output=single)
    var_of: dict = {}  # te.Tensor -> var id
    used: set[str] = set()

    def fresh(base: str) -> str:
        base = re.sub(r"[^0-9A-Za-z_]", "_", base) or "t"
        vid, k = base, 1
        while vid in used:
            vid, k = f"{base}_{k}", k + 1
        used.add(vid)
        return vid

    for t in inputs:
        if t in var_of:
            raise ValueError(f"placeholder {t.op.name!r} is listed twice in inputs")
        var_of[t] = fresh(t.op.name)
        g.add_input(var_of[t], [int(s) for s in t.shape], t.dtype)

    done_calls: set[int] = set()

    def call_of(t: te.Tensor) -> Call:
        if isinstance(t.op, te.PlaceholderOp):
            raise ValueError(
                f"placeholder {t.op.name!r} (shape {tuple(int(s) for s in t.shape)}) feeds the "
                f"outputs but is not in inputs; add it to the inputs of parallelize"
            )
        return plain_call(t)

    # iterative post-order walk: a call's tensor inputs are defined before the call
    stack: list[tuple[Any, bool]] = [(t, False) for t in reversed(outputs)]
    while stack:
        t, expanded = stack.pop()
        if t in var_of:
            continue
        call = call_of(t)
        if not expanded:
            stack.append((t, True))
            for x in reversed(call.inputs):
                if x not in var_of:
                    stack.append((x, False))
            continue
        if id(call) in done_calls:
            continue
        missing = [x for x in call.inputs if x not in var_of]
        if missing:  # a cycle cannot happen in TE; an input still pending means it is on the stack below
            stack.append((t, True))
            stack.extend((x, False) for x in missing)
            continue
        done_calls.add(id(call))
        idx = len(g.ops)
        short = _short(call.key)
        out_ids = []
        for o in call.outputs:
            vid = fresh(f"{short}_{idx}" if len(call.outputs) == 1 else f"{short}_{idx}_{len(out_ids)}")
            var_of[o] = vid
            out_ids.append((vid, [int(s) for s in o.shape], o.dtype))
        op_id = f"op{idx}_{short}"
        g.add_op(call.key, [var_of[x] for x in call.inputs], out_ids, call.attrs(), id=op_id, payload=call)
        out.calls[op_id] = call
    g.set_outputs([var_of[t] for t in outputs])
    g.validate()
    return out
