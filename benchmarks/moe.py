"""Mixture-of-experts training: MetaDist's expert parallelism against DDP, with the plan's figures beside each.

    python -m benchmarks.moe [--quick] [--nproc 4] [--rounds N]

Model: transformers' ``MixtralForCausalLM`` from a ``MixtralConfig`` made in code (nothing downloaded):
hidden 256, intermediate 384, 2 layers, 4 heads of which 2 key/value heads, 8 experts, top-2 routing,
vocab 512, sequence 64, global batch 16 (``--quick``: hidden 64, intermediate 96, 4 experts, batch 8,
sequence 16). The experts run transformers' eager loop over the experts hit (``experts_implementation=
"eager"``); AdamW at 1e-4; token batches from seeded generators; the step is loss, backward, optimizer step,
gradients cleared (:func:`benchmarks._models.lm_step`).

Systems on 4 gloo ranks (one launch, one thread each): ``ddp`` (DistributedDataParallel over the eager model,
each rank a quarter of the batch), ``metadist_ep`` (``strategy="ep"`` on a mesh of 4: the experts split by
expert over the mesh, the rest data-parallel), ``metadist_auto`` (the solver plans freely), ``metadist_ep_2x2``
(ep on a 2 x 2 mesh: experts split over axis 0, replicated over axis 1) and ``metadist_ep_cf1`` (ep on 4 with
``moe_capacity_factor=1.0``, so that tokens past an expert's even share are dropped). A MetaDist step takes the
whole global batch on every rank and splits it itself; DDP's ranks each take their quarter. The meshes are
made once (DeviceMeshes of (4,) and (2, 2)) before anything compiles, as in :mod:`benchmarks.torch_step`.

Measured, per system:

- the first step's loss against a single-device eager step on the whole batch (the same seed and weights),
  relative difference, held to 1e-4 (reported, never raised); DDP's is the mean of its ranks' losses. The
  capacity-factor system drops tokens, so it differs from that reference by design: it is also compared with
  a single-device eager forward that runs MetaDist's own capacity-padded dispatch with the same groups and
  factor (:func:`metadist_torch.moe.moe.capacity_dispatch`), which it should match;
- the step time: every system built and warmed up, then timed in interleaved rounds, one step of each per
  round in a Williams order (:func:`benchmarks._common.interleaved`), so that the shared machine's slow spells
  fall on all of them alike; the median over ranks of each rank's median step, and the median over ranks of
  each rank's median, over rounds, of the step over DDP's step in the same round;
- MetaDist's prediction: the plan's objective (``plan.objective``, the solver's price of a step) and
  ``metadist_core.plan.overlap.predict`` of the plan (the overlap replay torch_step reports);
- bytes per rank per step: all_to_all, and every collective kind together, as the plan prices them (the sum
  of ``nbytes`` of the plan's non-free collectives, and that sum once per reshard the lowering runs,
  :func:`metadist_core.plan.overlap.priced_collectives`) against those counted at the compiled step's
  collectives (``step.comm_stats``, since compile, over the calls made since compile; also over the calls
  after the first, to tell a first call's extras apart); DDP's all_reduce bytes counted in a comm hook;
- for the ep systems, ``plan.explain()``'s "experts" lines (which ranks hold which experts);
- the tokens dropped: each layer's routing of the first batch (``top_k_index``, taken by a forward hook on
  every layer's ``mlp.gate``) counted by :func:`metadist_torch.moe.moe.dropped_tokens` with no capacity factor
  (MetaDist's default: none dropped) and with 1.0, for the groups of each mesh.

Results: results/moe.json (one record per system, rank medians) and results/moe.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

from benchmarks._launch import add_worker_args, finish, launch, write_gathered
from benchmarks._models import lm_step, tokens

NAME = "moe"
# how close a system's first-step loss must be to the single-device eager one (relative)
RTOL = 1e-4
LR = 1e-4


def _config(quick: bool) -> dict:
    """The model's shape."""
    if quick:
        return dict(hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, vocab=512)
    return dict(hidden=256, intermediate=384, layers=2, heads=4, kv_heads=2, experts=8, top_k=2, vocab=512)


