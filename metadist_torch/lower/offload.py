"""``offload="optimizer"`` in the torch lowering: the optimizer state in host memory, the update on the host CPU.

:func:`metadist_core.levers.offload.host_region` names the ops that run on the host
(the optimizer update) and the values that cross the host link; this module
makes a per-rank fx program do exactly that (:func:`offload_graph`):

- every node is given a residency: placeholders of optimizer state live on
  the host, other placeholders on the device; the host region's op nodes run
  on the host (a factory op's ``device=`` is rewritten to the host); the
  plan's collectives always run on the device; ``getitem`` and ``md_select``
  follow the value they pick from;
- where a node reads a value of the other residency a transfer node is put
  in: ``md_to_host`` (device -> host) issued once the host part begins, and
  ``md_host_wait`` just before the first host reader; ``md_to_device`` (host ->
  device) right after the host value is made; each value crosses once;
- the program's outputs are sent where their state lives: new optimizer state
  stays on the host, new parameters and returned values go to the device.

On CUDA the device -> host copies are ``non_blocking`` into pinned memory
(``Tensor.to("cpu", non_blocking=True)`` allocates pinned memory) and the host
waits on a CUDA event before reading; host -> device copies are ``non_blocking``
from pinned memory; the optimizer state itself is stored pinned. On a CPU
device the host is the device: every transfer is the identity, and the
program still holds the transfer nodes (what the tests check).

State placement: :func:`state_to_host` stores optimizer state on the host
(DTensors on a host DeviceMesh of gloo groups when the engine mesh is CUDA);
:func:`state_to_device` brings it back for a retrace (a new call signature),
since tracing runs the optimizer on the device.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from metadist_core.ir.ir import MetaIR
from metadist_core.levers.offload import HostRegion, host_region

from .coalesce import DTYPE_META, VAR_META
from ..trace.state import ROLE_STATE, StepState

log = logging.getLogger("metadist.torch.offload")

HOST = torch.device("cpu")
HOST_MESHES: dict[int, Any] = {}  # id(engine DeviceMesh) -> the host DeviceMesh of its ranks (CUDA engines)


def md_to_host(x: torch.Tensor) -> tuple:
    """Start copying ``x`` to host memory: (host tensor, CUDA event or None). Pinned and asynchronous on CUDA."""
    if x.device.type == "cuda":
        y = x.to(HOST, non_blocking=True)  # the result is allocated in pinned memory
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(x.device))
        return y, ev
    return x.to(HOST), None


def md_host_wait(pair: tuple) -> torch.Tensor:
    """The host tensor of :func:`md_to_host` once its copy has landed."""
    y, ev = pair
    if ev is not None:
        ev.synchronize()
    return y


def md_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host value to ``device`` (asynchronous on CUDA: staged through pinned memory)."""
    if x.device == device:
        return x
    if device.type == "cuda":
        src = x if x.is_pinned() else x.pin_memory()
        return src.to(device, non_blocking=True)
    return x.to(device)


TRANSFERS = (md_to_host, md_host_wait, md_to_device)


@dataclass
class OffloadInfo:
    """What :func:`offload_graph` did to one program."""

    host_nodes: int = 0
    to_host: int = 0  # values copied device -> host each step
    to_device: int = 0  # values copied host -> device each step
    region: HostRegion | None = None


def _is_structural(n: fx.Node) -> bool:
    return n.op == "call_function" and (
        n.target is operator.getitem or getattr(n.target, "__name__", "") == "md_select"
    )


def _is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "md_wait"


