"""The whole program's factor over its ops' alone times is kept with the ops' slowdowns: a step compiled
again (a restart) is priced as before, without timing its program again, so its solver sees the same
problem and finds its answer kept."""

from __future__ import annotations

import pytest

from metadist_core.cost.model import DeviceSpec
from metadist_core.cost.optimes import _load, program_key, roofline, whole_slowdowns
from metadist_core.driver.frontend import OpTimes
from metadist_core.reference.plugin import op_cost, transformer_block

DEV = DeviceSpec("toy", 50e9, 10e9, op_overhead=1e-6)


def _timer(graph, factor, asked):
    """Every op runs twice its roofline; the whole program ``factor`` times what its ops' times add up to."""
    alone = [2.0 * roofline(op, graph, op_cost(op, graph), DEV) for op in graph.ops]
    program = factor * sum(alone) + DEV.op_overhead * len(graph.ops)

    def time_ops(requests, timing_program):
        asked.append((len(requests), timing_program))
        secs = [2.0 * roofline(op, graph, op_cost(op, graph), DEV) + 2e-6 for op, _, _ in requests]
        return OpTimes(secs, DEV, harness=2e-6, program=program if timing_program else None)

    return time_ops


def test_the_program_factor_is_timed_once_and_kept(tmp_path):
    g = transformer_block()
    costs = {op.id: op_cost(op, g) for op in g.ops}
    path = tmp_path / "ops.json"
    asked: list = []
    first = whole_slowdowns(g, costs, _timer(g, 2.0, asked), path, program=True)
    assert len(asked) == 1 and asked[0][0] > 0 and asked[0][1] is True
    key = program_key(g, {op.id: op.signature(g) for op in g.ops})
    assert _load(path)[key] == pytest.approx(2.0, rel=0.05)
    # compiled again, its program would now read 3x (noise, another load): nothing is timed, the kept factor stands
    second = whole_slowdowns(g, costs, _timer(g, 3.0, asked), path, program=True)
    assert len(asked) == 1 and first == second
    # another program (other shapes) is timed anew, and priced by its own factor
    g2 = transformer_block(batch=8)
    third = whole_slowdowns(g2, {op.id: op_cost(op, g2) for op in g2.ops}, _timer(g2, 3.0, asked), path, program=True)
    assert asked[-1][1] is True and len(asked) == 2
    ratio = {third[i] / first[i] for i in first if i in third}
    assert ratio and all(r == pytest.approx(1.5, rel=0.05) for r in ratio)
