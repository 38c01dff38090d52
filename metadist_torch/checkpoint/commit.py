"""A checkpoint folder is whole or absent: staged, checksummed, then committed by renames.

``save_checkpoint(path)`` writes into ``<path>.partial``; once every rank has
written its files, rank 0 writes the manifest (``metadist.json``: each file's
bytes and CRC-32) and swaps the folders: the old ``path`` (if any) becomes
``<path>.previous``, ``<path>.partial`` becomes ``path``, and the previous one
is removed. A crash before the swap leaves the old checkpoint in place; a
crash between the two renames leaves it at ``<path>.previous``, which
:func:`resolve` reads in its place. :func:`verify` checks the sizes and
checksums before anything is loaded, so a partial or corrupted folder is
named and never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "metadist.json"
MANIFEST_FORMAT = "metadist.checkpoint_manifest/1"
PARTIAL, PREVIOUS = ".partial", ".previous"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt, or does not fit the model or optimizer it is loaded into."""


def staging(path: str | os.PathLike) -> Path:
    return Path(os.fspath(path) + PARTIAL)


def crc32(path: Path, chunk: int = 1 << 22) -> int:
    c = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            c = zlib.crc32(block, c)
    return c


def describe(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """``{file name: {"bytes", "crc32"}}`` of ``names`` in ``folder``."""
    return {n: {"bytes": (folder / n).stat().st_size, "crc32": crc32(folder / n)} for n in names}


def own_files(folder: Path, rank: int) -> list[str]:
    """The files rank ``rank`` wrote into a DCP folder (``__<rank>_*``), and rank 0 the ``.metadata``."""
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_"))
    if rank == 0 and (folder / ".metadata").exists():
        names.append(".metadata")
    return names


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(folder: Path, files: dict[str, dict[str, int]], meta: dict[str, Any]) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": MANIFEST_FORMAT, **meta, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    _fsync_dir(folder)


def commit(path: str | os.PathLike) -> None:
    """Swap the staged folder in for ``path`` (rank 0, after the manifest is written)."""
    final, staged = Path(path), staging(path)
    previous = Path(os.fspath(path) + PREVIOUS)
    if previous.exists():
        shutil.rmtree(previous)
    if final.exists():
        os.replace(final, previous)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    if previous.exists():
        shutil.rmtree(previous, ignore_errors=True)


def resolve(path: str | os.PathLike) -> Path:
    """The folder to load for ``path``: itself, or its ``.previous`` left by a save cut short between its two
    renames; a missing one is a FileNotFoundError that says what is there instead."""
    final = Path(path)
    if final.is_dir():
        return final
    previous = Path(os.fspath(path) + PREVIOUS)
    if (previous / MANIFEST).exists():
        warnings.warn(
            f"metadist: no checkpoint at {os.fspath(path)!r}, but the one a save replaced is at {previous}: a "
            f"save was cut short while committing; loading that one",
            stacklevel=3,
        )
        return previous
    there = f" (only an unfinished save is there: {staging(path)})" if staging(path).exists() else ""
    raise FileNotFoundError(
        f"no checkpoint folder at {os.fspath(path)!r}{there}; save one with save_checkpoint(path, model, "
        f"optimizer) first"
    )


def manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest; None for a folder written without one (a DCP checkpoint of another writer)."""
    p = folder / MANIFEST
    if not p.exists():
        if not (folder / ".metadata").exists():
            raise CheckpointError(
                f"{folder} is not a complete checkpoint: it has neither a MetaDist manifest ({MANIFEST}) nor "
                f"DCP's .metadata, so the save that wrote it did not finish; load an earlier one"
            )
        return None
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the manifest {p} is unreadable ({e}); the checkpoint cannot be trusted") from e
    if m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), dict):
        raise CheckpointError(f"{p} is not a MetaDist checkpoint manifest (format {m.get('format')!r})")
    return m


def problems(folder: Path, m: dict[str, Any], share: int = 0, shares: int = 1) -> list[str]:
    """What is wrong with ``folder`` against its manifest: every file's size, and the checksums of this
    process's ``share`` of the files (one of ``shares``)."""
    out = []
    for i, (name, want) in enumerate(sorted(m["files"].items())):
        f = folder / name
        if not f.exists():
            out.append(f"{name} is missing")
            continue
        size = f.stat().st_size
        if size != want["bytes"]:
            out.append(f"{name} has {size} bytes, the manifest {want['bytes']}")
        elif i % shares == share and (got := crc32(f)) != want["crc32"]:
            out.append(f"{name} fails its checksum (CRC-32 {got:#010x}, the manifest {want['crc32']:#010x})")
    return out


def corrupt(folder: Path, found: list[str]) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint {folder} is corrupt and was not loaded: {'; '.join(found[:5])}"
        f"{f' (and {len(found) - 5} more)' if len(found) > 5 else ''}; load an earlier one"
    )


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (the highest saved ``step``, else the newest
    manifest), or None."""
    best: tuple | None = None
    found = None
    folder = Path(root)
    if not folder.is_dir():
        return None
    for d in folder.iterdir():
        if not d.is_dir() or d.name.endswith((PARTIAL, PREVIOUS)) or not (d / MANIFEST).exists():
            continue
        try:
            m = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        step = m.get("step")
        key = (step if isinstance(step, int) else -1, (d / MANIFEST).stat().st_mtime)
        if best is None or key > best:
            best, found = key, d
    return found


__all__ = ["CheckpointError", "MANIFEST", "staging", "commit", "resolve", "manifest", "problems", "latest"]
