"""ShardingRule, RuleBook and the on-disk rule cache.

A ShardingRule holds, for one op on **one** mesh axis, the placement of every
tensor input and every output. :func:`expand_rules` turns one-axis rules into
N-D strategies mechanically: one rule per mesh axis, kept when the shapes allow.
The cache is one JSON file (no pickle), versioned and written atomically.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from metadist_core import cachefiles
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Placement, Replicate, Shard, Sharding, parse_placement, splits_nonempty
from metadist_core.discovery.patterns import pattern_candidates
from metadist_core.config import load_settings
from metadist_core.discovery.patterns import op_pattern

log = logging.getLogger("metadist.rules")

CACHE_VERSION = (
    8  # 2: entries keyed by op pattern and axis size (metadist_core.discovery.patterns); 3: nonfinite draws;
)
# 4: sizes below the axis size exact, and the empty-piece class in the pattern; 5: slice_backward and
# select_backward run on gradient pieces at the pieces' own size (they had replicated rules only);
# 6: ops of 3 inputs also tried with the third Partial(sum) beside two shards, where it has fewer dims (addmm);
# 7: inputs split on one dim of sizes in whole ratios (grouped-query attention's heads), and ops whose traced
# call leaves a defaulted dropout_p out (CPU flash attention) no longer taken for random ops; 8: a JAX scatter's
# scalar combiner retyped, so scatters run in float64 (the embedding gradient's data-parallel rule)
CACHE_FILE = "rules-v%d.json" % CACHE_VERSION


@dataclass(frozen=True)
class ShardingRule:
    """Input placements -> output placements for one op on one mesh axis.

    ``inputs`` has one Placement per tensor input, ``outputs`` one per output
    (a non-tensor output is always ``Replicate()``).
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    #: the distributed implementation that runs the op so (:mod:`metadist_core.discovery.distimpl`): its
    #: collectives are inside the op; "" for a rule the op meets run as it is on each device's pieces
    impl: str = ""
    #: with ``impl``: positions among ``inputs + outputs`` whose split dim other axes may split too
    shared: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.inputs + self.outputs)

    def __str__(self) -> str:
        head = f"({', '.join(map(str, self.inputs))}) -> ({', '.join(map(str, self.outputs))})"
        return head + (f" via {self.impl}" if self.impl else "")

    def to_json(self) -> list[list[str]]:
        return [[str(p) for p in self.inputs], [str(p) for p in self.outputs]]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[str]]) -> "ShardingRule":
        return cls(tuple(parse_placement(p) for p in data[0]), tuple(parse_placement(p) for p in data[1]))

    @classmethod
    def replicated(cls, n_inputs: int, n_outputs: int) -> "ShardingRule":
        return cls((Replicate(),) * n_inputs, (Replicate(),) * n_outputs)


@dataclass(frozen=True)
class Strategy:
    """One N-D choice of an op: a Sharding per tensor input slot and per output (from one rule per mesh axis)."""

    inputs: tuple[Sharding, ...]
    outputs: tuple[Sharding, ...]
    rules: tuple[ShardingRule, ...] = field(default=(), compare=False)  # the rule used on each mesh axis
    #: per mesh axis, the distributed implementation the op runs on it ("" : none); empty when it uses none
    impls: tuple[str, ...] = ()

    def impl_axis(self) -> tuple[int, str] | None:
        """(mesh axis, name) of the distributed implementation this strategy runs, or None."""
        for a, name in enumerate(self.impls):
            if name:
                return a, name
        return None

    def __str__(self) -> str:
        return f"({', '.join(map(str, self.inputs))}) -> ({', '.join(map(str, self.outputs))})"

    def to_json(self) -> list:
        out: list = [[s.to_json() for s in self.inputs], [s.to_json() for s in self.outputs]]
        return out + [list(self.impls)] if self.impls else out

    @classmethod
    def from_json(cls, d) -> "Strategy":
        ins, outs = tuple(Sharding.from_json(s) for s in d[0]), tuple(Sharding.from_json(s) for s in d[1])
        return cls(ins, outs, impls=tuple(d[2]) if len(d) > 2 else ())


@dataclass
class OpRules:
    """What discovery learned for one op signature."""

    key: str
    rules: list[ShardingRule]
    axis_size: int = 2
    status: str = "ok"  # ok | replicated (no rule could be found; runs replicated) | error
    note: str = ""  # why, when status is not ok
    seconds: float = 0.0  # discovery time

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "rules": [r.to_json() for r in self.rules],
            "axis_size": self.axis_size,
            "status": self.status,
            "note": self.note,
            "seconds": round(self.seconds, 4),
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "OpRules":
        return cls(
            data["key"],
            [ShardingRule.from_json(r) for r in data["rules"]],
            data.get("axis_size", 2),
            data.get("status", "ok"),
            data.get("note", ""),
            data.get("seconds", 0.0),
        )


