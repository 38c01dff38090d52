"""Mixture-of-experts training: MetaDist's dropless expert parallelism against the capacity-padded dispatch and
DDP, with the plan's figures beside each.

    python -m benchmarks.moe [--quick] [--nproc 4] [--rounds N] [--model {mixtral,wide,both}]

Models (transformers, from configs made in code, nothing downloaded; ``--model both``, the default, runs one
launch of 4 gloo ranks per model):

- ``mixtral``: ``MixtralForCausalLM``, hidden 256, intermediate 384, 2 layers, 4 heads of which 2 key/value
  heads, 8 experts, top-2 routing, vocab 512, sequence 64, global batch 16 (``--quick``: hidden 64,
  intermediate 96, 4 experts, sequence 16, batch 8);
- ``wide``: ``Qwen3MoeForCausalLM``, many small experts as Qwen3-MoE trains them: hidden 128, expert width 64,
  2 layers, 4 heads of 32 of which 2 key/value heads, 64 experts, top-8 routing with the routing weights
  renormalised, vocab 512, sequence 32, global batch 16 (``--quick``: hidden 64, expert width 32, 16 experts
  top-4, sequence 16, batch 8).

The experts run transformers' eager loop over the experts hit (``experts_implementation="eager"``) in the
eager model; AdamW at 1e-4; token batches from seeded generators; the step is loss, backward, optimizer step,
gradients cleared (:func:`benchmarks._models.lm_step`). A MetaDist step traces each experts layer as one op,
``metadist::moe_dropless`` (:mod:`metadist_torch.moe.dropless`), unless a capacity factor is set.

Systems on 4 gloo ranks (one launch per model, one thread each):

- ``ddp``: DistributedDataParallel over the eager model, each rank a quarter of the batch;
- ``metadist_ep``: ``strategy="ep"`` on a mesh of 4, dropless: the experts split by expert over the mesh, the
  layer run by its distributed implementation ``moe.ep`` / ``moe.ep.backward`` (tokens sorted by expert,
  per-expert counts exchanged by an even all_to_all, the rows sent to the experts' owners and back by uneven
  all_to_alls, :mod:`metadist_torch.ops.ep_dispatch`), the rest data-parallel;
- ``metadist_auto``: dropless, the solver plans freely on the mesh of 4;
- ``metadist_ep_2x2``: dropless, ep on a 2 x 2 mesh: the experts split over axis 0 (moe.ep there) and
  replicated over axis 1, the tokens split over both (data parallelism on axis 1);
- ``metadist_padded_ep``: ep on 4 with ``moe_capacity_factor`` = experts / top_k: the capacity-padded one-hot
  dispatch (:func:`metadist_torch.moe.moe.capacity_experts_forward`) with a capacity of every token of a
  group, so none is dropped;
- ``metadist_ep_cf1``: ep on 4 with ``moe_capacity_factor=1.0``: the padded dispatch at an expert's even
  share, tokens past it dropped.

A MetaDist step takes the whole global batch on every rank and splits it itself; DDP's ranks each take their
quarter. The meshes are made once (DeviceMeshes of (4,) and (2, 2)) before anything compiles, as in
:mod:`benchmarks.torch_step`.

Measured, per system:

- the step time: every system built and warmed up, then timed in interleaved rounds, one step of each per
  round in a Williams order (:func:`benchmarks._common.interleaved`), so that the shared machine's slow spells
  fall on all of them alike; ``step_ms`` the median over ranks of each rank's median step, ``ratio_vs_ddp``
  the median over ranks of each rank's median, over rounds, of the step over DDP's step in the same round;
- MetaDist's prediction: the plan's objective (``plan.objective``, the solver's price of a step, the
  distributed implementations' prices included) and ``metadist_core.plan.overlap.predict`` of the plan;
- all_to_all bytes per rank per step, predicted against counted: predicted = the plan's reshards once each
  as the lowering runs them (:func:`metadist_core.plan.overlap.priced_collectives`, all_to_all only) plus, for
  every op the plan runs with ``moe.ep`` / ``moe.ep.backward``, the bytes the rank puts into the op's own
  three all_to_alls (:func:`metadist_core.discovery.moe_dispatch.dispatch_bytes` of the op's local shapes in
  the plan: those all_to_alls are inside the op, not among the plan's collectives); counted = the compiled
  step's ``step.comm_stats["all_to_all"]`` since compile over the calls since compile, on every rank (also
  over the calls after the first, to tell a first call's extras apart); the same for every collective kind
  together (DDP: its all_reduce buckets, counted in a comm hook), and the all_to_all calls (3 per moe.ep op);
- the first step's loss, relative difference against a single-device eager step on the whole batch (the same
  seed and weights; DDP's is the mean of its ranks' losses), held to 1e-4 for every system that drops no
  token (reported, never raised); also against a single-device forward through the same dispatch (the
  dropless op for the dropless systems, the capacity-padded dispatch with the same groups and factor for the
  padded ones, :func:`metadist_torch.moe.moe.capacity_dispatch`): ``metadist_ep_cf1`` drops tokens, differs
  from the eager step by design, and is held to that one;
- the tokens dropped: each layer's routing of the first batch (``top_k_index``, taken by a forward hook on
  every layer's ``mlp.gate``) counted by :func:`metadist_torch.moe.moe.dropped_tokens` for the system's groups
  and capacity factor (the dropless systems have no capacity: 0);
- which distributed implementations ran: the ``impls`` of the plan's strategies; and ``plan.explain()``'s
  "experts" lines (which ranks hold which experts).

Results: results/moe.json (one record per model and system, rank medians) and results/moe.md (one table per
model, with findings the benchmark writes from the figures).
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
MODELS = ("mixtral", "wide")
# a prediction further than this from the measured step is reported
PRED_BAND = 0.25


def _config(quick: bool, model: str = "mixtral") -> dict:
    """The model's shape."""
    if model == "wide":
        if quick:
            return dict(
                arch="qwen3_moe", hidden=64, intermediate=96, expert_width=32, layers=2, heads=4, kv_heads=2,
                head_dim=16, experts=16, top_k=4, vocab=512,
            )  # fmt: skip
        return dict(
            arch="qwen3_moe", hidden=128, intermediate=192, expert_width=64, layers=2, heads=4, kv_heads=2,
            head_dim=32, experts=64, top_k=8, vocab=512,
        )  # fmt: skip
    if quick:
        return dict(
            arch="mixtral", hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, vocab=512
        )
    return dict(
        arch="mixtral", hidden=256, intermediate=384, layers=2, heads=4, kv_heads=2, experts=8, top_k=2, vocab=512
    )


