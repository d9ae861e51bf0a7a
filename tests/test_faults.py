"""Fault injection on loopback (issue #8): what every client gets, what is stored, what is left.

Each case injects one fault through the fake upstream (``fakes/upstream.py``), a client, Redis or
a gateway process, and then checks three things:

1. what every client of the affected requests receives: the status, the OpenAI error shape, the
   whole text, or (for a stream that had started) an SSE error event and no ``[DONE]``;
2. what is stored: nothing after a failure (a later identical request is a ``miss`` that calls
   upstream again), the complete answer after a success (a later identical request is a ``hit``);
3. that nothing is left behind (``nothing_left``): no ticket (``waiters``, also as /stats reports
   it), no flight in progress (a failed flight is gone at once; a successful one may only linger,
   finished, for the coalescing window), no request in flight on a replica or at the fake
   upstream, no shared-flight bookkeeping, and no asyncio task beyond those alive before the
   case. Every wait is on an event or a condition (``eventually``), bounded; none is a fixed
   sleep standing for "long enough".

A gateway instance killed mid-call is ``test_distributed.py``'s
``test_leader_instance_killed_mid_call_the_waiter_elsewhere_still_gets_a_full_answer`` (which
checks the same bookkeeping on the surviving instance).

The issue's "Must show" pair comes first. Some cases are regressions of bugs this suite and the
soak benchmark (``benchmarks/bench_soak.py``) found: item sub-requests of a list input left
running when their client went; an embeddings batch whose every caller left still computed (and
a caller arriving just then was cancelled with it); pooled upstream connections reused as the
upstream closed them (502 under load); cached answers (and remembered request bodies) holding
ten times the bytes their budget counts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import httpx
import orjson
import pytest

from carpool.answer import Answer
from carpool.batching import KeyedBatcher
from carpool.config import Config
from carpool.fingerprint import RepeatMemo, fingerprint
from carpool.request import ClientRequest, parse
from carpool.server import create_app
from carpool.upstream import http as upstream_http
from carpool.upstream import wire
from carpool.wiring import build_gateway
from conftest import Served, redis_settings, run_gateway
from fakes.instances import Instance, free_port, serve_env
from fakes.raw_upstream import RawCall, chat_completion, raw_upstream
from fakes.raw_upstream import answer as raw_answer
from fakes.serving import serve_app
from fakes.upstream import DEFAULT_FAIL_BODY, FakeUpstream
from fakes.waiting import WAIT_S, eventually

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
QUESTION = "What is carpool?"


# ------------------------------------------------------------------------------------------------
# What a client received


def sse_events(raw: str) -> tuple[list[dict[str, Any]], bool]:
    """The JSON payloads of an SSE stream, and whether it ended with ``data: [DONE]``."""
    payloads, done = [], False
    for line in raw.splitlines():
        if not line.startswith("data: "):
            continue
        assert not done, f"a frame after [DONE]: {line[:200]}"
        if line == "data: [DONE]":
            done = True
            continue
        payloads.append(json.loads(line[len("data: ") :]))
    return payloads, done


def sse_text(raw: str) -> str:
    """The text of a complete stream (which must end with ``[DONE]``, without an error)."""
    payloads, done = sse_events(raw)
    assert done and not any("error" in p for p in payloads), raw[-300:]
    return "".join(
        choice["delta"].get("content") or "" for p in payloads for choice in p["choices"]
    )


def sse_failure(raw: str) -> tuple[str, dict[str, Any]]:
    """(the text received before the failure, the error) of a stream that failed part-way."""
    payloads, done = sse_events(raw)
    assert not done, "a failed stream must not end with [DONE]"
    *chunks, last = payloads
    assert set(last) == {"error"}, last
    assert not any("error" in chunk for chunk in chunks)
    error = last["error"]
    assert error["message"] and error["type"] and "code" in error
    text = "".join(
        choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"]
    )
    return text, error


def content(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert body["error"]["message"]
    return body["error"]


# ------------------------------------------------------------------------------------------------
# What is left behind


class Baseline:
    """The asyncio tasks alive before a case (the servers, the fixtures): what may remain.

    Besides those, only the in-loop uvicorn servers' tick comes and goes by itself
    (``serving.py``: ``wait_for(self._wake.wait(), 1.0)``, which Python 3.11 runs in a task):
    an ``Event.wait`` task on the ``_wake`` event of a server running at the baseline; and a
    degraded instance's Redis probe (``SharedStore._ping_until_up``), which lives as long as
    the instance is degraded, whatever its requests did.
    """

    def __init__(self) -> None:
        self.tasks = set(asyncio.all_tasks())
        self.ticks = set()
        for task in self.tasks:
            frame = getattr(task.get_coro(), "cr_frame", None)
            wake = getattr(frame and frame.f_locals.get("server"), "_wake", None)
            if wake is not None:
                self.ticks.add(id(wake))

    def _tick(self, task: asyncio.Task[Any]) -> bool:
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)
        return (
            getattr(coro, "__qualname__", "") == "Event.wait"
            and frame is not None
            and id(frame.f_locals.get("self")) in self.ticks
        )

    def leftovers(self) -> list[asyncio.Task[Any]]:
        current = asyncio.current_task()
        return [
            task
            for task in asyncio.all_tasks()
            if task not in self.tasks
            and task is not current
            and not self._tick(task)
            and getattr(task.get_coro(), "__qualname__", "") != "SharedStore._ping_until_up"
        ]


def _problems(gateways: tuple[Served, ...], fake: FakeUpstream | None, failed: bool) -> list[str]:
    problems = []
    for served in gateways:
        gateway, name = served.gateway, served.url
        if gateway.flights.waiters:
            problems.append(f"{name}: {gateway.flights.waiters} waiter(s) left")
        # (A finished flight lingers as a tuple; one made again for a joiner is a Flight.)
        flights = [f for f in gateway.flights._flights.values() if type(f) is not tuple]
        running = [
            f.key
            for f in flights
            if f.clients
            or not f.broadcast.done
            or (f.task is not None and not f.task.done())  # (a finished one lets go of it)
            or f.finished_at is None
        ]
        if running:
            problems.append(f"{name}: flight(s) in progress or failed: {running}")
        if failed and len(gateway.flights):
            problems.append(f"{name}: {len(gateway.flights)} flight(s) kept after a failure")
        if gateway.replicas.in_flight:
            problems.append(f"{name}: {gateway.replicas.in_flight} upstream call(s) in flight")
        shared = gateway.shared_flights
        if shared is not None and (shared.leading or shared.following or shared._background):
            problems.append(
                f"{name}: shared flights leading={shared.leading} following="
                f"{shared.following} background={len(shared._background)}"
            )
    if fake is not None and fake.in_flight:
        problems.append(f"fake upstream: {fake.in_flight} request(s) still in flight")
    return problems


async def nothing_left(
    baseline: Baseline, *gateways: Served, fake: FakeUpstream | None = None, failed: bool = False
) -> None:
    """No waiter, no flight in progress (none at all after a failure), no upstream call, no task
    beyond the baseline: waited for (bounded), then checked through /stats too."""
    try:
        await eventually(
            lambda: not _problems(gateways, fake, failed),
            timeout=10,
            what="the flights and waiters to be gone",
        )
    except AssertionError:
        raise AssertionError(_problems(gateways, fake, failed)) from None
    for served in gateways:
        # Lingering flights leave as their windows end, even during the request: between.
        before = len(served.gateway.flights)
        stats = (await served.client.get("/stats")).json()
        assert stats["waiters"] == 0
        assert len(served.gateway.flights) <= stats["flights"] <= before
        if failed:
            assert stats["flights"] == 0
    try:
        await eventually(lambda: not baseline.leftovers(), timeout=10, what="no task left")
    except AssertionError:
        raise AssertionError(f"tasks left behind: {baseline.leftovers()}") from None


def flight_clients(served: Served) -> int:
    return sum(f.clients for f in served.gateway.flights.running())


async def gone(*tasks: asyncio.Task[Any]) -> None:
    """Cancel client tasks (their connections close) and wait until they have ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task


