"""The degraded mode's rules (``store.shared``), each against a real Redis/Valkey: what a
degraded instance keeps in its own memory and when it tries Redis again (a review found each).
Failures are injected by wrapping one call, never by sleeping."""

from __future__ import annotations

from typing import Any

import pytest

from fakes.waiting import eventually
from test_distributed import gateways

pytest.importorskip("redis")

ADMIN = {"Authorization": "Bearer t"}
TAG = {"x-carpool-tags": "faq"}


def fail_once(served: Any) -> None:
    """``served``'s next exact-store get fails as a Redis timeout would: it turns degraded."""
    from carpool.store.base import StoreUnavailable

    redis_store = served.gateway.layers.shared_store.redis
    get = redis_store.get

    async def failing(key: str, kind: str | None = None) -> Any:
        redis_store.get = get
        raise StoreUnavailable("the Redis store failed to get: TimeoutError (injected)")

    redis_store.get = failing


async def degraded_with_an_answer(fake: Any, b: Any) -> Any:
    """B, degraded by one failed call, with an answer kept in its own memory (a hit there)."""
    fail_once(b)
    first = await b.chat("q", headers=TAG)
    assert b.gateway.redis_health()["state"] == "degraded"
    assert (await b.chat("q", headers=TAG)).headers["x-carpool"] == "hit"
    assert fake.count() == 1
    return first


async def test_an_invalidation_received_drops_what_a_degraded_instance_kept_locally(
    fake: Any, redis_server: Any
) -> None:
    """A's invalidation answered 200 and reached B's subscriber: B, degraded (by one transient
    failure) and not yet due to try Redis again, must not serve the answer it kept in its own
    memory. (Before, that memory was emptied only by B's next successful Redis call: B served
    the invalidated answer for up to ``retry_interval``.) The message does not switch B up
    before it is due (no flapping)."""
    distributed = {"retry_interval": 60.0}
    async with gateways(2, fake, redis_server, distributed=distributed) as (a, b):
        channel = b.gateway.invalidations
        await eventually(lambda: a.gateway.invalidations.listening and channel.listening)
        first = await degraded_with_an_answer(fake, b)
        response = await a.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
        assert response.status_code == 200
        await eventually(lambda: channel.counts["received"] == 1, what="B receiving it")
        after = await b.chat("q", headers=TAG)
        assert after.headers["x-carpool"] == "miss" and after.json()["id"] != first.json()["id"]
        assert channel.counts["dropped_locally"] == 1 and fake.count() == 2
        assert b.gateway.redis_health()["state"] == "degraded"  # not due yet: no flapping


async def test_an_invalidation_received_when_due_ends_the_degraded_period(
    fake: Any, redis_server: Any
) -> None:
    """A message from Redis proves it answers: B, degraded and due for another attempt, is up
    once it receives A's invalidation, without a request of its own."""
    distributed = {"retry_interval": 60.0}
    async with gateways(2, fake, redis_server, distributed=distributed) as (a, b):
        channel = b.gateway.invalidations
        await eventually(lambda: a.gateway.invalidations.listening and channel.listening)
        await degraded_with_an_answer(fake, b)
        store = b.gateway.layers.shared_store
        store._next_try = float("-inf")  # (its retry_interval has passed, without a request)
        response = await a.client.post("/admin/invalidate", json={"all": True}, headers=ADMIN)
        assert response.status_code == 200
        await eventually(lambda: channel.counts["received"] == 1, what="B receiving it")
        assert b.gateway.redis_health()["state"] == "up" and store.local.entries == 0


async def test_a_degraded_instance_takes_one_attempt_per_retry_interval_not_one_per_caller(
    redis_server: Any,
) -> None:
    """Degraded, due for another attempt, and Redis hangs: of 20 concurrent gets exactly one
    waits on Redis (it took the attempt); the others are answered from this instance's memory
    at once. (Before, every caller that found the attempt due made it: a herd waiting on a hung
    Redis for ``distributed.timeout`` each.)"""
    import asyncio

    from carpool.redis.store import RedisStore
    from carpool.store.base import StoreUnavailable
    from carpool.store.memory import MemoryStore
    from carpool.store.shared import SharedStore

    redis_store = RedisStore(redis_server.url, socket_timeout=2.0)
    # (A long interval, made due below: the store's own probe, due then too, stays asleep.)
    store = SharedStore(redis_store, MemoryStore(1 << 20), retry_interval=60)
    get, hung, attempts = redis_store.get, asyncio.Event(), []

    # A Redis that hangs until the test lets it answer.
    async def hanging(key: str, kind: str | None = None) -> Any:
        attempts.append(key)
        await hung.wait()
        return await get(key, kind)

    try:
        store.report(StoreUnavailable("injected"))
        redis_store.get = hanging  # type: ignore[method-assign]
        store._next_try = float("-inf")  # (its retry_interval has passed)
        gets = [asyncio.create_task(store.get(f"k{i}")) for i in range(20)]
        await eventually(lambda: sum(g.done() for g in gets) == 19, what="19 local answers")
        assert len(attempts) == 1 and store.degraded
        hung.set()
        assert await asyncio.gather(*gets) == [None] * 20
        assert not store.degraded  # the one attempt succeeded
    finally:
        await store.aclose()


