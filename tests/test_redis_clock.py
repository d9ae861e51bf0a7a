"""Instances sharing one Redis whose wall clocks disagree (separate machines, NTP broken or
slow): what they share is judged on Redis's clock, never on one instance's.

An instance minutes off runs in this process with its own ``ManualClock`` (its layers read
it), or as a process of its own whose ``time.time`` is shifted (``fakes/skewed_serve.py``: every
reading of the wall clock is off). Redis's own time passing is waited on where a rule needs it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from carpool.clock import ManualClock
from conftest import redis_settings, run_gateway
from fakes.instances import instances

aredis = pytest.importorskip("redis.asyncio")

ADMIN = {"Authorization": "Bearer t"}
NO_WINDOW = {"window_ms": 0}  # (a finished call's lingering flight would answer again)
FAQ = {"x-carpool-tags": "faq"}
FLEET = {"cache": {"default_ttl": 300}, "coalesce": NO_WINDOW}  # (answers live 5 minutes)


def chat(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}


@contextlib.asynccontextmanager
async def instance(fake: Any, target: Any, skew_s: float = 0, **config: Any):
    """A gateway on ``target`` whose wall clock is ``skew_s`` seconds off the system's."""
    distributed = {"retry_interval": 0.05, "timeout": 2.0, "connect_timeout": 2.0}
    shared = {**redis_settings(target, **distributed), "admin_token": "t", **config}
    clock = ManualClock(now=time.time() + skew_s)
    async with run_gateway([fake.url], clock, coalesce=NO_WINDOW, **shared) as served:
        yield served


async def redis_time_passes(target: Any, seconds: float) -> None:
    """Until ``seconds`` have passed on Redis's own clock (``TIME``), from now."""
    node = getattr(target, "nodes", [target])[0]
    client = aredis.Redis.from_url(node.url)
    try:

        async def now() -> float:
            seconds_, micros = await client.time()
            return seconds_ + micros / 1e6

        start = await now()
        while await now() - start < seconds:
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def test_an_invalidation_by_tag_reaches_entries_put_by_instances_minutes_ahead_or_behind(
    fake: Any, shared_redis: Any
) -> None:
    # Each answer lives 5 minutes; B's clock is 10 minutes ahead, C's 10 minutes behind (each a
    # process of its own). The indexes were scored and reaped by each writer's clock: C's member
    # was reaped by A's put (expired by A's clock), A's by B's; the invalidation answered 200
    # and those answers stayed served.
    settings = {**redis_settings(shared_redis), "admin_token": "t", **FLEET}
    async with (
        instances(2, fake.url, None, settings, skews=[600, -600]) as (b, c),
        instance(fake, shared_redis, cache=FLEET["cache"]) as a,
    ):
        for client, prompt in ((c.client, "from c"), (a.client, "from a"), (b.client, "from b")):
            made = await client.post("/v1/chat/completions", json=chat(prompt), headers=FAQ)
            assert made.headers["x-carpool"] == "miss"
        dropped = await a.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
        assert (dropped.status_code, dropped.json()["invalidated"]) == (200, 3)
        # (Each asked once: a miss stores the answer again.)
        for client, prompt in ((a.client, "from c"), (b.client, "from a"), (c.client, "from b")):
            again = await client.post("/v1/chat/completions", json=chat(prompt), headers=FAQ)
            assert again.headers["x-carpool"] == "miss", prompt


async def test_an_answers_age_is_judged_in_redis_time_by_a_reader_whose_clock_is_behind(
    fake: Any, shared_redis: Any
) -> None:
    # B and C run 2 minutes behind A: A's answer was younger than 0 s by their clocks, so it
    # was served as ``Age: 0`` past a client's max-age and past C's own TTL.
    async with (
        instance(fake, shared_redis) as a,
        instance(fake, shared_redis, -120) as b,
        instance(fake, shared_redis, -120, cache={"default_ttl": 1}) as c,
    ):
        for prompt in ("for b", "for c"):  # (a miss stores a fresh answer: one prompt each)
            assert (await a.chat(prompt)).headers["x-carpool"] == "miss"
        await redis_time_passes(shared_redis, 1.2)
        older = await b.chat("for b", headers={"Cache-Control": "max-age=1"})
        assert older.headers["x-carpool"] == "miss", older.headers.get("age")
        past_ttl = await c.chat("for c")
        assert past_ttl.headers["x-carpool"] == "miss", past_ttl.headers.get("age")
        assert fake.count() == 4


async def test_a_reader_whose_clock_is_ahead_serves_a_fresh_answer_within_max_age(
    fake: Any, shared_redis: Any
) -> None:
    # B runs 2 minutes ahead: A's answer just made was 2 minutes old by B's clock, a miss (a
    # second upstream call) for a client accepting a minute.
    async with (
        instance(fake, shared_redis) as a,
        instance(fake, shared_redis, 120) as b,
    ):
        assert (await a.chat()).headers["x-carpool"] == "miss"
        fresh = await b.chat(headers={"Cache-Control": "max-age=60"})
        assert fresh.headers["x-carpool"] == "hit"
        assert int(fresh.headers["age"]) < 60
        assert fake.count() == 1


async def test_an_instance_whose_clock_is_ahead_counts_the_fleets_live_entries(
    fake: Any, shared_redis: Any
) -> None:
    # The counts' script reaped the entries expired by its caller's clock: B, 10 minutes ahead
    # (a process of its own), found the fleet's 5-minute entries all expired and zeroed the
    # counts for good, in every instance's /stats and /metrics.
    settings = {**redis_settings(shared_redis), "admin_token": "t", **FLEET}
    async with instance(fake, shared_redis, cache=FLEET["cache"]) as a:
        for i in range(3):
            assert (await a.chat(f"q{i}")).headers["x-carpool"] == "miss"
        async with instances(1, fake.url, None, settings, skews=[600]) as (b,):
            # (B's first report reads the counts from Redis.)
            seen_by_b = (await b.client.get("/stats", headers=ADMIN)).json()
            assert seen_by_b["layers"]["exact"]["entries"] == 3
        await a.gateway.store.redis.refresh_stats()  # type: ignore[attr-defined]
        assert a.gateway.store.entries == 3


async def test_an_idempotent_replay_on_another_instance_says_the_answers_age_on_redis_clock(
    fake: Any, shared_redis: Any
) -> None:
    # B runs 5 minutes ahead of A. The record kept the writer's wall clock and the replaying
    # instance subtracted it from its own: a key run on B and retried on A said ``age: 0``
    # however old its answer, one run on A and retried on B said 300 s more than it was.
    async with (
        instance(fake, shared_redis) as a,
        instance(fake, shared_redis, 300) as b,
    ):
        for writer, key in ((b, "written-ahead"), (a, "written-behind")):
            first = await writer.chat(key, headers={"Idempotency-Key": key})
            assert first.status_code == 200 and "age" not in first.headers
        await redis_time_passes(shared_redis, 1.2)
        ages = {}
        for replayer, key in ((a, "written-ahead"), (b, "written-behind")):
            replay = await replayer.chat(key, headers={"Idempotency-Key": key})
            assert replay.headers["idempotent-replayed"] == "true", key
            ages[key] = int(replay.headers["age"])
        # (At least the Redis time waited; far less than the clocks' 300 s apart.)
        assert all(1 <= age < 60 for age in ages.values()), ages
        assert fake.count() == 2
