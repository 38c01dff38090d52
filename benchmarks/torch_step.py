"""MetaDist vs torch DDP vs FSDP2 (fully_shard) on the GPT example, 4 gloo ranks, one run.

    python -m benchmarks.torch_step [--quick] [--nproc 4]

Per system: median step time after warm-up and peak memory per rank (the
process's peak RSS while that system runs, reset between systems through
/proc/self/clear_refs, and its rise over the RSS before it). For MetaDist also:
compile time split into trace, discover, build_problem, solve, lower, cold
(empty rule cache) and warm (rule cache filled); the communication bytes per
step that the plan predicts (per rank, as the cost model prices them) next to
the bytes counted at the collectives on rank 0. World size 1: the compiled
step next to the plain eager step in one process. All ranks use one thread.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from metadist_core.hookspecs import hookimpl

REPO = Path(__file__).resolve().parents[1]
NAME = "torch_step"


def _gpt():
    sys.path.insert(0, str(REPO / "examples" / "torch"))
    import gpt  # noqa: E402
    return gpt


def _config(quick: bool):
    gpt = _gpt()
    if quick:
        return gpt.GPTConfig(vocab=256, seq=32, width=64, heads=4, layers=1, batch=8)
    return gpt.GPTConfig()  # the example's default: vocab 512, width 128, 2 layers, seq 64, batch 8


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS) in bytes from /proc/self/status."""
    cur = peak = 0
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    return cur, peak


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _timed_steps(run_step, batches, warmup: int) -> tuple[float, list[float]]:
    import torch.distributed as dist
    times = []
    for i, b in enumerate(batches):
        if dist.is_initialized():
            dist.barrier()
        t = time.perf_counter()
        run_step(b)
        times.append(time.perf_counter() - t)
    steady = times[warmup:] or times
    return statistics.median(steady), times


def _phase(name, fn):
    gc.collect()
    _reset_peak()
    before, _ = _rss()
    out = fn()
    _, peak = _rss()
    out.update({"peak_rss_mb": peak / 2**20, "rss_rise_mb": max(0, peak - before) / 2**20})
    return out


# -- a prototype of the proposed core change: all_reduces priced as buckets -----------------


def reprice_all_reduce_edges(problem) -> None:
    """Price every edge whose reshard is all_reduce-only by its bandwidth term (the latency amortised over a
    bucket), in place."""
    from metadist_core.cost import reshard
    from metadist_core.placement import Sharding

    def distinct(shs):
        out = []
        for x in shs:
            if x not in out:
                out.append(x)
        return out

    mesh = problem.mesh
    rep = Sharding.replicated(mesh.ndim)
    for e in problem.edges:
        sn = problem.nodes[e.src]
        srcs = distinct([o.outputs[e.src_slot] for o in sn.options])
        if e.dst < 0:
            dsts = [rep]
        elif e.dst_slot < 0:
            dsts = distinct([o.outputs[0] for o in problem.nodes[e.dst].options])
        else:
            dsts = distinct([o.inputs[e.dst_slot] for o in problem.nodes[e.dst].options])
        info = problem.vars[e.var]
        if info["shape"] is None:
            continue
        t = e.table.copy()
        for r, a in enumerate(srcs):
            for k, b in enumerate(dsts):
                if a == b:
                    continue
                colls = reshard(a, b, info["shape"], info["dtype"], mesh)
                if colls and all(c.kind == "all_reduce" for c in colls):
                    t[r, k] = sum(c.cost - 2 * (mesh.shape[c.axis] - 1) * mesh.alpha[c.axis] for c in colls)
        e.table = t


class BucketPricedSolver:
    """A solver plugin: every edge whose reshard is all_reduce-only priced without its latency term, then
    solved by the ``base`` solver.

    The lowering coalesces independent all_reduces into buckets (one latency per
    bucket, as DDP does), but the core cost model charges each all_reduce its full
    latency, which rules data parallelism out on high-latency links. This prices
    those edges by their bandwidth term only (the latency amortised over a bucket);
    the chosen plan is reported at its honest, per-collective cost. Benchmark-only:
    the core patch would do this in metadist_core.problem.
    """

    name = "bucket-priced"

    def __init__(self, plugins, base: str) -> None:
        self.plugins, self.base = plugins, base

    @hookimpl
    def metadist_solver_info(self):
        return {"name": self.name, "description": f"{self.base}, all_reduces priced as buckets (benchmark)"}

    @hookimpl
    def metadist_solve(self, problem, options):
        reprice_all_reduce_edges(problem)
        return self.plugins.solve(self.base, problem, options)


