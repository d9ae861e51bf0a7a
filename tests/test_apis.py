"""OpenAI's Responses API and Anthropic's Messages API get the layers chat gets (issue 15, 5-7).

Over HTTP, a real gateway in front of the fake upstream (``fakes/upstream.py`` serves both APIs
in their real shapes): the exact cache, coalescing with streaming fan-out and late joiners, the
conversion between streams and whole answers, what is stored (only complete answers), the
sampling policy, what never shares (Responses' ``background`` and ``conversation``), the
tenant (``x-api-key``), idempotency keys, the semantic view, the APIs' own error shapes, and the
official ``openai`` and ``anthropic`` SDKs. Joiners get into a flight through the fake's
``gate``/``chunk_gate`` (the upstream holds its answer until every client is in), never by
sleeping.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import orjson
import pytest

from carpool.apis import api_of
from carpool.apis import messages as messages_api
from carpool.apis import responses as responses_api
from carpool.config import Config
from carpool.fingerprint import fingerprint, semantic_view
from carpool.request import ClientRequest, parse
from carpool.sse import SSEDecoder
from conftest import run_gateway
from fakes.flights import flight_clients, leader_and_joiners, stream
from fakes.waiting import eventually

RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
CHAT = "/v1/chat/completions"
QUESTION = "What is carpool?"
# A Messages request as the anthropic SDK sends it greedy: recent SDKs no longer take
# ``temperature`` as an argument, only in ``extra_body`` (without it a request samples, and
# bypasses).
GREEDY_MESSAGE: dict[str, Any] = {
    "model": "m",
    "max_tokens": 64,
    "extra_body": {"temperature": 0},
    "messages": [{"role": "user", "content": QUESTION}],
}


def anthropic_client(gw: Any) -> anthropic.AsyncAnthropic:
    """The official SDK pointed at the gateway (it adds ``/v1/messages`` itself)."""
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-ant-test", max_retries=0)


BOTH = pytest.mark.parametrize("kind", ["responses", "messages"])
# The last event of each API's stream, and what a complete answer says.
LAST = {"responses": "response.completed", "messages": "message_stop"}


def body_of(kind: str, text: str = QUESTION, **extra: Any) -> dict[str, Any]:
    """A deterministic request (``temperature: 0``) unless ``extra`` says otherwise."""
    if kind == "responses":
        return {"model": "m", "input": text, "temperature": 0, **extra}
    return {
        "model": "m",
        "max_tokens": 64,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


def path_of(kind: str) -> str:
    return RESPONSES if kind == "responses" else MESSAGES


def without(body: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != name}


def events(raw: str) -> list[tuple[str | None, dict[str, Any]]]:
    """The (event name, data) pairs of a whole SSE text."""
    decoder = SSEDecoder()
    out = decoder.feed(raw.encode())
    decoder.close()
    assert not decoder.truncated, raw[-200:]
    return [(name, orjson.loads(payload)) for name, payload in out]


def typed(kind: str, raw: str) -> list[dict[str, Any]]:
    """The events of a typed stream that ended whole: every event is named after its data's own
    type, there is no [DONE], and the last event is the API's last one."""
    pairs = events(raw)
    assert "[DONE]" not in raw
    assert all(name == data.get("type") for name, data in pairs), pairs
    assert pairs and pairs[-1][0] == LAST[kind], pairs[-1:]
    return [data for _, data in pairs]


def stream_text(kind: str, raw: str) -> str:
    if kind == "responses":
        return "".join(
            e["delta"] for e in typed(kind, raw) if e["type"] == "response.output_text.delta"
        )
    return "".join(
        e["delta"]["text"]
        for e in typed(kind, raw)
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )


def body_text(kind: str, body: dict[str, Any]) -> str:
    if kind == "responses":
        return "".join(
            part["text"]
            for item in body["output"]
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        )
    return "".join(block["text"] for block in body["content"] if block["type"] == "text")


def assembled(kind: str, raw: str) -> dict[str, Any]:
    """The answer a client's stream makes, as the gateway assembles one."""
    api = api_of(kind)
    body, complete = api.judge_stream(typed(kind, raw), None)
    assert complete
    return body


def assert_complete(kind: str, body: dict[str, Any]) -> None:
    if kind == "responses":
        assert body["object"] == "response" and body["status"] == "completed"
        assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] > 0
    else:
        assert body["type"] == "message" and body["stop_reason"] == "end_turn"
        assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] > 0


def error_of(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The error object of an error body (or event) in the API's own shape."""
    if kind == "messages":
        assert body["type"] == "error", body
        assert set(body["error"]) >= {"type", "message"}
    return body["error"]


# --- the exact cache ---------------------------------------------------------------------------


@BOTH
async def test_a_repeat_is_a_hit_after_a_miss(gw, fake, kind):
    first = await gw.client.post(path_of(kind), json=body_of(kind))
    again = await gw.client.post(path_of(kind), json=body_of(kind))
    assert first.status_code == again.status_code == 200
    assert first.headers["x-carpool"] == "miss" and again.headers["x-carpool"] == "hit"
    assert "age" in again.headers
    assert_complete(kind, first.json())
    assert again.json() == first.json()
    assert body_text(kind, first.json()) == f"answer 1 to {QUESTION}"
    assert fake.count() == 1


@BOTH
async def test_a_streaming_repeat_is_a_hit_served_as_the_apis_own_events(gw, fake, kind):
    first, raw = await stream(gw, path_of(kind), body_of(kind))
    again, replayed = await stream(gw, path_of(kind), body_of(kind))
    assert first.headers["x-carpool"] == "miss" and again.headers["x-carpool"] == "hit"
    assert first.headers["content-type"].startswith("text/event-stream")
    assert stream_text(kind, raw) == f"answer 1 to {QUESTION}"
    assert replayed == raw  # the upstream's own events, as they came
    assert_complete(kind, assembled(kind, raw))
    assert fake.count() == 1 and fake.calls[0].stream


@BOTH
async def test_a_streaming_client_of_a_cached_whole_answer_gets_the_apis_event_stream(
    gw, fake, kind
):
    whole = await gw.client.post(path_of(kind), json=body_of(kind))
    hit, raw = await stream(gw, path_of(kind), body_of(kind))
    assert hit.headers["x-carpool"] == "hit"
    assert stream_text(kind, raw) == body_text(kind, whole.json())
    assert assembled(kind, raw) == whole.json()  # synthesized, and it assembles back
    assert fake.count() == 1


@BOTH
async def test_a_whole_answer_client_of_a_cached_stream_gets_the_assembled_object(gw, fake, kind):
    _, raw = await stream(gw, path_of(kind), body_of(kind))
    hit = await gw.client.post(path_of(kind), json=body_of(kind))
    assert hit.headers["x-carpool"] == "hit"
    assert hit.headers["content-type"].startswith("application/json")
    body = hit.json()
    assert_complete(kind, body)
    assert body_text(kind, body) == stream_text(kind, raw) == f"answer 1 to {QUESTION}"
    # Exactly what the upstream answers the same call whole (usage included): the fake numbers
    # its answers by call, so it is asked again as call 1, past the cache (another namespace).
    fake.reset()
    direct = await gw.client.post(
        path_of(kind), json=body_of(kind), headers={"x-carpool-namespace": "direct"}
    )
    assert direct.headers["x-carpool"] == "miss" and not fake.calls[0].stream
    assert body == direct.json()


# --- coalescing --------------------------------------------------------------------------------


@BOTH
async def test_identical_requests_in_flight_share_one_call_streaming_or_not(gw, fake, kind):
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(
        gw, fake, path_of(kind), body_of(kind)
    )
    assert leader.headers["x-carpool"] == "miss"
    assert joiner.headers["x-carpool"] == plain.headers["x-carpool"] == "coalesced"
    assert stream_text(kind, raw) == stream_text(kind, joined) == f"answer 1 to {QUESTION}"
    assert_complete(kind, plain.json())
    assert body_text(kind, plain.json()) == f"answer 1 to {QUESTION}"
    assert fake.count() == 1


@BOTH
async def test_a_streaming_joiner_of_a_whole_answer_call_gets_the_apis_events(gw, fake, kind):
    fake.gate = asyncio.Event()
    leader = asyncio.create_task(gw.client.post(path_of(kind), json=body_of(kind)))
    await fake.wait_for_calls(1)
    joiner = asyncio.create_task(stream(gw, path_of(kind), body_of(kind)))
    await eventually(lambda: flight_clients(gw) == 2, what="the joiner in the flight")
    fake.gate.set()
    whole, (joined, raw) = await asyncio.gather(leader, joiner)
    assert (whole.headers["x-carpool"], joined.headers["x-carpool"]) == ("miss", "coalesced")
    assert not fake.calls[0].stream
    assert assembled(kind, raw) == whole.json()  # synthesized from the whole answer
    assert fake.count() == 1


@BOTH
async def test_a_late_streaming_joiner_is_replayed_from_the_first_event(gw, fake, kind):
    fake.chunk_gate = asyncio.Event()
    leader = asyncio.create_task(stream(gw, path_of(kind), body_of(kind)))
    await fake.chunk_gate_reached.wait()
    # The gateway has relayed the first events (two text deltas among them) before it joins.
    early = 6 if kind == "responses" else 5
    await eventually(
        lambda: any(len(f.broadcast.frames) >= early for f in gw.gateway.flights.running()),
        what="the first events relayed",
    )
    joiner = asyncio.create_task(stream(gw, path_of(kind), body_of(kind)))
    await eventually(lambda: flight_clients(gw) == 2, what="the joiner in the flight")
    fake.chunk_gate.set()
    (first, raw), (late, joined) = await asyncio.gather(leader, joiner)
    assert late.headers["x-carpool"] == "coalesced"
    assert joined == raw  # every event, from the first one
    assert fake.count() == 1


# --- completeness ------------------------------------------------------------------------------


@BOTH
async def test_a_stream_that_stops_before_its_last_event_is_not_stored_and_every_client_gets_an_error(  # noqa: E501
    gw, fake, kind
):
    fake.omit_done = True  # ends cleanly without response.completed / message_stop
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(
        gw, fake, path_of(kind), body_of(kind)
    )
    for response, text in ((leader, raw), (joiner, joined)):
        assert response.status_code == 200
        name, data = events(text)[-1]
        assert name == "error" and error_of(kind, data)["message"]
        assert LAST[kind] not in text and "[DONE]" not in text
    assert plain.status_code == 502 and plain.headers["x-should-retry"] == "false"
    assert error_of(kind, plain.json())["message"]
    assert gw.gateway.store.entries == 0
    fake.omit_done = False
    again = await gw.client.post(path_of(kind), json=body_of(kind))
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2


@BOTH
async def test_an_answer_that_ended_without_completing_is_served_as_it_came_but_not_stored(
    gw, fake, kind
):
    # Responses: status "incomplete" (response.incomplete ends its stream); Messages: no
    # stop_reason. Whole answers of the upstream, not failures: served, never stored.
    fake.omit_finish_reason = True
    whole = await gw.client.post(path_of(kind), json=body_of(kind))
    streamed, raw = await stream(gw, path_of(kind), body_of(kind))
    assert whole.status_code == streamed.status_code == 200
    pairs = events(raw)
    if kind == "responses":
        assert whole.json()["status"] == "incomplete"
        assert pairs[-1][0] == "response.incomplete"
    else:
        assert whole.json()["stop_reason"] is None
        assert pairs[-1][0] == "message_stop"
    assert all(name != "error" for name, _ in pairs)
    assert streamed.headers["x-carpool"] == "miss" and fake.count() == 2
    assert gw.gateway.store.entries == 0


@BOTH
async def test_an_upstream_error_event_reaches_every_client_in_the_apis_shape_and_is_not_stored(
    gw, fake, kind
):
    fake.error_after = 3
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(
        gw, fake, path_of(kind), body_of(kind)
    )
    for text in (raw, joined):
        ((name, data),) = [pair for pair in events(text) if pair[0] == "error"]
        assert events(text)[-1][0] == "error"
        error = error_of(kind, data)
        assert error["message"] == "fake upstream stream failure"
        if kind == "messages":
            assert error["type"] == "overloaded_error"  # the engine's own error object
        else:
            assert data["code"] == "server_error"
    assert plain.status_code == 502
    assert error_of(kind, plain.json())["message"] == "fake upstream stream failure"
    assert gw.gateway.store.entries == 0 and fake.count() == 1


@pytest.mark.parametrize("how", ["cut", "upstream_error", "bypassed"])
async def test_a_responses_error_event_is_numbered_after_the_events_before_it(gw, fake, how):
    # Every event of a Responses stream has its ``sequence_number``, from 0 without a gap
    # (OpenAI's ``ResponseErrorEvent`` too): the gateway's own error event had none.
    body = body_of("responses")
    if how == "cut":
        fake.cut_after = 3
    elif how == "upstream_error":
        fake.error_after = 3
    else:
        fake.omit_done, body = True, without(body, "temperature")
    if how == "bypassed":
        raws = [(await stream(gw, RESPONSES, body))[1]]
    else:  # (the flight's leader and its streaming joiner, which came mid-stream)
        (_, raw), (_, joined), _ = await leader_and_joiners(gw, fake, RESPONSES, body)
        raws = [raw, joined]
    for raw in raws:
        pairs = events(raw)
        assert pairs[-1][0] == "error" and len(pairs) > 3
        assert [data["sequence_number"] for _, data in pairs] == list(range(len(pairs)))


async def test_an_error_event_reaches_a_joiner_with_another_body_without_the_upstreams_text(
    gw, fake
):
    # ``metadata`` is out of a Messages key: the second client joins the first's stream. The
    # engine's error event was about the first's call: the second gets its type, not its text.
    fake.error_after, fake.chunk_gate = 3, asyncio.Event()
    body = body_of("messages")
    first = asyncio.create_task(stream(gw, MESSAGES, {**body, "metadata": {"user_id": "alice"}}))
    await fake.chunk_gate_reached.wait()
    second = asyncio.create_task(stream(gw, MESSAGES, {**body, "metadata": {"user_id": "bob"}}))
    await eventually(lambda: flight_clients(gw) == 2, what="two clients in the flight")
    fake.chunk_gate.set()
    (_, mine), (_, joined) = await first, await second
    assert fake.count() == 1
    assert events(mine)[-1][1]["error"]["message"] == "fake upstream stream failure"
    name, data = events(joined)[-1]
    assert name == "error" and data["error"]["type"] == "overloaded_error"
    assert "fake upstream stream failure" not in joined


# --- what shares -------------------------------------------------------------------------------


@BOTH
async def test_an_absent_temperature_samples_so_it_bypasses(gw, fake, kind):
    sampled = without(body_of(kind), "temperature")  # Anthropic's default is 1: sampled too
    first = await gw.client.post(path_of(kind), json=sampled)
    second = await gw.client.post(path_of(kind), json=sampled)
    assert first.headers["x-carpool"] == second.headers["x-carpool"] == "bypass"
    assert body_text(kind, second.json()) == f"answer 2 to {QUESTION}"
    streamed, raw = await stream(gw, path_of(kind), sampled)  # relayed with its event names
    assert streamed.headers["x-carpool"] == "bypass"
    assert stream_text(kind, raw) == f"answer 3 to {QUESTION}"
    assert fake.count() == 3


@BOTH
async def test_a_bypassed_stream_that_stops_before_its_last_event_ends_with_an_error_event(
    gw, fake, kind
):
    fake.omit_done = True
    response, raw = await stream(gw, path_of(kind), without(body_of(kind), "temperature"))
    assert response.headers["x-carpool"] == "bypass"
    name, data = events(raw)[-1]
    assert name == "error" and error_of(kind, data)["message"]


@BOTH
async def test_a_bypassed_typed_stream_cut_with_done_ends_with_an_error_event(gw, fake, kind):
    # A typed stream sends no [DONE]: one in place of its last event (a proxy ending a stream
    # it cut as chat's end) is no whole end. Taken for one, the stream ended silently, its
    # client none the wiser, its credential accepted.
    fake.typed_done = True
    response, raw = await stream(gw, path_of(kind), without(body_of(kind), "temperature"))
    assert response.headers["x-carpool"] == "bypass"
    name, data = events(raw)[-1]
    assert name == "error" and "without its last event" in error_of(kind, data)["message"]
    assert LAST[kind] not in raw and "[DONE]" not in raw
    shared, raw = await stream(gw, path_of(kind), body_of(kind))  # a flight's too
    assert shared.headers["x-carpool"] == "miss" and events(raw)[-1][0] == "error"
    assert gw.gateway.store.entries == 0


async def test_messages_at_temperature_0_or_top_k_1_share(gw, fake):
    for body in (body_of("messages"), {**without(body_of("messages"), "temperature"), "top_k": 1}):
        first = await gw.client.post(MESSAGES, json=body)
        again = await gw.client.post(MESSAGES, json=body)
        assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
    assert fake.count() == 2


async def test_x_carpool_share_sampled_shares_a_sampled_messages_request(gw, fake):
    body, headers = without(body_of("messages"), "temperature"), {"x-carpool-share": "sampled"}
    first = await gw.client.post(MESSAGES, json=body, headers=headers)
    again = await gw.client.post(MESSAGES, json=body, headers=headers)
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "u"},
        {"safety_identifier": "s"},
        {"prompt_cache_key": "k"},
        {"request_id": "r"},
        {"stream_options": {"include_usage": True}},
        {"metadata": {"session": "s"}},
        {"metadata": {"user_id": "alice", "session": "s"}},
        {"metadata": {"user_id": 5}},
    ],
)
async def test_a_messages_field_anthropic_refuses_is_in_the_key(gw, fake, extra):
    # Anthropic answers a field it does not know with a 400: such a request gets its own call
    # (and the upstream's refusal), never the answer to the request without it.
    first = await gw.client.post(MESSAGES, json=body_of("messages"))
    again = await gw.client.post(MESSAGES, json=body_of("messages", **extra))
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "miss")
    assert fake.count() == 2


