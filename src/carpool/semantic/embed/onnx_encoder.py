"""The encoder layers on ONNX Runtime: the default encoder.

Contract
--------
:func:`_onnx_encoder` has :mod:`.onnx_graph` build the graph at load time from the same
:class:`_Layer` arrays as :func:`carpool.semantic.embed.encoder._numpy_encoder`, and returns an
encoder with the same inputs, outputs and arithmetic (see :mod:`carpool.semantic.embed.encoder`);
``precision`` is ``"fp32"`` or ``"int8"`` (dynamically quantised weight matrices, their inputs
quantised a text at a time: a text's vector does not depend on its batch). It needs
``onnxruntime`` and ``onnx`` (:class:`SemanticDependencyError` otherwise). The session runs with
:func:`default_threads` intra-op threads, one inter-op thread, and idle threads never spin.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

try:  # numpy is in the "semantic" extra: this module must import without it.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without the extra
    np = None  # type: ignore[assignment]  # (optional extra: callers check _require_numpy)

from .base import _require
from .encoder import _Layer

__all__ = ["default_threads"]


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

    ``precision="int8"``: the weight matrices quantised to int8 and their inputs at run time
    (:mod:`.onnx_graph` says how). Measured on the 2-core machine: a short prompt in 2.1 ms instead of 5.5 ms; against fp32,
    the cosine similarity of a pair moves by 0.012 on average (at most 0.064 on 1,000 development
    pairs) and the semantic cache served the same pairs (held-out half: 53.0 % / 1.6 % wrong
    against 53.1 % / 1.6 %). Their inputs quantised a text at a time (a text's vector the one
    it has alone, whatever its batch) cost nothing measurable on batches of 8 and 32 short
    prompts and ~0.4 ms on one (``bench_embed.py``'s prompt, p50: 2.6-2.8 -> 3.1-3.2 ms on the
    2-core machine, busy), and kept closer to
    fp32: a pair's similarity 0.011 from it on average, at most 0.060 (one scale per batch:
    0.012, 0.078; 1,000 pairs of three development files)."""
    ort = _require("onnxruntime")
    _require("onnx")  # (before onnx_graph imports it: a missing one names the extra)
    from .exact_int8 import exactly, saturates
    from .onnx_graph import encoder_graph

    model = encoder_graph(layers, heads, hidden, precision)
    if precision == "int8" and saturates():
        exactly(model)  # (this CPU clips int8 products: the same integers as uint8)
    output = model.graph.output[0].name
    serialized = model.SerializeToString()
    del model  # its copy of the weights: freed before the session makes its own

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = threads or default_threads()
    # Idle worker threads must not spin: the event loop shares these cores.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 3
    session = ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])

    def run(hidden_states: Any, key_bias: Any) -> Any:
        n, length, _ = hidden_states.shape
        if key_bias is None:
            key_bias = np.zeros((n, 1, 1, length), dtype=np.float32)
        return session.run([output], {"x": hidden_states, "key_bias": key_bias})[0]

    return run
