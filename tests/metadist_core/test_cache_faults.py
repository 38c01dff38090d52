"""The on-disk caches survive concurrency and faults (metadist_core/cachefiles.py): many writers at once never
corrupt a cache or let a reader see half a file, a read-only or full cache dir plans on without the cache and
one warning per directory, and a corrupt file is a miss with one warning, then rewritten."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cache_job  # noqa: E402

from metadist_core import cachefiles  # noqa: E402
from metadist_core.cost import optimes  # noqa: E402
from metadist_core.cost.localtime import LocalTimer  # noqa: E402
from metadist_core.cost.profile import (  # noqa: E402
    MeshProfile,
    beside_profile,
    cached_profile,
    profile_cache_path,
    profile_key,
)
from metadist_core.discovery.rules import CACHE_FILE, OpRules, RuleBook, ShardingRule  # noqa: E402
from metadist_core.ir.placement import Shard  # noqa: E402
from metadist_solvers import _cache  # noqa: E402

JOB = Path(_cache_job.__file__)
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """This process's environment for a worker: this checkout first on PYTHONPATH, one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", METADIST_PROGRESS="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _run_all(cmds: list[list[str]], timeout: float) -> None:
    """Start every command at once; fail with the last lines of each that failed."""
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    bad = []
    for c, p in zip(cmds, procs):
        out, _ = p.communicate(timeout=timeout)
        if p.returncode:
            bad.append(f"{' '.join(c[2:])} exited {p.returncode}:\n" + "\n".join(out.splitlines()[-15:]))
    assert not bad, "\n\n".join(bad)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def _assert_sound(d: Path) -> None:
    """Every file under ``d`` parses as what its cache writes, and no temp file is left."""
    left = [p for p in _files(d) if p.name.endswith(cachefiles.TEMP_SUFFIX)]
    assert not left, f"temp files left behind: {left}"
    for p in _files(d):
        if p.name.endswith(cachefiles.LOCK_SUFFIX):
            continue
        if p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                assert int(z["status"]) in _cache.KEPT
        elif p.suffix == ".timeout":
            float(p.read_text())
        else:
            raise AssertionError(f"an unexpected file in the cache: {p}")


def _cache_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "metadist.cache" and r.levelno >= logging.WARNING]


# -- many writers at once -------------------------------------------------------------------------------


def test_many_processes_and_threads_write_and_read_every_cache_at_once(tmp_path):
    """8 processes of 2 threads each write and read every cache in one folder; each asserts that every read
    was a miss or a whole value, kept its own entries and logged no warning. After: every file parses,
    no temp file is left, and the caches that gather entries hold every writer's."""
    workers, iterations, threads = 8, 20, 2
    d = tmp_path / "cache"
    t0 = time.perf_counter()
    _run_all(
        [[sys.executable, str(JOB), "hammer", str(d), str(w), str(iterations), str(threads)] for w in range(workers)],
        timeout=120,
    )
    seconds = time.perf_counter() - t0
    _assert_sound(d)
    names = {f"w{w}t{t}-{i}" for w in range(workers) for t in range(threads) for i in range(iterations)}
    assert names <= set(RuleBook.load(d).entries)
    key = profile_key(8, "fake", host="hammer")
    assert names <= set(optimes._load(beside_profile(d, key, "-ops.json")))
    local = LocalTimer(lambda op: True, _cache_job._measure, cache_file=beside_profile(d, key, "-local.json"))
    assert names <= set(local.times)
    assert names <= set(cached_profile(d, profile_key(8, "fake", host="kept")).axis_costs)
    assert len(list((d / _cache.SUBDIR).glob("*.npz"))) == 4
    assert seconds < 60, f"the hammer took {seconds:.0f} s"


# -- a cache dir that cannot be written -----------------------------------------------------------------


def _read_only(monkeypatch):
    """Every cache write fails as on a read-only file system: the temp file cannot be made."""

    def fail(folder, name):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder / name))

    monkeypatch.setattr(cachefiles, "_open_temp", fail)


