"""upstream.stream_flights: a shared call streamed from the upstream whatever its leader asked."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from fakes.flights import CHAT, flight_clients
from fakes.waiting import eventually

STREAMED = {"upstream": {"stream_flights": True}}


def body(content: str, **extra) -> dict:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


async def test_a_streaming_joiner_of_a_non_streaming_flight_gets_tokens_before_the_call_ends(
    gateway_with, fake
):
    async with gateway_with(**STREAMED) as gw:
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(gw.chat("a long story"))
        await fake.chunk_gate_reached.wait()  # the upstream has sent its first words only
        async with gw.client.stream(
            "POST", "/v1/chat/completions", json=body("a long story", stream=True)
        ) as joiner:
            assert joiner.headers["x-carpool"] == "coalesced"
            lines = joiner.aiter_lines()
            first = ""
            while not first:  # a content delta, while the call goes on
                line = await anext(lines)
                if line.startswith("data: {"):
                    first = orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            assert not fake.chunk_gate.is_set()
            fake.chunk_gate.set()
            rest = [line async for line in lines]
        answer = await leader
    assert answer.headers["x-carpool"] == "miss"
    assert answer.json()["choices"][0]["message"]["content"] == "answer 1 to a long story"
    assert answer.json()["object"] == "chat.completion" and answer.json()["usage"]
    assert [line for line in rest if line][-1] == "data: [DONE]"
    assert fake.count() == 1 and fake.calls[0].body["stream"] is True
    assert fake.calls[0].body["stream_options"] == {"include_usage": True}


async def test_the_streamed_answer_is_stored_whole_for_later_non_streaming_hits(gateway_with, fake):
    async with gateway_with(**STREAMED) as gw:
        first = await gw.chat("hello")
        again = await gw.chat("hello")
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
    assert again.json() == first.json() and fake.count() == 1


async def test_a_non_streaming_leader_of_a_streamed_call_gets_its_usage_without_stream_usage(
    gateway_with, fake
):
    # With upstream.stream_usage off, the call was streamed without include_usage: the leader
    # got (and the cache kept) an answer without the usage its own call would have had.
    async with gateway_with(upstream={"stream_flights": True, "stream_usage": False}) as gw:
        first = await gw.chat("count my tokens")
        again = await gw.chat("count my tokens")
    assert fake.calls[0].body["stream_options"] == {"include_usage": True}
    assert (
        first.json()["usage"]["total_tokens"] > 0 and again.json()["usage"] == first.json()["usage"]
    )
    assert "x-carpool-usage" not in first.headers


async def test_a_non_streaming_client_of_a_streamed_call_that_stalls_gets_504(gateway_with, fake):
    """Its call streamed for it (``stream_flights``) or not, a non-streaming client whose
    upstream stalls gets the same answer: 504 ``upstream_timeout`` (the streamed call's stall
    was a 502 ``upstream_stream_broken``, a status hanging on what the client cannot see),
    with ``x-should-retry: false`` (the engine took the call); nothing stored."""
    async with gateway_with(**STREAMED, limits={"upstream_timeout": 0.5}) as gw:
        fake.chunk_gate = asyncio.Event()  # 2 words, then nothing: the stream stalls
        stalled = await asyncio.wait_for(gw.chat("a long story"), 10)
        assert (stalled.status_code, stalled.json()["error"]["code"]) == (504, "upstream_timeout")
        assert stalled.headers["x-should-retry"] == "false"
        fake.chunk_gate.set()
        again = await gw.chat("a long story")
    assert (again.status_code, again.headers["x-carpool"]) == (200, "miss")
    assert fake.count() == 2


async def test_without_stream_flights_the_upstream_call_follows_its_leader(gw, fake):
    await gw.chat("plain")
    assert "stream" not in fake.calls[0].body


async def test_completions_with_best_of_or_echo_are_never_streamed_for_others(gateway_with, fake):
    async with gateway_with(**STREAMED) as gw:
        for extra in ({"best_of": 2}, {"echo": True}):
            response = await gw.client.post(
                "/v1/completions",
                json={"model": "m", "temperature": 0, "prompt": f"say {extra}", **extra},
            )
            assert response.status_code == 200, response.text
        plain = await gw.client.post(
            "/v1/completions", json={"model": "m", "temperature": 0, "prompt": "say hi"}
        )
        assert plain.json()["object"] == "text_completion"
    assert [c.body.get("stream") for c in fake.calls] == [None, None, True]


async def test_a_streamed_echo_completion_is_never_served_to_its_json_clients(gw, fake):
    """llama.cpp's server repeats the prompt (``echo``) in a whole answer and not in a stream:
    the answer assembled from a streaming client's call was stored and served to the JSON
    clients of the same request (and an Idempotency-Key's JSON retry) without its prompt.
    Streamed or not, an echo request is a request of its own."""
    body = {"model": "m", "temperature": 0, "prompt": "Hello there", "echo": True}
    streamed = await gw.client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["x-carpool"] == "miss"
    whole = await gw.client.post("/v1/completions", json=body)
    assert whole.headers["x-carpool"] == "miss", whole.headers
    again = await gw.client.post("/v1/completions", json={**body, "stream": True})
    assert again.headers["x-carpool"] == "hit"  # (the streamed one, for streaming clients)
    assert fake.count() == 2
    keyed = {"Idempotency-Key": "echo-1"}
    first = await gw.client.post(
        "/v1/completions", json={**body, "prompt": "Hi", "stream": True}, headers=keyed
    )
    assert first.status_code == 200
    retry = await gw.client.post("/v1/completions", json={**body, "prompt": "Hi"}, headers=keyed)
    assert retry.status_code == 422, retry.text  # (another request under the same key)


def vllm_refuses_prompt_logprobs_on_a_stream(call) -> str | None:
    """vLLM's own check (its request models): prompt_logprobs above 0 (or -1) with stream."""
    asked = (call.body or {}).get("prompt_logprobs")
    if asked is not None and (call.body or {}).get("stream") and (asked > 0 or asked == -1):
        return "`prompt_logprobs` are not available when `stream=True`."
    return None


async def test_stream_flights_asks_a_prompt_logprobs_request_whole(gateway_with, fake):
    # Streamed for others, its non-streaming client got vLLM's 400, which its own request
    # (not a stream) never gets; only the whole answer carries the prompt's logprobs anyway.
    fake.refuse = vllm_refuses_prompt_logprobs_on_a_stream
    async with gateway_with(**STREAMED) as gw:
        for i, path, extra in (
            (1, CHAT, body("logprobs of my prompt")),
            (0, CHAT, body("logprobs of my prompt")),
            (-1, "/v1/completions", {"model": "m", "temperature": 0, "prompt": "mine"}),
        ):
            response = await gw.client.post(path, json={**extra, "prompt_logprobs": i})
            assert response.status_code == 200, response.text
        plain = await gw.chat("plain")
        assert plain.status_code == 200
    assert [c.body.get("stream") for c in fake.calls] == [None, None, None, True]


def vllm_refuses_stream_options_without_a_stream(call) -> str | None:
    """vLLM's own check: ``stream_options`` (but null or {}) without ``stream``."""
    asked = call.body or {}
    if asked.get("stream_options") and not asked.get("stream"):
        return "Stream options can only be defined when `stream=True`."
    return None


async def test_stream_flights_asks_a_request_with_stream_options_and_no_stream_whole(
    gateway_with, fake
):
    # Streamed for others, its stream options rewritten, it got a 200 where its own request
    # gets the engine's 400 (a review).
    fake.refuse = vllm_refuses_stream_options_without_a_stream
    async with gateway_with(**STREAMED) as gw:
        asked = {**body("options without a stream"), "stream_options": {"include_usage": True}}
        response = await gw.client.post(CHAT, json=asked)
        assert response.status_code == 400, response.text
        assert (await gw.chat("plain")).status_code == 200
    assert [c.body.get("stream") for c in fake.calls] == [None, True]


def chunk(content: str, finish: str | None = None) -> bytes:
    return orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
        }
    )


