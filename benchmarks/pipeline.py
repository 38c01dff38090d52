"""Pipeline parallelism side by side: no pipeline, 2 stages x 2, 4 stages; GPipe against 1F1B; 1-8 micro-batches.

    python -m benchmarks.pipeline [--quick] [--nproc 4]

transformers' GPT-2 (8 layers, width 256; --quick: 4 layers, width 64) with
AdamW on 4 gloo ranks, one launch, one thread per rank. Systems: ``none``
(``pipeline_stages=1`` on mesh (4,), the batch cut into m micro-batches with
gradient accumulation), ``pp2x2`` (``pipeline_stages=2`` on mesh (2, 2): two
stages, each split two ways by its own plan) and ``pp4`` (``pipeline_stages=4``
on mesh (4,)), each with schedules GPipe and 1F1B and m micro-batches. For
every run: the median step time after warm-up (the slowest rank), the peak
tensor memory of the first call (``step.memory``: live tensor storages, the
largest rank) and the peak RSS during the timed steps (VmHWM reset through
/proc/self/clear_refs where the kernel allows), the cost model's step time and
bytes per device beside them,
and the measured bubble -- the share of the step a rank's stage is not
computing (time outside ``forward_one_chunk``/``backward_one_chunk``, mean over
ranks) -- against the schedule's ``(p-1)/(m+p-1)``. Results:
results/pipeline.json and results/pipeline.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._launch import add_worker_args, finish, launch, write_gathered
from benchmarks._models import adamw, gpt2, lm_step as _step, tokens

NAME = "pipeline"


def _model(quick: bool):
    layers, width = (4, 64) if quick else (8, 256)
    model = gpt2(vocab_size=256, n_positions=64, n_embd=width, n_layer=layers, n_head=4)
    return model, adamw(model, 1e-3), f"GPT-2 {layers} layers, width {width}"


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _busy_timer(runnable):
    """Wrap the pipeline stages' forward/backward chunks of ``runnable`` to add up their seconds."""
    box = {"s": 0.0}
    sched = getattr(runnable, "sched", None)
    if sched is None:
        return box
    stages = getattr(sched, "_stages", None) or [sched._stage]
    for st in stages:
        for meth in ("forward_one_chunk", "backward_one_chunk"):
            f = getattr(st, meth)

            def wrapped(*a, _f=f, **k):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    box["s"] += time.perf_counter() - t0

            setattr(st, meth, wrapped)
    return box


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from metadist_torch import metadist_compile

    torch.set_num_threads(1)
    quick = args.quick
    ms = [1, 4] if quick else [1, 2, 4, 8]
    batch, seq = 8, 32 if quick else 64
    steps, warm = (2, 1) if quick else (4, 1)
    systems = [("none", (4,), 1, ["-"]), ("pp2x2", (2, 2), 2, ["gpipe", "1f1b"]), ("pp4", (4,), 4, ["gpipe", "1f1b"])]
    rows = []
    for system, mesh, k, schedules in systems:
        for sched in schedules:
            for m in ms:
                if sched == "1f1b" and m < k:  # torch's 1F1B needs m >= p (a clear error from metadist)
                    continue
                model, opt, desc = _model(quick)
                kw = dict(mesh=mesh, pipeline_stages=k, micro_batches=m)
                if sched != "-":
                    kw["schedule"] = sched
                step = metadist_compile(**kw)(_step)
                ids = tokens(256, batch, seq, steps + warm)
                rec = {
                    "system": system,
                    "schedule": sched,
                    "micro_batches": m,
                    "mesh": "x".join(map(str, mesh)),
                    "model": desc,
                }
                try:
                    for i in range(warm):
                        step(model, opt, ids[i])
                    busy = _busy_timer(step.runnable)
                    _reset_peak()
                    ts = []
                    for i in range(warm, warm + steps):
                        dist.barrier()
                        t0 = time.perf_counter()
                        step(model, opt, ids[i])
                        ts.append(time.perf_counter() - t0)
                    plan = step.plan
                    pl = plan.stats.pipeline
                    measured = (step.memory or {}).get("measured_peak_bytes")  # the first call, tensor bytes
                    rec.update(
                        step_s=statistics.median(ts),
                        peak_rss=_peak(),
                        busy_s=busy["s"] / steps,
                        measured_peak=measured,
                        predicted_s=pl["step_time"] if pl else m * plan.objective,
                        predicted_bytes=max(s.memory for s in plan.stages) if plan.stages else plan.memory_per_device,
                        bubble_model=pl["bubble"] if pl else 0.0,
                        stages=len(plan.stages),
                    )
                except Exception as e:  # pragma: no cover - recorded, the table shows it
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(rec)
                if dist.get_rank() == 0:
                    print(f"[pipeline] {rec}", file=sys.stderr, flush=True)
    write_gathered(args.out, rows)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model, micro-batches 1 and 4, fewer steps")
    ap.add_argument("--nproc", type=int, default=4)
    add_worker_args(ap)
    args = ap.parse_args(argv)
    if args.worker:
        finish(worker(args))
    from benchmarks._common import write_results

    # no cache=True: the user's rule cache, discovery once per machine
    got = launch(__file__, args.nproc, ["--quick"] if args.quick else [], timeout=3000)
    if got is None:
        return 1
    ranks = got.data
    records = []
    for j, r0 in enumerate(ranks[0]):
        per = [r[j] for r in ranks]
        rec = {"benchmark": NAME, **{k: r0[k] for k in ("model", "system", "mesh", "schedule", "micro_batches")}}
        if any("error" in p for p in per):
            rec["error"] = next(p["error"] for p in per if "error" in p)
            records.append(rec)
            continue
        step_s = max(p["step_s"] for p in per)
        busy = statistics.mean(p["busy_s"] for p in per)
        p_, m = {"none": 1, "pp2x2": 2, "pp4": 4}[r0["system"]], r0["micro_batches"]
        rec.update(
            step_ms=step_s * 1e3,
            predicted_ms=r0["predicted_s"] * 1e3,
            peak_rss_mb=max(p["peak_rss"] for p in per) / 2**20,
            predicted_mb=r0["predicted_bytes"] / 2**20,
            measured_peak_mb=(
                max(p["measured_peak"] for p in per) / 2**20 if all(p.get("measured_peak") for p in per) else None
            ),
            bubble_measured=(1 - busy / step_s) if r0["stages"] else 0.0,
            bubble_model=(p_ - 1) / (m + p_ - 1),
        )
        records.append(rec)
    cols = [
        "system",
        "mesh",
        "schedule",
        "micro_batches",
        "step_ms",
        "predicted_ms",
        "measured_peak_mb",
        "predicted_mb",
        "peak_rss_mb",
        "bubble_measured",
        "bubble_model",
        "error",
    ]
    path = write_results(
        NAME,
        records,
        cols,
        "Pipeline parallelism: GPT-2 on 4 gloo ranks",
        notes=f"{records[0].get('model', '')}; step_ms: median of the slowest rank; predicted_ms: "
        "the cost model (pipelines: (m+p-1) x the slowest stage; none: m x the micro-batch "
        "plan); bubble_measured: share of the step a stage is not in forward/backward "
        "chunks (mean over ranks; it includes the optimizer update and the state "
        "broadcast); bubble_model: (p-1)/(m+p-1).",
    )
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
