"""torchrun worker of tests/metadist_torch/test_production.py: mixed precision, compressed gradients, checkpoints.

    python -m torch.distributed.run --nproc_per_node=4 production_worker.py four OUT_DIR
    python -m torch.distributed.run --nproc_per_node=2 production_worker.py two OUT_DIR

``four`` (mesh (4,)): a bf16 autocast step against eager autocast (3 steps); fp16 with a
GradScaler and a fused AdamW against eager (5 steps, one overflowing on one device's piece only), under
``strategy="ddp"`` and with the weights stored split; DDP
with and without ``grad_compression="bf16"`` (50 steps: counted bytes, loss
drift); a checkpoint saved after 3 steps of a plan that stores the weights
sharded, then 3 more steps (the uninterrupted run, written to OUT_DIR).
``two`` (mesh (2,)): that checkpoint loaded before the first compiled call and
after it, 3 steps each, against the uninterrupted run. Rank 0 writes
``OUT_DIR/<mode>.json`` with the errors and the measured figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "torch"))

import mlp  # noqa: E402

from metadist_core.problem.constraints import Pin  # noqa: E402
from metadist_core.ir.placement import Shard, Sharding  # noqa: E402

RTOL = 1e-4
BF16_TOL = 2e-2  # bf16 has 8 bits of mantissa: ~4e-3 per rounding, a few roundings per value
CKPT_CFG = mlp.MLPConfig(hidden=64, batch=16, layers=2, optimizer="adamw")
DDP_CFG = mlp.MLPConfig(hidden=64, batch=1024, layers=2, optimizer="adamw", lr=3e-3)  # batch >> width
AMP_CFG = mlp.MLPConfig(hidden=64, batch=256, layers=2, optimizer="sgd")  # not Adam: see check_autocast
SLOW_LINKS = {"alpha": 1e-6, "beta": 1e-8}  # 100 MB/s: bytes, not latency, decide (DDP's regime)
FP16_CFG = mlp.MLPConfig(hidden=64, batch=64, layers=2, optimizer="adamw", lr=3e-3)
FP16_TOL = 5e-3  # fp16: 11 bits of mantissa; the split batch sums its pieces in another order
OVERFLOW_STEP = 2  # the batch of this step overflows an fp16 gradient in its first rows only


def scaled_step(model, opt, scaler, x, y):
    """float16 autocast with a GradScaler: the update is skipped (on the device) when a gradient overflows."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss


def build_scaled(cfg=FP16_CFG):
    """The MLP with a fused AdamW (the optimizer a GradScaler can run inside one traced step) and a scaler
    that grows every 2 clean steps, so that growth and back-off both happen within a few steps."""
    model, _ = mlp.build(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=2)


def scaled_batches(cfg=FP16_CFG, steps: int = 5):
    """Batches whose step OVERFLOW_STEP has large values in its first 2 rows: with the batch split over
    devices only the first device's piece of the first weight's gradient overflows fp16."""
    batches = [mlp.batch(cfg, s) for s in range(steps)]
    batches[OVERFLOW_STEP][0][:2] *= 3e3
    return batches


def check_scaler(name, mesh, errors, report, **compile_kw):
    """fp16 + GradScaler against eager fp16 + GradScaler: losses, weights, the scale, the skipped step."""
    from metadist_torch import metadist_compile

    batches = scaled_batches()
    m_ref, o_ref, s_ref = build_scaled()
    ref, ref_scales = [], []
    for b in batches:
        ref.append(float(scaled_step(m_ref, o_ref, s_ref, *b).detach()))
        ref_scales.append(float(s_ref._scale))
    if ref_scales[OVERFLOW_STEP] >= ref_scales[OVERFLOW_STEP - 1]:
        errors.append(f"{name}: the eager scaler did not back off at step {OVERFLOW_STEP}: {ref_scales}")
    m, o, s = build_scaled()
    step = metadist_compile(mesh=mesh, **compile_kw)(scaled_step)
    got, scales, before = [], [], None
    for i, b in enumerate(batches):
        if i == OVERFLOW_STEP:
            before = {k: full(v).detach().clone() for k, v in m.state_dict().items()}
        got.append(float(step(m, o, s, *b).detach()))
        scales.append(float(full(s._scale)))
        if i == OVERFLOW_STEP:  # skipped on every device: the weights did not move at all
            moved = [k for k, v in m.state_dict().items() if not torch.equal(full(v).detach(), before[k])]
            if moved:
                errors.append(
                    f"{name}: the overflowing step changed {moved} on rank "
                    f"{dist.get_rank() if dist.is_initialized() else 0}; it must skip the update"
                )
    compare_losses(
        name,
        [x for i, x in enumerate(got) if i != OVERFLOW_STEP],
        [x for i, x in enumerate(ref) if i != OVERFLOW_STEP],
        FP16_TOL,
        errors,
    )
    compare_state(name, m, m_ref, FP16_TOL, errors)
    if scales != ref_scales:
        errors.append(f"{name}: scales {scales} vs eager {ref_scales}")
    if "float16" not in {v.dtype for v in step.graph.vars.values()}:
        errors.append(f"{name}: the traced step holds no float16 value")
    report[name] = {"losses": got, "ref": ref, "scales": scales, "plan": step.plan.summary()}
    return step


