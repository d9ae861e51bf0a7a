"""Micro-batching, shared by both embedders: ``embed``/``embed_many`` and the counters.

Contract
--------
Both embedders (:class:`~carpool.semantic.embed.LocalEmbedder`,
:class:`~carpool.semantic.embed.UpstreamEmbedder`) micro-batch. A batch of distinct texts goes to the model when ``max_batch``
(default 32) are waiting, or ``max_delay_s`` after the first of them arrived, or, while the
model is busy (``max_in_flight`` batches running: 1 for the local model, which has the CPU to
itself, 4 upstream), as soon as it is free again. So ``embed`` calls made together (``gather``)
always share a call, and under load the batches grow by themselves. Identical texts are computed
once: within a batch, and also when a text is asked for again while a batch holding it is still
being computed. ``model_calls`` counts the batches sent to the model, ``texts_computed`` the
distinct texts in them, ``requests`` the texts asked for. If the model call fails, every caller
of that batch gets the exception; a cancelled caller does not cancel the batch (a text whose
every caller left before its batch was sent is dropped from it). With ``timeout_s``, ``embed``
waits at most that long (from its call: the wait for a batch to form or for the model to be free
included) and then raises ``TimeoutError``; its batch goes on for its other callers. The
scheduling is
:class:`carpool.batching.KeyedBatcher` (one group, the text as key and item, ``grow_while_busy``).
One embedder serves one event loop at a time.

:class:`_BatchingEmbedder` is that, for an embedder that sets ``dim`` and ``name`` and gives
``_init_batching`` its ``compute(texts) -> ndarray (len(texts), dim)``; the shape is checked
here, and that every vector is finite and not zero (a ``ValueError`` for the batch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from carpool.batching import KeyedBatcher

from .base import _require_numpy

if TYPE_CHECKING:
    from .base import Vector


class _BatchingEmbedder:
    """``embed``/``embed_many`` and the counters, over a :class:`carpool.batching.KeyedBatcher`
    (one group; ``key = item = text``) bound to the running event loop."""

    dim: int
    name: str

    def _init_batching(
        self,
        compute: Callable[[list[str]], Awaitable[Any]],
        *,
        max_batch: int,
        max_delay_s: float,
        max_in_flight: int,
        timeout_s: float | None = None,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1 or max_delay_s < 0:
            raise ValueError("max_batch and max_in_flight must be >= 1, max_delay_s >= 0")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError("timeout_s must be > 0 (or None: no bound)")
        self.timeout_s = timeout_s
        self._model_compute = compute
        self._batch_settings: dict[str, Any] = {
            "max_batch_size": max_batch,
            "max_batch_delay_s": max_delay_s,
            "max_in_flight": max_in_flight,
        }
        self._batcher: KeyedBatcher[str, Any] = self._new_batcher()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _new_batcher(self) -> KeyedBatcher[str, Any]:
        return KeyedBatcher(self._compute_checked, grow_while_busy=True, **self._batch_settings)

    async def _compute_checked(self, group: Any, texts: list[str]) -> Any:
        vectors = await self._model_compute(texts)
        if vectors.shape != (len(texts), self.dim):
            raise ValueError(
                f"the model returned shape {vectors.shape} for {len(texts)} "
                f"texts, expected ({len(texts)}, {self.dim})"
            )
        # (A NaN compares false with every bar, so its candidates passed the similarity cut; a
        # zero vector is as near to another zero vector as a text to itself.)
        if (
            not (abs(vectors) < float("inf")).all()
            or not ((vectors * vectors).sum(axis=1) > 0).all()
        ):
            raise ValueError("the model returned a non-finite or zero embedding")
        return vectors

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``loop`` from now on. Work left behind by a closed loop is dropped (it can never
        finish); a loop that is still running with work in flight keeps the embedder."""
        old = self._batcher
        if not old.idle and self._loop is not None and not self._loop.is_closed():
            raise RuntimeError("an embedder serves one event loop at a time")
        new = self._new_batcher()
        new.batches, new.items_sent, new.requests = old.batches, old.items_sent, old.requests
        new.max_items_seen = old.max_items_seen
        self._batcher, self._loop = new, loop

    async def _submit(self, text: str) -> Vector:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._bind(loop)
        vector: Vector
        if self.timeout_s is None:
            vector = await self._batcher.submit(None, text, text)
        else:  # (leaving, this caller leaves the batch: it goes on for the others)
            async with asyncio.timeout(self.timeout_s):
                vector = await self._batcher.submit(None, text, text)
        return vector.copy()

    async def embed(self, text: str) -> Vector:
        return await self._submit(text)

    async def embed_many(self, texts: Sequence[str]) -> Vector:
        numpy = _require_numpy()
        if isinstance(texts, str):
            raise TypeError("embed_many takes a list of texts, not one str")
        if not texts:
            return cast("Vector", numpy.empty((0, self.dim), dtype=numpy.float32))
        vectors = await asyncio.gather(*(self._submit(t) for t in texts))
        return cast("Vector", numpy.stack(vectors))

    @property
    def model_calls(self) -> int:
        """Batches sent to the model so far."""
        return self._batcher.batches

    @property
    def texts_computed(self) -> int:
        """Distinct texts computed so far (summed over batches)."""
        return self._batcher.items_sent

    @property
    def requests(self) -> int:
        """Texts asked for so far, through ``embed`` and ``embed_many``."""
        return self._batcher.requests

    async def wait_idle(self) -> None:
        await self._batcher.wait_idle()