def _batch_shape(quick: bool, model: str = "mixtral") -> tuple[int, int]:
    """(global batch, sequence)."""
    if model == "wide":
        return (8, 16) if quick else (16, 32)
    return (8, 16) if quick else (16, 64)


def build(c: dict, seq: int, seed: int = 0):
    """(model, AdamW): the weights drawn after ``torch.manual_seed(seed)``, so two builds are equal."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    common = dict(
        vocab_size=c["vocab"],
        hidden_size=c["hidden"],
        intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        num_experts_per_tok=c["top_k"],
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        experts_implementation="eager",  # transformers' own loop over the experts hit
    )
    if c["arch"] == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            **common,
            num_experts=c["experts"],
            moe_intermediate_size=c["expert_width"],
            head_dim=c["head_dim"],
            norm_topk_prob=True,
        )
        cls = Qwen3MoeForCausalLM
    else:
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(**common, num_local_experts=c["experts"])
        cls = MixtralForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def describe(quick: bool, model: str = "mixtral") -> str:
    c, (b, s) = _config(quick, model), _batch_shape(quick, model)
    if c["arch"] == "qwen3_moe":
        head = (
            f"Qwen3-MoE (transformers) {c['layers']} layers hidden {c['hidden']} expert width {c['expert_width']} "
            f"{c['heads']} heads of {c['head_dim']} / {c['kv_heads']} kv"
        )
    else:
        head = (
            f"Mixtral (transformers) {c['layers']} layers hidden {c['hidden']} intermediate {c['intermediate']} "
            f"{c['heads']} heads / {c['kv_heads']} kv"
        )
    return (
        f"{head}, {c['experts']} experts top-{c['top_k']}, vocab {c['vocab']}, seq {s}, global batch {b} "
        f"({b * s} tokens, {b * s * c['top_k']} (token, expert) choices a layer)"
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

# name -> (strategy, mesh shape, dispatch): "dropless" (no capacity factor: the dropless op), "padded" (the
# capacity-padded dispatch with factor experts / top_k: none dropped) or "cf1" (factor 1.0: tokens dropped)
METADIST = {
    "metadist_ep": ("ep", (4,), "dropless"),
    "metadist_auto": ("auto", (4,), "dropless"),
    "metadist_ep_2x2": ("ep", (2, 2), "dropless"),
    "metadist_padded_ep": ("ep", (4,), "padded"),
    "metadist_ep_cf1": ("ep", (4,), "cf1"),
}
SYSTEMS = ["ddp", *METADIST]


def capacity_factor(dispatch: str, c: dict) -> float | None:
    """The ``moe_capacity_factor`` of a dispatch kind for model ``c``: None (dropless), experts / top_k (a
    capacity of every token of a group: ``ceil(E/k * k * Tg / E) = Tg``) or 1.0."""
    return {"dropless": None, "padded": c["experts"] / c["top_k"], "cf1": 1.0}[dispatch]


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


def dispatch_figures(step) -> dict:
    """What the compiled step's expert-parallel ops put into their own all_to_alls on this rank, from their local
    shapes in the plan (:func:`metadist_core.discovery.moe_dispatch.dispatch_bytes`): bytes, the ops, and the
    distributed implementations the plan's strategies run."""
    from metadist_core.plan.implbytes import moe_dispatch_bytes

    plan = step.plan
    total, ops = moe_dispatch_bytes(step.graph, plan)
    impls = sorted({i for s in plan.strategies.values() for i in s.impls if i})
    return {"dispatch_bytes": int(total), "dispatch_ops": ops, "impls": impls}


