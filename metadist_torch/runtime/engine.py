"""The engine: torch.distributed process group, the torch DeviceMesh, and mesh validation.

Launched by ``torchrun`` (``WORLD_SIZE``/``RANK`` set), the default process
group is created on first use: NCCL when CUDA is available and NCCL is
built, gloo otherwise. A plain process (no torchrun) is world size 1 and needs
no process group at all.

What MetaDist starts it also ends: at exit (:mod:`metadist_torch.runtime.shutdown`) it
destroys the default group where it made it, else the groups it made on the
user's (the CPU group, the DeviceMesh's axis groups), after the heartbeat stopped.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, NoReturn, Sequence

import torch

from metadist_core.ir.mesh import Mesh

from .shutdown import on_exit

log = logging.getLogger("metadist.torch.engine")


def dist_available() -> bool:
    return torch.distributed.is_available()


def world_info() -> tuple[int, int]:
    """(rank, world size) of the running job: the process group when there is one, else torchrun's env."""
    if dist_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def default_backend() -> str:
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo"


def restart_attempt() -> str:
    """Which attempt of the job this is: torchrun's restart count (``"0"`` for the first, or without torchrun)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def ensure_process_group(timeout: float | None = None) -> tuple[int, int]:
    """Start the default process group when launched by torchrun and none is running yet; (rank, world size).

    The group is made on the rendezvous store under a prefix of its own per restart attempt (torchrun's agent
    store keeps the keys of an attempt that failed, and a restarted rank would read its dead peers'
    addresses), with ``timeout`` seconds for every collective (default: the ``collective_timeout``
    setting). NCCL gets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless it is set: a collective that times out
    ends the process instead of hanging it. Each rank then beats into the store
    (:mod:`metadist_torch.runtime.faults`), so that a rank that stops is named by the others. MetaDist destroys the
    group at exit (unless the user destroyed it first).
    """
    rank, world = world_info()
    if world > 1 and not torch.distributed.is_initialized():
        from datetime import timedelta

        from metadist_core.config import load_settings

        from .faults import start_heartbeat

        seconds = float(timeout if timeout is not None else load_settings().collective_timeout)
        backend = default_backend()
        if backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        attempt = restart_attempt()
        td = timedelta(seconds=seconds)
        store, rank, world = next(torch.distributed.rendezvous("env://", rank, world, timeout=td))
        store = torch.distributed.PrefixStore(f"metadist/attempt/{attempt}/", store)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td)
        _TIMEOUT[:] = [seconds]
        _own_world()
        log.info(
            "started process group %s: rank %d of %d, attempt %s, timeout %g s", backend, rank, world, attempt, seconds
        )
        start_heartbeat(rank, world, attempt, seconds)
    return world_info()


_TIMEOUT: list[float] = []  # the collective timeout of the process group MetaDist started (empty: none started)


def collective_timeout() -> float | None:
    """Seconds a collective of MetaDist's process group may wait (None: the group is not MetaDist's)."""
    return _TIMEOUT[0] if _TIMEOUT else None


def device() -> torch.device:
    """The device this rank computes on."""
    if torch.cuda.is_available() and default_backend() == "nccl" and world_info()[1] > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _is_device_mesh(x: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, DeviceMesh)


def resolve_mesh(mesh: Any, world_size: int) -> tuple[Mesh, Any]:
    """The MetaDist ``Mesh`` for the ``mesh`` argument, and the torch DeviceMesh given with it (or None).

    ``mesh`` is None (the whole world as one axis), a shape such as ``(2, 2)``
    or ``"2x2"``, a metadist ``Mesh`` or a torch ``DeviceMesh``. A mesh whose
    size is not the world size is a ValueError that quotes both.
    """
    dm = None
    if mesh is None:
        m = Mesh((world_size,))
    elif isinstance(mesh, Mesh):
        m = mesh
    elif _is_device_mesh(mesh):
        dm = mesh
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        m = Mesh(tuple(int(s) for s in mesh.shape), names)
    elif isinstance(mesh, str):
        m = Mesh.parse(mesh)
    elif isinstance(mesh, int):
        m = Mesh((mesh,))
    elif isinstance(mesh, Sequence):
        m = Mesh(tuple(int(s) for s in mesh))
    else:
        raise TypeError(
            f"mesh must be None, a shape such as (2, 2), a metadist Mesh or a torch DeviceMesh; "
            f"got {type(mesh).__name__} {mesh!r}"
        )
    if m.size != world_size:
        shape = "x".join(map(str, m.shape))
        attempt = restart_attempt()
        restarted = (
            f" (this is restart {attempt} of the job: it came back with {world_size} ranks; checkpoints of "
            f"metadist_torch.save_checkpoint load on any mesh, so resume on one that fits)"
            if attempt != "0"
            else ""
        )
        raise ValueError(
            f"mesh {shape} has {m.size} devices but the world size is {world_size}{restarted}; "
            f"launch with torchrun --nproc_per_node={m.size} or pass a mesh of {world_size} devices "
            f"(the default mesh=None uses the whole world as one axis)"
        )
    return m, dm


@dataclass
class Engine:
    """This rank's view of the job: rank, world size, the Mesh, the torch DeviceMesh and its axis groups."""

    rank: int
    world_size: int
    mesh: Mesh
    device_mesh: Any  # torch DeviceMesh, or None at world size 1
    coords: tuple[int, ...]
    device: torch.device
    rng_synced: bool = False  # rank 0's random state given to every rank (once, at the first random step)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def groups(self) -> list[Any] | None:
        if self.device_mesh is None:
            return None
        return [self.device_mesh.get_group(a) for a in range(self.mesh.ndim)]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (a no-op at world size 1)."""
        if not self.distributed:
            return obj
        box = [obj if self.rank == src else None]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def sync_rng(self) -> None:
        """Give every rank rank 0's random state, so replicated random ops draw the same numbers everywhere."""
        if not self.distributed or self.rng_synced:
            return
        self.rng_synced = True
        states = self.broadcast(
            (torch.get_rng_state(), torch.cuda.get_rng_state() if self.device.type == "cuda" else None)
        )
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state(states[1])


