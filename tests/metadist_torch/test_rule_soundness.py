"""Every rule ShardCombine accepts is re-verified by an independent brute-force checker.

The checker has its own samplers (Laplace, uniform and spiky floats; integers
over the op's own range and, where the op takes them, wide ones; booleans at
2 %, 50 % and 98 % True), its own splitting (torch.chunk pieces, Partial pieces
built another way than verify.py's) and its own combining, and it runs each op
pattern at a third proxy size that discovery never used. It re-checks every
rule of every op pattern of the recorded GPT-2 step, of the GPT and CNN
examples, and of the op classes that convenient data used to fool.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from metadist_core.discovery.discover import discover  # noqa: E402
from metadist_core.discovery.patterns import NoProxy, op_pattern, proxy_op  # noqa: E402
from metadist_core.ir.placement import Partial, Replicate, Shard  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402
from metadist_core.ir.recorded import load_recorded_graph  # noqa: E402
from metadist_core.discovery.rules import RuleBook, ShardingRule  # noqa: E402

GRAPHS = Path(__file__).resolve().parents[1] / "data" / "graphs"
TRIALS = 4


# -- the checker's own sampling, splitting and combining ---------------------------------------------


def sample_like(x: np.ndarray, rng: np.random.Generator, wide_ints: bool) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.size == 0:
        return x
    if x.dtype == np.bool_:
        return rng.random(x.shape) < rng.choice([0.02, 0.5, 0.98])
    if np.issubdtype(x.dtype, np.integer):
        lo, hi = int(x.min()), int(x.max())
        if wide_ints:
            lo, hi = min(lo, -30), max(hi, 30)
        return rng.integers(lo, hi + 1, size=x.shape).astype(x.dtype)
    kind = rng.integers(0, 3)
    if kind == 0:
        v = rng.laplace(0.0, 2.0, x.shape)
    elif kind == 1:
        v = rng.uniform(-6.0, 6.0, x.shape)
    else:
        v = rng.standard_normal(x.shape) * np.where(rng.random(x.shape) < 0.1, 50.0, 1.0)
    return v.astype(x.dtype)


def chunk(x: np.ndarray, dim: int, n: int) -> list[np.ndarray]:
    c = -(-x.shape[dim] // n)
    return [np.take(x, range(min(i * c, x.shape[dim]), min((i + 1) * c, x.shape[dim])), axis=dim) for i in range(n)]


def split(x, p, n: int, rng: np.random.Generator) -> list:
    if not isinstance(x, np.ndarray) or isinstance(p, Replicate):
        return [x] * n
    if isinstance(p, Shard):
        return chunk(x, p.dim, n)
    e = rng.laplace(0.0, 1.0 + np.abs(x), (n,) + x.shape)
    if p.reduce in ("sum", "avg"):
        e = e - e.mean(axis=0)  # zero-sum noise
        base = x / n if p.reduce == "sum" else x
        return [(base + e[i]).astype(x.dtype) for i in range(n)]
    sign = -1.0 if p.reduce == "max" else 1.0
    owner = rng.integers(0, n, x.shape)
    return [np.where(owner == i, x, x + sign * np.abs(e[i])).astype(x.dtype) for i in range(n)]


def combine(pieces: list, p, full):
    if isinstance(p, Replicate):
        return pieces
    if isinstance(p, Shard):
        return np.concatenate(pieces, axis=p.dim)
    s = np.stack(pieces)
    if s.dtype == np.bool_:
        return s.any(0) if p.reduce == "max" else s.all(0)
    return {"sum": s.sum(0), "avg": s.mean(0), "max": s.max(0), "min": s.min(0)}[p.reduce]


def close(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if not np.issubdtype(a.dtype, np.floating):
        return bool(np.array_equal(a, b))
    fin = np.isfinite(a)
    if (
        not np.array_equal(fin, np.isfinite(b))
        or not np.array_equal(a[~fin], b[~fin])
        and not np.array_equal(np.isnan(a), np.isnan(b))
    ):
        return False
    scale = float(np.max(np.abs(a[fin]))) if fin.any() else 1.0
    return bool(np.allclose(a[fin], b[fin], rtol=1e-6, atol=1e-9 * max(scale, 1.0)))


def outs(x) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def check_rule(spec, rule: ShardingRule, n: int, rng: np.random.Generator, out_shapes) -> str | None:
    """None if ``rule`` reproduces the full op on TRIALS independent draws; else what went wrong."""
    ex = list(spec.example_inputs)
    for t in range(TRIALS):
        inputs = None
        for wide in (True, False):  # wide integers where the op accepts them
            cand = [sample_like(x, rng, wide) for x in ex]
            try:
                with np.errstate(all="ignore"):
                    full = outs(spec.fn(*cand))
                inputs = cand
                break
            except Exception:
                continue
        if inputs is None:
            return None  # the op takes none of our draws: nothing to check against
        pieces = [split(x, p, n, rng) for x, p in zip(inputs, rule.inputs)]
        per_dev = []
        for r in range(n):
            local = [pc[r] for pc in pieces]
            try:
                with np.errstate(all="ignore"):
                    if spec.reshape_fn is not None:
                        p_out = rule.outputs[0]
                        target = list(out_shapes[0])
                        if isinstance(p_out, Shard):
                            target[p_out.dim] = chunk(np.empty(out_shapes[0][p_out.dim]), 0, n)[r].shape[0]
                        per_dev.append(outs(spec.reshape_fn(local[0], tuple(target))))
                    else:
                        per_dev.append(outs(spec.fn(*local)))
            except Exception as e:
                return f"device {r} raised {type(e).__name__}: {e}"
        for k, (f, p) in enumerate(zip(full, rule.outputs)):
            got = combine([d[k] for d in per_dev], p, f)
            if isinstance(p, Replicate):
                if not all(close(f, g) for g in got):
                    return f"trial {t}: output {k} differs between devices and the full op"
            elif not close(f, got):
                return f"trial {t}: output {k} combined as {p} is not the full result"
    return None


def check_book(graph, book: RuleBook, pm: PluginManager, n: int, seed: int = 7) -> list[str]:
    """Re-check every rule of every op pattern of ``graph`` at a third proxy size; the wrong ones."""
    rng = np.random.default_rng(seed)
    wrong, seen = [], set()
    for op in graph.ops:
        pat = op_pattern(op, graph, n)
        if pat.key in seen:
            continue
        seen.add(pat.key)
        entry = book.lookup(op, graph, n)
        if entry is None or entry.status != "ok":
            continue
        try:
            p_op, p_graph = proxy_op(op, graph, n, instance=2)  # a size discovery never ran
        except NoProxy:
            p_op, p_graph = op, graph
        try:
            spec = pm.op_spec(p_op, p_graph)
        except Exception:
            continue
        out_shapes = [p_graph.vars[v].shape for v in p_op.outputs]
        for rule in entry.rules:
            why = check_rule(spec, rule, n, rng, out_shapes)
            if why:
                wrong.append(f"{op.key} {rule}: {why}")
    return wrong


# -- the tests ---------------------------------------------------------------------------------


def test_the_checker_catches_a_wrong_rule():
    """A checker that cannot fail proves nothing: softmax split along the dim it normalises is wrong."""
    from metadist_torch.ops.oprunner import build_spec  # noqa: F401 - the frontend is loaded

    pm = PluginManager()
    graph = load_recorded_graph(GRAPHS / "gpt2-tiny-2l-adamw.json")
    op = next(o for o in graph.ops if o.key == "aten._softmax.default" or o.key == "aten._log_softmax.default")
    p_op, p_graph = proxy_op(op, graph, 2, instance=2)
    spec = pm.op_spec(p_op, p_graph)
    last = len(p_graph.vars[p_op.inputs[0]].shape) - 1
    bad = ShardingRule((Shard(last),), (Shard(last),))
    good = ShardingRule((Shard(0),), (Shard(0),))
    shapes = [p_graph.vars[v].shape for v in p_op.outputs]
    rng = np.random.default_rng(0)
    assert check_rule(spec, bad, 2, rng, shapes) is not None
    assert check_rule(spec, good, 2, rng, shapes) is None


def test_every_rule_of_the_recorded_gpt2_step_is_right():
    graph = load_recorded_graph(GRAPHS / "gpt2-tiny-2l-adamw.json")
    pm = PluginManager()
    book = discover(graph, pm, RuleBook(), axis_sizes=(2,), progress=False)
    n_rules = sum(len(e.rules) for e in book.entries.values())
    assert len(book.entries) < len(graph.unique_signatures()) and n_rules > 300
    wrong = check_book(graph, book, pm, 2)
    assert not wrong, f"{len(wrong)} wrong rules:\n" + "\n".join(wrong[:20])


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_every_rule_of_the_recorded_gpt2_step_on_larger_axes_is_right(n):
    """On axes of 4 and more the unsharded combinations are verified on the proxies of an axis of 2 and,
    above 2, the Partial pieces come from windows of one pool (metadist_core.discovery.discover,
    verify.partial_pieces): every rule is re-checked here with n devices at a third proxy size of the axis."""
    graph = load_recorded_graph(GRAPHS / "gpt2-tiny-2l-adamw.json")
    pm = PluginManager()
    book = discover(graph, pm, RuleBook(), axis_sizes=(n,), progress=False)
    assert sum(len(e.rules) for e in book.entries.values()) > 300
    wrong = check_book(graph, book, pm, n)
    assert not wrong, f"{len(wrong)} wrong rules:\n" + "\n".join(wrong[:20])


aten = torch.ops.aten
FOOLED_BEFORE = [  # op, example arguments, a rule that convenient data let through (now it must not be found)
    ("any", lambda: (aten.any.dim, torch.rand(8, 6) < 0.5, 1), ShardingRule((Shard(1),), (Replicate(),))),
    ("all", lambda: (aten.all.dim, torch.rand(8, 6) < 0.5, 1), ShardingRule((Shard(1),), (Replicate(),))),
    (
        "clamp",
        lambda: (aten.clamp.default, torch.randn(8, 6), -10.0, 10.0),
        ShardingRule((Partial("sum"),), (Partial("sum"),)),
    ),
    (
        "hardtanh",
        lambda: (aten.hardtanh.default, torch.randn(8, 6), -8.0, 8.0),
        ShardingRule((Partial("sum"),), (Partial("sum"),)),
    ),
    (
        "clamp_min",
        lambda: (aten.clamp_min.default, torch.randn(8, 6), -9.0),
        ShardingRule((Partial("sum"),), (Partial("sum"),)),
    ),
    (
        "nll_loss mean",
        lambda: (
            aten.nll_loss_forward.default,
            torch.log_softmax(torch.randn(4, 5), 1),
            torch.tensor([0, 1, 2, 3]),
            None,
            1,
            -100,
        ),
        ShardingRule((Shard(0), Shard(0)), (Partial("avg"), Partial("sum"))),
    ),
    (
        "mul float int",
        lambda: (aten.mul.Tensor, torch.randn(8, 6), torch.randint(0, 2, (8, 6))),
        ShardingRule((Partial("max"), Replicate()), (Partial("max"),)),
    ),
    (
        "prod int",
        lambda: (aten.prod.dim_int, torch.randint(1, 3, (8, 6)), 1),
        ShardingRule((Shard(1),), (Partial("min"),)),
    ),
    ("silu tiny", lambda: (aten.silu.default, torch.randn(2)), ShardingRule((Partial("min"),), (Partial("min"),))),
    ("mish tiny", lambda: (aten.mish.default, torch.randn(2)), ShardingRule((Partial("min"),), (Partial("min"),))),
    (
        "hardswish tiny",
        lambda: (aten.hardswish.default, torch.randn(2)),
        ShardingRule((Partial("min"),), (Partial("min"),)),
    ),
]


@pytest.mark.parametrize("name,make,wrong_rule", FOOLED_BEFORE, ids=[c[0] for c in FOOLED_BEFORE])
def test_ops_that_convenient_data_fooled(name, make, wrong_rule):
    from metadist_torch import rules_for
    from metadist_torch.ops.oprunner import rules_for_spec

    op, *args = make()
    rules = rules_for(op, *args)
    assert wrong_rule not in rules, f"{name}: {wrong_rule} is still accepted"
    spec = rules_for_spec(op, *args)
    rng = np.random.default_rng(11)
    shapes = [np.shape(o) for o in outs(spec.fn(*spec.example_inputs))]
    bad = [f"{r}: {why}" for r in rules if (why := check_rule(spec, r, 2, rng, shapes))]
    assert not bad, f"{name}: wrong rules {bad}"
    assert len(rules) >= 2  # not only the replicated one


@pytest.mark.slow
@pytest.mark.parametrize("example", ["gpt", "cnn"])
def test_every_rule_of_the_examples_is_right(example, monkeypatch):
    """The examples' steps traced by the torch frontend; their rules on axes of 2 and 4, re-checked."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "torch" / f"{example}.py"
    spec = importlib.util.spec_from_file_location(f"example_{example}", path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    cfg = mod.GPTConfig() if example == "gpt" else mod.CNNConfig()
    model, opt = mod.build(cfg)
    pm = PluginManager()
    traced = pm.frontend("torch").trace(mod.train_step, (model, opt, *mod.batch(cfg)), {})
    for n in (2, 4):
        book = discover(traced.graph, pm, RuleBook(), axis_sizes=(n,), progress=False)
        wrong = check_book(traced.graph, book, pm, n)
        assert not wrong, f"{example}, axis of {n}: {len(wrong)} wrong rules:\n" + "\n".join(wrong[:20])
