"""Solver benchmark: greedy, beam and ILP against hand-written plans on GPT-2 training steps.

    python -m benchmarks.solvers [--quick] [--rules synthetic|discovered] [--time-limit S]

Problems: whole training steps (forward, backward, AdamW) of GPT-2 at 2, 12
and 48 layers on meshes (8,), (2,4), (2,2,2), priced with an A100-like device
(fp32 peak) and the default two-level mesh profile. Rules come from
``RULE_SOURCES`` (``synthetic``: hand-derived rules on synthetic graphs of the
same sizes as tests/data/graphs; ``discovered``: the recorded graphs with rules
from ShardCombine, once the PyTorch op runner exists).

Hand-written plans fix what a person writes by hand (parameter and optimizer
state layout, batch split, residual stream layout) per mesh axis role: ``dp``
(data parallel), ``fsdp`` (ZeRO-3: parameters and state sharded on dim 0),
``tp`` (Megatron: column/row-split weights, vocab-split embedding, replicated
residual); the remaining per-op choices are then filled in as cheaply as that
layout allows (an exact ILP under the pins), so each hand plan is the best
plan of its family on this cost model.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from pathlib import Path


from metadist_core.problem.coarsen import coarsen
from metadist_core.problem.constraints import Pin, apply_constraints
from metadist_core.cost.model import DEVICE_PRESETS
from metadist_core.ir.placement import largest_local_shape
from metadist_core.ir.placement import Replicate, Shard, Sharding
from metadist_core.plugins import PluginManager
from metadist_core.problem.build import build_problem
from metadist_core.driver.compile import op_costs
from metadist_core.cost.profile import load_profile

from ._common import RESULTS, timed, write_results
from .synthetic_gpt2 import Gpt2Graph, build_gpt2
from .synthetic_rules import synthetic_rulebook

NAME = "solvers"
MESHES = [(8,), (2, 4), (2, 2, 2)]
HAND_PLANS = {
    (8,): {"DP": ("dp",), "FSDP": ("fsdp",), "Megatron-TP": ("tp",)},
    (2, 4): {"DP": ("dp", "dp"), "FSDP": ("fsdp", "fsdp"), "Megatron-TP": ("tp", "tp"), "TPxDP": ("dp", "tp")},
    (2, 2, 2): {
        "DP": ("dp", "dp", "dp"),
        "FSDP": ("fsdp", "fsdp", "fsdp"),
        "Megatron-TP": ("tp", "tp", "tp"),
        "TPxDP": ("dp", "dp", "tp"),
    },
}
TP_PARAM = {
    "col_w": Shard(1),
    "col_b": Shard(0),
    "row_w": Shard(0),
    "row_b": Replicate(),
    "ln": Replicate(),
    "wte": Shard(0),
    "wpe": Replicate(),
}


# -- rule sources: the hook point -----------------------------------------------


def synthetic_source(model: str):
    """(graph info, RuleBook) from the synthetic generator and hand-derived rules."""
    g = build_gpt2(model)
    return g, synthetic_rulebook(g.graph)


GPT2_LAYER_KINDS = ["ln", "ln", "col_w", "col_b", "row_w", "row_b", "ln", "ln", "col_w", "col_b", "row_w", "row_b"]
DISCOVERABLE = ("gpt2-tiny-2l", "gpt2-small-12l", "gpt2-xl-48l")  # rules per op pattern, at proxy sizes


def discovered_source(model: str):
    """The recorded graph with rules found by ShardCombine through the PyTorch op runner (rule cache used)."""
    from metadist_core.discovery.discover import discover
    from metadist_core.plugins import PluginManager as PM
    from metadist_core.ir.recorded import load_recorded_graph
    from metadist_core.discovery.rules import RuleBook

    if model not in DISCOVERABLE:
        raise ValueError(f"--rules discovered runs on {', '.join(DISCOVERABLE)}, not {model}")
    path = Path(__file__).resolve().parents[1] / "tests" / "data" / "graphs" / f"{model}-adamw.json"
    graph = load_recorded_graph(path)
    pm = PM()
    sizes = sorted({n for m in MESHES for n in m})
    book = discover(graph, pm, RuleBook.load(), axis_sizes=sizes)
    return discovered_info(graph, op_costs(graph, pm)), book


def discovered_info(graph, costs) -> Gpt2Graph:
    """What the hand plans need of a recorded GPT-2 step: each parameter's role, its optimizer state, the batch.

    Parameters are classified by their position in transformers' GPT2LMHeadModel
    (wte, wpe, 12 per block: ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
    mlp.c_proj, then ln_f); Conv1D weights are [in, out], so c_attn/c_fc split
    columns and the projections split rows in the Megatron hand plan.
    """
    path = graph.name
    params = [v for v in graph.inputs if graph.vars[v].role == "parameter"]
    kinds = ["wte", "wpe"] + GPT2_LAYER_KINDS * ((len(params) - 4) // 12) + ["ln", "ln"]
    if len(kinds) != len(params):
        raise ValueError(f"{path}: {len(params)} parameters do not fit the GPT-2 layout (2 + 12 per block + 2)")
    i = {v: k for k, v in enumerate(params)}
    states = {
        p: tuple(
            v
            for v in graph.inputs
            if graph.vars[v].role == "optimizer_state" and v.rsplit("_", 1)[-1] == p.rsplit("_", 1)[-1]
        )
        for p in params
    }
    return Gpt2Graph(
        graph,
        costs,
        {p: kinds[i[p]] for p in params},
        states,
        [v for v in graph.inputs if graph.vars[v].role == "input"],
        [],
    )


RULE_SOURCES = {"synthetic": synthetic_source, "discovered": discovered_source}


# -- hand plans ------------------------------------------------------------------


def _fits(shape, placements, mesh_shape) -> bool:
    if any(isinstance(p, Shard) and not -len(shape) <= p.dim < len(shape) for p in placements):
        return False  # a 0-d optimizer step count (traced graphs) has no dim to split
    return largest_local_shape(tuple(shape), tuple(placements), tuple(mesh_shape)) is not None


def hand_pins(info, mesh_shape, roles) -> list[Pin]:
    """Pins of a hand-written plan: per mesh axis role, the layout of parameters, state, batch and residual."""
    g = info.graph
    pins = []

    def pin(var, per_axis):
        shape = g.vars[var].shape
        pl = []
        for a, p in enumerate(per_axis):  # drop a split that would leave a device nothing
            trial = pl + [p] + [Replicate()] * (len(per_axis) - a - 1)
            pl.append(p if _fits(shape, trial, mesh_shape) else Replicate())
        pins.append(Pin(var, Sharding(pl)))

    for p, kind in info.params.items():
        per_axis = [Replicate() if r == "dp" else Shard(0) if r == "fsdp" else TP_PARAM[kind] for r in roles]
        for v in (p, *info.states[p]):
            pin(v, per_axis)
    for v in info.batch:
        pin(v, [Replicate() if r == "tp" else Shard(0) for r in roles])
    for v in info.residual:
        pin(v, [Replicate() if r == "tp" else Shard(0) for r in roles])
    return pins


def constrained(problem, pins):
    q = copy.copy(problem)
    q.forget_terms()
    q.allowed = [a.copy() for a in problem.allowed]
    q.constraints = list(pins)
    apply_constraints(q)
    return q


# -- the run ---------------------------------------------------------------------


def run_case(pm, model, mesh_shape, rules, time_limit, beam_width, check_coarsening):
    info, book = RULE_SOURCES[rules](model)
    mesh = load_profile().mesh(mesh_shape)
    build_s, prob = timed(
        lambda: build_problem(info.graph, book, mesh, op_costs=info.op_costs, device=DEVICE_PRESETS["a100"])
    )
    coarse_s, co = timed(lambda: coarsen(prob))
    fine, small = co.fine, co.terms.size()
    base = dict(
        model=model,
        mesh="x".join(map(str, mesh_shape)),
        rules=rules,
        graph_ops=len(info.graph.ops),
        nodes=fine["nodes"],
        options=fine["options"],
        edge_cells=fine["edge_cells"],
        nodes_coarse=small["nodes"],
        options_coarse=small["options"],
        edge_cells_coarse=small["edge_cells"],
        build_s=build_s,
        coarsen_s=coarse_s,
    )
    recs = []
    plans = {}
    for solver, opts in (("ilp", {"time_limit": time_limit}), ("beam", {"beam_width": beam_width}), ("greedy", {})):
        t0 = time.perf_counter()
        plan = pm.solve(solver, prob, opts)
        wall = time.perf_counter() - t0
        plans[solver] = plan
        recs.append(
            {
                **base,
                "system": solver,
                "kind": "solver",
                "solve_s": wall,
                "search_s": plan.stats.extra.get("search_seconds"),
                "objective_ms": plan.objective * 1e3,
                "lower_bound_ms": None if plan.lower_bound is None else plan.lower_bound * 1e3,
                "gap": plan.gap,
                "memory_MiB": plan.memory_per_device / 2**20,
                "ilp_vars": plan.stats.extra.get("variables"),
                "status": plan.stats.status or "",
            }
        )
    for name, roles in HAND_PLANS[tuple(mesh_shape)].items():
        q = constrained(prob, hand_pins(info, mesh_shape, roles))
        t0 = time.perf_counter()
        plan = pm.solve("ilp", q, {"time_limit": time_limit})
        recs.append(
            {
                **base,
                "system": name,
                "kind": "hand",
                "solve_s": time.perf_counter() - t0,
                "objective_ms": plan.objective * 1e3,
                "gap": plan.gap,
                "memory_MiB": plan.memory_per_device / 2**20,
                "status": plan.stats.status or "",
            }
        )
    ilp = plans["ilp"].objective
    best_hand = min(r["objective_ms"] for r in recs if r["kind"] == "hand")
    for r in recs:
        r["vs_ilp"] = r["objective_ms"] / (ilp * 1e3)
        r["vs_best_hand"] = r["objective_ms"] / best_hand
    if check_coarsening:
        t0 = time.perf_counter()
        full = pm.solve("ilp", prob, {"time_limit": time_limit, "coarsen": False})
        recs.append(
            {
                **base,
                "system": "ilp-uncoarsened",
                "kind": "check",
                "nodes_coarse": fine["nodes"],
                "solve_s": time.perf_counter() - t0,
                "objective_ms": full.objective * 1e3,
                "lower_bound_ms": None if full.lower_bound is None else full.lower_bound * 1e3,
                "gap": full.gap,
                "memory_MiB": full.memory_per_device / 2**20,
                "vs_ilp": full.objective / ilp,
                "ilp_vars": full.stats.extra.get("variables"),
                "status": full.stats.status or "",
            }
        )
    return recs


def plot(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("metadist").warning("matplotlib is not installed; no PNG")
        return None
    cases = list(dict.fromkeys((r["model"], r["mesh"]) for r in records))
    systems = list(dict.fromkeys(r["system"] for r in records if r["kind"] != "check"))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(cases)), 8))
    w = 0.8 / len(systems)
    for k, s in enumerate(systems):
        xs, ys, ts = [], [], []
        for i, c in enumerate(cases):
            r = next((r for r in records if (r["model"], r["mesh"]) == c and r["system"] == s), None)
            if r:
                xs.append(i + k * w)
                ys.append(r["vs_ilp"])
                ts.append(r["solve_s"])
        ax1.bar(xs, ys, w, label=s)
        if s in ("ilp", "beam", "greedy"):
            ax2.bar(xs, ts, w, label=s)
    for ax in (ax1, ax2):
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"{m}\n{mesh}" for m, mesh in cases], fontsize=8)
    ax1.axhline(1.0, color="k", lw=0.5)
    ax1.set_ylabel("step cost / ILP optimum")
    ax1.set_yscale("log")
    ax1.legend(fontsize=7, ncol=4)
    ax2.set_ylabel("solve seconds (coarsen + search)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    fig.suptitle("MetaDist solvers vs hand-written plans (same cost model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2- and 12-layer models on fewer meshes (< 2 min)")
    ap.add_argument("--rules", choices=sorted(RULE_SOURCES), default="synthetic")
    ap.add_argument("--time-limit", type=float, default=None, help="ILP time limit per solve (s)")
    ap.add_argument("--beam-width", type=int, default=8)
    args = ap.parse_args(argv)
    if args.rules == "discovered":
        cases = [(m, s) for m in DISCOVERABLE for s in MESHES]
    elif args.quick:
        cases = [("gpt2-tiny-2l", m) for m in MESHES] + [("gpt2-small-12l", (2, 4))]
    else:
        cases = [(m, s) for m in ("gpt2-tiny-2l", "gpt2-small-12l", "gpt2-xl-48l") for s in MESHES]
    tl = args.time_limit or (20.0 if args.quick else 60.0)
    pm = PluginManager()
    records = []
    for model, mesh_shape in cases:
        t0 = time.perf_counter()
        recs = run_case(
            pm,
            model,
            mesh_shape,
            args.rules,
            tl,
            args.beam_width,
            check_coarsening=model == "gpt2-tiny-2l" and not (args.quick and len(mesh_shape) > 2),
        )
        records += recs
        ilp = next(r for r in recs if r["system"] == "ilp")
        print(
            f"{model} on {'x'.join(map(str, mesh_shape))}: nodes {ilp['nodes']} -> {ilp['nodes_coarse']}, "
            f"ilp {ilp['objective_ms']:.3f} ms in {ilp['solve_s']:.2f} s; "
            + ", ".join(f"{r['system']} x{r['vs_ilp']:.3f}" for r in recs if r["system"] != "ilp")
            + f"  [{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )
    cols = [
        "model",
        "mesh",
        "system",
        "kind",
        "nodes",
        "nodes_coarse",
        "options",
        "options_coarse",
        "build_s",
        "solve_s",
        "objective_ms",
        "lower_bound_ms",
        "gap",
        "vs_ilp",
        "vs_best_hand",
        "memory_MiB",
        "ilp_vars",
    ]
    notes = (
        "Cost: seconds per step on the cost model (A100-like fp32 roofline, default mesh profile: intra-node "
        "alpha 10 us, 25 GB/s). `solve_s` is coarsening + search (problem build is `build_s`). "
        "`nodes -> nodes_coarse`: decisions before and after coarsening (followers, fixed, tied layers). "
        "`ilp-uncoarsened` solves the full problem to check that coarsening did not make the optimum worse. "
        "Hand plans are the best plan of their family (pinned layouts, the rest filled in by the ILP)."
    )
    name = NAME if args.rules == "synthetic" else f"{NAME}_{args.rules}"
    write_results(name, records, cols, "Solvers: greedy, beam and ILP vs hand-written plans", notes)
    png = plot(records, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.md')}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
