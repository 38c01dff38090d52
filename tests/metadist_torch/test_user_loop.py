"""A compiled step is the user's step on every call: learning-rate schedules, weight decay edits, frozen
layers, new param groups, train/eval, Python flags and gradients accumulated over calls give the plain
loop's numbers, with the re-plans the change needs (none for a schedule). The loops live in
``_user_loops.py``; ``test_user_loop_ranks.py`` runs them on 4 ranks."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _user_loops as L  # noqa: E402

from metadist_torch import metadist_compile  # noqa: E402
from metadist_torch.trace.trace import trace_step  # noqa: E402


@pytest.mark.parametrize("name", list(L.LOOPS))
def test_loop_matches_eager_on_one_process(name):
    errors, info = L.run_both(L.LOOPS[name], rtol=1e-5)
    assert not errors, "\n".join(errors) + f"\n{info}"


def test_python_flag_compiles_once_per_value():
    errors, info = L.run_both(L.LOOPS["python_flag"], rtol=1e-5)
    assert not errors and info["signatures"] == 2 and info["replans"] == 0, (errors, info)


def test_the_inventory_names_every_number_the_optimizer_reads():
    model = L.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)
    step = trace_step(L.train_step, (model, opt, *L.batch(0)))
    names = {s.name for s in step.hyper.slots}
    assert {
        "opt0.group0.lr",
        "opt0.group0.betas[0]",
        "opt0.group0.betas[1]",
        "opt0.group0.eps",
        "opt0.group0.weight_decay",
    } <= names
    fed = {step.hyper.slots[i].key for i, _ in step.hyper.feeds}
    assert {"lr", "betas", "eps", "weight_decay"} <= fed  # read at run time, not folded
    src = step.gm.code
    assert "0.95" not in src and "0.001" not in src, "a number of the param group was folded into the program"


def test_sgd_branches_are_guards():
    """SGD reads momentum and weight_decay in Python branches: a value that flips a branch re-plans, one that
    does not is only fed."""
    model = L.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0, weight_decay=0.0)
    step = trace_step(L.train_step, (model, opt, *L.batch(0)))
    assert step.hyper.changed([opt]) is None
    opt.param_groups[0]["lr"] = 0.05
    assert step.hyper.changed([opt]) is None
    opt.param_groups[0]["momentum"] = 0.9
    assert "momentum" in step.hyper.changed([opt])
    opt.param_groups[0]["momentum"] = 0.0
    opt.param_groups[0]["weight_decay"] = 1
    assert "weight_decay" in step.hyper.changed([opt])


def test_replan_logs_what_changed_and_warns_past_max_replans(caplog):
    model = L.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = metadist_compile(max_replans=2, guard_cache=1)(L.train_step)
    with caplog.at_level(logging.INFO, logger="metadist"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in range(5):
            model[0].requires_grad_(s % 2 == 0)  # each call undoes the last: one kept program re-plans every call
            step(model, opt, *L.batch(s))
    assert step.replans == 4
    assert (
        sum("re-planning train_step: requires_grad of the parameters changed" in r.getMessage() for r in caplog.records)
        == 4
    )
    mine = [x for x in w if "re-planned" in str(x.message)]
    assert len(mine) == 1 and "max_replans=2" in str(mine[0].message) and "requires_grad" in str(mine[0].message)


def test_unknown_setting_is_an_error_naming_the_settings():
    with pytest.raises(ValueError, match=r"unknown setting 'max_replan'.*max_replans"):
        metadist_compile(max_replan=3)


def test_guard_check_is_cheap_and_state_edits_are_guarded():
    import time

    model = L.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = metadist_compile()(L.train_step)
    step(model, opt, *L.batch(0))
    watch = step.last.watch
    args = (model, opt, *L.batch(1))
    assert watch.failed(args, {}) is None
    t = time.perf_counter()
    for _ in range(100):
        watch.failed(args, {})
    assert (time.perf_counter() - t) / 100 < 0.01  # a loose bound: the check must not cost a step
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in (watch.failed(args, {}) or "")
    with torch.no_grad():
        assert "grad mode" in (watch.failed(args, {}) or "")
    h = model[0].register_forward_hook(lambda *a: None)
    assert "hooks" in (watch.failed(args, {}) or "")
    h.remove()
    assert watch.failed(args, {}) is None
    opt.load_state_dict(opt.state_dict())  # new state dicts: the program must not read the old ones
    assert "optimizer's state" in (watch.failed(args, {}) or "")
