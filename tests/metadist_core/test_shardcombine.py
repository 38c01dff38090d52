"""ShardCombine on the numpy reference ops: every rule found is right, the known rules are found,
and wrong rules are rejected even where a single draw would let them through."""

import math

import numpy as np
import pytest

from metadist_core.ir.placement import Partial, Replicate, Shard
from metadist_core.reference.plugin import OPS, rules_for
from metadist_core.discovery.rules import ShardingRule
from metadist_core.discovery.shardcombine import DiscoveryStats, OpSpec, Unrunnable, discover_rules

N = 2


# -- an independent brute-force checker (shares no code with shardcombine) -------


def _pieces(x, p, n, rng):
    if isinstance(p, Replicate):
        return [x] * n
    if isinstance(p, Shard):
        c = math.ceil(x.shape[p.dim] / n)
        return [np.take(x, range(r * c, min((r + 1) * c, x.shape[p.dim])), axis=p.dim) for r in range(n)]
    if p.reduce == "sum":
        parts = [rng.normal(size=x.shape) for _ in range(n - 1)]
        return parts + [x - sum(parts)]
    if p.reduce == "avg":
        parts = [rng.normal(size=x.shape) for _ in range(n - 1)]
        return parts + [n * x - sum(parts)]
    sign = -1 if p.reduce == "max" else 1
    keep = rng.integers(0, n, size=x.shape)
    return [np.where(keep == r, x, x + sign * (1 + rng.random(x.shape))) for r in range(n)]


def _whole(pieces, p):
    if isinstance(p, Replicate):
        for q in pieces[1:]:
            np.testing.assert_allclose(q, pieces[0], rtol=1e-9, atol=1e-12)
        return pieces[0]
    if isinstance(p, Shard):
        return np.concatenate(pieces, axis=p.dim)
    fn = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[p.reduce]
    return fn(np.stack(pieces), axis=0)


def brute_force_check(fn, rule: ShardingRule, shapes, draws=4, seed=123):
    """Run ``fn`` on per-device pieces under ``rule`` and check the combined outputs equal the full op."""
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        xs = [rng.normal(size=s) for s in shapes]
        full = fn(*xs)
        full = list(full) if isinstance(full, tuple) else [full]
        split = [_pieces(x, p, N, rng) for x, p in zip(xs, rule.inputs)]
        outs = [fn(*[s[r] for s in split]) for r in range(N)]
        outs = [list(o) if isinstance(o, tuple) else [o] for o in outs]
        for i, (f, p) in enumerate(zip(full, rule.outputs)):
            got = _whole([np.asarray(o[i]) for o in outs], p)
            np.testing.assert_allclose(got, f, rtol=1e-9, atol=1e-9, err_msg=f"rule {rule} is wrong")


def _rule(ins, outs):
    return ShardingRule(tuple(ins), tuple(outs))


R, P = Replicate(), Partial
CASES = [
    ("np.matmul", [(8, 6), (6, 4)], {}),
    ("np.matmul", [(4, 8, 6), (6, 4)], {}),
    ("np.add", [(8, 6), (6,)], {}),
    ("np.mul", [(8, 6), (8, 6)], {}),
    ("np.relu", [(8, 6)], {}),
    ("np.exp", [(4, 6)], {}),
    ("np.sum", [(8, 6)], {"dim": 1}),
    ("np.mean", [(8, 6)], {}),
    ("np.amax", [(8, 6)], {"dim": 0}),
    ("np.softmax", [(4, 6, 8)], {"dim": -1}),
    ("np.layer_norm", [(4, 6, 8), (8,), (8,)], {}),
    ("np.transpose", [(4, 6, 8)], {"perm": [2, 0, 1]}),
    ("np.concat", [(4, 6), (2, 6)], {"dim": 0}),
    ("np.concat", [(4, 6), (4, 2)], {"dim": 1}),
]


