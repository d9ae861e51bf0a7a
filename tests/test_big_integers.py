"""An integer past 64 bits is the integer it is, in a request and in an answer.

orjson reads an integer literal outside [-2**63, 2**64) as a double, silently rounded
(123456789012345678901234567890 -> 1.2345678901234568e+29); the gateway parses every body it
writes, keys or assembles again with ``carpool.exact_json``, which keeps its digits. Over HTTP,
a real gateway in front of the fake upstream (which reads and writes JSON with the standard
library: integers of any size).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import pytest

from fakes.flights import stream

BIG = 123456789012345678901234567890
ROUNDED = float(BIG)  # 1.2345678901234568e+29, what orjson made of it
CHAT, MESSAGES, EMBEDDINGS = "/v1/chat/completions", "/v1/messages", "/v1/embeddings"


def schema_with(value: Any) -> dict[str, Any]:
    """A chat's structured output whose schema names ``value`` as a constant."""
    schema = {"type": "object", "properties": {"id": {"const": value}}}
    return {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}


def chat(text: str, value: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
        "response_format": schema_with(value),
        **extra,
    }


def tool_history(order_id: Any) -> dict[str, Any]:
    """A Messages conversation in which the model called a tool with ``order_id``."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "cancel", "input": {"order_id": order_id}}
    return {
        "model": "m",
        "max_tokens": 64,
        "temperature": 0,
        "messages": [
            {"role": "user", "content": "Cancel my order"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        ],
    }


def const_of(body: dict[str, Any]) -> Any:
    return body["response_format"]["json_schema"]["schema"]["properties"]["id"]["const"]


# --- what the upstream is asked ----------------------------------------------------------------


async def test_the_upstream_gets_a_big_integer_of_a_chat_schema_as_the_client_wrote_it(gw, fake):
    await gw.client.post(CHAT, json=chat("whole", BIG))
    await stream(gw, CHAT, chat("streamed", -BIG, stream=True))
    assert [c.stream for c in fake.calls] == [False, True]
    assert const_of(fake.calls[0].body) == BIG and type(const_of(fake.calls[0].body)) is int
    assert const_of(fake.calls[1].body) == -BIG


async def test_the_upstream_gets_a_big_integer_of_a_messages_tool_call_as_the_client_wrote_it(
    gw, fake
):
    await gw.client.post(MESSAGES, json=tool_history(BIG))
    assert fake.calls[0].body["messages"][1]["content"][0]["input"] == {"order_id": BIG}


async def test_a_big_integer_temperature_is_forwarded_as_written_for_the_upstream_to_judge(
    gw, fake
):
    # A number all the same (the upstream says what is wrong with it), not refused as a type.
    response = await gw.client.post(
        CHAT,
        json={"model": "m", "temperature": BIG, "messages": [{"role": "user", "content": "a"}]},
    )
    assert response.status_code == 200 and response.headers["x-carpool"] == "bypass"
    assert fake.calls[0].body["temperature"] == BIG


@pytest.mark.parametrize("name", ["seed", "n", "top_k"])
async def test_a_field_that_must_be_an_integer_refuses_a_big_one_with_a_400(gw, fake, name):
    # As it refused the rounded float orjson made of it: the same 400, never a 500.
    response = await gw.client.post(CHAT, json={**chat("a", 1), name: BIG})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"'{name}' must be an integer"
    assert fake.count() == 0


async def test_a_merged_embeddings_call_carries_big_integers_both_ways_as_written(
    gateway_with, fake
):
    # The batcher writes the callers' body again for the merged call, and each caller's answer
    # is written again (an odd vector, to carry one: no usable vector, so each item then goes
    # alone, as the merged answer's split refuses it, and its answer is the engine's own).
    fake.embedding_fn = lambda item: [-BIG, float(len(item))]
    batching = {"max_batch_size": 2, "max_batch_delay_ms": 60_000, "embeddings": "on"}
    async with gateway_with(batching=batching) as gw:
        answers = await asyncio.gather(
            *(
                gw.client.post(EMBEDDINGS, json={"model": "e", "input": text, "tag": BIG})
                for text in ("one", "two")
            )
        )
    assert sorted(fake.calls[0].body["input"]) == ["one", "two"]
    assert sorted(c.body["input"] for c in fake.calls[1:]) == ["one", "two"]
    assert all(c.body["tag"] == BIG for c in fake.calls)
    assert [a.json()["data"][0]["embedding"] for a in answers] == [[-BIG, 3.0], [-BIG, 3.0]]


# --- the key -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "messages"])
async def test_requests_that_differ_only_in_a_big_integer_are_two_requests(gw, fake, kind):
    path, body = (CHAT, chat) if kind == "chat" else (MESSAGES, None)
    for value in (BIG, BIG + 1):
        sent = chat("a", value) if body else tool_history(value)
        response = await gw.client.post(path, json=sent)
        assert response.headers["x-carpool"] == "miss"  # not the other one's answer
    assert fake.count() == 2


@pytest.mark.parametrize("where", ["schema", "parameter"])
async def test_a_big_integer_and_the_float_it_rounds_to_are_two_requests(gw, fake, where):
    # An ordered field (a schema) keys a number as written, any other field by its value: the
    # float is another number than the integer either way.
    for value in (BIG, ROUNDED):
        sent = chat("a", value) if where == "schema" else {**chat("a", 1), "extra": value}
        response = await gw.client.post(CHAT, json=sent)
        assert response.headers["x-carpool"] == "miss"
    assert fake.count() == 2


# --- the answer --------------------------------------------------------------------------------

TOOL_CALL = {"type": "tool_use", "id": "toolu_9", "name": "cancel", "input": {"order_id": BIG}}
ASK = {
    "model": "m",
    "max_tokens": 64,
    "extra_body": {"temperature": 0},
    "messages": [{"role": "user", "content": "Cancel order 9"}],
}


async def test_a_cached_message_with_a_big_integer_in_a_tool_call_streams_it_as_written(gw, fake):
    fake.message_content = [TOOL_CALL]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as client:
        whole = await client.messages.create(**ASK)
        async with client.messages.stream(**ASK) as events:
            final = await events.get_final_message()  # synthesized from the cached JSON
    assert whole.content[0].input == {"order_id": BIG}
    assert final.model_dump() == whole.model_dump()
    assert fake.count() == 1


async def test_a_streamed_message_with_a_big_integer_in_a_tool_call_is_served_whole_as_written(
    gw, fake
):
    fake.message_content = [TOOL_CALL]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as client:
        async with client.messages.stream(**ASK) as events:
            streamed = await events.get_final_message()  # the SDK's own accumulation
        hit = await client.messages.with_raw_response.create(**ASK)  # assembled by the gateway
    assert hit.headers["x-carpool"] == "hit" and fake.calls[0].stream
    assert streamed.content[0].input == {"order_id": BIG}
    assert (await hit.parse()).model_dump() == streamed.model_dump()


def traced(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Messages stream whose message carries a big integer of its own, outside any text."""
    events[0]["message"]["trace"] = BIG
    return events


