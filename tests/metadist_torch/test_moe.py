"""Mixture-of-experts models as transformers writes them: the capacity-padded dispatch against the library's own
experts, the rules ShardCombine finds for its ops checked on routings discovery never drew, a compiled step
against the eager one, the ep preset's plan, and (on 4 gloo ranks) expert parallelism against one device."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _moe_models import autocast_step, batch, lm_step, mixtral, one_expert, optimizer, qwen_moe  # noqa: E402
from benchmarks.moe import routes  # noqa: E402
from metadist_core.config import load_settings  # noqa: E402
from metadist_core.driver.compile import plan_graph  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_core.ir.placement import Partial, Replicate, Shard  # noqa: E402
from metadist_core.plan.explain import explain_plan  # noqa: E402
from metadist_torch import metadist_compile, rules_for  # noqa: E402
from metadist_torch.moe.moe import (  # noqa: E402
    capacity_dispatch,
    capacity_experts_forward,
    dropped_tokens,
    experts_modules,
)
from metadist_torch.plugin import TorchFrontend  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUILDERS = {"mixtral": mixtral, "qwen_moe": qwen_moe}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("routing", ["learned", "one_expert"])
@pytest.mark.parametrize("mesh", [(1,), (2, 2), (3,)])
def test_capacity_dispatch_is_the_libraries_own_layer(name, routing, mesh, impl):
    """Forward and every gradient equal those of each of transformers' experts implementations (grouped matmul,
    the loop over the experts hit, batched matmul), for every grouping of the tokens, also when every token goes
    to one expert and the others get none; (3,) does not divide 128 tokens into 3 groups, so they fall back to 2."""
    model = BUILDERS[name](top_k=1 if routing == "one_expert" else 2)
    model.config._experts_implementation = impl
    if routing == "one_expert":
        one_expert(model)
        assert all(len(r.unique()) == 1 for r in routes(model, batch(0)))
    ids = batch(0)
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    want = _grads(model)
    model.zero_grad()
    with capacity_dispatch([m for _, m in experts_modules([model])], mesh):
        got = model(input_ids=ids, labels=ids)
        got.loss.backward()
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-6)
    grads = _grads(model)
    assert grads.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(grads[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    assert type(experts_modules([model])[0][1]).forward is not None and "forward" not in vars(
        experts_modules([model])[0][1]
    ), "the module's own forward is back after the trace"


def _dropping_reference(experts, x, idx, w, groups, cap):
    """GShard's dropping by hand: per group, every token's first choice before any second choice, in token
    order; a choice past its expert's ``cap`` slots is dropped."""
    out = torch.zeros_like(x)
    tg = x.shape[0] // groups
    for g in range(groups):
        used = [0] * experts.num_experts
        for j in range(idx.shape[1]):
            for t in range(g * tg, (g + 1) * tg):
                e = int(idx[t, j])
                if used[e] >= cap:
                    continue
                used[e] += 1
                gate, up = torch.nn.functional.linear(x[t], experts.gate_up_proj[e]).chunk(2, dim=-1)
                h = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
                out[t] += w[t, j] * h
    return out


def test_a_capacity_factor_drops_what_gshard_drops():
    experts = experts_modules([mixtral()])[0][1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=gen)
    first = torch.zeros(16, dtype=torch.long)
    first[:5] = 3  # skewed: expert 0 is every later token's first choice, expert 3 the first five tokens'
    idx = torch.stack([first, (first + torch.randint(1, 4, (16,), generator=gen)) % 4], dim=1)  # two distinct
    w = torch.rand(16, 2, generator=gen)
    with torch.no_grad():
        for factor, mesh in [(1.0, (2,)), (0.5, (1,)), (2.0, (4,))]:
            tg = 16 // mesh[0]
            cap = max(1, min(tg, math.ceil(factor * 2 * tg / 4)))
            got = capacity_experts_forward(experts, x, idx, w, mesh_shape=mesh, capacity_factor=factor)
            want = _dropping_reference(experts, x, idx, w, mesh[0], cap)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            dropped = dropped_tokens(idx, 4, mesh, factor)
            assert dropped > 0 if factor <= 1 else dropped == 0, (factor, dropped)  # 2.0: a group's worth of slots
        none = capacity_experts_forward(experts, x, idx, w, mesh_shape=(4,), capacity_factor=None)
        torch.testing.assert_close(none, _dropping_reference(experts, x, idx, w, 4, 4), rtol=1e-5, atol=1e-6)
    assert dropped_tokens(idx, 4, (4,), None) == 0


