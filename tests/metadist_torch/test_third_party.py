"""A model we did not write: transformers' GPT2LMHeadModel, built from a config (no download),
compiled whole (forward, backward, AdamW) and compared with the eager single-device step:
in this process at world size 1, and on 2 gloo ranks under torchrun with its state sharded."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    return (model, torch.optim.AdamW(model.parameters(), lr=1e-3)), (ref, torch.optim.AdamW(ref.parameters(), lr=1e-3))


def step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def run(memory_budget=None, steps=3) -> dict:
    """Compiled and eager side by side; the figures the tests check."""
    import torch
    from metadist_torch import metadist_compile

    (model, opt), (ref, opt_ref) = build()
    compiled = metadist_compile(memory_budget=memory_budget)(step)
    losses = []
    for i in range(steps):
        ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(i))
        losses.append((float(step(ref, opt_ref, ids).detach()), float(compiled(model, opt, ids))))
    def excess(a, b, mask):
        """How far past rtol 1e-4 (atol 1e-4 of the tensor's largest value) the worst element is: <= 1 passes."""
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        r = (a.detach() - b).abs() / (1e-4 * (b.abs() + b.abs().max()) + 1e-30)
        return r[mask].max().item() if mask.any() else 0.0

    # GPT-2's key bias (a third of each c_attn bias) gets a gradient that is zero but for rounding
    # (softmax ignores a constant per query), and Adam turns that noise into steps of size lr: no two
    # summation orders agree on those elements, so elements whose gradient is rounding noise are
    # left out of the comparison (and counted).
    pairs = list(zip(model.parameters(), ref.parameters()))
    top = max(opt_ref.state[q]["exp_avg"].abs().max().item() for _, q in pairs)
    masks = [opt_ref.state[q]["exp_avg"].abs() > 1e-6 * top for _, q in pairs]
    err = max(excess(p, q, m) for (p, q), m in zip(pairs, masks))
    state_err = max(excess(opt.state[p][k], opt_ref.state[q][k], m)
                    for (p, q), m in zip(pairs, masks) for k in ("exp_avg", "exp_avg_sq"))
    noise_only = sum(int((~m).sum()) for m in masks)
    compared = sum(int(m.sum()) for m in masks)
    sharded = sum(1 for s in compiled.plan.input_shardings.values() if not s.is_fully_replicated())
    return {"losses": losses, "param_excess": err, "state_excess": state_err, "sharded_inputs": sharded,
            "compared": compared, "noise_only": noise_only}


def _check(res: dict) -> None:
    for eager, ours in res["losses"]:
        assert abs(eager - ours) <= 1e-4 * abs(eager), res["losses"]
    assert res["param_excess"] <= 1 and res["state_excess"] <= 1, res
    assert res["noise_only"] < 0.01 * res["compared"], res  # key biases and the like: a sliver of the model


def test_transformers_gpt2_world_size_1():
    import pytest
    pytest.importorskip("transformers")
    _check(run())


def test_transformers_gpt2_on_2_gloo_ranks_with_sharded_state(tmp_path):
    import pytest
    pytest.importorskip("transformers")
    from metadist_torch.demo import torchrun_cmd

    out = tmp_path / "hf.json"
    env = dict(os.environ, MD_TEST_OUT=str(out), OMP_NUM_THREADS="1", METADIST_PROGRESS="0",
               PYTHONWARNINGS="ignore", METADIST_CACHE_DIR=str(tmp_path / "rules"))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    from test_compile_distributed import run_torchrun
    proc = run_torchrun(torchrun_cmd(__file__, 2, ["--worker"]), env, out)
    if proc.returncode != 0 or not out.exists():
        pytest.fail("torchrun failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    res = json.loads(out.read_text())
    _check(res)
    assert res["sharded_inputs"] > 0, "the memory budget should force some state to be stored sharded"


if __name__ == "__main__" and "--worker" in sys.argv:
    result = run(memory_budget=2_000_000)  # ~1.3x the least-memory plan: parameters and moments must split
    if int(os.environ.get("RANK", "0")) == 0:
        Path(os.environ["MD_TEST_OUT"]).write_text(json.dumps(result))
    from metadist_torch.engine import finish_worker

    finish_worker(0)
