"""The cost model prices what the lowering runs: one reshard per value and target, whole buckets,
and the measured profile cached per machine."""

import dataclasses
import itertools

import numpy as np
import pytest

from metadist_core.config import load_settings
from metadist_core.problem.constraints import Pin
from metadist_core.cost.model import all_reduce_cost
from metadist_core.plan.interpret import interpret
from metadist_core.ir.ir import MetaIR
from metadist_core.plan.overlap import buckets_latency, predict, priced_collectives
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding
from metadist_core.plan.plan import ShardingPlan
from metadist_core.problem.build import build_problem
from metadist_core.cost.profile import MeshProfile, cached_profile, profile_cache_path, profile_for, profile_key
from metadist_core.plugins import PluginManager
from metadist_core.reference.plugin import ReferenceFrontend

from _small_graphs import rulebook

R = Replicate()


@pytest.fixture(scope="module")
def pm():
    return PluginManager()


def three_readers(m=8, k=4, n=6) -> MetaIR:
    """y = x @ w read by three ops (each keeps y's layout or wants it whole)."""
    g = MetaIR("three")
    g.add_input("x", (m, k), "float32", "input")
    g.add_input("w", (k, n), "float32", "parameter")
    g.add_op("aten.mm.default", ["x", "w"], [("y", (m, n), "float32")], id="mm")
    for i in range(3):
        g.add_op("aten.mul.Tensor", ["y"], [(f"z{i}", (m, n), "float32")], {"scalar": 0.5 + i}, id=f"r{i}")
    g.set_outputs(["z0", "z1", "z2"])
    return g


def _choice(p, want: dict) -> list[int]:
    """Per node the first allowed option whose (inputs..., outputs...) match ``want[node id]``."""
    out = []
    for i, n in enumerate(p.nodes):
        opts = [k for k, o in enumerate(n.options) if p.allowed[i][k]]
        if n.id in want:
            opts = [k for k in opts if want[n.id](n.options[k])]
        out.append(opts[0])
    return out


def test_reshard_read_by_three_ops_is_charged_once():
    g = three_readers()
    mesh = Mesh((2,))
    p = build_problem(g, rulebook(g), mesh)
    rep = Sharding([R])
    ch = _choice(
        p,
        {
            "x": lambda o: o.outputs[0] == Sharding([Shard(1)]),
            "w": lambda o: o.outputs[0] == Sharding([Shard(0)]),
            "mm": lambda o: o.outputs[0] == Sharding([Partial("sum")]),
            **{f"r{i}": (lambda o: o.inputs[0] == rep and o.outputs[0] == rep) for i in range(3)},
        },
    )
    plan = ShardingPlan.from_choices(p, ch)
    one = all_reduce_cost(8 * 6 * 4, 2, mesh.alpha[0], mesh.beta[0])
    # three edges each list the all_reduce (what every reader sees) ...
    assert sum(1 for e in plan.edges if e.var == "y" and any(c.kind == "all_reduce" for c in e.collectives)) == 3
    # ... and the price holds it once, in the plan, the exact Terms and the coarsened Terms
    assert plan.comm_seconds == pytest.approx(one, rel=1e-12)
    assert p.terms().objective(np.asarray(ch)) == pytest.approx(plan.objective, rel=1e-12)
    assert p.terms().pairwise().objective(np.asarray(ch)) == pytest.approx(plan.compute_seconds + 3 * one)
    # the interpreter runs it once, and that is the priced list
    res = interpret(g, plan, mesh, {v: v for v in g.inputs}, lambda op, ins, sh: [op.id] * len(op.outputs), _Recorder())
    assert (
        [(c.kind, c.axis, c.nbytes) for _, c in res.collectives if not c.is_free]
        == [(c.kind, c.axis, c.nbytes) for _, c in priced_collectives(plan)]
        == [("all_reduce", 0, 192)]
    )


class _Recorder:
    def __getattr__(self, kind):
        return lambda x, c, shape: x


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_ilp_matches_brute_force_with_shared_reshards(pm, mesh_shape):
    g = three_readers()
    mesh = Mesh(mesh_shape)
    # readers forced to want y whole: the solver must pay the shared reshard, once
    p = build_problem(
        g, rulebook(g), mesh, constraints=[Pin(f"z{i}", Sharding([R] * len(mesh_shape))) for i in range(3)]
    )
    t = p.terms()
    allowed = [np.flatnonzero(a) for a in t.allowed]
    best = min(t.objective(np.array(c)) for c in itertools.product(*allowed))
    for coarse in (False, True):
        plan = pm.solve("ilp", p, {"coarsen": coarse, "mip_rel_gap": 1e-9})
        assert plan.objective == pytest.approx(best, rel=1e-6, abs=1e-12)