def offload_graph(
    g: fx.Graph, is_host: Callable[[fx.Node], bool], host_inputs: set[int], host_outputs: set[int], device: torch.device
) -> OffloadInfo:
    """Rewrite ``g`` in place so that nodes ``is_host`` picks run on the host (see the module docstring).

    ``host_inputs``: placeholder positions whose values live on the host;
    ``host_outputs``: flat output positions whose values are stored on the host
    (the new optimizer state). Everything else lives on ``device``.
    """
    res: dict[fx.Node, str | None] = {}
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        res[n] = "host" if i in host_inputs else "device"
    info = OffloadInfo()
    for n in g.nodes:
        if n.op == "get_attr":
            res[n] = None  # a constant: read where it is
        elif n.op == "call_function":
            if _is_structural(n):
                src = n.args[0]
                res[n] = res.get(src) if isinstance(src, fx.Node) else "device"
            elif _is_wait(n) or n.target is torch.ops.aten._local_scalar_dense.default:
                res[n] = None  # a wait, or a number read from a param group's 0-d tensor: used where it is
            elif is_host(n):
                res[n] = "host"
                info.host_nodes += 1
                if "device" in n.kwargs:
                    n.kwargs = {**n.kwargs, "device": HOST}
            else:
                res[n] = "device"
    host_nodes = [n for n in g.nodes if res.get(n) == "host" and n.op == "call_function" and not _is_structural(n)]
    first_host = host_nodes[0] if host_nodes else None
    order = {n: i for i, n in enumerate(g.nodes)}
    last_ph = placeholders[-1] if placeholders else None
    crossed: dict[tuple[fx.Node, str], fx.Node] = {}

    def cross(a: fx.Node, to: str, reader: fx.Node) -> fx.Node:
        hit = crossed.get((a, to))
        if hit is not None:
            return hit
        if to == "host":
            anchor = a if a.op != "placeholder" else last_ph
            if first_host is not None and order.get(first_host, 0) > order.get(anchor, 0) + 1:
                anchor = first_host.prev  # issue the copies once the host part begins: collectives keep overlapping
            with g.inserting_after(anchor):
                pair = g.call_function(md_to_host, (a,))
            with g.inserting_before(reader):
                out = g.call_function(md_host_wait, (pair,))
            info.to_host += 1
        else:
            with g.inserting_after(a if a.op != "placeholder" else last_ph):
                out = g.call_function(md_to_device, (a, device))
            info.to_device += 1
        for k in (VAR_META, DTYPE_META):
            if k in a.meta:
                out.meta[k] = a.meta[k]
        order.update({n: i for i, n in enumerate(g.nodes)})
        crossed[(a, to)] = out
        return out

    for n in list(g.nodes):
        if n.op != "call_function" or _is_structural(n) or _is_wait(n) or n.target in TRANSFERS:
            continue
        want = res[n]
        for a in list(n.all_input_nodes):
            ra = res.get(a)
            if ra is not None and want is not None and ra != want:
                n.replace_input_with(a, cross(a, want, n))
    out = next(n for n in g.nodes if n.op == "output")
    vals = out.args[0]
    flat = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    new_flat = list(flat)
    for p, v in enumerate(flat):
        if not isinstance(v, fx.Node):
            continue
        holder, src = out, v
        if v.target is operator.getitem and isinstance(v.args[0], fx.Node) and _is_wait(v.args[0]):
            holder, src = v.args[0], v.args[0].args[v.args[1]]  # md_wait passes values through: move before it
        want = "host" if p in host_outputs else "device"
        if not isinstance(src, fx.Node) or res.get(src) in (None, want):
            continue
        moved = cross(src, want, holder)
        if holder is out:
            new_flat[p] = moved
        else:
            args = list(holder.args)
            args[v.args[1]] = moved
            holder.args = tuple(args)
    out.args = (type(vals)(new_flat) if isinstance(vals, (tuple, list)) else new_flat[0],)
    g.lint()
    return info


def _op_of(n: fx.Node, graph: MetaIR) -> str | None:
    """The MetaIR op a rank-program node runs (aten op nodes only; by the value it makes)."""
    if not isinstance(n.target, torch._ops.OpOverload):
        return None
    todo, seen = [n], set()
    while todo:  # a multi-output op: its value ids sit on the getitems behind md_select
        m = todo.pop()
        v = m.meta.get(VAR_META)
        if v is not None and v in graph.vars:
            return graph.vars[v].producer
        if m in seen:
            continue
        seen.add(m)
        todo.extend(u for u in m.users if _is_structural(u))
    return None


def offload_rank_graph(lowered: Any, graph: MetaIR, device: torch.device) -> OffloadInfo:
    """Offload the optimizer update of a rank program (:class:`metadist_torch.lower.lower.RankGraph`) in place."""
    region = host_region(graph)
    if region.empty:
        log.warning("offload='optimizer': the step has no optimizer state; nothing moves to the host")
        return OffloadInfo(region=region)
    ops = set(region.ops)
    host_in = {i for i, v in enumerate(lowered.input_vars) if graph.vars[v].role == ROLE_STATE}
    n_out = len(lowered.output_vars)
    host_out = {n_out + i for i, v in enumerate(lowered.state_inputs) if graph.vars[v].role == ROLE_STATE}
    info = offload_graph(lowered.gm.graph, lambda n: _op_of(n, graph) in ops, host_in, host_out, device)
    lowered.gm.recompile()
    info.region = region
    return info


