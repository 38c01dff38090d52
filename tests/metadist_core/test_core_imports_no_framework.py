"""metadist_core must import no framework: checked in a fresh interpreter."""

import pkgutil
import subprocess
import sys

import metadist_core


def test_core_modules_import_no_framework():
    mods = sorted(m.name.split(".", 1)[1] for m in pkgutil.walk_packages(metadist_core.__path__, "metadist_core."))
    assert {
        "ir.placement",
        "ir.ir",
        "discovery.shardcombine",
        "discovery.rules",
        "driver.compile",
        "hookspecs",
        "plugins",
        "driver.cli",
    } <= set(mods)
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module('metadist_core.' + m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'jaxlib', 'tvm', 'flax', 'optax'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"metadist_core loaded framework modules: {out.stdout.strip()}"


FRONTEND_PACKAGES = ("metadist_torch", "metadist_jax", "metadist_tvm", "metadist_solvers")
FRAMEWORKS = ("torch", "jax", "jaxlib", "tvm", "flax", "optax")


def test_core_source_imports_no_frontend_or_framework():
    """Not even lazily: no import statement in metadist_core names a frontend, a solver package or a framework."""
    import ast
    from pathlib import Path

    bad = []
    for path in sorted(Path(metadist_core.__path__[0]).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                if n.split(".")[0] in FRONTEND_PACKAGES + FRAMEWORKS:
                    bad.append(f"{path.name}:{node.lineno} imports {n}")
        text = path.read_text()
        for pkg in FRONTEND_PACKAGES[:3]:  # importlib/__import__ with a frontend's name in the source
            for needle in (f'import_module("{pkg}', f"import_module('{pkg}", f'__import__("{pkg}'):
                if needle in text:
                    bad.append(f"{path.name} imports {pkg} dynamically")
    assert not bad, "metadist_core reaches up the flow: " + "; ".join(bad)
