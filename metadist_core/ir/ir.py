"""MetaIR: a framework-neutral graph of MetaOps over MetaVars."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence
from metadist_core.ir.placement import parse_placement
from metadist_core.ir.walk import Slice, walk_upstream

# Canonical dtype strings and their sizes in bytes.
#: Suffix of the ids of ops and values recomputed for the backward (metadist_core.levers.recompute).
RECOMPUTED_SUFFIX = "@rc"
ACC_SUFFIX = ".acc"
BATCH_ROLES = ("input",)
UPDATE_ROLES = ("parameter", "optimizer_state")
STATE_ROLES = ("parameter", "optimizer_state", "buffer")

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
# "gradient": a parameter's gradient as the optimizer reads it (frontends that know it mark it; grad_compression)
# hyperparameter: a number of the optimizer's param groups (a learning rate), a 0-d input fed at every call that
# lives on the host
ROLES: tuple[str, ...] = (
    "input",
    "parameter",
    "optimizer_state",
    "buffer",
    "intermediate",
    "output",
    "gradient",
    "hyperparameter",
)


def canonical_dtype(dtype: Any) -> str:
    """Map a framework dtype (``torch.float32``, ``np.dtype('f4')``, ``'bf16'``) to its canonical string."""
    s = str(dtype).lower()
    for prefix in ("torch.", "jnp.", "numpy.", "dtype("):
        if s.startswith(prefix):
            s = s[len(prefix) :]
    s = s.strip("')\"")
    aliases = {
        "float": "float32",
        "double": "float64",
        "half": "float16",
        "bf16": "bfloat16",
        "fp32": "float32",
        "fp16": "float16",
        "long": "int64",
        "int": "int64",
        "f4": "float32",
        "f8": "float64",
        "bool_": "bool",
        "<f4": "float32",
        "<f8": "float64",
    }
    s = aliases.get(s, s)
    if s not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return s


@dataclass
class MetaVar:
    """A tensor value in the graph (or a non-tensor value when ``shape`` is None)."""

    id: str
    shape: tuple[int, ...] | None
    dtype: str
    role: str = "intermediate"
    producer: str | None = None  # id of the MetaOp that makes it; None for graph inputs
    consumers: list[str] = field(default_factory=list)  # ids of MetaOps that read it
    label: str | None = None  # the user's name for it ("blocks.0.fc.weight"), when the frontend knows one
    experts: int | None = None  # a mixture-of-experts weight: its dim 0 indexes this many experts

    def __post_init__(self) -> None:
        if self.shape is not None:
            self.shape = tuple(int(s) for s in self.shape)
        if self.role not in ROLES:
            raise ValueError(f"MetaVar {self.id!r}: role {self.role!r} is not one of {ROLES}")

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    @property
    def ndim(self) -> int:
        return len(self.shape or ())

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "id": self.id,
            "shape": None if self.shape is None else list(self.shape),
            "dtype": self.dtype,
            "role": self.role,
        }
        if self.label is not None:
            d["label"] = self.label
        if self.experts is not None:
            d["experts"] = self.experts
        return d


@dataclass
class MetaOp:
    """One operator application: framework-qualified ``key``, input and output var ids, static attrs.

    ``attrs`` holds everything that is not a tensor input and must be JSON-able
    (numbers, strings, bools, None, lists, dicts). Frontends may keep a
    non-serialised handle in ``payload`` (say, the fx node) for lowering.
    """

    id: str
    key: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    payload: Any = field(default=None, repr=False, compare=False)

    def signature(self, graph: "MetaIR") -> str:
        """Stable key for the rule cache: op key, input shapes and dtypes, static attrs."""
        return op_signature(
            self.key,
            [graph.vars[v].shape for v in self.inputs],
            [graph.vars[v].dtype for v in self.inputs],
            self.attrs,
        )

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "key": self.key,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "attrs": self.attrs,
        }


def op_signature(
    key: str, shapes: Sequence[Sequence[int] | None], dtypes: Sequence[str], attrs: Mapping[str, Any] | None = None
) -> str:
    """The signature string: readable head plus a short digest of the static attributes."""
    shp = ";".join("-" if s is None else "x".join(str(d) for d in s) or "scalar" for s in shapes)
    attr_text = json.dumps(attrs or {}, sort_keys=True, default=str)
    digest = hashlib.sha1(attr_text.encode()).hexdigest()[:10]
    return f"{key}|{shp}|{','.join(dtypes)}|{digest}"


class MetaIR:
    """Ops in topological order over vars, with graph inputs/outputs and state aliasing.

    ``aliases`` maps a graph input (a parameter, optimizer state or buffer) to
    the graph output that holds its updated value after the step. ``payload``
    is what a frontend's trace leaves for its own lowering.
    """

    def __init__(self, name: str = "step") -> None:
        self.name = name
        self.vars: dict[str, MetaVar] = {}
        self.ops: list[MetaOp] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.aliases: dict[str, str] = {}
        self._op_index: dict[str, int] = {}
        self.payload: Any = None  # frontend-private data from tracing, handed to lowering; never serialised
        # a proxy graph's size map (metadist_core.discovery.patterns.proxy_op): {"small": int, "map": {real: proxy}},
        # for frontends whose op runs from a payload the attrs only describe (a jaxpr primitive's params)
        self.proxy_sizes: dict | None = None
        # var id -> the placements a user annotated it with inside the step (one, or one per mesh axis)
        self.annotations: dict[str, tuple] = {}

    # -- building -------------------------------------------------------
    def add_var(self, id: str, shape: Sequence[int] | None, dtype: Any, role: str = "intermediate") -> MetaVar:
        if id in self.vars:
            raise ValueError(f"MetaIR {self.name!r} already has a var {id!r}")
        v = MetaVar(id, None if shape is None else tuple(shape), canonical_dtype(dtype), role)
        self.vars[id] = v
        return v

    def add_input(self, id: str, shape: Sequence[int] | None, dtype: Any, role: str = "input") -> MetaVar:
        v = self.add_var(id, shape, dtype, role)
        self.inputs.append(id)
        return v

    def add_op(
        self,
        key: str,
        inputs: Sequence[str],
        outputs: Sequence[MetaVar | tuple],
        attrs: Mapping[str, Any] | None = None,
        id: str | None = None,
        payload: Any = None,
    ) -> MetaOp:
        """Append an op; ``outputs`` are MetaVars already added or ``(id, shape, dtype)`` tuples."""
        op_id = id or f"op{len(self.ops)}"
        if op_id in self._op_index:
            raise ValueError(f"MetaIR {self.name!r} already has an op {op_id!r}")
        for v in inputs:
            if v not in self.vars:
                raise KeyError(f"op {op_id} ({key}) reads {v!r}, which is not defined before it")
        out_ids = []
        for o in outputs:
            mv = o if isinstance(o, MetaVar) else self.add_var(*o)
            if mv.producer is not None:
                raise ValueError(f"var {mv.id!r} already has producer {mv.producer}")
            mv.producer = op_id
            out_ids.append(mv.id)
        op = MetaOp(op_id, key, list(inputs), out_ids, dict(attrs or {}), payload)
        for v in inputs:
            self.vars[v].consumers.append(op_id)
        self._op_index[op_id] = len(self.ops)
        self.ops.append(op)
        return op

    def set_outputs(self, outputs: Iterable[str]) -> None:
        self.outputs = list(outputs)
        for o in self.outputs:
            if o not in self.vars:
                raise KeyError(f"graph output {o!r} is not a var of {self.name!r}")
            if self.vars[o].role == "intermediate":
                self.vars[o].role = "output"

    def alias(self, state_input: str, updated_output: str) -> None:
        """Declare that ``updated_output`` is the new value of the state input ``state_input``."""
        for v in (state_input, updated_output):
            if v not in self.vars:
                raise KeyError(f"alias names {v!r}, which is not a var of {self.name!r}")
        a, b = self.vars[state_input], self.vars[updated_output]
        if a.shape != b.shape:
            raise ValueError(f"alias {state_input}{a.shape} -> {updated_output}{b.shape}: shapes differ")
        self.aliases[state_input] = updated_output

    # -- queries --------------------------------------------------------
    def op(self, op_id: str) -> MetaOp:
        return self.ops[self._op_index[op_id]]

    def op_index(self, op_id: str) -> int:
        return self._op_index[op_id]

    def ops_computing(self, targets: Iterable[str], stop: Iterable[str] = ()) -> list[str]:
        """Ids of the ops needed to compute ``targets`` from the graph inputs and the ``stop`` values,
        in graph order (a backward slice)."""
        need = self.upstream(targets, stop=stop).ops
        return [op.id for op in self.ops if op.id in need]

    def upstream(
        self,
        values: Iterable[str],
        *,
        stop: Iterable[str] = (),
        through: Callable[[MetaOp], bool] | None = None,
        reads: Callable[[MetaOp], Iterable[str]] | None = None,
    ) -> "Slice":
        """The backward slice of ``values``: the values they are computed from (``values`` included) and the
        ops that compute them. The walk does not look past a ``stop`` value (it is reached, its producer is
        not), passes only the ops ``through`` accepts (all when None), and goes on from a passed op to the
        inputs ``reads`` names (all its inputs when None)."""
        return walk_upstream(
            values,
            lambda v: self.vars[v].producer,
            (lambda p: self.op(p).inputs) if reads is None else (lambda p: reads(self.op(p))),
            stop=stop,
            through=None if through is None else (lambda p: through(self.op(p))),
        )

    def downstream(self, values: Iterable[str], *, through: Callable[[MetaOp], bool] | None = None) -> "Slice":
        """The forward slice of ``values``: the values computed from any of them (``values`` included) and the
        ops that compute those, passing only the ops ``through`` accepts (all when None)."""
        reached = set(values)
        ops: set[str] = set()
        for op in self.ops:
            if (through is None or through(op)) and any(v in reached for v in op.inputs):
                ops.add(op.id)
                reached.update(op.outputs)
        return Slice(reached, ops)

    def producer(self, var_id: str) -> MetaOp | None:
        p = self.vars[var_id].producer
        return None if p is None else self.op(p)

    def tensor_vars(self) -> list[MetaVar]:
        return [v for v in self.vars.values() if v.is_tensor]

    def validate(self) -> None:
        """Check topological order and that every read var is defined; raise ValueError if not."""
        defined = set(self.inputs)
        for op in self.ops:
            for v in op.inputs:
                if v not in defined:
                    raise ValueError(f"op {op.id} ({op.key}) reads {v!r} before it is defined")
            defined.update(op.outputs)
        for o in self.outputs:
            if o not in defined:
                raise ValueError(f"graph output {o!r} is never produced")

    def liveness(self) -> dict[str, tuple[int, int]]:
        """var id -> (first step, last step) over op positions; inputs live from -1, outputs to len(ops)."""
        n = len(self.ops)
        live: dict[str, list[int]] = {}
        for v in self.inputs:
            live[v] = [-1, -1]
        for i, op in enumerate(self.ops):
            for v in op.outputs:
                live[v] = [i, i]
            for v in op.inputs:
                live[v][1] = max(live[v][1], i)
        for v in self.outputs:
            live[v][1] = n
        for v in self.aliases:
            live[v][1] = max(live[v][1], n)  # state stays resident across steps
        return {k: (a, b) for k, (a, b) in live.items()}

    def unique_signatures(self) -> dict[str, MetaOp]:
        """Signature -> first op having it, in graph order."""
        out: dict[str, MetaOp] = {}
        for op in self.ops:
            out.setdefault(op.signature(self), op)
        return out

    # -- printing and serialisation ------------------------------------
    def __str__(self) -> str:
        return self.to_table()

    def to_table(self, max_rows: int | None = 60) -> str:
        def fmt(v: str) -> str:
            mv = self.vars[v]
            shp = "?" if mv.shape is None else "x".join(map(str, mv.shape)) or "()"
            return f"{v}:{shp}"

        rows = [("#", "op", "inputs", "outputs")]
        for i, op in enumerate(self.ops):
            rows.append((str(i), op.key, " ".join(fmt(v) for v in op.inputs), " ".join(fmt(v) for v in op.outputs)))
        shown = rows if max_rows is None or len(rows) <= max_rows + 1 else rows[: max_rows + 1]
        widths = [max(len(r[c]) for r in shown) for c in range(3)]
        lines = [
            f"MetaIR {self.name!r}: {len(self.ops)} ops, {len(self.inputs)} inputs, "
            f"{len(self.outputs)} outputs, {len(self.aliases)} state aliases"
        ]
        for r in shown:
            lines.append("  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3])
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more ops")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "vars": [v.to_json() for v in self.vars.values()],
            "ops": [op.to_json() for op in self.ops],
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "aliases": dict(self.aliases),
            **(
                {"annotations": {v: [str(p) for p in ps] for v, ps in self.annotations.items()}}
                if self.annotations
                else {}
            ),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "MetaIR":
        g = cls(data.get("name", "step"))
        produced = {o for op in data["ops"] for o in op["outputs"]}
        for v in data["vars"]:
            mv = g.add_var(v["id"], v["shape"], v["dtype"], v.get("role", "intermediate"))
            mv.label, mv.experts = v.get("label"), v.get("experts")
        g.inputs = [v for v in data["inputs"]]
        for op in data["ops"]:
            g.add_op(op["key"], op["inputs"], [g.vars[o] for o in op["outputs"]], op.get("attrs"), id=op["id"])
        g.outputs = list(data["outputs"])
        g.aliases = dict(data.get("aliases", {}))
        if data.get("annotations"):
            g.annotations = {v: tuple(parse_placement(p) for p in ps) for v, ps in data["annotations"].items()}
        missing = [v for v in g.vars if v not in produced and v not in g.inputs]
        if missing:
            raise ValueError(f"MetaIR JSON has vars that are neither inputs nor produced: {missing[:5]}")
        return g


def new_buffers(graph: MetaIR) -> list[str]:
    """New values of real buffers (not the gradients that micro-batching keeps as pseudo state)."""
    return [o for s, o in graph.aliases.items() if graph.vars[s].role == "buffer" and not s.endswith(ACC_SUFFIX)]


def forward_ops(graph: MetaIR) -> list[str]:
    """Op ids computing the non-state outputs (the loss) and the new buffers, in graph order."""
    state_outs = set(graph.aliases.values())
    targets = [o for o in graph.outputs if o not in state_outs]
    targets += new_buffers(graph)
    return graph.ops_computing(targets)
