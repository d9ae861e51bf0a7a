"""The simulated engine: OpenAI-shaped answers, cost model, prefix cache, counters, HTTP server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import struct
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest
import uvicorn

from carpool.apis import messages as messages_api
from carpool.config import SimConfig
from carpool.upstream.base import UpstreamRequest
from carpool.upstream.sim import (
    PrefixCache,
    SimReplica,
    SimUpstream,
    build_replicas,
    embedding_vector,
)
from carpool.upstream.sim_server import _announce_when_started, create_app, serve_replicas
from fakes.serving import serve_app
from fakes.waiting import eventually

FAST = SimConfig(decode_ms_per_token=0.5, prefill_ms_per_token=0.01)


def chat(content: str = "What is a carpool?", **fields: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": content}], **fields}


def replica(**overrides: Any) -> SimReplica:
    return SimReplica("sim-0", FAST.model_copy(update=overrides))


class RecordingSleep:
    """Stands in for asyncio.sleep: records every sleep and still yields to the loop."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    async def __call__(self, seconds: float) -> None:
        self.log.append(("sleep", seconds))
        await asyncio.sleep(0)


async def answer(sim: SimReplica, body: dict[str, Any], path: str = "/chat/completions") -> dict:
    reply = await sim.handle(path, body)
    assert reply.status == 200, reply.body
    return reply.body


async def collect(sim: SimReplica, body: dict[str, Any], path: str = "/chat/completions") -> list:
    reply = await sim.handle(path, {**body, "stream": True})
    assert reply.chunks is not None
    return [chunk async for chunk in reply.chunks]


def text_of(body: dict[str, Any]) -> str:
    return body["choices"][0]["message"]["content"]


# --------------------------------------------------------------------------- text


async def test_temperature_zero_text_is_deterministic():
    first, second = replica(), replica()
    a = await answer(first, chat(temperature=0))
    b = await answer(second, chat(temperature=0))
    assert text_of(a) == text_of(b)
    assert text_of(a) != text_of(await answer(first, chat("Something else", temperature=0)))


async def test_top_k_one_is_greedy_too():
    sim = replica()
    assert text_of(await answer(sim, chat(top_k=1, temperature=0.9))) == text_of(
        await answer(sim, chat(temperature=0))
    )


async def test_sampled_text_differs_between_calls():
    sim = replica()
    texts = {text_of(await answer(sim, chat(temperature=0.8))) for _ in range(5)}
    texts |= {text_of(await answer(sim, chat())) for _ in range(5)}  # absent temperature samples
    assert len(texts) == 10


async def test_seed_makes_sampled_text_deterministic():
    a = await answer(replica(), chat(temperature=0.8, seed=7))
    b = await answer(replica(), chat(temperature=0.8, seed=7))
    c = await answer(replica(), chat(temperature=0.8, seed=8))
    assert text_of(a) == text_of(b) != text_of(c)


async def test_max_tokens_is_honoured_with_finish_reason_length():
    sim = replica()
    full = await answer(sim, chat(temperature=0, max_tokens=1000))
    capped = await answer(sim, chat(temperature=0, max_tokens=3))
    newer_name = await answer(sim, chat(temperature=0, max_completion_tokens=3, max_tokens=50))
    assert full["choices"][0]["finish_reason"] == "stop"
    assert capped["choices"][0]["finish_reason"] == "length"
    assert text_of(capped).split() == text_of(full).split()[:3]
    assert text_of(newer_name) == text_of(capped)


async def test_default_max_tokens_caps_the_answer():
    body = await answer(replica(default_max_tokens=2), chat(temperature=0))
    assert body["usage"]["completion_tokens"] == 2
    assert body["choices"][0]["finish_reason"] == "length"


async def test_usage_is_reported():
    body = await answer(replica(), chat("one two three", temperature=0))
    usage = body["usage"]
    assert usage["completion_tokens"] == len(text_of(body).split())
    assert usage["prompt_tokens"] > 3  # three words plus the chat template's framing
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chat_answer_has_openai_shape_and_is_labelled_simulated():
    body = await answer(replica(), chat(temperature=0))
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "test-model"
    assert body["system_fingerprint"] == "carpool-sim"
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant"


async def test_n_choices_are_indexed_and_decoded_together():
    sleep = RecordingSleep()
    sim = SimReplica("sim-0", FAST, sleep=sleep)
    body = await answer(sim, chat(temperature=0, n=3, max_tokens=5))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 15
    prefill, decode = (seconds for _, seconds in sleep.log)
    assert decode == pytest.approx(5 * FAST.decode_ms_per_token / 1000)  # 5 steps, not 15


async def test_completions_serve_a_list_of_prompts_with_n_choices_each():
    body = await answer(
        replica(),
        {"model": "m", "prompt": ["say hi", [1, 2, 3]], "n": 2, "temperature": 0},
        path="/completions",
    )
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy: same for every n
    assert body["choices"][0]["text"] != body["choices"][2]["text"]  # another prompt
    assert body["usage"]["prompt_tokens"] == 2 + 3


