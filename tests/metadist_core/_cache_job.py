"""What test_cache_faults.py runs, in its own process or in the test's: writers and readers of every cache.

``python _cache_job.py hammer DIR WORKER ITERATIONS THREADS``: each thread writes and reads every kind of
cache in DIR, asserting that every read is a miss or a complete value and that no warning was logged.
``python _cache_job.py plan DIR JOB RANK OUT``: one rank of job JOB plans (:func:`plan`) with the cache DIR
and writes what it found in the caches to OUT as JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from metadist_core.cost import optimes
from metadist_core.cost.localtime import LocalTimer
from metadist_core.cost.model import DEVICE_PRESETS
from metadist_core.cost.profile import (
    MeshProfile,
    beside_profile,
    cached_profile,
    keep_profile,
    profile_cache_path,
    profile_for,
    profile_key,
)
from metadist_core.discovery.rules import OpRules, RuleBook, ShardingRule
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Shard

CPU = DEVICE_PRESETS["cpu"]
#: the mesh and block of each job of the slow test: different axis sizes and shapes, so different rules
#: and ILP answers
JOBS = [
    ((2, 2), dict(batch=8, seq=64, width=128, hidden=512)),
    ((4,), dict(batch=8, seq=64, width=128, hidden=512)),
    ((2, 4), dict(batch=8, seq=32, width=64, hidden=256)),
    ((2,), dict(batch=6, seq=64, width=96, hidden=384)),
]


class Warnings(logging.Handler):
    """The warnings MetaDist logs while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        logging.getLogger("metadist").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# -- planning with every cache ------------------------------------------------------------------------


def _time_ops(requests, program):
    """A frontend's op timer (``Frontend.time_ops``): every op takes 0.1 ms."""
    return SimpleNamespace(device=CPU, harness=1e-6, seconds=[1e-4] * len(requests), program=None)


def _measure(requests, mesh):
    """A LocalTimer's measure: every kernel takes 0.1 ms at its local shapes."""
    return [1e-4] * len(requests), CPU


class Measuring:
    """A frontend that measures a profile (``profile_for`` asks it), counting how often it had to."""

    def __init__(self) -> None:
        self.measured = 0

    def measure_profile(self, resolved, cached):
        if cached is not None:
            return cached
        self.measured += 1
        return MeshProfile(nodes=1, devices_per_node=resolved.mesh.size, backend="fake", measured=True)


def plan(cache_dir: str | Path, mesh_shape=(2, 2), lead: bool = True, **block) -> dict:
    """Plan a reference transformer block on ``mesh_shape`` with every cache under ``cache_dir`` in use: the
    measured profile (through ``profile_for``), the rules, the ops' slowdowns, the local op times and the ILP's
    answers. What each cache gave: discoveries, rule cache hits, ILP answers read, profiles measured."""
    from metadist_core.config import load_settings
    from metadist_core.driver.planner import plan_graph
    from metadist_core.reference.plugin import transformer_block

    settings = load_settings(cache_dir=str(cache_dir), measure_links=True, progress=False)
    mesh = Mesh(tuple(mesh_shape))
    front = Measuring()
    resolved = SimpleNamespace(mesh=mesh, device_kind="fake", lead=lead)
    prof = profile_for(front, resolved, settings)
    key = profile_key(mesh.size, "fake")
    ops_file = beside_profile(cache_dir, key, "-ops.json")
    timer = LocalTimer(
        lambda op: op.key == "np.matmul", _measure, cache_file=beside_profile(cache_dir, key, "-local.json")
    )
    res = plan_graph(
        transformer_block(**block),
        prof.mesh(mesh.shape),
        settings=settings,
        device=prof.device,
        op_slowdowns=lambda g, costs: optimes.whole_slowdowns(g, costs, _time_ops, ops_file),
        local_timer=timer,
    )
    return {
        "discovered": res.rulebook.discovered,
        "cache_hits": res.rulebook.cache_hits,
        "ilp_cached": int(res.plan.stats.extra.get("cached", 0)),
        "profiles_measured": front.measured,
        "kernels_timed": timer.stats()["kernels_timed"],
        "choices": [int(c) for c in res.plan.choices],
    }


# -- the hammer -----------------------------------------------------------------------------------------


def _proof(x: float):
    from scipy.optimize import OptimizeResult

    return OptimizeResult(status=0, message="optimal", success=True, x=np.full(64, x), fun=x, mip_gap=0.0)


