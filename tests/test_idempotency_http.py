"""Idempotency keys over HTTP (CONTRACT.md "Idempotency"): client retries never run twice on
the cached endpoints; on pass-through a key is held to the same rule but kept by no record."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import orjson
import pytest

from carpool.apis.base import Api
from carpool.clock import ManualClock
from carpool.config import Config
from carpool.idempotency import StoredResponse, once
from carpool.idempotency.once import MAX_KEYED_ITEMS, OFF_LOOP_BYTES
from carpool.pipeline import Gateway
from carpool.server import create_app
from carpool.wiring import build_gateway
from conftest import redis_settings, run_gateway
from fakes.serving import ServedApp, serve_app_with_server
from fakes.sizing import deep_size
from fakes.waiting import WAIT_S, eventually

KEY = {"Idempotency-Key": '"order-42"'}
# Redis timeouts for tests whose subject is not Redis failing: under load (pytest -n on two
# cores) a call past the 0.5 s default made the instance keep its record in its own memory,
# where the other instance, or the retry, did not find it.
STEADY_LINK = {"timeout": 5.0, "connect_timeout": 5.0}
CHAT = "/v1/chat/completions"


def text(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


async def test_a_retry_after_completion_is_replayed_without_calling_upstream(gw, fake):
    first = await gw.chat(temperature=0.9, headers=KEY)  # sampled: would differ if re-run
    retry = await gw.chat(temperature=0.9, headers=KEY)
    assert first.status_code == retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert retry.content == first.content and fake.count() == 1


async def test_an_upstream_error_is_stored_and_replayed_too(gw, fake):
    # An error of a request the upstream executed (a 503 is not one: test_idempotency_retry.py)
    fake.fail_status = 400
    first = await gw.chat(headers=KEY)
    fake.fail_status = None
    retry = await gw.chat(headers=KEY)
    assert first.status_code == retry.status_code == 400
    assert retry.content == first.content and retry.headers["idempotent-replayed"] == "true"
    assert fake.count() == 1


async def test_a_replayed_engine_failure_tells_the_sdk_not_to_retry_it(gw, fake):
    # A 500 of the engine is kept under its key (as Stripe does) and replayed to every retry:
    # the SDK, which retries a 5xx on its own, spent its retries (~1.3 s) on replays of it.
    messages = [{"role": "user", "content": "What is carpool?"}]
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)
    fake.fail_status = 500
    with pytest.raises(openai.InternalServerError) as first:
        await sdk.chat.completions.create(
            model="m", messages=messages, temperature=0, extra_headers=KEY
        )
    fake.fail_status = None
    with pytest.raises(openai.InternalServerError) as failed:
        await sdk.with_options(max_retries=2).chat.completions.create(
            model="m", messages=messages, temperature=0, extra_headers=KEY
        )
    await sdk.close()
    replay = failed.value.response
    assert first.value.response.headers["x-carpool"] == "miss"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["x-should-retry"] == "false"
    assert replay.request.headers["x-stainless-retry-count"] == "0"  # (asked once: no retry)
    assert fake.count() == 1


async def test_an_engine_failure_kept_under_its_key_tells_the_sdk_not_to_retry_it_at_once(gw, fake):
    # The first answer of a key, a 5xx kept as final, is what every retry with the key gets:
    # relayed with the upstream's ``Retry-After`` and ``x-should-retry: true``, the SDK waited
    # that long (up to 60 s) for a replay of it. A 5xx not kept (a 503: retryable) keeps them.
    retry = [(b"retry-after", b"4"), (b"retry-after-ms", b"4000"), (b"x-should-retry", b"true")]
    fake.fail_status, fake.response_headers = 500, retry
    kept = await gw.client.post(CHAT, json=body_of_chat(), headers=KEY)
    assert kept.status_code == 500 and kept.headers["x-should-retry"] == "false"
    assert "retry-after" not in kept.headers and "retry-after-ms" not in kept.headers
    fake.fail_status = 503
    again = {"Idempotency-Key": '"another"'}
    dropped = await gw.client.post(CHAT, json=body_of_chat(), headers=again)
    assert dropped.status_code == 503 and dropped.headers["x-should-retry"] == "true"
    assert dropped.headers["retry-after"] == "4"
    assert fake.count() == 2


def body_of_chat() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


async def test_the_same_key_while_processing_is_409_problem_json(gw, fake):
    fake.gate = asyncio.Event()
    first = asyncio.create_task(gw.chat(headers=KEY))
    await fake.wait_for_calls(1)
    conflict = await gw.chat(headers=KEY)
    assert conflict.status_code == 409
    assert conflict.headers["content-type"].startswith("application/problem+json")
    assert conflict.json()["status"] == 409
    fake.gate.set()
    assert (await first).status_code == 200 and fake.count() == 1


async def test_the_same_key_while_processing_waits_when_configured(fake, gateway_with):
    async with gateway_with(idempotency={"on_conflict": "wait"}) as gw:
        fake.gate = asyncio.Event()
        first = asyncio.create_task(gw.chat(headers=KEY))
        await fake.wait_for_calls(1)
        second = asyncio.create_task(gw.chat(headers=KEY))
        await eventually(lambda: gw.gateway.idempotency.waiters >= 1, what="the waiting retry")
        fake.gate.set()
        a, b = await asyncio.gather(first, second)
        assert b.status_code == 200 and b.headers["idempotent-replayed"] == "true"
        assert b.content == a.content and fake.count() == 1


async def test_the_same_key_with_a_different_request_is_422(gw, fake):
    await gw.chat("first question", headers=KEY)
    other = await gw.chat("another question", headers=KEY)
    assert other.status_code == 422
    assert other.headers["content-type"].startswith("application/problem+json")
    assert other.json()["error"]["code"] == "idempotency_mismatch"  # (where the Node SDK reads)
    assert fake.count() == 1


@pytest.mark.parametrize("value", ['""', "", "x" * 256, "bad\x01key"])
async def test_an_invalid_key_is_400_and_nothing_is_stored(gw, fake, value):
    response = await gw.client.post(
        "/v1/chat/completions",
        headers={"Idempotency-Key": value},
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0},
    )
    assert response.status_code == 400 and fake.count() == 0


async def test_two_idempotency_keys_are_400_never_one_key_made_of_both(gw, fake):
    """Two header lines read as one comma-joined value (RFC 9110 5.3): ``a, b`` is no key the
    client sent, and its retry with either line alone would run the generation again."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    for headers in (
        [("Idempotency-Key", "a"), ("Idempotency-Key", "b")],
        [("Idempotency-Key", "a, b")],
        [("X-Idempotency-Key", "a"), ("X-Idempotency-Key", "b")],
    ):
        response = await gw.client.post("/v1/chat/completions", headers=headers, json=body)
        assert response.status_code == 400, headers
        assert "one key" in response.json()["detail"]
    assert fake.count() == 0
    quoted = await gw.client.post(  # (a comma inside a quoted key is part of it)
        "/v1/chat/completions", headers={"Idempotency-Key": '"a, b"'}, json=body
    )
    assert quoted.status_code == 200 and fake.count() == 1


