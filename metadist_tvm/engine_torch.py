"""Run a plan across processes: TVM kernels per rank, collectives on torch.distributed through DLPack.

One process per device (``torchrun --nproc_per_node=N``); rank ``r`` plays
mesh device ``mesh.coordinates(r)``. Values live as torch CPU tensors; a
kernel reads them as TVM tensors with ``tvm.runtime.from_dlpack`` and its
outputs come back with ``torch.from_dlpack``, so no copy is made between the
two. Every rank walks the plan with :func:`metadist_core.plan.interpret.interpret`
and issues the same collectives in the same order, each on the process group
of its mesh axis (:class:`TorchCollectives`).

The collectives do what :class:`metadist_core.plan.simulate.SimCollectives` does,
with what gloo offers: all_reduce (avg as a sum divided by the group size),
all_gather (pieces padded to the largest chunk, so uneven splits work),
reduce_scatter as an all_reduce followed by taking this rank's chunk, and
all_to_all as an all_gather on the source dim followed by taking this rank's
chunk of the target dim.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist
import tvm

from metadist_core.cost.model import Collective
from metadist_core.plan.interpret import Collectives, interpret
from metadist_core.ir.ir import MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Sharding, chunk_bounds, group_extents, local_piece, shard_shape
from metadist_core.plan.simulate import axis_groups

log = logging.getLogger("metadist.tvm")


def ensure_process_group() -> None:
    """Start the default process group (gloo on CPU) from torchrun's environment when none is up."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; use engine='simulate'")
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the process group, started when needed."""
    ensure_process_group()
    return dist.get_rank(), dist.get_world_size()


def broadcast_from_rank0(payload: Any) -> Any:
    """Rank 0's ``payload`` on every rank (any picklable object; the others pass None)."""
    ensure_process_group()
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compact tensor on a 64-byte boundary, as TVM's DLPack import requires (copied only if not)."""
    t = t.contiguous()
    if t.data_ptr() % 64:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def flat_rank(coords: tuple[int, ...], mesh: Mesh) -> int:
    r = 0
    for c, s in zip(coords, mesh.shape):
        r = r * s + c
    return r


_GROUPS: dict[tuple, dict[int, Any]] = {}


def axis_process_groups(mesh: Mesh) -> dict[int, Any]:
    """This rank's process group on each mesh axis, made once per mesh and world (new_group is collective)."""
    rank, world = rank_and_world()
    if world != mesh.size:
        raise ValueError(f"mesh {mesh} has {mesh.size} devices but torch.distributed runs {world} processes; "
                         f"launch with torchrun --nproc_per_node={mesh.size} or pick a mesh of {world} devices")
    key = (mesh.shape, id(dist.group.WORLD))
    if key not in _GROUPS:
        groups: dict[int, Any] = {}
        for axis in range(mesh.ndim):
            for grp in axis_groups(mesh, axis):   # every rank creates every group, in the same order
                ranks = [flat_rank(d, mesh) for d in grp]
                pg = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                if rank in ranks:
                    groups[axis] = pg
        _GROUPS[key] = groups
    return _GROUPS[key]


class TorchCollectives(Collectives):
    """The plan's collectives on torch.distributed: a value is this rank's torch tensor."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.groups = axis_process_groups(mesh)
        self.coords = mesh.coordinates(dist.get_rank())

    def _gather(self, t: torch.Tensor, dim: int, axis: int, sizes: list[int]) -> torch.Tensor:
        big = max(sizes)
        pad = list(t.shape)
        pad[dim] = big
        buf = torch.zeros(pad, dtype=t.dtype)
        buf.narrow(dim, 0, t.shape[dim]).copy_(t)
        parts = [torch.empty_like(buf) for _ in sizes]
        dist.all_gather(parts, buf, group=self.groups[axis])
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim=dim)

    def _chunk(self, t: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        lo, hi = chunk_bounds(t.shape[dim], self.mesh.shape[axis], self.coords[axis])
        return t.narrow(dim, lo, hi - lo).contiguous()

    def all_reduce(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        t = t.clone().contiguous()
        op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}[c.reduce]
        dist.all_reduce(t, op=op, group=self.groups[c.axis])
        if c.reduce == "avg":   # avg is the sum divided by the axis size, in every engine
            t = (t / self.mesh.shape[c.axis]).to(t.dtype)
        return t

    def all_gather(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        d = c.dims[0] % len(shape)
        return self._gather(t, d, c.axis, group_extents(shape, c.before, self.mesh, self.coords, c.axis, d))

    def reduce_scatter(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        return self._chunk(self.all_reduce(t, c, shape), c.dims[0] % len(shape), c.axis)

    def all_to_all(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        src, dst = (d % len(shape) for d in c.dims)
        whole = self._gather(t, src, c.axis, group_extents(shape, c.before, self.mesh, self.coords, c.axis, src))
        return self._chunk(whole, dst, c.axis)

    def local_split(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        return self._chunk(t, c.dims[0] % len(shape), c.axis)

    def local_partial(self, t: torch.Tensor, c: Collective, shape: tuple[int, ...]) -> torch.Tensor:
        after = c.after[c.axis]
        if after.reduce == "sum" and self.coords[c.axis] != 0:
            return torch.zeros_like(t)
        return t


def run_kernel(kernel: Any, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run a compiled kernel (``metadist_tvm.oprunner.Kernel``) on torch tensors through DLPack, no copies."""
    ins = [tvm.runtime.from_dlpack(aligned(x)) for x in xs]
    dev = tvm.cpu()
    outs = [tvm.runtime.empty(s, d, dev) for s, d in zip(kernel.out_shapes, kernel.out_dtypes)]
    kernel.func(*ins, *outs)
    return [torch.from_dlpack(o) for o in outs]


def run_plan(graph: Any, plan: Any, mesh: Mesh, inputs: Mapping[str, np.ndarray], kernel_for: Any
             ) -> dict[str, np.ndarray]:
    """This rank's run of ``plan``: its pieces of the whole ``inputs``, TVM kernels, torch collectives.

    ``kernel_for(op, local input shapes, local output shapes)`` gives the compiled kernel of an op.
    Returns the graph outputs, whole (every rank gets the same).
    """
    coll = TorchCollectives(mesh)
    rank = dist.get_rank()
    rep = Sharding.replicated(mesh.ndim)
    local = {}
    for v in graph.inputs:
        t = torch.from_numpy(np.ascontiguousarray(inputs[v]))
        local[v] = local_piece(t, plan.input_shardings.get(v, rep), mesh, coll.coords,
                               zeros_like=torch.zeros_like).contiguous()

    def run_op(op: MetaOp, xs: list[torch.Tensor], out_sh: list[Sharding]) -> list[torch.Tensor]:
        shapes = [shard_shape(graph.vars[o].shape, s, mesh, coll.coords) for o, s in zip(op.outputs, out_sh)]
        res = run_kernel(kernel_for(op, [tuple(x.shape) for x in xs], shapes), xs)
        for r, want, v in zip(res, shapes, op.outputs):
            if tuple(r.shape) != tuple(want):
                raise RuntimeError(f"rank {rank}: op {op.id} ({op.key}) made {v} with local shape "
                                   f"{tuple(r.shape)}, the plan expects {tuple(want)}")
        return res

    result = interpret(graph, plan, mesh, local, run_op, coll)
    return {o: t.numpy().copy() for o, t in result.outputs.items()}
