"""The torch op runner: aten MetaOps made runnable for ShardCombine, their cost, and rules_for.

Every rule found is checked here by brute force, independently of
ShardCombine's own search: random inputs are split per the rule's input
placements onto simulated devices, the op runs per device, the outputs are
put together per the rule's output placements and compared with the full op
in float64.
"""

import os
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from metadist_core.ir.placement import Partial, Replicate, Shard  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402
from metadist_core.ir.recorded import load_recorded_graph  # noqa: E402
from metadist_core.discovery.shardcombine import Unrunnable, discover_rules  # noqa: E402
from metadist_torch import rules_for  # noqa: E402
from metadist_torch.ops.oprunner import op_cost, op_spec  # noqa: E402

GRAPHS = Path(os.environ.get("METADIST_GRAPHS_DIR", Path(__file__).resolve().parents[1] / "data" / "graphs"))
TINY = GRAPHS / "gpt2-tiny-2l-adamw.json"
needs_graphs = pytest.mark.skipif(not TINY.exists(), reason=f"no recorded graphs under {GRAPHS}")
aten = torch.ops.aten

S, R, P = Shard, Replicate, Partial


@pytest.fixture(scope="module")
def tiny():
    return load_recorded_graph(TINY)


# -- an independent brute-force check of a rule --------------------------------------