def closed_port() -> int:
    """A loopback port nothing listens on (bound then released): connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# The "Must show" pair


async def test_2000_requests_at_concurrency_200_with_30_percent_duplicates_no_errors_and_calls_equal_distinct_prompts(  # noqa: E501
    gw, fake
):
    distinct, total, concurrency = 1400, 2000, 200
    rng = random.Random(8)
    prompts = [f"question {i}" for i in range(distinct)]
    prompts += [rng.choice(prompts) for _ in range(total - distinct)]  # 600 duplicates: 30 %
    rng.shuffle(prompts)
    baseline = Baseline()
    queue = collections.deque(enumerate(prompts))
    results: list[tuple[int, str, str, str]] = []

    # aiohttp rather than httpx here: httpx's pool costs ~10x more CPU per request at this
    # concurrency, which alone would make this test last 15-30 s on a 2-core machine.
    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            i, prompt = queue.popleft()
            stream = i % 4 == 0  # a quarter of them stream
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "stream": stream,
            }
            async with session.post(CHAT, json=body) as response:
                raw = (await response.read()).decode()
            text = (
                raw
                if response.status != 200
                else sse_text(raw)
                if stream
                else json.loads(raw)["choices"][0]["message"]["content"]
            )
            results.append((response.status, response.headers["x-carpool"], prompt, text))

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(gw.url, connector=connector) as session, asyncio.timeout(60):
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    assert len(results) == total
    assert collections.Counter(status for status, *_ in results) == {200: total}, [
        r for r in results if r[0] != 200
    ][:5]
    for _, _, prompt, text in results:  # each got the answer to its own prompt
        assert text.startswith("answer ") and text.endswith(f" to {prompt}"), (prompt, text)
    assert (
        fake.count()
        == distinct
        == len({call.body["messages"][-1]["content"] for call in fake.calls})
    )
    outcomes = collections.Counter(outcome for _, outcome, *_ in results)
    assert outcomes["miss"] == distinct
    assert outcomes["hit"] + outcomes["coalesced"] == total - distinct
    stats = (await gw.client.get("/stats")).json()
    assert stats["upstream_calls"] == distinct and stats["upstream_errors"] == 0
    assert stats["layers"]["exact"]["entries"] == distinct
    await nothing_left(baseline, gw, fake=fake)


async def test_10_concurrent_requests_on_a_failing_upstream_make_1_call_all_get_the_error_and_the_next_calls_again(  # noqa: E501
    gw, fake
):
    baseline = Baseline()
    fake.gate = asyncio.Event()
    fake.fail_status = 503
    fake.fail_body = {"error": {"message": "overloaded", "type": "server_error", "code": "busy"}}
    clients = [
        asyncio.create_task(gw.stream_chat() if i % 3 == 0 else gw.chat()) for i in range(10)
    ]
    await fake.wait_for_calls(1)
    await eventually(lambda: flight_clients(gw) == 10, what="10 clients on one flight")
    fake.gate.set()
    async with asyncio.timeout(10):
        replies = await asyncio.gather(*clients)
    responses = [r[0] if isinstance(r, tuple) else r for r in replies]
    assert fake.count() == 1
    # Every client, streaming or not, gets the upstream's status and body as they were.
    assert [r.status_code for r in responses] == [503] * 10
    assert all(r.json() == fake.fail_body for r in responses)
    assert collections.Counter(r.headers["x-carpool"] for r in responses) == {
        "miss": 1,
        "coalesced": 9,
    }
    assert gw.gateway.store.entries == 0
    await nothing_left(baseline, gw, fake=fake, failed=True)

    # The upstream is well again: the next 10 identical requests make one new call together.
    fake.fail_status = None
    fake.gate = asyncio.Event()
    again = [asyncio.create_task(gw.chat()) for _ in range(10)]
    await fake.wait_for_calls(2)
    await eventually(lambda: flight_clients(gw) == 10)
    fake.gate.set()
    async with asyncio.timeout(10):
        responses = await asyncio.gather(*again)
    assert [r.status_code for r in responses] == [200] * 10
    assert {content(r) for r in responses} == {f"answer 2 to {QUESTION}"}
    assert fake.count() == 2 and gw.gateway.store.entries == 1
    assert (await gw.chat()).headers["x-carpool"] == "hit"
    await nothing_left(baseline, gw, fake=fake)


# ------------------------------------------------------------------------------------------------
# Upstream faults


async def test_upstream_500_on_a_stream_request_reaches_every_client_and_nothing_is_stored(
    gw, fake
):
    baseline = Baseline()
    fake.gate = asyncio.Event()
    fake.fail_status, fake.fail_times = 500, 1
    clients = [
        asyncio.create_task(gw.stream_chat()),
        asyncio.create_task(gw.chat()),
        asyncio.create_task(gw.stream_chat()),
    ]
    await fake.wait_for_calls(1)
    await eventually(lambda: flight_clients(gw) == 3)
    fake.gate.set()
    (first, _), plain, (joiner, _) = await asyncio.gather(*clients)
    for response in (first, plain, joiner):
        assert response.status_code == 500 and response.json() == DEFAULT_FAIL_BODY
        assert response.headers["content-type"].startswith("application/json")
    assert gw.gateway.store.entries == 0
    await nothing_left(baseline, gw, fake=fake, failed=True)
    response, raw = await gw.stream_chat()
    assert response.headers["x-carpool"] == "miss" and sse_text(raw) == f"answer 2 to {QUESTION}"
    assert fake.count() == 2
    await nothing_left(baseline, gw, fake=fake)


async def test_upstream_timeout_is_504_for_every_client_and_the_hung_call_is_closed(
    fake, gateway_with
):
    fake.hang = True
    async with gateway_with(limits={"upstream_timeout": 0.5}) as gw:
        baseline = Baseline()
        async with asyncio.timeout(10):
            replies = await asyncio.gather(gw.chat(), gw.stream_chat(), gw.chat())
        responses = [r[0] if isinstance(r, tuple) else r for r in replies]
        assert [r.status_code for r in responses] == [504] * 3
        assert {error_of(r)["code"] for r in responses} == {"upstream_timeout"}
        # However many flights the three made (one, unless a client came late), each of them was
        # one call, and the gateway closed every hung connection.
        outcomes = [r.headers["x-carpool"] for r in responses]
        assert outcomes.count("miss") == fake.count() >= 1
        await fake.wait_until(lambda: fake.cancelled == fake.count(), what="hung calls closed")
        assert gw.gateway.store.entries == 0
        await nothing_left(baseline, gw, fake=fake, failed=True)
        fake.hang = False
        calls = fake.count()
        again = await gw.chat()
        assert (again.status_code, again.headers["x-carpool"]) == (200, "miss")
        assert fake.count() == calls + 1
        await nothing_left(baseline, gw, fake=fake)


async def test_a_stall_mid_stream_ends_every_stream_with_an_error_event_and_is_504_to_the_others(
    fake, gateway_with
):
    """A stall is a timeout: a client sent nothing yet (the non-streaming one) gets 504
    ``upstream_timeout``, not the 502 of a broken stream (it got that, though the same stall
    of a whole answer's call was a 504), still with ``x-should-retry: false`` (the engine took
    the call); those sent frames already get the error event, the timeout's."""
    fake.chunk_gate = asyncio.Event()  # 2 words, then nothing: the stream stalls
    async with gateway_with(limits={"upstream_timeout": 0.5}) as gw:
        baseline = Baseline()
        async with asyncio.timeout(10):
            (r1, raw1), (r2, raw2), plain = await asyncio.gather(
                gw.stream_chat(), gw.stream_chat(), gw.chat()
            )
        for response, raw in ((r1, raw1), (r2, raw2)):
            assert response.status_code == 200
            text, error = sse_failure(raw)
            assert f"answer 1 to {QUESTION}".startswith(text)
            assert error["code"] == "upstream_timeout"
        assert plain.status_code == 504 and error_of(plain)["code"] == "upstream_timeout"
        assert plain.headers["x-should-retry"] == "false"
        await fake.wait_for_cancelled(fake.count())
        assert gw.gateway.store.entries == 0
        await nothing_left(baseline, gw, fake=fake, failed=True)
        fake.chunk_gate = None
        calls = fake.count()
        response, raw = await gw.stream_chat()
        assert response.headers["x-carpool"] == "miss"
        assert sse_text(raw) == f"answer {calls + 1} to {QUESTION}"
        await nothing_left(baseline, gw, fake=fake)


