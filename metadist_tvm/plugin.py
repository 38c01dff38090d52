"""The TVM frontend adapter (entry point ``tvm`` in group ``metadist.frontends``).

It owns op keys starting with ``te.``. A TE graph is not a Python step
function: the driver's "step" is ``fn=None`` with ``args == (inputs,
outputs)`` (placeholders and output tensors) and ``kwargs`` may hold
``name``. Importing this module imports neither tvm nor torch.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Hashable

from metadist_core.driver.frontend import (
    Frontend,
    FrontendTraits,
    Lowered,
    Program,
    Resolved,
    Traced,
    Trials,
    WholeStep,
    not_supported,
)
from metadist_core.hookspecs import hookimpl
from metadist_core.ir.mesh import Mesh

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
    shape = getattr(mesh, "shape", None)  # a torch DeviceMesh
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
    description = "TVM Tensor Expression: topi operators and TE computes rebuilt at shard shapes, llvm"
    # op specs come from the graph's shapes and the call, its static arguments rewritten
    traits = FrontendTraits(op_prefixes=("te.",), runner_module="metadist_tvm.oprunner", proxy_shapes=True)

    def __init__(self, engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        self.engine_choice = engine

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
        return (
            tuple(id(t) for t in inputs),
            tuple(id(t) for t in outs),
            isinstance(outputs, (list, tuple)),
            kwargs.get("name", "te_graph"),
        )

    def trace(self, fn: Callable | None, args: tuple, kwargs: dict) -> Traced:
        """``args`` is ``(inputs, outputs)``: te placeholders and one output tensor or a list of them."""
        from .trace import trace

        if len(args) < 2:
            raise TypeError(f"the tvm frontend traces (inputs, outputs) of a TE graph; got {len(args)} arguments")
        te_traced = trace(args[0], args[1], kwargs.get("name", "te_graph"))
        return Traced(te_traced.graph, context=te_traced)

    def resolve_mesh(self, mesh: Any, profile: Any) -> Resolved:
        """The planning Mesh and, under torch, this rank's metadist_torch Engine (None: the simulator)."""
        if self.engine == "torch":  # None is the whole world as one axis; a size that is not the world's: ValueError
            from .run import torch_engine

            eng = torch_engine(mesh)
            m = mesh if isinstance(mesh, Mesh) else profile.mesh(eng.mesh.shape, eng.mesh.axis_names)
            return Resolved(m, eng, lead=eng.rank == 0)
        if mesh is None:
            mesh = (2,)
        if isinstance(mesh, Mesh):
            return Resolved(mesh)
        shape, names = mesh_shape(mesh)
        return Resolved(profile.mesh(shape, names))

    def share(self, plan_fn: Callable[[], Any], traced: Traced, resolved: Resolved) -> Any:
        """Under torch, rank 0 plans and broadcasts its plan (or its error); else this process plans."""
        eng = resolved.engine
        if eng is None:
            return plan_fn()
        from metadist_core.plan.plan import ShardingPlan

        plan = None
        if resolved.lead:
            try:
                plan = plan_fn()
            except BaseException as error:  # the other ranks wait for a plan: tell them instead
                eng.broadcast({"error": f"{type(error).__name__}: {error}"})
                raise
        msg = eng.broadcast({"plan": plan.to_json()} if plan is not None else None)
        if msg is None or "error" in msg:
            why = "no plan" if msg is None else msg["error"]
            raise RuntimeError(f"rank 0 failed to plan {traced.graph.name!r}: {why}")
        return plan if plan is not None else ShardingPlan.from_json(msg["plan"])

    def lower(self, traced: Traced, program: Program, resolved: Resolved, settings: Any) -> Lowered:
        """A :class:`~metadist_tvm.runtime.Parallelized` running the plan on ``resolved``'s engine."""
        from .runtime import Parallelized
        from .trace import Traced as TeTraced

        if isinstance(program, Trials):
            return Lowered()
        if not isinstance(program, WholeStep):
            raise not_supported(self.name, program)
        te_traced = traced.context
        if not isinstance(te_traced, TeTraced):
            raise ValueError(
                f"{traced.graph.name!r} was not traced by the tvm frontend in this process "
                f"(its context is {type(te_traced).__name__}); trace it with TvmFrontend().trace"
            )
        return Lowered(
            Parallelized(te_traced, program.plan, resolved.mesh, "simulate" if resolved.engine is None else "torch")
        )

    def __repr__(self) -> str:
        return f"<TvmFrontend 'tvm' engine={self.engine_choice}>"


@hookimpl
def metadist_frontend() -> TvmFrontend:
    return TvmFrontend()
