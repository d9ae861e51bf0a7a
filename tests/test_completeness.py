"""Only complete answers are stored (issue 13, CONTRACT.md "Streaming").

An answer is complete when the upstream's stream ended with ``data: [DONE]`` and every choice the
request asked for (``n`` per prompt, whatever ``best_of``) is there with a finish reason. A
broken stream (no [DONE], or a choice in it that never finished) reaches every client of its
flight as an error (streaming clients: an SSE error event, then the end of the stream; the
others: a 502 in OpenAI's error shape) and is not stored, so the next identical request is a
fresh upstream call. A whole stream or body with fewer choices than asked for is the upstream's
own answer: its clients get it as it came, and it is not stored either. So is a body whose
choices are not of the shape a stream is made of (a message that is no object...): a streaming
client gets its stream's failure. A stream with a chunk the assembly cannot read fails as the
upstream's fault.

Joiners get into a flight through the fake's ``chunk_gate`` (the upstream pauses mid-stream until
every client is in), never by sleeping.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from carpool.apis import api_of
from carpool.errors import UpstreamStreamBroken
from carpool.exchange import _pipe
from carpool.sse import expected_choices, is_complete, well_formed
from carpool.upstream.base import UpstreamResponse
from conftest import run_gateway
from fakes.flights import leader_and_joiners, stream
from fakes.raw_upstream import answer, chat_completion, raw_upstream

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
STREAMED = {"upstream": {"stream_flights": True}}


def chat_body(content: str = "What is carpool?", **extra) -> dict:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def data_lines(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


def assert_failed_stream(response: httpx.Response, raw: str) -> None:
    """A stream that ended with an SSE error event (the last event), and no [DONE]."""
    assert response.status_code == 200
    events = data_lines(raw)
    assert "[DONE]" not in events, raw[-300:]
    assert set(json.loads(events[-1])) == {"error"}, raw[-300:]


# What judging an answer may allocate at most, whatever the request asked for. A check sized by
# the ``n`` asked allocates tens of MB for the million choices the tests ask (and, for the 2**62
# a client can ask, never ends): a million is as far as a test may go on code that does so.
JUDGING_BYTES = 4 * 2**20
MANY = 10**6


async def peak_bytes(work: Callable[[], Awaitable[Any]]) -> tuple[Any, int]:
    """``work``'s result and the most memory allocated (Python's heap) while it ran."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        result = await work()
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        if not tracing:
            tracemalloc.stop()


def assert_openai_error(response: httpx.Response, status: int = 502) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and "type" in error and "code" in error


async def assert_fresh_call_next(served, fake, path: str, body: dict, calls: int) -> None:
    """Nothing was stored: the same request, upstream healthy again, is a new upstream call."""
    assert served.gateway.store.entries == 0
    fake.omit_done, fake.drop_choices, fake.unfinished_choices = False, set(), set()
    again = await served.client.post(path, json=body)
    assert again.status_code == 200 and again.headers["x-carpool"] == "miss"
    assert fake.count() == calls + 1


# --- streams -----------------------------------------------------------------------------------


async def test_a_stream_without_done_is_not_stored_and_every_client_gets_an_error(gw, fake):
    fake.omit_done = True  # every choice finished, but the stream just stopped
    body = chat_body()
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(gw, fake, CHAT, body)
    assert leader.headers["x-carpool"] == "miss"
    assert_failed_stream(leader, raw)
    assert '"finish_reason":"stop"' in raw  # the finish came; the [DONE] did not
    assert joiner.headers["x-carpool"] == "coalesced"
    assert_failed_stream(joiner, joined)
    assert plain.headers["x-carpool"] == "coalesced"
    assert_openai_error(plain)
    assert fake.count() == 1
    await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


async def test_a_stream_with_fewer_finished_choices_than_n_is_not_stored(gw, fake):
    fake.unfinished_choices = {2}  # choices 0 and 1 finish; choice 2 never does
    body = chat_body(n=3)
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(gw, fake, CHAT, body)
    assert_failed_stream(leader, raw)
    assert_failed_stream(joiner, joined)
    assert_openai_error(plain)
    await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