# An upstream that keeps its connection warm without answering (``fakes/raw_upstream.py``): a
# byte every WARM_S, well within the timeout the gateway is given (TRICKLED_TIMEOUT_S).
WARM_S = 0.05
TRICKLED_TIMEOUT_S = 1.0
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def body_chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def chat_event(content: str, finish_reason: str | None = None) -> bytes:
    """A chat stream's event (its ``data:`` line and blank line) carrying ``content``."""
    delta = {"role": "assistant", "content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return b"data: " + orjson.dumps({**chunk, "choices": [choice]}) + b"\n\n"


async def first_event_then_comments() -> AsyncIterator[bytes]:
    """A stream's head and first event, then SSE comments only, for ever: a keep-alive
    (sse-starlette's and llama-cpp-python's ``: ping``, OpenRouter's ``: OPENROUTER
    PROCESSING``) from an upstream that sends nothing else."""
    yield STREAM_HEAD + body_chunk(chat_event("hel"))
    while True:
        await asyncio.sleep(WARM_S)  # (the upstream's pace)
        yield body_chunk(b": ping\n\n")


async def whole_answer_a_byte_at_a_time() -> AsyncIterator[bytes]:
    """A whole answer's head, then its body a byte at a time (padded: longer than any test
    waits)."""
    body = chat_completion("fine") + b" " * 100_000
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
        body
    )
    for i in range(len(body)):
        await asyncio.sleep(WARM_S)
        yield body[i : i + 1]


def first_call_then_fine(
    first: Callable[[], bytes | AsyncIterator[bytes]],
) -> Callable[[RawCall], bytes | AsyncIterator[bytes]]:
    """A raw upstream's answers: ``first()`` to its first call, a plain chat answer after."""
    calls = 0

    def respond(call: RawCall) -> bytes | AsyncIterator[bytes]:
        nonlocal calls
        calls += 1
        return first() if calls == 1 else raw_answer(200, b"OK", chat_completion("fine"))

    return respond


async def timed_out_then_called_again(
    timed_out: httpx.Response, gw: Any, upstream: Any, baseline: Baseline
) -> None:
    """``timed_out`` got the timeout's 504, not to be retried (the engine took the call);
    nothing was stored, the call's connection was closed (never kept for another call), nothing
    is left behind, and the next request calls the upstream again."""
    assert (timed_out.status_code, error_of(timed_out)["code"]) == (504, "upstream_timeout")
    assert timed_out.headers["x-should-retry"] == "false"
    assert gw.gateway.store.entries == 0
    await eventually(lambda: upstream.ended == 1, what="the timed-out call's connection closed")
    await nothing_left(baseline, gw, failed=True)
    again = await gw.chat()
    assert (again.status_code, again.headers["x-carpool"], content(again)) == (200, "miss", "fine")
    assert len(upstream.calls) == upstream.connections == 2


async def test_a_stream_with_only_comments_after_its_first_event_times_out_for_every_client():
    """``limits.upstream_timeout`` runs between a stream's events: a read that brings no
    ``data:`` (an SSE comment, a keep-alive) is none. Counted between any two bytes, a stream
    kept warm by comments after its first event held its streaming client and its joiner for
    ever. The streaming client gets its first event then the timeout's error event, the joiner
    (sent nothing yet) a 504; nothing is stored, the call's connection is closed (not kept for
    another call), and the next request calls again."""

    respond = first_call_then_fine(first_event_then_comments)
    limits = {"upstream_timeout": TRICKLED_TIMEOUT_S}
    async with raw_upstream(respond) as upstream, run_gateway([upstream.url], limits=limits) as gw:
        baseline = Baseline()
        async with asyncio.timeout(10):
            streaming = asyncio.create_task(gw.stream_chat())
            await upstream.arrived.wait()
            plain = asyncio.create_task(gw.chat())
            (response, raw), joined = await asyncio.gather(streaming, plain)
        assert response.status_code == 200
        text, error = sse_failure(raw)
        assert text == "hel" and error["code"] == "upstream_timeout"
        assert joined.headers["x-carpool"] == "coalesced"
        await timed_out_then_called_again(joined, gw, upstream, baseline)


async def test_a_whole_answer_trickling_in_is_504_once_upstream_timeout_has_passed_since_its_call():
    """A whole answer's head and body must come within ``limits.upstream_timeout`` of its call:
    counted between any two bytes, a body sent a byte at a time held its client for as long as
    it took (hours, for a large one). Its client gets 504 ``upstream_timeout`` with
    ``x-should-retry: false`` (the engine took the call); nothing is stored, the connection is
    closed, and the next request calls again."""

    respond = first_call_then_fine(whole_answer_a_byte_at_a_time)
    limits = {"upstream_timeout": TRICKLED_TIMEOUT_S}
    async with raw_upstream(respond) as upstream, run_gateway([upstream.url], limits=limits) as gw:
        baseline = Baseline()
        response = await asyncio.wait_for(gw.chat(), 10)
        await timed_out_then_called_again(response, gw, upstream, baseline)


async def test_a_stream_whose_events_keep_coming_is_not_timed_out_however_long_it_lasts():
    """The timeout runs between two events, not over the whole stream: events a little apart,
    comments between them, for longer in all than ``limits.upstream_timeout``, make a whole
    answer."""
    words = [f"w{i} " for i in range(8)]

    async def events_apart(call: RawCall) -> AsyncIterator[bytes]:
        yield STREAM_HEAD
        for word in words:
            await asyncio.sleep(TRICKLED_TIMEOUT_S / 4)  # (the upstream's pace)
            yield body_chunk(b": ping\n\n") + body_chunk(chat_event(word))
        yield body_chunk(chat_event("", "stop") + b"data: [DONE]\n\n") + b"0\r\n\r\n"

    limits = {"upstream_timeout": TRICKLED_TIMEOUT_S}
    async with (
        raw_upstream(events_apart) as upstream,
        run_gateway([upstream.url], limits=limits) as gw,
    ):
        response, raw = await asyncio.wait_for(gw.stream_chat(), 20)
    assert response.status_code == 200 and sse_text(raw) == "".join(words)
    assert len(upstream.calls) == 1


async def test_refused_connection_is_502_for_every_client_and_the_next_request_tries_again(
    fake, gateway_with
):
    async with gateway_with(upstreams=[f"http://127.0.0.1:{closed_port()}/v1"]) as gw:
        baseline = Baseline()
        async with asyncio.timeout(10):
            replies = await asyncio.gather(gw.chat(), gw.stream_chat(), gw.chat())
        responses = [r[0] if isinstance(r, tuple) else r for r in replies]
        assert [r.status_code for r in responses] == [502] * 3
        assert {error_of(r)["code"] for r in responses} == {"upstream_unreachable"}
        calls = gw.gateway.stats.upstream_calls
        assert [r.headers["x-carpool"] for r in responses].count("miss") == calls
        assert gw.gateway.store.entries == 0
        await nothing_left(baseline, gw, failed=True)
        again = await gw.chat()  # not stored, not lingering: tried again
        assert again.status_code == 502 and again.headers["x-carpool"] == "miss"
        assert gw.gateway.stats.upstream_calls == calls + 1
        await nothing_left(baseline, gw, failed=True)


async def test_a_request_waiting_past_upstream_queue_timeout_for_a_connection_is_a_503(
    fake, gateway_with
):
    """Once one client's long stream held every connection to the replica
    (``limits.upstream_max_connections``), another request waited for one as long as the stream
    ran: ``limits.upstream_timeout`` counts from the send. Past ``upstream_queue_timeout`` every
    client of its flight gets a 503 with ``Retry-After``, nothing sent, nothing stored, and the
    replica is not counted as failing (busy, not down)."""
    limits = {"upstream_max_connections": 1, "upstream_queue_timeout": 0.2}
    async with gateway_with(limits=limits) as gw:
        fake.chunk_gate = asyncio.Event()  # the long stream holds the one connection
        holder = asyncio.create_task(gw.stream_chat())
        await fake.chunk_gate_reached.wait()
        async with asyncio.timeout(WAIT_S):  # (a bound on the test, not a timing it checks)
            refused = await asyncio.gather(gw.chat("quick"), gw.stream_chat("quick"))
        responses = [r[0] if isinstance(r, tuple) else r for r in refused]
        assert [r.status_code for r in responses] == [503, 503], responses[0].text
        assert {error_of(r)["code"] for r in responses} == {"gateway_overloaded"}
        assert {r.headers["retry-after"] for r in responses} == {"1"}
        assert fake.count() == 1  # (the stream's: nothing of "quick" was sent)
        health = (await gw.client.get("/healthz")).json()
        assert [(r["healthy"], r["failures"]) for r in health["replicas"].values()] == [(True, 0)]
        stats = (await gw.client.get("/stats")).json()
        assert stats["upstream_errors"] == 0 and stats["overloaded"] == 1
        fake.chunk_gate.set()
        response, _ = await holder
        assert response.status_code == 200
        again = await gw.chat("quick")  # nothing stored of the 503: asked now
        assert again.status_code == 200 and again.headers["x-carpool"] == "miss"
        assert fake.count() == 2


