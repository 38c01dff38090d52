"""What a training loop changes between calls of a compiled JAX step, on 8 virtual CPU devices.

Over 8 calls the compiled step gives the plain jitted step's loss on every call, and its parameters and
optimizer state at the end (rtol 1e-5), on a mesh whose plan really splits something, while:

* an optax schedule passed as ``adamw``'s learning rate reads the step count from the optimizer state;
* the user sets ``opt_state.hyperparams`` of ``optax.inject_hyperparams(optax.adamw)`` by hand (a learning
  rate of 0 for two calls, then back; the weight decay every call);
* Python-level arguments change: a bool flag and a str mode (static: one compile per distinct value, as
  ``jax.jit``'s ``static_argnames``) and a Python float (a traced input: no compile for a new value).

Each test counts the compiles (traces of the step), so that a value the trace folded would show as a
wrong number and a needless compile as a wrong count.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from metadist_jax import metadist_compile  # noqa: E402

from _jax_models import assert_trees_close  # noqa: E402

STEPS = 8
SIZES = (16, 64, 8)  # a small MLP: 16 -> 64 -> 8
BATCH = 16
RTOL, ATOL = 1e-5, 1e-6


def _init_params(seed: int = 0) -> dict:
    key = jax.random.key(seed)
    params = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        key, k = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
            "b": jnp.zeros((b,), jnp.float32),
        }
    return params


def _batch(seed: int) -> tuple:
    """``(x, y, mask)``: inputs, regression targets and an inverted-dropout mask (p=0.5) drawn on the host."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.standard_normal((BATCH, SIZES[-1])).astype(np.float32)
    mask = (rng.random((BATCH, SIZES[1])) < 0.5).astype(np.float32) * 2.0
    return x, y, mask


def _loss(params: dict, batch: tuple, use_dropout: bool = False, act: str = "relu", scale: float = 1.0):
    x, y, mask = batch
    h = x @ params["layer0"]["w"] + params["layer0"]["b"]
    h = jax.nn.relu(h) if act == "relu" else jnp.tanh(h)
    if use_dropout:
        h = h * mask
    out = h @ params["layer1"]["w"] + params["layer1"]["b"]
    return scale * jnp.mean((out - y) ** 2)


def _make_step(opt: optax.GradientTransformation):
    def train_step(params, opt_state, batch, scale=1.0, *, use_dropout=False, act="relu"):
        loss, grads = jax.value_and_grad(_loss)(params, batch, use_dropout, act, scale)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return train_step


def _count_compiles(monkeypatch: pytest.MonkeyPatch, step) -> list:
    """A list that grows by one at every compile of ``step`` (each traces the step once)."""
    traces: list = []
    trace = step.frontend.trace

    def counted(*a, **kw):
        traces.append(1)
        return trace(*a, **kw)

    monkeypatch.setattr(step.frontend, "trace", counted)
    return traces


def _check_trees(ref, got) -> None:
    assert_trees_close(ref, got, rtol=RTOL, atol=ATOL)


def _split_state(step) -> list[str]:
    """Optimizer-state and batch inputs the plan stores split (not replicated) on the mesh."""
    return [
        v
        for v, sh in step.plan.input_shardings.items()
        if v.startswith(("opt_state/", "batch/")) and not sh.is_fully_replicated()
    ]


