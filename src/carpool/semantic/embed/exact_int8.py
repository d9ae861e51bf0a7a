"""Integer matrix products that ONNX Runtime computes exactly on every x86 CPU.

Contract
--------
- :func:`saturates` tells, once per process, whether this ONNX Runtime on this CPU saturates
  ``MatMulInteger`` with uint8 inputs and int8 weights (what ``quantize_dynamic`` writes, and
  :mod:`.onnx_graph` too): on x86 with AVX2 or AVX-512 but no VNNI (AMD Zen 1-3, Intel before
  Cascade Lake) ONNX Runtime multiplies such pairs with ``vpmaddubsw``, whose 16-bit sums clip
  (ONNX Runtime's quantization docs say so). Measured on an AMD EPYC (Zen 3): the packaged
  verifier's scores moved by up to 0.44 (0.03 on average) and 5 of 200 Quora pairs changed side
  of its threshold, calibrated where the arithmetic is exact.
- :func:`exactly` rewrites a model's ``MatMulInteger`` nodes with int8 weights (initializers) to
  uint8 weights with their zero point moved by 128: the same integers multiplied (q + 128 with
  zero point z + 128), which ONNX Runtime's uint8 x uint8 kernels sum without clipping. The
  rewrite costs ~30 % of a verifier call on such a CPU; where :func:`saturates` is false the model
  is left as it is (VNNI multiplies int8 weights exactly, and faster).
- :func:`model_bytes` is a serialized model as a session should load it here: ``exactly``'s if
  this CPU saturates, else the bytes given.

Every function needs ``onnx`` and ``onnxruntime`` (the ``semantic`` extra); callers have checked.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

# The probe: every product 255 x 127, summed over K: 64,770 a pair, more than int16 holds.
_PROBE_K = 64
# The name of the zero point given to a node that had none (0, moved to 128).
_NO_ZERO = "carpool.exact_int8.zero"


@functools.cache
def saturates() -> bool:
    """Whether this CPU's ONNX Runtime clips uint8 x int8 sums (see the module's contract)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weights = np.full((_PROBE_K, 16), 127, dtype=np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [4, _PROBE_K])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [4, 16])],
        [numpy_helper.from_array(weights, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    product = session.run(None, {"a": np.full((4, _PROBE_K), 255, dtype=np.uint8)})[0]
    return bool((product != 255 * 127 * _PROBE_K).any())


def exactly(model: Any) -> Any:
    """``model`` (an ``onnx.ModelProto``, changed in place and returned) with each
    ``MatMulInteger``'s int8 weight initializer and its zero point as uint8, moved by 128. A
    node whose weights or zero point are not int8 initializers (computed at run time) is left
    as it is. An initializer an older exporter also lists as a graph input is taken as the
    constant it holds (carpool feeds a model its token inputs only), and its input goes with it."""
    from onnx import numpy_helper

    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    made: dict[str, str] = {}  # an int8 constant's name -> its uint8 copy's

    def int8(name: str) -> Any:
        tensor = constants.get(name)
        values = numpy_helper.to_array(tensor) if tensor is not None else None
        return values if values is not None and values.dtype == np.int8 else None

    def as_uint8(name: str, values: Any) -> str:
        if name not in made:
            made[name] = f"{name}.uint8"
            shifted = (values.astype(np.int16) + 128).astype(np.uint8)
            graph.initializer.append(numpy_helper.from_array(shifted, made[name]))
        return made[name]

    for node in graph.node:
        if node.op_type != "MatMulInteger" or len(node.input) < 2:
            continue
        given_zero = node.input[3] if len(node.input) > 3 else ""
        weights = int8(node.input[1])
        zero = int8(given_zero) if given_zero else np.array(0, np.int8)
        if weights is None or zero is None:
            continue  # (not int8 constants: moving one without the other would be wrong)
        while len(node.input) < 4:
            node.input.append("")
        node.input[1] = as_uint8(node.input[1], weights)
        node.input[3] = as_uint8(given_zero or _NO_ZERO, zero)
    # The int8 originals no node reads any more go: the session would hold both copies.
    still_used = {name for node in graph.node for name in node.input}
    gone = {name for name in made if name not in still_used}
    kept = [t for t in graph.initializer if t.name not in gone]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inputs = [value for value in graph.input if value.name not in gone]
    del graph.input[:]
    graph.input.extend(inputs)
    return model


def model_bytes(serialized: bytes) -> bytes:
    """``serialized`` as a session should load it on this CPU (see the module's contract)."""
    if not saturates():
        return serialized
    import onnx

    return bytes(exactly(onnx.load_from_string(serialized)).SerializeToString())
