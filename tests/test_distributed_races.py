"""Races between instances sharing one real Redis/Valkey: an invalidation against a store on
its way, a leader's link that stalls once, the calls after an invalidation (a review found
each). Each test makes its interleaving happen (hooks, events), never by sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fakes.waiting import WAIT_S, eventually
from test_distributed import gateways, shared_flights_on, stalled_and_steady

pytest.importorskip("redis")

ADMIN = {"Authorization": "Bearer t"}


async def until(
    condition: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT_S
) -> None:
    """``eventually`` for a condition read from Redis."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- an answer stored after an
# invalidation that answered


@pytest.mark.parametrize("path", ["no-shared-flights", "led", "alone"])
async def test_an_invalidation_that_answered_leaves_no_answer_whose_store_was_on_its_way(
    fake: Any, shared_redis: Any, path: str
) -> None:
    """A's call began before B's invalidation, and its store reaches Redis after that
    invalidation answered 200 (A's link is slow; here the put waits for it): the answer, which
    may predate what was dropped, must not be served afterwards, whichever way A made the call
    (``alone``: its claim failed). (Before, only A's local epoch was checked, before its put:
    the pub/sub message came too late, and the stale answer was a hit on every instance until
    its TTL.)"""
    distributed = {"shared_flights": path != "no-shared-flights"}
    async with gateways(2, fake, shared_redis, distributed=distributed) as (a, b):
        shared_store = a.gateway.layers.shared_store
        redis_store = shared_store.redis
        put = redis_store.put
        answered: list[int] = []

        async def put_after_an_invalidation(key: str, entry: Any, **options: Any) -> Any:
            response = await b.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
            answered.append(response.status_code)
            return await put(key, entry, **options)

        redis_store.put = put_after_an_invalidation
        if path == "alone":
            import redis.exceptions

            flights = a.gateway.shared_flights
            claim = flights._claim

            async def refused(**_: Any) -> Any:
                flights._claim = claim  # (once)
                raise redis.exceptions.ConnectionError("refused")

            flights._claim = refused
            fake.gate = asyncio.Event()
        first = asyncio.create_task(a.chat("q", headers={"x-carpool-tags": "faq"}))
        if path == "alone":
            await fake.wait_until(lambda: fake.count() == 1, what="A's call, alone")
            # (Its put goes to Redis, not to this process's memory, once Redis is back: the
            # degraded instance's PING says so. Waiting only until Redis was due to be tried
            # raced with that PING, which takes the attempt: the put, while it was in flight,
            # went to memory, never reaching the hook above; ci44's one failure.)
            await eventually(lambda: not shared_store.degraded, what="Redis back")
            assert fake.gate is not None
            fake.gate.set()
        first_answer = await first
        redis_store.put = put
        assert answered == [200]
        if path == "alone":
            assert a.gateway.shared_flights.counts["alone"] == 1
        after = await b.chat("q")
        assert after.headers["x-carpool"] == "miss"
        assert after.json()["id"] != first_answer.json()["id"] and fake.count() == 2


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


# ---------------------------------------------------------------- a leader's link that stalls once


async def test_a_leader_whose_link_stalls_once_renews_its_lease_again_and_keeps_its_followers(
    fake: Any, redis_server: Any
) -> None:
    """A's link to Redis stalls (Redis and B are fine) longer than a renewal's timeout, shorter
    than the lease: A renews again once it is back, and B's clients, streaming or not, get the
    one call's whole answer. (Before, one failed renewal stopped publishing and renewing for
    good: the lease ran out under a healthy call, B's streaming client got an error event and
    its plain client a second upstream call.)"""
    # (A renewal's timeout is the subject for A, so it is short next to the lease, not so short
    # that a claim on two loaded cores times out: A would go alone, B never relay. B's link is
    # not the subject: its timeout is as long as the test's waits.)
    async with stalled_and_steady(fake, redis_server, lease_ms=12_000) as (a, b, proxy):
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(a.stream_chat("q"))
        await fake.chunk_gate_reached.wait()
        streaming = asyncio.create_task(b.stream_chat("q"))
        plain = asyncio.create_task(b.chat("q"))
        relayed = b.gateway.shared_flights.counts
        await eventually(lambda: relayed["frames_relayed"] >= 2, what="B relaying A's call")
        (publisher,) = a.gateway.shared_flights._publishers
        failures = a.gateway.shared_flights.counts
        proxy.hold()
        await eventually(lambda: failures["errors"] >= 1, what="a renewal that timed out")
        # (The held renewal, sent before the hold, reaches Redis on the release all the
        # same: only a renewal A sends after the release shows it renews again.)
        released_at = asyncio.get_running_loop().time()
        proxy.release()
        await eventually(
            lambda: publisher.renewed_at > released_at,
            what="A renewing its lease once its link is back",
        )
        fake.chunk_gate.set()
        (_, led), (_, followed), answer = await leader, await streaming, await plain
        assert followed.rstrip().endswith("data: [DONE]") and '"error"' not in followed
        assert led.rstrip().endswith("data: [DONE]")
        assert answer.status_code == 200 and answer.headers["x-carpool"] == "coalesced"
        assert fake.count() == 1
        assert relayed["broken"] == 0 and relayed["takeovers"] == 0