async def test_a_call_its_busy_replica_could_not_take_in_time_is_tried_on_another(
    fake, gateway_with
):
    """Nothing was sent: another replica's connections may be free, so the call is tried once
    there (each attempt counted in ``overloaded``), and neither replica is counted as failing."""
    limits = {"upstream_max_connections": 1, "upstream_queue_timeout": 0.2}
    async with gateway_with(upstreams=[fake.url, fake.url], limits=limits) as gw:
        fake.chunk_gate = asyncio.Event()  # two long streams hold a connection of each replica
        holders = [asyncio.create_task(gw.stream_chat(f"long {i}")) for i in range(2)]
        await fake.wait_for_calls(2)
        before = gw.gateway.stats.overloaded()
        async with asyncio.timeout(WAIT_S):
            refused = await gw.chat("quick")
        assert refused.status_code == 503 and error_of(refused)["code"] == "gateway_overloaded"
        assert gw.gateway.stats.overloaded() == before + 2  # (on each replica in turn)
        health = (await gw.client.get("/healthz")).json()
        assert [r["healthy"] for r in health["replicas"].values()] == [True, True]
        fake.chunk_gate.set()
        assert [(await holder)[0].status_code for holder in holders] == [200, 200]
        assert fake.count() == 2


@pytest.mark.parametrize("replicas", [1, 2])
async def test_every_client_of_a_flight_its_busy_replicas_could_not_take_gets_its_one_503(
    fake, gateway_with, replicas
):
    """A flight's call waits for a connection ``limits.upstream_queue_timeout`` on its replica,
    and as long again on another one (its one failover). Its joiners wait
    ``coalesce.join_timeout_ms`` for it: past that each made its own call, which queued as long
    again (with the defaults, both 30 s: the leader and a stream got their 503 at 30 s, two
    joiners at 60 s). The default queue timeout is held under half the join timeout, so every
    client of the flight, the streaming one included, gets the flight's one 503: one attempt
    per replica counted in ``overloaded``, nothing of it sent upstream."""
    limits = {"upstream_max_connections": 1}  # (the queue timeout: its default)
    coalesce = {"join_timeout_ms": 3000}
    upstreams = [fake.url] * replicas
    async with gateway_with(upstreams=upstreams, limits=limits, coalesce=coalesce) as gw:
        fake.chunk_gate = asyncio.Event()  # long streams hold each replica's one connection
        holders = [asyncio.create_task(gw.stream_chat(f"long {i}")) for i in range(replicas)]
        await fake.wait_for_calls(replicas)
        before = gw.gateway.stats.overloaded()
        async with asyncio.timeout(WAIT_S):  # (a bound on the test, not a timing it checks)
            refused = await asyncio.gather(
                gw.chat("same"), gw.chat("same"), gw.chat("same"), gw.stream_chat("same")
            )
        responses = [r[0] if isinstance(r, tuple) else r for r in refused]
        assert [r.status_code for r in responses] == [503] * 4, responses[0].text
        assert {error_of(r)["code"] for r in responses} == {"gateway_overloaded"}
        assert gw.gateway.stats.overloaded() == before + replicas  # (the flight's one call)
        assert fake.count() == replicas  # (the long streams': nothing of "same" was sent)
        fake.chunk_gate.set()
        assert [(await holder)[0].status_code for holder in holders] == [200] * replicas


async def test_a_pass_through_call_to_an_unreachable_upstream_is_502_in_openais_shape(gateway_with):
    async with gateway_with(upstreams=[f"http://127.0.0.1:{closed_port()}/v1"]) as gw:
        response = await gw.client.get("/v1/models")
        assert response.status_code == 502
        assert error_of(response)["code"] == "upstream_unreachable"


async def test_a_passthrough_answer_the_replica_cuts_is_logged_as_a_cut_not_a_crash(caplog):
    """A pass-through answer cut after its head (aiohttp's ``ClientPayloadError``) reached its
    client as a cut, but the gateway logged it as its own crash: ``a request failed (500)``
    with a traceback, and uvicorn's ``ASGI callable returned without completing response``.
    It is the upstream's failure: one warning naming the replica, no traceback; the client's
    connection is cut (never a short body that looks whole), and the replica stays in
    rotation (as after a stream that broke part-way: it took the call)."""
    caplog.set_level(logging.INFO)
    cuts = [True]

    def respond(call: RawCall) -> bytes | tuple[bytes, bool]:
        if cuts.pop(0) if cuts else False:
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n"
            return head + b'\r\n{"data": [', True
        return raw_answer(200, b"OK", b'{"object": "list", "data": []}')

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        with pytest.raises(httpx.RemoteProtocolError):
            await gw.client.get("/v1/models")
        await eventually(lambda: any(r.name == "carpool.routing" for r in caplog.records))
        again = await gw.client.get("/v1/models")  # the gateway and the replica serve on
        assert again.status_code == 200 and again.json()["data"] == []
        assert gw.gateway.replicas.snapshot()[upstream.url]["state"] == "healthy"
    assert [r for r in caplog.records if r.levelno >= logging.ERROR and r.name != "asyncio"] == []
    cut = [r for r in caplog.records if r.name == "carpool.routing"]
    assert len(cut) == 1 and cut[0].levelno == logging.WARNING and cut[0].exc_info is None
    line = cut[0].getMessage()
    assert "replica-0" in line and "cut" in line and "truncated" in line


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_under_another_server_a_passthrough_answer_the_replica_cuts_still_cuts_its_client(
    http,
):
    """Without carpool's HTTP protocol (a host serving the app itself) the response is left
    incomplete, and the server closes the connection: never a short body ended as if whole."""

    def respond(call: RawCall) -> tuple[bytes, bool]:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n"
        return head + b'\r\n{"data": [', True

    async with raw_upstream(respond) as upstream:
        gateway = build_gateway(Config(upstreams=[upstream.url]))
        async with serve_app(create_app(gateway), http=http) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.get("/v1/models")


class HeadRefused:
    """A server's part in front of the gateway's app: the first head it is given fails as it is
    sent. ``taint``: that head goes on to the server with a header value no server may write
    (uvicorn refuses it once it counted its reply begun); else it is refused here, nothing of
    it sent (as a server that checks a head before it begins its reply)."""

    def __init__(self, app: Any, taint: bool) -> None:
        self.app, self.taint, self.refused = app, taint, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def sent(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and not self.refused:
                self.refused += 1
                if not self.taint:
                    raise RuntimeError("Invalid HTTP header value.")
                message = {**message, "headers": [*message["headers"], (b"x-bad", b"\x1b")]}
            await send(message)

        await self.app(scope, receive, sent if scope["type"] == "http" else send)


async def test_a_head_refused_before_anything_was_sent_is_followed_by_the_gateways_500(caplog):
    """The gateway counted its reply begun as it handed the head to the server, before the
    server had taken it: a head refused then got no 500 from the gateway (under uvicorn, its
    bare ``Internal Server Error``, no request id, no error shape)."""

    def respond(call: RawCall) -> bytes:
        return raw_answer(200, b"OK", b'{"object": "list", "data": []}')

    async with raw_upstream(respond) as upstream:
        app = HeadRefused(create_app(build_gateway(Config(upstreams=[upstream.url]))), False)
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.get("/v1/models")
    assert response.status_code == 500, response.text
    assert error_of(response)["code"] == "internal_error"
    assert response.headers["x-request-id"]
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name != "asyncio"]
    assert [r.getMessage() for r in failed] == ["a request failed (500)"]


async def test_a_head_the_server_refuses_once_begun_cuts_its_client_with_one_error_logged(caplog):
    """uvicorn counts its reply begun before it checks the head's fields: a head it refuses
    takes no 500 after it. The gateway's 500 is then given up (the client's connection is cut,
    as for a reply that failed once begun), not a second failure in uvicorn's log."""

    def respond(call: RawCall) -> bytes:
        return raw_answer(200, b"OK", b'{"object": "list", "data": []}')

    async with raw_upstream(respond) as upstream:
        app = HeadRefused(create_app(build_gateway(Config(upstreams=[upstream.url]))), True)
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get("/v1/models")
            again = await client.get("/v1/models")
    assert again.status_code == 200
    failed = [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name != "asyncio" and r.exc_info
    ]
    assert [r.getMessage() for r in failed] == ["a request failed (500)"]