@pytest.mark.parametrize("metadata", [{"user_id": "bob"}, {"user_id": None}, {}])
async def test_a_messages_metadata_of_only_a_user_id_is_out_of_the_key(gw, fake, metadata):
    # Anthropic's one metadata field tags the request for abuse tracking: the answer is the same.
    first = await gw.client.post(MESSAGES, json=body_of("messages", metadata={"user_id": "al"}))
    again = await gw.client.post(MESSAGES, json=body_of("messages", metadata=metadata))
    plain = await gw.client.post(MESSAGES, json=body_of("messages"))
    assert [r.headers["x-carpool"] for r in (first, again, plain)] == ["miss", "hit", "hit"]
    assert fake.count() == 1


async def test_background_responses_pass_through_never_shared(gw, fake):
    # A background response is a job the client polls: never cached nor coalesced, whatever
    # the controls say.
    body = body_of("responses", background=True)
    headers = {"x-carpool-share": "sampled"}
    first = await gw.client.post(RESPONSES, json=body, headers=headers)
    second = await gw.client.post(RESPONSES, json=body, headers=headers)
    assert first.headers["x-carpool"] == second.headers["x-carpool"] == "bypass"
    assert fake.count() == 2 and fake.calls[0].body["background"] is True


async def test_responses_in_a_conversation_are_never_shared(gw, fake):
    # The upstream appends each call's turn to the conversation: the same request twice is two
    # turns, and the second sees the first.
    body = body_of("responses", conversation="conv_1")
    first = await gw.client.post(RESPONSES, json=body)
    second = await gw.client.post(RESPONSES, json=body)
    assert first.headers["x-carpool"] == second.headers["x-carpool"] == "bypass"
    assert fake.count() == 2


async def test_previous_response_id_is_part_of_the_key(gw, fake):
    one = body_of("responses", previous_response_id="resp_1")
    other = body_of("responses", previous_response_id="resp_2")
    outcomes = [
        (await gw.client.post(RESPONSES, json=body)).headers["x-carpool"]
        for body in (one, other, one, body_of("responses"))
    ]
    assert outcomes == ["miss", "miss", "hit", "miss"]
    assert [c.body.get("previous_response_id") for c in fake.calls] == ["resp_1", "resp_2", None]


