"""The gateway end to end: real HTTP on loopback to a counting fake upstream (CONTRACT.md)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import orjson
import pytest

from carpool.clock import ManualClock
from carpool.outcome import Outcome
from carpool.reply import SLICE_BYTES
from conftest import run_gateway
from fakes.raw_upstream import RawCall, chat_completion, raw_upstream
from fakes.raw_upstream import answer as raw_answer
from fakes.serving import serve_app
from fakes.waiting import eventually

CHAT = "/v1/chat/completions"


def sse_text(raw: str) -> str:
    """The assistant text carried by an SSE stream of chat chunks."""
    text = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def flight_clients(served) -> int:
    return sum(f.clients for f in served.gateway.flights.running())


# --- coalescing -------------------------------------------------------------------------------


async def test_200_concurrent_identical_requests_half_streaming_make_one_upstream_call(gw, fake):
    fake.gate = asyncio.Event()

    async def one(i: int):
        if i % 2:
            response, raw = await gw.stream_chat()
            return response.headers["x-carpool"], sse_text(raw)
        response = await gw.chat()
        return response.headers["x-carpool"], response.json()["choices"][0]["message"]["content"]

    clients = [asyncio.create_task(one(i)) for i in range(200)]
    await fake.wait_for_calls(1)
    # (200 connections made on a loaded 2-core machine took over the 5 s default once.)
    await eventually(
        lambda: flight_clients(gw) == 200, timeout=30, what="200 clients on the flight"
    )
    fake.gate.set()
    results = await asyncio.gather(*clients)
    assert fake.count() == 1
    outcomes = [outcome for outcome, _ in results]
    assert outcomes.count("miss") == 1 and outcomes.count("coalesced") == 199
    assert {text for _, text in results} == {"answer 1 to What is carpool?"}


async def test_streaming_client_joining_200ms_late_gets_the_whole_text(fake, gateway_with):
    clock = ManualClock()
    async with gateway_with(clock=clock) as gw:
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(gw.stream_chat("a long story"))
        await fake.chunk_gate_reached.wait()  # the leader has received the first chunks
        clock.advance(0.2)  # the scenario: a joiner 200 ms late
        joiner = asyncio.create_task(gw.stream_chat("a long story"))
        await eventually(lambda: flight_clients(gw) == 2, what="the late joiner on the flight")
        fake.chunk_gate.set()
        (r1, raw1), (r2, raw2) = await asyncio.gather(leader, joiner)
        assert r1.headers["x-carpool"] == "miss" and r2.headers["x-carpool"] == "coalesced"
        assert sse_text(raw2) == sse_text(raw1) == "answer 1 to a long story"
        assert raw2.rstrip().endswith("data: [DONE]")
        assert fake.count() == 1


async def test_40_distinct_prompts_times_5_duplicates_make_40_calls(gw, fake):
    fake.gate = asyncio.Event()
    clients = [asyncio.create_task(gw.chat(f"question {i}")) for i in range(40) for _ in range(5)]
    await fake.wait_for_calls(40)
    await eventually(lambda: flight_clients(gw) == 200, what="every request on a flight")
    fake.gate.set()
    responses = await asyncio.gather(*clients)
    assert fake.count() == 40
    for i in range(40):
        texts = {r.json()["choices"][0]["message"]["content"] for r in responses[i * 5 : i * 5 + 5]}
        assert len(texts) == 1 and texts.pop().endswith(f"to question {i}")


async def test_streaming_and_non_streaming_clients_share_one_call(gw, fake):
    fake.gate = asyncio.Event()
    streaming = asyncio.create_task(gw.stream_chat())
    await fake.wait_for_calls(1)
    plain = asyncio.create_task(gw.chat())
    await eventually(lambda: flight_clients(gw) == 2)
    fake.gate.set()
    (_, raw), response = await asyncio.gather(streaming, plain)
    assert sse_text(raw) == response.json()["choices"][0]["message"]["content"]
    assert fake.count() == 1


async def test_a_non_streaming_leader_serves_a_streaming_joiner_as_sse(gw, fake):
    fake.gate = asyncio.Event()
    plain = asyncio.create_task(gw.chat())
    await fake.wait_for_calls(1)
    streaming = asyncio.create_task(gw.stream_chat())
    await eventually(lambda: flight_clients(gw) == 2)
    fake.gate.set()
    response, (joined, raw) = await asyncio.gather(plain, streaming)
    assert joined.headers["content-type"].startswith("text/event-stream")
    assert sse_text(raw) == response.json()["choices"][0]["message"]["content"]
    assert fake.count() == 1


async def test_a_slow_client_never_slows_the_others(gw, fake):
    # 2 MB of answer: far more than the socket buffers hold for a client that does not read.
    fake.answer_text = lambda n, body: " ".join(["x" * 40_000] * 50)
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "big"}],
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as slow_client:
        async with slow_client.stream("POST", CHAT, json=payload) as stalled:
            chunks = stalled.aiter_bytes()
            first = await anext(chunks)  # then it stops reading
            assert first
            _, raw = await gw.stream_chat("big")  # a reader finishes meanwhile
            assert len(sse_text(raw)) == 50 * 40_000 + 49
            rest = b"".join([chunk async for chunk in chunks])
    assert sse_text((first + rest).decode()) == sse_text(raw)
    assert fake.count() == 1


async def test_leader_client_disconnecting_does_not_cancel_the_call_while_others_wait(gw, fake):
    fake.gate = asyncio.Event()
    leader = asyncio.create_task(gw.chat())
    await fake.wait_for_calls(1)
    joiner = asyncio.create_task(gw.chat())
    await eventually(lambda: flight_clients(gw) == 2)
    leader.cancel()  # the leading client goes away
    await eventually(lambda: flight_clients(gw) == 1, what="the leader to leave")
    fake.gate.set()
    response = await joiner
    assert response.json()["choices"][0]["message"]["content"] == "answer 1 to What is carpool?"
    assert fake.cancelled == 0 and fake.count() == 1


async def test_upstream_call_is_cancelled_when_every_client_has_gone(gw, fake):
    fake.hang = True
    clients = [asyncio.create_task(gw.chat()), asyncio.create_task(gw.stream_chat())]
    await fake.wait_for_calls(1)
    await eventually(lambda: flight_clients(gw) == 2)
    for client in clients:
        client.cancel()
    await fake.wait_for_cancelled(1)
    await eventually(lambda: len(gw.gateway.flights) == 0 and gw.gateway.flights.waiters == 0)
    assert gw.gateway.store.entries == 0


async def test_clients_leaving_a_stalled_stream_leave_nothing_waiting_on_it(gw, fake):
    fake.chunk_gate = asyncio.Event()
    leader = asyncio.create_task(gw.stream_chat())
    await fake.chunk_gate_reached.wait()  # the upstream stalls after its first chunks
    flight = gw.gateway.flights.running()[0]
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "What is carpool?"}],
        "temperature": 0,
        "stream": True,
    }

    async def streams_a_little_and_leaves() -> None:
        async with gw.client.stream("POST", CHAT, json=payload) as response:
            assert response.headers["x-carpool"] == "coalesced"
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    return  # (the frames so far are there: it leaves the stream unread)

    for _ in range(3):  # clients come and go while the flight makes no progress
        waiting = [asyncio.create_task(gw.chat()) for _ in range(50)]
        await asyncio.gather(*(streams_a_little_and_leaves() for _ in range(50)))
        await eventually(lambda: flight_clients(gw) == 51, what="the waiting clients joined")
        for client in waiting:
            client.cancel()
        await eventually(
            lambda: flight_clients(gw) == 1 and len(flight.broadcast._waiters or ()) <= 1,
            what="every client but the leader gone, its wait with it",
        )
    fake.chunk_gate.set()
    response, raw = await leader
    assert sse_text(raw) == "answer 1 to What is carpool?" and fake.count() == 1


async def test_abandoned_call_is_finished_to_fill_the_cache_with_finish_abandoned(
    fake, gateway_with
):
    async with gateway_with(coalesce={"finish_abandoned": True}) as gw:
        fake.gate = asyncio.Event()
        client = asyncio.create_task(gw.chat())
        await fake.wait_for_calls(1)
        await eventually(lambda: flight_clients(gw) == 1)
        client.cancel()
        await eventually(lambda: flight_clients(gw) == 0)
        fake.gate.set()
        await eventually(lambda: gw.gateway.store.entries == 1, what="the answer to be stored")
        assert (await gw.chat()).headers["x-carpool"] == "hit"
        assert fake.cancelled == 0 and fake.count() == 1


async def test_joiner_waiting_longer_than_join_timeout_runs_its_own_call(fake, gateway_with):
    async with gateway_with(coalesce={"join_timeout_ms": 100}) as gw:
        fake.gate = asyncio.Event()
        slow = asyncio.create_task(gw.chat())
        await fake.wait_for_calls(1)
        fake.gate = None  # the next call answers at once
        response = await gw.chat()  # joins, times out, runs its own call
        assert response.headers["x-carpool"] == "miss"
        assert response.json()["choices"][0]["message"]["content"] == "answer 2 to What is carpool?"
        slow_gate = fake.calls[0]
        assert slow_gate.number == 1 and fake.count() == 2
        slow.cancel()


async def test_a_no_store_joiner_that_times_out_runs_a_call_that_never_lingers(fake, gateway_with):
    coalesce = {"join_timeout_ms": 100, "window_ms": 60_000, "adaptive": False}
    async with gateway_with(coalesce=coalesce) as gw:
        fake.gate = asyncio.Event()
        slow = asyncio.create_task(gw.chat())
        await fake.wait_for_calls(1)
        fake.gate = None  # the next calls answer at once
        # Joins, times out, runs its own call: lingering, its answer would be a form of storing.
        no_store = await gw.chat(headers={"cache-control": "no-store"})
        assert no_store.headers["x-carpool"] == "miss" and fake.count() == 2
        later = await gw.chat()
        assert later.headers["x-carpool"] == "miss" and fake.count() == 3
        assert later.json()["choices"][0]["message"]["content"] == "answer 3 to What is carpool?"
        slow.cancel()


# --- the exact cache --------------------------------------------------------------------------


# An upstream whose Cache-Control keeps its answer out of shared caches (RFC 9111 3: no-store,
# private), in several lines and any case; a window long enough that a lingering answer shows.
KEPT_OUT = [(b"cache-control", b"max-age=600"), (b"Cache-Control", b"public, PRIVATE")]
WINDOW = {"window_ms": 60_000, "adaptive": False}


@pytest.mark.parametrize("said", [b"No-Store", b"private", b'private="set-cookie", max-age=9'])
async def test_an_answer_the_upstream_says_no_shared_cache_may_store_is_relayed_never_stored(
    fake, gateway_with, said
):
    async with gateway_with(coalesce=WINDOW) as gw:
        fake.response_headers = [(b"cache-control", b"max-age=600"), (b"cache-control", said)]
        first = await gw.chat()
        assert first.headers["x-carpool"] == "miss"
        assert first.json()["choices"][0]["message"]["content"] == "answer 1 to What is carpool?"
        assert gw.gateway.store.entries == 0
        again = await gw.chat()
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2
        assert again.json()["choices"][0]["message"]["content"] == "answer 2 to What is carpool?"


@pytest.mark.parametrize("stream_flights", [False, True], ids=["streamed", "stream_flights"])
async def test_a_stream_whose_head_says_no_store_as_sse_servers_do_by_default_is_stored_and_its_repeat_a_hit(
    fake, gateway_with, stream_flights
):
    """sse-starlette (llama-cpp-python's server) says ``Cache-Control: no-store`` on every event
    stream: "do not buffer or keep this live feed", nothing of the answer assembled from it.
    Read as the answer's, every streamed answer was a miss, and with ``stream_flights`` (every
    shared call streamed) nothing was cached at all. A whole answer's is read (above)."""
    async with gateway_with(upstream={"stream_flights": stream_flights}) as gw:
        fake.response_headers = [(b"cache-control", b"no-store")]  # (beside its own "no-cache")
        if stream_flights:
            first = await gw.chat()  # (asked whole, called as a stream)
            text = first.json()["choices"][0]["message"]["content"]
        else:
            first, raw = await gw.stream_chat()
            text = sse_text(raw)
        assert first.headers["x-carpool"] == "miss" and text == "answer 1 to What is carpool?"
        assert fake.calls[0].body["stream"] is True and gw.gateway.store.entries == 1
        streamed, raw = await gw.stream_chat()
        whole = await gw.chat()
        assert streamed.headers["x-carpool"] == whole.headers["x-carpool"] == "hit"
        assert sse_text(raw) == whole.json()["choices"][0]["message"]["content"] == text
        assert fake.count() == 1


