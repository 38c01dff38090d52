"""metadist_core must import no framework: checked in a fresh interpreter."""
import pkgutil
import subprocess
import sys

import metadist_core


def test_core_modules_import_no_framework():
    mods = sorted(m.name for m in pkgutil.iter_modules(metadist_core.__path__))
    assert {"placement", "ir", "shardcombine", "rules", "pipeline", "hookspecs", "plugins", "cli"} <= set(mods)
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
