"""The dropless experts layer: the op against a token-by-token reference, dropless expert parallelism on simulated
ranks verified by the core's verify_impl against the whole op (forward and backward, routings that leave experts
and ranks without tokens or send every token to one expert), the rules the op declares against ShardCombine's,
and the planner offering, pricing and pinning expert parallelism."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from metadist_core.discovery import moe_dispatch as core  # noqa: E402
from metadist_core.discovery.distimpl import DistImplRegistry, verify_impl  # noqa: E402
from metadist_torch.moe import dropless  # noqa: E402,F401  (registers the ops)
from metadist_torch.ops import ep_dispatch  # noqa: E402

T, K, H, E, FW = 12, 3, 6, 8, 5


def _reference(x, idx, w, gate_up, down):
    """Token by token, choice by choice: what the layer means."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g, u = F.linear(x[t], gate_up[e]).chunk(2, -1)
            acc = acc + w[t, j] * F.linear(F.silu(g) * u, down[e])
        rows.append(acc)
    return torch.stack(rows)


def _idx(v: np.ndarray) -> torch.Tensor:
    """Expert ids from any draw: a constant draw sends every pair to one expert, a sparse one most to expert 0."""
    return torch.from_numpy((np.floor(np.abs(v) * 3).astype(np.int64)) % E)