def make_engine(mesh: Any = None) -> Engine:
    """Set up (or find) the process group and the DeviceMesh for ``mesh``; validate the mesh size."""
    rank, world = ensure_process_group() if dist_available() else (0, 1)
    m, dm = resolve_mesh(mesh, world)
    dev = device()
    if world > 1 and dm is None:
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(dev.type, tuple(m.shape), mesh_dim_names=tuple(m.axis_names))
        _own_groups(dm.get_group(a) for a in range(dm.ndim))
        _bound_timeouts(dm)
    coords = m.coordinates(rank)
    if dm is not None:
        got = tuple(int(c) for c in dm.get_coordinate())
        if got != coords:
            raise ValueError(
                f"the DeviceMesh puts rank {rank} at {got}, but MetaDist expects the row-major "
                f"position {coords}; build the DeviceMesh from torch.arange(world).reshape(shape)"
            )
    if world > 1:
        cpu_group()  # made here, where every rank makes its engine: the guards agree on it at every call
        from .faults import heartbeat, start_heartbeat

        if heartbeat() is None:  # the user started the process group: beat into its store
            store = getattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: None)()
            if store is not None:
                start_heartbeat(rank, world, restart_attempt(), store=store)
    return Engine(rank, world, m, dm, coords, dev)


def _bound_timeouts(dm: Any) -> None:
    """Give the DeviceMesh's groups the timeout of the process group MetaDist started (torch makes them with
    its default, 30 minutes on gloo and 10 on NCCL)."""
    set_timeout = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if not _TIMEOUT or set_timeout is None:
        return
    from datetime import timedelta

    for a in range(dm.ndim):
        try:
            set_timeout(timedelta(seconds=_TIMEOUT[0]), dm.get_group(a))
        except Exception as e:  # a torch without it keeps its default: slower to stop, nothing worse
            log.info("could not set the timeout of mesh axis %d's group: %s", a, e)


_CPU_GROUP: list[Any] = []


def cpu_group() -> Any:
    """A group of the whole world whose collectives run on the CPU (gloo): the default group when its backend
    is gloo, else one made on the first call (every rank makes its first call at the same point)."""
    if torch.distributed.get_backend() == "gloo":
        return None
    if not _CPU_GROUP:
        from datetime import timedelta

        kw = {"timeout": timedelta(seconds=_TIMEOUT[0])} if _TIMEOUT else {}
        _CPU_GROUP.append(torch.distributed.new_group(backend="gloo", **kw))
        _own_groups([_CPU_GROUP[0]])
    return _CPU_GROUP[0]