def transposed_params(n=4, width=32, batch=16) -> MetaIR:
    """Layers y_i = y_{i-1} @ t(w_i): each parameter read through its transpose, as nn.Linear traces."""
    g = MetaIR("transposed")
    g.add_input("x", (batch, width), "float32", "input")
    prev = "x"
    for i in range(n):
        g.add_input(f"w{i}", (width, width), "float32", "parameter")
        g.add_op("aten.t.default", [f"w{i}"], [(f"wt{i}", (width, width), "float32")], id=f"t{i}")
        g.add_op("aten.mm.default", [prev, f"wt{i}"], [(f"y{i}", (batch, width), "float32")], id=f"mm{i}")
        prev = f"y{i}"
    g.set_outputs([prev])
    return g


@pytest.mark.parametrize("coarsen", [False, True])
def test_parameters_are_gathered_in_buckets_not_their_transposes(pm, coarsen):
    """A parameter's gather can be bucketed (metadist_core.cost.gathers), its transpose's cannot: the solver
    prefers the former (ShardingProblem.price, GATHER_SHARE), so a layout with parameters split on dim 0
    gathers the parameters, in one bucket, and transposes them whole."""
    g = transposed_params()
    mesh = Mesh((4,))
    # ZeRO-3: parameters split on dim 0, the batch split; every layer needs its whole weight
    pins = [Pin(f"w{i}", Sharding([Shard(0)])) for i in range(4)] + [
        Pin("x", Sharding([Shard(0)])),
        Pin("y3", Sharding([Shard(0)])),
    ]
    free_views = {f"t{i}": (0, 0) for i in range(4)}  # as the torch frontend prices a view
    p = build_problem(g, rulebook(g), mesh, constraints=pins, shard_bucket_bytes=1 << 22, op_costs=free_views)
    plan = pm.solve("ilp", p, {"coarsen": coarsen, "mip_rel_gap": 1e-9})
    moved = [(v, c.kind) for v, c in priced_collectives(plan) if not c.is_free and v != "y3"]  # y3: returned whole
    assert sorted(moved) == [(f"w{i}", "all_gather") for i in range(4)], moved
    from metadist_core.cost.gathers import gather_buckets

    assert [len(b) for b in gather_buckets(p, plan.choices)] == [4]
    # a parameter's gather is priced a little under the same gather of another value; the plan pays that
    one = p.price("w0", [c for v, c in priced_collectives(plan) if v == "w0"])
    whole = next(c.cost for v, c in priced_collectives(plan) if v == "w0")
    y3 = p.price("y3", [c for v, c in priced_collectives(plan) if v == "y3"])
    assert whole * 0.99 < one < whole and plan.comm_seconds == pytest.approx(4 * one + y3, rel=1e-9)
    # under a memory budget a gather pays only its bytes' share of the bucket's latency, as a gradient's
    # all_reduce does: the plans that meet a tight budget gather every layer's parameters, bucket by bucket
    from metadist_core.problem.problem import gathers_bucketed

    tight = build_problem(g, rulebook(g), mesh, constraints=pins, shard_bucket_bytes=1 << 22, memory_budget=1 << 30)
    assert gathers_bucketed(p, "w0") and gathers_bucketed(tight, "w0") and tight.vars["w0"]["gather_bucketed"]
    gather = next(c for v, c in priced_collectives(plan) if v == "w0")
    latency = (4 - 1) * mesh.link(0, "all_gather")[0]
    assert tight.price("w0", [gather]) == pytest.approx(whole - latency * (1 - gather.nbytes / (1 << 22)), rel=1e-12)
    assert tight.price("w0", [gather]) < one