# --------------------------------------------------------------------------- streaming


async def test_stream_is_shaped_like_openai_and_matches_the_whole_answer():
    sim = replica()
    chunks = await collect(sim, chat(temperature=0, max_tokens=6))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == text_of(await answer(sim, chat(temperature=0, max_tokens=6)))


async def test_stream_chunks_are_spread_over_time():
    sleep = RecordingSleep()
    sim = SimReplica("sim-0", FAST, sleep=sleep)
    reply = await sim.handle("/chat/completions", chat(temperature=0, max_tokens=5, stream=True))
    async for chunk in reply.chunks:
        if chunk["choices"][0]["delta"].get("content"):
            sleep.log.append(("token", chunk))
    kinds = [kind for kind, _ in sleep.log]
    # One prefill sleep, then a decode sleep before every token.
    assert kinds == ["sleep"] + ["sleep", "token"] * 5


async def test_stream_include_usage_adds_final_usage_chunk():
    chunks = await collect(
        replica(), chat(temperature=0, max_tokens=4, stream_options={"include_usage": True})
    )
    *body, last = chunks
    assert all(c["usage"] is None for c in body)
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4


async def test_completions_stream_text_chunks():
    chunks = await collect(
        replica(), {"prompt": "hello", "temperature": 0, "max_tokens": 3}, path="/completions"
    )
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len(chunks) == 4  # three tokens, then the finish
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "length",
    }


# --------------------------------------------------------------------------- cost model


async def test_prefix_cache_makes_second_prompt_prefill_cheaper():
    sleep = RecordingSleep()
    sim = SimReplica("sim-0", FAST, sleep=sleep)
    system = {"role": "system", "content": " ".join(f"rule{i}" for i in range(100))}

    def ask(question: str) -> dict[str, Any]:
        return {"messages": [system, {"role": "user", "content": question}], "temperature": 0}

    await answer(sim, ask("first question"))
    assert sim.stats()["cached_prompt_tokens"] == 0
    first_prefill = sleep.log[0][1]
    second = await answer(sim, ask("another question entirely"))
    cached = sim.stats()["cached_prompt_tokens"]
    assert cached >= 96  # the shared system prompt's full blocks
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert sleep.log[2][1] < first_prefill / 5


async def test_prefix_cache_is_a_bounded_lru_of_blocks():
    cache = PrefixCache(capacity_tokens=8, block_tokens=4)
    a = cache.block_ids("a b c d e f g h".split())
    b = cache.block_ids("x y z w".split())
    cache.touch(a)
    assert cache.cached_tokens(a, 9) == 8
    cache.touch(b)  # over capacity: a's tail block goes first, its head stays
    assert len(cache) == 2
    assert cache.cached_tokens(a, 9) == 4
    assert cache.cached_tokens(a, 8) == 4
    assert cache.cached_tokens(cache.block_ids("a b c d".split()), 4) == 3  # last token recomputed


async def test_concurrency_limit_queues():
    sim = replica(max_concurrency=2)
    await asyncio.gather(*(answer(sim, chat(f"q{i}", temperature=0)) for i in range(7)))
    stats = sim.stats()
    assert stats["max_in_flight"] == 2
    assert stats["queue_wait_seconds"] > 0
    assert stats["in_flight"] == 0 and stats["waiting"] == 0
    assert stats["calls"]["chat/completions"] == 7


async def test_every_call_the_engine_answers_is_counted():
    # A model's card, a path it does not serve (its 404) and a body that is not JSON (its 400)
    # were answered but counted nowhere: the gateway's upstream_calls ran ahead of the engine's
    # own count, which `carpool bench` reports as the same number (a review).
    sim = replica()
    async with serve_app(create_app(sim)) as url, httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/v1/models/foo")).status_code == 200
        assert (await client.get("/v1/files")).status_code == 404
        bad = await client.post("/v1/chat/completions", content=b"{bad")
        assert bad.status_code == 400
        stats = (await client.get("/sim/stats")).json()
    assert stats["calls"] == {"models": 1, "other": 1, "chat/completions": 1}
    assert stats["errors"] == 2
    # The embedded engine (``carpool serve`` without --upstream) counts its pass-through too.
    embedded = SimUpstream(replica())
    for path in ("/v1/models", "/v1/models/foo", "/v1/nothing"):
        await embedded.passthrough("GET", path, b"", {}, b"")
    assert embedded.replica.stats()["calls"] == {"models": 2, "other": 1}


