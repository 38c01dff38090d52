"""The front door and the docs say what is true: every relative link resolves (a heading anchor included),
every Python block compiles, and README's first example runs at world size 1 and prints what README says
it prints (numbers aside)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_block_compiles(page):
    for i, (lang, code) in enumerate(FENCE.findall(page.read_text())):
        if lang == "python":
            compile(code, f"{page.name} python block {i}", "exec")


def _mask(text: str) -> list[str]:
    return [re.sub(r"\d+(\.\d+)?", "N", line).rstrip() for line in text.strip().splitlines()]


def test_readme_first_example_prints_what_readme_says():
    text = (REPO / "README.md").read_text()
    blocks = FENCE.findall(text)
    first = next(i for i, (lang, _) in enumerate(blocks) if lang == "python")
    code, (lang, said) = blocks[first][1], blocks[first + 1]
    assert lang == "text", "README's first example is followed by what it prints, in a ```text block"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _mask(proc.stdout) == _mask(said), f"README says:\n{said}\nit prints:\n{proc.stdout}"
