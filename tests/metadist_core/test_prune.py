"""Pruning dominated Partial-input rules shrinks the problem and never changes the optimum."""

import pytest

from metadist_core.cost.model import strategy_split
from metadist_core.discovery.discover import discover
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding
from metadist_core.plugins import PluginManager
from metadist_core.problem.build import build_problem
from metadist_core.problem.prune import useful_rules
from metadist_core.reference.plugin import transformer_block
from metadist_core.discovery.rules import RuleBook


@pytest.fixture(scope="module")
def block():
    ir = transformer_block(batch=4, seq=8, width=16, hidden=64)
    return ir, discover(ir, PluginManager(), RuleBook())


def test_partial_inputs_kept_only_where_a_producer_makes_them(block):
    ir, book = block
    useful = {op_id: by_size[2] for op_id, by_size in useful_rules(ir, book, (2,)).items()}
    first = ir.ops[0]  # layer norm of the graph input: nothing upstream is partial
    assert all(not any(isinstance(p, Partial) for p in r.inputs) for r in useful[first.id])
    # the add after the attention matmul may take Partial(sum): that matmul can make it
    add = next(op for op in ir.ops if op.key == "np.add")
    assert any(isinstance(p, Partial) and p.reduce == "sum" for r in useful[add.id] for p in r.inputs)
    assert sum(map(len, useful.values())) < sum(len(book.rules_for(op, ir, 2)) for op in ir.ops)


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_pruning_keeps_the_optimum(block, shape):
    ir, book = block
    pm = PluginManager()
    mesh = Mesh(shape)
    full = build_problem(ir, book, mesh, prune=False)
    pruned = build_problem(ir, book, mesh)
    assert sum(len(n.options) for n in pruned.nodes) < sum(len(n.options) for n in full.nodes)
    a = pm.solve("ilp", full, {"time_limit": 60})
    b = pm.solve("ilp", pruned, {"time_limit": 60})
    assert b.objective == pytest.approx(a.objective, rel=1e-9, abs=1e-12)


def test_partial_only_axis_does_not_split_work():
    mesh = Mesh((2, 4))
    p, s, r = Partial("sum"), Shard(0), Replicate()
    assert strategy_split([Sharding([p, r])], [Sharding([p, r])], mesh) == 1
    assert strategy_split([Sharding([s, p])], [Sharding([s, p])], mesh) == 2
    assert strategy_split([Sharding([s, Shard(1)])], [Sharding([p, Shard(1)])], mesh) == 8
