"""The plan as a picture: communication seconds per layer and each parameter's placement, drawn with
matplotlib (``metadist explain PLAN.json --png FILE``)."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from metadist_core.problem.presets import GraphView

if TYPE_CHECKING:  # pragma: no cover
    from metadist_core.plan.plan import ShardingPlan
    from metadist_core.problem.problem import ShardingProblem

log = logging.getLogger("metadist.explain")


# -- layers, for the picture ------------------------------------------------------------------------


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its name up to the first number (``blocks.0``), else its module."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def comm_per_layer(plan: "ShardingPlan", prob: "ShardingProblem") -> dict[str, float]:
    """Communication seconds per layer: an op belongs to the layer of a parameter it reads (directly or
    through transposes), else, going forward, to the latest layer among its inputs, else to its first
    input's layer."""
    g = GraphView(prob)
    order: dict[str, int] = {}
    layer: dict[str, str] = {}
    for v in g.params:
        name = prob.vars[v].get("label") or v
        layer[v] = layer_of(name)
        order.setdefault(layer[v], len(order))
    direct: dict[str, str] = {}
    for i, n in enumerate(prob.nodes):
        if n.kind != "op":
            continue
        ins = [v for v in n.inputs if v in layer]
        own = [layer[v] for v in n.inputs if v in g.role and g.role[v] == "parameter"] + [
            direct[v] for v in n.inputs if v in direct
        ]
        if own:
            lay = own[0]
        elif not ins:
            continue
        elif i in g.forward:
            lay = max((layer[v] for v in ins), key=lambda x: order[x])
        else:
            lay = layer[ins[0]]
        for o in n.outputs:
            layer[o] = lay
            if own and len(n.inputs) == 1:
                direct[o] = lay  # a transposed or cast weight still belongs to its layer
    out = {k: 0.0 for k in order}
    for e in plan.edges:
        if e.cost:
            lay = layer.get(e.var) or "other"
            out[lay] = out.get(lay, 0.0) + e.cost
    return out


# -- the picture -------------------------------------------------------------------------------------


def _colour(p: Any) -> str:
    text = str(p)
    if text == "R":
        return "#d9d9d9"
    if text.startswith("P"):
        return "#e15759"
    palette = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2"]
    return palette[int(text[2:-1]) % len(palette)] if text.startswith("S(") else "#ffffff"


def draw_plan(plan: "ShardingPlan", path: str, problem: "ShardingProblem | None" = None) -> str:
    """Write a PNG of ``plan``: layers down, mesh axes across, a cell per parameter and axis coloured by
    its placement, and the communication time per layer beside it. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    prob = problem if problem is not None else plan.problem
    names = dict(plan.labels)
    if prob is not None:
        names.update({v: i["label"] for v, i in prob.vars.items() if i.get("label") and i["role"] == "parameter"})
        params = [n.id for n in prob.nodes if n.kind == "input" and prob.vars[n.id]["role"] == "parameter"]
    else:
        params = list(names)
    rows: dict[str, list[str]] = {}
    for v in params:
        rows.setdefault(layer_of(names.get(v, v)), []).append(v)
    comm = comm_per_layer(plan, prob) if prob is not None else {}
    nd = len(plan.mesh_shape)
    width = max(len(vs) for vs in rows.values()) if rows else 1
    fig, (ax, bx) = plt.subplots(
        1,
        2,
        figsize=(min(18.0, 3.0 + 0.75 * width * nd), 1.6 + 0.5 * len(rows)),
        gridspec_kw={"width_ratios": [max(1, width * nd), 2]},
    )
    seen: dict[str, str] = {}
    for r, (lay, vs) in enumerate(rows.items()):
        for c, v in enumerate(vs):
            sh = plan.input_shardings.get(v)
            short = names.get(v, v)[len(lay) + 1 :] or names.get(v, v)
            for a in range(nd):
                p = sh[a] if sh is not None else "?"
                col = _colour(p)
                seen.setdefault(str(p), col)
                x = c * nd + a
                ax.add_patch(plt.Rectangle((x, r), 0.95, 0.9, color=col))
                ax.text(
                    x + 0.47, r + 0.45, f"{short}\n{p}" if a == 0 else str(p), ha="center", va="center", fontsize=5.5
                )
    ax.set_xlim(0, max(1, width * nd))
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([r + 0.45 for r in range(len(rows))], list(rows))
    ax.set_xticks([])
    ax.set_title(
        f"parameters by placement on mesh {'x'.join(map(str, plan.mesh_shape))} "
        f"({plan.stats.strategy or 'auto'}): one cell per mesh axis, axis 0 first",
        fontsize=9,
    )
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in sorted(seen.items())],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(0, 0),
        ncol=6,
        frameon=False,
    )
    bx.barh(range(len(rows)), [comm.get(lay, 0.0) * 1e3 for lay in rows], color="#4e79a7")
    bx.set_ylim(len(rows) - 0.5, -0.5)
    bx.set_yticks([])
    bx.set_xlabel("communication ms/step", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["comm_per_layer", "draw_plan", "layer_of"]
