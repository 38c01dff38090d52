"""What the JAX lowering runs is what the cost model priced, and costs are measured by default.

* The collectives in the optimized HLO that XLA compiles from the lowered
  shard_map move exactly the bytes ``overlap.predict`` prices (kinds and bytes as
  one multiset), on meshes (8,) and (2, 4).
* A JAX training step has one reader phase: XLA merges the interpreter's second
  move of a value, so the problem prices one.
* The first compile with ``measure_links`` on measures the links per mesh axis
  (all_gather and reduce_scatter apart from the psums, and the local copy beside a gather or scatter of an
  inner dim) and the device, caches the profile, and the next compile reads it; a new mesh
  shape is measured and added.
* A metadist ``Mesh`` given as ``mesh=`` keeps link costs of its own; one with
  the built-in costs (a shape and axis names) takes the measured ones.
"""

from __future__ import annotations

from collections import Counter

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_core.config import load_settings  # noqa: E402
from metadist_core.plan.overlap import predict, priced_collectives  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.cost.profile import MeshProfile, cached_profile, profile_for, profile_key  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.hlo import collectives  # noqa: E402
from metadist_jax.plugin import JaxFrontend  # noqa: E402

from _jax_models import mlp_case  # noqa: E402


def _mlp_step():
    mlp, opt, params, state, batch = mlp_case()
    return mlp.make_step(opt), params, state, batch


@pytest.mark.parametrize("mesh", [(8,), (2, 4)], ids=lambda m: "x".join(map(str, m)))
def test_hlo_collectives_are_the_priced_ones(devices8, rule_cache, mesh):
    step_fn, params, opt_state, batch = _mlp_step()
    # a small budget so that the plan shards (and so moves) something on every mesh
    step = metadist_compile(step_fn, mesh=mesh, cache_dir=rule_cache, memory_budget=300_000)
    args = step.place(params, opt_state, batch)
    step(*args)
    priced = Counter((c.kind, int(c.nbytes)) for _, c in priced_collectives(step.plan))
    ran = Counter(collectives(step.lowered().compiled_text(*args)))
    assert sum(priced.values()) > 0, str(step.plan)
    assert ran == priced, f"priced {sorted(priced.items())}\nXLA runs {sorted(ran.items())}\n{step.plan}"
    assert predict(step.plan, step.problem).comm_bytes == sum(b * k for (_, b), k in ran.items())


def test_jax_step_has_one_reader_phase(devices8, rule_cache):
    step_fn, params, opt_state, batch = _mlp_step()
    step = metadist_compile(step_fn, mesh=(8,), cache_dir=rule_cache)
    step(*step.place(params, opt_state, batch))
    assert step.problem.phases == {}


def test_hlo_parser_reads_tuples_groups_and_async_starts():
    text = "\n".join(
        [
            "  %a = f32[4,8]{1,0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%r",
            "  %b = (f32[16]{0}, bf16[2,2]{1,0}) all-reduce(%y, %z), replica_groups=[2,4]<=[8]",
            "  %c = f32[8,4]{1,0} reduce-scatter(%w), replica_groups=[2,4]<=[8], dimensions={0}",
            "  %d = (f32[2]{0}, f32[8]{0}) all-gather-start(%v), replica_groups={{0,1,2,3}}",
            "  %e = f32[8]{0} all-gather-done(%d)",
            "  %f = f32[3]{0} add(%p, %q)",
        ]
    )
    assert collectives(text) == [
        ("all_reduce", 128),
        ("all_reduce", 64 + 8),
        ("reduce_scatter", 128 * 4),
        ("all_gather", 32),
    ]
    starts = "\n".join(
        [  # a combined all-reduce-start's tuple is its results; a permute's holds contexts
            "  %g = (f32[16]{0}, f32[4]{0}) all-reduce-start(%a, %b), replica_groups={{0,1}}, to_apply=%r",
            "  %h = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%c), source_target_pairs={{0,1}}",
        ]
    )
    assert collectives(starts) == [("all_reduce", 80), ("collective_permute", 32)]


