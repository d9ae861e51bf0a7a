"""int8 products computed exactly on every CPU (``carpool.semantic.embed.exact_int8``).

On x86 without VNNI (AVX2-only AMD EPYC Zen 3, where this was found) ONNX Runtime clips uint8 x
int8 sums to 16 bits: the packaged verifier scored pairs up to 0.44 away from its own arithmetic.
These tests compare against the integers as they are, so they hold on every CPU and fail on a
clipping one when the rewrite is missing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from carpool.semantic.embed.exact_int8 import exactly, model_bytes, saturates  # noqa: E402
from carpool.semantic.verifier import PACKAGED, CrossEncoder  # noqa: E402


def _product_model(weights: np.ndarray, zero: np.ndarray | None) -> onnx.ModelProto:
    inputs = ["a", "b", "", "bz"] if zero is not None else ["a", "b"]
    initializers = [numpy_helper.from_array(weights, "b")]
    if zero is not None:
        initializers.append(numpy_helper.from_array(zero, "bz"))
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", inputs, ["y"], name="product")],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, weights.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [None, weights.shape[1]])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, a: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a})[0]


def test_int8_products_a_clipping_cpu_gets_wrong_are_exact_once_rewritten():
    rng = np.random.default_rng(3)
    weights = rng.integers(-127, 128, size=(96, 24), dtype=np.int8)
    weights[:, 0] = 127  # (column 0: every pair of products past what int16 holds)
    a = rng.integers(0, 256, size=(5, 96), dtype=np.uint8)
    a[0] = 255
    for zero in (None, np.array(0, np.int8), rng.integers(-3, 4, size=24, dtype=np.int8)):
        want = a.astype(np.int64) @ (weights.astype(np.int64) - (0 if zero is None else zero))
        rewritten = exactly(_product_model(weights, zero))
        np.testing.assert_array_equal(_run(rewritten, a), want)
        initializers = {t.name: t.data_type for t in rewritten.graph.initializer}
        assert TensorProto.INT8 not in initializers.values()  # (no second copy kept)
    assert saturates() == bool(
        (_run(_product_model(weights, None), a) != a.astype(np.int64) @ weights).any()
    )


def test_weights_an_older_exporter_lists_as_graph_inputs_are_rewritten_with_their_input():
    # (keep_initializers_as_inputs): the int8 original went, its graph input stayed, and the
    # session then asked to be fed it: a verifier folder of that layout failed to load.
    weights = np.full((64, 4), 127, np.int8)
    model = _product_model(weights, np.zeros(4, np.int8))
    for name, tensor in (("b", weights), ("bz", np.zeros(4, np.int8))):
        model.graph.input.append(
            helper.make_tensor_value_info(name, TensorProto.INT8, list(tensor.shape))
        )
    rewritten = exactly(model)
    onnx.checker.check_model(rewritten, full_check=True)
    assert [value.name for value in rewritten.graph.input] == ["a"]
    a = np.full((2, 64), 255, np.uint8)
    np.testing.assert_array_equal(_run(rewritten, a), a.astype(np.int64) @ weights)


def test_weights_shared_with_a_node_whose_zero_point_is_fed_are_moved_for_the_other_only():
    weights = np.full((64, 4), 127, np.int8)
    graph = helper.make_graph(
        [
            helper.make_node("MatMulInteger", ["a", "b", "", "fed_zero"], ["y1"], name="fed"),
            helper.make_node("MatMulInteger", ["a", "b"], ["y2"], name="constant"),
        ],
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.UINT8, [None, 64]),
            helper.make_tensor_value_info("fed_zero", TensorProto.INT8, []),
        ],
        [
            helper.make_tensor_value_info("y1", TensorProto.INT32, [None, 4]),
            helper.make_tensor_value_info("y2", TensorProto.INT32, [None, 4]),
        ],
        [numpy_helper.from_array(weights, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rewritten = exactly(model)
    onnx.checker.check_model(rewritten, full_check=True)  # (no initializer made twice)
    assert [list(node.input) for node in rewritten.graph.node] == [
        ["a", "b", "", "fed_zero"],
        ["a", "b.uint8", "", "carpool.exact_int8.zero.uint8"],
    ]
    a = np.full((2, 64), 255, np.uint8)
    session = ort.InferenceSession(
        rewritten.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    second = session.run(["y2"], {"a": a, "fed_zero": np.array(0, np.int8)})[0]
    np.testing.assert_array_equal(second, a.astype(np.int64) @ weights)


def test_a_serialized_model_is_rewritten_only_where_the_cpu_clips():
    model = _product_model(np.full((64, 4), 127, np.int8), None)
    given = model.SerializeToString()
    assert (model_bytes(given) == given) is not saturates()


def test_the_packaged_verifier_scores_as_exact_integer_arithmetic_on_every_cpu():
    pairs = [
        ("How do I reset my router?", "How can I reset my router?"),
        (
            "Is it safe to drink tap water in Lisbon?",
            "Is it not safe to drink tap water in Lisbon?",
        ),
        ("What is the capital of Australia?", "Which city is Australia's capital?"),
        ("How do I import my contacts?", "How do I export my contacts?"),
        ("Best way to learn Python quickly?", "What is the fastest way to learn Python?"),
        ("Why is the sky blue?", "Why does the sky look blue during the day?"),
        ("How long should I boil an egg?", "How many minutes to hard boil an egg?"),
        (
            "Summarise this article about climate policy.",
            "Summarize the article on climate policy.",
        ),
    ]
    verifier = CrossEncoder()
    exact = CrossEncoder()
    model = exactly(onnx.load(str(PACKAGED / "model.onnx")))
    exact._session = ort.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    np.testing.assert_allclose(verifier.score(pairs), exact.score(pairs), atol=1e-5)
