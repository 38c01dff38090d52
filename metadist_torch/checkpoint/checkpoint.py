"""Layout-independent checkpoints through ``torch.distributed.checkpoint`` (DCP).

    save_checkpoint("ckpt/step-1000", model, optimizer)    # every rank calls it
    ...
    load_checkpoint("ckpt/step-1000", model, optimizer)    # any mesh, any world size, even 1

After the first compiled call a step's state lives as DTensors with the
plan's placements (:func:`metadist_torch.lower.program.place_state`), before it as
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

- ``scheduler``: a learning-rate scheduler's ``state_dict()``, when given;
- ``extra``: any picklable values of the caller's (the step number, a
  sampler's generator state), filled back in place on load;
- ``rng``: the random state (the CPU generator, and the current CUDA
  device's), so that dropout after a resume draws what it would have.

A save is atomic (:mod:`metadist_torch.checkpoint.commit`): it is staged beside
``path`` and swapped in whole, with a manifest of every file's size and
checksum; a load checks them first, so a crash mid-save leaves the previous
checkpoint loadable, and a partial or corrupt one is named, never loaded.

An optimizer whose lazy state does not exist yet (a fresh one) gets it made
first (:func:`metadist_torch.trace.state.init_optimizer_state`), so that there is
something to load into. Every rank of the job must call these functions.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from typing import Any

import torch

from . import commit as files
from .commit import CheckpointError
from ..trace.state import init_optimizer_state

FORMAT = "metadist.torch_checkpoint/1"


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


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng(saved: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])


def _state_dict(model: torch.nn.Module, optimizer: Any, scheduler: Any, extra: Any, rng: bool) -> dict[str, Any]:
    sd: dict[str, Any] = {"format": FORMAT, "model": model.state_dict()}
    if optimizer is not None:
        init_optimizer_state([optimizer])
        sd["optim"] = _optim_state(model, optimizer)
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    if extra is not None:
        sd["extra"] = extra
    if rng:
        sd["rng"] = _rng_state()
    return sd


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (0, 1) if _no_dist() else (dist.get_rank(), dist.get_world_size())


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, on every rank (over the CPU group: the default one may be NCCL)."""
    if _no_dist():
        return [obj]
    import torch.distributed as dist

    from ..runtime.engine import cpu_group

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=cpu_group())
    return out


def _barrier() -> None:
    if not _no_dist():
        import torch.distributed as dist

        from ..runtime.engine import cpu_group

        dist.barrier(group=cpu_group())


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
    step: int | None = None,
) -> float:
    """Save ``model``, ``optimizer`` (and ``scheduler``, ``extra``, the random state) into the folder ``path``,
    atomically; every rank calls it. Returns seconds taken.

    Parameters, buffers and optimizer state are saved as they live (DTensor
    shards after the first compiled call, plain tensors before it); the
    checkpoint does not depend on the mesh: :func:`load_checkpoint` reads it
    on any other one. ``step`` is written into the manifest, where
    :func:`latest_checkpoint` finds the newest.
    """
    t0 = time.perf_counter()
    rank, world = _rank_world()
    staged = files.staging(path)
    if rank == 0 and staged.exists():  # what a save cut short left
        shutil.rmtree(staged)
    _barrier()
    sd = _state_dict(model, optimizer, scheduler, extra, rng)
    with warnings.catch_warnings():  # DCP says "assuming ... a single process" even when told so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        _dcp().save(sd, checkpoint_id=os.fspath(staged), no_dist=_no_dist())
    described = _gather(files.describe(staged, files.own_files(staged, rank)))
    if rank == 0:
        listed = {k: v for part in described for k, v in part.items()}
        meta = {"world_size": world, **({"step": int(step)} if step is not None else {})}
        files.write_manifest(staged, listed, meta)
        files.commit(path)
    _barrier()
    return time.perf_counter() - t0


def verified(path: str | os.PathLike) -> Any:
    """The folder to load for ``path``, its sizes and checksums checked (each rank checks its share of the
    files; every rank raises if any found a fault)."""
    folder = files.resolve(path)
    m = files.manifest(folder)
    if m is None:
        warnings.warn(
            f"metadist: {folder} has no MetaDist manifest (saved by another writer): its files are not checked",
            stacklevel=3,
        )
        return folder
    rank, world = _rank_world()
    found = [x for part in _gather(files.problems(folder, m, rank, world)) for x in part]
    if found:
        raise files.corrupt(folder, found)
    return folder


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint folder under ``root`` (highest ``step`` saved, else newest), or None."""
    found = files.latest(root)
    return None if found is None else os.fspath(found)


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
) -> float:
    """Load the checkpoint in ``path`` into ``model`` and ``optimizer`` (``scheduler``, ``extra``: filled in
    place; ``rng``: the random state restored) in place; returns seconds taken.

    Works on any mesh and at world size 1, before or after the first compiled
    call. The model and optimizer must be built as the saved ones were (the
    same parameter names and shapes, the same optimizer class); their values
    and hyperparameters come from the checkpoint. A partial or corrupt
    checkpoint is a :class:`CheckpointError` that names it; nothing is loaded.
    """
    t0 = time.perf_counter()
    folder = os.fspath(verified(path))
    sd = _state_dict(model, optimizer, scheduler, extra, rng)
    sd["format"] = ""
    live = {k: v for k, v in sd["model"].items()}
    try:
        with warnings.catch_warnings():  # DCP says "assuming ... a single process" even when told so
            warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
            _dcp().load(sd, checkpoint_id=folder, no_dist=_no_dist())
    except Exception as e:
        raise CheckpointError(
            f"cannot load {folder!r} into this model/optimizer: {type(e).__name__}: {e}; "
            f"build them as the saved ones were (same names, shapes, optimizer; a scheduler, extra values or "
            f"random state only where they were saved)"
        ) from e
    if sd["format"] != FORMAT:
        raise CheckpointError(f"{folder!r} is not a MetaDist checkpoint (format {sd['format']!r}, expected {FORMAT!r})")
    _put_back(model, live, sd["model"])
    if optimizer is not None:
        _load_groups(optimizer, sd["optim"]["param_groups"])
        _load_scalars(model, optimizer, sd["optim"]["state"])
    if scheduler is not None:
        scheduler.load_state_dict(sd["scheduler"])
    if rng:
        _set_rng(sd["rng"])
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


__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError", "FORMAT"]
