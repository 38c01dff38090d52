"""Steering on 4 gloo ranks, mesh (2, 2): every strategy preset on the GPT example gives the single-device
numbers and the layout it promises; constraints by name and glob and ``annotate`` are honoured with equal
numbers; bad names fail clearly on every rank; rank 0 explains a plan (every parameter named) and draws it.

One torchrun launch checks everything (each rank costs seconds of imports); this file is also the worker.
Afterwards, ``metadist plan --compare`` prices the presets on the GPT example (reusing the launch's rules).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
STEPS = 3
RTOL = 1e-4
PRESET_NAMES = ("ddp", "zero1", "zero2", "zero3", "tp", "tp+dp")


# -- the worker (runs under torchrun) ------------------------------------------------------------------


def _load_gpt():
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_gpt", REPO / "examples" / "torch" / "gpt.py")
    m = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = m
    spec.loader.exec_module(m)
    return m


def _same(name, gpt, cfg, step_fn, compiled_fn, errors):
    """Run the single-device step and the compiled one side by side; compare loss, parameters, state."""
    from _compare import compare_steps

    batches = [gpt.batch(cfg, s) for s in range(STEPS)]
    compare_steps(name, lambda: gpt.build(cfg), batches, step_fn, compiled_fn, errors, RTOL)


def _layout(name, step, errors, report):
    """Check the parameter layout a preset promises."""
    from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding
    from metadist_core.problem.presets import preset_constraints

    plan, graph, prob = step.plan, step.graph, step.problem
    R2, S0 = Sharding((Replicate(), Replicate())), Sharding((Shard(0), Shard(0)))
    params = [v for v in graph.inputs if graph.vars[v].role == "parameter"]
    states = [v for v in graph.inputs if graph.vars[v].role == "optimizer_state" and graph.vars[v].ndim]
    batch = [v for v in graph.inputs if graph.vars[v].role == "input"]
    label = {v: graph.vars[v].label for v in graph.inputs}
    kinds = sorted({c.kind for _, c in plan.collectives() if not c.is_free})
    report.append({"name": name, "objective_ms": plan.objective * 1e3, "collectives": kinds})

    def want(vs, sharding, what):
        bad = [f"{label.get(v) or v}={plan.var_shardings[v]}" for v in vs if plan.var_shardings[v] != sharding]
        if bad:
            errors.append(f"{name}: {what} should be {sharding}: {bad[:4]}")

    if name in ("ddp", "zero1", "zero2", "zero3"):
        want(batch, S0, "the batch")
        want(params, S0 if name == "zero3" else R2, "parameters")
        want(states, R2 if name == "ddp" else S0, "optimizer state")
    if name == "ddp" and "all_reduce" not in kinds:
        errors.append(f"ddp: no all_reduce in the plan ({kinds})")
    if name in ("ddp", "zero1", "zero2") and prob is not None:  # rank 0 holds the problem
        grads = preset_constraints(prob.unsteered, name).gradients
        P = Sharding((Partial("sum"), Partial("sum")))
        partial = [v for v in grads if plan.var_shardings[v] == P]
        if len(partial) < len(params) // 2:
            errors.append(
                f"{name}: {len(partial)} of {len(grads)} gradients are partial sums ({len(params)} parameters)"
            )
    if name == "zero2" and "reduce_scatter" not in kinds:
        errors.append(f"zero2: no reduce_scatter in the plan ({kinds})")
    if name in ("tp", "tp+dp"):
        col = Sharding((Shard(0), Shard(0))) if name == "tp" else Sharding((Replicate(), Shard(0)))
        row = Sharding((Shard(1), Shard(1))) if name == "tp" else Sharding((Replicate(), Shard(1)))
        by = {graph.vars[v].label: v for v in params}
        want([by["blocks.0.fc.weight"], by["blocks.0.fc.bias"]], col, "the column-parallel fc")
        want([by["blocks.0.out.weight"], by["blocks.0.proj.weight"]], row, "the row-parallel out/proj")
        want([by["blocks.0.ln1.weight"], by["head.weight"]], R2, "other parameters")
        want(batch, R2 if name == "tp" else Sharding((Shard(0), Replicate())), "the batch")
        heads = [
            v for op in graph.ops if "scaled_dot_product" in op.key and "backward" not in op.key for v in op.inputs[:3]
        ]
        want(
            heads,
            Sharding((Shard(1), Shard(1))) if name == "tp" else Sharding((Replicate(), Shard(1))),
            "attention q/k/v (heads)",
        )


def worker() -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from metadist_core.ir.placement import Replicate, Shard, Sharding
    from metadist_torch import annotate, metadist_compile, to_dtensor_placements

    torch.set_num_threads(1)
    gpt = _load_gpt()
    cfg = gpt.GPTConfig(vocab=96, seq=16, width=32, heads=4, layers=1, batch=4)
    rank = int(os.environ["RANK"])  # the process group starts with the first compiled step
    errors: list[str] = []
    report: list[dict] = []
    out = Path(os.environ["MD_TEST_OUT"])
    for name in PRESET_NAMES:
        step = metadist_compile(mesh=(2, 2), strategy=name)(gpt.train_step)
        try:
            _same(name, gpt, cfg, gpt.train_step, step, errors)
            _layout(name, step, errors, report)
        except Exception as e:  # pragma: no cover - reported by the test
            import traceback

            errors.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    # constraints by name and glob, and annotate inside the step
    logits_pin = (Shard(0), Replicate())

    def annotated_step(model, opt, idx, targets):
        logits = annotate(model(idx), *logits_pin)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cons = {"head.weight": Replicate(), "blocks.*.fc.weight": (Shard(1), Replicate())}
    step = metadist_compile(mesh=(2, 2), constraints=cons)(annotated_step)
    try:
        _same("constraints+annotate", gpt, cfg, annotated_step, step, errors)
        g, plan = step.graph, step.plan
        by = {g.vars[v].label: v for v in g.inputs if g.vars[v].role == "parameter"}
        if plan.input_shardings[by["head.weight"]] != Sharding((Replicate(), Replicate())):
            errors.append(f"head.weight constraint not kept: {plan.input_shardings[by['head.weight']]}")
        if plan.input_shardings[by["blocks.0.fc.weight"]] != Sharding((Shard(1), Replicate())):
            errors.append(f"glob constraint not kept: {plan.input_shardings[by['blocks.0.fc.weight']]}")
        if len(g.annotations) != 1 or any(plan.var_shardings[v] != Sharding(logits_pin) for v in g.annotations):
            errors.append(f"annotate not kept: {g.annotations} -> {[plan.var_shardings[v] for v in g.annotations]}")
        tp = to_dtensor_placements(plan)
        if tuple(type(p).__name__ for p in tp["blocks.0.fc.weight"]) != ("Shard", "Replicate"):
            errors.append(f"to_dtensor_placements: {tp['blocks.0.fc.weight']}")
        if rank == 0:  # explain names every parameter; the picture is written
            text = plan.explain()
            missing = [n for n in by if n not in text]
            if missing or "strategy presets" not in text or "zero3" not in text:
                errors.append(f"explain misses {missing[:5]} or the presets:\n{text[:2000]}")
            (out.parent / "explain.txt").write_text(text)
            from metadist_core.plan.picture import draw_plan

            draw_plan(plan, str(out.parent / "plan.png"))
    except Exception as e:  # pragma: no cover - reported by the test
        import traceback

        errors.append(f"constraints+annotate: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    # bad names and unsatisfiable placements: a clear error on every rank (rank 0 names it)
    for bad, needle in (
        ({"no.such.weight": Replicate()}, "no.such.weight"),
        ({"blocks.0.ln1.weight": Shard(1)}, "blocks.0.ln1.weight"),
    ):
        m, o = gpt.build(cfg)
        try:
            metadist_compile(mesh=(2, 2), constraints=bad)(gpt.train_step)(m, o, *gpt.batch(cfg))
            errors.append(f"constraint {bad} was accepted")
        except Exception as e:
            if needle not in str(e) or (rank > 0 and "rank 0" not in str(e)):
                errors.append(f"rank {rank}: constraint {bad} gave an unclear {type(e).__name__}: {e}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        out.write_text(json.dumps({"errors": [e for errs in gathered for e in errs], "report": report}, indent=1))
    return 0


# -- the test ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_presets_constraints_annotate_and_explain_on_4_gloo_ranks(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from _torchrun import launch

    cache = tmp_path / "rules"
    res = launch(__file__, 4, ["--worker"], out=tmp_path / "out.json", timeout=1500, METADIST_CACHE_DIR=str(cache))
    assert not res["errors"], "\n".join(res["errors"])
    assert [r["name"] for r in res["report"]] == list(PRESET_NAMES)
    import matplotlib.image as mpimg

    img = mpimg.imread(tmp_path / "plan.png")
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 200
    assert "blocks.0.fc.weight" in (tmp_path / "explain.txt").read_text()
    # metadist plan --compare on the GPT example, with the rules the launch found
    from metadist_core.driver import cli

    plan_out = tmp_path / "gpt.plan.json"
    assert (
        cli.main(
            [
                "plan",
                str(REPO / "examples/torch/gpt.py"),
                "--mesh",
                "2x2",
                "--compare",
                "--cache-dir",
                str(cache),
                "--out",
                str(plan_out),
                "--",
                "--steps",
                "1",
                "--vocab",
                "96",
                "--width",
                "32",
                "--seq",
                "16",
                "--layers",
                "1",
                "--batch",
                "4",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for name in ("auto (plan)",) + tuple(n for n in PRESET_NAMES):
        assert f"\n{name} " in text, text[-3000:]
    assert cli.main(["explain", str(plan_out), "--png", str(tmp_path / "cli.png")]) == 0
    assert "blocks.0.out.weight" in capsys.readouterr().out
    assert mpimg.imread(tmp_path / "cli.png").ndim == 3


if __name__ == "__main__" and "--worker" in sys.argv:
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(worker())