async def test_x_idempotency_key_is_an_alias(gw, fake):
    await gw.chat(headers={"X-Idempotency-Key": "k1"})
    retry = await gw.chat(headers={"X-Idempotency-Key": "k1"})
    assert retry.headers["idempotent-replayed"] == "true" and fake.count() == 1


async def test_a_bare_key_is_the_same_key_as_its_quoted_form(gw, fake):
    # The draft's value is an RFC 8941 string; Stripe-style clients send the bare text.
    first = await gw.chat(temperature=0.9, headers={"Idempotency-Key": '"abc"'})
    for headers in ({"Idempotency-Key": "abc"}, {"X-Idempotency-Key": "abc"}):
        retry = await gw.chat(temperature=0.9, headers=headers)
        assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    assert fake.count() == 1


async def test_keys_are_scoped_by_tenant(gw, fake):
    a = await gw.chat(temperature=0.9, headers={**KEY, "Authorization": "Bearer a"})
    b = await gw.chat(temperature=0.9, headers={**KEY, "Authorization": "Bearer b"})
    assert "idempotent-replayed" not in b.headers and fake.count() == 2
    assert text(a) != text(b)


async def test_a_streamed_answer_is_replayed_as_the_same_stream(gw, fake):
    _, first = await gw.stream_chat(headers=KEY)
    response, retry = await gw.stream_chat(headers=KEY)
    assert response.headers["idempotent-replayed"] == "true"
    assert response.headers["content-type"].startswith("text/event-stream")
    assert retry == first and fake.count() == 1


@pytest.mark.parametrize("records", ["memory", "redis"])
async def test_a_replay_is_a_hit_with_the_age_of_its_answer_whole_or_streamed(
    fake, records, request
):
    """Hits carry ``age``: a replay too (it says ``x-carpool: hit``), counted from when its
    answer was made: the first reply's time, less the age that reply said."""
    clock = ManualClock()
    shared = {} if records == "memory" else idempotency_settings(records, request)
    async with run_gateway([fake.url], clock, **shared) as gw:
        first = await gw.chat(headers=KEY)
        assert first.headers["x-carpool"] == "miss" and "age" not in first.headers
        clock.advance(42)
        whole = await gw.chat(headers=KEY)
        streamed, _ = await gw.stream_chat(headers=KEY)
        for replay in (whole, streamed):
            assert replay.headers["idempotent-replayed"] == "true"
            assert (replay.headers["x-carpool"], replay.headers["age"]) == ("hit", "42")
        await gw.chat("cached")
        clock.advance(10)
        other = {"Idempotency-Key": "other"}
        hit = await gw.chat("cached", headers=other)
        # (An answer in Redis is aged in Redis time, which this clock does not move: 0 there.)
        aged = 10 if records == "memory" else 0
        assert (hit.headers["x-carpool"], hit.headers["age"]) == ("hit", str(aged))
        clock.advance(5)
        replay = await gw.chat("cached", headers=other)
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.headers["age"] == str(aged + 5)
        assert fake.count() == 2


async def test_a_request_whose_client_left_before_an_answer_can_be_retried(gw, fake):
    fake.hang = True
    first = asyncio.create_task(gw.chat(headers=KEY))
    await fake.wait_for_calls(1)
    first.cancel()
    await fake.wait_for_cancelled(1)
    await eventually(lambda: gw.gateway.flights.waiters == 0)
    fake.hang = False
    retry = await gw.chat(headers=KEY)
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers


async def test_idempotency_records_are_shared_across_instances(fake, shared_redis):
    config = redis_settings(shared_redis, **STEADY_LINK)
    async with run_gateway([fake.url], **config) as a, run_gateway([fake.url], **config) as b:
        fake.gate = asyncio.Event()
        first = asyncio.create_task(a.chat(temperature=0.9, headers=KEY))
        await fake.wait_for_calls(1)
        assert (await b.chat(temperature=0.9, headers=KEY)).status_code == 409
        fake.gate.set()
        original = await first
        retry = await b.chat(temperature=0.9, headers=KEY)
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.content == original.content and fake.count() == 1
        assert (await b.chat("other", headers=KEY)).status_code == 422


async def test_a_list_input_is_tracked_item_by_item_so_a_retry_recomputes_only_failed_items(
    fake, gateway_with
):
    # ttl 0 and no window: nothing but the idempotency records can spare a recomputation.
    async with gateway_with(coalesce={"window_ms": 0}) as gw:
        headers = {**KEY, "x-carpool-type": "factual"}
        body = {"model": "e", "input": ["alpha", "beta", "gamma"]}
        fake.fail_status, fake.fail_times = 500, 1  # exactly one item's call fails
        first = await gw.client.post("/v1/embeddings", json=body, headers=headers)
        assert first.status_code == 500 and fake.count() == 3
        retry = await gw.client.post("/v1/embeddings", json=body, headers=headers)
        assert retry.status_code == 200 and fake.count() == 4  # only the failed item again
        data = retry.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        alone = await gw.client.post("/v1/embeddings", json={"model": "e", "input": ["beta"]})
        assert data[1]["embedding"] == alone.json()["data"][0]["embedding"]
        again = await gw.client.post("/v1/embeddings", json=body, headers=headers)
        assert again.headers["idempotent-replayed"] == "true" and again.content == retry.content


async def test_an_answer_short_of_its_n_choices_is_not_kept_under_the_key(gw, fake):
    # A 200 with one of two choices is not the request's answer: a retry runs again (it was
    # replayed for the retention, one choice short).
    fake.drop_choices = {1}
    await gw.chat(n=2, headers=KEY)
    fake.drop_choices = set()
    retry = await gw.chat(n=2, headers=KEY)
    assert "idempotent-replayed" not in retry.headers
    assert len(retry.json()["choices"]) == 2 and fake.count() == 2


async def test_each_prompts_choices_keep_their_own_indexes_or_the_list_fails(gw, fake):
    body = {"model": "m", "prompt": ["a", "b"], "temperature": 0, "n": 2}
    whole = await gw.client.post("/v1/completions", json=body, headers=KEY)
    by_index = {c["index"]: c["text"].split(" to ")[1] for c in whole.json()["choices"]}
    assert by_index == {0: "a", 1: "a", 2: "b", 3: "b"}
    # An item short of a choice never shifts the next prompt's answers onto its indexes.
    fake.drop_choices = {1}
    body["prompt"] = ["c", "d"]
    short = await gw.client.post("/v1/completions", json=body, headers={"Idempotency-Key": "s"})
    assert short.status_code == 502 and "choices" not in short.json()


