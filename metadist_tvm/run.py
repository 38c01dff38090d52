"""One rank's run of a plan under torchrun: TVM kernels on torch CPU tensors, metadist_torch's collectives.

One process per device (``torchrun --nproc_per_node=N``); rank ``r`` plays
mesh device ``mesh.coordinates(r)``. The process group, the rank's Engine
(rank, world size, row-major coordinates, one process group per mesh axis)
and the collectives are metadist_torch's
(:func:`metadist_torch.runtime.engine.engine_for`,
:class:`metadist_torch.lower.collectives.AxisComm`); what is TVM's own is here:

- the default process group is gloo, started before metadist_torch's
  :func:`~metadist_torch.runtime.engine.ensure_process_group` would pick NCCL on a
  CUDA machine, because TVM's llvm kernels leave their results on the CPU;
- a kernel reads torch tensors as TVM tensors with ``tvm.runtime.from_dlpack``
  (compact, on a 64-byte boundary: :func:`aligned`) and its outputs come back
  with ``torch.from_dlpack``, so no copy is made between the two;
- every rank walks the plan with :func:`metadist_core.plan.interpret.interpret`
  and issues the same collectives in the same order (:class:`RankCollectives`).

The collectives do what :class:`metadist_core.plan.simulate.SimCollectives` does.
A reduce_scatter is an all_reduce followed by taking this rank's chunk, so that
its numbers are those of the all_reduce bit for bit on any number of ranks (a
gloo reduce_scatter sums in another order from 3 ranks on); ``avg`` of an
integer tensor is cast back to its dtype, as the simulator does.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import tvm

from metadist_core.cost.model import Collective
from metadist_core.plan.interpret import Collectives, interpret
from metadist_core.ir.ir import MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding, group_extents, local_piece, shard_shape
from metadist_torch.lower.collectives import AxisComm
from metadist_torch.runtime.engine import Engine, engine_for, ensure_process_group, world_info
from metadist_torch.runtime.stats import CommStats

log = logging.getLogger("metadist.tvm")


def start_process_group() -> tuple[int, int]:
    """(rank, world size) of the job, the default process group started on gloo when torchrun launched more
    than one rank and none is running yet (a plain process is world size 1 and needs none)."""
    if not dist.is_available():
        raise RuntimeError(
            "torch.distributed is not available in this torch build, so engine='torch' cannot "
            "run; use engine='simulate' or a torch build with distributed support"
        )
    if not dist.is_initialized() and world_info()[1] > 1:
        dist.init_process_group("gloo")
        log.info("started process group gloo: rank %d of %d", *world_info())
    return ensure_process_group()


def torch_engine(mesh: Any = None) -> Engine:
    """metadist_torch's Engine of this rank for ``mesh`` (None: the whole world as one axis), on a gloo
    process group; a mesh whose size is not the world size is a ValueError quoting both."""
    start_process_group()
    return engine_for(mesh)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compact tensor on a 64-byte boundary, as TVM's DLPack import requires (copied only if not)."""
    t = t.contiguous()
    if t.data_ptr() % 64:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class RankCollectives(Collectives):
    """The plan's collectives for this rank, each on the :class:`AxisComm` of its mesh axis: a value is this
    rank's torch tensor. ``stats`` counts the bytes they moved, by kind."""

    def __init__(self, engine: Engine) -> None:
        self.mesh, self.coords = engine.mesh, engine.coords
        self.stats = CommStats()
        groups = engine.groups()
        self.comms = [
            AxisComm(a, None if groups is None else groups[a], engine.mesh.shape[a], engine.coords[a], self.stats)
            for a in range(engine.mesh.ndim)
        ]

    def all_reduce(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        out = self.comms[c.axis].all_reduce(t, c.reduce)
        return out if out.dtype == t.dtype else out.to(t.dtype)  # an integer avg: back to its dtype

    def all_gather(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        d = c.dims[0] % len(shape)
        return self.comms[c.axis].all_gather(t, d, group_extents(shape, c.before, self.mesh, self.coords, c.axis, d))

    def reduce_scatter(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        return self.comms[c.axis].local_split(self.all_reduce(t, c, shape), c.dims[0] % len(shape))

    def all_to_all(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        src, dst = (d % len(shape) for d in c.dims)
        return self.comms[c.axis].all_to_all(
            t, src, dst, group_extents(shape, c.before, self.mesh, self.coords, c.axis, src)
        )

    def local_split(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        return self.comms[c.axis].local_split(t, c.dims[0] % len(shape))

    def local_partial(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        return self.comms[c.axis].local_partial(t, c.after[c.axis].reduce)


def run_kernel(kernel: Any, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run a compiled kernel (``metadist_tvm.oprunner.Kernel``) on torch tensors through DLPack, no copies."""
    ins = [tvm.runtime.from_dlpack(aligned(x)) for x in xs]
    dev = tvm.cpu()
    outs = [tvm.runtime.empty(s, d, dev) for s, d in zip(kernel.out_shapes, kernel.out_dtypes)]
    kernel.func(*ins, *outs)
    return [torch.from_dlpack(o) for o in outs]


def run_plan(
    graph: Any, plan: Any, mesh: Mesh, inputs: Mapping[str, np.ndarray], kernel_for: Callable
) -> dict[str, np.ndarray]:
    """This rank's run of ``plan``: its pieces of the whole ``inputs``, TVM kernels, metadist_torch collectives.

    ``kernel_for(op, local input shapes, local output shapes)`` gives the compiled kernel of an op.
    Returns the graph outputs, whole (every rank gets the same).
    """
    engine = torch_engine(mesh)
    coll = RankCollectives(engine)
    rep = Sharding.replicated(mesh.ndim)
    local = {}
    for v in graph.inputs:
        t = torch.from_numpy(np.ascontiguousarray(inputs[v]))
        local[v] = local_piece(
            t, plan.input_shardings.get(v, rep), mesh, coll.coords, zeros_like=torch.zeros_like
        ).contiguous()

    def run_op(op: MetaOp, xs: list[torch.Tensor], out_sh: list[Sharding]) -> list[torch.Tensor]:
        shapes = [shard_shape(graph.vars[o].shape, s, mesh, coll.coords) for o, s in zip(op.outputs, out_sh)]
        res = run_kernel(kernel_for(op, [tuple(x.shape) for x in xs], shapes), xs)
        for r, want, v in zip(res, shapes, op.outputs):
            if tuple(r.shape) != tuple(want):
                raise RuntimeError(
                    f"rank {engine.rank}: op {op.id} ({op.key}) made {v} with local shape "
                    f"{tuple(r.shape)}, but the plan expects {tuple(want)}; its rule does not hold "
                    f"at this shape"
                )
        return res

    result = interpret(graph, plan, mesh, local, run_op, coll)
    return {o: t.numpy().copy() for o, t in result.outputs.items()}


__all__ = ["run_plan", "run_kernel", "RankCollectives", "torch_engine", "start_process_group", "aligned"]