async def test_a_stream_cut_part_way_reaches_every_client_as_an_error_and_nothing_is_stored(
    gw, fake
):
    baseline = Baseline()
    fake.chunk_gate, fake.cut_after = asyncio.Event(), 3
    leader = asyncio.create_task(gw.stream_chat())
    await fake.chunk_gate_reached.wait()
    joiners = [
        asyncio.create_task(gw.stream_chat(stream_options={"include_usage": True})),
        asyncio.create_task(gw.chat()),
    ]
    await eventually(lambda: flight_clients(gw) == 3)
    fake.chunk_gate.set()
    async with asyncio.timeout(10):
        (r1, raw1), (r2, raw2), plain = await asyncio.gather(leader, *joiners)
    for response, raw in ((r1, raw1), (r2, raw2)):
        assert response.status_code == 200
        text, error = sse_failure(raw)
        assert text == "answer 1 to"  # the 3 words sent before the cut, no more
        assert error["code"] == "upstream_stream_broken"
    assert [r.headers["x-carpool"] for r in (r1, r2, plain)] == ["miss", "coalesced", "coalesced"]
    assert plain.status_code == 502 and error_of(plain)["code"] == "upstream_stream_broken"
    assert gw.gateway.store.entries == 0
    await nothing_left(baseline, gw, fake=fake, failed=True)
    fake.cut_after = fake.chunk_gate = None
    again = await gw.chat()
    assert again.headers["x-carpool"] == "miss" and content(again) == f"answer 2 to {QUESTION}"
    await nothing_left(baseline, gw, fake=fake)


# ------------------------------------------------------------------------------------------------
# Client faults

BIG_WORDS, BIG_WORD = 200, "x" * 40_000  # an 8 MB answer: far beyond what sockets buffer


