"""Distributed implementations as planner strategies, without a framework: the rules they add to an op, how
they combine with other axes' rules, their price, the UseImpl constraint and the plan's JSON."""

from __future__ import annotations

import pytest

from metadist_core.discovery import cp_attention as cpa
from metadist_core.discovery.distimpl import DistImplRegistry, SeqLayout
from metadist_core.discovery.rules import ShardingRule, Strategy, expand_rules
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Replicate, Shard, Sharding
from metadist_core.problem.distimpls import impl_rules, impl_seconds, impl_workspace, local_shapes
from metadist_core.problem.elements import UseImpl, parse_constraints
from metadist_core.cost.model import DEVICE_PRESETS

Q = (2, 4, 16, 8)  # batch, heads, sequence, head dim
KV = (2, 2, 16, 8)  # grouped-query: 2 K/V heads
CAUSAL = {"args": [{"$in": 0}, {"$in": 1}, {"$in": 2}, 0.0, True], "kwargs": {}, "select": [0, 1]}


def _registry(frontend: str = "fake") -> DistImplRegistry:
    reg = DistImplRegistry()
    for impl in cpa.register_attention(reg):
        reg.attach(impl.name, frontend, "lower", lambda *a, **k: None)
    return reg


def test_only_lowerable_contiguous_implementations_become_rules():
    reg = _registry()
    rules = impl_rules(reg, "fake", cpa.CPU_FORWARD, CAUSAL, [Q, KV, KV], 2, 4)
    assert [r.impl for r in rules] == [cpa.impl_name(SeqLayout("contiguous"))]
    assert rules[0].inputs == (Shard(2),) * 3 and rules[0].outputs == (Shard(2),) * 2
    assert impl_rules(reg, "other", cpa.CPU_FORWARD, CAUSAL, [Q, KV, KV], 2, 4) == []  # no lower hook there
    # the trace kept only the output: the rule's outputs follow the call's select
    only_out = dict(CAUSAL, select=[0])
    assert impl_rules(reg, "fake", cpa.CPU_FORWARD, only_out, [Q, KV, KV], 1, 4)[0].outputs == (Shard(2),)


def test_a_refused_call_gets_no_rule_and_says_why():
    reg = _registry()
    masked = {"args": [{"$in": 0}, {"$in": 1}, {"$in": 2}, 0.0, False], "kwargs": {"attn_mask": {"$in": 3}}}
    why: dict[str, str] = {}
    assert impl_rules(reg, "fake", cpa.CPU_FORWARD, masked, [Q, KV, KV, (16, 16)], 2, 4, why) == []
    assert why and all("attn_mask" in w for w in why.values())
    why.clear()
    assert impl_rules(reg, "fake", cpa.CPU_FORWARD, CAUSAL, [(2, 4, 18, 8), KV, KV], 2, 4, why) == []
    assert any("sequences differ" in w or "divisible" in w for w in why.values()), why


def test_an_implementation_combines_with_other_axes_but_never_on_two_or_over_its_own_split():
    impl_rule = ShardingRule((Shard(2),) * 3, (Shard(2),) * 2, impl="cp")
    heads = ShardingRule((Shard(1),) * 3, (Shard(1),) * 2)
    seq = ShardingRule((Shard(2),) * 3, (Shard(2),) * 2)  # an ordinary rule on the same dim (not causal)
    mesh = Mesh((2, 2))
    strats = expand_rules({2: [impl_rule, heads, seq]}, mesh, [Q, KV, KV], [Q, (2, 4, 16)])
    with_impl = [s for s in strats if s.impls]
    assert with_impl
    for s in with_impl:
        assert sum(1 for n in s.impls if n) == 1  # one axis runs it
        a = s.impl_axis()[0]
        other = 1 - a
        assert all(sh[other] != Shard(2) for sh in s.inputs + s.outputs)  # no nested split of its dim
    assert any(s.impls == ("cp", "") and s.inputs[0] == Sharding((Shard(2), Shard(1))) for s in with_impl)
    assert any(s.impls == ("", "cp") and s.inputs[0] == Sharding((Replicate(), Shard(2))) for s in with_impl)
    # the same placements without the implementation stay a strategy of their own
    assert Strategy(with_impl[0].inputs, with_impl[0].outputs) != with_impl[0]