def _chunks(size, n):
    c = -(-size // n)
    return [(min(size, r * c), min(size, (r + 1) * c)) for r in range(n)]


def _split(x, p, n, rng):
    if isinstance(p, Replicate) or not isinstance(x, np.ndarray):
        return [x] * n
    if isinstance(p, Shard):
        return [x[(slice(None),) * p.dim + (slice(a, b),)] for a, b in _chunks(x.shape[p.dim], n)]
    r = [rng.standard_normal(x.shape) for _ in range(n - 1)]
    if p.reduce == "sum":
        return r + [x - sum(r)]
    if p.reduce == "avg":
        return r + [n * x - sum(r)]
    owner = rng.integers(0, n, size=x.shape)
    off = -1.0 if p.reduce == "max" else 1.0
    return [np.where(owner == k, x, x + off * (np.abs(rng.standard_normal(x.shape)) + 1)) for k in range(n)]


def _close(full, got):
    full, got = np.asarray(full), np.asarray(got)
    if full.shape != got.shape:
        return False
    if not np.issubdtype(full.dtype, np.floating):
        return np.array_equal(full, got)
    fin = np.isfinite(full)
    if not np.array_equal(fin, np.isfinite(got)) or not np.array_equal(full[~fin], got[~fin], equal_nan=True):
        return False
    scale = float(np.max(np.abs(full[fin]))) if fin.any() else 1.0
    return bool(np.allclose(full[fin], got[fin], rtol=1e-7, atol=1e-9 * max(scale, 1e-12)))


def _local_target(out_shape, q, n, r):
    if not isinstance(q, Shard):
        return tuple(out_shape)
    t = list(out_shape)
    a, b = _chunks(out_shape[q.dim], n)[r]
    t[q.dim] = b - a
    return tuple(t)


def brute_force_ok(spec, rule, n=2, draws=2, seed=123):
    """Does ``rule`` hold for the op of ``spec`` on ``draws`` fresh random inputs?"""
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        xs = spec.sampler(rng, False)
        full = spec.fn(*xs)
        full = list(full) if isinstance(full, (tuple, list)) else [full]
        pieces = [_split(x, p, n, rng) for x, p in zip(xs, rule.inputs)]
        per_dev = []
        for r in range(n):
            local = [pc[r] for pc in pieces]
            if spec.reshape_fn is not None:
                out = spec.reshape_fn(local[0], _local_target(spec.out_shape, rule.outputs[0], n, r))
            else:
                out = spec.fn(*local)
            per_dev.append(list(out) if isinstance(out, (tuple, list)) else [out])
        if len(full) != len(rule.outputs):
            return False
        for i, (f, q) in enumerate(zip(full, rule.outputs)):
            outs = [np.asarray(d[i]) for d in per_dev]
            if isinstance(q, Replicate):
                if not all(_close(f, o) for o in outs):
                    return False
                continue
            if isinstance(q, Shard):
                got = np.concatenate(outs, axis=q.dim)
            else:
                got = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[q.reduce](np.stack(outs), axis=0)
            if not _close(f, got):
                return False
    return True


_DISCOVERED = {}


def _discover(op, graph):
    key = (graph.name, op.signature(graph))
    if key not in _DISCOVERED:
        spec = op_spec(op, graph)
        _DISCOVERED[key] = spec, discover_rules(spec, 2)
    return _DISCOVERED[key]


def _rules(op, graph):
    """Discover the rules of ``op`` and brute-force check every one."""
    spec, rules = _discover(op, graph)
    bad = [str(r) for r in rules if not brute_force_ok(spec, r)]
    assert not bad, f"{op.signature(graph)}: rules that fail the brute-force check: {bad}"
    return spec, rules


def _has(rules, ins, outs):
    return any(r.inputs == tuple(ins) and r.outputs == tuple(outs) for r in rules)


# -- the plugin ----------------------------------------------------------------------


@needs_graphs
def test_plugin_is_found_and_owns_aten_and_metadists_own_runnable_ops(tiny):
    pm = PluginManager()
    assert "torch" in pm.names("frontend")
    fe = pm.frontend("torch")
    assert fe.name == "torch" and tuple(fe.traits.op_prefixes) == (
        "aten.",
        "metadist.experts_ffn",
        "metadist.moe_dropless",
    )
    op = tiny.op("mm")
    assert fe.traits.owns(op) and pm.owner(op) is fe
    spec = pm.op_spec(op, tiny)
    assert spec is not None and spec.name == "aten.mm.default"
    assert [x.shape for x in spec.example_inputs] == [tiny.vars[v].shape for v in op.inputs]
    assert all(x.dtype == np.float64 for x in spec.example_inputs)  # float32 runs in float64
    other = type(op)("x", "jax.lax.dot_general", op.inputs, op.outputs, {})
    assert not fe.traits.owns(other)
    assert not fe.traits.owns(type(op)("y", "mylib.op.default", op.inputs, op.outputs, {}))  # a user's custom op
    assert fe.traits.owns(type(op)("z", "metadist.experts_ffn_backward.default", op.inputs, op.outputs, {}))
    assert fe.traits.owns(type(op)("w", "metadist.moe_dropless_backward.default", op.inputs, op.outputs, {}))
    assert pm.op_cost(op, tiny) == op_cost(op, tiny)


def test_importing_the_plugin_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, metadist_torch.plugin as p; fe = p.metadist_frontend(); "
        "assert fe.name == 'torch' and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- known rules on the recorded graph -----------------------------------------------


@needs_graphs
def test_mm_rules(tiny):
    _, rules = _rules(tiny.op("mm"), tiny)  # [1024,128] x [128,1024]
    assert _has(rules, [S(0), R()], [S(0)])
    assert _has(rules, [R(), S(1)], [S(1)])
    assert _has(rules, [S(1), S(0)], [P("sum")])
    assert not _has(rules, [S(1), R()], [P("sum")])


@needs_graphs
def test_embedding_batch_split(tiny):
    _, rules = _rules(tiny.op("embedding"), tiny)  # weight [1024,128], ids [8,128]
    assert _has(rules, [R(), S(0)], [S(0)])
    assert _has(rules, [S(1), R()], [S(2)])
    assert not any(r.inputs[0] == S(0) for r in rules)  # a vocab split needs masking: not a plain rule


@needs_graphs
def test_log_softmax_keeps_its_dim_whole(tiny):
    _, rules = _rules(tiny.op("_log_softmax"), tiny)  # [1024,1024], dim 1
    assert _has(rules, [S(0)], [S(0)])
    assert not any(r.inputs[0] == S(1) for r in rules)


def test_softmax_keeps_last_dim_whole():
    rules = rules_for(aten._softmax.default, torch.randn(8, 6, 10), -1, False)
    assert _has(rules, [S(0)], [S(0)]) and _has(rules, [S(1)], [S(1)])
    assert not any(r.inputs[0] == S(2) for r in rules)


@needs_graphs
def test_view_flattening_batch(tiny):
    op = tiny.op("view_1")  # [8,128,128] -> [1024,128]
    assert tiny.vars[op.inputs[0]].shape == (8, 128, 128) and tiny.vars[op.outputs[0]].shape == (1024, 128)
    spec, rules = _rules(op, tiny)
    assert spec.reshape_fn is not None and spec.out_shape == (1024, 128)
    assert _has(rules, [S(0)], [S(0)]) and _has(rules, [S(2)], [S(1)])
    assert not any(r.inputs[0] == S(1) for r in rules)


@needs_graphs
def test_nll_loss_mean_is_not_an_average_of_local_means(tiny):
    # targets hit ignore_index (-100) in real data: per-device means over different counts do not average
    spec, rules = _rules(tiny.op("nll_loss_forward"), tiny)
    assert (spec.example_inputs[1] == -100).any()
    assert not any(r.inputs == (S(0), S(0)) for r in rules)
    _, rules = _discover(tiny.op("nll_loss_backward"), tiny)  # brute-force checked below
    assert _has(rules, [R(), S(0), S(0), R()], [S(0)])


# A scalar input (nll_loss_backward's grad_output) has a 1-in-8 chance per Partial(max/min) candidate
# that its sign agrees by luck on a few draws, so a sign-dependent rule such as
# (R, R, R, P(max)) -> (P(max)) could pass; ShardCombine takes 12 draws for ops with a tiny float input.
SCALAR_WEAK = ("aten.nll_loss_backward.default",)


@needs_graphs
def test_rules_with_scalar_inputs_hold(tiny):
    _rules(tiny.op("nll_loss_backward"), tiny)


@needs_graphs
def test_factory_ops_replicate_only(tiny):
    for name in ("arange", "zeros"):
        _, rules = _rules(tiny.op(name), tiny)
        assert [str(r) for r in rules] == ["() -> (R)"]


# -- rules_for -----------------------------------------------------------------------


def test_rules_for_mm_and_add():
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    rules = rules_for(aten.mm.default, a, b)
    for ins, outs in (([S(0), R()], [S(0)]), ([R(), S(1)], [S(1)]), ([S(1), S(0)], [P("sum")])):
        assert _has(rules, ins, outs)
    assert all(len(r.inputs) == 2 and len(r.outputs) == 1 for r in rules)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    rules = rules_for(torch.add, x, y)
    for ins, outs in (([S(0), S(0)], [S(0)]), ([S(1), S(1)], [S(1)]), ([P("sum"), P("sum")], [P("sum")])):
        assert _has(rules, ins, outs)
    assert not _has(rules, [S(0), R()], [S(0)])


def test_rules_for_lists_dtypes_and_bf16():
    rules = rules_for(aten.cat.default, [torch.randn(4, 6), torch.randn(4, 2)], 1)
    assert _has(rules, [S(0), S(0)], [S(0)]) and not any(r.inputs[0] == S(1) for r in rules)
    rules = rules_for(aten.mm.default, torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 6, dtype=torch.bfloat16))
    assert _has(rules, [S(1), S(0)], [P("sum")])  # bf16 runs in float64, so the tolerance stays tight
    rules = rules_for(aten.sum.dim_IntList, torch.randn(4, 6), [1], False)
    assert _has(rules, [S(1)], [P("sum")]) and _has(rules, [S(0)], [S(0)])
    rules = rules_for(aten.empty.memory_format, [4, 6])  # garbage memory: run as zeros
    assert [str(r) for r in rules] == ["() -> (R)"]
    rules = rules_for(aten.expand.default, torch.randn(1, 6), [4, 6])
    assert _has(rules, [S(1)], [S(1)])


