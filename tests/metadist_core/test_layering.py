"""The packages' import graph: no loop anywhere, and in the core no arrow from an earlier stage of the flow to a
later one. Every import statement counts, at module level and inside functions; only imports under
``if TYPE_CHECKING:`` (never run) are left out."""

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


def imports() -> dict[str, set[str]]:
    """``{module: the project modules it imports}``."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, (path, init) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
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


def core_layer(name: str) -> int | None:
    """The layer of a core module (``metadist_core`` itself, the public names, sits above them all)."""
    parts = name.split(".")
    if parts[0] != "metadist_core":
        return None
    if len(parts) == 1:
        return len(CORE_LAYERS)
    for i, layer in enumerate(CORE_LAYERS):
        if parts[1] in layer:
            return i
    raise AssertionError(f"{name} is in no layer of CORE_LAYERS: put it in a folder of the flow")


def test_no_import_loop_anywhere():
    found = loops(imports())
    mods = modules()
    assert not found, (
        "import loops (each line: modules that import each other, directly or around a loop):\n"
        + "\n".join(", ".join(str(mods[m][0].relative_to(ROOT)) for m in comp) for comp in found)
    )


def test_core_imports_run_down_the_flow():
    mods = modules()
    back = []
    for src, targets in imports().items():
        a = core_layer(src)
        for dst in targets:
            b = core_layer(dst)
            if a is not None and b is not None and b > a:
                back.append(
                    f"{mods[src][0].relative_to(ROOT)} ({'/'.join(CORE_LAYERS[a])}) imports "
                    f"{mods[dst][0].relative_to(ROOT)} ({'/'.join(CORE_LAYERS[b]) if b < len(CORE_LAYERS) else 'the package'})"
                )
    assert not back, "imports from an earlier stage of the flow into a later one:\n" + "\n".join(sorted(back))


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
