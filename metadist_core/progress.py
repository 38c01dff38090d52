"""A small progress bar on stderr: the one thing MetaDist prints by default.

Shown when stderr is a terminal, or when ``METADIST_PROGRESS=1``; hidden with
``METADIST_PROGRESS=0``.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def progress_enabled() -> bool:
    env = os.environ.get("METADIST_PROGRESS")
    if env is not None:
        return env.strip().lower() not in ("0", "false", "no", "off", "")
    return sys.stderr.isatty()


class Progress:
    """``with Progress(total, "discover") as bar: bar.update(1, note)``."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None, width: int = 28) -> None:
        self.total, self.desc, self.width = max(total, 0), desc, width
        self.enabled = progress_enabled() if enabled is None else enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def __enter__(self) -> "Progress":
        self._draw("", force=True)
        return self

    def __exit__(self, *exc) -> None:
        self._draw("", force=True)
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self._draw(note)

    def _draw(self, note: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = self.done / self.total if self.total else 1.0
        fill = int(frac * self.width)
        bar = "#" * fill + "-" * (self.width - fill)
        note = (note[:40] + "...") if len(note) > 43 else note
        sys.stderr.write(f"\r{self.desc} [{bar}] {self.done}/{self.total} {now - self.t0:5.1f}s {note:<43}")
        sys.stderr.flush()


def track(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    with Progress(total, desc) as bar:
        for x in items:
            yield x
            bar.update(1)


class Ticker:
    """``with Ticker("solve (ilp)"): ...``: one line with the elapsed time, redrawn while the work runs.

    For long single calls that cannot report steps (a MILP solve). Shown under
    the same conditions as :class:`Progress`.
    """

    def __init__(self, desc: str, enabled: bool | None = None, interval: float = 0.5) -> None:
        self.desc, self.interval = desc, interval
        self.enabled = progress_enabled() if enabled is None else enabled
        self._stop = None
        self._thread = None
        self.t0 = 0.0

    def _draw(self) -> None:
        sys.stderr.write(f"\r{self.desc} {time.perf_counter() - self.t0:6.1f}s")
        sys.stderr.flush()

    def __enter__(self) -> "Ticker":
        self.t0 = time.perf_counter()
        if self.enabled:
            import threading

            self._stop = threading.Event()

            def run() -> None:
                while not self._stop.wait(self.interval):
                    self._draw()

            self._draw()
            self._thread = threading.Thread(target=run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._draw()
            sys.stderr.write(" done\n" if exc[0] is None else " failed\n")
            sys.stderr.flush()
