"""`metadist demo`: the main job end to end on an embedded default.

Until a framework frontend is installed and launched with torchrun, the demo
plans a transformer block built from the numpy reference ops: it discovers the
rules of every op (progress bar), solves the plan on the mesh, runs the plan
on simulated devices with the plan's own collectives, and prints the loss next
to the single-device loss.
"""
from __future__ import annotations

import time

import numpy as np

from .config import load_settings
from .placement import Mesh
from .plugins import PluginManager


def run_demo(mesh_text: str = "4", solver: str | None = None, cache_dir: str | None = None) -> int:
    from .planner import plan_graph
    from .reference import run_graph, run_local, transformer_block
    from .simulate import simulate

    mesh = Mesh.parse(mesh_text)
    settings = load_settings(solver=solver, cache_dir=cache_dir)
    pm = PluginManager()
    graph = transformer_block(batch=8, seq=16, width=32, hidden=128, name="demo-block")
    print(f"MetaDist demo: a transformer block ({len(graph.ops)} ops, numpy reference frontend) "
          f"on a simulated mesh {mesh} with solver {settings.solver!r}")
    import dataclasses
    result = plan_graph(graph, mesh, plugins=pm, settings=dataclasses.replace(settings, progress=True))
    sizes = sorted({n for n in mesh.shape if n > 1})
    keys = {(e.key, n) for n in sizes for op in graph.ops if (e := result.rulebook.lookup(op, graph, n))}
    n_rules = sum(len(result.rulebook.rules_for(op, graph, n)) for n in sizes
                  for op in graph.unique_signatures().values())
    print(f"rules: {n_rules} verified one-axis rules over {len(graph.unique_signatures())} op signatures and "
          f"{result.rulebook.discovered + result.rulebook.cache_hits} op patterns "
          f"({result.rulebook.cache_hits} read from the cache)")
    del keys
    print(result.plan)

    rng = np.random.default_rng(0)
    inputs = {v: rng.standard_normal(graph.vars[v].shape) for v in graph.inputs}
    t = time.perf_counter()
    ref = run_graph(graph, inputs)
    t_single = time.perf_counter() - t
    t = time.perf_counter()
    outs, _ = simulate(graph, result.plan, mesh, inputs, run_local)
    t_sim = time.perf_counter() - t
    loss = graph.outputs[0]
    diff = abs(float(outs[loss]) - float(ref[loss]))
    print(f"loss: {float(outs[loss]):.10f} on {mesh.size} simulated devices, "
          f"{float(ref[loss]):.10f} on one device (|diff| {diff:.1e})")
    print("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
          + f", one-device step {t_single * 1e3:.1f} ms, simulated step {t_sim * 1e3:.1f} ms")
    return 0 if diff <= 1e-9 * max(1.0, abs(float(ref[loss]))) else 1