def autocast_step(model, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def graph_of(fn, *objects_and_batch):
    """The traced graph of ``fn(*objects, *batch)`` (model, optimizer, maybe a scaler, then the batch)."""
    from metadist_torch.trace.trace import trace_step

    return trace_step(fn, (*objects_and_batch[:-1], *objects_and_batch[-1])).graph


def slow_link_profile(out_dir: Path) -> str:
    """A mesh profile whose links are slow enough that all-reducing gradients beats gathering the batch."""
    from metadist_core.cost.profile import MeshProfile

    path = out_dir / "slow-links.json"
    if dist.get_rank() == 0:
        path.write_text(json.dumps(MeshProfile(levels={"intra": SLOW_LINKS, "inter": SLOW_LINKS}).to_json()))
    dist.barrier()
    return str(path)


@contextlib.contextmanager
def profile_env(path: str):
    """Steps decorated inside plan with the mesh profile at ``path`` (settings are read at decoration)."""
    saved = os.environ.get("METADIST_MESH_PROFILE")
    os.environ["METADIST_MESH_PROFILE"] = path
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("METADIST_MESH_PROFILE", None)
        else:
            os.environ["METADIST_MESH_PROFILE"] = saved


def sharded_pins(graph, n: int) -> list[Pin]:
    """Store every matrix (and its optimizer state) split by rows: the checkpoint holds real shards."""
    return [
        Pin(v, Sharding((Shard(0),)))
        for v in graph.inputs
        if graph.vars[v].role in ("parameter", "optimizer_state")
        and graph.vars[v].ndim == 2
        and graph.vars[v].shape[0] % n == 0
    ]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    a, b = full(a).detach().double(), full(b).detach().double()
    return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * max(1e-3, b.abs().max().item())))


def compare_state(name, model, ref_model, rtol, errors):
    ref = ref_model.state_dict()
    for k, v in model.state_dict().items():
        if not close(v, ref[k], rtol):
            d = (full(v).detach().double() - full(ref[k]).detach().double()).abs().max().item()
            errors.append(f"{name}: {k} differs by {d:.3g} (rtol {rtol})")


def compare_losses(name, got, want, rtol, errors):
    for i, (a, b) in enumerate(zip(got, want)):
        if abs(a - b) > rtol * max(1.0, abs(b)):
            errors.append(f"{name}: loss of step {i}: {a} vs {b} (rtol {rtol})")


def predicted_bytes(plan, only=None) -> int:
    """Bytes per step of the plan's collectives, each (value, collectives) once, as the lowering runs them."""
    seen, total = set(), 0
    for e in plan.edges:
        if only is not None and e.var not in only:
            continue
        key = (e.var, tuple((c.kind, c.axis, c.dims, c.reduce, str(c.before), str(c.after)) for c in e.collectives))
        if e.collectives and key not in seen:
            seen.add(key)
            total += sum(c.nbytes for c in e.collectives if not c.is_free)
    return total


# -- mode four ------------------------------------------------------------------------------------