async def test_a_no_store_answer_says_no_store_to_its_client_bypassed_or_replayed_too(gw, fake):
    """For the caches past carpool: a sampled request's (bypass) said nothing, nor did a keyed
    request's replay of the answer its record kept."""
    fake.response_headers = [(b"cache-control", b"no-store")]
    cached = await gw.chat("same question")
    assert cached.headers["x-carpool"] == "miss" and cached.headers["cache-control"] == "no-store"
    sampled = await gw.chat("same question", temperature=0.9)
    assert sampled.headers["x-carpool"] == "bypass"
    assert sampled.headers["cache-control"] == "no-store"
    key = {"Idempotency-Key": '"ns-1"'}
    first = await gw.chat("keyed", headers=key)
    replay = await gw.chat("keyed", headers=key)
    assert first.headers["cache-control"] == replay.headers["cache-control"] == "no-store"
    assert replay.headers["idempotent-replayed"] == "true" and fake.count() == 3
    fake.response_headers = []  # (an answer that may be stored says nothing of it)
    plain = await gw.chat("another question", temperature=0.9)
    assert "cache-control" not in plain.headers


async def test_the_joiners_of_a_no_store_answers_call_get_it_from_that_one_call(fake, gateway_with):
    """Coalescing is not storing: the clients of the call it answers all get it; none after."""
    async with gateway_with(coalesce=WINDOW) as gw:
        fake.response_headers = KEPT_OUT
        fake.gate = asyncio.Event()
        # Its leader asks for it whole (a stream's head's Cache-Control is not read), then a
        # streaming client joins that call.
        leader = asyncio.create_task(gw.chat())
        await fake.wait_for_calls(1)
        joiner = asyncio.create_task(gw.stream_chat())
        await eventually(lambda: flight_clients(gw) == 2, what="both clients on the flight")
        fake.gate.set()
        whole, (streamed, raw) = await asyncio.gather(leader, joiner)
        assert (whole.headers["x-carpool"], streamed.headers["x-carpool"]) == ("miss", "coalesced")
        text = whole.json()["choices"][0]["message"]["content"]
        assert text == sse_text(raw) == "answer 1 to What is carpool?" and fake.count() == 1
        after = await gw.chat()  # (its flight over: nothing of it is kept)
        assert after.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_the_request_after_a_no_store_answer_is_a_miss_that_calls_the_upstream_again(
    fake, gateway_with
):
    """Neither stored nor lingering in the coalescing window for a later request."""
    async with gateway_with(coalesce=WINDOW) as gw:
        fake.response_headers = KEPT_OUT
        assert (await gw.chat()).headers["x-carpool"] == "miss"
        fake.response_headers = []  # (the next answer may be stored: the next request hits it)
        later = await gw.chat()
        assert later.headers["x-carpool"] == "miss" and fake.count() == 2
        assert later.json()["choices"][0]["message"]["content"] == "answer 2 to What is carpool?"
        assert (await gw.chat()).headers["x-carpool"] in ("hit", "coalesced") and fake.count() == 2


