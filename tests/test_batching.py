"""Dynamic batching with dedup for /embeddings (carpool.batching)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
from typing import Any

import orjson
import pytest

from carpool.batching import (
    PROBE_INPUTS,
    EmbeddingBatcher,
    KeyedBatcher,
    ListCheck,
    approx_tokens,
    probe_lists,
)
from carpool.errors import UpstreamUnreachable
from carpool.upstream.base import UpstreamRequest, UpstreamResponse
from fakes.waiting import eventually


def vector(model: str, item: Any) -> list[float]:
    """The fake engine's embedding: a function of the model and the input."""
    digest = hashlib.blake2b(orjson.dumps([model, item]), digest_size=8).digest()
    return [float(b) for b in digest]


class FakeSend:
    """Counts calls and items; answers list inputs; can hold calls on a gate or fail."""

    def __init__(
        self,
        *,
        gate: asyncio.Event | None = None,
        status: int = 200,
        raises: Exception | None = None,
    ) -> None:
        self.calls: list[UpstreamRequest] = []
        self.gate = gate
        self.status = status
        self.raises = raises
        self.entered = asyncio.Event()

    @property
    def items(self) -> list[list[Any]]:
        return [call.body["input"] for call in self.calls]

    async def __call__(self, request: UpstreamRequest) -> UpstreamResponse:
        self.calls.append(request)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.raises is not None:
            raise self.raises
        if self.status != 200:
            return UpstreamResponse(
                self.status,
                {"content-type": "application/json"},
                b'{"error": {"message": "boom", "type": "server_error"}}',
            )
        body = request.body
        if "input" not in body or "model" not in body:
            return UpstreamResponse(200, {}, b"{}")
        inputs = (
            body["input"]
            if isinstance(body["input"], list)
            and body["input"]
            and not isinstance(body["input"][0], int)
            else [body["input"]]
        )
        tokens = [approx_tokens(item) for item in inputs]
        data = [
            {"object": "embedding", "index": i, "embedding": vector(body["model"], item)}
            for i, item in enumerate(inputs)
        ]
        data.reverse()  # the batcher must sort by index
        payload = {
            "object": "list",
            "data": data,
            "model": body["model"],
            "usage": {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)},
        }
        return UpstreamResponse(
            200,
            {"content-type": "application/json", "content-length": "1", "x-up": "1"},
            orjson.dumps(payload),
        )


def req(text: Any, model: str = "emb", auth: str = "Bearer a", **extra: Any) -> UpstreamRequest:
    return UpstreamRequest(
        "/embeddings",
        {"model": model, "input": text, **extra},
        {"authorization": auth, "x-request-id": str(id(text))},
    )


def own(response: UpstreamResponse) -> dict[str, Any]:
    assert response.status == 200
    parsed = orjson.loads(response.body)
    assert parsed["object"] == "list"
    assert len(parsed["data"]) == 1
    assert parsed["data"][0]["object"] == "embedding" and parsed["data"][0]["index"] == 0
    # (a merged call's share is marked as such; an item sent alone has the upstream's own)
    assert set(parsed["usage"]) - {"apportioned"} == {"prompt_tokens", "total_tokens"}
    return parsed


async def test_96_concurrent_of_16_distinct_texts() -> None:
    send = FakeSend()
    waits: list[float] = []
    batcher = EmbeddingBatcher(
        send,
        max_batch_size=32,
        max_batch_delay_s=0.02,
        max_batch_tokens=8192,
        observe_wait=waits.append,
    )
    texts = [f"text number {i} " * (i + 1) for i in range(16)]
    asked = [texts[i % 16] for i in range(96)]
    responses = await asyncio.gather(*(batcher.embed(req(text)) for text in asked))

    assert 1 <= len(send.calls) <= 12
    assert sum(len(items) for items in send.items) <= 16
    for items in send.items:
        assert len(items) == len(set(items))  # distinct items only
    for text, response in zip(asked, responses, strict=True):
        parsed = own(response)
        assert parsed["data"][0]["embedding"] == vector("emb", text)
        assert parsed["model"] == "emb"
        assert parsed["usage"]["prompt_tokens"] == approx_tokens(text)
        assert response.headers["content-type"] == "application/json"
        assert "content-length" not in response.headers and response.headers["x-up"] == "1"
    assert batcher.requests == 96 and batcher.items_sent == 16
    assert batcher.batches == len(send.calls) and batcher.max_items_seen == 16
    assert len(waits) == 96 and all(w >= 0 for w in waits)
    # the merged call: a list input, identity headers only, no user
    assert send.calls[0].headers == {"authorization": "Bearer a"}


async def test_models_and_credentials_are_never_mixed() -> None:
    send = FakeSend()
    batcher = EmbeddingBatcher(
        send, max_batch_size=32, max_batch_delay_s=0.01, max_batch_tokens=8192
    )
    combos = [(m, a) for m in ("m1", "m2") for a in ("Bearer a", "Bearer b")]
    jobs = [(f"t{i % 5}", m, a) for i in range(40) for (m, a) in [combos[i % 4]]]
    extra = [
        ("t0", "m1", "Bearer a", {"dimensions": 8}),
        ("t0", "m1", "Bearer a", {"encoding_format": "base64"}),
    ]
    responses = await asyncio.gather(
        *(batcher.embed(req(t, m, a)) for t, m, a in jobs),
        *(batcher.embed(req(t, m, a, **x)) for t, m, a, x in extra),
    )
    assert len(send.calls) == 6
    seen = set()
    for call in send.calls:
        key = (
            call.body["model"],
            call.headers["authorization"],
            call.body.get("dimensions"),
            call.body.get("encoding_format"),
        )
        assert key not in seen
        seen.add(key)
    for (t, m, _), response in zip(jobs, responses[: len(jobs)], strict=True):
        assert own(response)["data"][0]["embedding"] == vector(m, t)


async def test_user_does_not_split_a_batch_and_is_not_forwarded() -> None:
    send = FakeSend()
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    await asyncio.gather(batcher.embed(req("a", user="u1")), batcher.embed(req("b", user="u2")))
    assert len(send.calls) == 1 and "user" not in send.calls[0].body


async def test_headers_named_in_fingerprint_neutral_headers_do_not_split_a_batch() -> None:
    def with_headers(text: str, **headers: str) -> UpstreamRequest:
        request = req(text)
        return UpstreamRequest(request.path, request.body, {**request.headers, **headers})

    send = FakeSend()
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01, neutral_headers=["X-Edge-Request"])
    await asyncio.gather(
        batcher.embed(with_headers("a", **{"X-Edge-Request": "1", "fly-request-id": "1"})),
        batcher.embed(with_headers("b", **{"x-edge-request": "2", "fly-request-id": "2"})),
    )
    assert len(send.calls) == 1
    assert send.calls[0].headers == {"authorization": "Bearer a"}  # neither's is sent
    # Without the config, the header is one that might change the answer: never mixed.
    send = FakeSend()
    plain = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    await asyncio.gather(
        plain.embed(with_headers("a", **{"x-edge-request": "1"})),
        plain.embed(with_headers("b", **{"x-edge-request": "2"})),
    )
    assert len(send.calls) == 2