async def test_frames_whose_publishing_failed_are_published_again(redis_server: Any) -> None:
    """A batch of frames whose script failed once (a stall, a reset) is sent again with the next
    one: followers get every frame. (Before, ``sent`` moved on before the round trip, and one
    failure stopped publishing for good: the followers' streams ended broken.)"""
    import redis.exceptions

    from carpool.answer import Answer
    from carpool.broadcast import Broadcast
    from carpool.redis.flight_protocol import flight_keys

    async with shared_flights_on(redis_server) as flights:
        client, send = flights._client, flights._frames  # (the frames script)
        failed = asyncio.Event()

        async def failing_once(*args: Any, **kwargs: Any) -> Any:
            if not failed.is_set():
                failed.set()
                raise redis.exceptions.ConnectionError("the link stalled")
            return await send(*args, **kwargs)

        flights._frames = failing_once
        frames = [b"data: 1\n\n", b"data: 2\n\n"]

        async def call(broadcast: Broadcast) -> Answer:
            broadcast.publish(frames[0])
            await failed.wait()
            broadcast.publish(frames[1])
            return Answer("chat", b"{}", True, frames=frames)

        async def keep(_: Answer) -> str:
            return ""

        await flights.run("k", Broadcast(), call, keep)
        flights._frames = send
        _, streams = flight_keys(flights.prefix, "k")
        (stream,) = [key async for key in client.scan_iter(match=streams + "*")]
        entries = await client.xrange(stream)
        published = [fields[b"f"] for _, fields in entries if b"f" in fields]
        assert published == frames and entries[-1][1][b"e"] == b"a"
        assert flights.counts["frames_published"] == 2


@pytest.mark.parametrize("window_ms", [0, 1000])
async def test_a_leader_cancelled_after_its_call_returned_still_ends_its_flight(
    redis_server: Any, window_ms: int
) -> None:
    """The gateway's close cancels a leader whose call has returned while its answer is being
    stored: its follower on another instance gets the answer at once, and the leader renews
    the lock no more. (Before, only the call itself ended the flight when cancelled: the
    publisher renewed the lock for as long as the process ran, even past ``aclose``, the
    follower waiting on it.)"""
    from carpool.answer import Answer
    from carpool.broadcast import Broadcast
    from carpool.redis.flight_protocol import flight_keys

    frame = b"data: 1\n\n"
    # (A lease far longer than the test: only the end the leader publishes ends the wait. Redis
    # calls may take as long as the test's waits: a claim timed out on two loaded cores made A
    # go alone, never leading.)
    distributed = {"lease_ms": 600_000, "timeout": WAIT_S, "connect_timeout": WAIT_S}
    async with (
        shared_flights_on(redis_server, distributed, window_ms=window_ms) as a,
        shared_flights_on(redis_server, distributed, window_ms=window_ms) as b,
    ):
        followed, storing = asyncio.Event(), asyncio.Event()

        async def call(broadcast: Broadcast) -> Answer:
            broadcast.publish(frame)
            await followed.wait()
            return Answer("chat", b"{}", True, frames=[frame])

        async def keep_slowly(_: Answer) -> str:
            storing.set()
            await asyncio.Event().wait()  # (a store on its way: never done here)
            return ""

        async def never_called(_: Broadcast) -> Answer:
            raise AssertionError("B ran the call: it should follow A's")

        async def keep(_: Answer) -> str:
            return ""

        leader = asyncio.create_task(a.run("k", Broadcast(), call, keep_slowly))
        await eventually(lambda: a.leading == 1, what="A leading the call")
        follower = asyncio.create_task(b.run("k", Broadcast(), never_called, keep))
        await eventually(lambda: b.counts["followed"] == 1, what="B following A's call")
        followed.set()
        await storing.wait()
        leader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leader
        answer = await asyncio.wait_for(follower, WAIT_S)
        assert answer.body == b"{}" and answer.frames == [frame]
        lock, _ = flight_keys(a.prefix, "k")

        async def lock_released() -> bool:
            return not await a._client.exists(lock)

        await until(lock_released, "A's lock released")
        await eventually(lambda: not a._publishers, what="A publishing no more")


async def test_a_leader_whose_flights_layer_closed_while_its_call_ran_still_answers_its_clients(
    redis_server: Any,
) -> None:
    """``aclose`` stops the publishing of the flights still led here; the call, still running,
    answers its own clients all the same. (Its publisher's task, cancelled by ``aclose``, was
    awaited as the call ended: the leader ended cancelled, its clients without the answer.)"""
    from carpool.answer import Answer
    from carpool.broadcast import Broadcast

    async with shared_flights_on(redis_server, window_ms=0) as flights:
        returns = asyncio.Event()

        async def call(_: Broadcast) -> Answer:
            await returns.wait()
            return Answer("chat", b"{}", True)

        async def keep(_: Answer) -> str:
            return ""

        leader = asyncio.create_task(flights.run("k", Broadcast(), call, keep))
        await eventually(lambda: flights.leading == 1, what="the call running")
        await flights.aclose()
        returns.set()
        answer = await asyncio.wait_for(leader, WAIT_S)
        assert answer.body == b"{}"


