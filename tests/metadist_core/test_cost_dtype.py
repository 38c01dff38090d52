"""Compute is priced by dtype: tensor-core rates for bf16/fp16, fp32 rates otherwise; specs round-trip as JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metadist_core.cost.model import DEVICE_PRESETS, DeviceSpec, compute_cost, compute_dtype
from metadist_core.ir.ir import MetaIR
from metadist_core.ir.mesh import Mesh
from metadist_core.problem.build import build_problem
from metadist_core.discovery.rules import RuleBook


def matmul_graph(dtype: str, m: int = 4096, k: int = 4096, n: int = 4096) -> MetaIR:
    g = MetaIR(f"mm_{dtype}")
    g.add_input("x", (m, k), dtype)
    g.add_input("w", (k, n), dtype, role="parameter")
    g.add_op("aten.mm.default", ["x", "w"], [("y", (m, n), dtype)], id="mm")
    g.set_outputs(["y"])
    return g


@pytest.mark.parametrize("preset,ratio", [("a100", 312 / 19.5), ("h100", 989 / 67), ("h200", 989 / 67)])
def test_the_same_matmul_in_bf16_is_priced_faster_by_the_tensor_core_ratio(preset, ratio):
    dev = DEVICE_PRESETS[preset]
    mesh = Mesh((1,))
    seconds = {}
    for dtype in ("float32", "bfloat16", "float16"):
        g = matmul_graph(dtype)
        flops = 2.0 * 4096**3
        nbytes = float(sum(v.nbytes for v in g.vars.values()))
        prob = build_problem(g, RuleBook(), mesh, op_costs={"mm": (flops, nbytes)}, device=dev)
        i = next(j for j, node in enumerate(prob.nodes) if node.id == "mm")
        seconds[dtype] = float(np.min(prob.compute[i]))
        # compute bound at this size on every preset: the FLOP term decides
        assert seconds[dtype] == pytest.approx(flops / dev.flops_for(dtype) + dev.op_overhead)
    assert seconds["float32"] / seconds["bfloat16"] == pytest.approx(ratio, rel=1e-9)
    assert seconds["float16"] == pytest.approx(seconds["bfloat16"])
    # bytes already follow the dtype: half the bytes, so a memory-bound op is priced at half the time
    assert matmul_graph("bfloat16").vars["y"].nbytes * 2 == matmul_graph("float32").vars["y"].nbytes


def test_memory_bound_ops_are_priced_by_bytes_not_by_dtype_rate():
    dev = DEVICE_PRESETS["a100"]
    nbytes_fp32, nbytes_bf16 = 4e9, 2e9  # an elementwise op: 1e9 FLOPs, far below either FLOP ceiling
    t32 = compute_cost(1e9, nbytes_fp32, device=dev, dtype="float32")
    t16 = compute_cost(1e9, nbytes_bf16, device=dev, dtype="bfloat16")
    assert t32 == pytest.approx(nbytes_fp32 / dev.mem_bandwidth)
    assert t32 / t16 == pytest.approx(2.0)


def test_compute_dtype_is_the_widest_floating_input():
    assert compute_dtype(["bfloat16", "bfloat16"]) == "bfloat16"
    assert compute_dtype(["float32", "bfloat16"]) == "float32"
    assert compute_dtype(["int64"], ["float16"]) == "float16"  # an embedding lookup: its table's dtype
    assert compute_dtype(["int64", "bool"]) is None
    assert DEVICE_PRESETS["cpu"].flops_for("bfloat16") == DEVICE_PRESETS["cpu"].peak_flops
    assert DEVICE_PRESETS["a100"].flops_for(None) == 19.5e12


def test_device_spec_json_round_trip_and_old_files():
    dev = DeviceSpec("x", 1e12, 1e11, 2**30, 1e-6, {"float16": 8e12, "bfloat16": 4e12})
    back = DeviceSpec.from_json(json.loads(json.dumps(dev.to_json())))
    assert back == dev and hash(back) == hash(dev)
    assert back.flops_for("float16") == 8e12 and back.flops_for("float32") == 1e12
    old = {"name": "old", "peak_flops": 5e11, "mem_bandwidth": 1e10, "memory_bytes": 2**30, "op_overhead": 0.0}
    spec = DeviceSpec.from_json(old)  # written before per-dtype rates existed
    assert spec.flops_by_dtype == () and spec.flops_for("bfloat16") == 5e11