@pytest.mark.parametrize("status", [401, 403, 429, 503])
async def test_an_upstream_error_about_the_whole_call_reaches_every_caller(status) -> None:
    send = FakeSend(status=status)
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    responses = await asyncio.gather(*(batcher.embed(req(f"t{i % 3}")) for i in range(9)))
    assert len(send.calls) == 1
    assert {r.status for r in responses} == {status}
    assert {r.body for r in responses} == {
        b'{"error": {"message": "boom", "type": "server_error"}}'
    }


async def test_a_merged_call_refused_for_one_item_is_sent_again_item_by_item() -> None:
    """Engines refuse a whole list for one bad item (a text over the context, a token id
    outside the vocabulary): every caller of the batch got that 400, which the idempotency
    layer then keeps for the retention. Each item alone: its own answer, refusal included."""
    answer = FakeSend()
    calls: list[Any] = []

    async def send(request: UpstreamRequest) -> UpstreamResponse:
        given = request.body["input"]
        calls.append(given)
        if "too long" in (given if isinstance(given, list) else [given]):
            return UpstreamResponse(
                400, {"content-type": "application/json"}, b'{"error": {"message": "too long"}}'
            )
        return await answer(request)

    batcher = EmbeddingBatcher(send, max_batch_delay_s=30.0, max_batch_size=3)
    good, bad, other = await asyncio.gather(
        *(batcher.embed(req(text)) for text in ("good", "too long", "other"))
    )
    assert own(good)["data"][0]["embedding"] == vector("emb", "good")
    assert own(other)["data"][0]["embedding"] == vector("emb", "other")
    assert bad.status == 400 and b"too long" in bad.body
    assert calls[0] == ["good", "too long", "other"]
    assert sorted(calls[1:]) == ["good", "other", "too long"]  # each alone, as it came
    # An engine's 500 may be one item's too; a single item's refusal is its own already.
    failing = FakeSend(status=500)
    batcher = EmbeddingBatcher(failing, max_batch_delay_s=0.01)
    responses = await asyncio.gather(*(batcher.embed(req(f"t{i % 3}")) for i in range(9)))
    assert {r.status for r in responses} == {500}
    assert len(failing.calls) == 1 + 3
    alone = EmbeddingBatcher(failing, max_batch_delay_s=0.01)
    assert (await alone.embed(req("one"))).status == 500 and len(failing.calls) == 5


async def test_upstream_exception_reaches_every_caller() -> None:
    send = FakeSend(raises=UpstreamUnreachable("refused"))
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    results = await asyncio.gather(
        *(batcher.embed(req(f"t{i % 3}")) for i in range(9)), return_exceptions=True
    )
    assert len(send.calls) == 1
    assert all(isinstance(r, UpstreamUnreachable) for r in results)


async def test_a_merged_2xx_answer_that_is_not_json_is_an_upstream_error_for_all() -> None:
    async def bad(request: UpstreamRequest) -> UpstreamResponse:
        return UpstreamResponse(200, {}, b"<html>proxy says hello</html>")

    batcher = EmbeddingBatcher(bad, max_batch_delay_s=0.01)
    results = await asyncio.gather(
        batcher.embed(req("a")), batcher.embed(req("b")), return_exceptions=True
    )
    assert all(getattr(r, "status", None) == 502 for r in results)
    assert batcher.stats()["alone"] == 0  # (no item by item retry of a broken proxy's page)
    # The engine took the call, as for one request alone: the SDKs must not try it again, each
    # try another merged call (``x-should-retry: false``).
    assert all(("x-should-retry", "false") in getattr(r, "also", ()) for r in results)


@pytest.mark.parametrize(
    "indexes", [[0], [0, 0], [1, 2], [0, 2]], ids=["short", "twice", "from-1", "a-gap"]
)
async def test_a_merged_2xx_answer_not_one_vector_per_item_in_order_sends_each_item_alone(
    indexes,
) -> None:
    """Merging must not change an answer: a merged call's 2xx answer that is not one vector
    per item, indexed 0..n-1 (an engine that left one out, or numbered them wrong), was a 502
    for every caller, though each item alone is answered fine. Each item now goes alone, as
    for a refusal, and each caller gets the engine's own answer to its own item."""
    calls: list[Any] = []

    async def send(request: UpstreamRequest) -> UpstreamResponse:
        given = request.body["input"]
        calls.append(given)
        if not isinstance(given, list):
            return await FakeSend()(request)
        rows = [{"object": "embedding", "index": i, "embedding": [float(i)]} for i in indexes]
        return UpstreamResponse(200, {}, orjson.dumps({"object": "list", "data": rows}))

    batcher = EmbeddingBatcher(send, max_batch_size=2, max_batch_delay_s=30.0)
    first, second = await asyncio.gather(batcher.embed(req("first")), batcher.embed(req("second")))
    assert own(first)["data"][0]["embedding"] == vector("emb", "first")
    assert own(second)["data"][0]["embedding"] == vector("emb", "second")
    assert calls[0] == ["first", "second"] and sorted(calls[1:]) == ["first", "second"]
    assert batcher.stats()["alone"] == 2


async def test_an_engine_answering_a_list_short_of_an_item_answers_each_caller_its_own(
    gateway_with, fake
):
    """The same over HTTP: an engine that leaves a list's 2nd input out of its answer (but
    answers every input alone) gave both clients a 502; each now gets its own vector."""
    fake.embedding_fn = lambda item: [float(len(item)), 1.0]
    fake.drop_embeddings = {1}  # a list's 2nd vector never comes back; a single input's does
    auth = {"authorization": "Bearer A"}
    batching = {"max_batch_size": 2, "max_batch_delay_ms": 60_000, "embeddings": "on"}
    async with gateway_with(batching=batching) as gw:
        answers = await asyncio.gather(
            *(
                gw.client.post(EMBEDDINGS, json={"model": "e", "input": text}, headers=auth)
                for text in ("one", "three")
            )
        )
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert [r.json()["data"][0]["embedding"] for r in answers] == [[3.0, 1.0], [5.0, 1.0]]
    inputs = [c.body["input"] for c in embedding_calls(fake)]
    assert inputs[0] == ["one", "three"] and sorted(inputs[1:]) == ["one", "three"]


async def test_alone_counts_the_calls_sent_alone_not_an_item_whose_callers_left() -> None:
    """``alone`` counts the calls sent alone: an item of an item by item retry whose callers
    had all left is never sent (its call is dropped before it starts), yet was counted."""
    gate = asyncio.Event()
    calls: list[Any] = []

    async def send(request: UpstreamRequest) -> UpstreamResponse:
        calls.append(request.body["input"])
        if isinstance(request.body["input"], list):
            await gate.wait()
            return UpstreamResponse(500, {}, b'{"error": {"message": "one of them"}}')
        return await FakeSend()(request)

    batcher = EmbeddingBatcher(send, max_batch_size=2, max_batch_delay_s=30.0)
    leaving = asyncio.create_task(batcher.embed(req("leaving")))
    staying = asyncio.create_task(batcher.embed(req("staying")))
    await eventually(lambda: len(calls) == 1, what="the merged call")
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving  # (its caller has left the batch)
    gate.set()  # the merged call is refused: its items go alone, but "leaving" has no caller
    assert own(await staying)["data"][0]["embedding"] == vector("emb", "staying")
    await batcher.wait_idle()
    assert calls == [["leaving", "staying"], "staying"]
    stats = batcher.stats()
    assert stats["alone"] == 1 and stats["batches"] == 2 and stats["items_sent"] == 3


