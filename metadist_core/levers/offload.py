"""Optimizer offload, framework-free: which ops run on the host, what crosses the host link, what it costs.

With ``offload="optimizer"`` the optimizer state lives in host memory and the
optimizer update runs on the host CPU (ZeRO-Offload style). This module
decides, on the MetaIR alone, the **host region** of a training step
(:func:`host_region`), and prices it in a ShardingProblem
(:func:`apply_offload`); a frontend's lowering runs exactly that region on
the host (``metadist_torch.lower.offload``), so what was priced is what runs.

The host region:

- every op that reads, directly or through other host ops, an input of role
  ``optimizer_state`` (the Adam moments, the step counter; the new state and
  the new parameters computed from them);
- pulled in after that: an op whose every reader is a host op, whose outputs
  the device does not need, and whose every input already lives on the host
  or crosses to it anyway (a parameter, an optimizer state input, a value some
  host op reads): weight decay's ``param * (1 - lr * wd)``, Adam's
  ``grad * grad``. Moving such an op adds no transfer and takes its compute off
  the device. The backward that computes a gradient never qualifies: its
  inputs are activations, which never cross.

What crosses, every step: **to the host** the values the host ops read that
the device makes or holds (the gradients after their collectives, the
parameters); **to the device** the host values the device reads or keeps (the
new parameters, and any returned value computed on the host). The optimizer
state and the host region's other values occupy no device memory.

Pricing (:func:`apply_offload`): the host ops' compute at the host's rate
(:func:`host_spec`: the CPU preset, or the device itself when the device is a
CPU), every crossing value's local bytes over ``DeviceSpec.host_link`` on the
node that produces it (per option, as its sharding sets its size), and the
host values' memory terms dropped. On a CPU device (``host_link`` None) the
host is the device: transfers are free and the compute rate is unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from metadist_core.cost.model import (
    DEVICE_PRESETS,
    DeviceSpec,
    compute_cost,
    compute_dtype,
    local_bytes,
    strategy_split,
)
from metadist_core.ir.ir import MetaIR
from metadist_core.problem.build import estimate_op_cost

log = logging.getLogger("metadist.offload")

STATE_ROLE = "optimizer_state"
HOST_INPUT_ROLES = (
    "parameter",
    "optimizer_state",
    "hyperparameter",
)  # inputs a pulled-in host op may read without a new transfer


@dataclass
class HostRegion:
    """What runs on the host under ``offload="optimizer"`` and what crosses the host link each step."""

    ops: list[str] = field(default_factory=list)  # op ids run on the host, in graph order
    host_vars: set[str] = field(default_factory=set)  # values that live on the host only (no device memory)
    to_host: list[str] = field(default_factory=list)  # device values the host ops read (copied each step)
    to_device: list[str] = field(default_factory=list)  # host values the device reads or keeps (copied back)

    @property
    def empty(self) -> bool:
        return not self.ops

    def to_json(self) -> dict:
        return {
            "ops": list(self.ops),
            "host_vars": sorted(self.host_vars),
            "to_host": list(self.to_host),
            "to_device": list(self.to_device),
        }


def host_region(graph: MetaIR) -> HostRegion:
    """The host region of ``graph`` (see the module docstring); empty when it has no optimizer state."""
    state_in = [v for v in graph.inputs if graph.vars[v].role == STATE_ROLE]
    if not state_in:
        return HostRegion()
    state_out = {graph.aliases[v] for v in state_in if v in graph.aliases}
    needed_on_device = set(graph.outputs) - state_out  # returned values, new parameters and buffers
    numbers = hyper_values(graph)  # the param groups' numbers and what is computed from them alone: host values
    host_ops = {op.id for op in graph.ops if op.outputs and all(v in numbers for v in op.outputs)}
    from_state = graph.downstream(state_in)  # forward closure from the optimizer state
    host_ops |= from_state.ops
    host_vals = from_state.values
    changed = True
    while changed:  # pull in readers-only-on-host ops that add no transfer
        changed = False
        for op in reversed(graph.ops):
            if op.id in host_ops or any(v in needed_on_device for v in op.outputs):
                continue
            readers = [c for v in op.outputs for c in graph.vars[v].consumers]
            if not readers or any(c not in host_ops for c in readers):
                continue
            if all(_on_host_anyway(graph, v, host_ops, host_vals, numbers) for v in op.inputs):
                host_ops.add(op.id)
                host_vals.update(op.outputs)
                changed = True
    ops = [op.id for op in graph.ops if op.id in host_ops]
    to_host: list[str] = []
    for op in graph.ops:
        if op.id not in host_ops:
            continue
        for v in op.inputs:  # the param groups' numbers live on the host: nothing to copy
            if v not in host_vals and graph.vars[v].is_tensor and v not in to_host and v not in numbers:
                to_host.append(v)
    for s in state_in:  # new state made on the device (a rare optimizer): copied to the host store
        out = graph.aliases.get(s)
        if out is not None and out not in host_vals and out not in to_host:
            to_host.append(out)
    to_device: list[str] = []
    for v in sorted(host_vals, key=lambda x: _position(graph, x)):
        if not graph.vars[v].is_tensor:
            continue
        device_reader = any(c not in host_ops for c in graph.vars[v].consumers)
        if device_reader or v in needed_on_device:
            to_device.append(v)
    resident = {v for v in host_vals if v not in to_device}
    return HostRegion(ops, resident, to_host, to_device)


def hyper_values(graph: MetaIR) -> set[str]:
    """The ``hyperparameter`` inputs (a learning rate: 0-d, on the host) and every value computed from them
    alone (``1 - lr * weight_decay``)."""
    out = {v for v in graph.inputs if graph.vars[v].role == "hyperparameter"}
    if not out:
        return out
    scalar = [op for op in graph.ops if op.outputs and all(graph.vars[v].ndim == 0 for v in op.outputs)]
    changed = True
    while changed:
        changed = False
        for op in scalar:
            if set(op.outputs) <= out:
                continue
            if op.inputs:
                joins = all(v in out for v in op.inputs)
            else:  # a 0-d constant (``scalar_tensor(1.0)``) that only meets the numbers
                readers = [graph.op(c) for v in op.outputs for c in graph.vars[v].consumers]
                joins = bool(readers) and all(u in out or u in op.outputs for r in readers for u in r.inputs)
            if joins:
                out.update(op.outputs)
                changed = True
    return out


def _on_host_anyway(graph: MetaIR, v: str, host_ops: set[str], host_vals: set[str], numbers: set[str]) -> bool:
    mv = graph.vars[v]
    if v in host_vals or not mv.is_tensor:
        return True
    if mv.producer is None and mv.role in HOST_INPUT_ROLES:
        return True
    if v in numbers:
        return True
    return any(c in host_ops for c in mv.consumers)


def _position(graph: MetaIR, v: str) -> int:
    p = graph.vars[v].producer
    return -1 if p is None else graph.op_index(p)


def host_spec(device: DeviceSpec) -> DeviceSpec:
    """The DeviceSpec the host's compute is priced at: the device itself when it is the host (``host_link``
    None: a CPU), else the CPU preset."""
    if getattr(device, "host_link", None) is None:
        return device
    return DEVICE_PRESETS["cpu"]


def transfer_seconds(nbytes: float, device: DeviceSpec) -> float:
    """Seconds to move ``nbytes`` over the device's host link (0 when the host is the device)."""
    link = getattr(device, "host_link", None)
    if link is None or link <= 0:
        return 0.0
    return float(nbytes) / float(link)


