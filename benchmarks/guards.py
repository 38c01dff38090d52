"""What a compiled step's watch costs: the guard check per call beside the step, and a re-plan after a guard
fails with warm caches, at world size 1 (one process).

    python -m benchmarks.guards [--quick]

Per model (the GPT example; transformers' GPT-2 where installed), with AdamW and a LambdaLR schedule that
changes the learning rate at every call:

- ``step_ms``: the compiled step (median of interleaved rounds beside the eager step, ``eager_ms``);
- ``check_us``: what every call adds before the program runs: the signature, the guard check and feeding
  the param groups' numbers (median of many calls of ``CompiledStep.compile`` plus ``refresh``);
- ``replan_s``: the first call after a layer is frozen (trace, plan and lower again, the rule cache warm);
- ``unfreeze_s``: the call after it is unfrozen: a re-plan too, since the frozen layer's AdamW step
  counters fell behind the others' and the first program reads them as one;
- ``return_ms``: after one call in eval mode (a re-plan), the call back in train mode, which runs the
  train program kept for that state (no re-plan);
- ``first_compile_s``: the first call of all, for scale.

Writes ``benchmarks/results/guards.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ._common import interleaved, write_results
from ._models import adamw, gpt2, lm_step_labels, tokens

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "torch"))


def _gpt(quick: bool):
    import gpt

    c = gpt.GPTConfig(layers=2 if quick else 4, width=128 if quick else 256, seq=64 if quick else 128)
    model, opt = gpt.build(c)
    return "GPT example", model, opt, lambda i: gpt.batch(c, i), gpt.train_step, model.blocks[0]


def _gpt2(quick: bool):
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    # dropout at transformers' default (0.1), not the benchmarks' 0
    model = gpt2(
        n_layer=2 if quick else 4,
        n_embd=128 if quick else 256,
        n_head=4,
        n_positions=128,
        vocab_size=1024,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    opt = adamw(model, 1e-3)

    def batch(i: int):
        ids = tokens(1024, 8, 64 if quick else 128, [i])[0]
        return ids, ids

    return "transformers GPT-2", model, opt, batch, lm_step_labels, model.transformer.h[0]


def measure(build, quick: bool) -> dict | None:
    from metadist_torch import metadist_compile

    made = build(quick)
    if made is None:
        return None
    name, model, opt, batch, step, layer = made
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    import copy

    ref_model = copy.deepcopy(model)
    ref_opt = type(opt)(
        ref_model.parameters(), **{k: v for k, v in opt.defaults.items() if k in ("lr", "weight_decay", "betas", "eps")}
    )
    compiled = metadist_compile()(step)
    t = time.perf_counter()
    compiled(model, opt, *batch(0))
    first = time.perf_counter() - t
    rounds = 5 if quick else 15
    times = interleaved(
        {
            "metadist": lambda i: (compiled(model, opt, *batch(i)), sched.step()),
            "eager": lambda i: step(ref_model, ref_opt, *batch(i)),
        },
        rounds,
        start=1,
    )
    args = (model, opt, *batch(0))
    n = 200 if quick else 1000
    checks = []
    for _ in range(n):
        t = time.perf_counter()
        res = compiled.compile(*args)
        res.traced.context.refresh()
        checks.append(time.perf_counter() - t)
    assert compiled.replans == 0, compiled.replan_reasons  # a schedule is fed, never re-planned
    layer.requires_grad_(False)
    t = time.perf_counter()
    compiled(model, opt, *batch(1))
    replan = time.perf_counter() - t
    layer.requires_grad_(True)
    t = time.perf_counter()
    compiled(model, opt, *batch(2))
    back = time.perf_counter() - t
    model.eval()
    compiled(model, opt, *batch(3))
    model.train()
    t = time.perf_counter()
    compiled(model, opt, *batch(4))
    ret = time.perf_counter() - t
    return {
        "model": name,
        "eager_ms": 1e3 * statistics.median(times["eager"]),
        "step_ms": 1e3 * statistics.median(times["metadist"]),
        "check_us": 1e6 * statistics.median(checks),
        "check_share_pct": 100 * statistics.median(checks) / statistics.median(times["metadist"]),
        "replan_s": replan,
        "unfreeze_s": back,
        "return_ms": 1e3 * ret,
        "replans": compiled.replans,
        "reasons": "; ".join(compiled.replan_reasons),
        "first_compile_s": first,
        "params": sum(1 for _ in model.parameters()),
        "rounds": rounds,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models, few rounds (about a minute)")
    args = ap.parse_args(argv)
    import os

    os.environ.setdefault("METADIST_PROGRESS", "0")
    os.environ.setdefault("METADIST_CACHE_DIR", tempfile.mkdtemp(prefix="metadist-guards-"))
    records = [r for r in (measure(b, args.quick) for b in (_gpt, _gpt2)) if r is not None]
    path = write_results(
        "guards",
        records,
        [
            "model",
            "params",
            "eager_ms",
            "step_ms",
            "check_us",
            "check_share_pct",
            "replan_s",
            "unfreeze_s",
            "return_ms",
            "replans",
            "first_compile_s",
        ],
        "What a compiled step's watch costs (world size 1)",
        "check_us: signature, guards and the param groups' numbers fed, per call (a LambdaLR "
        "schedule changes the learning rate at every call: 0 re-plans). replan_s: the call after "
        "a layer is frozen (warm rule cache); unfreeze_s: after it is unfrozen (its step "
        "counters fell behind: a re-plan); return_ms: back to train mode after one eval call (the "
        "kept program, no re-plan). Step times: medians of interleaved rounds beside eager.",
    )
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