async def test_a_cancelled_caller_does_not_break_the_batch() -> None:
    gate = asyncio.Event()
    send = FakeSend(gate=gate)
    waits: list[float] = []
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.005, observe_wait=waits.append)
    tasks = [asyncio.create_task(batcher.embed(req(f"t{i % 4}"))) for i in range(8)]
    await send.entered.wait()  # the batch is at the upstream
    tasks[0].cancel()
    tasks[1].cancel()
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert isinstance(results[1], asyncio.CancelledError)
    for i, response in enumerate(results[2:], start=2):
        assert own(response)["data"][0]["embedding"] == vector("emb", f"t{i % 4}")
    assert len(send.calls) == 1 and len(waits) == 8


async def test_an_item_whose_callers_all_left_before_sending_is_dropped() -> None:
    send = FakeSend()
    waits: list[float] = []
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01, observe_wait=waits.append)
    leaving = asyncio.create_task(batcher.embed(req("gone")))
    staying = asyncio.create_task(batcher.embed(req("kept")))
    await asyncio.sleep(0)  # both are in the buffer
    leaving.cancel()
    response = await staying
    assert own(response)["data"][0]["embedding"] == vector("emb", "kept")
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert send.items == ["kept"] and len(waits) == 2  # (a batch of one: sent as it came)


async def test_the_generic_scheduler_joins_a_running_batch_of_its_item() -> None:
    # (``join_running``, on by default: the semantic embedders' vectors of a text never change)
    gate, calls, compute = gated_upper()
    waits: list[float] = []
    batcher: KeyedBatcher[str, str] = KeyedBatcher(
        compute, max_batch_size=8, max_batch_delay_s=0.0, observe_wait=waits.append
    )
    first = asyncio.create_task(batcher.submit("g", "same", "same"))
    await eventually(lambda: len(calls) == 1, what="the first batch sent")
    second = asyncio.create_task(batcher.submit("g", "same", "same"))
    await eventually(lambda: len(waits) == 2, what="the second submit joining")
    gate.set()
    assert await asyncio.gather(first, second) == ["SAME", "SAME"]
    assert calls == [["same"]] and waits[-1] == 0.0


async def test_an_embeddings_request_never_joins_a_call_already_sent() -> None:
    gate = asyncio.Event()
    send = FakeSend(gate=gate)
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.0)
    first = asyncio.create_task(batcher.embed(req("same")))
    await send.entered.wait()
    second = asyncio.create_task(batcher.embed(req("same")))
    await eventually(lambda: len(send.calls) == 2, what="a call of its own")
    gate.set()
    a, b = await asyncio.gather(first, second)
    assert own(a)["data"] == own(b)["data"]


EMBEDDINGS = "/v1/embeddings"


def embedding_calls(fake: Any) -> list[Any]:
    return [c for c in fake.calls if c.path == EMBEDDINGS]


async def test_an_embeddings_request_after_an_invalidation_never_joins_a_call_begun_before_it(
    gateway_with, fake
):
    """The flights promise it (``admin.invalidate``: no request joins a call begun before an
    invalidation); the batcher let such a request join the running call of its item, whose
    answer (from before the invalidation) it was served and stored."""
    body, auth = {"model": "e", "input": "old fact"}, {"authorization": "Bearer A"}
    async with gateway_with(batching={"max_batch_delay_ms": 0, "embeddings": "on"}) as gw:
        fake.gate = asyncio.Event()
        before = asyncio.create_task(gw.client.post(EMBEDDINGS, json=body, headers=auth))
        await fake.wait_for_calls(1)
        await gw.gateway.invalidate({"all": True})
        after = asyncio.create_task(gw.client.post(EMBEDDINGS, json=body, headers=auth))
        await fake.wait_for_calls(2)  # its own call, begun after the invalidation
        fake.gate.set()
        old, new = await before, await after
        assert old.json()["model"] == "e#call1" and new.json()["model"] == "e#call2"
        again = await gw.client.post(EMBEDDINGS, json=body, headers=auth)
        assert again.headers["x-carpool"] == "hit" and again.json()["model"] == "e#call2"
        assert len(embedding_calls(fake)) == 2


async def test_an_embeddings_joiner_that_timed_out_gets_a_call_of_its_own(gateway_with, fake):
    """``coalesce.join_timeout_ms``: a joiner that waited that long runs its own call. Its call
    went through the batcher, which joined it to the very call it had timed out on."""
    body, auth = {"model": "e", "input": "slow"}, {"authorization": "Bearer A"}
    async with gateway_with(
        batching={"max_batch_delay_ms": 0, "embeddings": "on"},
        coalesce={"join_timeout_ms": 50},
    ) as gw:
        fake.gate = asyncio.Event()
        leader = asyncio.create_task(gw.client.post(EMBEDDINGS, json=body, headers=auth))
        await fake.wait_for_calls(1)
        joiner = asyncio.create_task(gw.client.post(EMBEDDINGS, json=body, headers=auth))
        await fake.wait_for_calls(2)  # the joiner's own, once it timed out
        fake.gate.set()
        answers = await asyncio.gather(leader, joiner)
        assert all(r.status_code == 200 for r in answers)
        assert len(embedding_calls(fake)) == 2


async def test_non_batchable_requests_bypass_the_batcher() -> None:
    send = FakeSend()
    waits: list[float] = []
    batcher = EmbeddingBatcher(send, max_batch_delay_s=10.0, observe_wait=waits.append)
    odd = [
        req(["a", "b"]),  # a list of inputs
        req([[1, 2], [3]]),  # a list of token lists
        UpstreamRequest("/embeddings", {"model": "emb", "input": "a"}, {}, stream=True),
        req("a", stream=True),
        UpstreamRequest("/chat/completions", {"model": "m", "messages": []}),
        UpstreamRequest("/embeddings", {"input": "no model"}),
        req(""),
        req({"not": "an input"}),
    ]
    for request in odd:
        send.calls.clear()
        await asyncio.wait_for(batcher.embed(request), 1)
        assert send.calls == [request] and send.calls[0] is request
    assert batcher.bypassed == len(odd) and batcher.requests == 0 and waits == []


async def test_a_text_and_a_token_list_are_never_batched_together() -> None:
    """An ``input`` list holds texts or token lists, never both: OpenAI's schema and vLLM refuse
    a mixed one (400), and a text and a token list were merged into one, every caller of the
    batch refused. Single token lists are batched with token lists."""
    send = FakeSend()
    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    a, b, c, d = await asyncio.gather(
        batcher.embed(req([1, 2, 3])),
        batcher.embed(req("1 2 3")),
        batcher.embed(req([1, 2, 3])),
        batcher.embed(req([4, 5])),
    )
    assert send.items in (["1 2 3", [[1, 2, 3], [4, 5]]], [[[1, 2, 3], [4, 5]], "1 2 3"])
    assert own(a)["data"][0]["embedding"] == vector("emb", [1, 2, 3])
    assert own(b)["data"][0]["embedding"] == vector("emb", "1 2 3")
    assert own(d)["data"][0]["embedding"] == vector("emb", [4, 5])
    assert a.body == c.body


