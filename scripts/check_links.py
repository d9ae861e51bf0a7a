"""Every relative link in README.md and docs/ points at something that exists.

    python scripts/check_links.py        # exit 1 listing each broken link

A link is ``[text](target)``: an http(s) or mailto target is not fetched (CI has no network);
any other target must be a file or folder of this repository, relative to the Markdown file,
and a ``#fragment`` on a Markdown target must be one of its headings (GitHub's anchors:
lower case, punctuation dropped, spaces to hyphens). mkdocs checks the docs site's own pages
(``mkdocs build --strict``); this checks what it does not: links into the repository (source
files, examples, benchmark results) and the README's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(markdown: Path) -> set[str]:
    text = FENCE.sub("", markdown.read_text(encoding="utf-8"))
    found = set()
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return found


def broken(markdown: Path) -> list[str]:
    text = FENCE.sub("", markdown.read_text(encoding="utf-8"))
    problems = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        resolved = (markdown.parent / path).resolve() if path else markdown
        if not resolved.exists():
            problems.append(f"{markdown.relative_to(ROOT)}: {target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{markdown.relative_to(ROOT)}: {target} (no such heading)")
        elif ROOT not in resolved.parents and resolved != ROOT:
            problems.append(f"{markdown.relative_to(ROOT)}: {target} (outside the repository)")
    return problems


def main() -> int:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += [ROOT / "benchmarks" / "README.md", ROOT / "requirements" / "README.md"]
    problems = [p for f in files if f.exists() for p in broken(f)]
    print("\n".join(problems) or f"{len(files)} files, every relative link resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
