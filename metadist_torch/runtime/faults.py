"""When a rank of the job stops: which one, said on every rank that is left.

Each rank runs a :class:`Heartbeat`, a daemon thread that adds one to its
counter in the job's rendezvous store every ``interval`` seconds and publishes
how many steps this process has called. The store is torchrun's agent store
(or rank 0's, launched without torchrun), reached through a client of its
own, so a beat never waits behind a collective. A rank that is killed stops
beating; a rank that hangs in a collective still beats, but its step count
falls behind.

When a collective fails (gloo: the peer's socket closed, or the
``collective_timeout`` ran out; NCCL: the watchdog's error), the step's caller
asks :func:`diagnose`: it reads every rank's counter twice, ``2.5 *
interval`` apart, and names the ranks whose counter did not move, else the
ranks whose step count is behind the others'. :func:`rank_failure` wraps the
original error into a :class:`RankFailure` that says so, and what to do.
Each heartbeat also watches its ring neighbour, so a rank whose peer died
logs the name as soon as it is seen, even while NCCL's watchdog is about to
end the process.

The heartbeat ends with the process group it serves (destroyed by the user:
it stops at its next beat) and with the process: :mod:`metadist_torch.runtime.shutdown`
stops and joins it before the interpreter finalizes, because a daemon thread
that comes back from a store call while Python finalizes is ended by
``pthread_exit``, and that aborts the process (see there). Every store
operation of a heartbeat waits at most ``STORE_TIMEOUT`` seconds, so the join
at exit is bounded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from .shutdown import on_exit

log = logging.getLogger("metadist.torch.faults")

INTERVAL = 1.0  # seconds between beats
STALE = 2.5  # intervals without a beat after which a rank is taken for stopped
STORE_TIMEOUT = 10.0  # seconds a heartbeat's store operation may wait (it bounds the join at exit)


class RankFailure(RuntimeError):
    """A collective failed because another rank of the job stopped answering (or this one was cut off)."""

    def __init__(self, message: str, stopped: list[int] | None = None) -> None:
        super().__init__(message)
        self.stopped = list(stopped or [])


@dataclass
class Heartbeat:
    """This rank's beat in the rendezvous store, and its watch on the next rank's."""

    store: Any
    rank: int
    world: int
    interval: float = INTERVAL
    steps: int = 0  # calls of a compiled step on this process, published with each beat
    lost: str | None = None  # why the store stopped answering (None while it answers)
    neighbour_stopped: bool = False
    known: tuple[list[int], str] | None = None  # what the first rank to diagnose a failure found
    serves: Callable[[], bool] | None = None  # whether the process group it beats for still runs (None: always)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"metadist-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: float | None = None) -> bool:
        """Stop beating; with ``wait``, join the thread for at most that many seconds. Whether it has ended."""
        self._stop.set()
        t = self._thread
        if wait is not None and t is not None and t is not threading.current_thread():
            t.join(wait)
        return t is None or not t.is_alive()

    def _beat(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        self.store.set(f"steps/{self.rank}", str(self.steps))

    def _run(self) -> None:
        peer = (self.rank + 1) % self.world
        seen, since = -1, time.monotonic()
        while not self._stop.wait(self.interval):
            if self.serves is not None and not self.serves():
                log.info("metadist: the process group of rank %d's heartbeat was destroyed: it stops", self.rank)
                _forget(self)
                return
            try:
                self._beat()
                n = int(self.store.add(f"beat/{peer}", 0))
                _named_already(self)  # kept here: the store may be gone when this rank's collective fails
            except Exception as e:  # the store's host is gone: nothing more to beat into
                self.lost = f"{type(e).__name__}: {e}"
                return
            now = time.monotonic()
            if n != seen:
                seen, since = n, now
                self.neighbour_stopped = False
            elif not self.neighbour_stopped and now - since > STALE * self.interval:
                self.neighbour_stopped = True
                log.error(
                    "metadist: rank %d has not beaten for %.1f s (rank %d of %d watching it): it has stopped",
                    peer,
                    now - since,
                    self.rank,
                    self.world,
                )

    def counters(self) -> tuple[list[int], list[int]]:
        """Every rank's beat counter and published step count, read now."""
        beats = [int(self.store.add(f"beat/{r}", 0)) for r in range(self.world)]
        keys = [f"steps/{r}" for r in range(self.world)]  # checked first: a get of a missing key waits
        steps = [int(self.store.get(k)) if self.store.check([k]) else -1 for k in keys]
        return beats, steps


