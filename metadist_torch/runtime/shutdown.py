"""A clean exit: what MetaDist started in this process, stopped and released in order when the process ends.

Why it must happen before the interpreter finalizes: once Python (before 3.14) starts finalizing, a daemon
thread that takes the GIL back is ended with ``pthread_exit``. A thread that comes back from a torch binding
that released the GIL (every ``Store`` operation runs under pybind11's ``gil_scoped_release``) takes the GIL
back in that guard's destructor, which is ``noexcept``: the forced unwind of ``pthread_exit`` meets it, and
``std::terminate`` aborts the process ("terminate called without an active exception", SIGABRT) after all
its work is done. The heartbeat (:mod:`metadist_torch.runtime.faults`) is such a thread.

So one ``atexit`` hook (it runs before finalization, on a normal end and after an uncaught exception)
calls :func:`shutdown`, which runs the steps registered with :func:`on_exit` in ``ORDER``: first the
heartbeat is stopped and joined (its store operations are bounded), then the process groups MetaDist made
are destroyed. :func:`shutdown` may be called earlier (``finish_worker`` does); each step runs once.
"""

from __future__ import annotations

import atexit
import logging
from typing import Callable

log = logging.getLogger("metadist.torch.shutdown")

ORDER = ("heartbeat", "process groups")  # a step's place at exit: the groups' store outlives the heartbeat

_STEPS: dict[str, Callable[[], object]] = {}
_HOOKED: list[bool] = []


def on_exit(step: str, release: Callable[[], object]) -> None:
    """Call ``release`` when the process ends (or at :func:`shutdown`), in ``step``'s place in ``ORDER``."""
    if step not in ORDER:
        raise ValueError(f"unknown exit step {step!r}; the steps are {', '.join(ORDER)}")
    _STEPS[step] = release
    if not _HOOKED:
        atexit.register(shutdown)
        _HOOKED.append(True)


def shutdown() -> None:
    """Run the registered steps in ``ORDER``, each once; a step that fails is logged, and the next one runs."""
    for step in ORDER:
        release = _STEPS.pop(step, None)
        if release is None:
            continue
        try:
            release()
        except Exception as e:  # the exit goes on: the next step still runs
            log.warning("metadist: at exit, %s could not be released: %s: %s", step, type(e).__name__, e)


__all__ = ["ORDER", "on_exit", "shutdown"]
