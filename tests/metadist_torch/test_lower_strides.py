"""The per-rank program runs on the values it is handed, whatever their strides.

A collective hands a rank a contiguous tensor where the trace saw a transposed one, and some kernels lay
their output out after their input (CPU flash attention follows the query's layout). A view that was legal
at the traced strides (the attention output transposed back and merged into one dim) must still run.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from metadist_core.driver.compile import replicated_plan  # noqa: E402
from metadist_core.ir.mesh import Mesh  # noqa: E402
from metadist_torch.lower.lower import lower_plan  # noqa: E402
from metadist_torch.plugin import TorchFrontend  # noqa: E402


def _attention(q, k, v):
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


def test_a_view_legal_only_at_the_traced_strides_runs_on_contiguous_inputs():
    g = torch.Generator().manual_seed(0)
    # (batch, heads, seq, dim) over (batch, seq, heads, dim) memory, as a Linear's output viewed into heads
    q, k, v = (torch.randn(2, 8, 4, 16, generator=g).transpose(1, 2) for _ in range(3))
    tr = TorchFrontend().trace(_attention, (q, k, v), {})
    views = [op for op in tr.graph.ops if op.key == "aten.view.default"]
    assert views, [op.key for op in tr.graph.ops]  # the merge traced as a view, legal at the traced strides
    mesh = Mesh((1,))
    plan, _ = replicated_plan(tr.graph, mesh)
    rg = lower_plan(tr.graph, plan, mesh, coords=(0,), groups=None, coalesce=False)
    flat = [t.contiguous() for t in (q, k, v)]  # the same values as a collective hands them over
    out = torch.nn.functional.scaled_dot_product_attention(*flat, is_causal=True).transpose(1, 2)
    with pytest.raises(RuntimeError, match="view size is not compatible"):  # the traced view, run as traced
        out.view(2, 8, -1)
    by_name = dict(zip(tr.graph.inputs, flat))
    got = rg(*[by_name[n] for n in rg.input_vars])
    torch.testing.assert_close(got[0], _attention(q, k, v))