async def test_a_deleted_response_and_its_follow_ups_are_no_longer_served(gw, fake):
    # The upstream keeps the responses it makes; a client deletes one through the gateway (a
    # pass-through). The identical request was a hit that handed back the deleted response
    # (its id naming nothing now, its content what the client deleted), and a follow-up
    # cached before was still served, where the upstream now refuses it (404).
    fake.keeps_responses = True
    asked = body_of("responses")
    streamed = body_of("responses", "Streamed, then deleted", stream=True)
    made = (await gw.client.post(RESPONSES, json=asked)).json()
    made_streaming = await gw.client.post(RESPONSES, json=streamed)
    made_streaming_id = typed("responses", made_streaming.text)[0]["response"]["id"]
    follow = body_of("responses", "And then?", previous_response_id=made["id"])
    assert (await gw.client.post(RESPONSES, json=follow)).status_code == 200
    unrelated = body_of("responses", "Something else")
    await gw.client.post(RESPONSES, json=unrelated)
    for rid in (made["id"], made_streaming_id):
        deleted = await gw.client.delete(f"{RESPONSES}/{rid}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    calls = fake.count()
    again = await gw.client.post(RESPONSES, json=asked)
    assert again.headers["x-carpool"] == "miss" and again.json()["id"] != made["id"]
    assert (await gw.client.post(RESPONSES, json=without(streamed, "stream"))).headers[
        "x-carpool"
    ] == "miss"
    refused = await gw.client.post(RESPONSES, json=follow)
    assert refused.status_code == 404 and fake.count() == calls + 3
    # Only what was or continued a deleted response is dropped; a DELETE the upstream refused
    # (gone already) drops nothing.
    assert (await gw.client.post(RESPONSES, json=unrelated)).headers["x-carpool"] == "hit"
    assert (await gw.client.delete(f"{RESPONSES}/{made['id']}")).status_code == 404
    assert (await gw.client.post(RESPONSES, json=asked)).headers["x-carpool"] == "hit"


async def test_a_delete_drops_only_the_deleting_tenants_answers(gw, fake):
    # Each tenant's stored responses are its own (the upstream keeps them per account): a
    # DELETE drops the deleter's answers, and another tenant's DELETE of the same id (which
    # the upstream would refuse; this one does not check) drops none of the owner's.
    fake.keeps_responses = True
    asked = body_of("responses")
    made = {
        key: (await gw.client.post(RESPONSES, json=asked, headers=bearer_of(key))).json()["id"]
        for key in ("a", "b")
    }
    await gw.client.delete(f"{RESPONSES}/{made['b']}", headers=bearer_of("b"))
    await gw.client.delete(f"{RESPONSES}/{made['a']}", headers=bearer_of("b"))
    outcomes = {
        key: (await gw.client.post(RESPONSES, json=asked, headers=bearer_of(key))).headers[
            "x-carpool"
        ]
        for key in ("a", "b")
    }
    assert outcomes == {"a": "hit", "b": "miss"}


def stored_chat(text: str, **extra: Any) -> dict[str, Any]:
    """A deterministic chat request the upstream keeps the answer of (``store: true``)."""
    return {**body_of("chat", text), "store": True, **extra}


def chunk_id(raw: str) -> str:
    """The id of a classic stream's first chunk (every chunk carries the completion's)."""
    data = next(line for line in raw.splitlines() if line.startswith("data: "))
    return orjson.loads(data.removeprefix("data: "))["id"]


async def test_a_deleted_stored_chat_completion_is_no_longer_served(gw, fake):
    # A chat completion asked with ``store: true`` is kept upstream under its id, which a
    # client deletes through the gateway (a pass-through), as a stored response. The identical
    # request was still a hit handing back the deleted completion's id (a retrieve or an
    # update of it: the upstream's 404).
    fake.keeps_completions = True
    asked, streamed = stored_chat("Keep me, then delete me"), stored_chat("Streamed, deleted")
    made = (await gw.client.post(CHAT, json=asked)).json()["id"]
    made_streaming = chunk_id((await stream(gw, CHAT, streamed))[1])
    assert {made, made_streaming} == set(fake.kept_completions)
    unrelated, plain = stored_chat("Something else"), without(asked, "store")
    for body in (unrelated, plain):
        assert (await gw.client.post(CHAT, json=body)).headers["x-carpool"] == "miss"
    for cid in (made, made_streaming):
        deleted = await gw.client.delete(f"{CHAT}/{cid}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    calls = fake.count(CHAT)
    again = await gw.client.post(CHAT, json=asked)
    assert again.headers["x-carpool"] == "miss" and again.json()["id"] != made
    assert (await gw.client.post(CHAT, json=streamed)).headers["x-carpool"] == "miss"
    assert fake.count(CHAT) == calls + 2
    # Only the deleted completions' answers go: another stored one, a completion not stored
    # (its id names nothing kept: no DELETE can name it) stay; a refused DELETE drops nothing.
    for body in (unrelated, plain):
        assert (await gw.client.post(CHAT, json=body)).headers["x-carpool"] == "hit"
    assert (await gw.client.delete(f"{CHAT}/{made}")).status_code == 404
    assert (await gw.client.post(CHAT, json=asked)).headers["x-carpool"] == "hit"


async def test_a_stored_chat_completion_updated_is_no_longer_served(gw, fake):
    # ``POST /v1/chat/completions/{id}`` sets the stored completion's metadata, which the key
    # of a ``store: true`` request holds (a listing filters by it): the identical request was
    # still a hit handing back the id of a completion tagged otherwise now.
    fake.keeps_completions = True
    asked = stored_chat("Tag me", metadata={"run": "eval-1"})
    made = (await gw.client.post(CHAT, json=asked)).json()["id"]
    updated = await gw.client.post(f"{CHAT}/{made}", json={"metadata": {"run": "eval-2"}})
    assert updated.status_code == 200 and updated.json()["metadata"] == {"run": "eval-2"}
    again = await gw.client.post(CHAT, json=asked)
    assert again.headers["x-carpool"] == "miss" and again.json()["id"] != made
    # (A refused update changes nothing upstream, and drops nothing here.)
    refused = await gw.client.post(f"{CHAT}/chatcmpl-unknown", json={"metadata": {}})
    assert refused.status_code == 404
    assert (await gw.client.post(CHAT, json=asked)).headers["x-carpool"] == "hit"


async def test_a_chat_completion_not_stored_upstream_is_tagged_with_no_state(gw, fake):
    # Its id names nothing the upstream keeps: nothing to drop it by, nothing to route by.
    for body in (body_of("chat"), body_of("chat", "Not kept", store=False)):
        assert (await gw.client.post(CHAT, json=body)).headers["x-carpool"] == "miss"
        await stream(gw, CHAT, {**body, "messages": [{"role": "user", "content": "streamed"}]})
    assert len(gw.gateway.layers.states) == 0 and gw.gateway.store.entries == 4
    assert (await gw.client.post(CHAT, json=stored_chat("Kept"))).status_code == 200
    assert len(gw.gateway.layers.states) == 1


FILES = "/v1/files"


def naming_a_file(kind: str, file_id: str, text: str = "What does it say?") -> dict[str, Any]:
    """A ``kind`` request (chat, responses, messages) asking ``text`` of an uploaded file, named
    as each API names one: a chat file part, a Responses ``input_file`` (in its input, or a
    stored prompt's variable: "responses prompt"), a Messages document whose source is the
    file."""
    if kind == "chat":
        file = {"type": "file", "file": {"file_id": file_id}}
        content: list[dict[str, Any]] = [{"type": "text", "text": text}, file]
        return {**body_of("messages"), "messages": [{"role": "user", "content": content}]}
    if kind == "responses":
        content = [{"type": "input_text", "text": text}, {"type": "input_file", "file_id": file_id}]
        return body_of("responses", input=[{"role": "user", "content": content}])
    if kind == "responses prompt":  # (a stored prompt's variable: an input item)
        variables = {"doc": {"type": "input_file", "file_id": file_id}}
        return body_of(
            "responses", input=text, prompt={"id": "p", "version": "2", "variables": variables}
        )
    document = {"type": "document", "source": {"type": "file", "file_id": file_id}}
    content = [document, {"type": "text", "text": text}]
    return body_of("messages", messages=[{"role": "user", "content": content}])


async def uploaded(gw: Any, key: str = "a") -> str:
    """The id of a file ``key``'s tenant uploads through the gateway (a pass-through)."""
    sent = await gw.client.post(FILES, content=b"A document\n", headers=bearer_of(key))
    assert sent.status_code == 200, sent.text
    return sent.json()["id"]


@pytest.mark.parametrize("kind", ["chat", "responses", "responses prompt", "messages"])
async def test_a_deleted_files_answers_are_no_longer_served(gw, fake, kind):
    # A client deletes a file it uploaded (to erase the document) through the gateway: the
    # answers made from it were still served, hits, until their TTL (OpenAI and Anthropic
    # answer 404 to a request naming a deleted file).
    fake.keeps_files = True
    path = {"chat": CHAT, "messages": MESSAGES}.get(kind, RESPONSES)
    erased, kept = await uploaded(gw), await uploaded(gw)
    asked, other = naming_a_file(kind, erased), naming_a_file(kind, kept)
    for body in (asked, other):
        for outcome in ("miss", "hit"):
            answer = await gw.client.post(path, json=body, headers=bearer_of("a"))
            assert answer.status_code == 200 and answer.headers["x-carpool"] == outcome
    # Another tenant's DELETE of an id drops nothing of A's: its 2xx (the fake keeps one
    # namespace of files) stands for a file of B's own under the same id.
    assert (await gw.client.delete(f"{FILES}/{kept}", headers=bearer_of("b"))).status_code == 200
    assert (await gw.client.post(path, json=other, headers=bearer_of("a"))).headers[
        "x-carpool"
    ] == "hit"
    deleted = await gw.client.delete(f"{FILES}/{erased}", headers=bearer_of("a"))
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    calls = fake.count(path)
    again = await gw.client.post(path, json=asked, headers=bearer_of("a"))
    assert again.headers["x-carpool"] == "miss" and fake.count(path) == calls + 1
    # Only the deleted file's answers went.
    assert (await gw.client.post(path, json=other, headers=bearer_of("a"))).headers[
        "x-carpool"
    ] == "hit"


def test_the_files_a_request_names_are_read_from_its_input_and_its_prompts_variables():
    # A key spelled with an escape (JSON allows one anywhere) names one all the same.
    from carpool.apis.base import named_files

    naming = naming_a_file("chat", "file-1")
    escaped = orjson.dumps(naming).replace(b'"file_id"', b'"\\u0066ile_id"')
    parsed = parse(ClientRequest(CHAT, escaped, {}), 1 << 20)
    assert named_files(parsed.body) == named_files(naming) == ["file-1"]
    assert named_files(body_of("messages")) == []
    assert named_files(naming_a_file("responses prompt", "file-3")) == ["file-3"]
    # Every file once; none in a tool call's arguments, a schema or metadata.
    call = {"type": "tool_use", "id": "t", "name": "f", "input": {"file_id": "f-in-args"}}
    named = naming_a_file("messages", "file-2")
    named["messages"] += [{"role": "assistant", "content": [call]}, *named["messages"]]
    assert named_files({**named, "metadata": {"file_id": "m"}}) == ["file-2"]
    assert named_files(body_of("responses", input=FUNCTION_OUTPUT_NAMING_A_FILE)) == ["f"]


async def test_an_answer_naming_a_file_deleted_while_in_flight_is_not_stored(gw, fake):
    # The file is deleted while a call naming it runs upstream: its answer, made from the
    # deleted document, was stored once whole, and a request sent after the DELETE joined the
    # running call.
    fake.keeps_files = True
    asked = naming_a_file("chat", await uploaded(gw))
    fake.gate = asyncio.Event()
    first = asyncio.create_task(gw.client.post(CHAT, json=asked, headers=bearer_of("a")))
    await eventually(lambda: fake.count(CHAT) == 1, what="the call at the upstream")
    held, fake.gate = fake.gate, None
    file_id = asked["messages"][0]["content"][1]["file"]["file_id"]
    assert (await gw.client.delete(f"{FILES}/{file_id}", headers=bearer_of("a"))).status_code == 200
    late = asyncio.create_task(gw.client.post(CHAT, json=asked, headers=bearer_of("a")))
    await eventually(
        lambda: gw.gateway.flights.waiters == 2 or fake.count(CHAT) == 2,
        what="the request sent after the DELETE, on the running flight or upstream",
    )
    held.set()
    assert (await first).status_code == 200  # (the call running then goes on for its client)
    assert (await late).headers["x-carpool"] != "coalesced"
    again = await gw.client.post(CHAT, json=asked, headers=bearer_of("a"))
    assert again.headers["x-carpool"] == "miss" and fake.count(CHAT) == 3


async def _in_flight(gw: Any, fake: Any, text: str, key: str) -> asyncio.Task[Any]:
    """``key``'s chat call of ``text``, held by the fake upstream until ``fake.gate`` is set
    (the gate it found: a DELETE sent after it goes through)."""
    asked = fake.count(CHAT)
    fake.gate = asyncio.Event()
    call = asyncio.create_task(gw.chat(text, headers=bearer_of(key)))
    await eventually(lambda: fake.count(CHAT) == asked + 1, what="the call at the upstream")
    return call


async def _b_deletes_while_a_is_in_flight(gw: Any, fake: Any) -> tuple[Any, asyncio.Event]:
    """Tenant A's chat call, held at the upstream, while tenant B deletes a stored response of
    its own (through the gate A's call found): A's call and its gate."""
    fake.keeps_responses = True
    made = await gw.client.post(RESPONSES, json=body_of("responses"), headers=bearer_of("b"))
    first = await _in_flight(gw, fake, "A's question", "a")
    held, fake.gate = fake.gate, None
    assert held is not None
    assert (
        await gw.client.delete(f"{RESPONSES}/{made.json()['id']}", headers=bearer_of("b"))
    ).status_code == 200
    return first, held


async def test_a_delete_splits_no_other_tenants_flight(gw, fake):
    # A DELETE of a tenant's own stored response dropped every flight there was: another
    # tenant's identical request, made while its first was in flight, was a second call.
    first, held = await _b_deletes_while_a_is_in_flight(gw, fake)
    fake.gate = held  # (a call made now would wait too: the join is seen, not raced)
    second = asyncio.create_task(gw.chat("A's question", headers=bearer_of("a")))
    await eventually(
        lambda: gw.gateway.flights.waiters == 2 or fake.count(CHAT) == 2,
        what="A's second request on A's flight, or at the upstream",
    )
    held.set()
    one, two = await first, await second
    assert one.status_code == two.status_code == 200 and fake.count(CHAT) == 1
    assert two.headers["x-carpool"] == "coalesced"


async def test_a_delete_unstores_no_other_tenants_answer(gw, fake):
    # A DELETE moved every flight's epoch: another tenant's answer in flight was not stored.
    first, held = await _b_deletes_while_a_is_in_flight(gw, fake)
    held.set()
    assert (await first).headers["x-carpool"] == "miss"
    assert (await gw.chat("A's question", headers=bearer_of("a"))).headers["x-carpool"] == "hit"


async def test_a_delete_invalidates_nothing(gw, fake, monkeypatch):
    # A client's DELETE drops its response's answers by key: no layer is scanned, no flight
    # forgotten (an invalidation of every layer is the operator's, and costs every tenant).
    fake.keeps_responses = True
    layers = gw.gateway.layers
    scanned: list[str] = []

    async def invalidate(selector: Any) -> int:
        scanned.append(f"store.invalidate({selector})")
        return 0

    def forget_all() -> int:
        scanned.append("flights.forget_all")
        return 0

    def forget_named(picks: Any) -> list:
        scanned.append("flights.invalidate")
        return []

    monkeypatch.setattr(layers.store, "invalidate", invalidate)
    monkeypatch.setattr(layers.flights, "forget_all", forget_all)
    monkeypatch.setattr(layers.flights, "invalidate", forget_named)
    asked = body_of("responses")
    made = (await gw.client.post(RESPONSES, json=asked)).json()
    epoch = layers.flights.epoch
    assert (await gw.client.delete(f"{RESPONSES}/{made['id']}")).status_code == 200
    assert scanned == [] and layers.flights.epoch == epoch
    assert (await gw.client.post(RESPONSES, json=asked)).headers["x-carpool"] == "miss"


async def test_an_answer_deleted_while_in_flight_is_not_stored(gw, fake):
    # A stream names its response first (response.created): its client may delete it before
    # the answer is whole. The answer being that response is not stored once whole (it would
    # be served again under a deleted id); another answer in flight meanwhile is.
    fake.keeps_responses = True
    other = await _in_flight(gw, fake, "Another question", "a")
    held, fake.gate = fake.gate, None
    fake.chunk_gate, fake.chunk_gate_after = asyncio.Event(), 1
    asked = body_of("responses", "Streamed, deleted while it streams")
    streaming = asyncio.create_task(stream(gw, RESPONSES, asked))
    await fake.chunk_gate_reached.wait()
    (made,) = fake.kept  # (the only response made)
    assert (await gw.client.delete(f"{RESPONSES}/{made}")).status_code == 200
    fake.chunk_gate.set()
    assert held is not None
    held.set()
    response, _ = await streaming
    assert response.status_code == 200 and (await other).status_code == 200
    again = await gw.client.post(RESPONSES, json=asked)
    assert again.headers["x-carpool"] == "miss" and again.json()["id"] != made
    assert (await gw.chat("Another question", headers=bearer_of("a"))).headers["x-carpool"] == "hit"


async def sent_after_the_delete(gw, fake, body: dict, calls: int) -> asyncio.Task:
    """``body`` posted again after its DELETE answered, once the gateway has it: on the running
    flight (a waiter), or upstream as call number ``calls``."""
    late = asyncio.create_task(gw.client.post(RESPONSES, json=body))
    await eventually(
        lambda: gw.gateway.flights.waiters == 2 or fake.count(RESPONSES) == calls,
        what="the request sent after the DELETE",
    )
    return late


async def test_no_request_after_a_delete_joins_a_running_follow_up_of_it(gw, fake):
    # A follow-up of a response is running upstream when the response is deleted: an identical
    # follow-up sent after the DELETE was coalesced onto it (the flight's key was indexed under
    # the deleted response only once its answer was stored), where the upstream now refuses it.
    fake.keeps_responses = True
    made = (await gw.client.post(RESPONSES, json=body_of("responses", "Root"))).json()["id"]
    follow = body_of("responses", "And then?", previous_response_id=made)
    fake.chunk_gate = asyncio.Event()
    leading = asyncio.create_task(stream(gw, RESPONSES, follow))
    await fake.chunk_gate_reached.wait()  # (the upstream took the follow-up: it streams)
    assert (await gw.client.delete(f"{RESPONSES}/{made}")).status_code == 200
    late = await sent_after_the_delete(gw, fake, follow, calls=3)
    fake.chunk_gate.set()
    response, _ = await leading
    assert response.status_code == 200  # (the call running then goes on for its clients)
    refused = await late
    assert refused.headers["x-carpool"] != "coalesced" and refused.status_code == 404


async def test_no_request_after_a_delete_joins_the_streaming_call_that_made_it(gw, fake):
    # A stream names its response first (response.created): its client deletes it while the
    # rest streams. An identical request sent after the DELETE was coalesced onto that call and
    # handed the deleted response (its id a 404 upstream).
    fake.keeps_responses = True
    fake.chunk_gate = asyncio.Event()
    asked = body_of("responses", "Streamed, deleted while it streams")
    leading = asyncio.create_task(stream(gw, RESPONSES, asked))
    await fake.chunk_gate_reached.wait()
    (made,) = fake.kept  # (response.created, naming it, is out to the client)
    assert (await gw.client.delete(f"{RESPONSES}/{made}")).status_code == 200
    late = await sent_after_the_delete(gw, fake, asked, calls=2)
    fake.chunk_gate.set()
    await leading
    again = await late
    assert again.headers["x-carpool"] != "coalesced" and again.json()["id"] != made


async def test_an_answer_whose_response_the_index_forgot_is_not_kept(fake, gateway_with):
    # The index of what each stored response's DELETE drops is bounded (routing.state_entries):
    # a response it no longer knows has its answers dropped then, so that none outlives a
    # DELETE the index could not see to.
    fake.keeps_responses = True
    async with gateway_with(routing={"state_entries": 1}) as gw:
        first = body_of("responses", "First")
        assert (await gw.client.post(RESPONSES, json=first)).headers["x-carpool"] == "miss"
        assert (await gw.client.post(RESPONSES, json=first)).headers["x-carpool"] == "hit"
        await gw.client.post(RESPONSES, json=body_of("responses", "Second"))  # (First out)
        await eventually(lambda: gw.gateway.store.entries == 1, what="First's answer dropped")
        assert (await gw.client.post(RESPONSES, json=first)).headers["x-carpool"] == "miss"


def test_the_gateways_own_tags_are_no_clients_tags():
    # The tag of a stored response's answers could be named by no client (nor collide with a
    # client's tag): every tag a client gives is printable, and this one is not.
    from carpool.request import parse_controls
    from carpool.store.base import state_tag

    tag = state_tag("anonymous", "resp_1")
    assert not tag.isprintable()
    for given in (tag, tag.strip(), "resp_1", f"x,{tag}"):
        assert tag not in parse_controls({"x-carpool-tags": given}).tags


async def test_store_is_forwarded_as_it_came_and_is_part_of_the_key(gw, fake):
    for body in (
        body_of("responses", store=False),
        body_of("responses", store=False),
        body_of("responses"),
    ):
        await gw.client.post(RESPONSES, json=body)
    assert [c.body.get("store") for c in fake.calls] == [False, None]


async def test_x_api_key_separates_tenants_and_anthropic_headers_are_in_the_key(gw, fake):
    async def post(headers: dict[str, str]) -> str:
        response = await gw.client.post(MESSAGES, json=body_of("messages"), headers=headers)
        return response.headers["x-carpool"]

    alice = {"x-api-key": "key-a", "anthropic-version": "2023-06-01"}
    bob = {"x-api-key": "key-b", "anthropic-version": "2023-06-01"}
    assert [await post(alice), await post(bob), await post(alice)] == ["miss", "miss", "hit"]
    beta = {**alice, "anthropic-beta": "some-feature-2025-01-01"}
    assert await post(beta) == "miss"  # a beta feature may change the answer
    assert await post({**alice, "anthropic-version": "2024-01-01"}) == "miss"
    assert fake.count() == 4
    assert fake.calls[0].headers["x-api-key"] == "key-a"
    assert fake.calls[0].headers["anthropic-version"] == "2023-06-01"
    assert fake.calls[2].headers["anthropic-beta"] == "some-feature-2025-01-01"


# --- idempotency -------------------------------------------------------------------------------


@BOTH
async def test_an_idempotency_key_replays_the_first_answer_in_the_format_the_retry_asks_for(
    gw, fake, kind
):
    sampled = without(body_of(kind), "temperature")  # bypass: only the key dedupes it
    headers = {"Idempotency-Key": f'"retry-{kind}"'}
    first = await gw.client.post(path_of(kind), json=sampled, headers=headers)
    retry = await gw.client.post(path_of(kind), json=sampled, headers=headers)
    assert first.headers["x-carpool"] == "bypass"
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json() == first.json()
    async with gw.client.stream(
        "POST", path_of(kind), json={**sampled, "stream": True}, headers=headers
    ) as response:
        raw = (await response.aread()).decode()
    assert response.headers["idempotent-replayed"] == "true"
    assert assembled(kind, raw) == first.json()
    other = await gw.client.post(
        path_of(kind), json=body_of(kind, "another question"), headers=headers
    )
    assert other.status_code == 422
    assert fake.count() == 1


@BOTH
async def test_an_idempotent_stream_is_replayed_and_assembled_for_a_whole_answer_retry(
    gw, fake, kind
):
    headers = {"Idempotency-Key": f'"stream-{kind}"'}
    async with gw.client.stream(
        "POST", path_of(kind), json={**body_of(kind), "stream": True}, headers=headers
    ) as response:
        raw = (await response.aread()).decode()
    replay = await gw.client.post(path_of(kind), json=body_of(kind), headers=headers)
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == assembled(kind, raw)
    assert fake.count() == 1


# --- what passes through, errors, the simulator --------------------------------------------------


async def test_retrieving_a_response_by_id_passes_through(gw, fake):
    response = await gw.client.get("/v1/responses/resp_fake_1")
    assert response.status_code == 200 and "x-carpool" not in response.headers
    assert response.json()["path"] == "/v1/responses/resp_fake_1"
    counted = await gw.client.post("/v1/messages/count_tokens", json=body_of("messages"))
    assert counted.json()["echo"] is True and "x-carpool" not in counted.headers


async def test_the_gateways_own_errors_on_messages_are_in_anthropics_shape(gw, fake):
    bad = await gw.client.post(MESSAGES, content=b"{not json")
    assert bad.status_code == 400 and bad.headers["x-carpool"] == "bypass"
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    missing = await gw.client.post(MESSAGES, json={"model": "m", "max_tokens": 5})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
    responses = await gw.client.post(RESPONSES, json={"model": 5, "input": "x"})
    assert responses.status_code == 400 and set(responses.json()) == {"error"}
    fake.fail_status = 429  # the upstream's own error: as it came
    limited = await gw.client.post(MESSAGES, json=body_of("messages"))
    assert limited.status_code == 429
    assert limited.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "fake upstream failure"},
    }
    assert fake.count() == 1


