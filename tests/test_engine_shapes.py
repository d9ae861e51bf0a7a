"""What clients get through carpool is what the engine gives them directly (issue 15, items 2-4).

The fake upstream imitates llama-cpp-python's server where it differs from OpenAI
(``tests/fakes/upstream.py``: ``tool_call_style = "llama.cpp"``, ``ignore_include_usage``,
``empty_stream``, ``broken_list_embeddings``), and each rule is checked against the engine's own
answer, asked directly:

- an answer assembled from a stream is the engine's non-streaming answer (tool calls whose name
  the engine repeats in every chunk included), for the client that led the call, the clients
  that joined it and every later hit;
- where the engine reports no usage on a stream, the answers built from it say so
  (``x-carpool-usage: missing``) and ``tokens_saved`` counts only what the engine reported;
  where the gateway did not ask for it (``upstream.stream_usage: false``), no client whose own
  request would have had it gets that answer, then or later;
- a stream that fails before its first chunk is one engine call per client call, with the
  official ``openai`` SDK's retries on; an error the engine reported keeps its status and
  message;
- single embeddings are merged into list calls only once a probe has shown that the engine
  answers lists item by item (for the credentials and headers it was probed with: a router may
  send another key to another engine); an engine that does not never has its list answers
  served.

Joiners get into a flight through the fake's ``chunk_gate`` (the upstream pauses mid-stream until
every client is in), never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from carpool.batching import PROBE_INPUTS
from carpool.broadcast import Broadcast
from carpool.errors import UpstreamStreamBroken, error_event
from carpool.exchange import _consume
from carpool.upstream.base import UpstreamResponse
from fakes.flights import flight_clients, leader_and_joiners, stream
from fakes.upstream import token_id
from fakes.waiting import eventually

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = ("get_weather", '{"city": "Paris", "unit": "celsius"}')


def tool_body(content: str = "Weather in Paris?") -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }


async def direct(fake, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's own non-streaming answer, asked without the gateway."""
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as client:
        response = await client.post(path.removeprefix("/v1"), json=body)
        assert response.status_code == 200, response.text
        return response.json()


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The body with what differs from one engine call to the next (ids) taken out."""
    body = json.loads(json.dumps(body))
    body.pop("id", None)
    for choice in body.get("choices", []):
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return body


def events(raw: str) -> list[Any]:
    return [
        json.loads(line[6:])
        for line in raw.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def stats(served) -> dict[str, Any]:
    return (await served.client.get("/stats")).json()


# --- 2. assembly that matches the engine --------------------------------------------------------


@pytest.mark.parametrize("style", ["openai", "llama.cpp"])
async def test_a_streamed_tool_call_is_served_as_the_engines_own_non_streaming_answer(
    gw, fake, style
):
    fake.tool_call, fake.tool_call_style = CALL, style
    body = tool_body()
    engine = await direct(fake, CHAT, body)
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(gw, fake, CHAT, body)
    assert fake.count() == 2  # the direct call, then one
    assert leader.headers["x-carpool"] == "miss" and joiner.headers["x-carpool"] == "coalesced"
    assert events(joined) == events(raw)  # the engine's own frames
    if style == "llama.cpp":  # ...the name in every chunk
        assert (
            sum('"name":"get_weather"' in json.dumps(e, separators=(",", ":")) for e in events(raw))
            > 2
        )
    assert plain.headers["x-carpool"] == "coalesced"
    assert without_ids(plain.json()) == without_ids(engine)
    message = plain.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == {"name": CALL[0], "arguments": CALL[1]}
    hit = await gw.client.post(CHAT, json=body)
    assert hit.headers["x-carpool"] == "hit" and hit.json() == plain.json()
    assert fake.count() == 2


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, {"messages": [{"role": "user", "content": "Say hello to the world"}]}),
        ("/v1/completions", {"prompt": ["Say hello", "Say goodbye"], "n": 2}),
    ],
    ids=["chat", "completions"],
)
async def test_a_streamed_answers_token_ids_assemble_whole_as_the_engines_own_answer(
    gw, fake, path, body
):
    # vLLM's return_token_ids: each chunk's choice carries the ids of its new tokens (and the
    # prompt's once); its whole answer carries them all, which the assembled answer must too.
    body = {"model": "m", "temperature": 0, "return_token_ids": True, **body}
    fake.answer_text = lambda n, body: "Hello to the whole world"  # (the same for each call)
    engine = await direct(fake, path, body)
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(gw, fake, path, body)
    assert leader.headers["x-carpool"] == "miss" and plain.headers["x-carpool"] == "coalesced"
    assert sum("token_ids" in json.dumps(e) for e in events(raw)) > 3  # ...chunk by chunk
    assert without_ids(plain.json()) == without_ids(engine)
    hit = await gw.client.post(path, json=body)
    assert hit.headers["x-carpool"] == "hit" and hit.json() == plain.json()
    for choice in hit.json()["choices"]:
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        assert choice["token_ids"] == [token_id(word) for word in text.split()]
    assert fake.count() == 2  # the direct call, then one


async def test_an_engine_that_ignores_include_usage_gives_answers_that_say_usage_is_missing(
    gw, fake
):
    fake.tool_call, fake.tool_call_style, fake.ignore_include_usage = CALL, "llama.cpp", True
    body = tool_body()
    engine = await direct(fake, CHAT, body)
    assert "usage" in engine  # its non-streaming answer has it
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(gw, fake, CHAT, body)
    assert not any("usage" in e and e["usage"] for e in events(raw))
    assert plain.headers["x-carpool-usage"] == "missing" and "usage" not in plain.json()
    engine.pop("usage")
    assert without_ids(plain.json()) == without_ids(engine)  # nothing else differs
    hit = await gw.client.post(CHAT, json=body)
    assert hit.headers["x-carpool-usage"] == "missing" and "usage" not in hit.json()
    with_usage, raw = await stream(gw, CHAT, {**body, "stream_options": {"include_usage": True}})
    assert with_usage.headers["x-carpool"] == "hit"
    assert with_usage.headers["x-carpool-usage"] == "missing"
    without, _ = await stream(gw, CHAT, body)  # it did not ask for usage
    assert "x-carpool-usage" not in without.headers


async def test_answers_with_the_engines_usage_carry_no_usage_header(gw, fake):
    (leader, _), (joiner, _), plain = await leader_and_joiners(gw, fake, CHAT, tool_body("usage"))
    assert "usage" in plain.json() and "x-carpool-usage" not in plain.headers
    hit = await gw.client.post(CHAT, json=tool_body("usage"))
    assert "x-carpool-usage" not in hit.headers


async def test_tokens_saved_counts_only_what_the_engine_reported(gw, fake):
    # Reported: the streaming joiner, the non-streaming joiner and a hit each saved the call.
    body = tool_body("reported")
    await leader_and_joiners(gw, fake, CHAT, body)
    await gw.client.post(CHAT, json=body)
    usage = (await direct(fake, CHAT, body))["usage"]
    counted = await stats(gw)
    assert counted["tokens_saved"] == 3 * usage["total_tokens"] > 0
    assert counted["saved_without_usage"] == 0
    # Not reported: nothing is added, and the answers saved without it are counted apart.
    fake.ignore_include_usage = True
    body = tool_body("not reported")
    await leader_and_joiners(gw, fake, CHAT, body)
    await gw.client.post(CHAT, json=body)
    after = await stats(gw)
    assert after["tokens_saved"] == counted["tokens_saved"]
    assert after["saved_without_usage"] == 3


async def test_continuous_usage_stats_without_include_usage_gets_no_usage_as_from_the_engines(
    gw, fake
):
    # The engines (OpenAI's reading; SGLang; vLLM since its PR #36379) read it only beside
    # include_usage, which the gateway adds to the call it makes for a client that did not ask:
    # passed on, it put a usage in every chunk this client would not have had (a review).
    body = tool_body("continuous alone")
    alone, raw = await stream(
        gw, CHAT, {**body, "stream_options": {"continuous_usage_stats": True}}
    )
    assert alone.headers["x-carpool"] == "miss"
    assert [e for e in events(raw) if e.get("usage") is not None] == []
    assert fake.calls[-1].body["stream_options"] == {"include_usage": True}
    # (Keyed apart all the same: a plain stream does not share it.)
    plain, _ = await stream(gw, CHAT, body)
    assert plain.headers["x-carpool"] == "miss" and fake.count() == 2


@pytest.mark.parametrize("first", ["alone", "with include_usage"])
async def test_continuous_usage_stats_alone_and_beside_include_usage_never_share_their_frames(
    gw, fake, first
):
    # Both were keyed alike (include_usage out of the key) while only one call passes the
    # option on: whichever came first, the other was served its shape (a review).
    body = tool_body(f"continuous, {first} first")
    shapes = {
        "alone": {"continuous_usage_stats": True},
        "with include_usage": {"include_usage": True, "continuous_usage_stats": True},
    }
    order = [first, *(shape for shape in shapes if shape != first)]
    for shape in order:
        response, raw = await stream(gw, CHAT, {**body, "stream_options": shapes[shape]})
        assert response.headers["x-carpool"] == "miss", shape
        usage = [e.get("usage") is not None for e in events(raw)]
        assert all(usage) if shape == "with include_usage" else not any(usage), shape
    assert fake.count() == 2


async def test_continuous_usage_stats_gets_a_usage_in_every_chunk_and_no_plain_stream_its_frames(
    gw, fake
):
    body = tool_body("continuous usage")
    both = {"include_usage": True, "continuous_usage_stats": True}
    asked, asked_raw = await stream(gw, CHAT, {**body, "stream_options": both})
    assert asked.headers["x-carpool"] == "miss" and fake.calls[-1].body["stream_options"] == both
    assert all(e.get("usage") is not None for e in events(asked_raw))  # (as the engine's)
    # A stream that did not ask is not replayed those frames: another key, its own call.
    plain, plain_raw = await stream(gw, CHAT, body)
    assert plain.headers["x-carpool"] == "miss" and fake.count() == 2
    assert [e for e in events(plain_raw) if e.get("usage") is not None] == []


async def test_a_json_request_with_stream_options_is_asked_of_the_engine_not_served_a_plain_200(
    gw, fake
):
    # vLLM and OpenAI refuse stream options without a stream (400): the request was keyed as
    # the plain one and served its stored 200 (a review).
    body = tool_body("json with stream options")
    assert (await gw.client.post(CHAT, json=body)).headers["x-carpool"] == "miss"
    asked = await gw.client.post(CHAT, json={**body, "stream_options": {"include_usage": True}})
    assert asked.headers["x-carpool"] == "miss" and fake.count() == 2
    assert fake.calls[-1].body["stream_options"] == {"include_usage": True}


WITHOUT_STREAM_USAGE = {"upstream": {"stream_usage": False}}
ASKING = {"stream_options": {"include_usage": True}}


def usage_chunks(raw: str) -> list[dict[str, Any]]:
    return [e["usage"] for e in events(raw) if not e.get("choices") and e.get("usage")]


async def test_without_stream_usage_each_client_gets_the_usage_its_own_request_would_have(
    gateway_with, fake
):
    body = tool_body("count my tokens")
    engine = await direct(fake, CHAT, body)  # what a non-streaming client gets from the engine
    async with gateway_with(**WITHOUT_STREAM_USAGE) as gw:
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(stream(gw, CHAT, body))  # asked without usage
        await fake.chunk_gate_reached.wait()
        fake.gate = asyncio.Event()  # (the calls that follow wait until every client is in)
        alike = asyncio.create_task(stream(gw, CHAT, body))
        plain = asyncio.create_task(gw.client.post(CHAT, json=body))
        asking = asyncio.create_task(stream(gw, CHAT, {**body, **ASKING}))
        await eventually(lambda: flight_clients(gw) == 4, what="four clients on flights")
        fake.gate.set()
        fake.chunk_gate.set()
        (led, raw), (joined, alike_raw) = await leader, await alike
        plain_response, (asked, asking_raw) = await plain, await asking
    # A stream like the leader's shares its call: neither asked for the usage, neither gets it.
    assert (led.headers["x-carpool"], joined.headers["x-carpool"]) == ("miss", "coalesced")
    assert usage_chunks(raw) == usage_chunks(alike_raw) == [] and alike_raw == raw
    # The others get it, as from the engine: from a call of their own, which they share.
    assert plain_response.headers["x-carpool"] == "miss"
    assert "x-carpool-usage" not in plain_response.headers
    assert plain_response.json()["usage"] == engine["usage"]
    assert asked.headers["x-carpool"] == "coalesced"
    assert usage_chunks(asking_raw) == [engine["usage"]]
    assert fake.count() == 1 + 2


async def test_without_stream_usage_an_answer_asked_without_usage_is_never_stored(
    gateway_with, fake
):
    body = tool_body("count my tokens")
    async with gateway_with(**WITHOUT_STREAM_USAGE) as gw:
        led, raw = await stream(gw, CHAT, body)
        assert led.headers["x-carpool"] == "miss" and usage_chunks(raw) == []
        # Neither stored nor joinable in its window by another shape: its own call.
        plain = await gw.client.post(CHAT, json=body)
        assert plain.headers["x-carpool"] == "miss" and plain.json()["usage"]["total_tokens"] > 0
        # That answer has the usage: stored, it serves every shape.
        asked, asked_raw = await stream(gw, CHAT, {**body, **ASKING})
        assert asked.headers["x-carpool"] == "hit"
        assert usage_chunks(asked_raw) == [plain.json()["usage"]]
        again = await gw.client.post(CHAT, json=body)
        assert again.headers["x-carpool"] == "hit" and again.json() == plain.json()
    assert fake.count() == 2


# --- 4. errors that do not multiply calls -------------------------------------------------------


@pytest.fixture
def sdk(gw):
    # The SDK's own retries on (its default is 2): the point is that they are not triggered.
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=2)


async def test_an_empty_200_stream_is_one_engine_call_for_one_streaming_sdk_call(sdk, gw, fake):
    fake.empty_stream = True  # llama.cpp's server on a prompt over its context
    with pytest.raises(openai.APIError, match="without sending anything"):
        stream = await sdk.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "too long"}],
            temperature=0,
            stream=True,
        )
        async for _ in stream:
            pass
    assert fake.count() == 1
    response, raw = await stream_raw(gw, "too long")
    assert response.status_code == 200 and events(raw)[-1].keys() == {"error"}
    assert "data: [DONE]" not in raw and fake.count() == 2
    assert gw.gateway.store.entries == 0


async def stream_raw(served, content: str) -> tuple[httpx.Response, str]:
    return await stream(
        served,
        CHAT,
        {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]},
    )


async def test_an_empty_stream_led_for_a_non_streaming_sdk_call_is_not_retried(gateway_with, fake):
    async with gateway_with(upstream={"stream_flights": True}) as gw:
        sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=2)
        fake.empty_stream = True
        with pytest.raises(openai.APIStatusError) as raised:
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "too long"}], temperature=0
            )
        assert raised.value.status_code == 502  # the status kept...
        assert raised.value.response.headers["x-should-retry"] == "false"  # ...not retried
        assert fake.count() == 1


@pytest.mark.parametrize("status", [400, 500])
async def test_an_error_the_engine_reported_keeps_its_status_and_message_for_a_stream(
    gw, fake, status
):
    fake.fail_status = status
    fake.fail_body = {
        "error": {
            "message": "the prompt is longer than the context (4096)",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        await sdk.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "too long"}],
            temperature=0,
            stream=True,
        )
    assert raised.value.status_code == status
    assert raised.value.body["message"] == "the prompt is longer than the context (4096)"
    assert raised.value.body["code"] == "context_length_exceeded"
    assert fake.count() == 1


async def test_an_error_the_engine_reports_in_its_stream_reaches_clients_as_it_is():
    engine_error = {
        "message": "the prompt is longer than the context",
        "type": "BadRequestError",
        "code": 400,
    }

    async def events() -> AsyncIterator[list[bytes]]:
        yield [json.dumps({"error": engine_error}).encode()]  # vLLM: then [DONE]

    with pytest.raises(UpstreamStreamBroken) as raised:
        await _consume("chat", UpstreamResponse(200, events=events()), Broadcast(), {})
    assert json.loads(error_event(raised.value)[6:]) == {"error": engine_error}
    assert json.loads(raised.value.body()) == {"error": engine_error}
    assert raised.value.headers()["x-should-retry"] == "false"


# --- 3. batching that cannot change an answer ---------------------------------------------------

# Four concurrent requests close a batch by its size: no timer decides what is merged.
BATCH = {"max_batch_size": 4, "max_batch_delay_ms": 60_000}


async def embed_all(served, texts: list[str]) -> list[httpx.Response]:
    responses = await asyncio.gather(
        *(served.client.post(EMBEDDINGS, json={"model": "e", "input": text}) for text in texts)
    )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return responses


def vector(response: httpx.Response) -> list[float]:
    return response.json()["data"][0]["embedding"]


def list_calls(fake) -> list[list[Any]]:
    return [
        c.body["input"]
        for c in fake.calls
        if c.path == EMBEDDINGS and isinstance(c.body["input"], list)
    ]


async def test_singles_are_never_merged_for_an_engine_that_answers_lists_wrongly(
    gateway_with, fake
):
    fake.broken_list_embeddings = True
    texts = [f"text {i}" for i in range(8)]
    alone = {
        t: (await direct(fake, EMBEDDINGS, {"model": "e", "input": t}))["data"][0]["embedding"]
        for t in texts
    }
    async with gateway_with(batching=BATCH) as gw:
        first = await embed_all(gw, texts[:4])  # a batch of four: sent item by item
        await gw.gateway.batcher.wait_idle()  # the probe it started has decided
        assert gw.gateway.batcher.stats()["lists"]["lists_wrong"] == 1
        second = await embed_all(gw, texts[4:])  # not even buffered: sent as it came
        assert [vector(r) for r in first + second] == [alone[t] for t in texts]
        assert list_calls(fake) == [list(PROBE_INPUTS)]  # the probe's list, and no other
        hits = await embed_all(gw, texts)
        assert all(r.headers["x-carpool"] == "hit" for r in hits)
        assert [vector(r) for r in hits] == [alone[t] for t in texts]


async def test_singles_are_merged_once_the_probe_shows_lists_are_answered_item_by_item(
    gateway_with, fake
):
    texts = [f"text {i}" for i in range(8)]
    async with gateway_with(batching=BATCH) as gw:
        first = await embed_all(gw, texts[:4])
        assert list_calls(fake) in ([], [list(PROBE_INPUTS)])  # none merged before the verdict
        await gw.gateway.batcher.wait_idle()
        assert gw.gateway.batcher.stats()["lists"]["lists_right"] == 1
        second = await embed_all(gw, texts[4:])
        assert list_calls(fake)[-1] == texts[4:]  # one merged call for the four
        calls = fake.count()
    alone = [
        (await direct(fake, EMBEDDINGS, {"model": "e", "input": t}))["data"][0]["embedding"]
        for t in texts
    ]
    assert [vector(r) for r in first + second] == alone
    assert calls == 4 + 3 + 1  # alone, the probe, one merged


async def test_a_list_verdict_holds_only_for_the_credentials_and_headers_it_was_probed_with(
    gateway_with, fake
):
    """A router in front of the engines may send one key, or one value of a forwarded header
    that may change the answer, to an engine that answers lists wrongly. The verdict was kept
    per body template only: a probe passed with tenant A's key let tenant B's items, and those
    sent to another deployment, be merged and answered with wrong vectors."""

    def routed_to_a_broken_engine(call) -> bool:
        return (
            call.headers.get("authorization") == "Bearer B"
            or call.headers.get("x-backend") == "llama"
        )

    fake.broken_list_embeddings = routed_to_a_broken_engine
    a = {"authorization": "Bearer A"}
    asking = {"A": a, "B": {"authorization": "Bearer B"}, "A on llama": {**a, "x-backend": "llama"}}

    async def pair(served, who: str, round_: int) -> list[httpx.Response]:
        texts = [f"{who} item {i}, round {round_}" for i in range(2)]
        responses = await asyncio.gather(
            *(
                served.client.post(
                    EMBEDDINGS, json={"model": "e", "input": text}, headers=asking[who]
                )
                for text in texts
            )
        )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        alone = [
            (await direct(fake, EMBEDDINGS, {"model": "e", "input": text}))["data"][0]["embedding"]
            for text in texts
        ]
        assert [vector(r) for r in responses] == alone, who
        return responses

    async with gateway_with(batching={"max_batch_size": 2, "max_batch_delay_ms": 60_000}) as gw:
        await pair(gw, "A", 1)  # sent alone; the probe (with A's key) finds lists right
        await gw.gateway.batcher.wait_idle()
        await pair(gw, "A", 2)  # merged now
        merged = [["A item 0, round 2", "A item 1, round 2"]]
        assert list_calls(fake)[-1] == merged[0]
        for who in ("B", "A on llama"):
            await pair(gw, who, 1)  # not merged on A's verdict: alone, and probed on its own
            await gw.gateway.batcher.wait_idle()
        lists = gw.gateway.batcher.stats()["lists"]
        assert (lists["probes"], lists["lists_right"], lists["lists_wrong"]) == (3, 1, 2)
        for who in ("B", "A on llama"):
            await pair(gw, who, 2)  # known wrong for them: still alone
        assert [items for items in list_calls(fake) if items != list(PROBE_INPUTS)] == merged


async def test_with_embeddings_batching_off_nothing_is_merged_nor_probed(gateway_with, fake):
    async with gateway_with(batching={**BATCH, "embeddings": "off"}) as gw:
        await embed_all(gw, [f"text {i}" for i in range(4)])
        await gw.gateway.batcher.wait_idle()
        assert list_calls(fake) == [] and fake.count() == 4
        assert gw.gateway.batcher.stats()["lists"]["probes"] == 0
