"""MetaDist's rank program compiled by Inductor (``backend="inductor"``) against eager torch, ``torch.compile``
of the same step, DDP over a compiled model and FSDP2 with compile.

    python -m benchmarks.compiled_step [--quick] [--part single,ranks] [--models gpt2,llama] [--nproc 4]

``single`` (world size 1, one process, one thread): the user's eager step, ``torch.compile(step)``, MetaDist
with the eager rank program and MetaDist with the Inductor-compiled one, timed in interleaved rounds (a
Williams order, benchmarks._common.interleaved) after warm-up. It runs in two processes one after the
other, sharing one fresh Inductor cache directory: the first compiles cold, the second finds what the first
left (the warm compile seconds). ``ranks`` (4 gloo ranks, one thread each): MetaDist (eager and inductor,
the planner's own plan), DDP over ``model.compile()``, and FSDP2 (``fully_shard`` per block) over
``model.compile()``, interleaved the same way. MetaDist(inductor) runs by default with Inductor's
``sink_waits`` pass (each wait where the lowering put it, :data:`metadist_torch.lower.compiled.SINK_WAITS`); it
is also timed without it (``waits_early``: Inductor waits right after each collective) and with all three of
Inductor's overlap passes (``OVERLAP``). Every MetaDist row carries the cost model's prediction for its
plan (``predicted_ms``, priced for the backend it runs), its compile seconds, dynamo's graph breaks and the
kernels Inductor generated. Results: results/compiled_step.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import RESULTS, interleaved, plot_predicted, write_results
from benchmarks._launch import add_worker_args, finish, launch, write_gathered
from benchmarks._models import adamw, gpt2, llama_of, lm_step, tokens

NAME = "compiled_step"
# all of Inductor's passes that move collectives, their waits and computation for overlap
OVERLAP = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"],
}
REPO = Path(__file__).resolve().parents[1]


def model(name: str, quick: bool, steps: int, device: str = "cpu"):
    """(build() -> (module, optimizer), batches, blocks(module), description) of benchmark model ``name``."""
    if name == "gpt2":
        layers, width, seq, vocab, batch = (2, 64, 32, 256, 4) if quick else (4, 256, 128, 1024, 8)

        def build():
            m = gpt2(n_positions=seq, n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab)
            return m, adamw(m, 1e-4)

        blocks, desc = (lambda m: list(m.transformer.h)), f"GPT-2 (transformers) {layers}x{width}"
    else:
        layers, width, seq, vocab, batch = (1, 64, 32, 256, 4) if quick else (4, 256, 128, 1024, 8)

        def build():
            m = llama_of(layers, width, seq, vocab)
            return m, adamw(m, 1e-4)

        blocks, desc = (lambda m: list(m.model.layers)), f"LLaMA-style (LlamaConfig) {layers}x{width}"
    batches = [(b.to(device),) for b in tokens(vocab, batch, seq, steps)]
    if device != "cpu":
        on_cpu = build

        def build():
            m, _ = on_cpu()
            m = m.to(device)
            return m, adamw(m, 1e-4)

    return build, batches, blocks, f"{desc} seq {seq} batch {batch}"


def _predicted(step) -> dict:
    """The cost model's step time for the plan the compiled step runs (only where this process planned)."""
    from metadist_core.plan.overlap import predict

    if step.problem is None:
        return {}
    pr = predict(step.plan, step.problem)
    return {"predicted_ms": pr.step * 1e3, "comm_bytes_predicted": pr.comm_bytes}


def _metadist(build, batches, backend: str, cache_dir: str | None, options: dict | None = None):
    from metadist_torch import metadist_compile

    m, opt = build()
    step = metadist_compile(cache_dir=cache_dir, backend=backend, compile_options=options, measure_memory=False)(
        lm_step
    )
    t = time.perf_counter()
    step(m, opt, *batches[0])
    first = time.perf_counter() - t
    c = (step.plan.stats.compile or {}) if step.plan is not None else {}
    info = {
        "first_call_s": first,
        "compile_s": c.get("seconds"),
        "graph_breaks": c.get("graph_breaks"),
        "kernels": c.get("kernels"),
        **_predicted(step),
    }
    return (lambda i: step(m, opt, *batches[i % len(batches)])), info, step


def _torch_compiled(build, batches, options: dict | None = None):
    import torch

    m, opt = build()
    step = torch.compile(lm_step, **(options or {}))
    t = time.perf_counter()
    step(m, opt, *batches[0])
    return (lambda i: step(m, opt, *batches[i % len(batches)])), {"compile_s": time.perf_counter() - t}