async def test_counters_add_up():
    sim = replica()
    body = await answer(sim, chat(temperature=0))
    chunks = await collect(sim, chat("other", temperature=0, max_tokens=4))
    await answer(sim, {"model": "e", "input": "an embedding has no first token"}, "/embeddings")
    stats = sim.stats()
    assert stats["simulated"] is True and stats["replica"] == "sim-0"
    assert stats["completion_tokens"] == body["usage"]["completion_tokens"] + 4
    # Generation requests only: an embeddings call's pass was counted as a first token.
    assert stats["ttft_count"] == 2 and stats["ttft_seconds_sum"] > 0
    assert stats["busy_seconds"] > 0
    assert len(chunks) == 6


# --------------------------------------------------------------------------- the Upstream adapter


async def test_sim_upstream_answers_and_streams_payload_bytes():
    upstream = SimUpstream(SimReplica("sim-3", FAST))
    assert upstream.name == "sim-3"
    whole = await upstream.send(UpstreamRequest("/chat/completions", chat(temperature=0)))
    assert whole.status == 200 and not whole.streaming
    assert whole.headers["content-type"] == "application/json"
    assert whole.headers["x-carpool-simulated"] == "true"
    streamed = await upstream.send(
        UpstreamRequest("/chat/completions", chat(temperature=0), stream=True)
    )
    payloads = [orjson.loads(p) async for batch in streamed.events() for p in batch]
    await streamed.aclose()
    await streamed.aclose()  # safe twice
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    assert text == text_of(orjson.loads(whole.body))


async def test_cancelled_stream_releases_slot():
    sim = replica(max_concurrency=1, decode_ms_per_token=5)
    upstream = SimUpstream(sim)
    started = asyncio.Event()

    async def consume() -> None:
        response = await upstream.send(
            UpstreamRequest("/chat/completions", chat(max_tokens=40), stream=True)
        )
        async for _ in response.events():
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    assert sim.stats()["in_flight"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sim.stats()["in_flight"] == 0
    await asyncio.wait_for(answer(sim, chat(max_tokens=2)), 1)  # the one slot is free again


async def test_closed_stream_releases_slot():
    sim = replica(max_concurrency=1)
    upstream = SimUpstream(sim)
    response = await upstream.send(UpstreamRequest("/chat/completions", chat(), stream=True))
    await anext(response.events())
    assert sim.stats()["in_flight"] == 1
    await response.aclose()
    assert sim.stats()["in_flight"] == 0


async def test_cancelled_send_while_queued_releases_everything():
    sim = replica(max_concurrency=1, decode_ms_per_token=5)
    upstream = SimUpstream(sim)
    first = asyncio.create_task(upstream.send(UpstreamRequest("/chat/completions", chat())))
    queued = asyncio.create_task(upstream.send(UpstreamRequest("/chat/completions", chat())))
    await eventually(lambda: sim.stats()["waiting"] == 1, what="the second request queued")
    queued.cancel()
    first.cancel()
    await asyncio.gather(first, queued, return_exceptions=True)
    stats = sim.stats()
    assert (stats["in_flight"], stats["waiting"]) == (0, 0)
    await asyncio.wait_for(answer(sim, chat(max_tokens=2)), 1)


async def test_passthrough_serves_models_and_404s_the_rest():
    upstream = SimUpstream(SimReplica("sim-0", FAST))
    models = await upstream.passthrough("GET", "/models", b"", {}, b"")
    body = orjson.loads(b"".join([part async for part in models.body]))
    assert models.status == 200 and body["data"][0]["id"] == "carpool-sim"
    assert (b"x-carpool-simulated", b"true") in models.headers
    missing = await upstream.passthrough("POST", "/files", b"", {}, b"{}")
    error = orjson.loads(b"".join([part async for part in missing.body]))
    assert missing.status == 404 and error["error"]["type"] == "invalid_request_error"


def test_build_replicas_names_each_replica():
    sims = build_replicas(SimConfig(replicas=3))
    assert [s.name for s in sims] == ["sim-0", "sim-1", "sim-2"]


# --------------------------------------------------------------------------- embeddings, errors


async def test_embeddings_are_deterministic_unit_vectors():
    sim = replica(embedding_dim=16)
    body = await answer(sim, {"model": "e", "input": ["hello world", "bye"]}, path="/embeddings")
    again = await answer(
        replica(embedding_dim=16), {"model": "e", "input": "hello world"}, path="/embeddings"
    )
    assert body["object"] == "list" and body["model"] == "e"
    assert [d["index"] for d in body["data"]] == [0, 1]
    first = body["data"][0]["embedding"]
    assert len(first) == 16
    assert math.isclose(sum(x * x for x in first), 1.0, rel_tol=1e-9)
    assert again["data"][0]["embedding"] == first
    assert body["data"][1]["embedding"] != first
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


async def test_embeddings_accept_token_arrays_and_base64():
    sim = replica(embedding_dim=8)
    arrays = await answer(sim, {"input": [[1, 2], [3]]}, path="/embeddings")
    assert len(arrays["data"]) == 2 and arrays["usage"]["prompt_tokens"] == 3
    single = await answer(sim, {"input": [1, 2]}, path="/embeddings")
    assert single["data"][0]["embedding"] == arrays["data"][0]["embedding"]
    packed = await answer(sim, {"input": [1, 2], "encoding_format": "base64"}, path="/embeddings")
    floats = struct.unpack("<8f", base64.b64decode(packed["data"][0]["embedding"]))
    assert floats == pytest.approx(single["data"][0]["embedding"], rel=1e-6)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/chat/completions", {"model": "m"}),
        ("/chat/completions", {"messages": []}),
        ("/chat/completions", {"messages": ["hi"]}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}),
        ("/completions", {"model": "m"}),
        ("/completions", {"prompt": [1.5]}),
        ("/embeddings", {"model": "m"}),
        ("/embeddings", {"input": ""}),
        ("/embeddings", {"input": []}),
        ("/chat/completions", ["not", "an", "object"]),
    ],
)
async def test_invalid_bodies_get_openai_400(path, body):
    sim = replica()
    reply = await sim.handle(path, body)
    assert reply.status == 400
    assert reply.body["error"]["type"] == "invalid_request_error"
    assert reply.body["error"]["message"]
    assert sim.stats()["errors"] == 1


