"""How much slower than the roofline each op of a step runs on this device, measured (the ops' slowdowns).

The cost model prices an op as ``max(flops / FLOP rate, bytes / memory rate)`` with the rates of a
matmul and of an ``add`` (:func:`metadist_torch.calibrate.measure_device_rates`). Most other ops run
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
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from metadist_core.cost.model import DeviceSpec, compute_cost, compute_dtype
from metadist_core.cost.timing import time_call
from metadist_core.ir.ir import MetaIR, MetaOp

from .calibrate import _time, measure_device_rates
from .calls import TORCH_DTYPES, rebuild, resolve_overload
from .engine import device as engine_device
from .lower import lower_plan
from .oprunner import op_spec

log = logging.getLogger("metadist.optime")

VERSION = 3                   # 3: less a tiny op timed alike (2: fastest timings, alone; 1: medians)
VERSION_KEY = "__version__"
MAX_ELEMENTS = 1 << 20        # an op whose inputs and outputs hold more elements takes its key's slowdown
LIMITS = (0.25, 100.0)        # slowdowns are clamped to this range (a tiny op's time is mostly noise)
FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})
RANDOM = frozenset({"bernoulli", "native_dropout", "rand", "randn", "rand_like", "randn_like", "randint",
                    "uniform", "normal", "randperm", "multinomial", "empty", "empty_like", "new_empty"})


def _inputs(op: MetaOp, graph: MetaIR, dev: torch.device) -> list[torch.Tensor]:
    """Tensors of the op's input shapes and dtypes: floats in [0.5, 1.5) (no NaN from sqrt or log),
    integer inputs drawn in their valid ranges by the discovery's sampler."""
    metas = [graph.vars[v] for v in op.inputs]
    if any(not m.is_tensor for m in metas):
        raise ValueError("a non-tensor input")
    drawn = None
    if any(m.dtype not in FLOATS for m in metas):
        drawn = op_spec(op, graph).example_inputs
    out = []
    for i, m in enumerate(metas):
        dt = TORCH_DTYPES[m.dtype]
        if m.dtype in FLOATS:
            out.append((torch.rand(tuple(m.shape), device=dev) + 0.5).to(dt))
        else:
            out.append(torch.as_tensor(drawn[i]).to(dtype=dt, device=dev).reshape(tuple(m.shape)))
    return out


def _timed(fn: Callable[[], Any], sync: Callable[[], None], iters: int = 7) -> float:
    """The fastest of ``iters`` timings of one call (each long enough, >= 50 us, to be read on a clock)."""
    return time_call(fn, iters, sync=sync, window=5e-5, pick=min)


def _roofline(op: MetaOp, graph: MetaIR, cost: tuple, dev: DeviceSpec) -> float:
    dt = compute_dtype([graph.vars[v].dtype for v in op.inputs], [graph.vars[v].dtype for v in op.outputs])
    return compute_cost(cost[0], cost[1], 1, dev, dt) - dev.op_overhead


def _elements(op: MetaOp, graph: MetaIR) -> int:
    return sum(int(graph.vars[v].numel) for v in [*op.inputs, *op.outputs] if graph.vars[v].is_tensor)


def alone_rates(dev: torch.device) -> Callable[[], dict]:
    """This process's rates on ``dev`` while it has the device to itself
    (:func:`metadist_torch.calibrate.measure_device_rates`, ``alone``), measured at the first call and
    kept: what :func:`measure_slowdowns` and :func:`program_factor` of one compile divide by."""
    return functools.cache(lambda: measure_device_rates(iters=7, alone=True, dev=dev))


def measure_slowdowns(graph: MetaIR, costs: dict[str, tuple], cache_file: str | os.PathLike | None = None,
                      device: torch.device | None = None, rates: Callable[[], dict] | None = None
                      ) -> dict[str, float]:
    """Per op id of ``graph``, its measured time over its roofline (see the module doc); ``costs``: the
    op's ``(flops, bytes)`` as the frontend reports them. Ops already in ``cache_file`` are not run again.
    ``rates``: the device's alone rates (:func:`alone_rates`; asked only when an op is timed)."""
    dev = device or engine_device()
    rates_of = rates or alone_rates(dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    cache: dict[str, float] = {}
    path = Path(cache_file) if cache_file else None
    if path is not None and path.exists():
        try:
            saved = json.loads(path.read_text())
            if saved.get(VERSION_KEY) == VERSION:
                cache = {str(k): float(v) for k, v in saved.items() if k != VERSION_KEY}
        except (OSError, ValueError, AttributeError):
            cache = {}
    t0 = time.perf_counter()
    spec: DeviceSpec | None = None
    sig_of = {op.id: op.signature(graph) for op in graph.ops}
    by_key: dict[tuple, tuple[int, float]] = {}   # (key, dtypes) -> (elements, slowdown) of its largest measured op
    new = tried = 0
    for op in graph.ops:
        cost = costs.get(op.id)
        if cost is None or (cost[0] <= 0 and cost[1] <= 0):
            continue   # a view: free
        name = op.key.split(".")[1] if op.key.startswith("aten.") else ""
        key = (op.key, tuple(graph.vars[v].dtype for v in op.inputs))
        sig = sig_of[op.id]
        n = _elements(op, graph)
        if sig not in cache and name and name not in RANDOM and n <= MAX_ELEMENTS:
            if spec is None:
                r = rates_of()
                # the op's time beyond its roofline is its time less a tiny op's timed the same way (this
                # call path dispatches slower than the lowered program, whose own per-op cost the profile's
                # op_overhead adds back: less the program's dispatch instead, the ops would be priced over
                # what the step takes)
                tiny = torch.randn(8, device=dev)
                harness = _timed(lambda: torch.ops.aten.add.Tensor(tiny, tiny), sync)
                spec = DeviceSpec("measured", r["peak_flops"], r["mem_bandwidth"], op_overhead=harness,
                                  flops_by_dtype=r["flops_by_dtype"], mem_curve=r["mem_curve"])
            try:
                overload = resolve_overload(op.key)
                tensors = _inputs(op, graph, dev)
                args = rebuild(op.attrs.get("args", []), tensors, device=dev)
                kwargs = rebuild(op.attrs.get("kwargs", {}), tensors, device=dev)
                with torch.no_grad():
                    t = _timed(lambda: overload(*args, **kwargs), sync)
            except Exception as e:   # an op that cannot run alone: priced by the roofline (0: not timed)
                log.debug("op %s (%s) not timed: %s", op.id, op.key, e)
                cache[sig] = 0.0
                tried += 1
            else:
                roof = _roofline(op, graph, cost, spec)
                cache[sig] = min(max((t - spec.op_overhead) / max(roof, 1e-9), LIMITS[0]), LIMITS[1])
                new += 1
        if cache.get(sig) and n >= by_key.get(key, (-1, 0.0))[0]:
            by_key[key] = (n, cache[sig])
    out = {}
    for op in graph.ops:
        sig = sig_of[op.id]
        key = (op.key, tuple(graph.vars[v].dtype for v in op.inputs))
        s = cache.get(sig) or by_key.get(key, (0, None))[1]
        if s and op.id in costs:
            out[op.id] = s
    if new or tried:
        log.info("timed %d ops of %s on %s in %.1f s (%d could not run alone)", new, graph.name, dev,
                 time.perf_counter() - t0, tried)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({VERSION_KEY: VERSION, **cache}, sort_keys=True))
                os.replace(tmp, path)
            except OSError as e:
                log.warning("could not cache op timings in %s: %s", path, e)
    return out