class Reads:
    """An upstream stream's payloads, as its reads brought them (``UpstreamResponse.events``)."""

    def __init__(self, *reads: list[bytes]) -> None:
        self.reads = reads

    async def events(self):
        for payloads in self.reads:
            yield payloads


async def test_a_streams_first_frame_reaches_its_clients_before_the_frames_read_with_it():
    """Frames that came in one read from the upstream: the clients waiting for the first are
    woken with it, before the others are parsed and published (their first byte is not held
    back by the rest)."""
    from carpool.broadcast import Broadcast
    from carpool.exchange import _consume

    broadcast = Broadcast()
    seen: list[int] = []

    async def client() -> None:
        await broadcast.wait_started()
        seen.append(len(broadcast.frames))

    waiting = asyncio.create_task(client())
    await asyncio.sleep(0)  # (waiting for the first frame)
    read = Reads([chunk("a"), chunk("b"), chunk("c"), chunk("", "stop")])  # all in one read
    answer = await _consume("chat", read, broadcast, body("x", stream=True))
    await waiting
    assert seen == [1] and len(broadcast.frames) == 4
    assert answer.complete and b'"content":"abc"' in answer.body


async def test_a_streams_first_event_is_decoded_alone_before_the_rest_of_its_read():
    """An engine that answers at once sends its whole stream in one read: the first event is
    decoded and given alone, before the rest of the read is decoded (its clients' first byte
    waits on nothing after it); the rest comes together; a read split anywhere decodes the same."""
    from carpool.upstream.http import _payloads

    async def batches(*reads: bytes) -> list[list[bytes]]:
        async def chunks():
            for read in reads:
                yield read

        ended: list[bool] = []
        got = [
            batch
            async for batch in _payloads(
                chunks(), None, "test", timeouts=(), errors=(), reason=str, done=ended.append
            )
        ]
        assert ended == [True]
        return got

    events = [chunk("a"), chunk("b"), chunk("", "stop")]
    sse = b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    assert await batches(sse) == [events[:1], events[1:]]
    # Only the first read with an event in it is split: a later read comes whole.
    assert await batches(sse[:10], sse[10:]) == [events[:1], events[1:]]
    cut = sse.index(b"\n\n") + 2
    assert await batches(sse[:cut], sse[cut:]) == [events[:1], events[1:]]
    for at in range(1, len(sse)):  # (and wherever the reads split it, the same payloads)
        assert sum(await batches(sse[:at], sse[at:]), []) == events
    # Lines ended by CRLF: not split (nothing found to split at), the same payloads.
    assert await batches(sse.replace(b"\n", b"\r\n")) == [events]