# -- rules ------------------------------------------------------------------------------------------------------


def _run_split(fn, rule, inputs, n=2):
    """``fn`` run on ``n`` pieces of ``inputs`` as ``rule`` cuts them, its output put back together as the rule
    says (Shard: concatenated, Partial(sum): summed, Replicate: every piece's must agree)."""

    gen = torch.Generator().manual_seed(7)
    shares = [torch.rand(x.shape, generator=gen, dtype=torch.float64) + 0.1 for x in inputs]

    def piece(k, x, p, i):
        if p.is_shard():
            return x.chunk(n, dim=p.dim)[i]
        if p.is_partial():  # uneven random shares: summing (sum) or averaging (avg) them gives ``x``
            part = x * (shares[k] * (i + 1) / sum(shares[k] * (j + 1) for j in range(n)))
            return part * n if p.reduce == "avg" else part
        return x

    outs = [fn(*[piece(k, x, p, i) for k, (x, p) in enumerate(zip(inputs, rule.inputs))]) for i in range(n)]
    p = rule.outputs[0]
    if p.is_shard():
        return torch.cat(outs, dim=p.dim)
    if p.is_partial():
        return sum(outs) if p.reduce == "sum" else sum(outs) / n
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0])
    return outs[0]


def _routings(groups=2, tg=8, e=4, k=2):
    """Dispatch and combine tensors ``[G, Tg, E, C]`` for routings discovery never draws: every token to expert
    0 (and 1), experts 2 and 3 with none; and one expert taking every token's first choice."""
    experts = experts_modules([mixtral(experts=e, top_k=k)])[0][1]
    out = []
    for idx in (
        torch.tensor([[0, 1]] * (groups * tg)),
        torch.stack([torch.full((groups * tg,), 3), torch.arange(groups * tg) % 3], dim=1),
    ):
        x = torch.randn(groups * tg, experts.hidden_dim)
        w = torch.rand(groups * tg, k)
        chosen = idx.reshape(groups, tg, k, 1) == torch.arange(e)
        slot_major = chosen.transpose(1, 2).reshape(groups, k * tg, e).to(torch.int32)
        pos = torch.cumsum(slot_major, dim=1) - 1
        placed = ((pos.unsqueeze(-1) == torch.arange(tg)) & slot_major.bool().unsqueeze(-1)).reshape(
            groups, k, tg, e, tg
        )
        dispatch = placed.any(dim=1).double()
        combine = torch.einsum("gktec,gtk->gtec", placed.double(), w.double().reshape(groups, tg, k))
        out.append((x.double().reshape(groups, tg, -1), dispatch, combine, experts, slot_major))
    return out