async def test_a_stream_where_a_choice_never_appears_is_served_as_it_came_but_not_stored(gw, fake):
    # The stream ended with [DONE], every choice in it finished: the engine answered fewer
    # than asked (as one that ignores ``n``). Every client gets what the upstream sent, as
    # without the gateway; it is never stored nor kept joinable.
    fake.drop_choices = {2}  # n: 3, and the upstream sent choices 0 and 1 only
    body = chat_body(n=3)
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(gw, fake, CHAT, body)
    assert '"index":2' not in raw and '"finish_reason":"stop"' in raw
    assert data_lines(raw)[-1] == "[DONE]" and joined == raw
    assert plain.status_code == 200 and [c["index"] for c in plain.json()["choices"]] == [0, 1]
    await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


async def test_a_complete_stream_with_n_choices_is_stored_and_replayed(gw, fake):
    body = chat_body(n=3)
    first, raw = await stream(gw, CHAT, body)
    assert data_lines(raw)[-1] == "[DONE]"
    hit = await gw.client.post(CHAT, json=body)
    assert hit.headers["x-carpool"] == "hit" and fake.count() == 1
    assert [c["index"] for c in hit.json()["choices"]] == [0, 1, 2]


async def test_a_completions_stream_needs_n_choices_for_each_prompt_of_a_list(gw, fake):
    body = {"model": "m", "temperature": 0, "prompt": ["one", "two"], "n": 2}
    fake.drop_choices = {3}  # the second prompt's second choice never came
    response, raw = await stream(gw, COMPLETIONS, body)
    assert response.status_code == 200 and data_lines(raw)[-1] == "[DONE]"  # served, not stored
    await assert_fresh_call_next(gw, fake, COMPLETIONS, body, calls=1)
    whole, raw = await stream(gw, COMPLETIONS, {**body, "prompt": ["three", "four"]})
    assert data_lines(raw)[-1] == "[DONE]"  # all four: complete, stored
    again = await gw.client.post(COMPLETIONS, json={**body, "prompt": ["three", "four"]})
    assert again.headers["x-carpool"] == "hit"


async def test_a_bypassed_stream_without_done_ends_with_an_error_event(gw, fake):
    fake.omit_done = True
    response, raw = await stream(gw, CHAT, chat_body(temperature=1))
    assert response.headers["x-carpool"] == "bypass"
    assert_failed_stream(response, raw)


def sse_of(*chunks: dict) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
MALFORMED_CHOICES = {
    "list-index": {"index": [0], "delta": {"content": "x"}, "finish_reason": None},
    "int-tool_calls": {"index": 0, "delta": {"tool_calls": 5}, "finish_reason": None},
    "string-function": {
        "index": 0,
        "delta": {"tool_calls": [{"index": 0, "function": "f"}]},
        "finish_reason": None,
    },
    "string-function_call": {"index": 0, "delta": {"function_call": "f"}, "finish_reason": None},
    "dict-tool-index": {
        "index": 0,
        "delta": {"tool_calls": [{"index": {"a": 1}, "function": {"name": "f"}}]},
        "finish_reason": None,
    },
}


