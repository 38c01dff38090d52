"""A torch step that changes Python state its trace cannot carry back stops with an error naming it, and the
change is undone; one case per kind (a module's attribute, a tensor kept on a module, a list argument, an
attribute of another object, a global)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from metadist_core.driver.sideeffects import SideEffectError  # noqa: E402
from metadist_torch import metadist_compile  # noqa: E402

STEPS = 0


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model, x):
    return model(x).pow(2).mean()


def _run(step, *extra):
    model, opt = _model_opt()
    x = torch.randn(6, 4)
    with pytest.raises(SideEffectError) as e:
        metadist_compile()(step)(model, opt, x, *extra)
    return str(e.value), model


def test_module_attribute_counter():
    def step(model, opt, x):
        model.calls = getattr(model, "calls", 0) + 1
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    msg, model = _run(step)
    assert "model.calls was set" in msg and "Return such values" in msg
    assert not hasattr(model, "calls")  # undone


def test_tensor_kept_on_a_submodule():
    def step(model, opt, x):
        h = model[0](x)
        model[1].last_hidden = h
        loss = model[2](model[1](h)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    msg, model = _run(step)
    assert "model.1.last_hidden was set" in msg
    assert "last_hidden" not in model[1].__dict__  # no fake tensor left behind


def test_list_argument_appended_to():
    def step(model, opt, x, history):
        loss = _loss(model, x)
        history.append(loss)
        loss.backward()
        opt.step()
        return loss

    msg, _ = _run(step, [])
    assert "changes its argument 'history' in place" in msg


def test_attribute_of_another_object():
    class Counter:
        def __init__(self) -> None:
            self.n = 0

    def step(model, opt, x, counter):
        counter.n += 1
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        return loss

    c = Counter()
    msg, _ = _run(step, c)
    assert "argument 'counter'.n changed from 0 to 1" in msg
    assert c.n == 0


def test_global_rebound():
    def step(model, opt, x):
        global STEPS
        STEPS += 1
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        return loss

    msg, _ = _run(step)
    assert "global 'STEPS'" in msg and "changed from 0 to 1" in msg
    assert STEPS == 0


def test_private_tensor_attribute_is_an_error_private_flag_is_not():
    def step(model, opt, x):
        model._seen = True  # a library's one-time flag: kept as set
        model._cache = model[0](x)  # a tensor: an error all the same
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        return loss

    msg, model = _run(step)
    assert "model._cache was set" in msg and "_seen" not in msg
    assert model._seen is True and "_cache" not in model.__dict__


def test_unchanged_state_passes():
    def step(model, opt, x, history):
        model.mode = "train"  # set to what it already was: nothing the program needs to repeat
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model, opt = _model_opt()
    model.mode = "train"
    x = torch.randn(6, 4)
    ref_model, ref_opt = _model_opt()
    got = metadist_compile()(step)(model, opt, x, [])
    assert torch.equal(got, step(ref_model, ref_opt, x, []))
