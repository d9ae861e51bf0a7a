"""The encoder layers as an ONNX graph, run by ONNX Runtime: the default encoder.

Contract
--------
:func:`_onnx_encoder` builds the graph at load time from the same :class:`_Layer` arrays as
:func:`carpool.semantic.embed.encoder._numpy_encoder` and returns an encoder with the same
inputs, outputs and arithmetic (see :mod:`carpool.semantic.embed.encoder`); ``precision`` is
``"fp32"`` or ``"int8"`` (dynamically quantised weight matrices). The session runs with
:func:`default_threads` intra-op threads, one inter-op thread, and idle threads never spin.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

from .base import _require
from .encoder import LAYER_NORM_EPS, _Layer

__all__ = ["default_threads"]


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
