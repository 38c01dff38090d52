"""The JAX frontend adapter: loads without jax, prices meshes with the profile it is given, and runs
through the one driver (metadist_core.driver.compile) on any mesh, one device included."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.cost.profile import MeshProfile  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.compile import JaxStep  # noqa: E402
from metadist_jax.engine import MeshMismatchError  # noqa: E402
from metadist_jax.plugin import JaxFrontend  # noqa: E402


def test_loading_the_plugin_imports_no_jax():
    code = (
        "import sys, metadist_jax.plugin as p; fe = p.metadist_frontend(); "
        "assert fe.name == 'jax' and fe.traits.op_prefixes == ('jax.lax.',); "
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resolve_mesh_prices_with_the_profile(devices8):
    fe = JaxFrontend()
    prof = MeshProfile(
        nodes=2,
        devices_per_node=4,
        levels={"intra": {"alpha": 1e-6, "beta": 1e-10}, "inter": {"alpha": 5e-5, "beta": 1e-9}},
    )
    resolved = fe.resolve_mesh((2, 4), prof)
    mesh = resolved.mesh
    assert mesh.shape == (2, 4) and mesh.alpha == (5e-5, 1e-6) and mesh.beta == (1e-9, 1e-10)
    assert resolved.engine.devices.shape == (2, 4)  # the jax.sharding.Mesh, resolved with it
    given = Mesh((8,), ("x",), alpha=3e-6)
    assert fe.resolve_mesh(given, prof).mesh is given
    with pytest.raises(MeshMismatchError, match="multiply to 8"):
        fe.resolve_mesh((3,), prof)


def _step(p, s, x):
    loss = jax.numpy.mean(jax.numpy.tanh(x @ p["w"]))
    return loss, {"w": p["w"] * 0.5}, s


def test_both_decorator_forms_give_a_jax_step():
    @metadist_compile
    def a(p, s, x):
        return _step(p, s, x)

    @metadist_compile(mesh=(2, 4))
    def b(p, s, x):
        return _step(p, s, x)

    assert isinstance(a, JaxStep) and isinstance(b, JaxStep) and b.mesh_arg == (2, 4)
    assert a.plan is None and a.jax_mesh is None
    with pytest.raises(RuntimeError, match="not been compiled"):
        a.partition_specs()


def test_a_one_device_mesh_runs_the_replicated_plan(devices8):
    one = jax.sharding.Mesh(np.asarray(jax.devices()[:1], dtype=object), ("x",))
    step = metadist_compile(_step, mesh=one)
    p = {"w": np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)}
    x = np.ones((2, 4), np.float32)
    loss, new_p, s = step(p, {}, x)
    want_loss, want_p, _ = jax.jit(_step)(p, {}, x)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new_p["w"]), np.asarray(want_p["w"]), rtol=1e-6)
    assert step.mesh.size == 1 and step.jax_mesh is one
    assert all(sh.is_fully_replicated() for sh in step.plan.input_shardings.values())