async def test_a_malformed_payload_read_with_others_fails_the_stream_after_the_frames_before_it():
    """The payloads of one read are parsed together: one that is not a JSON object (here two
    values, which one parse of the read would take for two payloads) still fails the stream as
    it would alone, once the frames read before it are out; nothing after it is published."""
    from carpool.broadcast import Broadcast
    from carpool.errors import UpstreamStreamBroken
    from carpool.exchange import _consume

    for bad, reason in ((b'{"x":1},{"y":2}', "malformed"), (b"[1,2]", "not an object")):
        broadcast = Broadcast()
        read = Reads([chunk("a")], [chunk("b"), chunk("c"), bad, chunk("d"), chunk("", "stop")])
        try:
            await _consume("chat", read, broadcast, body("x", stream=True))
        except UpstreamStreamBroken as error:
            assert reason in str(error)
        else:
            raise AssertionError("a malformed payload was taken")
        assert [
            orjson.loads(f[6:])["choices"][0]["delta"]["content"] for f in broadcast.frames
        ] == [
            "a",
            "b",
            "c",
        ]


async def test_a_usage_chunk_read_with_the_last_frames_is_still_left_out_for_clients_not_asking():
    from carpool.broadcast import Broadcast
    from carpool.exchange import _consume

    usage = orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    )
    broadcast = Broadcast()
    read = Reads([chunk("a")], [chunk("b"), chunk("", "stop"), usage])
    answer = await _consume("chat", read, broadcast, body("x", stream=True))
    assert answer.complete and broadcast.usage_frame == 3
    without, _ = broadcast.take(0, include_usage=False)
    with_usage, _ = broadcast.take(0, include_usage=True)
    assert b'"usage"' not in without and with_usage == without + broadcast.frames[3]