async def test_size_flushes_without_waiting_for_the_timer() -> None:
    send = FakeSend()
    batcher = EmbeddingBatcher(send, max_batch_size=4, max_batch_delay_s=30.0)
    await asyncio.wait_for(asyncio.gather(*(batcher.embed(req(f"t{i}")) for i in range(8))), 1)
    assert [len(items) for items in send.items] == [4, 4]
    assert batcher.max_items_seen == 4


async def test_token_budget_flushes() -> None:
    send = FakeSend()
    batcher = EmbeddingBatcher(send, max_batch_size=32, max_batch_delay_s=30.0, max_batch_tokens=10)
    five = [chr(ord("a") + i) * 20 for i in range(6)]  # 5 approximate tokens each
    await asyncio.wait_for(asyncio.gather(*(batcher.embed(req(t)) for t in five)), 1)
    assert [len(items) for items in send.items] == [2, 2, 2]
    # an item dearer than the budget goes alone, after what was waiting
    send.calls.clear()
    big = "x" * 400
    await asyncio.wait_for(asyncio.gather(batcher.embed(req("small")), batcher.embed(req(big))), 1)
    assert send.items == ["small", big]


async def test_the_delay_timer_flushes() -> None:
    send = FakeSend()
    batcher = EmbeddingBatcher(send, max_batch_size=32, max_batch_delay_s=0.005)
    await asyncio.wait_for(batcher.embed(req("alone")), 1)
    assert send.items == ["alone"]


async def test_usage_is_apportioned_across_distinct_items() -> None:
    async def send(request: UpstreamRequest) -> UpstreamResponse:
        n = len(request.body["input"])
        data = [{"object": "embedding", "index": i, "embedding": [float(i)]} for i in range(n)]
        return UpstreamResponse(
            200,
            {},
            orjson.dumps(
                {
                    "object": "list",
                    "data": data,
                    "model": "emb",
                    "usage": {"prompt_tokens": 100, "total_tokens": 100},
                }
            ),
        )

    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    texts = ["a" * 4, "b" * 8, "c" * 12, "a" * 4]  # 1, 2, 3 approximate tokens
    responses = await asyncio.gather(*(batcher.embed(req(t)) for t in texts))
    shares = [orjson.loads(r.body)["usage"]["prompt_tokens"] for r in responses]
    assert sum(shares[:3]) == 100 and shares[0] == shares[3]
    assert shares == [17, 33, 50, 17]


def gated_upper() -> tuple[asyncio.Event, list[list[str]], Any]:
    """A compute that records each batch, waits for the gate, then upper-cases the items."""
    gate = asyncio.Event()
    seen: list[list[str]] = []

    async def compute(group: Any, items: list[str]) -> list[str]:
        seen.append(items)
        await gate.wait()
        return [item.upper() for item in items]

    return gate, seen, compute


async def test_generic_batcher_with_in_flight_limit() -> None:
    """The scheduler alone, as the semantic layer's embedder would use it."""
    gate, seen, compute = gated_upper()
    batcher: KeyedBatcher[str, str] = KeyedBatcher(
        compute, max_batch_size=2, max_batch_delay_s=0.0, max_in_flight=1
    )
    tasks = [asyncio.create_task(batcher.submit(None, t, t)) for t in ("a", "b", "c", "a")]
    while not seen:
        await asyncio.sleep(0)
    assert seen == [["a", "b"]] and batcher.in_flight == 1  # "c" waits for the slot
    gate.set()
    assert await asyncio.gather(*tasks) == ["A", "B", "C", "A"]
    assert seen == [["a", "b"], ["c"]] and batcher.requests == 4 and batcher.items_sent == 3


async def test_grow_while_busy_keeps_a_due_batch_open_until_a_slot_frees() -> None:
    gate, seen, compute = gated_upper()
    batcher: KeyedBatcher[str, str] = KeyedBatcher(
        compute, max_batch_size=8, max_batch_delay_s=0.0, max_in_flight=1, grow_while_busy=True
    )
    first = asyncio.create_task(batcher.submit(None, "a", "a"))
    while not seen:
        await asyncio.sleep(0)
    later = []
    for t in ("b", "c", "a", "b"):  # each after the previous one's delay
        later.append(asyncio.create_task(batcher.submit(None, t, t)))
        for _ in range(3):
            await asyncio.sleep(0)
    assert seen == [["a"]]  # "b", "c" wait together, "a" joins
    gate.set()
    assert await asyncio.gather(first, *later) == ["A", "B", "C", "A", "B"]
    assert seen == [["a"], ["b", "c"]] and batcher.batches == 2 and batcher.idle


async def test_a_queued_batch_whose_every_caller_left_is_never_sent() -> None:
    gate, seen, compute = gated_upper()
    batcher: KeyedBatcher[str, str] = KeyedBatcher(
        compute, max_batch_size=2, max_batch_delay_s=0.0, max_in_flight=1
    )
    running = [asyncio.create_task(batcher.submit(None, t, t)) for t in ("a", "b")]
    queued = [asyncio.create_task(batcher.submit(None, t, t)) for t in ("c", "d")]
    while not seen:
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)  # "c", "d": a closed batch, queued
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    gate.set()
    assert await asyncio.gather(*running) == ["A", "B"]
    assert await batcher.submit(None, "c", "c") == "C"  # a new caller of a dropped item: a call
    assert seen == [["a", "b"], ["c"]] and batcher.idle


async def test_a_batch_whose_callers_left_before_its_task_began_gives_its_slot_back() -> None:
    """Every caller gone in the turn its batch was sent (a timeout, a client leaving, a flight
    ending and dropping its prompt's embedding): the batch's task was cancelled before its first
    step, so nothing of ``_run`` ran, its ``finally`` neither, and its ``max_in_flight`` slot was
    never given back. The semantic embedder (one slot for the local model) then queued every
    later embedding for good."""
    seen: list[list[str]] = []

    async def compute(group: Any, items: list[str]) -> list[str]:
        seen.append(items)
        return [item.upper() for item in items]

    batcher: KeyedBatcher[str, str] = KeyedBatcher(
        compute, max_batch_size=8, max_batch_delay_s=10.0, max_in_flight=1
    )
    for round in range(3):
        caller = asyncio.create_task(batcher.submit(None, "a", "a"))
        await asyncio.sleep(0)  # (waiting in its open batch)
        caller.cancel()  # (delivered in the turn its batch is sent)
        batcher.flush()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await batcher.wait_idle()
        assert batcher.idle and batcher.in_flight == 0, round
    served = asyncio.create_task(batcher.submit(None, "b", "b"))
    batcher.flush()
    assert await served == "B" and seen == [["b"]]


# --- merging must not change an answer (issue 15) -----------------------------------------------


