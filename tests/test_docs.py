"""The README and the docs: short, self-contained, every relative link resolving
(``scripts/check_links.py``; the site itself is built by ``mkdocs build --strict`` in CI)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_links", ROOT / "scripts" / "check_links.py")
assert spec is not None and spec.loader is not None
check_links = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_links)


def test_the_readme_is_under_250_lines_and_starts_with_the_quick_start() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) < 250
    start = readme.index("## Quick start")
    commands = [line for line in readme[start : start + 8] if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and commands[0].endswith("# the gateway")
    assert all(". .venv/bin/activate && pip install -r requirements/" in c for c in commands)


def test_every_relative_link_resolves() -> None:
    assert check_links.main() == 0


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    # Beside tests/, not in docs/: the checker run concurrently (pytest -n) scans docs/ and would
    # take this probe's broken links for the docs' own.
    page = ROOT / "tests" / f"_probe_for_the_link_checker_{os.getpid()}.md"
    page.write_text("# Probe\n\n[a](nope.md) [b](../docs/design.md#no-such-heading) [c](#probe)\n")
    try:
        problems = check_links.broken(page)
    finally:
        page.unlink()
    assert len(problems) == 2
    assert "nope.md (no such file)" in problems[0] and "no such heading" in problems[1]


def test_nothing_refers_to_what_is_outside_the_repository() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    outside = re.compile(r"\.\./shared|CONTRACT\.md|\bissue \d+|\bthe contract\b", re.I)
    found = [f"{p.name}: {m.group(0)}" for p in pages for m in outside.finditer(p.read_text())]
    assert found == []