async def test_unknown_path_is_openai_404():
    reply = await replica().handle("/fine_tuning/jobs", {})
    assert reply.status == 404
    assert set(reply.body["error"]) == {"message", "type", "param", "code"}


# --------------------------------------------------------------------------- Responses, Messages


def responses_body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "test-model",
        "instructions": "Be brief.",
        "input": "What is a carpool?",
        "temperature": 0,
        **fields,
    }


def messages_body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "test-model",
        "system": "Be brief.",
        "max_tokens": 64,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is a carpool?"}],
        **fields,
    }


API_BODIES = pytest.mark.parametrize(
    "path, make", [("/responses", responses_body), ("/messages", messages_body)]
)
LAST_EVENT = {"/responses": "response.completed", "/messages": "message_stop"}


def api_text(path: str, body: dict[str, Any]) -> str:
    if path == "/responses":
        return body["output"][0]["content"][0]["text"]
    return body["content"][0]["text"]


def delta_pieces(path: str, events: list[dict[str, Any]]) -> list[str]:
    if path == "/responses":
        return [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    return [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]


@API_BODIES
async def test_responses_and_messages_answer_in_their_shapes_as_their_chat_equivalent(path, make):
    sim = replica()
    body = await answer(sim, make(), path)
    if path == "/responses":
        assert body["object"] == "response" and body["status"] == "completed"
        assert body["output"][0]["type"] == "message"
        assert body["output"][0]["content"][0]["type"] == "output_text"
    else:
        assert body["type"] == "message" and body["role"] == "assistant"
        assert body["stop_reason"] == "end_turn" and body["content"][0]["type"] == "text"
    assert body["usage"]["output_tokens"] == len(api_text(path, body).split())
    assert body["usage"]["input_tokens"] > 0
    # Deterministic at temperature 0, and the same text as the chat request it stands for.
    assert api_text(path, await answer(sim, make(), path)) == api_text(path, body)
    as_chat = chat(temperature=0, max_tokens=64)
    as_chat["messages"].insert(0, {"role": "system", "content": "Be brief."})
    assert text_of(await answer(sim, as_chat)) == api_text(path, body)
    assert sim.stats()["calls"][path.lstrip("/")] == 2


@API_BODIES
async def test_a_cut_answer_says_so_in_each_apis_terms(path, make):
    cap = {"max_output_tokens": 3} if path == "/responses" else {"max_tokens": 3}
    body = await answer(replica(), make(**cap), path)
    assert body["usage"]["output_tokens"] == 3
    if path == "/responses":
        assert body["status"] == "incomplete"
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert body["stop_reason"] == "max_tokens"


@API_BODIES
async def test_typed_streams_send_one_delta_per_token_at_the_decode_pace(path, make):
    sleep = RecordingSleep()
    sim = SimReplica("sim-0", FAST, sleep=sleep)
    reply = await sim.handle(path, make(stream=True))
    assert reply.typed
    events = []
    async for event in reply.chunks:
        events.append(event)
        if event["type"] in ("response.output_text.delta", "content_block_delta"):
            sleep.log.append(("token", None))
    kinds = [kind for kind, _ in sleep.log]
    tokens = kinds.count("token")
    assert tokens > 1 and kinds == ["sleep"] + ["sleep", "token"] * tokens
    assert events[-1]["type"] == LAST_EVENT[path]
    whole = await answer(sim, make(), path)
    assert "".join(delta_pieces(path, events)) == api_text(path, whole)
    if path == "/responses":
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
    else:
        final = messages_api.assemble(events)
    assert api_text(path, final) == api_text(path, whole)
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == tokens
    assert sim.stats()["in_flight"] == 0


@API_BODIES
async def test_invalid_api_bodies_get_a_400_in_the_apis_shape(path, make):
    reply = await replica().handle(
        path, make(**({"input": 5} if path == "/responses" else {"messages": []}))
    )
    assert reply.status == 400
    if path == "/messages":
        assert reply.body["type"] == "error"
        assert reply.body["error"]["type"] == "invalid_request_error"
    else:
        assert reply.body["error"]["param"] == "input"


async def test_a_receive_that_replays_the_body_is_no_disconnect_and_the_request_is_served():
    # carpool bench's meaning upstream hands the simulator a receive that gives the body again
    # at once: the watch for a disconnect spun on it, and the event loop hung.
    body = orjson.dumps(chat(max_tokens=2))

    async def replaying() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": ("sim", 80),
    }
    await create_app(replica())(scope, replaying, send)
    assert sent[0]["status"] == 200
    assert orjson.loads(sent[1]["body"])["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "path, fields, name",
    [
        ("/responses", {"max_output_tokens": 0}, "max_output_tokens"),
        ("/responses", {"max_output_tokens": "many"}, "max_output_tokens"),
        ("/messages", {"max_tokens": 0}, "max_tokens"),
        ("/messages", {"stop_sequences": 5}, "stop_sequences"),
        ("/messages", {"stop_sequences": ["end", 5]}, "stop_sequences"),
    ],
)
async def test_an_api_field_refused_is_named_as_the_client_sent_it(path, fields, name):
    # They were checked as the chat request they stand for: the 400 named `max_tokens` for a
    # Responses request's max_output_tokens, and `stop` for a message's stop_sequences.
    make = responses_body if path == "/responses" else messages_body
    async with serve_app(create_app(replica()), http="httptools") as url:
        async with httpx.AsyncClient(base_url=url) as client:
            refused = await client.post(f"/v1{path}", json=make(**fields))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert f"'{name}'" in error["message"], error
    chat_name = {"max_output_tokens": "max_tokens", "stop_sequences": "stop"}.get(name)
    assert chat_name is None or f"'{chat_name}'" not in error["message"]
    if path == "/responses":
        assert error["param"] == name
    else:
        assert (refused.json()["type"], error["type"]) == ("error", "invalid_request_error")