_OWN_WORLD: list[Any] = []  # a weak reference to the default group, where MetaDist made it
_OWN_GROUPS: list[Any] = []  # the other groups MetaDist made


def _default_group() -> Any:
    try:
        return torch.distributed.distributed_c10d._get_default_group()
    except Exception:  # none, or a torch that will not hand it out
        return None


def _own_world() -> None:
    """Remember that MetaDist made the default group (to destroy it at exit)."""
    pg = _default_group()
    if pg is not None:
        _OWN_WORLD[:] = [weakref.ref(pg)]
        on_exit("process groups", release_groups)


def _own_groups(groups: Any) -> None:
    """Remember the groups MetaDist made other than the default one (to destroy them at exit)."""
    world = _default_group()
    mine = [g for g in groups if g is not None and g is not world]
    if mine:
        _OWN_GROUPS.extend(mine)
        on_exit("process groups", release_groups)


def release_groups() -> None:
    """Destroy the process groups MetaDist made that still run: the default group (and with it every group)
    where MetaDist made it, else the groups it made on the user's; forget the engines built on them."""
    made = _OWN_WORLD[0]() if _OWN_WORLD else None
    world = _default_group()
    groups = list(_OWN_GROUPS)
    _OWN_WORLD.clear()
    _OWN_GROUPS.clear()
    _CPU_GROUP.clear()
    _ENGINES.clear()
    if world is None:  # the user destroyed it, and every group with it
        return
    if made is not None and world is made:
        torch.distributed.destroy_process_group()
        log.info("destroyed the process group MetaDist started")
        return
    for g in groups:
        try:
            torch.distributed.destroy_process_group(g)
        except ValueError:  # destroyed already (the user destroyed it, or the world with it)
            pass


def agree_on(engine: Engine, values: Sequence[int], message: str, names: Sequence[str]) -> None:
    """Check that every rank holds the same ``values`` (one all_reduce of a few integers on the CPU group);
    where one differs, every rank raises ``message`` with ``{what}`` the name of the first that differs."""
    if not engine.distributed:
        return
    n = len(values)
    t = torch.tensor([int(v) for v in values] + [-int(v) for v in values], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=cpu_group())
    for i in range(n):
        if int(t[i]) != -int(t[n + i]):
            raise RuntimeError("metadist: " + message.format(what=names[i] if i < len(names) else f"value {i}"))


# one Engine per mesh of this process: (shape, axis names) or the DeviceMesh given -> (its argument, Engine)
_ENGINES: dict[tuple, tuple[Any, Engine]] = {}


def engine_for(mesh: Any = None) -> Engine:
    """This process's Engine for the ``mesh`` argument, made on first use and reused after (so that a
    DeviceMesh is built, and the random state synchronised, once per mesh)."""
    rank, world = ensure_process_group() if dist_available() else (0, 1)
    m, dm = resolve_mesh(mesh, world)
    key = ("device_mesh", id(dm)) if dm is not None else (m.shape, m.axis_names, world)
    hit = _ENGINES.get(key)
    if hit is None:
        hit = _ENGINES[key] = (mesh, make_engine(mesh))  # the argument kept alive: its id stays its own
    return hit[1]


def finish_worker(code: int = 0) -> NoReturn:
    """End a torchrun worker with exit code ``code``: wait for every rank (a barrier), stop MetaDist's heartbeat
    and destroy the process group (:func:`metadist_torch.runtime.shutdown.shutdown`, and the user's group too), flush
    output, and exit the ordinary way (``SystemExit``). Call it last, in place of ``sys.exit``."""
    import sys as _sys

    from .shutdown import shutdown

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.barrier()
        except Exception as e:  # a broken group must not hide the exit code
            log.warning("the barrier before exit failed: %s", e)
    shutdown()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception as e:
            log.warning("process group teardown failed: %s", e)
    _sys.stdout.flush()
    _sys.stderr.flush()
    raise SystemExit(int(code))


__all__ = [
    "Engine",
    "make_engine",
    "engine_for",
    "resolve_mesh",
    "ensure_process_group",
    "restart_attempt",
    "collective_timeout",
    "world_info",
    "default_backend",
    "finish_worker",
    "release_groups",
    "cpu_group",
    "agree_on",
]
