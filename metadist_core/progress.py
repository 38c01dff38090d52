"""Progress on stderr, through tqdm: the one thing MetaDist prints by default.

Shown when stderr is a terminal, or when the ``progress`` setting is on
(``METADIST_PROGRESS=1``); hidden with ``METADIST_PROGRESS=0``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from tqdm import tqdm
from metadist_core.config import load_settings


def progress_enabled(enabled: bool | None = None) -> bool:
    """``enabled`` if given, else the ``progress`` setting, else whether stderr is a terminal."""
    if enabled is not None:
        return bool(enabled)
    setting = load_settings().progress
    return sys.stderr.isatty() if setting is None else setting


class Progress:
    """``with Progress(total, "discover") as bar: bar.update(1, note)``: a tqdm bar counting items."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None) -> None:
        self.total, self.desc = max(total, 0), desc
        self.enabled = progress_enabled(enabled)
        self.done = 0
        self._bar: Any = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._bar = tqdm(
                total=self.total,
                desc=self.desc,
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
                bar_format="{desc} [{bar:28}] {n_fmt}/{total_fmt} {elapsed} {postfix}",
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note[:40], refresh=False)
            self._bar.update(n)


class Ticker:
    """``with Ticker("solve (ilp)"): ...``: the elapsed time of one long call that cannot report steps
    (a MILP solve), redrawn by tqdm while it runs; shown under the same conditions as :class:`Progress`."""

    def __init__(self, desc: str, enabled: bool | None = None, interval: float = 0.5) -> None:
        self.desc, self.interval = desc, interval
        self.enabled = progress_enabled(enabled)
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Ticker":
        if self.enabled:
            self._bar = tqdm(total=None, desc=self.desc, file=sys.stderr, bar_format="{desc} {elapsed}{postfix}")

            def run() -> None:
                while not self._stop.wait(self.interval):
                    self._bar.refresh()

            self._thread = threading.Thread(target=run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._bar.set_postfix_str(" done" if exc[0] is None else " failed", refresh=False)
            self._bar.close()
