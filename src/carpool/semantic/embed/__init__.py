"""Sentence embeddings for the semantic cache.

An :class:`Embedder` turns a prompt into a float32, L2-normalised vector of shape ``(dim,)``, so
that the dot product of two vectors is their cosine similarity. Each module's docstring is its
contract:

- :mod:`.base`: the :class:`Embedder` protocol; :class:`SemanticDependencyError` and the guard
  for the optional dependencies (the ``semantic`` extra);
- :mod:`.microbatch`: the micro-batching both embedders share (over
  :class:`carpool.batching.KeyedBatcher`);
- :mod:`.local`: :class:`LocalEmbedder` (all-MiniLM-L6-v2 in process) and
  :func:`default_embedder`;
- :mod:`.upstream`: :class:`UpstreamEmbedder` (an OpenAI-compatible ``/v1/embeddings``);
- :mod:`.minilm`: the model itself (tokenizer, weights, pooling; why this model and runtime);
- :mod:`.encoder`: its encoder layers and the NumPy encoder, the reference;
- :mod:`.onnx_encoder`: the same layers on ONNX Runtime (the default), as the graph that
  :mod:`.onnx_graph` builds with ``onnx.helper``;
- :mod:`.weights`: where the weights come from (:func:`find_model_dir`, :func:`fetch_model`).

Everything public is re-exported here: ``from carpool.semantic.embed import ...`` is the import
path to use. (A test that replaces a module global, such as ``MODEL_PACKAGES``, must do it in
the module that reads it.)
"""

from .base import INSTALL_HINT as INSTALL_HINT
from .base import Embedder, EmbeddingDimMismatch, SemanticDependencyError

# (private, but carpool.semantic.verifier imports them, with default_threads)
from .base import _require as _require
from .base import _require_numpy as _require_numpy
from .encoder import LAYER_NORM_EPS as LAYER_NORM_EPS
from .local import LocalEmbedder, default_embedder
from .minilm import HEADS as HEADS
from .minilm import MAX_SEQ_LENGTH as MAX_SEQ_LENGTH
from .minilm import PAD_RATIO as PAD_RATIO
from .minilm import PAD_TOKENS as PAD_TOKENS
from .minilm import PRECISIONS as PRECISIONS
from .minilm import RUNTIMES as RUNTIMES
from .onnx_encoder import default_threads as default_threads
from .upstream import UpstreamEmbedder
from .weights import (
    MODEL_NAME,
    MODEL_PACKAGES,
    MODEL_REPO,
    MODEL_REVISION,
    MODEL_SHA256,
    HubClientError,
    ModelFileError,
    ModelNotFoundError,
    fetch_model,
    find_model_dir,
)

__all__ = [
    "MODEL_NAME",
    "MODEL_PACKAGES",
    "MODEL_REPO",
    "MODEL_REVISION",
    "MODEL_SHA256",
    "Embedder",
    "EmbeddingDimMismatch",
    "LocalEmbedder",
    "HubClientError",
    "ModelFileError",
    "ModelNotFoundError",
    "SemanticDependencyError",
    "UpstreamEmbedder",
    "default_embedder",
    "fetch_model",
    "find_model_dir",
]
