"""MetaDist against what an engineer would write, with the cost model's prediction beside every figure.

    python -m benchmarks.torch_step [--quick] [--nproc 4] [--models gpt,gpt2,llama]

Models: the GPT example (``gpt``), transformers' GPT-2 with 4 layers of width
256 (``gpt2``), a LLaMA-style model from a small ``LlamaConfig`` (``llama``).
Systems on 4 gloo ranks (one launch, one thread each): MetaDist (``auto``,
the first compile measures this machine's link and device costs and caches
them), DDP, FSDP2 (``fully_shard`` per block; also with ``reshard_after_forward=False``), a hand Megatron tensor-parallel
plan (DTensor ``parallelize_module`` with ColwiseParallel/RowwiseParallel) where
the model's layers allow it, and TP x DP on a (2, 2) mesh (the TP plan on the
inner axis, ``fully_shard`` on the outer), and MetaDist's own lowering of each
hand plan's layout (``metadist_<layout>``: the strategy preset that pins it).
Every system is built and warmed up first, then timed in rounds, one step of
each per round in a Williams order (``--rounds``: by default whole designs, so that
every system runs in every position and right after every other system equally often), so that the
shared machine's slow spells, and what one step leaves to the next, fall on all of them alike. For every system: the median step time,
its time over DDP's in each round, the cost model's prediction for that same plan
(MetaDist's plan, or MetaDist's lowering of the hand plan's layout, priced by
``metadist_core.plan.overlap.predict``), the communication bytes per step that plan
prices and those counted (MetaDist: at its collectives; DDP: in a comm hook;
FSDP2 and the TP plans: at the dispatcher in one more, untimed step),
and the peak RSS. Results: results/torch_step.json (one record per model and
system, rank medians), .md, and torch_step.png (predicted against measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks._launch import add_worker_args, finish, launch, write_gathered
from benchmarks._models import adamw, gpt2, llama_of, lm_step as _hf_step, tokens

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


# -- models ----------------------------------------------------------------------------


class Model:
    """One benchmark model: ``build()`` -> (module, optimizer); ``batches[i]`` the step's arguments after them;
    ``step(model, opt, *batch)`` the training step; ``tp_plan(model)`` the Megatron plan or None."""

    def __init__(self, name, desc, build, step, batches, tp_plan=None, blocks=None, tp_pins=None):
        self.name, self.desc, self.build, self.step, self.batches = name, desc, build, step, batches
        self.tp_plan, self.blocks = tp_plan, blocks
        # constraints by name beside the tp presets, so that MetaDist's tp rows take the hand plan's layout
        self.tp_pins = tp_pins


def _gpt_model(quick: bool, steps: int) -> Model:
    gpt = _gpt()
    c = _config(quick)

    def tp_plan(model):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        # the MLP of every block, Megatron-style (the fused qkv is split by width after it: left whole)
        return {
            f"blocks.{i}.{n}": (ColwiseParallel() if n == "fc" else RowwiseParallel())
            for i in range(c.layers)
            for n in ("fc", "out")
        }

    # the hand plan keeps the attention whole: so does MetaDist's price of it (the tp preset leaves an attention
    # whose weights the user pins whole to the solver)
    whole_attention = {f"blocks.*.{n}.*": "R" for n in ("qkv", "proj")}
    return Model(
        "gpt",
        f"GPT example vocab {c.vocab} width {c.width} layers {c.layers} seq {c.seq} batch {c.batch}",
        lambda: gpt.build(c),
        gpt.train_step,
        [gpt.batch(c, s) for s in range(steps)],
        tp_plan,
        lambda m: list(m.blocks),
        whole_attention,
    )


def _gpt2_model(quick: bool, steps: int) -> Model:
    layers, width, seq, vocab, batch = (2, 128, 32, 512, 8) if quick else (4, 256, 64, 1024, 8)

    def build():
        m = gpt2(n_positions=seq, n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab)
        return m, adamw(m, 1e-4)

    ids = [(b,) for b in tokens(vocab, batch, seq, steps)]
    # GPT-2's layers are transformers' Conv1D, which ColwiseParallel/RowwiseParallel do not take: no TP plan
    return Model(
        "gpt2",
        f"GPT-2 (transformers) {layers} layers width {width} vocab {vocab} seq {seq} batch {batch}",
        build,
        _hf_step,
        ids,
        None,
        lambda m: list(m.transformer.h),
    )


def _llama_model(quick: bool, steps: int) -> Model:
    layers, width, seq, vocab, batch = (1, 64, 32, 256, 8) if quick else (2, 128, 64, 512, 8)

    def build():
        m = llama_of(layers, width, seq, vocab)
        return m, adamw(m, 1e-4)

    def tp_plan(model):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {}
        for i in range(layers):  # torchtitan's plan for attention and MLP (heads divide the TP size)
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
            for n in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
        return plan

    ids = [(b,) for b in tokens(vocab, batch, seq, steps)]
    return Model(
        "llama",
        f"LLaMA-style (LlamaConfig) {layers} layers width {width} vocab {vocab} seq {seq} batch {batch}",
        build,
        _hf_step,
        ids,
        tp_plan,
        lambda m: list(m.model.layers),
    )


MODELS = {"gpt": _gpt_model, "gpt2": _gpt2_model, "llama": _llama_model}


def _shard_batch(b, rank, world):
    per = b[0].shape[0] // world
    return tuple(x[rank * per : (rank + 1) * per] for x in b)


# -- the ranks ---------------------------------------------------------------------


class System:
    """One system under test, built and warmed up: ``run(i)`` runs its step on round ``i``'s batch;
    ``info`` holds what it says of itself (plan, prediction, bytes); ``after()`` more of it, once timing is done."""

    def __init__(self, run, info: dict | None = None, after=None):
        self.run, self.info, self.after = run, info or {}, after


def _counted(run_step) -> dict:
    """Bytes by kind of one more (untimed) step, counted at the dispatcher (benchmarks._comm_count)."""
    from benchmarks._comm_count import CountCollectives

    with CountCollectives() as c:
        run_step()
    return {"comm_bytes_counted": c.total, "comm_bytes_by_kind": dict(c.bytes), "comm_calls_by_kind": dict(c.calls)}


# every hand plan beside MetaDist's own lowering of its layout (the strategy preset that pins it): the hand
# plan's row takes that lowering's prediction, and the lowering's own row shows whether the cost model
# predicts what MetaDist runs, apart from what torch's implementation of the same layout adds
# (FSDP2 by default gathers each block's parameters again in the backward; with reshard_after_forward=False it
# keeps them from the forward to the backward. MetaDist's torch lowering moves a value again for its readers
# after the forward, so it gathers a parameter again where the backward reads the parameter itself. Both
# FSDP2 rows take the fsdp layout's price.)
HAND = {
    "ddp": ("metadist_ddp", "ddp", None),
    "fsdp2": ("metadist_fsdp", "fsdp", None),
    "fsdp2_no_reshard": ("metadist_fsdp", "fsdp", None),
    "tp": ("metadist_tp", "tp", None),
    "tp_x_dp": ("metadist_tp_x_dp", "tp+dp", (2, 2)),
}


_MESHES: dict = {}


def device_mesh(shape: tuple[int, ...]):
    """The run's one DeviceMesh of ``shape`` (dims ("tp",) or ("dp", "tp")), shared by every system and model.

    Made once per run, before anything compiles (:func:`worker`): every gloo process group a rank belongs
    to makes the others' collectives faster on this machine (a 16 KB all_reduce of 4 ranks: 6.4 ms with
    the world group alone, 5.2 with one more group, 4.8 with two, 3.9 with six; measured 2026-11-26), so
    meshes made per model made each model's steps faster than the last, and all of them faster than the
    links MetaDist measured at the first compile (LLaMA's tp layout +29..+66 % over its step)."""
    if shape not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        names = ("tp",) if len(shape) == 1 else ("dp", "tp")
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def build_systems(m: Model, args, rank: int, world: int, warmup: int) -> dict[str, System]:
    """Every system of the run for model ``m``, compiled and warmed up by ``warmup`` steps (peak RSS of each
    while it is built); a system this model does not take is ``{"error": ...}``."""
    import torch.distributed as dist

    cache = args.cache_dir
    local = [_shard_batch(b, rank, world) for b in m.batches]

    def warm(run):
        for i in range(warmup):
            run(i)

    def metadist(strategy="auto", mesh=None):
        from metadist_core.plan.overlap import predict
        from metadist_torch import metadist_compile

        model, opt = m.build()
        pins = m.tp_pins if strategy.startswith("tp") else None
        step = metadist_compile(cache_dir=cache, strategy=strategy, mesh=mesh, constraints=pins)(m.step)
        t0 = time.perf_counter()
        step(model, opt, *m.batches[0])
        first = time.perf_counter() - t0

        def run(i):
            return step(model, opt, *m.batches[i % len(m.batches)])

        warm(run)
        step.comm_stats.reset()
        info = {"first_call_s": first, "compile": step.timings, "plan": step.plan.summary()}
        if step.problem is not None:  # only the planning rank holds the problem: it predicts
            pr = predict(step.plan, step.problem)
            info.update(
                {
                    "predicted_ms": pr.step * 1e3,
                    "predicted_compute_ms": pr.compute * 1e3,
                    "predicted_comm_ms": pr.comm * 1e3,
                    "comm_bytes_predicted": pr.comm_bytes,
                }
            )

        def after(rounds):
            n = max(1, rounds)
            return {
                "comm_bytes_counted": step.comm_stats.total / n,
                "comm_bytes_by_kind": {k: v / n for k, v in step.comm_stats.bytes.items()},
                # the plan's collectives per step (a bucket counts its members), not the calls on the wire
                "plan_collectives_by_kind": {k: v / n for k, v in step.comm_stats.calls.items()},
            }

        return System(run, info, after)

    def ddp():
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        model, opt = m.build()
        d = DDP(model)
        counted = [0, 0]

        def hook(state, bucket):
            counted[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(state, bucket)

        d.register_comm_hook(None, hook)

        def run(i):
            counted[1] += 1
            return m.step(d, opt, *local[i % len(local)])

        warm(run)
        return System(run, after=lambda rounds: {"comm_bytes_counted": counted[0] / max(1, counted[1])})

    def hand_sharded(mesh_shape, tp_plan: bool, reshard_after_forward: bool = True):
        from torch.distributed.fsdp import fully_shard

        model, opt = m.build()
        batches = local
        if tp_plan:
            from torch.distributed.tensor.parallel import parallelize_module

            dm = device_mesh(mesh_shape)
            parallelize_module(model, dm["tp"], m.tp_plan(model))
            batches = m.batches  # every TP rank reads the whole batch
        if len(mesh_shape) == 2 or not tp_plan:
            dp_mesh = dm["dp"] if tp_plan else None
            for blk in m.blocks(model):
                fully_shard(blk, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
            if tp_plan:
                dp_rank, dp = dm["dp"].get_local_rank(), mesh_shape[0]
                batches = [_shard_batch(b, dp_rank, dp) for b in m.batches]
        opt = type(opt)(model.parameters(), **{k: v for k, v in opt.defaults.items() if k in ("lr", "betas")})

        def run(i):
            return m.step(model, opt, *batches[i % len(batches)])

        warm(run)
        return System(run, after=lambda rounds: _counted(lambda: run(0)))

    makers = [("metadist", lambda: metadist())]
    for hand, (mine, preset, mesh) in HAND.items():
        if hand.startswith("tp") and m.tp_plan is None:
            continue
        if mesh is not None and world != 4:
            continue
        if mine not in (n for n, _ in makers):
            makers.append((mine, lambda preset=preset, mesh=mesh: metadist(preset, mesh and device_mesh(mesh))))
        makers.append(
            (
                hand,
                {
                    "ddp": ddp,
                    "fsdp2": lambda: hand_sharded((world,), False),
                    "fsdp2_no_reshard": lambda: hand_sharded((world,), False, False),
                    "tp": lambda: hand_sharded((world,), True),
                    "tp_x_dp": lambda: hand_sharded((2, 2), True),
                }[hand],
            )
        )
    out: dict = {}
    for name, make in makers:
        gc.collect()
        _reset_peak()
        before, _ = _rss()
        try:
            sysm = make()
            _, peak = _rss()
            sysm.info.update({"peak_rss_mb": peak / 2**20, "rss_rise_mb": max(0, peak - before) / 2**20})
            out[name] = sysm
        except Exception as e:  # a hand plan this model does not take: say so, go on
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        dist.barrier()
    return out


def _steps(args) -> tuple[int, int]:
    """(warm-up steps, timed rounds) of every system."""
    return (2, args.rounds or 6) if args.quick else (3, args.rounds or 15)


def run_model(m: Model, args, rank: int, world: int) -> dict:
    """Build every system, then time them interleaved: each round runs one step of every system, in a
    Williams order (benchmarks._common.williams_order), so that a slow spell of this shared machine falls
    on all of them alike. Per system: the median step, and per round its time over DDP's in the same round."""
    import torch.distributed as dist
    from benchmarks._common import interleaved

    warmup, rounds = _steps(args)
    systems = build_systems(m, args, rank, world, warmup)
    if not args.rounds:  # whole Williams designs: n rounds for n systems, 2n when n is odd
        n = sum(1 for s in systems.values() if isinstance(s, System))
        design = n if n % 2 == 0 else 2 * n
        rounds = -(-rounds // design) * design
    times = interleaved(
        {n: s.run for n, s in systems.items() if isinstance(s, System)}, rounds, start=warmup, before=dist.barrier
    )
    res: dict = {}
    for name, s in systems.items():
        if not isinstance(s, System):
            res[name] = s
            continue
        rec = {**s.info, "step_s": statistics.median(times[name]), "times_s": times[name]}
        if "ddp" in times:
            rec["ratio_vs_ddp_by_round"] = [a / b for a, b in zip(times[name], times["ddp"])]
        if s.after is not None:
            rec.update(s.after(rounds))
        res[name] = rec
        dist.barrier()
    for hand, (mine, _, _) in HAND.items():  # a hand plan's prediction: MetaDist's price of its layout
        if hand in res and mine in res and "predicted_ms" in res[mine]:
            res[hand].update(
                {
                    k: res[mine][k]
                    for k in ("predicted_ms", "predicted_compute_ms", "predicted_comm_ms", "comm_bytes_predicted")
                },
                predicted_plan=res[mine].get("plan"),
            )
    return res


def worker(args) -> int:
    import torch
    from metadist_torch.runtime.engine import ensure_process_group

    torch.set_num_threads(1)
    rank, world = ensure_process_group()
    device_mesh((world,))
    if world == 4:
        device_mesh((2, 2))  # every process group of the run exists before the links are measured
    steps = sum(_steps(args))
    res = {}
    for name in args.models.split(","):
        m = MODELS[name](args.quick, steps)
        res[name] = {"desc": m.desc, **run_model(m, args, rank, world)}
    write_gathered(args.out, res)
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


def plot(records, path: Path) -> None:
    from benchmarks._common import plot_predicted

    plot_predicted(
        records,
        path,
        "torch_step: predicted against measured, 4 gloo ranks",
        lambda r: f"{r['model']}/{r['system']}",
        "measured step (ms, median over ranks)",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--models", default="gpt,gpt2,llama", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument(
        "--rounds", type=int, default=0, help="timed rounds, each one step of every system (default 15; 6 with --quick)"
    )
    ap.add_argument("--single", action="store_true", help="also the world-size-1 comparison with eager")
    add_worker_args(ap, cache=True)
    args = ap.parse_args(argv)
    if args.worker:
        finish(worker(args))

    from benchmarks._common import RESULTS, write_results

    t_all = time.perf_counter()
    got = launch(
        __file__,
        args.nproc,
        ["--models", args.models, "--rounds", str(args.rounds)] + (["--quick"] if args.quick else []),
        timeout=3000,
        cache=True,
        unset_env=["METADIST_MESH_PROFILE"],
    )  # unset: the first compile measures the costs
    if got is None:
        return 1
    ranks = got.data
    (RESULTS / f"{NAME}_ranks.json").write_text(json.dumps(ranks, default=str))  # every rank's figures
    records = []
    lines = []
    for model in args.models.split(","):
        per = [r[model] for r in ranks]
        ok = [s for s in per[0] if s != "desc" and all("step_s" in p.get(s, {}) for p in per)]
        best = min(
            (statistics.median(p[s]["step_s"] for p in per) for s in ok if not s.startswith("metadist")), default=None
        )
        for system in [s for s in per[0] if s != "desc"]:
            r0 = per[0][system]
            rec = {
                "benchmark": NAME,
                "model": model,
                "model_desc": per[0]["desc"],
                "system": system,
                "mesh": "2x2" if system.endswith("tp_x_dp") else str(args.nproc),
            }
            errs = [p[system]["error"] for p in per if "error" in p[system]]
            if errs:
                rec["error"] = errs[0]
                records.append(rec)
                continue
            step_ms = statistics.median(p[system]["step_s"] for p in per) * 1e3
            rec.update(
                {
                    "step_ms": step_ms,
                    "predicted_ms": r0.get("predicted_ms"),
                    "pred_error": (r0["predicted_ms"] - step_ms) / step_ms if r0.get("predicted_ms") else None,
                    "comm_bytes_predicted": r0.get("comm_bytes_predicted"),
                    "comm_bytes_counted": r0.get("comm_bytes_counted"),
                    "peak_rss_mb": max(p[system]["peak_rss_mb"] for p in per),
                    "ratio_vs_best_hand": step_ms / best / 1e3 if best else None,
                    # the median over ranks of each rank's median, over rounds, of this step over DDP's
                    "ratio_vs_ddp_by_round": statistics.median(
                        statistics.median(p[system]["ratio_vs_ddp_by_round"]) for p in per
                    )
                    if "ratio_vs_ddp_by_round" in r0
                    else None,
                    "plan": r0.get("plan") or r0.get("predicted_plan"),
                }
            )
            if system == "metadist":
                rec["compile_s"] = sum(v for k, v in r0["compile"].items())
                rec["profile_s"] = r0["compile"].get("profile")
                lines.append(
                    f"{model}: MetaDist {step_ms:.1f} ms vs best hand plan {best * 1e3:.1f} ms "
                    f"(ratio {step_ms / best / 1e3:.2f}; over DDP by round {rec['ratio_vs_ddp_by_round']:.2f}), "
                    f"predicted {r0['predicted_ms']:.1f} ms; "
                    f"plan {r0['plan']}"
                )
            records.append(rec)
    if args.single:
        one = single(args.quick)
        records.append(
            {
                "benchmark": NAME,
                "model": "gpt",
                "system": "metadist",
                "mesh": "1",
                "step_ms": one["metadist_step_s"] * 1e3,
                "eager_step_ms": one["eager_step_s"] * 1e3,
            }
        )
    notes = (
        f"{args.nproc} gloo ranks on this machine ({os.cpu_count()} cores), one thread each, one launch. "
        + " ".join(lines)
        + f" Whole run {time.perf_counter() - t_all:.0f} s. Systems timed in interleaved "
        f"rounds (one step of each per round, Williams orders: each system in each position and after each other "
        f"system equally often). step_ms: median over ranks of "
        "each rank's median step; vs_ddp_by_round: median over ranks of each rank's median, over rounds, of "
        "the step over DDP's step in the same round; predicted_ms: metadist_core.plan.overlap.predict of MetaDist's plan, or of "
        "MetaDist's lowering of the hand plan's layout (the metadist_<layout> row, its strategy preset); comm bytes per rank per step."
    )
    cols = [
        "model",
        "system",
        "mesh",
        "step_ms",
        "predicted_ms",
        "pred_error",
        "ratio_vs_best_hand",
        "ratio_vs_ddp_by_round",
        "comm_bytes_predicted",
        "comm_bytes_counted",
        "peak_rss_mb",
        "error",
    ]
    path = write_results(NAME, records, cols, "MetaDist vs DDP, FSDP2 and hand TP plans, measured and predicted", notes)
    try:
        plot(records, RESULTS / f"{NAME}.png")
    except Exception as e:  # matplotlib missing: the table still stands
        print(f"no plot: {e}")
    print(notes)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
