"""TVM ops are discovered at proxy sizes, and what they find holds at the real sizes.

The TVM frontend rewrites a call's size-bearing static arguments (a reshape's new shape) by value at the
proxy sizes, as the torch and JAX frontends do, and a rebuilt ``te.compute`` follows its new input shapes.
Every rule found at the proxies is re-checked here against the whole op at its real shapes on the
independent checker's own draws (tests/metadist_torch/test_rule_soundness.py), and the rules are the ones
discovery finds at the real shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("torch")  # the independent checker lives with the torch tests

from tvm import te  # noqa: E402

from metadist_core.discovery.discover import discover  # noqa: E402
from metadist_core.discovery.patterns import op_pattern  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402
from metadist_core.discovery.rules import RuleBook  # noqa: E402
from metadist_core.discovery.shardcombine import discover_rules  # noqa: E402
from metadist_tvm import topi  # noqa: E402
from metadist_tvm.plugin import TvmFrontend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metadist_torch"))
from test_rule_soundness import check_rule  # noqa: E402


def _graph():
    x = te.placeholder((48, 80), name="x")
    w = te.placeholder((96, 80), name="w")
    h = topi.nn.dense(x, w)  # (48, 96)
    s = topi.nn.softmax(topi.reshape(h, (48, 8, 12)), axis=-1)  # a reshape whose new shape holds sizes
    t = topi.transpose(s, (1, 0, 2))  # (8, 48, 12)
    k = te.reduce_axis((0, 12), name="k")
    m = te.compute((8, 48), lambda i, j: te.sum(t[i, j, k] * t[i, j, k], axis=k), name="sq")  # a plain compute
    return TvmFrontend(engine="simulate").trace(None, ([x, w], m), {}).graph


def test_tvm_ops_are_discovered_at_proxy_sizes_and_hold_at_real_sizes():
    graph = _graph()
    pm = PluginManager()
    book = discover(graph, pm, RuleBook(), axis_sizes=(2,), progress=False, workers=1)
    rng = np.random.default_rng(11)
    keys = {op.key for op in graph.ops}
    assert {"te.topi.nn.dense", "te.topi.reshape", "te.topi.transpose"} <= keys, keys
    for op in graph.ops:
        pattern = op_pattern(op, graph, 2)
        assert pattern.proxied, (op.key, pattern.reason)
        entry = book.entries.get(pattern.key)  # found under its pattern: discovered at proxy sizes
        assert entry is not None and entry.status == "ok", (op.key, sorted(book.entries))
        spec = pm.op_spec(op, graph)  # the op at its real shapes
        out_shapes = [graph.vars[v].shape for v in op.outputs]
        wrong = [f"{r}: {why}" for r in entry.rules if (why := check_rule(spec, r, 2, rng, out_shapes))]
        assert not wrong, (op.key, wrong)
        real = discover_rules(spec, 2)
        assert set(entry.rules) == set(real), (op.key, sorted(map(str, entry.rules)), sorted(map(str, real)))
