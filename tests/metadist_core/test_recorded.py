"""Loading the recorded GPT-2 training steps (tests/data/graphs/*.json) into MetaIR."""

import json
import os
from pathlib import Path

import pytest

from metadist_core.ir.ir import MetaIR
from metadist_core.ir.recorded import is_getitem, load_recorded_graph, recorded_graph_from_json

GRAPHS = Path(os.environ.get("METADIST_GRAPHS_DIR", Path(__file__).resolve().parents[1] / "data" / "graphs"))
FILES = ["gpt2-tiny-2l-adamw.json", "gpt2-small-12l-adamw.json", "gpt2-xl-48l-adamw.json"]
TINY = GRAPHS / FILES[0]

pytestmark = pytest.mark.skipif(not TINY.exists(), reason=f"no recorded graphs under {GRAPHS}")


def _markers(x, out):
    if isinstance(x, dict):
        if "$in" in x:
            out.append(x["$in"])
        for v in x.values():
            _markers(v, out)
    elif isinstance(x, list):
        for v in x:
            _markers(v, out)
    return out


@pytest.mark.parametrize("fname", FILES)
def test_load_matches_the_file(fname):
    data = json.loads((GRAPHS / fname).read_text())
    g = load_recorded_graph(GRAPHS / fname)
    assert g.name == fname[:-5]
    n_getitem = sum(is_getitem(n["op"]) for n in data["nodes"])
    assert n_getitem > 0
    # getitem nodes fold into the tuple-valued op that they read
    assert len(g.ops) + n_getitem == data["n_nodes"] == len(data["nodes"])

    # every tensor node keeps its shape and dtype, as an op output
    for n in data["nodes"]:
        if n["out"] is not None:
            v = g.vars[n["name"]]
            assert list(v.shape) == n["out"]["shape"] and v.dtype == n["out"]["dtype"], n["name"]
            assert v.producer is not None

    n_par = (len(data["outputs"]) - 1) // 3
    roles = [g.vars[v].role for v in g.inputs]
    assert roles.count("parameter") == n_par
    assert roles.count("optimizer_state") == 2 * n_par
    assert roles.count("input") == 1 and g.vars[data["inputs"][-1]["var"]].dtype == "int64"
    # the trace's _tensor_constant* come in as buffers after the file's inputs
    assert g.inputs[: len(data["inputs"])] == [i["var"] for i in data["inputs"]]
    assert all(g.vars[v].role == "buffer" and v.startswith("_tensor_constant") for v in g.inputs[len(data["inputs"]) :])

    assert len(g.aliases) == 3 * n_par
    for i in range(3 * n_par):
        state, new = data["inputs"][i]["var"], data["outputs"][1 + i]["var"]
        assert g.aliases[state] == new
        assert g.vars[state].shape == g.vars[new].shape
    assert g.outputs == [o["var"] for o in data["outputs"]]
    assert g.vars[g.outputs[0]].shape == ()  # the loss
    g.validate()

    # attrs are JSON and mark exactly the op's inputs, in order
    for op in g.ops:
        json.dumps(op.attrs)
        assert sorted(_markers(op.attrs, [])) == list(range(len(op.inputs))), op.id
        assert all(g.vars[v].is_tensor for v in op.inputs)


def test_tiny_graph_details():
    g = load_recorded_graph(TINY)
    assert len(g.ops) == 615 and len(g.unique_signatures()) == 190
    ln = g.op("native_layer_norm")
    assert ln.key == "aten.native_layer_norm.default"
    assert ln.inputs == ["add_1", "params_3", "params_4"]
    assert ln.outputs == ["getitem", "getitem_1", "getitem_2"]
    assert ln.attrs == {"args": [{"$in": 0}, [128], {"$in": 1}, {"$in": 2}, 1e-05], "kwargs": {}, "select": [0, 1, 2]}
    assert [g.vars[o].shape for o in ln.outputs] == [(8, 128, 128), (8, 128, 1), (8, 128, 1)]
    # a list of tensors (cat) gives one input per tensor
    cat = g.op("cat_4")
    assert len(cat.inputs) == 3 and cat.attrs["args"] == [[{"$in": 0}, {"$in": 1}, {"$in": 2}], 2]
    z = g.op("zeros")
    assert z.inputs == [] and z.attrs["kwargs"] == {
        "dtype": {"$dtype": "float32"},
        "layout": {"$torch": "strided"},
        "device": {"$device": "cpu"},
    }
    assert g.op("clone").attrs["kwargs"] == {"memory_format": {"$torch": "contiguous_format"}}
    assert g.op("_log_softmax_backward_data").attrs["args"][-1] == {"$dtype": "float32"}
    assert g.vars["_tensor_constant0"].shape == (0,)
    # getitem_25 (the loss) is the first output of nll_loss_forward
    assert g.vars["getitem_25"].producer == "nll_loss_forward"
    assert g.vars["getitem_25"].role == "output"


def test_round_trip_through_metair_json():
    g = load_recorded_graph(TINY)
    h = MetaIR.from_json(json.loads(json.dumps(g.to_json())))
    assert list(h.unique_signatures()) == list(g.unique_signatures())
    assert h.aliases == g.aliases


def test_clear_errors():
    data = json.loads(TINY.read_text())
    bad = dict(data, nodes=[dict(data["nodes"][0], args=[{"var": "nowhere"}, [-1, 128]])] + data["nodes"][1:])
    with pytest.raises(ValueError, match="nowhere"):
        recorded_graph_from_json(bad, "bad")
    # outputs out of order: parameter 0's update swapped with parameter 1's
    outs = list(data["outputs"])
    outs[1], outs[2] = outs[2], outs[1]
    with pytest.raises(ValueError, match="params_1"):
        recorded_graph_from_json(dict(data, outputs=outs), "swapped")
    # the two moment lists swapped: shapes agree, but the dataflow does not
    n_par = (len(outs) - 1) // 3
    outs = (
        [data["outputs"][0]]
        + data["outputs"][1 : 1 + n_par]
        + data["outputs"][1 + 2 * n_par :]
        + data["outputs"][1 + n_par : 1 + 2 * n_par]
    )
    with pytest.raises(ValueError, match="does not follow"):
        recorded_graph_from_json(dict(data, outputs=outs), "swapped-moments")
    with pytest.raises(ValueError, match="inputs"):
        recorded_graph_from_json({"nodes": []}, "empty")
    with pytest.raises(FileNotFoundError):
        load_recorded_graph(GRAPHS / "missing.json")