async def test_a_stream_retry_of_a_list_recomputes_only_the_items_that_failed(fake, gateway_with):
    async with gateway_with(coalesce={"window_ms": 0}) as gw:
        headers = {**KEY, "x-carpool-type": "factual"}  # (nothing cached: only the records)
        body = {"model": "m", "prompt": ["a", "b"], "temperature": 0}
        fake.fail_status, fake.fail_times = 503, 1
        first = await gw.client.post("/v1/completions", json=body, headers=headers)
        assert first.status_code == 503 and fake.count() == 2
        retry = await gw.client.post(
            "/v1/completions", json={**body, "stream": True}, headers=headers
        )
        assert retry.status_code == 200 and fake.count() == 3
        assert len(fake.calls[2].body["prompt"]) == 1  # the failed item alone, not the list
        assert retry.headers["content-type"].startswith("text/event-stream")
        assert retry.text.rstrip().endswith("data: [DONE]")
        again = await gw.client.post("/v1/completions", json=body, headers=headers)
        assert again.headers["idempotent-replayed"] == "true" and fake.count() == 3
        assert [c["text"].split(" to ")[1] for c in again.json()["choices"]] == ["a", "b"]
        # Its stream had no usage chunk (not asked for), but its record kept it.
        assert again.json()["usage"]["total_tokens"] > 0


async def test_a_list_says_what_its_items_were(gw, fake):
    sampled = {"model": "m", "prompt": ["a", "b"], "temperature": 1}
    bypassed = await gw.client.post("/v1/completions", json=sampled, headers=KEY)
    assert bypassed.headers["x-carpool"] == "bypass"
    body = {"model": "e", "input": ["x", "y"]}
    await gw.client.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "one"})
    hit = await gw.client.post("/v1/embeddings", json=body, headers={"Idempotency-Key": "two"})
    # Every item from the cache: a hit, with the age of the oldest (hits carry an age).
    assert hit.headers["x-carpool"] == "hit" and hit.headers["age"].isdigit()


async def test_a_list_prompt_is_answered_in_order_from_its_items(gw, fake):
    body = {"model": "m", "prompt": ["one", "two"], "temperature": 0}
    response = await gw.client.post("/v1/completions", json=body, headers=KEY)
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"].split(" to ")[1] for c in choices] == ["one", "two"]
    assert response.json()["usage"]["total_tokens"] > 0


async def test_a_replay_counts_the_tokens_it_saved_whole_or_streamed(gw, fake):
    # A replay is a hit: the retry's generation was not run again, its usage not recomputed.
    # It counted as a hit and added nothing to tokens_saved, nor to saved_without_usage.
    first = await gw.chat(temperature=0.9, headers=KEY)
    await gw.chat(temperature=0.9, headers=KEY)
    stats = (await gw.client.get("/stats")).json()
    assert stats["hits"] == 1 and stats["tokens_saved"] == first.json()["usage"]["total_tokens"]
    streamed = {"Idempotency-Key": '"order-43"'}
    await gw.stream_chat("streamed", headers=streamed, stream_options={"include_usage": True})
    await gw.stream_chat("streamed", headers=streamed, stream_options={"include_usage": True})
    after = (await gw.client.get("/stats")).json()
    assert after["hits"] == 2 and after["tokens_saved"] > stats["tokens_saved"]
    assert after["saved_without_usage"] == 0
    # A stream that did not ask for the usage: its record kept the usage chunk its client was
    # not sent, so its replay counts the tokens too.
    await gw.stream_chat("not asked", headers={"Idempotency-Key": '"order-44"'})
    await gw.stream_chat("not asked", headers={"Idempotency-Key": '"order-44"'})
    asked = (await gw.client.get("/stats")).json()
    assert asked["hits"] == 3 and asked["tokens_saved"] > after["tokens_saved"]
    assert asked["saved_without_usage"] == 0
    fake.ignore_include_usage = True  # an engine that reports none: counted apart
    await gw.stream_chat("no usage", headers={"Idempotency-Key": '"order-45"'})
    await gw.stream_chat("no usage", headers={"Idempotency-Key": '"order-45"'})
    last = (await gw.client.get("/stats")).json()
    assert last["hits"] == 4 and last["tokens_saved"] == asked["tokens_saved"]
    assert last["saved_without_usage"] == 1


