"""The one driver: a toy frontend (the numpy reference frontend) registered through the same hook as
torch, JAX and TVM, compiled through compile_step / CompiledStep, and checked against the unsplit run."""

import numpy as np
import pytest

from metadist_core.driver import cli, planonly
from metadist_core.driver.frontend import Frontend
from metadist_core.hookspecs import hookimpl
from metadist_core.driver.compile import compile_step
from metadist_core.driver.step import CompiledStep
from metadist_core.driver.frontend import FrontendTraits
from metadist_core.config import load_settings
from metadist_core.plugins import PluginManager, UnknownSolverError
from metadist_core.reference.plugin import ReferenceFrontend, run_graph, transformer_block


class ToyPlugin:
    """A plugin module's worth of hooks: one hook, returning the adapter."""

    @hookimpl
    def metadist_frontend(self):
        fe = ReferenceFrontend()
        fe.name = "toy"
        return fe


def _pm():
    pm = PluginManager()
    pm.register(ToyPlugin(), "frontend", "toy")
    return pm


def _inputs(graph, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(graph.vars[v].shape) for v in graph.inputs]


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
def test_toy_frontend_compiles_through_the_driver(tmp_path, mesh):
    pm = _pm()
    fe = pm.frontend("toy")
    assert isinstance(fe, Frontend) and fe.traits.owns(type("Op", (), {"key": "np.matmul"})())
    res = compile_step(
        fe,
        transformer_block,
        (),
        {"batch": 4, "seq": 8, "width": 16, "hidden": 32},
        load_settings(cache_dir=str(tmp_path), progress=False),
        mesh=mesh,
        plugins=pm,
    )
    assert set(res.timings) >= {"trace", "discover", "build_problem", "solve", "lower"}
    assert res.mesh.shape == mesh and res.plan.mesh_shape == mesh
    for seed in (1, 2):  # data the planner never saw
        ins = _inputs(res.graph, seed)
        outs, _ = res.runnable(*ins)
        ref = run_graph(res.graph, dict(zip(res.graph.inputs, ins)))
        for k, v in outs.items():
            np.testing.assert_allclose(v, ref[k], rtol=1e-12, atol=1e-12)


def test_compiled_step_caches_by_signature(tmp_path):
    pm = _pm()
    calls = []

    def build(width):
        calls.append(width)
        return transformer_block(batch=4, seq=4, width=width, hidden=2 * width)

    step = CompiledStep(pm.frontend("toy"), build, mesh=(2,), plugins=pm, cache_dir=str(tmp_path), progress=False)
    assert step.plan is None and step.timings == {}
    step.compile(8)
    first = step.plan
    step.compile(8)
    assert calls == [8] and step.plan is first
    step.compile(16)
    assert calls == [8, 16] and step.plan is not first and len(step.cache) == 2


def test_unknown_solver_fails_before_any_work():
    with pytest.raises(UnknownSolverError, match="unknown solver 'nope'; known solvers: .*ilp"):
        CompiledStep(ReferenceFrontend(), transformer_block, solver="nope")


def test_plan_only_is_handled_by_the_driver(tmp_path, monkeypatch, capsys):
    """Any frontend gets `metadist plan`: the driver plans for the requested mesh and ends the script."""
    out = tmp_path / "p.json"
    pm = _pm()
    with planonly.plan_only(planonly.PlanOnly(mesh=(2, 4), out=str(out), cache_dir=str(tmp_path))):
        with pytest.raises(planonly.PlanOnlyDone) as done:
            compile_step(pm.frontend("toy"), transformer_block, (), {}, load_settings(progress=False), plugins=pm)
    assert done.value.path == str(out) and not isinstance(done.value, SystemExit)
    assert planonly.requested() is None  # the setting ends with its context
    assert out.is_file() and "planned on mesh 2x4" in capsys.readouterr().out


class Misspelled:
    @hookimpl
    def metadist_frontnd(self):  # the typo is the point
        return None


