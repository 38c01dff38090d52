"""The wheel is the whole project and works where it is installed: every package folder and module of the source
is in it, and installed into a fresh virtual environment it loads its plugins through its entry points and plans
the reference demo, importing nothing from this checkout or from an editable install.

How the install is kept apart:

- the wheel is built (``pip wheel --no-deps``) from a copy of the checkout in a temporary folder, so a stale
  ``build/`` here can't leak old modules into it and the build writes nothing here. It builds offline
  (``--no-build-isolation --no-index``) with this environment's setuptools when that is new enough, else in
  pip's usual isolated build, which fetches setuptools from the package index as ``pip install -e .`` does;
- the environment is a new ``venv`` *without* system site packages. A venv is made from the base interpreter
  even when pytest runs in a venv, so the running venv's editable install (its ``__editable__`` .pth and finder)
  never reaches it either way; with system site packages it would see whatever the base interpreter has
  installed, which can hide a requirement the wheel forgot to declare;
- metadist goes in from the wheel with ``--no-deps --no-index``, by this pip aimed at the new interpreter
  (``pip --python``; a pip older than 22.3 gets a venv with its own pip instead); its runtime requirements (read from the wheel's
  own METADATA, followed transitively) are linked in from the running environment: each one's top-level files
  and its dist-info, symlinked into the new site-packages. That is offline and takes a second; ``pip check``
  then confirms the requirements are met, and an undeclared import would fail, since nothing else is there;
- every command runs from a temporary working folder with ``PYTHONPATH`` and the other ``PYTHON*`` variables
  removed, and the import check runs under ``python -I``; it asserts each package's ``__file__`` is in the new
  site-packages.

It takes about 12 s (35 s on the fallbacks), so it is not marked slow: CI's lean set runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
#: import name -> source folder (pyproject's [tool.setuptools.package-dir])
PACKAGES = {
    "metadist_core": "metadist_core",
    "metadist_torch": "metadist_torch",
    "metadist_jax": "metadist_jax",
    "metadist_tvm": "metadist_tvm",
    "metadist_solvers": "solvers",
}
#: what a copy of the checkout leaves behind: version control, environments, build outputs, caches
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.pyc"
)


def _env() -> dict[str, str]:
    """This environment minus whatever could point Python at the checkout or at another site folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env.update(
        PYTHONNOUSERSITE="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_CACHE_DIR="1",
        PIP_NO_INPUT="1",
        METADIST_PROGRESS="0",
        METADIST_MEASURE_LINKS="0",
    )
    return env


