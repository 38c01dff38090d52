"""Rank worker of test_moe: each case named on the command line trains a mixture-of-experts model for 3 steps with
a compiled step on 4 gloo ranks and, on every rank, the same model eagerly on one device; rank 0 writes per case
the errors found, the losses, and the all_to_all bytes the plan predicts beside those its collectives moved."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _moe_models import (  # noqa: E402
    autocast_step,
    batch,
    deepseek_v3,
    lm_step,
    mixtral,
    one_expert,
    optimizer,
    qwen3_moe,
    qwen_moe,
)

STEPS = 3
SIZE = dict(hidden=128)  # 16 x 32 tokens: enough that moving tokens to their experts beats replicating the layer
BATCH = dict(size=16, seq=32)
CASES = {
    # name: (build, mesh, strategy, step, optimizer, relative tolerance)
    "mixtral_ep": (lambda: mixtral(**SIZE), (4,), "ep", lm_step, "adamw", 1e-4),
    "mixtral_auto_2x2": (lambda: mixtral(**SIZE), (2, 2), "auto", lm_step, "adamw", 1e-4),
    "qwen_ep_2x2": (lambda: qwen_moe(**SIZE), (2, 2), "ep", lm_step, "adamw", 1e-4),
    "qwen_auto": (lambda: qwen_moe(**SIZE), (4,), "auto", lm_step, "adamw", 1e-4),
    "one_expert_ep": (lambda: one_expert(mixtral(top_k=1, **SIZE)), (4,), "ep", lm_step, "adamw", 1e-4),
    # bf16: the experts' sums round in another order than the library's loop (8 bits of mantissa)
    "bf16_ep": (lambda: qwen_moe(**SIZE), (4,), "ep", autocast_step, "sgd", 2e-2),
    # many small experts, top-8: expert parallelism on axis 0, data parallelism on axis 1; SGD, whose update is
    # the gradient itself (Adam's would hide an expert gradient off by a constant factor)
    "qwen3_ep_2x2": (lambda: qwen3_moe(**SIZE), (2, 2), "ep", lm_step, "sgd", 1e-4),
    "qwen3_auto": (lambda: qwen3_moe(**SIZE), (4,), "auto", lm_step, "adamw", 1e-4),
    # latent attention and grouped routing beside a shared expert; one dense layer, one of experts
    "dsv3_ep": (lambda: deepseek_v3(**SIZE), (4,), "ep", lm_step, "adamw", 1e-4),
    # GShard's capacity-padded dispatch, where a capacity factor is set (tokens past it dropped, as on one device)
    "mixtral_capacity_ep": (lambda: mixtral(**SIZE), (4,), "ep", lm_step, "adamw", 1e-4),
}
OPTIONS = {"mixtral_capacity_ep": {"moe_capacity_factor": 2.0}}


def _far(got: torch.Tensor, want: torch.Tensor, rtol: float) -> int:
    """Elements further apart than ``rtol`` (and an absolute floor of a tenth of it); a split parameter whole."""
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    return int(((got - want).abs() > rtol * want.abs() + rtol / 10).sum())


def run(name: str) -> dict:
    from metadist_torch import metadist_compile

    build, mesh, strategy, step_fn, opt_kind, rtol = CASES[name]
    ref, model = build(), build()
    o_ref, opt = optimizer(ref, opt_kind), optimizer(model, opt_kind)
    options = OPTIONS.get(name, {})
    step = metadist_compile(mesh=mesh, strategy=strategy, measure_links=False, **options)(step_fn)
    if options.get("moe_capacity_factor"):  # the reference drops what the dispatch drops
        from metadist_torch.moe.moe import capacity_dispatch, experts_modules

        plain = step_fn

        def step_fn(m, o, ids, _f=options["moe_capacity_factor"], _mesh=mesh):
            with capacity_dispatch([e for _, e in experts_modules([m])], _mesh, _f):
                return plain(m, o, ids)

    errors: list[str] = []
    losses, want = [], []
    for s in range(STEPS):
        losses.append(float(step(model, opt, batch(s, **BATCH))))
        want.append(float(step_fn(ref, o_ref, batch(s, **BATCH))))
        if abs(losses[-1] - want[-1]) > rtol * abs(want[-1]):
            errors.append(f"step {s}: loss {losses[-1]!r}, one device {want[-1]!r}")
    far = total = 0
    for p, q in zip(model.parameters(), ref.parameters()):
        far += _far(p.detach(), q.detach(), rtol)
        total += p.numel()
    # Adam turns a near-zero gradient summed in another order into a whole step of lr: a few in 1e5 may flip
    if far > 1e-4 * total:
        errors.append(f"{far} of {total} parameter elements differ by more than rtol {rtol}")
    from metadist_core.plan.implbytes import moe_dispatch_bytes
    from metadist_core.plan.overlap import priced_collectives

    plan = step.plan  # each reshard once, as the lowering runs it (the plan's edges list one per reader)
    a2a = sum(c.nbytes for _, c in priced_collectives(plan) if c.kind == "all_to_all") if plan.problem else -1
    a2a += moe_dispatch_bytes(step.graph, plan)[0]  # inside the expert-parallel ops
    impls = sorted({i for s in plan.strategies.values() for i in s.impls if i})
    stats = step.comm_stats
    text = plan.explain(presets=False)
    experts = text.split("\nexperts\n", 1)[1].split("\n\n", 1)[0].splitlines() if "\nexperts\n" in text else []
    return {
        "errors": errors,
        "losses": losses,
        "ref": want,
        "plan": plan.summary(),
        "a2a_predicted": int(a2a),
        "a2a_counted": int(stats.bytes.get("all_to_all", 0) // STEPS),
        "a2a_calls": int(stats.calls.get("all_to_all", 0) // STEPS),
        "experts": experts,
        "impls": impls,
    }


if __name__ == "__main__":
    out = {name: run(name) for name in sys.argv[1:]}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(os.environ["MD_TEST_OUT"]).write_text(json.dumps(out, indent=1))
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(0)
