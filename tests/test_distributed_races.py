"""Races between instances sharing one real Redis/Valkey: an invalidation against a store on
its way, a leader's link that stalls once, the calls after an invalidation (a review found
each). Each test makes its interleaving happen (hooks, events), never by sleeping."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from conftest import run_gateway

pytest.importorskip("redis")

ADMIN = {"Authorization": "Bearer t"}


@contextlib.asynccontextmanager
async def gateways(n: int, fake: Any, redis_server: Any, **config: Any) -> AsyncIterator[list[Any]]:
    distributed = {
        "retry_interval": 0.05,
        "timeout": 2.0,
        "connect_timeout": 2.0,
        "cluster": redis_server.cluster,
        **config.pop("distributed", {}),
    }
    shared = {"redis": redis_server.url, "admin_token": "t", "distributed": distributed, **config}
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_gateway([fake.url], **shared)) for _ in range(n)]


# ---------------------------------------------------------------- an answer stored after an
# invalidation that answered


@pytest.mark.parametrize("shared_flights", [False, True])
async def test_an_invalidation_that_answered_leaves_no_answer_whose_store_was_on_its_way(
    fake: Any, shared_redis: Any, shared_flights: bool
) -> None:
    """A's call began before B's invalidation, and its store reaches Redis after that
    invalidation answered 200 (A's link is slow; here the put waits for it): the answer, which
    may predate what was dropped, must not be served afterwards. (Before, only A's local epoch
    was checked, before its put: the pub/sub message came too late, and the stale answer was a
    hit on every instance until its TTL.)"""
    async with gateways(2, fake, shared_redis, distributed={"shared_flights": shared_flights}) as (
        a,
        b,
    ):
        redis_store = a.gateway.layers.shared_store.redis
        put = redis_store.put
        answered: list[int] = []

        async def put_after_an_invalidation(key: str, entry: Any, **options: Any) -> Any:
            response = await b.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
            answered.append(response.status_code)
            return await put(key, entry, **options)

        redis_store.put = put_after_an_invalidation
        first = await a.chat("q", headers={"x-carpool-tags": "faq"})
        redis_store.put = put
        assert answered == [200]
        after = await b.chat("q")
        assert after.headers["x-carpool"] == "miss"
        assert after.json()["id"] != first.json()["id"] and fake.count() == 2


async def test_invalidating_everything_while_a_put_is_half_done_leaves_its_entry_indexed(
    shared_redis: Any,
) -> None:
    """A put writes its indexes, then its entry (two round trips). ``{"all": true}`` running in
    between (it found no entry yet) must not leave the entry without its tag index: a later
    tag invalidation must find it. (Before, it UNLINKed the indexes too: the entry stayed
    orphaned, and every tag invalidation answered 0 while it was served.)"""
    from carpool.answer import Answer
    from carpool.redis.store import RedisStore
    from carpool.store import Entry
    from carpool.store.base import Selector

    def store_on() -> RedisStore:
        return RedisStore(shared_redis.url, cluster=shared_redis.cluster, socket_timeout=2.0)

    writer, other = store_on(), store_on()
    try:
        client, pipeline = writer.client, writer.client.pipeline
        pipes: list[Any] = []

        def first_pipeline_then_everything(*args: Any, **kwargs: Any) -> Any:
            pipe = pipeline(*args, **kwargs)
            if not pipes:  # the indexes'
                execute = pipe.execute

                async def then_invalidate(*a: Any, **k: Any) -> Any:
                    result = await execute(*a, **k)
                    assert await other.invalidate(Selector(everything=True)) == 0
                    return result

                pipe.execute = then_invalidate
            pipes.append(pipe)
            return pipe

        client.pipeline = first_pipeline_then_everything
        answer = Answer("chat", b"{}", True)
        await writer.put("k", Entry(answer, time.time() + 60, tags=("faq",)))
        client.pipeline = pipeline
        assert len(pipes) == 2 and await other.get("k") is not None
        assert await other.invalidate(Selector(tag="faq")) == 1
        assert await other.get("k") is None
    finally:
        await writer.aclose()
        await other.aclose()