async def test_repeat_is_a_hit_with_age_whatever_user_key_order_or_number_spelling(gw, fake):
    first = await gw.chat(user="alice")
    assert first.headers["x-carpool"] == "miss"
    raw = (
        b'{"temperature":0.0,"messages":[{"content":"What is carpool?","role":"user"}],'
        b'"model":"m","user":"bob"}'
    )
    again = await gw.client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert again.headers["x-carpool"] == "hit"
    assert int(again.headers["age"]) >= 0
    assert again.json() == first.json()
    assert fake.count() == 1


async def test_cached_answers_are_served_to_streaming_clients_as_sse(gw, fake):
    plain = await gw.chat()
    response, raw = await gw.stream_chat(stream_options={"include_usage": True})
    assert response.headers["x-carpool"] == "hit"
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse_text(raw) == plain.json()["choices"][0]["message"]["content"]
    assert '"usage":{' in raw and raw.rstrip().endswith("data: [DONE]")


async def test_a_streamed_answer_is_cached_and_replayed_to_both_kinds_of_client(gw, fake):
    _, raw = await gw.stream_chat()
    assert '"choices":[]' not in raw  # the usage chunk it did not ask for is hidden
    again, raw_again = await gw.stream_chat()
    plain = await gw.chat()
    assert again.headers["x-carpool"] == plain.headers["x-carpool"] == "hit"
    assert sse_text(raw_again) == sse_text(raw) == plain.json()["choices"][0]["message"]["content"]
    assert plain.json()["usage"]["total_tokens"] > 0
    assert fake.count() == 1


