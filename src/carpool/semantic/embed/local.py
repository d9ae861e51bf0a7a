"""The local embedder: all-MiniLM-L6-v2 in process, micro-batched, on a worker thread.

Contract
--------
- :class:`LocalEmbedder` runs all-MiniLM-L6-v2 (384 dims, English, uncased, max 256 tokens: a
  longer text is embedded from its first 256) in process, on one dedicated worker thread, so the
  event loop is never blocked. Its weights are found as :mod:`.weights` says (an operator's
  directory, the Hugging Face cache after ``carpool fetch-model``, or a development package);
  nothing is ever downloaded at run time. Its ``max_delay_s`` defaults to 0 (the batch
  leaves on the next turn of the event loop): measured with Poisson arrivals at 100, 300 and 600
  requests/s, a 1 or 2 ms wait made fewer model calls but a worse p50 and p90 latency at every
  rate, because a busy model already gathers the next batch while it computes. It also has a
  synchronous ``encode(texts)`` for offline tools. Loading takes ~0.6 s and ~100 MB of memory,
  once per process and settings (the weights are shared between instances), and ~1 s more once
  per process to import ``onnx`` (measured on the 2-core machine: mostly its ``ml_dtypes``
  extension), which builds the graph for ONNX Runtime. The cost grows with
  the text: ~4-6 ms of CPU for a 10-token question, ~80 ms for 256 tokens; a batch runs in chunks
  of similar lengths (``PAD_RATIO``), so a long text never pads short ones to its length. ONNX
  Runtime runs with ``default_threads()`` intra-op threads (1 on 2 cores), so that a batch never
  takes every core from the event loop.
- :func:`default_embedder` is a new :class:`LocalEmbedder` on the model that
  :func:`~.weights.find_model_dir` finds.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

from .microbatch import _BatchingEmbedder
from .minilm import _load_minilm
from .weights import MODEL_NAME, find_model_dir

if TYPE_CHECKING:
    from .base import Vector

__all__ = ["LocalEmbedder", "default_embedder"]


class LocalEmbedder(_BatchingEmbedder):
    """all-MiniLM-L6-v2 in process, micro-batched, on a dedicated worker thread.

    ``model_dir`` defaults to :func:`find_model_dir`; ``verify`` checks the SHA-256 of the
    weights and tokenizer (turn it off only for a model directory you trust that is not
    all-MiniLM-L6-v2). ``runtime`` is ``"onnxruntime"``, ``"numpy"`` (slower, no ONNX Runtime
    needed) or ``"auto"`` (ONNX Runtime when it and ``onnx`` are installed); ``threads`` is ONNX Runtime's
    intra-op thread count (default: :func:`default_threads`, half the cores, 1 on 2 cores; one
    inter-op thread, and idle threads never spin). ``precision`` is ``"int8"`` (the default:
    2.5x faster, the same decisions measured; see :mod:`.onnx_graph`) or ``"fp32"`` (the
    reference's numbers); the NumPy runtime is fp32 only. ``name`` says which, so vectors of
    another precision (from another instance, through Redis) are never mixed in. The model is
    loaded here, once per process and settings. ``timeout_s``: the longest ``embed`` waits
    (:mod:`.microbatch`); the batch it leaves runs on, on its thread.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        max_batch: int = 32,
        max_delay_s: float = 0.0,
        verify: bool = True,
        runtime: str = "auto",
        threads: int | None = None,
        precision: str = "int8",
        timeout_s: float | None = None,
    ) -> None:
        directory = find_model_dir(model_dir)
        self._model = _load_minilm(directory, verify, runtime, threads, precision)
        self.runtime = self._model.runtime
        self.precision = self._model.precision
        self.dim = self._model.dim
        name = MODEL_NAME if verify else f"{MODEL_NAME}@{directory}"
        self.name = name if self.precision == "fp32" else f"{name}:{self.precision}"
        self.max_batch = max_batch
        self._executor: ThreadPoolExecutor | None = None
        self._init_batching(
            self._compute,
            max_batch=max_batch,
            max_delay_s=max_delay_s,
            max_in_flight=1,
            timeout_s=timeout_s,
        )

    def encode(self, texts: Sequence[str], batch_size: int | None = None) -> Vector:
        """Synchronous embeddings ``(len(texts), dim)``, for offline tools (not batched with
        concurrent ``embed`` calls, not counted in ``model_calls``)."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of texts, not one str")
        return cast("Vector", self._model.encode(list(texts), batch_size or self.max_batch))

    async def _compute(self, texts: list[str]) -> Vector:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carpool-embed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._model.encode, texts, self.max_batch)

    def close(self) -> None:
        """Stop the worker thread (it is started again if the embedder is used again)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    async def aclose(self) -> None:
        await self.wait_idle()
        self.close()


def default_embedder() -> LocalEmbedder:
    """A new :class:`LocalEmbedder` on the packaged all-MiniLM-L6-v2 (weights loaded once per
    process and shared; each embedder has its own batching and worker thread)."""
    return LocalEmbedder()