async def test_a_degraded_instances_call_begun_before_an_invalidation_is_not_kept_locally(
    fake: Any, redis_server: Any
) -> None:
    """B, degraded, runs a call; A's invalidation reaches B while it runs: the answer, which may
    predate what was invalidated, is served to its client but kept nowhere (the flights' epoch
    moved on with the message), so B's next request is a fresh call."""
    import asyncio

    distributed = {"retry_interval": 60.0}
    async with gateways(2, fake, redis_server, distributed=distributed) as (a, b):
        channel = b.gateway.invalidations
        await eventually(lambda: a.gateway.invalidations.listening and channel.listening)
        fail_once(b)
        await b.chat("warm-up")  # (B degraded by its failed get)
        assert b.gateway.redis_health()["state"] == "degraded"
        fake.gate = asyncio.Event()
        running = asyncio.create_task(b.chat("q", headers=TAG))
        await fake.wait_until(lambda: fake.count() == 2, what="B's call")
        response = await a.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
        assert response.status_code == 200
        await eventually(lambda: channel.counts["received"] == 1, what="B receiving it")
        fake.gate.set()
        first = await running
        assert first.status_code == 200
        again = await b.chat("q", headers=TAG)
        assert again.headers["x-carpool"] == "miss" and fake.count() == 3


async def fail_answer_fail(served: Any) -> None:
    """Three of ``served``'s requests, whose exact-store gets all began while Redis was up, have
    them land in turn as a failure, an answer, a failure (each request answered before the next
    lands): concurrent calls on a Redis, or a file-descriptor table, that failed for a moment.
    Redis answers throughout: only those two gets fail."""
    import asyncio

    from carpool.store.base import StoreUnavailable

    redis_store = served.gateway.layers.shared_store.redis
    get = redis_store.get
    turns: list[asyncio.Future[bool]] = []  # one per get under way: True, it fails

    async def held(key: str, kind: str | None = None) -> Any:
        turn = asyncio.get_running_loop().create_future()
        turns.append(turn)
        if await turn:
            raise StoreUnavailable("the Redis store failed to get: TimeoutError (injected)")
        return await get(key, kind)

    redis_store.get = held
    try:
        chats = [asyncio.create_task(served.chat(f"q{i}")) for i in range(3)]
        await eventually(lambda: len(turns) == 3, what="three gets under way")
        for landed, (turn, fails) in enumerate(zip(turns, (True, False, True), strict=True), 1):
            turn.set_result(fails)
            await eventually(lambda n=landed: sum(c.done() for c in chats) == n, what="its answer")
        assert [(await chat).status_code for chat in chats] == [200] * 3
    finally:
        redis_store.get = get


async def test_a_relapse_right_after_redis_is_back_is_logged(
    fake: Any, redis_server: Any, caplog: Any
) -> None:
    """Failed, answered, failed again within ``log_interval``: the log's last word on Redis is
    that it is unavailable. (Before, the relapse was not logged, its interval not over: the last
    line said "redis is back" while the instance reported ``degraded``.)"""
    distributed = {"retry_interval": 60.0}  # (no attempt meanwhile: the three gets only)
    async with gateways(1, fake, redis_server, distributed=distributed) as (served,):
        await eventually(lambda: served.gateway.invalidations.listening)
        with caplog.at_level("WARNING", logger="carpool.store"):
            await fail_answer_fail(served)
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("redis ")]
        assert ["back" if " is back " in line else "down" for line in said] == [
            "down",
            "back",
            "down",
        ], said
        assert served.gateway.redis_health()["state"] == "degraded"


async def test_an_idle_instance_is_up_again_once_redis_answers_after_a_relapse(
    fake: Any, redis_server: Any
) -> None:
    """Failed, answered, failed again, then no request: the instance is ``up`` again, since
    Redis answers, within about ``retry_interval``. (Before, only a call, or the invalidation
    subscriber reconnecting after an outage it saw too, ended a degraded period: the subscriber
    never lost Redis here, so with no traffic /healthz said ``degraded`` for good.)"""
    distributed = {"retry_interval": 0.5}
    async with gateways(1, fake, redis_server, distributed=distributed) as (served,):
        await eventually(lambda: served.gateway.invalidations.listening)
        await fail_answer_fail(served)
        calls = fake.count()
        await eventually(
            lambda: served.gateway.redis_health()["state"] == "up",
            what="the idle instance up again",
            state=served.gateway.redis_health,
        )
        health = (await served.client.get("/healthz")).json()
        assert health["redis"]["state"] == "up" and health["redis"]["errors"] == 2
        assert fake.count() == calls  # (no request did it)