def test_rules_for_index_inputs_stay_in_range():
    w, idx = torch.randn(10, 4), torch.randint(0, 10, (6, 3))
    rules = rules_for(aten.embedding.default, w, idx)
    assert _has(rules, [R(), S(0)], [S(0)])
    x, i = torch.randn(6, 5), torch.randint(0, 5, (6, 3))
    rules = rules_for(aten.gather.default, x, 1, i)
    assert _has(rules, [S(0), S(0)], [S(0)])


def test_backward_ops_of_slices_split_with_their_gradient():
    """slice_backward/select_backward name the forward input's full size: on a piece of the gradient they run at
    the piece's size (rotary embeddings' backward; replicated-only rules replicated LLaMA's forward). Each rule is
    checked here on fresh data against the whole op, pieces given the local size as the lowering gives it."""
    g = torch.randn(6, 4, 8, dtype=torch.float64)
    for op, args, out_dim_of in (
        (aten.slice_backward.default, ([6, 4, 16], 2, 0, 8, 1), {0: 0, 1: 1}),
        (aten.select_backward.default, ([6, 5, 4, 8], 1, 3), {0: 0, 1: 2, 2: 3}),
    ):
        rules = rules_for(op, torch.randn(*g.shape), *args)
        for d, od in out_dim_of.items():
            assert _has(rules, [S(d)], [S(od)]), (op, d, [str(r) for r in rules])
            whole = op(g, *args)
            pieces = []
            for piece in g.chunk(2, dim=d):
                size = list(args[0])
                size[od] = piece.shape[d]
                pieces.append(op(piece, size, *args[1:]))
            assert torch.equal(torch.cat(pieces, dim=od), whole)
        sliced = args[1]
        assert not _has(rules, [S(sliced)], [S(sliced)]) or op is aten.select_backward.default