class Replica:
    """An upstream replica answering like ``FakeSend``; ``broken``: a list's items after the
    first get another text's vector (llama-cpp-python's server); ``status``/``list_status``:
    every call / list calls only answered so."""

    def __init__(
        self,
        *,
        broken: bool = False,
        status: int = 200,
        list_status: int = 200,
        base64: bool = False,
    ) -> None:
        self.name = "replica"
        self.right = FakeSend(status=status)
        self.broken, self.list_status, self.base64 = broken, list_status, base64
        self.calls: list[UpstreamRequest] = []

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.calls.append(request)
        given = request.body["input"]  # (a single token list is one input, not a list)
        listed = isinstance(given, list) and not (given and type(given[0]) is int)
        if listed and self.list_status != 200:
            return UpstreamResponse(self.list_status, {}, b'{"error": {"message": "no"}}')
        response = await self.right(request)
        if response.status != 200:
            return response
        parsed = orjson.loads(response.body)
        for row in parsed["data"]:
            if self.broken and listed and row["index"] > 0:
                row["embedding"] = vector("wrong", row["index"])
            if self.base64:
                row["embedding"] = base64.b64encode(
                    struct.pack(f"<{len(row['embedding'])}f", *row["embedding"])
                ).decode()
        return UpstreamResponse(200, response.headers, orjson.dumps(parsed))


GROUP = (
    "/embeddings",
    (("authorization", "Bearer a"),),
    orjson.dumps({"model": "emb"}),
    "",
    "text",
)
TOKENS_GROUP = (*GROUP[:4], "tokens")


@pytest.mark.parametrize(
    ("replica", "verdict"),
    [
        (Replica(), True),
        (Replica(base64=True), True),  # base64 answers are decoded to compare
        (Replica(broken=True), False),  # every item but the first is wrong
        (Replica(list_status=400), False),  # lists refused: never merged
        (Replica(list_status=503), None),  # the list failed: undecided
        (Replica(list_status=429), None),
        (Replica(status=500), None),  # no single answer to compare with
    ],
)
async def test_the_probe_compares_a_two_item_list_with_its_items_alone(replica, verdict) -> None:
    assert await probe_lists(replica, GROUP) is verdict
    inputs = [call.body["input"] for call in replica.calls]
    assert sorted(inputs, key=str) == sorted([list(PROBE_INPUTS), *PROBE_INPUTS], key=str)
    assert all(call.headers == {"authorization": "Bearer a"} for call in replica.calls)


async def test_lists_of_token_lists_are_probed_with_token_lists() -> None:
    """A group's kind of item is part of its verdict: an engine may answer lists of texts
    right and refuse (or answer wrongly) lists of token lists; the probe sends that kind."""
    from carpool.batching import PROBE_TOKENS

    replica = Replica()
    lists = ListCheck("auto", [replica])
    lists.probe(GROUP)
    await lists.wait_idle()
    assert lists.verdict(GROUP) is True and lists.verdict(TOKENS_GROUP) is None
    replica.calls.clear()
    lists.probe(TOKENS_GROUP)
    await lists.wait_idle()
    assert lists.verdict(TOKENS_GROUP) is True
    tokens = [list(t) for t in PROBE_TOKENS]
    inputs = [call.body["input"] for call in replica.calls]
    assert sorted(inputs, key=str) == sorted([tokens, *tokens], key=str)
    refusing = Replica(list_status=400)
    assert await probe_lists(refusing, TOKENS_GROUP) is False


async def test_a_group_is_merged_only_once_every_replica_answers_lists_item_by_item() -> None:
    right, broken = Replica(), Replica(broken=True)
    for replicas, verdict in (([right], True), ([right, broken], False)):
        lists = ListCheck("auto", replicas)
        assert lists.verdict(GROUP) is None
        lists.probe(GROUP)
        lists.probe(GROUP)  # one probe per replica at a time
        await lists.wait_idle()
        assert lists.verdict(GROUP) is verdict and lists.probes == len(replicas)
        other = (GROUP[0], GROUP[1], orjson.dumps({"model": "other"}), "", "text")
        assert lists.verdict(other) is None  # per model and parameters
    assert ListCheck("on", [broken]).verdict(GROUP) is True
    assert ListCheck("off", [right]).verdict(GROUP) is False


async def test_an_undecided_probe_is_tried_again_only_after_the_retry_delay() -> None:
    now = [0.0]
    replica = Replica(status=500)
    lists = ListCheck("auto", [replica], retry_s=30, clock=lambda: now[0])
    lists.probe(GROUP)
    await lists.wait_idle()
    assert lists.verdict(GROUP) is None and len(replica.calls) == 3
    now[0] = 29.0
    lists.probe(GROUP)
    assert len(replica.calls) == 3 and lists.probes == 1
    now[0] = 30.0
    replica.right.status = 200
    lists.probe(GROUP)
    await lists.wait_idle()
    assert lists.verdict(GROUP) is True and lists.probes == 2


async def test_items_are_sent_alone_until_lists_are_known_to_be_answered_item_by_item() -> None:
    replica = Replica(broken=True)
    batcher = EmbeddingBatcher(
        replica.send, max_batch_size=3, max_batch_delay_s=30.0, lists=ListCheck("auto", [replica])
    )
    texts = ["a", "b", "c"]
    responses = await asyncio.gather(*(batcher.embed(req(t)) for t in texts))
    # Each caller got the upstream's own answer to its own item, sent alone.
    assert [orjson.loads(r.body)["data"][0]["embedding"] for r in responses] == [
        vector("emb", t) for t in texts
    ]
    assert all("content-length" not in r.headers for r in responses)
    await batcher.wait_idle()  # the probe the batch started
    assert batcher.lists is not None and batcher.lists.verdict(GROUP) is False
    sent = [c.body["input"] for c in replica.calls if c.body["model"] == "emb"]
    assert sorted(sent, key=str) == sorted([*texts, list(PROBE_INPUTS), *PROBE_INPUTS], key=str)
    request = req("d")  # known wrong: not even buffered
    replica.calls.clear()
    response = await asyncio.wait_for(batcher.embed(request), 1)
    assert replica.calls == [request] and response.status == 200
    assert batcher.stats()["alone"] == 4 and batcher.stats()["lists"]["lists_wrong"] == 1


async def test_an_item_sent_alone_gets_its_own_status_and_its_own_failure() -> None:
    async def send(request: UpstreamRequest) -> UpstreamResponse:
        if request.body["input"] == "refused":
            return UpstreamResponse(
                400, {"content-type": "application/json"}, b'{"error": {"message": "bad input"}}'
            )
        if request.body["input"] == "unreachable":
            raise UpstreamUnreachable("refused")
        return await FakeSend()(request)

    batcher = EmbeddingBatcher(
        send, max_batch_size=3, max_batch_delay_s=30.0, lists=ListCheck("auto", [])
    )  # no verdict: alone
    ok, refused, unreachable = await asyncio.gather(
        batcher.embed(req("fine")),
        batcher.embed(req("refused")),
        batcher.embed(req("unreachable")),
        return_exceptions=True,
    )
    assert ok.status == 200 and own(ok)["data"][0]["embedding"] == vector("emb", "fine")
    assert refused.status == 400 and b"bad input" in refused.body
    assert isinstance(unreachable, UpstreamUnreachable)