def test_shardcombine_finds_the_expert_rules_and_they_hold_on_skewed_routings():
    """The dispatch's, the experts' and the combine's rules as discovery finds them (on its own draws), then run
    split on routings it never drew, against the whole op."""
    gen = torch.Generator().manual_seed(0)
    d0 = (torch.rand(2, 8, 4, 8, generator=gen) > 0.7).double()
    dispatch = lambda d, x: torch.einsum("gtec,gth->gech", d, x)  # noqa: E731
    experts_mm = lambda x, w: torch.einsum("geci,eoi->geco", x, w)  # noqa: E731
    combine = lambda c, y: torch.einsum("gtec,gech->gth", c, y)  # noqa: E731
    cumsum = lambda s: torch.cumsum(s, dim=1)  # noqa: E731
    found = {
        "dispatch": rules_for(dispatch, d0, torch.randn(2, 8, 6, generator=gen)),
        "experts": rules_for(experts_mm, torch.randn(2, 4, 8, 6, generator=gen), torch.randn(4, 10, 6, generator=gen)),
        "combine": rules_for(combine, d0, torch.randn(2, 4, 8, 6, generator=gen)),
        "cumsum": rules_for(cumsum, (torch.rand(2, 16, 4, generator=gen) > 0.5).to(torch.int32)),
    }
    rules = {k: {(r.inputs, r.outputs) for r in v} for k, v in found.items()}
    R, S, P = Replicate(), Shard, Partial("sum")
    # tokens grouped by expert: a dispatch split by expert gives the experts' tokens split by expert
    assert ((S(2), R), (S(1),)) in rules["dispatch"]
    assert ((S(0), S(0)), (S(0),)) in rules["dispatch"]  # a group per device: data parallel
    assert ((S(1), S(0)), (S(1),)) in rules["experts"]  # expert weights split on the expert dim
    assert ((S(2), S(1)), (P,)) in rules["combine"]  # each device's experts' share of every token
    assert ((S(0),), (S(0),)) in rules["cumsum"] and ((S(1),), (S(1),)) not in rules["cumsum"]
    checked = 0
    for x, d, c, experts, slot_major in _routings():
        w = experts.gate_up_proj.detach().double()
        y = experts_mm(dispatch(d, x), w)
        cases = [(dispatch, found["dispatch"], [d, x]), (experts_mm, found["experts"], [dispatch(d, x), w])]
        cases += [(combine, found["combine"], [c, y]), (cumsum, found["cumsum"], [slot_major])]
        for fn, rs, inputs in cases:
            whole = fn(*inputs)
            for r in rs:
                if all(p.is_replicate() for p in r.inputs):
                    continue
                torch.testing.assert_close(_run_split(fn, r, inputs).to(whole.dtype), whole, msg=f"{r}")
                checked += 1
    assert checked > 20


def test_experts_ffn_rules_hold_with_one_expert_full_and_others_empty():
    """The experts op's rules as discovery finds them, then run split where one expert's slots are all filled
    and the others' empty, and against the padded batched matmuls it stands for."""
    gen = torch.Generator().manual_seed(1)
    ffn = torch.ops.metadist.experts_ffn.default
    bwd = torch.ops.metadist.experts_ffn_backward.default
    x, gu, down = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(4, 10, 8, generator=gen), torch.randn(4, 8, 5)
    counts = torch.randint(0, 7, (2, 4), generator=gen)
    fwd_rules = rules_for(ffn, x, counts, gu, down, "silu", 0.5)
    bwd_rules = rules_for(bwd, torch.randn(2, 4, 6, 8, generator=gen), x, counts, gu, down, "silu", 0.5)
    R, S = Replicate(), Shard
    assert any(r.inputs == (S(1), S(1), S(0), S(0)) and r.outputs == (S(1),) for r in fwd_rules)  # by expert
    assert any(r.inputs == (S(0), S(0), R, R) and r.outputs == (S(0),) for r in fwd_rules)  # by group
    assert not any(r.inputs[0] == S(2) for r in fwd_rules), "slots must not split: counts say which are filled"
    P = Partial("sum")
    assert any(r.inputs[:3] == (S(1),) * 3 and r.outputs == (S(1), S(0), S(0)) for r in bwd_rules)
    assert any(r.inputs[:3] == (S(0),) * 3 and r.outputs == (S(0), P, P) for r in bwd_rules)
    full = torch.tensor([[6, 0, 0, 0], [0, 0, 0, 6]])  # every slot of one expert filled, the others empty
    x = x * (torch.arange(6)[None, None, :, None] < full[..., None, None])  # empty slots hold zeros
    gu, down = gu.double(), down.double()
    x = x.double()
    padded_h = torch.einsum("geci,eoi->geco", x, gu)
    gate, up = padded_h.chunk(2, dim=-1)
    padded = torch.einsum("geci,eoi->geco", torch.nn.functional.silu(gate) * up, down)
    padded = padded * (torch.arange(6)[None, None, :, None] < full[..., None, None])
    fn = lambda x, c, a, b: ffn(x, c, a, b, "silu", 0.5)  # noqa: E731
    torch.testing.assert_close(fn(x, full, gu, down), padded)
    inputs = [x, full, gu, down]
    for r in fwd_rules:
        if not all(p.is_replicate() for p in r.inputs):
            torch.testing.assert_close(_run_split(fn, r, inputs), padded, msg=str(r))