def _plan_figures(step) -> dict:
    """What the plan says of a step: the dispatch bytes (every rank), and on the rank that holds the plan's
    problem the reshards priced once each by kind, the predicted bytes (those plus the dispatch bytes), its
    objective, the overlap replay and the experts lines of its explanation."""
    plan = step.plan
    edges = [c for _, c in plan.collectives() if not c.is_free]
    edge_sums: dict[str, int] = {}
    for c in edges:
        edge_sums[c.kind] = edge_sums.get(c.kind, 0) + int(c.nbytes)
    info = {
        "plan": plan.summary(),
        "predicted_ms": plan.objective * 1e3,
        "predicted_compute_ms": plan.compute_seconds * 1e3,
        "predicted_comm_ms": plan.comm_seconds * 1e3,
        # the sum over the plan's edges (a reshard read by several ops once per reader): for reference only
        "comm_bytes_plan_edges_by_kind": edge_sums,
        "experts_storage": {
            plan.labels.get(v, v): str(s)
            for v, s in plan.input_shardings.items()
            if step.problem is not None and step.problem.vars.get(v, {}).get("experts")
        },
        **dispatch_figures(step),
    }
    if step.problem is not None:  # only the planning rank holds the problem
        from metadist_core.plan.overlap import predict, priced_collectives

        if plan.problem is None:
            plan = dataclasses.replace(plan, problem=step.problem)
        priced: dict[str, int] = {}
        priced_calls: dict[str, int] = {}
        for _, c in priced_collectives(plan):
            priced[c.kind] = priced.get(c.kind, 0) + int(c.nbytes)
            priced_calls[c.kind] = priced_calls.get(c.kind, 0) + 1
        pr = predict(plan, step.problem)
        text = plan.explain(presets=False)
        experts = text.split("\nexperts\n", 1)[1].split("\n\n", 1)[0].splitlines() if "\nexperts\n" in text else []
        d = info["dispatch_bytes"]
        info.update(
            {
                "has_problem": True,
                "a2a_bytes_reshards": priced.get("all_to_all", 0),
                "a2a_bytes_predicted": priced.get("all_to_all", 0) + d,
                "a2a_calls_predicted": priced_calls.get("all_to_all", 0) + 3 * info["dispatch_ops"],
                "comm_bytes_reshards_by_kind": priced,
                "comm_bytes_predicted": sum(priced.values()) + d,
                "predicted_overlap_ms": pr.step * 1e3,
                "predicted_overlap_comm_bytes": pr.comm_bytes,
                "experts_lines": [line.strip() for line in experts if line.strip()],
                "explain": text,
            }
        )
    return info


