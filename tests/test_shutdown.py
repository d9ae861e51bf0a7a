"""Graceful shutdown of ``carpool serve`` (``carpool.draining``): on SIGTERM the gateway turns
unready and keeps serving for ``shutdown.drain_s``, then the requests in progress finish within
``shutdown.grace_s`` and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aredis

from fakes.instances import instances
from fakes.raw_upstream import RawCall, raw_upstream
from fakes.raw_upstream import answer as raw_answer
from fakes.waiting import eventually

BODY = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "a slow one"}]}


async def test_sigterm_with_50_waiters_on_a_slow_flight_answers_them_all_then_exits(fake):
    settings = {"shutdown": {"drain_s": 1.0, "grace_s": 20}, "log_level": "info"}
    async with instances(1, fake.url, None, settings, connections=60) as (gw,):
        assert (await gw.client.get("/readyz")).status_code == 200
        fake.gate = asyncio.Event()  # the flight's upstream call waits for it
        waiters = [
            asyncio.create_task(gw.client.post("/v1/chat/completions", json=BODY))
            for _ in range(50)
        ]
        await fake.wait_for_calls(2)  # (the readiness probe's GET /models, then the flight)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while (await gw.stats())["waiters"] < 50:  # every one of them on the flight
            assert loop.time() < deadline, "the 50 requests never all joined the flight"
            await asyncio.sleep(0.01)
        gw.proc.send_signal(signal.SIGTERM)
        ready = await gw.client.get("/readyz")  # still serving, but not ready: draining
        assert ready.status_code == 503 and ready.json()["ready"] is False
        fake.gate.set()
        answers = await asyncio.gather(*waiters)
        assert [a.status_code for a in answers] == [200] * 50
        texts = {a.json()["choices"][0]["message"]["content"] for a in answers}
        assert len(texts) == 1 and fake.count("/v1/chat/completions") == 1  # one call, shared
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0  # within the grace period
        log = gw.log.read_text()
        assert "draining" in log


async def test_every_stopping_signal_exits_0(fake):
    # uvicorn re-raised the signal it caught once stopped: SIGTERM without a drain, a second
    # SIGTERM during the drain, and SIGINT ("Aborted!", 1) exited as killed by it, not 0.
    for settings, draining_first, sig in (
        ({"shutdown": {"drain_s": 0}}, False, signal.SIGTERM),
        ({"shutdown": {"drain_s": 30}}, True, signal.SIGTERM),
        ({}, False, signal.SIGINT),
    ):
        async with instances(1, fake.url, None, settings) as (gw,):
            if draining_first:
                await _drained(gw)
            gw.proc.send_signal(sig)
            assert await asyncio.to_thread(gw.proc.wait, 20) == 0, gw.log.read_text()[-2000:]


async def _drained(gw: Any) -> httpx.Response:
    """SIGTERM sent to ``gw``: returns once it drains (``/readyz`` says 503), that answer."""
    gw.proc.send_signal(signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (ready := await gw.client.get("/readyz")).status_code != 503:
        assert loop.time() < deadline, "never draining"
        await asyncio.sleep(0.02)
    return ready


async def _first_event(client: httpx.AsyncClient, path: str, body: dict, **headers: str) -> Any:
    """A stream opened, read until its first data line: it has begun (head and a frame)."""
    response = await client.send(
        client.build_request("POST", path, json=body, headers=headers), stream=True
    )
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data:"):
            break
    return response, lines


async def _rest(response: httpx.Response, lines: Any) -> list[str]:
    """The rest of a stream's lines, to its end (httpx raises if it is cut: no last chunk)."""
    rest = [line async for line in lines if line]
    await response.aclose()
    return rest


