"""The optimizer update priced as one fused loop per parameter (metadist_core.cost.fusion), on a hand-built step."""

from __future__ import annotations

from metadist_core.cost.fusion import fused_bytes, update_regions
from metadist_core.ir.ir import MetaIR

ELEMENTWISE = {"mul", "add", "sub"}


def _step() -> MetaIR:
    """loss = sum(x * w); g = sum over the batch of x; m' = 0.9 m + 0.1 g; w' = w - 0.01 m' (float32)."""
    g = MetaIR()
    g.add_input("x", (4, 8), "float32")
    g.add_input("w", (8,), "float32", "parameter")
    g.add_input("m", (8,), "float32", "optimizer_state")
    g.add_input("c", (), "float32")
    g.add_op("t.mul", ["x", "w"], [("h", (4, 8), "float32")], id="fwd_mul")  # elementwise, but the forward
    g.add_op("t.sum", ["h"], [("loss", (), "float32")], id="fwd_sum")
    g.add_op("t.sum", ["x"], [("grad", (8,), "float32")], id="bwd_sum")  # not elementwise
    g.add_op("t.mul", ["grad", "c"], [("gm", (8,), "float32")], id="scale_g")  # only the update reads it
    g.add_op("t.mul", ["m", "c"], [("m1", (8,), "float32")], id="decay_m")
    g.add_op("t.add", ["m1", "gm"], [("m2", (8,), "float32")], id="new_m")
    g.add_op("t.mul", ["m2", "c"], [("u", (8,), "float32")], id="step")
    g.add_op("t.sub", ["w", "u"], [("w2", (8,), "float32")], id="new_w")
    g.set_outputs(["loss", "w2", "m2"])
    g.alias("w", "w2")
    g.alias("m", "m2")
    return g


def _elementwise(op) -> bool:
    return op.key.split(".")[1] in ELEMENTWISE


def test_the_update_is_one_loop_and_the_forward_is_not_in_it():
    g = _step()
    regions = update_regions(g, _elementwise)
    assert regions == [["scale_g", "decay_m", "new_m", "step", "new_w"]]


def test_a_fused_loop_reads_each_outside_value_once_and_writes_what_leaves_it():
    g = _step()
    fb = fused_bytes(g, _elementwise)
    assert set(fb) == {"scale_g", "decay_m", "new_m", "step", "new_w"}
    # reads grad, m, w (32 B each) and the scalar c once (4 B); writes m2 and w2 (returned): 5 x 32 + 4
    assert sum(fb.values()) == 5 * 32 + 4
    assert fb["step"] == 0  # u: written and read inside the loop only
    assert fb["scale_g"] == 32 + 4 and fb["decay_m"] == 32  # the first reader of c pays for it
    # op by op the same ops move 2 or 3 tensors each
    unfused = sum(sum(g.vars[v].nbytes for v in g.op(i).inputs + g.op(i).outputs) for i in fb)
    assert unfused == 12 * 32 + 3 * 4


def test_a_value_something_else_reads_leaves_its_producer_out_of_the_loop():
    """Gradient clipping's norm reads the scaled gradient: that product is written once, the loop reads it."""
    g = MetaIR()
    g.add_input("w", (8,), "float32", "parameter")
    g.add_input("m", (8,), "float32", "optimizer_state")
    g.add_input("c", (), "float32")
    g.add_op("t.mul", ["w", "w"], [("sq", (8,), "float32")], id="fwd")
    g.add_op("t.sum", ["sq"], [("loss", (), "float32")], id="fwd_sum")
    g.add_op("t.mul", ["w", "c"], [("grad", (8,), "float32")], id="bwd")  # reads the parameter: joins
    g.add_op("t.mul", ["grad", "c"], [("gm", (8,), "float32")], id="scale_g")
    g.add_op("t.sum", ["gm"], [("norm", (), "float32")], id="norm")  # a reduction reads gm
    g.add_op("t.mul", ["m", "norm"], [("m2", (8,), "float32")], id="new_m")
    g.add_op("t.sub", ["w", "m2"], [("w2", (8,), "float32")], id="new_w")
    g.set_outputs(["loss", "w2", "m2"])
    g.alias("w", "w2")
    g.alias("m", "m2")
    regions = update_regions(g, _elementwise)
    # bwd reads w (state) and scale_g follows it, so both are in the update; the norm splits the chain in two
    assert sorted(map(sorted, regions)) == [["bwd", "scale_g"], ["new_m", "new_w"]]
    fb = fused_bytes(g, _elementwise)
    assert fb["scale_g"] == 32  # gm: the norm reads it, so the first loop writes it
    assert fb["bwd"] == 32 + 4  # reads w and c; grad stays inside
    # new_m reads m and the norm and writes m2 (returned); new_w reads w, m2 from inside, writes w2
    assert fb["new_m"] == 32 + 4 + 32 and fb["new_w"] == 32 + 32


def test_inference_has_no_update():
    g = MetaIR()
    g.add_input("x", (4,), "float32")
    g.add_input("w", (4,), "float32", "parameter")
    g.add_op("t.mul", ["x", "w"], [("y", (4,), "float32")])
    g.set_outputs(["y"])
    assert update_regions(g, _elementwise) == [] and fused_bytes(g, _elementwise) == {}
