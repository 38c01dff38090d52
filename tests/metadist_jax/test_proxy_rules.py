"""JAX ops are discovered at proxy sizes: size-bearing params of a primitive (a broadcast's shape, a
reshape's new sizes, slice bounds and sizes) are rewritten by value as metadist_core.discovery.patterns.proxy_op
rewrites the op's attrs (metadist_jax.oprunner.proxied_payload); an op carrying a jaxpr, a literal with a
large dim or a large param that is no size of its tensors is discovered at its real shapes. Every rule
the transformer example's step gets is re-checked by the independent checker of the torch tests."""

import logging
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from metadist_core.discovery.discover import discover  # noqa: E402
from metadist_core.discovery.patterns import NoProxy  # noqa: E402
from metadist_core.plugins import PluginManager  # noqa: E402
from metadist_core.discovery.rules import RuleBook  # noqa: E402
from metadist_jax.oprunner import proxied_payload  # noqa: E402
from metadist_jax.payload import OpPayload  # noqa: E402

from _jax_models import load_example  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "metadist_torch"))


def _eqn(fn, *args):
    """The one equation ``fn`` traces to, as an OpPayload."""
    eqn = jax.make_jaxpr(fn)(*args).jaxpr.eqns[-1]
    return OpPayload(eqn.primitive, dict(eqn.params), list(range(len(eqn.invars))), tuple(v.aval for v in eqn.outvars))


def test_size_params_follow_the_proxy_and_the_rest_refuses():
    x = jnp.zeros((48, 20))
    bcast = _eqn(lambda a: jax.lax.broadcast_in_dim(a, (3, 48, 20), (1, 2)), x)
    p = proxied_payload(bcast, {48: 13, 20: 7}, 4)
    assert p.params["shape"] == (3, 13, 7) and p.params["broadcast_dimensions"] == (1, 2)
    assert tuple(p.out_avals[0].shape) == (3, 13, 7)
    out = p.prim.bind(jnp.ones((13, 7)), **p.params)
    assert out.shape == (3, 13, 7)
    sl = _eqn(lambda a: jax.lax.slice(a, (0, 0), (48, 10)), x)  # 10: a bound that is no size of the op
    with pytest.raises(NoProxy):
        proxied_payload(sl, {48: 13, 20: 7}, 4)
    scan = _eqn(lambda a: jax.lax.scan(lambda c, r: (c + r, c), jnp.zeros(20), a)[0], x)
    with pytest.raises(NoProxy):
        proxied_payload(scan, {48: 13, 20: 7}, 4)


def test_transformer_rules_at_proxy_sizes_pass_the_independent_checker(caplog):
    from test_rule_soundness import check_book

    T = load_example("transformer")
    cfg = T.Config(vocab=96, width=32, heads=2, layers=1, hidden=128, seq=16)
    model, params = T.init(cfg)
    opt = optax.adam(1e-3)
    pm = PluginManager()
    traced = pm.frontend("jax").trace(T.make_step(model, opt), (params, opt.init(params), T.make_batch(0, cfg)), {})
    graph = traced.graph
    with caplog.at_level(logging.INFO, logger="metadist"):
        book = discover(graph, pm, RuleBook(), axis_sizes=(2,), progress=False, workers=1)
    real = {r.getMessage().split(" ")[1] for r in caplog.records if "discovered at its real shapes" in r.getMessage()}
    keys = {op.key for op in graph.ops}
    assert len(real) < len(keys) / 2, f"most op kinds should run at proxy sizes; at real shapes: {sorted(real)}"
    assert any(len(e.rules) > 1 for e in book.entries.values())
    wrong = check_book(graph, book, pm, 2)
    assert not wrong, f"{len(wrong)} wrong rules:\n" + "\n".join(wrong[:20])
