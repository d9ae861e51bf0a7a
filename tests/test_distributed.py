"""Several gateway instances sharing one real Redis/Valkey (CONTRACT.md config `redis`)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from conftest import run_gateway

pytest.importorskip("redis")


@contextlib.asynccontextmanager
async def two_gateways(fake, redis_server, **config):
    shared = {"redis": redis_server.url, "admin_token": "t",
              "distributed": {"retry_interval": 0.05}, **config}
    async with run_gateway([fake.url], **shared) as a, run_gateway([fake.url], **shared) as b:
        yield a, b


async def test_an_answer_stored_via_one_instance_is_a_hit_on_another(fake, redis_server):
    async with two_gateways(fake, redis_server) as (a, b):
        first = await a.chat()
        again = await b.chat()
        assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
        assert again.json() == first.json() and fake.count() == 1
        assert (await b.client.get("/stats")).json()["redis"]["state"] == "up"


async def test_an_invalidation_on_one_instance_reaches_every_instance(fake, redis_server):
    async with two_gateways(fake, redis_server) as (a, b):
        await a.chat(headers={"x-carpool-tags": "faq"})
        dropped = await a.client.post("/admin/invalidate", json={"tag": "faq"},
                                      headers={"Authorization": "Bearer t"})
        assert dropped.json() == {"invalidated": 1}
        assert (await b.chat()).headers["x-carpool"] == "miss"


async def test_redis_killed_requests_still_succeed_and_health_says_degraded(fake, redis_server):
    async with two_gateways(fake, redis_server) as (a, b):
        assert (await a.chat("before")).headers["x-carpool"] == "miss"
        redis_server.kill()
        during = [await a.chat("during"), await a.chat("during"), await b.chat("before")]
        assert [r.status_code for r in during] == [200, 200, 200]
        # This instance keeps what it computed while Redis is down, in its own memory.
        assert [r.headers["x-carpool"] for r in during] == ["miss", "hit", "miss"]
        health = (await a.client.get("/healthz")).json()
        assert health["status"] == "degraded" and health["redis"]["errors"] >= 1
        assert (await a.client.get("/healthz")).status_code == 200
        redis_server.restart()
        for gateway in (a, b):
            await until_redis_is_back(gateway)
        await b.chat("shared again")
        assert (await a.chat("shared again")).headers["x-carpool"] == "hit"


async def until_redis_is_back(served, timeout: float = 5.0) -> None:
    """Requests probe Redis again once per retry_interval; the first success ends degraded mode."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while served.gateway.redis_health()["state"] != "up":
        assert loop.time() < deadline, "the gateway never reconnected to Redis"
        await served.chat("probe")
        await asyncio.sleep(0.01)