def _full(monkeypatch):
    """Every cache write fails as on a full disk: part of the data is written, then ENOSPC."""

    def fail(fd, raw):
        with os.fdopen(fd, "wb") as f:
            f.write(raw[: len(raw) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cachefiles, "_write", fail)


def test_a_read_only_cache_dir_plans_without_the_cache_and_one_warning(tmp_path, monkeypatch, caplog):
    """Every cache (profile, rules, op slowdowns, local times, ILP) fails to write; planning gives the plan it
    gives with a working cache, twice, and one warning names the directory, the error and what to do."""
    good = _cache_job.plan(tmp_path / "good")
    d = tmp_path / "read-only"
    _read_only(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="metadist"):
        first = _cache_job.plan(d)
        second = _cache_job.plan(d)
    assert first["choices"] == second["choices"] == good["choices"]
    assert second["discovered"] == first["discovered"] > 0 and second["profiles_measured"] == 1  # nothing kept
    (w,) = _cache_warnings(caplog)
    text = w.getMessage()
    assert str(d) in text and "EROFS" in text and "METADIST_CACHE_DIR" in text and "can write" in text
    assert not [p for p in _files(d) if not p.name.endswith(cachefiles.LOCK_SUFFIX)]


def test_a_full_disk_keeps_the_old_files_and_warns_once_per_directory(tmp_path, monkeypatch, caplog):
    """A cache filled before the disk ran out keeps its files whole; two full cache dirs, one warning each,
    naming ENOSPC and the MiB free."""
    a, b = tmp_path / "a", tmp_path / "b"
    _cache_job.plan(a)
    before = {p: p.read_bytes() for p in _files(a)}
    _full(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="metadist"):
        for d in (a, b, a, b):
            got = _cache_job.plan(d, (4,), batch=8, seq=64, width=128, hidden=512)
            assert got["choices"]
    assert {p: p.read_bytes() for p in _files(a) if p in before} == before
    _assert_sound(a)
    _assert_sound(b)
    warned = _cache_warnings(caplog)
    assert len(warned) == 2 and {str(a) in warned[0].getMessage(), str(b) in warned[1].getMessage()} == {True}
    assert all("ENOSPC" in w.getMessage() and "MiB free" in w.getMessage() for w in warned)


def test_a_profile_the_user_asked_for_still_raises(tmp_path, monkeypatch):
    """`metadist calibrate --out` writes a file the user named: there a failed write is an error, not a warning."""
    _read_only(monkeypatch)
    with pytest.raises(OSError, match="Read-only"):
        MeshProfile().save(tmp_path / "mine.json")
    assert not _files(tmp_path)


# -- a corrupt file in each cache -----------------------------------------------------------------------

KEY = profile_key(4, "fake", host="corrupt")


def _rules(d: Path):
    path = d / CACHE_FILE

    def write():
        book = RuleBook(cache_dir=d)
        book.add("k", OpRules("np.relu", [ShardingRule((Shard(0),), (Shard(0),))]))
        assert book.save() == path

    return path, write, lambda: RuleBook.load(d).get("k")


def _optimes(d: Path):
    path = beside_profile(d, KEY, "-ops.json")
    return path, lambda: optimes._save(path, {"sig": 2.0}), lambda: optimes._load(path).get("sig")


def _profile(d: Path):
    path = profile_cache_path(d, KEY)
    prof = MeshProfile(nodes=1, devices_per_node=4, measured=True, key=KEY)
    write = lambda: cachefiles.write_atomic(path, prof.dumps())
    return path, write, lambda: cached_profile(d, KEY)


def _localtime(d: Path):
    path = beside_profile(d, KEY, "-local.json")

    def write():
        timer = LocalTimer(lambda op: True, _cache_job._measure, cache_file=path)
        timer.times["kernel"] = (1e-3, _cache_job.CPU)
        timer.save()

    return path, write, lambda: LocalTimer(lambda op: True, _cache_job._measure, cache_file=path).times.get("kernel")


def _ilp(d: Path):
    return (
        d / _cache.SUBDIR / "k.npz",
        lambda: _cache.store(d, "k", _cache_job._proof(3.0)),
        lambda: _cache.load(d, "k"),
    )


def _timeout(d: Path):
    path = d / _cache.SUBDIR / "k.timeout"
    return path, lambda: _cache.note_ran_out(d, "k", 2.0), lambda: _cache.ran_out(d, "k", 1.0)


@pytest.mark.parametrize("kind", [_rules, _optimes, _profile, _localtime, _ilp, _timeout], ids=lambda k: k.__name__[1:])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_file_is_a_miss_with_one_warning_then_rewritten(tmp_path, caplog, kind, damage):
    if kind is _timeout and damage == "truncated":
        pytest.skip("a number cut short is still a number: a timeout note has no end to miss")
    path, write, read = kind(tmp_path)
    write()
    assert read() is not None
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else b"\x00not a cache file\xff")
    with caplog.at_level(logging.WARNING, logger="metadist"):
        assert read() is None and read() is None
    (w,) = _cache_warnings(caplog)
    assert "unreadable" in w.getMessage() and str(path) in w.getMessage()
    write()
    assert read() is not None
    assert len(_cache_warnings(caplog)) == 1