def bucket_priced_plugins(cache_dir):
    """The installed plugins plus the bucket-priced solver over the configured one; its name."""
    from metadist_core.config import load_settings
    from metadist_core.plugins import PluginManager
    pm = PluginManager()
    solver = BucketPricedSolver(pm, load_settings(cache_dir=cache_dir).solver)
    pm.register(solver, "solver", solver.name)
    return pm, solver.name


# -- the ranks ---------------------------------------------------------------------


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from metadist_torch import metadist_compile
    from metadist_torch.engine import ensure_process_group
    torch.set_num_threads(1)
    rank, world = ensure_process_group()
    gpt = _gpt()
    c = _config(args.quick)
    steps, warmup = (6, 2) if args.quick else (12, 3)
    batches = [gpt.batch(c, s) for s in range(steps)]
    per = c.batch // world
    local = [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) for x, y in batches]
    res: dict = {}

    def ddp():
        from torch.nn.parallel import DistributedDataParallel as DDP
        model, opt = gpt.build(c)
        m = DDP(model)

        def run(b):
            gpt.train_step(m, opt, *b)
        t, _ = _timed_steps(run, local, warmup)
        return {"step_s": t}

    def fsdp2():
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(c.seed)
        model = gpt.GPT(c)
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=c.lr, betas=(0.9, 0.95))

        def run(b):
            gpt.train_step(model, opt, *b)
        t, _ = _timed_steps(run, local, warmup)
        return {"step_s": t}

    cache = args.cache_dir

    def metadist(profile=None, bucket_priced=False):
        saved = os.environ.pop("METADIST_MESH_PROFILE", None)
        if profile:
            os.environ["METADIST_MESH_PROFILE"] = profile
        model, opt = gpt.build(c)
        if bucket_priced:
            pm, solver = bucket_priced_plugins(cache)
            step = metadist_compile(cache_dir=cache, solver=solver, plugins=pm)(gpt.train_step)
        else:
            step = metadist_compile(cache_dir=cache)(gpt.train_step)
        losses = []
        t0 = time.perf_counter()
        losses.append(float(step(model, opt, *batches[0])))
        first = time.perf_counter() - t0
        step.comm_stats.reset()

        def run(b):
            losses.append(float(step(model, opt, *b)))
        t, _ = _timed_steps(run, batches[1:], warmup - 1)
        counted = step.comm_stats.total / max(1, len(batches) - 1)
        plan = step.plan
        predicted = sum(cl.nbytes for _, cl in plan.collectives() if not cl.is_free)
        # the lowering runs the same collectives of one value once for all its readers
        seen, predicted_shared = set(), 0
        for e in plan.edges:
            key = (e.var, tuple((cl.kind, cl.axis, cl.dims, cl.reduce, str(cl.before), str(cl.after))
                                for cl in e.collectives))
            if e.collectives and key not in seen:
                seen.add(key)
                predicted_shared += sum(cl.nbytes for cl in e.collectives if not cl.is_free)
        if saved:
            os.environ["METADIST_MESH_PROFILE"] = saved
        return {"step_s": t, "first_call_s": first, "compile_cold": step.timings, "plan": plan.summary(),
                "compute_model_s": plan.compute_seconds,
                "predicted_comm_bytes": predicted, "predicted_shared_comm_bytes": predicted_shared,
                "counted_comm_bytes": counted,
                "counted_by_kind": {k: v / max(1, len(batches) - 1) for k, v in step.comm_stats.bytes.items()},
                "comm_ms_per_step": 1e3 * sum(step.comm_stats.seconds.values()) / max(1, len(batches) - 1),
                "losses": losses, "n_collectives": sum(1 for _, cl in plan.collectives() if not cl.is_free),
                "sharded_state": sum(1 for v, s in plan.input_shardings.items() if not s.is_fully_replicated())}

    if args.calibrate:
        # what a user runs once per machine: `metadist calibrate` (here inside the job, every rank measures)
        from metadist_torch.calibrate import run_calibrate
        prof_path = Path(args.cache_dir).parent / "mesh-profile.json"
        t = time.perf_counter()
        prof = run_calibrate(prof_path)
        from metadist_torch.engine import measure_device
        dev = measure_device()            # the roofline of one rank here (one thread)
        devs = [None] * world
        dist.all_gather_object(devs, (dev.peak_flops, dev.mem_bandwidth))
        if rank == 0:
            from metadist_core.cost import DeviceSpec
            prof.device = DeviceSpec("measured-cpu", min(d[0] for d in devs), min(d[1] for d in devs))
            prof.save(prof_path)
        dist.barrier()
        res["profile"] = {"levels": prof.levels, "device": [min(d[0] for d in devs), min(d[1] for d in devs)]}
        os.environ["METADIST_MESH_PROFILE"] = str(prof_path)
        res["calibrate_s"] = time.perf_counter() - t
    res["ddp"] = _phase("ddp", ddp)
    res["fsdp2"] = _phase("fsdp2", fsdp2)
    prof_env = os.environ.get("METADIST_MESH_PROFILE")
    res["metadist"] = _phase("metadist", lambda: metadist(prof_env))
    # the same step planned with the built-in link costs (10 us, 25 GB/s): a plan that shards
    res["metadist_builtin_costs"] = _phase("metadist_builtin_costs", lambda: metadist(None))
    res["metadist_builtin_costs"].pop("compile_cold", None)
    # prototype of the proposed core changes: all_reduces priced as buckets, and the device's speed taken from
    # a measured step (the cost model's compute of the plan just run vs its measured time on these ranks)
    prof2 = prof_env
    if prof_env:
        times = [None] * world
        dist.all_gather_object(times, res["metadist"]["step_s"])
        k = res["metadist"]["compute_model_s"] / max(times)
        if rank == 0:
            from metadist_core.cost import DeviceSpec
            from metadist_core.profile import load_profile
            prof = load_profile(prof_env)
            prof.device = DeviceSpec("measured-step", prof.device.peak_flops * k, prof.device.mem_bandwidth * k)
            prof.save(Path(prof_env).with_name("mesh-profile-step.json"))
        dist.barrier()
        prof2 = str(Path(prof_env).with_name("mesh-profile-step.json"))
        res["device_scale"] = k
    res["metadist_bucket_priced"] = _phase("metadist_bucket_priced", lambda: metadist(prof2, bucket_priced=True))
    res["metadist_bucket_priced"].pop("compile_cold", None)
    # warm compile: a fresh step over a fresh model, same rule cache
    model, opt = gpt.build(c)
    step = metadist_compile(cache_dir=cache)(gpt.train_step)
    step(model, opt, *batches[0])
    res["metadist"]["compile_warm"] = step.timings
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered, default=str))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- world size 1 ------------------------------------------------------------------


