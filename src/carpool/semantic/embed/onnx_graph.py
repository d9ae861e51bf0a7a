"""The encoder layers as an ONNX model, built with the ``onnx`` package's helpers.

Contract
--------
:func:`encoder_graph(layers, heads, hidden, precision) <encoder_graph>` returns an
``onnx.ModelProto`` (IR version 8, opset 17, one graph named ``encoder``) computing
:func:`carpool.semantic.embed.encoder._numpy_encoder`'s arithmetic on the same :class:`_Layer`
arrays: inputs ``x`` ``(n, len, hidden)`` and ``key_bias`` ``(n, 1, 1, len)``, float32, one
float32 output ``(n, len, hidden)`` (the model's only output; its name is ``graph.output[0]``).
The weights are initializers: the model holds a copy of them (~43 MB fp32, ~11 MB int8).

``precision="int8"``: the four weight matrices of each layer are quantised to int8 (one
symmetric scale per output column) and their inputs to uint8 at run time, with a scale and zero
point **per batch row** (text), computed as ONNX's ``DynamicQuantizeLinear`` computes them but
over that row's real tokens only (``key_bias`` 0; a padded position counts as 0). So a row's
output at its real tokens is the one it gets alone, to float rounding, whatever rows it is
batched with and however they pad it (``DynamicQuantizeLinear`` itself, one scale per call as
``quantize_dynamic`` writes it, moved a text's vector by up to 0.04 a component with the texts
batched beside it: a cache decision depended on other tenants' concurrent lookups). The output
at padded positions is not the fp32 graph's (they are quantised outside their row's range):
nothing may read it. The rows are quantised by ``QuantizeLinear`` per axis 0 (a batch costs
what ``DynamicQuantizeLinear`` did). ONNX Runtime's CPU ``MatMulInteger`` takes one zero point
for its first input, so the products are taken with none and each row's zero point times the
weights' column sums is taken off in int32 (the same integers). The attention products stay
fp32. (Where this CPU clips such products, the encoder's session loads the graph rewritten by
:func:`carpool.semantic.embed.exact_int8.exactly`, which still applies: the weights are int8
initializers.)

This module imports ``onnx`` (the ``semantic`` extra) at the top: only
:func:`carpool.semantic.embed.onnx_encoder._onnx_encoder` imports it, once it has checked that
``onnx`` is there, so ``carpool.semantic.embed`` still imports without it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

from .encoder import LAYER_NORM_EPS, _Layer

__all__ = ["OPSET", "encoder_graph"]

OPSET = 17  # LayerNormalization is in the default domain from opset 17
IR_VERSION = 8  # what opset 17 came with: every ONNX Runtime since 1.13 reads it


class _GraphBuilder:
    """The nodes and initializers of a graph, each output and constant given a fresh name."""

    def __init__(self) -> None:
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._names = itertools.count()

    def const(self, array: Any) -> str:
        """An initializer holding ``array`` (its shape and dtype as they are), by name."""
        name = f"c{next(self._names)}"
        # (np.asarray, not ascontiguousarray: it makes scalars 1-d)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, **attributes: int | float | list[int]) -> str:
        return self.ops(op_type, 1, *inputs, **attributes)[0]

    def ops(
        self, op_type: str, outputs: int, *inputs: str, **attributes: int | float | list[int]
    ) -> list[str]:
        """A node with several outputs (their names, in order)."""
        names = [f"t{next(self._names)}" for _ in range(outputs)]
        node = helper.make_node(op_type, list(inputs), names)
        node.attribute.extend(helper.make_attribute(k, v) for k, v in attributes.items())
        self.nodes.append(node)
        return names


def encoder_graph(
    layers: Sequence[_Layer], heads: int, hidden: int, precision: str = "fp32"
) -> ModelProto:
    """The encoder ``layers`` as an ONNX model; see the module docstring."""
    g = _GraphBuilder()

    def linear(x: str, weight: Any, bias: Any) -> str:
        if precision == "fp32":
            return g.op("Add", g.op("MatMul", x, g.const(weight)), g.const(bias))
        scale = np.maximum(np.abs(weight).max(axis=0), np.float32(1e-12)) / np.float32(127)
        quantized = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
        # The input as DynamicQuantizeLinear quantises it, but a row (text) at a time, over its
        # real tokens: one scale and zero point per call made a text's vector depend on the
        # texts batched with it, and on their padding. A padded position counts as 0, which
        # the range holds anyway. (QuantizeLinear per axis 0: one fused pass, measured as fast
        # as DynamicQuantizeLinear on a batch; the same arithmetic in elementwise ops cost
        # ~20 % more.)
        real_x = g.op("Where", real, x, zero)
        low = g.op("ReduceMin", real_x, axes=[1, 2], keepdims=0)  # (n,), <= 0
        high = g.op("ReduceMax", real_x, axes=[1, 2], keepdims=0)  # >= 0
        x_scale = g.op("Max", g.op("Div", g.op("Sub", high, low), u8_max), tiny)
        x_zero = g.op("QuantizeLinear", g.op("Neg", low), x_scale, axis=0)  # uint8 (n,)
        x_q = g.op("QuantizeLinear", x, x_scale, x_zero, axis=0)
        # ONNX Runtime's CPU MatMulInteger takes one zero point for A, not one a row: the
        # product is taken with none and the zero point's share taken off in int32 (exact):
        # (x_q - z) @ w = x_q @ w - z * (the column sums of w).
        product = g.op("MatMulInteger", x_q, g.const(quantized))
        column_sums = g.const(quantized.astype(np.int32).sum(axis=0, dtype=np.int32))
        x_zero = g.op("Reshape", g.op("Cast", x_zero, to=TensorProto.INT32), per_row)
        product = g.op("Sub", product, g.op("Mul", x_zero, column_sums))
        product = g.op(
            "Mul",
            g.op("Cast", product, to=TensorProto.FLOAT),
            g.op("Mul", g.op("Reshape", x_scale, per_row), g.const(scale.astype(np.float32))),
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
    if precision != "fp32":
        zero = g.const(np.array(0.0, dtype=np.float32))
        u8_max = g.const(np.array(255.0, dtype=np.float32))
        tiny = g.const(np.array(np.finfo(np.float32).tiny, dtype=np.float32))  # (an all-0 row)
        per_row = g.const(np.array([-1, 1, 1], dtype=np.int64))  # (n,) -> (n, 1, 1)
        # Which positions are real tokens, (n, len, 1): those key_bias adds 0 to.
        by_position = g.const(np.array([0, -1, 1], dtype=np.int64))
        real = g.op("Equal", g.op("Reshape", bias, by_position), zero)
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
    graph = helper.make_graph(
        g.nodes,
        "encoder",
        inputs=[
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "len", hidden]),
            helper.make_tensor_value_info("key_bias", TensorProto.FLOAT, ["n", 1, 1, "len"]),
        ],
        outputs=[helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", "len", hidden])],
        initializer=g.initializers,
    )
    return helper.make_model(
        graph,
        producer_name="carpool",
        ir_version=IR_VERSION,
        opset_imports=[helper.make_opsetid("", OPSET)],
    )