def test_corrupt_caches_plan_the_same_plan(tmp_path, caplog):
    """Planning over a cache whose every file was cut short plans as a fresh cache does and rewrites them."""
    d = tmp_path / "cache"
    fresh = _cache_job.plan(d)
    files = [p for p in _files(d) if not p.name.endswith(cachefiles.LOCK_SUFFIX)]
    for p in files:
        p.write_bytes(p.read_bytes()[:10])
    with caplog.at_level(logging.WARNING, logger="metadist"):
        again = _cache_job.plan(d)
    assert again["choices"] == fresh["choices"] and again["discovered"] == fresh["discovered"]
    assert len(_cache_warnings(caplog)) == len(files)
    _assert_sound(d)
    assert _cache_job.plan(d)["discovered"] == 0


# -- 4 jobs of 4 ranks at once --------------------------------------------------------------------------


@pytest.mark.slow
def test_four_jobs_of_four_ranks_share_one_fresh_cache_dir(tmp_path):
    """4 jobs, each of 4 rank processes that all plan and write, start at once on one fresh cache dir (each
    job another mesh and block); then every file parses, and a fifth run of each job discovers nothing,
    reads its ILP answer and measures no profile."""
    d = tmp_path / "cache"
    outs = {(j, r): tmp_path / f"job{j}-rank{r}.json" for j in range(4) for r in range(4)}
    _run_all([[sys.executable, str(JOB), "plan", str(d), str(j), str(r), str(o)] for (j, r), o in outs.items()], 300)
    _assert_sound(d)
    for j, (mesh, block) in enumerate(_cache_job.JOBS):
        ranks = [json.loads(outs[j, r].read_text()) for r in range(4)]
        again = _cache_job.plan(d, mesh, **block)
        assert again["discovered"] == 0 and again["cache_hits"] > 0, f"job {j} discovered again: {again}"
        assert again["ilp_cached"] >= 1 and again["profiles_measured"] == 0
        assert all(r["choices"] == again["choices"] for r in ranks)


@pytest.mark.slow
def test_four_torchrun_jobs_of_four_ranks_share_one_fresh_cache_dir(tmp_path):
    """4 torchrun jobs of 4 gloo ranks each compile and run a small step at once on one fresh cache dir, links
    and op times measured (rules, ILP answers, the mesh profile and the op slowdowns written by every job);
    then every file parses, and a fifth run of each job discovers no rule, measures no profile and times no
    op (the files are left as they were)."""
    import socket

    sys.path.insert(0, str(REPO / "tests"))
    from _torchrun import torchrun_env

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    d = tmp_path / "cache"
    env = torchrun_env(METADIST_CACHE_DIR=str(d), METADIST_MEASURE_LINKS="1")

    def cmd(job: int, out: Path) -> list[str]:
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=4"]
        return [*run, f"--master-port={port()}", str(JOB), "torch", str(job), str(out)]

    def start(job: int, out: Path) -> subprocess.Popen:
        return subprocess.Popen(cmd(job, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    outs = [tmp_path / f"job{j}.json" for j in range(4)]
    t0 = time.perf_counter()
    procs = [start(j, o) for j, o in enumerate(outs)]
    for j, p in enumerate(procs):
        text, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and outs[j].exists(), f"job {j} failed:\n" + "\n".join(text.splitlines()[-30:])
    concurrent = time.perf_counter() - t0
    _assert_sound(d)
    kept = {p: p.read_bytes() for p in _files(d) if p.suffix == ".json"}
    assert any(p.name.endswith("-ops.json") for p in kept) and any(p.parent.name == "profiles" for p in kept)
    for j, o in enumerate(outs):
        first = json.loads(o.read_text())
        (p := start(j, o)).communicate(timeout=300)
        assert p.returncode == 0 and json.loads(o.read_text())["loss"] == pytest.approx(first["loss"], rel=1e-5)
    changed = [p.name for p, raw in kept.items() if p.read_bytes() != raw]
    assert not changed, f"a fifth run of each job discovered or measured again: {changed} rewritten"
    assert concurrent < 180, f"4 jobs of 4 ranks took {concurrent:.0f} s"
