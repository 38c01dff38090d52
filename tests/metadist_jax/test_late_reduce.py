"""A reduce planned before a transpose runs after it, so that XLA folds the transpose into its dot.

A weight gradient is ``dot_general`` then ``transpose`` in JAX's jaxpr. Where the plan reduces the dot's
Partial output before the transpose (a tie in the cost model: the same bytes either way), a collective
stands between the two and XLA fuses the transpose into each reader as a strided read: the MLP example's
data-parallel step on 8 virtual devices ran 53.6 ms so, 22 ms with the all-reduce after it. The lowering
runs such a transpose on the Partial value and the collectives on its result, their dims permuted.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from metadist_core.plan.interpret import late_reduces  # noqa: E402
from metadist_core.plan.overlap import priced_collectives  # noqa: E402
from metadist_core.plan.plan import ShardingPlan  # noqa: E402
from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.hlo import collectives  # noqa: E402
from metadist_jax.lower import build_body, lower_plan, moves_only  # noqa: E402

from _jax_models import mlp_case  # noqa: E402


def _reduce_before_transposes(step):
    """The compiled plan with every transpose made to read its input whole, so that the reduce of a dot's
    Partial value runs before it, as the solver's tie-break sometimes leaves it; and their ids."""
    prob, plan = step.problem, step.plan
    choices = list(plan.choices)
    ids = []
    for i, n in enumerate(prob.nodes):
        if n.kind != "op" or n.key != "jax.lax.transpose":
            continue
        whole = [
            k
            for k, o in enumerate(n.options)
            if o.inputs[0].is_fully_replicated() and o.outputs[0].is_fully_replicated()
        ]
        assert whole, f"transpose {n.id} has no replicated option: {n.options}"
        choices[i] = whole[0]
        prob.allowed[i][whole[0]] = True  # the ddp preset pins what the solver chose
        ids.append(n.id)
    return ShardingPlan.from_choices(prob, choices), ids


def _bytes_by_kind(pairs) -> dict:
    out: dict = {}
    for kind, nbytes in pairs:
        out[kind] = out.get(kind, 0) + nbytes
    return out


def _whole_gradients(hlo: str, weights: set) -> list[tuple[int, int]]:
    """The 2-D results of the HLO's all-reduces and all-gathers that hold as many elements as a weight:
    whole weight gradients, in the weight's own (in, out) shape where the transpose ran before the collective."""
    sizes = {a * b for a, b in weights}
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) (all-reduce|all-gather)(-start)?\(", line)
        if m:
            out += [
                (int(a), int(b)) for a, b in re.findall(r"f32\[(\d+),(\d+)\]", m.group(1)) if int(a) * int(b) in sizes
            ]
    return out


@pytest.mark.parametrize(
    "mesh,features", [((8,), None), ((2, 4), None), ((2, 4), 12)], ids=["8", "2x4", "2x4-features12"]
)
def test_a_reduce_before_a_transpose_runs_after_it(devices8, rule_cache, mesh, features):
    """features=12: the first weight's gradient is (12, 256), whose dim 0 does not split 8 ways, so its
    reduce-scatter and all-gather act on the dim the transpose moves the planned one to."""
    mlp, opt, params, opt_state, batch = mlp_case()
    if features is not None:
        sizes = (features,) + tuple(mlp.TEST_SIZES[1:])
        params = mlp.init_params(jax.random.key(0), sizes)
        opt_state = opt.init(params)
        batch = mlp.make_batch(0, **{**mlp.TEST_BATCH, "features": features})
    step = metadist_compile(mlp.make_step(opt), mesh=mesh, cache_dir=rule_cache, strategy="ddp", autotune=False)
    step(params, opt_state, batch)
    args = step.lowered().operands((params, opt_state, batch), {})
    want = [np.asarray(x) for x in step.lowered().program.fn(*args)]

    plan, ids = _reduce_before_transposes(step)
    graph = step.graph
    inc, _ = plan.edge_index()
    assert ids and all(inc[(t, 0)].collectives for t in ids), str(plan)  # the weight gradients' transposes
    late = late_reduces(graph, plan, inc, step.problem.mesh, moves_only)
    assert set(late) == set(ids)
    if features is not None:  # some edge scatters, and on the first weight's gradient the dim moves
        assert any(d != e for dims in late.values() for d, e in dims.items()), late

    prog = lower_plan(graph, plan, step.problem.mesh, step.jax_mesh)
    for got, w in zip(prog.fn(*args), want):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5, atol=1e-6)
    hlo = prog.fn.lower(*args).compile().as_text()
    # the bytes priced for each kind of collective (XLA may combine all-reduces); each gradient moved in its
    # weight's shape: its transpose ran on the Partial value, next to the dot
    assert _bytes_by_kind(collectives(hlo)) == _bytes_by_kind(
        (c.kind, int(c.nbytes)) for _, c in priced_collectives(plan)
    )
    weights = {tuple(layer["w"].shape) for layer in params.values()}
    moved = _whole_gradients(hlo, weights)
    assert moved and set(moved) <= weights, (moved, weights)

    # held before the transposes, the reduces leave them standing
    body = build_body(graph, plan, step.problem.mesh, list(graph.outputs), reduce_after=lambda op: None)
    held = jax.jit(
        jax.shard_map(
            body, mesh=step.jax_mesh, in_specs=tuple(prog.in_specs), out_specs=tuple(prog.out_specs), check_vma=False
        )
    )
    for got, w in zip(held(*args), want):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5, atol=1e-6)
    assert not set(_whole_gradients(held.lower(*args).compile().as_text(), weights)) <= weights
