"""The numpy reference frontend: a handful of ops, a graph builder and an interpreter.

It proves the core without any framework: ShardCombine discovers rules for
these ops exactly as it does for aten, lax or TE ops, and `metadist demo`
plans a small transformer block built from them. Op keys start with ``np.``.
Discovery runs in float64.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from metadist_core.config import load_settings
from metadist_core.driver.frontend import (
    Frontend,
    FrontendTraits,
    Lowered,
    Program,
    Resolved,
    Traced,
    Trials,
    WholeStep,
    not_supported,
)
from metadist_core.hookspecs import hookimpl
from metadist_core.ir.ir import MetaIR, MetaOp
from metadist_core.ir.mesh import Mesh
from metadist_core.driver.planner import plan_graph
from metadist_core.plugins import PluginManager
from metadist_core.discovery.shardcombine import OpSpec
from metadist_core.plan.simulate import simulate
from metadist_core.discovery.shardcombine import discover_rules

# -- the ops: key -> fn(*inputs, **attrs) ------------------------------------


def _softmax(x: np.ndarray, dim: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=dim, keepdims=True))
    return e / e.sum(axis=dim, keepdims=True)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, ndim: int = 1, eps: float = 1e-5) -> np.ndarray:
    axes = tuple(range(x.ndim - ndim, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _ax(attrs_dim):
    return tuple(attrs_dim) if isinstance(attrs_dim, list) else attrs_dim


OPS: dict[str, Callable[..., Any]] = {
    "np.matmul": lambda a, b: np.matmul(a, b),
    "np.add": lambda a, b: a + b,
    "np.sub": lambda a, b: a - b,
    "np.mul": lambda a, b: a * b,
    "np.div": lambda a, b: a / b,
    "np.scale": lambda a, *, factor: a * factor,
    "np.relu": lambda a: np.maximum(a, 0),
    "np.exp": np.exp,
    "np.tanh": np.tanh,
    "np.gelu": _gelu,
    "np.sum": lambda a, *, dim=None, keepdims=False: np.sum(a, axis=_ax(dim), keepdims=keepdims),
    "np.mean": lambda a, *, dim=None, keepdims=False: np.mean(a, axis=_ax(dim), keepdims=keepdims),
    "np.amax": lambda a, *, dim=None, keepdims=False: np.max(a, axis=_ax(dim), keepdims=keepdims),
    "np.softmax": lambda a, *, dim=-1: _softmax(a, dim),
    "np.layer_norm": lambda x, w, b, *, ndim=1, eps=1e-5: _layer_norm(x, w, b, ndim, eps),
    "np.reshape": lambda a, *, shape: np.reshape(a, shape),
    "np.transpose": lambda a, *, perm: np.transpose(a, perm),
    "np.concat": lambda *xs, dim=0: np.concatenate(xs, axis=dim),
}

RESHAPES = {"np.reshape"}


def run_op(key: str, inputs: Sequence[np.ndarray], attrs: dict | None = None) -> Any:
    if key not in OPS:
        raise KeyError(f"the reference frontend has no op {key!r}; it has {', '.join(sorted(OPS))}")
    return OPS[key](*inputs, **(attrs or {}))


# -- a graph builder -----------------------------------------------------------


class GraphBuilder:
    """Build a MetaIR from reference ops, shapes inferred by running on zeros.

    >>> g = GraphBuilder("mlp"); x = g.input("x", (8, 16)); w = g.param("w", (16, 4))
    >>> y = g.op("np.matmul", x, w); g.output(y); ir = g.ir
    """

    def __init__(self, name: str = "reference") -> None:
        self.ir = MetaIR(name)
        self._n = 0

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32", role: str = "input") -> str:
        self.ir.add_input(name, shape, dtype, role)
        return name

    def param(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        return self.input(name, shape, dtype, "parameter")

    def op(self, key: str, *inputs: str, **attrs: Any) -> str:
        zeros = [np.zeros(_known_shape(self.ir, v), dtype=np.float64) for v in inputs]
        out = run_op(key, zeros, attrs)
        name = f"{key.split('.')[-1]}_{self._n}"
        self._n += 1
        self.ir.add_op(key, list(inputs), [(name, np.shape(out), "float32")], attrs, id=f"op_{name}")
        return name

    def output(self, *names: str) -> None:
        self.ir.set_outputs(list(self.ir.outputs) + list(names))


def run_graph(ir: MetaIR, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Interpret a reference MetaIR on full (unsplit) arrays; every var's value by id."""
    env = dict(inputs)
    for op in ir.ops:
        out = run_op(op.key, [env[v] for v in op.inputs], op.attrs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for v, x in zip(op.outputs, outs):
            env[v] = np.asarray(x)
    return env


def transformer_block(batch: int = 4, seq: int = 8, width: int = 16, hidden: int = 32, name: str = "block") -> MetaIR:
    """A pre-norm MLP + single-head attention block with a mean loss, built from reference ops."""
    g = GraphBuilder(name)
    x = g.input("x", (batch, seq, width))
    ln_w, ln_b = g.param("ln_w", (width,)), g.param("ln_b", (width,))
    wq, wk, wv = (g.param(n, (width, width)) for n in ("wq", "wk", "wv"))
    w1, w2 = g.param("w1", (width, hidden)), g.param("w2", (hidden, width))
    h = g.op("np.layer_norm", x, ln_w, ln_b)
    q, k, v = g.op("np.matmul", h, wq), g.op("np.matmul", h, wk), g.op("np.matmul", h, wv)
    kt = g.op("np.transpose", k, perm=[0, 2, 1])
    s = g.op("np.scale", g.op("np.matmul", q, kt), factor=1.0 / math.sqrt(width))
    a = g.op("np.matmul", g.op("np.softmax", s, dim=-1), v)
    r = g.op("np.add", x, a)
    flat = g.op("np.reshape", r, shape=[batch * seq, width])
    m = g.op("np.matmul", g.op("np.gelu", g.op("np.matmul", flat, w1)), w2)
    out = g.op("np.add", flat, m)
    loss = g.op("np.mean", g.op("np.mul", out, out))
    g.output(loss)
    return g.ir


# -- the frontend adapter -----------------------------------------------------------


def op_spec(op: MetaOp, graph: MetaIR, seed: int = 0) -> OpSpec:
    """An OpSpec running a reference op in float64 on random example inputs."""
    rng = np.random.default_rng(seed)
    examples = [rng.standard_normal(graph.vars[v].shape) for v in op.inputs]
    attrs = dict(op.attrs)
    if op.key in RESHAPES:
        out_shape = _known_shape(graph, op.outputs[0])
        return OpSpec(
            lambda x: run_op(op.key, [x], attrs),
            examples,
            op.key,
            reshape_fn=lambda x, shape: np.reshape(x, shape),
            out_shape=out_shape,
        )
    return OpSpec(lambda *xs: run_op(op.key, xs, attrs), examples, op.key)


def _known_shape(graph: MetaIR, v: str) -> tuple[int, ...]:
    """The shape of ``v``, which a reference op needs."""
    shape = graph.vars[v].shape
    if shape is None:
        raise ValueError(
            f"value {v!r} of graph {graph.name!r} has no known shape; the reference ops run on "
            "numpy arrays and need every value's shape (give it one when building the graph)"
        )
    return tuple(shape)


def op_cost(op: MetaOp, graph: MetaIR) -> tuple[float, float]:
    ins = [graph.vars[v] for v in op.inputs]
    outs = [graph.vars[v] for v in op.outputs]
    nbytes = sum(v.nbytes for v in ins + outs)
    if op.key == "np.matmul":
        a = _known_shape(graph, op.inputs[0])
        flops = 2 * math.prod(_known_shape(graph, op.outputs[0])) * a[-1]
    else:
        flops = sum(v.numel for v in ins + outs)
    return (float(flops), float(nbytes))


class ReferenceFrontend(Frontend):
    """The numpy reference frontend: a "step" is a MetaIR of ``np.*`` ops; it runs on simulated devices.

    ``trace(fn, args, kwargs)`` takes ``fn(*args, **kwargs) -> MetaIR`` (a graph
    builder); the lowered step takes one numpy array per graph input and
    returns ``(outputs, state)`` dicts, split over the mesh exactly as the plan
    says (:mod:`metadist_core.plan.simulate`).
    """

    name = "reference"
    description = "numpy reference ops, for tests and the framework-free demo"
    traits = FrontendTraits(op_prefixes=("np.",), runner_module="metadist_core.reference.plugin", proxy_shapes=True)

    def signature(self, args: tuple, kwargs: dict) -> Any:
        return (tuple(repr(a) for a in args), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))

    def trace(self, fn: Any, args: tuple, kwargs: dict) -> Traced:
        graph = fn(*args, **kwargs)
        if not isinstance(graph, MetaIR):
            raise TypeError(
                f"the reference frontend traces functions that return a MetaIR; "
                f"{getattr(fn, '__name__', fn)!r} returned {type(graph).__name__}"
            )
        return Traced(graph)

    def resolve_mesh(self, mesh: Any, profile: Any) -> Resolved:
        if mesh is None:
            mesh = (2,)
        if isinstance(mesh, Mesh):
            return Resolved(mesh)
        shape = Mesh.parse(mesh).shape if isinstance(mesh, str) else ((mesh,) if isinstance(mesh, int) else tuple(mesh))
        return Resolved(profile.mesh(shape))

    def lower(self, traced: Traced, program: Program, resolved: Resolved, settings: Any) -> Lowered:
        """The plan run on simulated devices (:func:`metadist_core.plan.simulate.simulate`)."""
        if isinstance(program, Trials):
            return Lowered()
        if not isinstance(program, WholeStep):
            raise not_supported(self.name, program)
        graph, plan, mesh = traced.graph, program.plan, resolved.mesh

        def run(*arrays: np.ndarray) -> tuple[dict, dict]:
            if len(arrays) != len(graph.inputs):
                raise TypeError(
                    f"{graph.name} takes {len(graph.inputs)} inputs ({', '.join(graph.inputs)}), got {len(arrays)}"
                )
            return simulate(graph, plan, mesh, dict(zip(graph.inputs, arrays)), run_local)

        return Lowered(run)

    def demo(self, args: Sequence[str]) -> int:
        mesh = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--mesh"), "4")
        solver = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--solver"), None)
        return run_demo(mesh_text=mesh, solver=solver)


