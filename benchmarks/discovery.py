"""Discovery time per op signature and per graph: cold (every op run by ShardCombine) and warm (rule cache).

    python -m benchmarks.discovery [--quick]

Graphs: the numpy reference transformer block at two sizes and, when the
PyTorch frontend is installed, the recorded 2-layer GPT-2 training step
(forward, backward, AdamW) from tests/data/graphs. Writes
benchmarks/results/discovery.{json,md,png}.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from benchmarks._common import RESULTS, write_results
from metadist_core.discovery.discover import discover
from metadist_core.plugins import PluginManager
from metadist_core.reference.plugin import transformer_block
from metadist_core.discovery.rules import RuleBook

GRAPHS = Path(__file__).resolve().parents[1] / "tests" / "data" / "graphs"


def graphs(quick: bool):
    yield "reference block 4x8x16", transformer_block(4, 8, 16, 32, "block-small")
    yield "reference block 8x64x128", transformer_block(8, 64, 128, 512, "block-medium")
    tiny = GRAPHS / "gpt2-tiny-2l-adamw.json"
    if tiny.exists():
        try:
            import metadist_torch  # noqa: F401  (the aten op runner)
        except ImportError:
            logging.warning("metadist_torch is not importable; skipping the recorded GPT-2 graph")
            return
        from metadist_core.ir.recorded import load_recorded_graph

        yield "GPT-2 2-layer step (recorded)", load_recorded_graph(tiny)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="finish within two minutes on a 2-core machine")
    args = ap.parse_args(argv)
    pm = PluginManager()
    per_graph, per_op = [], []
    for name, g in graphs(args.quick):
        with tempfile.TemporaryDirectory() as cache:
            t = time.perf_counter()
            book = discover(g, pm, RuleBook.load(cache), progress=None)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            warm_book = discover(g, pm, RuleBook.load(cache), progress=False)
            warm = time.perf_counter() - t
        sigs = g.unique_signatures()
        statuses = [book.get(s).status for s in sigs]
        per_graph.append(
            {
                "graph": name,
                "ops": len(g.ops),
                "signatures": len(sigs),
                "replicated_only": statuses.count("replicated"),
                "rules": sum(len(book.get(s).rules) for s in sigs),
                "cold_s": round(cold, 3),
                "warm_s": round(warm, 4),
                "warm_cache_hits": warm_book.cache_hits,
                "system": "MetaDist ShardCombine",
            }
        )
        for s, op in sigs.items():
            e = book.get(s)
            per_op.append(
                {
                    "graph": name,
                    "op": op.key,
                    "shapes": s.split("|")[1],
                    "seconds": round(e.seconds, 4),
                    "rules": len(e.rules),
                    "status": e.status,
                    "note": e.note[:80],
                }
            )
        print(f"{name}: {len(sigs)} signatures, cold {cold:.2f}s, warm {warm:.3f}s", flush=True)
    per_op.sort(key=lambda r: -r["seconds"])
    write_results(
        "discovery",
        per_graph + per_op,
        [
            "graph",
            "ops",
            "signatures",
            "replicated_only",
            "rules",
            "cold_s",
            "warm_s",
            "op",
            "shapes",
            "seconds",
            "status",
        ],
        "ShardCombine discovery time",
        "Per graph: cold discovery of every op signature, then warm (read from the rule cache). "
        "Per op signature (slowest first): seconds, rules found, status.",
    )
    _plot(per_op)


def _plot(per_op) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    top = per_op[:20][::-1]
    if not top:
        return
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(top) + 1.2))
    ax.barh([f"{r['op']} {r['shapes'][:28]}" for r in top], [r["seconds"] for r in top])
    ax.set_xlabel("discovery seconds (one op signature)")
    ax.set_title("ShardCombine: slowest op signatures")
    fig.tight_layout()
    fig.savefig(RESULTS / "discovery.png", dpi=110)


if __name__ == "__main__":
    main()
