"""How much slower than the roofline each op of a step runs on this device, measured (the ops' slowdowns).

The cost model prices an op as ``max(flops / FLOP rate, bytes / memory rate)`` with the rates of a
matmul and of an ``add`` (:func:`metadist_torch.measure.devicerates.measure_device_rates`). Most other ops run
far slower than that on a CPU (``tanh``, ``_log_softmax``, ``native_layer_norm`` run many times their
roofline, where ``mm`` runs close to it), so the roofline prices a step under what it takes. Here each
distinct op of the step (its key, input
shapes, dtypes and static arguments: ``MetaOp.signature``) is run at its real shapes on this process's
device, once, and its time less that of a tiny op timed the same way (what this call path adds to
any op; the profile's ``op_overhead``, what the lowered program adds, is priced on top), divided by its
roofline at the rates measured in the same process just before, is its slowdown: the cost model multiplies its roofline by it
(:func:`metadist_core.cost.model.compute_cost`). Being a ratio it carries over to the rates of the live mesh
profile (which include what ranks sharing a machine take from each other). Both the op and the rates
are the fastest of several timings: the speed of this process when it has the device to itself, however
busy the other ranks are meanwhile (medians would read the op at whatever share of a core the rank got,
which depends on whether the other ranks are compiling or waiting while rank 0 times). The cache holds
:data:`VERSION`; a cache of another version is measured again. An op whose inputs are too
large to run in a few milliseconds takes the slowdown measured on the largest op of the same key and
dtype, and none (1) when there is none. Slowdowns are cached in a JSON file beside the mesh profile.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any, Callable

import torch

from metadist_core.cost.model import DeviceSpec
from metadist_core.cost.optimes import LIMITS, VERSION, VERSION_KEY, whole_slowdowns  # noqa: F401 - the cache format, re-exported
from metadist_core.cost.timing import time_call
from metadist_core.driver.frontend import OpTimes
from metadist_core.driver.planner import replicated_plan
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.mesh import Mesh

from .devicerates import measure_device_rates
from ..trace.calls import TORCH_DTYPES, rebuild, resolve_overload
from ..runtime.engine import device as engine_device
from ..lower.lower import lower_plan
from ..ops.oprunner import op_spec

log = logging.getLogger("metadist.optime")

MAX_ELEMENTS = 1 << 20  # an op whose inputs and outputs hold more elements takes its key's slowdown
FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})
RANDOM = frozenset(
    {
        "bernoulli",
        "native_dropout",
        "rand",
        "randn",
        "rand_like",
        "randn_like",
        "randint",
        "uniform",
        "normal",
        "randperm",
        "multinomial",
        "empty",
        "empty_like",
        "new_empty",
    }
)


def _inputs(op: MetaOp, shapes: tuple, dtypes: tuple, graph: MetaIR | None, dev: torch.device) -> list[torch.Tensor]:
    """Tensors of the given shapes and dtypes: floats in [0.5, 1.5) (no NaN from sqrt or log), integer
    inputs drawn in their valid ranges by the discovery's sampler (from ``graph``, the op's own)."""
    if graph is None and any(dt not in FLOATS for dt in dtypes):
        raise ValueError("integer inputs need the op's graph to be drawn")
    if len(shapes) != len(op.inputs):
        raise ValueError("a non-tensor input")
    drawn = None
    if any(dt not in FLOATS for dt in dtypes):
        drawn = op_spec(op, graph).example_inputs
    out = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        dt = TORCH_DTYPES[dtype]
        if dtype in FLOATS:
            out.append((torch.rand(tuple(shape), device=dev) + 0.5).to(dt))
        else:
            out.append(torch.as_tensor(drawn[i]).to(dtype=dt, device=dev).reshape(tuple(shape)))
    return out


def _timed(fn: Callable[[], Any], sync: Callable[[], None], iters: int = 7) -> float:
    """The fastest of ``iters`` timings of one call (each long enough, >= 50 us, to be read on a clock)."""
    return time_call(fn, iters, sync=sync, window=5e-5, pick=min)


def _elements(op: MetaOp, graph: MetaIR) -> int:
    return sum(int(graph.vars[v].numel) for v in [*op.inputs, *op.outputs] if graph.vars[v].is_tensor)


def alone_rates(dev: torch.device) -> Callable[[], dict]:
    """This process's rates on ``dev`` while it has the device to itself
    (:func:`metadist_torch.measure.devicerates.measure_device_rates`, ``alone``), measured at the first call and
    kept: what :func:`measure_slowdowns` and :func:`program_factor` of one compile divide by."""
    return functools.cache(lambda: measure_device_rates(iters=7, alone=True, dev=dev))


def time_ops(requests: list, dev: torch.device, step: Any = None, program: bool = False) -> OpTimes | None:
    """Seconds of one run of each requested ``(op, input shapes, dtypes)`` alone on ``dev`` (the fastest of
    several; None for an op that cannot run alone, draws random numbers, or whose inputs and outputs hold
    more than :data:`MAX_ELEMENTS` elements), the alone rates of ``dev`` and the harness (a tiny op timed
    the same way); with ``program``, also the whole program of ``step`` (a
    :class:`~metadist_torch.trace.trace.TracedStep`), replicated on ``dev`` (:func:`program_seconds`). None where
    nothing is to be timed. ``step`` gives the graph the ops come from (integer inputs are drawn in their
    valid ranges from it)."""
    graph = getattr(step, "graph", None)
    runnable = [i for i, (op, shapes, _) in enumerate(requests) if _runs_alone(op, shapes, graph)]
    if not runnable and not program:
        return None
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    rates = alone_rates(dev)
    seconds: list[float | None] = [None] * len(requests)
    harness = 0.0
    if runnable:
        rates()
        tiny = torch.randn(8, device=dev)
        harness = _timed(lambda: torch.ops.aten.add.Tensor(tiny, tiny), sync)
    for i in runnable:
        op, shapes, dtypes = requests[i]
        try:
            overload = resolve_overload(op.key)
            tensors = _inputs(op, shapes, dtypes, graph, dev)
            args = rebuild(op.attrs.get("args", []), tensors, device=dev)
            kwargs = rebuild(op.attrs.get("kwargs", {}), tensors, device=dev)
            with torch.no_grad():
                seconds[i] = _timed(lambda: overload(*args, **kwargs), sync)
        except Exception as e:  # an op that cannot run alone: priced by the roofline
            log.debug("op %s (%s) not timed: %s", op.id, op.key, e)
    whole = program_seconds(step, dev) if program else None
    r = rates()
    device = DeviceSpec(
        "measured",
        r["peak_flops"],
        r["mem_bandwidth"],
        op_overhead=r["op_overhead"],
        flops_by_dtype=r["flops_by_dtype"],
        mem_curve=r["mem_curve"],
    )
    return OpTimes(seconds, device, harness=harness, program=whole)


def _runs_alone(op: MetaOp, shapes: tuple, graph: MetaIR | None) -> bool:
    """Is ``op`` timed alone: an aten op that draws no random numbers, at most :data:`MAX_ELEMENTS`
    elements in its inputs and outputs (outputs counted where ``graph`` holds it)?"""
    name = op.key.split(".")[1] if op.key.startswith("aten.") else ""
    if not name or name in RANDOM:
        return False
    if graph is not None and all(v in graph.vars for v in [*op.inputs, *op.outputs]):
        return _elements(op, graph) <= MAX_ELEMENTS
    return sum(math.prod(s) for s in shapes) <= MAX_ELEMENTS


def measure_slowdowns(
    graph: MetaIR,
    costs: dict[str, tuple],
    cache_file: str | os.PathLike | None = None,
    device: torch.device | None = None,
    step: Any = None,
) -> dict[str, float]:
    """Per op id of ``graph``, its measured time over its roofline on ``device``
    (:func:`metadist_core.cost.optimes.whole_slowdowns` over :func:`time_ops`); ``step`` (whose graph is
    ``graph``): its program is timed whole too."""
    dev = device or engine_device()
    holder = step if step is not None else _GraphOnly(graph)
    return whole_slowdowns(
        graph, costs, lambda reqs, prog: time_ops(reqs, dev, holder, prog), cache_file, program=step is not None
    )


class _GraphOnly:
    """A stand-in for a traced step that holds only its graph (no program to time)."""

    def __init__(self, graph: MetaIR) -> None:
        self.graph = graph


#: the program is timed whole only when the cost model's one-device peak of it is at most this many bytes
PROGRAM_BYTES = 1 << 30


def program_seconds(step: Any, device: torch.device | None = None, iters: int = 3) -> float | None:
    """Seconds of the fastest of ``iters`` runs of the whole step's program, alone on this device at its
    traced shapes, replicated and lowered as every plan is, on copies of the state (``step``: a
    :class:`~metadist_torch.trace.trace.TracedStep`); None where its one-device peak is over
    :data:`PROGRAM_BYTES` (a model that needs the mesh to fit) or it cannot run. A step with dropout draws
    from the random generators here: the caller keeps them (:meth:`metadist_torch.plugin.TorchFrontend.time_ops`)."""
    dev = device or engine_device()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    if step is None or not getattr(step, "example_inputs", None):
        return None
    graph = step.graph
    mesh = Mesh((1,))
    plan, _ = replicated_plan(graph, mesh)
    if plan.memory_per_device > PROGRAM_BYTES:
        log.info(
            "the step's program is not timed whole: its one-device peak of %s bytes is over %s",
            f"{int(plan.memory_per_device):,}",
            f"{PROGRAM_BYTES:,}",
        )
        return None
    try:
        # as a compiled step runs it: state updated in its own storage (here, copies of the state)
        rg = lower_plan(graph, plan, mesh, coords=(0,), groups=None, coalesce=False, inplace_state=True)
        n_s = len(step.state.slots)
        vals = {step.in_names[i]: slot.get().detach().clone().to(dev) for i, slot in enumerate(step.state.slots)}
        vals.update({step.in_names[n_s + j]: t.to(dev) for j, t in enumerate(step.example_inputs)})
        vals.update(
            {n: step.constant_on(k, dev) for k, n in enumerate(step.in_names[n_s + len(step.example_inputs) :])}
        )
        args = [vals[v] for v in rg.input_vars]
        with torch.no_grad():
            return time_call(lambda: rg(*args), iters, sync=sync, pick=min)
    except Exception as e:  # a program that cannot run alone here: the ops' times stand
        log.info("the step's program could not be timed whole: %s: %s", type(e).__name__, e)
        return None


__all__ = ["alone_rates", "measure_slowdowns", "program_seconds", "time_ops", "MAX_ELEMENTS"]