def hammer(cache_dir: Path, me: str, iterations: int) -> None:
    """``iterations`` rounds of writing and reading every cache in ``cache_dir`` as writer ``me``."""
    from metadist_solvers import _cache

    key = profile_key(8, "fake", host="hammer")
    prof_path = profile_cache_path(cache_dir, key)
    kept = profile_key(8, "fake", host="kept")
    ops_file = beside_profile(cache_dir, key, "-ops.json")
    local_file = beside_profile(cache_dir, key, "-local.json")
    rule = OpRules("np.relu", [ShardingRule((Shard(0),), (Shard(0),))])
    mine: list[str] = []
    for i in range(iterations):
        name = f"{me}-{i}"
        mine.append(name)
        book = RuleBook(cache_dir=cache_dir)
        book.add(name, rule)
        assert book.save() is not None
        back = RuleBook.load(cache_dir)
        assert all(back.rules(n) == rule.rules for n in mine), f"{me}: the rule cache lost an entry of mine"

        optimes._save(ops_file, {name: float(i)})
        slow = optimes._load(ops_file)
        assert all(slow.get(n) == float(n.rsplit("-", 1)[1]) for n in mine), f"{me}: op timings lost an entry"

        MeshProfile(nodes=1, devices_per_node=i + 1, measured=True, key=key).save(prof_path)
        got = MeshProfile.from_json(json.loads(prof_path.read_text()))
        assert got.measured and got.key == key, f"{me}: a mesh profile read back wrong"
        assert cached_profile(cache_dir, key) is not None, f"{me}: the cached mesh profile was a miss"
        shape = {name: [{"alpha": 1e-6, "beta": 1e-9}]}  # each writer measures a mesh shape of its own
        assert keep_profile(MeshProfile(measured=True, key=kept, axis_costs=shape), cache_dir, kept)
        shapes = cached_profile(cache_dir, kept).axis_costs
        assert all(n in shapes for n in mine), f"{me}: the cached profile lost a mesh shape of mine"

        timer = LocalTimer(lambda op: True, _measure, cache_file=local_file)
        timer.times[name] = (1e-3 * (i + 1), CPU)
        timer.save()
        again = LocalTimer(lambda op: True, _measure, cache_file=local_file)
        assert all(n in again.times for n in mine), f"{me}: local op times lost an entry"

        shared = f"shared{i % 4}"  # every writer stores the same answer under the same key, as ranks do
        _cache.store(cache_dir, shared, _proof(i % 4))
        hit = _cache.load(cache_dir, shared)
        assert hit is None or (hit.fun == i % 4 and np.all(hit.x == i % 4)), f"{me}: an ILP answer read back wrong"
        _cache.note_ran_out(cache_dir, shared, 1.5)
        assert _cache.ran_out(cache_dir, shared, 1.0) in (None, 1.5)


def _hammer_main(cache_dir: str, worker: str, iterations: str, threads: str) -> None:
    seen = Warnings()
    failed: list[BaseException] = []

    def run(t: int) -> None:
        try:
            hammer(Path(cache_dir), f"w{worker}t{t}", int(iterations))
        except BaseException as e:  # reported below, from the main thread
            failed.append(e)

    pool = [threading.Thread(target=run, args=(t,)) for t in range(int(threads))]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if failed:
        raise failed[0]
    assert not seen.records, "warnings while hammering: " + "; ".join(r.getMessage() for r in seen.records)


#: the mesh and activation of each torch job: different op patterns and ILP problems per job
TORCH_JOBS = [((4,), "GELU"), ((2, 2), "ReLU"), ((4,), "Tanh"), ((2, 2), "SiLU")]


def _torch_main(job: str, out: str) -> None:
    """One rank of torch job JOB: a small MLP step compiled by metadist_compile and run once; rank 0 writes
    the loss and how many ILP answers the plan read from the cache to OUT."""
    import torch

    from metadist_torch import metadist_compile
    from metadist_torch.runtime.engine import ensure_process_group, finish_worker

    rank, _ = ensure_process_group()
    mesh, act = TORCH_JOBS[int(job)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), getattr(torch.nn, act)(), torch.nn.Linear(128, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = metadist_compile(mesh=mesh, measure_memory=False)(step)
    loss = float(fn(model, opt, torch.randn(16, 32)))
    if rank == 0:
        Path(out).write_text(json.dumps({"loss": loss, "ilp_cached": int(fn.plan.stats.extra.get("cached", 0))}))
    finish_worker(0)


def _plan_main(cache_dir: str, job: str, rank: str, out: str) -> None:
    mesh_shape, block = JOBS[int(job)]
    got = plan(cache_dir, mesh_shape, lead=rank == "0", **block)
    Path(out).write_text(json.dumps(got))


if __name__ == "__main__":
    {"hammer": _hammer_main, "plan": _plan_main, "torch": _torch_main}[sys.argv[1]](*sys.argv[2:])
