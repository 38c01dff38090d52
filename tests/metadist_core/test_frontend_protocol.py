"""The Frontend protocol stays small, and adapters hand nothing between hook calls through hidden attributes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from metadist_core.driver.frontend import Frontend, FrontendTraits

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = (
    "metadist_torch/plugin.py",
    "metadist_jax/plugin.py",
    "metadist_tvm/plugin.py",
    "metadist_core/reference/plugin.py",
)
MAX_METHODS = 12


def test_the_frontend_has_at_most_twelve_methods():
    methods = sorted(n for n, v in vars(Frontend).items() if callable(v) and not n.startswith("__"))
    assert len(methods) <= MAX_METHODS, (
        f"Frontend has {len(methods)} methods ({', '.join(methods)}); "
        f"fold new capabilities into FrontendTraits or an existing hook"
    )
    fields = sorted(n for n, v in vars(Frontend).items() if not callable(v) and not n.startswith("_"))
    assert fields == ["description", "name", "traits"], fields
    assert isinstance(Frontend.traits, FrontendTraits)


def test_adapters_keep_no_state_between_hook_calls():
    """Only ``__init__`` (and properties) may set attributes on an adapter: what one hook gives the next
    travels in the values the driver passes (``Traced.context``, ``Resolved``, the program lowered)."""
    bad = []
    for rel in ADAPTERS:
        tree = ast.parse((ROOT / rel).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if not any(isinstance(b, ast.Name) and b.id == "Frontend" for b in cls.bases):
                continue
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
                for node in ast.walk(fn):
                    targets = (
                        node.targets
                        if isinstance(node, ast.Assign)
                        else [node.target]
                        if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                        else []
                    )
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            bad.append(f"{rel}:{node.lineno} {cls.name}.{fn.name} sets self.{t.attr}")
                    if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                        "setattr",
                        "self.__dict__.pop",
                        "self.__dict__.update",
                    ):
                        bad.append(f"{rel}:{node.lineno} {cls.name}.{fn.name} calls {ast.unparse(node.func)}")
    assert not bad, "adapter state set outside __init__:\n" + "\n".join(bad)


def test_every_adapter_overrides_only_protocol_methods():
    """An adapter method the protocol does not declare would be a hook nobody calls."""
    from metadist_core.plugins import PluginManager

    protocol = {n for n, v in vars(Frontend).items() if callable(v)}
    for fe in PluginManager().frontends().values():
        own = {n for n, v in vars(type(fe)).items() if inspect.isfunction(v) and not n.startswith("_")}
        extra = own - protocol
        assert not extra, f"{type(fe).__name__} defines {sorted(extra)}, which no driver step calls"
