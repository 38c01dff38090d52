"""``parallelize``: trace a TE graph, plan it on a mesh, and run the split program.

Two engines run the same plan:

- ``simulate``: one process plays every device of the mesh. Each device's
  kernels are the ops rebuilt at its shard shapes (TVM, llvm); the plan's
  collectives move numpy values exactly as :mod:`metadist_core.simulate`
  defines them.
- ``torch``: one process per device, launched with ``torchrun``; kernels
  exchange buffers with torch through DLPack and the collectives run on
  ``torch.distributed`` (gloo on CPU). See :mod:`metadist_tvm.engine_torch`.

``engine="auto"`` picks ``torch`` when a process group is up (or
``WORLD_SIZE`` > 1 says torchrun started this process) and ``simulate`` else.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

import numpy as np

from metadist_core.ir import MetaOp
from metadist_core.placement import Mesh
from metadist_core.simulate import simulate

from .oprunner import KernelCache, kernel_cache, run_call, run_reshape
from .trace import Traced, trace

log = logging.getLogger("metadist.tvm")

ENGINES = ("auto", "simulate", "torch")


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
                raise RuntimeError(f"op {op.id} ({op.key}) made {v} with local shape {tuple(o.shape)}, but the plan "
                                   f"expects {tuple(want)}; its rule does not hold at this shape")
        return outs[0] if len(outs) == 1 else tuple(outs)


def as_mesh(mesh: Any) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, str):
        return Mesh.parse(mesh)
    if isinstance(mesh, (int, tuple, list)):
        return Mesh(mesh)
    shape = getattr(mesh, "shape", None)   # a torch DeviceMesh
    if shape is not None:
        return Mesh(tuple(shape), tuple(getattr(mesh, "mesh_dim_names", None) or ()) or None)
    raise TypeError(f"mesh must be a Mesh, a shape such as (2, 2), or a string like '2x2'; got {mesh!r}")


def _torch_world() -> int:
    """World size of a running or announced torch.distributed job, else 0."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except ImportError:
        return 0
    return int(os.environ.get("WORLD_SIZE", "0") or 0)


class Parallelized:
    """The split program of a TE graph: call it with one array per graph input; it returns the outputs whole.

    ``.plan`` is the ShardingPlan, ``.graph`` the MetaIR, ``.engine`` the
    engine that runs it ("simulate" or "torch").
    """

    def __init__(self, traced: Traced, plan: Any, mesh: Mesh, engine: str, single_output: bool,
                 cache: KernelCache | None = None, result: Any = None) -> None:
        self.traced, self.plan, self.mesh, self.engine = traced, plan, mesh, engine
        self.graph = traced.graph
        self.result = result   # the pipeline's CompileResult (rulebook, problem, timings), where planned here
        self._single = single_output
        self.cache = cache or kernel_cache()
        self._runner = LocalRunner(traced, self.cache)
        self._dist = None
        if engine == "torch":
            from .engine_torch import engine_for
            self._dist = engine_for(mesh)

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
        if self._dist is not None:
            outs = self._dist.run(self.traced, self.plan, inputs, self._runner)
        else:
            outs, _ = simulate(g, self.plan, self.mesh, inputs, self._runner)
        result = [outs[o] for o in g.outputs]
        return result[0] if self._single else result

    def __repr__(self) -> str:
        return f"<Parallelized {self.graph.name!r} on mesh {self.mesh} ({self.engine}): {len(self.graph.ops)} ops>"


def _plugins(plugins: Any = None):
    from metadist_core.plugins import PluginManager
    pm = plugins or PluginManager()
    if pm.pm.get_plugin("frontend:tvm") is None:   # not installed through its entry point (say, from a checkout)
        from . import plugin
        pm.register(plugin, "frontend", "tvm")
    return pm


def plan_traced(traced: Traced, mesh: Mesh, *, plugins: Any = None, **plan_kwargs: Any):
    """Discover rules for the traced graph and solve it on ``mesh`` (the pipeline's ``plan_graph``)."""
    from metadist_core.pipeline import plan_graph
    return plan_graph(traced.graph, mesh, plugins=_plugins(plugins), **plan_kwargs)


def parallelize(inputs: Sequence[Any], outputs: Any, mesh: Any = None, *, solver: str | None = None,
                engine: str = "auto", memory_budget: int | None = None, cache_dir: str | None = None,
                constraints: Any = None, plugins: Any = None, name: str = "te_graph",
                solver_options: Mapping | None = None) -> Parallelized:
    """Split the TE graph from placeholders ``inputs`` to ``outputs`` over ``mesh``; a callable running it.

    ``outputs`` is one te.Tensor (the callable then returns one array) or a
    list of them. ``mesh`` is a shape such as ``(4,)`` or ``(2, 2)``, a
    :class:`~metadist_core.placement.Mesh`, or None for one axis over the
    torch world (or 2 simulated devices without one). ``engine`` is
    ``auto``, ``simulate`` (every device in this process) or ``torch`` (one
    process per device under torchrun, gloo on CPU). The graph's operators
    must come from ``metadist_tvm.topi`` or ``@metadist_tvm.op`` builders.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    single = not isinstance(outputs, (list, tuple))
    outs = [outputs] if single else list(outputs)
    world = _torch_world()
    if engine == "auto":
        engine = "torch" if world > 1 else "simulate"
    if mesh is None:
        mesh = (world,) if engine == "torch" else (2,)
    m = as_mesh(mesh)
    traced = trace(inputs, outs, name)
    plan_kwargs = dict(solver=solver, memory_budget=memory_budget, cache_dir=cache_dir, constraints=constraints,
                       solver_options=dict(solver_options or {}))
    if engine == "torch":
        from .engine_torch import planned_on_rank0
        plan, result = planned_on_rank0(traced, m, lambda: plan_traced(traced, m, plugins=plugins, **plan_kwargs))
    else:
        result = plan_traced(traced, m, plugins=plugins, **plan_kwargs)
        plan = result.plan
    return Parallelized(traced, plan, m, engine, single, result=result)