def parses_of_whole_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of each whole SSE body parsed from now on (``Api.stream_chunks``: every chunk
    of a kept stream parsed as JSON), as it is parsed."""
    parsed: list[int] = []
    stream_chunks = Api.stream_chunks

    def counted(self: Api, raw: bytes) -> Any:
        parsed.append(len(raw))
        return stream_chunks(self, raw)

    monkeypatch.setattr(Api, "stream_chunks", counted)
    return parsed


async def test_a_replay_of_a_kept_stream_parses_it_once_in_either_format(gw, fake, monkeypatch):
    # Its form for the retry and the tokens it saved come from one parse: a long stream's
    # chunks, all parsed twice on every retry, were most of what a replay cost.
    _, first = await gw.stream_chat(headers=KEY)
    parsed = parses_of_whole_streams(monkeypatch)
    asked = {"stream_options": {"include_usage": True}}
    for retry in (
        gw.stream_chat(headers=KEY),
        gw.stream_chat(headers=KEY, **asked),
        gw.chat(headers=KEY),
    ):
        before = len(parsed)
        done = await retry
        response = done[0] if isinstance(done, tuple) else done
        assert response.headers["idempotent-replayed"] == "true"
        assert len(parsed) - before == 1
    tokens = response.json()["usage"]["total_tokens"]  # (the JSON retry's)
    stats = (await gw.client.get("/stats")).json()
    assert stats["hits"] == 3 and stats["tokens_saved"] == 3 * tokens and fake.count() == 1


async def test_keyed_clients_of_one_shared_stream_are_kept_without_each_parsing_it(
    fake, gateway_with, monkeypatch
):
    # Clients with keys of their own on one flight received the same frames, which the flight
    # judged as they came: their records are kept by that answer (``Reply.answered``), not by
    # each parsing the whole stream again at its end; a keyed hit of the answer too.
    async with gateway_with(coalesce={"window_ms": 0}) as gw:
        parsed = parses_of_whole_streams(monkeypatch)
        fake.chunk_gate = asyncio.Event()  # (two words, then held until every client joined)
        keys = [{"Idempotency-Key": f'"joiner-{i}"'} for i in range(4)]
        clients = [asyncio.create_task(gw.stream_chat(headers=key)) for key in keys]
        await eventually(lambda: gw.gateway.flights.waiters == 4, what="4 clients on the flight")
        fake.chunk_gate.set()
        streams = await asyncio.gather(*clients)
        after = {"Idempotency-Key": '"after"'}
        hit, _ = await gw.stream_chat(headers=after)
        assert hit.headers["x-carpool"] == "hit"
        assert parsed == [] and fake.count() == 1
        for key, (_, raw) in zip([*keys, after], [*streams, (hit, None)], strict=True):
            retry, again = await gw.stream_chat(headers=key)  # (each record kept)
            assert retry.headers["idempotent-replayed"] == "true"
            assert raw is None or again == raw
        assert fake.count() == 1


async def test_a_long_kept_stream_is_parsed_while_the_event_loop_serves_others(
    gw, fake, monkeypatch
):
    # A sampled stream is bypassed: no flight's answer judges it, its record parses it, at its
    # end and on each retry. A long one is parsed while the loop runs the other requests (every
    # tenant's): the loop ran a callback scheduled as each parse began, before it ended.
    loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()
    served: list[bool] = []  # one a parse of a long stream: whether the loop ran meanwhile
    stream_chunks = Api.stream_chunks

    def watched(self: Api, raw: bytes) -> Any:
        if len(raw) > OFF_LOOP_BYTES:
            ran = threading.Event()
            loop.call_soon_threadsafe(ran.set)
            # (On the loop's own thread nothing else runs until this parse returns.)
            served.append(threading.get_ident() != loop_thread and ran.wait(WAIT_S))
        return stream_chunks(self, raw)

    monkeypatch.setattr(Api, "stream_chunks", watched)
    fake.answer_text = lambda number, body: " ".join(["word"] * 1000)
    response, first = await gw.stream_chat(temperature=0.9, headers=KEY)
    assert response.headers["x-carpool"] == "bypass" and len(first) > OFF_LOOP_BYTES
    retry, again = await gw.stream_chat(temperature=0.9, headers=KEY)
    whole = await gw.chat(temperature=0.9, headers=KEY)
    assert retry.headers["idempotent-replayed"] == whole.headers["idempotent-replayed"] == "true"
    assert again == first and fake.count() == 1
    assert served == [True, True, True]  # (its end, then one parse a retry)


async def test_a_list_items_replayed_from_their_records_are_counted_as_hits(fake, gateway_with):
    async with gateway_with(coalesce={"window_ms": 0}) as gw:
        headers = {**KEY, "x-carpool-type": "factual"}
        body = {"model": "e", "input": ["alpha", "beta", "gamma"]}
        fake.fail_status, fake.fail_times = 500, 1  # one item fails: the list is not kept
        await gw.client.post("/v1/embeddings", json=body, headers=headers)
        before = (await gw.client.get("/stats")).json()
        assert (await gw.client.post("/v1/embeddings", json=body, headers=headers)).is_success
        after = (await gw.client.get("/stats")).json()
        # The failed item ran again (a miss); the two kept ones were replayed (hits).
        assert after["misses"] - before["misses"] == 1
        assert after["hits"] - before["hits"] == 2


async def test_a_list_of_hits_says_the_age_of_its_oldest_item_one_replayed_from_its_record_too(
    fake, gateway_with
):
    clock = ManualClock()
    async with gateway_with(clock=clock) as gw:
        words = ["alpha", "beta", "gamma"]
        body = {"model": "e", "input": words}
        fake.fail_status, fake.fail_times = 500, 1  # one item fails: the list is not kept
        assert (await gw.client.post("/v1/embeddings", json=body, headers=KEY)).status_code == 500
        clock.advance(30)
        for word in words:  # the failed item computed now, without a key; the others hits
            await gw.client.post("/v1/embeddings", json={"model": "e", "input": [word]})
        clock.advance(5)
        retry = await gw.client.post("/v1/embeddings", json=body, headers=KEY)
        # Two items replayed from their records (35 s old), one from the cache (5 s old).
        assert (retry.headers["x-carpool"], retry.headers["age"]) == ("hit", "35")
        assert fake.count() == 4


async def test_a_client_leaving_while_its_record_is_finished_is_counted_once_and_kept(gw, fake):
    # Its outcome was counted, then it was counted abandoned too; and the record's finish was
    # cancelled with the request, so a retry ran the generation again.
    records = gw.gateway.once.records
    original, release, finishing = records.finish, asyncio.Event(), []

    async def held_finish(*args, **kwargs):  # as a slow Redis round trip would be
        await release.wait()
        return await original(*args, **kwargs)

    def finish(*args, **kwargs):
        finishing.append(args)
        return held_finish(*args, **kwargs)

    records.finish = finish
    leaving = asyncio.create_task(gw.chat(temperature=0.9, headers=KEY))
    await eventually(lambda: finishing, what="the record being finished")
    leaving.cancel()
    await eventually(lambda: not gw.gateway.serving, what="the request's end")
    release.set()
    retry = await gw.chat(temperature=0.9, headers=KEY)
    assert retry.headers.get("idempotent-replayed") == "true" and fake.count() == 1
    stats = (await gw.client.get("/stats")).json()
    assert (stats["requests"], stats["abandoned"]) == (2, 0)


async def test_a_long_answer_whose_client_leaves_while_it_is_judged_off_the_loop_is_kept(
    gw, fake, monkeypatch
):
    # A long answer is judged on a worker thread (``once._off_loop``): a client leaving
    # meanwhile cancels its request there, and the record is kept all the same, as when it
    # leaves during the record's finish (above): not left processing for a retry to get 409.
    judging, judged = threading.Event(), threading.Event()
    is_final = once.is_final

    def held(*args: Any) -> bool:
        judging.set()
        judged.wait(WAIT_S)
        return is_final(*args)

    records, kept = gw.gateway.once.records, asyncio.Event()
    finish = records.finish

    async def finished(*args: Any) -> bool:
        done = await finish(*args)
        kept.set()
        return done

    monkeypatch.setattr(once, "is_final", held)
    monkeypatch.setattr(records, "finish", finished)
    fake.answer_text = lambda number, body: " ".join(["word"] * 20_000)  # (JSON over 64 KiB)
    leaving = asyncio.create_task(gw.chat(temperature=0.9, headers=KEY))
    assert await asyncio.to_thread(judging.wait, WAIT_S)
    leaving.cancel()
    await eventually(lambda: not gw.gateway.serving, what="the request's end")
    judged.set()
    await asyncio.wait_for(kept.wait(), WAIT_S)
    retry = await gw.chat(temperature=0.9, headers=KEY)
    assert retry.headers.get("idempotent-replayed") == "true" and fake.count() == 1


@pytest.mark.parametrize(
    "path, body, items",
    [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, 1),
        ("/v1/embeddings", {"model": "e", "input": ["alpha", "beta"]}, 2),
    ],
    ids=["one", "a list"],
)
async def test_a_request_counted_under_its_outcome_is_timed_under_it_when_its_client_leaves_as_its_record_is_kept(  # noqa: E501
    gw, fake, path, body, items
):
    # Its outcome was counted, then the cancel landed while its record was kept: its reply
    # never came back to be timed (carpool_request_duration_seconds a miss short of
    # carpool_requests_total); a list, counted item by item in tasks of their own, was counted
    # abandoned as well.
    records = gw.gateway.once.records
    original, release, finishing = records.finish, asyncio.Event(), []

    def finish(*args, **kwargs):
        finishing.append(args)

        async def held():  # as a slow Redis round trip would be
            await release.wait()
            return await original(*args, **kwargs)

        return held()

    records.finish = finish
    leaving = asyncio.create_task(
        gw.client.post(path, json={**body, "temperature": 0}, headers=KEY)
    )
    await eventually(lambda: len(finishing) == items, what="its records being kept")
    leaving.cancel()
    await eventually(lambda: not gw.gateway.serving, what="the request's end")
    release.set()
    stats = (await gw.client.get("/stats")).json()
    assert (stats["misses"], stats["abandoned"]) == (items, 0)
    assert {outcome: f["count"] for outcome, f in stats["latency_ms"].items()} == {"miss": 1}
    retry = await gw.client.post(path, json={**body, "temperature": 0}, headers=KEY)
    assert retry.headers["x-carpool"] == "hit" and fake.count() == items  # (what it kept)


async def test_identical_replays_of_a_long_answer_in_progress_share_one_parse(
    gw, fake, monkeypatch
):
    # Each retry of a key whose stored answer is long parsed it on the one parsing thread
    # (~70 ms for 4.6 MB of a stream): 40 retries at once queued 2.9 s of parses, every other
    # tenant's long replay waiting behind them. Identical replays in progress share one.
    fake.answer_text = lambda number, body: " ".join(["word"] * 20_000)
    first, text = await gw.stream_chat(headers=KEY)  # (its record: a stream over 64 KiB)
    assert first.status_code == 200 and len(text) > OFF_LOOP_BYTES
    parsed = []
    real = once.replayed

    def counted(*args: Any) -> Any:
        parsed.append(args[1:])
        return real(*args)

    monkeypatch.setattr(once, "replayed", counted)
    hold, holding = threading.Event(), threading.Event()
    once._PARSING.submit(lambda: (holding.set(), hold.wait(WAIT_S)))  # (the thread busy)
    assert await asyncio.to_thread(holding.wait, WAIT_S)
    retries = [asyncio.create_task(gw.stream_chat(headers=KEY)) for _ in range(5)]
    try:
        await eventually(lambda: gw.gateway.once.replays_joined == 4, what="the retries joined")
    finally:
        hold.set()
    for retry, replayed_text in await asyncio.gather(*retries):
        assert retry.headers["idempotent-replayed"] == "true" and replayed_text == text
    assert len(parsed) == 1 and fake.count() == 1
    json_retry = await gw.chat(headers=KEY)  # (another format: a parse of its own)
    assert json_retry.headers["idempotent-replayed"] == "true" and len(parsed) == 2


async def test_a_key_still_running_is_never_evicted_by_the_records_bounds(fake, gateway_with):
    # In-process records beyond idempotency.max_records: a running one was the oldest, went
    # first, and its retry ran the generation again while the first still streamed.
    async with gateway_with(idempotency={"max_records": 2}) as gw:
        fake.chunk_gate = asyncio.Event()
        first = asyncio.create_task(gw.stream_chat("long", headers=KEY))
        await fake.chunk_gate_reached.wait()
        for i in range(4):  # finished ones, past the bound
            fake.chunk_gate_after = 10_000
            done = await gw.chat(f"short {i}", headers={"Idempotency-Key": f'"k{i}"'})
            assert done.status_code == 200
        assert (await gw.chat("long", headers=KEY)).status_code == 409
        fake.chunk_gate.set()
        await first
        retry = await gw.chat("long", headers=KEY)
        assert (
            retry.headers.get("idempotent-replayed") == "true"
            and fake.count("/v1/chat/completions") == 5
        )


async def test_one_tenants_flood_of_keys_never_makes_another_tenants_retry_run_again(
    fake, gateway_with
):
    # In-process records beyond idempotency.max_records: the oldest overall went, so a tenant
    # sending many keys evicted a quiet tenant's finished record, and its retry ran again.
    async with gateway_with(idempotency={"max_records": 4}) as gw:
        quiet = {**KEY, "Authorization": "Bearer quiet"}
        first = await gw.chat("quiet question", temperature=0.9, headers=quiet)
        for i in range(6):
            loud = {"Idempotency-Key": f'"k{i}"', "Authorization": "Bearer loud"}
            assert (await gw.chat(f"loud {i}", headers=loud)).status_code == 200
        retry = await gw.chat("quiet question", temperature=0.9, headers=quiet)
        assert retry.headers.get("idempotent-replayed") == "true"
        assert retry.content == first.content and fake.count("/v1/chat/completions") == 7


def idempotency_settings(records: str, request: pytest.FixtureRequest) -> dict:
    """The gateway config whose idempotency records live in memory, or in a Redis server."""
    if records == "memory":
        return {}
    return redis_settings(request.getfixturevalue("redis_server"), **STEADY_LINK)


def waiting(gw) -> int:
    """The retries waiting on the gateway's records (Redis's, behind the fallback)."""
    records = gw.gateway.idempotency
    return getattr(records, "shared", records).waiters


@pytest.mark.parametrize("records", ["memory", "redis"])
async def test_a_different_list_under_a_partly_failed_lists_key_is_422_and_the_first_lists_retry_still_runs(
    fake, gateway_with, records, request
):
    # The list's record was dropped after its partial failure: another list under the key took
    # it over (its first item replayed from the first list's), and the first list's own retry
    # got a 422 for the retention.
    async with gateway_with(**idempotency_settings(records, request)) as gw:

        async def embed(items: list[str]):
            body = {"model": "e", "input": items}
            return await gw.client.post("/v1/embeddings", json=body, headers=KEY)

        fake.refuse = lambda call: "no b" if call.body and call.body.get("input") == ["b"] else None
        assert (await embed(["a", "b"])).status_code == 400  # "a" answered and kept, "b" refused
        fake.refuse = None
        other = await embed(["a", "c"])
        assert other.status_code == 422 and other.json()["code"] == "idempotency_mismatch"
        assert fake.count() == 2  # nothing of the other list ran
        retry = await embed(["a", "b"])
        assert retry.status_code == 200 and fake.count() == 3  # "b" alone ran again
        again = await embed(["a", "b"])
        assert again.headers["idempotent-replayed"] == "true" and again.content == retry.content
        assert (await embed(["a", "c"])).status_code == 422


@pytest.mark.parametrize("records", ["memory", "redis"])
async def test_every_waiting_retry_waits_again_when_the_first_run_is_dropped(
    fake, gateway_with, records, request
):
    # With on_conflict: wait, the first run's record dropped (a 503: retryable), one waiting
    # retry began a new run and the other got a 409 at once (Redis: both woke to no record).
    config = idempotency_settings(records, request)
    async with gateway_with(idempotency={"on_conflict": "wait"}, **config) as gw:
        fake.gate = asyncio.Event()
        fake.fail_status, fake.fail_times = 503, 1
        first = asyncio.create_task(gw.chat(temperature=0.9, headers=KEY))
        await fake.wait_for_calls(1)
        retries = [asyncio.create_task(gw.chat(temperature=0.9, headers=KEY)) for _ in range(2)]
        await eventually(lambda: waiting(gw) == 2, what="the two waiting retries")
        fake.gate.set()
        assert (await first).status_code == 503
        answers = await asyncio.gather(*retries)
        assert [r.status_code for r in answers] == [200, 200]
        replayed = [r.headers.get("idempotent-replayed") == "true" for r in answers]
        assert sorted(replayed) == [False, True] and answers[0].content == answers[1].content
        assert fake.count() == 2  # the dropped run, and the one run after it


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [("/v1/embeddings", "input", {"model": "e"}), ("/v1/completions", "prompt", {"model": "m"})],
)
async def test_a_keyed_list_over_the_item_cap_is_400(gw, fake, path, field, body):
    # A keyed list ran one upstream call and kept one record per item, however many: 20,000
    # inputs made 20,000 calls and 20,001 records.
    items = [f"item {i}" for i in range(MAX_KEYED_ITEMS + 1)]
    refused = await gw.client.post(path, json={**body, field: items}, headers=KEY)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert str(MAX_KEYED_ITEMS) in error["message"]
    assert fake.count() == 0 and len(gw.gateway.idempotency) == 0  # nothing ran, nothing kept
    # Without a key the list is the upstream's to judge (one call), not the gateway's.
    unkeyed = await gw.client.post(path, json={**body, field: items})
    assert unkeyed.status_code == 200 and fake.count() == 1
    if field == "input":  # (a call an item: once is enough)
        at_the_cap = {**body, field: items[:MAX_KEYED_ITEMS]}
        assert (await gw.client.post(path, json=at_the_cap, headers=KEY)).status_code == 200


# --- pass-through: keys validated, never recorded ---------------------------------------------

IMAGE = {"model": "dall-e-3", "prompt": "a red car"}
BATCH = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.mark.parametrize(
    "value",
    ['""', "", "x" * 256, "clé".encode(), '"order-42', "order\t42"],
    ids=["empty-string", "empty", "too-long", "non-ascii", "unterminated", "tab"],
)
async def test_an_invalid_idempotency_key_on_a_pass_through_call_is_400_and_reaches_no_upstream(
    gw, fake, value
):
    # Only the cached endpoints read the key: on pass-through an invalid one was a 200, the
    # call made (and, with pass-through credentials, the key sent on to the upstream).
    cached = await gw.client.post(
        "/v1/chat/completions",
        headers={"Idempotency-Key": value},
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    assert cached.status_code == 400
    calls = [
        ("POST", "/v1/images/generations", IMAGE, "Idempotency-Key"),
        ("POST", "/v1/batches", BATCH, "X-Idempotency-Key"),
        ("GET", "/v1/models", None, "Idempotency-Key"),
        ("DELETE", "/v1/files/file-1", None, "X-Idempotency-Key"),
    ]
    for method, path, body, header in calls:
        refused = await gw.client.request(method, path, json=body, headers={header: value})
        assert refused.status_code == 400, (method, path)
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert refused.json()["code"] == "idempotency_key_invalid"
        if header == "Idempotency-Key":  # the cached endpoints' very answer (its label aside)
            assert refused.content == cached.content
    assert fake.calls == []


async def test_a_valid_idempotency_key_on_a_pass_through_call_is_forwarded_and_its_retry_runs_again(
    gw, fake
):
    # What docs/idempotency.md says of the other paths: no record is kept of a call the gateway
    # does not understand; with pass-through credentials the key goes on, for the upstream to
    # honour (or not), and a retry is another call.
    first = await gw.client.post("/v1/images/generations", json=IMAGE, headers=KEY)
    retry = await gw.client.post("/v1/images/generations", json=IMAGE, headers=KEY)
    assert first.status_code == retry.status_code == 200
    assert "idempotent-replayed" not in retry.headers
    assert [(c.path, c.headers.get("idempotency-key")) for c in fake.calls] == [
        ("/v1/images/generations", '"order-42"'),
        ("/v1/images/generations", '"order-42"'),
    ]


@contextlib.asynccontextmanager
async def _served(
    fake, **config: Any
) -> AsyncIterator[tuple[ServedApp, Gateway, httpx.AsyncClient]]:
    """The gateway over HTTP, its server at hand: its connections say when one has ended."""
    gateway = build_gateway(Config(upstreams=[fake.url], **config))
    async with serve_app_with_server(create_app(gateway)) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            yield served, gateway, client


async def _first_then_gone(
    served: ServedApp, body: dict, fake, *, streamed: bool, path: str = CHAT
):
    """Sends the first keyed request on a connection of its own; returns, once its answer is
    under way (streamed: its head and first words sent), its writer (kept: collected, it closes
    the connection) and the server's side of that connection."""
    payload = orjson.dumps(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n" % path.encode()
        + b'idempotency-key: "order-42"\r\ncontent-length: %d\r\n\r\n' % len(payload)
        + payload
    )
    if streamed:
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
    else:
        await fake.wait_for_calls(1)
    (connection,) = served.server.server_state.connections
    return writer, connection