def check_autocast(mesh, profile, errors, report):
    from metadist_torch import metadist_compile

    batches = [mlp.batch(AMP_CFG, s) for s in range(3)]
    m_ref, o_ref = mlp.build(AMP_CFG)
    ref = [float(autocast_step(m_ref, o_ref, *b)) for b in batches]
    m, o = mlp.build(AMP_CFG)
    with profile_env(profile):  # gradients all-reduced (in bf16 where autocast made them bf16)
        # the ddp preset: gradients made as partial sums and all-reduced (pinning only where the batch is
        # stored no longer splits it: every rank holds the whole batch, and the tiny step then ran replicated).
        # SGD, not Adam: the bf16 partial gradients summed over 4 ranks round differently from one matmul's,
        # and Adam's update turns a near-zero gradient's sign flip into a whole step of lr (2e-2 here)
        step = metadist_compile(mesh=mesh, strategy="ddp")(autocast_step)
    got = [float(step(m, o, *b)) for b in batches]
    compare_losses("autocast", got, ref, BF16_TOL, errors)
    compare_state("autocast", m, m_ref, BF16_TOL, errors)
    dtypes = sorted({step.graph.vars[v].dtype for v in step.graph.vars})
    if "bfloat16" not in dtypes:
        errors.append(f"autocast: the traced step holds no bfloat16 value ({dtypes})")
    if not any(not c.is_free for _, c in step.plan.collectives()):
        errors.append(f"autocast: the plan splits nothing: {step.plan.summary()}")
    report["autocast"] = {
        "losses": got,
        "ref": ref,
        "plan": step.plan.summary(),
        "collectives": sum(1 for _, c in step.plan.collectives() if not c.is_free),
    }


def check_compression(mesh, errors, report, steps=50):
    from metadist_core.cost.compression import wire_dtypes
    from metadist_torch import metadist_compile

    batches = [mlp.batch(DDP_CFG, s) for s in range(steps)]
    m0, o0 = mlp.build(DDP_CFG)
    graph = graph_of(mlp.train_step, m0, o0, batches[0])
    grads = set(wire_dtypes(graph, "bf16"))
    if not grads:
        errors.append("compression: the traced step marks no gradient")
    out = {}
    for mode in (None, "bf16"):
        m, o = mlp.build(DDP_CFG)
        step = metadist_compile(mesh=mesh, strategy="ddp", grad_compression=mode)(mlp.train_step)
        losses = [float(step(m, o, *batches[0]))]
        step.comm_stats.reset()
        t0 = time.perf_counter()
        losses += [float(step(m, o, *b)) for b in batches[1:]]
        secs = (time.perf_counter() - t0) / (steps - 1)
        counted = step.comm_stats.total / (steps - 1)
        out[str(mode)] = {
            "losses": losses,
            "counted": counted,
            "predicted": predicted_bytes(step.plan),
            "predicted_grad": predicted_bytes(step.plan, grads),
            "step_ms": 1e3 * secs,
            "objective_s": step.plan.objective,
            "comm_s": step.plan.comm_seconds,
            "params": [full(p).detach().clone() for p in m.parameters()],
        }
        if counted != out[str(mode)]["predicted"]:
            errors.append(
                f"compression {mode}: counted {counted} bytes per step, the plan predicts {out[str(mode)]['predicted']}"
            )
    u, c = out["None"], out["bf16"]
    if u["predicted_grad"] == 0 or c["predicted_grad"] * 2 != u["predicted_grad"]:
        errors.append(
            f"compression: gradient bytes {c['predicted_grad']} compressed vs {u['predicted_grad']} "
            f"uncompressed; expected half"
        )
    non_grad_u, non_grad_c = u["counted"] - u["predicted_grad"], c["counted"] - c["predicted_grad"]
    if non_grad_u != non_grad_c:
        errors.append(f"compression: non-gradient bytes changed: {non_grad_c} vs {non_grad_u}")
    l20u, l20c = u["losses"][19], c["losses"][19]
    if abs(l20c - l20u) > 0.01 * abs(l20u):
        errors.append(f"compression: loss after 20 steps {l20c} vs {l20u} uncompressed: more than 1 % apart")
    drift = [abs(a - b) / abs(b) for a, b in zip(c["losses"], u["losses"])]
    pdrift = max(((a - b).norm() / b.norm()).item() for a, b in zip(c["params"], u["params"]))
    report["compression"] = {
        "counted_bytes_per_step": {"none": u["counted"], "bf16": c["counted"]},
        "gradient_bytes_per_step": {"none": u["predicted_grad"], "bf16": c["predicted_grad"]},
        "loss_20": {"none": l20u, "bf16": l20c},
        f"loss_{steps}": {"none": u["losses"][-1], "bf16": c["losses"][-1]},
        "max_rel_loss_drift": max(drift),
        f"rel_loss_drift_{steps}": drift[-1],
        "max_rel_param_drift": pdrift,
        "step_ms": {"none": u["step_ms"], "bf16": c["step_ms"]},
        "predicted_comm_s": {"none": u["comm_s"], "bf16": c["comm_s"]},
    }


