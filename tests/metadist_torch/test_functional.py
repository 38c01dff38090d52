"""One-pass functionalization (metadist_torch/trace/functional.py) against re-tracing under torch.func.functionalize.

For whole training steps (AdamW with weight decay, SGD with momentum, BatchNorm's running statistics,
transformers' GPT-2) the one-pass graph has no in-place op left and gives bit for bit the outputs of the
re-traced graph on real data; where aliasing could make the rename wrong the pass declines and the
re-trace runs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import metadist_torch.trace.capture as trace_mod  # noqa: E402
from metadist_torch.trace.functional import functionalize_in_place  # noqa: E402
from metadist_torch.trace.trace import trace_step  # noqa: E402
from _examples import load_example  # noqa: E402


def _gpt():
    gpt = load_example("gpt")
    c = gpt.GPTConfig()
    m, o = gpt.build(c)
    return gpt.train_step, (m, o, *gpt.batch(c))


def _cnn():
    cnn = load_example("cnn")
    c = cnn.CNNConfig()
    m, o = cnn.build(c)
    return cnn.train_step, (m, o, *cnn.batch(c))


def _sgd():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)

    def step(m, o, x, y):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    return step, (m, o, torch.randn(6, 8), torch.randn(6, 4))


def _gpt2_hf():
    pytest.importorskip("transformers")
    hf = load_example("gpt2_hf")
    m, o = hf.build("tiny", 16)
    return hf.train_step, (m, o, torch.randint(0, 1024, (2, 16)))


def _mutating(gm) -> list[str]:
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(getattr(n.target, "_schema", None), "is_mutable", False)
    ]


def _run(traced, users, seed: int):
    """The traced graph on real data: the state as it is, the user's inputs with fresh noise on the floats."""
    g = torch.Generator().manual_seed(seed)
    state = [s.get().detach().clone() for s in traced.state.slots]
    users = [
        u + torch.randn(u.shape, generator=g, dtype=u.dtype) if u.dtype.is_floating_point else u.clone() for u in users
    ]
    return traced.gm(*state, *users)


@pytest.mark.parametrize("make", [_gpt, _cnn, _sgd, _gpt2_hf], ids=["gpt", "cnn-batchnorm", "sgd-nesterov", "gpt2-hf"])
def test_one_pass_equals_retracing(make, monkeypatch):
    fn, args = make()
    taken = []
    real = trace_mod.functionalize_in_place

    def spy(gm):
        taken.append(real(gm))
        return taken[-1]

    monkeypatch.setattr(trace_mod, "functionalize_in_place", spy)
    fast = trace_step(fn, args, {})
    assert taken == [True], "the one-pass functionalization declined a plain training step"
    assert _mutating(fast.gm) == []
    monkeypatch.setattr(trace_mod, "functionalize_in_place", lambda gm: False)
    fn2, args2 = make()
    slow = trace_step(fn2, args2, {})
    assert len(fast.graph.ops) == len(slow.graph.ops)
    for seed in (1, 2):
        users = [a for a in args if isinstance(a, torch.Tensor)]
        a, b = _run(fast, users, seed), _run(slow, users, seed)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _captured(f, *xs):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(f)(*xs)


def test_a_view_read_after_its_base_is_written_declines_and_the_retrace_is_right():
    def f(x, y):
        v = x.view(-1)
        x.mul_(y)
        return v + 1, x

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = _captured(f, x.clone(), y)
    assert functionalize_in_place(gm) is False
    assert _mutating(gm) == ["aten.mul_.Tensor"]  # declined: untouched
    fgm = trace_mod.functionalize_graph(_captured(f, x.clone(), y), [x.clone(), y])
    assert _mutating(fgm) == []
    want = f(x.clone(), y)
    for a, b in zip(fgm(x.clone(), y), want):
        assert torch.equal(a, b)


def test_chained_in_place_results_read_the_newest_value():
    def f(x, y):
        a = x.mul_(y)  # an alias of x
        z = x * 2  # reads x after the first write
        x.add_(1.5)  # a is x: it sees this write too
        b = torch.div(y, 3).mul_(2).add_(x)  # a fresh tensor written twice
        return a + 0, z, b, x

    x, y = torch.randn(5), torch.randn(5)
    gm = _captured(f, x.clone(), y)
    assert functionalize_in_place(gm) is True
    assert _mutating(gm) == []
    gm.recompile()
    for a, b in zip(gm(x.clone(), y), f(x.clone(), y)):
        assert torch.equal(a, b)


def test_a_write_that_would_change_dtype_declines():
    def f(x, y):
        x.add_(y)  # float32 written with float64: the functional add would give float64
        return x

    gm = _captured(f, torch.randn(4), torch.randn(4, dtype=torch.float64))
    assert functionalize_in_place(gm) is False