def _answer_held(fake, streamed: bool) -> asyncio.Event:
    """The fake's answer held until the event is set: a stream's after its head and first
    words."""
    gate = asyncio.Event()
    if streamed:
        fake.chunk_gate = gate
    else:
        fake.gate = gate
    return gate


def _records_waiting(gateway: Gateway) -> int:
    return getattr(gateway.idempotency, "shared", gateway.idempotency).waiters


@pytest.mark.parametrize("records", ["memory", "redis"])
@pytest.mark.parametrize(
    "asked",
    [
        pytest.param({"temperature": 0}, id="coalesced"),
        pytest.param({"temperature": 0.9}, id="sampled"),
        pytest.param({"temperature": 0, "stream": True}, id="streamed, gone part-way"),
    ],
)
async def test_a_retry_waiting_on_its_key_keeps_the_first_run_going_when_its_client_leaves(
    fake, records, asked, request
):
    # The usual reason for a retry: the first request's connection dropped. The first run was
    # cancelled part-way, then run again for the retry waiting on its record: two generations
    # for one key, the first thrown away.
    config = {"idempotency": {"on_conflict": "wait"}, **idempotency_settings(records, request)}
    streamed = asked.get("stream", False)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **asked}
    async with _served(fake, **config) as (served, gateway, client):
        gate = _answer_held(fake, streamed)
        retry = await _first_gone_while_a_retry_waits(fake, served, gateway, client, body, streamed)
        gate.set()
        answer = await retry
    assert answer.status_code == 200 and answer.headers["idempotent-replayed"] == "true"
    assert (fake.count(), fake.cancelled) == (1, 0)