def build_systems(args, rank: int, world: int, batches: list, warmup: int, ref: dict) -> dict:
    """Every system, built, its first step's loss checked against the reference, warmed up by ``warmup`` steps;
    a system that fails to build is ``{"error": ...}``."""
    import torch
    import torch.distributed as dist

    c = _config(args.quick, args.model)
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
        info = {"first_call_s": first, "loss": loss0, "rank_loss": float(loss)}
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

    def metadist(strategy: str, shape: tuple[int, ...], dispatch: str):
        from metadist_torch import metadist_compile

        model, opt = build(c, seq)
        factor = capacity_factor(dispatch, c)
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
        info = {
            "first_call_s": first,
            "compile": dict(step.timings or {}),
            "loss": loss0,
            "first_call_bytes_by_kind": after_first[0],
            **_plan_figures(step),
        }
        warm(run)

        def after():
            s = step.comm_stats
            n = calls[0]
            rest = max(1, n - 1)
            return {
                "calls_since_compile": n,
                "a2a_bytes_counted": s.bytes.get("all_to_all", 0) / n,
                "a2a_calls_counted": s.calls.get("all_to_all", 0) / n,
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
        t0 = time.perf_counter()
        try:
            out[name] = make()
        except Exception as e:  # say so, go on with the others
            import traceback

            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        if rank == 0:
            got = out[name]
            if isinstance(got, dict):
                what = got["error"]
            else:
                kind = METADIST.get(name, ("", (), "eager"))[2]
                want = ref["loss"] if kind in ("eager", "dropless") else ref["loss_dispatch"][kind]
                what = f"loss rel. diff {_rel(got.info['loss'], want):.2e} (against {kind} on one device)"
            print(f"[moe] {args.model}: built {name} in {time.perf_counter() - t0:.0f} s: {what}", flush=True)
        dist.barrier()
    return out


def reference(args, batch) -> dict:
    """The single-device eager first step on the whole batch; the same forward through each dispatch a system
    runs, on one device: the dropless op, the capacity-padded dispatch with factor experts / top_k (no token
    dropped) and with factor 1.0, both with the groups of a mesh of 4; the (token, expert) choices each
    system's groups and factor drop from the batch's routing."""
    import torch
    from metadist_torch.moe.moe import capacity_dispatch, dropped_tokens, experts_modules

    c = _config(args.quick, args.model)
    model, opt = build(c, batch.shape[1])
    idx = routes(model, batch)
    experts = [m for _, m in experts_modules([model])]
    by_dispatch = {}
    with torch.no_grad():
        for kind in ("dropless", "padded", "cf1"):
            with capacity_dispatch(experts, (4,), capacity_factor(kind, c)):
                by_dispatch[kind] = float(model(input_ids=batch, labels=batch).loss)
    loss = float(lm_step(model, opt, batch))
    dropped = {}
    for name, (_, shape, kind) in METADIST.items():
        dropped[name] = [dropped_tokens(i, c["experts"], shape, capacity_factor(kind, c)) for i in idx]
    return {
        "loss": loss,
        "loss_dispatch": by_dispatch,
        "choices_per_layer": int(idx[0].numel()),
        "layers_routed": len(idx),
        "dropped": dropped,
    }


def _steps(args) -> tuple[int, int]:
    """(warm-up steps after the first, timed rounds)."""
    return (2, args.rounds or 6) if args.quick else (3, args.rounds or 12)


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
    b, s = _batch_shape(args.quick, args.model)
    vocab = _config(args.quick, args.model)["vocab"]
    t0 = time.perf_counter()
    batches = tokens(vocab, b, s, 1 + warmup + rounds + 20)
    ref = reference(args, batches[0])
    ref_s = time.perf_counter() - t0
    if rank == 0:
        d = ref["loss_dispatch"]
        print(
            f"[moe] {args.model}: reference loss {ref['loss']:.6f} (one device: dropless op {d['dropless']:.6f}, "
            f"padded {d['padded']:.6f}, cf 1.0 {d['cf1']:.6f}) in {ref_s:.1f} s",
            flush=True,
        )
    systems = build_systems(args, rank, world, batches, warmup, ref)
    runs = {n: x.run for n, x in systems.items() if isinstance(x, System)}
    if not args.rounds:  # whole Williams designs: n rounds for n systems, 2n when n is odd
        design = len(runs) if len(runs) % 2 == 0 else 2 * len(runs)
        rounds = -(-rounds // design) * design
    t0 = time.perf_counter()
    times = interleaved(runs, rounds, start=1 + warmup, before=dist.barrier)
    timed_s = time.perf_counter() - t0
    if rank == 0:
        print(f"[moe] {args.model}: {rounds} timed rounds in {timed_s:.0f} s", flush=True)
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


def _close(a, b, tol: float = 0.01) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1)


def records_of(ranks: list, args, model: str) -> list[dict]:
    """One record per system: medians over ranks, the plan's figures from the rank that holds its problem."""
    ref = ranks[0]["reference"]
    c = _config(args.quick, model)
    out = []
    for name in SYSTEMS:
        per = [r["systems"].get(name, {"error": "not built"}) for r in ranks]
        strategy, shape, kind = METADIST.get(name, ("ddp", (len(ranks),), "eager"))
        rec: dict = {
            "benchmark": NAME,
            "model": model,
            "model_desc": describe(args.quick, model),
            "system": name,
            "strategy": strategy,
            "mesh": "x".join(map(str, shape)),
            "dispatch": kind,
            "capacity_factor": capacity_factor(kind, c) if name != "ddp" else None,
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
        same = ref["loss"] if kind in ("eager", "dropless") else ref["loss_dispatch"][kind]
        rec.update(
            {
                "step_ms": step_ms,
                "ratio_vs_ddp": statistics.median(statistics.median(p["ratio_vs_ddp_by_round"]) for p in per)
                if "ratio_vs_ddp_by_round" in r0
                else None,
                "predicted_ms": planner.get("predicted_ms"),
                "predicted_overlap_ms": planner.get("predicted_overlap_ms"),
                "pred_error": (planner["predicted_ms"] - step_ms) / step_ms if planner.get("predicted_ms") else None,
                "impls": ", ".join(planner.get("impls") or []) or ("-" if name != "ddp" else None),
                "dispatch_ops": planner.get("dispatch_ops"),
                "a2a_bytes_reshards": planner.get("a2a_bytes_reshards"),
                "a2a_bytes_dispatch": planner.get("dispatch_bytes"),
                "a2a_bytes_dispatch_ranks": [p.get("dispatch_bytes") for p in per],
                "a2a_bytes_predicted": planner.get("a2a_bytes_predicted"),
                "a2a_bytes_counted": r0.get("a2a_bytes_counted"),
                "a2a_bytes_counted_ranks": [p.get("a2a_bytes_counted") for p in per],
                "a2a_bytes_counted_after_first": r0.get("a2a_bytes_counted_after_first"),
                "a2a_calls_predicted": planner.get("a2a_calls_predicted"),
                "a2a_calls_counted": r0.get("a2a_calls_counted"),
                "comm_bytes_predicted": planner.get("comm_bytes_predicted"),
                "comm_bytes_counted": r0.get("comm_bytes_counted"),
                "comm_bytes_counted_after_first": r0.get("comm_bytes_counted_after_first"),
                "comm_bytes_counted_ranks": [p.get("comm_bytes_counted") for p in per],
                "comm_bytes_reshards_by_kind": planner.get("comm_bytes_reshards_by_kind"),
                "comm_bytes_plan_edges_by_kind": planner.get("comm_bytes_plan_edges_by_kind"),
                "comm_bytes_counted_by_kind": r0.get("comm_bytes_counted_by_kind"),
                "comm_calls_counted_by_kind": r0.get("comm_calls_counted_by_kind"),
                "first_call_bytes_by_kind": r0.get("first_call_bytes_by_kind"),
                "loss": r0["loss"],
                "loss_ranks": losses,
                "ref_loss": ref["loss"],
                "loss_rel_diff": max(_rel(x, ref["loss"]) for x in losses),
                "ref_loss_same_dispatch": same,
                "loss_rel_diff_same_dispatch": max(_rel(x, same) for x in losses),
                "first_call_s": max(p["first_call_s"] for p in per),
                "plan": planner.get("plan"),
                "experts_lines": planner.get("experts_lines"),
                "experts_storage": planner.get("experts_storage"),
                "compile": planner.get("compile"),
            }
        )
        # a system that drops no token is held to the eager step; the dropping one to the same dropping
        rec["loss_ok"] = (rec["loss_rel_diff_same_dispatch"] if kind == "cf1" else rec["loss_rel_diff"]) <= RTOL
        if name != "ddp":
            rec["tokens_dropped"] = sum(ref["dropped"][name])
            rec["tokens_dropped_per_layer"] = ref["dropped"][name]
            rec["token_choices"] = ref["choices_per_layer"] * ref["layers_routed"]
        out.append(rec)
    return out


def notes_of(records: list[dict], ranks: list, model: str, wall: float, args) -> str:
    """The paragraph above a model's table: the model, the run, the references."""
    ref = ranks[0]["reference"]
    d = ref["loss_dispatch"]
    c = _config(args.quick, model)
    return (
        f"{args.nproc} gloo ranks on this machine ({os.cpu_count()} cores), one "
        f"thread each, one launch of {wall:.0f} s, {ranks[0]['rounds']} timed rounds ({ranks[0]['timed_s']:.0f} s). "
        f"Single-device first-step loss: eager {ref['loss']:.6f}; the same forward through the dropless op "
        f"{d['dropless']:.6f} ({_rel(d['dropless'], ref['loss']):.1e} off), through the padded dispatch at factor "
        f"{c['experts'] / c['top_k']:g} {d['padded']:.6f} ({_rel(d['padded'], ref['loss']):.1e} off), at factor "
        f"1.0 {d['cf1']:.6f} ({_rel(d['cf1'], ref['loss']):.1e} off). metadist_padded_ep's capacity factor "
        f"{c['experts']}/{c['top_k']} = {c['experts'] / c['top_k']:g} gives each expert a slot for every token of "
        "its group: nothing dropped."
    )


COLUMNS = [
    "system",
    "mesh",
    "impls",
    "step_ms",
    "ratio_vs_ddp",
    "predicted_ms",
    "a2a_bytes_predicted",
    "a2a_bytes_counted",
    "a2a_calls_counted",
    "comm_bytes_predicted",
    "comm_bytes_counted",
    "loss_rel_diff",
    "loss_rel_diff_same_dispatch",
    "tokens_dropped",
    "error",
]

DEFINITIONS = (
    "step_ms: median over ranks of each rank's median step; ratio_vs_ddp: median over ranks of each rank's median, "
    "over rounds, of the step over DDP's in the same round; predicted_ms: plan.objective. Bytes and calls per rank "
    "per step: a2a_bytes_predicted = the plan's all_to_all reshards once each as the lowering runs them "
    "(metadist_core.plan.overlap.priced_collectives) + what the rank puts into the all_to_alls inside every op run "
    "by moe.ep / moe.ep.backward (metadist_core.discovery.moe_dispatch.dispatch_bytes of the op's local shapes); "
    "comm_bytes_predicted the same over every collective kind; counted = step.comm_stats since compile over the "
    "calls since compile (DDP: its comm hook's all_reduce buckets); a2a_calls_counted: all_to_all calls (3 per "
    "moe.ep op). impls: the distributed implementations the plan's strategies run. loss_rel_diff: the first step's "
    f"loss against the single-device eager step, held to {RTOL:g} for every system that drops no token; "
    "loss_rel_diff_same_dispatch: against a single-device forward through the same dispatch (the dropless op; "
    "the padded dispatch with the same groups and factor). tokens_dropped: (token, expert) choices of the first "
    "batch's routing past an expert's capacity, over both layers (metadist_torch.moe.moe.dropped_tokens)."
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="much smaller models and fewer steps")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument(
        "--rounds", type=int, default=0, help="timed rounds, each one step of every system (default 12; 6 with --quick)"
    )
    ap.add_argument(
        "--model",
        choices=[*MODELS, "both"],
        default="both",
        help="mixtral (8 experts top-2), wide (Qwen3-MoE, 64 experts top-8) or both (default; one launch each)",
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
    models = list(MODELS) if args.model == "both" else [args.model]
    records: list[dict] = []
    sections: list[str] = []
    for model in models:
        t0 = time.perf_counter()
        got = launch(
            __file__,
            args.nproc,
            ["--rounds", str(args.rounds), "--model", model] + (["--quick"] if args.quick else []),
            timeout=3000,
            cache=True,
            unset_env=["METADIST_MESH_PROFILE"],  # unset: the first compile measures the costs
            show=lambda line: line.startswith("[moe]"),
        )
        if got is None:
            return 1
        wall = time.perf_counter() - t0
        ranks = got.data
        recs = records_of(ranks, args, model)
        for r in recs:
            r["launch_s"] = wall
        records += recs
        lines = [f"## {model}: {describe(args.quick, model)}", "", notes_of(recs, ranks, model, wall, args), ""]
        lines.append("| " + " | ".join(COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
        kib = {col for col in COLUMNS if "bytes" in col}
        for r in recs:
            cells = [
                _fmt_bytes(r[col]) if col in kib and r.get(col) is not None else fmt(r.get(col)) for col in COLUMNS
            ]
            lines.append("| " + " | ".join(cells) + " |")
        seen = findings(recs)
        if seen:
            lines += ["", "Findings (written by the benchmark from the figures above):", ""] + [f"- {f}" for f in seen]
        for r in recs:
            if r.get("experts_lines") and r["system"] in ("metadist_ep", "metadist_ep_2x2"):
                lines += ["", f"{r['system']}: where the experts live (plan.explain())", "", "```"]
                lines += r["experts_lines"] + ["```"]
        sections.append("\n".join(lines))
    wall = time.perf_counter() - t_all
    for r in records:
        r["run_s"] = wall
    title = "Mixture of experts: dropless expert parallelism against the capacity-padded dispatch and DDP"
    head = [
        f"# {title}",
        "",
        f"Machine: {machine()}. `python -m benchmarks.moe{' --quick' if args.quick else ''}`, whole run {wall:.0f} s.",
        "",
        DEFINITIONS,
        "",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = "\n".join(head) + "\n" + "\n\n".join(sections) + "\n"
    (RESULTS / f"{NAME}.json").write_text(json.dumps(records, indent=1, default=str))
    (RESULTS / f"{NAME}.md").write_text(text)
    print(text)
    print(f"wrote {RESULTS / f'{NAME}.md'} and {RESULTS / f'{NAME}.json'}")
    return 0


def _times(a: dict, b: dict, key: str) -> str:
    """``a``'s figure over ``b``'s, as "1.23x", or "-" when either is missing."""
    x, y = a.get(key), b.get(key)
    return f"{x / y:.2f}x" if x and y else "-"


def findings(records: list[dict]) -> list[str]:
    """What one model's figures say that a reader should not have to work out: errors, losses off their
    references, bytes the prediction and the counters disagree on, which implementation ran, and the dropless
    dispatch against the padded one and the dropping one."""
    out = []
    by = {r["system"]: r for r in records if "error" not in r}
    for r in records:
        if "error" in r:
            out.append(f"{r['system']} failed: {r['error']}")
    # the losses
    nodrop = [r for r in by.values() if r["dispatch"] != "cf1"]
    off = [r for r in nodrop if not r["loss_ok"]]
    for r in off:
        out.append(
            f"{r['system']}: first-step loss off the single-device eager step by {r['loss_rel_diff']:.2e} (> {RTOL:g})"
        )
    if nodrop and not off:
        worst = max(nodrop, key=lambda r: r["loss_rel_diff"])
        out.append(
            f"every system that drops no token has the eager step's loss within {RTOL:g} (largest difference "
            f"{worst['loss_rel_diff']:.1e}, {worst['system']})"
        )
    # predicted against counted bytes, on every rank
    md = [r for r in by.values() if r["system"] != "ddp"]
    a2a_bad = []
    for r in md:
        pred, ranks = r.get("a2a_bytes_predicted"), r.get("a2a_bytes_counted_ranks") or []
        if pred is None or any(x is None or not _close(pred, x, 0) for x in ranks):
            a2a_bad.append(r)
            out.append(
                f"{r['system']}: all_to_all bytes per rank per step predicted {_fmt_bytes(pred)} (reshards "
                f"{_fmt_bytes(r.get('a2a_bytes_reshards'))} + dispatch {_fmt_bytes(r.get('a2a_bytes_dispatch'))}) "
                f"against counted {', '.join(_fmt_bytes(x) for x in ranks)} on the ranks"
            )
    if md and not a2a_bad:
        out.append(
            "all_to_all bytes per rank per step: predicted (the plan's reshards + the moe.ep ops' dispatch_bytes) "
            "equal those counted, on every rank, for every MetaDist system"
        )
    for r in md:
        pred, counted = r.get("comm_bytes_predicted"), r.get("comm_bytes_counted")
        if pred is not None and counted is not None and not _close(pred, counted):
            out.append(
                f"{r['system']}: bytes of every kind per rank per step predicted {_fmt_bytes(pred)} against "
                f"{_fmt_bytes(counted)} counted (by kind, reshards {r.get('comm_bytes_reshards_by_kind')}, "
                f"counted {r.get('comm_bytes_counted_by_kind')})"
            )
        calls_p, calls_c = r.get("a2a_calls_predicted"), r.get("a2a_calls_counted")
        if calls_p is not None and calls_c is not None and not _close(calls_p, calls_c, 0):
            out.append(f"{r['system']}: {calls_c:g} all_to_all calls per step counted, {calls_p} predicted")
        a, b = r.get("comm_bytes_counted_after_first"), r.get("comm_bytes_counted")
        if a is not None and b is not None and not _close(a, b):
            out.append(
                f"{r['system']}: the first call counted other bytes than the later ones ({_fmt_bytes(b)} per call "
                f"overall, {_fmt_bytes(a)} after the first)"
            )
    # which implementation ran
    for r in md:
        ran = "moe.ep" in (r.get("impls") or "")
        if r["dispatch"] == "dropless" and r["strategy"] == "ep" and not ran:
            out.append(f"{r['system']}: ep with the dropless layer, but the plan runs no moe.ep ({r.get('plan')})")
        if r["dispatch"] != "dropless" and ran:
            out.append(f"{r['system']}: the padded dispatch, yet the plan runs {r['impls']}")
        if r["strategy"] == "ep" and not r.get("a2a_bytes_predicted") and not r.get("a2a_bytes_counted"):
            by_kind = r.get("comm_bytes_reshards_by_kind") or {}
            out.append(
                f"{r['system']}: no all_to_all (the tokens stay where they are); the experts' weights are stored "
                f"split ({', '.join(sorted(set((r.get('experts_storage') or {}).values())))}) and all-gathered for "
                f"the step ({_fmt_bytes(by_kind.get('all_gather', 0))} of all_gather per rank per step)"
            )
    if "metadist_auto" in by:
        auto = by["metadist_auto"]
        ep = by.get("metadist_ep")
        same = ep is not None and auto.get("impls") == ep.get("impls") and auto.get("plan") == ep.get("plan")
        out.append(
            "metadist_auto runs "
            + (auto["impls"] if auto.get("impls") not in (None, "-") else "no distributed implementation")
            + (" with the same plan as metadist_ep" if same else f" (plan: {auto.get('plan')})")
            + (
                f"; the solver prices it at {fmt_ms(auto, 'predicted_ms')} against {fmt_ms(ep, 'predicted_ms')} for "
                f"metadist_ep's plan, and it measures {fmt_ms(auto)} against {fmt_ms(ep)} "
                f"({_times(auto, ep, 'step_ms')} metadist_ep's)"
                if ep is not None and not same
                else ""
            )
        )
    # dropless against padded, dropping, and 2 x 2
    ep = by.get("metadist_ep")
    if ep is not None:
        pad = by.get("metadist_padded_ep")
        if pad is not None:
            out.append(
                f"dropless (metadist_ep) against the padded dispatch without dropping (metadist_padded_ep, factor "
                f"{pad['capacity_factor']:g}): all_to_all bytes per rank per step "
                f"{_fmt_bytes(ep.get('a2a_bytes_counted'))} against {_fmt_bytes(pad.get('a2a_bytes_counted'))} "
                f"(padded {_times(pad, ep, 'a2a_bytes_counted')}), every kind "
                f"{_fmt_bytes(ep.get('comm_bytes_counted'))} against {_fmt_bytes(pad.get('comm_bytes_counted'))}; "
                f"step {fmt_ms(ep)} against {fmt_ms(pad)} (padded {_times(pad, ep, 'step_ms')}); predicted "
                f"{fmt_ms(ep, 'predicted_ms')} against {fmt_ms(pad, 'predicted_ms')}"
            )
        cf1 = by.get("metadist_ep_cf1")
        if cf1 is not None:
            out.append(
                f"metadist_ep_cf1 drops {cf1['tokens_dropped']} of {cf1['token_choices']} (token, expert) choices "
                f"of the first batch; its loss is {cf1['loss_rel_diff']:.2e} off the eager step and "
                f"{cf1['loss_rel_diff_same_dispatch']:.2e} off a single-device forward with the same dropping; "
                f"all_to_all bytes {_fmt_bytes(cf1.get('a2a_bytes_counted'))} "
                f"({_times(cf1, ep, 'a2a_bytes_counted')} dropless's), step {fmt_ms(cf1)} "
                f"({_times(cf1, ep, 'step_ms')} dropless's)"
            )
        two = by.get("metadist_ep_2x2")
        if two is not None:
            out.append(
                f"metadist_ep_2x2 (experts over 2 ranks, data parallel over 2): step {fmt_ms(two)} "
                f"({_times(two, ep, 'step_ms')} metadist_ep's), bytes of every kind "
                f"{_fmt_bytes(two.get('comm_bytes_counted'))} ({_times(two, ep, 'comm_bytes_counted')} metadist_ep's)"
            )
    far = [
        f"{r['system']} {r['pred_error']:+.0%}"
        for r in md
        if r.get("pred_error") is not None and abs(r["pred_error"]) > PRED_BAND
    ]
    if far:
        out.append(f"predicted step off the measured one by more than {PRED_BAND:.0%}: {', '.join(far)}")
    for r in by.values():
        ranks = r.get("comm_bytes_counted_ranks") or []
        if len(set(ranks)) > 1:
            out.append(f"{r['system']}: the ranks counted different bytes per step: {ranks}")
    return out


def fmt_ms(r: dict, key: str = "step_ms") -> str:
    v = r.get(key)
    return "-" if v is None else f"{v:.1f} ms"


if __name__ == "__main__":
    raise SystemExit(main())
