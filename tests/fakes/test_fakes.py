"""Tests of the test infrastructure itself: serve_app and the fake OpenAI-compatible upstream."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from . import upstream as upstream_module
from .serving import serve_app, serve_app_with_server
from .upstream import DEFAULT_FAIL_BODY, FakeUpstream, token_id

CHAT = "/v1/chat/completions"


def chat_body(prompt: str = "hello world", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], **extra}


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeUpstream, httpx.AsyncClient]]:
    upstream = FakeUpstream()
    async with serve_app(upstream) as url:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            yield upstream, client


async def read_sse(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of an SSE response: parsed JSON, or the string ``"[DONE]"``."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


# ------------------------------------------------------------------ serving


async def test_serve_app_gives_a_loopback_url_and_stops() -> None:
    async with serve_app_with_server(FakeUpstream()) as served:
        assert served.url == f"http://127.0.0.1:{served.port}"
        async with httpx.AsyncClient() as client:
            assert (await client.get(served.url + "/v1/models")).status_code == 200
    assert served.server.should_exit
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(served.url + "/v1/models")


async def test_shutdown_does_not_wait_forever_for_a_hung_request() -> None:
    upstream = FakeUpstream()
    upstream.hang = True
    client = httpx.AsyncClient(timeout=5.0)
    try:
        async with serve_app(upstream, shutdown_timeout=0.2) as url:
            pending = asyncio.ensure_future(client.post(url + CHAT, json=chat_body()))
            await upstream.wait_for_calls(1)
        # The server closed the connection of the hung request and the handler saw it.
        assert upstream.cancelled == 1 and upstream.in_flight == 0
        with pytest.raises(httpx.HTTPError):
            await pending
    finally:
        await client.aclose()


async def test_serve_app_runs_a_starlette_app_with_its_lifespan() -> None:
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    events: list[str] = []

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))], lifespan=lifespan)
    async with serve_app(app) as url:
        assert events == ["startup"]
        async with httpx.AsyncClient() as client:
            assert (await client.get(url + "/")).text == "ok"
    assert events == ["startup", "shutdown"]


async def test_serve_app_raises_when_startup_fails() -> None:
    async def app(scope, receive, send):
        assert scope["type"] == "lifespan"
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "nope"})

    with pytest.raises(RuntimeError, match="failed to start"):
        async with serve_app(app):
            pass  # pragma: no cover


# ------------------------------------------------------------------ answers and counting


async def test_chat_answers_reveal_the_call_and_are_counted(fake) -> None:
    upstream, client = fake
    r1 = await client.post(
        CHAT, json=chat_body("hello world"), headers={"Authorization": "Bearer sk-test"}
    )
    r2 = await client.post(CHAT, json=chat_body("again"))
    assert r1.status_code == 200 and r1.headers["content-type"] == "application/json"
    assert r1.headers["x-fake-call"] == "1"
    b1, b2 = r1.json(), r2.json()
    assert b1 == {
        "id": "chatcmpl-fake-1",
        "object": "chat.completion",
        "created": b1["created"],
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "answer 1 to hello world"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7},
        "system_fingerprint": "fp_fake",
    }
    assert b2["id"] == "chatcmpl-fake-2"
    assert b2["choices"][0]["message"]["content"] == "answer 2 to again"
    assert upstream.count() == 2 and upstream.count(CHAT) == 2 and upstream.count("/v1/x") == 0
    first = upstream.calls[0]
    assert first.path == CHAT and first.method == "POST" and first.number == 1
    assert first.body == chat_body("hello world")
    assert first.headers["authorization"] == "Bearer sk-test"
    assert "authorization" not in upstream.calls[1].headers
    assert upstream.completed == 2 and upstream.in_flight == 0 and upstream.cancelled == 0


async def test_chat_content_parts_and_answer_override(fake) -> None:
    upstream, client = fake
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = await client.post(
        CHAT,
        json={
            "model": "m",
            "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": parts}],
        },
    )
    assert r.json()["choices"][0]["message"]["content"] == "answer 1 to a b"
    upstream.answer_text = lambda n, body: f"custom {n} {body['model']}"
    r = await client.post(CHAT, json=chat_body())
    assert r.json()["choices"][0]["message"]["content"] == "custom 2 m"


async def test_completions(fake) -> None:
    upstream, client = fake
    body = (await client.post("/v1/completions", json={"model": "m", "prompt": "say hi"})).json()
    assert body["id"] == "cmpl-fake-1" and body["object"] == "text_completion"
    assert body["choices"] == [
        {"text": "answer 1 to say hi", "index": 0, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    batch = (await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})).json()
    assert [c["text"] for c in batch["choices"]] == ["answer 2 to a", "answer 2 to b"]
    assert upstream.count("/v1/completions") == 2


async def test_the_prompt_is_tokenized_only_when_its_token_ids_are_asked(
    fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tokenizing is a hash per word in Python: done for every prompt, an 8 MB one held the
    # event loop the fake shares with the gateway in a test for seconds, and that was measured
    # as the gateway's own stall.
    upstream, client = fake
    tokenized: list[str] = []
    token_ids = upstream_module._token_ids

    def counted(text: str) -> list[int]:
        tokenized.append(text)
        return token_ids(text)

    monkeypatch.setattr(upstream_module, "_token_ids", counted)
    for stream in (False, True):
        await client.post(CHAT, json=chat_body("a long prompt", stream=stream))
        await client.post("/v1/completions", json={"model": "m", "prompt": "a long prompt"})
    assert tokenized == []
    chat = (await client.post(CHAT, json=chat_body("two words", return_token_ids=True))).json()
    assert chat["prompt_token_ids"] == [token_id("two"), token_id("words")]
    completion = await client.post(
        "/v1/completions", json={"model": "m", "prompt": "two words", "return_token_ids": True}
    )
    assert completion.json()["choices"][0]["prompt_token_ids"] == chat["prompt_token_ids"]


async def test_embeddings_are_deterministic_and_carry_the_call_in_model(fake) -> None:
    upstream, client = fake
    r1 = (await client.post("/v1/embeddings", json={"model": "e", "input": ["x", "y"]})).json()
    r2 = (await client.post("/v1/embeddings", json={"model": "e", "input": "x"})).json()
    assert r1["object"] == "list" and r1["model"] == "e#call1" and r2["model"] == "e#call2"
    assert [d["index"] for d in r1["data"]] == [0, 1]
    vx, vy = r1["data"][0]["embedding"], r1["data"][1]["embedding"]
    assert len(vx) == 8 and vx == r2["data"][0]["embedding"] and vx != vy
    assert abs(sum(v * v for v in vx) - 1.0) < 1e-9
    r3 = (
        await client.post(
            "/v1/embeddings", json={"model": "e", "input": "x", "encoding_format": "base64"}
        )
    ).json()
    decoded = struct.unpack("<8f", base64.b64decode(r3["data"][0]["embedding"]))
    assert decoded == pytest.approx(vx, abs=1e-6)
    r4 = (
        await client.post("/v1/embeddings", json={"model": "e", "input": "x", "dimensions": 3})
    ).json()
    assert len(r4["data"][0]["embedding"]) == 3
    upstream.embedding_fn = lambda item: [1.0, 0.0]
    r5 = (await client.post("/v1/embeddings", json={"model": "e", "input": "x"})).json()
    assert r5["data"][0]["embedding"] == [1.0, 0.0]


async def test_models_passthrough_echo_and_404(fake) -> None:
    upstream, client = fake
    models = (await client.get("/v1/models")).json()
    assert models == {
        "object": "list",
        "data": [
            {
                "id": "fake-model",
                "object": "model",
                "created": models["data"][0]["created"],
                "owned_by": "fake-upstream",
            }
        ],
    }
    echo = (await client.post("/v1/moderations", json={"input": "hi"})).json()
    assert echo == {
        "path": "/v1/moderations",
        "method": "POST",
        "query": "",
        "body": {"input": "hi"},
        "echo": True,
    }
    echo = (await client.get("/v1/files", params={"purpose": "batch"})).json()
    assert echo == {
        "path": "/v1/files",
        "method": "GET",
        "query": "purpose=batch",
        "body": None,
        "echo": True,
    }
    r = await client.get("/health")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = await client.post(CHAT, content=b"not json")
    assert r.status_code == 400
    assert upstream.count() == 5 and upstream.count("/v1/files") == 1


# ------------------------------------------------------------------ gate, waiting, delay


async def test_gate_holds_every_request_until_set(fake) -> None:
    upstream, client = fake
    upstream.gate = asyncio.Event()
    tasks = [asyncio.ensure_future(client.post(CHAT, json=chat_body(f"q{i}"))) for i in range(3)]
    calls = await upstream.wait_for_calls(3)
    assert len(calls) == 3 and upstream.arrived.is_set()
    assert upstream.in_flight == 3 and not any(t.done() for t in tasks)
    upstream.gate.set()
    bodies = [r.json() for r in await asyncio.gather(*tasks)]
    ids = sorted(b["id"] for b in bodies)
    assert ids == ["chatcmpl-fake-1", "chatcmpl-fake-2", "chatcmpl-fake-3"]
    for b in bodies:  # each answer names the call that produced it
        n = b["id"].rsplit("-", 1)[1]
        assert b["choices"][0]["message"]["content"].startswith(f"answer {n} to q")
    await upstream.wait_idle()
    assert upstream.completed == 3 and upstream.cancelled == 0


async def test_wait_for_calls_times_out(fake) -> None:
    upstream, _client = fake
    with pytest.raises(TimeoutError, match="1 call"):
        await upstream.wait_for_calls(1, timeout=0.05)


async def test_delay(fake) -> None:
    upstream, client = fake
    upstream.delay = 0.05
    loop = asyncio.get_running_loop()
    start = loop.time()
    r = await client.post(CHAT, json=chat_body())
    assert r.status_code == 200 and loop.time() - start >= 0.05


# ------------------------------------------------------------------ failures


async def test_fail_status(fake) -> None:
    upstream, client = fake
    upstream.fail_status = 503
    r = await client.post(CHAT, json=chat_body())
    assert r.status_code == 503 and r.json() == DEFAULT_FAIL_BODY
    upstream.fail_status, upstream.fail_body = (
        429,
        {"error": {"message": "slow down", "type": "rate_limit", "code": 42}},
    )
    r = await client.post(CHAT, json=chat_body(stream=True))
    assert r.status_code == 429 and r.json()["error"]["code"] == 42
    upstream.fail_status, upstream.fail_body, upstream.fail_times = 500, None, 1
    assert (await client.get("/v1/models")).status_code == 500
    assert (await client.get("/v1/models")).status_code == 200
    assert upstream.count() == 4


# ------------------------------------------------------------------ streaming


async def test_stream_format(fake) -> None:
    upstream, client = fake
    async with client.stream("POST", CHAT, json=chat_body("hi there", stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(
        c["id"] == "chatcmpl-fake-1" and c["object"] == "chat.completion.chunk" and "usage" not in c
        for c in chunks
    )
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    words = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert words == ["answer", " 1", " to", " hi", " there"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert upstream.calls[0].stream and upstream.completed == 1


async def test_stream_include_usage(fake) -> None:
    _upstream, client = fake
    body = chat_body("hi", stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", CHAT, json=body) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    assert all(c["usage"] is None for c in events[:-2])
    assert events[-3]["choices"][0]["finish_reason"] == "stop"


async def test_completions_stream(fake) -> None:
    _upstream, client = fake
    body = {"model": "m", "prompt": "p", "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == "answer 1 to p"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "text_completion" for c in events[:-1])


async def test_omit_finish_reason_and_chunk_delay(fake) -> None:
    upstream, client = fake
    upstream.omit_finish_reason = True
    upstream.chunk_delay = 0.001
    async with client.stream("POST", CHAT, json=chat_body("x", stream=True)) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:-1])
    r = await client.post(CHAT, json=chat_body("x"))
    assert r.json()["choices"][0]["finish_reason"] is None


async def test_chunk_gate_pauses_mid_stream(fake) -> None:
    upstream, client = fake
    upstream.chunk_gate = asyncio.Event()
    upstream.chunk_gate_after = 2
    received: list[Any] = []
    async with client.stream("POST", CHAT, json=chat_body("a b c", stream=True)) as r:
        lines = r.aiter_lines()
        while len(received) < 3:  # role chunk + 2 content chunks
            line = await anext(lines)
            if line:
                received.append(json.loads(line[len("data: ") :]))
        await asyncio.wait_for(upstream.chunk_gate_reached.wait(), 5)
        assert [c["choices"][0]["delta"]["content"] for c in received[1:]] == ["answer", " 1"]
        upstream.chunk_gate.set()
        async for line in lines:
            if line:
                received.append(line[len("data: ") :])
    assert received[-1] == "[DONE]"
    rest = [json.loads(x)["choices"][0]["delta"].get("content") for x in received[3:-1]]
    assert rest == [" to", " a", " b", " c", None]


async def test_cut_after_breaks_the_stream(fake) -> None:
    upstream, client = fake
    upstream.cut_after = 2
    seen: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", CHAT, json=chat_body("a b c", stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    seen.append(line)
    assert len(seen) == 3  # role chunk + 2 content chunks, then the connection dropped
    assert not any("[DONE]" in s or '"finish_reason":"stop"' in s for s in seen)
    await upstream.wait_idle()
    assert upstream.cancelled == 0 and upstream.completed == 0
    # The fake keeps working afterwards.
    assert (await client.post(CHAT, json=chat_body())).status_code == 200


# ------------------------------------------------------------------ cancellation


async def test_cancelled_when_client_task_is_cancelled_at_the_gate(fake) -> None:
    upstream, client = fake
    upstream.gate = asyncio.Event()
    task = asyncio.ensure_future(client.post(CHAT, json=chat_body()))
    await upstream.wait_for_calls(1)
    task.cancel()
    await asyncio.wait_for(upstream.cancel_seen.wait(), 5)
    await upstream.wait_idle()
    assert upstream.cancelled == 1 and upstream.completed == 0


async def test_cancelled_when_client_closes_while_hanging() -> None:
    upstream = FakeUpstream()
    upstream.hang = True
    async with serve_app(upstream) as url:
        client = httpx.AsyncClient(base_url=url)
        task = asyncio.ensure_future(client.post(CHAT, json=chat_body()))
        await upstream.wait_for_calls(1)
        await client.aclose()
        await upstream.wait_for_cancelled(1)
        task.cancel()
        await asyncio.wait([task])
    assert upstream.in_flight == 0


async def test_cancelled_when_client_times_out(fake) -> None:
    upstream, client = fake
    upstream.hang = True
    with pytest.raises(httpx.ReadTimeout):
        await client.post(CHAT, json=chat_body(), timeout=0.05)
    await upstream.wait_for_cancelled(1)


async def test_cancelled_when_client_leaves_mid_stream(fake) -> None:
    upstream, client = fake
    upstream.chunk_gate = asyncio.Event()
    async with client.stream("POST", CHAT, json=chat_body("a b c", stream=True)) as r:
        lines = r.aiter_lines()
        await anext(lines)  # the role chunk has arrived
        await asyncio.wait_for(upstream.chunk_gate_reached.wait(), 5)
    # Leaving the block closed the response before its end: the connection is dropped.
    await upstream.wait_for_cancelled(1)
    upstream.chunk_gate.set()
    await upstream.wait_idle()
    assert upstream.completed == 0


async def test_reset(fake) -> None:
    upstream, client = fake
    upstream.fail_status = 500
    await client.get("/v1/models")
    upstream.reset()
    assert upstream.count() == 0 and upstream.fail_status is None
    assert (await client.get("/v1/models")).headers["x-fake-call"] == "1"


# ------------------------------------------------------------------ the official SDK


async def test_openai_sdk_against_the_fake() -> None:
    upstream = FakeUpstream()
    async with serve_app(upstream) as url:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0)
        try:
            done = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello"}]
            )
            assert done.id == "chatcmpl-fake-1"
            assert done.choices[0].message.content == "answer 1 to hello"
            assert done.choices[0].finish_reason == "stop" and done.usage.total_tokens == 5

            stream = await sdk.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hello"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            pieces, usage, finish = [], None, None
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage
            assert "".join(pieces) == "answer 2 to hello" and finish == "stop"
            assert usage is not None and usage.completion_tokens == 4

            emb = await sdk.embeddings.create(model="e", input=["x"])  # SDK asks for base64
            assert emb.model == "e#call3" and len(emb.data[0].embedding) == 8

            with pytest.raises(openai.InternalServerError):
                upstream.fail_status = 500
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]
                )
            assert upstream.calls[0].headers["authorization"] == "Bearer sk-x"
        finally:
            await sdk.close()


# ------------------------------------------------------------------ llama.cpp's server, imitated


async def stream_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", CHAT, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return await read_sse(response)


async def test_tool_call_answers_and_their_two_stream_styles(fake) -> None:
    upstream, client = fake
    upstream.tool_call = ("get_weather", '{"city": "Paris"}')
    whole = (await client.post(CHAT, json=chat_body())).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_fake_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    openai_style = await stream_events(client, chat_body())
    calls = [
        e["choices"][0]["delta"]["tool_calls"][0]
        for e in openai_style[:-1]
        if e["choices"][0]["delta"].get("tool_calls")
    ]
    assert [c["function"].get("name") for c in calls] == ["get_weather", None, None]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    upstream.tool_call_style = "llama.cpp"
    llama = await stream_events(client, chat_body())
    deltas = [e["choices"][0]["delta"] for e in llama[:-1]]
    assert deltas[0] == {
        "role": "assistant",
        "content": None,
        "function_call": None,
        "tool_calls": None,
    }
    repeated = [d for d in deltas[1:] if d.get("tool_calls")]
    assert len(repeated) == 2 and all(
        d["tool_calls"][0]["function"]["name"] == d["function_call"]["name"] == "get_weather"
        and d["tool_calls"][0]["id"] == "call_fake_3"
        for d in repeated
    )
    assert deltas[-1] == {"role": None, "content": None, "function_call": None, "tool_calls": None}
    assert llama[-2]["choices"][0]["finish_reason"] == "tool_calls" and llama[-1] == "[DONE]"
    whole = (await client.post(CHAT, json=chat_body())).json()["choices"][0]["message"]
    assert whole["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_ignore_include_usage_leaves_usage_out_of_streams_only(fake) -> None:
    upstream, client = fake
    upstream.ignore_include_usage = True
    events = await stream_events(client, chat_body(stream_options={"include_usage": True}))
    assert all("usage" not in e for e in events[:-1])
    assert "usage" in (await client.post(CHAT, json=chat_body())).json()


async def test_empty_stream_is_a_200_event_stream_with_nothing_in_it(fake) -> None:
    upstream, client = fake
    upstream.empty_stream = True
    async with client.stream("POST", CHAT, json={**chat_body(), "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert await response.aread() == b""


async def test_broken_list_embeddings_answer_only_a_lists_first_item_right(fake) -> None:
    upstream, client = fake

    async def vectors(value: Any) -> list[list[float]]:
        response = await client.post("/v1/embeddings", json={"model": "e", "input": value})
        return [row["embedding"] for row in response.json()["data"]]

    right = [(await vectors(text))[0] for text in ("a", "b", "c")]
    assert await vectors(["a", "b", "c"]) == right
    upstream.broken_list_embeddings = True
    listed = await vectors(["a", "b", "c"])
    assert listed[0] == right[0] and listed[1] != right[1] and listed[2] != right[2]
    assert await vectors("b") == [right[1]] and await vectors(["b"]) == [right[1]]


async def typed_events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a typed stream (Responses, Messages)."""
    pairs, name = [], None
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                pairs.append((name, json.loads(line[len("data: ") :])))
    return pairs


