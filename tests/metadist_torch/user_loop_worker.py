"""torchrun worker of tests/metadist_torch/test_user_loop_ranks.py: users' training loops on every rank.

``python -m torch.distributed.run --nproc_per_node=4 user_loop_worker.py OUT_DIR LOOP [LOOP ...]`` runs each
named loop of ``_user_loops.py`` compiled (``strategy="fsdp"``: parameters and optimizer state split over
the ranks, so every re-plan really moves state) against the plain loop run on this rank, then ``divergent``:
a layer frozen on rank 1 only, which every rank must report as an error, not wait forever. Rank 0 writes
``OUT_DIR/report.json``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _user_loops as L  # noqa: E402

RTOL = 1e-4


def divergent(errors: list[str], report: dict) -> None:
    """Rank 1 alone freezes a layer: every rank must stop with the same error naming the disagreement."""
    from metadist_torch import metadist_compile

    model = L.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = metadist_compile(strategy="fsdp")(L.train_step)
    step(model, opt, *L.batch(0))
    if dist.get_rank() == 1:
        model[0].requires_grad_(False)
    t0 = time.perf_counter()
    try:
        step(model, opt, *L.batch(1))
    except RuntimeError as e:
        report.setdefault("divergent", {})[dist.get_rank()] = round(time.perf_counter() - t0, 2)
        if "ranks disagree" not in str(e):
            errors.append(f"divergent: rank {dist.get_rank()}: another error: {e}")
        return
    errors.append(f"divergent: rank {dist.get_rank()} ran on although rank 1 froze a layer alone")


def gpt2_warmup(errors: list[str], report: dict) -> None:
    """transformers' GPT-2 with AdamW, a LambdaLR warm-up stepped after every call and global-norm clipping
    inside the step, 5 steps on mesh (4,) with the solver's own plan: losses and gradient norms as eager's."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    from metadist_torch import metadist_compile

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=32,
        vocab_size=128,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)

    def step(model, opt, ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss, norm

    runs = []
    for m, fn in ((ref, step), (model, metadist_compile()(step))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        got = []
        for s in range(5):
            ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(s))
            loss, norm = fn(m, opt, ids)
            got.append((float(loss), float(norm)))
            sched.step()
        runs.append(got)
    for s, ((a, na), (b, nb)) in enumerate(zip(runs[1], runs[0])):
        if abs(a - b) > RTOL * abs(b) or abs(na - nb) > RTOL * abs(nb):
            errors.append(f"gpt2_warmup: step {s}: loss {a} / grad norm {na}, eager {b} / {nb}")
    report["gpt2_warmup"] = {"compiled": runs[1], "eager": runs[0]}


def _median_us(fn, n: int = 50) -> float:
    """Median microseconds of ``fn()`` over ``n`` calls, every rank starting each call together."""
    import statistics

    ts = []
    for _ in range(n):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return round(1e6 * statistics.median(ts), 1)


def agree_cost(errors: list[str], report: dict) -> None:
    """What deciding which program runs costs per call on every rank: the signature, the guards and the
    all_reduce that makes the ranks agree, beside the same decision unsynchronised, a bare all_reduce of as
    many integers, and the step itself (medians of 50 calls)."""
    from metadist_torch import metadist_compile

    model = L.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = metadist_compile(strategy="fsdp")(L.train_step)
    args = (model, opt, *L.batch(0))
    step(*args)
    synced = _median_us(lambda: step.compile(*args))
    step_us = _median_us(lambda: step(*args))
    step.settings.sync_guards = False
    report["agree"] = {
        "decide_us": synced,
        "decide_unsynced_us": _median_us(lambda: step.compile(*args)),
        "bare_all_reduce_us": _median_us(lambda: dist.all_reduce(torch.zeros(3, dtype=torch.int64))),
        "step_ms": round(step_us / 1e3, 2),
    }


def main() -> int:
    torch.set_num_threads(1)
    out, names = Path(sys.argv[1]), sys.argv[2:]
    from metadist_torch.runtime.engine import ensure_process_group

    ensure_process_group()
    errors: list[str] = []
    report: dict = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            if name == "divergent":
                divergent(errors, report)
            elif name == "agree":
                agree_cost(errors, report)
            elif name == "gpt2_warmup":
                gpt2_warmup(errors, report)
            else:
                errs, info = L.run_both(L.LOOPS[name], RTOL, strategy="fsdp")
                errors += [f"rank {dist.get_rank()}: {e}" for e in errs]
                report[name] = info
        except Exception as e:  # reported by the test, with the traceback
            errors.append(f"{name}: rank {dist.get_rank()}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    stops: list = [None] * dist.get_world_size()  # each rank's seconds to its error, ranks that disagreed
    dist.all_gather_object(stops, report.get("divergent", {}))
    if "divergent" in names:
        report["divergent"] = {r: t for d in stops for r, t in d.items()}
    if dist.get_rank() == 0:
        (out / "report.json").write_text(
            json.dumps({"errors": [e for es in gathered for e in es], "report": report}, indent=1, default=str)
        )
    return 0


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(main())
