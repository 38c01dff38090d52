"""Run a plan across processes: TVM kernels per rank, collectives on torch.distributed through DLPack.

One process per device (``torchrun --nproc_per_node=N``); rank ``r`` plays
mesh device ``mesh.coordinates(r)``. Values live as torch CPU tensors; a
kernel reads them as TVM tensors with ``tvm.runtime.from_dlpack`` and its
outputs come back with ``torch.from_dlpack``, so no copy is made between the
two. Every rank walks the ops and the plan's edges in the same order and
issues the same collectives, each on the process group of its mesh axis.

The collectives do what :func:`metadist_core.simulate.apply_collective` does,
with what gloo offers: all_reduce (avg as a sum divided by the group size),
all_gather (pieces padded to the largest chunk, so uneven splits work),
reduce_scatter as an all_reduce followed by taking this rank's chunk, and
all_to_all as an all_gather on the source dim followed by taking this rank's
chunk of the target dim.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist
import tvm

from metadist_core.cost import UnknownCollectiveError
from metadist_core.placement import Mesh, Partial, Shard, Sharding, chunk_bounds, shard_shape
from metadist_core.simulate import axis_groups

log = logging.getLogger("metadist.tvm")


def ensure_process_group() -> None:
    """Start the default process group (gloo on CPU) from torchrun's environment when none is up."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; use engine='simulate'")
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compact tensor on a 64-byte boundary, as TVM's DLPack import requires (copied only if not)."""
    t = t.contiguous()
    if t.data_ptr() % 64:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _flat(coords: tuple[int, ...], mesh: Mesh) -> int:
    r = 0
    for c, s in zip(coords, mesh.shape):
        r = r * s + c
    return r


