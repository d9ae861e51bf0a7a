"""Idempotency records tell retryable from final (CONTRACT.md "Idempotency"), over HTTP.

Only a request the upstream executed is frozen for the retention: a refusal by the gateway, an
unreachable or timed-out upstream, a 429, a proxy's 502/503/504, a stream that failed part-way
or a 200 that is not an answer leave nothing behind, so a retry with the same key runs again.
A replay comes in the format the retry asks for (stream or not), or the retry gets 422. The
rules that concern storage run against both backends (memory, and Redis/Valkey).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import orjson
import pytest

from carpool.errors import (
    FlightAbandoned,
    UpstreamError,
    UpstreamStreamBroken,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from carpool.idempotency import (
    IdempotencyConflict,
    IdempotencyRecords,
    MemoryIdempotencyRecords,
    StoredResponse,
    is_final,
)
from carpool.redis.idempotency import RedisIdempotencyRecords
from carpool.store.base import StoreUnavailable
from fakes.waiting import eventually

KEY = {"Idempotency-Key": '"retry-1"'}
SAMPLED = 0.9  # a sampled request is bypassed: nothing but the record can spare a call
ERROR_BODY = {"error": {"message": "the engine failed", "type": "server_error", "code": None}}


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The config of a gateway whose idempotency records live in memory, or in Redis (a
    server or a cluster)."""
    if request.param == "memory":
        return {}
    cluster = request.param == "redis-cluster"
    target = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    return {"redis": target.url, "distributed": {"cluster": cluster}}