async def test_a_timed_out_upstream_on_messages_is_anthropics_timeout_error(fake, gateway_with):
    fake.hang = True  # the gateway's 504: the type the anthropic SDK has for it
    async with gateway_with(limits={"upstream_timeout": 0.2}) as gw:
        response = await gw.client.post(MESSAGES, json=body_of("messages"))
    assert response.status_code == 504
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "timeout_error"


def test_the_gateways_own_overload_on_messages_is_anthropics_overloaded_error():
    """Its 503s that say "try again" (no connection to be had, the pool held past its wait, a
    shutdown's cut) were ``api_error``, Anthropic's internal failure; Anthropic says overload
    with ``overloaded_error``."""
    from carpool.apis.messages import MessagesApi
    from carpool.errors import GatewayOverloaded, ShuttingDown, UpstreamBusy

    for error in (GatewayOverloaded("no port"), UpstreamBusy("r0"), ShuttingDown()):
        body = orjson.loads(MessagesApi().error_body(error))
        assert body["error"]["type"] == "overloaded_error", error


@BOTH
async def test_the_simulator_serves_each_api_through_the_gateway_streaming_or_not(kind):
    """The embedded simulated engine serves both APIs: the gateway stores its answer (a repeat is
    a hit), its typed stream ends with the API's last event and carries the same text, and its
    other paths stay a 404 in the API's error shape."""
    async with run_gateway([]) as sim:
        first = await sim.client.post(path_of(kind), json=body_of(kind))
        assert first.status_code == 200 and first.headers["x-carpool"] == "miss"
        assert_complete(kind, first.json())
        again = await sim.client.post(path_of(kind), json=body_of(kind))
        assert again.headers["x-carpool"] == "hit" and again.json() == first.json()
        streamed, raw = await stream(sim, path_of(kind), body_of(kind, "another question"))
        assert streamed.status_code == 200 and streamed.headers["x-carpool"] == "miss"
        deltas = [
            e
            for e in typed(kind, raw)
            if e["type"] in ("response.output_text.delta", "content_block_delta")
        ]
        assert len(deltas) > 1  # one delta per decoded token
        whole = await sim.client.post(path_of(kind), json=body_of(kind, "another question"))
        assert whole.headers["x-carpool"] == "hit"
        assert body_text(kind, whole.json()) == stream_text(kind, raw)
        if kind == "messages":
            async with anthropic.AsyncAnthropic(
                base_url=sim.url, api_key="k", max_retries=0
            ) as client:
                message = await client.messages.create(
                    model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
                )
                assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
                with pytest.raises(anthropic.NotFoundError, match="simulated engine"):
                    await client.messages.count_tokens(
                        model="m", messages=[{"role": "user", "content": "hi"}]
                    )
        else:
            async with openai.AsyncOpenAI(
                base_url=sim.url + "/v1", api_key="k", max_retries=0
            ) as client:
                response = await client.responses.create(model="m", input="hi", temperature=0)
                assert response.status == "completed" and response.output_text
                with pytest.raises(openai.NotFoundError, match="Responses API"):
                    await client.responses.retrieve("resp_1")


# --- the semantic view and the per-API forms ----------------------------------------------------


def view_of(path: str, body: dict[str, Any]):
    config = Config()
    request = parse(ClientRequest(path, orjson.dumps(body), {}), 1 << 20)
    return semantic_view(request, fingerprint(request, config), config)


def test_the_semantic_view_is_the_last_user_input_and_the_rest_is_in_the_scope():
    plain = view_of(RESPONSES, body_of("responses", "How do I reset my password?", store=False))
    assert plain.text == "How do I reset my password?"
    items = view_of(
        RESPONSES,
        body_of(
            "responses",
            [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "How do I reset my password?"}],
                },
            ],
            store=False,
        ),
    )
    assert items.text == plain.text and items.scope != plain.scope  # earlier turns: scope
    instructed = view_of(
        RESPONSES,
        body_of(
            "responses",
            "How do I reset my password?",
            instructions="Answer in French.",
            store=False,
        ),
    )
    assert instructed.text == plain.text and instructed.scope != plain.scope
    message = view_of(MESSAGES, body_of("messages", "How do I reset my password?"))
    system = view_of(
        MESSAGES, body_of("messages", "How do I reset my password?", system="You are a bank.")
    )
    assert message.text == system.text == plain.text and message.scope != system.scope
    image = body_of("messages")
    image["messages"][-1]["content"] = [{"type": "image", "source": {}}]
    assert view_of(MESSAGES, image) is None
    unstored = body_of("responses", store=False)
    assert view_of(RESPONSES, without(unstored, "temperature")) is None  # sampled
    # Stored (the default): the answer's id names the response kept for another input.
    assert view_of(RESPONSES, body_of("responses")) is None
    assert view_of(RESPONSES, body_of("responses", store=True)) is None


