"""Synthetic GPT-2 training steps as MetaIR: forward, backward and an elementwise AdamW.

Same sizes as the recorded graphs in tests/data/graphs (2/12/48 layers, widths
128/768/1600, vocab 1024/50257, batch 8 x seq 128), written directly with aten
op keys so that the solver benchmark needs no frontend. Scalars are attributes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from metadist_core.ir.ir import MetaIR

CONFIGS = {
    "gpt2-tiny-2l": dict(layers=2, width=128, heads=4, vocab=1024),
    "gpt2-small-12l": dict(layers=12, width=768, heads=12, vocab=50257),
    "gpt2-xl-48l": dict(layers=48, width=1600, heads=25, vocab=50257),
}


@dataclass
class Gpt2Graph:
    graph: MetaIR
    op_costs: dict  # op id -> (flops, bytes)
    params: dict = field(default_factory=dict)  # param var -> kind (col_w, col_b, row_w, row_b, ln, wte, wpe)
    states: dict = field(default_factory=dict)  # param var -> (exp_avg var, exp_avg_sq var)
    batch: list = field(default_factory=list)  # the token inputs
    residual: list = field(default_factory=list)  # the residual stream values between blocks


class _B:
    def __init__(self, name: str) -> None:
        self.g = MetaIR(name)
        self.costs: dict = {}
        self.n = 0

    def op(self, key, inputs, outs, attrs=None, flops=None):
        ids = []
        for shape, dtype in outs:
            self.n += 1
            ids.append((f"v{self.n}", shape, dtype))
        o = self.g.add_op(key, inputs, ids, attrs)
        nb = sum(self.g.vars[v].nbytes for v in list(inputs) + list(o.outputs) if self.g.vars[v].is_tensor)
        fl = flops if flops is not None else sum(self.g.vars[v].numel for v in o.outputs)
        self.costs[o.id] = (float(fl), float(nb))
        return o.outputs if len(o.outputs) > 1 else o.outputs[0]

    def shape(self, v):
        return self.g.vars[v].shape

    def ew(self, name, *xs, scalar=None):
        attrs = {} if scalar is None else {"scalar": scalar}
        shp = max((self.shape(x) for x in xs), key=len)
        return self.op(
            f"aten.{name}.Tensor" if name in ("add", "sub", "mul", "div") else f"aten.{name}.default",
            list(xs),
            [(shp, "float32")],
            attrs,
        )

    def view(self, x, shape):
        return self.op("aten.view.default", [x], [(tuple(shape), self.g.vars[x].dtype)], {"size": list(shape)})

    def t(self, x):
        a, b = self.shape(x)
        return self.op("aten.t.default", [x], [((b, a), "float32")], {"dims": [0, 1]})

    def transpose(self, x, d0, d1):
        s = list(self.shape(x))
        s[d0], s[d1] = s[d1], s[d0]
        return self.op("aten.transpose.int", [x], [(tuple(s), "float32")], {"dims": [d0, d1]})

    def mm(self, a, b):
        (m, k), (_, n) = self.shape(a), self.shape(b)
        return self.op("aten.mm.default", [a, b], [((m, n), "float32")], flops=2 * m * n * k)

    def addmm(self, bias, x, w):
        (m, k), (_, n) = self.shape(x), self.shape(w)
        return self.op("aten.addmm.default", [bias, x, w], [((m, n), "float32")], flops=2 * m * n * k + m * n)

    def sum0(self, x, dims):
        s = tuple(d for i, d in enumerate(self.shape(x)) if i not in dims)
        return self.op("aten.sum.dim_IntList", [x], [(s, "float32")], {"dims": list(dims)})


def build_gpt2(name: str = "gpt2-tiny-2l", batch: int = 8, seq: int = 128, layers: int | None = None) -> Gpt2Graph:
    """The whole training step of a GPT-2 configuration from :data:`CONFIGS`."""
    cfg = dict(CONFIGS[name])
    if layers is not None:
        cfg["layers"] = layers
    L, H, nh, V = cfg["layers"], cfg["width"], cfg["heads"], cfg["vocab"]
    hd, T = H // nh, batch * seq
    b = _B(f"{name}-{L}l" if layers is not None else name)
    g = b.g
    out = Gpt2Graph(g, b.costs)

    def param(pid, shape, kind):
        g.add_input(pid, shape, "float32", "parameter")
        out.params[pid] = kind
        return pid

    wte = param("wte", (V, H), "wte")
    wpe = param("wpe", (seq, H), "wpe")
    layer_params = []
    for i in range(L):
        p = {
            k: param(f"h{i}.{k}", shp, kind)
            for k, shp, kind in (
                ("ln1.w", (H,), "ln"),
                ("ln1.b", (H,), "ln"),
                ("attn.w", (H, 3 * H), "col_w"),
                ("attn.b", (3 * H,), "col_b"),
                ("proj.w", (H, H), "row_w"),
                ("proj.b", (H,), "row_b"),
                ("ln2.w", (H,), "ln"),
                ("ln2.b", (H,), "ln"),
                ("fc.w", (H, 4 * H), "col_w"),
                ("fc.b", (4 * H,), "col_b"),
                ("proj2.w", (4 * H, H), "row_w"),
                ("proj2.b", (H,), "row_b"),
            )
        }
        layer_params.append(p)
    lnf_w, lnf_b = param("lnf.w", (H,), "ln"), param("lnf.b", (H,), "ln")
    for pid in list(out.params):
        shp = g.vars[pid].shape
        m = g.add_input(f"{pid}.exp_avg", shp, "float32", "optimizer_state").id
        v = g.add_input(f"{pid}.exp_avg_sq", shp, "float32", "optimizer_state").id
        out.states[pid] = (m, v)
    ids = g.add_input("ids", (batch, seq), "int64", "input").id
    labels = g.add_input("labels", (T,), "int64", "input").id
    out.batch = [ids, labels]

    # -- forward ----------------------------------------------------------
    def ln(x, w, bb):
        return b.op(
            "aten.native_layer_norm.default",
            [x, w, bb],
            [(b.shape(x), "float32"), (b.shape(x)[:-1] + (1,), "float32"), (b.shape(x)[:-1] + (1,), "float32")],
            {"normalized_shape": [H], "eps": 1e-5},
            flops=8 * math.prod(b.shape(x)),
        )

    emb = b.op("aten.embedding.default", [wte, ids], [((batch, seq, H), "float32")])
    h = b.ew("add", emb, wpe)
    out.residual.append(h)
    saved = []
    for p in layer_params:
        x1, mean1, rstd1 = ln(h, p["ln1.w"], p["ln1.b"])
        x1v = b.view(x1, (T, H))
        qkv = b.addmm(p["attn.b"], x1v, p["attn.w"])
        qkv3 = b.view(qkv, (batch, seq, 3 * H))
        q, k, v = b.op("aten.split.Tensor", [qkv3], [((batch, seq, H), "float32")] * 3, {"dim": 2, "size": H})
        heads = [b.transpose(b.view(z, (batch, seq, nh, hd)), 1, 2) for z in (q, k, v)]
        att_fl = 4 * batch * nh * seq * seq * hd
        ao, lse = b.op(
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            heads,
            [((batch, nh, seq, hd), "float32"), ((batch, nh, seq), "float32")],
            {"causal": True},
            flops=att_fl,
        )
        aot = b.transpose(ao, 1, 2)
        aov = b.view(aot, (T, H))
        pr = b.addmm(p["proj.b"], aov, p["proj.w"])
        h1 = b.ew("add", h, b.view(pr, (batch, seq, H)))
        x2, mean2, rstd2 = ln(h1, p["ln2.w"], p["ln2.b"])
        x2v = b.view(x2, (T, H))
        fc = b.addmm(p["fc.b"], x2v, p["fc.w"])
        ge = b.op("aten.gelu.default", [fc], [((T, 4 * H), "float32")], {"approximate": "tanh"})
        pr2 = b.addmm(p["proj2.b"], ge, p["proj2.w"])
        h2 = b.ew("add", h1, b.view(pr2, (batch, seq, H)))
        out.residual.append(h2)
        saved.append(
            dict(
                h=h,
                x1=x1,
                mean1=mean1,
                rstd1=rstd1,
                x1v=x1v,
                heads=heads,
                ao=ao,
                lse=lse,
                aov=aov,
                h1=h1,
                x2=x2,
                mean2=mean2,
                rstd2=rstd2,
                x2v=x2v,
                fc=fc,
                ge=ge,
            )
        )
        h = h2
    xf, meanf, rstdf = ln(h, lnf_w, lnf_b)
    xfv = b.view(xf, (T, H))
    wte_t = b.t(wte)
    logits = b.mm(xfv, wte_t)
    logp = b.op("aten._log_softmax.default", [logits], [((T, V), "float32")], {"dim": 1}, flops=4 * T * V)
    loss, tw = b.op(
        "aten.nll_loss_forward.default", [logp, labels], [((), "float32"), ((), "float32")], {"reduction": 1}
    )

    # -- backward ---------------------------------------------------------
    grads: dict = {}
    gl = b.op("aten.ones_like.default", [loss], [((), "float32")])
    dlogp = b.op("aten.nll_loss_backward.default", [gl, logp, labels, tw], [((T, V), "float32")], {"reduction": 1})
    dlogits = b.op("aten._log_softmax_backward_data.default", [dlogp, logp], [((T, V), "float32")], {"dim": 1})
    dxfv = b.mm(dlogits, wte)
    grads[wte] = b.mm(b.t(dlogits), xfv)

    def ln_bw(dy, x, mean, rstd, w, bb):
        dx, dw, db = b.op(
            "aten.native_layer_norm_backward.default",
            [dy, x, mean, rstd, w, bb],
            [(b.shape(x), "float32"), ((H,), "float32"), ((H,), "float32")],
            {"normalized_shape": [H]},
            flops=12 * math.prod(b.shape(x)),
        )
        grads[w], grads[bb] = dw, db
        return dx

    def linear_bw(dy, x, bias, w):  # y = x @ w + bias, dy (T, N)
        grads[w] = b.mm(b.t(x), dy)
        grads[bias] = b.sum0(dy, [0])
        return b.mm(dy, b.t(w))

    dh = ln_bw(b.view(dxfv, (batch, seq, H)), xf, meanf, rstdf, lnf_w, lnf_b)
    for p, s in zip(reversed(layer_params), reversed(saved)):
        dpr2 = b.view(dh, (T, H))
        dge = linear_bw(dpr2, s["ge"], p["proj2.b"], p["proj2.w"])
        dfc = b.op("aten.gelu_backward.default", [dge, s["fc"]], [((T, 4 * H), "float32")], {"approximate": "tanh"})
        dx2v = linear_bw(dfc, s["x2v"], p["fc.b"], p["fc.w"])
        dh1 = b.ew(
            "add", dh, ln_bw(b.view(dx2v, (batch, seq, H)), s["x2"], s["mean2"], s["rstd2"], p["ln2.w"], p["ln2.b"])
        )
        dpr = b.view(dh1, (T, H))
        daov = linear_bw(dpr, s["aov"], p["proj.b"], p["proj.w"])
        dao = b.transpose(b.view(daov, (batch, seq, nh, hd)), 1, 2)
        dq, dk, dv = b.op(
            "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
            [dao, *s["heads"], s["ao"], s["lse"]],
            [((batch, nh, seq, hd), "float32")] * 3,
            {"causal": True},
            flops=2 * 4 * batch * nh * seq * seq * hd,
        )
        dqkv = b.op(
            "aten.cat.default",
            [b.view(b.transpose(z, 1, 2), (batch, seq, H)) for z in (dq, dk, dv)],
            [((batch, seq, 3 * H), "float32")],
            {"dim": 2},
        )
        dx1v = linear_bw(b.view(dqkv, (T, 3 * H)), s["x1v"], p["attn.b"], p["attn.w"])
        dh = b.ew(
            "add", dh1, ln_bw(b.view(dx1v, (batch, seq, H)), s["x1"], s["mean1"], s["rstd1"], p["ln1.w"], p["ln1.b"])
        )
    grads[wpe] = b.sum0(dh, [0])
    dwte_emb = b.op("aten.embedding_dense_backward.default", [dh, ids], [((V, H), "float32")], {"num_weights": V})
    grads[wte] = b.ew("add", grads[wte], dwte_emb)

    # -- AdamW, elementwise -------------------------------------------------
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    outputs = [loss]
    for pid in out.params:
        gr = grads[pid]
        m, v = out.states[pid]
        m_new = b.ew("add", b.ew("mul", m, scalar=b1), b.ew("mul", gr, scalar=1 - b1))
        v_new = b.ew("add", b.ew("mul", v, scalar=b2), b.ew("mul", b.ew("mul", gr, gr), scalar=1 - b2))
        denom = b.ew("add", b.ew("sqrt", v_new), scalar=eps)
        upd = b.ew("mul", b.ew("div", m_new, denom), scalar=lr)
        p_new = b.ew("sub", b.ew("mul", pid, scalar=1 - lr * wd), upd)
        for old, new in ((pid, p_new), (m, m_new), (v, v_new)):
            g.alias(old, new)
            outputs.append(new)
    g.set_outputs(outputs)
    g.validate()
    return out
