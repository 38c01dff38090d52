"""Distributed implementations in the core: layouts, the registry, prices, refusals, and verify_impl accepting a
right split and rejecting wrong ones (a prefix sum along the sequence, split with an exchange of chunk totals)."""

from __future__ import annotations

import numpy as np
import pytest

from metadist_core.discovery import cp_attention as cpa
from metadist_core.discovery.distimpl import (
    DistImpl,
    DistImplRegistry,
    ImplPrice,
    SeqLayout,
    inverse_permutation,
    join,
    split,
    verify_impl,
)
from metadist_core.ir.placement import Partial, Shard

HT, CONT = SeqLayout("head_tail"), SeqLayout("contiguous")


def test_head_tail_permutation_and_inverse():
    assert HT.chunks(0, 2) == (0, 3) and HT.chunks(1, 2) == (1, 2)
    assert HT.permutation(8, 2) == [0, 1, 6, 7, 2, 3, 4, 5]
    assert CONT.permutation(4, 2) == [0, 1, 2, 3]
    perm = HT.permutation(24, 4)
    inv = inverse_permutation(perm)
    assert [perm[inv[i]] for i in range(24)] == list(range(24))
    x = np.arange(2 * 16).reshape(2, 16)
    pieces = split(x, Shard(1), 4, HT)
    assert pieces[0][0].tolist() == [0, 1, 14, 15]
    assert np.array_equal(join(pieces, Shard(1), HT)[0], x)
    with pytest.raises(ValueError, match="divisible by 8"):
        HT.permutation(12, 4)


def _cumsum_impl(layout: SeqLayout) -> DistImpl:
    return DistImpl(
        name=f"cumsum.{layout.kind}",
        op_keys=("np.cumsum",),
        inputs=(Shard(1),),
        outputs=(Shard(1),),
        price=lambda shapes, itemsize, n: ImplPrice(0.0, float(np.prod(shapes[0]))),
        refusal=lambda attrs, shapes, n: layout.check(shapes[0][1], n),
        layout=layout,
    )


def _cumsum_pieces(layout: SeqLayout, carry: bool = True):
    """Each rank: the prefix sum of its chunks plus the totals of every chunk before each (all-gathered)."""

    def run(inputs, cots):
        n = len(inputs)
        k = layout.chunks_per_rank()
        chunks = {i: c for r, (x,) in enumerate(inputs) for i, c in zip(layout.chunks(r, n), np.split(x, k, 1))}
        totals = {i: c.sum(1, keepdims=True) for i, c in chunks.items()}
        out = []
        for r in range(n):
            mine = []
            for i in layout.chunks(r, n):
                before = sum((totals[j] for j in range(i)), np.zeros_like(totals[i])) if carry else 0.0
                mine.append(np.cumsum(chunks[i], 1) + before)
            out.append([np.concatenate(mine, 1)])
        return out

    return run


@pytest.mark.parametrize("layout", [HT, CONT])
@pytest.mark.parametrize("n", [2, 4])
def test_verify_impl_accepts_a_right_split_and_rejects_a_wrong_one(layout, n):
    impl = _cumsum_impl(layout)
    whole = lambda inputs, cots: [np.cumsum(inputs[0], 1)]
    examples = [np.zeros((3, 16))]
    good = verify_impl(impl, whole, _cumsum_pieces(layout), examples, n)
    assert good.ok, str(good)
    assert good.draws >= 3 * 6  # every seed, every family but the examples
    bad = verify_impl(impl, whole, _cumsum_pieces(layout, carry=False), examples, n)
    assert not bad.ok and "output 0" in bad.failures[0]


def test_verify_impl_refuses_float32_and_bad_sizes():
    impl = _cumsum_impl(HT)
    whole = lambda inputs, cots: [np.cumsum(inputs[0], 1)]
    with pytest.raises(ValueError, match="float64"):
        verify_impl(impl, whole, _cumsum_pieces(HT), [np.zeros((2, 8), np.float32)], 2)
    with pytest.raises(ValueError, match="divisible by 8"):
        verify_impl(impl, whole, _cumsum_pieces(HT), [np.zeros((2, 12))], 4)
    with pytest.raises(ValueError, match="no grad_outputs"):
        verify_impl(impl, whole, _cumsum_pieces(HT), [np.zeros((2, 8))], 2, backward=True)


