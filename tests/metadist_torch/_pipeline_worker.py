"""torchrun worker of tests/metadist_torch/test_pipeline.py (4 gloo ranks): micro-batched steps equal the
single-device whole-batch step over 3 steps (loss, parameters, optimizer state; rtol 1e-4).

Every rank runs the eager step itself and compares; rank 0 writes the errors of all ranks to $MD_TEST_OUT.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
STEPS = 3


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def _masked_compare(name, ref, opt_ref, model, opt, losses_ref, losses, errors):
    """GPT-2's comparison (as tests/metadist_torch/test_third_party.py): elements whose gradient is rounding
    noise (the key biases) are left out; the rest within rtol 1e-4."""
    for i, (a, b) in enumerate(zip(losses_ref, losses)):
        if abs(a - b) > 1e-4 * abs(a):
            errors.append(f"{name}: loss of step {i}: {b} vs single-device {a}")

    def excess(a, b, mask):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        r = (a.detach() - b).abs() / (1e-4 * (b.abs() + b.abs().max()) + 1e-30)
        return r[mask].max().item() if mask.any() else 0.0

    pairs = list(zip(model.parameters(), ref.parameters()))
    top = max(opt_ref.state[q]["exp_avg"].abs().max().item() for _, q in pairs)
    masks = [opt_ref.state[q]["exp_avg"].abs() > 1e-6 * top for _, q in pairs]
    err = max(excess(p, q, m) for (p, q), m in zip(pairs, masks))
    state_err = max(
        excess(opt.state[p][k], opt_ref.state[q][k], m)
        for (p, q), m in zip(pairs, masks)
        for k in ("exp_avg", "exp_avg_sq")
    )
    if err > 1 or state_err > 1:
        errors.append(f"{name}: parameters {err:.3g}x and optimizer state {state_err:.3g}x past rtol 1e-4")


def _check(name, build, batches, step_fn, errors, report, compare=None, **kw):
    from test_compile_distributed import _compare

    compare = compare or _compare
    from metadist_torch import metadist_compile

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
    report.append(
        {
            "name": name,
            "mesh": list(plan.mesh_shape),
            "loss": losses[-1],
            "loss_ref": losses_ref[-1],
            "collectives": sum(1 for _, c in plan.collectives() if not c.is_free),
            "counted_bytes": step.comm_stats.total,
            "timings": step.timings,
        }
    )


def worker() -> int:
    import torch
    from test_compile_distributed import _random_solver

    torch.set_num_threads(1)
    gpt = _load(REPO / "examples" / "torch" / "gpt.py", "example_gpt")
    mlp = _load(REPO / "examples" / "torch" / "mlp.py", "example_mlp")
    third = _load(Path(__file__).resolve().parent / "test_third_party.py", "third_party")
    errors: list[str] = []
    report: list[dict] = []
    c = gpt.GPTConfig(vocab=96, seq=16, width=32, heads=2, layers=1, batch=8)
    gb = [gpt.batch(c, s) for s in range(STEPS)]
    for mesh in ((4,), (2, 2)):
        tag = "x".join(map(str, mesh))
        _check(f"gpt-mb4@{tag}", lambda: gpt.build(c), gb, gpt.train_step, errors, report, mesh=mesh, micro_batches=4)
    pm, solver = _random_solver(3)
    cm = mlp.MLPConfig(hidden=20, batch=8, layers=2, optimizer="adam")
    _check(
        "mlp-adam-random-plan-mb2@2x2",
        lambda: mlp.build(cm),
        [mlp.batch(cm, s) for s in range(STEPS)],
        mlp.train_step,
        errors,
        report,
        mesh=(2, 2),
        micro_batches=2,
        solver=solver,
        plugins=pm,
    )

    def gpt2():
        return third.build()[0]

    ids = [(torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(i)),) for i in range(STEPS)]
    _check(
        "gpt2-adamw-mb4@2x2",
        gpt2,
        ids,
        third.step,
        errors,
        report,
        mesh=(2, 2),
        micro_batches=4,
        compare=_masked_compare,
    )
    # a batch that micro_batches does not divide: a clear error quoting both, on every rank
    try:
        from metadist_torch import metadist_compile

        m, o = gpt.build(c)
        metadist_compile(micro_batches=3)(gpt.train_step)(m, o, *gb[0])
        errors.append("micro_batches=3 accepted a batch of 8")
    except ValueError as e:
        if "8" not in str(e) or "micro_batches=3" not in str(e):
            errors.append(f"indivisible batch error does not quote both numbers: {e}")
    from _torchrun import write_results

    write_results(errors, report)
    return 0


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(worker())