async def test_a_streamed_hit_whose_frames_exceed_a_slice_is_parted_even_if_its_body_is_small(
    gw, fake
):
    """A token stream's frames are many times the body they assemble to (each chunk repeats
    the id, the model, the choice around a word): a hit of one whose body is under a slice but
    whose frames are far over is its answer's own frames (``Reply.parted``), written a slice at
    a time, not one copy of the whole stream for each client. Its bytes are the same."""
    fake.answer_text = lambda n, body: " ".join(["ab"] * 15_000)  # ~45 KB, 15,000 chunks
    miss, raw_miss = await gw.stream_chat("many")
    hit, raw_hit = await gw.stream_chat("many")
    plain = await gw.chat("many")
    assert [r.headers["x-carpool"] for r in (miss, hit, plain)] == ["miss", "hit", "hit"]
    assert raw_hit == raw_miss and fake.count() == 1
    assert len(plain.content) < SLICE_BYTES < 10 * SLICE_BYTES < len(raw_hit)
    # The same hit through the library: the reply the transport is handed.
    reply = await gw.gateway.request(
        CHAT,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "many"}],
            "temperature": 0,
            "stream": True,
        },
    )
    assert reply.outcome is Outcome.HIT
    assert reply.parts is not None  # (its answer's frames, not joined...)
    assert reply.size == len(raw_hit.encode())
    assert reply.body == raw_hit.encode()  # (...until read: the same bytes)


