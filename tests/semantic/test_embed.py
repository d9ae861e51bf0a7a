"""The embedders of carpool.semantic.embed: the packaged model's vectors, and micro-batching."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from carpool.semantic import embed as E  # noqa: E402
from carpool.semantic.embed import (  # noqa: E402
    Embedder,
    LocalEmbedder,
    SemanticDependencyError,
    UpstreamEmbedder,
    default_embedder,
    minilm,  # (the modules whose globals a test reads or replaces)
    weights,
)
from fakes.model_env import UNREADABLE, model_env  # noqa: E402

ROUTER = "How do I reset my router?"
LOREM = "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 40  # > 256 tokens

# From sentence-transformers 6.2 on PyTorch 2.13 (CPU), same weights: the reference.
REFERENCE_HEAD = {
    ROUTER: [
        0.0014111241,
        -0.0115746637,
        -0.0340196081,
        0.0301286094,
        -0.0132871233,
        0.0224302858,
        -0.0730089322,
        -0.0094338115,
    ],
    LOREM: [0.0095638428, -0.0226807483, 0.0073574428, 0.0289987940, -0.0493704900, 0.0111137331],
    "Emoji test 🚀🔥 — does the tokenizer cope? 👍🏽": [
        -0.0199790299,
        -0.0704913884,
        0.1166466624,
        0.0085301809,
    ],
}
REFERENCE_COSINE = [
    (ROUTER, "What's the best way to restart my wifi router?", 0.7864271403),
    ("How do I cancel my subscription?", "Cancel my subscription please.", 0.8402396441),
    (ROUTER, "The stock market crashed today amid fears of a recession.", 0.0404161811),
]

PARAPHRASES = [
    (ROUTER, "What's the way to restart my wifi router?"),
    ("How do I cancel my subscription?", "Cancel my subscription please."),
    ("What is the capital of France?", "Which city is France's capital?"),
    ("I forgot my password and can't log in.", "How can I recover my account password?"),
    ("Give me three tips to sleep better.", "How can I improve my sleep? Three tips please."),
]


@pytest.fixture(scope="module")
def model_dir():
    try:
        return E.find_model_dir()
    except SemanticDependencyError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def local(model_dir):
    embedder = LocalEmbedder(model_dir, precision="fp32")
    yield embedder
    embedder.close()


# ------------------------------------------------------------------------------------------------
# The local model


def test_vectors_are_unit_norm_float32_of_the_right_dim(local):
    assert isinstance(local, Embedder)
    assert local.dim == 384 and local.name == "all-MiniLM-L6-v2"
    vectors = local.encode([ROUTER, "", "a", LOREM])
    assert vectors.dtype == np.float32 and vectors.shape == (4, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_vectors_match_the_sentence_transformers_reference(local):
    vectors = local.encode(list(REFERENCE_HEAD))
    for vector, head in zip(vectors, REFERENCE_HEAD.values(), strict=True):
        np.testing.assert_allclose(vector[: len(head)], head, atol=2e-6)
    for a, b, cosine in REFERENCE_COSINE:
        va, vb = local.encode([a, b])
        assert float(va @ vb) == pytest.approx(cosine, abs=1e-5)


def test_paraphrases_score_higher_than_unrelated_pairs(local):
    lefts = local.encode([a for a, _ in PARAPHRASES])
    rights = local.encode([b for _, b in PARAPHRASES])
    sims = lefts @ rights.T  # [i, j]: left i against right j
    paraphrase = np.diag(sims)
    unrelated = sims[~np.eye(len(PARAPHRASES), dtype=bool)]
    assert paraphrase.min() > 0.7
    assert unrelated.max() < 0.4
    assert paraphrase.min() > unrelated.max()


def test_batching_and_padding_do_not_change_a_vector(local):
    texts = [ROUTER, "short", LOREM, "a somewhat longer prompt about routers and modems"]
    alone = np.stack([local.encode([t])[0] for t in texts])
    for batch_size in (2, 32):
        np.testing.assert_allclose(local.encode(texts, batch_size=batch_size), alone, atol=1e-5)


# Texts of several token counts that _length_chunks puts in one chunk with the two below
# (within PAD_RATIO): each of them is padded in some mixes and pads the others in the rest.
LIKELY, NOT_IMPROBABLE = "That's likely.", "That's not improbable."
NEIGHBOURS = ["hi", "What is the capital of France?", "ok then", "Is it likely to rain at noon?"]


def test_an_int8_vector_is_the_same_alone_and_in_any_batch(model_dir):
    # Other tenants' lookups are micro-batched with a text: its vector (and so the cache's
    # decision) must not depend on them. The reviewer's pair scored 0.387 together and 0.401
    # with three other texts in the batch, either side of a 0.400 threshold.
    pytest.importorskip("onnxruntime")
    int8 = LocalEmbedder(model_dir)
    assert int8.precision == "int8"
    texts = [LIKELY, NOT_IMPROBABLE, *NEIGHBOURS, LOREM]
    alone = {text: int8.encode([text])[0] for text in texts}
    mixes = [
        [LIKELY, NOT_IMPROBABLE],
        [LIKELY, NOT_IMPROBABLE, *NEIGHBOURS],
        [NEIGHBOURS[1], LIKELY, NEIGHBOURS[0]],
        [NEIGHBOURS[3], NOT_IMPROBABLE, NEIGHBOURS[2], LOREM],
        texts[::-1],
    ]
    for mix in mixes:
        for text, vector in zip(mix, int8.encode(mix), strict=True):
            np.testing.assert_allclose(vector, alone[text], rtol=0, atol=1e-5, err_msg=text)
    pair = int8.encode([LIKELY, NOT_IMPROBABLE])
    batched = int8.encode([LIKELY, NOT_IMPROBABLE, *NEIGHBOURS])
    assert float(pair[0] @ pair[1]) == pytest.approx(float(batched[0] @ batched[1]), abs=1e-5)
    int8.close()


async def test_concurrent_int8_lookups_get_the_vectors_each_text_has_alone(model_dir):
    pytest.importorskip("onnxruntime")
    int8 = LocalEmbedder(model_dir)
    texts = [LIKELY, NOT_IMPROBABLE, *NEIGHBOURS]
    alone = int8.encode([texts[0]])[0], int8.encode([texts[1]])[0]
    calls = int8.model_calls
    vectors = await asyncio.gather(*(int8.embed(t) for t in texts))
    assert int8.model_calls - calls == 1  # one micro-batch, padded: the case that went wrong
    np.testing.assert_allclose(vectors[0], alone[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(vectors[1], alone[1], rtol=0, atol=1e-5)
    await int8.aclose()


def test_an_int8_graph_row_does_not_depend_on_the_other_rows_or_their_padding():
    # Each linear layer's input is quantised with a scale and zero point per batch row, over
    # that row's real tokens: not one per call across the batch, padding included.
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from carpool.semantic.embed.exact_int8 import exactly
    from carpool.semantic.embed.onnx_encoder import _onnx_encoder
    from carpool.semantic.embed.onnx_graph import encoder_graph

    hidden, heads = 16, 4
    layers = _random_layers(hidden, 32, 2)
    # Where a CPU clips int8 products, every product's weights are still rewritten to uint8.
    rewritten = exactly(encoder_graph(layers, heads, hidden, "int8")).graph
    assert onnx.TensorProto.INT8 not in {t.data_type for t in rewritten.initializer}
    int8 = _onnx_encoder(layers, heads, hidden, threads=1, precision="int8")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 6, hidden)).astype(np.float32)
    x[2] *= 20  # a row of much larger activations: it set the whole batch's scale
    lengths = [6, 3, 5]
    mask = (np.arange(6)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    x[mask == 0] = 50.0  # padded positions: whatever is there must not count
    key_bias = ((mask - 1.0) * np.float32(1e9))[:, None, None, :]
    batched = int8(x, key_bias)
    for row, length in enumerate(lengths):
        alone = int8(x[row : row + 1, :length], None)[0]
        np.testing.assert_allclose(batched[row, :length], alone, rtol=0, atol=1e-5)


def test_a_long_text_never_pads_short_ones_to_its_length(local):
    # One 256-token prompt padded 31 short questions to 256 tokens: ~20x the work.
    texts = ["short one", "short two", LOREM, "a short third one"]
    calls = local._model.calls
    vectors = local.encode(texts)
    assert local._model.calls - calls == 2  # the short ones together, the long alone
    alone = np.stack([local.encode([t])[0] for t in texts])
    np.testing.assert_allclose(vectors, alone, atol=1e-5)
    assert minilm._length_chunks([0, 1, 2, 3], [5, 6, 9, 200], 32) == [[0, 1, 2], [3]]
    assert minilm._length_chunks([0, 1, 2, 3, 4], [10] * 5, 2) == [[0, 1], [2, 3], [4]]
    assert minilm._length_chunks([], [], 32) == []


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (64, 4)])
def test_onnx_runtime_leaves_cores_to_the_event_loop(monkeypatch, cores, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert E.default_threads() == threads


def test_onnxruntime_and_numpy_runtimes_agree(model_dir):
    pytest.importorskip("onnxruntime")
    texts = [ROUTER, "Cancel my subscription please.", LOREM[:200], "日本語", ""]
    ort = LocalEmbedder(model_dir, runtime="onnxruntime", precision="fp32")
    ref = LocalEmbedder(model_dir, runtime="numpy")
    assert (ort.runtime, ref.runtime) == ("onnxruntime", "numpy")
    cosines = np.sum(ort.encode(texts) * ref.encode(texts), axis=1)
    assert cosines.min() > 0.99999


def _random_layers(hidden: int, inner: int, count: int) -> list:
    from carpool.semantic.embed.encoder import _Layer

    rng = np.random.default_rng(0)

    def w(*shape: int):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    return [
        _Layer(
            qkv_w=w(hidden, 3 * hidden),
            qkv_b=w(3 * hidden),
            attn_out_w=w(hidden, hidden),
            attn_out_b=w(hidden),
            ln1_w=1 + w(hidden),
            ln1_b=w(hidden),
            inter_w=w(hidden, inner),
            inter_b=w(inner),
            out_w=w(inner, hidden),
            out_b=w(hidden),
            ln2_w=1 + w(hidden),
            ln2_b=w(hidden),
        )
        for _ in range(count)
    ]


def test_the_onnx_graph_is_valid_onnx_and_computes_what_the_numpy_encoder_does():
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from carpool.semantic.embed.encoder import _numpy_encoder
    from carpool.semantic.embed.onnx_encoder import _onnx_encoder
    from carpool.semantic.embed.onnx_graph import OPSET, encoder_graph

    hidden, heads = 16, 4
    layers = _random_layers(hidden, inner=32, count=2)
    for precision in ("fp32", "int8"):
        model = encoder_graph(layers, heads, hidden, precision)
        onnx.checker.check_model(model, full_check=True)
        assert (model.ir_version, model.opset_import[0].version) == (8, OPSET)
    x = np.random.default_rng(1).standard_normal((3, 5, hidden)).astype(np.float32)
    mask = np.ones((3, 5), dtype=np.float32)
    mask[1, 3:] = mask[2, 1:] = 0  # padded rows
    key_bias = ((mask - 1.0) * np.float32(1e9))[:, None, None, :]
    reference = _numpy_encoder(layers, heads)
    fp32 = _onnx_encoder(layers, heads, hidden, threads=1, precision="fp32")
    int8 = _onnx_encoder(layers, heads, hidden, threads=1, precision="int8")
    for bias, real in ((None, mask == mask), (key_bias, mask == 1)):
        want = reference(x, bias)
        np.testing.assert_allclose(fp32(x, bias), want, atol=1e-4)
        # (LayerNorm outputs: ~unit scale. Padded positions are quantised outside their row's
        # range, and nothing reads what comes out there: the pooling skips them.)
        assert np.abs(int8(x, bias) - want)[real].max() < 0.25


def test_without_onnx_the_onnx_runtime_names_the_extra_and_auto_falls_back_to_numpy(
    monkeypatch, model_dir
):
    pytest.importorskip("onnxruntime")
    from carpool.semantic.embed.onnx_encoder import _onnx_encoder

    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx -> ImportError
    with pytest.raises(SemanticDependencyError, match=r"'onnx'.*'\.\[semantic\]'"):
        _onnx_encoder(_random_layers(8, 16, 1), 2, 8, threads=1)
    assert minilm._MiniLM(model_dir, runtime="auto").runtime == "numpy"


def test_int8_weights_keep_every_vector_close_to_the_reference_and_say_so_in_the_name(
    model_dir, local
):
    pytest.importorskip("onnxruntime")
    int8 = LocalEmbedder(model_dir)  # the default precision
    assert (int8.precision, int8.name) == ("int8", "all-MiniLM-L6-v2:int8")
    assert local.name == "all-MiniLM-L6-v2"  # never mixed with fp32 vectors
    texts = [ROUTER, "Cancel my subscription please.", LOREM, "日本語", "", "x = 1 if y else 2"]
    vectors = int8.encode(texts)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.sum(vectors * local.encode(texts), axis=1).min() > 0.98
    lefts = int8.encode([a for a, _ in PARAPHRASES])
    rights = int8.encode([b for _, b in PARAPHRASES])
    reference = (
        local.encode([a for a, _ in PARAPHRASES]) @ local.encode([b for _, b in PARAPHRASES]).T
    )
    assert np.abs(lefts @ rights.T - reference).max() < 0.05
    with pytest.raises(ValueError, match="precision"):
        LocalEmbedder(model_dir, precision="fp16")
    assert LocalEmbedder(model_dir, runtime="numpy").precision == "fp32"


async def test_concurrent_embeds_make_few_model_calls_and_each_gets_its_own_vector(local):
    texts = [f"question number {i}: how do I reset router model {i}?" for i in range(50)]
    expected = local.encode(texts)
    vectors = await asyncio.gather(*(local.embed(t) for t in texts))
    assert local.requests == 50 and local.texts_computed == 50
    assert local.model_calls <= 3  # 32 + 18 (max_batch 32), with a little slack
    for vector, want in zip(vectors, expected, strict=True):
        assert vector.shape == (384,) and vector.dtype == np.float32
        np.testing.assert_allclose(vector, want, atol=1e-5)
    vectors[0][:] = 0  # every caller owns its array
    assert np.linalg.norm(vectors[1]) == pytest.approx(1.0, abs=1e-5)


async def test_identical_texts_in_a_batch_are_computed_once(local):
    texts = [ROUTER] * 20 + ["other"] * 5 + [ROUTER]
    vectors = await asyncio.gather(*(local.embed(t) for t in texts))
    assert local.model_calls == 1 and local.texts_computed == 2 and local.requests == 26
    for vector, text in zip(vectors, texts, strict=True):
        np.testing.assert_allclose(vector, vectors[0] if text == ROUTER else vectors[20])
    assert vectors[0] is not vectors[1]


async def test_embed_many_keeps_order_and_joins_concurrent_embeds(local):
    assert (await local.embed_many([])).shape == (0, 384)
    many, one = await asyncio.gather(local.embed_many(["b", "a", "b"]), local.embed("a"))
    assert many.shape == (3, 384) and local.model_calls == 1 and local.texts_computed == 2
    np.testing.assert_allclose(many[1], one)
    np.testing.assert_allclose(many[0], many[2])
    np.testing.assert_allclose(many, local.encode(["b", "a", "b"]), atol=1e-5)


async def test_the_model_runs_off_the_event_loop(local):
    texts = [f"{i} {LOREM}" for i in range(8)]  # 8 x 256 tokens: a few hundred ms of work
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.perf_counter()
    await local.embed_many(texts)
    elapsed = time.perf_counter() - started
    tick.cancel()
    assert local.model_calls == 1
    assert len(gaps) > 10 and max(gaps) < max(0.1, elapsed / 3)


def test_default_embedder_shares_the_loaded_model(local):
    first, second = default_embedder(), default_embedder()
    assert first is not second and first._model is second._model
    assert first._model.precision == "int8" and local._model is not first._model  # fp32 apart
    assert LocalEmbedder(precision="fp32")._model is local._model


def test_a_tampered_model_file_is_refused(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="SHA-256"):
        LocalEmbedder(tmp_path)


def test_a_model_folder_without_its_files_is_an_error_naming_the_folder_and_file(
    tmp_path, model_dir
):
    # A FileNotFoundError: `carpool serve` ended in a traceback; the folder is the operator's
    # choice (semantic.model_dir), so no other copy is looked for.
    with pytest.raises(ValueError, match="model.safetensors") as raised:
        LocalEmbedder(tmp_path)
    assert str(tmp_path) in str(raised.value)
    (tmp_path / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="tokenizer.json") as raised:
        LocalEmbedder(tmp_path)
    assert str(tmp_path) in str(raised.value)


def _opens(directory: Path):
    """A counter of the files opened in ``directory`` (Linux inotify: whoever opens them, Python
    or a library's native code): ``read()`` -> ``{name: opens}`` since the last read."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    # IN_OPEN, and IN_CLOSE_NOWRITE between them: two opens in a row would be one event.
    if fd < 0 or libc.inotify_add_watch(fd, str(directory).encode(), 0x20 | 0x10) < 0:
        pytest.skip("no inotify here")

    class Opens:
        def read(self) -> dict[str, int]:
            counts: dict[str, int] = {}
            while True:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    return counts
                at = 0
                while at < len(data):
                    _, mask, _, size = struct.unpack_from("iIII", data, at)
                    name = data[at + 16 : at + 16 + size].rstrip(b"\0").decode()
                    if mask & 0x20:
                        counts[name] = counts.get(name, 0) + 1
                    at += 16 + size

        def close(self) -> None:
            os.close(fd)

    return Opens()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts opens with inotify")
def test_the_embedder_loads_the_bytes_it_checked_reading_each_file_once(tmp_path, model_dir):
    # It hashed each file, then opened it again to load it: bytes replaced in between were
    # loaded unchecked (the verifier already read its files once).
    for name in E.MODEL_SHA256:
        shutil.copyfile(model_dir / name, tmp_path / name)
    opens = _opens(tmp_path)
    try:
        model = minilm._MiniLM(tmp_path, runtime="numpy", precision="fp32")
        assert opens.read() == {name: 1 for name in E.MODEL_SHA256}
    finally:
        opens.close()
    assert model.tokenize(["hello"]) == [[101, 7592, 102]]


def test_missing_weights_say_how_to_fetch_them_and_a_missing_module_names_the_extra(monkeypatch):
    monkeypatch.setattr(weights, "MODEL_PACKAGES", (("carpool_no_such_weights_pkg", "model"),))
    monkeypatch.setattr(weights, "_hub_cache_dir", lambda: None)
    with pytest.raises(SemanticDependencyError, match="carpool fetch-model"):
        E.find_model_dir()
    with pytest.raises(
        SemanticDependencyError, match=r"pip install '\.\[semantic\]' in carpool's checkout"
    ):
        E._require("carpool_no_such_module")


def _hub_snapshot(cache: Path, source: Path) -> Path:
    """A Hugging Face cache holding the pinned revision's two files (as the hub client lays it
    out), copied from ``source``."""
    repo = cache / ("models--" + E.MODEL_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / E.MODEL_REVISION
    snapshot.mkdir(parents=True)
    for name in E.MODEL_SHA256:
        shutil.copyfile(source / name, snapshot / name)
    return snapshot


def test_the_model_is_found_in_the_hub_cache_at_the_pinned_revision_without_a_download(
    monkeypatch, tmp_path, model_dir
):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(weights, "MODEL_PACKAGES", ())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    # (0.23's file_download copied the setting when imported: its copy too.)
    from huggingface_hub import file_download

    monkeypatch.setattr(file_download, "HF_HUB_CACHE", str(tmp_path), raising=False)
    snapshot = _hub_snapshot(tmp_path, model_dir)
    assert E.find_model_dir() == snapshot
    assert E.find_model_dir(model_dir) == model_dir  # semantic.model_dir comes first


def test_fetch_model_keeps_only_files_with_the_pinned_digests(monkeypatch, tmp_path, model_dir):
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import file_download  # (where carpool takes it from: ``weights._hub``)

    asked = []

    def download(repo, name, revision, cache_dir):  # the hub client, offline
        asked.append((repo, name, revision))
        target = tmp_path / "hub" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_dir / name, target)
        if tampered and name == "tokenizer.json":
            target.write_bytes(target.read_bytes() + b" ")
        return str(target)

    monkeypatch.setattr(file_download, "hf_hub_download", download)
    tampered = False
    assert E.fetch_model() == tmp_path / "hub"
    assert asked == [(E.MODEL_REPO, name, E.MODEL_REVISION) for name in E.MODEL_SHA256]
    tampered = True
    with pytest.raises(ValueError, match="SHA-256"):
        E.fetch_model()
    assert not (tmp_path / "hub" / "tokenizer.json").exists()


class FakeHub:
    """The Hugging Face hub's file endpoint on loopback, serving the pinned revision's two files
    (ETag = their SHA-256, as the hub's LFS files have); ``gets`` counts the downloads."""

    def __init__(self, files: dict[str, bytes]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hub = self
        self.gets: dict[str, int] = {}

        class Handler(BaseHTTPRequestHandler):
            def _head(self) -> bytes | None:
                name = self.path.rsplit("/", 1)[-1]
                data = files.get(name)
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                etag = f'"{hashlib.sha256(data).hexdigest()}"'
                self.send_response(200)
                self.send_header("X-Repo-Commit", E.MODEL_REVISION)
                self.send_header("ETag", etag)
                self.send_header("X-Linked-Etag", etag)
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return data

            def do_HEAD(self) -> None:
                self._head()

            def do_GET(self) -> None:
                data = self._head()
                if data is not None:
                    name = self.path.rsplit("/", 1)[-1]
                    hub.gets[name] = hub.gets.get(name, 0) + 1
                    self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fetch_model_run(tmp_path: Path, hub: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``carpool fetch-model --cache-dir tmp_path/cache`` against the hub at ``hub``, in an
    environment without the machine's HF_* and proxy settings, ``env`` added."""
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()
    }
    clean.update(HF_ENDPOINT=hub, HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf"))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "carpool.cli",
            "fetch-model",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )


def test_fetch_model_deletes_the_bytes_it_refused_so_the_next_fetch_downloads_them_afresh(
    tmp_path, model_dir
):
    # It said "removed" but unlinked only the snapshot's link: the hub client linked the same
    # cached bytes (its blob, by ETag) again, and every later fetch-model failed the digest.
    pytest.importorskip("huggingface_hub")
    hub = FakeHub({name: (model_dir / name).read_bytes() for name in E.MODEL_SHA256})

    def fetch() -> subprocess.CompletedProcess[str]:
        return fetch_model_run(tmp_path, hub.url)

    try:
        first = fetch()
        assert first.returncode == 0, first.stderr
        snapshot = Path(first.stdout.strip())
        blob = (snapshot / "tokenizer.json").resolve()
        with blob.open("ab") as f:  # (the disk, an edit, a bad mirror earlier)
            f.write(b" ")
        refused = fetch()
        assert refused.returncode == 1 and "SHA-256" in refused.stderr, refused.stderr
        assert f"deleted {blob}" in refused.stderr and not blob.exists()
        again = fetch()
        assert again.returncode == 0, again.stderr
        assert hub.gets == {"model.safetensors": 1, "tokenizer.json": 2}
        assert (snapshot / "tokenizer.json").read_bytes() == (
            model_dir / "tokenizer.json"
        ).read_bytes()
    finally:
        hub.close()


@pytest.mark.parametrize("variable", ["HTTPS_PROXY", "https_proxy", "ALL_PROXY"])
def test_fetch_model_with_a_proxy_setting_it_cannot_read_says_so_without_a_traceback(
    tmp_path, variable
):
    # The hub client's HTTP client refused the environment's proxy URL as it was made: a
    # 20-line traceback ending in "InvalidURL: Invalid port: ':1'", and nothing said which
    # setting it was.
    pytest.importorskip("huggingface_hub")
    done = fetch_model_run(tmp_path, "http://127.0.0.1:9", **{variable: "http://[::1"})
    assert done.returncode == 1, done.stderr
    assert "carpool: could not fetch the model" in done.stderr, done.stderr
    assert variable in done.stderr and "Traceback" not in done.stderr


def test_fetch_model_says_a_refusal_of_the_hub_in_one_line(tmp_path):
    # The hub client's message for a 401 ran over two lines (a link to a page about the status).
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    pytest.importorskip("huggingface_hub")

    class Refusing(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = fetch_model_run(tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert done.returncode == 1, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("carpool:")]
    assert len(said) == 1 and "401" in said[0], done.stderr
    after = done.stderr.split(said[0], 1)[1]
    assert not after.strip(), done.stderr  # (nothing of its message on the lines after)


# ------------------------------------------------------------------------------------------------
# The upstream embedder


class FakeEmbeddings:
    """A counting stand-in for POST /v1/embeddings: deterministic, un-normalised vectors."""

    def __init__(self, dim: int = 8, delay: float = 0.0) -> None:
        self.dim = dim
        self.delay = delay
        self.calls: list[list[str]] = []
        self.error: Exception | None = None

    def vector(self, text: str) -> list[float]:
        rng = np.random.default_rng(sum(text.encode()) + len(text))
        return (rng.standard_normal(self.dim) * 3).tolist()

    async def __call__(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        await asyncio.sleep(self.delay)
        if self.error is not None:  # (each call its own, as a real client raises)
            raise (
                type(self.error)(*self.error.args)
                if type(self.error) is RuntimeError
                else self.error
            )
        return [self.vector(t) for t in texts]


def unit(values: list[float]):
    v = np.asarray(values, dtype=np.float32)
    return v / np.linalg.norm(v)


async def test_upstream_embedder_batches_and_normalises():
    fake = FakeEmbeddings()
    embedder = UpstreamEmbedder(fake, dim=8, name="text-embedding-fake")
    assert isinstance(embedder, Embedder)
    texts = [f"prompt {i}" for i in range(40)] + ["prompt 3"] * 10
    vectors = await asyncio.gather(*(embedder.embed(t) for t in texts))
    assert [len(c) for c in fake.calls] == [32, 8]  # 40 distinct texts, two requests
    assert embedder.model_calls == 2 and embedder.texts_computed == 40
    for vector, text in zip(vectors, texts, strict=True):
        assert vector.dtype == np.float32 and vector.shape == (8,)
        np.testing.assert_allclose(vector, unit(fake.vector(text)), rtol=1e-6)
    many = await embedder.embed_many(["x", "y", "x"])
    assert fake.calls[-1] == ["x", "y"] and many.shape == (3, 8)


async def test_upstream_embedder_waits_for_the_delay_then_sends_what_came():
    fake = FakeEmbeddings()
    embedder = UpstreamEmbedder(fake, dim=8, max_delay_s=0.05)
    first = asyncio.create_task(embedder.embed("a"))
    await asyncio.sleep(0.01)
    assert fake.calls == []  # still collecting
    second = asyncio.create_task(embedder.embed("b"))
    await asyncio.gather(first, second)
    assert fake.calls == [["a", "b"]]


async def test_a_text_being_computed_is_joined_not_recomputed():
    fake = FakeEmbeddings(delay=0.05)
    embedder = UpstreamEmbedder(fake, dim=8, max_delay_s=0)
    first = asyncio.create_task(embedder.embed("a"))
    await asyncio.sleep(0.01)  # "a" is in flight now
    second = await embedder.embed("a")
    np.testing.assert_allclose(await first, second)
    assert len(fake.calls) == 1


async def test_upstream_errors_reach_every_caller_of_the_batch_and_then_clear():
    fake = FakeEmbeddings()
    fake.error = RuntimeError("upstream 503")
    embedder = UpstreamEmbedder(fake, dim=8)
    results = await asyncio.gather(*(embedder.embed(t) for t in "abc"), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results) and len(fake.calls) == 1
    fake.error = None
    assert (await embedder.embed("a")).shape == (8,)


async def test_a_wrong_shape_from_upstream_is_an_error():
    async def call(texts: list[str]) -> list[list[float]]:
        return [[1.0, 0.0]] * len(texts)

    with pytest.raises(ValueError, match="vectors of 2 dimensions, semantic.embedding_dim says 8"):
        await UpstreamEmbedder(call, dim=8).embed("a")


async def test_a_cancelled_caller_does_not_cancel_the_batch():
    fake = FakeEmbeddings(delay=0.02)
    embedder = UpstreamEmbedder(fake, dim=8)
    doomed = asyncio.create_task(embedder.embed("a"))
    survivor = asyncio.create_task(embedder.embed("a"))
    await asyncio.sleep(0.01)
    doomed.cancel()
    np.testing.assert_allclose(await survivor, unit(fake.vector("a")), rtol=1e-6)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert len(fake.calls) == 1


async def test_an_embedding_not_made_within_the_timeout_fails_and_frees_its_slot():
    # One call at a time (max_in_flight=1): the first never answers. Its callers give up after
    # timeout_s, and so does the call itself, so that the next batch is sent, not held behind it.
    fake = FakeEmbeddings()
    never = asyncio.Event()
    answered = fake.__call__

    async def call(texts: list[str]) -> list[list[float]]:
        if not fake.calls:
            fake.calls.append(list(texts))
            await never.wait()
        return await answered(texts)

    embedder = UpstreamEmbedder(call, dim=8, max_in_flight=1, timeout_s=0.05)
    with pytest.raises(TimeoutError):
        await embedder.embed("hung")
    np.testing.assert_allclose(await embedder.embed("next"), unit(fake.vector("next")), rtol=1e-6)
    assert fake.calls == [["hung"], ["next"]]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        UpstreamEmbedder(FakeEmbeddings(), dim=8, max_batch=0)
    with pytest.raises(ValueError):
        UpstreamEmbedder(FakeEmbeddings(), dim=0)
    with pytest.raises(ValueError):
        UpstreamEmbedder(FakeEmbeddings(), dim=8, timeout_s=0)


async def test_embed_takes_a_str():
    embedder = UpstreamEmbedder(FakeEmbeddings(), dim=8)
    with pytest.raises(TypeError):
        await embedder.embed(["a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await embedder.embed_many("abc")  # type: ignore[arg-type]


def test_an_embedder_outlives_its_event_loop():
    fake = FakeEmbeddings(delay=10)  # never answers before the loop is gone
    embedder = UpstreamEmbedder(fake, dim=8, max_delay_s=0)

    async def abandon() -> None:
        task = asyncio.create_task(embedder.embed("a"))
        await asyncio.sleep(0.01)  # "a" is being computed
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # (the abandoned batch is cancelled
        await asyncio.sleep(0)  # with it; let that finish)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(abandon())
    finally:
        loop.close()
    fake.delay = 0
    vector = asyncio.run(embedder.embed("a"))  # a new loop: not stuck on the old batch
    np.testing.assert_allclose(vector, unit(fake.vector("a")), rtol=1e-6)
    assert len(fake.calls) == 2


async def test_the_breaker_opens_when_its_own_text_fails_too_and_backs_off_only_as_checks_fail():
    # Calls sent before it opened and failing after doubled its pause each: a burst of ten
    # lookups on a hung embedder opened it for 30 s at once. Now only a failed check doubles it,
    # and an answer about the texts (a 4xx) closes it: the embedder answered. Failures in a row
    # open it only once the embedder fails the gateway's own text too (CHECK_TEXT, asked alone).
    from carpool.errors import UpstreamStatusError
    from carpool.semantic.embed import upstream
    from carpool.semantic.embed.upstream import RETRY_MIN_S, EmbedderDown

    fake = FakeEmbeddings()
    embedder = UpstreamEmbedder(fake, dim=8, max_batch=1)
    breaker = embedder.breaker
    fake.error = RuntimeError("upstream 503")
    burst = await asyncio.gather(
        *(embedder.embed(f"t{i}") for i in range(10)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in burst) and len(fake.calls) == 10
    assert breaker.retry_at is None  # (clients' texts alone: not yet)
    with pytest.raises(RuntimeError):  # its check fails: open
        await embedder.embed("checked first")
    assert fake.calls[10:] == [[upstream.CHECK_TEXT]]  # (the caller's own text not sent)
    assert breaker.retry_at is not None and breaker.retry_s == RETRY_MIN_S
    with pytest.raises(EmbedderDown):
        await embedder.embed("skipped")
    assert len(fake.calls) == 11  # (not sent)
    breaker.retry_at = 0.0  # (its pause has passed) the check fails: twice the pause
    with pytest.raises(RuntimeError):
        await embedder.embed("try")
    assert breaker.retry_s == 2 * RETRY_MIN_S and fake.calls[11:] == [[upstream.CHECK_TEXT]]
    fake.error = UpstreamStatusError(400, b'{"error": "input too long"}')
    breaker.retry_at = 0.0
    with pytest.raises(UpstreamStatusError):
        await embedder.embed("a text it refuses")
    assert breaker.retry_at is None and breaker.failures == 0  # it answered: closed
    fake.error = None
    assert (await embedder.embed("a")).shape == (8,)


async def test_texts_the_embedder_fails_while_it_answers_its_own_never_open_the_breaker():
    # An input the engine cannot take (llama.cpp: a 500 over its batch size) failed three
    # embeddings in a row and opened the breaker for every text. Now each three failures in a
    # row cost one check of the gateway's own text, and while that is answered the breaker
    # stays closed: the failing texts are their requesters' misses, the others embedded.
    from carpool.errors import UpstreamStatusError
    from carpool.semantic.embed import upstream

    fake = FakeEmbeddings()

    async def call(texts: list[str]) -> list[list[float]]:
        if any(t.startswith("too long") for t in texts):
            fake.calls.append(list(texts))
            raise UpstreamStatusError(500, b'{"error": "input is too large to process"}')
        return await fake(texts)

    embedder = UpstreamEmbedder(call, dim=8, max_batch=1)
    for round_ in range(3):
        for n in range(3):
            with pytest.raises(UpstreamStatusError):
                await embedder.embed(f"too long {round_} {n}")
        vector = await embedder.embed(f"another's {round_}")  # checks first, then embeds
        np.testing.assert_allclose(vector, unit(fake.vector(f"another's {round_}")), rtol=1e-6)
        assert embedder.breaker.retry_at is None and embedder.breaker.failures == 0
    checks = [c for c in fake.calls if c == [upstream.CHECK_TEXT]]
    assert len(checks) == 3  # (one per three failures in a row)


async def test_a_check_that_fails_after_a_client_embedding_succeeded_meanwhile_leaves_it_closed():
    # The check failed (a blip) while another caller's text was embedded: that success reset
    # the failures in a row to 0, and the failed check opened the breaker anyway ("failed 0
    # embeddings in a row"), every lookup skipping an embedder that answers. It opens only if
    # the failures in a row still call for it as the check ends.
    from carpool.errors import UpstreamStatusError, UpstreamUnreachable
    from carpool.semantic.embed import upstream

    fake = FakeEmbeddings()
    check_sent, check_fails = asyncio.Event(), asyncio.Event()

    async def call(texts: list[str]) -> list[list[float]]:
        if texts == [upstream.CHECK_TEXT]:
            fake.calls.append(list(texts))
            check_sent.set()
            await check_fails.wait()
            raise UpstreamUnreachable("a blip")
        if texts[0].startswith("failed"):
            fake.calls.append(list(texts))
            raise UpstreamStatusError(500, b"{}")
        return await fake(texts)

    embedder = UpstreamEmbedder(call, dim=8, max_batch=1, max_delay_s=0)
    for n in range(upstream.FAILURES_TO_OPEN):
        with pytest.raises(UpstreamStatusError):
            await embedder.embed(f"failed {n}")
    checking = asyncio.create_task(embedder.embed("checks first"))
    await check_sent.wait()
    assert (await embedder.embed("another's, meanwhile")).shape == (8,)
    assert embedder.breaker.failures == 0
    check_fails.set()
    assert (await checking).shape == (8,)  # (it answers: the checker's own text embedded)
    assert embedder.breaker.retry_at is None  # (closed: it answered a client meanwhile)
    assert (await embedder.embed("next")).shape == (8,)


def _broken_hub(
    setup: str, *args: str, setting: str | None = UNREADABLE
) -> subprocess.CompletedProcess[str]:
    """``python -c SETUP ARGS...`` with ``HF_HUB_DOWNLOAD_TIMEOUT=SETTING`` (by default one
    huggingface_hub cannot read, when imported; None: none)."""
    return subprocess.run(
        [sys.executable, "-c", setup, *args],
        env=model_env(hub_setting=setting),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("broken", "setting", "said"),
    [
        ("", UNREADABLE, "invalid literal for int()"),  # (a setting it cannot read)
        ("import sys; sys.modules['filelock'] = None; ", None, "filelock"),  # (its dependency)
    ],
)
def test_a_hub_client_that_cannot_start_is_said_as_such_never_as_missing_weights(
    broken, setting, said
):
    """A hub client setting it cannot read was a bare "invalid literal for int()" naming no
    setting; a dependency of its own missing read as "the weights are not here" (the files in
    its cache) and as "needs huggingface_hub"."""
    done = _broken_hub(
        broken + "from carpool.semantic.embed import weights; weights._hub_cache_dir()",
        setting=setting,
    )
    assert "HubClientError: the Hugging Face hub client could not start" in done.stderr
    assert said in done.stderr and "weights are not here" not in done.stderr


def test_fetch_model_with_a_hub_client_that_cannot_start_says_so_and_exits_2():
    done = _broken_hub("from carpool.cli import main; main()", "fetch-model")
    assert done.returncode == 2, done.stderr
    assert "carpool: the Hugging Face hub client could not start" in done.stderr
    assert "HF_* environment variables" in done.stderr and "Traceback" not in done.stderr


def _packaged() -> bool:
    """Whether the tests' model package is installed (requirements/test-model.txt)."""
    import importlib.util

    return importlib.util.find_spec(E.MODEL_PACKAGES[0][0]) is not None


def test_a_hub_client_that_cannot_start_stops_no_one_whose_model_is_in_a_package():
    """Its cache is one place of several: the files found in a package are used, and the hub
    client's failure is said only when they are nowhere."""
    if not _packaged():
        pytest.skip("the tests' model package is not installed: requirements/test-model.txt")
    done = _broken_hub(
        "from carpool.semantic.embed import weights; print(weights.find_model_dir())"
    )
    assert done.returncode == 0, done.stderr
    # (Nothing else on stdout, where a child announces itself: no "Error importing ...".)
    (found,) = done.stdout.splitlines()
    assert found.endswith(E.MODEL_PACKAGES[0][1]), done.stdout


def test_the_hub_client_is_imported_with_stdout_untouched(monkeypatch):
    """A lookup never swaps ``sys.stdout`` around the hub client's import (process-wide: two
    overlapping lookups left it on stderr for good, and another thread's output went there
    meanwhile): seen at every import it makes, loaded already or not."""
    import importlib
    import types

    stdout, seen = sys.stdout, []

    def import_module(name: str, *args: Any) -> types.ModuleType:
        seen.append(sys.stdout is stdout)
        return importlib.import_module(name, *args)

    monkeypatch.setattr(
        weights,
        "importlib",
        types.SimpleNamespace(import_module=import_module, util=importlib.util),
    )
    E.find_model_dir()
    assert seen and all(seen)


def test_fetch_model_says_a_fetch_that_failed_even_when_the_error_is_a_value_error_too(
    monkeypatch,
):
    """huggingface_hub 0.23's "not found locally" is an OSError and a ValueError: a failed
    fetch, not a digest that differs."""
    from click.testing import CliRunner

    from carpool.cli import main

    class NotFound(OSError, ValueError):
        pass

    def fetch(cache_dir=None):
        raise NotFound("An error happened while trying to locate the file on the Hub")

    monkeypatch.setattr(E, "fetch_model", fetch)
    result = CliRunner().invoke(main, ["fetch-model"])
    assert result.exit_code == 1
    assert "carpool: could not fetch the model: An error happened" in result.output