def single(quick: bool) -> dict:
    """Eager and compiled steps interleaved (one of each per round), medians after warm-up."""
    import torch
    from metadist_torch import metadist_compile
    torch.set_num_threads(1)
    gpt = _gpt()
    c = _config(quick)
    rounds, warmup = (10, 2) if quick else (24, 4)
    batches = [gpt.batch(c, s) for s in range(rounds)]
    m_e, o_e = gpt.build(c)
    m_c, o_c = gpt.build(c)
    step = metadist_compile()(gpt.train_step)
    step(m_c, o_c, *batches[0])
    te, tc = [], []
    for b in batches:
        t = time.perf_counter()
        gpt.train_step(m_e, o_e, *b)
        te.append(time.perf_counter() - t)
        t = time.perf_counter()
        step(m_c, o_c, *b)
        tc.append(time.perf_counter() - t)
    return {"eager_step_s": statistics.median(te[warmup:]), "metadist_step_s": statistics.median(tc[warmup:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller GPT and fewer steps (< 2 minutes)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="plan with the built-in link costs instead of measuring this machine's collectives first")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    from benchmarks._common import write_results
    from metadist_torch.demo import torchrun_cmd
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        wargs = ["--worker", "--out", str(out), "--cache-dir", str(Path(tmp) / "rules")] + \
            (["--quick"] if args.quick else []) + ([] if args.calibrate else ["--no-calibrate"])
        env = dict(os.environ, OMP_NUM_THREADS="1", METADIST_PROGRESS="0", PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(torchrun_cmd(Path(__file__), args.nproc, wargs), env=env, capture_output=True,
                              text=True, cwd=str(REPO), timeout=1800)
        if proc.returncode != 0 or not out.exists():
            print("\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
            return 1
        ranks = json.loads(out.read_text())
    one = single(args.quick)
    c = _config(args.quick)
    model_desc = f"GPT vocab {c.vocab} width {c.width} layers {c.layers} seq {c.seq} batch {c.batch}"
    records = []
    best_baseline = min(statistics.median(r["ddp"]["step_s"] for r in ranks),
                        statistics.median(r["fsdp2"]["step_s"] for r in ranks))
    for system in ("metadist", "metadist_builtin_costs", "metadist_bucket_priced", "ddp", "fsdp2"):
        for rk, r in enumerate(ranks):
            rec = {"benchmark": NAME, "model": model_desc, "world": args.nproc, "system": system, "rank": rk,
                   "step_ms": r[system]["step_s"] * 1e3, "peak_rss_mb": r[system]["peak_rss_mb"],
                   "rss_rise_mb": r[system]["rss_rise_mb"]}
            if system.startswith("metadist"):
                rec["ratio_vs_best_baseline"] = r[system]["step_s"] / best_baseline
                for phase in ("compile_cold", "compile_warm"):
                    for k, v in r[system].get(phase, {}).items():
                        rec[f"{phase}_{k}_s"] = v
                    if phase in r[system]:
                        rec[f"{phase}_total_s"] = sum(r[system][phase].values())
                rec["predicted_comm_bytes"] = r[system]["predicted_comm_bytes"]
                rec["predicted_shared_comm_bytes"] = r[system]["predicted_shared_comm_bytes"]
                rec["counted_comm_bytes"] = r[system]["counted_comm_bytes"]
                rec["n_collectives"] = r[system]["n_collectives"]
                rec["plan"] = r[system]["plan"]
            records.append(rec)
    records.append({"benchmark": NAME, "model": model_desc, "world": 1, "system": "metadist", "rank": 0,
                    "step_ms": one["metadist_step_s"] * 1e3, "eager_step_ms": one["eager_step_s"] * 1e3,
                    "ratio_vs_eager": one["metadist_step_s"] / one["eager_step_s"]})
    r0 = ranks[0]["metadist"]
    notes = (f"{model_desc}; {args.nproc} gloo ranks on this machine, one thread each. "
             f"MetaDist step {statistics.median(r['metadist']['step_s'] for r in ranks) * 1e3:.1f} ms vs "
             f"best of DDP/FSDP2 {best_baseline * 1e3:.1f} ms (ratio "
             f"{statistics.median(r['metadist']['step_s'] for r in ranks) / best_baseline:.2f}); world size 1: "
             f"{one['metadist_step_s'] / one['eager_step_s']:.3f}x eager. Compile cold "
             f"{sum(r0['compile_cold'].values()):.1f} s, warm {sum(r0['compile_warm'].values()):.1f} s. "
             f"Comm bytes/step predicted {r0['predicted_comm_bytes']:,} vs counted {r0['counted_comm_bytes']:,.0f} "
             f"(rank 0). Plan: {r0['plan']}. With the built-in link costs instead: step "
             f"{statistics.median(r['metadist_builtin_costs']['step_s'] for r in ranks) * 1e3:.1f} ms (of which "
             f"{ranks[0]['metadist_builtin_costs']['comm_ms_per_step']:.1f} ms in collectives on rank 0), comm bytes/step "
             f"predicted {ranks[0]['metadist_builtin_costs']['predicted_comm_bytes']:,} vs counted "
             f"{ranks[0]['metadist_builtin_costs']['counted_comm_bytes']:,.0f}, plan "
             f"{ranks[0]['metadist_builtin_costs']['plan']}. Prototype of the proposed core changes (measured "
             f"link costs, device speed scaled by {ranks[0].get('device_scale', 1):.2f} to the measured step, "
             f"all_reduces priced as buckets, lowered with bucketing): step "
             f"{statistics.median(r['metadist_bucket_priced']['step_s'] for r in ranks) * 1e3:.1f} ms (ratio "
             f"{statistics.median(r['metadist_bucket_priced']['step_s'] for r in ranks) / best_baseline:.2f}), "
             f"{ranks[0]['metadist_bucket_priced']['comm_ms_per_step']:.1f} ms in collectives, comm bytes/step "
             f"predicted {ranks[0]['metadist_bucket_priced']['predicted_comm_bytes']:,} (once per value: "
             f"{ranks[0]['metadist_bucket_priced']['predicted_shared_comm_bytes']:,}) vs counted "
             f"{ranks[0]['metadist_bucket_priced']['counted_comm_bytes']:,.0f}, plan "
             f"{ranks[0]['metadist_bucket_priced']['plan']}. Mesh profile measured in the job: {ranks[0].get('profile')}. Peak memory is the process's peak RSS while that system ran "
             f"(imports included); rss_rise is its rise over the RSS before. Whole run "
             f"{time.perf_counter() - t_all:.0f} s.")
    cols = ["system", "world", "rank", "step_ms", "peak_rss_mb", "rss_rise_mb", "ratio_vs_best_baseline",
            "ratio_vs_eager", "eager_step_ms", "compile_cold_total_s", "compile_cold_trace_s",
            "compile_cold_discover_s", "compile_cold_solve_s", "compile_cold_lower_s", "compile_warm_total_s",
            "predicted_comm_bytes", "predicted_shared_comm_bytes", "counted_comm_bytes"]
    path = write_results(NAME, records, cols, "MetaDist vs DDP vs FSDP2: one training step of the GPT example",
                         notes)
    print(notes)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
