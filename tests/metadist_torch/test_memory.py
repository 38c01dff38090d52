"""Peak memory measured (metadist_torch.measure.memory) against the cost model's prediction (plan.memory_per_device)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from metadist_torch.measure.memory import LIVE_STORAGES, LiveTensorTracker, measure_peak, state_tensors  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_memory_worker.py")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun

from _torchrun import launch  # noqa: E402


def test_tracker_counts_known_allocations_frees_views_and_resizes():
    base = torch.zeros(1000)  # 4,000 bytes held before the call
    orig_resize = torch.UntypedStorage.resize_

    def step():
        x = torch.empty(1000)  # +4,000
        y = torch.empty(2000)  # +8,000 -> peak 16,000 with the base
        del y  # -8,000
        v = x.view(10, 100).t()  # views: no new storage
        w = torch.ones(500)  # +2,000
        x.untyped_storage().resize_(0)  # -4,000 (as FSDP2 frees a gathered parameter)
        return w, v

    (w, v), m = measure_peak(step, [base])
    assert m.method == LIVE_STORAGES
    assert m.baseline_bytes == 4000
    assert m.peak_bytes == 16000
    assert m.end_bytes == 4000 + 2000  # x resized to nothing, y freed, the view adds nothing
    assert torch.UntypedStorage.resize_ is orig_resize  # the patch that follows resize_ is undone


def test_tracker_counts_a_shared_storage_once_and_sees_autograd():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    with LiveTensorTracker() as tr:
        tr.track(lin.weight, x)
        start = tr.current
        lin(x).sum().backward()
    assert start == (64 * 32 + 16 * 64) * 4
    # the weight's gradient (32x64, made by autograd's mm) is alive at the end; the output (16x32) was freed
    # once sum() read it, before the gradient existed: the peak is the gradient plus scalars
    assert tr.current >= start + 32 * 64 * 4
    assert start + 32 * 64 * 4 <= tr.peak_bytes < start + 32 * 64 * 4 + 16 * 32 * 4
    assert tr.ops > 3


def test_compiled_step_memory_matches_prediction_on_one_device():
    """World size 1: the plan's peak (every value over its liveness, views free) against the live storages."""
    sys.path.insert(0, str(REPO / "examples" / "torch"))
    import gpt
    from metadist_torch import metadist_compile

    c = gpt.GPTConfig(vocab=128, seq=32, width=64, heads=4, layers=2, batch=8)
    model, opt = gpt.build(c)
    ref_m, ref_o = gpt.build(c)
    step = metadist_compile()(gpt.train_step)
    for s in range(2):
        b = gpt.batch(c, s)
        loss = step(model, opt, *b)
        assert torch.allclose(loss, gpt.train_step(ref_m, ref_o, *b), rtol=1e-5)
    mem = step.memory
    assert mem["method"] == LIVE_STORAGES
    assert mem["predicted_peak_bytes"] == mem["predicted_solver_bytes"] == step.plan.memory_per_device > 0
    # measured here: 1.0002 (the loss and the AdamW step counters are 0-dim values the model prices the same)
    assert abs(mem["measured_peak_bytes"] / mem["predicted_peak_bytes"] - 1) < 0.02, mem
    assert "measure_memory" in step.timings
    # the eager step on the same model holds about as much (it keeps the gradients, not the old state)
    b = gpt.batch(c, 5)
    _, eager = measure_peak(lambda: gpt.train_step(ref_m, ref_o, *b), state_tensors(ref_m, ref_o) + list(b))
    assert 0.5 < eager.peak_bytes / mem["measured_peak_bytes"] < 1.5


def test_measure_memory_off_leaves_step_memory_empty(monkeypatch):
    monkeypatch.setenv("METADIST_MEASURE_MEMORY", "0")
    from metadist_torch import metadist_compile

    def step(w, x):
        return (w * x).sum()

    compiled = metadist_compile()(step)
    compiled(torch.ones(4), torch.ones(4))
    assert compiled.memory == {}


# -- 2 gloo ranks: three plans --------------------------------------------------------------

# Measured on this machine (2 ranks, the GPT example at width 64), measured / predicted: ddp 0.85,
# fsdp 1.10, tp 1.03 with the collectives' buffers in the prediction (metadist_core.plan.memprofile); the
# solver's own figure (plan.memory_per_device, no buffers) gave 1.16, 1.18-1.25 and 1.0007. The issue's
# target is 15 %. ddp sits at the low edge: the model puts its gradient bucket's transient copies (the
# test below) where the last gradient is made, and the rank's measured peak does not show them there.
RATIO_BOUNDS = {"ddp": (0.8, 1.15), "fsdp": (0.85, 1.15), "tp": (0.85, 1.15)}


BUCKET_SCRIPT = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from metadist_torch.lower.collectives import AxisComm
from metadist_torch.measure.memory import measure_peak
from metadist_torch.lower.schedule import md_wait
from metadist_torch.runtime.stats import CommStats
comm = AxisComm(0, dist.group.WORLD, 1, 0, CommStats())
for reduce in ("sum", "avg"):
    xs = [torch.ones(n) for n in (1000, 3000, 500, 2500)]
    _, m = measure_peak(lambda: md_wait(*comm.all_reduce_bucket(xs, reduce)), xs)
    print(reduce, m.peak_bytes)
dist.destroy_process_group()
"""


def test_a_gradient_bucket_holds_the_copies_the_memory_model_counts(tmp_path):
    import subprocess
    from metadist_torch.plugin import TorchFrontend

    BUCKET_COPIES = TorchFrontend.traits.bucket_copies
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", BUCKET_SCRIPT, str(tmp_path / "pg")],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    peaks = dict(line.split() for line in out.stdout.splitlines())
    members = 7000 * 4
    # the members, their concatenation and the functional all_reduce's result (the op clones its input, so
    # the concatenation is gone by the wait); an avg's quotient is made at the wait, beside the result only
    assert int(peaks["sum"]) == members * (1 + BUCKET_COPIES)
    assert int(peaks["avg"]) == members * (1 + BUCKET_COPIES)


@pytest.mark.slow
def test_memory_prediction_compares_predicted_and_measured_peaks_on_three_plans(tmp_path):
    ranks = launch(WORKER, 2, out=tmp_path / "memory.json", METADIST_CACHE_DIR=str(tmp_path / "rules"))
    errors = [e for r in ranks for e in r["errors"]]
    assert not errors, "\n".join(errors)
    for r in ranks:
        mem = r["memory"]
        for strategy, (lo, hi) in RATIO_BOUNDS.items():
            m = mem[strategy]
            assert m["predicted_peak_bytes"] >= m["predicted_solver_bytes"] > 0 and m["measured_peak_bytes"] > 0
            assert lo <= m["ratio"] <= hi, (strategy, m)
        # the same tracker on the eager baselines: FSDP2 holds half of DDP's state on 2 ranks, so less at its peak
        assert 0 < mem["eager_fsdp2"]["measured_peak_bytes"] < mem["eager_ddp"]["measured_peak_bytes"]
        assert mem["eager_fsdp2"]["baseline_bytes"] < mem["eager_ddp"]["baseline_bytes"]