def gradients(n_grads=5, size=(64, 32)) -> MetaIR:
    """n gradient values, each made Partial by an mm with a split contraction, then an update of each."""
    g = MetaIR("grads")
    g.add_input("x", (16, size[0]), "float32", "input")
    g.add_input("dy", (16, size[1]), "float32", "input")
    for i in range(n_grads):
        g.add_input(f"w{i}", size, "float32", "parameter")
        g.add_op("aten.t.default", ["x"], [(f"xt{i}", (size[0], 16), "float32")], id=f"t{i}")
        g.add_op("aten.mm.default", [f"xt{i}", "dy"], [(f"g{i}", size, "float32")], id=f"mm{i}")
        g.vars[f"g{i}"].role = "gradient"
    for i in range(n_grads):  # the optimizer after the whole backward, as in a training step
        g.add_op("aten.sub.Tensor", [f"w{i}", f"g{i}"], [(f"w{i}n", size, "float32")], id=f"upd{i}")
        g.alias(f"w{i}", f"w{i}n")
    g.set_outputs([f"w{i}n" for i in range(n_grads)])
    return g


def test_bucketed_all_reduces_cost_one_latency_per_bucket():
    g = gradients()
    mesh = Mesh((4,), alpha=[1e-3], beta=[1e-9])
    each = 64 * 32 * 4
    bucket = 2 * each  # 5 gradients of `each` bytes: buckets of 2, 2, 1 -> 3 latencies
    cons = [Pin("x", Sharding([Shard(0)])), Pin("dy", Sharding([Shard(0)]))] + [
        Pin(f"w{i}", Sharding([R])) for i in range(5)
    ]
    p = build_problem(g, rulebook(g), mesh, constraints=cons, bucket_bytes=bucket)
    plain = build_problem(g, rulebook(g), mesh, constraints=cons)
    ch = _choice(
        p,
        {f"mm{i}": (lambda o: o.outputs[0] == Sharding([Partial("sum")])) for i in range(5)}
        | {f"t{i}": (lambda o: o.inputs[0] == Sharding([Shard(0)])) for i in range(5)}
        | {f"upd{i}": (lambda o: o.inputs[1] == Sharding([R])) for i in range(5)},
    )
    plan, plan0 = ShardingPlan.from_choices(p, ch), ShardingPlan.from_choices(plain, ch)
    colls = priced_collectives(plan)
    assert [c.kind for _, c in colls] == ["all_reduce"] * 5
    latency, bw = 2 * 3 * 1e-3, 2 * 3 / 4 * each * 1e-9
    # unbucketed: five latencies; the solver's price: each pays its share of a bucket; predict: whole buckets
    assert plan0.comm_seconds == pytest.approx(5 * (latency + bw))
    assert plan.comm_seconds == pytest.approx(5 * bw + 5 * latency * each / bucket)
    assert buckets_latency([each] * 5, bucket) == 3
    pr = predict(plan)
    assert pr.n_buckets == 3 and pr.n_collectives == 5 and pr.comm_bytes == 5 * each
    assert pr.comm == pytest.approx(3 * latency + 5 * bw)
    # a bucket can start before the last gradient is computed: it overlaps with the compute after it
    assert pr.step <= pr.compute + pr.comm + 1e-12
    assert pr.step >= max(pr.compute, pr.comm) - 1e-12


class _Measuring(ReferenceFrontend):
    name = "measuring"

    def __init__(self):
        self.measured = 0

    def resolve_mesh(self, mesh, profile):
        return dataclasses.replace(super().resolve_mesh(mesh, profile), device_kind="toy")

    def measure_profile(self, resolved, cached, traced=None):
        mesh = resolved.mesh
        if cached is not None and cached.covers(mesh):
            return cached
        self.measured += 1
        prof = MeshProfile(measured=True)
        prof.axis_costs["x".join(map(str, mesh.shape))] = [{"alpha": 7e-6, "beta": 3e-10}] * mesh.ndim
        return prof


def test_profile_measured_once_reused_and_rebuilt_for_another_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("METADIST_MEASURE_LINKS", "1")  # on by default; the test suite turns it off
    fe = _Measuring()
    s = load_settings(cache_dir=str(tmp_path), progress=False)
    two, four = fe.resolve_mesh((2,), MeshProfile()), fe.resolve_mesh((4,), MeshProfile())
    p1 = profile_for(fe, two, s)
    assert fe.measured == 1 and p1.measured and p1.key["world_size"] == 2 and p1.covers(Mesh((2,)))
    assert not p1.covers((2, 2))
    assert profile_cache_path(str(tmp_path), profile_key(2, "toy")).exists()
    p2 = profile_for(fe, two, s)  # the next compile: from the cache
    assert fe.measured == 1 and p2.mesh((2,)).alpha == (7e-6,)
    profile_for(fe, four, s)  # another world size: measured again
    assert fe.measured == 2 and cached_profile(str(tmp_path), profile_key(4, "toy")) is not None
    profile_for(fe, two, s, force=True)  # `metadist calibrate`: measured again
    assert fe.measured == 3
    # the mesh_profile setting overrides: nothing is measured
    path = MeshProfile().save(tmp_path / "mine.json")
    assert profile_for(fe, two, load_settings(cache_dir=str(tmp_path), mesh_profile=str(path))).measured is False
    assert fe.measured == 3