_HEART: list[Heartbeat] = []


def start_heartbeat(rank: int, world: int, attempt: str, timeout: float = 30.0, store: Any = None) -> Heartbeat | None:
    """Start this process's heartbeat (once): in ``store`` (the default process group's, where the user made
    the group: through a clone of it, a connection of its own), else through a client of its own to the
    rendezvous store at ``MASTER_ADDR:MASTER_PORT``. Its operations wait at most ``timeout`` seconds, and
    ``STORE_TIMEOUT`` at most. It beats while the default process group of now runs, and is stopped at exit.
    None where there is no store."""
    if _HEART:
        return _HEART[0]
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world < 2 or (store is None and (not host or not port)):
        return None
    import torch.distributed as dist

    wait = timedelta(seconds=min(timeout, STORE_TIMEOUT))
    try:
        if store is None:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=wait, wait_for_workers=False)
        else:
            store = _own_client(store, wait)
        beat = Heartbeat(dist.PrefixStore(f"metadist/heartbeat/{attempt}/", store), rank, world)
        beat.serves = _serving_group()
        beat.start()
    except Exception as e:
        log.warning("metadist: no heartbeat (its store: %s); a rank that stops will not be named", e)
        return None
    _HEART.append(beat)
    on_exit("heartbeat", stop_heartbeat)
    return beat


def _own_client(store: Any, wait: timedelta) -> Any:
    """A connection of the heartbeat's own to ``store``, whose operations wait at most ``wait`` (a store that
    cannot be cloned is used as it is: its own timeout then bounds the heartbeat's operations)."""
    try:
        mine = store.clone()
        mine.set_timeout(wait)
        return mine
    except Exception as e:  # a store kind without clone()
        log.info("metadist: the heartbeat shares the process group's store (%s cannot be cloned: %s)", store, e)
        return store


def _serving_group() -> Callable[[], bool] | None:
    """Whether the default process group of now still runs, as a check for the heartbeat (None: there is none)."""
    import torch.distributed as dist

    try:
        ref = weakref.ref(dist.distributed_c10d._get_default_group())
    except Exception:  # no default group (or one torch will not hand out): nothing to watch
        return None

    def serves() -> bool:
        try:
            return dist.is_initialized() and dist.distributed_c10d._get_default_group() is ref()
        except Exception:  # torch could not say: taken for gone
            return False

    return serves


def heartbeat() -> Heartbeat | None:
    return _HEART[0] if _HEART else None


def _forget(beat: Heartbeat) -> None:
    _HEART[:] = [b for b in _HEART if b is not beat]


def stop_heartbeat(wait: float | None = None) -> bool:
    """Stop this process's heartbeat and join its thread, for at most ``wait`` seconds (by default the
    longest a store operation may take, and two beats). Whether the thread has ended (True: none ran)."""
    beat = heartbeat()
    if beat is None:
        return True
    _forget(beat)
    wait = STORE_TIMEOUT + 2 * beat.interval if wait is None else wait
    if beat.stop(wait):
        log.debug("metadist: rank %d's heartbeat stopped", beat.rank)
        return True
    log.warning(
        "metadist: rank %d's heartbeat is still inside a store call after %.1f s; if it returns while the "
        "interpreter finalizes, the process aborts ('terminate called without an active exception')",
        beat.rank,
        wait,
    )
    return False


def count_step() -> None:
    """One more call of a compiled step on this process (published with the next beat)."""
    if _HEART:
        _HEART[0].steps += 1


