"""The TVM frontend adapter (entry point ``tvm`` in group ``metadist.frontends``).

It owns op keys starting with ``te.``. A TE graph is not a Python step
function: the driver's "step" is ``fn=None`` with ``args == (inputs,
outputs)`` (placeholders and output tensors) and ``kwargs`` may hold
``name``. Importing this module imports neither tvm nor torch.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Hashable

from metadist_core.driver.frontend import Frontend, Traced
from metadist_core.hookspecs import hookimpl
from metadist_core.ir.placement import Mesh

ENGINES = ("auto", "simulate", "torch")


def torch_world() -> int:
    """World size of a running or announced torch.distributed job (torchrun's ``WORLD_SIZE``), else 0."""
    import sys
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "0") or 0)


def mesh_shape(mesh: Any) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """(shape, axis names or None) of a mesh argument: a shape, an int, a string like '2x2', a torch DeviceMesh."""
    if isinstance(mesh, Mesh):
        return mesh.shape, mesh.axis_names
    if isinstance(mesh, str):
        m = Mesh.parse(mesh)
        return m.shape, m.axis_names
    if isinstance(mesh, int):
        return (mesh,), None
    if isinstance(mesh, (tuple, list)):
        return tuple(int(s) for s in mesh), None
    shape = getattr(mesh, "shape", None)   # a torch DeviceMesh
    if shape is not None:
        return tuple(int(s) for s in shape), tuple(getattr(mesh, "mesh_dim_names", None) or ()) or None
    raise TypeError(f"mesh must be a Mesh, a shape such as (2, 2), or a string like '2x2'; got {mesh!r}")


class TvmFrontend(Frontend):
    """TVM Tensor Expression graphs, split by rebuilding each operator at the shard shapes.

    ``engine`` is ``simulate`` (every device in this process), ``torch`` (one
    process per device under torchrun, collectives on torch.distributed) or
    ``auto`` (torch when torchrun started this process with more than one
    rank, else simulate).
    """

    name = "tvm"
    op_prefixes = ("te.",)
    description = "TVM Tensor Expression: topi operators and TE computes rebuilt at shard shapes, llvm"
    runner_module = "metadist_tvm.oprunner"
    proxy_shapes = True   # op specs come from the graph's shapes and the call, its static arguments rewritten

    def __init__(self, engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        self.engine_choice = engine
        self.rank_engine: Any = None   # metadist_torch's Engine of this rank, when the engine is torch

    @property
    def engine(self) -> str:
        """The engine this adapter runs on: ``simulate`` or ``torch``."""
        if self.engine_choice == "auto":
            return "torch" if torch_world() > 1 else "simulate"
        return self.engine_choice

    # -- the flow -------------------------------------------------------------------
    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        inputs, outputs = args[:2]
        outs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return (tuple(id(t) for t in inputs), tuple(id(t) for t in outs), isinstance(outputs, (list, tuple)),
                kwargs.get("name", "te_graph"))

    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        """``args`` is ``(inputs, outputs)``: te placeholders and one output tensor or a list of them."""
        from .trace import trace
        if len(args) < 2:
            raise TypeError(f"the tvm frontend traces (inputs, outputs) of a TE graph; got {len(args)} arguments")
        te_traced = trace(args[0], args[1], kwargs.get("name", "te_graph"))
        return Traced(te_traced.graph, context=te_traced)

    def resolve_mesh(self, mesh: Any, profile: Any) -> Mesh:
        if self.engine == "torch":   # metadist_torch's Engine: None is the whole world as one axis
            from .run import torch_engine
            self.rank_engine = torch_engine(mesh)   # a mesh whose size is not the world size: ValueError
            if isinstance(mesh, Mesh):
                return mesh
            return profile.mesh(self.rank_engine.mesh.shape, self.rank_engine.mesh.axis_names)
        if mesh is None:
            mesh = (2,)
        if isinstance(mesh, Mesh):
            return mesh
        shape, names = mesh_shape(mesh)
        return profile.mesh(shape, names)

    def _rank_engine(self) -> Any:
        """This rank's metadist_torch Engine: the one :meth:`resolve_mesh` made, else the whole world's."""
        if self.rank_engine is None:
            from .run import torch_engine
            self.rank_engine = torch_engine(None)
        return self.rank_engine

    def is_planner(self) -> bool:
        return self.engine != "torch" or self._rank_engine().rank == 0

    def share(self, plan: Any, traced: Traced) -> Any:
        if self.engine != "torch":
            return super().share(plan, traced)
        from metadist_core.plan.plan import ShardingPlan

        eng = self._rank_engine()
        msg = eng.broadcast({"plan": plan.to_json()} if plan is not None else None)
        if msg is None or "error" in msg:
            why = "no plan" if msg is None else msg["error"]
            raise RuntimeError(f"rank 0 failed to plan {traced.graph.name!r}: {why}")
        return plan if plan is not None else ShardingPlan.from_json(msg["plan"])

    def share_error(self, error: BaseException) -> None:
        if self.engine == "torch":
            self._rank_engine().broadcast({"error": f"{type(error).__name__}: {error}"})

    def lower(self, traced: Traced, plan: Any, mesh: Mesh, settings: Any) -> Callable:
        """A :class:`~metadist_tvm.runtime.Parallelized` running ``plan`` on this process's engine."""
        from .runtime import Parallelized
        from .trace import Traced as TeTraced
        te_traced = traced.context
        if not isinstance(te_traced, TeTraced):
            raise ValueError(f"{traced.graph.name!r} was not traced by the tvm frontend in this process "
                             f"(its context is {type(te_traced).__name__}); trace it with TvmFrontend().trace")
        return Parallelized(te_traced, plan, mesh, self.engine)

    def __repr__(self) -> str:
        return f"<TvmFrontend 'tvm' engine={self.engine_choice}>"


@hookimpl
def metadist_frontend() -> TvmFrontend:
    return TvmFrontend()
