"""The deepest GPT-2 that trains in a per-device memory budget: MetaDist, FSDP2, FSDP2 + checkpointing.

    python -m benchmarks.memory [--quick] [--budget-mb 48] [--nproc 4]

transformers' GPT-2 (width 256, built from a config) on 4 gloo ranks, one thread each. For each system
the depth is searched by doubling, then bisection: a depth *trains* when every rank's measured peak
tensor memory over one training step stays within the budget (and, for MetaDist, when it compiles with
``memory_budget=`` the budget: under a budget no plan meets it says so). Systems:

- ``metadist``: ``metadist_compile(memory_budget=budget)`` (strategy auto; whatever the solver does to
  fit -- sharding, and recomputation where the solver offers it -- is what is measured);
- ``fsdp2``: ``fully_shard`` on every block and the model;
- ``fsdp2_ckpt``: the same with ``torch.utils.checkpoint`` on every block
  (``gradient_checkpointing_enable(use_reentrant=False)``).

After the searches MetaDist and FSDP2 + checkpointing run again side by side at FSDP2 + checkpointing's
depth (when it fits MetaDist's budget), both built first and timed interleaved, one step of each per round
(``--rounds``), so the step times compare at one depth under the same machine load (``equal_depth`` in
the metadist record: each median and the median of the per-round ratio).

Memory is measured the same way for all (:func:`metadist_torch.measure.memory.measure_peak`: live tensor
storages on CPU, the CUDA allocator's peak on a GPU); MetaDist's prediction (``step.memory``'s
``predicted_peak_bytes``: the plan's peak with its collectives' buffers; ``predicted_solver_mb``: the
solver's own figure, ``plan.memory_per_device``) is printed beside its measurement. Records: results/memory.json (``system``, ``budget_mb``,
``max_layers``, ``step_ms``, ``predicted_peak_mb``, ``measured_peak_mb``, and the probes), .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._launch import add_worker_args, finish, launch, write_rank0
from benchmarks._models import adamw, gpt2, lm_step as _step, tokens

NAME = "memory"
SYSTEMS = ("metadist", "fsdp2", "fsdp2_ckpt")
MB = 2**20


def _shape(quick: bool) -> dict:
    # width 256 as the issue asks; sequence and batch small enough for 2 cores, large enough that
    # activations weigh against the state (what checkpointing and recomputation trade)
    return dict(width=256, heads=4, vocab=512, seq=64, batch=8, steps=3 if quick else 5, cap=8 if quick else 24)


def _build(layers: int, sh: dict):
    m = gpt2(n_positions=sh["seq"], n_layer=layers, n_embd=sh["width"], n_head=sh["heads"], vocab_size=sh["vocab"])
    return m, adamw(m, 1e-4)


def _batches(sh: dict):
    return tokens(sh["vocab"], sh["batch"], sh["seq"], sh["steps"] + 1)


def _local(batches: list, rank: int, world: int) -> list:
    """This rank's slice of every batch (what FSDP2's ranks each read)."""
    per = batches[0].shape[0] // world
    return [b[rank * per : (rank + 1) * per] for b in batches]


def _median_ms(fn, batches) -> float:
    import torch.distributed as dist

    ts = []
    for b in batches:
        dist.barrier()
        t = time.perf_counter()
        fn(b)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[1:] or ts) * 1e3


def _run_metadist(layers: int, sh: dict, budget: int, cache: str) -> dict:
    from metadist_torch import metadist_compile

    model, opt = _build(layers, sh)
    ids = _batches(sh)
    step = metadist_compile(memory_budget=budget, cache_dir=cache)(_step)
    step(model, opt, ids[0])  # compile, then the first call is measured (step.memory)
    mem = step.memory
    ms = _median_ms(lambda b: step(model, opt, b), ids[1:])
    plan = step.plan
    pred = None
    if plan.problem is not None:  # rank 0 holds the problem: the cost model's step time for this plan
        from metadist_core.plan.overlap import predict

        pred = predict(plan).step * 1e3
    return {
        "measured_peak": mem["measured_peak_bytes"],
        "predicted_peak": mem["predicted_peak_bytes"],
        "predicted_solver_mb": plan.memory_per_device / MB,
        "step_ms": ms,
        "predicted_step_ms": pred,
        "method": mem["method"],
        "plan": plan.summary(),
        "recompute": len(getattr(plan, "recompute", []) or []),
        # who chose the recomputed segments (the ILP with the shardings, or the search over counts), and
        # the planning seconds (trace, discover, build, solve) on this rank
        "recompute_chosen_by": (plan.stats.recompute or {}).get("chosen_by"),
        "plan_s": sum(
            v
            for k, v in (getattr(step, "timings", None) or {}).items()
            if k in ("trace", "discover", "build_problem", "solve")
        ),
    }


def _fsdp2_model(layers: int, sh: dict, ckpt: bool):
    """transformers' GPT-2 with ``fully_shard`` on every block and the model (and checkpointing on every block)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model, _ = _build(layers, sh)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for blk in model.transformer.h:
        fully_shard(blk)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _run_fsdp2(layers: int, sh: dict, ckpt: bool, rank: int, world: int) -> dict:
    from metadist_torch.measure.memory import measure_peak, state_tensors

    model, opt = _fsdp2_model(layers, sh, ckpt)
    ids = _local(_batches(sh), rank, world)
    _step(model, opt, ids[0])  # the optimizer state exists from here on, as in MetaDist's traced step
    _, m = measure_peak(lambda: _step(model, opt, ids[1]), state_tensors(model, opt) + [ids[1]])
    ms = _median_ms(lambda b: _step(model, opt, b), ids[1:])
    return {"measured_peak": m.peak_bytes, "predicted_peak": None, "step_ms": ms, "method": m.method}


