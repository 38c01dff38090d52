"""The sharding problem's graph: a node per decision (an op or a graph input) with its candidate
strategies, an edge per value with its reshard table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metadist_core.discovery.rules import Strategy


@dataclass
class Node:
    """A decision: an op (``kind='op'``) or a graph input tensor (``kind='input'``)."""

    id: str
    kind: str
    key: str  # op key, or the input's role
    inputs: list[str]  # tensor input var per slot (op nodes)
    outputs: list[str]  # vars defined by this node
    options: list[Strategy]

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "kind": self.kind,
            "key": self.key,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "options": [o.to_json() for o in self.options],
        }

    @classmethod
    def from_json(cls, d) -> "Node":
        return cls(
            d["id"],
            d["kind"],
            d["key"],
            list(d["inputs"]),
            list(d["outputs"]),
            [Strategy.from_json(o) for o in d["options"]],
        )


@dataclass
class Edge:
    """Value ``var`` flows from node ``src`` (output ``src_slot``) to node ``dst`` (input ``dst_slot``).

    ``dst == -1`` is the final reshard of a graph output to Replicate (folded
    into the unary costs, kept for the plan). An alias edge goes from an
    updated state to its input node; its ``dst_slot`` is -1.
    """

    src: int
    src_slot: int
    dst: int
    dst_slot: int
    var: str
    src_map: np.ndarray
    dst_map: np.ndarray
    table: np.ndarray

    def to_json(self) -> dict:
        return {
            "src": self.src,
            "src_slot": self.src_slot,
            "dst": self.dst,
            "dst_slot": self.dst_slot,
            "var": self.var,
            "src_map": self.src_map.tolist(),
            "dst_map": self.dst_map.tolist(),
            "table": self.table.tolist(),
        }

    @classmethod
    def from_json(cls, d) -> "Edge":
        return cls(
            d["src"],
            d["src_slot"],
            d["dst"],
            d["dst_slot"],
            d["var"],
            np.asarray(d["src_map"], dtype=np.int32),
            np.asarray(d["dst_map"], dtype=np.int32),
            np.asarray(d["table"], dtype=float),
        )


__all__ = ["Edge", "Node"]