@hookimpl
def metadist_frontend() -> ReferenceFrontend:
    return ReferenceFrontend()


def rules_for(key: str, *example_inputs: np.ndarray, axis_size: int = 2, **attrs: Any):
    """The verified one-axis ShardingRules of reference op ``key`` on these example inputs."""

    xs = [np.asarray(x, dtype=np.float64) for x in example_inputs]
    if key in RESHAPES:
        out_shape = tuple(np.reshape(xs[0], attrs["shape"]).shape)
        spec = OpSpec(
            lambda x: run_op(key, [x], attrs),
            xs,
            key,
            reshape_fn=lambda x, shape: np.reshape(x, shape),
            out_shape=out_shape,
        )
    else:
        spec = OpSpec(lambda *a: run_op(key, a, attrs), xs, key)
    return discover_rules(spec, axis_size)


def run_local(op: MetaOp, inputs: list, out_shapes: list) -> Any:
    """Run one reference op on one simulated device's pieces (for :mod:`metadist_core.plan.simulate`)."""
    if op.key in RESHAPES:
        return np.reshape(inputs[0], out_shapes[0])
    return run_op(op.key, inputs, op.attrs)


def run_demo(mesh_text: str = "4", solver: str | None = None, cache_dir: str | None = None) -> int:
    mesh = Mesh.parse(mesh_text)
    settings = load_settings(solver=solver, cache_dir=cache_dir)
    pm = PluginManager()
    graph = transformer_block(batch=8, seq=16, width=32, hidden=128, name="demo-block")
    print(
        f"MetaDist demo: a transformer block ({len(graph.ops)} ops, numpy reference frontend) "
        f"on a simulated mesh {mesh} with solver {settings.solver!r}"
    )
    result = plan_graph(graph, mesh, plugins=pm, settings=dataclasses.replace(settings, progress=True))
    sizes = sorted({n for n in mesh.shape if n > 1})
    keys = {(e.key, n) for n in sizes for op in graph.ops if (e := result.rulebook.lookup(op, graph, n))}
    n_rules = sum(
        len(result.rulebook.rules_for(op, graph, n)) for n in sizes for op in graph.unique_signatures().values()
    )
    print(
        f"rules: {n_rules} verified one-axis rules over {len(graph.unique_signatures())} op signatures and "
        f"{result.rulebook.discovered + result.rulebook.cache_hits} op patterns "
        f"({result.rulebook.cache_hits} read from the cache)"
    )
    del keys
    print(result.plan)

    rng = np.random.default_rng(0)
    inputs = {v: rng.standard_normal(graph.vars[v].shape) for v in graph.inputs}
    t = time.perf_counter()
    ref = run_graph(graph, inputs)
    t_single = time.perf_counter() - t
    t = time.perf_counter()
    outs, _ = simulate(graph, result.plan, mesh, inputs, run_local)
    t_sim = time.perf_counter() - t
    loss = graph.outputs[0]
    diff = abs(float(outs[loss]) - float(ref[loss]))
    print(
        f"loss: {float(outs[loss]):.10f} on {mesh.size} simulated devices, "
        f"{float(ref[loss]):.10f} on one device (|diff| {diff:.1e})"
    )
    print(
        "timings: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items())
        + f", one-device step {t_single * 1e3:.1f} ms, simulated step {t_sim * 1e3:.1f} ms"
    )
    return 0 if diff <= 1e-9 * max(1.0, abs(float(ref[loss]))) else 1