async def test_usage_the_upstream_did_not_report_is_not_invented() -> None:
    async def send(request: UpstreamRequest) -> UpstreamResponse:
        data = [
            {"object": "embedding", "index": i, "embedding": [1.0]}
            for i in range(len(request.body["input"]))
        ]
        return UpstreamResponse(
            200, {}, orjson.dumps({"object": "list", "data": data, "model": "emb"})
        )

    batcher = EmbeddingBatcher(send, max_batch_size=2, max_batch_delay_s=30.0)
    responses = await asyncio.gather(batcher.embed(req("a")), batcher.embed(req("b")))
    assert all("usage" not in orjson.loads(r.body) for r in responses)


async def test_the_list_checks_verdicts_are_bounded_the_least_recently_used_forgotten() -> None:
    # A group is a body template: a client choosing its parameters (or junk fields) made one
    # verdict per template, kept for the process's life, the template's bytes with it.
    lists = ListCheck("auto", [Replica()], max_groups=4)
    groups = [(GROUP[0], GROUP[1], orjson.dumps({"model": f"m{i}"}), "", "text") for i in range(6)]
    for group in groups:
        lists.probe(group)
        await lists.wait_idle()
        lists.verdict(groups[0])  # the first one stays in use
    assert lists.stats()["groups"] == 4
    assert lists.verdict(groups[0]) is True and lists.verdict(groups[1]) is None
    assert lists.verdict(groups[5]) is True


async def test_one_identitys_groups_never_push_out_another_identitys_verdict() -> None:
    """The verdicts were one LRU for every identity: a tenant sending templates of its own
    (an unknown field each, 4,097 pairs in 49 s) pushed out another's verdict, whose batches
    were sent item by item again and paid a probe again (three calls). Each identity's count
    is its share now: the one making groups forgets its own."""
    lists = ListCheck("auto", [Replica()], max_groups=4)
    quiet = (GROUP[0], (("authorization", "Bearer quiet"),), GROUP[2], "", "text")
    lists.probe(quiet)
    await lists.wait_idle()
    assert lists.verdict(quiet) is True
    for i in range(6):
        loud = (GROUP[0], GROUP[1], orjson.dumps({"model": "m", f"x{i}": 1}), "", "text")
        lists.probe(loud)
        await lists.wait_idle()
    assert lists.verdict(quiet) is True
    assert lists.stats()["groups"] == 4


def client_headers(i: int) -> dict[str, str]:
    """Forwarded headers that change no answer (so they split no batch), each client's own."""
    return {
        "authorization": "Bearer A",
        "traceparent": f"00-0af7651916cd43dd8448eb211c8031{i:02x}-b7ad6b7169203331-01",
        "x-request-id": f"rid-{i}",
        "user-agent": f"app/{i}",
    }


@pytest.mark.parametrize("why", ["a batch of one", "merging not known safe", "item by item"])
async def test_an_embeddings_item_sent_alone_is_sent_as_its_client_sent_it(gateway_with, fake, why):
    """A merged call carries none of the callers' own ``user`` nor headers (they may differ);
    an item sent alone has no other caller, yet it was sent as that merged call would be: its
    ``user``, trace context, request id and user agent dropped. (Its request id is never sent:
    every call carries the gateway's own, ``test_request_id``.)"""
    batching: dict[str, Any] = {"max_batch_size": 2, "max_batch_delay_ms": 60_000}
    if why == "a batch of one":
        batching = {}  # the defaults (merging "auto"): a lone request is a batch of one
    elif why == "item by item":
        batching["embeddings"] = "on"  # merged, refused (a 500 may be one item's), retried
        fake.fail_status, fake.fail_times = 500, 1
    count = 1 if why == "a batch of one" else 2
    texts = [f"{why} {i}" for i in range(count)]
    async with gateway_with(batching=batching) as gw:
        responses = await asyncio.gather(
            *(
                gw.client.post(
                    EMBEDDINGS,
                    json={"model": "e", "input": text, "user": f"end-user-{i}"},
                    headers=client_headers(i),
                )
                for i, text in enumerate(texts)
            )
        )
        await gw.gateway.batcher.wait_idle()
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    alone = [c for c in embedding_calls(fake) if c.body["input"] in texts]  # (not the probe's)
    assert sorted(c.body["input"] for c in alone) == texts
    for call in alone:
        i = texts.index(call.body["input"])
        assert call.body == {"model": "e", "input": texts[i], "user": f"end-user-{i}"}
        sent = {name: call.headers.get(name) for name in client_headers(i)}
        assert sent == {**client_headers(i), "x-request-id": call.headers["x-request-id"]}
        assert call.headers["x-request-id"] != f"rid-{i}"  # (the call's own id, not the client's)
    if why == "item by item":
        assert [c.body["input"] for c in embedding_calls(fake)][0] == texts  # the merged call


async def test_apportioned_embeddings_usage_is_marked_on_the_answer_and_on_every_copy(
    gateway_with, fake
):
    """A merged call's usage is shared out by approximate tokens (characters / 4): an estimate,
    not the engine's count for each input (a 1-token input alone was 1, merged 51). It was given
    unmarked, and stored: later hits kept the estimate as if it were the engine's."""
    words = " ".join(["word"] * 100)  # 100 tokens for the fake (one a word), ~125 by characters
    one = "x" * 200  # 1 token for the fake, ~50 by characters
    auth = {"authorization": "Bearer A"}
    batching = {"max_batch_size": 2, "max_batch_delay_ms": 60_000, "embeddings": "on"}
    async with gateway_with(batching=batching) as gw:
        merged = await asyncio.gather(
            gw.client.post(EMBEDDINGS, json={"model": "e", "input": words}, headers=auth),
            gw.client.post(
                EMBEDDINGS,
                json={"model": "e", "input": one},
                headers={**auth, "Idempotency-Key": "k1"},
            ),
        )
        assert [c.body["input"] for c in embedding_calls(fake)] == [[words, one]]
        usages = [r.json()["usage"] for r in merged]
        assert all(u["apportioned"] is True for u in usages)
        assert sum(u["prompt_tokens"] for u in usages) == 101  # the engine's total, shared
        assert all(r.headers["x-carpool-usage"] == "apportioned" for r in merged)
        # Stored with its mark: a hit, and an idempotent replay, say so too.
        hit = await gw.client.post(EMBEDDINGS, json={"model": "e", "input": one}, headers=auth)
        replay = await gw.client.post(
            EMBEDDINGS,
            json={"model": "e", "input": one},
            headers={**auth, "Idempotency-Key": "k1"},
        )
        assert replay.headers.get("idempotent-replayed") == "true"
        for copy in (hit, replay):
            assert copy.headers["x-carpool"] == "hit"
            assert copy.headers["x-carpool-usage"] == "apportioned"
            assert copy.json()["usage"] == usages[1]
    assert len(embedding_calls(fake)) == 1
    async with gateway_with() as gw:  # (the defaults: a lone request goes alone at once)
        # Sent alone, an input gets the engine's own count, unmarked.
        alone = await gw.client.post(EMBEDDINGS, json={"model": "e", "input": "y" * 200})
        assert alone.json()["usage"] == {"prompt_tokens": 1, "total_tokens": 1}
        assert "x-carpool-usage" not in alone.headers


