"""The rank program handed to ``torch.compile``: one flat graph of aten ops and torch's native functional
collectives, no Python in between.

A lowered program (:func:`metadist_torch.lower.lower.lower_plan`, or the traced step itself at world size 1) reads
the param groups' numbers as ``aten._local_scalar_dense`` of 0-d tensors, and runs its collectives through
:class:`~metadist_torch.lower.collectives.AxisComm`'s methods. Before compiling, :func:`compilable`

- turns every tensor the graph reads as a module attribute into an input of its own (the param groups'
  numbers change between calls: a compiled graph must read them, never fold them in);
- passes each such number to its ops as the 0-d tensor itself (:func:`scalars_as_tensors`): an op that
  takes a Tensor gets it cast to the op's dtype, an op with a ``.Scalar`` overload gets its ``.Tensor``
  twin, ``alpha=`` and ``value=`` become a multiplication. Dynamo would otherwise stop the graph at each
  number (a data-dependent output);
- traces the program once on fake tensors (``make_fx``), so that every collective's padding, bucket
  flattening and splitting is the aten ops it runs, and each collective the ``_c10d_functional`` op and
  its ``wait_tensor`` where the lowering waits for it. What each collective moves is counted by that
  trace, once (:class:`CompiledProgram` adds it to the program's :class:`~metadist_torch.runtime.stats.CommStats`
  at every call).

:class:`CompiledProgram` compiles at its first call with the backend and options of the settings
``backend`` and ``compile_options``, and reports the seconds that took, dynamo's graph breaks and the
kernels Inductor generated.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from metadist_core.progress import Ticker

from ..runtime.stats import CommStats

aten = torch.ops.aten
ITEM = aten._local_scalar_dense.default
EAGER = "eager"

# ops with a number argument that has no Tensor form: (overload, argument name) -> how to fold it in
_SCALED = {"alpha": (1,), "value": (1, 2)}  # which argument the number multiplies: other (add, sub); tensor1


def check_backend(name: str) -> str:
    """``name`` if torch.compile knows it ("eager" runs the program as it is); else a ValueError listing them."""
    if name == EAGER:
        return name
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(
            f"unknown backend {name!r}: choose 'eager' (run the rank program as it is) or a torch.compile "
            f"backend: {', '.join(sorted(known))}"
        )
    return name


def _float_dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.is_floating_point():
        return val.dtype
    from .coalesce import DTYPE_META

    name = node.meta.get(DTYPE_META) if isinstance(node, fx.Node) else None
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None


def _twin(op: torch._ops.OpOverload, arg: str) -> torch._ops.OpOverload | None:
    """The overload of ``op``'s packet that takes argument ``arg`` as a Tensor, all else the same."""
    args = op._schema.arguments
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1])
    for name in packet.overloads():
        other = getattr(packet, name)
        oargs = other._schema.arguments
        if len(oargs) != len(args) or [a.name for a in oargs] != [a.name for a in args]:
            continue
        if all(
            (isinstance(b.type, torch.TensorType) if a.name == arg else str(a.type) == str(b.type))
            for a, b in zip(args, oargs)
        ):
            return other
    return None


def scalars_as_tensors(g: fx.Graph, device: torch.device | None = None) -> int:
    """Pass each ``_local_scalar_dense`` number to its readers as its 0-d tensor (see the module docstring),
    moved to ``device`` where the program runs on a GPU (the numbers are fed as CPU tensors).

    Returns how many numbers are left as numbers (readers this cannot rewrite: dynamo breaks the graph there).
    """
    left = 0
    to = {"device": device} if device is not None and torch.device(device).type != "cpu" else {}
    for item in [n for n in g.nodes if n.op == "call_function" and n.target is ITEM]:
        t = item.args[0]
        for user in list(item.users):
            if not _rewrite(g, user, item, t, to):
                left += 1
        if not item.users:
            g.erase_node(item)
    return left