def single(args) -> dict:
    """One process at world size 1: every system of the ``single`` part, per model."""
    import torch

    torch.set_num_threads(1)
    warmup, rounds = (2, 6) if args.quick else (3, 16)
    out: dict = {}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for name in args.models.split(","):
        build, batches, _, desc = model(name, args.quick, warmup + rounds + 1, args.device)
        m, opt = build()
        runs = {"eager": lambda i, m=m, opt=opt: lm_step(m, opt, *batches[i % len(batches)])}
        infos: dict = {"eager": {}}
        runs["torch.compile"], infos["torch.compile"] = _torch_compiled(build, batches)
        for backend in ("eager", "inductor"):
            runs[f"metadist_{backend}"], infos[f"metadist_{backend}"], _ = _metadist(
                build, batches, backend, args.cache_dir
            )
        if args.device == "cuda":  # CUDA graphs: the launch-bound step replayed as one graph
            graphs = {"mode": "reduce-overhead"}
            runs["torch.compile_cudagraphs"], infos["torch.compile_cudagraphs"] = _torch_compiled(
                build, batches, graphs
            )
            runs["metadist_inductor_cudagraphs"], infos["metadist_inductor_cudagraphs"], _ = _metadist(
                build, batches, "inductor", args.cache_dir, graphs
            )
        for run in runs.values():
            for i in range(warmup):
                run(i)
        sync()
        timed = {k: (lambda i, run=run: (run(i), sync())) for k, run in runs.items()}
        times = interleaved(timed, rounds, start=warmup)
        out[name] = {"desc": desc, **{k: {**infos[k], "times_s": times[k]} for k in runs}}
    return out


# -- 4 ranks ------------------------------------------------------------------------


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from metadist_torch.runtime.engine import ensure_process_group

    torch.set_num_threads(1)
    rank, world = ensure_process_group()
    warmup, rounds = (2, 6) if args.quick else (3, 12)
    res: dict = {}
    for name in args.models.split(","):
        build, batches, blocks, desc = model(name, args.quick, warmup + rounds + 1)
        per = batches[0][0].shape[0] // world
        local = [(b[0][rank * per : (rank + 1) * per],) for b in batches]
        runs, infos = {}, {}
        for label, backend, options in (
            ("metadist_eager", "eager", None),
            ("metadist_inductor", "inductor", None),
            ("metadist_inductor_waits_early", "inductor", {"options": {"reorder_for_compute_comm_overlap": False}}),
            ("metadist_inductor_overlap", "inductor", {"options": OVERLAP}),
        ):
            runs[label], infos[label], _ = _metadist(build, batches, backend, args.cache_dir, options)
            dist.barrier()

        def ddp():
            from torch.nn.parallel import DistributedDataParallel as DDP

            m, opt = build()
            m.compile()
            d = DDP(m)
            return lambda i: lm_step(d, opt, *local[i % len(local)])

        def fsdp2():
            from torch.distributed.fsdp import fully_shard

            m, _ = build()
            for blk in blocks(m):
                fully_shard(blk)
            fully_shard(m)
            m.compile()
            opt = adamw(m, 1e-4)
            return lambda i: lm_step(m, opt, *local[i % len(local)])

        for label, make in (("ddp_compiled", ddp), ("fsdp2_compiled", fsdp2)):
            t = time.perf_counter()
            runs[label] = make()
            runs[label](0)
            infos[label] = {"compile_s": time.perf_counter() - t}
            dist.barrier()
        for run in runs.values():
            for i in range(warmup):
                run(i)
        times = interleaved(runs, rounds, start=warmup, before=dist.barrier)
        res[name] = {"desc": desc, **{k: {**infos[k], "times_s": times[k]} for k in runs}}
    write_gathered(args.out, res)
    return 0


# -- the launcher -------------------------------------------------------------------