async def test_sampled_requests_bypass_and_seeded_ones_are_shared(gw, fake):
    sampled = [await gw.chat(temperature=0.8) for _ in range(2)]
    assert [r.headers["x-carpool"] for r in sampled] == ["bypass", "bypass"]
    seeded = [await gw.chat(temperature=0.8, seed=7) for _ in range(2)]
    assert [r.headers["x-carpool"] for r in seeded] == ["miss", "hit"]
    absent = await gw.client.post(
        CHAT, json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    assert absent.headers["x-carpool"] == "bypass"  # no temperature: the upstream samples
    assert fake.count() == 4


async def test_identical_embeddings_requests_make_one_call(gw, fake):
    fake.gate = asyncio.Event()
    body = {"model": "e", "input": ["alpha", "beta"]}
    clients = [asyncio.create_task(gw.client.post("/v1/embeddings", json=body)) for _ in range(10)]
    await fake.wait_for_calls(1)
    await eventually(lambda: flight_clients(gw) == 10)
    fake.gate.set()
    responses = await asyncio.gather(*clients)
    assert fake.count() == 1
    assert len({r.content for r in responses}) == 1
    assert (await gw.client.post("/v1/embeddings", json=body)).headers["x-carpool"] == "hit"


async def test_embeddings_asked_to_stream_are_answered_as_json(gw, fake):
    # Embeddings have no stream form: ``stream: true`` is no reason to crash on a hit.
    body = {"model": "e", "input": "alpha", "stream": True}
    first = await gw.client.post("/v1/embeddings", json=body)
    again = await gw.client.post("/v1/embeddings", json=body)
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
    assert again.headers["content-type"].startswith("application/json")
    assert again.json() == first.json() and fake.count() == 1


BROKEN_VECTORS = {
    "NaN in base64": ("base64", lambda item: [math.nan] * 8),
    "infinity in base64": ("base64", lambda item: [math.inf] + [0.0] * 7),
    "an empty vector": ("float", lambda item: []),
    "vectors of two lengths": ("float", lambda item: [0.5] * (2 if item == "a" else 8)),
}


@pytest.mark.parametrize("broken", list(BROKEN_VECTORS))
async def test_an_embeddings_answer_with_a_broken_vector_is_relayed_never_stored(gw, fake, broken):
    # One fault of the engine (fp16 overflowing to NaN) was served, as a hit, for the TTL.
    encoding, vector = BROKEN_VECTORS[broken]
    body = {"model": "e", "input": ["a", "b"], "encoding_format": encoding}
    fake.embedding_fn = vector
    first = await gw.client.post("/v1/embeddings", json=body)
    assert (first.status_code, first.headers["x-carpool"]) == (200, "miss")
    fake.embedding_fn = None
    again = await gw.client.post("/v1/embeddings", json=body)
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2
    assert (await gw.client.post("/v1/embeddings", json=body)).headers["x-carpool"] == "hit"


async def test_completions_endpoint_is_cached_too(gw, fake):
    body = {"model": "m", "prompt": "Say hi", "temperature": 0}
    first = await gw.client.post("/v1/completions", json=body)
    second = await gw.client.post("/v1/completions", json=body)
    assert (first.headers["x-carpool"], second.headers["x-carpool"]) == ("miss", "hit")
    assert first.json()["choices"][0]["text"] == "answer 1 to Say hi"


async def test_stats_and_metrics_count_outcomes_and_tokens_saved(gw, fake):
    await gw.chat()
    await gw.chat()
    stats = (await gw.client.get("/stats")).json()
    assert stats["misses"] == 1 and stats["hits"] == 1 and stats["upstream_calls"] == 1
    assert stats["tokens_saved"] > 0 and stats["saved_fraction"] == 0.5
    assert stats["layers"]["exact"]["entries"] == 1
    assert fake.url in stats["replicas"]
    metrics = (await gw.client.get("/metrics")).text
    assert 'carpool_requests_total{outcome="hit",route="/v1/chat/completions"} 1.0' in metrics
    assert "carpool_request_duration_seconds_bucket" in metrics
    assert (await gw.client.get("/healthz")).status_code == 200


async def test_stats_reports_each_replicas_in_flight_calls_while_they_run(gw, fake):
    # "per-upstream-replica in-flight load": four calls (three chats and an embedding) held at
    # the fake upstream are four in flight on its replica, in /stats and /metrics; none after.
    fake.gate = asyncio.Event()
    held = [asyncio.create_task(gw.chat(f"question {i}")) for i in range(3)]
    held.append(
        asyncio.create_task(gw.client.post("/v1/embeddings", json={"model": "e", "input": "x"}))
    )
    await fake.wait_for_calls(4)
    stats = (await gw.client.get("/stats")).json()
    assert stats["replicas"][fake.url]["in_flight"] == 4
    metrics = (await gw.client.get("/metrics")).text
    assert f'carpool_upstream_in_flight{{replica="{fake.url}"}} 4.0' in metrics
    fake.gate.set()
    assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 4
    stats = (await gw.client.get("/stats")).json()
    assert stats["replicas"][fake.url]["in_flight"] == 0
    metrics = (await gw.client.get("/metrics")).text
    assert f'carpool_upstream_in_flight{{replica="{fake.url}"}} 0.0' in metrics


async def test_saved_fraction_leaves_out_bypassed_and_rejected_requests(gw, fake):
    # "share of eligible requests that did not reach upstream": one miss, one hit -> 0.5,
    # whatever the requests that were never eligible (bypassed, refused by the gateway).
    await gw.chat()
    await gw.chat()
    for sampled in ("Tell me a story", "Tell me another"):  # (no-store still coalesces: a miss)
        assert (await gw.chat(sampled, temperature=0.9)).headers["x-carpool"] == "bypass"
    refused = await gw.client.post(
        CHAT, content=b"{not json", headers={"content-type": "application/json"}
    )
    assert refused.status_code == 400
    stats = (await gw.client.get("/stats")).json()
    assert (stats["misses"], stats["hits"], stats["bypass"], stats["rejected"]) == (1, 1, 2, 1)
    assert stats["requests"] == 5 and stats["upstream_calls"] == 3
    assert stats["saved_fraction"] == 0.5


# --- failures ---------------------------------------------------------------------------------


async def test_leader_error_reaches_every_waiter_and_is_never_stored(gw, fake):
    fake.gate = asyncio.Event()
    fake.fail_status = 500
    clients = [asyncio.create_task(gw.chat()) for _ in range(5)]
    await fake.wait_for_calls(1)
    await eventually(lambda: flight_clients(gw) == 5)
    fake.gate.set()
    responses = await asyncio.gather(*clients)
    assert [r.status_code for r in responses] == [500] * 5
    assert all(r.json()["error"]["message"] == "fake upstream failure" for r in responses)
    assert fake.count() == 1 and gw.gateway.store.entries == 0
    fake.fail_status = None
    again = await gw.chat()
    assert again.status_code == 200 and again.headers["x-carpool"] == "miss"


@pytest.mark.parametrize(
    "status, own_call",
    [(400, True), (413, True), (422, True), (401, False), (403, False), (408, False)]
    + [(429, False), (500, False)],
)
async def test_a_4xx_refusing_another_body_than_a_joiners_is_not_its_answer(
    gw, fake, status, own_call
):
    # metadata is not in the key, but reaches the upstream, which may refuse one and not the
    # other (OpenAI: metadata values must be strings). A refusal of the requester or of the
    # moment (credentials, rate limit, timeout) and a 5xx stay every joiner's answer.
    fake.gate = asyncio.Event()
    fake.fail_status, fake.fail_times = status, 1
    led = asyncio.create_task(gw.chat(metadata={"a": 1}))
    await fake.wait_for_calls(1)
    same = asyncio.create_task(gw.chat(metadata={"a": 1}))
    other = asyncio.create_task(gw.chat(metadata={"a": "x"}))
    await eventually(lambda: flight_clients(gw) == 3, what="both joiners on the flight")
    fake.gate.set()
    led, same, other = await asyncio.gather(led, same, other)
    assert led.status_code == same.status_code == status
    assert same.headers["x-carpool"] == "coalesced"  # the same body: the same answer, no call
    if own_call:
        assert other.status_code == 200 and other.headers["x-carpool"] == "miss"
        assert fake.count() == 2 and fake.calls[1].body["metadata"] == {"a": "x"}
    else:
        assert other.status_code == status and other.headers["x-carpool"] == "coalesced"
        assert fake.count() == 1
    # The 4xx is never stored; the answer of the joiner's own call is, under the key.
    assert gw.gateway.store.entries == (1 if own_call else 0)


async def test_a_joiner_whose_body_only_orders_its_keys_otherwise_shares_the_4xx_and_its_words(
    gw, fake
):
    # Key order is no difference (the same fingerprint, and the upstream reads JSON objects
    # unordered): before, such a joiner was "another request", sent upstream again after the
    # 4xx and, on a failed stream, told the gateway's redaction instead of the engine's words.
    fake.gate = asyncio.Event()
    fake.fail_status, fake.fail_times = 400, 1
    messages = [{"role": "user", "content": "hi"}]
    led = asyncio.create_task(
        gw.client.post(
            "/v1/chat/completions",
            json={"model": "m", "temperature": 0, "metadata": {"a": "1", "b": "2"}}
            | {"messages": messages},
        )
    )
    await fake.wait_for_calls(1)
    reordered = asyncio.create_task(
        gw.client.post(
            "/v1/chat/completions",
            json={"messages": messages, "metadata": {"b": "2", "a": "1"}}
            | {"temperature": 0, "model": "m"},
        )
    )
    await eventually(lambda: flight_clients(gw) == 2, what="the joiner on the flight")
    fake.gate.set()
    led, reordered = await asyncio.gather(led, reordered)
    assert led.status_code == reordered.status_code == 400
    assert reordered.headers["x-carpool"] == "coalesced" and fake.count() == 1
    assert reordered.json()["error"]["message"] == led.json()["error"]["message"]


async def test_a_stream_failing_part_way_reaches_every_client_as_an_error_and_is_never_stored(
    gw, fake
):
    fake.chunk_gate = asyncio.Event()
    fake.cut_after = 3
    leader = asyncio.create_task(gw.stream_chat())
    await fake.chunk_gate_reached.wait()
    joiners = [asyncio.create_task(gw.stream_chat()), asyncio.create_task(gw.chat())]
    await eventually(lambda: flight_clients(gw) == 3)
    fake.chunk_gate.set()
    (_, raw_leader), (_, raw_joiner), plain = await asyncio.gather(leader, *joiners)
    for raw in (raw_leader, raw_joiner):
        assert '"error"' in raw.splitlines()[-2] and "[DONE]" not in raw
    assert plain.status_code == 502 and plain.headers["x-carpool"] == "coalesced"
    assert gw.gateway.store.entries == 0
    fake.cut_after = None
    fake.chunk_gate = None
    assert (await gw.chat()).headers["x-carpool"] == "miss"


async def test_a_stream_without_finish_reason_is_never_stored(gw, fake):
    fake.omit_finish_reason = True
    _, raw = await gw.stream_chat()
    assert '"error"' in raw
    assert gw.gateway.store.entries == 0


async def test_incomplete_non_streaming_answer_is_served_but_not_stored(gw, fake):
    fake.omit_finish_reason = True
    first = await gw.chat()
    assert first.status_code == 200
    assert (await gw.chat()).headers["x-carpool"] == "miss"
    assert fake.count() == 2


async def test_unreachable_upstream_is_502(gateway_with):
    async with gateway_with(upstreams=["http://127.0.0.1:9/v1"]) as gw:
        response = await gw.chat()
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_unreachable"


async def test_upstream_timeout_is_504(fake, gateway_with):
    fake.hang = True
    async with gateway_with(limits={"upstream_timeout": 0.2}) as gw:
        response = await gw.chat()
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, code, param",
    [
        (b"{not json", "invalid_json", None),
        (b"[1, 2]", "invalid_body", None),
        (b'"text"', "invalid_body", None),
        (b'{"model": "m", "messages": "hi"}', "invalid_request", "messages"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "0"}',
            "invalid_request",
            "temperature",
        ),
    ],
)
async def test_malformed_requests_get_400_in_openai_error_shape(gw, fake, body, code, param):
    response = await gw.client.post(
        CHAT, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    # OpenAI's error object always has a param (the field at fault, or null): the SDKs read it.
    assert "param" in error and error["param"] == param
    assert response.headers["x-carpool"] == "bypass"
    assert fake.count() == 0


async def test_body_over_the_limit_is_413(fake, gateway_with):
    async with gateway_with(limits={"max_body_bytes": 1000}) as gw:
        response = await gw.chat("x" * 2000)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "body_too_large"
        assert (await gw.chat("short")).status_code == 200
        assert fake.count() == 1


# --- pass-through and headers -----------------------------------------------------------------


async def test_other_v1_paths_and_models_pass_through_uncached(gw, fake):
    models = await gw.client.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    moderation = await gw.client.post("/v1/moderations?x=1", json={"input": "hi"})
    assert moderation.json()["path"] == "/v1/moderations" and moderation.json()["query"] == "x=1"
    await gw.client.post("/v1/moderations?x=1", json={"input": "hi"})
    assert fake.count() == 3


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_a_pass_through_call_whose_client_leaves_before_its_answer_is_cancelled_upstream(
    gw, fake, streamed
):
    # A long call (a transcription, a speech stream) whose client went: its upstream call stayed
    # open until the upstream answered or limits.upstream_timeout passed, counted in flight on
    # its replica, and a shutdown waited for it through its whole grace period.
    fake.hang = True
    call = asyncio.create_task(
        gw.client.post("/v1/audio/transcriptions", json={"model": "w", "stream": streamed})
    )
    await fake.wait_for_calls(1)
    call.cancel()  # (its connection closed)
    await fake.wait_for_cancelled(1)
    await eventually(lambda: gw.gateway.replicas.in_flight == 0, what="its replica freed")


async def test_a_pass_through_answer_whose_client_leaves_part_way_closes_its_upstream_call():
    upstream_saw_it_leave = asyncio.Event()

    async def head_then_wait(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"RIFF", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        upstream_saw_it_leave.set()

    async with serve_app(head_then_wait) as slow, run_gateway([slow + "/v1"]) as gw:
        async with gw.client.stream("POST", "/v1/audio/speech", json={"input": "hi"}) as reply:
            assert await anext(reply.aiter_raw()) == b"RIFF"
        # (closed with its body unread: the connection goes)
        await asyncio.wait_for(upstream_saw_it_leave.wait(), 5)
        await eventually(lambda: gw.gateway.replicas.in_flight == 0, what="its replica freed")


async def test_a_pass_through_client_that_sent_its_whole_body_and_waits_is_not_gone(gw, fake):
    # Watched for leaving once its body is read, not before: a body in pieces reaches the
    # upstream whole, and the client waiting for the answer gets it.
    fake.gate = asyncio.Event()

    async def pieces():
        for piece in (b"a" * 70_000, b"b" * 70_000, b"c" * 70_000):
            yield piece

    call = asyncio.create_task(
        gw.client.post(
            "/v1/moderations",
            content=pieces(),
            headers={"content-type": "application/octet-stream"},
        )
    )
    await fake.wait_for_calls(1)
    fake.gate.set()
    assert (await call).status_code == 200
    assert fake.calls[0].raw_body == b"a" * 70_000 + b"b" * 70_000 + b"c" * 70_000
    assert fake.cancelled == 0 and gw.gateway.replicas.in_flight == 0


async def test_a_prompt_of_megabytes_reaches_the_upstream_byte_for_byte_then_a_small_one_after_it(
    gw, fake
):
    """A large body is written after its head, not joined to it (a copy of the whole body per
    call in flight); a small one with its head, in one write. Either way the upstream reads each
    request whole and exact, one after the other on the one kept connection."""

    def chat(content: str) -> bytes:
        return orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}
        )

    prompt = "".join(f"line {i}: the quick brown fox\n" for i in range(150_000))  # (~4 MB)
    bodies = [chat(prompt), chat("and a small one"), chat(prompt + "and again")]
    for body in bodies:
        reply = await gw.client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert reply.status_code == 200, reply.text
    assert fake.count() == 3
    for call, body in zip(fake.calls, bodies, strict=True):  # (compared, not diffed: megabytes)
        assert (len(call.raw_body), call.raw_body == body) == (len(body), True)
    assert len(bodies[0]) > 4_000_000
    assert len({call.peer for call in fake.calls}) == 1  # (the large one's connection, kept)