def test_a_stored_chat_completion_has_no_semantic_view():
    # Its answer's id names the completion kept for its prompt (GET .../{id}/messages): a
    # paraphrase served it would hold an id whose messages are another prompt's.
    assert view_of(CHAT, body_of("messages")) is not None
    assert view_of(CHAT, body_of("messages", store=True)) is None
    assert view_of(CHAT, body_of("messages", store=False)) is not None


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "m", "temperature": 0, "prompt": QUESTION}),
        ("/v1/chat/completions", body_of("messages")),
    ],
    ids=["completion", "chat"],
)
@pytest.mark.parametrize(
    "echoing",
    [
        {"echo": True},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 5},
        {"return_token_ids": True},
        {"return_prompt_text": True},  # (vLLM's: the rendered prompt, system prompt and all)
        {"return_prompt_token_ids": True},  # (SGLang's)
    ],
)
def test_a_request_whose_answer_repeats_its_prompt_has_no_semantic_view(path, body, echoing):
    # The answer holds the prompt (echo, vLLM's prompt_logprobs, vLLM's return_token_ids:
    # prompt_token_ids decode to it): served to a paraphrase it would hand over another
    # request's prompt. Matched exactly only.
    assert view_of(path, body) is not None
    assert view_of(path, {**body, **echoing}) is None
    for off in (
        {"echo": False},
        {"echo": None, "prompt_logprobs": None},
        {"return_token_ids": False},
    ):
        assert view_of(path, {**body, **off}) is not None


@pytest.mark.parametrize("asked", [True, 1, "yes"])
def test_a_responses_request_whose_answer_repeats_its_prompt_has_no_semantic_view(asked):
    # vLLM's enable_response_messages: the answer carries the whole prompt (input_messages),
    # which a paraphrase from another tenant of a shared namespace would be handed.
    body = body_of("responses", store=False)
    assert view_of(RESPONSES, body) is not None
    assert view_of(RESPONSES, {**body, "enable_response_messages": asked}) is None
    for off in (False, None):
        assert view_of(RESPONSES, {**body, "enable_response_messages": off}) is not None


def test_a_responses_answer_that_carries_its_prompt_is_never_stored_semantically():
    # Whatever asked for it, an answer holding input_messages holds its prompt.
    from carpool.apis.openai import answer_repeats_prompt

    prompt = [{"author": {"role": "user"}, "content": [{"type": "text", "text": QUESTION}]}]
    answer = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
    assert answer_repeats_prompt(orjson.dumps({**answer, "input_messages": prompt}))
    assert answer_repeats_prompt(orjson.dumps({**answer, "input_messages": []}))
    assert not answer_repeats_prompt(orjson.dumps({**answer, "input_messages": None}))
    assert not answer_repeats_prompt(orjson.dumps({**answer, "output_messages": prompt}))
    quoted = {**answer, "output": [{"type": "message", "content": '"input_messages": [1]'}]}
    assert not answer_repeats_prompt(orjson.dumps(quoted))


def test_a_responses_answer_synthesized_into_events_assembles_back_to_itself():
    body = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": "m",
        "output": [
            {"id": "rs_1", "type": "reasoning", "summary": []},
            {
                "id": "msg_1",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "Hello", "annotations": []},
                    {"type": "refusal", "refusal": "No."},
                ],
            },
            {
                "id": "fc_1",
                "type": "function_call",
                "status": "completed",
                "call_id": "call_1",
                "name": "f",
                "arguments": '{"a": 1}',
            },
        ],
        "usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
    }
    api = api_of("responses")
    frames = api.synthesize(body, True)
    chunks = typed("responses", b"".join(frames).decode())
    assert [c["sequence_number"] for c in chunks] == list(range(len(chunks)))
    assert api.judge_stream(chunks, None) == (body, True)
    assert responses_api.assemble(chunks[:-1]) == {
        **body,
        "status": "in_progress",
        "output": body["output"],
        "usage": None,
    }
    assert api.usage_tokens(body) == 7


def test_a_message_synthesized_into_events_assembles_back_to_itself():
    body = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "text", "text": "Hello", "citations": [{"x": 1}]},
            {"type": "tool_use", "id": "tu_1", "name": "f", "input": {"a": [1, 2]}},
            {"type": "redacted_thinking", "data": "xyz"},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    api = api_of("messages")
    chunks = typed("messages", b"".join(api.synthesize(body, True)).decode())
    assert api.judge_stream(chunks, None) == (body, True)
    assert list(messages_api.assemble(chunks)) == list(body)  # in the body's key order
    assert api.usage_tokens(body) == 7
    assert not api.complete({**body, "stop_reason": None})


def test_a_paused_turn_is_served_and_replayed_but_never_stored():
    # ``pause_turn``: Anthropic paused a long turn (its own tools) for the client to send it
    # back and go on: not a complete answer to share, though a retry of the same call replays it.
    api = api_of("messages")
    paused = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Searching"}],
        "stop_reason": "pause_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    assert not api.complete(paused) and api.final(paused)
    assert api.complete({**paused, "stop_reason": "end_turn"})
    chunks = typed("messages", b"".join(api.synthesize(paused, True)).decode())
    assert api.judge_stream(chunks, None) == (paused, False)


# --- the official SDKs -------------------------------------------------------------------------


async def test_the_openai_sdk_responses_20_concurrent_half_streaming_make_one_call_and_a_repeat_is_a_hit(  # noqa: E501
    gw, fake
):
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-test", max_retries=0
    ) as client:
        ask = {"model": "m", "input": QUESTION, "temperature": 0}

        async def streaming() -> str:
            deltas = []
            async for event in await client.responses.create(**ask, stream=True):
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            return "".join(deltas)

        async def whole() -> str:
            return (await client.responses.create(**ask)).output_text

        fake.gate = asyncio.Event()
        leader = asyncio.create_task(streaming())  # the call streams: live fan-out
        await fake.wait_for_calls(1)
        others = [asyncio.create_task(streaming() if i % 2 else whole()) for i in range(19)]
        await eventually(lambda: flight_clients(gw) == 20, what="20 clients in the flight")
        fake.gate.set()
        texts = await asyncio.gather(leader, *others)
        assert set(texts) == {f"answer 1 to {QUESTION}"}
        assert fake.count() == 1
        stats = gw.gateway.snapshot()
        assert (stats["misses"], stats["coalesced"]) == (1, 19)

        raw = await client.responses.with_raw_response.create(**ask)
        assert raw.headers["x-carpool"] == "hit" and raw.parse().output_text == texts[0]
        raw = await client.responses.with_raw_response.create(**ask, stream=True)
        assert raw.headers["x-carpool"] == "hit"
        deltas = [e.delta async for e in raw.parse() if e.type == "response.output_text.delta"]
        assert "".join(deltas) == texts[0]
        assert fake.count() == 1


async def test_the_openai_sdk_responses_stream_helper_reads_a_synthesized_hit(gw, fake):
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-test", max_retries=0
    ) as client:
        ask = {"model": "m", "input": QUESTION, "temperature": 0}
        first = await client.responses.create(**ask)  # whole: the hit is synthesized
        async with client.responses.stream(**ask) as events:
            final = await events.get_final_response()
        assert final.output_text == first.output_text and final.id == first.id
        assert final.usage.output_tokens == first.usage.output_tokens
        assert fake.count() == 1


# A reasoning model's answer, with its text's logprobs (``include``), as OpenAI and vLLM make it.
LOGPROBS = [
    {"token": "Hello", "logprob": -0.1, "bytes": [72, 101, 108, 108, 111], "top_logprobs": []},
    {
        "token": " world",
        "logprob": -0.2,
        "bytes": [32, 119, 111, 114, 108, 100],
        "top_logprobs": [],
    },
]
REASONING_OUTPUT = [
    {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [
            {"type": "summary_text", "text": "First, think."},
            {"type": "summary_text", "text": "Then, answer."},
        ],
        "content": [{"type": "reasoning_text", "text": "The user greets me."}],
    },
    {
        "id": "msg_1",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [
            {"type": "output_text", "text": "Hello world", "annotations": [], "logprobs": LOGPROBS}
        ],
    },
]


async def test_a_replayed_responses_stream_carries_reasoning_summaries_and_logprobs(gw, fake):
    # A whole answer replayed as a stream (a hit) dropped what a stream of the engine carries:
    # the text's logprobs (its deltas said []) and the reasoning's summary and text, which came
    # whole in the item only (a client showing them as they stream showed nothing).
    fake.responses_output = REASONING_OUTPUT
    ask = {
        "model": "m",
        "input": QUESTION,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "reasoning": {"summary": "auto"},
    }
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-test", max_retries=0
    ) as client:
        first = await client.responses.create(**ask)
        streamed = [event async for event in await client.responses.create(**ask, stream=True)]
        async with client.responses.stream(**ask) as events:
            helped = [event.type async for event in events]
            final = await events.get_final_response()
    assert fake.count() == 1
    assert final.output_text == first.output_text == "Hello world"
    assert final.output[0].model_dump() == first.output[0].model_dump()
    kinds = [event.type for event in streamed]
    assert [kind for kind in helped if "reasoning" in kind] == [
        kind for kind in kinds if "reasoning" in kind
    ]
    summary = [
        (event.type, event.summary_index, getattr(event, "delta", None))
        for event in streamed
        if event.type.startswith("response.reasoning_summary")
    ]
    assert summary == [
        (f"response.reasoning_summary_{step}", index, delta)
        for index, text in enumerate(["First, think.", "Then, answer."])
        for step, delta in (
            ("part.added", None),
            ("text.delta", text),
            ("text.done", None),
            ("part.done", None),
        )
    ]
    assert [e.delta for e in streamed if e.type == "response.reasoning_text.delta"] == [
        "The user greets me."
    ]
    added = next(e for e in streamed if e.type == "response.output_item.added")
    assert added.item.summary == [] and kinds.index("response.reasoning_summary_part.added") > (
        kinds.index("response.output_item.added")
    )
    for kind in ("response.output_text.delta", "response.output_text.done"):
        (event,) = [e for e in streamed if e.type == kind]
        assert [p.model_dump() for p in event.logprobs] == LOGPROBS, kind


async def test_the_anthropic_sdk_20_concurrent_messages_half_streaming_make_one_call_and_a_repeat_is_a_hit(  # noqa: E501
    gw, fake
):
    async with anthropic_client(gw) as client:
        ask = dict(GREEDY_MESSAGE)

        async def helper() -> str:  # messages.stream()
            async with client.messages.stream(**ask) as events:
                return await events.get_final_text()

        async def streaming() -> str:  # messages.create(stream=True)
            parts = []
            async for event in await client.messages.create(**ask, stream=True):
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    parts.append(event.delta.text)
            return "".join(parts)

        async def whole() -> str:
            message = await client.messages.create(**ask)
            return "".join(block.text for block in message.content if block.type == "text")

        fake.gate = asyncio.Event()
        leader = asyncio.create_task(helper())
        await fake.wait_for_calls(1)
        others = [
            asyncio.create_task((helper, streaming)[i % 2]() if i < 9 else whole())
            for i in range(19)
        ]
        await eventually(lambda: flight_clients(gw) == 20, what="20 clients in the flight")
        fake.gate.set()
        texts = await asyncio.gather(leader, *others)
        assert set(texts) == {f"answer 1 to {QUESTION}"}
        assert fake.count() == 1
        # The SDK's credential (``x-api-key``, or ``Authorization: Bearer`` in recent
        # versions) and ``anthropic-version`` reached the upstream.
        sent = fake.calls[0].headers
        assert "sk-ant-test" in (sent.get("x-api-key"), sent.get("authorization", "")[7:])
        assert sent["anthropic-version"]
        stats = gw.gateway.snapshot()
        assert (stats["misses"], stats["coalesced"]) == (1, 19)

        raw = await client.messages.with_raw_response.create(**ask)
        assert raw.headers["x-carpool"] == "hit"
        assert (await raw.parse()).content[0].text == texts[0]
        assert await helper() == texts[0]
        assert fake.count() == 1 and gw.gateway.snapshot()["hits"] == 2


