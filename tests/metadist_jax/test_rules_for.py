"""rules_for: the verified one-axis rules of a JAX primitive or callable (run in float64)."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from metadist_core.placement import Partial, Replicate, Shard  # noqa: E402
from metadist_jax import rules_for  # noqa: E402
from metadist_jax.oprunner import eqn_flops  # noqa: E402

R = Replicate()


def _rules(rs):
    return {(r.inputs, r.outputs) for r in rs}


def test_matmul_rules():
    rs = _rules(rules_for(jnp.matmul, np.ones((8, 4), np.float32), np.ones((4, 6), np.float32)))
    assert ((Shard(0), R), (Shard(0),)) in rs          # split rows
    assert ((R, Shard(1)), (Shard(1),)) in rs          # split columns
    assert ((Shard(1), Shard(0)), (Partial("sum"),)) in rs   # split the contraction: partial sums
    assert ((Shard(0), Shard(0)), (Shard(0),)) not in rs


def test_primitive_with_params():
    rs = _rules(rules_for(lax.reduce_sum_p, np.ones((4, 6)), axes=(1,)))
    assert ((Shard(0),), (Shard(0),)) in rs
    assert ((Shard(1),), (Partial("sum"),)) in rs
    assert ((Partial("max"),), (Partial("max"),)) not in rs
    rs = _rules(rules_for(lax.exp_p, np.ones((4, 6))))
    assert ((Shard(1),), (Shard(1),)) in rs and ((Partial("sum"),), (Partial("sum"),)) not in rs


def test_shape_carrying_primitives_split_through_their_params():
    # reshape: the major dim of a merged group carries the split
    rs = _rules(rules_for(lambda x: x.reshape(8, 3), np.ones((4, 6))))
    assert ((Shard(0),), (Shard(0),)) in rs and ((Shard(1),), (Shard(1),)) not in rs
    # broadcast_in_dim: the broadcast's shape param follows the local piece
    rs = _rules(rules_for(lambda b: jnp.broadcast_to(b, (5, 6)), np.ones((6,))))
    assert ((Shard(0),), (Shard(1),)) in rs


def test_gather_rules_use_in_range_indices():
    table = np.arange(24, dtype=np.float32).reshape(6, 4)
    idx = np.array([5, 0, 3, 1], np.int32)
    rs = _rules(rules_for(lambda t, i: t[i], table, idx))
    assert ((Shard(1), R), (Shard(1),)) in rs            # embedding split on its width
    assert ((R, Shard(0)), (Shard(0),)) in rs            # lookups split by index
    assert ((Shard(0), R), (R,)) not in rs and ((Shard(0), R), (Partial("sum"),)) not in rs


def test_flops_of_dot_general():
    a = jax.ShapeDtypeStruct((8, 4), np.float32)
    b = jax.ShapeDtypeStruct((4, 6), np.float32)
    o = jax.ShapeDtypeStruct((8, 6), np.float32)
    assert eqn_flops("dot_general", {"dimension_numbers": (((1,), (0,)), ((), ()))}, [a, b], [o]) == 2 * 8 * 6 * 4


def test_discovery_leaves_the_users_dtypes_alone():
    rules_for(lax.exp_p, np.ones((4, 6), np.float32))
    assert not jax.config.jax_enable_x64
    assert jnp.ones(2).dtype == jnp.float32
