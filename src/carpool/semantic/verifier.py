"""The verifier: reads a candidate pair of prompts together and says whether a cached answer to one
is a correct answer to the other.

Contract
--------
- :class:`Verifier` (a protocol): ``name``, ``threshold`` (calibrated with the model; the guard
  may hold another) and ``await scores(pairs) -> list[float]``,
  one probability in [0, 1] per ``(new, cached)`` pair, in order; a pair is *the same* when its
  score is at or above ``threshold``. Symmetric: each pair is read in one canonical order
  (:func:`ordered`), so ``scores([(a, b)]) == scores([(b, a)])``. An empty list costs nothing.
- :class:`CrossEncoder` runs a fine-tuned cross-encoder (``[CLS] a [SEP] b [SEP]``, one logit) with
  ONNX Runtime on one worker thread of its own, so the event loop never waits on it. It loads a
  folder holding ``model.onnx``, ``tokenizer.json`` and ``verifier.json`` (``threshold``,
  ``max_length``, the SHA-256 of both files, checked at load: a file that does not match, a
  setting missing or out of range, a model that does not load is a :class:`VerifierFileError`
  naming the folder). The default folder is the one packaged with carpool (:data:`PACKAGED`), made by
  ``scripts/train_verifier.py`` (its docstring: base model, data, how the threshold was picked).
  Its int8 products are computed exactly on every CPU (:mod:`carpool.semantic.embed.exact_int8`:
  where ONNX Runtime would clip them, the threshold calibrated on exact ones would not hold).
- A pair's score is the one it has alone (to float rounding, ~1e-6), whatever pairs are scored
  in the same call: the packaged model quantises its activations with ONNX's
  ``DynamicQuantizeLinear``, one scale for the whole call and its padding, which moved a pair's
  score by up to 0.085 with the pairs beside it; at load the graph is rewritten to quantise
  each pair on its own, over its real tokens (:func:`quantized_per_pair`; the file and its
  digest are unchanged). Each ``scores`` is one session call of its own pairs (a lookup's):
  calls are never merged across lookups.
- The pair the model reads is the whole text of each side, up to ``max_length`` tokens between
  them. ``unread(pairs)`` says which pairs it would have to cut (the longer side first): those
  score 0, as does a pair with a token the model's vocabulary does not have (``[UNK]``: most
  Chinese characters, for the packaged English model): a model never vouches for what it did
  not read, whatever ``semantic.scripts`` lets through. (A pair cut to its first ~127 tokens a
  side was served for "...I want to accept the invitation." / "...decline..." at the end of a
  pasted email.) A conversation's earlier turns are read as one text
  (:func:`render_context`), compared by a second pair beside the last turns (``semantic.cache``).

Why a model and not rules: meaning-level changes (negation, antonyms, a changed detail, another
intent) have no closed list; a hand-written grammar that caught them grew to ~2,600 lines and still
missed every trap kind it had not been written for. What a model cannot be trusted with (numbers,
operators, quoted text and identifiers, names, word order) is checked exactly, before it, by the
rules of :mod:`carpool.semantic.rules`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

#: Tokens of the pair read by the model (both sides, with [CLS] and two [SEP]).
MAX_LENGTH = 256
#: The verifier shipped with carpool.
PACKAGED = Path(__file__).parent / "verifier_model"
#: A verifier folder's settings (threshold, max_length, digests), and the files they digest.
SETTINGS_FILE = "verifier.json"
DIGESTED_FILES = ("model.onnx", "tokenizer.json")
#: What a verifier folder holds (``semantic.verifier_dir`` is refused without one of them).
FILES = (SETTINGS_FILE, *DIGESTED_FILES)


class Verifier(Protocol):
    name: str
    threshold: float

    async def scores(self, pairs: Sequence[tuple[str, str]]) -> list[float]: ...

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """``scores``, synchronously (offline evaluation)."""
        ...

    def unread(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Per pair: whether the model would not read it whole (cut to its length)."""
        ...


def ordered(a: str, b: str) -> tuple[str, str]:
    """The pair in the one order the model reads it: what makes the verdict symmetric."""
    return (a, b) if a <= b else (b, a)


def render_context(messages: Sequence[dict[str, Any]]) -> str:
    """A conversation's earlier turns as one text: a ``role: content`` line per turn (its own line
    breaks indented). A turn whose content is not plain text is shown as its JSON."""
    lines = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, sort_keys=True, ensure_ascii=False)
        # A line break inside a turn is indented, so no content can pass for a turn of its own.
        content = content.replace("\n", "\n  ")
        lines.append(f"{message.get('role', '')}: {content}")
    return "\n".join(lines)