def apply_offload(
    problem: Any,
    graph: MetaIR,
    op_costs: Mapping[str, tuple[float, float]] | None = None,
    region: HostRegion | None = None,
) -> HostRegion:
    """Price ``offload="optimizer"`` into ``problem`` (a ShardingProblem built from ``graph``), in place.

    Host ops' compute is re-priced at :func:`host_spec`; each crossing value's
    local bytes over the host link are added to the node that defines it, per
    option; host-only values are marked ``vars[v]["host"]`` (no memory term).
    Call before the problem's terms are first read. Returns the region priced.
    """
    region = region if region is not None else host_region(graph)
    if problem.terms_read:
        raise RuntimeError("apply_offload must run before the problem's terms are read (they are cached)")
    if region.empty:
        log.info("offload='optimizer': %s has no optimizer state; nothing runs on the host", graph.name)
        return region
    host = host_spec(problem.device)
    mesh = problem.mesh
    for op_id in region.ops:
        i = problem.op_node(op_id)
        # the update on the host: its roofline (a slowdown measured on the device does not apply there)
        flops, nbytes, *_ = (op_costs or {}).get(op_id) or estimate_op_cost(graph.op(op_id), graph)
        op = graph.op(op_id)
        dt = compute_dtype(
            [graph.vars[v].dtype for v in op.inputs if graph.vars[v].is_tensor],
            [graph.vars[v].dtype for v in op.outputs],
        )
        problem.compute[i] = np.array(
            [
                compute_cost(flops, nbytes, strategy_split(o.inputs, o.outputs, mesh), host, dt)
                for o in problem.nodes[i].options
            ]
        )
    moved = 0
    for v in (*region.to_host, *region.to_device):
        i, slot = problem.definer(v)
        b = problem.output_bytes(i, slot)
        problem.compute[i] = problem.compute[i] + np.array([transfer_seconds(x, problem.device) for x in b])
        moved += 1
    for v in region.host_vars:
        if v in problem.vars:
            problem.vars[v]["host"] = True
    log.info("offload='optimizer': %d ops on the host, %d values cross the host link per step", len(region.ops), moved)
    return region


def offload_stats(region: HostRegion, problem: Any, plan: Any) -> dict:
    """What the chosen plan moves over the host link each step and keeps off the device (``plan.stats``)."""
    mesh = problem.mesh

    def nbytes(v: str) -> int:
        info = problem.vars[v]
        sh = plan.var_shardings.get(v)
        return 0 if sh is None or info["shape"] is None else local_bytes(info["shape"], info["dtype"], sh, mesh)

    d2h = sum(nbytes(v) for v in region.to_host)
    h2d = sum(nbytes(v) for v in region.to_device)
    state = sum(nbytes(v) for v in region.host_vars if problem.vars.get(v, {}).get("role") == STATE_ROLE)
    return {
        "mode": "optimizer",
        "host_ops": len(region.ops),
        "to_host_bytes": int(d2h),
        "to_device_bytes": int(h2d),
        "host_state_bytes": int(state),
        "transfer_seconds": transfer_seconds(d2h, problem.device) + transfer_seconds(h2d, problem.device),
    }


__all__ = ["offload_stats", "HostRegion", "host_region", "apply_offload", "host_spec", "transfer_seconds"]
