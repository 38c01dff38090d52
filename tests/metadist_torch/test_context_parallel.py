"""Context parallelism planned and run: the sequence split inside causal attention, as the planner's strategy.

Without ranks: the cp presets pin causal attention to its distributed implementation on the last mesh axis
(forward and backward), and the planner prices it; an attention the implementation cannot serve (a mask) is
never given that strategy. On 4 gloo ranks (one launch; this file is also the worker): the GPT example with
``strategy="cp"`` on (4,) in float32 and float64 and ``"fsdp+cp"`` on (2, 2) in float64, and a LLaMA with
grouped-query attention with ``"cp"`` on (4,), each step equal to the single-device step (loss, parameters,
optimizer state over 3 steps; float64 to 1e-9) with the attention split on the sequence, and transformers'
GPT-2 with ``"cp"`` on (2, 2) (batch on axis 0, sequence on axis 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _torchrun
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/metadist_torch/: _examples, _compare
STEPS = 3
RTOL = 1e-4
FWD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BWD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def _attention_impls(plan, graph) -> dict[str, tuple]:
    return {op.id: plan.strategies[op.id].impls for op in graph.ops if op.key in (FWD, BWD)}


# -- without ranks ----------------------------------------------------------------------------------------


def _plan(strategy: str, mesh_shape, cfg_kw=None, dropout=0.0):
    torch = pytest.importorskip("torch")
    from metadist_core.config import load_settings
    from metadist_core.driver.compile import plan_graph
    from metadist_core.ir.mesh import Mesh
    from _examples import load_example
    from metadist_torch.plugin import TorchFrontend

    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(vocab=64, seq=16, width=32, heads=4, layers=2, batch=4, dropout=dropout, **(cfg_kw or {}))
    torch.manual_seed(0)
    model, opt = gpt.build(cfg)
    fe = TorchFrontend()
    g = fe.trace(gpt.train_step, (model, opt, *gpt.batch(cfg, 0)), {}).graph
    nd = len(mesh_shape)
    mesh = Mesh(mesh_shape, alpha=[2e-4] * nd, beta=[1e-9] * nd)
    settings = load_settings(progress=False, strategy=strategy)
    return g, plan_graph(g, mesh, settings=settings, constraints=fe.constraints(g, mesh), traits=fe.traits)


def test_the_cp_preset_runs_every_causal_attention_split_on_the_last_axis():
    g, res = _plan("cp", (2, 2))
    impls = _attention_impls(res.plan, g)
    assert len(impls) == 4, impls  # 2 layers, forward and backward
    for op_id, names in impls.items():
        assert names[0] == "" and names[1].startswith("cp_attention.allgather"), (op_id, names)
        assert names[1].endswith(".backward") == op_id.startswith(
            "_scaled_dot_product_flash_attention_for_cpu_backward"
        )
    for op in g.ops:
        if op.key in (FWD, BWD):
            for sh in res.plan.strategies[op.id].inputs:
                assert str(sh[1]) == "S(2)", (op.id, sh)  # q, k, v (and dout, out, lse) split on the sequence
    tokens = [v for v in g.inputs if g.vars[v].role == "input"]
    assert tokens and all(str(res.plan.input_shardings[v]) == "[S(0), S(1)]" for v in tokens)
    # the same problem unsteered: causal attention may run split, and is priced with its gathers
    auto = res.problem.unsteered
    for i, n in enumerate(auto.nodes):
        if n.kind == "op" and n.key in (FWD, BWD):
            with_impl = [j for j, o in enumerate(n.options) if o.impls]
            assert with_impl, n.id
            plain = [j for j, o in enumerate(n.options) if not o.impls]
            # an implementation's option pays its collectives: dearer than the plain op split by heads
            assert min(auto.compute[i][j] for j in with_impl) > min(auto.compute[i][j] for j in plain)
            # and holds the K/V it gathers while the op runs, in the memory terms; the plain options nothing
            pos, held = auto.workspace[i]
            assert all(held[j] > 0 for j in with_impl) and not any(held[j] for j in plain)
            assert g.ops[pos].id == n.id
    from metadist_core.problem.problem import ShardingProblem

    again = ShardingProblem.from_json(auto.to_json())
    assert again.workspace.keys() == auto.workspace.keys()
    terms = again.terms()
    assert len(terms.mem) == len(auto.terms().mem)


def test_fsdp_cp_splits_the_parameters_too_and_plan_json_keeps_the_implementation():
    from metadist_core.plan.plan import ShardingPlan

    g, res = _plan("fsdp+cp", (2, 2))
    params = [v for v in g.inputs if g.vars[v].role == "parameter" and g.vars[v].shape[0] % 4 == 0]
    assert params and all(str(res.plan.input_shardings[v]) == "[S(0), S(0)]" for v in params)
    again = ShardingPlan.from_json(res.plan.to_json())
    assert _attention_impls(again, g) == _attention_impls(res.plan, g)
    assert "context-parallel" in res.plan.explain() or "cp_attention" in res.plan.explain()


def test_a_masked_attention_keeps_its_sequence_whole_and_says_why(caplog):
    """An explicit mask (padding, documents) is not plain causal attention: the implementation refuses it,
    so the cp preset cannot split that attention; the plan keeps its sequence whole there and says why."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from metadist_core.config import load_settings
    from metadist_core.driver.compile import plan_graph
    from metadist_core.ir.mesh import Mesh
    from metadist_torch.plugin import TorchFrontend

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.head = torch.nn.Linear(16, 48), torch.nn.Linear(16, 8)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.head(a.transpose(1, 2).reshape(b, s, 16)).square().mean()

    def step(model, opt, x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fe = TorchFrontend()
    g = fe.trace(step, (model, opt, torch.randn(2, 8, 16)), {}).graph
    mesh = Mesh((2,), alpha=[2e-4], beta=[1e-9])
    with caplog.at_level("WARNING", logger="metadist.presets"):
        res = plan_graph(
            g,
            mesh,
            settings=load_settings(progress=False, strategy="cp"),
            constraints=fe.constraints(g, mesh),
            traits=fe.traits,
        )
    attention = [op.id for op in g.ops if op.key in (FWD, BWD)]
    assert attention, sorted({op.key for op in g.ops})
    refused = res.problem.unsteered.impl_refusals
    assert set(attention) <= set(refused) and all("attn_mask" in refused[o] for o in attention), refused
    assert not any(res.plan.strategies[o].impls for o in attention)
    assert any("keep their sequence whole" in r.getMessage() and "attn_mask" in r.getMessage() for r in caplog.records)


# -- on 4 gloo ranks ---------------------------------------------------------------------------------------

# float32 parameters and state are compared at 1e-3 of each one's largest element: the split attention sums
# its blocks in another order, and AdamW's update m / (sqrt(v) + eps) of an element whose gradient is near
# zero turns that rounding into up to 5e-5 of a 0.1-sized weight after 3 steps; in float64 the same plans
# agree to 1e-9, which a wrong split never does
F32_STATE_RTOL = 1e-3


def _split_attention(name, step, errors, report):
    plan, graph = step.plan, step.graph
    impls = _attention_impls(plan, graph)
    if not impls or not all(any(n.startswith("cp_attention") for n in names) for names in impls.values()):
        errors.append(f"{name}: attention not split on the sequence: {impls}")
    stats = getattr(step, "stats", None)
    report.append(
        {"name": name, "impls": sorted({n for names in impls.values() for n in names if n}), "stats": str(stats)}
    )


def worker() -> int:

    import torch

    from _compare import compare_steps
    from _examples import load_example
    from metadist_torch import metadist_compile

    torch.set_num_threads(1)
    gpt = load_example("gpt")
    errors: list[str] = []
    report: list[dict] = []
    cfg = gpt.GPTConfig(vocab=96, seq=16, width=32, heads=4, layers=2, batch=4)
    gpt_batches = [gpt.batch(cfg, s) for s in range(STEPS)]

    def build64():
        model, opt = gpt.build(cfg)
        return model.double(), opt

    for name, mesh, strategy, build, tols in (
        ("gpt-cp@4", (4,), "cp", lambda: gpt.build(cfg), (RTOL, F32_STATE_RTOL)),
        ("gpt-float64-cp@4", (4,), "cp", build64, (1e-9, 1e-9)),
        ("gpt-float64-fsdp+cp@2x2", (2, 2), "fsdp+cp", build64, (1e-9, 1e-9)),
    ):
        step = metadist_compile(mesh=mesh, strategy=strategy)(gpt.train_step)
        try:
            compare_steps(name, build, gpt_batches, gpt.train_step, step, errors, *tols)
            _split_attention(name, step, errors, report)
        except Exception as e:  # pragma: no cover - reported by the test
            import traceback

            errors.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:  # LLaMA: rotary positions and grouped-query attention (2 K/V heads for 4 query heads)
        from benchmarks._models import adamw, llama, lm_step

        def build():
            torch.manual_seed(0)
            m = llama(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
            )
            return m, adamw(m, 1e-3)

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, 64, (2, 16), generator=g),) for _ in range(STEPS)]
        step = metadist_compile(mesh=(4,), strategy="cp")(lm_step)
        compare_steps("llama-gqa-cp@4", build, batches, lm_step, step, errors, RTOL, F32_STATE_RTOL)
        _split_attention("llama-gqa-cp@4", step, errors, report)
    except Exception as e:  # pragma: no cover - reported by the test
        import traceback

        errors.append(f"llama: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:  # transformers' GPT-2: learned positions, its own attention module calling SDPA with is_causal=True
        from benchmarks._models import gpt2

        def build_gpt2():
            torch.manual_seed(0)
            m = gpt2(n_positions=16, n_layer=2, n_embd=32, n_head=4, vocab_size=64)
            return m, adamw(m, 1e-3)

        g = torch.Generator().manual_seed(2)
        batches = [(torch.randint(0, 64, (2, 16), generator=g),) for _ in range(STEPS)]
        step = metadist_compile(mesh=(2, 2), strategy="cp")(lm_step)
        compare_steps("gpt2-cp@2x2", build_gpt2, batches, lm_step, step, errors, RTOL, F32_STATE_RTOL)
        _split_attention("gpt2-cp@2x2", step, errors, report)
    except Exception as e:  # pragma: no cover - reported by the test
        import traceback

        errors.append(f"gpt2: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    from _torchrun import write_results

    write_results(errors, report)
    return 0


@pytest.mark.slow
@pytest.mark.ci
def test_context_parallel_steps_equal_one_device_on_4_gloo_ranks(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _torchrun import launch

    res = launch(__file__, 4, ["--worker"], out=tmp_path / "out.json", METADIST_CACHE_DIR=str(tmp_path / "rules"))
    assert not res["errors"], "\n".join(res["errors"])
    names = {r["name"] for r in res["report"]}
    want = {"gpt-cp@4", "gpt-float64-cp@4", "gpt-float64-fsdp+cp@2x2", "llama-gqa-cp@4", "gpt2-cp@2x2"}
    assert names == want, res["report"]


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.exit(worker())
