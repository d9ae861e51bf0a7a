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
  setting missing or out of range, a model that does not load, or one whose weights are ONNX
  external data (another file, not covered by the digests), is a :class:`VerifierFileError`
  naming the folder). The default folder is the one packaged with carpool (:data:`PACKAGED`), made by
  ``scripts/train_verifier.py`` (its docstring: base model, data, how the threshold was picked).
  Its int8 products are computed exactly on every CPU (:mod:`carpool.semantic.embed.exact_int8`:
  where ONNX Runtime would clip them, the threshold calibrated on exact ones would not hold).
- A pair's score is the one it has alone, whatever pairs it is scored with: ``score`` runs the
  model once a pair. The packaged model quantises its activations at run time with one scale
  per run (ONNX's ``DynamicQuantizeLinear``, over every row and its padding), so the pairs of a
  batch moved each other's scores by up to 0.085 ("...safe to drink tap water in Lisbon?" /
  "...not safe...": 0.165 alone, 0.250 beside a long pair). Each ``scores`` call is one
  lookup's pairs, on the one worker thread: calls are never merged across lookups (tenants).
  Measured (2 cores, Quora pairs, p50): one pair 6.0 ms; 16 of mixed lengths 171 -> 103 ms (a
  graph quantising each row on its own cost 7-34 % more; docs/semantic.md has the rest).
- The pair the model reads is the whole text of each side, up to ``max_length`` tokens between
  them. ``unread(pairs)`` says which pairs it would have to cut (the longer side first): those
  score 0, as does a pair with a token the model's vocabulary does not have (``[UNK]``: most
  Chinese characters, for the packaged English model): a model never vouches for what it did
  not read, whatever ``semantic.scripts`` lets through. (A pair cut to its first ~127 tokens a
  side was served for "...I want to accept the invitation." / "...decline..." at the end of a
  pasted email.) A conversation's earlier turns are read as one text
  (:func:`render_context`), compared by a second pair beside the last turns (``semantic.cache``).

Why a model: meaning-level changes have no closed list (a grammar grew to ~2,600 lines, missing
every trap kind it was not written for); the rest is checked exactly (:mod:`.rules`). A pair is
also scored as its core (shared edges cut: they drowned a one-word difference; :mod:`.frame`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from .frame import core

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
            meta = json.loads((folder / SETTINGS_FILE).read_text(encoding="utf-8"))
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
        if _external_data(files["model.onnx"]):
            # Weights in another file: not covered by the digests, and ONNX Runtime, given the
            # model's bytes, would look for them in the working directory.
            raise VerifierFileError(
                f"{folder / 'model.onnx'}: its weights are ONNX external data (another file); "
                "a verifier's model must hold them itself"
            )
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
        self.calls = 0  # ``scores`` calls with pairs (one lookup's; a model run a pair)
        self.pairs = 0  # pairs scored

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """``scores``, synchronously; a pair's core's where lower (:mod:`.frame`)."""
        cores = [core(*ordered(a, b)) for a, b in pairs]
        cut = iter(self._score([c for c in cores if c is not None]))
        whole = self._score(pairs)
        return [min(s, next(cut)) if c else s for s, c in zip(whole, cores, strict=True)]

    def _score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        if not pairs:
            return []
        np = self._np
        out = []
        # One model run a pair: the int8 model quantises its activations with one scale per
        # run, over every pair in it (a pair beside others moved by up to 0.085); alone, its
        # score is its own, and unpadded, mixed lengths cost less (the module's contract).
        for e in self._encoded(pairs):
            ids = np.array([e.ids], dtype=np.int64)
            feed = {
                "input_ids": ids,
                "attention_mask": np.ones_like(ids),
                "token_type_ids": np.array([e.type_ids], dtype=np.int64),
            }
            (logits,) = self._session.run(["logits"], feed)
            unreadable = self._unknown is not None and self._unknown in e.ids
            cut = bool(e.overflowing)  # not read whole
            out.append(0.0 if unreadable or cut else float(1.0 / (1.0 + np.exp(-logits[0, 0]))))
        return out

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


def _external_data(model: bytes) -> bool:
    """Whether any tensor of ``model`` (initializers, constants, subgraphs' and functions') is
    stored in another file (ONNX external data); False for bytes that are no model (the
    session's load says why)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        proto = onnx.load_model_from_string(model)
    except DecodeError:
        return False

    def tensors(nodes: Any, graph: Any = None) -> Iterator[Any]:
        if graph is not None:
            yield from graph.initializer
            for sparse in graph.sparse_initializer:
                yield from (sparse.values, sparse.indices)
        for node in nodes:
            for attribute in node.attribute:
                yield attribute.t
                yield from attribute.tensors
                for sub in (attribute.g, *attribute.graphs):
                    yield from tensors(sub.node, sub)

    every = itertools.chain(
        tensors(proto.graph.node, proto.graph), *(tensors(f.node) for f in proto.functions)
    )
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in every)


def _loadable(model: bytes) -> bytes:
    """``model`` as this CPU computes its int8 products exactly (``exact_int8``), or as given
    when ``onnx`` cannot read it (ONNX Runtime then says why it is no model)."""
    from google.protobuf.message import DecodeError  # (onnx's, which reads the model)

    from .embed.exact_int8 import model_bytes

    try:
        return model_bytes(model)
    except DecodeError:  # (a file that is no model: reported by the session's load)
        return model