async def test_the_anthropic_sdk_stream_helper_reads_a_synthesized_hit(gw, fake):
    async with anthropic_client(gw) as client:
        ask = dict(GREEDY_MESSAGE)
        first = await client.messages.create(**ask)  # whole: the hit is synthesized
        async with client.messages.stream(**ask) as events:
            final = await events.get_final_message()
        assert final.content[0].text == first.content[0].text and final.id == first.id
        assert final.stop_reason == "end_turn" and final.usage == first.usage
        assert fake.count() == 1


async def test_the_anthropic_sdk_stream_helper_reads_a_synthesized_hit_of_a_message_without_usage(
    gw, fake
):
    """An engine's whole message without ``usage`` (or a thinking block without a signature, as
    engines other than Anthropic's answer it): the synthesized stream's ``message_start``
    carried no usage, and the SDK's stream helper raised on the hit (AttributeError on
    ``output_tokens``); the thinking block gained an empty ``signature`` it never had."""
    fake.omit_message_usage = True
    fake.message_content = [
        {"type": "thinking", "thinking": "hmm"},
        {"type": "text", "text": "Hello"},
    ]
    async with anthropic_client(gw) as client:
        ask = dict(GREEDY_MESSAGE)
        first = await client.messages.with_raw_response.create(**ask)
        assert first.headers["x-carpool"] == "miss"
        async with client.messages.stream(**ask) as events:
            final = await events.get_final_message()
        assert final.content[1].text == "Hello" and final.stop_reason == "end_turn"
        thinking = final.content[0].model_dump(exclude_unset=True)
        assert thinking == {"type": "thinking", "thinking": "hmm"}
        assert fake.count() == 1


def prompt_cached(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Messages stream whose prompt was mostly written to and read from Anthropic's prompt
    cache: counted apart from ``input_tokens``, as Anthropic reports them."""
    for event in events:
        if event["type"] == "message_start":
            event["message"]["usage"].update(
                input_tokens=10, cache_creation_input_tokens=7000, cache_read_input_tokens=990
            )
    return events


async def test_tokens_saved_counts_the_prompt_tokens_anthropic_reports_apart_for_its_cache(
    gw, fake
):
    # tokens_saved is prompt + completion tokens not recomputed: a message's prompt is its
    # input_tokens and the tokens its prompt cache wrote and read, as OpenAI's cached tokens
    # are inside prompt_tokens.
    fake.message_events = prompt_cached
    body = body_of("messages")
    first, _ = await stream(gw, MESSAGES, body)
    assert first.headers["x-carpool"] == "miss"
    whole = await gw.client.post(MESSAGES, json=body)
    streamed, _ = await stream(gw, MESSAGES, body)
    assert (whole.headers["x-carpool"], streamed.headers["x-carpool"]) == ("hit", "hit")
    usage = whole.json()["usage"]
    assert usage["cache_creation_input_tokens"] == 7000
    prompt_and_completion = sum(usage.values())  # input, output, cache written, cache read
    stats = (await gw.client.get("/stats")).json()
    assert stats["tokens_saved"] == 2 * prompt_and_completion > 2 * 7990


async def test_a_null_stream_asks_for_a_whole_message(gw, fake):
    # As the OpenAI APIs take it (tests/test_openai_sdk.py): null is no stream, and the
    # upstream is asked without it.
    async with anthropic_client(gw) as client:
        ask: dict[str, Any] = dict(GREEDY_MESSAGE)
        raw = await client.messages.with_raw_response.create(**ask, stream=None)
        assert raw.http_request.content.count(b'"stream":null') == 1
        assert raw.headers["x-carpool"] == "miss"
        whole = await raw.parse()
        assert whole.stop_reason == "end_turn" and "stream" not in fake.calls[0].body
        again = await client.messages.with_raw_response.create(**ask)
        assert again.headers["x-carpool"] == "hit" and fake.count() == 1


async def test_the_sdks_raise_on_a_stream_that_fails_part_way(gw, fake):
    fake.error_after = 2
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-test", max_retries=0
    ) as client:
        with pytest.raises(openai.APIError, match="fake upstream stream failure"):
            async for _ in await client.responses.create(
                model="m", input=QUESTION, temperature=0, stream=True
            ):
                pass
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0) as client:
        with pytest.raises(anthropic.APIStatusError, match="fake upstream stream failure"):
            async with client.messages.stream(
                model="m",
                max_tokens=8,
                extra_body={"temperature": 0},
                messages=[{"role": "user", "content": QUESTION}],
            ) as events:
                await events.get_final_message()
    assert fake.count() == 2


# --- review fixes: what a bypassed stream's failure, idempotency, the key and sharing must do ---


@BOTH
async def test_a_bypassed_typed_stream_that_fails_ends_with_the_apis_named_error_event(
    gw, fake, kind
):
    fake.error_after = 2
    sampled = without(body_of(kind), "temperature")
    response, raw = await stream(gw, path_of(kind), sampled)
    assert response.headers["x-carpool"] == "bypass"
    name, data = events(raw)[-1]
    assert name == "error" and data["type"] == "error"


async def test_the_anthropic_sdk_raises_on_a_bypassed_stream_that_fails(gw, fake):
    fake.error_after = 2
    sdk = anthropic.AsyncAnthropic(base_url=gw.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError):
        async with sdk.messages.stream(
            model="m", max_tokens=64, messages=[{"role": "user", "content": QUESTION}]
        ) as events_:
            async for _ in events_:
                pass


@pytest.mark.parametrize(
    "extra",
    [{"background": True}, {"conversation": "conv_1"}, {}],
    ids=["background", "conversation", "incomplete"],
)
async def test_an_idempotent_response_the_upstream_took_is_replayed_not_run_again(gw, fake, extra):
    fake.omit_finish_reason = True  # an ``incomplete`` response: taken, not whole
    headers = {"Idempotency-Key": '"resp-1"'}
    body = body_of("responses", **extra)
    first = await gw.client.post(RESPONSES, json=body, headers=headers)
    retry = await gw.client.post(RESPONSES, json=body, headers=headers)
    assert retry.headers.get("idempotent-replayed") == "true"
    assert retry.json()["id"] == first.json()["id"] and fake.count() == 1


async def test_responses_metadata_and_user_are_in_the_key_since_the_answer_echoes_them(gw, fake):
    alice = await gw.client.post(
        RESPONSES, json=body_of("responses", user="alice", metadata={"customer": "alice"})
    )
    bob = await gw.client.post(
        RESPONSES, json=body_of("responses", user="bob", metadata={"customer": "bob"})
    )
    assert [r.headers["x-carpool"] for r in (alice, bob)] == ["miss", "miss"]


async def test_a_stored_response_is_never_shared_across_tenants_even_in_a_shared_namespace(
    fake, gateway_with
):
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        for key in ("a", "b"):  # both accepted by the upstream
            await gw.client.post(
                RESPONSES,
                json=body_of("responses", "warm " + key),
                headers={"Authorization": f"Bearer {key}"},
            )
        for store, shares in ((None, False), (False, True)):
            extra = {} if store is None else {"store": store}
            body = body_of("responses", f"stored {store}", **extra)
            await gw.client.post(
                RESPONSES, json=body, headers={"Authorization": "Bearer a", **shared}
            )
            other = await gw.client.post(
                RESPONSES, json=body, headers={"Authorization": "Bearer b", **shared}
            )
            assert (other.headers["x-carpool"] == "hit") is shares, store


FILE_PART = {"type": "file", "file": {"file_id": "file-of-a"}}
# A file named only inside a nested part: a tool's result (Messages), a function's output
# (Responses). Such requests were shared across tenants: Bob read Alice's answer on her file.
TOOL_RESULT_NAMING_A_FILE = [
    {"role": "user", "content": "describe the image the tool returned"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t",
                "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
            }
        ],
    },
]
# Shapes the walk of those parts did not enter either: a computer call's output (an object), a
# Messages document whose source is content blocks.
SCREENSHOT_NAMING_A_FILE = [
    {"type": "computer_call", "call_id": "c", "action": {"type": "screenshot"}},
    {
        "type": "computer_call_output",
        "call_id": "c",
        "output": {"type": "computer_screenshot", "file_id": "f"},
    },
    {"role": "user", "content": "what is on the screen?"},
]
CONTENT_DOCUMENT_NAMING_A_FILE = [
    {
        "role": "user",
        "content": [
            {
                "type": "document",
                "source": {
                    "type": "content",
                    "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                },
            },
            {"type": "text", "text": "describe it"},
        ],
    }
]
FUNCTION_OUTPUT_NAMING_A_FILE = [
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    {
        "type": "function_call_output",
        "call_id": "c",
        "output": [{"type": "input_file", "file_id": "f"}],
    },
    {"role": "user", "content": "summarize the file"},
]


HI = {"role": "user", "content": "hi"}
REASONING_BY_ID = {"type": "reasoning", "id": "rs_x", "summary": []}
MESSAGE_WITH_ITS_ID = {
    "type": "message",
    "id": "msg_x",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "hello"}],
}


@pytest.mark.parametrize(
    "path, body",
    [
        (RESPONSES, body_of("responses", store=False, previous_response_id="resp_of_a")),
        (RESPONSES, body_of("responses", store=False, prompt={"id": "pmpt_1", "version": "2"})),
        (
            RESPONSES,
            {**body_of("responses", store=False), "input": [{"type": "item_reference", "id": "x"}]},
        ),
        (
            RESPONSES,
            body_of(
                "responses",
                store=False,
                input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
            ),
        ),
        (
            MESSAGES,
            body_of(
                "messages",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "file", "file_id": "f"}}
                        ],
                    }
                ],
            ),
        ),
        (CHAT, {**body_of("messages"), "messages": [{"role": "user", "content": [FILE_PART]}]}),
        (CHAT, {**body_of("messages"), "store": True}),
        (MESSAGES, body_of("messages", messages=TOOL_RESULT_NAMING_A_FILE)),
        (RESPONSES, body_of("responses", store=False, input=FUNCTION_OUTPUT_NAMING_A_FILE)),
        (RESPONSES, body_of("responses", store=False, input=SCREENSHOT_NAMING_A_FILE)),
        (MESSAGES, body_of("messages", messages=CONTENT_DOCUMENT_NAMING_A_FILE)),
        # An item by its id alone (``ItemReference.type`` is optional), a reasoning item
        # without its encrypted content (read from the account's store), and an output item
        # sent back with its id (looked up too: "Item with id ... not found" for another's).
        (RESPONSES, body_of("responses", store=False, input=[{"id": "msg_x"}, HI])),
        (RESPONSES, body_of("responses", store=False, input=[REASONING_BY_ID, HI])),
        (RESPONSES, body_of("responses", store=False, input=[MESSAGE_WITH_ITS_ID, HI])),
        # What each account names its own (an OpenRouter preset and a LiteLLM prompt were
        # served another's: two accounts pick the same names), a pinned version too; a
        # Gemini context cache (its project's).
        (CHAT, {**body_of("messages"), "prompt_id": "my-prompt", "prompt_version": 2}),
        (RESPONSES, body_of("responses", store=False, prompt_id="my-prompt", prompt_version=2)),
        (CHAT, {**body_of("messages"), "cached_content": "cachedContents/c"}),
        (
            CHAT,
            {
                **body_of("messages"),
                "extra_body": {"google": {"cached_content": "cachedContents/c"}},
            },
        ),
    ],
)
async def test_a_request_naming_a_tenants_own_object_is_never_shared_across_tenants(
    fake, gateway_with, path, body
):
    # The upstream keeps files, responses, items and stored prompts per account: another
    # tenant naming one would be refused (404). In a shared namespace it read the owner's
    # answer (a hit, no upstream call).
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        for key in ("a", "b"):  # both accepted by the upstream for this endpoint and model
            warm = {**body, "store": False} if path == RESPONSES else body
            warm = {k: v for k, v in warm.items() if k not in ("previous_response_id", "prompt")}
            await gw.client.post(path, json={**warm, "max_tokens": 7}, headers=bearer_of(key))
        await gw.client.post(path, json=body, headers={**bearer_of("a"), **shared})
        calls = fake.count()
        other = await gw.client.post(path, json=body, headers={**bearer_of("b"), **shared})
        assert other.headers["x-carpool"] == "miss" and fake.count() == calls + 1


async def test_chat_audio_is_tenant_bound_in_a_shared_namespace(fake, gateway_with):
    # An audio answer's id names the audio the upstream keeps for the account that asked (a
    # later turn refers to it by ``audio.id``): another tenant must not be handed that id, nor
    # read the answer to a conversation naming one it could not.
    chat = {**body_of("messages"), "max_tokens": 7}
    asked = {**chat, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
    follow = {
        **chat,
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "audio": {"id": "audio_of_a"}},
            {"role": "user", "content": "And then?"},
        ],
    }
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        for key in ("a", "b"):  # both accepted by the upstream for this endpoint and model
            await gw.client.post(CHAT, json=chat, headers=bearer_of(key))
        for body in (asked, follow):
            first = await gw.client.post(CHAT, json=body, headers={**bearer_of("a"), **shared})
            assert first.status_code == 200
            calls = fake.count()
            other = await gw.client.post(CHAT, json=body, headers={**bearer_of("b"), **shared})
            assert other.headers["x-carpool"] == "miss" and fake.count() == calls + 1
            again = await gw.client.post(CHAT, json=body, headers={**bearer_of("a"), **shared})
            assert again.headers["x-carpool"] == "hit"  # (still cached for its own tenant)


def test_a_file_id_named_in_a_schema_or_metadata_does_not_bind_a_request_to_its_tenant():
    # The whole body was walked: a tool's or a response format's property called file_id, or
    # metadata.file_id (outside the key), kept a request out of its shared namespace.
    from carpool.apis.base import names_tenant_state

    schema = {"type": "object", "properties": {"file_id": {"type": "string"}}}
    chat = body_of("messages")
    assert not names_tenant_state({**chat, "metadata": {"file_id": "f"}})
    assert not names_tenant_state({**chat, "response_format": {"json_schema": {"schema": schema}}})
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    assert not names_tenant_state({**chat, "tools": [tool]})
    call = {"type": "tool_use", "id": "t", "name": "f", "input": {"file_id": "f"}}
    assert not names_tenant_state({**chat, "messages": [{"role": "assistant", "content": [call]}]})
    assert names_tenant_state({**chat, "messages": [{"role": "user", "content": [FILE_PART]}]})


def test_parts_nested_deeper_than_any_api_defines_are_taken_as_naming_a_tenants_object():
    # When unsure, a request is not shared: the walk does not go on for ever either.
    from carpool.apis.base import names_tenant_state

    part: dict = {"type": "text", "text": "x"}
    for _ in range(40):
        part = {"type": "tool_result", "content": [part]}
    assert names_tenant_state({"messages": [{"role": "user", "content": [part]}]})
    shallow = {"type": "tool_result", "content": [{"type": "text", "text": "x"}]}
    assert not names_tenant_state({"messages": [{"role": "user", "content": [shallow]}]})


def bearer_of(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("responses", {"tools": [{"type": "web_search"}]}),
        ("responses", {"tools": [{"type": "mcp", "server_url": "https://example.test"}]}),
        ("responses", {"prompt": {"id": "pmpt_1"}}),
        ("messages", {"mcp_servers": [{"type": "url", "url": "https://example.test"}]}),
        ("messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        # A template the account edits in place, read at its latest: OpenRouter's presets (by
        # the model, alone or after one, or its ``preset`` field), LiteLLM's ``prompt_id``
        # without its ``prompt_version``.
        ("messages", {"model": "@preset/code-reviewer"}),
        ("messages", {"model": "openai/gpt-4o@preset/code-reviewer"}),
        ("messages", {"preset": "code-reviewer"}),
        ("messages", {"prompt_id": "my-prompt"}),
        ("responses", {"model": "@preset/code-reviewer"}),
        ("responses", {"prompt_id": "my-prompt", "prompt_variables": {"topic": "x"}}),
    ],
)
async def test_server_tools_and_latest_prompts_are_never_shared(gw, fake, kind, extra):
    body = body_of(kind, **extra)
    first = await gw.client.post(path_of(kind), json=body)
    again = await gw.client.post(path_of(kind), json=body)
    assert [r.headers["x-carpool"] for r in (first, again)] == ["bypass", "bypass"]


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "browser_search"}]},  # (Groq's: the engine browses)
        {"tools": [{"type": "code_interpreter"}]},  # (Groq's: the engine runs code)
        {"tools": [{"type": "web_search"}]},
        {"model": "gpt-4o-search-preview"},  # (OpenAI's: searches without being asked)
        {"model": "gpt-5-search-api"},
        {"model": "sonar-pro"},  # (Perplexity's: every one searches)
        {"data_sources": [{"type": "azure_search", "parameters": {}}]},  # (Azure On Your Data)
        {"search_parameters": {"mode": "on"}},  # (xAI Live Search)
        {"plugins": [{"id": "web"}]},  # (OpenRouter's)
        {"model": "openai/gpt-4o:online"},  # (OpenRouter's: its web plugin, by the slug)
        {"model": "groq/compound"},  # (Groq's Compound: searches and runs code itself)
        {"model": "compound-beta-mini"},
        {"tools": [{"googleSearch": {}}]},  # (LiteLLM's Gemini grounding: a tool with no type)
        {"tools": [{"codeExecution": {}}]},
        {"enable_search": True},  # (Alibaba DashScope's)
        {"web_search": {"enable": True}},  # (Baidu Qianfan's)
        # vLLM's disaggregated prefill: the answer names this request's KV blocks held for its
        # decode (``remote_block_ids``), another client's decode would read them.
        {"kv_transfer_params": {"do_remote_decode": True}},
        {"ec_transfer_params": {"do_remote_encode": True}},  # (its encoder cache's: unsure)
    ],
)
async def test_a_chat_the_upstream_answers_from_the_web_or_a_code_run_is_never_shared(
    gw, fake, extra
):
    """Only ``web_search_options`` was taken for a live search: a chat with a tool the engine
    runs itself (Groq's ``browser_search``, ``code_interpreter``), a search model, or a
    provider's retrieval field was cached at temperature 0 and served an hour later (and
    coalesced), though its own call would have read the web, the index or the code's run as
    they are now. A function tool still shares."""
    body = {**body_of("messages"), **extra}
    first = await gw.client.post(CHAT, json=body)
    again = await gw.client.post(CHAT, json=body)
    assert [r.headers["x-carpool"] for r in (first, again)] == ["bypass", "bypass"]
    assert fake.count() == 2
    function = {"type": "function", "function": {"name": "f", "parameters": {}}}
    # (A plugin that reads nothing live, OpenRouter's response healing, shares; so does a
    # search turned off.)
    tooled = {
        **body_of("messages"),
        # (A function tool without its ``type``, which vLLM and SGLang take as a function's.)
        "tools": [function, {"function": {"name": "g", "parameters": {}}}],
        "plugins": [{"id": "response-healing"}],
        "search_parameters": {"mode": "off"},
        "enable_search": False,
        "web_search": {},  # (Baidu's is off unless ``enable``)
        "data_sources": [],
        "kv_transfer_params": None,
    }
    assert (await gw.client.post(CHAT, json=tooled)).headers["x-carpool"] == "miss"
    assert (await gw.client.post(CHAT, json=tooled)).headers["x-carpool"] == "hit"


async def test_chat_web_search_options_is_never_shared(gw, fake):
    # Chat's web search answers from a live search, as the Responses and Messages search
    # tools do: two identical requests are not the same request.
    body = {**body_of("messages"), "web_search_options": {"search_context_size": "low"}}
    first = await gw.client.post(CHAT, json=body)
    again = await gw.client.post(CHAT, json=body)
    assert [r.headers["x-carpool"] for r in (first, again)] == ["bypass", "bypass"]
    assert fake.count() == 2
    plain = await gw.client.post(CHAT, json=body_of("messages"))
    assert plain.headers["x-carpool"] == "miss"  # (without it, as any chat)


@BOTH
async def test_a_seed_does_not_make_these_apis_deterministic(gw, fake, kind):
    body = {**without(body_of(kind), "temperature"), "seed": 3}
    assert (await gw.client.post(path_of(kind), json=body)).headers["x-carpool"] == "bypass"


def test_malformed_upstream_answers_never_raise_in_assembly_or_synthesis():
    odd = {"object": "response", "status": ["completed"], "output": []}
    assert api_of("responses").synthesize(odd, False)  # a failed-looking stream, no crash
    message = messages_api.assemble(
        [
            {"type": "message_start", "message": {"usage": "x"}},
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": 5},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "a"},
            },
        ]
    )
    assert message["content"][0]["text"] == "5a"


# --- what a Messages stream carries besides text: the non-streaming answer keeps it all ----------

CONTEXT_MANAGEMENT = {
    "applied_edits": [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2, "cleared_input_tokens": 500}
    ]
}


def newer_message_stream(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fake's Messages stream as Anthropic streams a turn with compaction, a model fallback
    and context management: a compaction block (its summary in a ``compaction_delta``) and a
    ``fallback`` block (the model that served the rest) before the text, the applied edits at
    the top of ``message_delta``, beside its delta."""
    out: list[dict[str, Any]] = []
    for event in events:
        event = {**event}
        if "index" in event:
            event["index"] += 2
        if event["type"] == "message_start":
            event["message"] = {**event["message"], "context_management": None}
            out += [
                event,
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {
                        "type": "compaction",
                        "content": None,
                        "encrypted_content": None,
                    },
                },
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {
                        "type": "compaction_delta",
                        "content": "A summary of the earlier turns.",
                        "encrypted_content": "ZW5jcnlwdGVk",
                    },
                },
                {"type": "content_block_stop", "index": 0},
                {
                    "type": "content_block_start",
                    "index": 1,
                    "content_block": {
                        "type": "fallback",
                        "from": {"model": "m"},
                        "to": {"model": "m-fallback"},
                        "trigger": {"type": "refusal"},
                    },
                },
                {"type": "content_block_stop", "index": 1},
            ]
            continue
        if event["type"] == "message_delta":
            event["context_management"] = CONTEXT_MANAGEMENT
        out.append(event)
    return out


