"""A full Redis: ``maxmemory`` reached under ``maxmemory-policy noeviction`` (the policy carpool
asks for: an evicting one loses its indexes and idempotency records). Redis then refuses the
writes that grow it. carpool stores no more answers there (``RedisStore.put``'s scripts are
refused whole: an entry begun with a DEL went past the limit, without bound), while what frees
memory or keeps a generation from running twice still works: invalidations (a full Redis could
not be emptied through /admin/invalidate), flights and idempotency records. Redis answers, so
the instance is not degraded: a refused write is counted (``full``), nothing is kept locally.

Each test fills a real server at once with ``CONFIG SET maxmemory 1``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fakes.waiting import eventually
from test_distributed import gateways

aredis = pytest.importorskip("redis.asyncio")

ADMIN = {"Authorization": "Bearer t"}
TAG = {"x-carpool-tags": "faq"}


@contextlib.asynccontextmanager
async def raw(redis_server: Any) -> AsyncIterator[Any]:
    client = aredis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


async def fill(client: Any) -> None:
    """Redis full from now on: every write that grows it is refused (``OOM``)."""
    assert (await client.config_get("maxmemory-policy"))["maxmemory-policy"] == "noeviction"
    await client.config_set("maxmemory", 1)
    with pytest.raises(aredis.ResponseError, match="OOM|maxmemory"):
        await client.set("probe", "x")


async def entries(client: Any) -> int:
    return len([key async for key in client.scan_iter(match="carpool:e:*")])


async def test_a_full_redis_takes_no_more_answers_and_the_instance_stays_up(
    fake: Any, redis_server: Any
) -> None:
    no_window = {"window_ms": 0}  # (a finished call's lingering flight would answer again)
    async with (
        raw(redis_server) as client,
        gateways(1, fake, redis_server, coalesce=no_window) as (a,),
    ):
        await fill(client)
        first = await a.chat("q")
        assert first.status_code == 200 and first.headers["x-carpool"] == "miss"
        assert await entries(client) == 0  # (before: its entry went past maxmemory)
        health = a.gateway.redis_health()
        assert health["state"] == "up" and health["full"] >= 1
        metrics = (await a.client.get("/metrics", headers=ADMIN)).text
        assert f"carpool_redis_full_total {float(health['full'])}" in metrics
        again = await a.chat("q")  # not kept locally either: nothing clears that of invalidations
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2
        await client.config_set("maxmemory", 0)
        await a.chat("q")
        assert await entries(client) == 1 and (await a.chat("q")).headers["x-carpool"] == "hit"


async def test_an_invalidation_empties_a_full_redis(fake: Any, redis_server: Any) -> None:
    async with raw(redis_server) as client, gateways(2, fake, redis_server) as (a, b):
        await a.chat("q", headers=TAG)
        await a.chat("other")
        assert await entries(client) == 2
        await fill(client)
        by_tag = await b.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
        assert (by_tag.status_code, by_tag.json()) == (200, {"invalidated": 1})
        everything = await b.client.post("/admin/invalidate", json={"all": True}, headers=ADMIN)
        assert everything.status_code == 200 and await entries(client) == 0
        assert (await a.chat("q", headers=TAG)).headers["x-carpool"] == "miss"
        assert b.gateway.redis_health()["state"] == "up"


async def test_a_keyed_request_runs_once_on_a_full_redis_and_its_retries_are_told(
    fake: Any, redis_server: Any
) -> None:
    """Its response, kept for the retention, is not stored by a full Redis (each keyed request
    grew Redis by its body for a day); that it ran is: a retry on another instance is a 507
    saying so, never a second run. The instance that ran it kept a copy and replays it."""
    key = {"Idempotency-Key": "order-1"}
    async with raw(redis_server) as client, gateways(2, fake, redis_server) as (a, b):
        await fill(client)
        first = await a.chat("q", headers=key)
        assert first.status_code == 200
        retry = await b.chat("q", headers=key)
        assert retry.status_code == 507
        assert retry.json()["code"] == "idempotency_response_not_kept"
        assert (await a.chat("q", headers=key)).json() == first.json()
        assert fake.count() == 1
        (record,) = [k async for k in client.scan_iter(match="carpool:*idem*")]
        held = b"".join((await client.hgetall(record)).values())
        assert first.json()["choices"][0]["message"]["content"].encode() not in held
        # Nor the 507's own text (~900 bytes a record, written past maxmemory for a day by
        # every keyed request: a review): the record says "not kept"; its reader words it.
        assert b"not kept" not in held.lower() and len(held) < 200, held


async def test_a_retry_of_a_stream_whose_response_a_full_redis_did_not_keep_is_told_too(
    fake: Any, redis_server: Any
) -> None:
    """The record says it ran in whatever format the retry asks (it was a 422, "held as not a
    stream"), counted as a refusal, not a hit."""
    key = {"Idempotency-Key": "order-2"}
    async with raw(redis_server) as client, gateways(2, fake, redis_server) as (a, b):
        await fill(client)
        first, _ = await a.stream_chat("q", headers=key)
        assert first.status_code == 200
        for retry in ((await b.stream_chat("q", headers=key))[0], await b.chat("q", headers=key)):
            assert retry.status_code == 507
            assert retry.json()["code"] == "idempotency_response_not_kept"
        counts = b.gateway.snapshot()
        assert (counts["hits"], counts["rejected"], counts["latency_ms"]) == (0, 2, {})
        assert fake.count() == 1


async def test_instances_share_one_flight_on_a_full_redis(fake: Any, redis_server: Any) -> None:
    async with raw(redis_server) as client, gateways(2, fake, redis_server) as (a, b):
        await fill(client)
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat("running"))
        await fake.wait_until(lambda: fake.count() == 1, what="the call led by A")
        followed = asyncio.create_task(b.chat("running"))
        flights = b.gateway.layers.shared_flights
        await eventually(lambda: flights.following == 1, what="B following A's call")
        fake.gate.set()
        first, second = await led, await followed
        assert second.json() == first.json() and fake.count() == 1
        assert a.gateway.redis_health()["state"] == b.gateway.redis_health()["state"] == "up"