def _batch_shape(quick: bool) -> tuple[int, int]:
    """(global batch, sequence)."""
    return (8, 16) if quick else (16, 64)


def build(c: dict, seq: int, seed: int = 0):
    """(MixtralForCausalLM, AdamW): the weights drawn after ``torch.manual_seed(seed)``, so two builds are equal."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = MixtralConfig(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        num_local_experts=c["experts"],
        num_experts_per_tok=c["top_k"],
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        experts_implementation="eager",  # transformers' own loop over the experts hit
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def describe(quick: bool) -> str:
    c, (b, s) = _config(quick), _batch_shape(quick)
    return (
        f"Mixtral (transformers) {c['layers']} layers hidden {c['hidden']} intermediate {c['intermediate']} "
        f"{c['heads']} heads / {c['kv_heads']} kv, {c['experts']} experts top-{c['top_k']}, vocab {c['vocab']}, "
        f"seq {s}, global batch {b}"
    )


def routes(model, ids) -> list:
    """Each layer's ``top_k_index`` [tokens, k] for ``ids``, as its router (``mlp.gate``) chose it."""
    import torch

    out: list = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, o: out.append(o[2].detach().clone()))
        for n, m in model.named_modules()
        if n.endswith("mlp.gate") and not isinstance(m, torch.nn.Linear)  # a router, not a dense gate projection
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return out


# -- the systems --------------------------------------------------------------------

# name -> (strategy, mesh shape, moe_capacity_factor)
METADIST = {
    "metadist_ep": ("ep", (4,), None),
    "metadist_auto": ("auto", (4,), None),
    "metadist_ep_2x2": ("ep", (2, 2), None),
    "metadist_ep_cf1": ("ep", (4,), 1.0),
}
SYSTEMS = ["ddp", *METADIST]

_MESHES: dict = {}


def device_mesh(shape: tuple[int, ...]):
    """The run's one DeviceMesh of ``shape``, shared by the systems on it (made once, before anything compiles:
    every gloo group a rank belongs to changes the others' speed, see benchmarks.torch_step.device_mesh)."""
    if shape not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        names = ("ep",) if len(shape) == 1 else ("ep", "dp")
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


class System:
    """A system built and warmed up: ``run(i)`` one step on batch ``i``; ``info`` what it says of itself;
    ``after()`` more, once the timing is done."""

    def __init__(self, run, info: dict, after):
        self.run, self.info, self.after = run, info, after


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _plan_figures(step) -> dict:
    """What the plan says of a step: bytes per rank by kind as priced, its objective, the overlap replay, and
    the experts lines of its explanation (on the rank that holds the plan's problem)."""
    plan = step.plan
    colls = [c for _, c in plan.collectives() if not c.is_free]
    by_kind: dict[str, int] = {}
    for c in colls:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + int(c.nbytes)
    info = {
        "plan": plan.summary(),
        "predicted_ms": plan.objective * 1e3,
        "predicted_compute_ms": plan.compute_seconds * 1e3,
        "predicted_comm_ms": plan.comm_seconds * 1e3,
        "a2a_bytes_predicted": by_kind.get("all_to_all", 0),
        "comm_bytes_predicted": sum(by_kind.values()),
        "comm_bytes_predicted_by_kind": by_kind,
        "collectives_predicted_by_kind": {k: sum(1 for c in colls if c.kind == k) for k in by_kind},
        "experts_storage": {
            plan.labels.get(v, v): str(s)
            for v, s in plan.input_shardings.items()
            if step.problem is not None and step.problem.vars.get(v, {}).get("experts")
        },
    }
    if step.problem is not None:  # only the planning rank holds the problem
        from metadist_core.plan.overlap import predict, priced_collectives

        if plan.problem is None:
            plan = dataclasses.replace(plan, problem=step.problem)
        priced: dict[str, int] = {}
        for _, c in priced_collectives(plan):
            priced[c.kind] = priced.get(c.kind, 0) + int(c.nbytes)
        pr = predict(plan, step.problem)
        text = plan.explain(presets=False)
        lines = text.splitlines()
        experts = []
        if "experts" in lines:
            for line in lines[lines.index("experts") + 1 :]:
                if not line.strip():
                    break
                experts.append(line.strip())
        info.update(
            {
                "has_problem": True,
                "a2a_bytes_priced": priced.get("all_to_all", 0),
                "comm_bytes_priced": sum(priced.values()),
                "comm_bytes_priced_by_kind": priced,
                "predicted_overlap_ms": pr.step * 1e3,
                "predicted_overlap_comm_bytes": pr.comm_bytes,
                "experts_lines": experts,
                "explain": text,
            }
        )
    return info


