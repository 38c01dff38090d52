"""torchrun worker of tests/metadist_torch/test_whole_program.py: the user's program around the compiled step.

``python -m torch.distributed.run --nproc_per_node=4 _whole_program_worker.py OUT CASE [CASE ...]`` runs each
case compiled on mesh (4,) beside the same program run eagerly on one device (on this rank); rank 0 writes
``OUT`` as ``{"errors": [...], "report": {case: {...}}}``. Cases:

- ``nanogpt``: nanoGPT's model.py as it is, trained as its train.py trains (two AdamW param groups, the tied
  lm_head, warm-up + cosine lr written into the param groups every iteration, 2 accumulation micro-steps,
  clipping, an eager eval between iterations), one iteration being the compiled step; then the exported
  state dict, an eager ``generate`` on every rank, and one more compiled iteration.
- ``gpt2``: transformers' GPT-2 trained 2 steps, then its ``generate`` (greedy) called eagerly, a forward
  under ``torch.no_grad()``, and one more compiled step; what an eager call costs beside a plain model's.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "nanogpt"))

RTOL, ATOL = 1e-4, 1e-6


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL)


def _plain(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return not isinstance(t, DTensor)


def _params_equal(errors: list[str], case: str, model: torch.nn.Module, ref: torch.nn.Module) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    want = ref.state_dict()
    for k, v in want.items():
        if k not in got:
            continue  # a tied weight exported once
        g = got[k]
        if not _plain(g) or not _close(g, v):
            errors.append(f"{case}: exported {k} differs from one device's (max {(g - v).abs().max().item():.3g})")


def nanogpt(errors: list[str], report: dict) -> None:
    from model import GPT, GPTConfig

    from metadist_torch import metadist_compile

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    opt = model.configure_optimizers(0.1, 6e-3, (0.9, 0.95), "cpu")
    ref_opt = ref.configure_optimizers(0.1, 6e-3, (0.9, 0.95), "cpu")
    warmup, decay, lr0, min_lr = 2, 6, 6e-3, 6e-4

    def get_lr(it: int) -> float:  # train.py's schedule
        if it < warmup:
            return lr0 * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (decay - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr0 - min_lr)

    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (400,), generator=gen)

    def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - cfg.block_size - 1, (4,), generator=torch.Generator().manual_seed(100 + i))
        x = torch.stack([data[j : j + cfg.block_size] for j in ix])
        y = torch.stack([data[j + 1 : j + 1 + cfg.block_size] for j in ix])
        return x, y

    def iteration(model, optimizer, xs, ys):
        total = 0.0
        for micro in range(2):
            _, loss = model(xs[micro], ys[micro])
            loss = loss / 2
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    @torch.no_grad()
    def estimate_loss(m: torch.nn.Module) -> torch.Tensor:
        m.eval()
        x, y = get_batch(999)
        _, loss = m(x, y)
        m.train()
        return loss

    step = metadist_compile(mesh=(4,))(iteration)
    losses, evals = [], []
    for it in range(4):
        lr = get_lr(it)
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = lr
        if it % 2 == 0:
            e, re = estimate_loss(model), estimate_loss(ref)
            if not _plain(e) or not _close(e, re):
                errors.append(f"nanogpt: eval loss before iteration {it}: {e} against one device's {re}")
            evals.append(float(e))
        xs, ys = zip(*(get_batch(2 * it + k) for k in range(2)))
        xs, ys = torch.stack(xs), torch.stack(ys)
        got, want = step(model, opt, xs, ys), iteration(ref, ref_opt, xs, ys)
        losses.append(float(got))
        if not _close(got, want):
            errors.append(f"nanogpt: iteration {it} loss {float(got)} against one device's {float(want)}")
    _params_equal(errors, "nanogpt", model, ref)
    model.eval()
    ref.eval()
    prompt = torch.zeros((1, 1), dtype=torch.long)
    t = time.perf_counter()
    torch.manual_seed(7)
    out = model.generate(prompt, 4, top_k=1)
    gen_s = time.perf_counter() - t
    torch.manual_seed(7)
    want = ref.generate(prompt, 4, top_k=1)
    if not _plain(out) or not torch.equal(out, want):
        errors.append(f"nanogpt: generate gave {out.tolist()} against one device's {want.tolist()}")
    model.train()
    ref.train()
    xs, ys = zip(*(get_batch(50 + k) for k in range(2)))
    xs, ys = torch.stack(xs), torch.stack(ys)
    got, want = step(model, opt, xs, ys), iteration(ref, ref_opt, xs, ys)
    if not _close(got, want):
        errors.append(f"nanogpt: the iteration after generate: {float(got)} against one device's {float(want)}")
    _params_equal(errors, "nanogpt after generate", model, ref)
    report["nanogpt"] = {"losses": losses, "evals": evals, "generate_s": round(gen_s, 4), "tokens": out.tolist()}


def gpt2(errors: list[str], report: dict) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from metadist_torch import metadist_compile

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def train(model, opt, ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = metadist_compile(mesh=(4,), strategy="fsdp")(train)
    for i in range(3):
        ids = torch.randint(1, 128, (4, 16), generator=torch.Generator().manual_seed(i))
        got, want = step(model, opt, ids), train(ref, ref_opt, ids)
        if not _close(got, want):
            errors.append(f"gpt2: step {i} loss {float(got)} against one device's {float(want)}")
        if i == 1:  # between steps: generate, and a forward under no_grad
            prompt = torch.tensor([[5, 6, 7]])
            kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
            out, want_ids = model.generate(prompt, **kw), ref.generate(prompt, **kw)
            if not torch.equal(out, want_ids):
                errors.append(f"gpt2: generate gave {out.tolist()} against one device's {want_ids.tolist()}")
            with torch.no_grad():
                logits, want_logits = model(ids).logits, ref(ids).logits
            if not _plain(logits) or not _close(logits, want_logits):
                errors.append("gpt2: an eager forward's logits differ from one device's")
            report["gpt2"] = {"tokens": out.tolist(), **_eager_cost(step, model, opt, ref, ids)}


def _eager_cost(step, model, opt, ref, ids) -> dict:
    """Seconds of an eager forward under no_grad: the first after a compiled step (it gathers), a later one
    (kept whole tensors), and the plain model's; medians of 5."""

    def timed(fn) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            fn()
        return time.perf_counter() - t

    first, warm, plain = [], [], []
    for _ in range(5):
        # a compiled call drops the kept tensors: a forward-only step would do, but the eager path alone is
        # what is measured, so the cache is dropped the way a compiled call drops it
        from metadist_torch.runtime.eager import compiled_call

        with compiled_call():
            pass
        first.append(timed(lambda: model(ids)))
        warm.append(timed(lambda: model(ids)))
        plain.append(timed(lambda: ref(ids)))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"eager_first_s": med(first), "eager_warm_s": med(warm), "plain_s": med(plain)}


CASES = {"nanogpt": nanogpt, "gpt2": gpt2}


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    errors: list[str] = []
    report: dict = {}
    for name in names:
        try:
            CASES[name](errors, report)
        except Exception:
            errors.append(f"{name}: rank {dist.get_rank()}: {traceback.format_exc()}")
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"errors": errors, "report": report}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