def planned_on_rank0(traced: Any, mesh: Mesh, plan_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Plan on rank 0 only and hand the plan (as JSON) to every rank, so that all run the same one."""
    from metadist_core.plan import ShardingPlan

    ensure_process_group()
    world = dist.get_world_size()
    if world != mesh.size:
        raise ValueError(f"mesh {mesh} has {mesh.size} devices but torch.distributed runs {world} processes; "
                         f"launch with torchrun --nproc_per_node={mesh.size} or pick a mesh of {world} devices")
    result = None
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        result = plan_fn()
        box[0] = result.plan.to_json()
    dist.broadcast_object_list(box, src=0)
    plan = result.plan if result is not None else ShardingPlan.from_json(box[0])
    return plan, result


_ENGINES: dict[tuple, "TorchEngine"] = {}


def engine_for(mesh: Mesh) -> "TorchEngine":
    """This rank's engine for ``mesh``, made once per mesh and process group (new_group is collective)."""
    ensure_process_group()
    key = (mesh.shape, id(dist.group.WORLD))
    if key not in _ENGINES:
        _ENGINES[key] = TorchEngine(mesh)
    return _ENGINES[key]


class TorchEngine:
    """This rank's side of a plan: its mesh coordinates and one process group per mesh axis."""

    def __init__(self, mesh: Mesh) -> None:
        ensure_process_group()
        self.mesh = mesh
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        if world != mesh.size:
            raise ValueError(f"mesh {mesh} has {mesh.size} devices but torch.distributed runs {world} processes")
        self.coords = mesh.coordinates(self.rank)
        self.groups: dict[int, Any] = {}
        for axis in range(mesh.ndim):
            for grp in axis_groups(mesh, axis):   # every rank creates every group, in the same order
                ranks = [_flat(d, mesh) for d in grp]
                pg = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                if self.rank in ranks:
                    self.groups[axis] = pg

    # -- values ---------------------------------------------------------------
    def local_input(self, x: np.ndarray, sharding: Sharding) -> torch.Tensor:
        """This rank's piece of a whole input (as :func:`metadist_core.simulate.distribute`)."""
        t = torch.from_numpy(np.ascontiguousarray(x))
        for axis, p in enumerate(sharding):
            if isinstance(p, Shard):
                lo, hi = chunk_bounds(t.shape[p.dim], self.mesh.shape[axis], self.coords[axis])
                t = t.narrow(p.dim, lo, hi - lo)
            elif isinstance(p, Partial) and p.reduce == "sum" and self.coords[axis] != 0:
                t = torch.zeros_like(t)
        return t.contiguous()

    def run_kernel(self, runner: Any, op: Any, xs: list[torch.Tensor], out_shapes: list) -> list[torch.Tensor]:
        """Run op's kernel on torch tensors through DLPack (no copies between torch and TVM)."""
        call = runner.traced.calls[op.id]
        g = runner.traced.graph
        if call.reshape_arg is not None:
            target = [int(s) for s in out_shapes[0]]
            k = runner.cache.get(call.with_arg(call.reshape_arg, target), [tuple(xs[0].shape)],
                                 [g.vars[op.inputs[0]].dtype])
        else:
            k = runner.cache.get(call, [tuple(x.shape) for x in xs], [g.vars[v].dtype for v in op.inputs])
        ins = [tvm.runtime.from_dlpack(_aligned(x)) for x in xs]
        dev = tvm.cpu()
        outs = [tvm.runtime.empty(s, d, dev) for s, d in zip(k.out_shapes, k.out_dtypes)]
        k.func(*ins, *outs)
        res = [torch.from_dlpack(o) for o in outs]
        for r, want, v in zip(res, out_shapes, op.outputs):
            if want is not None and tuple(r.shape) != tuple(want):
                raise RuntimeError(f"rank {self.rank}: op {op.id} ({op.key}) made {v} with local shape "
                                   f"{tuple(r.shape)}, the plan expects {tuple(want)}")
        return res

    # -- collectives ------------------------------------------------------------
    def _gather(self, t: torch.Tensor, dim: int, axis: int, sizes: list[int]) -> torch.Tensor:
        n = self.mesh.shape[axis]
        big = max(sizes)
        pad = list(t.shape)
        pad[dim] = big
        buf = torch.zeros(pad, dtype=t.dtype)
        buf.narrow(dim, 0, t.shape[dim]).copy_(t)
        parts = [torch.empty_like(buf) for _ in range(n)]
        dist.all_gather(parts, buf, group=self.groups[axis])
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim=dim)

    def _all_reduce(self, t: torch.Tensor, reduce: str, axis: int) -> torch.Tensor:
        t = t.clone().contiguous()
        op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}[reduce]
        dist.all_reduce(t, op=op, group=self.groups[axis])
        if reduce == "avg":
            t = (t / self.mesh.shape[axis]).to(t.dtype)
        return t

    def _chunk(self, t: torch.Tensor, dim: int, axis: int) -> torch.Tensor:
        lo, hi = chunk_bounds(t.shape[dim], self.mesh.shape[axis], self.coords[axis])
        return t.narrow(dim, lo, hi - lo).contiguous()

    def _sizes(self, shape: tuple[int, ...], before: Sharding, dim: int, axis: int) -> list[int]:
        """Each group member's extent of ``dim`` under ``before`` (they differ only on ``axis``)."""
        out = []
        for i in range(self.mesh.shape[axis]):
            c = list(self.coords)
            c[axis] = i
            out.append(shard_shape(shape, before, self.mesh, tuple(c))[dim])
        return out

    def apply(self, t: torch.Tensor, c: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """Apply one cost-model Collective to this rank's value of a tensor of whole ``shape``."""
        axis, kind = c.axis, c.kind
        if kind == "all_reduce":
            return self._all_reduce(t, c.reduce, axis)
        if kind == "all_gather":
            d = c.dims[0]
            return self._gather(t, d, axis, self._sizes(shape, c.before, d, axis))
        if kind == "reduce_scatter":
            return self._chunk(self._all_reduce(t, c.reduce, axis), c.dims[0], axis)
        if kind == "all_to_all":
            src, dst = c.dims
            whole = self._gather(t, src, axis, self._sizes(shape, c.before, src, axis))
            return self._chunk(whole, dst, axis)
        if kind == "local_split":
            return self._chunk(t, c.dims[0], axis)
        if kind == "local_partial":
            after = c.after[axis]
            if after.reduce == "sum" and self.coords[axis] != 0:
                return torch.zeros_like(t)
            return t
        raise UnknownCollectiveError(kind, "the TVM torch.distributed engine")

    # -- the program ------------------------------------------------------------------
    def run(self, traced: Any, plan: Any, inputs: Mapping[str, np.ndarray], runner: Any) -> dict[str, np.ndarray]:
        g, mesh = traced.graph, self.mesh
        env: dict[str, torch.Tensor] = {}
        for v in g.inputs:
            env[v] = self.local_input(inputs[v], plan.input_shardings.get(v, Sharding.replicated(mesh.ndim)))
        incoming, finals = plan.edge_index()
        for op in g.ops:
            xs = []
            for slot, v in enumerate(op.inputs):
                t = env[v]
                e = incoming.get((op.id, slot))
                if e is not None:
                    for c in e.collectives:
                        t = self.apply(t, c, g.vars[v].shape)
                xs.append(t)
            strategy = plan.strategies.get(op.id)
            out_sh = list(strategy.outputs) if strategy is not None else \
                [Sharding.replicated(mesh.ndim)] * len(op.outputs)
            shapes = [shard_shape(g.vars[o].shape, s, mesh, self.coords) for o, s in zip(op.outputs, out_sh)]
            for o, r in zip(op.outputs, self.run_kernel(runner, op, xs, shapes)):
                env[o] = r
        out = {}
        for o in g.outputs:
            t = env[o]
            e = finals.get((o, "<output>"))
            sh = plan.var_shardings.get(o, Sharding.replicated(mesh.ndim))
            if e is not None:
                for c in e.collectives:
                    t = self.apply(t, c, g.vars[o].shape)
                sh = e.dst_sharding
            if not sh.is_fully_replicated():
                raise RuntimeError(f"graph output {o} ends as {sh}, not whole on every rank")
            out[o] = t.numpy().copy()
        return out
