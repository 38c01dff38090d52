"""Peak tensor memory of one step on this rank, measured, beside the cost model's prediction.

Two methods, one result (:class:`MemoryMeasurement`):

- ``cuda_allocator`` (the step's device is a GPU): ``torch.cuda.reset_peak_memory_stats`` before the
  step, ``torch.cuda.max_memory_allocated`` after it -- every byte the caching allocator handed out,
  state, inputs, activations, gradients and collective buffers included -- less what it held before the
  step besides the baseline's storages (``outside_bytes``: the cuBLAS workspace, other models).
- ``live_storages`` (CPU): a :class:`LiveTensorTracker` -- a ``TorchDispatchMode`` that records the
  untyped storage of every tensor an op returns, holds a weak reference to it, and after each op adds
  up the bytes of the storages still alive. The tensors that exist before the step (parameters,
  buffers, optimizer state, gradients, the batch: ``baseline``) are counted from the start. A storage
  shared by several tensors (views) counts once; ``UntypedStorage.resize_`` (FSDP2 frees its gathered
  parameters that way) is followed while tracking.

The same :func:`measure_peak` serves MetaDist's compiled steps (``TorchStep.memory``) and the eager
baselines a benchmark compares them with (DDP, FSDP2: :func:`state_tensors` gives their baseline), so
the figures compare like with like. What is counted: the bytes of tensor storages on this rank, at op
granularity (a kernel's private workspace inside one op is not seen on CPU); Python objects, the
allocator's caching and the communication library's own buffers are not.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..lower.program import user_tensors

LIVE_STORAGES = "live_storages"
CUDA_ALLOCATOR = "cuda_allocator"


@dataclass
class MemoryMeasurement:
    """What one measured call held on this rank: bytes at its start, at its peak and at its end."""

    method: str
    peak_bytes: int
    baseline_bytes: int
    end_bytes: int
    ops: int = 0  # ops seen (live_storages) or 0
    outside_bytes: int = 0  # cuda_allocator: allocated before the call and not the baseline's (left out)

    def as_dict(self) -> dict[str, Any]:
        d = {
            "method": self.method,
            "measured_peak_bytes": self.peak_bytes,
            "baseline_bytes": self.baseline_bytes,
            "end_bytes": self.end_bytes,
        }
        if self.outside_bytes:
            d["outside_bytes"] = self.outside_bytes
        return d


def _storages(t: Any) -> list[torch.UntypedStorage]:
    """The untyped storages behind a tensor (a DTensor's: its local tensor's; a meta tensor has none)."""
    if not isinstance(t, torch.Tensor):
        return []
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return _storages(local)
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _storages(getattr(t, n))]
    if t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # a wrapper without storage
        return []


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive while ops run; ``peak_bytes`` is the most seen.

    Use as a context manager around the code to measure; ``track(*tensors)`` adds tensors that exist
    already (state, inputs). A storage counts from the op (or ``track``) that first shows it to its
    deallocation, at its current size.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (weak ref, bytes counted)
        self.current = 0
        self.peak_bytes = 0
        self.ops = 0
        self._orig_resize: Callable | None = None

    # -- bookkeeping -------------------------------------------------------------------------
    def track(self, *tensors: Any) -> None:
        """Count these tensors' storages (nested lists, tuples and dicts are walked)."""
        for t in pytree.tree_leaves(list(tensors)):
            for st in _storages(t):
                self._add(st)
        self.peak_bytes = max(self.peak_bytes, self.current)

    def _add(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        hit = self.live.get(key)
        if hit is not None and hit[0]() is st:
            self._resize(st)
            return
        n = int(st.nbytes())
        self.live[key] = (weakref.ref(st, lambda _ref, k=key: self._drop(k, _ref)), n)
        self.current += n

    def _drop(self, key: int, ref: weakref.ref) -> None:
        hit = self.live.get(key)
        if hit is not None and hit[0] is ref:
            del self.live[key]
            self.current -= hit[1]

    def _resize(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        hit = self.live.get(key)
        if hit is None or hit[0]() is not st:
            return
        n = int(st.nbytes())
        if n != hit[1]:
            self.live[key] = (hit[0], n)
            self.current += n - hit[1]

    # -- the mode ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in pytree.tree_leaves(out):
            for st in _storages(t):
                self._add(st)
        self.peak_bytes = max(self.peak_bytes, self.current)
        return out

    def __enter__(self) -> "LiveTensorTracker":
        orig = self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:  # FSDP2 frees and refills storages this way
            r = orig(st, size)
            tracker._resize(st)
            tracker.peak_bytes = max(tracker.peak_bytes, tracker.current)
            return r

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._orig_resize is not None:
                torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
                self._orig_resize = None


def _device_of(tensors: Iterable[Any]) -> torch.device:
    for t in pytree.tree_leaves(list(tensors)):
        if isinstance(t, torch.Tensor):
            local = getattr(t, "_local_tensor", t)
            return local.device
    return torch.device("cpu")


def measure_peak(
    fn: Callable[[], Any], baseline: Iterable[Any] = (), device: torch.device | str | None = None
) -> tuple[Any, MemoryMeasurement]:
    """Run ``fn()`` once and measure the peak tensor bytes it holds on this rank: ``(result, measurement)``.

    ``baseline``: the tensors alive before the call that the step uses (state, inputs); on CPU they are
    counted from the start (on a GPU the allocator knows them already). ``device``: where the step runs
    (default: the first baseline tensor's); a CUDA device uses the allocator's statistics.
    """
    base = list(baseline)
    dev = torch.device(device) if device is not None else _device_of(base)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        # what the allocator holds before the call besides the baseline's storages is not the step's: the
        # cuBLAS workspace (which can be larger than a small model's state), other models in the
        # process. It is left out, as the live_storages count leaves it out on CPU.
        seen: dict[int, int] = {}
        for t in pytree.tree_leaves(base):
            for st in _storages(t):
                if st.device == dev:
                    seen[st.data_ptr()] = st.nbytes()
        outside = max(0, int(start) - sum(seen.values()))
        out = fn()
        torch.cuda.synchronize(dev)
        return out, MemoryMeasurement(
            CUDA_ALLOCATOR,
            int(torch.cuda.max_memory_allocated(dev)) - outside,
            int(start) - outside,
            int(torch.cuda.memory_allocated(dev)) - outside,
            outside_bytes=outside,
        )
    tracker = LiveTensorTracker()
    tracker.track(base)
    start = tracker.current
    with tracker:
        out = fn()
        tracker.track(out)
    return out, MemoryMeasurement(LIVE_STORAGES, tracker.peak_bytes, start, tracker.current, tracker.ops)


def state_tensors(model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an eager training step starts from: parameters, their gradients, buffers, optimizer state."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    out.extend(model.buffers())
    for opt in optimizers:
        for st in opt.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def report(predicted: int | None, m: MemoryMeasurement) -> dict[str, Any]:
    """``step.memory``'s dict: the prediction beside the measurement and their ratio (measured / predicted)."""
    d: dict[str, Any] = {"predicted_peak_bytes": predicted, **m.as_dict()}
    d["ratio"] = (m.peak_bytes / predicted) if predicted else None
    return d


def step_baseline(traced: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a compiled step starts from: its state (``traced``: a ``TracedStep``) and the call's tensors
    (with the gradients it reads)."""
    slots = getattr(getattr(traced, "state", None), "slots", None) or []
    return [s.get() for s in slots] + (
        traced.inputs(args, kwargs) if traced is not None else user_tensors(args, kwargs)
    )


def measure_compiled(result: Any, args: tuple, kwargs: dict) -> tuple[Any, dict[str, Any]]:
    """Run a compile result's step once under :func:`measure_peak`: ``(what the step returns, step.memory)``.

    ``predicted_peak_bytes`` is the plan's peak with the buffers its collectives make
    (``plan.stats.peak_with_buffers``, :mod:`metadist_core.plan.memprofile`; a plan made without a solve, at
    world size 1, has none and needs none); ``predicted_solver_bytes`` is ``plan.memory_per_device``
    (:meth:`metadist_core.problem.terms.Terms.peak_memory`), the figure the solver holds to ``memory_budget``.
    """
    traced = getattr(result.traced, "context", None)
    out, m = measure_peak(lambda: result.runnable(*args, **kwargs), step_baseline(traced, args, kwargs))
    solver = getattr(result.plan, "memory_per_device", None)
    stats = getattr(result.plan, "stats", None)
    with_buffers = stats.peak_with_buffers if stats is not None else None
    predicted = with_buffers or solver
    d = report(int(predicted) if predicted else None, m)
    d["predicted_solver_bytes"] = int(solver) if solver else None
    return out, d


__all__ = [
    "LiveTensorTracker",
    "MemoryMeasurement",
    "measure_peak",
    "state_tensors",
    "report",
    "step_baseline",
    "measure_compiled",
    "LIVE_STORAGES",
    "CUDA_ALLOCATOR",
]