def _tensor_ok(
    shape: Sequence[int] | None, placements: Sequence[Placement], mesh: Mesh, discovered_axis_size: int | None = None
) -> bool:
    """Can a tensor of ``shape`` take these per-axis placements?

    Every split piece must be non-empty; on a mesh axis whose size differs
    from the axis size the rules were discovered on, or that splits a dim a
    second time, the split must be even (an uneven rule is only known to hold
    at the size and shape it was verified at).
    """
    if shape is None:
        return all(p.is_replicate() for p in placements)
    local = list(shape)
    split: set[int] = set()
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if not -len(local) <= p.dim < len(local):
                return False
            d = p.dim % len(local)
            n = mesh.shape[axis]
            if not splits_nonempty(local[d], n):
                return False
            if (
                local[d] % n
                and discovered_axis_size is not None
                and ((discovered_axis_size and n != discovered_axis_size) or d in split)
            ):
                return False
            split.add(d)
            local[d] = -(-local[d] // n)
    return True


def _impl_alone(combo: Sequence[ShardingRule]) -> bool:
    """May these per-axis rules combine, one of them a distributed implementation? Only one axis may run an
    implementation (its collectives span that axis alone), and no other axis may split a dim it splits: the
    implementation's pieces are then whole on its own axis, in the order it lays them out. Positions it
    names ``shared`` (values it handles element by element) may be split by other axes too."""
    with_impl = [r for r in combo if r.impl]
    if len(with_impl) != 1:
        return False
    mine = with_impl[0]
    for r in combo:
        if r is mine:
            continue
        for i, (p, q) in enumerate(zip(r.inputs + r.outputs, mine.inputs + mine.outputs)):
            if isinstance(p, Shard) and p == q and i not in mine.shared:
                return False
    return True


def expand_rules(
    rules: Sequence[ShardingRule] | Mapping[int, Sequence[ShardingRule]],
    mesh: Mesh,
    input_shapes: Sequence[Sequence[int] | None],
    output_shapes: Sequence[Sequence[int] | None],
    *,
    max_strategies: int | None = None,
    discovered_axis_size: int | None = 2,
) -> list[Strategy]:
    """Expand one-axis rules to N-D strategies: the product of one rule per mesh axis.

    ``rules`` maps each axis size to the rules verified on an axis of that size
    (a rule found on an axis of 4 is never used on an axis of 2: uneven splits
    and views differ); a plain list serves every axis (verified at
    ``discovered_axis_size``).

    A combination is dropped when a split dim would leave a device an empty
    piece. On a mesh axis of size 1 only the fully replicated rule is used
    (every placement is the same there). Strategies come out deduplicated.
    ``discovered_axis_size`` is the axis size the rules were verified at (see
    :func:`_tensor_ok`); None trusts uneven splits on every axis.
    """
    n_in, n_out = len(input_shapes), len(output_shapes)
    rep = ShardingRule.replicated(n_in, n_out)
    per_axis: list[list[ShardingRule]] = []
    for size in mesh.shape:
        mine = rules.get(size, []) if isinstance(rules, Mapping) else rules
        per_axis.append([rep] if size == 1 else list(dict.fromkeys([rep, *mine])))
    if isinstance(rules, Mapping):
        discovered_axis_size = 0  # each axis uses rules verified at its own size
    out: list[Strategy] = []
    seen = set()
    for combo in itertools.product(*per_axis):
        ins = tuple(Sharding(r.inputs[i] for r in combo) for i in range(n_in))
        outs = tuple(Sharding(r.outputs[i] for r in combo) for i in range(n_out))
        impls = tuple(r.impl for r in combo) if any(r.impl for r in combo) else ()
        if (ins, outs, impls) in seen or (impls and not _impl_alone(combo)):
            continue
        if not all(_tensor_ok(s, sh.placements, mesh, discovered_axis_size) for s, sh in zip(input_shapes, ins)):
            continue
        if not all(_tensor_ok(s, sh.placements, mesh, discovered_axis_size) for s, sh in zip(output_shapes, outs)):
            continue
        seen.add((ins, outs, impls))
        out.append(Strategy(ins, outs, tuple(combo), impls))
        if max_strategies is not None and len(out) >= max_strategies:
            break
    return out


class RuleBook:
    """Rules per op signature, backed by an optional on-disk JSON cache."""

    def __init__(
        self, entries: Mapping[str, OpRules] | None = None, cache_dir: str | os.PathLike | None = None
    ) -> None:
        self.entries: dict[str, OpRules] = dict(entries or {})
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.cache_hits = 0
        self.discovered = 0

    def __contains__(self, signature: str) -> bool:
        return signature in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, signature: str) -> OpRules | None:
        return self.entries.get(signature)

    def rules(self, signature: str) -> list[ShardingRule]:
        e = self.entries.get(signature)
        return [] if e is None else list(e.rules)

    def add(self, signature: str, entry: OpRules) -> None:
        self.entries[signature] = entry

    def add_op(self, op, graph, entry: OpRules, axis_sizes: Iterable[int] = (2, 4, 8, 16)) -> None:
        """Record hand-made rules for ``op`` at its exact signature, for every axis size in ``axis_sizes``."""
        for n in axis_sizes:
            self.entries[op_pattern(op, graph, n, proxies=False).key] = entry

    def lookup(self, op, graph, axis_size: int) -> OpRules | None:
        """The rules of ``op`` on an axis of ``axis_size``: by its pattern (discovered at proxy sizes),
        else by its exact signature (discovered at its real shapes); None when not discovered."""
        for key in rule_keys(op, graph, axis_size):
            e = self.entries.get(key)
            if e is not None:
                return e
        return None

    def rules_for(self, op, graph, axis_size: int) -> list[ShardingRule]:
        e = self.lookup(op, graph, axis_size)
        return [] if e is None or e.status != "ok" else list(e.rules)

    def to_json(self) -> dict:
        return {"version": CACHE_VERSION, "entries": {k: v.to_json() for k, v in sorted(self.entries.items())}}

    @classmethod
    def from_json(cls, data: Mapping, cache_dir=None) -> "RuleBook":
        if not isinstance(data, Mapping) or data.get("version") != CACHE_VERSION:
            raise ValueError(
                f"rule cache version {data.get('version') if isinstance(data, Mapping) else '?'} is not {CACHE_VERSION}"
            )
        return cls({k: OpRules.from_json(v) for k, v in data["entries"].items()}, cache_dir)

    # -- the cache --------------------------------------------------------
    @property
    def cache_path(self) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / CACHE_FILE

    @classmethod
    def load(cls, cache_dir: str | os.PathLike | None = None) -> "RuleBook":
        """Open the cache under ``cache_dir`` (default: :func:`default_cache_dir`).

        A missing file gives an empty book; a corrupt or old file gives one
        warning and an empty book, and is rewritten on the next :meth:`save`.
        """
        d = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        book = cls(cache_dir=d)
        path = book.cache_path
        loaded = None if path is None else _read_book(path, d)
        return book if loaded is None else loaded

    def save(self) -> Path | None:
        """Merge with what is on disk now and write atomically (temp file + rename), holding the file's lock
        so that concurrent writers keep each other's entries. The path written; None without a cache dir,
        or when it cannot be written (read-only, full: one warning, and planning goes on without it)."""
        path = self.cache_path
        if path is None:
            return None
        with cachefiles.exclusive(path):
            merged = dict(self.entries)
            on_disk = _read_book(path)
            for k, v in (on_disk.entries if on_disk is not None else {}).items():
                merged.setdefault(k, v)
            data = {"version": CACHE_VERSION, "entries": {k: v.to_json() for k, v in sorted(merged.items())}}
            ok = cachefiles.write_atomic(path, json.dumps(data, indent=1), cache_dir=self.cache_dir, what="rule cache")
        return path if ok else None


