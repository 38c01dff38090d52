"""Count the bytes a torch program's collectives move, whoever issues them (FSDP2, DTensor, DDP).

Collectives reach the dispatcher as ``c10d.*`` ops (ProcessGroup calls: DDP, FSDP2) or as
``_c10d_functional.*`` ops (DTensor's redistribute). A dispatch mode sees both and counts by kind with
the convention of MetaDist's own ``CommStats`` and of the cost model: an all_reduce its buffer, an
all_gather its gathered output, a reduce_scatter its unscattered input, an all_to_all its input.
The mode costs Python time per op: count in a step that is not timed.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _kind(name: str) -> str | None:
    for key, kind in (
        ("reduce_scatter", "reduce_scatter"),
        ("allgather", "all_gather"),
        ("all_gather", "all_gather"),
        ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("alltoall", "all_to_all"),
        ("all_to_all", "all_to_all"),
        ("broadcast", "broadcast"),
    ):
        if key in name:
            return kind
    return None


class CountCollectives(TorchDispatchMode):
    """``with CountCollectives() as c: step()`` then ``c.bytes`` / ``c.calls`` by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            name = func._schema.name.split("::")[-1]
            kind = _kind(name)
            if kind is not None:
                if ns == "c10d":  # in place: (outputs, inputs, ...) for gathers/scatters, (tensors, ...) else
                    n = _nbytes(args[1]) if kind == "reduce_scatter" else _nbytes(args[0])
                else:  # functional: the result is the gathered output / reduced buffer
                    n = _nbytes(args[0]) if kind == "reduce_scatter" else _nbytes(out)
                self.bytes[kind] = self.bytes.get(kind, 0) + n
                self.calls[kind] = self.calls.get(kind, 0) + 1
        return out

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
