"""The user's model called eagerly between compiled steps: whole parameters in, plain tensors out.

After a distributed compile the model's parameters and buffers live as DTensors
holding this rank's pieces (:func:`metadist_torch.lower.program.place_state`). A
plain call of the model (an eval loop, sampling, transformers' ``generate``, a
callback reading an activation) would mix those with the user's plain tensors.
So every module of a compiled step's models carries a forward pre-hook and a
forward hook: the outermost module called outside a compiled step swaps each
DTensor parameter and buffer of its subtree for the whole tensor (gathered
with ``full_tensor``, one all-gather per tensor), runs the user's forward on
plain tensors, and swaps the DTensors back afterwards, also when the forward
raises. The numbers are one device's: the forward itself runs unsplit.

The whole tensors are kept between eager calls, keyed by the version of the
local piece they were gathered from, so that a sampling loop gathers once;
the next compiled call drops them (training memory is the plan's again). A
whole tensor changed in place by the eager call (a running statistic in
train mode, a hand edit under ``no_grad``) is written back to the pieces.

Gathering is a collective: every rank makes the same eager calls, as with
FSDP's ``summon_full_params``. Gradients of an eager call land on the
temporary whole tensors and are dropped; train through the compiled step.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Iterator

import torch

_ATTR = "_metadist_eager_hooks"
HOOK_IDS: set[int] = set()  # the ids of the hooks installed here (the step's guards leave them out)


class _Local(threading.local):
    in_step: int = 0  # depth of compiled calls running on this thread
    owner: torch.nn.Module | None = None  # the outermost module of the eager call in progress
    depth: int = 0  # how many times ``owner`` is on the call stack
    swapped: list | None = None  # (container, key, DTensor, whole tensor, its version at the swap)


_STATE = _Local()
_CACHE: dict[int, tuple[Any, int, torch.Tensor]] = {}  # id(DTensor) -> (DTensor, local version, whole tensor)


@contextlib.contextmanager
def compiled_call() -> Iterator[None]:
    """Around a compiled step's call: the hooks stand aside, and the whole tensors kept for eager calls are
    dropped (the step updates the pieces, and its memory is the plan's)."""
    _CACHE.clear()
    _STATE.in_step += 1
    try:
        yield
    finally:
        _STATE.in_step -= 1


def attach(modules: Iterable[torch.nn.Module]) -> None:
    """Give every module under ``modules`` the hooks that make eager calls see whole tensors (once each)."""
    for top in modules:
        for m in top.modules():
            if _ATTR in m.__dict__:
                continue
            pre = m.register_forward_pre_hook(_before)
            post = m.register_forward_hook(_after, always_call=True)
            HOOK_IDS.update((pre.id, post.id))
            m.__dict__[_ATTR] = (pre, post)


def detach_hooks(modules: Iterable[torch.nn.Module]) -> None:
    """Remove the hooks :func:`attach` installed under ``modules``."""
    for top in modules:
        for m in top.modules():
            handles = m.__dict__.pop(_ATTR, None)
            for h in handles or ():
                HOOK_IDS.discard(h.id)
                h.remove()


def _before(module: torch.nn.Module, args: Any) -> None:
    st = _STATE
    if st.in_step:
        return
    if st.owner is module:
        st.depth += 1
        return
    if st.owner is not None:
        return
    swapped = _swap_in(module)
    if swapped:
        st.owner, st.depth, st.swapped = module, 1, swapped


def _after(module: torch.nn.Module, args: Any, output: Any) -> None:
    st = _STATE
    if st.owner is not module or st.in_step:
        return
    st.depth -= 1
    if st.depth:
        return
    swapped, st.owner, st.swapped = st.swapped or [], None, None
    _swap_out(swapped)


def _containers(module: torch.nn.Module) -> Iterator[tuple[dict, str, Any]]:
    for m in module.modules():
        for d in (m._parameters, m._buffers):
            for k, t in d.items():
                yield d, k, t


def _swap_in(module: torch.nn.Module) -> list:
    from torch.distributed.tensor import DTensor

    found = [(d, k, t) for d, k, t in _containers(module) if isinstance(t, DTensor)]
    if not found:
        return []
    out = []
    for d, k, dt in found:
        whole = _whole(dt)
        d[k] = whole
        out.append((d, k, dt, whole, whole._version))
    return out


def _whole(dt: Any) -> torch.Tensor:
    """``dt`` as one plain tensor: kept from an earlier eager call while its local piece is unchanged."""
    version = dt._local_tensor._version
    kept = _CACHE.get(id(dt))
    if kept is not None and kept[0] is dt and kept[1] == version:
        return kept[2]
    with torch.no_grad():
        full = dt.full_tensor()
    whole = torch.nn.Parameter(full, requires_grad=dt.requires_grad) if isinstance(dt, torch.nn.Parameter) else full
    _CACHE[id(dt)] = (dt, version, whole)
    return whole


def _swap_out(swapped: list) -> None:
    from torch.distributed.tensor import distribute_tensor

    written: set[int] = set()
    for d, k, dt, whole, version in swapped:
        d[k] = dt
        if whole._version != version and id(dt) not in written:  # changed in place by the eager call
            written.add(id(dt))
            with torch.no_grad():
                piece = distribute_tensor(whole.detach(), dt.device_mesh, dt.placements, src_data_rank=None)
                dt._local_tensor.copy_(piece._local_tensor)
            _CACHE[id(dt)] = (dt, dt._local_tensor._version, whole)


__all__ = ["attach", "detach_hooks", "compiled_call", "HOOK_IDS"]