def closed_port() -> int:
    """A loopback port nothing listens on (bound then released): connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def sse_payloads(raw: str) -> list[Any]:
    """The data payloads of an SSE body, parsed ("[DONE]" kept as the string)."""
    payloads = []
    for event in raw.split("\n\n"):
        if event.startswith("data: "):
            data = event[len("data: ") :]
            payloads.append(data if data == "[DONE]" else orjson.loads(data))
    return payloads


def sse_text(raw: str) -> str:
    return "".join(
        choice["delta"].get("content") or ""
        for chunk in sse_payloads(raw)
        if isinstance(chunk, dict)
        for choice in chunk.get("choices", ())
    )


# --------------------------------------------------------------------------- the classification


@pytest.mark.parametrize(
    ("status", "final"),
    [
        (200, True),
        (201, True),
        (400, True),
        (401, True),
        (403, True),
        (404, True),
        (413, True),
        (422, True),
        (408, False),
        (409, False),
        (425, False),
        (429, False),
        (499, False),
        (500, True),
        (501, True),
        (502, False),
        (503, False),
        (504, False),
        (520, False),
        (524, False),
        (301, False),
        (304, False),
    ],
)
def test_is_final_tells_an_executed_answer_from_a_retryable_one(status: int, final: bool) -> None:
    body = (
        b'{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},'
        b'"finish_reason":"stop"}]}'
        if status < 300
        else orjson.dumps(ERROR_BODY)
    )
    response = StoredResponse(status, [(b"content-type", b"application/json")], body)
    assert is_final("chat", response) is final


@pytest.mark.parametrize(
    "body",
    [
        orjson.dumps(ERROR_BODY),  # an error body
        b'{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":null}]}',  # unfinished
        b'{"choices":[{"index":0,"message":{"content":""},"finish_reason":"abort"}]}',  # vLLM's abort
        b'{"choices":[{"index":0,"message":{"content":"h',  # cut
        b"<html>bad gateway</html>",  # not JSON
    ],
)
def test_a_200_that_is_not_a_complete_answer_is_not_final(body: bytes) -> None:
    assert not is_final("chat", StoredResponse(200, [(b"content-type", b"application/json")], body))


def test_a_stream_is_final_only_when_it_ended_with_done_and_no_error_event() -> None:
    sse = [(b"content-type", b"text/event-stream")]
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    finish = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    error = b'data: {"error":{"message":"upstream stream broke","type":"upstream_error"}}\n\n'
    done = b"data: [DONE]\n\n"
    assert is_final("chat", StoredResponse(200, sse, chunk + finish + done, True))
    assert not is_final("chat", StoredResponse(200, sse, chunk + error, True))
    assert not is_final("chat", StoredResponse(200, sse, chunk + error + done, True))
    assert not is_final("chat", StoredResponse(200, sse, chunk + finish, True))  # no [DONE]
    assert not is_final("chat", StoredResponse(200, sse, chunk + done, True))  # unfinished
    assert not is_final("chat", StoredResponse(200, sse, b"", True))


@pytest.mark.parametrize(
    "error",
    [
        UpstreamUnreachable("x"),
        UpstreamTimeout("x"),
        UpstreamStreamBroken("x"),
        UpstreamError("x"),
        FlightAbandoned("x"),
        StoreUnavailable("x"),
        IdempotencyConflict(),
    ],
    ids=lambda error: type(error).__name__,
)
def test_every_error_of_the_gateway_itself_after_a_record_is_begun_is_retryable(error) -> None:
    """The gateway's own refusals of a request (400, 413, 431, an invalid key) come before its
    record is begun; what it can still answer afterwards must never be frozen as final."""
    response = StoredResponse(error.status, [(b"content-type", b"application/json")], error.body())
    assert not is_final("chat", response)


# --------------------------------------------------------------------------- 1. not executed: not kept


@pytest.mark.parametrize("status", [408, 409, 425, 429, 502, 503, 504])
async def test_an_upstream_answer_that_was_not_executed_is_not_kept_and_a_retry_runs_again(
    fake, gateway_with, backend, status
):
    async with gateway_with(**backend) as gw:
        fake.fail_status, fake.fail_times = status, 1
        first = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert first.status_code == status and not replayed(first)
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert retry.status_code == 200 and not replayed(retry) and fake.count() == 2
        again = await gw.chat(temperature=SAMPLED, headers=KEY)  # the retry's answer is final
        assert replayed(again) and again.content == retry.content and fake.count() == 2


@pytest.mark.parametrize("status", [400, 404, 422, 500])
async def test_an_upstream_error_for_an_executed_request_is_final_and_replayed(
    fake, gateway_with, backend, status
):
    async with gateway_with(**backend) as gw:
        fake.fail_status, fake.fail_times = status, 1
        first = await gw.chat(temperature=SAMPLED, headers=KEY)
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert first.status_code == retry.status_code == status
        assert replayed(retry) and retry.content == first.content and fake.count() == 1


async def test_a_request_refused_by_the_gateway_is_not_kept(fake, gateway_with, backend):
    async with gateway_with(**backend) as gw:
        refused = await gw.chat(temperature="hot", headers=KEY)  # 400 from the gateway
        assert refused.status_code == 400 and fake.count() == 0
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)  # not a 422: nothing kept
        assert retry.status_code == 200 and not replayed(retry) and fake.count() == 1


async def test_an_unreachable_upstream_is_not_kept(gateway_with, backend):
    async with gateway_with(upstreams=[f"http://127.0.0.1:{closed_port()}/v1"], **backend) as gw:
        first = await gw.chat(temperature=SAMPLED, headers=KEY)
        calls = gw.gateway.stats.upstream_calls
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert first.status_code == retry.status_code == 502
        assert retry.json()["error"]["code"] == "upstream_unreachable"
        assert not replayed(retry) and gw.gateway.stats.upstream_calls == calls + 1


async def test_an_upstream_timeout_is_not_kept(fake, gateway_with, backend):
    fake.hang = True
    async with gateway_with(limits={"upstream_timeout": 0.3}, **backend) as gw:
        first = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert first.status_code == 504
        fake.hang = False
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert retry.status_code == 200 and not replayed(retry) and fake.count() == 2


@pytest.mark.parametrize("fault", ["error body", "no finish reason"])
async def test_a_200_that_is_not_a_complete_answer_is_not_kept(fake, gateway_with, backend, fault):
    async with gateway_with(**backend) as gw:
        if fault == "error body":
            fake.fail_status, fake.fail_body, fake.fail_times = 200, ERROR_BODY, 1
        else:
            fake.omit_finish_reason = True
        first = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert first.status_code == 200
        fake.omit_finish_reason = False
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert retry.status_code == 200 and not replayed(retry) and fake.count() == 2
        assert retry.json()["choices"][0]["finish_reason"] == "stop"


async def test_a_stream_cut_before_any_byte_reached_the_client_is_not_kept(
    fake, gateway_with, backend
):
    async with gateway_with(**backend) as gw:
        payload = {"model": "m", "prompt": "once", "temperature": 0, "stream": True}
        fake.cut_after = 0  # a completion stream: no byte before the cut
        async with gw.client.stream("POST", "/v1/completions", json=payload, headers=KEY) as first:
            failed = (await first.aread()).decode()
        # A streaming client's stream that failed before its first chunk: a 200 and an SSE
        # error event (a 502 would be retried by the SDKs: issue 15).
        assert first.status_code == 200 and '"error"' in failed and "[DONE]" not in failed
        fake.cut_after = None
        async with gw.client.stream("POST", "/v1/completions", json=payload, headers=KEY) as retry:
            raw = (await retry.aread()).decode()
        assert retry.status_code == 200 and not replayed(retry) and raw.endswith("[DONE]\n\n")
        assert fake.count() == 2


async def test_a_stream_whose_client_left_part_way_is_not_kept(fake, gateway_with, backend):
    # on_conflict: wait makes the retry wait for the first record to be finished or dropped: it
    # runs as soon as the record is dropped, and would get the replay (or a 409) if it were kept.
    async with gateway_with(
        idempotency={"on_conflict": "wait"}, coalesce={"join_timeout_ms": 10_000}, **backend
    ) as gw:
        fake.chunk_gate = asyncio.Event()  # two words, then the stream waits
        payload = {
            "model": "m",
            "messages": [{"role": "user", "content": "q"}],
            "temperature": SAMPLED,
            "stream": True,
        }
        async with gw.client.stream(
            "POST", "/v1/chat/completions", json=payload, headers=KEY
        ) as first:
            await fake.chunk_gate_reached.wait()
            async for _ in first.aiter_bytes():  # a first byte has reached the client...
                break
        await fake.wait_for_cancelled(1)  # ...which left: the upstream call was closed
        fake.chunk_gate = None
        response, raw = await gw.stream_chat("q", temperature=SAMPLED, headers=KEY)
        assert response.status_code == 200 and not replayed(response)
        assert sse_payloads(raw)[-1] == "[DONE]" and fake.count() == 2


# --------------------------------------------------------------------------- 2. the format


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_json_answer_is_replayed_as_a_stream_to_a_streaming_retry(
    fake, gateway_with, backend, include_usage
):
    async with gateway_with(**backend) as gw:
        first = await gw.chat(temperature=SAMPLED, headers=KEY)
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        response, raw = await gw.stream_chat(temperature=SAMPLED, headers=KEY, **options)
        assert response.status_code == 200 and replayed(response)
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(raw)
        assert payloads[-1] == "[DONE]" and fake.count() == 1
        assert sse_text(raw) == first.json()["choices"][0]["message"]["content"]
        finish = [c["finish_reason"] for p in payloads[:-1] for c in p["choices"]]
        assert finish[-1] == "stop"
        usage = [p["usage"] for p in payloads[:-1] if p.get("usage")]
        assert usage == ([first.json()["usage"]] if include_usage else [])


async def test_a_streamed_answer_is_replayed_as_json_to_a_non_streaming_retry(
    fake, gateway_with, backend
):
    async with gateway_with(**backend) as gw:
        _, raw = await gw.stream_chat(temperature=SAMPLED, headers=KEY)
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert retry.status_code == 200 and replayed(retry) and fake.count() == 1
        assert retry.headers["content-type"].startswith("application/json")
        body = retry.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": sse_text(raw)}
        assert body["choices"][0]["finish_reason"] == "stop"


async def test_a_completion_is_replayed_in_either_format(fake, gateway_with, backend):
    async with gateway_with(**backend) as gw:
        payload = {"model": "m", "prompt": "once", "temperature": SAMPLED}
        first = await gw.client.post("/v1/completions", json=payload, headers=KEY)
        async with gw.client.stream(
            "POST", "/v1/completions", json={**payload, "stream": True}, headers=KEY
        ) as streamed:
            raw = (await streamed.aread()).decode()
        assert replayed(streamed) and streamed.headers["content-type"].startswith(
            "text/event-stream"
        )
        text = "".join(
            c["text"] for p in sse_payloads(raw) if isinstance(p, dict) for c in p["choices"]
        )
        assert text == first.json()["choices"][0]["text"] and fake.count() == 1


def usage_chunks(raw: str) -> list[Any]:
    """The usage-only chunks of an SSE body (``"choices": []``)."""
    return [p for p in sse_payloads(raw) if isinstance(p, dict) and p.get("choices") == []]


@pytest.mark.parametrize("first_usage", [False, True], ids=["first without usage", "with"])
@pytest.mark.parametrize("path", ["bypass", "flight", "hit"])
async def test_a_streamed_record_replays_the_usage_its_retry_asks_for_in_either_format(
    fake, gateway_with, backend, path, first_usage
):
    """``stream_options.include_usage`` is outside the request's digest: a retry may differ in
    it. Its replay has the usage chunk only if it asks for it, and a JSON retry has its usage,
    as a hit of the stored answer would, whatever the first client asked: the record keeps
    the usage chunk the first client may not have been sent (a bypassed stream, a flight's
    relay, a hit served whole)."""
    async with gateway_with(**backend) as gw:
        temperature = SAMPLED if path == "bypass" else 0
        if path == "hit":
            assert (await gw.chat()).status_code == 200  # stored: the keyed stream is a hit
        calls = fake.count()
        with_usage = {"stream_options": {"include_usage": True}}
        first, raw = await gw.stream_chat(
            temperature=temperature, headers=KEY, **(with_usage if first_usage else {})
        )
        assert first.status_code == 200 and bool(usage_chunks(raw)) is first_usage
        asked, full = await gw.stream_chat(temperature=temperature, headers=KEY, **with_usage)
        bare_response, bare = await gw.stream_chat(temperature=temperature, headers=KEY)
        whole = await gw.chat(temperature=temperature, headers=KEY)
        for retry in (asked, bare_response, whole):
            assert replayed(retry) and "x-carpool-usage" not in retry.headers
        assert fake.count() == calls + (path != "hit")  # (the first stream's call only)
        usage = whole.json()["usage"]
        assert usage["total_tokens"] > 0
        assert [chunk["usage"] for chunk in usage_chunks(full)] == [usage]
        assert usage_chunks(bare) == []
        # The same stream but for its usage chunk, the first client's byte for byte.
        assert sse_payloads(bare) == [p for p in sse_payloads(full) if p not in usage_chunks(full)]
        assert (full if first_usage else bare) == raw
        assert sse_text(full) == whole.json()["choices"][0]["message"]["content"]


async def test_a_streamed_record_replayed_as_json_has_its_usage(fake, gateway_with, backend):
    """A sampled stream without the usage (bypassed: asked of the upstream as it came), then a
    JSON retry: its body has the usage a JSON answer has, and the replay counts the tokens it
    saved in /stats."""
    async with gateway_with(**backend) as gw:
        _, raw = await gw.stream_chat(temperature=SAMPLED, headers=KEY)
        assert usage_chunks(raw) == []
        before = (await gw.client.get("/stats")).json()
        retry = await gw.chat(temperature=SAMPLED, headers=KEY)
        assert replayed(retry) and "x-carpool-usage" not in retry.headers
        usage = retry.json()["usage"]
        assert usage["total_tokens"] > 0 and fake.count() == 1
        after = (await gw.client.get("/stats")).json()
        assert after["tokens_saved"] - before["tokens_saved"] == usage["total_tokens"]
        assert after["saved_without_usage"] == before["saved_without_usage"]
        # The keyed stream was asked for its usage; one without a key is sent as it came.
        await gw.stream_chat(temperature=SAMPLED)
        asked = [call.body.get("stream_options") for call in fake.calls]
        assert asked == [{"include_usage": True}, None]


@pytest.mark.parametrize("path", ["bypass", "flight"])
async def test_a_streamed_record_without_usage_says_so_to_a_retry_that_asks_for_it(
    fake, gateway_with, backend, path
):
    """An engine that sends no usage (it ignores ``include_usage``): a replay that asks for
    it (JSON, or a stream with ``include_usage``) says ``x-carpool-usage: missing``, as a hit
    of such an answer does; one that does not ask says nothing."""
    async with gateway_with(**backend) as gw:
        fake.ignore_include_usage = True
        temperature = SAMPLED if path == "bypass" else 0
        await gw.stream_chat(temperature=temperature, headers=KEY)
        whole = await gw.chat(temperature=temperature, headers=KEY)
        asked, raw = await gw.stream_chat(
            temperature=temperature, headers=KEY, stream_options={"include_usage": True}
        )
        bare, _ = await gw.stream_chat(temperature=temperature, headers=KEY)
        assert all(replayed(r) for r in (whole, asked, bare)) and fake.count() == 1
        assert "usage" not in whole.json() and usage_chunks(raw) == []
        assert whole.headers["x-carpool-usage"] == asked.headers["x-carpool-usage"] == "missing"
        assert "x-carpool-usage" not in bare.headers


@pytest.mark.parametrize("first_streams", [False, True])
async def test_an_error_stored_for_one_format_is_422_to_a_retry_in_the_other(
    fake, gateway_with, backend, first_streams
):
    async with gateway_with(**backend) as gw:
        fake.fail_status, fake.fail_times = 400, 1

        async def ask(stream: bool) -> httpx.Response:
            if stream:
                return (await gw.stream_chat(temperature=SAMPLED, headers=KEY))[0]
            return await gw.chat(temperature=SAMPLED, headers=KEY)

        first = await ask(first_streams)
        assert first.status_code == 400
        other = await ask(not first_streams)
        assert other.status_code == 422
        assert other.headers["content-type"].startswith("application/problem+json")
        assert other.json()["status"] == 422
        same = await ask(first_streams)
        assert same.status_code == 400 and replayed(same) and fake.count() == 1


# --------------------------------------------------------------------------- 3. list items


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m", "prompt": ["alpha", "beta", "gamma"], "temperature": 0}),
        ("/v1/embeddings", {"model": "e", "input": ["alpha", "beta", "gamma"]}),
    ],
)
@pytest.mark.parametrize(
    "fail_body", [ERROR_BODY, {"object": "list", "model": "e"}], ids=["error body", "no answer"]
)
async def test_a_list_item_answered_200_without_an_answer_is_recomputed_by_the_retry(
    fake, gateway_with, backend, path, body, fail_body
):
    # ttl 0 and no window: nothing but the idempotency records can spare a recomputation.
    async with gateway_with(coalesce={"window_ms": 0}, **backend) as gw:
        headers = {**KEY, "x-carpool-type": "factual"}
        fake.fail_status, fake.fail_body, fake.fail_times = 200, fail_body, 1
        first = await gw.client.post(path, json=body, headers=headers)
        assert first.status_code == 502 and fake.count() == 3
        assert first.json()["error"]["message"]
        retry = await gw.client.post(path, json=body, headers=headers)
        assert retry.status_code == 200 and not replayed(retry)
        assert fake.count() == 4  # only the failed item again
        rows = retry.json()["data" if path == "/v1/embeddings" else "choices"]
        assert [row["index"] for row in rows] == [0, 1, 2]
        again = await gw.client.post(path, json=body, headers=headers)
        assert replayed(again) and again.content == retry.content and fake.count() == 4


# --------------------------------------------------------------------------- 4. streams


@pytest.mark.parametrize("temperature", [0, SAMPLED], ids=["shared", "bypass"])
async def test_a_stream_that_ends_with_an_error_event_is_not_kept(
    fake, gateway_with, backend, temperature
):
    async with gateway_with(**backend) as gw:
        fake.cut_after = 2  # two words, then the upstream is gone
        response, raw = await gw.stream_chat(temperature=temperature, headers=KEY)
        assert response.status_code == 200
        payloads = sse_payloads(raw)
        assert "error" in payloads[-1] and "[DONE]" not in payloads
        fake.cut_after = None
        response, raw = await gw.stream_chat(temperature=temperature, headers=KEY)
        assert response.status_code == 200 and not replayed(response)
        assert sse_payloads(raw)[-1] == "[DONE]" and fake.count() == 2


async def test_a_complete_stream_is_kept_as_received_and_replayed_as_such(
    fake, gateway_with, backend
):
    async with gateway_with(**backend) as gw:
        first, raw = await gw.stream_chat(temperature=SAMPLED, headers=KEY)
        retry, again = await gw.stream_chat(temperature=SAMPLED, headers=KEY)
        assert replayed(retry) and again == raw and fake.count() == 1
        assert retry.headers["content-type"].startswith("text/event-stream")


# --------------------------------------------------------------------------- the records


@pytest.fixture
async def records(backend: dict[str, Any]) -> Any:
    made: IdempotencyRecords = (
        RedisIdempotencyRecords(
            backend["redis"], retention=60, cluster=backend["distributed"]["cluster"]
        )
        if backend
        else MemoryIdempotencyRecords(60)
    )
    yield made
    await made.aclose()


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_record_keeps_the_format_of_the_request_that_made_it(records, streamed):
    response = StoredResponse(
        400, [(b"content-type", b"application/json")], orjson.dumps(ERROR_BODY), streamed
    )
    began = await records.begin("k", "fp")
    waiter = asyncio.create_task(records.wait("k", "fp", timeout=10))
    await eventually(lambda: records.waiters == 1, what="the waiter")
    assert await records.finish("k", began.token, response) is True
    assert (await asyncio.wait_for(waiter, 5)).streamed is streamed
    done = await records.begin("k", "fp")
    assert done.state == "done" and done.response == response


async def test_a_redis_record_written_before_the_format_field_takes_it_from_its_content_type(
    redis_server,
):
    import redis.asyncio as aredis

    records = RedisIdempotencyRecords(redis_server.url, retention=60)
    raw = aredis.Redis.from_url(redis_server.url)
    try:
        for key, ctype in (("old-sse", "text/event-stream"), ("old-json", "application/json")):
            await raw.hset(
                records.record_key(key),
                mapping={
                    "s": "s",
                    "fp": "fp",
                    "t": "t",
                    "st": "200",
                    "b": b"x",
                    "h": orjson.dumps([["content-type", ctype]]),
                },
            )
        assert (await records.begin("old-sse", "fp")).response.streamed is True
        assert (await records.begin("old-json", "fp")).response.streamed is False
        assert (await records.wait("old-sse", "fp", timeout=1)).streamed is True
    finally:
        await raw.aclose()
        await records.aclose()