@pytest.mark.parametrize("key,shapes,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_rule_found_is_right(key, shapes, attrs):
    rng = np.random.default_rng(0)
    rules = rules_for(key, *[rng.normal(size=s) for s in shapes], **attrs)
    assert rules, f"no rule at all for {key}"
    assert _rule([R] * len(shapes), [R]) in rules
    fn = lambda *xs: OPS[key](*xs, **attrs)
    for r in rules:
        brute_force_check(fn, r, shapes)


def test_every_rule_found_is_right_for_reshape():
    x = np.random.default_rng(0).normal(size=(4, 6, 8))
    rules = rules_for("np.reshape", x, shape=[24, 8])
    merge = lambda a: a.reshape(a.shape[0] * a.shape[1], a.shape[2])  # the same reshape at any local shape
    for r in rules:
        brute_force_check(merge, r, [(4, 6, 8)])
    assert _rule([Shard(0)], [Shard(0)]) in rules
    assert _rule([Shard(2)], [Shard(1)]) in rules
    assert not any(r.inputs[0] == Shard(1) for r in rules), "a non-major dim of a merged group cannot pass a reshape"


def test_matmul_known_rules():
    a, b = np.random.default_rng(1).normal(size=(8, 6)), np.random.default_rng(2).normal(size=(6, 4))
    rules = rules_for("np.matmul", a, b)
    assert _rule([Shard(0), R], [Shard(0)]) in rules  # row split
    assert _rule([R, Shard(1)], [Shard(1)]) in rules  # column split
    assert _rule([Shard(1), Shard(0)], [P("sum")]) in rules  # contraction split
    assert _rule([P("sum"), R], [P("sum")]) in rules  # linear: Partial(sum) flows through
    assert _rule([Shard(0), Shard(1)], [Shard(0)]) not in rules


def test_softmax_keeps_last_dim_whole():
    rules = rules_for("np.softmax", np.random.default_rng(0).normal(size=(4, 6, 8)), dim=-1)
    ins = {r.inputs[0] for r in rules}
    assert Shard(0) in ins and Shard(1) in ins and Shard(2) not in ins
    assert not any(isinstance(p, Partial) for p in ins)


def test_sum_over_dim_gives_partial_sum():
    rules = rules_for("np.sum", np.random.default_rng(0).normal(size=(8, 6)), dim=1)
    assert _rule([Shard(1)], [P("sum")]) in rules
    assert _rule([Shard(0)], [Shard(0)]) in rules


def test_monotone_ops_carry_partial_max():
    x = np.random.default_rng(0).normal(size=(8, 6))
    assert _rule([P("max")], [P("max")]) in rules_for("np.relu", x)
    assert _rule([P("max")], [P("max")]) in rules_for("np.amax", x, dim=1)
    assert _rule([Shard(1)], [P("max")]) in rules_for("np.amax", x, dim=1)
    assert _rule([P("max")], [P("max")]) in rules_for("np.exp", x)  # exp is monotone too
    assert _rule([P("max")], [P("max")]) not in rules_for("np.mul", x, x)  # max(a)*max(a) != max(a*a) with signs


def test_layer_norm_splits_batch_and_sequence_not_normalised_dim():
    rng = np.random.default_rng(0)
    rules = rules_for("np.layer_norm", rng.normal(size=(4, 6, 8)), rng.normal(size=(8,)), rng.normal(size=(8,)))
    assert _rule([Shard(0), R, R], [Shard(0)]) in rules
    assert _rule([Shard(1), R, R], [Shard(1)]) in rules
    assert not any(r.inputs[0] == Shard(2) for r in rules)


def test_mean_of_batch_shards_is_never_accepted_as_min():
    """The classic trap: a mean-reduced loss whose batch shards happen to have the same mean.

    On the example inputs the two halves are identical, so min/max of the shard means equals the full mean;
    independent random draws must still reject it, and Partial(avg) must be what is found."""
    half = np.random.default_rng(0).normal(size=(4, 6))
    x = np.concatenate([half, half])
    spec = OpSpec(lambda a: a.mean(), [x], "mean")
    rules = discover_rules(spec, 2)
    outs = {r.outputs[0] for r in rules if r.inputs[0] == Shard(0)}
    assert outs == {P("avg")}, outs


def test_known_wrong_rule_rejected_even_if_close():
    """An op whose shards nearly agree: a tolerance-only check on one draw would accept `min`."""
    x = np.full((8, 6), 5.0)
    x[:4] += 1e-7  # shard means differ by 1e-7 relative: within a loose float tolerance
    rules = discover_rules(OpSpec(lambda a: a.mean(), [x], "mean"), 2)
    assert _rule([Shard(0)], [P("min")]) not in rules and _rule([Shard(0)], [P("max")]) not in rules


def test_integer_draw_is_exact(monkeypatch):
    """An integer-valued draw must match exactly: a sum that is off by a tiny amount is rejected."""

    def almost_sum(a):
        s = a.sum(0)
        return s + 1e-11 * (a.shape[0] != 8)  # wrong only on shards

    rules = discover_rules(OpSpec(almost_sum, [np.random.default_rng(0).normal(size=(8, 3))], "almost_sum"), 2)
    assert _rule([Shard(0)], [P("sum")]) not in rules


def test_ops_that_raise_on_shards_are_rejected_not_crashing():
    def picky(a):
        if a.shape[0] != 8:
            raise ValueError("only full batches")
        return a * 2

    rules = discover_rules(OpSpec(picky, [np.ones((8, 4))], "picky"), 2)
    assert _rule([Shard(1)], [Shard(1)]) in rules
    assert not any(r.inputs[0] == Shard(0) for r in rules)


def test_random_op_is_unrunnable():
    rng = np.random.default_rng(0)
    with pytest.raises(Unrunnable, match="different results"):
        discover_rules(OpSpec(lambda a: a + rng.normal(size=a.shape), [np.ones((4, 4))], "noise"), 2)
    with pytest.raises(Unrunnable, match="raised on its example"):
        discover_rules(OpSpec(lambda a: a @ a, [np.ones((4, 3))], "bad"), 2)


def test_multiple_and_non_tensor_outputs():
    def split_and_count(a):
        return a[:, :3], a[:, 3:], a.shape[1]

    rules = discover_rules(OpSpec(split_and_count, [np.ones((8, 6))], "split"), 2)
    assert _rule([Shard(0)], [Shard(0), Shard(0), R]) in rules
    assert not any(r.inputs[0] == Shard(1) for r in rules)  # column counts change on shards


def test_uneven_splits():
    x = np.random.default_rng(0).normal(size=(7, 5))
    rules = rules_for("np.relu", x)
    assert _rule([Shard(0)], [Shard(0)]) in rules and _rule([Shard(1)], [Shard(1)]) in rules
    # a mean over an uneven split is not the average of the shard means
    rules = rules_for("np.mean", x)
    assert not any(r.inputs[0] == Shard(0) for r in rules) and not any(r.inputs[0] == Shard(1) for r in rules)
    rules = rules_for("np.sum", x)
    assert _rule([Shard(0)], [P("sum")]) in rules


def test_index_inputs_stay_in_range():
    table = np.random.default_rng(0).normal(size=(10, 4))
    idx = np.array([[0, 9, 3], [2, 2, 7]])
    stats = DiscoveryStats()
    rules = discover_rules(OpSpec(lambda t, i: t[i], [table, idx], "embedding", partial_inputs=True), 2, stats=stats)
    assert _rule([R, Shard(0)], [Shard(0)]) in rules and _rule([R, Shard(1)], [Shard(1)]) in rules
    assert _rule([Shard(1), R], [Shard(2)]) in rules
    assert stats.runs > 0


@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("reduce", ["sum", "avg", "max", "min"])
def test_partial_pieces_reduce_to_the_value_and_straddle_it(reduce, dtype, n):
    """The pieces of a Partial input reduce back to the value; for max/min one device holds each element
    and the others lie strictly below (above), some close to the value and some far past its scale.
    On more than 2 devices the random values are windows of one pool: no two pieces are the same."""
    from metadist_core.discovery.verify import partial_pieces

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 7, 5)) * 3).astype(dtype)
    pieces = np.stack(partial_pieces(x, reduce, n, rng, False))
    flat = pieces.reshape(n, -1)
    assert all(not np.array_equal(flat[i], flat[j]) for i in range(n) for j in range(i))
    if reduce in ("max", "min"):  # every device owns some elements, about 1/n of them
        owned = (pieces == x[None]).reshape(n, -1).sum(axis=1)
        assert (owned > 0).all() and owned.sum() == x.size
    assert pieces.shape == (n,) + x.shape and pieces.dtype == x.dtype
    tol = 1e-9 if dtype == "float64" else 1e-4
    if reduce in ("sum", "avg"):
        back = pieces.sum(axis=0) if reduce == "sum" else pieces.mean(axis=0)
        np.testing.assert_allclose(back, x, rtol=tol, atol=tol * 30)
        return
    back = pieces.max(axis=0) if reduce == "max" else pieces.min(axis=0)
    assert np.array_equal(back, x)
    owners = (pieces == x[None]).sum(axis=0)
    assert (owners == 1).all()  # one device holds the value
    gap = np.abs(pieces - x[None])[pieces != x[None]]
    scale = max(float(np.abs(x).max()), 1.0)
    assert (gap < 0.5 * np.abs(x).max()).any() and (gap > 5 * scale).any()  # near and far gaps
    if reduce == "max":
        assert (pieces <= x[None]).all()
    else:
        assert (pieces >= x[None]).all()


def test_replicated_inputs_run_the_op_once_not_on_every_device():
    from metadist_core.discovery.shardcombine import _Runner

    spec = OpSpec(lambda a: np.tanh(a), [np.ones((6, 5))], "tanh")
    stats = DiscoveryStats()
    runner = _Runner(spec, 16, stats)
    x = np.random.default_rng(0).standard_normal((6, 5))
    outs = runner.pieces((R,), [x], np.random.default_rng(1), False)
    assert stats.runs == 1 and len(outs[0]) == 16 and all(np.array_equal(o, np.tanh(x)) for o in outs[0])
    runner.pieces((Shard(0),), [x], np.random.default_rng(1), False)
    assert stats.runs == 1 + 16
