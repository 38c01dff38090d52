"""Calls for tensors that were not recorded: plain ``te.compute`` and plain ``tvm.topi`` operators.

Each ComputeOp of a plain TE graph becomes one op, whose builder is a
:class:`~metadist_tvm.rebuild.ComputeRebuilder` (its body written again on
placeholders of any shapes its axes allow), checked at the original shapes
before it is used. What cannot be rebuilt (an extern op, a scan, a body
MetaDist cannot rewrite, a rebuild that does not reproduce the original) is
an *opaque* op: it reads the graph placeholders upstream of it, recomputes
what lies between inside its own kernel, and runs replicated; discovery
warns once, naming it.

Calls made here are remembered like recorded ones (:func:`metadist_tvm.record.lookup`).
"""

from __future__ import annotations

import logging
from typing import Any

from tvm import te

from .rebuild import ComputeRebuilder, NotRebuildable, shape_of, upstream_placeholders, verify
from .record import Call, Slot, lookup, remember

log = logging.getLogger("metadist.tvm")


def op_kind(op: Any) -> str:
    if isinstance(op, te.ComputeOp):
        return "compute"
    if isinstance(op, te.ExternOp):
        return "extern"
    if isinstance(op, te.ScanOp):
        return "scan"
    return type(op).__name__


def op_key(op: Any) -> str:
    """The MetaOp key of a plain TE operation: ``te.compute.<name>``, ``te.extern.<name>``..."""
    return f"te.{op_kind(op)}.{op.name}"


class FixedOp:
    """The builder of an opaque op: the original operation, at its own shapes only."""

    def __init__(self, op: Any, placeholders: list) -> None:
        self.op = op
        self.placeholders = placeholders

    def __repr__(self) -> str:
        return f"{op_kind(self.op)}.{self.op.name}"

    def __call__(self, *tensors: Any) -> list:
        for x, orig in zip(tensors, self.placeholders):
            if shape_of(x) != shape_of(orig) or str(x.dtype) != str(orig.dtype):
                raise NotRebuildable(
                    f"{op_kind(self.op)} {self.op.name!r} runs only at its own shapes; "
                    f"{orig.op.name!r} is {shape_of(orig)} {orig.dtype}, got {shape_of(x)} "
                    f"{x.dtype}"
                )
        return [self.op.output(i) for i in range(self.op.num_outputs)]


def opaque_call(op: Any, reason: str) -> Call:
    """A call running ``op`` whole, from the placeholders upstream of it (it recomputes what lies between)."""
    outs = [op.output(i) for i in range(op.num_outputs)]
    phs = upstream_placeholders(outs)
    return Call(
        op_key(op),
        FixedOp(op, phs),
        tuple(Slot(i) for i in range(len(phs))),
        {},
        len(phs),
        list(phs),
        outs,
        fixed=True,
        info={"opaque": reason},
        opaque=reason,
    )


def plain_call(t: Any) -> Call:
    """The Call that makes te.Tensor ``t``: recorded, else rebuilt from its compute's body, else opaque."""
    rec = lookup(t)
    if rec is not None:
        return rec[0]
    op = t.op
    if isinstance(op, te.PlaceholderOp):
        raise ValueError(f"{op.name!r} is a placeholder; it is made by no call")
    try:
        rb = ComputeRebuilder(op)
        verify(rb)
        ins = list(rb.inputs)
        call = Call(
            op_key(op),
            rb,
            tuple(Slot(i) for i in range(len(ins))),
            {},
            len(ins),
            ins,
            [op.output(i) for i in range(op.num_outputs)],
            info={"body": rb.fingerprint, "tag": op.tag},
        )
    except NotRebuildable as e:
        call = opaque_call(op, str(e))
    except Exception as e:  # a rebuild TVM refuses: run it whole
        call = opaque_call(op, f"rebuilding it failed: {type(e).__name__}: {e}")
    if call.opaque:
        log.info("%s %r cannot be split: %s", op_kind(op), op.name, call.opaque)
    remember(call)
    return call
