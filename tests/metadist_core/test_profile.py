"""Mesh profiles: defaults, per-axis link levels, loading by path or environment, alpha-beta fitting."""

import pytest

from metadist_core.cost.profile import PROFILE_ENV, MeshProfile, fit_alpha_beta, load_profile, profile_from_samples


def test_axis_levels_follow_nodes():
    prof = MeshProfile(
        nodes=2,
        devices_per_node=4,
        levels={"intra": {"alpha": 1e-6, "beta": 1e-11}, "inter": {"alpha": 1e-5, "beta": 1e-10}},
    )
    mesh = prof.mesh((2, 4))
    assert mesh.alpha == (1e-5, 1e-6) and mesh.beta == (1e-10, 1e-11)


def test_load_by_path_and_env(tmp_path, monkeypatch):
    p = MeshProfile(nodes=1, devices_per_node=2, backend="gloo", measured=True).save(tmp_path / "p.json")
    assert load_profile(p).backend == "gloo"
    monkeypatch.setenv(PROFILE_ENV, str(p))
    assert load_profile().measured
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="metadist calibrate"):
        load_profile()


def test_fit_recovers_alpha_beta():
    a, b = 2e-5, 3e-10
    samples = [
        (
            k,
            n,
            s,
            (2 * (n - 1) * a + 2 * (n - 1) / n * s * b) if k == "all_reduce" else ((n - 1) * a + (n - 1) / n * s * b),
        )
        for k in ("all_reduce", "all_gather")
        for n in (2, 4)
        for s in (1e3, 1e5, 1e7)
    ]
    fa, fb = fit_alpha_beta(samples)
    assert fa == pytest.approx(a, rel=1e-3) and fb == pytest.approx(b, rel=1e-3)
    prof = profile_from_samples(
        [{"level": "intra", "kind": k, "n": n, "nbytes": s, "seconds": t} for k, n, s, t in samples], 1, 4, "gloo"
    )
    assert prof.levels["intra"]["alpha"] == pytest.approx(a, rel=1e-3)
    assert MeshProfile.from_json(prof.to_json()).levels == prof.levels