async def test_slow_and_stalled_readers_do_not_hold_back_the_other_clients_of_the_flight(gw, fake):
    fake.answer_text = lambda n, body: " ".join([BIG_WORD] * BIG_WORDS)
    full = BIG_WORDS * len(BIG_WORD) + BIG_WORDS - 1
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "big"}],
        "temperature": 0,
        "stream": True,
    }
    baseline = Baseline()
    stalled_clients = [httpx.AsyncClient(base_url=gw.url, timeout=30) for _ in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        for client in stalled_clients:
            await stack.enter_async_context(client)
        # Two clients read one chunk each, then stop reading.
        stalled = [
            await stack.enter_async_context(client.stream("POST", CHAT, json=payload))
            for client in stalled_clients
        ]
        readers = [response.aiter_raw() for response in stalled]
        firsts = [await anext(reader) for reader in readers]

        async def slow_reader() -> str:
            async with gw.client.stream("POST", CHAT, json=payload) as response:
                parts = []
                async for part in response.aiter_bytes():
                    parts.append(part)
                    await asyncio.sleep(0.001)  # the behaviour under test: a slow reader
                return b"".join(parts).decode()

        async with asyncio.timeout(20):
            slow = asyncio.create_task(slow_reader())
            (_, fast), plain = await asyncio.gather(gw.stream_chat("big"), gw.chat("big"))
            assert len(sse_text(fast)) == len(content(plain)) == full
            slow_raw = await slow
        assert sse_text(slow_raw) == sse_text(fast)
        # The stalled ones have not received their answer, and still hold their places...
        assert gw.gateway.flights.waiters == 2
        # ...one resumes and gets all of it; the other goes away without reading.
        rest = b"".join([part async for part in readers[0]])
        assert sse_text((firsts[0] + rest).decode()) == sse_text(fast)
        await stalled[1].aclose()
        await stalled_clients[1].aclose()
    assert fake.count() == 1 and fake.cancelled == 0
    assert (await gw.chat("big")).headers["x-carpool"] == "hit"
    await nothing_left(baseline, gw, fake=fake)


async def test_the_leading_client_leaving_mid_stream_the_joiners_get_the_whole_answer(gw, fake):
    baseline = Baseline()
    fake.chunk_gate = asyncio.Event()
    leader = asyncio.create_task(gw.stream_chat())
    await fake.chunk_gate_reached.wait()  # the leader has received 2 words
    joiners = [asyncio.create_task(gw.stream_chat()), asyncio.create_task(gw.chat())]
    await eventually(lambda: flight_clients(gw) == 3)
    await gone(leader)
    await eventually(lambda: flight_clients(gw) == 2, what="the leader to leave")
    fake.chunk_gate.set()
    async with asyncio.timeout(10):
        (streamed, raw), plain = await asyncio.gather(*joiners)
    assert sse_text(raw) == content(plain) == f"answer 1 to {QUESTION}"
    assert streamed.headers["x-carpool"] == plain.headers["x-carpool"] == "coalesced"
    assert fake.count() == 1 and fake.cancelled == 0
    await nothing_left(baseline, gw, fake=fake)
    hit = await gw.chat()
    assert hit.headers["x-carpool"] == "hit" and content(hit) == f"answer 1 to {QUESTION}"


async def test_every_client_leaving_mid_stream_cancels_the_upstream_call(gw, fake):
    baseline = Baseline()
    fake.chunk_gate = asyncio.Event()
    clients = [asyncio.create_task(gw.stream_chat())]
    await fake.chunk_gate_reached.wait()
    clients += [asyncio.create_task(gw.stream_chat()), asyncio.create_task(gw.chat())]
    await eventually(lambda: flight_clients(gw) == 3)
    await gone(*clients)
    await fake.wait_for_cancelled(1)  # the upstream saw its connection close
    assert fake.count() == 1 and fake.completed == 0
    assert gw.gateway.store.entries == 0
    await nothing_left(baseline, gw, fake=fake, failed=True)
    fake.chunk_gate = None  # a later identical request calls again
    response, raw = await gw.stream_chat()
    assert response.headers["x-carpool"] == "miss" and sse_text(raw) == f"answer 2 to {QUESTION}"
    await nothing_left(baseline, gw, fake=fake)


async def test_a_client_leaving_an_idempotent_list_request_cancels_every_item_call(gw, fake):
    """Each item of a list input is a sub-request in a task of its own: the client leaving must
    cancel all of them (and so their upstream calls), not only the first to start waiting."""
    baseline = Baseline()
    fake.hang = True
    body = {"model": "m", "prompt": ["alpha", "beta", "gamma"], "temperature": 0}
    key = {"Idempotency-Key": "list-1"}
    client = asyncio.create_task(gw.client.post("/v1/completions", json=body, headers=key))
    await fake.wait_for_calls(3)
    await eventually(lambda: gw.gateway.flights.waiters == 3)
    await gone(client)
    await fake.wait_for_cancelled(3)  # every item's call, not one of them
    await nothing_left(baseline, gw, fake=fake, failed=True)
    fake.hang = False  # the record was dropped: a retry runs
    retry = await gw.client.post("/v1/completions", json=body, headers=key)
    assert retry.status_code == 200 and retry.headers["x-carpool"] == "miss"
    texts = [choice["text"] for choice in retry.json()["choices"]]
    assert [text.split(" to ")[1] for text in texts] == body["prompt"]
    assert fake.count() == 6  # the three items, each called again
    await nothing_left(baseline, gw, fake=fake)


async def test_every_client_of_an_embeddings_batch_leaving_cancels_the_batched_call(
    gateway_with, fake
):
    # "on": merged without a probe (a probe would hang on the hanging fake too).
    async with gateway_with(batching={"embeddings": "on"}) as gw:
        await _every_client_of_a_batch_leaving_cancels_its_call(gw, fake)


async def _every_client_of_a_batch_leaving_cancels_its_call(gw, fake):
    baseline = Baseline()
    fake.hang = True
    clients = [
        asyncio.create_task(
            gw.client.post("/v1/embeddings", json={"model": "e", "input": f"text {i}"})
        )
        for i in range(3)
    ]
    calls = await fake.wait_for_calls(1)
    await eventually(lambda: gw.gateway.flights.waiters == 3)
    assert len(calls[0].body["input"]) == 3  # one merged call for the three
    await gone(*clients)
    await fake.wait_for_cancelled(1)
    await nothing_left(baseline, gw, fake=fake, failed=True)
    fake.hang = False
    again = await gw.client.post("/v1/embeddings", json={"model": "e", "input": "text 0"})
    assert again.status_code == 200 and again.headers["x-carpool"] == "miss"
    assert fake.count() == 2
    await nothing_left(baseline, gw, fake=fake)


async def test_a_request_arriving_as_an_abandoned_batch_is_cancelled_gets_a_call_of_its_own():
    """Found by the soak (an embeddings request answered 499 although its client stayed): the
    cancelled batch must take no new caller, or that caller is cancelled with it."""
    calls: list[list[str]] = []
    release = asyncio.Event()

    async def compute(group: str, items: list[str]) -> list[str]:
        calls.append(items)
        await release.wait()
        return [f"call {len(calls)}: {item}" for item in items]

    batcher = KeyedBatcher(compute, max_batch_size=8, max_batch_delay_s=0)
    first = asyncio.create_task(batcher.submit("g", "x", "x"))
    await eventually(lambda: len(calls) == 1)
    first.cancel()  # its only caller leaves: cancelled...
    second = asyncio.create_task(batcher.submit("g", "x", "x"))  # ...as an identical one comes
    await eventually(lambda: len(calls) == 2, what="a call for the newcomer")
    release.set()
    assert await asyncio.wait_for(second, 5) == "call 2: x"
    assert first.cancelled()
    await asyncio.wait_for(batcher.wait_idle(), 5)


async def test_an_upstream_connection_idle_for_as_long_as_the_upstream_keeps_it_is_not_reused(
    gw, fake, monkeypatch
):
    """The keep-alive race: uvicorn (vLLM, SGLang...) closes a connection idle for 5 s; a gateway
    that reuses it at that moment sees a reset and answers 502. The pool drops it first."""
    await gw.chat("one")
    await gw.chat("two")
    assert fake.calls[1].peer == fake.calls[0].peer  # a pooled connection is reused...
    real = wire.monotonic
    monkeypatch.setattr(wire, "monotonic", lambda: real() + 4.5)
    await gw.chat("three")  # ...but not once idle for 4.5 s
    assert fake.calls[2].peer != fake.calls[1].peer


def test_cached_answers_hold_no_more_memory_than_the_cache_budget_counts():
    """Found by the soak (bench_soak.py: gateway RSS 30 % up after warm-up): orjson returns
    bytes with a 4 KB buffer whatever their length, so the 8 MiB exact cache of 300-byte
    streamed answers (assembled with orjson.dumps) really held ~70 MiB."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        answers = [
            Answer("chat", orjson.dumps({"id": i, "text": "x" * 200}), True) for i in range(2000)
        ]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = sum(answer.size for answer in answers)
    assert held < 1.5 * counted, (held, counted)


def test_the_repeat_memo_holds_no_more_memory_than_its_budget_counts():
    """The same orjson buffers, in the memo of raw request bodies: the library API builds them
    with orjson.dumps, so each entry held 4.3 KB more than counted (the default 16 MiB budget of
    150-byte bodies: ~110,000 entries, about half a GiB)."""
    config, memo = Config(), RepeatMemo(("authorization",), max_bytes=1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2000):  # each request over, its memo entry kept
            client = ClientRequest(
                CHAT,
                orjson.dumps(
                    {
                        "model": "m",
                        "temperature": 0,
                        "messages": [{"role": "user", "content": f"q {i}"}],
                    }
                ),
                {"authorization": f"Bearer sk-{i:0>100}", "cache-control": "max-age=60"},
            )
            request = parse(client, 1 << 20)
            memo.remember(memo.key_of(client), request, fingerprint(request, config), None)
        del client, request
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(memo) == 2000
    assert held <= memo.bytes, (held, memo.bytes)  # the budget counts all it holds


# ------------------------------------------------------------------------------------------------
# Infrastructure faults


async def until_redis_is_back(served: Served, prompt: str) -> None:
    """Requests try Redis again once per retry_interval; the first success ends degraded mode."""
    async with asyncio.timeout(10):
        while served.gateway.redis_health()["state"] != "up":
            assert (await served.chat(prompt)).status_code == 200
            await asyncio.sleep(0.01)  # the polling interval (bounded by the timeout)


async def test_redis_killed_mid_stream_and_restarted_no_client_gets_a_broken_answer_as_success(
    fake, killable_redis
):
    pytest.importorskip("redis")
    shared = redis_settings(killable_redis, retry_interval=0.05, timeout=2.0, connect_timeout=2.0)
    async with run_gateway([fake.url], **shared) as a, run_gateway([fake.url], **shared) as b:
        baseline = Baseline()
        assert (await a.chat("before")).headers["x-carpool"] == "miss"
        assert (await b.chat("before")).headers["x-carpool"] == "hit"
        # A leads a stream; B relays its first frames to two clients of its own.
        fake.chunk_gate = asyncio.Event()
        led = asyncio.create_task(a.stream_chat())
        await fake.chunk_gate_reached.wait()
        await eventually(lambda: a.gateway.shared_flights.counts["frames_published"] >= 3)
        relayed = [asyncio.create_task(b.stream_chat()), asyncio.create_task(b.chat())]
        await eventually(
            lambda: (
                b.gateway.shared_flights.counts["frames_relayed"] >= 3
                and b.gateway.flights.waiters == 2
            ),
            what="B relaying A's stream",
        )
        killable_redis.kill()
        fake.chunk_gate.set()
        async with asyncio.timeout(20):
            (response_a, raw_a), (response_b, raw_b), plain_b = await asyncio.gather(led, *relayed)
        # A's client, whose call ran here, has all of it; B's streaming client, which had part
        # of a stream it can no longer follow, gets an SSE error event, never a cut answer as
        # success; B's non-streaming client had received nothing: it takes the call over.
        assert sse_text(raw_a) == f"answer 2 to {QUESTION}"
        assert response_b.status_code == 200
        text, error = sse_failure(raw_b)
        assert text == "answer 2" and error["code"] == "upstream_stream_broken"
        assert plain_b.status_code == 200 and content(plain_b) == f"answer 3 to {QUESTION}"
        assert fake.count() == 3
        await nothing_left(baseline, a, fake=fake)
        await nothing_left(baseline, b, failed=True)

        killable_redis.restart()
        for served in (a, b):
            await until_redis_is_back(served, "probe")
        # Nothing broken was kept: Redis came back empty, and what A kept in its own memory
        # meanwhile was dropped. The retry calls again, then it is shared by both instances.
        calls = fake.count()
        retry = await b.chat()
        assert (retry.status_code, retry.headers["x-carpool"]) == (200, "miss")
        assert content(retry) == f"answer {calls + 1} to {QUESTION}"
        again = await a.chat()
        assert again.headers["x-carpool"] == "hit" and again.json() == retry.json()
        await nothing_left(baseline, a, b, fake=fake)


# ------------------------------------------------------------------------------------------------
# Statuses that are no answer (a raw upstream: ``fakes/raw_upstream.py``)

_UPSTREAM_SECRET = orjson.dumps({"error": {"message": "alice's metadata: s3cr3t", "type": "x"}})


def _chat_answer(text: str = "fine") -> bytes:
    return raw_answer(200, b"OK", chat_completion(text))


def _odd(status: int) -> Callable[[RawCall], bytes | tuple[bytes, bool]]:
    """Answers ``status`` to the prompt "odd", a normal chat answer to anything else; a 101 as
    a server switching protocols does (no body, the connection then closed)."""

    def respond(call: RawCall) -> bytes | tuple[bytes, bool]:
        if call.body["messages"][-1]["content"] != "odd":
            return _chat_answer()
        if status == 101:
            return raw_answer(101, b"Switching Protocols", content_type=None), True
        if status == 304:  # (a 304 has no body: what follows its head is the next answer)
            return raw_answer(304, b"Not Modified")
        return raw_answer(status, b"Whatever", _UPSTREAM_SECRET)

    return respond


@pytest.mark.parametrize("status", [101, 302, 304, 600, 999])
@pytest.mark.parametrize("shape", ["whole", "stream", "bypass"])
async def test_an_upstream_status_neither_2xx_4xx_nor_5xx_is_a_502_of_the_gateways_never_relayed(
    status, shape
):
    """1xx taken as final, 3xx, 600-999 (httptools reads any three digits): relayed, a 999 was
    a KeyError and a connection closed without an answer (the SDK retried it twice), a 101 told
    the client its connection switched protocols, a 304 carried a body. Now the gateway's own
    502 in the API's error shape, as pass-through answers a redirect; nothing stored; the
    client's connection goes on."""
    code = "upstream_redirect" if 300 <= status < 400 else "upstream_bad_status"
    async with raw_upstream(_odd(status)) as upstream, run_gateway([upstream.url]) as gw:
        body = {"model": "m", "messages": [{"role": "user", "content": "odd"}], "temperature": 0}
        if shape == "bypass":
            body["temperature"] = 1
        one = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=gw.url, limits=one, timeout=10) as client:
            for attempt in (1, 2):
                if shape == "stream":
                    response = await client.post(CHAT, json={**body, "stream": True})
                else:
                    response = await client.post(CHAT, json=body)
                assert response.status_code == 502
                assert response.headers["content-type"] == "application/json"
                assert response.headers["x-carpool"] == ("bypass" if shape == "bypass" else "miss")
                error = error_of(response)
                assert error["code"] == code and error["type"] == "upstream_error"
                assert "s3cr3t" not in response.text
                assert len(upstream.calls) == attempt  # never stored: called again
            assert gw.gateway.store.entries == 0
            # The same connection serves the next request.
            fine = {**body, "messages": [{"role": "user", "content": "hello"}]}
            after = await client.post(CHAT, json=fine)
            assert after.status_code == 200 and content(after) == "fine"