async def test_a_duplicate_sharing_a_slot_never_gets_a_refusal_of_another_callers_user(
    gateway_with, fake
):
    """Two requests of one tenant for one input that are two flights (their namespaces differ)
    shared one slot of a batch, and the item went alone as the first caller sent it, its
    ``user`` with it: the upstream refused that ``user``, and the second caller, which sent
    none, got the first's 400 (its message quoting the first's ``user``), labelled as a refusal
    of its own body (so neither scrubbed nor retried with it). Each is now its own slot."""
    refused_user = "alice-secret-user-id"
    fake.refuse = lambda call: (
        f"user {refused_user!r} is not allowed"
        if isinstance(call.body, dict) and call.body.get("user") == refused_user
        else None
    )
    auth = {"authorization": "Bearer A"}
    # (the defaults otherwise: merging "auto", so two items of a batch each go alone now)
    async with gateway_with(batching={"max_batch_size": 2, "max_batch_delay_ms": 100}) as gw:
        first = asyncio.create_task(
            gw.client.post(
                EMBEDDINGS,
                json={"model": "e", "input": "hello", "user": refused_user},
                headers={**auth, "x-carpool-namespace": "one"},
            )
        )
        await eventually(lambda: gw.gateway.batcher.requests == 1, what="the first buffered")
        second = await gw.client.post(
            EMBEDDINGS,
            json={"model": "e", "input": "hello"},
            headers={**auth, "x-carpool-namespace": "two"},
        )
        assert second.status_code == 200, second.text
        assert refused_user not in second.text
        assert (await first).status_code == 400  # its own refusal
        await gw.gateway.batcher.wait_idle()
    sent = [c.body for c in embedding_calls(fake) if c.body["input"] == "hello"]
    assert {"model": "e", "input": "hello"} in sent  # the second's own, without a ``user``


async def test_a_client_leaving_an_item_by_item_batch_cancels_its_own_items_call(
    gateway_with, fake
):
    """A batch whose items go one by one (merging not known safe yet) ran them all in its one
    task, which was cancelled only once every caller of every item had left: a client that
    left had its own item's call run on at the upstream, though no client wanted it."""
    auth = {"authorization": "Bearer A"}
    mine = ("leaving", "staying")
    async with gateway_with(batching={"max_batch_size": 2, "max_batch_delay_ms": 60_000}) as gw:
        fake.gate = asyncio.Event()
        leaving, staying = (
            asyncio.create_task(
                gw.client.post(EMBEDDINGS, json={"model": "e", "input": text}, headers=auth)
            )
            for text in mine
        )
        await eventually(
            lambda: sum(c.body["input"] in mine for c in embedding_calls(fake)) == 2,
            what="each item's call at the upstream",
        )
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await fake.wait_for_cancelled(1)  # its own call, and only that one
        fake.gate.set()
        response = await staying
        assert response.status_code == 200 and response.json()["data"][0]["embedding"]
        await gw.gateway.batcher.wait_idle()
    assert fake.cancelled == 1


async def test_a_client_leaving_an_item_by_item_retry_cancels_its_own_items_call() -> None:
    """The same, for the item-by-item retry of a merged call refused (a 500 may be one item's)."""
    gates = {"leaving": asyncio.Event(), "staying": asyncio.Event()}
    at_gate: list[Any] = []
    cancelled: list[Any] = []

    async def send(request: UpstreamRequest) -> UpstreamResponse:
        given = request.body["input"]
        if isinstance(given, list):
            return UpstreamResponse(500, {}, b'{"error": {"message": "one of them"}}')
        at_gate.append(given)
        try:
            await gates[given].wait()
        except asyncio.CancelledError:
            cancelled.append(given)
            raise
        return await FakeSend()(request)

    batcher = EmbeddingBatcher(send, max_batch_size=2, max_batch_delay_s=30.0)
    leaving = asyncio.create_task(batcher.embed(req("leaving")))
    staying = asyncio.create_task(batcher.embed(req("staying")))
    await eventually(lambda: len(at_gate) == 2, what="the retry, item by item")
    leaving.cancel()
    await eventually(lambda: cancelled == ["leaving"], what="the leaving item's call cancelled")
    gates["staying"].set()
    assert own(await staying)["data"][0]["embedding"] == vector("emb", "staying")
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await batcher.wait_idle()
    assert cancelled == ["leaving"]


async def test_a_merged_2xx_answer_reporting_an_error_is_not_stored(gateway_with, fake):
    """A 2xx answer with a non-null top-level ``error`` beside its ``data`` is no success
    (``completeness.is_complete``): alone, it reaches its client as it came and is not stored.
    Merged, each caller's body was rebuilt from ``data`` alone, without the error: complete,
    stored and served as hits. Such a merged call's items now go one by one, as a refusal's do,
    each caller getting the upstream's own answer to its own item."""
    error = {"message": "partial failure", "type": "server_error"}
    fake.embeddings_extra = {"error": error}
    auth = {"authorization": "Bearer A"}
    # (two callers fill a batch at once; the lone request after them waits out the delay)
    batching = {"max_batch_size": 2, "max_batch_delay_ms": 100, "embeddings": "on"}
    async with gateway_with(batching=batching) as gw:
        merged = await asyncio.gather(
            *(
                gw.client.post(EMBEDDINGS, json={"model": "e", "input": text}, headers=auth)
                for text in ("aaa", "bbb")
            )
        )
        assert all(r.json().get("error") == error for r in merged), [r.text for r in merged]
        again = await gw.client.post(EMBEDDINGS, json={"model": "e", "input": "aaa"}, headers=auth)
        assert again.headers["x-carpool"] != "hit"
    inputs = [c.body["input"] for c in embedding_calls(fake)]
    assert inputs[0] == ["aaa", "bbb"] and sorted(inputs[1:3]) == ["aaa", "bbb"]


async def test_embeddings_answer_short_of_its_inputs_is_not_stored(gateway_with, fake):
    """An embeddings answer holding fewer vectors than its request has inputs (an engine that
    dropped some) is the upstream's own answer: its client gets it as it came, as a chat
    answer with fewer choices than ``n`` (tests/test_completeness.py). It is not complete:
    never stored, so the same request is a fresh upstream call, not a hit short of vectors."""
    body, auth = {"model": "e", "input": ["one", "two", "three"]}, {"authorization": "Bearer A"}
    fake.drop_embeddings = {1, 2}  # only the first input's vector comes back
    async with gateway_with() as gw:
        short = await gw.client.post(EMBEDDINGS, json=body, headers=auth)
        assert short.status_code == 200 and short.headers["x-carpool"] == "miss"
        assert [row["index"] for row in short.json()["data"]] == [0]
        assert gw.gateway.store.entries == 0
        again = await gw.client.post(EMBEDDINGS, json=body, headers=auth)
        assert again.headers["x-carpool"] == "miss" and len(again.json()["data"]) == 1
        fake.drop_embeddings = set()
        whole = await gw.client.post(EMBEDDINGS, json=body, headers=auth)
        assert [row["index"] for row in whole.json()["data"]] == [0, 1, 2]
        hit = await gw.client.post(EMBEDDINGS, json=body, headers=auth)
        assert hit.headers["x-carpool"] == "hit" and hit.json()["data"] == whole.json()["data"]
    assert len(embedding_calls(fake)) == 3