def _single_process(args, cache: str, label: str) -> dict:
    """The ``single`` part in a fresh process whose Inductor cache is ``cache``."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "single.json"
        cmd = [sys.executable, "-m", "benchmarks.compiled_step", "--single-worker", "--out", str(out)]
        cmd += ["--models", args.models, "--device", args.device] + (["--quick"] if args.quick else [])
        cmd += ["--cache-dir", args.cache_dir] if args.cache_dir else []
        env = dict(os.environ, OMP_NUM_THREADS="1", METADIST_PROGRESS="0", TORCHINDUCTOR_CACHE_DIR=cache)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        print(f"[compiled_step] world size 1, {label} Inductor cache ...", flush=True)
        subprocess.run(cmd, env=env, cwd=REPO, check=True)
        got = json.loads(out.read_text())
        for name, systems in got.items():  # printed at once: a later pass that is cut short loses nothing
            for system, rec in systems.items():
                if isinstance(rec, dict) and rec.get("times_s"):
                    ms = statistics.median(rec["times_s"]) * 1e3
                    print(f"  {name:8s} {system:30s} {ms:9.2f} ms  compile {rec.get('compile_s') or 0:6.1f} s")
        return got


def _rows(part: str, data: dict, warm: dict | None = None) -> list[dict]:
    rows = []
    for name, systems in data.items():
        desc = systems.pop("desc")
        base = statistics.median(systems["eager"]["times_s"]) if "eager" in systems else None
        tc = statistics.median(systems["torch.compile"]["times_s"]) if "torch.compile" in systems else None
        for system, rec in systems.items():
            step = statistics.median(rec["times_s"])
            row = {
                "part": part,
                "model": name,
                "desc": desc,
                "system": system,
                "step_ms": step * 1e3,
                "spread_ms": (max(rec["times_s"]) - min(rec["times_s"])) * 1e3,
                "vs_eager": step / base if base else None,
                "vs_torch_compile": step / tc if tc else None,
                **{k: v for k, v in rec.items() if k != "times_s"},
                "times_ms": [t * 1e3 for t in rec["times_s"]],
            }
            if warm is not None:
                row["compile_warm_s"] = warm.get(name, {}).get(system, {}).get("compile_s")
            rows.append(row)
    return rows


def _rank_rows(got: list) -> list[dict]:
    """Rank medians of the 4-rank part: each round's slowest rank is the step."""
    rows = []
    first = got[0]
    for name in first:
        systems = {k: v for k, v in first[name].items() if k != "desc"}
        merged = {"desc": first[name]["desc"]}
        for system in systems:
            per_round = list(zip(*[r[name][system]["times_s"] for r in got]))
            merged[system] = {**first[name][system], "times_s": [max(ts) for ts in per_round]}
        rows += _rows("4 ranks", {name: merged})
    best = {}
    for r in rows:
        if r["system"] in ("ddp_compiled", "fsdp2_compiled"):
            best[r["model"]] = min(best.get(r["model"], float("inf")), r["step_ms"])
    for r in rows:
        r["vs_best_hand"] = r["step_ms"] / best[r["model"]] if r["model"] in best else None
        r.pop("vs_eager", None)
        r.pop("vs_torch_compile", None)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small models, few rounds (a check that it runs)")
    p.add_argument("--part", default="single,ranks", help="single, ranks or both (comma-separated)")
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--rank-models", default="gpt2", help="the models of the 4-rank part")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the world-size-1 part on one GPU")
    p.add_argument("--name", default=NAME, help="results/NAME.{json,md,png}")
    p.add_argument(
        "--no-warm", dest="warm", action="store_false", help="skip the second, warm-cache process (compile_warm_s)"
    )
    p.add_argument("--single-worker", action="store_true", help=argparse.SUPPRESS)
    add_worker_args(p, cache=True)
    args = p.parse_args(argv)
    if args.single_worker:
        Path(args.out).write_text(json.dumps(single(args)))
        return 0
    if args.worker:
        finish(worker(args))
    parts = args.part.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as cache:
        if "single" in parts:
            cold = _single_process(args, cache, "a cold")
            warm = _single_process(args, cache, "the first run's") if args.warm else None
            rows += _rows("world size 1", cold, warm)
        if "ranks" in parts:  # an Inductor cache of its own, so that its compile seconds are cold too
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache) / "ranks")
            extra = ["--models", args.rank_models] + (["--quick"] if args.quick else [])
            got = launch(__file__, args.nproc, extra, timeout=5400, cache=True)
            if got is None:
                return 1
            rows += _rank_rows(got.data)
    if args.quick:
        print(json.dumps([{k: v for k, v in r.items() if k != "times_ms"} for r in rows], indent=1, default=str))
        return 0
    cols = [
        "part",
        "model",
        "system",
        "step_ms",
        "spread_ms",
        "vs_eager",
        "vs_torch_compile",
        "vs_best_hand",
        "predicted_ms",
        "compile_s",
        "compile_warm_s",
        "graph_breaks",
        "kernels",
    ]
    notes = (
        "Medians of interleaved rounds (one step of every system per round, Williams order); spread: slowest "
        "minus fastest round. 4 ranks: each round's slowest rank. compile_s: the first call (torch.compile, "
        "DDP and FSDP2: the whole first step; MetaDist: its program's compile and first run, planning apart); "
        "compile_warm_s: the same in a second process that finds the first one's Inductor cache."
    )
    kept = RESULTS / f"{args.name}.json"  # the rows of the parts not run this time stay as they were
    if kept.exists():
        ran = {r["part"] for r in rows}
        rows = [r for r in json.loads(kept.read_text()) if r.get("part") not in ran] + rows
    write_results(args.name, rows, cols, f"The rank program compiled by Inductor ({args.device})", notes)
    plot_predicted(rows, RESULTS / f"{args.name}.png", args.name, lambda r: f"{r['model']} {r['system']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
