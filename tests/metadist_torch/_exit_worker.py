"""Worker of tests/metadist_torch/test_exit.py: processes whose ending test_exit.py watches.

``server``
    hosts a TCPStore and prints its port; the test pauses and resumes it (SIGSTOP, SIGCONT).
``rank PORT DIR``
    starts MetaDist's heartbeat on that store, waits until the heartbeat thread is inside a store call (the
    test has paused the server), and ends its script. An object of ``__main__`` then holds the interpreter's
    finalization open: it writes ``DIR/finalizing`` and waits for ``DIR/resumed`` (the test resumed the server).
``destroy``
    the user makes a process group, MetaDist beats into its store, the user destroys the group: prints JSON
    saying whether the heartbeat stopped.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

IN_STORE_CALL = {"_beat", "_run", "_named_already"}  # the heartbeat's frames that call the store


def server() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(store.port, flush=True)
    time.sleep(300)


def _in_store_call(thread: threading.Thread, for_s: float = 0.5) -> bool:
    """Whether ``thread``'s innermost Python frame stays a store-calling heartbeat frame for ``for_s`` seconds:
    it is blocked inside a store operation (between beats it waits in ``threading``)."""
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        frame = sys._current_frames().get(thread.ident or -1)
        if frame is None or frame.f_code.co_name not in IN_STORE_CALL:
            return False
        time.sleep(0.02)
    return True


class HoldFinalization:
    """Deleted when ``__main__`` is cleared, after the interpreter began finalizing: says so, and waits for the
    store to be resumed (and a moment more, for the heartbeat's call to come back)."""

    def __init__(self, folder: Path) -> None:
        self.finalizing, self.resumed = str(folder / "finalizing"), str(folder / "resumed")

    def __del__(self, open=open, exists=os.path.exists, sleep=time.sleep) -> None:
        open(self.finalizing, "w").close()
        for _ in range(600):
            if exists(self.resumed):
                break
            sleep(0.05)
        sleep(2.0)


def rank(port: int, folder: Path) -> None:
    import torch.distributed as dist

    from metadist_torch.runtime import faults

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    beat = faults.start_heartbeat(0, 2, "0", store=store)
    assert beat is not None and beat._thread is not None
    beat.interval = 0.05
    print("ready", flush=True)
    sys.stdin.readline()  # the test has paused the store's server
    t = time.monotonic()
    while not _in_store_call(beat._thread):
        if time.monotonic() - t > 30:
            sys.exit("the heartbeat never blocked in a store call")
    print("blocked", flush=True)
    globals()["hold"] = HoldFinalization(folder)


def destroy() -> None:
    import torch.distributed as dist

    from metadist_torch.runtime import faults

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    beat = faults.start_heartbeat(0, 2, "0", store=dist.distributed_c10d._get_default_store())
    assert beat is not None and beat._thread is not None
    beat.interval = 0.05
    time.sleep(0.2)
    dist.destroy_process_group()
    beat._thread.join(5.0)
    print(json.dumps({"stopped": not beat._thread.is_alive(), "forgotten": faults.heartbeat() is None}), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "server":
        server()
    elif mode == "rank":
        rank(int(sys.argv[2]), Path(sys.argv[3]))
    elif mode == "destroy":
        destroy()
    else:
        sys.exit(f"unknown mode {mode!r}: server, rank or destroy")
