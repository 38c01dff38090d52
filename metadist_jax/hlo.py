"""The collectives a compiled XLA program really runs, read from its optimized HLO text.

What the benchmark sets beside the cost model's priced bytes (``comm_bytes_counted``
against ``comm_bytes_predicted``): XLA may combine, split or drop collectives the
plan placed, and GSPMD places its own. Bytes follow the cost model's conventions
(:mod:`metadist_core.cost.model`): an all-reduce or all-to-all its local buffer, an
all-gather its gathered output, a reduce-scatter its input (the result times the
group size). Shapes in a partitioned module are per device already.
"""

from __future__ import annotations

import re

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    "collective-permute": "collective_permute",
}
# `%name = <shape> <op>(` where <op> is a collective, optionally its async `-start` half
_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")


def _shape_bytes(shape: str) -> int:
    total = 0
    for dt, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES.get(dt, 4)
    return total


def _group_size(line: str) -> int:
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    return 1


def collectives(hlo_text: str) -> list[tuple[str, int]]:
    """``(kind, bytes per device)`` of every collective in an optimized HLO module's text."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        op, shape = m.group("op"), m.group("shape")
        kind = KINDS[op]
        if "-start(" in line and op in ("all-gather", "collective-permute"):
            # their async start's tuple holds the operands, then the results (a permute's then two u32
            # contexts): count the results only; an all-reduce-start's shape is its results already
            parts = _ARRAY.findall(shape)
            parts = parts[len(parts) // 2 :] if op == "all-gather" else parts[1:2]
            shape = " ".join(f"{dt}[{dims}]" for dt, dims in parts)
        nbytes = _shape_bytes(shape)
        if kind == "reduce_scatter":
            nbytes *= _group_size(line)
        out.append((kind, nbytes))
    return out


def counted_bytes(hlo_text: str) -> tuple[int, int]:
    """(bytes per device, number of collectives) in an optimized HLO module's text: a jitted function's
    ``f.lower(*args).compile().as_text()``, a lowered step's ``compiled_text(*args)``."""
    found = collectives(hlo_text)
    return sum(b for _, b in found), len(found)


__all__ = ["collectives", "counted_bytes", "DTYPE_BYTES"]