def test_compile_prices_with_the_measured_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("METADIST_MEASURE_LINKS", "1")
    from metadist_core.driver.compile import compile_step
    from metadist_core.reference.plugin import transformer_block

    fe = _Measuring()
    s = load_settings(cache_dir=str(tmp_path), progress=False)
    for _ in range(2):
        res = compile_step(fe, transformer_block, (), {"batch": 4, "seq": 8, "width": 16, "hidden": 32}, s, mesh=(2,))
    assert fe.measured == 1 and res.mesh.alpha == (7e-6,) and res.problem.mesh.beta == (3e-10,)


class _Timing(_Measuring):
    """A frontend whose ops were all measured ``factor`` times slower than their roofline."""

    name = "timing"

    def __init__(self, factor):
        super().__init__()
        self.factor, self.calls = factor, 0

    def time_ops(self, requests, resolved, traced=None, program=False):
        """Every op ran ``factor`` times its roofline at the rates measured alongside."""
        from metadist_core.cost.model import DeviceSpec
        from metadist_core.cost.optimes import roofline
        from metadist_core.driver.frontend import OpTimes

        self.calls += 1
        dev = DeviceSpec("toy-measured", 50e9, 10e9, op_overhead=1e-6)
        graph = traced.graph
        return OpTimes(
            [self.factor * roofline(op, graph, self.op_cost(op, graph), dev) + 2e-6 for op, _, _ in requests],
            dev,
            harness=2e-6,
        )


def test_measured_ops_price_their_slowdown_and_builtin_costs_do_not(tmp_path, monkeypatch):
    from metadist_core.driver.compile import compile_step
    from metadist_core.reference.plugin import transformer_block

    kw = {"batch": 4, "seq": 8, "width": 16, "hidden": 32}
    monkeypatch.setenv("METADIST_MEASURE_LINKS", "1")
    s = load_settings(cache_dir=str(tmp_path), progress=False)
    runs = {}
    for f in (1.0, 3.0):
        fe = _Timing(f)
        s = load_settings(cache_dir=str(tmp_path / str(f)), progress=False)
        runs[f] = compile_step(fe, transformer_block, (), kw, s, mesh=(2,)).problem
        # asked once, the slowdowns kept in a file beside the measured profile
        assert fe.calls == 1 and list((tmp_path / str(f) / "profiles").glob("*-ops.json"))
    assert runs[1.0].device.op_overhead == 0.0
    for a, b, n in zip(runs[1.0].compute, runs[3.0].compute, runs[1.0].nodes):
        assert np.allclose(b, 3.0 * a), (n.id, a, b)  # every op, under every option, 3x its roofline
    assert any(float(np.max(a)) > 0 for a in runs[1.0].compute)
    monkeypatch.setenv("METADIST_MEASURE_LINKS", "0")  # the built-in costs: plans that do not depend on timings
    fe = _Timing(3.0)
    plain = compile_step(
        fe, transformer_block, (), kw, load_settings(cache_dir=str(tmp_path), progress=False), mesh=(2,)
    ).problem
    assert fe.calls == 0 and all(np.allclose(a, b) for a, b in zip(plain.compute, runs[1.0].compute))


