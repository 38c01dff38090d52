"""AxisComm.all_gather_bucket and reduce_scatter_bucket on 3 gloo ranks (forked processes): uneven pieces
(one rank empty) split on different dims, in one call, give each whole tensor (each rank's chunk of each
sum), as one collective each would."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

N = 3
FULL = [((5, 4), 0, torch.float32), ((3, 7), 1, torch.float32), ((2,), 0, torch.float32), ((6, 2, 3), 2, torch.float32)]


def _worker(rank: int, store: str, q) -> None:
    try:
        from metadist_core.ir.placement import chunk_sizes
        from metadist_torch.lower.collectives import AxisComm
        from metadist_torch.runtime.stats import CommStats

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=N)
        g = torch.Generator().manual_seed(0)
        fulls = [torch.randn(shape, generator=g).to(dt) for shape, _, dt in FULL]
        pieces, dims, sizes = [], [], []
        for t, (shape, d, _) in zip(fulls, FULL):
            s = chunk_sizes(shape[d], N)
            pieces.append(torch.chunk(t, N, dim=d)[rank] if s[rank] else t.narrow(d, 0, 0))
            dims.append(d)
            sizes.append(s)
        stats = CommStats()
        outs = AxisComm(0, dist.group.WORLD, N, rank, stats).all_gather_bucket(pieces, dims, sizes)
        ok = all(torch.equal(o, t) for o, t in zip(outs, fulls))
        # reduce_scatter_bucket: every rank holds its own partial sums (whole tensors); each gets its chunk
        # of every member's sum (and of the mean for "avg")
        partial = [t * (rank + 1) for t in fulls]
        total = [t * sum(range(1, N + 1)) for t in fulls]
        comm = AxisComm(0, dist.group.WORLD, N, rank, stats)
        for reduce, scale in (("sum", 1.0), ("avg", 1.0 / N)):
            got = comm.reduce_scatter_bucket(partial, reduce, dims)
            for o, t, d in zip(got, total, dims):
                want = torch.chunk(t * scale, N, dim=d)[rank] if chunk_sizes(t.shape[d], N)[rank] else t.narrow(d, 0, 0)
                ok = ok and o.shape == want.shape and torch.allclose(o, want, rtol=1e-6, atol=1e-6)
        q.put(
            (
                rank,
                ok,
                stats.calls.get("all_gather"),
                stats.bytes.get("all_gather"),
                sum(t.numel() * t.element_size() for t in fulls),
            )
        )
        dist.destroy_process_group()
    except Exception as e:  # report, never hang the parent
        q.put((rank, repr(e), None, None, None))


def test_gather_and_reduce_scatter_buckets_give_each_member():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, store, q)) for r in range(N)]
        for p in procs:
            p.start()
        results = [q.get(timeout=120) for _ in range(N)]
        for p in procs:
            p.join(timeout=60)
    for rank, ok, calls, nbytes, want in results:
        assert ok is True, f"rank {rank}: {ok}"
        assert calls == len(FULL) and nbytes == want, (rank, calls, nbytes, want)