def malformed_stream(name: str) -> bytes:
    """A whole chat stream, [DONE] and all, with one chunk of an odd shape in its middle."""
    return sse_of(
        {**CHUNK, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
        {**CHUNK, "choices": [MALFORMED_CHOICES[name]]},
        {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )


@pytest.mark.parametrize("name", list(MALFORMED_CHOICES))
async def test_a_malformed_chunk_fails_the_stream_as_the_upstreams_fault(name, caplog):
    """The assembly raised on it (a TypeError...): the clients were told of a failure, but the
    gateway logged its own ("failed unexpectedly", a traceback, at ERROR), not the upstream's."""
    sent = answer(200, b"OK", malformed_stream(name), content_type=b"text/event-stream")
    async with raw_upstream(lambda call: sent) as up:
        async with run_gateway([up.url], **STREAMED) as served:
            streamed, raw = await stream(served, CHAT, chat_body("odd?"))
            assert streamed.headers["x-carpool"] == "miss"
            assert_failed_stream(streamed, raw)
            assert "the upstream sent a malformed stream chunk" in raw
            plain = await served.client.post(CHAT, json=chat_body("odd?"))  # (streamed too)
            assert_openai_error(plain)
            assert plain.json()["error"]["message"] == "the upstream sent a malformed stream chunk"
            assert served.gateway.store.entries == 0 and len(up.calls) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_recorded_bypassed_stream_with_a_malformed_chunk_is_relayed_as_it_came(caplog):
    # An idempotency record judges the stream it keeps (``idempotency.final``): its assembly
    # raised, which cut the client's stream mid-way (the connection dropped) after a traceback.
    sent = answer(200, b"OK", malformed_stream("int-tool_calls"), content_type=b"text/event-stream")
    async with raw_upstream(lambda call: sent) as up:
        async with run_gateway([up.url]) as served:
            key = {"Idempotency-Key": '"odd-1"'}
            async with served.client.stream(
                "POST", CHAT, json=chat_body("odd?", temperature=1, stream=True), headers=key
            ) as response:
                raw = (await response.aread()).decode()
            assert response.headers["x-carpool"] == "bypass"
            assert raw.encode() == malformed_stream("int-tool_calls")  # as it came, whole
            assert len(up.calls) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# --- non-streaming leaders ---------------------------------------------------------------------


async def test_a_non_streaming_leader_of_a_streamed_call_without_done_gets_a_502(
    gateway_with, fake
):
    async with gateway_with(**STREAMED) as gw:
        fake.omit_done = True
        body = chat_body()
        leader, (joiner, joined), plain = await leader_and_joiners(
            gw, fake, CHAT, body, leader_streams=False
        )
        assert fake.calls[0].body["stream"] is True  # streamed for the others
        assert leader.headers["x-carpool"] == "miss"
        assert_openai_error(leader)
        assert_failed_stream(joiner, joined)
        assert_openai_error(plain)
        await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


async def test_a_non_streaming_leader_of_a_streamed_call_missing_a_choice_gets_a_502(
    gateway_with, fake
):
    async with gateway_with(**STREAMED) as gw:
        fake.unfinished_choices = {1}
        body = chat_body(n=2)
        leader, (joiner, joined), plain = await leader_and_joiners(
            gw, fake, CHAT, body, leader_streams=False
        )
        assert_openai_error(leader)
        assert_failed_stream(joiner, joined)
        assert_openai_error(plain)
        await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


async def test_a_body_with_fewer_choices_than_n_is_served_as_it_came_but_not_stored(gw, fake):
    # Not a broken transfer: the upstream's whole 2xx answer. Its client gets it unchanged (as
    # without the gateway), but it is never stored nor kept joinable.
    fake.drop_choices = {1}
    body = chat_body(n=2)
    first = await gw.client.post(CHAT, json=body)
    assert first.status_code == 200 and first.headers["x-carpool"] == "miss"
    assert [c["index"] for c in first.json()["choices"]] == [0]
    await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


async def test_a_client_asking_for_more_choices_than_the_engine_gives_costs_only_what_came():
    """An engine that ignores ``n`` (Ollama) answers one choice to a request for any number: the
    client gets it as it came, and it is not stored; judging it costs the one choice, never
    the ``n`` asked (a request with ``n`` 2**62 once froze the gateway's event loop: it built
    the set of every index asked for, until memory ran out)."""
    async with raw_upstream(lambda call: answer(200, b"OK", chat_completion("fine"))) as up:
        async with run_gateway([up.url]) as served:
            warm = await served.client.post(CHAT, json=chat_body())  # (one asked: stored)
            assert warm.headers["x-carpool"] == "miss" and served.gateway.store.entries == 1
            many, peak = await peak_bytes(lambda: served.client.post(CHAT, json=chat_body(n=MANY)))
            assert many.status_code == 200 and many.headers["x-carpool"] == "miss"
            assert [choice["index"] for choice in many.json()["choices"]] == [0]
            assert peak < JUDGING_BYTES, peak
            # (Past the bound above only: on code sized by ``n`` this would never end.)
            huge = await served.client.post(CHAT, json=chat_body(n=2**62))
            assert huge.status_code == 200 and huge.headers["x-carpool"] == "miss"
            assert [choice["index"] for choice in huge.json()["choices"]] == [0]
            again = await served.client.post(CHAT, json=chat_body(n=2**62))
            assert again.headers["x-carpool"] == "miss"
            assert served.gateway.store.entries == 1 and len(up.calls) == 4
            assert (await served.client.get("/healthz")).status_code == 200


@pytest.mark.parametrize("error", [{"message": "partial failure"}, "partial failure"])
async def test_a_body_with_finished_choices_and_a_top_level_error_is_served_as_it_came_but_not_stored(
    gw, fake, error
):
    """Judged by its choices alone it was stored and served as a hit, while the same error in
    a stream's chunk fails the flight: an answer reporting an error is not complete."""
    fake.chat_extra = {"error": error}
    body = chat_body("partly failed?")
    first = await gw.client.post(CHAT, json=body)
    assert first.status_code == 200 and first.headers["x-carpool"] == "miss"
    assert first.json()["error"] == error and first.json()["choices"]
    await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


def odd_body(kind: str, choice: object) -> dict:
    """A 2xx answer of ``kind`` whose one choice is ``choice``: finished, but of an odd shape."""
    return {
        "id": "odd",
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


FINISHED = {"logprobs": None, "finish_reason": "stop"}


def odd_message(**message: object) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": None, **message}, **FINISHED}


MALFORMED = {
    "null-choice": ("chat", None),
    "string-message": ("chat", {"index": 0, "message": "hi", **FINISHED}),
    "tool_calls-object": ("chat", odd_message(tool_calls={"id": "t"})),
    "tool_calls-with-null": ("chat", odd_message(tool_calls=[None])),
    "function_call-string": ("chat", odd_message(function_call="f")),
    "completion-text-number": ("completion", {"index": 0, "text": 5, **FINISHED}),
}


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_a_malformed_but_finished_answer_never_crashes_a_streaming_client(name):
    """Judged by its finish reasons alone it was stored, and every streaming hit of it was a
    500 (no stream is made of it); not stored, its streaming clients were 500s too. Now it is
    not complete (never stored): a JSON client gets it as it came, a streaming one its
    stream's failure, an error event that says so."""
    kind, choice = MALFORMED[name]
    body = odd_body(kind, choice)
    path = CHAT if kind == "chat" else COMPLETIONS
    request = chat_body("odd?") if kind == "chat" else {"model": "m", "prompt": "odd?"}
    request["temperature"] = 0
    async with raw_upstream(lambda call: answer(200, b"OK", json.dumps(body).encode())) as up:
        async with run_gateway([up.url]) as served:
            streamed, raw = await stream(served, path, request)
            assert streamed.headers["x-carpool"] == "miss"
            assert_failed_stream(streamed, raw)
            assert "malformed choices" in raw
            plain = await served.client.post(path, json=request)
            assert plain.status_code == 200 and plain.json() == body  # as it came
            again, raw = await stream(served, path, request)
            assert again.headers["x-carpool"] == "miss"  # never stored
            assert_failed_stream(again, raw)
            assert served.gateway.store.entries == 0 and len(up.calls) == 3


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_answer_is_not_complete_and_a_stream_is_still_made_of_it(name):
    # Not complete, so never stored now; but one stored before it was judged so is still
    # served to streaming clients: a stream is made of its well-formed parts, never a raise.
    kind, choice = MALFORMED[name]
    body = odd_body(kind, choice)
    assert not is_complete(kind, body) and not well_formed(kind, body)
    assert b'"usage"' in api_of(kind).synthesize(body, include_usage=True)[-1]


async def test_a_body_whose_error_field_is_null_is_complete_and_stored(gw, fake):
    """Some servers write every field, ``"error": null`` too: no failure (as in a stream)."""
    fake.chat_extra = {"error": None}
    first = await gw.client.post(CHAT, json=chat_body("all well?"))
    again = await gw.client.post(CHAT, json=chat_body("all well?"))
    assert again.headers["x-carpool"] == "hit" and again.json() == first.json()
    assert fake.count() == 1


async def test_a_stream_with_fewer_choices_than_n_that_ended_whole_is_served_as_it_came_but_not_stored(
    gw, fake
):
    # An engine that ignores ``n`` (Ollama's OpenAI layer) streams one choice and [DONE]. Its
    # client got the choice, then an error event instead of [DONE] (the SDK raised), though
    # the same answer as a whole body was served.
    fake.drop_choices = {1}
    body = {**chat_body(n=2), "stream": True}
    first = await gw.client.post(CHAT, json=body)
    assert first.status_code == 200 and first.headers["x-carpool"] == "miss"
    assert first.text.endswith("data: [DONE]\n\n") and '"error"' not in first.text
    await assert_fresh_call_next(gw, fake, CHAT, body, calls=1)


async def test_best_of_does_not_change_the_number_of_choices_a_complete_answer_has(gw, fake):
    body = {"model": "m", "temperature": 0, "prompt": "pick", "best_of": 3}
    first = await gw.client.post(COMPLETIONS, json=body)
    assert len(first.json()["choices"]) == 1
    again = await gw.client.post(COMPLETIONS, json=body)
    assert again.headers["x-carpool"] == "hit" and fake.count() == 1


# --- the embedded simulator --------------------------------------------------------------------


async def test_the_embedded_simulators_streams_are_complete_and_stored():
    from carpool import Config, Outcome, build_gateway

    gateway = build_gateway(Config())
    try:
        body = {**chat_body("sim", n=2), "stream": True}
        first = await gateway.request(CHAT, body)
        assert first.outcome is Outcome.MISS and first.body.endswith(b"data: [DONE]\n\n")
        again = await gateway.request(CHAT, {**body, "stream": False})
        assert again.outcome is Outcome.HIT and len(again.json()["choices"]) == 2
    finally:
        await gateway.aclose()


# --- the rules, unit by unit -------------------------------------------------------------------

DONE_CHOICE = {
    "index": 0,
    "message": {"role": "assistant", "content": "x"},
    "finish_reason": "stop",
}
EMBEDDED = {"data": [{"index": 0, "embedding": [0.5, 0.5]}]}


def test_every_choice_asked_for_must_be_there_and_finished():
    two = {"choices": [DONE_CHOICE, {**DONE_CHOICE, "index": 1}]}
    assert is_complete("chat", two, 2) and is_complete("chat", two, 1)
    assert not is_complete("chat", two, 3)
    assert not is_complete("chat", {"choices": [DONE_CHOICE, DONE_CHOICE]}, 2)  # index 1 missing
    assert not is_complete(
        "chat", {"choices": [DONE_CHOICE, {"index": 1, "finish_reason": "abort"}]}, 2
    )
    # Without an index, a choice counts at its position.
    assert is_complete("completion", {"choices": [{"text": "x", "finish_reason": "stop"}] * 2}, 2)


def test_a_well_formed_choice_the_engine_gave_up_on_is_not_complete():
    # vLLM's "abort", an "error": the choice is whole in shape (a message, a text), but it
    # ended in failure, and is never stored as an answer.
    for failed in ("abort", "error"):
        assert not is_complete("chat", {"choices": [{**DONE_CHOICE, "finish_reason": failed}]})
        done = {"index": 0, "text": "x", "finish_reason": failed}
        assert not is_complete("completion", {"choices": [done]})
    assert is_complete(
        "completion", {"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}
    )


def test_the_choices_asked_for_are_indexes_0_to_n_not_just_n_of_them():
    # Two choices came, but choice 0 never did: not the answer to n=2.
    shifted = {"choices": [{**DONE_CHOICE, "index": 1}, {**DONE_CHOICE, "index": 2}]}
    assert not is_complete("chat", shifted, 2)
    assert is_complete("chat", shifted, None)


async def test_judging_an_answer_costs_what_came_never_the_choices_asked_for():
    one = {"choices": [DONE_CHOICE]}
    two_prompts = {"choices": [{"index": i, "text": "x", "finish_reason": "stop"} for i in (0, 1)]}
    embedded = {"data": [{"index": 0, "embedding": [0.5]}]}

    async def judge() -> list[bool]:
        return [
            is_complete("chat", one, MANY),
            api_of("chat").complete(one, {"n": MANY}),
            api_of("completion").complete(two_prompts, {"prompt": ["a", "b"], "n": MANY}),
            is_complete("embedding", embedded, MANY),
        ]

    verdicts, peak = await peak_bytes(judge)
    assert verdicts == [False] * 4
    assert peak < JUDGING_BYTES, peak
    # (Past the bound above only: on code sized by what was asked this would never end.)
    assert not is_complete("chat", one, 2**62)
    assert not is_complete(
        "completion",
        two_prompts,
        expected_choices("completion", {"prompt": ["a", "b"], "n": 2**62}),
    )
    assert not is_complete("embedding", embedded, 2**62)
    # What came is still judged as before: every index asked for, once at least.
    assert is_complete("completion", two_prompts, 2)
    assert not is_complete("chat", {"choices": [DONE_CHOICE, DONE_CHOICE]}, 2)


def test_an_answer_reporting_an_error_at_its_top_is_not_complete_a_null_error_is():
    for kind, answered in (("chat", {"choices": [DONE_CHOICE]}), ("embedding", EMBEDDED)):
        assert is_complete(kind, {**answered, "error": None})
        assert not is_complete(kind, {**answered, "error": {"message": "m"}})
        assert not is_complete(kind, {**answered, "error": "m"})
        for said in ({}, "", False, 0, []):  # (an error, however empty: only null is none)
            assert not is_complete(kind, {**answered, "error": said}), said
        assert api_of(kind).complete({**answered, "error": None})
        assert not api_of(kind).complete({**answered, "error": {"message": "m"}})


def test_the_choices_expected_are_n_per_prompt_whatever_best_of():
    assert expected_choices("chat", {"messages": []}) == 1
    assert expected_choices("chat", {"n": 3}) == 3
    assert expected_choices("completion", {"prompt": "x", "n": 2, "best_of": 5}) == 2
    assert expected_choices("completion", {"prompt": ["a", "b", "c"], "n": 2}) == 6
    assert expected_choices("completion", {"prompt": [[1, 2], [3]]}) == 2
    assert expected_choices("completion", {"prompt": [1, 2, 3]}) == 1  # one token prompt
    assert expected_choices("chat", {"n": 0}) is None
    assert expected_choices("responses", {"input": "a"}) is None


def test_the_vectors_expected_are_one_per_embeddings_input():
    assert expected_choices("embedding", {"input": "a"}) == 1
    assert expected_choices("embedding", {"input": [1, 2, 3]}) == 1  # one token list
    assert expected_choices("embedding", {"input": ["a", "b", "c"]}) == 3
    assert expected_choices("embedding", {"input": [[1, 2], [3]]}) == 2
    assert expected_choices("embedding", {"input": []}) is None
    assert expected_choices("embedding", {"input": None}) is None
    # (Items that are neither texts nor token lists: no count, as the contract says.)
    assert expected_choices("embedding", {"input": [{"a": 1}]}) is None
    assert expected_choices("embedding", {"input": [1.5, 2.5]}) is None


def test_an_embeddings_answer_needs_one_vector_per_input_at_indexes_0_to_n():
    row = {"object": "embedding", "embedding": [0.5]}
    three = {"data": [{**row, "index": i} for i in (2, 0, 1)]}  # (any order)
    assert is_complete("embedding", three, 3) and is_complete("embedding", three)
    assert not is_complete("embedding", three, 4)  # one input's vector missing
    assert not is_complete("embedding", three, 2)  # one more than asked
    assert not is_complete("embedding", {"data": [{**row, "index": i} for i in (0, 0, 1)]}, 3)
    assert not is_complete("embedding", {"data": [{**row, "index": i} for i in (0, 2)]})
    # Without an index, an item counts at its position.
    assert is_complete("embedding", {"data": [row, row]}, 2)
    assert not is_complete("embedding", {"data": [{**row, "index": "0"}]}, 1)
    assert api_of("embedding").complete(three, {"input": ["a", "b", "c"]})
    assert not api_of("embedding").complete(three, {"input": ["a", "b", "c", "d"]})


async def test_an_upstream_error_event_ends_a_bypassed_stream_without_a_second_one():
    async def events() -> AsyncIterator[list[bytes]]:
        yield [b'{"choices":[{"index":0,"delta":{"content":"hi"}}]}']
        yield [b'{"error":{"message":"engine died"}}']
        raise UpstreamStreamBroken("ended without [DONE]")

    frames = [f async for f in _pipe(api_of("chat"), UpstreamResponse(200, events=events()))]
    assert len(frames) == 2 and b"engine died" in frames[1]


async def test_an_upstream_error_event_read_with_frames_before_it_ends_a_bypassed_stream_after_them():
    async def events() -> AsyncIterator[list[bytes]]:
        yield [
            b'{"choices":[{"index":0,"delta":{"content":"hi"}}]}',
            b'{"error":{"message":"engine died"}}',
            b'{"choices":[{"index":0,"delta":{"content":"never"}}]}',
        ]
        raise UpstreamStreamBroken("ended without [DONE]")

    frames = [f async for f in _pipe(api_of("chat"), UpstreamResponse(200, events=events()))]
    assert len(frames) == 1
    assert frames[0].startswith(b'data: {"choices"') and b"engine died" in frames[0]
    assert b"never" not in frames[0]


async def test_an_http_stream_that_stops_without_done_raises_after_what_came(fake):
    """``HttpUpstream``: a body that ends cleanly without [DONE] is a broken stream."""
    from carpool.config import LimitsConfig
    from carpool.upstream.base import UpstreamRequest
    from carpool.upstream.http import HttpUpstream

    fake.omit_done = True
    upstream = HttpUpstream(fake.url, LimitsConfig())
    body = chat_body("a b", stream=True)
    try:
        response = await upstream.send(UpstreamRequest("/chat/completions", body, stream=True))
        got = []
        with pytest.raises(UpstreamStreamBroken, match="without \\[DONE\\]"):
            async for payloads in response.events():
                got += [json.loads(payload) for payload in payloads]
        await response.aclose()
        assert got[-1]["choices"][0]["finish_reason"] == "stop"  # everything but the [DONE]
        fake.omit_done = False
        response = await upstream.send(UpstreamRequest("/chat/completions", body, stream=True))
        assert len([p async for payloads in response.events() for p in payloads]) == len(got)
        await response.aclose()
    finally:
        await upstream.aclose()


def _base64(*values: float) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


@pytest.mark.parametrize(
    "vectors",
    [
        [[]],
        [[0.5], [0.5, 0.5]],
        [["a", None]],
        [[[0.5]]],
        [_base64(math.nan, 0.5)],
        [_base64(0.5, -math.inf)],
        [[1e308, 1e308, math.nan]],  # (its sum past the largest float: each looked at)
        [""],
        ["@@@@"],
        ["AAA="],  # 2 bytes: no float32
        [_base64(0.5), [0.5]],
        [[0.5], _base64(0.5)],
    ],
    ids=repr,
)
def test_an_embeddings_answer_with_a_vector_no_sound_engine_sends_is_not_complete(vectors):
    body = {"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}
    assert not is_complete("embedding", body, len(vectors))


@pytest.mark.parametrize(
    "vectors",
    [
        [[0.5, -1, 0]],
        [[0.5], [2.0]],
        [_base64(0.5, 1e-30)],
        [_base64(1.0)] * 3,
        # Finite numbers whose sum is past the largest float: refused, a merged batch was
        # sent again item by item.
        [[1e308, 1e308, 0.5]],
    ],
)
def test_an_embeddings_answer_of_sound_vectors_is_complete(vectors):
    body = {"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}
    assert is_complete("embedding", body, len(vectors))