@pytest.mark.parametrize("replay", ["hit", "idempotent"])
async def test_a_big_integer_in_a_stream_event_is_in_the_whole_answer_made_of_it(gw, fake, replay):
    # A cached stream's answer is assembled from its events as they came; an idempotency
    # record's from the stream it kept (asked sampled: only the key dedupes it).
    fake.message_events, fake.message_content = traced, [TOOL_CALL]
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Cancel"}]}
    headers = {"Idempotency-Key": '"big"'} if replay == "idempotent" else {}
    if replay == "hit":
        body["temperature"] = 0
    async with gw.client.stream(
        "POST", MESSAGES, json={**body, "stream": True}, headers=headers
    ) as response:
        await response.aread()
    whole = await gw.client.post(MESSAGES, json=body, headers=headers)
    if replay == "hit":
        assert whole.headers["x-carpool"] == "hit"
    else:
        assert whole.headers["idempotent-replayed"] == "true"
    assert whole.json()["trace"] == BIG
    assert whole.json()["content"][0]["input"] == {"order_id": BIG}
    assert fake.count() == 1


async def test_a_big_integer_and_a_float_of_its_very_value_are_one_request_outside_a_schema(
    gw, fake
):
    # Outside the ordered fields a number is keyed by its value, as 0 and 0.0 are one: 2**70 is
    # a double exactly.
    for value in (2**70, float(2**70)):
        await gw.client.post(CHAT, json={**chat("a", 1), "extra": value})
    assert fake.count() == 1