async def test_requests_still_running_when_the_grace_period_ends_get_their_apis_shutdown_error(
    fake,
):
    # A stream under way ends with its API's error event, then its end ([DONE] for chat; none
    # for Messages); a reply not begun is a 503 with Retry-After in the API's error shape,
    # x-carpool: bypass; nothing logs a traceback. Before, uvicorn's cancel went through as a
    # crash: a plain-text 500, streams cut with no error and no end, an ERROR traceback each.
    # Served both ways: the HTTP protocol's own (keep-alive) and ASGI's ("connection: close").
    settings = {"shutdown": {"drain_s": 0, "grace_s": 0.3}, "log_level": "info"}
    async with instances(1, fake.url, None, settings) as (gw,):
        fake.chunk_gate = asyncio.Event()  # streams stop after their first chunks, never set
        chat = await _first_event(
            gw.client,
            "/v1/chat/completions",
            {**BODY, "stream": True, "messages": [{"role": "user", "content": "a long story"}]},
        )
        messages = await _first_event(
            gw.client,
            "/v1/messages",
            {**BODY, "stream": True, "max_tokens": 64},
            connection="close",
        )
        fake.gate = asyncio.Event()  # the whole answer's call waits for it, never set
        leader = asyncio.create_task(gw.client.post("/v1/chat/completions", json=BODY))
        joiner = asyncio.create_task(
            gw.client.post("/v1/chat/completions", json=BODY, headers={"connection": "close"})
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while (await gw.stats())["waiters"] < 4:  # the two streams, the leader, its joiner
            assert loop.time() < deadline, "the requests never all joined their flights"
            await asyncio.sleep(0.01)
        gw.proc.send_signal(signal.SIGTERM)

        for answer in await asyncio.gather(leader, joiner):
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "1"
            assert answer.headers["x-carpool"] == "bypass"
            error = answer.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "shutting_down")
        chat_rest = await _rest(*chat)
        assert chat_rest[-1] == "data: [DONE]"
        chat_error = json.loads(chat_rest[-2].removeprefix("data: "))["error"]
        assert chat_error["code"] == "shutting_down"
        messages_rest = await _rest(*messages)
        assert messages_rest[-2:-1] == ["event: error"]
        messages_error = json.loads(messages_rest[-1].removeprefix("data: "))
        assert messages_error["type"] == "error" and "shutting down" in str(messages_error)
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0
        log = gw.log.read_text()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log
        assert log.count("shutting down: a request still waiting was cut") == 2, log
        assert log.count("shutting down: a stream still running was cut") == 2, log


async def test_pass_through_requests_still_running_when_the_grace_period_ends_are_cut_in_the_apis_terms():
    # A pass-through call not answered yet is a 503 with Retry-After in OpenAI's error shape,
    # with its x-request-id; an answer being relayed has its connection cut (never ended as if
    # whole); neither logs a traceback. uvicorn's cancel went through them as a crash: a bare
    # text/plain 500 without x-request-id, and "Exception in ASGI application" at ERROR.
    release = asyncio.Event()  # (the held call's answer, once the test is over)

    async def respond(call: RawCall) -> bytes:
        if call.line.startswith("POST /v1/held "):
            await release.wait()
        if call.line.startswith("GET /v1/half "):
            return _half_answer()  # the rest of its body never comes
        return raw_answer(200, b"OK", b'{"object": "list", "data": []}')

    settings = {"shutdown": {"drain_s": 0, "grace_s": 0.3}, "log_level": "info"}
    async with raw_upstream(respond) as upstream:
        try:
            async with instances(1, upstream.url, None, settings) as (gw,):
                half = await gw.client.send(gw.client.build_request("GET", "/v1/half"), stream=True)
                assert half.status_code == 200
                chunks = half.aiter_raw()
                assert await anext(chunks) == b"the first part"  # its relay under way
                held = asyncio.create_task(gw.client.post("/v1/held", json={"a": 1}))
                await _until(
                    async_(lambda: any(c.line.startswith("POST /v1/held") for c in upstream.calls)),
                    "the held call upstream",
                )
                gw.proc.send_signal(signal.SIGTERM)

                answer = await held
                assert answer.status_code == 503, answer.text
                assert answer.headers["retry-after"] == "1"
                assert answer.headers["content-type"] == "application/json"
                assert answer.headers["x-request-id"]
                assert "x-carpool" not in answer.headers  # (pass-through: never labelled)
                error = answer.json()["error"]
                assert (error["type"], error["code"]) == ("server_error", "shutting_down")
                with pytest.raises(httpx.RemoteProtocolError):  # cut, not ended as if whole
                    async for _ in chunks:
                        pass
                await half.aclose()
                assert await asyncio.to_thread(gw.proc.wait, 20) == 0
                log = gw.log.read_text()
        finally:
            release.set()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert "returned without completing response" not in log, log
    assert log.count("shutting down: a request still waiting was cut (503") == 1, log
    assert log.count("shutting down: an answer still being relayed was cut") == 1, log