async def test_a_joiner_of_another_users_call_answered_304_gets_the_502_and_keeps_its_connection():
    """A 304 with the joiner's ``for_others`` body (194 bytes) desynchronised its keep-alive
    connection: its next request read that body as its answer's head."""
    async with raw_upstream(_odd(304)) as upstream, run_gateway([upstream.url]) as gw:
        upstream.gate = asyncio.Event()
        body = {"model": "m", "messages": [{"role": "user", "content": "odd"}], "temperature": 0}
        one = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=gw.url, limits=one, timeout=10) as bob:
            alice = asyncio.create_task(gw.client.post(CHAT, json={**body, "user": "alice"}))
            await upstream.arrived.wait()
            joiner = asyncio.create_task(bob.post(CHAT, json={**body, "user": "bob"}))
            await eventually(lambda: flight_clients(gw) == 2, what="bob joining alice's call")
            upstream.gate.set()
            led, joined = await asyncio.gather(alice, joiner)
            assert joined.headers["x-carpool"] == "coalesced"
            for response in (led, joined):
                assert response.status_code == 502
                assert error_of(response)["code"] == "upstream_redirect"
            fine = {**body, "messages": [{"role": "user", "content": "hello"}]}
            after = await bob.post(CHAT, json=fine)
            assert after.status_code == 200 and content(after) == "fine"
        assert len(upstream.calls) == 2


# ------------------------------------------------------------------------------------------------
# Answers in a content coding the gateway did not ask for (a raw upstream)

_REFUSAL = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit", "code": None}})
_SSE = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'


def _coded(status: int, body: bytes, coding: bytes, *more: tuple[bytes, bytes]) -> bytes:
    return raw_answer(status, b"Whatever", body, headers=((b"content-encoding", coding), *more))


RETRY = [(b"retry-after", b"7"), (b"retry-after-ms", b"7000"), (b"x-should-retry", b"false")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 0.7], ids=["flight", "bypass"])
async def test_an_upstream_refusal_keeps_what_it_said_of_when_to_retry_shared_or_not(
    gw, fake, temperature, stream
):
    """A sampled request's refusal (a bypass: any request without a temperature) lost the
    upstream's ``Retry-After``, ``retry-after-ms`` and ``x-should-retry``: its SDK hammered a
    rate-limited upstream, or retried a failure the upstream said not to retry."""
    fake.fail_status, fake.response_headers = 429, RETRY
    response = await gw.chat(temperature=temperature, stream=stream)
    assert response.status_code == 429
    assert [(name, response.headers.get(name.decode())) for name, _ in RETRY] == [
        (name, value.decode()) for name, value in RETRY
    ]


@pytest.mark.parametrize("body", [b"[1, 2, 3]", b'"ok"', b"null"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 0.7], ids=["flight", "bypass"])
async def test_a_2xx_body_that_is_no_json_object_is_a_502_shared_or_not(body, stream, temperature):
    """A bypass relayed a JSON array or string as a 200 (an SDK returned a bare list; a
    streaming client got an empty stream and no error), where a flight answered a 502."""
    async with (
        raw_upstream(lambda call: raw_answer(200, b"OK", body)) as upstream,
        run_gateway([upstream.url]) as gw,
    ):
        response = await gw.chat(temperature=temperature, stream=stream)
        assert response.status_code == 502, response.text
        assert "not a JSON object" in response.json()["error"]["message"]
        assert (await gw.client.get("/stats")).json()["upstream_errors"] == 1


# Answers whose 2xx head the upstream sent, then failed (``test_a_bypassed_call...``).
FAILED_2XX = {
    "error-event": raw_answer(
        200, b"OK", b'data: {"error": {"message": "overloaded"}}\n\n', b"text/event-stream"
    ),
    "empty": raw_answer(200, b"OK", b"", b"text/event-stream"),
    "done-only": raw_answer(200, b"OK", b"data: [DONE]\n\n", b"text/event-stream"),
    "not-json": raw_answer(200, b"OK", b"<html>down for maintenance</html>", b"text/html"),
}


async def test_a_bypassed_stream_that_ended_without_an_event_accepts_no_key():
    """A sampled stream that was only ``data: [DONE]`` was relayed as a success and accepted
    its key: in a shared namespace, a key that never got an answer read the others'."""

    def respond(call: RawCall) -> bytes:
        if call.headers.get("authorization") == "Bearer made-up":
            return FAILED_2XX["done-only"]
        return raw_answer(200, b"OK", chat_completion("shared answer"))

    shared = {"x-carpool-namespace": "docs"}
    async with (
        raw_upstream(respond) as upstream,
        run_gateway([upstream.url], tenant={"shared_namespaces": ["docs"]}) as gw,
    ):
        stored = await gw.chat(headers={"authorization": "Bearer real", **shared})
        assert stored.headers["x-carpool"] == "miss"
        made_up = {"authorization": "Bearer made-up"}
        streamed = await gw.chat("other", headers=made_up, temperature=0.7, stream=True)
        assert b"without an answer" in streamed.content
        again = await gw.chat(headers={**made_up, **shared})
        assert again.headers["x-carpool"] == "miss", "a key with no answer read another's"


@pytest.mark.parametrize("how", ["cut", *FAILED_2XX])
async def test_a_bypassed_call_that_failed_is_counted_in_upstream_errors_as_a_flights(fake, how):
    """A bypassed call whose stream broke, carried the upstream's error event or nothing, or
    whose 2xx body was no JSON, was counted in no ``upstream_errors`` (a flight's is): the
    failures of sampled traffic went unseen."""
    async with contextlib.AsyncExitStack() as stack:
        if how == "cut":
            fake.cut_after, url = 1, fake.url
        else:
            upstream = await stack.enter_async_context(raw_upstream(lambda _: FAILED_2XX[how]))
            url = upstream.url
        gw = await stack.enter_async_context(run_gateway([url]))
        response = await gw.chat(temperature=0.7, stream=how != "not-json")
        assert response.headers["x-carpool"] == "bypass"
        assert response.status_code == 502 if how == "not-json" else b"error" in response.content
        assert (await gw.client.get("/stats")).json()["upstream_errors"] == 1
        metrics = (await gw.client.get("/metrics")).text
        assert "\ncarpool_upstream_errors_total 1.0\n" in metrics