def test_profile_measured_cached_and_grown(devices8, tmp_path, monkeypatch):
    import metadist_jax.calibrate as cal

    calls = []
    real = cal.measure_live

    def counting(jax_mesh, shape, cached=None, iters=5):
        calls.append(tuple(shape))
        return real(jax_mesh, shape, cached, iters=2)

    monkeypatch.setattr(cal, "measure_live", counting)
    fe = JaxFrontend()
    settings = load_settings(cache_dir=str(tmp_path), measure_links=True, mesh_profile=None)
    m8 = fe.resolve_mesh((8,), MeshProfile())
    prof = profile_for(fe, m8, settings)
    assert prof.measured and calls == [(8,)] and prof.covers(m8.mesh) and not prof.covers((2, 4))
    assert prof.device.peak_flops > 0 and prof.device.mem_bandwidth > 0
    alpha = prof.axis_costs["8"][0]["alpha"]
    assert alpha > 0
    key = profile_key(8, m8.device_kind)
    assert cached_profile(str(tmp_path), key) is not None
    again = profile_for(fe, m8, settings)  # read from the cache: nothing measured
    assert calls == [(8,)] and again.axis_costs["8"][0]["alpha"] == alpha
    m24 = fe.resolve_mesh((2, 4), MeshProfile())
    grown = profile_for(fe, m24, settings)  # a new shape: measured and added
    assert calls == [(8,), (2, 4)]
    assert set(grown.axis_costs) == {"8", "2x4"}
    mesh = grown.mesh((2, 4))
    assert list(mesh.alpha) == [a["alpha"] for a in grown.axis_costs["2x4"]]
    # gathers and scatters are timed apart from the psums, per axis, and price those kinds
    for axis, a in enumerate(grown.axis_costs["2x4"]):
        k = a["kinds"]
        assert set(k) == {"all_gather", "reduce_scatter", "local_copy"} and k["all_gather"]["alpha"] > 0
        # a gather/scatter of an inner dim copies its buffer: a read and a write at the device's memory rate
        assert k["local_copy"] == {"alpha": 0.0, "beta": pytest.approx(2.0 / grown.device.mem_bandwidth)}
        assert mesh.link(axis, "all_gather") == (k["all_gather"]["alpha"], k["all_gather"]["beta"])
        assert mesh.link(axis, "all_reduce") == (a["alpha"], a["beta"])


def test_given_mesh_keeps_its_link_costs(devices8, rule_cache):
    step_fn, params, opt_state, batch = _mlp_step()
    mine = Mesh((8,), None, [3.5e-3], [2.5e-9])
    step = metadist_compile(step_fn, mesh=mine, cache_dir=rule_cache)
    step(*step.place(params, opt_state, batch))
    assert list(step.problem.mesh.alpha) == [3.5e-3] and list(step.problem.mesh.beta) == [2.5e-9]


def test_a_mesh_of_shape_only_takes_the_measured_costs(devices8, rule_cache, monkeypatch):
    """``Mesh((8,))`` says a shape and axis names, not costs: the measured profile prices it."""
    import metadist_jax.calibrate as cal

    real = cal.measure_live
    monkeypatch.setattr(cal, "measure_live", lambda jm, shape, cached=None, iters=5: real(jm, shape, cached, iters=2))
    monkeypatch.setenv("METADIST_MEASURE_LINKS", "1")
    step_fn, params, opt_state, batch = _mlp_step()
    step = metadist_compile(step_fn, mesh=Mesh((8,)), cache_dir=rule_cache)
    step(*step.place(params, opt_state, batch))
    prof = cached_profile(rule_cache, profile_key(8, JaxFrontend().resolve_mesh((8,), MeshProfile()).device_kind))
    assert prof is not None
    assert list(step.problem.mesh.alpha) == [prof.axis_costs["8"][0]["alpha"]]


def test_calibration_times_its_programs_in_interleaved_rounds():
    """The live calibration compiles every program first, then times all of them in rounds, forwards and
    backwards in turn, so that a slow spell of the shared cores falls on every figure alike; each figure is
    the median of all its runs."""
    import metadist_jax.calibrate as cal

    calls: list = []

    def prog(name):
        def run(arg):
            calls.append(name)
            return arg

        return run

    progs = cal._Programs()
    assert [progs.add(prog(name), 1) for name in "abc"] == [0, 1, 2]
    out = progs.run(iters=2, rounds=3)  # 2 // 2 + 1 = 2 runs of each a round
    assert calls[:3] == list("abc")  # each run once before any timing
    timed = calls[3:]
    assert timed == list("aabbcc") + list("ccbbaa") + list("aabbcc")
    assert len(out) == 3 and all(t >= 0 for t in out)
