"""The packages' import graph: no loop anywhere, and in the core and in the torch frontend no arrow from a lower
folder to a higher one. Every import statement counts, at module level and inside functions; imports under
``if TYPE_CHECKING:`` (never run) count for loops too, and only they may point up a list of layers."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "metadist_core": "metadist_core",
    "metadist_torch": "metadist_torch",
    "metadist_jax": "metadist_jax",
    "metadist_tvm": "metadist_tvm",
    "metadist_solvers": "solvers",
}

#: the core's layers, bottom first: a module may import its own layer and the layers below it
CORE_LAYERS = (
    ("cachefiles", "config", "hookspecs", "plugins", "progress", "version"),
    ("ir",),
    ("discovery",),
    ("cost",),
    ("problem",),
    ("plan",),
    ("levers",),
    ("driver",),
    ("reference",),
)

#: the torch frontend's layers, bottom first; its top-level modules sit above its folders, the package above all
TORCH_LAYERS = (
    ("runtime",),
    ("moe",),
    ("trace",),
    ("ops",),
    ("lower",),
    ("measure",),
    ("checkpoint",),
    ("compile", "demo", "harness", "plugin"),
)

#: ``{package: its layers}``: the packages whose imports must run down their list
LAYERED = {"metadist_core": CORE_LAYERS, "metadist_torch": TORCH_LAYERS}


def modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package __init__)}`` for every module of the project's packages."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = [pkg, *f.relative_to(ROOT / folder).with_suffix("").parts]
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (f, init)
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(x) for x in ast.walk(node))
    return skip


def imports(type_checking: bool = False) -> dict[str, set[str]]:
    """``{module: the project modules it imports}`` (with ``type_checking``, also those under ``if TYPE_CHECKING:``)."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, (path, init) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if type_checking else _type_checking_only(tree)
        here = name.split(".") if init else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = (
                    ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module
                )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name:
                    edges[name].add(t)
    return edges


def loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def layer(name: str, layers: tuple = CORE_LAYERS) -> int | None:
    """The layer of a module of the package ``layers`` belong to (None: another package's); the package
    itself, its public names, sits above them all."""
    package = next(p for p, ls in LAYERED.items() if ls is layers)
    parts = name.split(".")
    if parts[0] != package:
        return None
    if len(parts) == 1:
        return len(layers)
    for i, names in enumerate(layers):
        if parts[1] in names:
            return i
    where = "CORE_LAYERS" if layers is CORE_LAYERS else "TORCH_LAYERS"
    raise AssertionError(f"{name} is in no layer of {where}: put it in a folder of the flow, or name it there")


def core_layer(name: str) -> int | None:
    """The layer of a core module (``metadist_core`` itself, the public names, sits above them all)."""
    return layer(name, CORE_LAYERS)


def back_arrows(edges: dict[str, set[str]], layers: tuple, paths: dict | None = None) -> list[str]:
    """Every import in ``edges`` from a module of ``layers``' package into a higher layer of it."""
    back = []
    for src, targets in edges.items():
        a = layer(src, layers)
        for dst in targets:
            b = layer(dst, layers)
            if a is not None and b is not None and b > a:
                where = "the package" if b == len(layers) else "/".join(layers[b])
                s, d = (str(paths[m][0].relative_to(ROOT)) for m in (src, dst)) if paths else (src, dst)
                back.append(f"{s} ({'/'.join(layers[a])}) imports {d} ({where})")
    return sorted(back)


def test_no_import_loop_anywhere():
    found = loops(imports(type_checking=True))
    mods = modules()
    assert not found, (
        "import loops, counting imports under TYPE_CHECKING (each line: modules that import each other, directly "
        "or around a loop; move the types both need where both may import them):\n"
        + "\n".join(", ".join(str(mods[m][0].relative_to(ROOT)) for m in comp) for comp in found)
    )


def test_core_imports_run_down_the_flow():
    back = back_arrows(imports(), CORE_LAYERS, modules())
    assert not back, "imports from an earlier stage of the flow into a later one:\n" + "\n".join(back)


def test_torch_imports_run_down_its_folders():
    back = back_arrows(imports(), TORCH_LAYERS, modules())
    assert not back, "metadist_torch imports from a lower folder into a higher one:\n" + "\n".join(back)


def test_every_torch_module_is_in_a_layer():
    for name in modules():
        layer(name, TORCH_LAYERS)  # raises, naming the module, for a folder or top-level module not listed


def test_the_core_imports_no_frontend():
    edges = imports()
    bad = sorted(
        f"{s} -> {d}"
        for s, ds in edges.items()
        if s.startswith("metadist_core")
        for d in ds
        if not d.startswith("metadist_core")
    )
    assert not bad, "the core imports a frontend or solver package: " + "; ".join(bad)


def test_module_names_are_unique_in_the_core():
    seen: dict[str, Path] = {}
    dup = []
    for f in sorted((ROOT / "metadist_core").rglob("*.py")):
        if f.name == "__init__.py":
            continue
        if f.name in seen:
            dup.append(f"{seen[f.name].relative_to(ROOT)} and {f.relative_to(ROOT)}")
        seen[f.name] = f
    assert not dup, "two core modules share a file name: " + "; ".join(dup)


def test_the_checker_sees_a_loop_and_a_back_arrow():
    """The analysis itself: a made-up loop is found, and a driver module imported by ir would be a back arrow."""
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert core_layer("metadist_core.ir.ir") < core_layer("metadist_core.driver.compile")
    assert core_layer("metadist_core.config") == 0


def test_the_checker_sees_a_back_arrow_in_the_torch_frontend():
    """A made-up import of trace/ from runtime/ (and of the plugin from lower/) is reported; the real
    arrows (trace imports runtime, the plugin imports lower) are not."""
    edges = {
        "metadist_torch.runtime.engine": {"metadist_torch.trace.trace", "metadist_torch.runtime.faults"},
        "metadist_torch.lower.lower": {"metadist_torch.plugin", "metadist_torch.trace.calls"},
        "metadist_torch.trace.watch": {"metadist_torch.runtime.engine", "metadist_core.ir.ir"},
        "metadist_torch.plugin": {"metadist_torch.lower.lower"},
    }
    assert back_arrows(edges, TORCH_LAYERS) == [
        "metadist_torch.lower.lower (lower) imports metadist_torch.plugin (compile/demo/harness/plugin)",
        "metadist_torch.runtime.engine (runtime) imports metadist_torch.trace.trace (trace)",
    ]
    assert layer("metadist_core.ir.ir", TORCH_LAYERS) is None


def test_the_checker_counts_type_checking_imports_for_loops(tmp_path, monkeypatch):
    """Two modules that import each other, one only under TYPE_CHECKING, are a loop; without them, not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGES", {"pkg": "pkg"})
    assert loops(imports()) == []
    assert loops(imports(type_checking=True)) == [["pkg.a", "pkg.b"]]