class VerifierFileError(ValueError):
    """A verifier folder that is incomplete or whose files do not match their digests."""


class CrossEncoder:
    """The cross-encoder in ``directory`` (default :data:`PACKAGED`)."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        threads: int | None = None,
    ) -> None:
        folder = Path(directory) if directory is not None else PACKAGED
        try:
            meta = json.loads((folder / SETTINGS_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise VerifierFileError(f"no verifier in {folder}: {exc}") from exc
        threshold, max_length, digests = _settings(folder / SETTINGS_FILE, meta)
        # The bytes checked are the bytes loaded: nothing is read from disk twice.
        files: dict[str, bytes] = {}
        for name in DIGESTED_FILES:
            path = folder / name
            try:
                files[name] = path.read_bytes()
            except OSError:
                files[name] = b""
            if hashlib.sha256(files[name]).hexdigest() != digests.get(name):
                raise VerifierFileError(f"{path} is missing or does not match its SHA-256")
        from .embed import _require, _require_numpy, default_threads  # its imports are heavy

        ort = _require("onnxruntime")
        _require("onnx")  # (reads the model where this CPU's int8 products need it: _loadable)
        self._np = _require_numpy()
        tokenizers = _require("tokenizers")
        self.name = f"cross-encoder:{digests['model.onnx'][:12]}"
        self.threshold = threshold  # calibrated with the model
        # (The digests are the folder's own: files that match them may still be no model.)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
        except Exception as exc:
            raise VerifierFileError(
                f"{folder / 'tokenizer.json'}: not a tokenizer ({exc})"
            ) from None
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=max_length)
        self._unknown = self._tokenizer.token_to_id("[UNK]")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or default_threads()
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(
                _loadable(files["model.onnx"]), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise VerifierFileError(f"{folder / 'model.onnx'}: not a model ({exc})") from None
        try:  # (at the longest the tokenizer lets through: one past the model's positions
            # failed only in a lookup, at the first pair that long)
            longest = self._np.zeros((1, max_length), dtype=self._np.int64)
            feed = {"input_ids": longest, "attention_mask": longest + 1, "token_type_ids": longest}
            self._session.run(["logits"], feed)
        except Exception as exc:
            raise VerifierFileError(
                f"{folder / 'verifier.json'}: the model cannot read max_length {max_length} "
                f"tokens ({type(exc).__name__})"
            ) from None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="carpool-verifier")
        self.calls = 0  # model calls (one per ``scores`` with pairs)
        self.pairs = 0  # pairs scored

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """``scores``, synchronously (offline tools, and the worker thread)."""
        if not pairs:
            return []
        np = self._np
        encoded = self._encoded(pairs)
        width = max(len(e.ids) for e in encoded)
        ids = np.zeros((len(encoded), width), dtype=np.int64)
        types = np.zeros_like(ids)
        mask = np.zeros_like(ids)
        for row, e in enumerate(encoded):
            ids[row, : len(e.ids)] = e.ids
            types[row, : len(e.ids)] = e.type_ids
            mask[row, : len(e.ids)] = 1
        (logits,) = self._session.run(
            ["logits"], {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        )
        probs = 1.0 / (1.0 + np.exp(-logits[:, 0]))
        if self._unknown is not None:
            probs[(ids == self._unknown).any(axis=1)] = 0.0
        probs[[bool(e.overflowing) for e in encoded]] = 0.0  # cut: not read whole
        return [float(p) for p in probs]

    def unread(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Which pairs the model would cut: their tokens over ``max_length`` (what the tokenizer
        cut off is its ``overflowing``)."""
        return [bool(e.overflowing) for e in self._encoded(pairs)] if pairs else []

    def _encoded(self, pairs: Sequence[tuple[str, str]]) -> list[Any]:
        return list(self._tokenizer.encode_batch([ordered(a, b) for a, b in pairs]))

    async def scores(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        if not pairs:
            return []
        self.calls += 1
        self.pairs += len(pairs)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.score, list(pairs)
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False)


