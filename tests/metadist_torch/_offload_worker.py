"""torchrun worker for test_offload_distributed.py: offload="optimizer" on gloo ranks equals one device.

Per config: AdamW (weight decay) over 4 steps, loss, parameters and optimizer state compared with the
eager single-device step; the optimizer state must sit on the host device, the rank program must hold
the transfers and run ops on the host. Rank 0 writes {"errors": [...], "report": [...]} to MD_TEST_OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun

STEPS = 4
RTOL = 1e-4


def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def step_fn(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check(name, strategy, errors, report):
    from metadist_torch import metadist_compile
    from metadist_torch.lower.offload import count_transfers, host_tensors

    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]
    m_ref, o_ref = build()
    ref = [float(step_fn(m_ref, o_ref, *d).detach()) for d in data]
    m, o = build()
    step = metadist_compile(offload="optimizer", strategy=strategy)(step_fn)
    try:
        got = [float(step(m, o, *d)) for d in data]
    except Exception as e:  # reported by the test
        import traceback

        errors.append(f"{name}: raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return
    for i, (a, b) in enumerate(zip(ref, got)):
        if abs(a - b) > RTOL * max(1.0, abs(a)):
            errors.append(f"{name}: loss of step {i}: {b} vs single-device {a}")
    for (k, a), b in zip(m_ref.state_dict().items(), m.state_dict().values()):
        if not torch.allclose(full(b).detach(), a, rtol=RTOL, atol=1e-6):
            errors.append(f"{name}: {k} differs by {(full(b).detach() - a).abs().max().item():.3g}")
    for i, (pr, p) in enumerate(zip(m_ref.parameters(), o.param_groups[0]["params"])):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            a, b = o_ref.state[pr][k].float(), full(o.state[p][k]).float()
            if not torch.allclose(a, b, rtol=RTOL, atol=1e-7):
                errors.append(f"{name}: optimizer state[{i}][{k}] differs by {(a - b).abs().max().item():.3g}")
    prog = step.runnable
    where = {t.device.type for t in host_tensors(prog.traced.state)}
    if where != {"cpu"}:
        errors.append(f"{name}: optimizer state on {where}, expected the host (cpu)")
    moves = count_transfers(prog.lowered.gm)
    if not moves["md_to_host"] or not moves["md_to_device"] or not prog.offload.host_nodes:
        errors.append(f"{name}: the rank program holds no offload: {moves}, {prog.offload.host_nodes} host nodes")
    sharded_state = sum(
        1
        for v, s in step.plan.input_shardings.items()
        if step.graph.vars[v].role == "optimizer_state" and not s.is_fully_replicated()
    )
    report.append(
        {
            "name": name,
            "loss": got[-1],
            "loss_ref": ref[-1],
            "transfers": moves,
            "host_nodes": prog.offload.host_nodes,
            "sharded_state": sharded_state,
            "offload": step.plan.stats.offload,
        }
    )


def main() -> int:
    from metadist_torch.runtime.engine import ensure_process_group

    ensure_process_group()
    errors: list[str] = []
    report: list[dict] = []
    check("auto", None, errors, report)
    check("zero1", "zero1", errors, report)
    from _torchrun import write_results

    write_results(errors, report)
    return 0


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    code = 1
    try:
        code = main()
    finally:
        sys.stdout.flush()
        finish_worker(code)
