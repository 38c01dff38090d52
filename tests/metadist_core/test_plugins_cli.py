import logging
import shutil
import subprocess
from importlib import metadata

import pytest

from metadist_core.driver import cli
from metadist_core.plugins import PluginManager, UnknownSolverError


def test_entry_point_plugins_load():
    pm = PluginManager()
    assert "reference" in pm.names("frontend")
    rec = next(r for r in pm.records if r.name == "reference")
    assert rec.distribution == "metadist" and rec.module == "metadist_core.reference.plugin"


def test_broken_plugin_is_named_and_skipped(monkeypatch, caplog):
    real = metadata.entry_points

    def fake(**kw):
        eps = list(real(**kw))
        if kw.get("group") == "metadist.solvers":
            eps.append(metadata.EntryPoint("broken", "no_such_module_xyz", "metadist.solvers"))
        return eps

    monkeypatch.setattr(metadata, "entry_points", fake)
    with caplog.at_level(logging.WARNING, logger="metadist"):
        pm = PluginManager()
    assert "broken" not in pm.names("solver") and "reference" in pm.names("frontend")
    msgs = [r.message for r in caplog.records if "broken" in r.message]
    assert len(msgs) == 1 and "no_such_module_xyz" in msgs[0] and "skipped" in msgs[0]


def test_unknown_solver_lists_known_ones():
    pm = PluginManager()
    with pytest.raises(UnknownSolverError, match=r"unknown solver 'nope'; known solvers: "):
        pm.solver("nope")


def test_cli_plugins_and_rules(capsys):
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "frontend" in out and "reference" in out and "metadist" in out
    assert cli.main(["rules", "np.matmul", "8x6", "6x4", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "S(1)    S(0)    ->  P(sum)" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["frobnicate"], "invalid choice"),
        (["plan"], "required"),
        (["rules", "np.matmul", "8xq"], "cannot read a shape"),
        (["plan", "missing.json"], "no such file"),
        (["rules", "np.nope", "4x4"], "has no op"),
        (["rules", "zz.nope", "4x4"], "no loaded frontend"),
    ],
)
def test_cli_errors_are_one_line(capsys, argv, needle):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("metadist: error:") and needle in err and "\n" not in err and "Traceback" not in err


def test_console_script_help():
    exe = shutil.which("metadist")
    if exe is None:
        pytest.skip("the metadist console script is not on PATH (package not installed)")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "plugins" in out.stdout and "demo" in out.stdout
    bad = subprocess.run([exe, "nonsense"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_reference_demo_runs_end_to_end(capsys):
    """`metadist demo --reference`: discover, solve, run the plan on simulated devices, same loss."""
    assert cli.main(["demo", "--reference", "--mesh", "2x2"]) == 0
    out = capsys.readouterr().out
    assert "on 4 simulated devices" in out and "|diff| 0.0e+00" in out