def test_grouped_query_attention_splits_by_batch_and_by_head_group():
    """The CPU flash kernel takes key/value with fewer heads than the query (LLaMA's grouped-query attention):
    the shape guard lets it run, and discovery splits the query's 4 heads with the key/value's 2 (dims of
    sizes in whole ratios split together), so attention shards by heads as Megatron's plan does. The head
    rule is checked here on fresh data against the whole op: each device's query heads with its key/value
    head, the outputs concatenated."""
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    rules = rules_for(op, q, k, v, 0.0, True)
    assert _has(rules, [S(0), S(0), S(0)], [S(0), S(0)])
    assert _has(rules, [S(1), S(1), S(1)], [S(1), S(1)]), [str(r) for r in rules]
    assert not _has(rules, [S(1), S(1), R()], [S(1), S(1)])  # a key head split from its value head
    q, k, v = torch.randn(3, 8, 5, 16), torch.randn(3, 2, 5, 16), torch.randn(3, 2, 5, 16)
    whole = op(q, k, v, 0.0, True)
    pieces = [op(qp, kp, vp, 0.0, True) for qp, kp, vp in zip(q.chunk(2, 1), k.chunk(2, 1), v.chunk(2, 1))]
    for i in range(2):
        torch.testing.assert_close(torch.cat([p[i] for p in pieces], dim=1), whole[i])


def test_addmm_splits_its_contraction_with_the_bias_as_a_partial_sum():
    """A Linear with a bias (addmm) split on its contraction needs the bias as a partial sum: the row-parallel
    Linear of Megatron. Discovery tries the unsplit inputs of a 3-input op Partial(sum) beside the shards,
    and the rule is checked here on fresh data against the whole op (the bias cut into pieces that sum)."""
    rules = rules_for(aten.addmm.default, torch.randn(24), torch.randn(8, 16), torch.randn(16, 24))
    assert _has(rules, [P("sum"), S(1), S(0)], [P("sum")]), [str(r) for r in rules]
    gen = torch.Generator().manual_seed(7)
    b, x, w = (torch.randn(*s, generator=gen, dtype=torch.float64) * 10 for s in ((24,), (8, 16), (16, 24)))
    cut = torch.rand(2, 24, generator=gen, dtype=torch.float64)
    bias_pieces = [b * cut[0] / cut.sum(0), b * cut[1] / cut.sum(0)]
    got = sum(torch.addmm(bp, xp, wp) for bp, xp, wp in zip(bias_pieces, x.chunk(2, 1), w.chunk(2, 0)))
    torch.testing.assert_close(got, torch.addmm(b, x, w))


def test_unrunnable_ops():
    x = torch.randn(4, 4)
    for op, args in (
        (aten.native_dropout.default, (x, 0.5, True)),
        (aten.nonzero.default, (x,)),
        (aten._local_scalar_dense.default, (torch.tensor(1.0),)),
        (aten.rand.default, ([4, 4],)),
        (aten.bernoulli.p, (x, 0.5)),
    ):
        with pytest.raises(Unrunnable):
            rules_for(op, *args)
    # no dropout: deterministic, so it runs
    assert _has(rules_for(aten.native_dropout.default, x, 0.5, False), [S(0)], [S(0), S(0)])
    g = load_recorded_graph(TINY) if TINY.exists() else None
    if g is not None:
        op = g.op("mm")
        for key in ("profiler._record_function_enter_new.default", "mylib.custom.default", "aten.no_such_op.default"):
            with pytest.raises(Unrunnable):
                op_spec(type(op)("x", key, op.inputs, op.outputs, op.attrs), g)


# -- cost ----------------------------------------------------------------------------


@needs_graphs
def test_op_cost(tiny):
    mm = tiny.op("mm")  # [1024,128] x [128,1024]
    flops, nbytes = op_cost(mm, tiny)
    assert flops == 2 * 1024 * 128 * 1024
    assert nbytes == 4 * (1024 * 128 + 128 * 1024 + 1024 * 1024)
    add = tiny.op("add_1")  # [8,128,128] + [1,128,128]
    assert op_cost(add, tiny) == (8 * 128 * 128, 4 * (2 * 8 * 128 * 128 + 128 * 128))
    assert op_cost(tiny.op("t"), tiny) == (0, 0)  # a view moves nothing
    attn = tiny.op("_scaled_dot_product_flash_attention_for_cpu")
    assert op_cost(attn, tiny)[0] == 4 * 8 * 4 * 128 * 128 * 32
    bwd = tiny.op("_scaled_dot_product_flash_attention_for_cpu_backward")
    assert op_cost(bwd, tiny)[0] > op_cost(attn, tiny)[0]
    assert op_cost(tiny.op("addmm"), tiny)[0] >= 2 * 1024 * 128 * 384
    for op in tiny.ops:  # every op gets a cost
        f, b = op_cost(op, tiny)
        assert f >= 0 and b >= 0


