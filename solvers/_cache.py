"""Proven MILP answers kept on disk: the same model is never solved twice.

The key is a digest of everything HiGHS sees (objective, integrality, bounds, every
constraint's coefficients and limits, the gap and presolve options) and of the scipy
version that solved it. Only proven answers are kept, optimal (status 0) or infeasible
(status 2); a solve stopped by its time limit is not, since another run with more time
may do better. (A toggled solve, the recompute proposal, that runs out of its time before its toggles
and shardings meet the budget leaves a marker with its time limit instead: :func:`ran_out`.) A hit gives back the stored result, so a re-run of the same step on the
same mesh (a restart, every rank under torchrun, the benchmark's warm run) skips the
MILP, while any change to the problem (sizes, mesh, link costs, budget, constraints)
makes a new key and a new solve. The answers take at most the ``ilp_cache_mb`` setting
(512 MiB by default) on disk: past that, the ones least recently used go first.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from metadist_core import cachefiles

log = logging.getLogger("metadist.solve")

KEPT = (0, 2)  # HiGHS statuses that are proofs: optimal within the gap, infeasible
SUBDIR = "milp"
DEFAULT_MB = 512.0  # the ilp_cache_mb setting's default; one answer takes a small fraction of a MB


def milp_key(parts: Sequence[Any]) -> str:
    """A digest of the model: arrays by dtype, shape and bytes; sparse matrices by their CSR arrays."""
    import scipy

    h = hashlib.sha256(f"scipy {scipy.__version__}".encode())
    for p in parts:
        if hasattr(p, "tocsr"):  # a scipy sparse matrix
            m = p.tocsr()
            m.sort_indices()
            h.update(f"csr{m.shape}".encode())
            for a in (m.data, m.indices, m.indptr):
                _update(h, a)
        elif isinstance(p, np.ndarray):
            _update(h, p)
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return h.hexdigest()


def _update(h: Any, a: np.ndarray) -> None:
    a = np.ascontiguousarray(a)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())


def _path(cache_dir: str | os.PathLike, key: str, suffix: str = ".npz") -> Path:
    return Path(cache_dir) / SUBDIR / f"{key}{suffix}"


def load(cache_dir: str | os.PathLike | None, key: str) -> Any | None:
    """The stored result for ``key`` (a scipy OptimizeResult), or None (none kept, or unreadable: one warning)."""
    if cache_dir is None:
        return None
    path = _path(cache_dir, key)
    res = cachefiles.read(path, _parse, "ILP answer")
    if res is None:
        return None
    try:
        os.utime(path)  # used now: the last to be evicted
    except OSError:
        pass
    return res


def _parse(raw: bytes) -> Any:
    """The OptimizeResult kept in an answer file's bytes."""
    from scipy.optimize import OptimizeResult

    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        return OptimizeResult(
            status=int(z["status"]),
            message=str(z["message"]),
            success=bool(z["success"]),
            x=z["x"] if z["has_x"] else None,
            fun=float(z["fun"]) if z["has_x"] else None,
            mip_dual_bound=float(z["mip_dual_bound"]),
            mip_gap=float(z["mip_gap"]),
            mip_node_count=int(z["mip_node_count"]),
            cached=True,
        )


def store(cache_dir: str | os.PathLike | None, key: str, res: Any, limit_mb: float = DEFAULT_MB) -> None:
    """Keep ``res`` under ``key`` when it is a proof (optimal or infeasible); written atomically. The least
    recently used answers then go until all take at most ``limit_mb`` MiB. A cache dir that cannot be written
    costs the next run a solve, nothing more (one warning)."""
    if cache_dir is None or res.status not in KEPT:
        return
    path = _path(cache_dir, key)
    has_x = res.x is not None
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        status=res.status,
        message=str(res.message),
        success=bool(res.success),
        has_x=has_x,
        x=res.x if has_x else np.zeros(0),
        fun=float(res.fun) if has_x else 0.0,
        mip_dual_bound=_num(getattr(res, "mip_dual_bound", None)),
        mip_gap=_num(getattr(res, "mip_gap", None)),
        mip_node_count=int(getattr(res, "mip_node_count", 0) or 0),
    )
    if cachefiles.write_atomic(path, buf.getvalue(), cache_dir=cache_dir, what="ILP answer"):
        evict(path.parent, int(limit_mb * 2**20), keep=path)


def evict(folder: Path, limit: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used answers in ``folder`` until they take at most ``limit`` bytes (never
    ``keep``, the one just written); the removed paths."""
    entries = []
    for p in folder.glob("*.npz"):
        try:
            st = p.stat()
        except OSError:  # removed by another rank meanwhile
            continue
        entries.append((st.st_mtime, p, st.st_size))
    total = sum(size for _, _, size in entries)
    gone = []
    for _, p, size in sorted(entries, key=lambda e: (e[0], e[1].name)):
        if total <= limit:
            break
        if keep is not None and p == keep:
            continue
        try:
            p.unlink()
        except OSError:
            continue
        total -= size
        gone.append(p)
    if gone:
        log.info("ILP cache: removed %d least recently used answers to stay within %.0f MiB", len(gone), limit / 2**20)
    return gone


def ran_out(cache_dir: str | os.PathLike | None, key: str, time_limit: float) -> float | None:
    """The time limit an earlier solve of ``key`` ran out of without meeting its memory rows, when it was at
    least ``time_limit`` (a run given no more time would too); else None."""
    if cache_dir is None:
        return None
    spent = cachefiles.read(_path(cache_dir, key, ".timeout"), lambda raw: float(raw), "ILP timeout note")
    return spent if spent is not None and spent >= time_limit else None


def note_ran_out(cache_dir: str | os.PathLike | None, key: str, time_limit: float) -> None:
    """Remember that the solve of ``key`` (its first round) ran out of ``time_limit`` seconds unanswered.
    Not a proof, so not an answer: only a run given no more time skips it (:func:`ran_out`)."""
    if cache_dir is None:
        return
    path = _path(cache_dir, key, ".timeout")
    cachefiles.write_atomic(path, f"{float(time_limit)!r}", cache_dir=cache_dir, what="ILP timeout note")


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)