#: the program is timed whole only when the cost model's one-device peak of it is at most this many bytes
PROGRAM_BYTES = 1 << 30
PROGRAM_FACTOR = (1.0, 4.0)   # the program's factor over its ops' alone times is clamped to this range


def program_factor(step: Any, graph: MetaIR, costs: dict[str, tuple], slowdowns: dict[str, float],
                   device: torch.device | None = None, iters: int = 3,
                   rates: Callable[[], dict] | None = None) -> float | None:
    """How many times longer the whole step's program runs, alone on this device at its traced shapes,
    than its ops' alone times say (their rooflines times ``slowdowns``, plus the per-op dispatch of a
    lowered program): each op is timed again and again on its own inputs, hot in the caches, while the
    program reads what the op before it wrote and writes fresh outputs (so the ops' times alone price a
    step under what it takes). The fastest of ``iters`` runs of the replicated program, lowered as every
    plan is (``step``: the :class:`~metadist_torch.trace.TracedStep` whose graph is ``graph``), on copies
    of the state; None where its one-device peak is over :data:`PROGRAM_BYTES` (a model that needs the
    mesh to fit) or it cannot run. Clamped to :data:`PROGRAM_FACTOR`. ``rates``: as for
    :func:`measure_slowdowns`. A step with dropout draws from the random generators here: the caller keeps
    them (:meth:`metadist_torch.plugin.TorchFrontend.op_slowdowns`)."""
    from metadist_core.driver.compile import replicated_plan
    from metadist_core.ir.mesh import Mesh
    dev = device or engine_device()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    if step is None or getattr(step, "graph", None) is not graph or not step.example_inputs:
        return None
    mesh = Mesh((1,))
    plan, _ = replicated_plan(graph, mesh)
    if plan.memory_per_device > PROGRAM_BYTES:
        log.info("the step's program is not timed whole: its one-device peak of %s bytes is over %s",
                 f"{int(plan.memory_per_device):,}", f"{PROGRAM_BYTES:,}")
        return None
    try:
        # as a compiled step runs it: state updated in its own storage (here, copies of the state)
        rg = lower_plan(graph, plan, mesh, coords=(0,), groups=None, coalesce=False, inplace_state=True)
        n_s = len(step.state.slots)
        vals = {step.in_names[i]: slot.get().detach().clone().to(dev) for i, slot in enumerate(step.state.slots)}
        vals.update({step.in_names[n_s + j]: t.to(dev) for j, t in enumerate(step.example_inputs)})
        vals.update({n: step.constant_on(k, dev)
                     for k, n in enumerate(step.in_names[n_s + len(step.example_inputs):])})
        args = [vals[v] for v in rg.input_vars]
        with torch.no_grad():
            measured = _time(lambda: rg(*args), iters, sync, pick=min)
    except Exception as e:   # a program that cannot run alone here: the ops' times stand
        log.info("the step's program could not be timed whole: %s: %s", type(e).__name__, e)
        return None
    r = (rates or alone_rates(dev))()
    spec = DeviceSpec("measured", r["peak_flops"], r["mem_bandwidth"], flops_by_dtype=r["flops_by_dtype"],
                      mem_curve=r["mem_curve"])
    roof = sum(_roofline(op, graph, costs[op.id], spec) * slowdowns.get(op.id, 1.0)
               for op in graph.ops if op.id in costs)
    dispatch = r["op_overhead"] * len(graph.ops)
    factor = (measured - dispatch) / max(roof, 1e-9)
    log.info("the step's program ran %.1f ms alone; its ops' alone times say %.1f (+ %.1f dispatch): x%.2f",
             measured * 1e3, roof * 1e3, dispatch * 1e3, factor)
    return min(max(factor, PROGRAM_FACTOR[0]), PROGRAM_FACTOR[1])


__all__ = ["alone_rates", "measure_slowdowns", "program_factor", "MAX_ELEMENTS"]
