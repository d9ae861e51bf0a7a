"""The :class:`Embedder` protocol, and the guard for the optional dependencies.

Contract
--------
An :class:`Embedder` turns a prompt into a float32, L2-normalised vector of shape ``(dim,)``, so
that the dot product of two vectors is their cosine similarity:

- ``dim: int`` and ``name: str`` (the model; vectors of different names are not comparable);
- ``await embed(text) -> ndarray (dim,)`` and ``await embed_many(texts) -> ndarray (n, dim)``
  (``(0, dim)`` for an empty list). Every caller gets its own array (a copy), in the order asked.
  Vectors of another length than ``dim`` (a model other than the setting says) raise
  :class:`EmbeddingDimMismatch`, naming both lengths.
- optionally ``await aclose()``: the semantic cache that uses it calls it when closed
  (``LocalEmbedder`` stops its worker thread; used again, it starts a new one).

The embedders (:mod:`.local`, :mod:`.upstream`) micro-batch (:mod:`.microbatch`).

The heavy dependencies (numpy, tokenizers, safetensors, onnxruntime, onnx) are the ``semantic``
extra (``carpool.extras.install_hint``); the weights are found or fetched as :mod:`.weights`
says.
This package imports without them; using an embedder without them raises
:class:`SemanticDependencyError`, which says so (``_require``, ``_require_numpy``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...extras import install_hint

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

if TYPE_CHECKING:
    from numpy.typing import NDArray

    Vector = NDArray[np.float32]

__all__ = ["INSTALL_HINT", "Embedder", "EmbeddingDimMismatch", "SemanticDependencyError"]

INSTALL_HINT = install_hint("semantic")


class EmbeddingDimMismatch(ValueError):
    """The embedding model answers vectors of another length than ``semantic.embedding_dim``
    says: a setting to correct, not a passing failure (every embedding fails until it is). Its
    message holds the two lengths and the key's name only, no text."""

    def __init__(self, expected: int, received: int) -> None:
        self.expected = expected
        self.received = received
        super().__init__(
            f"the embedding model returns vectors of {received} dimensions, "
            f"semantic.embedding_dim says {expected}: set semantic.embedding_dim: {received}"
        )


class SemanticDependencyError(ImportError):
    """A dependency of the semantic cache (or its model) is not installed."""


def _require_numpy() -> Any:
    if np is None:
        raise SemanticDependencyError(
            f"the semantic cache needs numpy, which is not installed: {INSTALL_HINT}"
        )
    return np


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SemanticDependencyError(
            f"the semantic cache needs {module!r}, which is not installed: {INSTALL_HINT}"
        ) from exc


@runtime_checkable
class Embedder(Protocol):
    """Text -> unit-norm float32 vector of shape ``(dim,)``; see the module docstring."""

    dim: int
    name: str

    async def embed(self, text: str) -> Vector: ...

    async def embed_many(self, texts: list[str]) -> Vector: ...