def _settings(path: Path, meta: Any) -> tuple[float, int, dict[str, str]]:
    """``verifier.json``'s threshold, max_length and digests, or a :class:`VerifierFileError`
    naming the file and the setting (a KeyError or a TypeError was a traceback)."""
    if not isinstance(meta, dict):
        raise VerifierFileError(f"{path}: not a JSON object")
    threshold, max_length = meta.get("threshold"), meta.get("max_length", MAX_LENGTH)
    digests = meta.get("sha256")
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not 0 <= threshold <= 1  # (NaN included)
    ):
        raise VerifierFileError(f"{path}: 'threshold' must be a number in [0, 1]")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 3:
        raise VerifierFileError(f"{path}: 'max_length' must be a whole number of tokens (>= 3)")
    if not isinstance(digests, dict) or not all(
        isinstance(digests.get(name), str) for name in DIGESTED_FILES
    ):
        raise VerifierFileError(
            f"{path}: 'sha256' must give the SHA-256 of {' and '.join(DIGESTED_FILES)}"
        )
    return float(threshold), max_length, digests


@functools.lru_cache(maxsize=4)
def shared_cross_encoder(directory: str | None = None) -> CrossEncoder:
    """One :class:`CrossEncoder` per folder for the process (loading it takes ~0.3 s and ~30 MB;
    every gateway and cache in the process may share it: the threshold is the guard's)."""
    return CrossEncoder(directory)


def _loadable(model: bytes) -> bytes:
    """``model`` with its activations quantised a pair at a time (:func:`quantized_per_pair`)
    and its int8 products computed exactly on this CPU (``exact_int8``), or as given when
    ``onnx`` cannot read it (ONNX Runtime then says why it is no model)."""
    import onnx
    from google.protobuf.message import DecodeError  # (onnx's, which reads the model)

    from .embed.exact_int8 import exactly, saturates

    try:
        graph = onnx.load_from_string(model)
    except DecodeError:  # (a file that is no model: reported by the session's load)
        return model
    graph = quantized_per_pair(graph)
    # (After the per-pair rewrite: it leaves the weights int8 initializers, what exactly moves.)
    return bytes((exactly(graph) if saturates() else graph).SerializeToString())


