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
  answer of the wrong shape: not a 4xx about the texts) make the next caller first ask the
  embedder for ``CHECK_TEXT``, a text of the gateway's own, alone; only if that fails too, and
  no client's text was embedded while it ran (a success resets the count), does it open, and
  while it is open ``embed`` raises :class:`EmbedderDown` at once, but for one
  caller every ``retry_s`` (1 s, doubling while it fails, up to ``RETRY_MAX_S``) that checks
  again, and goes on with its own text if the check is answered (which closes it). A text the
  embedder fails while it answers its own (an input over llama.cpp's batch size: a 500) is its
  requester's miss: clients' texts alone never open it, nor keep it open, for everyone. The
  check costs one call each ``FAILURES_TO_OPEN`` failures in a row, and the caller's wait for
  both stays within ``timeout_s``. Without the breaker, a hung embedder cost every lookup in a
  scope with entries the whole timeout (1 s by default) before its miss, for as long as it hung.
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

FAILURES_TO_OPEN = 3  # embeddings failed in a row that make the breaker check the embedder
RETRY_MIN_S = 1.0  # s between the checks while it is open; doubles while they fail
RETRY_MAX_S = 30.0
# The breaker's own text: short, plain, and no client's (what it answers is about the embedder).
CHECK_TEXT = "carpool checks that the embedder answers."
# What an embeddings call answers about the texts it was given, not about the embedder.
_ABOUT_THE_TEXTS = frozenset({400, 413, 422})


def _about_the_texts(error: BaseException) -> bool:
    return isinstance(error, UpstreamStatusError) and error.status in _ABOUT_THE_TEXTS


class EmbedderDown(RuntimeError):
    """The breaker is open: the upstream embedder failed its last calls (not tried now)."""


class _Breaker:
    """The module's breaker: ``admit()`` before a text is asked for (raises while open, but for
    one caller every ``retry_s``); when it returns True, that caller checks the embedder with
    ``CHECK_TEXT`` first and says what came of it (``checked``). Then ``succeeded()`` or
    ``failed(error)`` after the text's embedding."""

    def __init__(self) -> None:
        self.failures = 0  # clients' embeddings failed in a row
        self.retry_s = RETRY_MIN_S
        self.retry_at: float | None = None  # open: when the next check may go (monotonic)
        self.checking = False  # a caller is checking (one at a time)
        self._last: BaseException | None = None  # (a batch's error reaches all its callers)

    def admit(self) -> bool:
        """Whether this caller is to check the embedder first (raises if it is not let through)."""
        if self.retry_at is None:
            # Failures in a row not yet checked: one caller checks, the others go on meanwhile
            # (it is not open: they are not refused on clients' texts alone).
            if self.failures < FAILURES_TO_OPEN or self.checking:
                return False
        elif self.checking or time.monotonic() < self.retry_at:
            raise EmbedderDown(
                f"the upstream embedder failed {self.failures} embeddings in a row and its "
                f"own text; checked again at most every {self.retry_s:g} s"
            )
        self.checking = True
        return True

    def checked(self, error: BaseException | None) -> bool:
        """The check's outcome (None: answered); returns whether the embedder answered, or
        answered a client's text while the check ran (its failures in a row reset: a failed
        check opens the breaker only if they still call for it)."""
        self.checking = False
        if error is None or _about_the_texts(error):  # (a 4xx: it answered)
            if self.retry_at is None and self.failures:
                log.debug(
                    "the upstream embedder failed %d embeddings in a row but answers its own "
                    "text: failures about those texts (their requesters' misses)",
                    self.failures,
                )
            self.succeeded()
            return True
        if self.failures < FAILURES_TO_OPEN:
            # A client's text was embedded while the check ran (``succeeded``: no failures in a
            # row left): the embedder answers, the check's failure was a blip of its own.
            log.debug(
                "the upstream embedder failed its own text (%s) but answered a client's since "
                "the check began: not skipped",
                error.__class__.__name__,
            )
            return True
        if self.retry_at is None:
            log.warning(
                "the upstream embedder failed %d embeddings in a row and its own text (%s): "
                "lookups skip it (misses, no entries) but for a check every %g s",
                self.failures,
                error.__class__.__name__,
                self.retry_s,
            )
        else:  # a failed check while open: longer until the next
            self.retry_s = min(2 * self.retry_s, RETRY_MAX_S)
        self.retry_at = time.monotonic() + self.retry_s
        return False

    def cancelled(self) -> None:
        """The checking caller left before the check's end: the next one checks."""
        self.checking = False

    def succeeded(self) -> None:
        if self.retry_at is not None:
            log.info("the upstream embedder answers again: lookups use it")
        self.failures, self.retry_s, self.retry_at = 0, RETRY_MIN_S, None

    def failed(self, error: BaseException) -> None:
        if _about_the_texts(error):
            self.succeeded()  # (it answered: about the texts, not about itself)
            return
        if error is self._last:
            return  # (one failed call, counted once)
        self._last = error
        self.failures += 1  # (whether it opens is the check's to say)


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
        deadline = None
        if self.breaker.admit():
            # One bound for the check and this text: its caller waits no longer for both.
            if self.timeout_s is not None:
                deadline = asyncio.get_running_loop().time() + self.timeout_s
            await self._check(deadline)
        try:
            async with asyncio.timeout_at(deadline):  # (None: super()'s own bound alone)
                vector = await super()._submit(text)
        except Exception as error:
            self.breaker.failed(error)
            raise
        self.breaker.succeeded()
        return vector

    async def _check(self, deadline: float | None) -> None:
        """The breaker's check: ``CHECK_TEXT`` alone (not micro-batched: no client's text
        beside it, nor counted as theirs); raises its error if the embedder did not answer."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._vectors([CHECK_TEXT])
        except asyncio.CancelledError:
            self.breaker.cancelled()
            raise
        except Exception as error:
            if not self.breaker.checked(error):
                raise
        else:
            self.breaker.checked(None)

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