async def _first_gone_while_a_retry_waits(
    fake: Any, served: Any, gateway: Any, client: Any, body: dict[str, Any], streamed: bool
) -> asyncio.Task[Any]:
    """The first keyed request sent, a retry with its key waiting on its record, then the first
    client's connection dropped (the usual reason for a retry): the retry, still waiting."""
    writer, first = await _first_then_gone(served, body, fake, streamed=streamed)
    retry = asyncio.create_task(client.post(CHAT, json=body, headers=KEY))
    await eventually(lambda: _records_waiting(gateway) == 1, what="the waiting retry")
    writer.transport.abort()  # (the first client's connection drops)
    await eventually(
        lambda: first not in served.server.server_state.connections, what="the first gone"
    )
    return retry


@pytest.mark.parametrize("records", ["memory", "redis"])
@pytest.mark.parametrize(
    "asked",
    [
        pytest.param({"temperature": 0}, id="coalesced"),
        pytest.param({"temperature": 0.9}, id="sampled"),
        pytest.param({"temperature": 0.9, "stream": True}, id="sampled stream, gone part-way"),
    ],
)
async def test_with_finish_abandoned_a_keyed_run_whose_client_left_is_finished_and_replayed(
    fake, records, asked, request
):
    """``coalesce.finish_abandoned`` keeps a run whose client left going (docs/idempotency.md:
    the remedy where a retry cannot keep it, on another worker or instance): only a flight's
    call was, so a sampled keyed request was cancelled with its client, and its retry made a
    second, different generation; a shared one's record was dropped (its retry not replayed)."""
    config = {
        "coalesce": {"finish_abandoned": True},
        # (The retry, sent once the run ended, waits for its record to be written, not a 409.)
        "idempotency": {"on_conflict": "wait"},
        **idempotency_settings(records, request),
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **asked}
    retry = await _retried_once_its_client_left(fake, config, body, CHAT)
    assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
    assert (fake.count(), fake.cancelled) == (1, 0)