# -- discovery over the recorded graph ------------------------------------------------

SLOW_KEYS = (
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten.native_layer_norm_backward.default",
)


def _representatives(graph):
    """Per op key, its signature with the fewest input elements."""
    best = {}
    for _sig, op in graph.unique_signatures().items():
        size = sum(math.prod(graph.vars[v].shape) for v in op.inputs)
        if op.key not in best or size < best[op.key][0]:
            best[op.key] = (size, op)
    return [op for _, op in best.values()]


@needs_graphs
def test_every_op_kind_of_the_tiny_graph(tiny):
    """One signature per op key (the smallest), every rule brute-force checked."""
    found = {}
    for op in _representatives(tiny):
        if op.key in SLOW_KEYS:
            continue
        _, rules = _rules(op, tiny)
        assert any(r.is_replicated() for r in rules), op.key
        assert all(len(r.inputs) == len(op.inputs) and len(r.outputs) == len(op.outputs) for r in rules)
        found[op.key] = len(rules)
    assert len(found) == 38 - len(SLOW_KEYS)


@pytest.mark.slow
@needs_graphs
def test_whole_tiny_graph_discovery(tiny):
    """Every distinct signature of the tiny graph (~190; a few minutes on 2 cores)."""
    pm = PluginManager()
    wrong = {}
    for sig, op in tiny.unique_signatures().items():
        spec = pm.op_spec(op, tiny)
        rules = discover_rules(spec, 2)
        assert any(r.is_replicated() for r in rules), sig
        bad = [str(r) for r in rules if not brute_force_ok(spec, r, draws=1)]
        if bad:
            wrong[sig] = bad
    assert not wrong, f"rules that fail the brute-force check: {wrong}"


def test_op_cost_matches_flop_counter_on_a_traced_step():
    """FLOPs from torch's formulas called on the traced shapes equal FlopCounterMode running each op, for a
    step with convolutions (forward and both backward weights), linears, bmm and a batch norm."""
    from torch.utils.flop_counter import FlopCounterMode

    from metadist_torch.trace.calls import TORCH_DTYPES, rebuild, resolve_overload
    from metadist_torch.trace.trace import trace_step

    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(8, 4, 2, stride=2),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 16 * 16, 10),
    )

    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(net, opt, x, w):
        y = net(x)
        loss = (torch.bmm(y.unsqueeze(1), w).sum()) ** 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    graph = trace_step(step, (net, opt, torch.randn(2, 3, 8, 8), torch.randn(2, 10, 5))).graph
    counted = 0
    for op in graph.ops:
        try:
            overload = resolve_overload(op.key)
        except Unrunnable:
            continue
        ins = [graph.vars[v] for v in op.inputs]
        tensors = [torch.empty(v.shape, dtype=TORCH_DTYPES[v.dtype], device="meta") for v in ins]
        with FlopCounterMode(display=False) as fc:
            overload(
                *rebuild(op.attrs.get("args", []), tensors, device="meta"),
                **rebuild(op.attrs.get("kwargs", {}), tensors, device="meta"),
            )
        want = fc.get_total_flops()
        if want:
            counted += 1
            assert op_cost(op, graph)[0] == want, op.key
    keys = {op.key for op in graph.ops}
    assert "aten.convolution_backward.default" in keys
    assert counted >= 8  # convolutions, their backward, addmm, mm, bmm...


def test_an_op_no_proxy_stands_for_is_named_with_the_reason(caplog):
    """A static argument larger than the proxy threshold that is no size of the op's tensors (a clamp bound)
    keeps its op at real shapes; discovery says which op and why."""
    import logging

    from metadist_core.discovery.discover import discover
    from metadist_core.discovery.rules import RuleBook
    from metadist_torch.plugin import TorchFrontend

    def step(x):
        return x.clamp(max=1000).sum()

    graph = TorchFrontend().trace(step, (torch.randn(48, 80),), {}).graph
    with caplog.at_level(logging.INFO, logger="metadist"):
        book = discover(graph, PluginManager(), RuleBook(), axis_sizes=(2,), progress=False, workers=1)
    said = [r.getMessage() for r in caplog.records if "discovered at its real shapes" in r.getMessage()]
    assert any("aten.clamp" in m and "static argument 1000" in m for m in said), said
    clamp = next(op for op in graph.ops if op.key.startswith("aten.clamp"))
    assert book.lookup(clamp, graph, 2).status == "ok"