SCHEDULES = {
    "warmup_cosine": (
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=STEPS, end_value=1e-4),
        (8,),
        "zero1",
    ),
    "linear_then_cosine": (
        optax.join_schedules(
            [optax.linear_schedule(1e-3, 1e-2, 3), optax.cosine_decay_schedule(1e-2, STEPS - 3, alpha=0.1)], [3]
        ),
        (2, 4),
        "ddp",
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_follows_the_step_count(devices8, rule_cache, monkeypatch, name):
    """The learning rate an optax schedule reads from the state's count changes every call: the compiled
    step follows it with its one compile."""
    schedule, mesh, strategy = SCHEDULES[name]
    assert len({float(schedule(i)) for i in range(STEPS)}) == STEPS  # a new rate every call
    opt = optax.adamw(schedule, weight_decay=1e-2)
    step_fn = _make_step(opt)
    params = _init_params()
    state = opt.init(params)
    step = metadist_compile(step_fn, mesh=mesh, strategy=strategy, cache_dir=rule_cache)
    compiles = _count_compiles(monkeypatch, step)
    ref = jax.jit(step_fn)

    pr, sr, pm, sm = params, state, params, state
    for i in range(STEPS):
        b = _batch(i)
        lr_, pr, sr = ref(pr, sr, b)
        lm, pm, sm = step(pm, sm, b)
        np.testing.assert_allclose(float(lm), float(lr_), rtol=RTOL, err_msg=f"loss of call {i}")
    _check_trees(pr, pm)
    _check_trees(sr, sm)
    counts = [int(c) for c in jax.tree_util.tree_leaves(sm) if np.ndim(c) == 0]
    assert counts and all(c == STEPS for c in counts), counts
    assert len(compiles) == 1
    assert _split_state(step), f"the plan splits nothing:\n{step.plan}"


def test_inject_hyperparams_set_by_hand(devices8, rule_cache, monkeypatch):
    """``opt_state.hyperparams`` set by hand between calls are inputs of the one compiled program: a learning
    rate of 0 leaves the parameters as they were, and every call matches plain JAX."""
    opt = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=1e-2)
    step_fn = _make_step(opt)
    params = _init_params(1)
    state = opt.init(params)
    step = metadist_compile(step_fn, mesh=(8,), strategy="zero1", cache_dir=rule_cache)
    compiles = _count_compiles(monkeypatch, step)
    ref = jax.jit(step_fn)

    lrs = [1e-2, 0.0, 0.0, 1e-2, 3e-2, 1e-2, 5e-3, 1e-2]
    wds = [1e-2, 1e-2, 0.0, 0.1, 0.1, 0.0, 1e-2, 0.3]
    pr, sr, pm, sm = params, state, params, state
    first = None
    for i in range(STEPS):
        if i:  # the first call runs with the state as opt.init made it
            for s in (sr, sm):
                s.hyperparams["learning_rate"] = jnp.asarray(lrs[i])
                s.hyperparams["weight_decay"] = jnp.asarray(wds[i])
        b = _batch(10 + i)
        before = pm
        lr_, pr, sr = ref(pr, sr, b)
        lm, pm, sm = step(pm, sm, b)
        np.testing.assert_allclose(float(lm), float(lr_), rtol=RTOL, err_msg=f"loss of call {i}")
        if lrs[i] == 0.0:  # no step at all, whatever the gradient and the weight decay
            jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), before, pm)
        if first is None:
            first = step.last
        assert step.last is first  # the same compiled program every call
        np.testing.assert_allclose(float(sm.hyperparams["learning_rate"]), lrs[i], rtol=1e-6)
    _check_trees(pr, pm)
    _check_trees(sr, sm)
    assert int(sm.count) == STEPS
    assert len(compiles) == 1
    assert _split_state(step), f"the plan splits nothing:\n{step.plan}"
    mu = sm.inner_state[0].mu["layer0"]["w"]
    assert not mu.sharding.is_fully_replicated  # zero1: the Adam moments stay split


def test_python_arguments_change_between_calls(devices8, rule_cache, monkeypatch):
    """A Python bool flag and a str mode steer the step's Python code: each distinct pair is its own compile,
    reused when it comes back; a Python float is a traced input and compiles nothing new."""
    opt = optax.adam(1e-2)
    step_fn = _make_step(opt)
    params = _init_params(2)
    state = opt.init(params)
    step = metadist_compile(step_fn, mesh=(2, 4), strategy="ddp", cache_dir=rule_cache)
    compiles = _count_compiles(monkeypatch, step)
    refs: dict = {}  # the plain step, jitted with the flag and the mode static

    calls = [
        (False, "relu", 1.0),
        (True, "relu", 0.5),
        (True, "relu", 2.0),
        (False, "relu", 0.5),
        (True, "tanh", 1.0),
        (False, "relu", 1.5),
        (True, "tanh", 0.25),
        (True, "relu", 1.0),
    ]
    pr, sr, pm, sm = params, state, params, state
    seen: list = []
    for i, (flag, act, scale) in enumerate(calls):
        b = _batch(20 + i)
        ref = refs.setdefault((flag, act), jax.jit(functools.partial(step_fn, use_dropout=flag, act=act)))
        lr_, pr, sr = ref(pr, sr, b, scale)
        lm, pm, sm = step(pm, sm, b, scale, use_dropout=flag, act=act)
        np.testing.assert_allclose(
            float(lm), float(lr_), rtol=RTOL, err_msg=f"loss of call {i} (use_dropout={flag}, act={act}, scale={scale})"
        )
        if (flag, act) not in seen:
            seen.append((flag, act))
        assert len(compiles) == len(seen), f"call {i}: {len(compiles)} compiles for {seen}"
    _check_trees(pr, pm)
    _check_trees(sr, sm)
    assert len(compiles) == 3
    # the flag is fixed in the trace (no graph input), the float is an input
    names = [v for v in step.graph.inputs if not v.startswith(("params/", "opt_state/"))]
    assert "arg3" in names and not any("use_dropout" in v or "act" in v for v in names), names
    assert _split_state(step), f"the plan splits nothing:\n{step.plan}"