async def _retried_once_its_client_left(
    fake, config: dict[str, Any], body: dict[str, Any], path: str
) -> httpx.Response:
    """A keyed request whose client leaves once its answer is under way (and, when no retry
    waits, whose run then ends one way or another), retried with its key once its record
    settled: the retry's response."""
    streamed = body.get("stream", False)
    async with _served(fake, **config) as (served, gateway, client):
        gate = _answer_held(fake, streamed)
        writer, first = await _first_then_gone(served, body, fake, streamed=streamed, path=path)
        writer.transport.abort()  # (the first client's connection drops; no retry waits)
        await eventually(
            lambda: first not in served.server.server_state.connections, what="the first gone"
        )
        gate.set()
        await eventually(lambda: fake.completed + fake.cancelled == 1, what="the first run's end")
        await eventually(lambda: _runs(gateway) == 0, what="its record settled")
        return await client.post(path, json=body, headers=KEY)


@pytest.mark.parametrize("records", ["memory", "redis"])
async def test_a_keyed_background_response_whose_client_left_is_finished_and_replayed(
    fake, records, request
):
    """A background response runs on upstream whether its client stays or not (the client
    resumes its stream by the response's id): a keyed one is kept going when its client
    leaves, as with ``coalesce.finish_abandoned``, and its retry replays it. (Before, its
    record was dropped with its client, and the retry started a second background job.)"""
    config = {"idempotency": {"on_conflict": "wait"}, **idempotency_settings(records, request)}
    body = {"model": "m", "input": "hi", "background": True, "stream": True}
    retry = await _retried_once_its_client_left(fake, config, body, "/v1/responses")
    assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
    assert "response.completed" in retry.text
    assert (fake.count(), fake.cancelled) == (1, 0)


def _runs(gateway: Gateway) -> int:
    """The keyed runs begun here whose record is not settled yet."""
    return len(gateway.once._runs)


async def test_once_the_waiting_retry_leaves_too_the_first_run_is_cancelled(fake):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    async with _served(fake, idempotency={"on_conflict": "wait"}) as (served, gateway, client):
        fake.gate = asyncio.Event()
        retry = await _first_gone_while_a_retry_waits(fake, served, gateway, client, body, False)
        retry.cancel()  # (its connection closed)
        await fake.wait_for_cancelled(1)
        await eventually(lambda: gateway.flights.waiters == 0, what="the flight left")
        fake.gate = None
        again = await client.post(CHAT, json=body, headers=KEY)  # its record was dropped
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers
    assert fake.count() == 2


async def test_keyed_embeddings_lists_hold_no_more_than_idempotency_max_bytes(fake, gateway_with):
    """A keyed list keeps a record per item, under the list's key and the item's index: with
    long keys and small answers the records held 2.65 times ``idempotency.max_bytes`` (only
    the answers' bytes were counted, not the keys and records around them)."""
    max_bytes = 600_000
    async with gateway_with(
        idempotency={"max_bytes": max_bytes, "max_records": 1_000_000}, coalesce={"window_ms": 0}
    ) as gw:
        records = gw.gateway.layers.idempotency
        gc.collect()
        empty = deep_size(records)
        for n in range(3):
            body = {"model": "e", "input": [f"list {n} item {i}" for i in range(MAX_KEYED_ITEMS)]}
            key = {"Idempotency-Key": f"k{n}-" + "K" * 240}
            assert (await gw.client.post("/v1/embeddings", json=body, headers=key)).is_success
        gc.collect()
        held = deep_size(records) - empty
        assert records.evictions > 0  # (filled past its budget)
        assert records.bytes <= max_bytes
        assert held <= 1.2 * max_bytes, (held, records.bytes, len(records))