def quantized_per_pair(model: Any) -> Any:
    """``model`` (an ``onnx.ModelProto``, changed in place and returned) with each
    ``DynamicQuantizeLinear`` that feeds only ``MatMulInteger`` products with constant weights
    (and ``Mul`` by their scale) rewritten to quantise each batch row (pair) on its own: a scale
    and zero point per row, computed as ``DynamicQuantizeLinear`` computes them but over the
    row's real tokens only (``attention_mask`` 1; a padded position counts as 0, which the
    range holds anyway). So a pair's logit is the one it has scored alone, to float rounding,
    whatever pairs share its session call and however they pad it. Rows are quantised by
    ``QuantizeLinear`` per axis 0; ONNX Runtime's CPU ``MatMulInteger`` takes one zero point
    for its first input, so the products are taken with none and each row's zero point times
    the weights' column sums (less their zero point) is taken off in int32: the same integers.
    A node of another shape is left as it is; a model without an ``attention_mask`` input, or
    whose inputs' ranks ``onnx`` cannot infer, is returned unchanged."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, shape_inference

    graph = model.graph
    if "attention_mask" not in {value.name for value in graph.input}:
        return model
    constants = {t.name: t for t in graph.initializer}
    inferred = shape_inference.infer_shapes(model).graph
    ranks = {
        value.name: len(value.type.tensor_type.shape.dim)
        for value in (*inferred.value_info, *inferred.input)
        if value.type.tensor_type.HasField("shape")
    }
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    prefix = "carpool.per_pair"
    added: list[Any] = []  # initializers
    values: dict[str, Any] = {
        "zero": np.array(0.0, np.float32),
        "u8_max": np.array(255.0, np.float32),
        "tiny": np.array(np.finfo(np.float32).tiny, np.float32),  # (an all-0 row)
        "by_position": np.array([0, -1, 1], np.int64),  # (n, len) -> (n, len, 1)
        "per_row_3d": np.array([-1, 1, 1], np.int64),  # (n,) -> (n, 1, 1)
        "per_row_2d": np.array([-1, 1], np.int64),  # (n,) -> (n, 1)
    }
    # Which DynamicQuantizeLinear nodes are rewritten (those of the shape described), and the
    # products they feed.
    chosen: dict[str, int] = {}  # a chosen node's quantised output -> its input's rank
    for node in graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            continue
        x_q, x_scale, x_zero = node.output
        products = readers.get(x_q, [])
        if (
            ranks.get(node.input[0]) in (2, 3)
            and products
            and all(
                p.op_type == "MatMulInteger"
                and list(p.input[:3]) == [x_q, p.input[1], x_zero]
                and p.input[1] in constants
                and (len(p.input) < 4 or not p.input[3] or p.input[3] in constants)
                for p in products
            )
            and all(r.op_type == "Mul" for r in readers.get(x_scale, []))
            and all(any(r is p for p in products) for r in readers.get(x_zero, []))
        ):
            chosen[x_q] = ranks[node.input[0]]
    if not chosen:
        return model
    nodes: list[Any] = [
        helper.make_node("Cast", ["attention_mask"], [f"{prefix}.real"], to=TensorProto.BOOL),
        helper.make_node(
            "Reshape", [f"{prefix}.real", f"{prefix}.by_position"], [f"{prefix}.real_3d"]
        ),
    ]
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLinear" and node.output[0] in chosen:
            nodes += _per_row_quantization(node, chosen[node.output[0]], prefix)
        elif node.op_type == "MatMulInteger" and node.input[0] in chosen:
            # ONNX Runtime's CPU MatMulInteger takes one zero point for A, not one a row: the
            # product is taken with none and the rows' share taken off in int32 (exact):
            # (x_q - z) @ (w - wz) = x_q @ (w - wz) - z * (the column sums of w - wz).
            weights = numpy_helper.to_array(constants[node.input[1]]).astype(np.int32)
            if len(node.input) > 3 and node.input[3]:
                weights -= numpy_helper.to_array(constants[node.input[3]]).astype(np.int32)
            out, x_zero = node.output[0], node.input[2]
            sums = f"{prefix}.{out}.column_sums"
            added.append(numpy_helper.from_array(weights.sum(axis=0, dtype=np.int32), sums))
            node.input[2] = ""
            node.output[0] = f"{out}.without_zero"
            nodes += [
                node,
                helper.make_node("Mul", [x_zero, sums], [f"{out}.zero_share"]),
                helper.make_node("Sub", [f"{out}.without_zero", f"{out}.zero_share"], [out]),
            ]
        else:
            nodes.append(node)
    for name, value in values.items():
        added.append(numpy_helper.from_array(value, f"{prefix}.{name}"))
    graph.initializer.extend(added)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _per_row_quantization(node: Any, rank: int, prefix: str) -> list[Any]:
    """The nodes that compute ``node``'s (a ``DynamicQuantizeLinear``) three outputs a batch row
    at a time (see :func:`quantized_per_pair`): the quantised input, uint8; the scale, shaped
    ``(n, 1, 1)`` (``(n, 1)`` for a rank-2 input) for its readers to multiply into the rows'
    products; the zero point, int32 and shaped alike, for the products to take off."""
    from onnx import TensorProto, helper

    x, (x_q, x_scale, x_zero) = node.input[0], node.output
    at = f"{prefix}.{x_q}"
    per_row = f"{prefix}.per_row_{rank}d"
    # The row's range as DynamicQuantizeLinear takes it (it always holds 0), over its real
    # tokens: one range per call made a pair's score depend on the pairs beside it.
    if rank == 3:
        real_x = f"{at}.real_x"
        ops = [helper.make_node("Where", [f"{prefix}.real_3d", x, f"{prefix}.zero"], [real_x])]
    else:  # ((n, hidden): a token a row, the pooler's, no padding in it)
        real_x, ops = x, []
    axes = list(range(1, rank))
    return [
        *ops,
        helper.make_node("ReduceMin", [real_x], [f"{at}.low"], axes=axes, keepdims=0),
        helper.make_node("ReduceMax", [real_x], [f"{at}.high"], axes=axes, keepdims=0),
        helper.make_node("Min", [f"{at}.low", f"{prefix}.zero"], [f"{at}.low0"]),
        helper.make_node("Max", [f"{at}.high", f"{prefix}.zero"], [f"{at}.high0"]),
        helper.make_node("Sub", [f"{at}.high0", f"{at}.low0"], [f"{at}.span"]),
        helper.make_node("Div", [f"{at}.span", f"{prefix}.u8_max"], [f"{at}.span_q"]),
        helper.make_node("Max", [f"{at}.span_q", f"{prefix}.tiny"], [f"{at}.scale"]),
        helper.make_node("Neg", [f"{at}.low0"], [f"{at}.minus_low"]),
        helper.make_node(
            "QuantizeLinear", [f"{at}.minus_low", f"{at}.scale"], [f"{at}.zero"], axis=0
        ),
        helper.make_node("QuantizeLinear", [x, f"{at}.scale", f"{at}.zero"], [x_q], axis=0),
        helper.make_node("Reshape", [f"{at}.scale", per_row], [x_scale]),
        helper.make_node("Cast", [f"{at}.zero"], [f"{at}.zero_i32"], to=TensorProto.INT32),
        helper.make_node("Reshape", [f"{at}.zero_i32", per_row], [x_zero]),
    ]