def _named_already(beat: Heartbeat) -> tuple[list[int], str] | None:
    """What a rank that failed before this one found (it wrote it into the store), or None."""
    if beat.known is None and beat.store.check(["found"]):
        r = int(beat.store.get("found"))
        stopped, _, how = beat.store.get(f"found/{r}").decode().partition(";")
        beat.known = ([int(x) for x in stopped.split(",") if x], f"{how} (found by rank {r})")
    return beat.known


def diagnose(beat: Heartbeat | None = None) -> tuple[list[int], str]:
    """The ranks that stopped, and a sentence that says how that was found. The first rank to find them
    writes them into the store for the others: a rank that exits after the failure is not taken for one."""
    beat = beat or heartbeat()
    if beat is None:
        return [], (
            "MetaDist cannot tell which rank stopped: it did not start this job's process group from "
            "MASTER_ADDR/MASTER_PORT (torchrun's environment), so no rank beats into a store"
        )
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if beat.known is not None:
        return beat.known
    try:
        known = _named_already(beat)
        if known is not None:
            return known
        first, _ = beat.counters()
        time.sleep(STALE * beat.interval)
        known = _named_already(beat)
        if known is not None:
            return known
        second, steps = beat.counters()
        stopped, how = _judge(beat, first, second, steps)
        beat.store.set(f"found/{beat.rank}", ",".join(map(str, stopped)) + ";" + how)
        beat.store.set("found", str(beat.rank))
        if beat.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            time.sleep(2 * beat.interval)  # this process hosts the store: the others' beats read the finding first
        return stopped, how
    except Exception as e:
        if beat.known is not None:
            return beat.known
        return [], (
            f"the job's rendezvous store at {where} no longer answers ({type(e).__name__}: {e}); it lives in "
            f"torchrun's agent, or in rank 0 when the job was started without torchrun, so that process has "
            f"stopped"
        )


def _judge(beat: Heartbeat, first: list[int], second: list[int], steps: list[int]) -> tuple[list[int], str]:
    stopped = [r for r in range(beat.world) if r != beat.rank and second[r] == first[r]]
    if stopped:
        names = ", ".join(
            f"rank {r} ({f'its last beat: {steps[r]} step calls' if steps[r] >= 0 else 'it never beat'})"
            for r in stopped
        )
        return stopped, f"{names} stopped answering: no heartbeat in {STALE * beat.interval:.1f} s"
    live = [s for s in steps if s >= 0]
    ahead = max(live) if live else 0
    behind = [r for r, s in enumerate(steps) if 0 <= s < ahead]
    if behind:
        names = ", ".join(f"rank {r} (at step call {steps[r]}, the others at {ahead})" for r in behind)
        return behind, f"every rank still beats, but {names} fell behind: it is stuck or slower than the timeout"
    return [], "every rank still beats and has called the step as often as this one: the failure is elsewhere"


def is_collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a process group's error (a closed peer, a timeout, NCCL's watchdog)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out")
    )


def rank_failure(e: BaseException, rank: int, world: int, timeout: float | None) -> RankFailure:
    """``e``, a failed collective on ``rank``, as the error that names the rank that stopped and what to do."""
    stopped, how = diagnose()
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    bound = f" (collective_timeout={timeout:g} s)" if timeout else ""
    return RankFailure(
        f"metadist: a collective failed on rank {rank} of {world}{bound}: {how}. The job cannot go on with a "
        f"rank missing: every rank stops. Restart it (torchrun --max-restarts=N) and resume from the last "
        f"checkpoint (metadist_torch.save_checkpoint / load_checkpoint). The collective's error: "
        f"{type(e).__name__}: {first}",
        stopped,
    )


__all__ = [
    "RankFailure",
    "Heartbeat",
    "start_heartbeat",
    "stop_heartbeat",
    "heartbeat",
    "count_step",
    "diagnose",
    "rank_failure",
]
