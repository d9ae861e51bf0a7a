"""The upstream embedder: an OpenAI-compatible ``/v1/embeddings``, micro-batched.

Contract
--------
- :class:`UpstreamEmbedder` calls an OpenAI-compatible ``/v1/embeddings`` through an injected
  ``async call(texts) -> list[list[float]]`` (so it does not depend on carpool's HTTP client),
  checks the shape and L2-normalises what comes back; ``max_delay_s`` defaults to 2 ms there (a
  round trip costs far more than the wait). With ``timeout_s``, each ``embed`` waits at most
  that long (``TimeoutError``: :mod:`.microbatch`) and so does each ``call``: a hung upstream
  never holds one of the ``max_in_flight`` slots longer, so the batches after it are not held
  up behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, cast

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

from .base import _require_numpy
from .microbatch import _BatchingEmbedder

if TYPE_CHECKING:
    from .base import Vector

__all__ = ["UpstreamEmbedder"]


class UpstreamEmbedder(_BatchingEmbedder):
    """Embeddings from an OpenAI-compatible ``/v1/embeddings``, micro-batched.

    ``call(texts)`` sends one request for all ``texts`` (the ``input`` list) and returns the
    vectors in the same order (``data[i].embedding``, sorted by ``index``); it is injected so
    this module needs no HTTP client. Vectors are checked to be ``dim`` long and L2-normalised
    here. Up to ``max_in_flight`` requests run at once.
    """

    def __init__(
        self,
        call: Callable[[list[str]], Awaitable[Sequence[Sequence[float]]]],
        dim: int,
        *,
        name: str = "upstream",
        max_batch: int = 32,
        max_delay_s: float = 0.002,
        max_in_flight: int = 4,
        timeout_s: float | None = None,
    ) -> None:
        _require_numpy()
        if dim < 1:
            raise ValueError("dim must be >= 1")
        self._call = call
        self.dim = dim
        self.name = name
        self._init_batching(
            self._compute,
            max_batch=max_batch,
            max_delay_s=max_delay_s,
            max_in_flight=max_in_flight,
            timeout_s=timeout_s,
        )

    async def _compute(self, texts: list[str]) -> Vector:
        async with asyncio.timeout(self.timeout_s):  # (None: no bound)
            raw = await self._call(texts)
        vectors = np.asarray(raw, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape != (len(texts), self.dim):
            raise ValueError(
                f"the upstream returned embeddings of shape {vectors.shape} for "
                f"{len(texts)} texts, expected ({len(texts)}, {self.dim})"
            )
        if not np.isfinite(vectors).all():
            raise ValueError("the upstream returned a non-finite embedding")
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return cast("Vector", vectors / np.maximum(norms, np.float32(1e-12)))