# --------------------------------------------------------------------------- HTTP server


@pytest.fixture
async def http_client():
    sim = replica()
    transport = httpx.ASGITransport(app=create_app(sim))
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        yield client


async def test_http_server_answers_like_openai(http_client):
    response = await http_client.post("/v1/chat/completions", json=chat(temperature=0))
    assert response.status_code == 200
    assert response.headers["x-carpool-simulated"] == "true"
    assert response.json()["system_fingerprint"] == "carpool-sim"
    models = await http_client.get("/v1/models")
    assert models.json()["data"][0]["id"] == "carpool-sim"
    embedded = await http_client.post("/v1/embeddings", json={"input": "hi"})
    assert embedded.json()["data"][0]["object"] == "embedding"


async def test_http_server_rejects_malformed_json_and_unknown_paths(http_client):
    malformed = await http_client.post(
        "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "invalid_request_error"
    missing = await http_client.get("/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = await http_client.get("/v1/chat/completions")
    assert wrong_method.status_code == 404 and "error" in wrong_method.json()


async def test_sim_stats_endpoint_says_simulated(http_client):
    await http_client.post("/v1/chat/completions", json=chat(temperature=0))
    stats = (await http_client.get("/sim/stats")).json()
    assert stats["simulated"] is True
    assert stats["replica"] == "sim-0"
    assert stats["calls"]["chat/completions"] == 1
    assert stats["completion_tokens"] > 0


@pytest.fixture
async def live_server():
    """The app on a real socket: SSE framing is only honest over HTTP."""
    sim = replica()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(sim), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1", sim
    server.should_exit = True
    await task


async def test_http_server_streams_sse_ending_with_done(live_server):
    base_url, sim = live_server
    async with httpx.AsyncClient() as client:
        async with client.stream(
            "POST",
            f"{base_url}/chat/completions",
            json=chat(temperature=0, max_tokens=5, stream=True),
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-carpool-simulated"] == "true"
            raw = b"".join([part async for part in response.aiter_bytes()])
    frames = raw.decode().split("\n\n")
    assert frames[-1] == ""  # every frame is terminated
    assert frames[-2] == "data: [DONE]"
    payloads = [orjson.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(f.startswith("data: {") for f in frames[:-2])
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert len(payloads) == 1 + 5 + 1
    assert sim.stats()["in_flight"] == 0


@API_BODIES
async def test_http_server_streams_typed_events_without_done(live_server, path, make):
    base_url, sim = live_server
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", f"{base_url}{path}", json=make(stream=True)) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([part async for part in response.aiter_bytes()])
    frames = raw.decode().split("\n\n")
    assert frames[-1] == "" and "[DONE]" not in raw.decode()
    for frame in frames[:-1]:
        name, data = frame.split("\n")
        assert name == "event: " + orjson.loads(data.removeprefix("data: "))["type"]
    assert frames[-2].startswith(f"event: {LAST_EVENT[path]}\n")
    assert sim.stats()["in_flight"] == 0


async def test_openai_sdk_works_against_the_sim_server(live_server):
    openai = pytest.importorskip("openai")
    base_url, _ = live_server
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        whole = await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], temperature=0
        )
        stream = await client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            pieces += [c.delta.content or "" for c in chunk.choices]
        embedding = await client.embeddings.create(model="any", input="hi")  # base64 by default
    finally:
        await client.close()
    assert whole.choices[0].message.content == "".join(pieces)
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert len(embedding.data[0].embedding) == FAST.embedding_dim


async def test_serve_replicas_runs_one_labelled_server_per_replica(capsys):
    task = asyncio.create_task(
        serve_replicas(FAST.model_copy(update={"replicas": 2}), "127.0.0.1", 0)
    )
    lines: list[str] = []
    while len(lines) < 2:
        assert not task.done(), "serve_replicas ended early"
        await asyncio.sleep(0.01)
        lines += capsys.readouterr().out.splitlines()
    try:
        assert all("SIMULATED engine, not a real model" in line for line in lines)
        urls = [line.rsplit(" ", 1)[1] for line in lines]
        async with httpx.AsyncClient() as client:
            names = [
                (await client.get(url.removesuffix("/v1") + "/sim/stats")).json()["replica"]
                for url in urls
            ]
        assert names == ["sim-0", "sim-1"]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_http_server_404s_name_the_path_as_sent_and_keep_each_apis_shape(live_server):
    url, _ = live_server
    base = url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base) as client:
        foo = (await client.post("/v1/foo", json={})).json()
        assert foo["error"]["message"] == "Invalid URL (POST /v1/foo)"
        bare = (await client.post("/foo", json={})).json()
        assert bare["error"]["message"] == "Invalid URL (POST /foo)"
        response = await client.get("/v1/responses/abc")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "unknown_url"
        assert "GET /v1/responses/abc (of the Responses API)" in response.json()["error"]["message"]
        count = await client.post("/v1/messages/count_tokens", json={})
        assert count.status_code == 404
        assert count.json()["type"] == "error"
        assert count.json()["error"]["type"] == "not_found_error"
        assert "POST /v1/messages/count_tokens" in count.json()["error"]["message"]


async def test_embeddings_in_flight_are_counted_apart_from_the_generation_slots():
    # Embeddings run in their own passes: they never made max_in_flight exceed max_concurrency.
    gate = asyncio.Event()

    async def held_sleep(seconds: float) -> None:
        await gate.wait()

    sim = SimReplica(
        "sim-0",
        FAST.model_copy(update={"max_concurrency": 1, "embedding_concurrency": 3}),
        sleep=held_sleep,
    )
    async with serve_app(create_app(sim)) as url, httpx.AsyncClient(base_url=url) as client:
        calls = [
            asyncio.create_task(client.post("/v1/embeddings", json={"input": f"item {i}"}))
            for i in range(3)
        ]
        await eventually(lambda: sim.embedding_in_flight == 3, what="three passes at once")
        gate.set()
        assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
        stats = (await client.get("/sim/stats")).json()
    assert stats["max_in_flight"] == 0 <= stats["max_concurrency"] == 1
    assert stats["max_embedding_in_flight"] == 3 == stats["embedding_concurrency"]
    assert stats["embedding_in_flight"] == 0


@pytest.mark.parametrize("http", ["httptools", "h11"])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat("left", max_tokens=40)),
        ("/v1/responses", {"model": "m", "input": "left", "max_output_tokens": 40}),
    ],
)
async def test_a_whole_answer_whose_client_left_is_abandoned_freeing_its_slot(http, path, body):
    # vLLM and SGLang abort a request whose connection closed, and the gateway relies on it: it
    # cancels a call every client left (coalesce.finish_abandoned: false). The simulator kept
    # decoding such a whole answer, holding one of max_concurrency slots, its tokens counted.
    released = asyncio.Event()

    async def decoding_until_released(seconds: float) -> None:
        await released.wait()

    sim = SimReplica(
        "sim-0", FAST.model_copy(update={"max_concurrency": 1}), sleep=decoding_until_released
    )
    async with serve_app(create_app(sim), http=http) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            left = asyncio.create_task(client.post(path, json=body))
            await eventually(lambda: sim.in_flight == 1, what="the request holding its slot")
            left.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await left
        # The client and its connection are closed; nothing lets the decode finish.
        await eventually(lambda: sim.in_flight == 0, what="the abandoned request's slot freed")
        released.set()
        async with httpx.AsyncClient(base_url=url) as client:
            stats = (await client.get("/sim/stats")).json()
            assert (stats["in_flight"], stats["waiting"], stats["completion_tokens"]) == (0, 0, 0)
            after = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
    assert sim.completion_tokens == 2  # the abandoned answer's tokens were never decoded


