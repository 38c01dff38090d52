"""MetaDist against what an engineer would write, with the cost model's prediction beside every figure.

    python -m benchmarks.torch_step [--quick] [--nproc 4] [--models gpt,gpt2,llama]

Models: the GPT example (``gpt``), transformers' GPT-2 with 4 layers of width
256 (``gpt2``), a LLaMA-style model from a small ``LlamaConfig`` (``llama``).
Systems on 4 gloo ranks (one launch, one thread each): MetaDist (``auto``,
the first compile measures this machine's link and device costs and caches
them), DDP, FSDP2 (``fully_shard`` per block), a hand Megatron tensor-parallel
plan (DTensor ``parallelize_module`` with ColwiseParallel/RowwiseParallel) where
the model's layers allow it, and TP x DP on a (2, 2) mesh (the TP plan on the
inner axis, ``fully_shard`` on the outer). For every system: the median step
time after warm-up, the cost model's prediction for that same plan (MetaDist
pinned to the hand plan's layout by its strategy preset, priced by
``metadist_core.overlap.predict``), the communication bytes per step that plan
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


# -- models ----------------------------------------------------------------------------


class Model:
    """One benchmark model: ``build()`` -> (module, optimizer); ``batches[i]`` the step's arguments after them;
    ``step(model, opt, *batch)`` the training step; ``tp_plan(model)`` the Megatron plan or None."""

    def __init__(self, name, desc, build, step, batches, tp_plan=None, blocks=None):
        self.name, self.desc, self.build, self.step, self.batches = name, desc, build, step, batches
        self.tp_plan, self.blocks = tp_plan, blocks


def _gpt_model(quick: bool, steps: int) -> Model:
    gpt = _gpt()
    c = _config(quick)

    def tp_plan(model):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        # the MLP of every block, Megatron-style (the fused qkv is split by width after it: left whole)
        return {f"blocks.{i}.{n}": (ColwiseParallel() if n == "fc" else RowwiseParallel())
                for i in range(c.layers) for n in ("fc", "out")}
    return Model("gpt", f"GPT example vocab {c.vocab} width {c.width} layers {c.layers} seq {c.seq} batch {c.batch}",
                 lambda: gpt.build(c), gpt.train_step, [gpt.batch(c, s) for s in range(steps)], tp_plan,
                 lambda m: list(m.blocks))


def _hf_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _gpt2_model(quick: bool, steps: int) -> Model:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    layers, width, seq, vocab, batch = (2, 128, 32, 512, 8) if quick else (4, 256, 64, 1024, 8)

    def build():
        torch.manual_seed(0)
        cfg = GPT2Config(n_positions=seq, n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        m = GPT2LMHeadModel(cfg)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)
    ids = [(torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(i)),) for i in range(steps)]
    # GPT-2's layers are transformers' Conv1D, which ColwiseParallel/RowwiseParallel do not take: no TP plan
    return Model("gpt2", f"GPT-2 (transformers) {layers} layers width {width} vocab {vocab} seq {seq} batch {batch}",
                 build, _hf_step, ids, None, lambda m: list(m.transformer.h))


def _llama_model(quick: bool, steps: int) -> Model:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    layers, width, seq, vocab, batch = (1, 64, 32, 256, 8) if quick else (2, 128, 64, 512, 8)

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        m = LlamaForCausalLM(cfg)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-4)

    def tp_plan(model):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        plan = {}
        for i in range(layers):   # torchtitan's plan for attention and MLP (heads divide the TP size)
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{n}"] = ColwiseParallel()
            for n in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{n}"] = RowwiseParallel()
        return plan
    ids = [(torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(i)),) for i in range(steps)]
    return Model("llama", f"LLaMA-style (LlamaConfig) {layers} layers width {width} vocab {vocab} seq {seq} "
                 f"batch {batch}", build, _hf_step, ids, tp_plan, lambda m: list(m.model.layers))


MODELS = {"gpt": _gpt_model, "gpt2": _gpt2_model, "llama": _llama_model}


def _shard_batch(b, rank, world):
    per = b[0].shape[0] // world
    return tuple(x[rank * per:(rank + 1) * per] for x in b)


# -- the ranks ---------------------------------------------------------------------


def _predicted(m: Model, cache, strategy: str, mesh=None) -> dict:
    """The cost model's price of ``strategy``'s plan for this step (compiled, not run)."""
    from metadist_core.overlap import predict
    from metadist_torch import metadist_compile
    model, opt = m.build()
    step = metadist_compile(cache_dir=cache, strategy=strategy, mesh=mesh)(m.step)
    step.compile(model, opt, *m.batches[0])
    if step.problem is None:   # only the planning rank holds the problem: it predicts
        return {}
    pr = predict(step.plan, step.problem)
    return {"predicted_ms": pr.step * 1e3, "comm_bytes_predicted": pr.comm_bytes,
            "predicted_compute_ms": pr.compute * 1e3, "predicted_comm_ms": pr.comm * 1e3,
            "predicted_plan": step.plan.summary()}


def _counted(run_step) -> dict:
    """Bytes by kind of one more (untimed) step, counted at the dispatcher (benchmarks._comm_count)."""
    from benchmarks._comm_count import CountCollectives
    with CountCollectives() as c:
        run_step()
    return {"comm_bytes_counted": c.total, "comm_bytes_by_kind": dict(c.bytes), "comm_calls_by_kind": dict(c.calls)}


def run_model(m: Model, args, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    cache = args.cache_dir
    warmup = 2 if args.quick else 3
    local = [_shard_batch(b, rank, world) for b in m.batches]
    res: dict = {}

    def metadist(strategy="auto"):
        from metadist_core.overlap import predict
        from metadist_torch import metadist_compile
        model, opt = m.build()
        step = metadist_compile(cache_dir=cache, strategy=strategy)(m.step)
        t0 = time.perf_counter()
        step(model, opt, *m.batches[0])
        first = time.perf_counter() - t0
        step.comm_stats.reset()
        t, _ = _timed_steps(lambda b: step(model, opt, *b), m.batches[1:], warmup - 1)
        out = {"step_s": t, "first_call_s": first, "compile": step.timings, "plan": step.plan.summary(),
               "comm_bytes_counted": step.comm_stats.total / max(1, len(m.batches) - 1),
               "comm_bytes_by_kind": {k: v / max(1, len(m.batches) - 1) for k, v in step.comm_stats.bytes.items()},
               # the plan's collectives per step (a bucket counts its members), not the calls on the wire
               "plan_collectives_by_kind": {k: v / max(1, len(m.batches) - 1)
                                            for k, v in step.comm_stats.calls.items()}}
        if step.problem is None:   # only the planning rank holds the problem: it predicts
            return out
        pr = predict(step.plan, step.problem)
        return {**out, "predicted_ms": pr.step * 1e3, "predicted_compute_ms": pr.compute * 1e3,
                "predicted_comm_ms": pr.comm * 1e3, "comm_bytes_predicted": pr.comm_bytes}

    def ddp():
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP
        model, opt = m.build()
        d = DDP(model)
        counted = [0]

        def hook(state, bucket):
            counted[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(state, bucket)
        d.register_comm_hook(None, hook)
        t, _ = _timed_steps(lambda b: m.step(d, opt, *b), local, warmup)
        return {"step_s": t, "comm_bytes_counted": counted[0] / len(local)}

    def fsdp2():
        from torch.distributed.fsdp import fully_shard
        model, opt = m.build()
        for blk in m.blocks(model):
            fully_shard(blk)
        fully_shard(model)
        opt = type(opt)(model.parameters(), **{k: v for k, v in opt.defaults.items() if k in ("lr", "betas")})
        t, _ = _timed_steps(lambda b: m.step(model, opt, *b), local, warmup)
        return {"step_s": t, **_counted(lambda: m.step(model, opt, *local[0]))}

    def tp(mesh_shape):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        model, opt = m.build()
        if len(mesh_shape) == 1:
            dm = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",))
            parallelize_module(model, dm, m.tp_plan(model))
            batches = m.batches      # every TP rank reads the whole batch
        else:
            from torch.distributed.fsdp import fully_shard
            dm = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
            parallelize_module(model, dm["tp"], m.tp_plan(model))
            for blk in m.blocks(model):
                fully_shard(blk, mesh=dm["dp"])
            fully_shard(model, mesh=dm["dp"])
            dp_rank, dp = dm["dp"].get_local_rank(), mesh_shape[0]
            batches = [_shard_batch(b, dp_rank, dp) for b in m.batches]
        opt = type(opt)(model.parameters(), **{k: v for k, v in opt.defaults.items() if k in ("lr", "betas")})
        t, _ = _timed_steps(lambda b: m.step(model, opt, *b), batches, warmup)
        return {"step_s": t, **_counted(lambda: m.step(model, opt, *batches[0]))}

    systems = [("metadist", lambda: metadist(), None), ("metadist_ddp", lambda: metadist("ddp"), None),
               ("ddp", ddp, ("ddp", None)), ("fsdp2", fsdp2, ("fsdp", None))]
    if m.tp_plan is not None:
        systems += [("tp", lambda: tp((world,)), ("tp", None))]
        if world == 4:
            systems += [("tp_x_dp", lambda: tp((2, 2)), ("tp+dp", (2, 2)))]
    for name, fn, pinned in systems:
        try:
            res[name] = _phase(name, fn)
            if pinned is not None:
                res[name].update(_predicted(m, cache, *pinned))
        except Exception as e:   # a hand plan this model does not take: say so, go on
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        dist.barrier()
    return res


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from metadist_torch.engine import ensure_process_group
    torch.set_num_threads(1)
    rank, world = ensure_process_group()
    steps = 6 if args.quick else 10
    res = {}
    for name in args.models.split(","):
        m = MODELS[name](args.quick, steps)
        res[name] = {"desc": m.desc, **run_model(m, args, rank, world)}
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered, default=str))
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5))
    pts = [r for r in records if r.get("predicted_ms") and r.get("step_ms")]
    for r in pts:
        ax.scatter(r["step_ms"], r["predicted_ms"], s=30)
        ax.annotate(f"{r['model']}/{r['system']}", (r["step_ms"], r["predicted_ms"]), fontsize=7)
    hi = max([1.0] + [max(r["step_ms"], r["predicted_ms"]) for r in pts]) * 1.2
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="predicted = measured")
    ax.plot([0, hi], [0, hi * 0.75], ":", c="grey", lw=0.8)
    ax.plot([0, hi], [0, hi * 1.25], ":", c="grey", lw=0.8, label="+-25 %")
    ax.set_xlabel("measured step (ms, median over ranks)")
    ax.set_ylabel("cost model's prediction (ms)")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.legend(fontsize=8)
    ax.set_title("torch_step: predicted against measured, 4 gloo ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--models", default="gpt,gpt2,llama", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--single", action="store_true", help="also the world-size-1 comparison with eager")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:   # finish_worker: gloo ranks have aborted in the interpreter's teardown (README "Not yet")
        from metadist_torch.engine import finish_worker
        finish_worker(worker(args))

    from benchmarks._common import RESULTS, write_results
    from metadist_torch.demo import torchrun_cmd
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        cache = os.environ.get("METADIST_CACHE_DIR") or str(Path(tmp) / "cache")
        wargs = ["--worker", "--out", str(out), "--cache-dir", cache, "--models", args.models] + \
            (["--quick"] if args.quick else [])
        env = dict(os.environ, OMP_NUM_THREADS="1", METADIST_PROGRESS="0", PYTHONWARNINGS="ignore")
        env.pop("METADIST_MESH_PROFILE", None)   # costs measured by default
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(torchrun_cmd(Path(__file__), args.nproc, wargs), env=env, capture_output=True,
                              text=True, cwd=str(REPO), timeout=3000)
        if proc.returncode != 0 or not out.exists():
            print("\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
            return 1
        ranks = json.loads(out.read_text())
        (RESULTS / f"{NAME}_ranks.json").write_text(json.dumps(ranks, default=str))   # every rank's figures
    records = []
    lines = []
    for model in args.models.split(","):
        per = [r[model] for r in ranks]
        ok = [s for s in per[0] if s != "desc" and all("step_s" in p.get(s, {}) for p in per)]
        best = min((statistics.median(p[s]["step_s"] for p in per) for s in ok if not s.startswith("metadist")), default=None)
        for system in [s for s in per[0] if s != "desc"]:
            r0 = per[0][system]
            rec = {"benchmark": NAME, "model": model, "model_desc": per[0]["desc"], "system": system,
                   "mesh": "2x2" if system == "tp_x_dp" else str(args.nproc)}
            errs = [p[system]["error"] for p in per if "error" in p[system]]
            if errs:
                rec["error"] = errs[0]
                records.append(rec)
                continue
            step_ms = statistics.median(p[system]["step_s"] for p in per) * 1e3
            rec.update({"step_ms": step_ms, "predicted_ms": r0.get("predicted_ms"),
                        "pred_error": (r0["predicted_ms"] - step_ms) / step_ms if r0.get("predicted_ms") else None,
                        "comm_bytes_predicted": r0.get("comm_bytes_predicted"),
                        "comm_bytes_counted": r0.get("comm_bytes_counted"),
                        "peak_rss_mb": max(p[system]["peak_rss_mb"] for p in per),
                        "ratio_vs_best_hand": step_ms / best / 1e3 if best else None,
                        "plan": r0.get("plan") or r0.get("predicted_plan")})
            if system == "metadist":
                rec["compile_s"] = sum(v for k, v in r0["compile"].items())
                rec["profile_s"] = r0["compile"].get("profile")
                lines.append(f"{model}: MetaDist {step_ms:.1f} ms vs best hand plan {best * 1e3:.1f} ms "
                             f"(ratio {step_ms / best / 1e3:.2f}), predicted {r0['predicted_ms']:.1f} ms; "
                             f"plan {r0['plan']}")
            records.append(rec)
    if args.single:
        one = single(args.quick)
        records.append({"benchmark": NAME, "model": "gpt", "system": "metadist", "mesh": "1",
                        "step_ms": one["metadist_step_s"] * 1e3, "eager_step_ms": one["eager_step_s"] * 1e3})
    notes = (f"{args.nproc} gloo ranks on this machine ({os.cpu_count()} cores), one thread each, one launch. "
             + " ".join(lines) + f" Whole run {time.perf_counter() - t_all:.0f} s. step_ms: median over ranks of "
             "each rank's median step; predicted_ms: metadist_core.overlap.predict of MetaDist's plan, or of "
             "MetaDist pinned to the hand plan's layout (its strategy preset); comm bytes per rank per step.")
    cols = ["model", "system", "mesh", "step_ms", "predicted_ms", "pred_error", "ratio_vs_best_hand",
            "comm_bytes_predicted", "comm_bytes_counted", "peak_rss_mb", "error"]
    path = write_results(NAME, records, cols, "MetaDist vs DDP, FSDP2 and hand TP plans, measured and predicted",
                         notes)
    try:
        plot(records, RESULTS / f"{NAME}.png")
    except Exception as e:  # matplotlib missing: the table still stands
        print(f"no plot: {e}")
    print(notes)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
