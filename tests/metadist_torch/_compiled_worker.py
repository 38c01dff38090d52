"""Worker of test_compiled.py: on every rank, for each model asked for, the step compiled with the eager rank
program and with Inductor, each against the single-device step over 3 steps with a learning-rate schedule.

    torchrun --nproc_per_node=N _compiled_worker.py MODELS STRATEGY [OPTION=VALUE ...]

MODELS: comma-separated of gpt (the GPT example), gpt2, llama (transformers, from configs). STRATEGY: a
preset or auto. OPTION=VALUE: more metadist_compile settings (micro_batches=2). Rank 0 writes, per model,
the largest difference of each run from the single-device step and the compile report to $MD_TEST_OUT.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[2] / "examples" / "torch")]

STEPS = 3


def build(name: str):
    """(model, batches, step) of ``name``, its weights drawn from seed 0."""
    import torch

    from benchmarks._models import gpt2, llama_of, lm_step, tokens

    if name == "gpt":
        import gpt

        c = gpt.GPTConfig(layers=2, width=64, seq=32, vocab=128, batch=8)
        torch.manual_seed(0)
        return gpt.GPT(c), [gpt.batch(c, s) for s in range(STEPS)], gpt.train_step
    if name == "gpt2":
        m = gpt2(n_positions=32, n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    else:
        m = llama_of(layers=2, width=64, seq=32, vocab=128)
    return m, [(b,) for b in tokens(128, 8, 32, STEPS)], lm_step


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(m0, batches, step, compiled):
    """Losses and final parameters of STEPS steps of ``step`` (or of it compiled by ``compiled``) with AdamW
    and a halving learning rate."""
    import torch

    m = copy.deepcopy(m0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    fn = step if compiled is None else compiled(step)
    losses = []
    for b in batches:
        losses.append(float(fn(m, opt, *b)))
        sched.step()
    params = torch.cat([full(p).detach().double().flatten() for p in m.parameters()])
    return losses, params, fn


def plan_key(plan) -> str:
    """What the plan chose (each op's strategy, each input's layout), without its prices: the backend prices
    the update differently, and may choose differently."""
    ops = sorted(plan.op_strategies.items())
    inputs = sorted((k, str(v)) for k, v in plan.input_shardings.items())
    return hashlib.sha1(repr((ops, inputs)).encode()).hexdigest()


def main() -> int:
    from metadist_torch import metadist_compile
    from metadist_torch.runtime.engine import ensure_process_group, finish_worker

    rank, _ = ensure_process_group()
    models, strategy, *opts = sys.argv[1:]
    extra = {}
    for o in opts:
        k, v = o.split("=", 1)
        extra[k] = json.loads(v)
    out = {}
    for name in models.split(","):
        m0, batches, step = build(name)
        ref_losses, ref, _ = run(m0, batches, step, None)
        rec = {}
        for backend in ("eager", "inductor"):
            comp = metadist_compile(strategy=strategy, backend=backend, measure_memory=False, **extra)
            losses, params, fn = run(m0, batches, step, comp)
            rec[backend] = {
                "loss_diff": max(abs(a - b) / max(1.0, abs(a)) for a, b in zip(ref_losses, losses)),
                "param_diff": float(((params - ref).abs() / (ref.abs().max())).max()),
                "params": params,
                "compile": fn.plan.stats.compile if fn.plan is not None else None,
                "comm": dict(fn.comm_stats.bytes),
                "plan": plan_key(fn.plan),
            }
        diff = (rec["inductor"]["params"] - rec["eager"]["params"]).abs().max()
        rec["inductor_vs_eager"] = float(diff / ref.abs().max())
        for backend in ("eager", "inductor"):
            del rec[backend]["params"]
        out[name] = rec
    if rank == 0:
        Path(os.environ["MD_TEST_OUT"]).write_text(json.dumps(out))
    finish_worker(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
