"""XLA fuses optax's Adam update into one loop per parameter, and the JAX frontend prices it so.

On a traced MLP step with optax adam: each parameter's update is one region whose fused loop reads the
parameter, its gradient and its two moments once and writes the new three (7x the parameter's bytes, plus
scalars), where op by op the same ops move 5-6x that again; the planner's op costs carry those bytes; the
forward and backward keep their op-by-op bytes.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.cost.fusion import fused_bytes, update_regions  # noqa: E402
from metadist_core.driver.planner import op_costs  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402
from metadist_core.ir.ir import forward_ops  # noqa: E402
from metadist_jax.plugin import JaxFrontend  # noqa: E402

from _jax_models import mlp_case  # noqa: E402


def _graph():
    mlp, opt, params, state, batch = mlp_case()
    fe = JaxFrontend()
    return fe, fe.trace(mlp.make_step(opt), (params, state, batch), {}).graph


def test_each_parameters_adam_update_is_one_loop_of_seven_passes():
    fe, g = _graph()
    params = [v for v in g.inputs if g.vars[v].role == "parameter"]
    regions = update_regions(g, fe.traits.fuses)
    fb = fused_bytes(g, fe.traits.fuses)
    for p in params:
        mine = [r for r in regions if any(p in g.op(i).inputs for i in r)]
        assert len(mine) == 1, f"{p}: read by {len(mine)} update loops"
        loop = mine[0]
        size = g.vars[p].nbytes
        fused = sum(fb[i] for i in loop)
        assert 7 * size <= fused <= 7 * size + 64, (p, size, fused)  # p, g, m, v in; p, m, v out
        unfused = sum(g.vars[v].nbytes for i in loop for v in g.op(i).inputs + g.op(i).outputs)
        assert unfused > 4 * fused
    fwd = set(forward_ops(g))
    assert not fwd & set(fb), "a forward op was priced as part of the update"


def test_the_planner_prices_the_update_at_its_fused_bytes_and_the_rest_op_by_op():
    fe, g = _graph()
    fb = fused_bytes(g, fe.traits.fuses)
    costs = op_costs(g, PluginManager())
    for op in g.ops:
        own = float(sum(g.vars[v].nbytes for v in op.inputs + op.outputs))
        assert costs[op.id][1] == (fb[op.id] if op.id in fb else own), op.id


@pytest.mark.parametrize(
    "name,make,passes",
    [
        ("sgd", lambda: optax.sgd(0.1), 3),  # p, g in; p out
        ("sgd momentum", lambda: optax.sgd(0.1, momentum=0.9), 5),  # p, g, trace in; p, trace out
        ("adamw", lambda: optax.adamw(1e-3, weight_decay=0.01), 7),
    ],
)
def test_other_optimizers_fuse_to_their_passes(name, make, passes):
    from _jax_models import load_example

    mlp = load_example("mlp")
    opt = make()
    params = mlp.init_params(jax.random.key(0), mlp.TEST_SIZES)
    fe = JaxFrontend()
    g = fe.trace(mlp.make_step(opt), (params, opt.init(params), mlp.make_batch(0, **mlp.TEST_BATCH)), {}).graph
    regions = update_regions(g, fe.traits.fuses)
    fb = fused_bytes(g, fe.traits.fuses)
    for p in (v for v in g.inputs if g.vars[v].role == "parameter"):
        loop = [r for r in regions if any(p in g.op(i).inputs for i in r)]
        assert len(loop) == 1, (name, p)
        fused = sum(fb[i] for i in loop[0])
        assert passes * g.vars[p].nbytes <= fused <= passes * g.vars[p].nbytes + 64, (name, p, fused)