# -- compiled steps --------------------------------------------------------------------------------------------


def test_mixtral_step_compiles_at_world_size_1_with_the_eager_numbers(tmp_path):
    ref, model = mixtral(), mixtral()
    o_ref, opt = optimizer(ref), optimizer(model)
    step = metadist_compile(cache_dir=str(tmp_path))(lm_step)
    for s in range(3):
        want = lm_step(ref, o_ref, batch(s))
        got = step(model, opt, batch(s))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5, msg=n)
    keys = {op.key for op in step.graph.ops}
    assert not any("nonzero" in k or "grouped_mm" in k or "index_add" in k for k in keys), sorted(keys)
    experts = {step.graph.vars[v].label: step.graph.vars[v].experts for v in step.graph.inputs}
    assert experts["model.layers.0.mlp.experts.gate_up_proj"] == 4
    assert experts["model.layers.1.mlp.experts.down_proj"] == 4
    assert experts["model.layers.0.mlp.gate.weight"] is None


class _HandMoE(torch.nn.Module):
    """A user's own top-2 layer: every expert on every token, weighted by a sparse routing (topk, scatter,
    one_hot), no transformers module."""

    def __init__(self, h: int = 32, e: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(h, e, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(e, h, 64) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(e, 64, h) * 0.1)
        self.e = e

    def forward(self, x):
        p = torch.softmax(self.router(x), -1)
        v, i = torch.topk(p, 2, -1)
        gates = torch.zeros_like(p).scatter(-1, i, v) * torch.nn.functional.one_hot(i, self.e).sum(-2)
        y = torch.einsum("etf,efh->eth", torch.einsum("th,ehf->etf", x, self.w1).relu(), self.w2)
        return torch.einsum("te,eth->th", gates, y)


def test_a_hand_written_static_moe_layer_traces_as_any_model(tmp_path):
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), _HandMoE(), torch.nn.Linear(32, 8))

    def step(model, opt, x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ref, model = build(), build()
    o_ref, opt = optimizer(ref), optimizer(model)
    compiled = metadist_compile(cache_dir=str(tmp_path))(step)
    for s in range(3):
        gen = torch.Generator().manual_seed(s)
        x, y = torch.randn(64, 16, generator=gen), torch.randint(0, 8, (64,), generator=gen)
        torch.testing.assert_close(compiled(model, opt, x, y), step(ref, o_ref, x, y), rtol=1e-4, atol=0)


def test_router_aux_loss_and_jitter_noise_at_world_size_1(tmp_path):
    """The load-balancing loss (``output_router_logits``) and the router's jitter noise (random, seeded as the
    eager step is) trace and give the eager numbers."""
    ref, model = mixtral(), mixtral()
    for m in (ref, model):
        m.config.output_router_logits = True
        for mod in m.modules():
            if hasattr(mod, "jitter_noise"):
                mod.jitter_noise = 0.1
    o_ref, opt = optimizer(ref), optimizer(model)
    step = metadist_compile(cache_dir=str(tmp_path))(lm_step)
    for s in range(2):
        torch.manual_seed(s)
        got = step(model, opt, batch(s))
        torch.manual_seed(s)
        torch.testing.assert_close(got, lm_step(ref, o_ref, batch(s)), rtol=1e-4, atol=0)


def test_bf16_weights_take_no_grouped_matmul_path_when_traced(tmp_path):
    """bf16 weights, where transformers' grouped matmul runs eagerly on the CPU: the trace takes the dispatch."""
    ref, model = mixtral().to(torch.bfloat16), mixtral().to(torch.bfloat16)
    assert model.config._experts_implementation == "grouped_mm"
    o_ref, opt = optimizer(ref, "sgd"), optimizer(model, "sgd")
    step = metadist_compile(cache_dir=str(tmp_path))(lm_step)
    for s in range(3):
        torch.testing.assert_close(step(model, opt, batch(s)), lm_step(ref, o_ref, batch(s)), rtol=2e-2, atol=0)
    assert not any("grouped_mm" in op.key for op in step.graph.ops)


def test_bf16_autocast_moe_step_at_world_size_1(tmp_path):
    ref, model = qwen_moe(), qwen_moe()
    o_ref, opt = optimizer(ref, "sgd"), optimizer(model, "sgd")
    step = metadist_compile(cache_dir=str(tmp_path))(autocast_step)
    for s in range(3):
        torch.testing.assert_close(step(model, opt, batch(s)), autocast_step(ref, o_ref, batch(s)), rtol=2e-2, atol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3, msg=n)
    assert "bfloat16" in {v.dtype for v in step.graph.vars.values()}


def _ep_plan(capacity_factor=None):
    model = mixtral(hidden=128, experts=4)
    fe = TorchFrontend()
    fe.mesh_shape = (4,)
    fe.moe_capacity_factor = capacity_factor
    ids = torch.randint(0, 128, (16, 32))
    g = fe.trace(lm_step, (model, optimizer(model), ids), {}).graph
    mesh = Mesh((4,), alpha=[2e-5], beta=[1e-10])
    settings = load_settings(progress=False, strategy="ep")
    res = plan_graph(g, mesh, settings=settings, constraints=fe.constraints(g, mesh), traits=fe.traits)
    by = {g.vars[v].label: res.plan.input_shardings[v] for v in g.inputs if g.vars[v].role == "parameter"}
    for i in range(2):
        for w in ("gate_up_proj", "down_proj"):
            assert tuple(by[f"model.layers.{i}.mlp.experts.{w}"]) == (Shard(0),)
        assert tuple(by[f"model.layers.{i}.self_attn.q_proj.weight"]) == (Replicate(),)
    text = explain_plan(res.plan, presets=False, problem=res.problem)
    assert (
        "model.layers.0.mlp.experts.gate_up_proj (4 experts, [S(0)]): expert 0 on rank 0; expert 1 on rank 1; "
        "expert 2 on rank 2; expert 3 on rank 3"
    ) in text, text
    return g, res


def test_ep_preset_runs_every_dropless_layer_expert_parallel_on_axis_0():
    """The tokens travel inside the layer's op (moe.ep, forward and backward), so the plan itself moves none by
    all_to_all, and no tensor of tokens x experts exists anywhere in the step."""
    g, res = _ep_plan()
    layers = [o for o in g.ops if o.key.startswith("metadist.moe_dropless")]
    assert len(layers) == 4, [o.key for o in layers]  # 2 layers, forward and backward
    for op in layers:
        assert res.plan.strategies[op.id].impl_axis()[0] == 0, (op.id, res.plan.strategies[op.id].impls)
        assert res.plan.strategies[op.id].impl_axis()[1].startswith("moe.ep")
    assert not [c for _, c in res.plan.collectives() if c.kind == "all_to_all"], res.plan.summary()
    tokens, experts = 16 * 32, 4
    assert max(v.numel for v in g.vars.values() if v.shape is not None) < tokens * experts * 128


def test_a_capacity_factor_keeps_the_padded_dispatch_whose_tokens_the_plan_moves_by_all_to_all():
    g, res = _ep_plan(capacity_factor=2.0)
    assert not any(o.key.startswith("metadist.moe_dropless") for o in g.ops)
    a2a = [c for _, c in res.plan.collectives() if c.kind == "all_to_all"]
    assert a2a, res.plan.summary()
    # the dispatch's all_to_all moves one device's slots grouped by expert: [1 group, 4 experts, C, 128] with
    # C = ceil(2.0 * top-2 * 128 tokens / 4 experts) = 128
    assert 1 * 4 * 128 * 128 * 4 in {c.nbytes for c in a2a}, {c.nbytes for c in a2a}


def test_plan_the_mixtral_example_for_a_mesh_this_machine_has_not(tmp_path, capsys):
    """`metadist plan` traces the tokens in a group per device of the mesh asked, not of this one process."""
    from metadist_core.driver import cli
    from metadist_core.plan.plan import ShardingPlan

    out = tmp_path / "mixtral.plan.json"
    script = str(REPO / "examples/torch/mixtral_hf.py")
    argv = ["plan", script, "--mesh", "4", "--out", str(out), "--cache-dir", str(tmp_path / "rules")]
    assert cli.main(argv + ["--", "--strategy", "ep", "--steps", "1"]) == 0
    plan = ShardingPlan.from_json(__import__("json").loads(out.read_text()))
    experts = [v for v, name in plan.labels.items() if ".mlp.experts." in name]
    assert experts and all(tuple(plan.input_shardings[v]) == (Shard(0),) for v in experts)
    ep = [s.impls for s in plan.strategies.values() if any(i.startswith("moe.ep") for i in s.impls)]
    assert len(ep) == 4, "the tokens must reach their experts: every layer's op, forward and backward, runs moe.ep"
    assert "planned on mesh 4" in capsys.readouterr().out


def test_unknown_capacity_factor_is_refused():
    with pytest.raises(ValueError, match="moe_capacity_factor must be"):
        metadist_compile(moe_capacity_factor=0)(lm_step)


# -- 4 gloo ranks ------------------------------------------------------------------------------------------


def _launch(tmp_path, cases):
    sys.path.insert(0, str(REPO / "tests"))
    from _torchrun import launch

    return launch(
        Path(__file__).with_name("_moe_worker.py"),
        4,
        cases,
        out=tmp_path / "moe.json",
        METADIST_CACHE_DIR=str(tmp_path / "cache"),
    )


def _check(res):
    for name, r in res.items():
        assert not r["errors"], (name, r["errors"])


@pytest.mark.slow
@pytest.mark.ci
def test_dropless_expert_parallelism_on_4_ranks_has_one_devices_numbers(tmp_path):
    """ep with the dropless layer: Mixtral on (4,), every expert on its own rank; every token to one expert
    (the other ranks' experts get none, and every rank still issues the same collectives); a toy Qwen3-MoE
    (32 experts, top-8) under expert x data parallelism on (2, 2) with SGD, so the experts' gradients are
    checked as they are. The all_to_all bytes counted are those the plan's shapes give."""
    res = _launch(tmp_path, ["mixtral_ep", "one_expert_ep", "qwen3_ep_2x2"])
    _check(res)
    for name, r in res.items():
        assert r["a2a_counted"] == r["a2a_predicted"] > 0, (name, r)
        assert r["impls"] == ["moe.ep", "moe.ep.backward"], (name, r["impls"])
        assert r["a2a_calls"] == 2 * 2 * 3, (name, r["a2a_calls"])  # 2 layers, forward and backward, 3 each


@pytest.mark.slow
def test_moe_models_on_4_ranks_have_one_devices_numbers(tmp_path):
    """The planner's own choice for Mixtral on (2, 2), Qwen2-MoE and Qwen3-MoE on (4,), Qwen2-MoE under ep on
    (2, 2), a small DeepSeek-V3 (latent attention, grouped routing, a shared expert) under ep, bf16 autocast,
    and the capacity-padded dispatch (a capacity factor set), each over 3 steps against the single-device step."""
    cases = ["mixtral_auto_2x2", "qwen_auto", "qwen3_auto", "qwen_ep_2x2", "dsv3_ep", "bf16_ep", "mixtral_capacity_ep"]
    res = _launch(tmp_path, cases)
    _check(res)
    r = res["mixtral_capacity_ep"]
    assert r["impls"] == [] and r["a2a_counted"] == r["a2a_predicted"] > 0, r