def test_registry_registers_once_and_names_missing_hooks():
    reg = DistImplRegistry()
    impls = cpa.register_attention(reg)
    assert len(impls) == 4 and cpa.register_attention(reg) == impls  # once per registry
    with pytest.raises(ValueError, match="already registered"):
        reg.register(cpa.attention_impls(HT)[0])
    with pytest.raises(KeyError, match="attached no 'lower' hook"):
        reg.hook(cpa.impl_name(HT), "torch", "lower")
    with pytest.raises(KeyError, match="no distributed implementation 'nope'"):
        reg.get("nope")
    with pytest.raises(ValueError, match="Shard or Replicate"):
        DistImpl("p", ("k",), (Partial("sum"),), (), impls[0].price, impls[0].refusal)


def _attrs(mask=None, causal=True, dropout=0.0):
    return {"args": [{"$in": 0}, {"$in": 1}, {"$in": 2}, dropout, causal], "kwargs": {"attn_mask": mask}}


def test_attention_applies_only_to_plain_causal_self_attention():
    reg = DistImplRegistry()
    cpa.register_attention(reg)
    q, kv = (2, 8, 32, 16), (2, 2, 32, 16)
    ok, why = reg.matching(cpa.CPU_FORWARD, _attrs(), [q, kv, kv], 4)
    assert {i.name for i in ok} == {cpa.impl_name(HT), cpa.impl_name(CONT)} and not why
    _, why = reg.matching(cpa.CPU_FORWARD, _attrs(mask={"$in": 3}), [q, kv, kv], 4)
    assert all("explicit attn_mask" in w for w in why.values()) and len(why) == 2
    _, why = reg.matching(cpa.CPU_FORWARD, _attrs(causal=False), [q, kv, kv], 4)
    assert all("is_causal=False" in w for w in why.values())
    _, why = reg.matching(cpa.CPU_FORWARD, _attrs(dropout=0.1), [q, kv, kv], 4)
    assert all("dropout_p=0.1" in w for w in why.values())
    ok, why = reg.matching(cpa.CPU_FORWARD, _attrs(), [(2, 8, 36, 16), (2, 2, 36, 16), (2, 2, 36, 16)], 4)
    assert [i.name for i in ok] == [cpa.impl_name(CONT)] and "divisible by 8, got 36" in why[cpa.impl_name(HT)]
    bwd_attrs = {"args": [{"$in": i} for i in range(6)] + [0.0, True], "kwargs": {}}
    ok, _ = reg.matching(cpa.CPU_BACKWARD, bwd_attrs, [q, q, kv, kv, q, q[:3]], 2)
    assert len(ok) == 2


def test_attention_price_balances_head_tail():
    b, h, hkv, seq, d, n = 1, 8, 2, 1024, 64, 4
    shapes = [(b, h, seq, d), (b, hkv, seq, d), (b, hkv, seq, d)]
    fwd, _ = cpa.attention_impls(HT)
    p = fwd.price(shapes, 2, n)
    assert p.comm_bytes == pytest.approx(2 * b * hkv * seq * d * 2 * (n - 1) / n)  # K and V, bf16, 3/4 received
    whole_causal = 2.0 * b * h * seq * seq * 2 * d / 2  # QK^T and PV over the lower triangle
    assert p.flops == pytest.approx(whole_causal / n, rel=1e-9)
    assert cpa.balance(n, HT) == pytest.approx(1.0)
    assert cpa.balance(n, CONT) == pytest.approx(3.5 / 2.0)  # the last rank's chunk: 3.5 blocks of a mean of 2
    _, bwd = cpa.attention_impls(HT)
    pb = bwd.price([shapes[0], *shapes, shapes[0], shapes[0][:3]], 2, n)
    assert pb.comm_bytes == pytest.approx(2 * p.comm_bytes) and pb.flops == pytest.approx(2.5 * p.flops)
