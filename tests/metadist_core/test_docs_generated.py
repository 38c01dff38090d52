"""docs/configuration.md and docs/cli.md are generated (scripts/gen_docs.py) and kept up to date; every setting
documents itself; `metadist --help` and each command's help name what there is, with examples."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metadist_core.driver import cli
from metadist_core.config import Settings, default_text, env_var, plain_default

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("plugins", "rules", "plan", "explain", "demo", "calibrate")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["configuration.md", "cli.md"])
def test_generated_docs_are_up_to_date(name):
    gen = _gen_docs()
    path = ROOT / "docs" / name
    expected = gen.outputs()[path]
    assert path.is_file(), f"docs/{name} is missing: run `python scripts/gen_docs.py`"
    assert path.read_text(encoding="utf-8") == expected, (
        f"docs/{name} is stale: run `python scripts/gen_docs.py` and commit it"
    )


def test_check_mode_exits_zero_when_fresh_and_names_a_stale_file(tmp_path, monkeypatch, capsys):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "37"},
    )
    assert out.returncode == 0, out.stderr  # a narrow terminal changes nothing
    gen = _gen_docs()
    stale = tmp_path / "cli.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(gen, "CLI_MD", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "CONFIG_MD", tmp_path / "configuration.md")
    (tmp_path / "configuration.md").write_text(gen.render_configuration())
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "cli.md is stale" in err and "configuration.md" not in err
    assert stale.read_text() == "# old\n"  # --check writes nothing


def test_every_setting_documents_itself():
    text = _gen_docs().render_configuration()
    for f in dataclasses.fields(Settings):
        assert f.metadata.get("help", "").strip(), f"Settings.{f.name} has no help metadata"
        shown = default_text(f)
        assert shown.strip()
        if f.default is not None:  # words beside a default may explain it, never contradict it
            assert shown.startswith(plain_default(f.default)), (f.name, shown)
        assert f"| `{f.name}` | `{env_var(f.name)}` | `{f.name}` |" in text


def test_config_docstring_has_no_second_table():
    import metadist_core.config as config

    assert "docs/configuration.md" in config.__doc__
    assert "METADIST_BEAM_WIDTH" not in config.__doc__ and "|---" not in config.__doc__


def test_help_lists_every_subcommand_with_examples():
    parser = cli.build_parser()
    top = parser.format_help()
    assert "example" in top
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == set(SUBCOMMANDS)  # a new command: add it here and to the docs
    for name in SUBCOMMANDS:
        line = next((ln for ln in top.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None and len(line.split()) > 1, f"`metadist --help` gives {name} no line of help"
        text = subs.choices[name].format_help()
        assert "example" in text and f"\n  metadist {name}" in text, f"`metadist {name} --help` shows no example"


def test_console_help_names_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "metadist_core.driver.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert f"\n    {name} " in out.stdout, name
    for name in SUBCOMMANDS:
        sub = subprocess.run(
            [sys.executable, "-m", "metadist_core.driver.cli", name, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sub.returncode == 0 and "example" in sub.stdout and f"\n  metadist {name}" in sub.stdout, name
