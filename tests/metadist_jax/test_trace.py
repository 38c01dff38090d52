"""Tracing a JAX step into MetaIR: nested jaxprs inlined, control flow kept whole, state aliased."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from metadist_core.plugins import PluginManager  # noqa: E402
from metadist_jax.trace import TraceError, trace_step  # noqa: E402


def _step(params, opt_state, batch):
    x, y = batch

    @jax.jit
    def inner(w, x):
        return jax.nn.relu(x @ w)  # pjit + custom_jvp inside

    def loss_fn(p):
        h = inner(p["w"], x)
        c, _ = jax.lax.scan(lambda c, r: (c + r, None), jnp.zeros(h.shape[1]), h)  # scan stays one op
        return jnp.mean((h.sum(1) - y) ** 2) + 1e-3 * jnp.sum(c)

    loss, g = jax.value_and_grad(loss_fn)(params)
    return loss, {"w": params["w"] - 0.1 * g["w"], "b": params["b"]}, {"n": opt_state["n"] + 1}


def _args():
    p = {"w": np.ones((8, 4), np.float32), "b": np.zeros((4,), np.float32)}
    return p, {"n": np.zeros((), np.int32)}, (np.ones((6, 8), np.float32), np.ones((6,), np.float32))


def test_inlines_nested_jaxprs_and_keeps_control_flow():
    g, ctx = trace_step(_step, _args())
    keys = {op.key for op in g.ops}
    assert not keys & {"jax.lax.jit", "jax.lax.pjit", "jax.lax.custom_jvp_call", "jax.lax.custom_vjp_call"}
    assert "jax.lax.scan" in keys and "jax.lax.dot_general" in keys and "jax.lax.max" in keys
    assert all(k.startswith("jax.lax.") for k in keys)
    g.validate()
    # every attr is JSON-able, so the signature keys the rule cache
    import json

    for op in g.ops:
        json.dumps(op.attrs)
        assert op.payload is not None


def test_roles_outputs_and_state_aliases():
    g, ctx = trace_step(_step, _args())
    roles = {v: g.vars[v].role for v in g.inputs}
    assert roles["params/w"] == roles["params/b"] == "parameter"
    assert roles["opt_state/n"] == "optimizer_state"
    assert roles["batch/0"] == roles["batch/1"] == "input"
    assert set(g.aliases) == {"params/w", "params/b", "opt_state/n"}
    # an unchanged parameter passes through an identity op, so every output is a distinct made value
    b_out = g.aliases["params/b"]
    assert g.producer(b_out).key == "jax.lax.copy"
    assert len(set(g.outputs)) == len(g.outputs) == 4
    assert ctx.output_ids == g.outputs


def test_integer_examples_follow_the_real_values():
    def step(p, s, batch):
        x, y = batch
        logp = jax.nn.log_softmax(x @ p["w"])
        loss = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
        return loss, p, s

    y = np.array([3, 1, 2, 0], np.int32)
    g, ctx = trace_step(step, ({"w": np.ones((5, 4), np.float32)}, {}, (np.ones((4, 5), np.float32), y)))
    np.testing.assert_array_equal(ctx.examples["batch/1"], y)
    gathers = [op for op in g.ops if op.key == "jax.lax.gather"]
    assert gathers and all(op.inputs[1] in ctx.examples for op in gathers)


def test_mismatched_state_structure_is_a_clear_error():
    def step(p, s, b):
        return b.sum(), {"other": p["w"]}, s

    with pytest.raises(TraceError, match="same structure"):
        trace_step(step, ({"w": np.ones(3, np.float32)}, {}, np.ones(3, np.float32)))


def test_plugin_adapter_is_registered():
    from metadist_core.driver.frontend import Traced
    from metadist_core.plugins import UnknownFrontendError

    pm = PluginManager()
    assert "jax" in pm.names("frontend")
    fe = pm.frontend("jax")
    traced = fe.trace(_step, _args(), {})
    assert isinstance(traced, Traced) and traced.context is not None
    g = traced.graph
    op = next(o for o in g.ops if o.key == "jax.lax.dot_general")
    assert pm.owner(op) is fe
    flops, nbytes = fe.op_cost(op, g)
    a, b = (g.vars[v].shape for v in op.inputs)
    assert flops > 0 and nbytes == sum(g.vars[v].nbytes for v in op.inputs + op.outputs)
    assert pm.op_cost(op, g) == (flops, nbytes)
    assert pm.op_spec(op, g) is not None
    with pytest.raises(UnknownFrontendError):
        pm.frontend("torch-not-jax")