def _rewrite(g: fx.Graph, user: fx.Node, item: fx.Node, t: fx.Node, to: dict) -> bool:
    op = user.target
    if user.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema.arguments
    tensors = [a for a in user.all_input_nodes if a is not item and _float_dtype(a) is not None]
    dtype = _float_dtype(tensors[0]) if tensors else None
    if dtype is None:
        return False

    def cast() -> fx.Node:
        with g.inserting_before(user):
            return g.call_function(aten._to_copy.default, (t,), {"dtype": dtype, **to})

    args, kwargs = list(user.args), dict(user.kwargs)
    for i, a in enumerate(args):
        if a is not item:
            continue
        arg = schema[i]
        if isinstance(arg.type, torch.TensorType):
            args[i] = cast()
            continue
        twin = _twin(op, arg.name)
        if twin is None:
            return False
        args[i] = cast()
        op = twin
    for k, a in list(kwargs.items()):
        if a is not item:
            continue
        if k not in _SCALED:
            return False
        del kwargs[k]
        which = next((j for j in _SCALED[k] if j < len(args) and isinstance(args[j], fx.Node)), None)
        if which is None:
            return False
        with g.inserting_before(user):
            args[which] = g.call_function(aten.mul.Tensor, (args[which], cast()))
    user.target, user.args, user.kwargs = op, tuple(args), kwargs
    return True


def attributes_as_inputs(g: fx.Graph, owner: torch.nn.Module) -> list[str]:
    """Turn each tensor the graph reads with ``get_attr`` (of ``owner``) into a placeholder after the others;
    returns the attribute names, in the order the program now takes them."""
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    names: list[str] = []
    for n in [n for n in g.nodes if n.op == "get_attr"]:
        if not isinstance(getattr(owner, str(n.target), None), torch.Tensor):
            continue
        with g.inserting_after(last):
            ph = g.placeholder(f"attr_{len(names)}")
        ph.meta.update(n.meta)
        n.replace_all_uses_with(ph)
        g.erase_node(n)
        names.append(str(n.target))
        last = ph
    return names


@dataclass
class Compilable:
    """A program ready for ``torch.compile``: ``gm(*inputs, *attributes)``."""

    gm: fx.GraphModule
    attributes: list[torch.Tensor]
    numbers_left: int
    stats: CommStats = field(default_factory=CommStats)  # what one run's collectives move


