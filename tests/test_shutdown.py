"""Graceful shutdown of ``carpool serve`` (``carpool.draining``): on SIGTERM the gateway turns
unready and keeps serving for ``shutdown.drain_s``, then the requests in progress finish within
``shutdown.grace_s`` and the process exits 0."""

from __future__ import annotations

import asyncio
import signal

from fakes.instances import instances

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
                gw.proc.send_signal(signal.SIGTERM)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 10
                while (await gw.client.get("/readyz")).status_code != 503:
                    assert loop.time() < deadline, "never draining"
                    await asyncio.sleep(0.02)
            gw.proc.send_signal(sig)
            assert await asyncio.to_thread(gw.proc.wait, 20) == 0, gw.log.read_text()[-2000:]