async def test_a_stream_with_a_usage_chunk_mid_way_is_served_but_never_stored():
    """Clients not asking for usage are kept from one usage-only chunk (the last one read): a
    stream with another mid-way (no engine asked sends one) would replay it to their hits,
    stale, where an SDK reading ``choices[0]`` fails. Not stored: when unsure, not shared."""
    from carpool.broadcast import Broadcast
    from carpool.exchange import _consume

    def usage(completion_tokens: int) -> bytes:
        return orjson.dumps(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": {
                    "prompt_tokens": 1,
                    "completion_tokens": completion_tokens,
                    "total_tokens": 1 + completion_tokens,
                },
            }
        )

    for reads in (
        ([chunk("a"), usage(1)], [chunk("b"), chunk("", "stop"), usage(2)]),
        ([chunk("a"), usage(1), chunk("b"), chunk("", "stop"), usage(2)],),
    ):
        answer = await _consume("chat", Reads(*reads), Broadcast(), body("x", stream=True))
        assert not answer.complete, reads
    once = Reads([chunk("a")], [chunk("b"), chunk("", "stop"), usage(2)])
    assert (await _consume("chat", once, Broadcast(), body("x", stream=True))).complete


async def test_a_flight_streams_last_piece_ends_the_asgi_body_in_the_same_message():
    """Through the ASGI path too, the last piece of a flight's stream (``exchange.Relay``)
    carries the body's end (``more_body`` false): no empty message after it."""
    from types import SimpleNamespace

    from carpool.answer import Answer
    from carpool.apis import api_of
    from carpool.broadcast import Broadcast
    from carpool.exchange import Relay
    from carpool.reply import SSE_HEADERS, Reply
    from carpool.server import _send_reply

    broadcast = Broadcast()
    broadcast.publish(b"data: {}\n\n")
    broadcast.finish(Answer("chat", b"{}", True))
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    state = SimpleNamespace(finished=False, headed=False)  # (a ClientWatch's)
    reply = Reply(200, list(SSE_HEADERS), stream=Relay(api_of("chat"), broadcast, False))
    await _send_reply(send, reply, state)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1] == {
        "type": "http.response.body",
        "body": b"data: {}\n\ndata: [DONE]\n\n",
        "more_body": False,
    }
    assert state.finished


@pytest.mark.parametrize(
    ("path", "request_body", "error_body"),
    [
        (
            "/v1/chat/completions",
            body("overloaded?"),
            {"error": {"message": "model overloaded", "type": "server_error", "code": None}},
        ),
        (
            "/v1/messages",
            {**body("overloaded?"), "max_tokens": 8},
            {"type": "error", "error": {"type": "overloaded_error", "message": "model overloaded"}},
        ),
    ],
    ids=["chat", "messages"],
)
async def test_a_2xx_body_reporting_an_error_reaches_a_streaming_client_as_its_streams_failure(
    gw, fake, path, request_body, error_body
):
    """An upstream that answered 200 with an error object (some servers and proxies do, to a
    stream too): its streaming client got ``data: [DONE]`` alone, an empty stream that the SDK
    ends as a successful, empty answer."""
    fake.fail_status, fake.fail_body = 200, error_body
    streamed = await gw.client.post(path, json={**request_body, "stream": True})
    plain = await gw.client.post(path, json=request_body)
    assert streamed.status_code == 200
    payloads = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert [orjson.loads(payload) for payload in payloads] == [
        error_body if path == "/v1/messages" else {"error": error_body["error"]}
    ]  # the engine's own error object, and no end of a stream that went well
    assert "[DONE]" not in streamed.text and "message_stop" not in streamed.text
    assert plain.status_code == 200 and plain.json() == error_body  # (asked JSON: as it came)
    assert fake.count(path) == 2  # neither stored


async def test_a_stream_event_whose_error_field_is_null_is_no_failure(gw, fake):
    """Some servers write every field of an event, ``"error": null`` too: each such event was
    read as a failure ("None"), every client got an error event, nothing was stored."""
    from carpool.apis import api_of

    fake.message_events = lambda events: [{**event, "error": None} for event in events]
    request = {**body("null error?"), "max_tokens": 8, "stream": True}
    streamed = await gw.client.post("/v1/messages", json=request)
    again = await gw.client.post("/v1/messages", json=request)
    assert "event: error" not in streamed.text and "message_stop" in streamed.text
    assert again.headers["x-carpool"] == "hit" and fake.count("/v1/messages") == 1
    for name in ("chat", "responses", "messages"):
        assert api_of(name).failure({"type": "message", "error": None}) is None
        assert api_of(name).failure({"error": {"message": "m", "type": "t"}}) is not None


