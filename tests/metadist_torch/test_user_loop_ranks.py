"""Users' training loops on 4 gloo ranks (worker: ``user_loop_worker.py``), each against the plain loop on
one device at rtol 1e-4, with ``strategy="fsdp"`` so that parameters and optimizer state are really split
and every re-plan moves them. CI runs the lean set (a schedule, a frozen layer, train/eval with an eval step
of its own, and ranks that disagree); the slow set adds the other loops of ``_user_loops.py``, transformers'
GPT-2 with a warm-up and clipping on the solver's own plan, and what deciding the program costs a call."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _user_loops as L  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
from _torchrun import launch  # noqa: E402

LEAN = ["warmup_cosine", "freeze", "train_eval", "divergent"]
REST = [n for n in L.LOOPS if n not in LEAN] + ["gpt2_warmup", "agree"]


def _run(tmp_path: Path, loops: list[str]) -> dict:
    got = launch(
        Path(__file__).parent / "user_loop_worker.py", 4, [str(tmp_path), *loops], out=tmp_path / "report.json"
    )
    assert not got["errors"], "\n".join(got["errors"])
    return got["report"]


@pytest.mark.slow
@pytest.mark.ci
def test_user_loops_on_4_ranks_lean(tmp_path):
    report = _run(tmp_path, LEAN)
    assert report["warmup_cosine"]["replans"] == 0
    assert report["freeze"]["replans"] == 2
    assert len(report["divergent"]) == 4  # every rank stopped with the error, none waited


@pytest.mark.slow
def test_user_loops_on_4_ranks_rest(tmp_path):
    report = _run(tmp_path, REST)
    for name in REST[:-2]:
        assert report[name]["replans"] == L.LOOPS[name].replans, (name, report[name])
    assert report["agree"]["decide_us"] > 0