async def test_a_whole_answer_abandoned_mid_decode_counts_the_tokens_it_decoded():
    # A stream counts each token as it is decoded; a whole answer counted none of its own when
    # its client left part-way (a review: two answers ~7 tokens into their decode counted 0).
    now, sleeps, decoding = [0.0], [0], asyncio.Event()

    async def prefill_then_decode_for_ever(seconds: float) -> None:
        sleeps[0] += 1
        if sleeps[0] == 2:  # (the first sleep is the prefill's, the second the decode's)
            decoding.set()
            await asyncio.Event().wait()

    sim = SimReplica(
        "sim-0",
        FAST.model_copy(update={"decode_ms_per_token": 10.0}),
        sleep=prefill_then_decode_for_ever,
        clock=lambda: now[0],
    )
    async with serve_app(create_app(sim)) as url, httpx.AsyncClient(base_url=url) as client:
        left = asyncio.create_task(client.post("/v1/chat/completions", json=chat(max_tokens=40)))
        await decoding.wait()
        now[0] += 0.075  # 7.5 steps of 10 ms: 7 tokens decoded
        left.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await left
        await eventually(lambda: sim.in_flight == 0, what="the abandoned request's slot freed")
    assert sim.completion_tokens == 7


# ------------------------------------------------------------------- what one request may ask


