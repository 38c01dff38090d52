"""Context-parallel causal attention on simulated ranks, verified by the core's verify_impl against the whole
op (torch's scaled_dot_product_attention, is_causal=True), forward and backward; wrong splits are rejected and
masks other than plain causal are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from metadist_core.discovery import cp_attention as cpa
from metadist_core.discovery.distimpl import DistImplRegistry, SeqLayout, verify_impl
from metadist_torch.ops import cp_attention as cp

HT, CONT = SeqLayout("head_tail"), SeqLayout("contiguous")
B, HQ, HKV, SEQ, D = 2, 8, 2, 16, 8  # grouped-query: 8 query heads over 2 key/value heads


def _examples(seq: int = SEQ) -> list[np.ndarray]:
    return [np.zeros((B, HQ, seq, D)), np.zeros((B, HKV, seq, D)), np.zeros((B, HKV, seq, D))]


def _whole(inputs, cots):
    """The whole op: sdpa on the whole sequence; its log-sum-exp from the masked scores; autograd's gradients."""
    q, k, v = (torch.from_numpy(x).requires_grad_(cots is not None) for x in inputs)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rep = HQ // HKV
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / D**0.5
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    lse = torch.logsumexp(scores.masked_fill(~causal, float("-inf")), -1)
    res = [out.detach().numpy(), lse.detach().numpy()]
    if cots is not None:
        res += [g.numpy() for g in torch.autograd.grad(out, (q, k, v), torch.from_numpy(cots[0]))]
    return res


def _pieces(registry: DistImplRegistry, layout: SeqLayout):
    fwd = registry.hook(cpa.impl_name(layout), "torch", "simulate")
    bwd = registry.hook(cpa.impl_name(layout, True), "torch", "simulate")

    def run(inputs, cots):
        qs, ks, vs = ([torch.from_numpy(r[i]) for r in inputs] for i in range(3))
        outs = fwd(qs, ks, vs)
        res = [[o.numpy(), lse.numpy()] for o, lse in outs]
        if cots is not None:
            douts = [torch.from_numpy(c[0]) for c in cots]
            grads = bwd(douts, qs, ks, vs, [o for o, _ in outs], [lse for _, lse in outs])
            res = [r + [g.numpy() for g in gr] for r, gr in zip(res, grads)]
        return res

    return run


@pytest.fixture(scope="module")
def registry() -> DistImplRegistry:
    reg = DistImplRegistry()
    cp.register_torch(reg)
    cp.register_torch(reg)  # once: a second call changes nothing
    return reg


@pytest.mark.parametrize("layout", [HT, CONT], ids=["head_tail", "contiguous"])
@pytest.mark.parametrize("n", [2, 4])
def test_split_attention_matches_the_whole_op_forward_and_backward(registry, layout, n):
    impl = registry.get(cpa.impl_name(layout))
    verdict = verify_impl(impl, _whole, _pieces(registry, layout), _examples(), n, backward=True)
    assert verdict.ok, str(verdict)
    assert verdict.draws >= 18


def _wrong_merge(out, lse, out_b, lse_b):
    return (out + out_b) / 2, torch.logaddexp(lse, lse_b)  # the outputs averaged: no log-sum-exp weights


def _causal_from_own_start(q, k_all, v_all, chunks, scale, backend):
    """Each rank's queries masked causally from their own first position against all keys (top-left)."""
    return backend.forward(q, k_all, v_all, True, scale)


def _backward_on_block_stats(dout, q, k_all, v_all, out, lse, chunks, scale, backend):
    """Each block's kernel backward fed the block's own output and log-sum-exp, not the merged ones."""
    c = q.shape[2] // len(chunks)
    dk_all, dv_all, dqs = torch.zeros_like(k_all), torch.zeros_like(v_all), []
    for j, i in enumerate(chunks):
        qi, doi = q[:, :, j * c : (j + 1) * c], dout[:, :, j * c : (j + 1) * c]
        dq = torch.zeros_like(qi)
        for lo, hi, causal in cp._blocks(i, c):
            kb, vb = k_all[:, :, lo:hi], v_all[:, :, lo:hi]
            ob, lb = backend.forward(qi, kb, vb, causal, scale)
            dq_b, dk_b, dv_b = backend.backward(doi, qi, kb, vb, ob, lb, causal, scale)
            dq += dq_b
            dk_all[:, :, lo:hi] += dk_b
            dv_all[:, :, lo:hi] += dv_b
        dqs.append(dq)
    return torch.cat(dqs, 2), dk_all, dv_all


