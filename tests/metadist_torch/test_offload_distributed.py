"""offload="optimizer" under torchrun: 2 gloo ranks, the auto plan and the zero1 preset (optimizer state
sharded, then stored on the host), equal the single-device step; one lean launch (_offload_worker.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun

from _torchrun import launch  # noqa: E402


@pytest.mark.slow
def test_offload_on_2_gloo_ranks_matches_single_device(tmp_path):
    pytest.importorskip("torch")
    res = launch(
        Path(__file__).with_name("_offload_worker.py"),
        2,
        out=tmp_path / "out.json",
        METADIST_CACHE_DIR=str(tmp_path / "rules"),
        METADIST_MEASURE_LINKS="0",
    )
    assert not res["errors"], "\n".join(res["errors"])
    names = {r["name"] for r in res["report"]}
    assert names == {"auto", "zero1"}
    zero1 = next(r for r in res["report"] if r["name"] == "zero1")
    assert zero1["sharded_state"] > 0  # the preset shards the state: the host stores shards