async def test_request_headers_are_forwarded_upstream(gw, fake):
    await gw.chat(
        headers={"Authorization": "Bearer sk-abc", "X-Custom": "1", "x-carpool-namespace": "n"}
    )
    headers = fake.calls[0].headers
    assert headers["authorization"] == "Bearer sk-abc" and headers["x-custom"] == "1"
    assert "x-carpool-namespace" not in headers


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("/v1/chat/completions", "Café ☕".encode()),
        ("/v1/chat/completions", "Café".encode("latin-1")),
        ("/v1/chat/completions", "Bearer sk-clé-1".encode()),
        ("/v1/models", "Café ☕".encode()),
        ("/v1/models", "Bearer sk-clé-1".encode()),
    ],
    ids=["cached-utf-8", "cached-latin-1", "cached-utf-8 key", "passed-utf-8", "passed-utf-8 key"],
)
async def test_a_header_value_reaches_the_upstream_byte_for_byte_as_the_client_sent_it(
    gw, fake, path, value
):
    # Read as latin-1 and written as UTF-8, every byte over 0x7f reached the upstream as two:
    # a client key written in UTF-8 was another key there.
    name = "authorization" if value.startswith(b"Bearer") else "x-title"
    if path == "/v1/models":
        response = await gw.client.get(path, headers={name: value})
    else:
        response = await gw.chat(repr(value), headers={name: value})
    assert response.status_code == 200, response.text
    (call,) = fake.calls
    # (The fake reads header bytes as latin-1, as the gateway's server does: its code points.)
    assert call.headers[name].encode("latin-1") == value