async def test_a_whole_answer_of_a_streamed_message_is_what_the_anthropic_sdk_accumulates(gw, fake):
    # The SDK reads the upstream's own stream (a miss), then the non-streaming answer carpool
    # assembled from it (a hit): the same message, compaction summary, fallback model and
    # applied context edits included.
    fake.message_events = newer_message_stream
    async with anthropic_client(gw) as client:
        ask: dict[str, Any] = {**GREEDY_MESSAGE, "betas": ["context-management-2025-06-27"]}
        async with client.beta.messages.stream(**ask) as events:
            streamed = await events.get_final_message()
        raw = await client.beta.messages.with_raw_response.create(**ask)
        assert raw.headers["x-carpool"] == "hit" and fake.count() == 1
        whole = await raw.parse()
    assert whole.model_dump(exclude={"content"}) == streamed.model_dump(exclude={"content"})
    assert whole.model == "m-fallback"
    assert whole.context_management is not None
    assert whole.context_management.model_dump() == CONTEXT_MANAGEMENT
    compaction = whole.content[0]
    assert compaction.type == "compaction"
    assert compaction.content == "A summary of the earlier turns."
    assert compaction.encrypted_content == "ZW5jcnlwdGVk"
    assert [block.model_dump() for block in whole.content] == [
        block.model_dump(exclude={"parsed_output"}) for block in streamed.content
    ]


@pytest.mark.parametrize(
    "odd",
    [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "novel_delta", "x": 1}},
        {"type": "novel_event", "x": 1},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta"}},
    ],
    ids=["unknown delta", "unknown event", "delta of another block type"],
)
async def test_a_message_stream_carpool_cannot_assemble_faithfully_is_relayed_but_never_stored(
    gw, fake, odd
):
    # Its non-streaming form would lack what the event carried: not stored, not lingering for
    # later requests to join; the stream itself reaches its client as it came.
    fake.message_events = lambda events: [*events[:-2], odd, *events[-2:]]
    streamed, raw = await stream(gw, MESSAGES, body_of("messages"))
    assert streamed.headers["x-carpool"] == "miss"
    assert (odd["type"], odd) in events(raw) and events(raw)[-1][0] == "message_stop"
    assert gw.gateway.store.entries == 0
    again, raw = await stream(gw, MESSAGES, body_of("messages"))
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2


CUT_PIECES = ['{"location"', ': "San', " Fra"]


def tool_input_cut_by_max_tokens(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message stream whose only block is a tool call cut by ``max_tokens`` mid-way through
    its input's JSON (in three pieces: the fake holds its stream at the third)."""
    return [
        events[0],
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}},
        },
        *[
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": piece},
            }
            for piece in CUT_PIECES
        ],
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"output_tokens": 8},
        },
        {"type": "message_stop"},
    ]