async def test_an_invalidation_leaves_the_idempotency_records_so_a_retry_replays_its_first_answer(
    fake, gateway_with
):
    # (docs/deviations.md) Dropping the record would run the request a second time; the cache
    # serves no other client that answer after the invalidation.
    async with gateway_with(admin_token="t") as gw:
        first = await gw.chat("what is new?", headers=KEY)
        dropped = await gw.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": "Bearer t"}
        )
        assert dropped.status_code == 200 and dropped.json()["invalidated"] >= 1
        retry = await gw.chat("what is new?", headers=KEY)
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.content == first.content and fake.count() == 1
        unkeyed = await gw.chat("what is new?")
        assert unkeyed.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_a_keyed_lists_usage_is_the_sum_of_its_items_own_or_missing_as_theirs_was(gw, fake):
    """A keyed list is answered item by item, then merged: the items' usage was summed at its
    top level only, so the engine's ``*_details`` (cached and reasoning tokens) were dropped,
    and items without usage made up a ``"usage": {}`` (no ``x-carpool-usage: missing``); with
    some items without it, a part-sum passed for the whole list's figure."""
    from carpool.request import merge_items

    detailed = {
        "prompt_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    bodies = [{"choices": [{"index": 0}], "usage": detailed} for _ in range(2)]
    assert merge_items("completion", bodies)["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 4},
    }
    # A detail some item lacks (or holds as null) is no list's figure either.
    half = [{"choices": [{"index": 0}], "usage": {**detailed, "prompt_tokens_details": None}}]
    merged = merge_items("completion", bodies[:1] + half)["usage"]
    assert merged["prompt_tokens_details"] is None and merged["prompt_tokens"] == 4
    part = [{"data": [{}], "usage": {"prompt_tokens": 4, "total_tokens": 4}}, {"data": [{}]}]
    assert merge_items("embedding", part).get("usage") is None
    assert "usage" not in merge_items("embedding", [{"data": [{}]}, {"data": [{}]}])
    # From outside: an engine that reports no usage, a keyed list says it is missing.
    fake.embeddings_extra = {"usage": None}
    answer = await gw.client.post(
        "/v1/embeddings", json={"model": "e", "input": ["x", "y"]}, headers=KEY
    )
    assert answer.status_code == 200 and answer.json().get("usage") is None
    assert answer.headers["x-carpool-usage"] == "missing"
    # A stream of it says so once (its SSE form says its own: it was said twice).
    fake.completions_extra = {"usage": None}
    streamed = await gw.client.post(
        "/v1/completions",
        json={"model": "m", "prompt": ["a", "b"], "temperature": 0, "stream": True}
        | {"stream_options": {"include_usage": True}, "max_tokens": 3},
        headers={"Idempotency-Key": "listed-stream"},
    )
    assert streamed.status_code == 200
    assert streamed.headers.get_list("x-carpool-usage") == ["missing"]


async def test_a_keyed_lists_answer_keeps_when_to_retry_and_the_upstreams_no_store(gw, fake):
    """A keyed list is answered item by item: an item's 429 lost the upstream's Retry-After
    (the SDKs then backed off blindly), and an answer the upstream said no cache may store lost
    its ``Cache-Control: no-store``, first and replayed, where a request alone keeps both."""
    retry = [(b"retry-after", b"7"), (b"retry-after-ms", b"7000"), (b"x-should-retry", b"true")]
    body = {"model": "m", "prompt": ["a", "b"], "temperature": 0}
    fake.fail_status, fake.response_headers = 429, retry
    refused = await gw.client.post(
        "/v1/completions", json=body, headers={"Idempotency-Key": "rated"}
    )
    assert refused.status_code == 429
    assert [refused.headers.get(name.decode()) for name, _ in retry] == ["7", "7000", "true"]
    fake.fail_status, fake.response_headers = None, [(b"cache-control", b"no-store")]
    kept = {"Idempotency-Key": "not-stored"}
    first = await gw.client.post("/v1/completions", json=body, headers=kept)
    again = await gw.client.post("/v1/completions", json=body, headers=kept)
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
    assert "no-store" in first.headers["cache-control"]
    assert "no-store" in again.headers["cache-control"]


async def test_an_embeddings_retry_asking_a_stream_is_replayed_as_json(gw, fake):
    """Embeddings have no stream form (``request.parse``: JSON whatever ``stream`` says), so a
    retry with ``"stream": true`` is the same request and replays its JSON (docs/idempotency.md
    once promised a 422 here)."""
    body = {"model": "e", "input": "x"}
    first = await gw.client.post("/v1/embeddings", json=body, headers=KEY)
    retry = await gw.client.post("/v1/embeddings", json={**body, "stream": True}, headers=KEY)
    assert first.status_code == retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.headers["content-type"].startswith("application/json")
    assert retry.json() == first.json() and fake.count("/v1/embeddings") == 1


@pytest.mark.parametrize("http", ["carpool", "httptools"])
@pytest.mark.parametrize(
    "framing", [(b"content-length", b"3"), (b"transfer-encoding", b"chunked")], ids=lambda h: h[0]
)
async def test_a_replay_frames_its_body_once_whatever_headers_its_record_was_given(
    fake, http, framing
):
    """A record keeps only the headers a replay repeats (``records.replayable``), whatever its
    finish is given: a framing header kept went out beside the one the transport writes (two
    ``content-length``, or ``chunked`` over a body that is not), under carpool's protocol and
    through ASGI (uvicorn's own): a client hung or read a body cut short, a proxy desynced."""
    gateway = build_gateway(Config(upstreams=[fake.url]))
    records = gateway.once.records
    finish = records.finish

    async def with_framing(key: str, token: str, response: StoredResponse) -> bool:
        return await finish(key, token, replace(response, headers=[*response.headers, framing]))

    records.finish = with_framing  # type: ignore[method-assign]
    options = {} if http == "carpool" else {"http": "httptools"}
    payload = orjson.dumps(body_of_chat())
    async with serve_app_with_server(create_app(gateway), **options) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            first = await client.post(CHAT, json=body_of_chat(), headers=KEY)
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        try:
            writer.write(
                b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                % CHAT.encode()
                + b'idempotency-key: "order-42"\r\nconnection: close\r\n'
                + b"content-length: %d\r\n\r\n" % len(payload)
                + payload
            )
            wire = await asyncio.wait_for(reader.read(), WAIT_S)  # (to its close)
        finally:
            writer.close()
    head, _, body = wire.partition(b"\r\n\r\n")
    lines = [line.lower() for line in head.split(b"\r\n")[1:]]
    assert b"idempotent-replayed: true" in lines
    assert [line for line in lines if line.startswith((b"content-length:", b"transfer-"))] == [
        b"content-length: %d" % len(body)
    ]
    assert orjson.loads(body) == first.json() and fake.count() == 1
