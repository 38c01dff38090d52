"""Planning at real model sizes: trace (load) / discover / build / solve seconds, cold and warm, peak RSS.

    python -m benchmarks.plan_scale [--quick]
    python -m benchmarks.plan_scale --real [--real-cases 8b 8b-80g 70b 8b-131k 8b-131k-nocp]

``--real``: LLaMA at the shapes people train (transformers' LlamaConfig on the meta device, AdamW, batch
64 x 4,096), the whole step traced and planned by ``plan_graph`` on the A100 preset, cold (a fresh rule
cache) then warm (the same cache), each case in a fresh process. Yardstick, timed in that process right
before: torch's own ``make_fx`` of the model's forward and backward on fake tensors; the record's ratio is
(trace + plan) / yardstick. Written to results/plan_scale_real.{json,md} (``--quick`` and the default
cases write plan_scale.{json,md}).

Models are whole training steps (forward, backward, AdamW) of transformers'
GPT-2 recorded in tests/data/graphs (small: 12 layers, width 768, vocabulary
50,257; XL: 48 layers, width 1,600), planned with the rules ShardCombine
discovers through the PyTorch op runner at proxy sizes, and transformers' GPT-2
medium (24 layers, width 1,024) and LLaMA at 8B traced on the meta device (no
recorded step of them in tests/data/graphs). Each case runs in a
fresh process (so its peak RSS is its own), first with an empty cache (cold),
then with the rules the first run left but not its kept ILP answer (warm, the
MILP solved again), then with both (warm, the same MILP answered from the
cache, solvers/_cache.py). The plan's cost is
set against the best hand plan of each family on the same cost model (data
parallel, ZeRO-3, Megatron TP, TP x DP: the layouts pinned, the rest filled in
by the ILP; pinned from the GPT-2 layout where it reads the graph, else, or where
those pins do not fit, by MetaDist's presets ddp, zero3, tp and tp+dp; each
record says which in ``hand_<family>_from``; each hand ILP may take ``--hand-time-limit`` seconds, and its gap is in
``hand_<family>_gap``). PyTorch AutoParallel's figures, measured on this machine, stand in the same
table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._common import RESULTS, write_results
from ._models import adamw, gpt2, llama, lm_step

NAME = "plan_scale"
GRAPHS = Path(__file__).resolve().parents[1] / "tests" / "data" / "graphs"
CASES = [
    ("gpt2-small-12l", (8,)),
    ("gpt2-small-12l", (2, 4)),
    ("gpt2-small-12l", (2, 2, 2)),
    ("gpt2-medium-24l", (8,)),
    ("gpt2-medium-24l", (2, 4)),
    ("gpt2-xl-48l", (8,)),
    ("gpt2-xl-48l", (2, 4)),
    ("gpt2-xl-48l", (8, 8, 16)),
    ("llama-8b", (8, 8)),
]
# the rest of issue 11's models x meshes: `--cases` with `--add` merges them into the results (long: ~30 min)
MORE = [
    ("gpt2-medium-24l", (2, 2, 2)),
    ("gpt2-medium-24l", (8, 8, 16)),
    ("gpt2-xl-48l", (2, 2, 2)),
    ("llama-8b", (8,)),
    ("llama-8b", (2, 4)),
    ("llama-8b", (2, 2, 2)),
    ("llama-8b", (8, 8, 16)),
]
# traced models: what builds the user's model and batch (timed apart, as `build_model_s`: not MetaDist's work)
TRACED = {"llama-8b": lambda: build_llama_8b(), "gpt2-medium-24l": lambda: build_gpt2_medium()}
QUICK = [("gpt2-small-12l", (2, 4))]
HAND_ROLES = {
    1: {"DP": ("dp",), "ZeRO-3": ("fsdp",), "Megatron-TP": ("tp",)},
    2: {"DP": ("dp", "dp"), "ZeRO-3": ("fsdp", "fsdp"), "Megatron-TP": ("tp", "tp"), "TPxDP": ("dp", "tp")},
    3: {"DP": ("dp",) * 3, "ZeRO-3": ("fsdp",) * 3, "Megatron-TP": ("tp",) * 3, "TPxDP": ("dp", "dp", "tp")},
}
# the strategy preset that pins each family where benchmarks.solvers' hand pins cannot read the graph
PRESET_OF = {"DP": "ddp", "ZeRO-3": "zero3", "Megatron-TP": "tp", "TPxDP": "tp+dp"}
# PyTorch AutoParallel on GPT-2 small (3,468 graph nodes), fake world of 8, measured on this machine (NOTES.md)
AUTOPARALLEL = [
    {
        "model": "gpt2-small-12l",
        "mesh": "8",
        "system": "PyTorch AutoParallel",
        "cold": True,
        "total_s": 24.0,
        "ilp_vars": 13528,
        "note": "measured on this machine",
    },
    {
        "model": "gpt2-small-12l",
        "mesh": "2x4",
        "system": "PyTorch AutoParallel",
        "cold": True,
        "total_s": 168.0,
        "peak_rss_mb": 3000,
        "ilp_vars": 389470,
        "note": "measured on this machine",
    },
]


# --real: LLaMA at the shapes people train; (name, model, mesh, batch, seq, memory_budget bytes or None)
GiB = 2**30
LLAMA_SIZES = {
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}
REAL = {
    "8b": ("llama-8b", (8, 8), 64, 4096, None),
    "8b-80g": ("llama-8b", (8, 8), 64, 4096, 80 * GiB),
    "70b": ("llama-70b", (8, 8, 8), 64, 4096, None),
    "8b-131k": ("llama-8b", (8, 8), 1, 131072, 80 * GiB),
    "8b-131k-nocp": ("llama-8b", (8, 8), 1, 131072, 80 * GiB),
    "qwen3-moe": ("qwen3-moe-30b", (8, 8), 8, 4096, 80 * GiB),
    "dsv3-like": ("deepseek-v3-like", (8, 8), 8, 4096, 80 * GiB),
}
# dense models beside LLaMA whose every op must get its rules at 64 x 4,096 (transformers' config class, sizes)
DENSE_SIZES = {
    "qwen2-7b": (
        "Qwen2",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            num_hidden_layers=28,
            vocab_size=152064,
        ),
    ),
    "qwen3-8b": (
        "Qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=36,
            vocab_size=151936,
        ),
    ),
    "mistral-7b": (
        "Mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=32,
            vocab_size=32000,
            sliding_window=4096,
        ),
    ),
}


def dense_on_meta(name: str, batch: int, seq: int, layers: int | None = None, use_cache: bool = False):
    """transformers' causal LM of :data:`DENSE_SIZES` ``name`` (``layers``: instead of its own depth) on the
    meta device, and a batch of ``batch`` x ``seq`` token ids."""
    import torch
    import transformers

    from ._models import _build, _quiet_transformers

    _quiet_transformers()
    family, sizes = DENSE_SIZES[name]
    sizes = {**sizes, **({} if layers is None else {"num_hidden_layers": layers})}
    config = getattr(transformers, f"{family}Config")(max_position_embeddings=seq, use_cache=use_cache, **sizes)
    model = _build(getattr(transformers, f"{family}ForCausalLM"), config, "meta")
    return model, torch.randint(0, config.vocab_size, (batch, seq), device="meta")


# mixtures of experts at the shapes they train: Qwen3-30B-A3B (48 layers, 128 experts of width 768, top-8), and
# DeepSeek-V3's layer (latent attention, 256 routed experts beside a shared one, top-8 of 8 groups, the first
# layer dense) at width 2,048 and 27 layers; built on the meta device
MOE_SIZES = {
    "qwen3-moe-30b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=151936,
    ),
    "deepseek-v3-like": dict(
        hidden_size=2048,
        intermediate_size=8192,
        moe_intermediate_size=512,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=1,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=129280,
    ),
}
# the long-sequence cases: built with transformers' default use_cache (SDPA called with is_causal=True; with
# use_cache=False it materialises the causal mask, which context parallelism refuses), and planned with the
# distributed implementations torch lowers offered to the solver (context-parallel attention), or without
# them ("impls": False) for the same budget
REAL_OPTS: dict[str, dict] = {
    "8b-131k": {"use_cache": True, "impls": True},
    "8b-131k-nocp": {"use_cache": True, "impls": False},
    "qwen3-moe": {"impls": True},
    "dsv3-like": {"impls": True},
}
# 70B is planned only where the 8B cases stayed under this (MB; the 70B under an 80 GiB budget once passed 24 GB)
REAL_GATE_MB = 10_000
# the hand plans priced beside each real plan: MetaDist's strategy presets on the same problem and cost model
REAL_HAND = ("fsdp", "tp+dp")


def build_llama(model: str, batch: int, seq: int, use_cache: bool = False):
    """LLaMA-3-like ``model`` (vocabulary 128,256, 8 key-value heads, head 128) on the meta device and a
    batch of ``batch`` x ``seq`` token ids."""
    return llama_on_meta(
        batch,
        seq,
        use_cache=use_cache,
        vocab_size=128256,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=max(seq, 2048),
        **LLAMA_SIZES[model],
    )


def build_real(model: str, batch: int, seq: int, use_cache: bool = False):
    """A --real case's model on the meta device and its batch: LLaMA (:func:`build_llama`) or a mixture of
    experts of :data:`MOE_SIZES`."""
    if model not in MOE_SIZES:
        return build_llama(model, batch, seq, use_cache=use_cache)
    import torch

    from benchmarks._models import deepseek_v3, qwen3_moe

    build = qwen3_moe if model.startswith("qwen3") else deepseek_v3
    built = build(seed=None, device="meta", use_cache=use_cache, max_position_embeddings=seq, **MOE_SIZES[model])
    return built, torch.randint(0, built.config.vocab_size, (batch, seq), device="meta")


@contextlib.contextmanager
def dense_experts(model):
    """While inside, each experts module of ``model`` runs as one dense MLP (its first expert's weights on every
    token, scaled by the token's routing weights so that the router stays in the step): what ``make_fx`` can
    trace of a mixture of experts, whose routed sizes are data."""
    from metadist_torch.moe.experts_ffn import expert_forward, plain_gated
    from metadist_torch.moe.moe import experts_modules

    mods = [m for _, m in experts_modules([model])]
    for m in mods:
        act = plain_gated(m) or "silu"
        m.forward = lambda h, i, w, _m=m, _a=act: (
            expert_forward(h, _m.gate_up_proj[0], _m.down_proj[0], _a) * w.sum(-1, keepdim=True)
        )
    try:
        yield len(mods)
    finally:
        for m in mods:
            del m.forward


def yardstick(model, ids) -> tuple[float, int]:
    """Seconds and nodes of torch's own ``make_fx`` of ``model``'s forward and backward on fake tensors
    (``functional_call`` + ``torch.autograd.grad``; ``_allow_non_fake_inputs`` for the meta buffers): what
    tracing the same step costs torch alone, without the optimizer. A mixture of experts is traced with each
    experts module as one dense MLP (:func:`dense_experts`)."""
    with dense_experts(model):
        return _make_fx_seconds(model, ids)


def _make_fx_seconds(model, ids) -> tuple[float, int]:
    import torch
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())

    def fwd_bwd(params, buffers, ids):
        loss = functional_call(model, {**params, **buffers}, (), {"input_ids": ids, "labels": ids}).loss
        return loss, torch.autograd.grad(loss, list(params.values()))

    t = time.perf_counter()
    gm = make_fx(fwd_bwd, tracing_mode="fake", _allow_non_fake_inputs=True)(params, buffers, ids)
    return time.perf_counter() - t, len(gm.graph.nodes)


class _Replicated:
    """Counts discovery's "op ... runs replicated" warnings (and the op keys they name)."""

    def __init__(self):
        import logging

        self.keys: dict[str, int] = {}
        outer = self

        class H(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "runs replicated" in msg:
                    key = msg.split()[1] if msg.startswith("op ") else msg[:60]
                    outer.keys[key] = outer.keys.get(key, 0) + 1

        self.handler = H(level=logging.WARNING)
        logging.getLogger("metadist.discover").addHandler(self.handler)


def replicated_ops(graph, book, mesh_shape) -> tuple[int, list[str]]:
    """Ops of ``graph`` whose rules (on any of the mesh's axis sizes) say they run replicated, and their keys."""
    n, keys = 0, {}
    for op in graph.ops:
        for size in sorted(set(mesh_shape)):
            e = book.lookup(op, graph, size)
            if e is not None and e.status != "ok":
                n += 1
                keys[op.key] = keys.get(op.key, 0) + 1
                break
    return n, [f"{k} x{c}" for k, c in sorted(keys.items(), key=lambda kv: -kv[1])]


def _plan_figures(res, prefix: str = "") -> dict:
    """A plan's memory, predicted step, budget and recomputation as flat record fields."""
    from metadist_core.plan import memprofile

    plan = res.plan
    peak = plan.stats.peak_with_buffers or memprofile.peak_with_buffers(res.problem, plan)
    budget = plan.stats.budget or {}
    rc = plan.stats.recompute or {}
    out = {
        "plan_gib": peak / GiB,
        "step_s": plan.objective,
        "gap": plan.gap,
        "recompute_segments": rc.get("segments", 0),
        "fits_budget": None if not budget.get("bytes") else peak <= budget["bytes"],
    }
    return {prefix + k: v for k, v in out.items()}


def run_real(case: str, cache: str, warm: bool, hand: bool, time_limit: float) -> dict:
    """One --real case in this process: yardstick, trace, cold plan_graph (a fresh cache), then a warm one."""
    import gc

    import torch

    torch.set_num_threads(1)
    from metadist_core.config import load_settings
    from metadist_core.cost.model import DEVICE_PRESETS
    from metadist_core.driver.compile import plan_graph
    from metadist_core.plugins import PluginManager
    from metadist_core.cost.profile import load_profile
    from metadist_core.plan.explain import impl_lines

    model, mesh_shape, batch, seq, budget = REAL[case]
    opts = REAL_OPTS.get(case, {})
    rec = {
        "case": case,
        "model": model,
        "tokens": f"{batch}x{seq}",
        "mesh": "x".join(map(str, mesh_shape)),
        "system": "MetaDist (ilp)",
    }
    t0 = time.perf_counter()
    built = build_real(model, batch, seq, use_cache=opts.get("use_cache", False))
    rec["build_model_s"] = time.perf_counter() - t0
    rec["params_b"] = sum(p.numel() for p in built[0].parameters()) / 1e9
    rec["yardstick_s"], rec["yardstick_nodes"] = yardstick(*built)
    gc.collect()
    rec["rss_after_yardstick_mb"] = _peak_rss_mb()
    rep = _Replicated()
    t0 = time.perf_counter()
    graph = trace_lm(*built)
    rec["trace_s"] = time.perf_counter() - t0
    rec["graph_ops"] = len(graph.ops)
    pm = PluginManager()
    mesh = load_profile().mesh(mesh_shape)
    settings = load_settings(cache_dir=cache, progress=False, time_limit=time_limit, memory_budget=budget)
    traits = None
    if "impls" in opts:  # the same traits as the other cases, with or without torch's distributed implementations
        from dataclasses import replace

        from metadist_core.driver.frontend import FrontendTraits
        from metadist_torch.plugin import TRAITS

        traits = replace(FrontendTraits(), dist_impls=TRAITS.dist_impls if opts["impls"] else None)
    try:
        res = plan_graph(graph, mesh, plugins=pm, settings=settings, device=DEVICE_PRESETS["a100"], traits=traits)
    except ValueError as e:  # no plan fits: the record says so, with the smallest memory the solver found
        rec["note"] = f"no plan: {str(e)[:300]}"
        return rec
    t = res.timings
    b = res.plan.stats.budget or {}
    rec.update(
        {
            "budget_gib": None if b.get("bytes") is None else b["bytes"] / GiB,
            "budget_from": "memory_budget" if b.get("explicit") else "default (preset less reserve)",
            "budget_source": b.get("source"),
            "discover_s": t.get("discover", 0.0),
            "build_problem_s": t.get("build_problem", 0.0),
            "solve_s": t.get("solve", 0.0),
        }
    )
    rec["plan_s"] = sum(t.values())
    rec["total_s"] = rec["trace_s"] + rec["plan_s"]
    rec["ratio"] = rec["total_s"] / rec["yardstick_s"]
    rec.update(_plan_figures(res))
    rec["replicated_ops"], rec["replicated_keys"] = replicated_ops(res.graph, res.rulebook, mesh_shape)
    impls = [i for st in res.plan.strategies.values() for i in st.impls if i]
    rec["cp_ops"] = sum(1 for i in impls if i.startswith("cp_attention"))
    rec["ep_ops"] = sum(1 for i in impls if i.startswith("moe.ep"))
    rec["seq_split"] = "; ".join(line.strip() for line in impl_lines(res.plan)[2:]) or None
    rec["replicated_warnings"] = sum(rep.keys.values())
    rec["patterns"] = len(res.rulebook.entries)
    rec["peak_rss_mb"] = _peak_rss_mb()
    rec["children_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    print(json.dumps({"partial": rec}, default=float), flush=True)  # what the parent keeps if the rest is stopped
    if warm:  # the same graph and cache: the rules and the kept ILP answer are read back
        w = plan_graph(graph, mesh, plugins=pm, settings=settings, device=DEVICE_PRESETS["a100"])
        rec["warm_plan_s"] = sum(w.timings.values())
        rec["warm_solve_s"] = w.timings.get("solve", 0.0)
        rec["warm_ratio"] = (rec["trace_s"] + rec["warm_plan_s"]) / rec["yardstick_s"]
        rec["warm_same_plan"] = abs(w.plan.objective - res.plan.objective) <= 1e-9 * max(1.0, res.plan.objective)
        rec["peak_rss_mb"] = _peak_rss_mb()
        del w
    if hand:  # the FSDP x TP family's hand plans: the presets' pins on the same problem, priced and solved alike
        from metadist_core.plan import memprofile
        from metadist_core.problem.presets import steer

        for name in REAL_HAND + (("ep",) if model in MOE_SIZES else ()):
            t0 = time.perf_counter()
            pinned = steer(res.problem, name)
            try:
                hp = pm.solve("ilp", pinned, {"time_limit": time_limit})
                rec[f"hand_{name}_fits"] = True
            except ValueError as e:  # no plan of the family fits the budget: priced without it, its memory said
                rec[f"hand_{name}_note"] = str(e)[:160]
                rec[f"hand_{name}_fits"] = False
                try:
                    hp = pm.solve("ilp", pinned.with_budget(None), {"time_limit": time_limit})
                except ValueError as e2:
                    rec[f"hand_{name}_note"] += f"; without the budget: {str(e2)[:100]}"
                    continue
            rec[f"hand_{name}_step_s"] = hp.objective
            rec[f"hand_{name}_gib"] = memprofile.peak_with_buffers(res.problem, hp) / GiB
            if rec[f"hand_{name}_fits"] and rec.get("budget_gib"):  # the solver's memory rows leave out the buffers
                rec[f"hand_{name}_fits"] = rec[f"hand_{name}_gib"] <= rec["budget_gib"]
            rec[f"hand_{name}_gap"] = hp.gap
            rec[f"hand_{name}_solve_s"] = time.perf_counter() - t0
            rec[f"vs_{name}"] = res.plan.objective / hp.objective
        rec["peak_rss_mb"] = _peak_rss_mb()
    return rec


def _tree_rss_mb(pid: int) -> float:
    """Resident MB of process ``pid`` and its descendants (discovery forks children), from /proc."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024.0
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def _real_child(case: str, args) -> dict:
    """Run one --real case in a fresh process, watching its resident memory (stopped past ``--rss-limit-gb``
    or ``--case-timeout``): its record, or the partial record it printed and why it was stopped."""
    with tempfile.TemporaryDirectory(prefix="metadist-plan-real-") as cache:
        cmd = [sys.executable, "-m", "benchmarks.plan_scale", "--real-one", case, "--cache", cache]
        cmd += ["--time-limit", str(args.time_limit)] + (["--no-warm"] if args.no_warm else [])
        cmd += [] if args.no_hand else ["--hand"]
        env = dict(os.environ, METADIST_PROGRESS="0")
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=Path(__file__).resolve().parents[1]
            )
            t0, watched, why = time.perf_counter(), 0.0, None
            while proc.poll() is None:
                time.sleep(1.0)
                watched = max(watched, _tree_rss_mb(proc.pid))
                if watched > args.rss_limit_gb * 1024:
                    why = f"stopped: resident memory passed {args.rss_limit_gb:g} GB"
                elif args.case_timeout and time.perf_counter() - t0 > args.case_timeout:
                    why = f"stopped: still running after {args.case_timeout:g} s"
                if why:
                    proc.kill()
                    proc.wait()
            out.seek(0)
            text = out.read()
    rec, partial = None, None
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            partial, rec = d.get("partial", partial), (None if "partial" in d else d)
    if rec is None:
        rec = dict(partial or {"case": case, "model": REAL[case][0], "mesh": "x".join(map(str, REAL[case][1]))})
        rec["note"] = why or f"failed (exit {proc.returncode}): {text.strip()[-400:]}"
        rec.setdefault("system", "MetaDist (ilp)")
    rec["watched_rss_mb"] = watched
    rec["wall_s"] = time.perf_counter() - t0
    return rec


REAL_COLS = [
    "case",
    "model",
    "tokens",
    "mesh",
    "budget_gib",
    "budget_from",
    "trace_s",
    "discover_s",
    "build_problem_s",
    "solve_s",
    "total_s",
    "yardstick_s",
    "ratio",
    "warm_plan_s",
    "warm_ratio",
    "peak_rss_mb",
    "watched_rss_mb",
    "plan_gib",
    "fits_budget",
    "recompute_segments",
    "step_s",
    "gap",
    "replicated_ops",
    "cp_ops",
    "ep_ops",
    "graph_ops",
    "yardstick_nodes",
    "hand_fsdp_step_s",
    "hand_fsdp_gib",
    "hand_fsdp_fits",
    "vs_fsdp",
    "hand_tp+dp_step_s",
    "hand_tp+dp_gib",
    "hand_tp+dp_fits",
    "hand_ep_step_s",
    "hand_ep_gib",
    "note",
]


def main_real(args) -> None:
    """The --real cases, each in a fresh process; 70B only where the 8B cases stayed under REAL_GATE_MB."""
    records = []
    for case in args.real_cases:
        if REAL[case][0] == "llama-70b" and not args.force:
            path = RESULTS / f"{NAME}_real.json"
            kept = json.loads(path.read_text()) if path.exists() else []
            eights = {r["case"]: r for r in kept + records if r.get("case") in ("8b", "8b-80g")}.values()  # newest wins
            worst = max((max(r.get("peak_rss_mb") or 0, r.get("watched_rss_mb") or 0) for r in eights), default=None)
            if (
                len(eights) < 2
                or any(r.get("total_s") is None or r.get("note") for r in eights)
                or worst > REAL_GATE_MB
            ):
                print(f"{case}: not run (the 8B cases did not both finish under {REAL_GATE_MB} MB; --force runs it)")
                continue
        rec = _real_child(case, args)
        records.append(rec)
        print(
            json.dumps({k: rec.get(k) for k in REAL_COLS if k in rec}, default=float),
            flush=True,
        )
    path = RESULTS / f"{NAME}_real.json"
    if path.exists():  # keep the other cases' rows
        new = {r["case"] for r in records}
        records = [r for r in json.loads(path.read_text()) if r.get("case") not in new] + records
        records.sort(key=lambda r: list(REAL).index(r["case"]) if r.get("case") in REAL else len(REAL))
    notes = (
        "LLaMA-3-like models from transformers' LlamaConfig (vocabulary 128,256, 8 key-value heads, head 128) "
        "on the meta device, AdamW, whole step traced by the torch frontend and planned by plan_graph on the "
        "A100 preset (80 GiB), cold rule cache, each case a fresh process. `yardstick_s`: torch's make_fx of "
        "the same model's forward and backward on fake tensors, timed in the same process right before; "
        "`ratio` = (trace + discover + build + solve) / yardstick; `warm_ratio` uses the same trace time and "
        "a second plan_graph on the same cache (rules and kept ILP answer read back). `budget_from`: the "
        "user's memory_budget, or the default (device preset's memory less device_reserve_mb), which binds "
        "only where the plan without a budget does not fit. `plan_gib`: the plan's peak per device with the "
        "collectives' buffers. `step_s`: the cost model's predicted step. `replicated_ops`: ops whose rules say "
        "they run replicated. `peak_rss_mb`: the planning process's own peak; `watched_rss_mb`: the peak of "
        "it and its children sampled each second. hand_*: MetaDist's fsdp and tp+dp presets pinned on the "
        "same (final) problem and solved by the ILP; `hand_*_gib` with the collectives' buffers, `hand_*_fits` "
        "against the same budget (a family no plan of which fits is priced without the budget where that "
        "is solved); `vs_fsdp`: the plan's step over the fsdp hand plan's. The 8b-131k cases: one sequence of "
        "131,072 tokens under an 80 GiB budget, the model built with transformers' default use_cache (SDPA with "
        "is_causal=True), planned with torch's distributed implementations offered to the solver (8b-131k) or "
        "without them (8b-131k-nocp); `cp_ops`: the ops the plan runs through one (context-parallel attention), "
        "`seq_split`: where (explain's lines). The MoE cases (qwen3-moe: Qwen3-30B-A3B's config; dsv3-like: "
        "DeepSeek-V3's layer at width 2,048 and 27 layers) at 8 x 4,096 tokens, planned with the distributed "
        "implementations offered (dropless expert parallelism); their yardstick traces each experts module as "
        "one dense MLP (make_fx cannot trace routed sizes); `ep_ops`: the ops the plan runs expert-parallel; "
        "hand_ep: the ep preset on the same problem."
    )
    write_results(
        f"{NAME}_real",
        records,
        REAL_COLS,
        "Planning LLaMA and mixtures of experts at real shapes, against torch's trace",
        notes,
    )
    print(f"wrote {RESULTS / (NAME + '_real.md')}")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_one(
    model: str, mesh_shape: tuple[int, ...], cache: str, hand: bool, time_limit: float, hand_time_limit: float = 300.0
) -> dict:
    """Plan one model on one mesh in this process; the figures as a flat record."""
    import torch

    torch.set_num_threads(1)
    from metadist_core.config import load_settings
    from metadist_core.cost.model import DEVICE_PRESETS
    from metadist_core.driver.compile import plan_graph
    from metadist_core.plugins import PluginManager
    from metadist_core.cost.profile import load_profile
    from metadist_core.ir.recorded import load_recorded_graph

    t0 = time.perf_counter()
    built = TRACED[model]() if model in TRACED else None  # the transformers import and the model on meta
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = trace_lm(*built) if built else load_recorded_graph(GRAPHS / f"{model}-adamw.json")
    t_load = time.perf_counter() - t0
    pm = PluginManager()
    mesh = load_profile().mesh(mesh_shape)
    settings = load_settings(cache_dir=cache, progress=False, time_limit=time_limit)
    res = plan_graph(graph, mesh, plugins=pm, settings=settings, device=DEVICE_PRESETS["a100"])
    plan = res.plan
    sizes = plan.stats.extra.get("sizes", {})
    rec = {
        "model": model,
        "mesh": "x".join(map(str, mesh_shape)),
        "system": "MetaDist (ilp)",
        "graph_ops": len(graph.ops),
        "patterns": len(res.rulebook.entries),
        "patterns_discovered": res.rulebook.discovered,
        "build_model_s": t_build if built else None,
        "trace_s": t_load,
        **{f"{k}_s": v for k, v in res.timings.items()},
        "total_s": t_load + sum(res.timings.values()),
        "objective_ms": plan.objective * 1e3,
        "gap": plan.gap,
        "decisions": len(res.problem.nodes),
        "decisions_coarse": (sizes.get("tied") or sizes.get("fixed") or sizes.get("fine") or {}).get("nodes"),
        "ilp_vars": plan.stats.extra.get("variables"),
        "peak_rss_mb": _peak_rss_mb(),
        "solve_method": "axis descent" if "descent" in str(plan.stats.status or "") else "one ILP",
    }
    if hand:
        from metadist_core.problem.presets import steer
        from .solvers import constrained, discovered_info, hand_pins

        try:  # the recorded GPT-2 graphs: pins written from its layout (benchmarks/solvers.py)
            info = discovered_info(graph, {}) if model.startswith("gpt2") else None
        except ValueError:  # a traced graph whose parameters do not read as the recorded GPT-2 layout
            info = None
        best = None
        for name, roles in HAND_ROLES[len(mesh_shape)].items():
            ways = [("pins", lambda: constrained(res.problem, hand_pins(info, mesh_shape, roles)))] if info else []
            # else, or where those pins do not fit this graph: the family as MetaDist's strategy preset pins it
            ways.append(("preset", lambda: steer(res.problem, PRESET_OF[name])))
            for how, make in ways:
                try:
                    hp = pm.solve("ilp", make(), {"time_limit": max(time_limit, hand_time_limit)})
                except ValueError as e:  # a family that cannot hold this model on this mesh (memory), or whose
                    # pins this graph's rules do not allow (the traced medium step's optimizer state)
                    rec["note"] = (rec.get("note", "") + f" no {name} plan by {how}: {str(e)[:100]};").strip()
                    continue
                rec[f"hand_{name}_ms"] = hp.objective * 1e3
                rec[f"hand_{name}_from"] = how
                rec[f"hand_{name}_gap"] = hp.gap  # not 0: the ILP stopped at time_limit, the hand plan may be dearer
                best = hp.objective if best is None else min(best, hp.objective)
                break
        rec["vs_best_hand"] = None if best is None else plan.objective / best
    return rec


def build_gpt2_medium():
    """transformers' GPT2LMHeadModel at medium size (24 layers, width 1,024, 16 heads, vocabulary 50,257; no recorded
    medium step is kept), built on the meta device, and a batch of 8 x 128 as the recorded steps."""
    import torch

    model = gpt2(
        seed=None,
        device="meta",
        released=True,
        n_layer=24,
        n_embd=1024,
        n_head=16,
        vocab_size=50257,
        n_positions=1024,
        use_cache=False,
    )
    return model, torch.randint(0, model.config.vocab_size, (8, 128), device="meta")


def trace_lm(model, ids):
    """The whole training step of a causal LM with AdamW, traced by the torch frontend."""
    from metadist_core.plugins import PluginManager

    return PluginManager().frontend("torch").trace(lm_step, (model, adamw(model, 1e-4), ids), {}).graph


def llama_on_meta(batch: int, seq: int, use_cache: bool = False, **sizes):
    """transformers' LlamaForCausalLM of the ``LlamaConfig`` ``sizes``, built on the meta device (nothing
    allocated), and a batch of token ids ``batch`` x ``seq`` on meta."""
    import torch

    model = llama(seed=None, device="meta", pad_token_id=None, use_cache=use_cache, **sizes)
    return model, torch.randint(0, model.config.vocab_size, (batch, seq), device="meta")


def build_llama_8b():
    """LLaMA at 8B (32 layers, hidden 4096, 32 heads, 8 key-value heads, vocabulary 128,256) on the meta
    device, and a batch of 8 x 512."""
    return llama_on_meta(
        8,
        512,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=2048,
    )


def _child(
    model: str,
    mesh_shape: tuple[int, ...],
    cache: str,
    hand: bool,
    time_limit: float,
    timeout: float | None = None,
    hand_time_limit: float = 300.0,
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.plan_scale",
        "--one",
        model,
        "x".join(map(str, mesh_shape)),
        "--cache",
        cache,
        "--time-limit",
        str(time_limit),
        "--hand-time-limit",
        str(hand_time_limit),
    ] + (["--hand"] if hand else [])
    env = dict(os.environ, METADIST_PROGRESS="0")
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=timeout
        )
    except subprocess.TimeoutExpired:  # a row that says so, not a missing row
        return {
            "model": model,
            "mesh": "x".join(map(str, mesh_shape)),
            "system": "MetaDist (ilp)",
            "total_s": None,
            "note": f"did not plan within {timeout:g} s (stopped)",
        }
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(records: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ours = [r for r in records if r["system"].startswith("MetaDist")]
    cases = list(dict.fromkeys((r["model"], r["mesh"]) for r in ours))
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(cases)), 4.5))
    phases = ["trace_s", "discover_s", "build_problem_s", "solve_s"]
    runs = ("nothing", "rules", "rules+ILP")
    for k, cached in enumerate(runs):
        bottom = [0.0] * len(cases)
        for ph, color in zip(phases, ("#888", "#d62", "#48c", "#3a3")):
            ys = [
                next(
                    (
                        r.get(ph) or 0.0
                        for r in ours
                        if (r["model"], r["mesh"]) == c
                        and r.get("cached", "nothing" if r["cold"] else "rules") == cached
                    ),
                    0.0,
                )
                for c in cases
            ]
            ax.bar(
                [i + 0.27 * k for i in range(len(cases))],
                ys,
                0.25,
                bottom=bottom,
                color=color,
                label=ph[:-2] if k == 0 else None,
                alpha=(1.0, 0.65, 0.35)[k],
            )
            bottom = [b + y for b, y in zip(bottom, ys)]
    for r in records:
        if r["system"] == "PyTorch AutoParallel" and (r["model"], r["mesh"]) in cases:
            i = cases.index((r["model"], r["mesh"]))
            ax.plot([i - 0.15, i + 0.7], [r["total_s"]] * 2, "k--", lw=1)
            ax.text(i + 0.27, r["total_s"], "AutoParallel", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + 0.27 for i in range(len(cases))])
    ax.set_xticklabels([f"{m}\n{mesh}\ncold|rules|+ILP" for m, mesh in cases], fontsize=7)
    ax.set_ylabel("seconds from graph to plan")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(0, 300)
    ax.legend(fontsize=7)
    ax.set_title("MetaDist planning time at real model sizes (2-core CPU); cached: nothing | rules | rules+ILP answer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 small on (2,4) only (< 2 min)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "MESH"), help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument(
        "--hand-time-limit",
        type=float,
        default=300.0,
        help="seconds each hand plan's ILP may take (reference prices, not timed; LLaMA-8B's on (8,8) "
        "take 8-13 s each)",
    )
    ap.add_argument(
        "--cases", nargs="+", metavar="MODEL:MESH", help="only these cases (say gpt2-small-12l:2x4 llama-8b:8x8)"
    )
    ap.add_argument(
        "--add",
        action="store_true",
        help="merge these cases into the existing results (replacing their rows) instead of starting anew",
    )
    ap.add_argument("--more", action="store_true", help="also the models x meshes outside the default set (MORE)")
    ap.add_argument(
        "--case-timeout",
        type=float,
        default=None,
        help="seconds a case (cold or warm) may take before it is stopped and reported as such",
    )
    ap.add_argument("--real", action="store_true", help="LLaMA 8B / 70B at 64 x 4,096 against torch's make_fx")
    ap.add_argument("--real-cases", nargs="+", choices=list(REAL), default=list(REAL), help="which --real cases")
    ap.add_argument("--real-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-warm", action="store_true", help="--real: no second (warm) plan_graph")
    ap.add_argument("--no-hand", action="store_true", help="--real: no hand plans (fsdp, tp+dp presets)")
    ap.add_argument("--rss-limit-gb", type=float, default=12.0, help="--real: stop a case past this resident GB")
    ap.add_argument("--force", action="store_true", help="--real: plan 70B even where the 8B cases did not pass")
    args = ap.parse_args(argv)
    if args.real_one:
        rec = run_real(args.real_one, args.cache, not args.no_warm, args.hand, args.time_limit)
        print(json.dumps(rec, default=float))
        return
    if args.real:
        main_real(args)
        return
    if args.one:
        model, mesh = args.one
        rec = run_one(
            model, tuple(int(x) for x in mesh.split("x")), args.cache, args.hand, args.time_limit, args.hand_time_limit
        )
        print(json.dumps(rec, default=float))
        return
    records = []
    cases = QUICK if args.quick else CASES + (MORE if args.more else [])
    if args.cases:
        cases = [(c.split(":")[0], tuple(int(x) for x in c.split(":")[1].split("x"))) for c in args.cases]
    runs = [("nothing", True), ("rules", False), ("rules+ILP", False)]  # what the cache holds before the run
    for model, mesh_shape in cases:
        with tempfile.TemporaryDirectory(prefix="metadist-plan-scale-") as cache:
            for cached, cold in runs:
                if cached == "rules":  # the rules the cold run found, but no kept ILP answer: the MILP is solved
                    shutil.rmtree(Path(cache) / "milp", ignore_errors=True)
                rec = _child(
                    model,
                    mesh_shape,
                    cache,
                    hand=cached == "rules+ILP",
                    time_limit=args.time_limit,
                    timeout=args.case_timeout,
                    hand_time_limit=args.hand_time_limit,
                )
                rec["cold"], rec["cached"] = cold, cached
                records.append(rec)
                label = "cold" if cold else f"warm, {cached} cached"
                if rec["total_s"] is None:
                    print(f"{model} on {rec['mesh']} ({label}): {rec['note']}", flush=True)
                    break
                print(
                    f"{model} on {rec['mesh']} ({label}): total {rec['total_s']:.1f} s "
                    f"(load {rec['trace_s']:.1f}, discover {rec.get('discover_s', 0):.1f}, build "
                    f"{rec.get('build_problem_s', 0):.1f}, solve {rec.get('solve_s', 0):.1f}), "
                    f"{rec['patterns']} patterns, peak {rec['peak_rss_mb']:.0f} MB, gap {rec['gap']}"
                    + (f", vs best hand {rec['vs_best_hand']:.3f}" if rec.get("vs_best_hand") else ""),
                    flush=True,
                )
    if args.add and (RESULTS / f"{NAME}.json").exists():  # keep the other cases' rows, in their order
        new = {(r["model"], r["mesh"]) for r in records}
        old = [
            r
            for r in json.loads((RESULTS / f"{NAME}.json").read_text())
            if r["system"].startswith("MetaDist") and (r["model"], r["mesh"]) not in new
        ]
        records = old + records
    records += AUTOPARALLEL
    cols = [
        "model",
        "mesh",
        "system",
        "cold",
        "cached",
        "total_s",
        "build_model_s",
        "trace_s",
        "discover_s",
        "build_problem_s",
        "solve_s",
        "peak_rss_mb",
        "patterns",
        "decisions",
        "decisions_coarse",
        "solve_method",
        "gap",
        "vs_best_hand",
        "ilp_vars",
        "note",
    ]
    notes = (
        "Graphs: the recorded GPT-2 whole steps in tests/data/graphs (batch 8 x 128 tokens; `trace_s` is loading "
        "the recorded graph) and transformers' LlamaForCausalLM at 8B built on the meta device with AdamW, batch "
        "8 x 512 (`trace_s` is the torch frontend's real trace; importing transformers and building the model on the "
        "meta device, `build_model_s`, is the user's own work and not in `total_s`). Rules: ShardCombine through the PyTorch op runner, once per op pattern at two proxy "
        "sizes per mesh axis size. `cached`: what the cache held before the run (nothing: cold; rules: the rules "
        "the cold run found, the ILP solved again; rules+ILP: also the ILP's kept answer for the same problem, "
        "solvers/_cache.py). `build_problem_s` includes the ops' costs. "
        "Cost model: A100-like fp32 roofline, default two-level mesh profile. "
        "`vs_best_hand`: the plan's cost over the best hand plan (DP, ZeRO-3, Megatron TP, TPxDP) on the same "
        "cost model (below 1: cheaper). AutoParallel rows: PyTorch AutoParallel measured on this machine."
    )
    write_results(NAME, records, cols, "Planning at real model sizes", notes)
    png = plot(records, RESULTS / f"{NAME}.png")
    print(f"wrote {RESULTS / (NAME + '.md')}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