@pytest.mark.parametrize("wrong", ["merge", "mask", "backward"])
def test_wrong_splits_are_rejected(registry, monkeypatch, wrong):
    patch = {"merge": ("_merge", _wrong_merge), "mask": ("rank_forward", _causal_from_own_start)}
    patch["backward"] = ("rank_backward", _backward_on_block_stats)
    monkeypatch.setattr(cp, *patch[wrong])
    impl = registry.get(cpa.impl_name(HT))
    verdict = verify_impl(impl, _whole, _pieces(registry, HT), _examples(), 2, seeds=(0,), backward=True)
    assert not verdict.ok
    assert ("gradient of input 0" if wrong == "backward" else "output 0") in str(verdict)


def test_masks_other_than_plain_causal_are_refused():
    q, k = torch.randn(B, HQ, SEQ, D), torch.randn(B, HKV, SEQ, D)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    with pytest.raises(cp.UnsupportedAttention, match="explicit attn_mask"):
        cp.simulate_attention(q, k, k, 2, HT, attn_mask=mask, is_causal=False)
    with pytest.raises(cp.UnsupportedAttention, match="is_causal=False"):
        cp.simulate_attention(q, k, k, 2, HT)
    with pytest.raises(cp.UnsupportedAttention, match="dropout_p=0.5"):
        cp.simulate_attention(q, k, k, 2, HT, is_causal=True, dropout_p=0.5)
    with pytest.raises(cp.UnsupportedAttention, match="divisible by 8, got 12"):
        cp.simulate_attention(q[:, :, :12], k[:, :, :12], k[:, :, :12], 4, HT, is_causal=True)


def test_float32_merge_and_custom_scale():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 32, 16), torch.randn(1, 1, 32, 16), torch.randn(1, 1, 32, 16)
    got = cp.simulate_attention(q, k, v, 4, HT, is_causal=True, scale=0.3)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_permutation_matches_the_core():
    x = torch.arange(16).reshape(1, 1, 16, 1)
    perm = HT.permutation(16, 4)
    assert cp.to_rank_order(x, 4, HT).flatten().tolist() == perm
    assert torch.equal(cp.to_sequence_order(cp.to_rank_order(x, 4, HT), 4, HT), x)


def _lowered_rank(rank: int, n: int, port: int, layout_kind: str, conn) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        torch.manual_seed(0)
        lay = SeqLayout(layout_kind)
        q, k, v = (torch.randn(1, h, 16, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
        g = torch.randn(1, 4, 16, 8, dtype=torch.float64)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(ref, (q, k, v), g)
        loc = lambda t: cp.to_rank_order(t.detach(), n, lay).chunk(n, 2)[rank]
        out, lse = cp.lower_forward(loc(q), loc(k), loc(v), group=dist.group.WORLD, layout=lay)
        got = cp.lower_backward(loc(g), loc(q), loc(k), loc(v), out, lse, group=dist.group.WORLD, layout=lay)
        errs = [float((a - loc(b)).abs().max()) for a, b in zip((out, *got), (ref, *grads))]
        conn.send(errs)
    finally:
        dist.destroy_process_group()


def test_lowering_on_two_gloo_ranks_matches_the_whole_op():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_lowered_rank, args=(r, 2, port, "head_tail", pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    errs = [pipes[r][0].recv() if pipes[r][0].poll(120) else None for r in range(2)]
    for p in procs:
        p.join(30)
    assert all(e is not None and max(e) < 1e-12 for e in errs), errs
