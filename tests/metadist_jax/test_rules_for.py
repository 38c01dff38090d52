"""rules_for: the verified one-axis rules of a JAX primitive or callable (run in float64)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from metadist_core.ir.placement import Partial, Replicate, Shard  # noqa: E402
from metadist_jax import rules_for  # noqa: E402
from metadist_jax.oprunner import eqn_flops  # noqa: E402

R = Replicate()


def _rules(rs):
    return {(r.inputs, r.outputs) for r in rs}


def test_matmul_rules():
    rs = _rules(rules_for(jnp.matmul, np.ones((8, 4), np.float32), np.ones((4, 6), np.float32)))
    assert ((Shard(0), R), (Shard(0),)) in rs  # split rows
    assert ((R, Shard(1)), (Shard(1),)) in rs  # split columns
    assert ((Shard(1), Shard(0)), (Partial("sum"),)) in rs  # split the contraction: partial sums
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
    assert ((Shard(1), R), (Shard(1),)) in rs  # embedding split on its width
    assert ((R, Shard(0)), (Shard(0),)) in rs  # lookups split by index
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


def test_a_scatter_add_takes_its_rows_split_into_a_partial_table():
    """The embedding's gradient: a scatter-add of the batch's rows into a zero table. Its combiner (a jaxpr
    of float32 scalars) is retyped, so it runs in float64 like other ops and the data-parallel rule is found
    (in float32 the pieces' partial sums missed the tolerance: 6.9e-6 against about 2e-7). The rule then
    holds on data discovery did not draw: rows and ids split on dim 0, the table a partial sum."""
    V, D, B, S = 64, 16, 8, 8
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(2,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (B, S, 1)).astype(np.int32)
    rows = rng.standard_normal((B, S, D)).astype(np.float32)
    scatter = lambda t, i, u: lax.scatter_add(t, i, u, dn)  # noqa: E731
    rs = _rules(rules_for(scatter, np.zeros((V, D), np.float32), ids, rows))
    rule = ((Partial("sum"), Shard(0), Shard(0)), (Partial("sum"),))
    assert rule in rs, sorted(map(str, rs))

    other = np.random.default_rng(7)  # fresh data, a non-zero table
    table = other.standard_normal((V, D))
    ids2 = other.integers(0, V, (B, S, 1)).astype(np.int32)
    rows2 = other.standard_normal((B, S, D))
    with jax.enable_x64(True):
        whole = np.asarray(scatter(table, ids2, rows2))
        part = other.standard_normal((V, D))
        pieces = [
            np.asarray(scatter(t, ids2[k * B // 2 : (k + 1) * B // 2], rows2[k * B // 2 : (k + 1) * B // 2]))
            for k, t in enumerate((table - part, part))
        ]
    np.testing.assert_allclose(pieces[0] + pieces[1], whole, rtol=1e-12, atol=1e-12)