async def test_a_2xx_body_with_choices_and_an_error_reaches_a_streaming_client_as_its_failure(
    gw, fake
):
    """Not stored (an answer reporting an error is not complete), yet a streaming client got
    its choices and [DONE], as if all went well, where the same error in a stream's chunk fails
    the flight: an idempotent streamed retry was replayed what a JSON one ran again."""
    answer = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "pa"}, "finish_reason": "stop"}
        ],
        "error": {"message": "partial failure", "type": "server_error"},
    }
    fake.fail_status, fake.fail_body = 200, answer
    streamed = await gw.client.post(CHAT, json={**body("partly?"), "stream": True})
    assert streamed.status_code == 200 and "[DONE]" not in streamed.text
    payloads = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert orjson.loads(payloads[-1])["error"]["message"] == "partial failure"
    plain = await gw.client.post(CHAT, json=body("partly?"))
    assert plain.json() == answer and fake.count(CHAT) == 2  # (asked JSON: as it came)


@pytest.mark.parametrize("choices", ["missing", "empty"])
async def test_a_2xx_body_without_choices_reaches_a_streaming_client_as_its_streams_failure(
    gw, fake, choices
):
    """A whole 200 body with no answer in it (``choices`` missing or empty), to a streaming
    request or to a streaming joiner of a non-streaming leader: the client got ``data: [DONE]``
    alone, which the SDK ends as an empty success. Now its stream's failure (an error event, no
    end), as a body reporting an error; the non-streaming leader gets the body as it came."""
    answer = {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m"}
    if choices == "empty":
        answer["choices"] = []
    fake.fail_status, fake.fail_body = 200, answer

    def failed(streamed) -> None:
        assert streamed.status_code == 200 and "[DONE]" not in streamed.text
        payloads = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        [event] = [orjson.loads(payload) for payload in payloads]
        assert event["error"]["code"] == "upstream_stream_broken"
        assert "choices" in event["error"]["message"]

    failed(await gw.client.post(CHAT, json={**body("no answer?"), "stream": True}))
    fake.gate = asyncio.Event()
    fake.arrived.clear()
    leader = asyncio.create_task(gw.client.post(CHAT, json=body("none?")))
    await fake.arrived.wait()
    joiner = asyncio.create_task(gw.client.post(CHAT, json={**body("none?"), "stream": True}))
    await eventually(lambda: flight_clients(gw) == 2, what="the streaming joiner")
    fake.gate.set()
    plain, streamed = await asyncio.gather(leader, joiner)
    assert plain.status_code == 200 and plain.json() == answer  # (asked JSON: as it came)
    assert streamed.headers["x-carpool"] == "coalesced"
    failed(streamed)
    assert fake.count(CHAT) == 2  # neither stored


async def test_every_live_stream_tells_a_buffering_proxy_not_to_buffer_it(gw, fake):
    """nginx buffers what it proxies by default (``proxy_buffering on``) unless the answer says
    ``X-Accel-Buffering: no``, as the engines' SSE servers do (sse-starlette): behind it, a
    stream through carpool came in one read at its end (its first token at the last). A
    streamed miss, its joiner, a bypassed (sampled) stream say it."""
    fake.chunk_gate = asyncio.Event()

    async def streamed(extra: dict) -> dict[str, str]:
        async with gw.client.stream("POST", CHAT, json=body("tell a story", **extra)) as r:
            await r.aread()
            return dict(r.headers)

    leader = asyncio.create_task(streamed({"stream": True}))
    await fake.wait_for_calls(1)
    joiner = asyncio.create_task(streamed({"stream": True}))
    await eventually(lambda: fake.chunk_gate_reached.is_set(), what="the first chunks")
    await eventually(
        lambda: sum(f.clients for f in gw.gateway.flights.running()) == 2, what="the joiner"
    )
    fake.chunk_gate.set()
    sampled = {"stream": True, "temperature": 0.7}
    heads = [await leader, await joiner, await streamed(sampled)]
    assert [h["x-carpool"] for h in heads] == ["miss", "coalesced", "bypass"]
    assert all(h.get("x-accel-buffering") == "no" for h in heads), heads