async def test_a_flush_sends_the_batches_waiting_and_later_ones_wait_no_longer() -> None:
    # (``Gateway.begin_draining``: a batch's delay may be longer than the grace period left.)
    calls: list[list[int]] = []

    async def compute(group: Any, items: list[int]) -> list[int]:
        calls.append(items)
        return [item * 10 for item in items]

    batcher: KeyedBatcher[int, int] = KeyedBatcher(compute, max_batch_size=8, max_batch_delay_s=600)
    waiting = [asyncio.create_task(batcher.submit(None, i, i)) for i in range(3)]
    await eventually(lambda: batcher.requests == 3)
    assert calls == []
    batcher.flush()
    assert await asyncio.gather(*waiting) == [0, 10, 20] and calls == [[0, 1, 2]]
    later = [asyncio.create_task(batcher.submit(None, i, i)) for i in (3, 4)]
    assert await asyncio.wait_for(asyncio.gather(*later), 30) == [30, 40]  # (not 600 s)
    assert calls[1:] == [[3, 4]]  # (still batched, within a turn of the event loop)


@pytest.mark.parametrize(
    "bad",
    ["NaN", "Infinity", "1e400", "1" + "0" * 400, "1" + "0" * 5000],
    ids=["nan", "inf", "1e400", "int", "int-past-int-digits"],  # (Python's int() limit: 4,300)
)
async def test_a_merged_answer_with_a_non_finite_number_for_one_item_sends_each_item_alone(
    bad,
) -> None:
    """An engine that writes NaN or Infinity for one input's vector (a Python ``json.dumps``
    server does), or a number past a double (``1e400``, or ``1`` and 400 zeros), made the
    merged answer unreadable, a 502 for every caller merged with it, though each of the others
    alone is answered fine: merging changed their answers. Such a body is JSON of a kind: each
    item goes alone, each caller gets the engine's own answer."""
    calls: list[Any] = []

    async def send(request: UpstreamRequest) -> UpstreamResponse:
        given = request.body["input"]
        calls.append(given)
        items = given if isinstance(given, list) else [given]
        rows = ",".join(
            f'{{"object":"embedding","index":{i},"embedding":[{bad if item == "poison" else 0.5}]}}'
            for i, item in enumerate(items)
        )
        return UpstreamResponse(200, {}, b'{"object":"list","data":[%s]}' % rows.encode())

    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    results = await asyncio.gather(
        *(batcher.embed(req(text)) for text in ("alice", "poison", "bob")), return_exceptions=True
    )
    # (Each caller gets the engine's own answer to its item alone: the poisoned one its bad
    # number, which the gateway then refuses for it alone, as for any request sent alone.)
    assert [getattr(r, "status", None) for r in results] == [200, 200, 200], results
    assert [bad.encode() in r.body for r in results] == [False, True, False]
    assert batcher.stats()["alone"] == 3 and calls[0] == ["alice", "poison", "bob"]


@pytest.mark.parametrize(
    "bad",
    ["null", "[]", "[0.5, 0.5]", '"AAAAPw=="', "3"],
    ids=["null", "empty", "long", "b64", "n"],
)
async def test_a_merged_answer_with_no_usable_vector_for_one_item_sends_each_item_alone(
    bad,
) -> None:
    """A merged 2xx with a null, empty or odd vector for one row (a broken list answer: every
    other row holds one float) was split as it came, that row's caller served it as a 200
    (though never stored). Judged as a stored answer is (``completeness``): each item goes
    alone, each caller gets the engine's own answer."""
    calls: list[Any] = []

    async def send(request: UpstreamRequest) -> UpstreamResponse:
        given = request.body["input"]
        calls.append(given)
        items = given if isinstance(given, list) else [given]
        merged = isinstance(given, list)
        rows = ",".join(
            f'{{"object":"embedding","index":{i},"embedding":'
            f"{bad if merged and item == 'broken' else '[0.5]'}}}"
            for i, item in enumerate(items)
        )
        return UpstreamResponse(200, {}, b'{"object":"list","data":[%s]}' % rows.encode())

    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    results = await asyncio.gather(*(batcher.embed(req(t)) for t in ("alice", "broken", "bob")))
    assert [r.status for r in results] == [200, 200, 200]
    assert [orjson.loads(r.body)["data"][0]["embedding"] for r in results] == [[0.5]] * 3
    assert batcher.stats()["alone"] == 3 and calls[0] == ["alice", "broken", "bob"]


@pytest.mark.parametrize(
    "body",
    [
        b'\xef\xbb\xbf{"object":"list","data":[]}',  # (a byte order mark)
        '{"object":"list","data":[]}'.encode("utf-16"),
        b'{"object":"list","data":[],"x":"\\ud800"}',  # (a lone surrogate)
    ],
    ids=["bom", "utf16", "surrogate"],
)
async def test_a_merged_answer_not_json_for_no_number_is_a_502_for_all_in_one_call(body) -> None:
    """Python's reader takes these (it strips a byte order mark, reads UTF-16, keeps a lone
    surrogate), so they were sent again item by item (N + 1 calls); they are no item's fault:
    the one merged call's 502 for all, as any answer that is not JSON."""
    calls: list[Any] = []

    async def send(request: UpstreamRequest) -> UpstreamResponse:
        calls.append(request.body["input"])
        return UpstreamResponse(200, {}, body)

    batcher = EmbeddingBatcher(send, max_batch_delay_s=0.01)
    results = await asyncio.gather(
        batcher.embed(req("a")), batcher.embed(req("b")), return_exceptions=True
    )
    assert all(getattr(r, "status", None) == 502 for r in results)
    assert len(calls) == 1 and batcher.stats()["alone"] == 0


async def test_the_list_checks_verdicts_keep_no_clients_template() -> None:
    """A verdict's record held its group's body template (a client's, up to a body's size),
    under a bound by count only: 64 groups of 1 MiB held 64 MiB for good. A slot is named by
    the group's hash now, and holds a verdict alone."""
    import gc
    import tracemalloc

    class Refusing:  # (keeps nothing of what it is asked: every probe undecided, kept)
        async def send(self, request: UpstreamRequest) -> UpstreamResponse:
            return UpstreamResponse(400, {}, b'{"error": {"message": "no"}}')

    lists = ListCheck("auto", [Refusing()], max_groups=64)
    tracemalloc.start()
    try:
        for i in range(64):
            template = orjson.dumps({"model": "m", "x": f"{i}" + "a" * (1 << 20)})
            lists.probe((GROUP[0], GROUP[1], template, "", "text"))
            await lists.wait_idle()
            del template
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lists.stats()["probes"] == 64
    assert held < 8 << 20, held
