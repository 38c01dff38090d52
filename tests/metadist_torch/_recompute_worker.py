"""torchrun worker of tests/metadist_torch/test_recompute.py: a step compiled under a memory budget that only
recomputation meets, against the single-device step (3 steps: losses, parameters, optimizer state).

    python -m torch.distributed.run --nproc_per_node=4 _recompute_worker.py gpt|gpt_mb|gpt2

Every rank finds the budget the same way: halfway (with micro-batches three quarters of the way) from the
leanest plan with every segment recomputed to the leanest without recomputation (the RecomputeBudgetError of an impossible budget gives both). Rank 0 prints
``RECOMPUTE OK <case>`` when everything matched.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks._models import gpt2, lm_step, tokens  # noqa: E402

STEPS = 3
RTOL = 1e-4


def _gpt_case():
    spec = importlib.util.spec_from_file_location("example_gpt", REPO / "examples" / "torch" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpt
    spec.loader.exec_module(gpt)
    c = gpt.GPTConfig(layers=2, vocab=128, width=64, seq=64, batch=16)
    return (lambda: gpt.build(c)), [gpt.batch(c, s) for s in range(STEPS)], gpt.train_step


def _gpt2_case():
    def build():
        m = gpt2(n_positions=64, n_layer=2, n_embd=64, n_head=4, vocab_size=128)
        # SGD with momentum: GPT-2's key bias has a zero gradient but for rounding, which Adam would amplify
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    return build, [(b,) for b in tokens(128, 16, 64, STEPS)], lm_step


def _budget(build, batch, step_fn, mesh_shape, at: float = 0.5) -> tuple[int, int, int]:
    from metadist_core.config import load_settings
    from metadist_core.driver.compile import plan_graph
    from metadist_core.ir.mesh import Mesh
    from metadist_core.levers.recompute import RecomputeBudgetError
    from metadist_torch.plugin import TorchFrontend

    model, opt = build()
    fe = TorchFrontend()
    graph = fe.trace(step_fn, (model, opt, *batch), {}).graph
    try:  # priced as the compile prices it: the lowering's bucket copies, the whole batch on every rank
        plan_graph(graph, Mesh(mesh_shape), settings=load_settings(memory_budget=1), traits=fe.traits)
    except RecomputeBudgetError as e:
        return int(e.with_recompute + at * (e.without - e.with_recompute)), e.without, e.with_recompute
    raise AssertionError("a budget of one byte was met")


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()


def main() -> int:
    import torch.distributed as dist
    from metadist_torch import metadist_compile
    from metadist_torch.runtime.engine import ensure_process_group

    case = sys.argv[1]
    torch.set_num_threads(1)
    ensure_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    build, batches, step_fn = {"gpt": _gpt_case, "gpt_mb": _gpt_case, "gpt2": _gpt2_case}[case]()
    mb = 2 if case == "gpt_mb" else 1  # micro-batches: the plan is made (and recomputes) for one of them
    errors: list[str] = []
    try:
        first = tuple(t[: t.shape[0] // mb] for t in batches[0])
        # with micro-batches the program also holds the accumulated gradients and their bucket, which the plain
        # graph's leanest figures leave out: three quarters of the way from all recomputed to none
        budget, without, lean = _budget(build, first, step_fn, (world,), 0.75 if mb > 1 else 0.5)
        m_ref, o_ref = build()
        ref = [float(step_fn(m_ref, o_ref, *b)) for b in batches]
        m, o = build()
        step = metadist_compile(memory_budget=budget, micro_batches=mb)(step_fn)
        got = [float(step(m, o, *b)) for b in batches]
        plan = step.plan
        if not plan.recompute:
            errors.append(f"no recomputation under a budget of {budget:,} (leanest without {without:,})")
        if sum(op.id.endswith("@rc") for op in step.graph.ops) != len(plan.recompute):
            errors.append("the compiled graph does not hold the recomputed copies the plan lists")
        if plan.memory_per_device > budget:
            errors.append(f"the plan needs {plan.memory_per_device:,} bytes, over the budget of {budget:,}")
        for i, (a, b) in enumerate(zip(got, ref)):
            if abs(a - b) > RTOL * max(1.0, abs(b)):
                errors.append(f"loss of step {i}: {a} vs single device {b}")
        ref_sd = m_ref.state_dict()
        for k, v in m.state_dict().items():
            a, b = _full(v), _full(ref_sd[k])
            if not torch.allclose(a, b, rtol=RTOL, atol=RTOL * max(1e-3, b.abs().max().item())):
                errors.append(f"{k} differs by {(a - b).abs().max().item():.3g}")
        if rank == 0:
            print(
                f"{case}: budget {budget:,} between {lean:,} (all recomputed) and {without:,} (none); "
                f"plan: {plan.summary()}; recomputed {len(plan.recompute)} ops "
                f"{plan.stats.recompute}; losses {got} vs {ref}",
                flush=True,
            )
    except Exception:
        errors.append(traceback.format_exc())
    if errors:
        print(f"rank {rank}: " + "\n".join(errors), flush=True)
    elif rank == 0:
        print(f"RECOMPUTE OK {case}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(main())