def _read_book(path: Path, cache_dir: Path | None = None) -> RuleBook | None:
    """The rule cache at ``path``; None when there is none, or it is corrupt or of another version (one warning)."""
    return cachefiles.read(path, lambda raw: RuleBook.from_json(json.loads(raw), cache_dir), "rule cache")


_KEYS: dict[tuple, list[str]] = {}  # op content -> its keys: a 12-layer step asks 12 times for each


def rule_keys(op, graph, axis_size: int) -> list[str]:
    """The RuleBook keys that may hold ``op``'s rules on an axis of ``axis_size``, most general first."""
    outs = tuple(
        (None if graph.vars[v].shape is None else tuple(graph.vars[v].shape), graph.vars[v].dtype) for v in op.outputs
    )
    memo = (op.signature(graph), outs, axis_size)
    keys = _KEYS.get(memo)
    if keys is None:
        if len(_KEYS) > 200_000:
            _KEYS.clear()
        keys = _KEYS[memo] = [p.key for p in pattern_candidates(op, graph, axis_size)]
    return list(keys)


def default_cache_dir() -> Path:
    """The ``cache_dir`` setting (``$METADIST_CACHE_DIR``, ``[tool.metadist]``) if set, else the user cache dir."""
    configured = load_settings().cache_dir
    if configured:
        return Path(configured)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("metadist"))
    except ImportError:  # pragma: no cover - platformdirs is a dependency
        return Path.home() / ".cache" / "metadist"
