"""Two processes under torchrun: TVM kernels per rank, collectives on torch.distributed (gloo) through
DLPack; a dense-relu-dense-softmax graph (forced tensor parallel, a forced all_reduce, and random plans
exercising every collective kind), a conv-relu-pool graph and a plain tvm.topi / te.compute graph (no wrappers)
match numpy on both ranks."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
from _torchrun import run_torchrun, torchrun_env  # noqa: E402

WORKER = Path(__file__).with_name("_dist_worker.py")


def test_two_processes_match_numpy(tmp_path):
    pytest.importorskip("torch.distributed")
    env = torchrun_env(METADIST_CACHE_DIR=str(tmp_path / "cache"), METADIST_TEST_OUT=str(tmp_path))
    out = run_torchrun(WORKER, 2, env=env, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text().strip() for r in range(2)]
    assert [ln.split()[1] for ln in lines] == ["0/2", "1/2"], lines
    assert all(" OK " in ln for ln in lines), "\n".join(lines)
    kinds = set(lines[0].split("collectives ")[1].split(","))
    assert {"all_gather", "all_reduce"} <= kinds, lines[0]
