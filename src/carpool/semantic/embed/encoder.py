"""The 6 BERT encoder layers of all-MiniLM-L6-v2: their weights, and the NumPy encoder.

Contract
--------
An encoder is ``run(x (n, len, hidden) float32, key_bias (n, 1, 1, len) float32 or None) ->
the last hidden states (n, len, hidden)``: the layers applied in turn (fused QKV projection,
multi-head attention with ``key_bias`` added to the scores, output projection, residual and
LayerNorm; exact-GELU feed-forward, residual and LayerNorm). ``key_bias`` is the additive
attention mask (``-1e9`` on padding keys; None: no padding).

- :class:`_Layer` holds one layer's arrays, laid out for ``x @ w + b``;
- :func:`_numpy_encoder` is the readable reference, and the fallback when ONNX Runtime is not
  installed; :func:`carpool.semantic.embed.onnx_encoder._onnx_encoder` is the same arithmetic as
  an ONNX graph, the default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

LAYER_NORM_EPS = 1e-12


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