RESPONSES_BODY = {"model": "m", "input": "hello world"}
MESSAGES_BODY = {
    "model": "m",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hello world"}],
}


async def test_responses_and_messages_answers_and_their_typed_streams(fake) -> None:
    upstream, client = fake
    response = (await client.post("/v1/responses", json=RESPONSES_BODY)).json()
    assert response["id"] == "resp_fake_1" and response["status"] == "completed"
    assert response["output"][0]["content"][0]["text"] == "answer 1 to hello world"
    assert response["usage"]["input_tokens"] == 2 and response["usage"]["output_tokens"] == 5
    pairs = await typed_events(client, "/v1/responses", RESPONSES_BODY)
    assert all(name == data["type"] for name, data in pairs)
    assert [data["sequence_number"] for _, data in pairs] == list(range(len(pairs)))
    assert pairs[0][0] == "response.created" and pairs[-1][0] == "response.completed"
    assert (
        "".join(d["delta"] for n, d in pairs if n == "response.output_text.delta")
        == "answer 2 to hello world"
    )
    assert pairs[-1][1]["response"]["id"] == "resp_fake_2"

    message = (await client.post("/v1/messages", json=MESSAGES_BODY)).json()
    assert message["id"] == "msg_fake_3" and message["stop_reason"] == "end_turn"
    assert message["content"] == [{"type": "text", "text": "answer 3 to hello world"}]
    pairs = await typed_events(client, "/v1/messages", MESSAGES_BODY)
    assert [n for n, _ in pairs][:3] == ["message_start", "content_block_start", "ping"]
    assert [n for n, _ in pairs][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert (
        "".join(d["delta"]["text"] for n, d in pairs if n == "content_block_delta")
        == "answer 4 to hello world"
    )
    assert upstream.count("/v1/messages") == 2


async def test_typed_stream_controls(fake) -> None:
    upstream, client = fake
    upstream.omit_done = True
    assert (await typed_events(client, "/v1/messages", MESSAGES_BODY))[-1][0] == "message_delta"
    upstream.omit_done, upstream.omit_finish_reason = False, True
    pairs = await typed_events(client, "/v1/responses", RESPONSES_BODY)
    assert pairs[-1][0] == "response.incomplete"
    assert pairs[-1][1]["response"]["status"] == "incomplete"
    upstream.omit_finish_reason, upstream.error_after = False, 2
    pairs = await typed_events(client, "/v1/messages", MESSAGES_BODY)
    assert [n for n, _ in pairs].count("content_block_delta") == 2
    assert pairs[-1] == (
        "error",
        {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "fake upstream stream failure"},
        },
    )
    upstream.error_after = None
    upstream.message_events = lambda events: [events[0], {"type": "novel"}, *events[1:]]
    pairs = await typed_events(client, "/v1/messages", MESSAGES_BODY)
    assert [n for n, _ in pairs][:3] == ["message_start", "novel", "content_block_start"]
    assert pairs[1][1] == {"type": "novel"}
    upstream.message_events, upstream.fail_status = None, 500
    failed = await client.post("/v1/messages", json=MESSAGES_BODY)
    assert failed.json()["type"] == "error" and failed.json()["error"]["type"] == "api_error"


def test_free_port_never_gives_out_a_port_it_gave_out_lately(monkeypatch):
    """Two instances of one test drew one port (free when drawn, neither bound yet): the second
    could not listen (a CI run). A draw that repeats a port given out is drawn again."""
    from . import ports

    class Repeating:
        def __init__(self) -> None:
            self.draws = iter([20_001, 20_001, 20_002])

        def randrange(self, low: int, high: int) -> int:
            return next(self.draws)

    monkeypatch.setattr(ports, "_DRAW", Repeating())
    monkeypatch.setattr(ports, "_GIVEN", ports.collections.deque(maxlen=512))
    monkeypatch.setattr(ports, "_outgoing_low", lambda: 32_768)
    assert [ports.free_port(), ports.free_port()] == [20_001, 20_002]