def test_memory_rate_follows_the_measured_curve():
    from metadist_core.cost.model import DeviceSpec, compute_cost

    dev = DeviceSpec("toy", 1e12, 5e9, op_overhead=1e-6, mem_curve=[(1e6, 1e9), (1e3, 1e10)])
    assert dev.mem_curve == ((1e3, 1e10), (1e6, 1e9))  # kept sorted by bytes
    assert dev.bandwidth_for(10) == 1e10 and dev.bandwidth_for(1e9) == 1e9  # its ends beyond its range
    assert dev.bandwidth_for(10**4.5) == pytest.approx(5.5e9)  # halfway in log-bytes
    # memory-bound: bytes over the rate at the local bytes, times the slowdown, plus the overhead
    assert compute_cost(0, 2e6, 2, dev) == pytest.approx(1e6 / 1e9 + 1e-6)
    assert compute_cost(0, 2e6, 2, dev, slowdown=3.0) == pytest.approx(3e6 / 1e9 + 1e-6)
    assert compute_cost(4e9, 10, 1, dev, slowdown=2.0) == pytest.approx(8e-3 + 1e-6)  # FLOP-bound alike
    assert DeviceSpec.from_json(dev.to_json()) == dev
    flat = DeviceSpec("toy", 1e12, 5e9)
    assert flat.bandwidth_for(1e9) == 5e9 and DeviceSpec.from_json(flat.to_json()) == flat
    shared = DeviceSpec("toy", 1e12, 5e9, overlap=0.0)  # measured: collectives need the compute's cores
    assert flat.overlap == 1.0 and DeviceSpec.from_json(shared.to_json()).overlap == 0.0


# -- collective kinds priced apart (Mesh.links, measured by metadist_torch.measure.calibrate) ------------------


def test_links_price_each_kind_and_tiny_all_reduces_apart():
    from metadist_core.cost.model import all_gather_cost, all_reduce_cost
    from metadist_core.cost.reshard import reshard, reshard_cost
    from metadist_core.ir.placement import Partial, Replicate, Shard, Sharding

    plain = Mesh((4,), alpha=1e-3, beta=1e-9)
    mesh = Mesh((4,), alpha=1e-3, beta=1e-9, links=[{"all_gather": (2e-3, 3e-9), "all_reduce_tiny": (1e-4, 1e-9)}])
    S0, R, P = Sharding([Shard(0)]), Sharding([Replicate()]), Sharding([Partial("sum")])
    nb = 64 * 32 * 4
    assert reshard_cost(S0, R, (64, 32), "float32", mesh) == pytest.approx(all_gather_cost(nb, 4, 2e-3, 3e-9))
    assert reshard_cost(S0, R, (64, 32), "float32", plain) == pytest.approx(all_gather_cost(nb, 4, 1e-3, 1e-9))
    # an all_reduce of one element (fewer than the 4 devices) takes the tiny figures; 4 elements do not
    assert reshard_cost(P, R, (), "float32", mesh) == pytest.approx(all_reduce_cost(4, 4, 1e-4, 1e-9))
    assert reshard_cost(P, R, (4,), "float32", mesh) == pytest.approx(all_reduce_cost(16, 4, 1e-3, 1e-9))
    assert mesh.link(0, "all_reduce", 1) == (1e-4, 1e-9) and mesh.link(0, "all_to_all") == (1e-3, 1e-9)
    # the path follows the prices: all_reduce dear, reduce_scatter + all_gather cheap
    dear = Mesh(
        (4,),
        alpha=1e-3,
        beta=1e-9,
        links=[{"all_reduce": (1.0, 1e-9), "all_gather": (1e-6, 1e-9), "reduce_scatter": (1e-6, 1e-9)}],
    )
    assert [c.kind for c in reshard(P, R, (64, 32), "float32", dear)] == ["reduce_scatter", "all_gather"]
    assert [c.kind for c in reshard(P, R, (64, 32), "float32", plain)] == ["all_reduce"]
    again = Mesh.from_json(mesh.to_json())
    assert again == mesh and again.links == mesh.links
    with pytest.raises(ValueError, match="unknown collective kind"):
        Mesh((2,), links=[{"broadcast": (1.0, 1.0)}])


def test_a_profile_measured_by_kind_gives_its_mesh_the_links():
    prof = MeshProfile(measured=True)
    prof.axis_costs["2x2"] = [
        {"alpha": 1e-3, "beta": 1e-9, "kinds": {"all_gather": {"alpha": 2e-3, "beta": 2e-9}}},
        {"alpha": 5e-4, "beta": 1e-9},
    ]
    mesh = MeshProfile.from_json(prof.to_json()).mesh((2, 2))
    assert mesh.link(0, "all_gather") == (2e-3, 2e-9) and mesh.link(1, "all_gather") == (5e-4, 1e-9)
    assert mesh.alpha == (1e-3, 5e-4)
