"""torchrun worker of tests/metadist_torch/test_stages.py (4 gloo ranks): pipelined steps on
torch.distributed.pipelining equal the single-device step over 3 steps (loss, parameters, optimizer state;
rtol 1e-4), and the planner pipelines when no unpipelined plan meets the memory budget.

Every rank runs the eager step itself and compares; rank 0 writes the errors of all ranks to $MD_TEST_OUT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
STEPS = 3


def _check(name, build, batches, step_fn, errors, report, compare=None, **kw):
    from _pipeline_worker import _load  # noqa: F401 - same loader as the micro-batch worker
    from test_compile_distributed import _compare
    from metadist_torch import metadist_compile

    compare = compare or _compare
    model_ref, opt_ref = build()
    losses_ref = [float(step_fn(model_ref, opt_ref, *b).detach()) for b in batches]
    model, opt = build()
    step = metadist_compile(**kw)(step_fn)
    try:
        losses = [float(step(model, opt, *b)) for b in batches]
    except Exception as e:  # pragma: no cover - reported by the test
        import traceback

        errors.append(f"{name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return
    compare(name, model_ref, opt_ref, model, opt, losses_ref, losses, errors)
    plan = step.plan
    mods = getattr(step.runnable, "modules", {})
    ran = next(iter(mods.values())).sub.ran if mods else {}
    sharded = sum(1 for p in next(iter(mods.values())).placements.values() if "Shard" in str(p)) if mods else 0
    report.append(
        {
            "name": name,
            "stages": len(plan.stages),
            "plan_mesh": list(plan.mesh_shape),
            "devices": [s.devices for s in plan.stages],
            "pipeline": plan.stats.pipeline,
            "text": str(plan).splitlines()[-len(plan.stages) - 1 :] if plan.stages else [],
            "ran": ran,
            "sharded_values": sharded,
            "loss": losses[-1],
            "loss_ref": losses_ref[-1],
        }
    )


def worker() -> int:
    import torch
    from _pipeline_worker import _load

    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    gpt = _load(repo / "examples" / "torch" / "gpt.py", "example_gpt")
    errors: list[str] = []
    report: list[dict] = []
    c = gpt.GPTConfig(vocab=96, seq=16, width=32, heads=2, layers=2, batch=8)
    gb = [gpt.batch(c, s) for s in range(STEPS)]
    build = lambda: gpt.build(c)  # noqa: E731
    mode = os.environ.get("MD_STAGES_MODES", "all")
    runs = {
        "gpt-pp2-1f1b-tp@2x2": dict(mesh=(2, 2), pipeline_stages=2, schedule="1f1b", micro_batches=4, strategy="tp"),
        "gpt-pp2-gpipe@2x2": dict(mesh=(2, 2), pipeline_stages=2, schedule="gpipe", micro_batches=2),
        "gpt-pp4-1f1b@4": dict(mesh=(4,), pipeline_stages=4, schedule="1f1b", micro_batches=4),
        "gpt-pp4-interleaved@4": dict(mesh=(4,), pipeline_stages=4, schedule="interleaved", micro_batches=4),
        # no unpipelined data-parallel plan keeps whole parameters and Adam moments in 2 MB; 4 stages do
        "gpt-auto-budget@4": dict(mesh=(4,), micro_batches=4, memory_budget=2_000_000, strategy="ddp"),
    }
    cw = gpt.GPTConfig(vocab=96, seq=16, width=64, heads=2, layers=2, batch=8)
    for name, kw in runs.items():
        if mode != "all" and name not in mode.split(","):
            continue
        if "auto" in name:
            _check(
                name,
                lambda: gpt.build(cw),
                [gpt.batch(cw, s) for s in range(STEPS)],
                gpt.train_step,
                errors,
                report,
                **kw,
            )
        else:
            _check(name, build, gb, gpt.train_step, errors, report, **kw)
    # transformers' GPT-2 (tied input and output embeddings: the owning stage sends the weight on and gets its
    # gradient back through the pipeline's backward), AdamW; key-bias noise masked as in test_third_party
    from _pipeline_worker import _masked_compare

    third = _load(Path(__file__).resolve().parent / "test_third_party.py", "third_party")
    ids = [(torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(i)),) for i in range(STEPS)]
    gpt2_runs = {
        "gpt2-pp2-1f1b@2x2": dict(mesh=(2, 2), pipeline_stages=2, schedule="1f1b", micro_batches=4),
        "gpt2-pp2-gpipe@2x2": dict(mesh=(2, 2), pipeline_stages=2, schedule="gpipe", micro_batches=2),
        "gpt2-pp4-1f1b@4": dict(mesh=(4,), pipeline_stages=4, schedule="1f1b", micro_batches=4),
    }
    for name, kw in gpt2_runs.items():
        if mode == "all" or name in mode.split(","):
            _check(name, lambda: third.build()[0], ids, third.step, errors, report, compare=_masked_compare, **kw)
    # a bad combination: 3 stages on a first axis of 4 devices
    try:
        from metadist_torch import metadist_compile

        m, o = build()
        metadist_compile(mesh=(4,), pipeline_stages=3)(gpt.train_step)(m, o, *gb[0])
        errors.append("pipeline_stages=3 on mesh (4,) was accepted")
    except ValueError as e:
        if "pipeline_stages=3" not in str(e) or "4 devices" not in str(e):
            errors.append(f"the stage-count error does not quote both numbers: {e}")
    from _torchrun import write_results

    write_results(errors, report)
    return 0


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(worker())
