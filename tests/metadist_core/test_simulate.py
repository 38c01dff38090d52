"""Plans run on simulated devices give exactly the unsplit numbers: any plan the problem allows,
on 1-D, 2-D and 3-D meshes, with the collectives the cost model chose. A wrong rule is caught."""

import numpy as np
import pytest

from metadist_core.discovery.discover import discover
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Shard
from metadist_core.plan.plan import ShardingPlan
from metadist_core.plugins import PluginManager
from metadist_core.problem.build import build_problem
from metadist_core.reference.plugin import run_graph, run_local, transformer_block
from metadist_core.discovery.rules import OpRules, RuleBook, ShardingRule
from metadist_core.plan.simulate import assemble, distribute, simulate


@pytest.fixture(scope="module")
def block():
    ir = transformer_block()
    book = discover(ir, PluginManager(), RuleBook())
    rng = np.random.default_rng(0)
    inputs = {v: rng.standard_normal(ir.vars[v].shape) for v in ir.inputs}
    return ir, book, inputs, run_graph(ir, inputs)


@pytest.mark.parametrize("shape", [(2,), (4,), (2, 2)])
def test_random_plans_match_the_unsplit_graph(block, shape):
    ir, book, inputs, ref = block
    mesh = Mesh(shape)
    problem = build_problem(ir, book, mesh)
    rng = np.random.default_rng(sum(shape))
    sharded_somewhere = 0
    for _ in range(12):
        choice = [int(rng.choice(np.flatnonzero(problem.allowed[i]))) for i in range(len(problem.nodes))]
        plan = ShardingPlan.from_choices(problem, choice)
        outs, _ = simulate(ir, plan, mesh, inputs, run_local)
        for o in ir.outputs:
            np.testing.assert_allclose(outs[o], ref[o], rtol=1e-9, atol=1e-12)
        sharded_somewhere += any(not s.is_fully_replicated() for s in plan.var_shardings.values())
    assert sharded_somewhere > 0


def test_a_wrong_rule_is_caught(block):
    ir, book, inputs, ref = block
    bad = RuleBook(dict(book.entries))
    sig = next(k for k, e in bad.entries.items() if e.key == "np.softmax")
    # softmax over the last dim, claimed splittable on that dim: wrong
    bad.add(sig, OpRules("np.softmax", [ShardingRule((Shard(2),), (Shard(2),))]))
    mesh = Mesh((2,))
    problem = build_problem(ir, bad, mesh)
    i = next(k for k, n in enumerate(problem.nodes) if n.key == "np.softmax")
    k = next(j for j, o in enumerate(problem.nodes[i].options) if o.inputs[0][0] == Shard(2))
    choice = problem.replicated_choice()
    choice[i] = k
    outs, _ = simulate(ir, ShardingPlan.from_choices(problem, choice), mesh, inputs, run_local)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(outs[ir.outputs[0]], ref[ir.outputs[0]], rtol=1e-6)


def test_distribute_and_assemble_are_inverse():
    mesh = Mesh((2, 3))
    x = np.arange(7 * 6, dtype=float).reshape(7, 6)
    for sh in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Partial("sum"), Shard(0)], [Shard(0), Shard(0)]):
        from metadist_core.ir.placement import Sharding

        s = Sharding(sh)
        if sh == [Shard(0), Shard(0)]:
            x2 = np.arange(12 * 2, dtype=float).reshape(12, 2)
            np.testing.assert_array_equal(assemble(distribute(x2, s, mesh), s, mesh), x2)
        else:
            np.testing.assert_array_equal(assemble(distribute(x, s, mesh), s, mesh), x)


def test_a_step_no_reshard_emits_is_a_clear_error():
    from metadist_core.cost.model import RESHARD_KINDS, Collective, UnknownCollectiveError
    from metadist_core.cost.reshard import reshard
    from metadist_core.ir.placement import Replicate, Sharding
    from metadist_core.plan.simulate import apply_collective

    mesh = Mesh((2,))
    s, r = Sharding([Shard(0)]), Sharding([Replicate()])
    assert {c.kind for c in reshard(s, r, (4, 2), "float32", mesh)} <= set(RESHARD_KINDS)
    step = Collective("send_recv", 0, (), None, 32, 1e-5, s, r)
    with pytest.raises(UnknownCollectiveError, match="plans hold only the steps reshard"):
        apply_collective(distribute(np.ones((4, 2)), s, mesh), step, mesh)


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_inputs_every_device_holds_whole_are_sliced_not_moved(block, shape):
    """whole_inputs: a user input read in another layout than it is stored in costs nothing and runs as a
    local slice (no collective on the plan), with the unsplit numbers."""
    ir, book, inputs, ref = block
    mesh = Mesh(shape)
    user = {v for v in ir.inputs if ir.vars[v].role == "input"}
    assert user
    problem = build_problem(ir, book, mesh, whole_inputs=True)
    for e in problem.edges:
        if e.var in user:
            assert not e.table.any(), e.var
    rng = np.random.default_rng(7 + len(shape))
    sliced = 0
    for _ in range(12):
        choice = [int(rng.choice(np.flatnonzero(problem.allowed[i]))) for i in range(len(problem.nodes))]
        plan = ShardingPlan.from_choices(problem, choice)
        for e in plan.edges:
            if e.var in user:
                assert not e.collectives
                sliced += e.src_sharding != e.dst_sharding
        outs, _ = simulate(ir, plan, mesh, inputs, run_local)
        for o in ir.outputs:
            np.testing.assert_allclose(outs[o], ref[o], rtol=1e-9, atol=1e-12)
    assert sliced > 0  # some reader took another layout than the stored one


def test_a_sliced_input_on_an_engine_without_whole_inputs_is_a_clear_error(block):
    from metadist_core.plan.interpret import PlanError, interpret

    ir, book, inputs, _ = block
    mesh = Mesh((2,))
    problem = build_problem(ir, book, mesh, whole_inputs=True)
    rng = np.random.default_rng(3)
    while True:
        plan = ShardingPlan.from_choices(
            problem, [int(rng.choice(np.flatnonzero(problem.allowed[i]))) for i in range(len(problem.nodes))]
        )
        if any(e.src_sharding != e.dst_sharding and ir.vars[e.var].role == "input" for e in plan.edges):
            break
    with pytest.raises(PlanError, match="whole_inputs=False"):
        interpret(ir, plan, mesh, {v: None for v in ir.inputs}, lambda op, ins, sh: [None] * len(op.outputs), object())