def offload_traced(step: Any) -> tuple[Any, OffloadInfo]:
    """World size 1: a copy of the TracedStep whose functional graph runs the optimizer update on the host."""
    region = host_region(step.graph)
    if region.empty:
        log.warning("offload='optimizer': the step has no optimizer state; nothing moves to the host")
        return step, OffloadInfo(region=region)
    st = step.state
    n_pb = len(st.params) + len(st.buffers)
    host_in = set(range(n_pb, len(st.slots)))
    host_out = {o for k, o in enumerate(step.state_out) if o is not None and k >= n_pb}
    # the copy reads the same param-group number tensors the step refills before every call (a learning-rate
    # schedule): copied, they would keep the first call's numbers
    gm = copy.deepcopy(step.gm, memo={id(t): t for t in step.hyper.tensors})
    ops = set(region.ops)
    info = offload_graph(gm.graph, lambda n: n.name in ops, host_in, host_out, _param_device(st))
    gm.recompile()
    info.region = region
    return dataclasses.replace(step, gm=gm), info


def _param_device(st: StepState) -> torch.device:
    for s in st.params + st.buffers:
        t = s.get()
        return getattr(t, "_local_tensor", t).device
    return HOST


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    y = t.detach().to(HOST)
    return y.pin_memory() if t.device.type == "cuda" else y


def state_to_host(st: StepState, engine: Any = None) -> int:
    """Store every optimizer state tensor in host memory (pinned when it came from CUDA); returns bytes moved.

    DTensors on a CUDA mesh become DTensors of the same placements on the host
    DeviceMesh of the same ranks (gloo groups, :func:`host_mesh`); on a CPU
    mesh they already live on the host.
    """
    moved = 0
    for slot in st.opt_states:
        t = slot.get()
        mesh = getattr(t, "device_mesh", None)
        if mesh is not None:
            if mesh.device_type == HOST.type:
                continue
            from torch.distributed.tensor import DTensor

            local = t.to_local()
            slot.owner[slot.key] = DTensor.from_local(
                _host_copy(local),
                host_mesh(mesh),
                list(t.placements),
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
            moved += local.numel() * local.element_size()
        elif t.device.type != HOST.type:
            slot.owner[slot.key] = _host_copy(t)
            moved += t.numel() * t.element_size()
    return moved


def state_to_device(st: StepState) -> int:
    """Bring host-stored optimizer state back next to the parameters (before a retrace); returns bytes moved."""
    ref = next((s.get() for s in st.params), None)
    if ref is None:
        return 0
    ref_mesh = getattr(ref, "device_mesh", None)
    dev = getattr(ref, "_local_tensor", ref).device
    if dev.type == HOST.type:
        return 0
    moved = 0
    for slot in st.opt_states:
        t = slot.get()
        mesh = getattr(t, "device_mesh", None)
        if mesh is not None and ref_mesh is not None and mesh.device_type == HOST.type:
            from torch.distributed.tensor import DTensor

            local = t.to_local()
            slot.owner[slot.key] = DTensor.from_local(
                local.to(dev), ref_mesh, list(t.placements), run_check=False, shape=t.shape, stride=t.stride()
            )
            moved += local.numel() * local.element_size()
        elif mesh is None and t.device.type == HOST.type:
            slot.owner[slot.key] = t.to(dev)
            moved += t.numel() * t.element_size()
    return moved


def host_mesh(mesh: Any) -> Any:
    """A DeviceMesh over the same ranks as ``mesh`` (a CUDA mesh) on the host, one gloo group per axis.

    Every rank must call it in the same order (it creates process groups)."""
    if mesh.device_type == HOST.type:
        return mesh
    hit = HOST_MESHES.get(id(mesh))
    if hit is not None:
        return hit
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh.mesh
    groups = []
    for a in range(ranks.ndim):
        rows = ranks.movedim(a, -1).reshape(-1, ranks.shape[a]).tolist()
        mine, _ = dist.new_subgroups_by_enumeration(rows, backend="gloo")
        groups.append(mine)
    hm = DeviceMesh.from_group(groups, HOST.type, mesh=ranks.clone(), mesh_dim_names=mesh.mesh_dim_names)
    HOST_MESHES[id(mesh)] = hm
    return hm


def count_transfers(gm: fx.GraphModule) -> dict[str, int]:
    """How many of each transfer node a program holds: ``{"md_to_host": .., "md_to_device": ..}``."""
    out = {"md_to_host": 0, "md_to_device": 0}
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "")
        if n.op == "call_function" and name in out:
            out[name] += 1
    return out


def host_tensors(st: StepState) -> list[torch.Tensor]:
    """The local optimizer state tensors of a step (to check where they live)."""
    return [getattr(s.get(), "_local_tensor", s.get()) for s in st.opt_states]


__all__ = [
    "offload_graph",
    "offload_rank_graph",
    "offload_traced",
    "state_to_host",
    "state_to_device",
    "host_mesh",
    "count_transfers",
    "host_tensors",
    "md_to_host",
    "md_host_wait",
    "md_to_device",
    "OffloadInfo",
]
