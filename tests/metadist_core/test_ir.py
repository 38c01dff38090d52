import json

import pytest

from metadist_core.ir.ir import MetaIR, canonical_dtype
from metadist_core.reference.plugin import transformer_block


def small_graph():
    g = MetaIR("sgd")
    g.add_input("x", (8, 4), "float32")
    g.add_input("w", (4, 2), "bfloat16", role="parameter")
    g.add_input("mask", (8,), "bool")
    g.add_op("np.matmul", ["x", "w"], [("y", (8, 2), "float32")])
    g.add_op("np.mean", ["y"], [("loss", (), "float32")])
    g.add_op("np.scale", ["w"], [("w_new", (4, 2), "bfloat16")], {"factor": 0.5})
    g.set_outputs(["loss", "w_new"])
    g.alias("w", "w_new")
    return g


def test_dtypes_are_canonical():
    assert canonical_dtype("torch.bfloat16") == "bfloat16"
    assert canonical_dtype("float16") == "float16" and canonical_dtype("int8") == "int8"
    assert canonical_dtype("bool") == "bool" and canonical_dtype("torch.float32") == "float32"
    with pytest.raises(ValueError, match="unknown dtype"):
        canonical_dtype("float7")


def test_graph_structure_liveness_and_table():
    g = small_graph()
    g.validate()
    assert g.vars["y"].producer == g.ops[0].id and g.vars["w"].consumers == [g.ops[0].id, g.ops[2].id]
    assert g.vars["w"].role == "parameter" and g.vars["loss"].role == "output"
    assert g.vars["w"].nbytes == 16  # bfloat16: 2 bytes
    live = g.liveness()
    assert live["y"] == (0, 1) and live["x"] == (-1, 0) and live["loss"][1] == 3 and live["w"][1] == 3
    table = str(g)
    assert "np.matmul" in table and "x:8x4" in table and "1 state aliases" in table


def test_json_round_trip_and_signatures():
    g = small_graph()
    h = MetaIR.from_json(json.loads(json.dumps(g.to_json())))
    assert h.to_json() == g.to_json()
    assert [op.signature(h) for op in h.ops] == [op.signature(g) for op in g.ops]
    # signatures see shapes, dtypes and static attributes
    ir = transformer_block()
    sigs = ir.unique_signatures()
    assert len(sigs) < len(ir.ops)  # q, k, v projections share one signature
    assert g.ops[2].signature(g) != MetaIR.from_json(
        {
            **g.to_json(),
            "ops": [{**o.to_json(), "attrs": {"factor": 0.25}} if o.key == "np.scale" else o.to_json() for o in g.ops],
        }
    ).ops[2].signature(g)


def test_bad_graphs_are_refused():
    g = MetaIR()
    g.add_input("x", (2,), "float32")
    with pytest.raises(KeyError, match="not defined"):
        g.add_op("np.relu", ["nope"], [("y", (2,), "float32")])
    with pytest.raises(ValueError, match="shapes differ"):
        g.add_op("np.sum", ["x"], [("s", (), "float32")])
        g.alias("x", "s")
