"""offload="optimizer" under torchrun: 2 gloo ranks, the auto plan and the zero1 preset (optimizer state
sharded, then stored on the host), equal the single-device step; one lean launch (_offload_worker.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_offload_on_2_gloo_ranks_matches_single_device(tmp_path):
    pytest.importorskip("torch")
    from metadist_torch.demo import torchrun_cmd
    from test_compile_distributed import run_torchrun
    out = tmp_path / "out.json"
    env = dict(os.environ, MD_TEST_OUT=str(out), METADIST_CACHE_DIR=str(tmp_path / "rules"), OMP_NUM_THREADS="1",
               METADIST_PROGRESS="0", PYTHONWARNINGS="ignore", METADIST_MEASURE_LINKS="0")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = run_torchrun(torchrun_cmd(Path(__file__).with_name("_offload_worker.py"), 2), env, out)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"torchrun with 2 ranks failed (exit {proc.returncode}):\n{tail}")
    res = json.loads(out.read_text())
    assert not res["errors"], "\n".join(res["errors"])
    names = {r["name"] for r in res["report"]}
    assert names == {"auto", "zero1"}
    zero1 = next(r for r in res["report"] if r["name"] == "zero1")
    assert zero1["sharded_state"] > 0   # the preset shards the state: the host stores shards
