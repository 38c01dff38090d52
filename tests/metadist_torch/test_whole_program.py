"""The user's program around the compiled step: the model called eagerly after training, on 4 gloo ranks
(worker: ``_whole_program_worker.py``) with nanoGPT's own model.py and transformers' GPT-2, and the eager
hooks' rules in one process (a one-rank group, DTensors on a mesh of one device)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
from _torchrun import launch  # noqa: E402

from metadist_torch.runtime import eager  # noqa: E402


@pytest.mark.slow
@pytest.mark.ci
def test_model_used_eagerly_after_training_on_4_ranks(tmp_path):
    got = launch(
        Path(__file__).with_name("_whole_program_worker.py"),
        4,
        [str(tmp_path / "out.json"), "nanogpt", "gpt2"],
        out=tmp_path / "out.json",
        METADIST_CACHE_DIR=str(tmp_path / "rules"),
    )
    assert not got["errors"], "\n".join(got["errors"])
    assert len(got["report"]["nanogpt"]["losses"]) == 4
    assert got["report"]["gpt2"]["eager_warm_s"] > 0


@pytest.fixture
def one_rank_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if made:
        dist.destroy_process_group()


def _as_dtensors(model: torch.nn.Module, mesh) -> None:
    """Every parameter and buffer of ``model`` as a DTensor, as a distributed compile stores them (tied
    parameters stay one object)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    done: dict[int, torch.nn.Parameter] = {}
    for m in model.modules():
        for k, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]), p.requires_grad)
            m._parameters[k] = done[id(p)]
        for k, b in list(m._buffers.items()):
            if b is not None and b.dim():
                m._buffers[k] = distribute_tensor(b, mesh, [Shard(0)])
    eager.attach([model])


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def test_eager_call_gives_plain_tensors_and_one_device_numbers(one_rank_mesh):
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model, ref = Tied(), None
    ref = copy.deepcopy(model)
    _as_dtensors(model, one_rank_mesh)
    ids = torch.randint(0, 10, (6,))
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, want = model(ids), ref(ids)
    assert not isinstance(out, DTensor) and torch.equal(out, want)
    assert isinstance(model.emb.weight, DTensor) and model.head.weight is model.emb.weight  # swapped back, tied
    with torch.no_grad():  # a submodule called on its own gathers its own tensors
        assert torch.equal(model.emb(ids), ref.emb(ids))


def test_eager_train_mode_writes_running_stats_back(one_rank_mesh):
    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    _as_dtensors(model, one_rank_mesh)
    ids = torch.randint(0, 10, (6,))
    with torch.no_grad():
        model(ids)
        ref(ids)
    assert torch.equal(model.norm.running_mean.full_tensor(), ref.norm.running_mean)
    with torch.no_grad():  # the kept whole tensor was refreshed with it: a second call sees the new stats
        model(ids)
        ref(ids)
    assert torch.equal(model.norm.running_var.full_tensor(), ref.norm.running_var)


def test_eager_call_that_raises_leaves_the_dtensors(one_rank_mesh):
    from torch.distributed.tensor import DTensor

    model = Tied()
    _as_dtensors(model, one_rank_mesh)
    with pytest.raises(IndexError):
        model(torch.tensor([99]))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    with torch.no_grad():  # and the next call works
        model.eval()(torch.tensor([1, 2]))


def test_hooks_stand_aside_in_a_compiled_call(one_rank_mesh):
    from torch.distributed.tensor import DTensor

    model = Tied()
    _as_dtensors(model, one_rank_mesh)
    seen = []
    model.emb.register_forward_pre_hook(lambda m, a: seen.append(isinstance(m.weight, DTensor)))
    with eager.compiled_call():  # no swap inside a compiled call (the step's own trace and program run there)
        try:
            model.eval()(torch.tensor([1, 2]))
        except RuntimeError:
            pass
    with torch.no_grad():
        model(torch.tensor([1, 2]))
    assert seen == [True, False]