def check_save(mesh, out_dir: Path, errors, report):
    from metadist_torch import metadist_compile, save_checkpoint

    batches = [mlp.batch(CKPT_CFG, s) for s in range(6)]
    m_ref, o_ref = mlp.build(CKPT_CFG)
    ref = [float(mlp.train_step(m_ref, o_ref, *b)) for b in batches]
    m, o = mlp.build(CKPT_CFG)
    pins = sharded_pins(graph_of(mlp.train_step, *mlp.build(CKPT_CFG), batches[0]), mesh[0])
    step = metadist_compile(mesh=mesh, constraints=pins)(mlp.train_step)
    losses = [float(step(m, o, *b)) for b in batches[:3]]
    w = m[0].weight
    if not (hasattr(w, "placements") and w.placements[0].is_shard()):
        errors.append(
            f"save: the first weight is not stored sharded: {type(w).__name__} {getattr(w, 'placements', None)}"
        )
    dist.barrier()
    t_save = save_checkpoint(out_dir / "ckpt", m, o)
    losses += [float(step(m, o, *b)) for b in batches[3:]]
    compare_losses("uninterrupted", losses, ref, RTOL, errors)
    compare_state("uninterrupted", m, m_ref, RTOL, errors)
    final = {k: full(v).detach().clone() for k, v in m.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "state": final}, out_dir / "uninterrupted.pt")
    report["checkpoint_save_s"] = t_save
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in (out_dir / "ckpt").iterdir())


# -- mode two ---------------------------------------------------------------------------------------


def check_resume(name, out_dir: Path, mesh, errors, report, *, after_compile: bool):
    from metadist_torch import load_checkpoint, metadist_compile

    done = torch.load(out_dir / "uninterrupted.pt")
    batches = [mlp.batch(CKPT_CFG, s) for s in range(6)]
    m, o = mlp.build(mlp.MLPConfig(**{**CKPT_CFG.__dict__, "seed": 11}))  # other initial values
    pins = sharded_pins(graph_of(mlp.train_step, *mlp.build(CKPT_CFG), batches[0]), mesh[0]) if mesh else []
    step = metadist_compile(mesh=mesh, constraints=pins)(mlp.train_step)
    if after_compile:  # state already lives as DTensors of this mesh; one step moves it away first
        step(m, o, *batches[5])
    t_load = load_checkpoint(out_dir / "ckpt", m, o)
    losses = [float(step(m, o, *b)) for b in batches[3:]]
    compare_losses(name, losses, done["losses"][3:], RTOL, errors)
    for k, v in m.state_dict().items():
        if not close(v, done["state"][k], RTOL):
            errors.append(
                f"{name}: {k} differs from the uninterrupted run by "
                f"{(full(v).double() - done['state'][k].double()).abs().max().item():.3g}"
            )
    report[name] = {"losses": losses, "load_s": t_load}


def main() -> int:
    torch.set_num_threads(1)
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    from metadist_torch.runtime.engine import ensure_process_group

    ensure_process_group()
    errors: list[str] = []
    report: dict = {}
    world = dist.get_world_size()
    profile = slow_link_profile(out_dir)
    checks = {
        "four": [
            lambda: check_autocast((world,), profile, errors, report),
            lambda: check_scaler("scaler_ddp", (world,), errors, report, strategy="ddp"),
            lambda: check_scaler(
                "scaler_sharded",
                (world,),
                errors,
                report,
                constraints=sharded_pins(graph_of(scaled_step, *build_scaled(), scaled_batches()[0]), world),
            ),
            lambda: check_compression((world,), errors, report),
            lambda: check_save((world,), out_dir, errors, report),
        ],
        "two": [
            lambda: check_resume("resume_before_compile", out_dir, (world,), errors, report, after_compile=False),
            lambda: check_resume("resume_after_compile", out_dir, (world,), errors, report, after_compile=True),
        ],
    }[mode]
    for check in checks:
        t0 = time.perf_counter()
        try:
            check()
        except Exception as e:  # reported by the test, with the traceback
            errors.append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        report.setdefault("seconds", []).append(time.perf_counter() - t0)
    gathered = [None] * world
    dist.all_gather_object(gathered, errors)
    if dist.get_rank() == 0:
        (out_dir / f"{mode}.json").write_text(
            json.dumps({"errors": [e for es in gathered for e in es], "report": report}, indent=1, default=str)
        )
    return 0


if __name__ == "__main__":
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(main())
