"""Cache files that many processes and threads share: written atomically, read tolerantly.

Every cache under the ``cache_dir`` setting (the rule cache, mesh profiles and the op times kept beside
them, the ILP's proven answers) is written and read through here. A write goes to a temp file of its own in
the target's folder (``mkstemp``: unique per process and thread), is flushed to disk and renamed over the
target, so that a reader sees the old file or the new one, never part of one, however many jobs and ranks
write at once; the temp file goes on any failure. A cache that cannot be written (a read-only or full disk)
costs only the cache: the write returns False and one warning per process and cache directory says what to
do. A file that cannot be read or parsed is a miss, with one warning per file. :func:`exclusive` serialises
the read-merge-write of a file that gathers entries from many writers, so that none loses another's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar, Union

log = logging.getLogger("metadist.cache")

T = TypeVar("T")
StrPath = Union[str, os.PathLike]

#: the suffix of the temp files a write leaves only while it runs (``.<name>.<random>.tmp``)
TEMP_SUFFIX = ".tmp"
#: the suffix of the lock files :func:`exclusive` keeps beside a file (``.<name>.lock``; never removed)
LOCK_SUFFIX = ".lock"
ENV = "METADIST_CACHE_DIR"

_lock = threading.Lock()
_warned: set[tuple[int, Any]] = set()  # (pid, what was warned about): a forked child warns afresh


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` sets it, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


_MODE = 0o666 & ~_umask()  # what a plain open() would have made: mkstemp makes 0600


def _first_time(key: Any) -> bool:
    """True the first time this process asks about ``key``."""
    with _lock:
        k = (os.getpid(), key)
        if k in _warned:
            return False
        _warned.add(k)
        return True


# -- writing --------------------------------------------------------------------------------------------


def _open_temp(folder: Path, name: str) -> tuple[int, str]:
    """A new temp file beside ``folder / name``: its descriptor and path."""
    return tempfile.mkstemp(prefix=f".{name}.", suffix=TEMP_SUFFIX, dir=folder)


def _write(fd: int, raw: bytes) -> None:
    """Write ``raw`` to the open temp file ``fd`` and flush it to the disk; closes ``fd``."""
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
        f.flush()
        if hasattr(os, "fchmod"):
            os.fchmod(f.fileno(), _MODE)
        os.fsync(f.fileno())


def _commit(tmp: str, path: Path) -> None:
    """Put the written temp file in place of ``path`` (atomic on one file system)."""
    os.replace(tmp, path)


def replace_atomic(path: StrPath, data: bytes | str) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` atomically: a temp file of this process and thread beside it,
    flushed, then renamed over it. Raises OSError (the temp file removed): for files a user asked for; caches
    use :func:`write_atomic`."""
    p = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _open_temp(p.parent, p.name)
    try:
        _write(fd, raw)
        _commit(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def write_atomic(path: StrPath, data: bytes | str, *, cache_dir: StrPath | None = None, what: str = "cache") -> bool:
    """Write a cache file as :func:`replace_atomic` does; False when it could not, after one warning per
    process and cache directory (``cache_dir``, by default the file's folder) naming ``what`` failed and
    what to do. Planning goes on without the cache."""
    try:
        replace_atomic(path, data)
    except OSError as e:
        unwritable(Path(cache_dir) if cache_dir is not None else Path(path).parent, Path(path), e, what)
        return False
    return True


def _free_mib(folder: Path) -> str:
    """The MiB free on ``folder``'s disk (its nearest existing folder's), as text; '?' when unknown."""
    for d in (folder, *folder.parents):
        try:
            return f"{shutil.disk_usage(d).free / 2**20:.0f}"
        except OSError:
            continue
    return "?"


def unwritable(cache_dir: Path, path: Path, err: OSError, what: str) -> None:
    """Warn, once per process and ``cache_dir``, that writing ``path`` (the ``what``) there failed with
    ``err``; later failures there are logged at debug level only."""
    if not _first_time(("write", str(cache_dir))):
        log.debug("could not write the %s %s: %s", what, path, err)
        return
    name = errno.errorcode.get(err.errno or 0, "error")
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        todo = (
            f"free space on its disk ({_free_mib(cache_dir)} MiB free now) or set {ENV} (the cache_dir "
            "setting) to a folder on another disk"
        )
    else:
        todo = f"set {ENV} (the cache_dir setting) to a folder this process can write"
    log.warning(
        "cannot write to the cache directory %s (%s: %s, writing the %s %s); planning goes on without "
        "keeping what it learns there, so later runs learn it again. To keep the caches, %s. "
        "(Shown once per process and directory.)",
        cache_dir,
        name,
        err.strerror or err,
        what,
        path.name,
        todo,
    )


@contextlib.contextmanager
def exclusive(path: StrPath) -> Iterator[None]:
    """Hold an advisory lock on ``path`` (a lock file ``.<name>.lock`` beside it) for a read-merge-write of
    it, so that concurrent writers keep each other's entries. Where no lock can be had (no ``fcntl``, a
    read-only folder, a file system without locks) the body runs unlocked: the write stays atomic."""
    fd = _lock_fd(Path(path))
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _lock_fd(p: Path) -> int | None:
    """An open descriptor holding the exclusive lock of ``p``, or None."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p.with_name(f".{p.name}{LOCK_SUFFIX}"), os.O_RDWR | os.O_CREAT, _MODE)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


# -- reading --------------------------------------------------------------------------------------------


def read(path: StrPath, parse: Callable[[bytes], T], what: str = "cache file") -> T | None:
    """``parse`` of the bytes at ``path``; None when there is no such file (quietly), or when it cannot be
    read or ``parse`` raises on it (a corrupt or foreign file: a miss, with one warning per process and
    version of the file; the next write of the cache replaces it)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        unreadable(p, e, what, key=str(p))
        return None
    try:
        return parse(raw)
    except Exception as e:  # any error parsing bytes that are not what a write left says the same: a miss
        unreadable(p, e, what, key=(str(p), st.st_mtime_ns, st.st_size))
        return None


def read_json(path: StrPath, what: str = "cache file") -> Any | None:
    """The JSON value in ``path``, or None (see :func:`read`)."""
    return read(path, json.loads, what)


def read_text(path: StrPath, what: str = "cache file") -> str | None:
    """The UTF-8 text in ``path``, or None (see :func:`read`)."""
    return read(path, lambda raw: raw.decode("utf-8"), what)


def unreadable(path: Path, err: BaseException, what: str, key: Any = None) -> None:
    """Warn, once per process and ``key`` (default: the path), that the ``what`` at ``path`` is unreadable."""
    if not _first_time(("read", key if key is not None else str(path))):
        log.debug("the %s %s is unreadable: %s", what, path, err)
        return
    log.warning(
        "the %s %s is unreadable (%s: %s); it counts as a miss and is rewritten when next learned "
        "(delete it if this repeats)",
        what,
        path,
        type(err).__name__,
        err,
    )


__all__ = [
    "LOCK_SUFFIX",
    "TEMP_SUFFIX",
    "exclusive",
    "read",
    "read_json",
    "read_text",
    "replace_atomic",
    "unreadable",
    "unwritable",
    "write_atomic",
]