async def test_a_request_cut_at_the_end_of_the_grace_period_logs_no_error(fake):
    # The cut is planned (the grace period is the operator's) and carpool says it at INFO, but
    # uvicorn said it too, at ERROR ("Cancel 1 running task(s), timeout graceful shutdown
    # exceeded"): an alert on every rollout that cut a long request.
    settings = {"shutdown": {"drain_s": 0, "grace_s": 0.3}, "log_level": "info"}
    async with instances(1, fake.url, None, settings) as (gw,):
        fake.gate = asyncio.Event()  # the upstream call waits for it, never set
        request = asyncio.create_task(gw.client.post("/v1/chat/completions", json=BODY))
        await _until(lambda: _waiters(gw, 1), "the request in progress")
        gw.proc.send_signal(signal.SIGTERM)
        answer = await request
        assert answer.status_code == 503, answer.text
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0
        log = gw.log.read_text()
    assert log.count("shutting down: a request still waiting was cut") == 1, log
    assert [line for line in log.splitlines() if " ERROR " in line] == [], log
    cancel = [line for line in log.splitlines() if "timeout graceful shutdown exceeded" in line]
    assert len(cancel) == 1 and " INFO uvicorn.error " in cancel[0], log


def _half_answer() -> bytes:
    """An answer's head and the first part of a body its ``content-length`` says is longer."""
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 1000\r\n\r\n" + (
        b"the first part"
    )