def build_systems(args, rank: int, world: int, batches: list, warmup: int, ref: dict) -> dict:
    """Every system, built, its first step's loss checked against the reference, warmed up by ``warmup`` steps;
    a system that fails to build is ``{"error": ...}``."""
    import torch
    import torch.distributed as dist

    c = _config(args.quick)
    seq = batches[0].shape[1]
    per = batches[0].shape[0] // world
    local = [b[rank * per : (rank + 1) * per] for b in batches]

    def warm(run):
        for i in range(1, warmup + 1):
            run(i)

    def ddp():
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        model, _ = build(c, seq)
        d = DDP(model)
        opt = torch.optim.AdamW(d.parameters(), lr=LR)
        counted = {"bytes": 0, "calls": 0, "steps": 0}

        def hook(state, bucket):
            counted["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
            counted["calls"] += 1
            return default_hooks.allreduce_hook(state, bucket)

        d.register_comm_hook(None, hook)

        def run(i):
            counted["steps"] += 1
            return lm_step(d, opt, local[i % len(local)])

        t0 = time.perf_counter()
        loss = run(0).detach()
        first = time.perf_counter() - t0
        mean = loss.clone()
        dist.all_reduce(mean)  # each rank's loss is its quarter's mean: the batch's is their mean
        loss0 = float(mean) / world
        info = {
            "first_call_s": first,
            "loss": loss0,
            "rank_loss": float(loss),
            "ref_loss": ref["loss"],
            "loss_rel_diff": _rel(loss0, ref["loss"]),
        }
        warm(run)
        start = dict(counted)

        def after():
            n = max(1, counted["steps"] - start["steps"])
            b = (counted["bytes"] - start["bytes"]) / n
            return {
                "comm_bytes_counted": b,
                "comm_bytes_counted_by_kind": {"all_reduce": b},
                "comm_calls_counted_by_kind": {"all_reduce": (counted["calls"] - start["calls"]) / n},
                "steps_counted": n,
            }

        return System(run, info, after)

    def metadist(strategy: str, shape: tuple[int, ...], factor: float | None):
        from metadist_torch import metadist_compile

        model, opt = build(c, seq)
        kw = {} if factor is None else {"moe_capacity_factor": factor}
        step = metadist_compile(mesh=device_mesh(shape), strategy=strategy, cache_dir=args.cache_dir, **kw)(lm_step)
        calls = [0]

        def run(i):
            calls[0] += 1
            return step(model, opt, batches[i % len(batches)])

        t0 = time.perf_counter()
        loss0 = float(run(0))
        first = time.perf_counter() - t0
        s = step.comm_stats
        after_first = (dict(s.bytes), dict(s.calls))
        want = ref["loss_cf1"] if factor is not None else ref["loss"]
        info = {
            "first_call_s": first,
            "compile": dict(step.timings or {}),
            "loss": loss0,
            "ref_loss": ref["loss"],
            "loss_rel_diff": _rel(loss0, ref["loss"]),
            "first_call_bytes_by_kind": after_first[0],
            **_plan_figures(step),
        }
        if factor is not None:  # against the same dropping, run on one device
            info.update({"ref_loss_dropping": want, "loss_rel_diff_dropping": _rel(loss0, want)})
        warm(run)

        def after():
            s = step.comm_stats
            n = calls[0]
            rest = max(1, n - 1)
            return {
                "calls_since_compile": n,
                # the brief's figure: counted since compile over the calls since compile
                "a2a_bytes_counted": s.bytes.get("all_to_all", 0) / n,
                "comm_bytes_counted": s.total / n,
                "comm_bytes_counted_by_kind": {k: v / n for k, v in s.bytes.items()},
                "comm_calls_counted_by_kind": {k: v / n for k, v in s.calls.items()},
                # the same over the calls after the first (what a first call adds, if anything, left out)
                "a2a_bytes_counted_after_first": (s.bytes.get("all_to_all", 0) - after_first[0].get("all_to_all", 0))
                / rest,
                "comm_bytes_counted_after_first": (s.total - sum(after_first[0].values())) / rest,
            }

        return System(run, info, after)

    makers = {"ddp": ddp, **{n: (lambda a=a: metadist(*a)) for n, a in METADIST.items()}}
    out: dict = {}
    for name, make in makers.items():
        gc.collect()
        try:
            out[name] = make()
        except Exception as e:  # say so, go on with the others
            import traceback

            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        if rank == 0:
            got = out[name]
            what = got["error"] if isinstance(got, dict) else f"loss rel. diff {got.info['loss_rel_diff']:.2e}"
            print(f"[moe] built {name}: {what}", flush=True)
        dist.barrier()
    return out


def reference(args, batch) -> dict:
    """The single-device eager first step on the whole batch; the same forward through MetaDist's capacity-padded
    dispatch on a mesh of 4, with no factor (it should give the eager loss) and at factor 1.0 (what
    metadist_ep_cf1 computes); the (token, expert) choices each mesh and factor drop from the batch's routing."""
    import torch
    from metadist_torch.moe.moe import capacity_dispatch, dropped_tokens, experts_modules

    c = _config(args.quick)
    model, opt = build(c, batch.shape[1])
    idx = routes(model, batch)
    experts = [m for _, m in experts_modules([model])]
    padded = {}
    with torch.no_grad():
        for factor in (None, 1.0):
            with capacity_dispatch(experts, (4,), factor):
                padded[factor] = float(model(input_ids=batch, labels=batch).loss)
    loss = float(lm_step(model, opt, batch))
    dropped = {}
    for shape in ((4,), (2, 2)):
        for factor in (None, 1.0):
            per_layer = [dropped_tokens(i, c["experts"], shape, factor) for i in idx]
            dropped[f"{'x'.join(map(str, shape))}/cf={factor}"] = per_layer
    return {
        "loss": loss,
        "loss_cf1": padded[1.0],
        "loss_capacity_nodrop": padded[None],
        "choices_per_layer": int(idx[0].numel()),
        "dropped": dropped,
    }


def _steps(args) -> tuple[int, int]:
    """(warm-up steps after the first, timed rounds)."""
    return (2, args.rounds or 6) if args.quick else (3, args.rounds or 15)


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from benchmarks._common import interleaved
    from metadist_torch.runtime.engine import ensure_process_group

    torch.set_num_threads(1)
    rank, world = ensure_process_group()
    device_mesh((world,))
    if world == 4:
        device_mesh((2, 2))  # every process group of the run exists before the links are measured
    warmup, rounds = _steps(args)
    b, s = _batch_shape(args.quick)
    vocab = _config(args.quick)["vocab"]
    t0 = time.perf_counter()
    batches = tokens(vocab, b, s, 1 + warmup + rounds + 20)
    ref = reference(args, batches[0])
    ref_s = time.perf_counter() - t0
    if rank == 0:
        print(f"[moe] reference loss {ref['loss']:.6f} (cf 1.0: {ref['loss_cf1']:.6f}) in {ref_s:.1f} s", flush=True)
    systems = build_systems(args, rank, world, batches, warmup, ref)
    runs = {n: x.run for n, x in systems.items() if isinstance(x, System)}
    if not args.rounds:  # whole Williams designs: n rounds for n systems, 2n when n is odd
        design = len(runs) if len(runs) % 2 == 0 else 2 * len(runs)
        rounds = -(-rounds // design) * design
    t0 = time.perf_counter()
    times = interleaved(runs, rounds, start=1 + warmup, before=dist.barrier)
    timed_s = time.perf_counter() - t0
    res: dict = {"reference": ref, "timed_s": timed_s, "rounds": rounds, "systems": {}}
    for name, x in systems.items():
        if not isinstance(x, System):
            res["systems"][name] = x
            continue
        rec = {**x.info, "step_s": statistics.median(times[name]), "times_s": times[name]}
        if "ddp" in times:
            rec["ratio_vs_ddp_by_round"] = [a / d for a, d in zip(times[name], times["ddp"])]
        rec.update(x.after())
        res["systems"][name] = rec
    dist.barrier()
    write_gathered(args.out, res)
    return 0


# -- the launcher -------------------------------------------------------------------


def _fmt_bytes(v) -> str:
    return "-" if v is None else f"{v / 1024:,.1f} KiB"


def records_of(ranks: list, args) -> list[dict]:
    """One record per system: medians over ranks, the plan's figures from the rank that holds its problem."""
    ref = ranks[0]["reference"]
    out = []
    for name in SYSTEMS:
        per = [r["systems"].get(name, {"error": "not built"}) for r in ranks]
        strategy, shape, factor = METADIST.get(name, ("ddp", (len(ranks),), None))
        rec: dict = {
            "benchmark": NAME,
            "model_desc": describe(args.quick),
            "system": name,
            "strategy": strategy,
            "mesh": "x".join(map(str, shape)),
            "capacity_factor": factor,
        }
        errs = [p["error"] for p in per if "error" in p]
        if errs:
            rec["error"] = errs[0]
            out.append(rec)
            continue
        planner = next((p for p in per if p.get("has_problem")), per[0])
        r0 = per[0]
        losses = [p["loss"] for p in per]
        step_ms = statistics.median(p["step_s"] for p in per) * 1e3
        rec.update(
            {
                "step_ms": step_ms,
                "ratio_vs_ddp": statistics.median(statistics.median(p["ratio_vs_ddp_by_round"]) for p in per)
                if "ratio_vs_ddp_by_round" in r0
                else None,
                "predicted_ms": planner.get("predicted_ms"),
                "predicted_overlap_ms": planner.get("predicted_overlap_ms"),
                "pred_error": (planner["predicted_ms"] - step_ms) / step_ms if planner.get("predicted_ms") else None,
                "a2a_bytes_predicted": planner.get("a2a_bytes_predicted"),
                "a2a_bytes_priced": planner.get("a2a_bytes_priced"),
                "a2a_bytes_counted": r0.get("a2a_bytes_counted"),
                "a2a_bytes_counted_after_first": r0.get("a2a_bytes_counted_after_first"),
                "comm_bytes_predicted": planner.get("comm_bytes_predicted"),
                "comm_bytes_priced": planner.get("comm_bytes_priced"),
                "comm_bytes_counted": r0.get("comm_bytes_counted"),
                "comm_bytes_counted_after_first": r0.get("comm_bytes_counted_after_first"),
                "comm_bytes_counted_ranks": [p.get("comm_bytes_counted") for p in per],
                "comm_bytes_predicted_by_kind": planner.get("comm_bytes_predicted_by_kind"),
                "comm_bytes_priced_by_kind": planner.get("comm_bytes_priced_by_kind"),
                "comm_bytes_counted_by_kind": r0.get("comm_bytes_counted_by_kind"),
                "comm_calls_counted_by_kind": r0.get("comm_calls_counted_by_kind"),
                "collectives_predicted_by_kind": planner.get("collectives_predicted_by_kind"),
                "first_call_bytes_by_kind": r0.get("first_call_bytes_by_kind"),
                "loss": r0["loss"],
                "loss_ranks": losses,
                "ref_loss": ref["loss"],
                "loss_rel_diff": max(_rel(x, ref["loss"]) for x in losses),
                "loss_ok": all(_rel(x, ref["loss"]) <= RTOL for x in losses),
                "first_call_s": max(p["first_call_s"] for p in per),
                "plan": planner.get("plan"),
                "experts_lines": planner.get("experts_lines"),
                "experts_storage": planner.get("experts_storage"),
                "compile": planner.get("compile"),
            }
        )
        if factor is not None:
            rec["ref_loss_dropping"] = ref["loss_cf1"]
            rec["loss_rel_diff_dropping"] = max(_rel(x, ref["loss_cf1"]) for x in losses)
        if name != "ddp":
            key = f"{rec['mesh']}/cf={factor}"
            rec["tokens_dropped"] = sum(ref["dropped"].get(key, []))
            rec["tokens_dropped_per_layer"] = ref["dropped"].get(key)
            rec["token_choices"] = ref["choices_per_layer"] * len(ref["dropped"].get(key, []))
        out.append(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a much smaller model and fewer steps")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument(
        "--rounds", type=int, default=0, help="timed rounds, each one step of every system (default 15; 6 with --quick)"
    )
    add_worker_args(ap, cache=True)
    args = ap.parse_args(argv)
    if args.worker:
        finish(worker(args))
    if args.nproc != 4:
        print("moe: the systems' meshes (4 and 2 x 2) need --nproc 4")
        return 2

    from benchmarks._common import RESULTS, fmt, machine

    t_all = time.perf_counter()
    got = launch(
        __file__,
        args.nproc,
        ["--rounds", str(args.rounds)] + (["--quick"] if args.quick else []),
        timeout=3000,
        cache=True,
        unset_env=["METADIST_MESH_PROFILE"],  # unset: the first compile measures the costs
        show=lambda line: line.startswith("[moe]"),
    )
    if got is None:
        return 1
    ranks = got.data
    records = records_of(ranks, args)
    ref = ranks[0]["reference"]
    wall = time.perf_counter() - t_all
    for r in records:
        r["run_s"] = wall
    dropped = "; ".join(
        f"mesh {k.split('/')[0]}, {k.split('/')[1].replace('cf=None', 'no capacity factor').replace('cf=', 'factor ')}: "
        f"{sum(v)} of {ref['choices_per_layer'] * len(v)} (per layer {v})"
        for k, v in ref["dropped"].items()
    )
    bad = [r["system"] for r in records if r.get("error") is None and not r.get("loss_ok") and not r["capacity_factor"]]
    notes = (
        f"{describe(args.quick)}. {args.nproc} gloo ranks on this machine ({os.cpu_count()} cores), one thread "
        f"each, one launch; whole run {wall:.0f} s, {ranks[0]['rounds']} timed rounds "
        f"({ranks[0]['timed_s']:.0f} s). step_ms: median over ranks of each rank's median step; ratio_vs_ddp: "
        "median over ranks of each rank's median, over rounds, of the step over DDP's in the same round; "
        "predicted_ms: plan.objective; a2a/comm bytes per rank per step: predicted = the sum of nbytes of the "
        "plan's non-free collectives (all_to_all / all kinds), priced = that sum once per reshard the lowering "
        "runs (metadist_core.plan.overlap.priced_collectives), counted = step.comm_stats since compile over the "
        "calls since compile (DDP: its comm hook's all_reduce buckets). loss_rel_diff: the first step's loss "
        f"against a single-device eager step on the whole batch ({ref['loss']:.6f}), held to {RTOL:g}"
        + (f"; over it: {', '.join(bad)}" if bad else "; every system without a capacity factor within it")
        + f" (the capacity-padded dispatch with no factor, on one device: {ref['loss_capacity_nodrop']:.6f}, "
        f"{_rel(ref['loss_capacity_nodrop'], ref['loss']):.1e} off)"
        + f". Tokens dropped on the first batch's routing ((token, expert) choices): {dropped}. "
        f"metadist_ep_cf1 drops tokens, so its loss differs from the reference by design; against a single-device "
        f"forward with the same capacity-padded dispatch ({ref['loss_cf1']:.6f}) it differs by "
        + fmt(next((r.get("loss_rel_diff_dropping") for r in records if r["system"] == "metadist_ep_cf1"), None))
        + "."
    )
    cols = [
        "system",
        "mesh",
        "step_ms",
        "ratio_vs_ddp",
        "predicted_ms",
        "a2a_bytes_predicted",
        "a2a_bytes_counted",
        "comm_bytes_predicted",
        "comm_bytes_priced",
        "comm_bytes_counted",
        "loss_rel_diff",
        "tokens_dropped",
        "error",
    ]
    kib = {c for c in cols if "bytes" in c}
    title = "Mixture of experts: MetaDist ep and auto against DDP"
    lines = [f"# {title}", "", f"Machine: {machine()}.", "", notes, ""]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in records:
        lines.append(
            "| "
            + " | ".join(_fmt_bytes(r[c]) if c in kib and r.get(c) is not None else fmt(r.get(c)) for c in cols)
            + " |"
        )
    seen = findings(records)
    if seen:
        lines += ["", "Findings (written by the benchmark from the figures above):", ""] + [f"- {f}" for f in seen]
    for r in records:
        if r.get("experts_lines"):
            lines += ["", f"{r['system']}: where the experts live (plan.explain())", "", "```"]
            lines += r["experts_lines"] + ["```"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{NAME}.json").write_text(json.dumps(records, indent=1, default=str))
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {RESULTS / f'{NAME}.md'} and {RESULTS / f'{NAME}.json'}")
    return 0


def findings(records: list[dict]) -> list[str]:
    """What the figures say that a reader should not have to work out: errors, losses off the reference, plans
    without an all_to_all, bytes the plan's sum and the counters disagree on."""
    out = []
    ddp = next((r for r in records if r["system"] == "ddp" and "error" not in r), None)
    for r in records:
        name = r["system"]
        if "error" in r:
            out.append(f"{name} failed: {r['error']}")
            continue
        if not r["capacity_factor"] and not r["loss_ok"]:
            out.append(
                f"{name}: first-step loss off the single-device reference by {r['loss_rel_diff']:.2e} (> {RTOL:g})"
            )
        if r["capacity_factor"]:
            out.append(
                f"{name}: drops {r['tokens_dropped']} of {r['token_choices']} (token, expert) choices; its loss is "
                f"{r['loss_rel_diff']:.2e} off the no-drop reference and {r['loss_rel_diff_dropping']:.2e} off a "
                "single-device forward with the same dropping"
            )
        if name == "ddp":
            continue
        by_kind = r.get("comm_bytes_priced_by_kind") or r.get("comm_bytes_predicted_by_kind") or {}
        if r["strategy"] == "ep" and not r.get("a2a_bytes_predicted"):
            gathered = by_kind.get("all_gather", 0)
            out.append(
                f"{name}: the plan has no all_to_all (the tokens stay where they are); the experts' weights are stored "
                f"split ({', '.join(sorted(set((r.get('experts_storage') or {}).values())))}) and all-gathered for "
                f"the step ({_fmt_bytes(gathered)} of all_gather per rank per step)"
                + (
                    f", and it moves {r['comm_bytes_counted'] / ddp['comm_bytes_counted']:.2f}x DDP's bytes"
                    if ddp and ddp.get("comm_bytes_counted")
                    else ""
                )
            )
        for what in ("a2a", "comm"):
            pred, priced, counted = (r.get(f"{what}_bytes_{k}") for k in ("predicted", "priced", "counted"))
            if pred is None or counted is None:
                continue
            if abs(pred - counted) > 0.01 * max(pred, counted, 1):
                extra = (
                    f"; once per reshard the lowering runs (priced_collectives) the plan says {_fmt_bytes(priced)}"
                    + (", as counted" if priced is not None and abs(priced - counted) <= 0.01 * max(priced, 1) else "")
                    if priced is not None
                    else ""
                )
                out.append(
                    f"{name}: {what} bytes per step, the sum over the plan's collectives {_fmt_bytes(pred)} against "
                    f"{_fmt_bytes(counted)} counted{extra}"
                )
            elif priced is not None and abs(priced - counted) > 0.01 * max(priced, counted, 1):
                out.append(f"{name}: {what} bytes priced {_fmt_bytes(priced)} against {_fmt_bytes(counted)} counted")
        if r.get("comm_bytes_counted_after_first") is not None and r.get("comm_bytes_counted") is not None:
            a, b = r["comm_bytes_counted_after_first"], r["comm_bytes_counted"]
            if abs(a - b) > 0.01 * max(a, b, 1):
                out.append(
                    f"{name}: the first call counted other bytes than the later ones ({_fmt_bytes(b)} per call overall, {_fmt_bytes(a)} after the first)"
                )
        ranks = r.get("comm_bytes_counted_ranks") or []
        if len(set(ranks)) > 1:
            out.append(f"{name}: the ranks counted different bytes per step: {ranks}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
