import os

# Tests never draw the progress bar and never touch the user's real cache.
os.environ.setdefault("METADIST_PROGRESS", "0")
# Plans must not change with this machine's load from run to run: tests price with the built-in link costs
# (tests of measuring itself turn it back on), and torchrun workers inherit this.
os.environ.setdefault("METADIST_MEASURE_LINKS", "0")


import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("METADIST_CACHE_DIR", str(tmp_path / "metadist-cache"))
    yield