@pytest.mark.parametrize(
    ("coding", "compress", "status", "retry"),
    [
        (b"gzip", gzip.compress, 429, (b"retry-after", b"7")),
        (b"x-gzip", gzip.compress, 429, (b"retry-after", b"7")),
        (b"deflate", zlib.compress, 400, None),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_coded_upstream_refusal_reaches_the_client_decoded_with_when_to_retry(
    coding, compress, status, retry, stream
):
    """Asked for ``identity``, an upstream (a proxy before it) compressed its refusal anyway:
    it was relayed as compressed bytes labelled ``application/json`` with no
    ``Content-Encoding``, unreadable (an SDK retrying a 429 could not even read it). Decoded,
    it reaches the client as it would have come uncompressed, its ``Retry-After`` with it."""
    also = () if retry is None else (retry,)
    async with (
        raw_upstream(lambda call: _coded(status, compress(_REFUSAL), coding, *also)) as upstream,
        run_gateway([upstream.url]) as gw,
    ):
        response = await gw.chat(stream=stream)
        assert upstream.calls[0].headers["accept-encoding"] == "identity"
        assert response.status_code == status
        assert "content-encoding" not in response.headers
        assert response.headers["content-type"] == "application/json"
        assert error_of(response)["message"] == "slow down"
        if retry is not None:
            assert response.headers["retry-after"] == "7"


@pytest.mark.parametrize(
    ("coding", "compress"), [(b"gzip", gzip.compress), (b"deflate", zlib.compress)]
)
async def test_a_coded_whole_answer_is_stored_decoded_and_served_to_a_hit_uncoded(coding, compress):
    """A 2xx whole answer so compressed was a 502 "not JSON": decoded, it is the answer, stored
    as its JSON, and a hit serves that without any ``Content-Encoding``."""
    async with (
        raw_upstream(lambda call: _coded(200, compress(chat_completion("fine")), coding)) as up,
        run_gateway([up.url]) as gw,
    ):
        first = await gw.chat()
        assert (first.status_code, first.headers["x-carpool"]) == (200, "miss")
        again = await gw.chat()
        assert (again.status_code, again.headers["x-carpool"]) == (200, "hit")
        for response in (first, again):
            assert "content-encoding" not in response.headers
            assert content(response) == "fine"
        assert len(up.calls) == 1


_GZIP_STREAM = _coded(200, gzip.compress(_SSE + b"data: [DONE]\n\n"), b"gzip")
_GZIP_STREAM = _GZIP_STREAM.replace(b"application/json", b"text/event-stream")


@pytest.mark.parametrize(
    ("answered", "named", "stream"),
    [
        (_coded(200, b"\x0b\x02\x80fine\x03", b"br"), "br", False),
        (_coded(200, b"\x1f\x8b\x08 not gzip", b"gzip"), "gzip", False),
        (_GZIP_STREAM, "gzip", True),
    ],
    ids=["br", "broken gzip", "gzip stream"],
)
async def test_an_answer_in_a_coding_the_gateway_cannot_read_is_a_502_naming_it_nothing_stored(
    answered, named, stream
):
    """An answer in a coding the gateway does not decode (br, zstd, unknown), a gzip that does
    not decode, and any coded stream: the gateway's own 502 in OpenAI's error shape (a stream's
    error event), naming the
    coding the upstream sent although asked for ``identity`` (a coded stream was "ended its
    stream without sending anything", a br answer relayed unreadable or "not JSON"); nothing
    stored: the next identical request calls the upstream again."""
    async with raw_upstream(lambda call: answered) as upstream, run_gateway([upstream.url]) as gw:
        for attempt in (1, 2):
            response = await gw.chat(stream=stream)
            assert "content-encoding" not in response.headers
            if stream:
                # (A stream that fails before its first chunk: a 200 and its error event, as
                # for an engine's empty stream, which the SDKs would not retry.)
                assert response.status_code == 200
                text, error = sse_failure(response.text)
                assert text == ""
            else:
                assert response.status_code == 502
                error = error_of(response)
            assert error["code"] == "upstream_content_coding"
            assert named in error["message"] and "identity" in error["message"]
            assert len(upstream.calls) == attempt
        assert gw.gateway.store.entries == 0


@pytest.mark.parametrize(
    ("body", "coding", "named"),
    [
        (b"", b"gzip", None),
        (b"", b"deflate", None),
        (b"(\xb5/\xfd\x00\x00", b"zstd", "zstd"),
        (b"\x1f\x8b\x08 not gzip", b"gzip", "gzip"),
    ],
    ids=["empty gzip", "empty deflate", "zstd", "broken gzip"],
)
@pytest.mark.parametrize("status", [429, 503])
async def test_a_coded_refusal_the_gateway_cannot_read_keeps_its_status_and_when_to_retry(
    body, coding, named, status
):
    """A refusal whose body is empty (a proxy's bodiless 429 labelled gzip) or in a coding the
    gateway cannot read was a 502 with ``x-should-retry: false``: a rate limit the SDKs back off
    from became one they must not retry. It keeps its status and ``Retry-After``; an unreadable
    text is replaced by the gateway's own naming the coding."""
    answered = _coded(status, body, coding, (b"retry-after", b"7"))
    async with raw_upstream(lambda call: answered) as upstream, run_gateway([upstream.url]) as gw:
        response = await gw.chat()
        assert response.status_code == status
        assert response.headers["retry-after"] == "7"
        assert "content-encoding" not in response.headers
        assert response.headers.get("x-should-retry") != "false"
        if named is not None:
            error = error_of(response)
            assert error["code"] == "upstream_content_coding" and named in error["message"]
        assert gw.gateway.store.entries == 0


async def test_a_coded_answer_decoding_past_the_cap_is_a_502_nothing_stored(monkeypatch):
    """Decoding is bounded (``upstream.http.MAX_DECODED``): a small gzip that inflates past it
    (a bomb) is refused, never held whole."""
    monkeypatch.setattr(upstream_http, "MAX_DECODED", 1024)
    bomb = gzip.compress(b'{"x": "' + b"a" * 4096 + b'"}')
    async with (
        raw_upstream(lambda call: _coded(200, bomb, b"gzip")) as upstream,
        run_gateway([upstream.url]) as gw,
    ):
        response = await gw.chat()
        assert response.status_code == 502
        error = error_of(response)
        assert error["code"] == "upstream_content_coding" and "gzip" in error["message"]
        assert gw.gateway.store.entries == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="counts /proc/PID/fd")
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])  # (a name: its lookup fails first)
async def test_a_call_this_machine_cannot_open_for_want_of_descriptors_is_a_503_and_no_replicas_fault(
    fake, tmp_path, host
):
    """Out of file descriptors (a burst of clients under a low limit), every miss failed to
    connect: a 502 "unreachable", the healthy replica left out for its back-off and counted in
    ``upstream_errors``, as if it had failed. The gateway's own want: a 503 with
    ``Retry-After`` (``gateway_overloaded``), the replica untouched; served again once
    descriptors are free."""
    import resource

    limit = 64
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port)]
            + ["--upstream", fake.url.replace("127.0.0.1", host)],
            env=serve_env({"coalesce": {"window_ms": 0, "adaptive": False}}),
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
        )
    held: list[socket.socket] = []
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)  # (one, kept)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30)
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "q"}]}
    try:
        instance = Instance(port, log, gateway)
        instance.client = client
        await instance.until_serving()
        for _ in range(2 * limit):  # (idle clients: the gateway takes them until it has no fd)
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            held.append(sock)
        descriptors = f"/proc/{gateway.pid}/fd"
        await eventually(lambda: len(os.listdir(descriptors)) >= limit, what="every fd taken")
        refused = await client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "gateway_overloaded"
        assert refused.headers["retry-after"] == "1"
        # (Its readiness probe could not open a connection either: not ready, no verdict.)
        assert (await client.get("/readyz")).status_code == 503
        assert fake.count() == 0
        for sock in held:
            sock.close()
        held.clear()
        await eventually(lambda: len(os.listdir(descriptors)) < limit // 2, what="fds freed")
        health = (await client.get("/healthz")).json()
        assert [(r["healthy"], r["failures"]) for r in health["replicas"].values()] == [
            (True, 0)
        ], health
        served = await client.post("/v1/chat/completions", json=body)
        assert served.status_code == 200 and fake.count() == 1
        stats = (await client.get("/stats")).json()
        assert stats["upstream_errors"] == 0 and stats["overloaded"] >= 1
        assert log.read_text().count("too many open files on this machine") == 1
    finally:
        for sock in held:
            sock.close()
        await client.aclose()
        gateway.terminate()
        gateway.wait(10)


async def test_an_engines_unwrapped_error_object_in_its_stream_fails_it_for_every_client():
    """An engine's error written as its bare error object mid-stream (``{"object": "error",
    "message": ...}``: vLLM's ``ErrorResponse``, unwrapped) was relayed as an ordinary chunk,
    its message to every client of the call; then the stream's end without a finish reason
    failed it with the gateway's words. It is the engine's error, as a wrapped one is."""
    from fakes.raw_upstream import answer, chat_completion, raw_upstream

    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}],
    }
    error = {"object": "error", "message": "engine fell over", "type": "InternalError"}
    body = b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in (chunk, error))
    sse = answer(200, b"OK", body + b"data: [DONE]\n\n", content_type=b"text/event-stream")
    whole = answer(200, b"OK", chat_completion("fine"))
    asked = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    respond = lambda call: sse if call.body.get("stream") else whole  # noqa: E731
    async with raw_upstream(respond) as up, run_gateway([up.url]) as gw:
        streamed = await gw.client.post("/v1/chat/completions", json={**asked, "stream": True})
        again = await gw.client.post("/v1/chat/completions", json={**asked, "stream": True})
        calls = len(up.calls)
    for reply in (streamed, again):
        events = [line for line in reply.text.splitlines() if line.startswith("data: {")]
        assert orjson.loads(events[-1][6:])["error"]["message"] == "engine fell over"
        assert not any('"object":"error"' in event for event in events)
    assert calls == 2  # (nothing stored)