# ---------------------------------------------------------------- after an invalidation


async def test_after_an_invalidation_the_instances_share_one_fresh_call_per_key(
    fake: Any, shared_redis: Any
) -> None:
    """A's streaming call runs, B follows it (frames relayed); an invalidation marks it stale.
    C and D then ask the same: one fresh call, shared, while B still gets A's call to its end.
    (Before, every instance that found the stale lock ran its own call, "alone": N instances,
    N calls per key in flight at each invalidation.)"""
    async with gateways(4, fake, shared_redis) as (a, b, c, d):
        fake.chunk_gate = asyncio.Event()
        led = asyncio.create_task(a.stream_chat("q"))
        await fake.chunk_gate_reached.wait()
        followed = asyncio.create_task(b.stream_chat("q"))
        relayed = b.gateway.shared_flights.counts
        await eventually(lambda: relayed["frames_relayed"] >= 2, what="B relaying A's call")
        response = await c.client.post("/admin/invalidate", json={"tag": "x"}, headers=ADMIN)
        assert response.status_code == 200
        fake.gate = asyncio.Event()  # (the fresh call waits: C and D ask while it runs)
        asking = asyncio.gather(c.chat("q"), d.chat("q"))
        counts = [c.gateway.shared_flights.counts, d.gateway.shared_flights.counts]
        await eventually(
            lambda: (
                sum(n["led"] for n in counts) == 1
                and sum(n["followed"] for n in counts) == 1
                and fake.count() == 2  # A's, and one fresh call for C and D
            ),
            what="one fresh call, led by C or D and followed by the other",
        )
        fake.gate.set()
        fresh = await asking
        assert fresh[0].json()["id"] == fresh[1].json()["id"]
        fake.chunk_gate.set()
        (_, old), (_, relayed_old) = await led, await followed
        assert relayed_old == old and relayed_old.rstrip().endswith("data: [DONE]")
        assert '"error"' not in relayed_old and relayed["broken"] == 0
        assert fresh[0].json()["id"] not in old
        # A's answer is replayed to nobody: the next request gets the fresh one.
        assert (await b.chat("q")).json()["id"] == fresh[0].json()["id"] and fake.count() == 2


# ---------------------------------------------------------------- without a window


async def test_without_a_window_a_claim_that_finds_the_answer_stored_takes_it(
    fake: Any, shared_redis: Any
) -> None:
    """``coalesce.window_ms: 0``: B's request misses the cache while A's call runs; A then
    stores its answer and drops its lock before B claims. B's claim sees the entry (same hash
    slot) and serves it. (Before, it found no lock and led a second upstream call for one key,
    with nothing failing.)"""
    async with gateways(2, fake, shared_redis, coalesce={"window_ms": 0}) as (a, b):
        fake.gate = asyncio.Event()
        first = asyncio.create_task(a.chat("q"))
        await fake.wait_until(lambda: fake.count() == 1, what="A's call")
        store = b.gateway.layers.store
        get = store.get

        async def miss_then_let_a_finish(key: str, kind: str | None = None) -> Any:
            store.get = get  # (once)
            entry = await get(key, kind)
            assert fake.gate is not None
            fake.gate.set()
            await first  # stored, and its lock gone
            return entry

        store.get = miss_then_let_a_finish
        second = await b.chat("q")
        assert store.get == get and fake.count() == 1
        assert second.json()["id"] == (await first).json()["id"]
        assert second.headers["x-carpool"] == "hit"


# ---------------------------------------------------------------- a claim that failed, and landed


async def test_a_claim_that_timed_out_but_landed_leaves_no_lock_nobody_owns(
    fake: Any, shared_redis: Any
) -> None:
    """A's claim reaches Redis, its answer does not reach A in time (a timeout on A's side): A
    runs the call alone, and once Redis answers it takes the lock back, with a "gone" record for
    anyone who followed it. (Before, the lock stayed for lease_ms in the name of a leader that
    never renewed, published or ended it: B's requests followed it, then made a second call.)"""
    import redis.exceptions

    async with gateways(2, fake, shared_redis) as (a, b):
        flights = a.gateway.shared_flights
        claim = flights._claim

        async def lands_then_times_out(**kwargs: Any) -> Any:
            flights._claim = claim  # (once)
            await claim(**kwargs)
            raise redis.exceptions.TimeoutError("Timeout reading from socket")

        flights._claim = lands_then_times_out
        fake.gate = asyncio.Event()
        first = asyncio.create_task(a.chat("q"))
        await fake.wait_until(lambda: fake.count() == 1, what="A's call, alone")
        client = b.gateway.layers.shared_store.redis.client

        async def no_lock() -> bool:
            return not [key async for key in client.scan_iter(match="carpool:lock:*")]

        await until(no_lock, "the lock A's failed claim left taken back", timeout=2.0)
        fake.gate.set()
        assert (await first).status_code == 200 and flights.counts["alone"] == 1