def test_the_price_takes_the_other_axes_pieces_and_the_axis_links():
    reg = _registry()
    impl = reg.get(cpa.impl_name(SeqLayout("contiguous")))
    s = Strategy((Sharding((Shard(1), Shard(2))),) * 3, (Sharding((Shard(1), Shard(2))),) * 2, impls=("", impl.name))
    mesh = Mesh((2, 4), alpha=[1e-5, 2e-5], beta=[1e-9, 1e-8])
    assert local_shapes(s, [Q, KV, KV], mesh, 1) == [(2, 2, 16, 8), (2, 1, 16, 8), (2, 1, 16, 8)]
    dev = DEVICE_PRESETS["cpu"]
    t = impl_seconds(impl, s, 1, [Q, KV, KV], 4, 1e4, 8, mesh, dev, "float32")
    price = impl.price(local_shapes(s, [Q, KV, KV], mesh, 1), 4, 4)
    comm = price.calls * 3 * 2e-5 + price.comm_bytes * 1e-8
    assert price.calls == 2 and price.comm_bytes == 2 * 1 * 16 * 16 * 4 * 3 / 4
    assert comm < t < comm + 1e-3
    # a slower link on the implementation's axis costs more
    slow = Mesh((2, 4), alpha=[1e-5, 2e-4], beta=[1e-9, 1e-7])
    assert impl_seconds(impl, s, 1, [Q, KV, KV], 4, 1e4, 8, slow, dev, "float32") > t


def test_use_impl_parses_and_strategies_round_trip_through_json():
    (c,) = parse_constraints([{"impl": "cp_attention", "axis": 1}])
    assert c == UseImpl("cp_attention", 1) and c.to_json() == {"impl": "cp_attention", "axis": 1}
    assert c.hits(("", "cp_attention.allgather.contiguous")) and not c.hits(("cp_attention.x", ""))
    s = Strategy((Sharding((Shard(2),)),), (Sharding((Shard(2),)),), impls=("cp_attention.allgather.contiguous",))
    assert Strategy.from_json(s.to_json()) == s
    plain = Strategy((Sharding((Shard(0),)),), (Sharding((Shard(0),)),))
    assert len(plain.to_json()) == 2 and Strategy.from_json(plain.to_json()) == plain
    with pytest.raises(ValueError, match="UseImpl"):
        parse_constraints([{"nothing": 1}])


def test_the_workspace_is_what_the_implementation_gathers_at_the_other_axes_pieces():
    reg = _registry()
    fwd = reg.get(cpa.impl_name(SeqLayout("contiguous")))
    bwd = reg.get(cpa.impl_name(SeqLayout("contiguous"), True))
    s = Strategy((Sharding((Shard(1), Shard(2))),) * 3, (Sharding((Shard(1), Shard(2))),) * 2, impls=("", fwd.name))
    mesh = Mesh((2, 4))
    # K and V of 1 head each (2 split over axis 0), the whole sequence of 16, head dim 8, float32
    assert impl_workspace(fwd, s, 1, [Q, KV, KV], 4, mesh) == 2 * 1 * 16 * (8 + 8) * 4
    sb = Strategy((Sharding((Shard(1), Shard(2))),) * 6, (Sharding((Shard(1), Shard(2))),) * 3, impls=("", bwd.name))
    shapes6 = [Q, Q, KV, KV, Q, Q[:3]]
    assert impl_workspace(bwd, sb, 1, shapes6, 4, mesh) == 2 * (2 * 1 * 16 * 16 * 4)  # gathered, and their grads
    assert impl_workspace(bwd, sb, 1, shapes6, 2, mesh) == 2 * 1 * 16 * 16 * (2 + 4)  # grads summed in float32


def test_a_user_passes_use_impl_as_an_object_or_json_beside_names():
    from metadist_core.problem.constraints import split_constraints

    plain, named = split_constraints([UseImpl("cp_attention", 0), {"impl": "cp_attention", "axis": 1}, {"w": "R"}])
    assert plain == [UseImpl("cp_attention", 0), UseImpl("cp_attention", 1)] and named == {"w": "R"}
    assert split_constraints(UseImpl("cp_attention", 0))[0] == [UseImpl("cp_attention", 0)]
    assert split_constraints({"impl": "R"})[1] == {"impl": "R"}  # a parameter named impl stays a name