async def test_a_latin1_header_value_is_passed_through_as_the_utf8_of_its_text(gw, fake):
    # aiohttp writes header values as UTF-8: bytes that are not (a legacy latin-1 value, as
    # Python's requests sends one) go as the UTF-8 of their latin-1 reading, a deviation; they
    # are forwarded (for a while they were refused), and the cached endpoints send them as sent.
    response = await gw.client.get("/v1/models", headers={"x-title": "Café".encode("latin-1")})
    assert response.status_code == 200, response.text
    (call,) = fake.calls
    assert call.headers["x-title"].encode("latin-1") == "Café".encode()


async def test_tenants_do_not_share_answers(gw, fake):
    a = await gw.chat(headers={"Authorization": "Bearer a"})
    b = await gw.chat(headers={"Authorization": "Bearer b"})
    assert a.headers["x-carpool"] == b.headers["x-carpool"] == "miss"
    assert fake.count() == 2


async def test_behind_a_hosting_platform_the_same_request_is_a_hit_whatever_its_request_ids(
    gw, fake
):
    """Heroku's router, Fly.io's proxy, CloudFront, Azure... add a new request id, a queue
    time or the client's port to every request: in the key, every request was a miss."""

    def platform(i: int) -> dict[str, str]:
        return {
            "Authorization": "Bearer k",
            "X-Request-Start": f"t={1_700_000_000_000_000 + i}",
            "Fly-Request-Id": f"01J{i:023d}",
            "X-Amz-Cf-Id": f"cf-{i}",
            "CloudFront-Viewer-Address": f"203.0.113.{i}:5{i:04d}",
            "X-Azure-Ref": f"ref-{i}",
            "X-Client-Port": str(40000 + i),
        }

    first = await gw.chat(headers=platform(1))
    again = await gw.chat(headers=platform(2))  # byte-identical body: the repeat memo
    streamed, text = await gw.stream_chat(headers=platform(3))  # other bytes: parsed
    assert [r.headers["x-carpool"] for r in (first, again, streamed)] == ["miss", "hit", "hit"]
    assert again.json() == first.json() and text.endswith("data: [DONE]\n\n")
    assert fake.count() == 1