def _equal_depth(layers: int, sh: dict, budget: int, args, rank: int, world: int) -> dict:
    """MetaDist (under the budget) and FSDP2 + checkpointing at one depth, both built first, then timed in
    ``args.rounds`` rounds of one step each, in alternating order, so that the shared machine's slow spells
    fall on both alike (timed one system after the other, the ratio moved from 0.76x to 1.15x between runs
    of one plan). Returns each system's median step (slowest rank) and the median over rounds of
    MetaDist's step over FSDP2 + checkpointing's in the same round (median over ranks)."""
    import torch.distributed as dist
    from benchmarks._common import interleaved
    from metadist_torch import metadist_compile

    ids = _batches(sh)
    model, opt = _build(layers, sh)
    step = metadist_compile(memory_budget=budget, cache_dir=args.cache_dir)(_step)
    step(model, opt, ids[0])
    ck_model, ck_opt = _fsdp2_model(layers, sh, True)
    local = _local(ids, rank, world)
    runs = {
        "metadist": lambda i: step(model, opt, ids[i % len(ids)]),
        "fsdp2_ckpt": lambda i: _step(ck_model, ck_opt, local[i % len(local)]),
    }
    for i in range(2):  # warm-up
        for run in runs.values():
            run(i)
    times = interleaved(runs, args.rounds, before=dist.barrier)
    mine = {
        "metadist_ms": statistics.median(times["metadist"]) * 1e3,
        "fsdp2_ckpt_ms": statistics.median(times["fsdp2_ckpt"]) * 1e3,
        "ratio": statistics.median(a / b for a, b in zip(times["metadist"], times["fsdp2_ckpt"])),
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {
        "layers": layers,
        "rounds": args.rounds,
        "timing": "interleaved",
        "metadist_ms": max(e["metadist_ms"] for e in every),
        "fsdp2_ckpt_ms": max(e["fsdp2_ckpt_ms"] for e in every),
        "ratio_by_round": statistics.median(e["ratio"] for e in every),
        "plan": step.plan.summary(),
        "recompute": len(getattr(step.plan, "recompute", []) or []),
    }


def _probe(system: str, layers: int, sh: dict, budget: int, args, rank: int, world: int) -> dict:
    """One depth on every rank: the figures (worst rank's peak), ``fits`` agreed by all ranks."""
    import gc
    import torch
    import torch.distributed as dist

    gc.collect()
    try:
        if system == "metadist":
            r = _run_metadist(layers, sh, budget, args.cache_dir)
        else:
            r = _run_fsdp2(layers, sh, system == "fsdp2_ckpt", rank, world)
        err = ""
    except Exception as e:  # no plan meets the budget, or the step failed: this depth does not train
        r, err = {}, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    flags = torch.tensor([0.0 if err else 1.0, float(r.get("measured_peak", 0)), r.get("step_ms", 0.0)])
    lo = flags.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    ok = bool(lo[0] > 0)
    peak = int(flags[1])
    out = {
        "layers": layers,
        "fits": ok and peak <= budget,
        "measured_peak_mb": peak / MB if ok else None,
        "step_ms": float(flags[2]) if ok else None,
        "error": err or None,
    }
    if r.get("predicted_peak") is not None:
        out["predicted_peak_mb"] = r["predicted_peak"] / MB
    for k in (
        "plan",
        "recompute",
        "method",
        "predicted_solver_mb",
        "predicted_step_ms",
        "recompute_chosen_by",
        "plan_s",
    ):
        if r.get(k) is not None:
            out[k] = r[k]
    if rank == 0:
        print(
            f"  {system:<11} {layers:>3} layers: "
            + (
                f"peak {out['measured_peak_mb']:.1f} MiB (budget {budget / MB:.0f}), "
                f"predicted {out.get('predicted_peak_mb') or float('nan'):.1f}, {out['step_ms']:.0f} ms"
                + (f" (predicted {out['predicted_step_ms']:.0f} ms)" if out.get("predicted_step_ms") else "")
                + (
                    f", {out['recompute']} ops recomputed ({out['recompute_chosen_by']})"
                    if out.get("recompute")
                    else ""
                )
                + (f", planned in {out['plan_s']:.1f} s" if out.get("plan_s") else "")
                if ok
                else f"failed: {err}"
            )
            + (" fits" if out["fits"] else ""),
            flush=True,
        )
    return out


def search(system: str, sh: dict, budget: int, args, rank: int, world: int) -> dict:
    """Doubling, then bisection, over the depth: the deepest probe that fits and every probe made."""
    probes: dict[int, dict] = {}

    def fits(n: int) -> bool:
        if n not in probes:
            probes[n] = _probe(system, n, sh, budget, args, rank, world)
        return probes[n]["fits"]

    lo, hi = 0, None
    n = 1
    while n <= sh["cap"]:
        if fits(n):
            lo, n = n, n * 2
        else:
            hi = n
            break
    if hi is None:  # every doubling up to the cap fits: bisect between the last one and the cap
        hi = sh["cap"] + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    best = probes.get(lo, {"layers": 0})
    return {"best": best, "probes": [probes[k] for k in sorted(probes)]}


def worker(args) -> int:
    import torch
    from metadist_torch.runtime.engine import ensure_process_group

    torch.set_num_threads(1)
    rank, world = ensure_process_group()
    sh = _shape(args.quick)
    budget = int(args.budget_mb * MB)
    res = {}
    for system in args.systems.split(","):
        t = time.perf_counter()
        res[system] = search(system, sh, budget, args, rank, world)
        res[system]["search_s"] = time.perf_counter() - t
    if "metadist" in res and "fsdp2_ckpt" in res:  # the step times at one depth: FSDP2 + checkpointing's
        depth = res["fsdp2_ckpt"]["best"]["layers"]
        if depth and depth <= res["metadist"]["best"]["layers"]:
            res["equal_depth"] = _equal_depth(depth, sh, budget, args, rank, world)
            if rank == 0:
                e = res["equal_depth"]
                print(
                    f"  equal depth {depth} layers: metadist {e['metadist_ms']:.0f} ms, fsdp2_ckpt "
                    f"{e['fsdp2_ckpt_ms']:.0f} ms, {e['ratio_by_round']:.2f}x by round",
                    flush=True,
                )
    write_rank0(args.out, {"shape": sh, "world": world, "results": res})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer timed steps, depths up to 8")
    ap.add_argument("--budget-mb", type=float, default=None, help="bytes per device, in MiB (default 48; quick 40)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds timed at equal depth, one step of each system per round (default 8; quick 4)",
    )
    add_worker_args(ap, cache=True)
    args = ap.parse_args(argv)
    if args.budget_mb is None:
        args.budget_mb = 40.0 if args.quick else 48.0
    if args.rounds is None:
        args.rounds = 4 if args.quick else 8
    if args.worker:
        finish(worker(args))

    from benchmarks._common import write_results

    t_all = time.perf_counter()
    got = launch(
        __file__,
        args.nproc,
        ["--budget-mb", str(args.budget_mb), "--systems", args.systems, "--rounds", str(args.rounds)]
        + (["--quick"] if args.quick else []),
        timeout=5400,
        cache=True,
        show=lambda line: "layers:" in line,
    )
    if got is None:
        return 1
    data = got.data
    sh = data["shape"]
    desc = (
        f"GPT-2 (transformers) width {sh['width']} heads {sh['heads']} vocab {sh['vocab']} seq {sh['seq']} "
        f"batch {sh['batch']}, {data['world']} gloo ranks"
    )
    records = []
    equal = data["results"].pop("equal_depth", None)
    for system, r in data["results"].items():
        b = r["best"]
        records.append(
            {
                "benchmark": NAME,
                "model": desc,
                "system": system,
                "budget_mb": args.budget_mb,
                "max_layers": b["layers"],
                "step_ms": b.get("step_ms"),
                "predicted_step_ms": b.get("predicted_step_ms"),
                "predicted_peak_mb": b.get("predicted_peak_mb"),
                "measured_peak_mb": b.get("measured_peak_mb"),
                "predicted_solver_mb": b.get("predicted_solver_mb"),
                "recomputed_ops": b.get("recompute"),
                "measured_over_predicted": (
                    b["measured_peak_mb"] / b["predicted_peak_mb"]
                    if b.get("predicted_peak_mb") and b.get("measured_peak_mb")
                    else None
                ),
                "plan": b.get("plan"),
                "search_s": r["search_s"],
                "probes": r["probes"],
                "quick": args.quick,
                **({"equal_depth": equal} if equal and system == "metadist" else {}),
            }
        )
    ref = {r["system"]: r for r in records}
    notes = [
        f"{desc}. Budget {args.budget_mb:g} MiB per device; depth searched by doubling then bisection "
        f"(up to {sh['cap']} layers); a depth fits when every rank's measured peak is within the budget. "
        f"step_ms: median over the timed steps, slowest rank. Total {time.perf_counter() - t_all:.0f} s."
    ]
    if (
        "metadist" in ref
        and "fsdp2_ckpt" in ref
        and ref["fsdp2_ckpt"].get("step_ms")
        and ref["metadist"].get("step_ms")
    ):
        md, ck = ref["metadist"], ref["fsdp2_ckpt"]
        notes.append(
            f"MetaDist {md['max_layers']} layers vs FSDP2+checkpointing {ck['max_layers']}; step time "
            f"ratio at each system's own depth {md['step_ms'] / ck['step_ms']:.2f}x."
        )
    if equal and equal.get("metadist_ms") and equal.get("fsdp2_ckpt_ms"):
        notes.append(
            f"At FSDP2+checkpointing's depth ({equal['layers']} layers), both timed interleaved in "
            f"{equal['rounds']} rounds: MetaDist {equal['metadist_ms']:.0f} ms, "
            f"FSDP2+checkpointing {equal['fsdp2_ckpt_ms']:.0f} ms (medians, slowest rank; "
            f"{equal['ratio_by_round']:.2f}x by round)."
        )
    if "metadist" in ref and "fsdp2_ckpt" in ref:  # the step times at every depth both ran (fitting or not)
        ck = {p["layers"]: p for p in ref["fsdp2_ckpt"]["probes"] if p.get("step_ms")}
        rows = [
            (p["layers"], p["step_ms"], ck[p["layers"]]["step_ms"])
            for p in sorted(ref["metadist"]["probes"], key=lambda p: p["layers"])
            if p.get("step_ms") and p["layers"] in ck
        ]
        ref["metadist"]["vs_fsdp2_ckpt_by_depth"] = [
            {"layers": n, "metadist_ms": a, "fsdp2_ckpt_ms": b, "ratio": a / b} for n, a, b in rows
        ]
        if rows:
            notes.append(
                "MetaDist / FSDP2+checkpointing step time at the depths both ran: "
                + ", ".join(f"{n} layers {a:.0f}/{b:.0f} ms = {a / b:.2f}x" for n, a, b in rows)
                + "."
            )
    for r in records:  # every probe: predicted beside measured
        for p in r["probes"]:
            if p.get("predicted_peak_mb") and p.get("measured_peak_mb"):
                notes.append(
                    f"{r['system']} {p['layers']} layers: predicted {p['predicted_peak_mb']:.1f} MiB, "
                    f"measured {p['measured_peak_mb']:.1f} MiB "
                    f"({p['measured_peak_mb'] / p['predicted_peak_mb']:.2f}x)"
                    + (
                        f"; step predicted {p['predicted_step_ms']:.0f} ms, measured {p['step_ms']:.0f} ms "
                        f"({p['step_ms'] / p['predicted_step_ms']:.2f}x)"
                        if p.get("predicted_step_ms") and p.get("step_ms")
                        else ""
                    )
                )
    path = write_results(
        NAME,
        records,
        [
            "system",
            "budget_mb",
            "max_layers",
            "step_ms",
            "predicted_peak_mb",
            "measured_peak_mb",
            "measured_over_predicted",
        ],
        "Deepest GPT-2 in a memory budget",
        "\n\n".join(notes),
    )
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