async def test_a_tool_input_cut_short_is_an_object_for_its_flight_and_never_stored(gw, fake):
    # Its JSON does not parse: a non-streaming client of the flight gets the input as the
    # anthropic SDK's accumulation of the stream makes it (an object: ``{}``, here), and the
    # message, short of what the stream carried, is not stored for later requests.
    fake.message_events = tool_input_cut_by_max_tokens
    body = body_of("messages", tools=[{"name": "weather", "input_schema": {"type": "object"}}])
    (leader, raw), (joiner, joined), plain = await leader_and_joiners(gw, fake, MESSAGES, body)
    assert leader.headers["x-carpool"] == "miss" and joined == raw
    relayed = [e["delta"] for e in typed("messages", raw) if e["type"] == "content_block_delta"]
    assert [delta["partial_json"] for delta in relayed] == CUT_PIECES  # (as they came)
    assert plain.status_code == 200 and plain.headers["x-carpool"] == "coalesced"
    assert plain.json()["stop_reason"] == "max_tokens"
    assert plain.json()["content"] == [
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    ]
    assert gw.gateway.store.entries == 0
    async with anthropic_client(gw) as client:
        ask: dict[str, Any] = {
            **GREEDY_MESSAGE,
            "messages": body["messages"],
            "tools": body["tools"],
        }
        async with client.messages.stream(**ask) as stream_events:
            accumulated = await stream_events.get_final_message()
        assert stream_events.response.headers["x-carpool"] == "miss" and fake.count() == 2
        assert accumulated.content[0].input == plain.json()["content"][0]["input"]
        raw_again = await client.messages.with_raw_response.create(**ask)
        assert raw_again.headers["x-carpool"] == "miss" and fake.count() == 3


def test_a_synthesized_message_stream_sends_compaction_and_context_management_as_anthropic_does():
    # The summary in a compaction_delta after a block start without it, the applied context
    # edits at the top of message_delta (null in message_start): a client reading the events
    # (not only the SDK's accumulation) finds them where Anthropic puts them.
    body = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m-fallback",
        "content": [
            {"type": "compaction", "content": "summary", "encrypted_content": "ZW5j"},
            {"type": "fallback", "from": {"model": "m"}, "to": {"model": "m-fallback"}},
            {"type": "text", "text": "Hello"},
        ],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "context_management": CONTEXT_MANAGEMENT,
        "usage": {"input_tokens": 3, "output_tokens": 4},
    }
    api = api_of("messages")
    chunks = typed("messages", b"".join(api.synthesize(body, True)).decode())
    assert chunks[0]["message"]["context_management"] is None
    assert chunks[1]["content_block"] == {
        "type": "compaction",
        "content": None,
        "encrypted_content": None,
    }
    assert chunks[2]["delta"] == {
        "type": "compaction_delta",
        "content": "summary",
        "encrypted_content": "ZW5j",
    }
    (delta,) = [chunk for chunk in chunks if chunk["type"] == "message_delta"]
    assert delta["context_management"] == CONTEXT_MANAGEMENT
    assert api.judge_stream(chunks, None) == (body, True)
    assert list(messages_api.assemble(chunks)) == list(body)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/"])
async def test_the_gateways_refusals_on_messages_are_anthropic_shaped_with_a_slash_too(
    fake, gateway_with, tmp_path, path
):
    # /v1/messages/ is served as /v1/messages; a client key refused there, and headers over the
    # limit, were answered in OpenAI's shape without ``x-carpool: bypass``.
    keys = tmp_path / "keys"
    keys.write_text("good\n")
    ask = {
        "model": "m",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}],
    }
    config = {"auth": {"client_keys_file": str(keys)}, "limits": {"max_header_bytes": 4096}}
    async with gateway_with(**config) as gw:
        served = await gw.client.post(path, json=ask, headers={"x-api-key": "good"})
        refused = await gw.client.post(path, json=ask, headers={"x-api-key": "bad"})
        padded = {"x-api-key": "good", "x-pad": "p" * 8000}
        too_large = await gw.client.post(path, json=ask, headers=padded)
    assert served.status_code == 200 and served.headers["x-carpool"] == "miss"
    for answer, status, kind in ((refused, 401, "authentication_error"), (too_large, 431, None)):
        assert answer.status_code == status and answer.headers["x-carpool"] == "bypass"
        assert answer.json()["type"] == "error"
        assert kind is None or answer.json()["error"]["type"] == kind


async def test_an_audio_answer_is_not_served_past_the_time_its_audio_expires_upstream():
    """A chat's audio answer names audio the upstream keeps until ``expires_at`` (for the next
    turn, ``{"role": "assistant", "audio": {"id": ...}}``); stored for its type's TTL (an hour),
    a hit handed out an id already gone, whose next turn the upstream refused though the
    client's own call would have worked. It is kept no longer than its audio."""
    import json

    from carpool.clock import ManualClock
    from conftest import run_gateway
    from fakes.raw_upstream import answer, raw_upstream

    clock = ManualClock()
    audio = {"id": "audio_1", "data": "UklGRg==", "transcript": "hi", "expires_at": 0}

    def respond(_call):
        audio["expires_at"] = int(clock.now()) + 10
        message = {"role": "assistant", "content": None, "audio": audio}
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": int(clock.now()),
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
        return answer(200, b"OK", json.dumps(body).encode())

    body = {
        "model": "m",
        "temperature": 0,
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "messages": [{"role": "user", "content": "say hi"}],
    }
    async with raw_upstream(respond) as up, run_gateway([up.url], clock=clock) as gw:
        outcomes = [(await gw.client.post(CHAT, json=body)).headers["x-carpool"]]
        clock.advance(5)  # (its audio still kept upstream)
        outcomes.append((await gw.client.post(CHAT, json=body)).headers["x-carpool"])
        clock.advance(6)  # (past it: the id names nothing now)
        outcomes.append((await gw.client.post(CHAT, json=body)).headers["x-carpool"])
    assert outcomes == ["miss", "hit", "miss"]
    assert len(up.calls) == 2


async def _each_tenants_own(gw, fake, path: str, warm: dict, body: dict) -> None:
    """``body`` sent in the shared namespace ``docs`` by tenant a, then b (both accepted by
    the upstream first, with ``warm``): b's is a call of its own; a's repeat is still a hit."""
    shared = {"x-carpool-namespace": "docs"}
    for key in ("a", "b"):
        await gw.client.post(path, json=warm, headers=bearer_of(key))
    first = await gw.client.post(path, json=body, headers={**bearer_of("a"), **shared})
    assert first.status_code == 200, first.text
    calls = fake.count()
    other = await gw.client.post(path, json=body, headers={**bearer_of("b"), **shared})
    assert other.headers["x-carpool"] == "miss" and fake.count() == calls + 1, body
    again = await gw.client.post(path, json=body, headers={**bearer_of("a"), **shared})
    assert again.headers["x-carpool"] == "hit"  # (still cached for its own tenant)


async def test_responses_encrypted_reasoning_is_tenant_bound_in_a_shared_namespace(
    fake, gateway_with
):
    """A stateless Responses turn (``store: false``) asking ``include:
    ["reasoning.encrypted_content"]`` gets reasoning the upstream encrypts for its organization
    alone; the next turn sends it back, and OpenAI refuses another organization's
    (``invalid_encrypted_content``). In a shared namespace it was served to the other tenants,
    whose next turn then failed, and a turn carrying one tenant's encrypted item was answered
    for another (the upstream would have refused it that). Both are their tenant's now."""
    fake.responses_output = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "enc:org-a"},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "fine", "annotations": []}],
        },
    ]
    base = {**body_of("responses"), "store": False}
    carried = {
        **base,
        "input": [
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "enc:org-a"},
            {"role": "user", "content": "And then?"},
        ],
    }
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        for body in (
            {**base, "include": ["reasoning.encrypted_content"]},
            carried,
            {**base, "context_management": [{"type": "compaction", "compact_threshold": 1}]},
        ):
            await _each_tenants_own(gw, fake, "/v1/responses", base, body)


@pytest.mark.parametrize(
    "extra",
    [
        # Compaction by ``context_management``, or by its own parameter: the answer's block
        # (its ``encrypted_content``, or signed) is round-tripped verbatim by the next turn;
        # whether Anthropic takes it from another organization is not said: not shared.
        {"context_management": {"edits": [{"type": "compact_20260112"}]}},
        {"compaction": {"type": "summarize"}},
        # The turn sending back a signed compaction block (no ``encrypted_content``).
        {
            "messages": [
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": [{"type": "compaction", "content": "summary", "signature": "s"}],
                },
                {"role": "user", "content": "And then?"},
            ]
        },
    ],
    ids=["context_management", "compaction", "a-signed-block-sent-back"],
)
async def test_a_messages_compaction_is_tenant_bound_in_a_shared_namespace(
    fake, gateway_with, extra
):
    """A Messages turn asking for compaction, or carrying its block back, was shared across a
    shared namespace's tenants: another tenant got, or sent, one organization's block."""
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        warm = body_of("messages")
        await _each_tenants_own(gw, fake, "/v1/messages", warm, {**warm, **extra})


async def test_a_completion_naming_kv_blocks_for_a_remote_decode_is_never_shared(gw, fake):
    """vLLM's disaggregated prefill goes through ``/v1/completions`` in its own proxies: the
    answer names this request's KV blocks (``kv_transfer_params``), so a hit handed another
    client's decode blocks already read or freed. As on chat: never shared."""
    body = {
        "model": "m",
        "temperature": 0,
        "max_tokens": 1,
        "prompt": "a long shared document",
        "kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": None},
    }
    first = await gw.client.post("/v1/completions", json=body)
    again = await gw.client.post("/v1/completions", json=body)
    assert [r.headers["x-carpool"] for r in (first, again)] == ["bypass", "bypass"]
    assert fake.count() == 2


async def test_in_front_of_tgi_a_greedy_looking_request_it_samples_is_never_shared(
    fake, gateway_with
):
    """``upstream.engine: tgi``: TGI samples ``temperature: 0`` with ``top_p`` 0.9 (a warper,
    and a random seed of its own), and drops ``top_k``: each was served the first sample."""
    async with gateway_with(upstream={"engine": "tgi"}) as gw:
        for extra in ({"temperature": 0, "top_p": 0.9}, {"top_k": 1}):
            body = {**without(body_of("messages"), "temperature"), **extra}
            outcomes = [(await gw.client.post(CHAT, json=body)).headers["x-carpool"] for _ in "ab"]
            assert outcomes == ["bypass", "bypass"], extra
        greedy = await gw.client.post(CHAT, json=body_of("messages"))  # (temperature 0 alone)
        assert greedy.headers["x-carpool"] == "miss"
        # (``typical_p`` TGI's OpenAI routes drop, as they drop ``top_k``: greedy there.)
        typical = {**body_of("messages"), "typical_p": 0.5}
        outcomes = [(await gw.client.post(CHAT, json=typical)).headers["x-carpool"] for _ in "ab"]
        assert outcomes == ["miss", "hit"]
    assert fake.count() == 6


def test_an_audio_chat_stream_ended_without_a_finish_reason_is_whole():
    """OpenAI's audio models end a chat stream ([DONE]) on the audio's ``expires_at`` delta and
    never say a finish reason (openai-node #1206); their whole answer says "stop". Such a
    stream failed for every client sharing it, and every repeat ran again. A text choice
    without one is still a stream cut short."""
    from carpool.errors import UpstreamStreamBroken

    def chunk(delta: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}

    spoken = [
        chunk({"role": "assistant", "content": None}),
        chunk({"audio": {"id": "audio_1", "transcript": "Hi", "data": "AAAA"}}),
        chunk({"audio": {"expires_at": 1_700_000_000}}),
    ]
    api = api_of("chat")
    body, complete = api.judge_stream(spoken, None)
    assert complete and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["audio"]["transcript"] == "Hi"
    with pytest.raises(UpstreamStreamBroken):
        api.judge_stream([chunk({"role": "assistant", "content": "Hi"})], None)


def test_an_audio_chat_stream_ended_before_its_audio_expires_at_delta_is_cut_short():
    """A spoken choice is whole only once its audio's ``expires_at`` delta came, the last one
    OpenAI sends (openai-node infers "stop" only then): a stream ended ([DONE]) after part of
    the audio and transcript, as a proxy ends one it cut, is broken, never stored. (Before, any
    audio at all made it "stop": the cut answer was served from the cache to every repeat.)"""
    from carpool.errors import UpstreamStreamBroken

    def chunk(delta: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}

    cut = [
        chunk({"role": "assistant", "content": None}),
        chunk({"audio": {"id": "audio_1", "transcript": "Hel"}}),
        chunk({"audio": {"data": "UklGRg=="}}),
    ]
    with pytest.raises(UpstreamStreamBroken):
        api_of("chat").judge_stream(cut, None)