def test_misspelled_hook_is_an_error_naming_it():
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(ValueError, match="metadist_frontnd"):
        pm.register(Misspelled(), "frontend", "typo")
    assert "typo" not in pm.names("frontend")


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--solver", "nope"],
        ["demo", "--reference", "--solver", "nope"],
        ["plan", "x.py", "--solver", "nope"],
        ["plan", "g.json", "--solver", "nope"],
    ],
)
def test_cli_unknown_solver_is_one_line_and_launches_nothing(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope'" in err and "ilp" in err and "beam" in err and "Traceback" not in err


def test_an_adapter_that_runs_no_ops_is_refused_when_defined():
    import pytest as _pytest

    from metadist_core.driver.frontend import Frontend
    from metadist_core.reference.plugin import ReferenceFrontend

    with _pytest.raises(TypeError, match="runs no ops for discovery"):

        class NoRunner(ReferenceFrontend):  # noqa: F841 - concrete, neither runner_module nor op_spec
            traits = FrontendTraits(op_prefixes=("np.",))

    class Partial(Frontend):  # still abstract: allowed
        pass

    assert Partial.__abstractmethods__


def test_the_first_gradient_bucket_follows_the_measured_overlap(monkeypatch):
    """DDP's 1 MiB first bucket exists to start an all_reduce early, beside the rest of the backward. Where
    the profile measured that nothing overlaps (4 gloo ranks on 2 cores: 0), it only adds a latency, so
    auto gives none; where something does (or nothing was measured), DDP's. A number the user set stays."""
    from metadist_core.config import DDP_FIRST_BUCKET_MB, NO_OVERLAP, load_settings, resolve_first_bucket

    s = load_settings(progress=False)
    assert s.first_bucket_mb is None and s.first_bucket_bytes == int(DDP_FIRST_BUCKET_MB * 2**20)
    none = resolve_first_bucket(s, 0.0)
    assert none.first_bucket_mb == 0.0 and none.first_bucket_bytes == s.bucket_bytes
    assert resolve_first_bucket(s, NO_OVERLAP).first_bucket_bytes == 2**20
    assert resolve_first_bucket(s, None).first_bucket_bytes == 2**20
    assert resolve_first_bucket(load_settings(first_bucket_mb=2.0), 0.0).first_bucket_bytes == 2 * 2**20
    monkeypatch.setenv("METADIST_FIRST_BUCKET_MB", "auto")
    assert load_settings().first_bucket_mb is None
    monkeypatch.setenv("METADIST_FIRST_BUCKET_MB", "0.5")
    assert resolve_first_bucket(load_settings(), 0.0).first_bucket_bytes == 2**19


def test_the_fsdp_preset_prices_its_parameter_gathers_as_bucketed_without_a_budget(tmp_path):
    """Every plan of the fsdp (zero3) preset gathers every parameter, in buckets: the solver prices each gather by
    its bucket share, as under a budget, so that its objective is the step the lowering runs
    (overlap.predict). Priced each at a whole latency, the objective was several times the prediction and the
    solver traded FSDP's reduce-scatters for all-reduces (the GPT example on 4 gloo ranks: 163 ms priced,
    30 predicted, 35 measured). ``auto`` keeps the small share (a plan there may gather one input alone)."""
    from metadist_core.plan.overlap import predict
    from metadist_core.driver.compile import plan_graph
    from metadist_core.ir.mesh import Mesh
    from metadist_core.problem.problem import BUDGET_GATHER_SHARE, GATHER_SHARE

    pm = _pm()
    graph = pm.frontend("toy").trace(transformer_block, (), {"batch": 4, "seq": 8, "width": 16, "hidden": 32}).graph
    mesh = Mesh((4,), alpha=[1e-3], beta=[1e-9])  # latency-bound, as gloo on small models
    shares, gaps = {}, {}
    for strategy in ("auto", "fsdp"):
        s = load_settings(
            cache_dir=str(tmp_path), progress=False, strategy=strategy, shard_bucket_mb=0.004, bucket_mb=0.004
        )  # buckets of 4 KiB: this block's parameters fill several
        res = plan_graph(graph, mesh, plugins=pm, settings=s, traits=FrontendTraits(shard_buckets=True))
        shares[strategy] = {res.problem.vars[v]["gather_share"] for v in graph.inputs}
        pr = predict(res.plan, res.problem)
        gaps[strategy] = (res.plan.objective, pr.step, res.plan.summary())
    assert shares == {"auto": {GATHER_SHARE}, "fsdp": {BUDGET_GATHER_SHARE}}, shares
    # per value the share approximates whole buckets to within one latency (ShardingProblem.price); priced
    # whole, this plan's 9 gathers read 23.8 ms against 9.0 predicted
    priced, predicted, _ = gaps["fsdp"]
    assert predicted > 0 and abs(priced - predicted) <= (4 - 1) * 1e-3 * 1.01, gaps


def test_under_a_budget_that_no_bucket_priced_plan_meets_the_gathers_are_priced_whole(tmp_path, monkeypatch):
    """Under a memory budget the solver prices an input's gather by its share of a bucket (FSDP-like plans,
    which hold each bucket's gathered parameters outside the solver's memory terms). Where no plan so priced
    meets the budget, the driver plans once more with every gather priced whole, as plans that gather few
    inputs may fit where bucketed ones do not; a budget nothing meets is still the error it was."""
    from metadist_core.levers import recompute
    from metadist_core.driver.compile import plan_graph
    from metadist_core.ir.mesh import Mesh
    from metadist_core.problem.problem import BUDGET_GATHER_SHARE, GATHER_SHARE, InfeasibleBudgetError

    pm = _pm()
    graph = pm.frontend("toy").trace(transformer_block, (), {"batch": 4, "seq": 8, "width": 16, "hidden": 32}).graph
    s = load_settings(cache_dir=str(tmp_path), progress=False, memory_budget=1 << 30)
    res = plan_graph(graph, Mesh((4,)), plugins=pm, settings=s, traits=FrontendTraits(shard_buckets=True))
    shares = {res.problem.vars[v]["gather_share"] for v in graph.inputs}
    assert shares == {BUDGET_GATHER_SHARE}, shares  # it fits: priced by bucket share, planned once

    real, seen = recompute.choose, []

    def choose(g, budget, solve, *a, **kw):  # as if no bucket-priced plan met the budget
        problem, _ = solve(g)
        seen.append({problem.vars[v].get("gather_share") for v in g.inputs})
        if seen[-1] != {GATHER_SHARE}:
            raise InfeasibleBudgetError(budget, 2 * budget, problem.mesh)
        return real(g, budget, solve, *a, **kw)

    monkeypatch.setattr(recompute, "choose", choose)
    res = plan_graph(graph, Mesh((4,)), plugins=pm, settings=s, traits=FrontendTraits(shard_buckets=True))
    assert seen == [{BUDGET_GATHER_SHARE}, {GATHER_SHARE}]
    assert {res.problem.vars[v]["gather_share"] for v in graph.inputs} == {GATHER_SHARE}
    # without gather buckets in the lowering there is nothing to price otherwise: the error stands
    seen.clear()
    with pytest.raises(InfeasibleBudgetError):
        plan_graph(graph, Mesh((4,)), plugins=pm, settings=s, traits=FrontendTraits(shard_buckets=False))
    assert len(seen) == 1
