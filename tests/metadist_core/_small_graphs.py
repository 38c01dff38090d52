"""Small MetaIR graphs with hand-derived rules, for problem and solver tests."""

from metadist_core.ir.ir import MetaIR
from metadist_core.discovery.rules import OpRules, RuleBook


def reference_pm():
    """A PluginManager with the numpy reference frontend only (no entry points)."""
    from metadist_core.hookspecs import hookimpl
    from metadist_core.plugins import PluginManager
    from metadist_core.reference.plugin import ReferenceFrontend

    class _Plugin:
        @hookimpl
        def metadist_frontend(self):
            return ReferenceFrontend()

    pm = PluginManager(load_entry_points=False)
    pm.register(_Plugin(), "frontend", "reference")
    return pm


def rules_by_op(book: RuleBook, graph: MetaIR, n: int) -> dict:
    """``{op id: set of its rules on an axis of n}``."""
    return {op.id: set(book.rules_for(op, graph, n)) for op in graph.ops}


def rulebook(graph: MetaIR) -> RuleBook:
    from benchmarks.synthetic_rules import rules_for_op

    book = RuleBook()
    for _sig, op in graph.unique_signatures().items():
        book.add_op(op, graph, OpRules(op.key, rules_for_op(op, graph)))
    return book


def linear_step(m=8, k=4, n=6) -> MetaIR:
    """loss = sum(relu-free scale(x @ w)); w updated by a scaled gradient stand-in."""
    g = MetaIR("linear")
    g.add_input("x", (m, k), "float32", "input")
    g.add_input("w", (k, n), "float32", "parameter")
    g.add_op("aten.mm.default", ["x", "w"], [("y", (m, n), "float32")], id="mm")
    g.add_op("aten.mul.Tensor", ["y"], [("z", (m, n), "float32")], {"scalar": 0.5}, id="scale")
    g.add_op("aten.sum.dim_IntList", ["z"], [("s", (n,), "float32")], {"dims": [0]}, id="sum")
    g.add_op("aten.mul.Tensor", ["w"], [("w2", (k, n), "float32")], {"scalar": 0.9}, id="decay")
    g.set_outputs(["s", "w2"])
    g.alias("w", "w2")
    return g


def mm_only(m=8, k=4, n=8) -> MetaIR:
    g = MetaIR("mm")
    g.add_input("x", (m, k), "float32", "input")
    g.add_input("w", (k, n), "float32", "parameter")
    g.add_op("aten.mm.default", ["x", "w"], [("y", (m, n), "float32")], id="mm")
    g.set_outputs(["y"])
    return g


def scaled_by_param(m=4096, k=1024, n=64) -> MetaIR:
    """RMSNorm's ``gain * x`` (the parameter first) feeding a matmul: a replicated gain must not tie x's product
    to being replicated (coarsening once rode on the gain and lost the batch-split optimum)."""
    g = MetaIR("scaled_by_param")
    g.add_input("x", (m, k), "float32", "input")
    g.add_input("gain", (k,), "float32", "parameter")
    g.add_input("w", (k, n), "float32", "parameter")
    g.add_op("aten.mul.Tensor", ["gain", "x"], [("y", (m, k), "float32")], id="norm")
    g.add_op("aten.mm.default", ["y", "w"], [("z", (m, n), "float32")], id="mm")
    g.add_op("aten.sum.dim_IntList", ["z"], [("s", (n,), "float32")], {"dims": [0]}, id="sum")
    g.set_outputs(["s"])
    return g
