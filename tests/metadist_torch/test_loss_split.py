"""A mean cross-entropy is traced as a sum over the count of kept targets (metadist_torch.trace.trace._nll_loss_mean).

As one op the mean is not a partial anything when ignored targets fall unevenly on the batch pieces,
so a batch-split plan had to gather the logits; as a sum (a partial sum) over a count taken from the
targets alone it splits with two scalar all_reduces. The rewrite must give the kernel's numbers bit for bit
on one device, keep class-weighted losses whole (their total weight is summed in another order), and
give the single-device numbers under a plan that splits the batch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from metadist_torch.trace.trace import trace_step  # noqa: E402


def _nll_ops(graph):
    return [op for op in graph.ops if op.key.startswith("aten.nll_loss_forward")]


def _loss_fn():
    def step(logits, targets):
        return F.cross_entropy(logits, targets, ignore_index=-100)

    return step


def _data(n=37, c=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, c, generator=g) * 3
    targets = torch.randint(0, c, (n,), generator=g)
    targets[: n // 3] = -100  # every ignored target on the first pieces: uneven over any split
    return logits, targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_cross_entropy_is_traced_as_sum_over_count_bit_for_bit(seed):
    logits, targets = _data(seed=seed)
    traced = trace_step(_loss_fn(), (logits, targets))
    (nll,) = _nll_ops(traced.graph)
    assert nll.attrs["args"][3] == 2, "the mean should be traced as a sum (reduction 2)"
    keys = {op.key for op in traced.graph.ops}
    assert "aten.ne.Scalar" in keys and "aten.div.Tensor" in keys
    got = traced.gm(logits, targets)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.equal(got, F.cross_entropy(logits, targets, ignore_index=-100))


def test_all_targets_ignored_gives_the_kernels_nan():
    logits, targets = _data()
    targets[:] = -100
    traced = trace_step(_loss_fn(), (logits, targets))
    got = traced.gm(logits, targets)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert torch.isnan(got) and torch.isnan(F.cross_entropy(logits, targets, ignore_index=-100))


def test_class_weighted_mean_stays_one_op():
    logits, targets = _data()
    w = torch.rand(logits.shape[1])
    traced = trace_step(lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=-100), (logits, targets, w))
    (nll,) = _nll_ops(traced.graph)
    assert nll.attrs["args"][3] == 1


def _split_step(logits, targets):
    logits = logits.detach().requires_grad_(True)
    loss = F.cross_entropy(logits, targets, ignore_index=-100)
    loss.backward()
    return loss.detach(), logits.grad


def _worker(rank: int, store: str, rules: str, q) -> None:
    try:
        import torch.distributed as dist
        from metadist_core.config import load_settings
        from metadist_core.problem.constraints import Pin
        from metadist_core.driver.compile import plan_graph
        from metadist_core.ir.mesh import Mesh
        from metadist_core.ir.placement import Partial, Sharding, Shard
        from metadist_torch.lower.lower import lower_plan

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        logits, targets = _data(n=24)
        g = trace_step(_split_step, (logits, targets)).graph
        (nll,) = _nll_ops(g)
        split, psum = Sharding((Shard(0),)), Sharding((Partial("sum"),))
        mesh = Mesh((2,), alpha=[1e-6], beta=[1e-12])
        pins = [Pin(v, split) for v in g.inputs[:2]] + [Pin(nll.outputs[0], psum)]
        plan = plan_graph(
            g, mesh, settings=load_settings(progress=False, cache_dir=rules, discovery_workers=1), constraints=pins
        ).plan
        rg = lower_plan(g, plan, mesh, coords=(rank,), groups=[dist.group.WORLD])
        outs = rg(logits.chunk(2)[rank], targets.chunk(2)[rank])
        big = tuple(logits.shape)  # no logits-sized value may be gathered but the gradient the step returns
        kinds = sorted(
            (c.kind, v)
            for v, c in rg.collectives
            if c.kind == "all_gather" and tuple(g.vars[v].shape) == big and v not in g.outputs
        )
        q.put((rank, [o.detach().numpy() for o in outs[:2]], kinds, plan.var_shardings[nll.outputs[0]] == psum))
        dist.destroy_process_group()
    except Exception:  # report, never hang the parent
        import traceback

        q.put((rank, traceback.format_exc(), None, None))


def test_batch_split_loss_gives_the_single_device_numbers(tmp_path):
    """Two gloo ranks (forked) run the lowered program of a plan that splits the batch and makes the loss
    a partial sum (pinned), with every ignored target on rank 0: loss and gradient are the full batch's."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), str(tmp_path / "rules"), q)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=240) for _ in range(2)]
    for p in procs:
        p.join(timeout=60)
    logits, targets = _data(n=24)
    ref_logits = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, targets, ignore_index=-100)
    ref.backward()
    for rank, outs, kinds, split in sorted(results, key=lambda r: r[0]):
        assert kinds is not None, f"rank {rank} failed:\n{outs}"
        assert split, "the pinned partial-sum loss was not planned"
        assert not kinds, f"a split loss should not gather logits-sized values: {kinds}"
        np.testing.assert_allclose(outs[0], ref.detach().numpy(), rtol=1e-6)
        np.testing.assert_allclose(outs[1], ref_logits.grad.numpy(), rtol=1e-5, atol=1e-7)
