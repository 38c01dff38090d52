"""The split program of a TE graph: :class:`Parallelized`, what the TVM frontend's ``lower`` returns.

Two engines run the same plan, both through :func:`metadist_core.plan.interpret.interpret`:

- ``simulate``: one process plays every device of the mesh
  (:func:`metadist_core.plan.simulate.simulate` with :class:`LocalRunner`). Each
  device's kernels are the ops rebuilt at its shard shapes (TVM, llvm).
- ``torch``: one process per device, launched with ``torchrun``; kernels
  exchange buffers with torch through DLPack and the collectives are
  metadist_torch's, on ``torch.distributed`` (gloo on CPU). See :mod:`metadist_tvm.run`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from metadist_core.ir.ir import MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.plan.simulate import simulate

from .oprunner import Kernel, KernelCache, kernel_cache, run_call, run_reshape
from .trace import Traced

ENGINES = ("simulate", "torch")


def to_numpy(x: Any) -> np.ndarray:
    """A numpy array from a numpy array, a TVM tensor, a torch tensor or anything array-like."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "numpy") and callable(x.numpy):
        try:
            return np.asarray(x.numpy())
        except TypeError:
            pass
    return np.asarray(x)


class LocalRunner:
    """Runs one op of a traced graph on one device's pieces (the ``run_local`` of simulate)."""

    def __init__(self, traced: Traced, cache: KernelCache | None = None) -> None:
        self.traced = traced
        self.cache = cache or kernel_cache()

    def kernel(self, op: MetaOp, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]) -> Kernel:
        """The compiled kernel of ``op`` at these local input shapes (a reshape at its local target shape)."""
        call = self.traced.calls[op.id]
        g = self.traced.graph
        dtypes = [g.vars[v].dtype for v in op.inputs]
        if call.reshape_arg is not None:
            call = call.with_arg(call.reshape_arg, [int(s) for s in out_shapes[0]])
        return self.cache.get(call, in_shapes, dtypes)

    def __call__(self, op: MetaOp, inputs: list, out_shapes: list) -> Any:
        call = self.traced.calls[op.id]
        g = self.traced.graph
        xs = [np.asarray(x, dtype=g.vars[v].dtype) for x, v in zip(inputs, op.inputs)]
        if call.reshape_arg is not None:
            outs = run_reshape(call, xs[0], out_shapes[0], self.cache)
        else:
            outs = run_call(call, xs, self.cache)
        for o, want, v in zip(outs, out_shapes, op.outputs):
            if want is not None and tuple(o.shape) != tuple(want):
                raise RuntimeError(
                    f"op {op.id} ({op.key}) made {v} with local shape {tuple(o.shape)}, but the plan "
                    f"expects {tuple(want)}; its rule does not hold at this shape"
                )
        return outs[0] if len(outs) == 1 else tuple(outs)


class Parallelized:
    """The split program of a TE graph: call it with one array per graph input; it returns the outputs whole.

    ``.plan`` is the ShardingPlan, ``.graph`` the MetaIR, ``.mesh`` the Mesh,
    ``.engine`` the engine that runs it ("simulate" or "torch"); ``.result``
    is the pipeline's CompileResult (rulebook, problem, timings) when
    :func:`metadist_tvm.parallelize` made it, and ``.timings`` its seconds.
    """

    def __init__(
        self,
        traced: Traced,
        plan: Any,
        mesh: Mesh,
        engine: str = "simulate",
        cache: KernelCache | None = None,
        result: Any = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        self.traced, self.plan, self.mesh, self.engine = traced, plan, mesh, engine
        self.graph = traced.graph
        self.result = result
        self.cache = cache or kernel_cache()
        self.runner = LocalRunner(traced, self.cache)

    def with_result(self, result: Any) -> "Parallelized":
        """The same program, carrying the CompileResult that produced it."""
        return Parallelized(self.traced, self.plan, self.mesh, self.engine, self.cache, result)

    @property
    def timings(self) -> dict[str, float]:
        """Seconds of the compile that made this program: trace, discover, build_problem, solve, share, lower."""
        return {} if self.result is None else dict(self.result.timings)

    def __call__(self, *arrays: Any):
        g = self.graph
        if len(arrays) != len(g.inputs):
            raise TypeError(f"this program takes {len(g.inputs)} inputs ({', '.join(g.inputs)}), got {len(arrays)}")
        inputs = {}
        for v, a in zip(g.inputs, arrays):
            x = to_numpy(a)
            want = g.vars[v].shape
            if tuple(x.shape) != tuple(want):
                raise ValueError(f"input {v} must have shape {tuple(want)} (as its placeholder), got {tuple(x.shape)}")
            inputs[v] = x.astype(g.vars[v].dtype, copy=False)
        if self.engine == "torch":
            from .run import run_plan

            outs = run_plan(g, self.plan, self.mesh, inputs, self.runner.kernel)
        else:
            outs, _ = simulate(g, self.plan, self.mesh, inputs, self.runner)
        result = [outs[o] for o in g.outputs]
        return result[0] if self.traced.single_output else result

    def __repr__(self) -> str:
        return f"<Parallelized {self.graph.name!r} on mesh {self.mesh} ({self.engine}): {len(self.graph.ops)} ops>"
