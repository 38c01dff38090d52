"""JAX tests run on 8 virtual CPU devices: XLA_FLAGS is set here, before anything initializes a JAX backend."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import pytest  # noqa: E402

jax = pytest.importorskip("jax", reason="the JAX frontend tests need jax (pip install 'metadist[jax]')")


@pytest.fixture(scope="session")
def devices8():
    """The 8 CPU devices; skips when JAX came up with another count (a backend started before this conftest)."""
    n = jax.device_count()
    if n != 8:
        pytest.skip(
            f"these tests need 8 JAX devices, JAX has {n}: a backend was initialized before "
            f"tests/metadist_jax/conftest.py could set XLA_FLAGS={_FLAG}; run tests/metadist_jax alone"
        )
    return jax.devices()


@pytest.fixture(scope="session")
def rule_cache(tmp_path_factory):
    """One rule cache for the whole JAX test session, so meshes and tests share discovery."""
    return str(tmp_path_factory.mktemp("metadist-jax-rules"))
