"""One GPU: the torch_step models' MetaDist step against eager, measured beside the cost model's price.

    python -m benchmarks.cuda_step [--models gpt,gpt2,llama] [--rounds 30] [--device cuda] [--out F]

The models of :mod:`benchmarks.torch_step` (the GPT example, transformers' GPT-2 with 4 layers width 256,
a LLaMA-style model from a config) at world size 1 on one device (``cuda`` by default; ``--device cpu``
runs the same code here, for its tests). A machine with one GPU cannot run NCCL with 2 or more ranks
(NCCL refuses two ranks on one GPU), so this is what a one-GPU machine can say of the cost model:

- ``eager``: the plain step; ``metadist``: ``metadist_compile()`` of the same step, timed interleaved
  with eager (one step of each per round, the device synchronised around each), medians after warm-up;
- ``predicted_ms``: ``metadist_core.plan.overlap.predict`` of the plan priced on this device's measured rates
  (``Frontend.measure_profile``: matmul FLOP/s, copy bandwidth, per-op dispatch). At world size 1 a step with
  nothing to plan is priced on the built-in CPU rates, so the benchmark compiles with a memory budget of
  1 TiB, which no step here comes near: the one device is then planned, on its own measured rates, and
  the plan is the same (every value whole, nothing recomputed);
- ``max_rel_loss_diff``: the largest relative difference of MetaDist's losses from eager's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback

from .torch_step import MODELS

BIG_BUDGET = 1 << 40  # bytes: far above any step here; makes a one-device step planned on measured rates


def _to(dev, batch):
    return tuple(x.to(dev) for x in batch)


def run_model(name: str, rounds: int, warmup: int, dev: str, cache: str) -> list[dict]:
    """Eager and MetaDist for one model, interleaved; one record each."""
    import torch
    from metadist_core.plan.overlap import predict
    from metadist_torch import metadist_compile

    m = MODELS[name](False, rounds + warmup)
    sync = (lambda: torch.cuda.synchronize()) if dev == "cuda" else (lambda: None)
    batches = [_to(dev, b) for b in m.batches]

    def built():
        model, opt = m.build()  # the optimizer holds the parameters, which .to() moves in place
        return model.to(dev), opt

    me, oe = built()
    mc, oc = built()
    step = metadist_compile(cache_dir=cache, memory_budget=BIG_BUDGET)(m.step)
    t0 = time.perf_counter()
    lc = [float(step(mc, oc, *batches[0]))]
    sync()
    first_s = time.perf_counter() - t0
    le = [float(m.step(me, oe, *batches[0]))]
    te, tc = [], []
    for _i, b in enumerate(batches[1:], 1):
        for fn, mod, opt, losses, times in ((m.step, me, oe, le, te), (step, mc, oc, lc, tc)):
            sync()
            t = time.perf_counter()
            out = fn(mod, opt, *b)
            sync()
            times.append(time.perf_counter() - t)
            losses.append(float(out))
    te, tc = te[warmup:], tc[warmup:]
    pr = predict(step.plan, step.problem)
    device = step.problem.device
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lc, le))
    base = {
        "model": name,
        "model_desc": m.desc,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "rounds": len(tc),
    }
    eager = {**base, "system": "eager", "step_ms": statistics.median(te) * 1e3}
    mine = {
        **base,
        "system": "metadist",
        "step_ms": statistics.median(tc) * 1e3,
        "predicted_ms": pr.step * 1e3,
        "pred_error": (pr.step - statistics.median(tc)) / statistics.median(tc),
        "ratio_vs_eager": statistics.median(tc) / statistics.median(te),
        "first_call_s": first_s,
        "max_rel_loss_diff": rel,
        "ops": sum(1 for n in step.problem.nodes if n.kind == "op"),
        "plan": step.plan.summary(),
        "device_rates": {
            "peak_flops": device.peak_flops,
            "mem_bandwidth": device.mem_bandwidth,
            "op_overhead": device.op_overhead,
        },
    }
    return [eager, mine]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,gpt2,llama", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=None, help="JSON file for the records (default: stdout only)")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks.cuda_step needs a CUDA device; none is visible here (--device cpu runs it on the CPU)",
            file=sys.stderr,
        )
        return 2
    records = []
    with tempfile.TemporaryDirectory() as cache:
        for name in args.models.split(","):
            try:
                recs = run_model(name, args.rounds, args.warmup, args.device, cache)
            except Exception as e:  # one model failing must not hide the others
                recs = [
                    {
                        "model": name,
                        "system": "metadist",
                        "error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc()[-3000:],
                    }
                ]
            for r in recs:
                print(json.dumps(r, default=str), flush=True)
            records += recs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1, default=str)
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