async def _until(check: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while not await check():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


async def test_a_call_only_another_instances_follower_needs_finishes_within_the_grace_period(
    fake, redis_server
):
    # A leads a call; its own client leaves, B's follower still waits on it. A gets SIGTERM:
    # its lifespan closed the upstream client and Redis at once, under the call (a healthy
    # replica logged as failed), and B took the call over once the lease ran out: 2 calls.
    settings = {"shutdown": {"drain_s": 0, "grace_s": 20}, "log_level": "info"}
    redis = aredis.Redis.from_url(redis_server.url)
    async with instances(2, fake.url, redis_server.url, settings) as (a, b):
        fake.gate = asyncio.Event()
        mine = asyncio.create_task(a.client.post("/v1/chat/completions", json=BODY))
        await _until(async_(lambda: fake.count("/v1/chat/completions") == 1), "A's call")
        theirs = asyncio.create_task(b.client.post("/v1/chat/completions", json=BODY))
        await _until(lambda: redis.keys("*followed*"), "B following A's call")
        mine.cancel()  # A's own client leaves: the call goes on for B
        await _until(lambda: _waiters(a, 0), "A's client gone")
        a.proc.send_signal(signal.SIGTERM)
        await _until(
            async_(lambda: "Waiting for application shutdown" in a.log.read_text()),
            "A's lifespan shutdown",
        )
        fake.gate.set()
        answer = await theirs
        assert answer.status_code == 200, answer.text
        assert fake.count("/v1/chat/completions") == 1  # A's call, finished for B
        assert await asyncio.to_thread(a.proc.wait, 20) == 0
        assert "left out for" not in a.log.read_text(), a.log.read_text()  # (no replica downed)
    await redis.aclose()


async def test_a_worker_lets_a_call_another_instances_follower_needs_finish_within_the_grace_period(
    fake, redis_server
):
    # As above, A being ``--workers 2``: uvicorn's workers are plain uvicorn servers, which never
    # said when their shutdown began (``Gateway.stop_by``), so the worker's lifespan cancelled
    # the call at once and B took it over: 2 calls.
    settings = {"shutdown": {"drain_s": 0, "grace_s": 20}, "log_level": "info"}
    redis = aredis.Redis.from_url(redis_server.url)
    async with instances(2, fake.url, redis_server.url, settings, workers=[2, 1]) as (a, b):
        fake.gate = asyncio.Event()
        mine = asyncio.create_task(a.client.post("/v1/chat/completions", json=BODY))
        await _until(async_(lambda: fake.count("/v1/chat/completions") == 1), "A's call")
        theirs = asyncio.create_task(b.client.post("/v1/chat/completions", json=BODY))
        await _until(lambda: redis.keys("*followed*"), "B following A's call")
        mine.cancel()  # A's own client leaves: the call goes on for B
        a.proc.send_signal(signal.SIGTERM)
        await _until(
            async_(lambda: a.log.read_text().count("Waiting for application shutdown") == 2),
            "A's workers' lifespan shutdown",
        )
        fake.gate.set()
        answer = await theirs
        assert answer.status_code == 200, answer.text
        assert fake.count("/v1/chat/completions") == 1  # A's call, finished for B
        assert await asyncio.to_thread(a.proc.wait, 30) == 0
    await redis.aclose()


async def test_a_leader_cut_at_the_grace_deadline_hands_its_call_to_its_followers_elsewhere(
    fake, redis_server
):
    # A leads a stream's call, B's whole-answer request follows it; A's grace period ends
    # before the answer. B's client got a 502 "coalesced" (the upstream client closed under
    # the call, published as its failure) where it takes the call over, as after a SIGKILL.
    settings = {"shutdown": {"drain_s": 0, "grace_s": 0.3}, "log_level": "info"}
    redis = aredis.Redis.from_url(redis_server.url)
    async with instances(2, fake.url, redis_server.url, settings) as (a, b):
        fake.chunk_gate = asyncio.Event()  # the stream stops after its first chunks
        body = {**BODY, "messages": [{"role": "user", "content": "a long story"}]}
        mine = await _first_event(a.client, "/v1/chat/completions", {**body, "stream": True})
        theirs = asyncio.create_task(b.client.post("/v1/chat/completions", json=body))
        await _until(lambda: redis.keys("*followed*"), "B following A's call")
        a.proc.send_signal(signal.SIGTERM)
        assert "shutting_down" in "".join(await _rest(*mine))
        assert await asyncio.to_thread(a.proc.wait, 20) == 0
        fake.chunk_gate.set()  # (B's own call, once it took it over)
        answer = await theirs
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-carpool"] == "miss"
    await redis.aclose()


async def test_an_idempotency_key_request_cut_at_the_grace_deadline_leaves_no_record_behind(
    fake, redis_server
):
    # Its record stayed 'processing' in Redis (Redis closed before the cut request gave it
    # up): a retry after the advised Retry-After got 409 until the lease ran out.
    settings = {"shutdown": {"drain_s": 0, "grace_s": 0.3}, "log_level": "info"}
    key = {"Idempotency-Key": "order-42"}
    async with instances(2, fake.url, redis_server.url, settings) as (a, b):
        fake.gate = asyncio.Event()
        cut = asyncio.create_task(a.client.post("/v1/chat/completions", json=BODY, headers=key))
        await _until(async_(lambda: fake.count("/v1/chat/completions") == 1), "A's call")
        a.proc.send_signal(signal.SIGTERM)
        assert (await cut).status_code == 503
        assert await asyncio.to_thread(a.proc.wait, 20) == 0
        fake.gate.set()
        retry = await b.client.post("/v1/chat/completions", json=BODY, headers=key)
        assert retry.status_code == 200, retry.text


async def _waiters(instance: Any, n: int) -> bool:
    return bool((await instance.stats())["waiters"] == n)


def async_(check: Any) -> Any:
    async def checked() -> Any:
        return check()

    return checked


async def test_sighup_to_one_worker_is_logged_and_ignored(fake):
    # SIGHUP's default action killed a one-worker gateway at once: no drain, no log line, the
    # requests in progress cut. A reload is uvicorn's with --workers; here it is said, not done.
    async with instances(1, fake.url, None) as (gw,):
        fake.gate = asyncio.Event()  # the upstream call waits for it
        request = asyncio.create_task(gw.client.post("/v1/chat/completions", json=BODY))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while (await gw.stats())["waiters"] < 1:  # in progress
            assert loop.time() < deadline, "the request never reached its flight"
            await asyncio.sleep(0.01)
        gw.proc.send_signal(signal.SIGHUP)
        while "SIGHUP" not in gw.log.read_text():
            assert gw.proc.poll() is None, gw.log.read_text()[-2000:]
            assert loop.time() < deadline, "SIGHUP was never logged"
            await asyncio.sleep(0.02)
        said = [line for line in gw.log.read_text().splitlines() if "SIGHUP" in line]
        assert len(said) == 1 and "WARNING" in said[0] and "--workers" in said[0], said
        fake.gate.set()
        assert (await request).status_code == 200
        other = {**BODY, "messages": [{"role": "user", "content": "after the SIGHUP"}]}
        assert (await gw.client.post("/v1/chat/completions", json=other)).status_code == 200
        assert (await gw.client.get("/readyz")).status_code == 200  # (not draining)
        assert gw.proc.poll() is None


@pytest.mark.parametrize("drain_s", [0, 30])
async def test_embedding_requests_waiting_in_a_batch_are_sent_when_the_drain_begins(fake, drain_s):
    # A batch left when full or when its delay was over, nothing else: with a delay longer
    # than the grace period, its requests sat through the drain and the grace, then were cut
    # (503), the upstream never asked.
    settings = {
        "shutdown": {"drain_s": drain_s, "grace_s": 20},
        "batching": {"embeddings": "on", "max_batch_delay_ms": 600_000},
        "log_level": "info",
    }
    async with instances(1, fake.url, None, settings) as (gw,):
        waiting = [
            asyncio.create_task(
                gw.client.post("/v1/embeddings", json={"model": "m", "input": f"text {i}"})
            )
            for i in range(3)
        ]

        async def batched() -> bool:
            return bool((await gw.stats())["batching"]["requests"] == 3)

        await _until(batched, "the three requests waiting in a batch")
        gw.proc.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(*waiting)
        assert [a.status_code for a in answers] == [200] * 3, answers[0].text
        assert fake.count("/v1/embeddings") == 1  # (one batch, sent whole)
        if drain_s:  # answered while still draining
            assert (await gw.client.get("/readyz")).status_code == 503
            assert gw.proc.poll() is None
            gw.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0


async def test_a_second_sigint_stops_as_a_second_sigterm_letting_requests_finish(fake):
    # Ctrl-C twice: uvicorn's force quit cut the requests in progress at once, skipped the
    # lifespan's shutdown (the layers never closed) and logged a CancelledError traceback.
    settings = {"shutdown": {"drain_s": 5, "grace_s": 60}, "log_level": "info"}
    async with instances(1, fake.url, None, settings) as (gw,):
        fake.gate = asyncio.Event()  # the upstream call waits for it
        request = asyncio.create_task(gw.client.post("/v1/chat/completions", json=BODY))
        await _until(lambda: _waiters(gw, 1), "the request in progress")
        gw.proc.send_signal(signal.SIGINT)
        await _until(async_(lambda: "Shutting down" in gw.log.read_text()), "stopping")
        gw.proc.send_signal(signal.SIGINT)
        await _until(
            async_(lambda: "already stopping" in gw.log.read_text() or gw.proc.poll() is not None),
            "the second SIGINT handled",
        )
        assert gw.proc.poll() is None, gw.log.read_text()[-3000:]
        fake.gate.set()
        answer = await request
        assert answer.status_code == 200, answer.text
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0
        log = gw.log.read_text()
        assert "Application shutdown complete" in log, log  # (the layers closed)
        assert "Traceback" not in log and " ERROR " not in log, log


async def test_a_third_stopping_signal_quits_at_once_cutting_the_requests_as_the_grace_end_does(
    fake,
):
    # Mashing Ctrl-C quits: the requests still running are cut as at the grace period's end
    # (a 503 with Retry-After), the lifespan still closes the layers, nothing logs a traceback.
    settings = {"shutdown": {"drain_s": 0, "grace_s": 600}, "log_level": "info"}
    async with instances(1, fake.url, None, settings) as (gw,):
        fake.gate = asyncio.Event()  # the upstream call waits for it, never set
        request = asyncio.create_task(gw.client.post("/v1/chat/completions", json=BODY))
        await _until(lambda: _waiters(gw, 1), "the request in progress")
        # (Each once the one before was handled: a signal sent while the same one is pending
        # is lost.)
        for handled in ("Shutting down", "already stopping", "quitting now"):
            gw.proc.send_signal(signal.SIGINT)
            await _until(
                async_(
                    lambda said=handled: said in gw.log.read_text() or gw.proc.poll() is not None
                ),
                handled,
            )
        answer = await request
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "shutting_down"
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0
        log = gw.log.read_text()
        assert "Application shutdown complete" in log, log
        assert "Traceback" not in log and " ERROR " not in log, log
        assert log.count("shutting down: a request still waiting was cut") == 1, log


async def test_every_answer_sent_while_draining_says_connection_close(fake):
    """Behind a proxy that keeps its connections to the gateway (nginx's keepalive pool), the
    drain's answers said nothing of closing: the proxy sent its next request on a connection
    the gateway closed as the drain ended, and its client got a 502. While draining, every
    answer (a hit held by the HTTP protocol, a miss, a control page) says ``Connection: close``
    and its connection closes after it."""
    settings = {"shutdown": {"drain_s": 30, "grace_s": 5}, "log_level": "info"}
    async with instances(1, fake.url, None, settings) as (gw,):
        assert (await gw.client.post("/v1/chat/completions", json=BODY)).status_code == 200
        before = await gw.client.post("/v1/chat/completions", json=BODY)
        assert before.headers.get("connection") != "close"
        ready = await _drained(gw)
        assert ready.headers.get("connection") == "close"
        miss = {**BODY, "messages": [{"role": "user", "content": "another"}]}
        for body in (BODY, miss):  # (a hit, then a miss)
            answered = await gw.client.post("/v1/chat/completions", json=body)
            assert answered.status_code == 200
            assert answered.headers.get("connection") == "close", answered.headers
        gw.proc.send_signal(signal.SIGTERM)  # (a second one ends the drain)
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_request_in_progress_as_the_drain_begins_is_its_connections_last(fake, stream):
    """Only requests begun during the drain were told: one in progress as SIGTERM came (a long
    generation, a stream: the likeliest) was answered without ``Connection: close`` and its
    connection kept, which a proxy then reused as the drain ended. Its answer says it (one
    begun after: a stream's head went out before) and the connection ends with it."""
    settings = {"shutdown": {"drain_s": 30, "grace_s": 5}, "log_level": "info"}
    async with instances(1, fake.url, None, settings) as (gw,):
        fake.gate = asyncio.Event()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        body = orjson.dumps({**BODY, "stream": stream})
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        await eventually(lambda: fake.count("/v1/chat/completions") == 1, what="the call")
        await _drained(gw)
        fake.gate.set()
        answered = await asyncio.wait_for(reader.read(), 20)  # (to the connection's end)
        writer.close()
        head = answered.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 200"), answered[:300]
        if not stream:
            assert b"\r\nconnection: close" in head, head
        gw.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0
