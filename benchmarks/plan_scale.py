"""Planning at real model sizes: trace (load) / discover / build / solve seconds, cold and warm, peak RSS.

    python -m benchmarks.plan_scale [--quick]

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


def llama_on_meta(batch: int, seq: int, **sizes):
    """transformers' LlamaForCausalLM of the ``LlamaConfig`` ``sizes``, built on the meta device (nothing
    allocated), and a batch of token ids ``batch`` x ``seq`` on meta."""
    import torch

    model = llama(seed=None, device="meta", pad_token_id=None, use_cache=False, **sizes)
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
    args = ap.parse_args(argv)
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
