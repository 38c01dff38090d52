"""The torch examples (examples/torch/*.py) as modules, for tests that build their models and steps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_example(name: str):
    """``examples/torch/<name>.py``, imported once per process as ``example_<name>``."""
    mod_name = f"example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, REPO / "examples" / "torch" / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = m
    spec.loader.exec_module(m)
    return m