async def test_headers_named_in_fingerprint_neutral_headers_are_out_of_the_key_over_http(
    fake, gateway_with
):
    async with gateway_with(
        fingerprint={"neutral_headers": ["X-Edge-Request"]},
        batching={"max_batch_delay_ms": 200, "embeddings": "on"},
    ) as gw:
        first = await gw.chat(headers={"X-Edge-Request": "a1"})
        again = await gw.chat(headers={"x-edge-request": "b2"})
        assert len(gw.gateway.repeats) == 1  # the repeat memo's key leaves it out as well
        streamed, _ = await gw.stream_chat(headers={"X-EDGE-REQUEST": "c3"})
        assert [r.headers["x-carpool"] for r in (first, again, streamed)] == [
            "miss",
            "hit",
            "hit",
        ]
        assert again.json() == first.json() and fake.count() == 1
        # Still forwarded as it came; a header it does not name is still in the key.
        assert fake.calls[0].headers["x-edge-request"] == "a1"
        other = await gw.chat(headers={"X-Edge-Other": "1"})
        assert other.headers["x-carpool"] == "miss" and fake.count() == 2
        # Nor do they split a batched embeddings call.
        embedded = await asyncio.gather(
            *(
                gw.client.post(
                    "/v1/embeddings",
                    json={"model": "e", "input": f"item {i}"},
                    headers={"X-Edge-Request": f"e{i}"},
                )
                for i in range(2)
            )
        )
        assert all(r.status_code == 200 for r in embedded)
        calls = [c for c in fake.calls if c.path == "/v1/embeddings"]
        assert len(calls) == 1 and sorted(calls[0].body["input"]) == ["item 0", "item 1"]


async def test_every_response_of_a_cached_endpoint_carries_x_carpool(gw, fake):
    responses = [
        await gw.chat(),
        await gw.chat(),
        await gw.chat(temperature=1),
        await gw.client.post(CHAT, content=b"{"),
    ]
    assert [r.headers["x-carpool"] for r in responses] == ["miss", "hit", "bypass", "bypass"]
    assert orjson.loads(responses[0].content) == orjson.loads(responses[1].content)


# --- what is relayed of an upstream's head ----------------------------------------------------


async def test_an_upstream_answer_without_a_content_type_is_relayed_without_one_not_an_empty_one():
    """An upstream that names no content type: its refusal and a bypassed answer were relayed
    with ``content-type:`` and nothing after it. Now without the header, as it came."""
    whole = chat_completion("hi")

    def respond(call: RawCall) -> bytes:
        if call.body["messages"][-1]["content"] == "refused":
            return raw_answer(429, b"Busy", b"upstream overloaded", content_type=None)
        return raw_answer(200, b"OK", whole, content_type=None)

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        refused = await gw.chat("refused")
        bypassed = await gw.chat("hello", temperature=1)
        assert refused.status_code == 429 and refused.content == b"upstream overloaded"
        assert bypassed.status_code == 200 and bypassed.headers["x-carpool"] == "bypass"
        assert bypassed.content == whole
        for response in (refused, bypassed):
            assert "content-type" not in response.headers
