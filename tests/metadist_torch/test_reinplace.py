"""State updates run in the state's own storage (metadist_torch.lower.reinplace): the same numbers as the functional
program, the storage kept, and every case where writing in place would change a value left functional."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.fx as fx  # noqa: E402
from torch.fx.passes.shape_prop import ShapeProp  # noqa: E402

from metadist_torch.lower.reinplace import inplace_overload, reinplace_updates  # noqa: E402

aten = torch.ops.aten
REPO = Path(__file__).resolve().parents[2]


def _layout(n):
    m = n.meta.get("tensor_meta")
    return (tuple(m.shape), m.dtype) if m is not None else None


def _run(fn, n_user, state, other):
    """Trace ``fn(state, other) -> (*user outputs, new state)``; reinplace; run the functional and the rewritten
    program on copies. Returns (rewritten?, functional outputs, rewritten outputs, state after the rewritten)."""
    gm = fx.symbolic_trace(fn)
    ShapeProp(gm).propagate(state.clone(), other.clone())
    ref = gm(state.clone(), other.clone())
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    done = reinplace_updates(gm.graph, [(ph, n_user)], range(n_user), _layout)
    gm.recompile()
    s = state.clone()
    got = gm(s, other.clone())
    return bool(done), ref, got, s


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_pointwise_chain_runs_in_the_state_and_returns_it():
    def f(s, g):
        m = aten.mul.Tensor(s, 0.9)
        m2 = aten.add.Tensor(m, g, alpha=0.1)
        return (aten.sum.default(g), aten.addcmul.default(m2, g, g, value=0.5))

    s, g = torch.randn(4, 8), torch.randn(4, 8)
    done, ref, got, after = _run(f, 1, s, g)
    assert done
    assert _same(ref, got)
    assert torch.equal(after, ref[1])  # the new value is in the state's storage
    assert got[1] is after  # and the program returns the state itself


@pytest.mark.parametrize(
    "case",
    [
        "old value read later",
        "view read later",
        "reads its own view",
        "dtype changes",
        "intermediate returned",
        "self twice",
        "user output",
    ],
)
def test_updates_that_would_change_a_value_stay_functional(case):
    s, g = torch.randn(4, 4), torch.randn(4, 4)
    if case == "old value read later":

        def f(s, g):
            new = aten.mul.Tensor(s, 2.0)
            return (aten.add.Tensor(s, 1.0), new)
    elif case == "view read later":

        def f(s, g):
            v = aten.t.default(s)
            new = aten.mul.Tensor(s, 2.0)
            return (aten.mm.default(v, g), new)
    elif case == "reads its own view":

        def f(s, g):
            return (aten.sum.default(g), aten.mul.Tensor(s, aten.t.default(s)))
    elif case == "dtype changes":
        g = g.double()

        def f(s, g):
            return (aten.sum.default(g), aten.add.Tensor(s, g))
    elif case == "intermediate returned":

        def f(s, g):
            m = aten.mul.Tensor(s, 2.0)
            return (m, aten.add.Tensor(m, g))
    elif case == "self twice":

        def f(s, g):
            return (aten.sum.default(g), aten.mul.Tensor(s, s))
    else:

        def f(s, g):
            new = aten.mul.Tensor(s, 2.0)
            return (new, new)

    done, ref, got, after = _run(f, 1, s, g)
    assert not done
    assert _same(ref, got)
    assert torch.equal(after, s)  # the state is untouched by the program


def test_only_pointwise_ops_with_an_in_place_twin_qualify():
    assert inplace_overload(aten.lerp.Scalar) is aten.lerp_.Scalar
    assert inplace_overload(aten.addcdiv.default) is aten.addcdiv_.default
    assert inplace_overload(aten.mm.default) is None  # not pointwise
    assert inplace_overload(aten.t.default) is None  # a view
    assert inplace_overload(aten.clone.default) is None  # pointwise, no clone_
    assert inplace_overload(aten.where.self) is None  # first argument is not self


def _mlp(optimizer):
    sys.path.insert(0, str(REPO / "examples" / "torch"))
    import mlp

    cfg = mlp.MLPConfig(hidden=32, batch=8, optimizer=optimizer)
    return mlp, cfg


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_compiled_step_updates_state_in_place_with_the_functional_numbers(optimizer, monkeypatch):
    import metadist_torch.lower.program as program
    from metadist_torch import metadist_compile

    mlp, cfg = _mlp(optimizer)
    batches = [mlp.batch(cfg, s) for s in range(3)]

    def run(reinplace):
        if not reinplace:
            monkeypatch.setattr(program, "reinplace_updates", lambda *a, **k: [])
        model, opt = mlp.build(cfg)
        step = metadist_compile()(mlp.train_step)
        losses = [float(step(model, opt, *batches[0]))]
        ptrs = [t.data_ptr() for t in _state(model, opt)]
        losses += [float(step(model, opt, *b)) for b in batches[1:]]
        monkeypatch.undo()
        return step, model, opt, losses, ptrs

    step_f, model_f, opt_f, losses_f, _ = run(False)
    step_i, model_i, opt_i, losses_i, ptrs = run(True)
    assert losses_i == losses_f
    assert all(torch.equal(a, b) for a, b in zip(_state(model_f, opt_f), _state(model_i, opt_i)))
    assert [t.data_ptr() for t in _state(model_i, opt_i)] == ptrs  # updated in their own storage
    assert step_f.runnable.inplace_updates == []
    traced = step_i.runnable.traced
    # every update but the step counters' (merged into one 0-d value that all of them copy)
    own = [
        traced.in_names[k]
        for k, o in enumerate(traced.state_out)
        if o is not None and traced.state.slots[k].get().numel() > 1
    ]
    assert sorted(step_i.runnable.inplace_updates) == sorted(own) and len(own) >= len(list(model_i.parameters()))
    model_e, opt_e = mlp.build(cfg)  # and the eager step's numbers
    losses_e = [float(mlp.train_step(model_e, opt_e, *b)) for b in batches]
    assert losses_i == pytest.approx(losses_e, rel=1e-5)
    for a, b in zip(model_e.parameters(), model_i.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _state(model, opt):
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out