@pytest.mark.parametrize("routing", ["random", "one_expert", "half_the_experts"])
def test_the_op_and_its_gradients_are_the_token_by_token_layer(routing):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if routing == "one_expert":
        idx = torch.full((T, 1), 5)
    elif routing == "half_the_experts":
        idx = idx % (E // 2)
    w = torch.rand(idx.shape, dtype=torch.float64, generator=g, requires_grad=True)
    gate_up = torch.randn(E, 2 * FW, H, dtype=torch.float64, generator=g, requires_grad=True)
    down = torch.randn(E, H, FW, dtype=torch.float64, generator=g, requires_grad=True)
    got = torch.ops.metadist.moe_dropless(x, idx, w, gate_up, down, "silu")
    want = _reference(x, idx, w, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    cot = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, b in zip(
        torch.autograd.grad(got, (x, w, gate_up, down), cot), torch.autograd.grad(want, (x, w, gate_up, down), cot)
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def registry():
    reg = DistImplRegistry()
    ep_dispatch.register_torch(reg)
    return reg


def _examples(tokens: int = T) -> list[np.ndarray]:
    return [
        np.zeros((tokens, H)),
        np.zeros((tokens, K)),
        np.zeros((tokens, K)),
        np.zeros((E, 2 * FW, H)),
        np.zeros((E, H, FW)),
    ]


def _whole(inputs, cots):
    x, v, w, gu, dn = inputs
    tx, tw, tgu, tdn = (torch.from_numpy(a).requires_grad_(cots is not None) for a in (x, w, gu, dn))
    out = torch.ops.metadist.moe_dropless(tx, _idx(v), tw, tgu, tdn, "silu")
    res = [out.detach().numpy()]
    if cots is not None:
        gx, gw, ggu, gdn = torch.autograd.grad(out, (tx, tw, tgu, tdn), torch.from_numpy(cots[0]))
        res += [gx.numpy(), np.zeros_like(v), gw.numpy(), ggu.numpy(), gdn.numpy()]
    return res


def _pieces(registry, fwd_hook=None):
    fwd = fwd_hook or registry.hook(core.EP, "torch", "simulate")
    bwd = registry.hook(core.EP_BACKWARD, "torch", "simulate")

    def run(inputs, cots):
        xs, vs, ws, gus, dns = ([torch.from_numpy(r[i]) for r in inputs] for i in range(5))
        idxs = [_idx(v.numpy()) for v in vs]
        outs = fwd(xs, idxs, ws, gus, dns, act="silu")
        res = [[o.numpy()] for o in outs]
        if cots is not None:
            grads = bwd([torch.from_numpy(c[0]) for c in cots], xs, idxs, ws, gus, dns, act="silu")
            for r, (gx, gw, ggu, gdn) in enumerate(grads):
                res[r] += [gx.numpy(), np.zeros_like(vs[r].numpy()), gw.numpy(), ggu.numpy(), gdn.numpy()]
        return res

    return run


@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallelism_matches_the_whole_op_forward_and_backward(registry, n):
    """Every draw family: random, integer-valued, uniform, wide, sparse (most pairs on expert 0: the other
    ranks' experts get few or none) and constant (every pair on one expert, every other rank's experts empty)."""
    verdict = verify_impl(registry.get(core.EP), _whole, _pieces(registry), _examples(), n, backward=True)
    assert verdict.ok, str(verdict)
    assert verdict.draws >= 18


def test_a_wrong_exchange_is_caught(registry):
    """Results returned to the sender in the order the expert's owner grouped them (by expert), not in the
    order they were sent: verify_impl must reject it."""
    from metadist_torch.moe.dropless import combine, dispatch, run_experts, weighted_sum

    def wrong(xs, idxs, ws, gus, dns, *, act):
        n = len(xs)
        ds = [dispatch(x, i, gus[0].shape[0] * n) for x, i in zip(xs, idxs)]
        rcs = ep_dispatch._recv_counts(ds, n)
        ys = [run_experts(r, rc, gu, dn, act) for r, rc, gu, dn in zip(ep_dispatch._there(ds, n), rcs, gus, dns)]
        ret = ep_dispatch._back([y.flip(0) for y in ys], rcs, n)
        return [weighted_sum(combine(ret[s], ds[s].order, *idxs[s].shape), ws[s], xs[s].dtype) for s in range(n)]

    verdict = verify_impl(registry.get(core.EP), _whole, _pieces(registry, wrong), _examples(), 2)
    assert not verdict.ok and verdict.failures


def test_the_declared_rules_are_among_those_shardcombine_finds():
    """Run at a small size with valid expert ids, ShardCombine finds every rule the op declares."""
    from metadist_core.discovery.shardcombine import discover_rules
    from metadist_torch.ops.oprunner import op_spec
    from metadist_torch.plugin import TorchFrontend

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1)
            self.proj = torch.nn.Linear(H, H)
            self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * FW, H, generator=g))
            self.down = torch.nn.Parameter(torch.randn(E, H, FW, generator=g))

        def forward(self, x, idx, w):
            h = self.proj(x)
            return torch.ops.metadist.moe_dropless(h, idx, w * h.sum(-1, keepdim=True), self.gate_up, self.down, "silu")

    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(8)])
    w = torch.rand(8, K, generator=g)

    def step(model, x, idx, w):
        loss = (model(x, idx, w) ** 2).sum()
        loss.backward()
        return loss

    graph = TorchFrontend().trace(step, (Layer(), x, idx, w), {}).graph
    ops = [o for o in graph.ops if o.key in core.OP_KEYS]
    assert {o.key for o in ops} == set(core.OP_KEYS)
    for op in ops:
        declared = core.declared_rules(op, graph, 2)
        found = discover_rules(op_spec(op, graph), 2)
        missing = [str(r) for r in declared if r not in found]
        assert not missing, (op.key, missing, [str(r) for r in found])
        assert len(declared) >= 2


def test_refusals_name_the_numbers():
    shapes = [(16, 64), (16, 2), (16, 2), (6, 32, 64), (6, 64, 16)]
    assert "6 experts do not split evenly over 4 ranks" in core.refusal(core.FORWARD, {}, shapes, 4)
    assert core.refusal(core.FORWARD, {}, shapes, 3) is None
    assert "1 tokens are fewer than the 2 ranks" in core.refusal(core.FORWARD, {}, [(1, 64), (1, 2)] + shapes[2:], 2)
