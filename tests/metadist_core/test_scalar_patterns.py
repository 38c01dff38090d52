"""An op with a Python scalar keeps that scalar in its pattern: ``x * 0``, ``x * -1`` and ``x * 0.5`` differ."""

from __future__ import annotations

from metadist_core.ir.ir import MetaIR
from metadist_core.discovery.patterns import op_pattern


def _mul(scalar: float | None) -> tuple[MetaIR, str]:
    g = MetaIR("m")
    g.add_input("x", (8, 6), "float32")
    g.add_input("y", (8, 6), "float32")
    if scalar is None:
        g.add_op(
            "aten.mul.Tensor",
            ["x", "y"],
            [("z", (8, 6), "float32")],
            {"args": [{"$in": 0}, {"$in": 1}], "kwargs": {}},
            id="op",
        )
    else:
        g.add_op(
            "aten.mul.Tensor", ["x"], [("z", (8, 6), "float32")], {"args": [{"$in": 0}, scalar], "kwargs": {}}, id="op"
        )
    return g, "op"


def test_a_scalar_operand_is_part_of_the_pattern():
    keys = {}
    for s in (0.0, -1.0, 0.5, None):
        g, op = _mul(s)
        keys[s] = op_pattern(g.ops[0], g, 2).key
    # x * 0 is the same on every device (Replicate from Partial), x * -1 swaps Partial(max) and Partial(min):
    # rules found for one scalar must not serve another
    assert len({keys[0.0], keys[-1.0], keys[0.5]}) == 3
    assert keys[None].startswith("mul|")  # two tensors of one shape: the shared canonical name
    assert not keys[0.5].startswith("mul|")
