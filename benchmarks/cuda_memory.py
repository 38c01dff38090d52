"""One GPU: MetaDist's step, its optimizer offload and its recomputation, against eager, on the CUDA allocator.

    python -m benchmarks.cuda_memory [--layers 4] [--out results.json]

Needs a CUDA device (it says so and stops without one). transformers' GPT-2 (width 256, built from a
config) with AdamW, on one process (world size 1: MetaDist runs its traced functional program on the
model's device). For each system, the same initial weights and batches:

- ``eager``: the plain step;
- ``metadist``: ``metadist_compile()``;
- ``metadist_offload``: ``metadist_compile(offload="optimizer")``: AdamW's state and update on the host
  (pinned), the rest on the GPU;
- ``metadist_budget``: ``metadist_compile(memory_budget=...)`` at 0.8x the plain plan's predicted
  peak, so that the solver recomputes, and
  ``metadist_budget_offload`` a budget of 0.9x with the optimizer state offloaded (met without recomputing).

Each record: the losses' largest relative difference from eager over the steps, the median step time,
and the CUDA allocator's peak over the second step (:func:`metadist_torch.measure.memory.measure_peak`: the
allocator's peak less what it held besides the state and the batch, ``outside_mb``), and MetaDist's own
``step.memory`` (its first call) beside its prediction. Results go to ``--out`` (JSON) and stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

from ._models import adamw, gpt2, lm_step as _step  # the CPU memory benchmark's model and step

MB = 2**20


def _build(layers: int, seed: int = 0):
    m = gpt2(seed=seed, n_positions=64, n_layer=layers, n_embd=256, n_head=4, vocab_size=512).cuda()
    return m, adamw(m, 1e-3)


def _run(name: str, layers: int, batches: list, ref: list | None, **kw) -> dict:
    import torch

    model, opt = _build(layers)
    if name == "eager":
        fn = _step
    else:
        from metadist_torch import metadist_compile

        fn = metadist_compile(cache_dir="/tmp/metadist-cuda-cache", **kw)(_step)
    t0 = time.perf_counter()
    losses = [float(fn(model, opt, batches[0]))]
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    from metadist_torch.measure.memory import measure_peak, state_tensors

    # the second call, for every system alike: the allocator's peak less what it held besides the state and
    # the batch (the cuBLAS workspace; offloaded state lives on the host and is not the GPU's)
    out, m = measure_peak(lambda: fn(model, opt, batches[1]), state_tensors(model, opt) + [batches[1]])
    losses.append(float(out))
    ts = []
    for b in batches[2:]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses.append(float(fn(model, opt, b)))
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    rec = {
        "system": name,
        "layers": layers,
        "step_ms": statistics.median(ts) * 1e3,
        "first_call_s": first_s,
        "peak_mb": m.peak_bytes / MB,
        "before_mb": m.baseline_bytes / MB,
        "outside_mb": m.outside_bytes / MB,
        "losses": losses,
    }
    if ref is not None:
        rec["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))
    mem = getattr(fn, "memory", None)
    if mem:
        rec.update(
            {
                "method": mem.get("method"),
                "measured_peak_mb": mem.get("measured_peak_bytes", 0) / MB,
                "predicted_peak_mb": mem.get("predicted_peak_bytes", 0) / MB,
                "predicted_solver_mb": mem.get("predicted_solver_bytes", 0) / MB,
            }
        )
    plan = getattr(fn, "plan", None)
    if plan is not None:
        rec["plan"] = plan.summary()
        rec["recompute"] = len(getattr(plan, "recompute", None) or [])
        rec["offload"] = plan.stats.offload
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.cuda_memory needs a CUDA device; none is visible here", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (8, 64), generator=g).cuda() for _ in range(args.steps)]
    records = []
    ref = None
    plain_pred = None
    # (system, options, budget as a fraction of the plain plan's predicted peak: under it the solver must
    # recompute or rely on the offload)
    runs = [
        ("eager", {}, None),
        ("metadist", {}, None),
        ("metadist_offload", {"offload": "optimizer"}, None),
        ("metadist_budget", {}, 0.8),
        ("metadist_budget_offload", {"offload": "optimizer"}, 0.9),
    ]
    for name, kw, fraction in runs:
        if fraction is not None:
            if plain_pred is None:
                continue
            kw = {**kw, "memory_budget": int(plain_pred * fraction * MB)}
        try:
            r = _run(name, args.layers, batches, ref, **kw)
        except Exception as e:  # report and go on: one system failing must not hide the others
            r = {"system": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        r["options"] = dict(kw)
        records.append(r)
        if name == "eager":
            ref = r.get("losses")
        if name == "metadist":
            plain_pred = r.get("predicted_peak_mb")
        print(json.dumps({k: v for k, v in r.items() if k not in ("losses", "trace")}, default=str), flush=True)
        if "trace" in r:
            print(r["trace"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