def prompts(count: int) -> list[str]:
    return [f"prompt {i}" for i in range(count)]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/embeddings", {"input": "hi", "dimensions": 4097}, "dimensions"),
        ("/embeddings", {"input": prompts(2049)}, "input"),
        ("/embeddings", {"input": prompts(2048), "dimensions": 513}, "dimensions"),
        ("/completions", {"prompt": prompts(2049)}, "prompt"),
        ("/completions", {"prompt": prompts(17), "n": 128}, "n"),
        ("/chat/completions", chat(n=129), "n"),
    ],
)
async def test_a_request_past_one_of_the_engines_limits_is_a_400_that_names_it(path, body, param):
    reply = await replica().handle(path, body)
    assert reply.status == 400
    error = reply.body["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert any(str(limit) in error["message"] for limit in (4096, 2048, 1048576, 128))


class Ticker:
    """Counts the turns the event loop gives other tasks while a request is served."""

    def __init__(self) -> None:
        self.turns = 0
        self.done = False

    async def run(self) -> None:
        while not self.done:
            self.turns += 1
            await asyncio.sleep(0)


async def served_beside_a_ticker(sim: SimReplica, path: str, body: dict) -> tuple[dict, int]:
    ticker = Ticker()
    task = asyncio.create_task(ticker.run())
    try:
        return await answer(sim, body, path=path), ticker.turns
    finally:
        ticker.done = True
        await task


async def test_the_largest_embeddings_call_allowed_is_answered_yielding_the_loop_between_items():
    # The cost model's sleeps are one turn each here: the ticker counts the turns between items.
    sim = SimReplica(
        "sim-0", FAST.model_copy(update={"embedding_dim": 512}), sleep=RecordingSleep()
    )
    inputs = prompts(2048)
    body, turns = await served_beside_a_ticker(sim, "/embeddings", {"model": "e", "input": inputs})
    assert [d["index"] for d in body["data"]] == list(range(2048))
    assert all(len(datum["embedding"]) == 512 for datum in body["data"])
    for i in (0, 1, 1000, 2047):  # (each vector takes as long to check as to make)
        assert body["data"][i]["embedding"] == embedding_vector("e", inputs[i], 512)
    assert turns >= 2048


async def test_the_most_choices_allowed_are_answered_whole_handing_the_loop_back_between_prompts():
    sim = SimReplica("sim-0", FAST, sleep=RecordingSleep())
    request = {"model": "m", "prompt": prompts(16), "n": 128, "temperature": 0.7, "seed": 3}
    body, turns = await served_beside_a_ticker(sim, "/completions", {**request, "max_tokens": 2})
    assert [c["index"] for c in body["choices"]] == list(range(2048))
    one = await answer(
        replica(), {**request, "prompt": "prompt 5", "max_tokens": 2}, "/completions"
    )
    assert [c["text"] for c in body["choices"][5 * 128 : 6 * 128]] == [
        c["text"] for c in one["choices"]
    ]
    assert turns >= 16


async def test_a_stream_of_many_choices_hands_the_loop_back_within_each_decode_step():
    sim = SimReplica("sim-0", FAST, sleep=RecordingSleep())
    request = {"prompt": prompts(16), "n": 128, "temperature": 0, "max_tokens": 2}
    ticker = Ticker()
    task = asyncio.create_task(ticker.run())
    try:
        chunks = await collect(sim, request, path="/completions")
    finally:
        ticker.done = True
        await task
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == list(range(2048))
    # 2 tokens and a finish chunk per choice: 3 x 2048 chunks, a turn every 128 of them.
    assert ticker.turns >= 3 * 2048 // 128


# --------------------------------------------------------------------------- sampling values


async def test_a_number_is_read_as_its_value_whatever_its_spelling(http_client):
    def raw(temperature: str, top_p: str) -> bytes:
        return (
            '{"model": "m", "messages": [{"role": "user", "content": "spell"}], "seed": 5, '
            f'"temperature": {temperature}, "top_p": {top_p}}}'
        ).encode()

    async def text(content: bytes) -> str:
        response = await http_client.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text
        return text_of(response.json())

    spellings = [("1", "1"), ("1.0", "1.0"), ("1e0", "10e-1"), ("1", "1.0")]
    assert len({await text(raw(*spelling)) for spelling in spellings}) == 1
    assert await text(raw("0.5", "1")) != await text(raw("1", "1"))


async def test_a_text_is_read_in_its_composed_form_as_the_gateways_key_reads_it(http_client):
    # "café" written with a combining accent is one request to the gateway (its key is NFC):
    # the engine answered it otherwise, so which text a client got depended on which came first.
    async def text(content: str) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}
        response = await http_client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return text_of(response.json())

    composed, decomposed = "un caf\u00e9 noir", "un cafe\u0301 noir"
    assert await text(composed) == await text(decomposed)
    assert await text(composed) != await text("un cafe noir")


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/chat/completions", {"temperature": 2.01}, "temperature"),
        ("/chat/completions", {"temperature": 3, "seed": 1}, "temperature"),
        ("/chat/completions", {"temperature": -0.5}, "temperature"),
        ("/chat/completions", {"top_p": 1.5}, "top_p"),
        ("/chat/completions", {"top_p": -0.1}, "top_p"),
        ("/chat/completions", {"top_p": "1"}, "top_p"),
        ("/chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("/chat/completions", {"presence_penalty": -3}, "presence_penalty"),
        ("/chat/completions", {"top_logprobs": 21}, "top_logprobs"),
        ("/chat/completions", {"seed": "5"}, "seed"),
        ("/completions", {"logprobs": 6}, "logprobs"),
        ("/completions", {"best_of": 1, "n": 2}, "best_of"),
        ("/completions", {"best_of": 21}, "best_of"),
        ("/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/responses", {"temperature": 2.5}, "temperature"),
    ],
)
async def test_a_sampling_value_openai_refuses_is_a_400_naming_the_field(path, fields, param):
    body = {
        "/chat/completions": chat(),
        "/completions": {"model": "m", "prompt": "hi"},
        "/responses": responses_body(),
    }[path]
    reply = await replica().handle(path, {**body, **fields})
    assert reply.status == 400, reply.body
    error = reply.body["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert param in error["message"]


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/chat/completions", {"temperature": 2, "top_p": 0, "seed": -1}),
        ("/chat/completions", {"frequency_penalty": -2, "presence_penalty": 2.0}),
        ("/chat/completions", {"logprobs": True, "top_logprobs": 20}),
        ("/completions", {"logprobs": 5, "best_of": 3, "n": 3, "top_p": 1}),
    ],
)
async def test_the_sampling_values_openai_accepts_at_its_bounds_are_answered(path, fields):
    body = chat() if path == "/chat/completions" else {"model": "m", "prompt": "hi"}
    await answer(replica(), {**body, **fields}, path=path)


