"""Layout-independent checkpoints through ``torch.distributed.checkpoint`` (DCP).

    save_checkpoint("ckpt/step-1000", model, optimizer)    # every rank calls it
    ...
    load_checkpoint("ckpt/step-1000", model, optimizer)    # any mesh, any world size, even 1

After the first compiled call a step's state lives as DTensors with the
plan's placements (:func:`metadist_torch.program.place_state`), before it as
plain tensors; both are saved as what they are: DCP writes each DTensor's
shards with their global offsets, and a plain tensor once. Loading fills the
tensors the model and optimizer hold *now*, in place, whatever their layout:
DTensors of another mesh read the pieces they own, plain tensors (before the
first compile, or at world size 1 without a process group) read the whole
value. So a job saved on 8 devices resumes on 4, or on one, with the numbers
of a run that never stopped.

What is saved:

- ``model``: ``model.state_dict()`` (parameters and buffers, by name);
- ``optim``: the optimizer's per-parameter state keyed by the parameter's
  name in ``model`` (not by its position, which depends on how the
  optimizer was built), and every param group's hyperparameters (``lr``,
  betas...) with the names of its parameters.

An optimizer whose lazy state does not exist yet (a fresh one) gets it made
first (:func:`metadist_torch.state.init_optimizer_state`), so that there is
something to load into. Every rank of the job must call these functions.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from .state import init_optimizer_state

FORMAT = "metadist.torch_checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint does not fit the model or optimizer it is loaded into."""


def _names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in ``model`` (the first name of a tied weight)."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


def _optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name; its tensors are the live ones (DCP loads in place)."""
    names = _names(model)
    state: dict[str, dict] = {}
    groups: list[dict] = []
    for gi, g in enumerate(optimizer.param_groups):
        pnames = []
        for p in g["params"]:
            name = names.get(id(p))
            if name is None:
                raise CheckpointError(
                    f"param group {gi} of the optimizer holds a parameter of shape "
                    f"{tuple(p.shape)} that the model does not; save the model that owns "
                    f"every optimized parameter"
                )
            pnames.append(name)
            st = optimizer.state.get(p)
            if st:
                state[name] = dict(st)
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({"params": pnames, "hyper": hyper})
    return {"state": state, "param_groups": groups}


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def _no_dist() -> bool:
    """One process without a process group (world size 1 without torchrun): DCP reads and writes alone."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def save_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> float:
    """Save ``model`` and ``optimizer`` into the folder ``path``; every rank calls it. Returns seconds taken.

    Parameters, buffers and optimizer state are saved as they live (DTensor
    shards after the first compiled call, plain tensors before it); the
    checkpoint does not depend on the mesh: :func:`load_checkpoint` reads it
    on any other one.
    """
    t0 = time.perf_counter()
    sd: dict[str, Any] = {"format": FORMAT, "model": model.state_dict()}
    if optimizer is not None:
        init_optimizer_state([optimizer])
        sd["optim"] = _optim_state(model, optimizer)
    with warnings.catch_warnings():  # DCP says "assuming ... a single process" even when told so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        _dcp().save(sd, checkpoint_id=os.fspath(path), no_dist=_no_dist())
    return time.perf_counter() - t0


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> float:
    """Load the checkpoint in ``path`` into ``model`` and ``optimizer`` in place; returns seconds taken.

    Works on any mesh and at world size 1, before or after the first compiled
    call. The model and optimizer must be built as the saved ones were (the
    same parameter names and shapes, the same optimizer class); their values
    and hyperparameters come from the checkpoint.
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no checkpoint folder at {path!r}; save one with save_checkpoint(path, model, optimizer) first"
        )
    sd: dict[str, Any] = {"format": "", "model": model.state_dict()}
    if optimizer is not None:
        init_optimizer_state([optimizer])
        sd["optim"] = _optim_state(model, optimizer)
    live = {k: v for k, v in sd["model"].items()}
    try:
        with warnings.catch_warnings():  # DCP says "assuming ... a single process" even when told so
            warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
            _dcp().load(sd, checkpoint_id=path, no_dist=_no_dist())
    except Exception as e:
        raise CheckpointError(
            f"cannot load {path!r} into this model/optimizer: {type(e).__name__}: {e}; "
            f"build them as the saved ones were (same names, shapes, optimizer)"
        ) from e
    if sd["format"] != FORMAT:
        raise CheckpointError(f"{path!r} is not a MetaDist checkpoint (format {sd['format']!r}, expected {FORMAT!r})")
    _put_back(model, live, sd["model"])
    if optimizer is not None:
        _load_groups(optimizer, sd["optim"]["param_groups"])
        _load_scalars(model, optimizer, sd["optim"]["state"])
    return time.perf_counter() - t0


def _load_scalars(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, dict]) -> None:
    """Non-tensor optimizer state (an int step counter) is replaced by DCP, not filled: write it back."""
    names = _names(model)
    for g in optimizer.param_groups:
        for p in g["params"]:
            st, new = optimizer.state.get(p), loaded.get(names.get(id(p), ""))
            if st is None or new is None:
                continue
            for k, v in new.items():
                if not isinstance(v, torch.Tensor):
                    st[k] = v


def _put_back(model: torch.nn.Module, live: dict[str, Any], loaded: dict[str, Any]) -> None:
    """DCP loads tensors in place; a value it had to replace (a non-tensor entry) is written back."""
    for k, v in loaded.items():
        if live.get(k) is not v and isinstance(v, torch.Tensor):
            with torch.no_grad():
                live[k].copy_(v)


def _load_groups(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(saved)} optimizer param groups, this optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer as the saved one was"
        )
    for g, s in zip(optimizer.param_groups, saved):
        for k, v in s["hyper"].items():
            cur = g.get(k)
            if isinstance(cur, torch.Tensor) and not isinstance(v, torch.Tensor):
                with torch.no_grad():
                    cur.fill_(v)
            else:
                g[k] = v


__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "FORMAT"]
