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
- A breaker: ``FAILURES_TO_OPEN`` embeddings failed in a row (timed out, unreachable, a 5xx, an
  answer of the wrong shape: not a 4xx about the texts) open it, and while it is open ``embed``
  raises :class:`EmbedderDown` at once, but for one text let through every ``retry_s`` (1 s,
  doubling while it fails, up to ``RETRY_MAX_S``); the first embedding that succeeds closes it.
  Without it, a hung embedder cost every lookup in a scope with entries the whole timeout
  (1 s by default) before its miss, for as long as it hung.
- :func:`embeddings_through` is that ``call`` for the gateway's replicas (``send``), under the
  embedder's ``model`` and ``headers`` (its key). A micro-batch holds every tenant's prompts,
  and merging must not change an answer: some engines answer a list wrongly (llama-cpp-python's
  server: every item but the first gets a wrong vector, so a prompt would be stored under
  another's vector, a paraphrase of it a miss and another's a wrong hit). So its texts are
  merged into one list ``input`` only while ``lists`` (the :class:`carpool.batching.ListCheck`
  of the gateway's own /v1/embeddings batching, ``batching.embeddings``; None: always) says
  they are answered item by item for the embedder's group (path, key, model, texts); until then
  (its probe started in the background by the first batch of two or more), and for good when
  it says they are not (or ``batching.embeddings`` is ``off``), each text goes in a call of its
  own, as a single input, concurrently. An answer that is not 200, or whose ``data`` is not
  numbered exactly 0..n-1 (which vector is whose, it does not say), fails the embedding (an
  :class:`~carpool.errors.UpstreamError`: the semantic layer's miss, no entry); a text's
  failure fails its whole micro-batch, as a refused list did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import orjson

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

from ...batching.lists import rows_in_order
from ...errors import UpstreamError, UpstreamStatusError
from ...upstream.base import UpstreamRequest, UpstreamResponse
from .base import EmbeddingDimMismatch, _require_numpy
from .microbatch import _BatchingEmbedder

if TYPE_CHECKING:
    from ...batching import ListCheck
    from .base import Vector

__all__ = ["EmbedderDown", "UpstreamEmbedder", "embeddings_through"]

log = logging.getLogger("carpool.semantic")

FAILURES_TO_OPEN = 3  # embeddings failed in a row that open the breaker
RETRY_MIN_S = 1.0  # s between the calls let through while it is open; doubles while they fail
RETRY_MAX_S = 30.0
# What an embeddings call answers about the texts it was given, not about the embedder.
_ABOUT_THE_TEXTS = frozenset({400, 413, 422})


class EmbedderDown(RuntimeError):
    """The breaker is open: the upstream embedder failed its last calls (not tried now)."""


class _Breaker:
    """The module's breaker: ``admit()`` before a text is asked for (raises while open, but for
    one text every ``retry_s``: the try, for which it returns True), then ``succeeded()`` or
    ``failed(error, try_)`` after its embedding."""

    def __init__(self) -> None:
        self.failures = 0  # embeddings failed in a row
        self.retry_s = RETRY_MIN_S
        self.retry_at: float | None = None  # open: when the next try may go (monotonic)
        self._last: BaseException | None = None  # (a batch's error reaches all its callers)

    def admit(self) -> bool:
        """Whether this text is the try of an open breaker (raises if it is not let through)."""
        if self.retry_at is None:
            return False
        now = time.monotonic()
        if now < self.retry_at:
            raise EmbedderDown(
                f"the upstream embedder failed {self.failures} embeddings in a row; "
                f"tried again at most every {self.retry_s:g} s"
            )
        self.retry_at = now + self.retry_s  # this caller's try; the others wait for its end
        return True

    def succeeded(self) -> None:
        if self.retry_at is not None:
            log.info("the upstream embedder answers again: lookups use it")
        self.failures, self.retry_s, self.retry_at = 0, RETRY_MIN_S, None

    def failed(self, error: BaseException, try_: bool) -> None:
        if isinstance(error, UpstreamStatusError) and error.status in _ABOUT_THE_TEXTS:
            self.succeeded()  # (it answered: about the texts, not about itself)
            return
        if error is self._last:
            return  # (one failed call, counted once)
        self._last = error
        self.failures += 1
        if self.retry_at is not None:
            if try_:  # the try failed: longer until the next (not for calls sent before it)
                self.retry_s = min(2 * self.retry_s, RETRY_MAX_S)
                self.retry_at = time.monotonic() + self.retry_s
            return
        if self.failures >= FAILURES_TO_OPEN:
            log.warning(
                "the upstream embedder failed %d embeddings in a row (%s): lookups skip it "
                "(misses, no entries) but for one try every %g s",
                self.failures,
                error.__class__.__name__,
                self.retry_s,
            )
            self.retry_at = time.monotonic() + self.retry_s


class UpstreamEmbedder(_BatchingEmbedder):
    """Embeddings from an OpenAI-compatible ``/v1/embeddings``, micro-batched.

    ``call(texts)`` returns the vectors of ``texts`` in the same order (one list call, or a
    call per text: :func:`embeddings_through`); it is injected so this module needs no HTTP
    client. Vectors are checked to be ``dim`` long and L2-normalised
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
        self.breaker = _Breaker()

    async def _submit(self, text: str) -> Vector:
        # The breaker counts what its callers got: a caller that timed out may have left a
        # batch then cancelled (its callers all gone), which never fails on its own.
        try_ = self.breaker.admit()
        try:
            vector = await super()._submit(text)
        except Exception as error:
            self.breaker.failed(error, try_)
            raise
        self.breaker.succeeded()
        return vector

    async def _compute(self, texts: list[str]) -> Vector:
        return await self._vectors(texts)

    async def _vectors(self, texts: list[str]) -> Vector:
        async with asyncio.timeout(self.timeout_s):  # (None: no bound)
            raw = await self._call(texts)
        vectors = np.asarray(raw, dtype=np.float32)
        if vectors.ndim == 2 and len(vectors) == len(texts) and vectors.shape[1] != self.dim:
            # A setting to correct, said as such (the cache logs it once, /stats shows it).
            raise EmbeddingDimMismatch(self.dim, int(vectors.shape[1]))
        if vectors.ndim != 2 or vectors.shape != (len(texts), self.dim):
            raise ValueError(
                f"the upstream returned embeddings of shape {vectors.shape} for "
                f"{len(texts)} texts, expected ({len(texts)}, {self.dim})"
            )
        if not np.isfinite(vectors).all():
            raise ValueError("the upstream returned a non-finite embedding")
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return cast("Vector", vectors / np.maximum(norms, np.float32(1e-12)))


def embeddings_through(
    send: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]],
    model: str,
    headers: Mapping[str, str],
    lists: ListCheck | None,
) -> Callable[[list[str]], Awaitable[list[list[float]]]]:
    """``call(texts)`` for :class:`UpstreamEmbedder` through ``send`` (the module's contract:
    lists merged only once ``lists`` says they are answered item by item)."""
    path, sent = "/embeddings", dict(headers)
    # The group of :class:`carpool.batching.EmbeddingBatcher` this call is: its verdict is
    # the embedder's key's and model's (another key may reach another engine).
    template = orjson.dumps({"model": model}, option=orjson.OPT_SORT_KEYS)
    group = (path, tuple(sorted(sent.items())), template, "", "text")

    async def embedded(given: str | list[str], count: int) -> list[list[float]]:
        response = await send(UpstreamRequest(path, {"model": model, "input": given}, sent))
        try:
            if response.status != 200:
                raise UpstreamStatusError(response.status, response.body)
            data = rows_in_order(orjson.loads(response.body)["data"], count)
            if data is None:
                raise UpstreamError(
                    f"the upstream's embeddings answer for {count} texts is not one vector "
                    "per text, numbered 0..n-1"
                )
            return [row["embedding"] for row in data]
        finally:
            await response.aclose()

    async def call(texts: list[str]) -> list[list[float]]:
        if len(texts) == 1:
            return await embedded(texts[0], 1)
        if lists is None or lists.verdict(group) is True:
            return await embedded(texts, len(texts))
        lists.probe(group)  # (in the background; a verdict reached already is not asked again)
        # One by one, as the probe asks them alone, concurrently; the others given up as soon
        # as one fails (the batch has failed), or when the call is cancelled (its timeout).
        alone = [asyncio.ensure_future(embedded(text, 1)) for text in texts]
        try:
            return [vectors[0] for vectors in await asyncio.gather(*alone)]
        finally:
            for task in alone:
                task.cancel()

    return call