def _run(cmd: list, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _local_backend() -> bool:
    """Whether this environment can build the wheel offline: setuptools>=68 with a bdist_wheel of its own (70.1
    and later) or from the ``wheel`` package. Else pip builds in isolation, fetching them from the index."""
    try:
        major, minor = (int(x) for x in metadata.version("setuptools").split(".")[:2])
    except metadata.PackageNotFoundError:
        return False
    if (major, minor) < (68, 0):
        return False
    if (major, minor) >= (70, 1):
        return True
    try:
        metadata.version("wheel")
        return True
    except metadata.PackageNotFoundError:
        return False


def _pip_has_python_option() -> bool:
    major, minor = (int(x) for x in metadata.version("pip").split(".")[:2])
    return (major, minor) >= (22, 3)


def _link_requirements(wheel: Path, site: Path) -> list[str]:
    """Symlink the wheel's runtime requirements, and theirs, from this environment into ``site``."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        todo = [
            line.split(":", 1)[1].strip()
            for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    linked: list[str] = []
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra, or another platform's requirement
        name = req.name.lower().replace("_", "-")
        if name in linked:
            continue
        dist = metadata.distribution(req.name)
        assert dist.files, f"{req.name} in {sys.prefix} has no RECORD: can't tell which files to link"
        top = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
        for entry in sorted(top):
            src = Path(dist.locate_file(entry))
            if src.exists() and not (site / entry).exists():
                (site / entry).symlink_to(src, target_is_directory=src.is_dir())
        linked.append(name)
        todo.extend(dist.requires or [])
    return linked


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(wheel, venv folder, its site-packages, a scratch working folder)``, the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, out, env_dir, work = tmp / "src", tmp / "dist", tmp / "venv", tmp / "work"
    shutil.copytree(REPO, src, ignore=NOT_COPIED, symlinks=True)
    work.mkdir()
    isolation = ["--no-build-isolation", "--no-index"] if _local_backend() else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", out, src], cwd=work)
    (wheel,) = out.glob("metadist-*.whl")

    with_pip = not _pip_has_python_option()
    venv.EnvBuilder(system_site_packages=False, with_pip=with_pip, symlinks=os.name != "nt").create(env_dir)
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(
        _run([py, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=work).stdout.strip()
    )
    pip = [py, "-m", "pip"] if with_pip else [sys.executable, "-m", "pip", "--python", py]
    _run([*pip, "install", "--no-deps", "--no-index", wheel], cwd=work)
    _link_requirements(wheel, site)
    _run([*pip, "check"], cwd=work)
    return wheel, env_dir, site, work


def _source_modules() -> tuple[set[str], set[str]]:
    """The source's package folders (each a folder with an ``__init__.py``) and all its modules, as wheel paths."""
    folders, modules = set(), set()
    for pkg, folder in PACKAGES.items():
        root = REPO / folder
        for f in root.rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            rel = Path(pkg, *f.relative_to(root).parts).as_posix()
            modules.add(rel)
            if f.name == "__init__.py":
                folders.add(rel.rsplit("/", 1)[0])
    return folders, modules


def test_every_package_folder_and_module_is_in_the_wheel(installed):
    wheel = installed[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    folders, modules = _source_modules()
    assert {"metadist_core", "metadist_core/ir", "metadist_core/driver", "metadist_core/reference"} <= folders
    missing = sorted(f for f in folders if f"{f}/__init__.py" not in names)
    assert not missing, (
        f"package folders not in {wheel.name}: {', '.join(missing)}; "
        "list them in pyproject.toml's [tool.setuptools] packages"
    )
    missing = sorted(modules - names)
    assert not missing, (
        f"modules not in {wheel.name}: {', '.join(missing)} (a folder without __init__.py, "
        "or a subpackage missing from pyproject.toml's [tool.setuptools] packages)"
    )
    extra = sorted(n for n in names if n.endswith(".py") and n not in modules)
    assert not extra, f"{wheel.name} holds modules the source doesn't: {', '.join(extra)}"
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    recorded = {line.split(",")[0] for line in zipfile.ZipFile(wheel).read(record).decode().splitlines()}
    assert modules <= recorded, f"{record} misses {sorted(modules - recorded)}"


def test_installed_packages_come_from_the_wheel_not_the_checkout(installed):
    _, env_dir, site, work = installed
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    code = (
        "import importlib, importlib.metadata as m, json, sys\n"
        f"mods = {sorted(PACKAGES) + ['metadist_core.reference.plugin', 'metadist_core.driver.cli']!r}\n"
        "files = {n: importlib.import_module(n).__file__ for n in mods}\n"
        "d = m.distribution('metadist')\n"
        "print(json.dumps({'files': files, 'dist': str(d.locate_file('')), 'path': sys.path,\n"
        "                  'editable': [n for n in sys.modules if 'editable' in n]}))\n"
    )
    got = json.loads(_run([py, "-I", "-c", code], cwd=work).stdout)
    site = site.resolve()
    for name, file in got["files"].items():
        assert Path(file).resolve().is_relative_to(site), f"{name} imported from {file}, not from {site}"
    assert Path(got["dist"]).resolve() == site, f"metadist's metadata read from {got['dist']}, not {site}"
    assert not got["editable"], f"an editable finder was imported: {got['editable']}"
    leaks = [p for p in got["path"] if p and Path(p).resolve().is_relative_to(REPO)]
    assert not leaks, f"the checkout is on the installed interpreter's path: {leaks}"


def test_the_console_script_finds_the_plugins_and_plans_the_demo(installed):
    _, env_dir, site, work = installed
    script = env_dir / ("Scripts/metadist.exe" if os.name == "nt" else "bin/metadist")
    assert script.exists(), f"the wheel installed no `metadist` console script into {script.parent}"

    listing = _run([script, "plugins"], cwd=work).stdout
    rows = {tuple(line.split()[:3]): line for line in listing.splitlines()[2:] if line.strip()}
    eps = _wheel_entry_points(installed[0])
    for (kind, name), module in eps.items():
        assert (kind, name, module) in rows, f"`metadist plugins` does not list {kind} {name} ({module}):\n{listing}"
    assert {("frontend", "reference"), ("solver", "greedy"), ("solver", "beam"), ("solver", "ilp")} <= set(eps)
    # every plugin loads, the framework ones too: a plugin module imports its framework only when used
    failed = [line for key, line in rows.items() if not line.rstrip().endswith(" ok")]
    assert not failed, "plugins that failed to load from the wheel:\n" + "\n".join(failed)

    # the default solver (the ILP, through scipy's HiGHS), the plan checked against one device by the demo itself
    demo = _run([script, "demo", "--reference", "--mesh", "2x2"], cwd=work).stdout
    assert "MetaDist demo: a transformer block" in demo and "on 4 simulated devices" in demo, demo


def _wheel_entry_points(wheel: Path) -> dict[tuple[str, str], str]:
    """``{(frontend|solver, name): module}`` from the wheel's entry_points.txt."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    kinds = {"metadist.frontends": "frontend", "metadist.solvers": "solver"}
    out, group = {}, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            group = kinds.get(line.strip("[]"))
        elif "=" in line and group:
            name, module = (s.strip() for s in line.split("=", 1))
            out[(group, name)] = module
    assert out, f"{wheel.name} declares no metadist plugins:\n{text}"
    return out
