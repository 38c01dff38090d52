"""Context parallelism on 4 gloo ranks: memory per rank against one device's as the sequence grows, and the
step beside FSDP2 at a quarter of the sequence.

    python -m benchmarks.context_parallel [--quick] [--nproc 4]

transformers' LLaMA (2 layers, width 64, 4 query heads, 2 key-value heads, vocabulary 256, built from a
config with the default ``use_cache``, so SDPA is called with ``is_causal=True``), AdamW, one sequence per
step. For each sequence length ``S``:

- ``cp``: ``metadist_compile(strategy="cp")`` on mesh (4,): the sequence split over the 4 ranks, K/V
  all-gathered inside attention. Measured: each rank's peak tensor memory over one step
  (``step.memory``: live storages on CPU), the plan's prediction beside it, and the bytes its collectives
  moved in that step (``step.comm_stats``, gathers at their gathered size) beside the plan's
  (:func:`predicted_gather_bytes`: the plan's edges, plus the implementation's K/V gathers at their local
  shapes);
- ``one_device``: the same step eager on one process (rank 0), its peak measured the same way.

At the longest sequence, ``fsdp2`` (``fully_shard`` on every decoder layer and the model, each rank its own
sequence of ``S / 4``: the same tokens per step) and ``cp`` are timed interleaved, one step of each per
round. Records: results/context_parallel.{json,md}; the plot context_parallel.png (memory against sequence).
Four ranks on two cores time scheduling noise as much as the step: the memory columns are the result here.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks._launch import add_worker_args, finish, launch, write_rank0
from benchmarks._models import adamw, llama, lm_step

NAME = "context_parallel"
MB = 2**20
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _build(seq: int):
    model = llama(seed=0, num_key_value_heads=2, max_position_embeddings=seq, **SIZES)
    return model, adamw(model, 1e-3)


def _ids(seq: int, n: int, batch: int = 1, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SIZES["vocab_size"], (batch, seq), generator=g) for _ in range(n)]


def predicted_gather_bytes(plan, graph) -> dict[str, float]:
    """Bytes per rank the plan's collectives move in one step, by kind, as ``CommStats`` counts them (a
    gather its gathered output, a reduce-scatter its input): the plan's edges, plus each distributed
    implementation's own collectives (context-parallel attention: K and V gathered whole along its axis,
    and in the backward their gradients reduce-scattered) at the local shapes of the other axes."""
    from metadist_core.cost.model import itemsize
    from metadist_core.discovery.cp_attention import backward_workspace, forward_workspace
    from metadist_core.ir.mesh import Mesh
    from metadist_core.problem.distimpls import local_shapes

    out: dict[str, float] = {}
    for _, c in plan.collectives():
        if not c.is_free:
            out[c.kind] = out.get(c.kind, 0.0) + c.nbytes
    mesh = Mesh(plan.mesh_shape)
    for op in graph.ops:
        st = plan.strategies.get(op.id)
        placed = st.impl_axis() if st is not None else None
        if placed is None:
            continue
        axis, name = placed
        tensors = [v for v in op.inputs if graph.vars[v].is_tensor]
        local = local_shapes(st, [graph.vars[v].shape for v in tensors], mesh, axis)
        size = itemsize(graph.vars[tensors[0]].dtype)
        n = plan.mesh_shape[axis]
        # K and V gathered whole are the forward's workspace; the backward's holds them and their gradients,
        # which it reduce-scatters at the size it sums them in
        qkv = local[1:4] if name.endswith(".backward") else local[:3]
        gathered = forward_workspace(qkv, size, n)
        out["all_gather"] = out.get("all_gather", 0.0) + gathered
        if name.endswith(".backward"):
            out["reduce_scatter"] = out.get("reduce_scatter", 0.0) + backward_workspace(local, size, n) - gathered
    return out


def _cp(seq: int, cache: str) -> tuple[dict, object]:
    from metadist_torch import metadist_compile

    model, opt = _build(seq)
    ids = _ids(seq, 2)
    step = metadist_compile(mesh=(4,), strategy="cp", cache_dir=cache)(lm_step)
    step(model, opt, ids[0])  # compile; this first call is measured (step.memory)
    mem = step.memory
    step.comm_stats.reset()
    step(model, opt, ids[1])
    counted = dict(step.comm_stats.bytes)
    rec = {
        "measured_peak_mb": mem["measured_peak_bytes"] / MB,
        "predicted_peak_mb": mem["predicted_peak_bytes"] / MB,
        "method": mem["method"],
        "counted_all_gather_mb": counted.get("all_gather", 0) / MB,
        "counted_reduce_scatter_mb": counted.get("reduce_scatter", 0) / MB,
        "cp_ops": sum(1 for st in step.plan.strategies.values() if st.impls),
    }
    if step.plan.problem is not None:  # rank 0 holds the problem and the graph
        pred = predicted_gather_bytes(step.plan, step.graph)
        rec["predicted_all_gather_mb"] = pred.get("all_gather", 0.0) / MB
        rec["predicted_reduce_scatter_mb"] = pred.get("reduce_scatter", 0.0) / MB
    return rec, (step, model, opt)


def _one_device(seq: int) -> dict:
    from metadist_torch.measure.memory import measure_peak, state_tensors

    model, opt = _build(seq)
    ids = _ids(seq, 2)
    lm_step(model, opt, ids[0])  # the optimizer state exists from here on, as in the compiled step
    _, m = measure_peak(lambda: lm_step(model, opt, ids[1]), state_tensors(model, opt) + [ids[1]])
    return {"measured_peak_mb": m.peak_bytes / MB, "method": m.method}


def _fsdp2(seq: int, rank: int, world: int):
    from torch.distributed.fsdp import fully_shard

    model, _ = _build(seq)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = adamw(model, 1e-3)
    ids = _ids(seq // world, world, seed=rank)  # this rank's own sequences of S / 4
    return model, opt, ids


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from metadist_torch.runtime.engine import ensure_process_group

    torch.set_num_threads(1)
    rank, world = ensure_process_group()
    seqs = [int(s) for s in args.seqs.split(",")]
    records = []
    kept = None
    for seq in seqs:
        rec, kept = _cp(seq, args.cache_dir)
        peaks = [None] * world
        dist.all_gather_object(peaks, rec["measured_peak_mb"])
        rec.update({"system": "cp", "seq": seq, "ranks": world, "max_rank_peak_mb": max(peaks)})
        records.append(rec)
        if rank == 0:
            one = _one_device(seq)
            records.append({"system": "one_device", "seq": seq, "ranks": 1, **one})
            print(f"  S={seq}: cp {max(peaks):.1f} MB/rank, one device {one['measured_peak_mb']:.1f} MB", flush=True)
        dist.barrier()
    seq = seqs[-1]
    step, model, opt = kept
    cp_ids = _ids(seq, args.rounds + 1, seed=7)
    f_model, f_opt, f_ids = _fsdp2(seq, rank, world)
    lm_step(f_model, f_opt, f_ids[0])  # warm
    cp_ms, fsdp_ms = [], []
    for r in range(args.rounds):
        cp_ms.append(_timed(lambda: step(model, opt, cp_ids[r + 1])) * 1e3)
        fsdp_ms.append(_timed(lambda: lm_step(f_model, f_opt, f_ids[1 + r % (len(f_ids) - 1)])) * 1e3)
    ratio = statistics.median(c / f for c, f in zip(cp_ms, fsdp_ms))
    records.append(
        {
            "system": "timing",
            "seq": seq,
            "ranks": world,
            "cp_step_ms": statistics.median(cp_ms),
            "fsdp2_quarter_seq_step_ms": statistics.median(fsdp_ms),
            "cp_over_fsdp2_by_round": ratio,
            "rounds": args.rounds,
        }
    )
    write_rank0(args.out, records)
    return 0


COLS = [
    "system",
    "seq",
    "ranks",
    "measured_peak_mb",
    "max_rank_peak_mb",
    "predicted_peak_mb",
    "counted_all_gather_mb",
    "predicted_all_gather_mb",
    "counted_reduce_scatter_mb",
    "predicted_reduce_scatter_mb",
    "cp_ops",
    "cp_step_ms",
    "fsdp2_quarter_seq_step_ms",
    "cp_over_fsdp2_by_round",
    "method",
]


def plot(records: list[dict]):
    from benchmarks._common import RESULTS

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for system, label in (("one_device", "one device"), ("cp", "cp on 4 ranks (largest rank)")):
        rows = sorted((r for r in records if r["system"] == system), key=lambda r: r["seq"])
        key = "max_rank_peak_mb" if system == "cp" else "measured_peak_mb"
        ax.plot([r["seq"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak tensor memory (MiB)")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.set_title("LLaMA 2 layers, width 64: memory per rank")
    fig.tight_layout()
    path = RESULTS / f"{NAME}.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sequences 256 and 1024, 3 timed rounds")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 256,512,1024,2048)")
    ap.add_argument("--rounds", type=int, default=None)
    add_worker_args(ap, cache=True)
    args = ap.parse_args(argv)
    if args.seqs is None:
        args.seqs = "256,1024" if args.quick else "256,512,1024,2048"
    if args.rounds is None:
        args.rounds = 3 if args.quick else 8
    if args.worker:
        finish(worker(args))
    from benchmarks._common import write_results

    got = launch(
        __file__,
        args.nproc,
        ["--seqs", args.seqs, "--rounds", str(args.rounds)],
        timeout=3600,
        cache=True,
        show=lambda line: line.startswith("  S="),
    )
    if got is None:
        return 1
    records = got.data
    notes = (
        "transformers' LLaMA (2 layers, width 64, 4 query and 2 key-value heads, vocabulary 256), AdamW, one "
        "sequence per step. cp: metadist_compile(strategy='cp') on mesh (4,), gloo, one thread a rank; "
        "measured_peak_mb: rank 0's peak tensor memory over one step (live storages), max_rank_peak_mb the "
        "largest rank's; predicted_peak_mb: the plan's peak with its collectives' buffers and the K/V gathered "
        "inside attention. counted_*: step.comm_stats over one step; predicted_*: the plan's "
        "edges plus the implementation's K/V gathers at their local shapes. one_device: the eager step on one "
        "process. timing: cp at the longest sequence against FSDP2 (fully_shard per decoder layer, each rank "
        "its own sequence of a quarter of the length), one step of each per round, medians and the median "
        "of the per-round ratio; 4 ranks share 2 cores here."
    )
    write_results(NAME, records, COLS, "Context parallelism: memory per rank and step time", notes)
    path = plot(records)
    print(f"wrote results/{NAME}.md" + (f" and {path.name}" if path else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