async def test_a_replica_stopped_as_it_started_is_announced_by_no_line_and_no_traceback(capsys):
    """A Ctrl-C as ``carpool sim`` started: uvicorn started and stopped at once, its sockets
    closed, and the announcement read the first of none (``IndexError``, exit 1)."""
    stopped = SimpleNamespace(started=True, servers=[SimpleNamespace(sockets=())])
    task = asyncio.get_running_loop().create_future()
    replica = SimpleNamespace(name="sim-0")
    await _announce_when_started([replica], [stopped], [task], "127.0.0.1")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k"])
async def test_messages_under_api_version_2026_10_21_refuse_sampling_parameters(field):
    """Anthropic's API version 2026-10-21 (the ``anthropic`` SDK 2.x's default) refuses
    ``temperature``, ``top_p`` and ``top_k``, even at their defaults: the simulated engine
    answered them, so sharing Messages by ``temperature: 0`` worked there and failed (400s)
    against Anthropic. Under 2023-06-01, and without the header, they are taken."""
    value = {"temperature": 0, "top_p": 1, "top_k": 1}[field]
    body = {k: v for k, v in messages_body().items() if k != "temperature"} | {field: value}
    new = await replica().handle("/v1/messages", body, {"anthropic-version": "2026-10-21"})
    assert new.status == 400 and new.body is not None
    assert new.body["type"] == "error"
    assert new.body["error"]["type"] == "invalid_request_error"
    assert field in new.body["error"]["message"]
    for headers in ({"anthropic-version": "2023-06-01"}, {}):
        assert (await replica().handle("/v1/messages", body, headers)).status == 200
