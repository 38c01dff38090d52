"""metadist_core.cost.localtime: strategies priced at the time their op takes at their local shapes, as measured.

A fake frontend "measures" a matmul split by its rows at twice its roofline and any other at its roofline;
the problem's compute must carry exactly those ratios, each kernel is measured once per compile and kept
on disk for the next, a kernel not measured takes the median of those measured, and a spent budget
measures nothing more."""

from __future__ import annotations

import numpy as np
import pytest

from metadist_core.problem.build import build_problem, estimate_op_cost
from metadist_core.cost.model import DeviceSpec, compute_cost, local_shape, strategy_split
from metadist_core.discovery.discover import discover
from metadist_core.cost.localtime import LocalTimer
from metadist_core.ir.mesh import Mesh
from metadist_core.plugins import PluginManager
from metadist_core.reference.plugin import GraphBuilder
from metadist_core.discovery.rules import RuleBook

#: slow enough that every matmul here is over localtime.MIN_SECONDS at its roofline
DEV = DeviceSpec("slow", 1e8, 1e8, op_overhead=0.0)
RATES = DeviceSpec("measured-alongside", 2e8, 5e7, op_overhead=0.0)  # other rates: only ratios carry over


def _graph():
    g = GraphBuilder("two_matmuls")
    x = g.input("x", (64, 32))
    w1, w2 = g.param("w1", (32, 48)), g.param("w2", (48, 16))
    y = g.op("np.matmul", g.op("np.gelu", g.op("np.matmul", x, w1)), w2)
    g.output(g.op("np.mean", y))
    return g.ir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ir = _graph()
    mesh = Mesh((4,))
    book = discover(ir, PluginManager(), RuleBook.load(str(tmp_path_factory.mktemp("rules"))), axis_sizes=(4,))
    return ir, mesh, book


class FakeFrontend:
    """Times a matmul at twice its roofline (at ``RATES``) where its first input's rows are split, else at
    its roofline; refuses the kernels named in ``refuse``."""

    def __init__(self, ir, refuse=()):
        self.ir, self.calls, self.refuse = ir, [], set(refuse)

    def wants(self, op) -> bool:
        return op.key == "np.matmul"

    def measure(self, requests, mesh):
        self.calls.append(len(requests))
        out = []
        for op, shapes, _dtypes in requests:
            (m, k), (_, n) = shapes
            if (m, k, n) in self.refuse:
                out.append(None)
                continue
            full_m = self.ir.vars[op.inputs[0]].shape[0]
            flops, nbytes = 2.0 * m * k * n, 4.0 * (m * k + k * n + m * n)
            out.append(max(flops / RATES.peak_flops, nbytes / RATES.mem_bandwidth) * (2.0 if m < full_m else 1.0))
        return out, RATES


def _matmul_rows(ir, problem):
    return [(i, node) for i, node in enumerate(problem.nodes) if node.kind == "op" and node.key == "np.matmul"]


def _expected_ratio(ir, node, strategy, mesh) -> float:
    """What the fake measures over the roofline of this strategy (both at RATES, at the core's split)."""
    (m, k), (_, n) = (local_shape(ir.vars[v].shape, sh, mesh) for v, sh in zip(node.inputs, strategy.inputs))
    full_m = ir.vars[node.inputs[0]].shape[0]
    op = next(o for o in ir.ops if o.id == node.id)
    split = strategy_split(strategy.inputs, strategy.outputs, mesh)
    flops, nbytes = estimate_op_cost(op, ir)
    measured = max(2.0 * m * k * n / RATES.peak_flops, 4.0 * (m * k + k * n + m * n) / RATES.mem_bandwidth)
    measured *= 2.0 if m < full_m else 1.0
    return measured / compute_cost(flops, nbytes, split, RATES)


def test_each_strategy_is_priced_at_its_measured_ratio_and_each_kernel_timed_once(setup, tmp_path):
    ir, mesh, book = setup
    plain = build_problem(ir, book, mesh, device=DEV)
    fe = FakeFrontend(ir)
    timer = LocalTimer(fe.wants, fe.measure, cache_file=tmp_path / "local.json")
    timed = build_problem(ir, book, mesh, device=DEV, local_timer=timer)
    assert fe.calls and sum(fe.calls) == len(timer.times)
    split_rows = 0
    for i, node in _matmul_rows(ir, timed):
        for k, strategy in enumerate(node.options):
            ratio = _expected_ratio(ir, node, strategy, mesh)
            assert timed.compute[i][k] == pytest.approx(plain.compute[i][k] * ratio, rel=1e-9)
            split_rows += ratio > 1.5
    assert split_rows > 0  # the rows-split strategies are there, and dearer than their roofline said
    # the non-matmul ops are untouched
    for i, node in enumerate(timed.nodes):
        if node.kind == "op" and node.key != "np.matmul":
            np.testing.assert_array_equal(timed.compute[i], plain.compute[i])
    # a second build of the same compile, and a later compile reading the file, measure nothing
    calls = len(fe.calls)
    build_problem(ir, book, mesh, device=DEV, local_timer=timer)
    again = LocalTimer(fe.wants, fe.measure, cache_file=tmp_path / "local.json")
    reread = build_problem(ir, book, mesh, device=DEV, local_timer=again)
    assert len(fe.calls) == calls and set(again.times) == set(timer.times)
    for i, _ in _matmul_rows(ir, timed):
        np.testing.assert_allclose(reread.compute[i], timed.compute[i], rtol=1e-12)


def test_a_kernel_not_measured_takes_the_median_of_those_measured(setup):
    ir, mesh, book = setup
    plain = build_problem(ir, book, mesh, device=DEV)
    refuse = {(64, 32, 48)}  # the first matmul, whole: the replicated strategy is not measured
    fe = FakeFrontend(ir, refuse)
    timer = LocalTimer(fe.wants, fe.measure)
    timed = build_problem(ir, book, mesh, device=DEV, local_timer=timer)
    assert None in timer.times.values()
    ratios, refused_at = [], []
    for i, node in _matmul_rows(ir, timed):
        for k, strategy in enumerate(node.options):
            (m, kk), (_, n) = (local_shape(ir.vars[v].shape, sh, mesh) for v, sh in zip(node.inputs, strategy.inputs))
            if (m, kk, n) in refuse:
                refused_at.append((i, k))
            else:
                ratios.append(timed.compute[i][k] / plain.compute[i][k])
    assert refused_at
    for i, k in refused_at:
        assert timed.compute[i][k] / plain.compute[i][k] == pytest.approx(float(np.median(ratios)), rel=1e-9)


def test_a_spent_budget_measures_nothing_more(setup):
    ir, mesh, book = setup
    plain = build_problem(ir, book, mesh, device=DEV)
    fe = FakeFrontend(ir)
    timer = LocalTimer(fe.wants, fe.measure, budget=0.0)
    timed = build_problem(ir, book, mesh, device=DEV, local_timer=timer)
    assert fe.calls == [] and timer.stats()["left_untimed"] > 0
    for i, _ in _matmul_rows(ir, timed):
        np.testing.assert_array_equal(timed.compute[i], plain.compute[i])