def compilable(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> Compilable:
    """Flatten ``gm`` for the compiler as the module docstring says (``inputs``: one call's inputs; the
    program runs on the device of the first input not on the CPU, if any)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from . import collectives

    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    attrs = attributes_as_inputs(g, gm)
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor) and x.device.type != "cpu"), None)
    left = scalars_as_tensors(g, device)
    work = fx.GraphModule(gm, g)
    held = [getattr(gm, a) for a in attrs]
    stats = CommStats()
    with collectives.counting_into(stats):
        flat = make_fx(work, tracing_mode="fake")(*inputs, *held)
    flat.graph.eliminate_dead_code()
    flat.recompile()
    return Compilable(flat, held, left, stats)


@dataclass
class CompiledProgram:
    """``gm`` compiled by ``torch.compile`` at the first call (see the module docstring). Call it as ``gm``."""

    gm: fx.GraphModule
    backend: str
    options: dict = field(default_factory=dict)
    stats: CommStats | None = None  # the lowered program's: what the collectives move, added at every call
    random: bool = False  # the step draws random numbers: the compiled program draws eager torch's
    compile_seconds: float | None = None
    graph_breaks: int = 0
    kernels: int = 0
    numbers_left: int = 0
    _prog: Compilable | None = None
    _fn: Callable | None = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self._fn is None:
            return self._first(inputs)
        out = self._fn(*inputs, *self._prog.attributes)  # type: ignore[union-attr]
        self._count()
        return out

    def _count(self) -> None:
        if self.stats is not None and self._prog is not None:
            for k, b in self._prog.stats.bytes.items():
                self.stats.add(k, b, self._prog.stats.calls.get(k, 0))

    def _first(self, inputs: Sequence[torch.Tensor]) -> Any:
        from torch._dynamo.utils import counters
        from torch._inductor import metrics

        t0 = time.perf_counter()
        self._prog = compilable(self.gm, inputs)
        breaks = sum(counters["graph_break"].values())
        kernels = metrics.generated_kernel_count
        try:
            self._fn = torch.compile(self._prog.gm, backend=self.backend, **self.options)
        except TypeError as e:
            raise TypeError(f"compile_options {self.options!r} are not torch.compile's keywords: {e}") from None
        config = _inductor_config(self.random, bool(self._prog.stats.calls), self.options)
        with config, Ticker(f"compile ({self.backend})"):
            out = self._fn(*inputs, *self._prog.attributes)
        self.compile_seconds = time.perf_counter() - t0
        self.graph_breaks = sum(counters["graph_break"].values()) - breaks + self._prog.numbers_left
        self.kernels = metrics.generated_kernel_count - kernels
        self.numbers_left = self._prog.numbers_left
        self._count()
        return out


def check_settings(settings: Any, stages: bool = False) -> str:
    """The backend of ``settings`` if this module can compile a step with them (``stages``: the plan runs
    pipeline stages); else a NotSupported naming the option, or a ValueError for an unknown backend."""
    from metadist_core.driver.frontend import NotSupported

    backend = check_backend(settings.backend)
    if backend == EAGER:
        return backend
    for option, on in (
        ("pipeline_stages", stages or (settings.pipeline_stages or 1) > 1),
        ("offload", settings.offload),
    ):
        if on:
            value = getattr(settings, option) if not stages or option != "pipeline_stages" else "planned"
            raise NotSupported(
                f"backend={backend!r} cannot compile a step with {option}={value!r} yet: "
                f"use backend='eager' with {option}, or leave {option} out"
            )
    return backend


def compile_programs(run: Any, settings: Any, random: bool) -> list[CompiledProgram]:
    """Compile the rank programs of a lowered step ``run`` (a LocalProgram, RankProgram or MicroBatchProgram)
    with ``settings.backend`` and ``settings.compile_options``, each at its first call; returns them."""
    from metadist_core.driver.frontend import NotSupported

    backend = check_settings(settings)
    made: list[CompiledProgram] = []

    def make(gm: fx.GraphModule, stats: CommStats | None) -> CompiledProgram:
        made.append(CompiledProgram(gm, backend, dict(settings.compile_options or {}), stats, random))
        return made[-1]

    if hasattr(run, "lowered"):  # a RankProgram
        run.lowered.compiled = make(run.lowered.gm, run.lowered.stats)
    elif hasattr(run, "grad") and hasattr(run, "update"):  # a MicroBatchProgram: its two programs
        run.grad.compiled = make(run.grad.gm, run.grad.stats)
        run.update.compiled = make(run.update.gm, run.update.stats)
    elif hasattr(run, "compiled"):  # a LocalProgram
        run.compiled = make(run.gm, None)
    else:
        raise NotSupported(f"backend={backend!r} cannot compile a {type(run).__name__} yet: use backend='eager'")
    run.compiled_programs = made
    return made


def compile_report(run: Any) -> dict[str, Any] | None:
    """What compiling ``run``'s programs took, once every one has been compiled: ``backend``, ``seconds``
    (their first calls, the compile included), ``graph_breaks``, ``kernels`` (Inductor's generated kernels),
    ``programs``; None before, or for a step run eagerly."""
    progs = getattr(run, "compiled_programs", None)
    if not progs or any(p.compile_seconds is None for p in progs):
        return None
    return {
        "backend": progs[0].backend,
        "seconds": round(sum(p.compile_seconds or 0.0 for p in progs), 3),
        "graph_breaks": sum(p.graph_breaks for p in progs),
        "kernels": sum(p.kernels for p in progs),
        "programs": len(progs),
    }


#: Inductor's pass that moves each collective's wait down to the first op reading its result: the place the
#: lowering waits (metadist_torch.lower.schedule). Left alone, Inductor waits right after each collective starts.
SINK_WAITS = {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": ["sink_waits"]}


def _inductor_config(random: bool, collectives: bool, options: dict) -> contextlib.AbstractContextManager:
    """Inductor's configuration while a program compiles: a step that draws random numbers draws them as
    eager torch does (``fallback_random``: the single-device step's numbers from the same seed), and a
    program with collectives keeps its waits where the lowering put them (:data:`SINK_WAITS`), unless the
    user's ``compile_options`` set those passes."""
    import torch._inductor.config as inductor_config

    patch: dict[str, Any] = {}
    if random:
        patch["fallback_random"] = True
    user = set(options.get("options") or {})
    if collectives and not user & set(SINK_WAITS):
        patch.update(SINK_WAITS)
    return inductor_config.patch(patch) if patch else contextlib.nullcontext()


__all__ = [
    "EAGER",
    "SINK_WAITS",
    "CompiledProgram",
    "Compilable",
    "attributes_as_inputs",
    "check_backend",
    "check_settings",
    "compilable",
    "compile_programs",
    "compile_report",
    "scalars_as_tensors",
]
