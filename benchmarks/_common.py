"""Helpers for benchmarks: timing, and writing results/NAME.json, NAME.md and NAME.png."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn: Callable, repeats: int = 1, warmup: int = 0):
    """(median seconds, last result) of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    ts, out = [], None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def williams_order(n: int, r: int) -> list[int]:
    """Round ``r``'s order of ``n`` systems in a Williams design: over ``n`` rounds (``2n`` when ``n`` is
    odd) each system runs in each position equally often *and* runs right after each other system equally
    often. Rotating one order by one each round kept every system's predecessor fixed: on GPT-2 the first
    system always ran right after FSDP2's step, and two rows of one program differed by 5-8 % in four runs."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    order = [(x + r) % n for x in first]
    return order[::-1] if n % 2 and (r // n) % 2 else order


def interleaved(
    runs: "dict[str, Callable[[int], object]]", rounds: int, start: int = 0, before: Callable[[], object] | None = None
) -> dict[str, list[float]]:
    """Seconds of each of ``runs`` (name -> ``run(i)``, one step on batch ``i``) over ``rounds`` rounds of one
    call each, in the orders of :func:`williams_order` (two systems alternate), so that a slow spell of a
    shared machine, and what one system's step leaves behind for the next (freed memory, cold caches), fall
    on all of them alike. ``before()`` runs untimed ahead of every call (a barrier); round ``r`` passes
    ``start + r``. Every rank runs the same order."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for k in williams_order(len(names), r):
            name = names[k]
            if before is not None:
                before()
            t = time.perf_counter()
            runs[name](start + r)
            times[name].append(time.perf_counter() - t)
    return times


def machine() -> str:
    import os

    return f"{platform.machine()} {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def write_results(name: str, records: Sequence[dict], columns: Sequence[str], title: str, notes: str = "") -> Path:
    """Write ``results/NAME.json`` (flat records) and ``results/NAME.md`` (a table of ``columns``)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(list(records), indent=1, default=str))
    lines = [f"# {title}", "", f"Machine: {machine()}.", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in records:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_predicted(
    records: Sequence[dict], path: Path, title: str, label: Callable[[dict], str], xlabel: str = "measured step (ms)"
) -> None:
    """A PNG of each record's ``predicted_ms`` against its ``step_ms`` (records without a prediction left
    out), with the diagonal and the +-25 % band the cost model is held to."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    pts = [r for r in records if r.get("predicted_ms") and r.get("step_ms")]
    for r in pts:
        ax.scatter(r["step_ms"], r["predicted_ms"], s=30)
        ax.annotate(label(r), (r["step_ms"], r["predicted_ms"]), fontsize=7)
    hi = max([1.0] + [max(r["step_ms"], r["predicted_ms"]) for r in pts]) * 1.2
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="predicted = measured")
    ax.plot([0, hi], [0, hi * 0.75], ":", c="grey", lw=0.8)
    ax.plot([0, hi], [0, hi * 1.25], ":", c="grey", lw=0.8, label="+-25 %")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("cost model's prediction (ms)")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
