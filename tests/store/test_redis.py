"""The Redis/Valkey store beyond the shared contract: key layout, counts, failures.

The contract itself (get/put/replace/expiry/invalidate, several instances) is in
test_store_contract.py; these run against a real server (tests/fakes/redis_server.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aredis

from carpool.answer import Answer
from carpool.redis.connection import connect
from carpool.redis.store import RedisStore
from carpool.store import Entry
from carpool.store.base import Selector, StoreUnavailable
from conftest import redis_keys
from fakes.redis_server import RedisServer, assert_each_fails_fast
from fakes.waiting import eventually

FINGERPRINT = "0123456789abcdef0123456789abcdef"
EVIL = "x} *evil"


def entry(ttl: float = 60.0, **kw) -> Entry:
    return Entry(Answer("chat", b"x" * 100, True, frames=[b"a"]), time.time() + ttl, **kw)


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@pytest.fixture
def redis_server(killable_redis):
    """Each test here on a single server and on a cluster of its own (killed, paused...)."""
    return killable_redis


def store_on(target, **kw) -> RedisStore:
    return RedisStore(target.url, cluster=target.cluster, **kw)


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aredis.Redis]:
    client = connect(redis_server.url, cluster=redis_server.cluster)
    client.target = redis_server  # (for ``keys``)
    yield client
    await client.aclose()


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    s = store_on(redis_server)
    yield s
    await s.aclose()


async def keys(raw: aredis.Redis) -> set[str]:
    """Every key, on every node of a cluster (KEYS on a cluster client asks one node)."""
    target = raw.target  # type: ignore[attr-defined]
    return {key.decode() for key in await redis_keys(target)}


# --------------------------------------------------------------------------- key layout


async def test_keys_follow_the_layout_and_hold_no_raw_user_input(
    store: RedisStore, raw: aredis.Redis
) -> None:
    await store.put(
        FINGERPRINT,
        entry(tags=(EVIL, "faq"), namespace="ns {1}\n*", prompt_prefix="How do I " + EVIL),
    )
    assert await keys(raw) == {
        f"carpool:e:{{{FINGERPRINT}}}",  # the fingerprint as it is, hash-tagged
        f"carpool:tag:{digest(EVIL)}",
        f"carpool:tag:{digest('faq')}",
        f"carpool:ns:{digest('ns {1}' + chr(10) + '*')}",
        "carpool:prefixes",
        "carpool:{stats}:live",
        "carpool:{stats}:size",
        "carpool:{stats}:bytes",
    }
    assert not any(text in key for key in await keys(raw) for text in (EVIL, "evil", "faq", "{1}"))
    assert 59_000 < await raw.pttl(f"carpool:e:{{{FINGERPRINT}}}") <= 60_001
    # (An index outlives its entries by ``INDEX_SLACK_MS``: their TTLs start apart.)
    assert 60_000 < await raw.pttl(f"carpool:tag:{digest(EVIL)}") <= 61_001


async def test_a_key_that_is_not_a_fingerprint_is_hashed(
    store: RedisStore, raw: aredis.Redis
) -> None:
    await store.put(EVIL, entry())
    await store.put(FINGERPRINT.upper(), entry())
    entry_keys = {key for key in await keys(raw) if key.startswith("carpool:e:")}
    assert len(entry_keys) == 2
    assert all(len(key) == len("carpool:e:{}") + 40 for key in entry_keys)
    assert await store.get(EVIL) is not None and await store.get(FINGERPRINT) is None


async def test_an_entry_an_older_carpool_wrote_without_its_body_length_is_read_as_ever(
    store: RedisStore, raw: aredis.Redis
) -> None:
    """A fleet mid-upgrade shares one cache: an entry's header says its body's length (a body
    cut short is no entry: ``test_redis_corrupt.py``), an older carpool's says none, and that
    one is read unchecked. (An older carpool reads a newer one's, passing over the field.)"""
    await store.put(FINGERPRINT, entry())
    key = f"carpool:e:{{{FINGERPRINT}}}"
    header = orjson.loads(await raw.hget(key, "m"))
    assert header.pop("bl") == 100
    await raw.hset(key, "m", orjson.dumps(header))
    read = await store.get(FINGERPRINT, "chat")
    assert read is not None and read.answer.body == b"x" * 100


async def test_index_keys_expire_with_their_entries_and_counts_go_to_zero(
    store: RedisStore, raw: aredis.Redis
) -> None:
    await store.put(FINGERPRINT, entry(ttl=0.08, tags=("faq",), namespace="docs"))
    assert store.entries == 1
    index_keys = {
        "carpool:prefixes",
        f"carpool:tag:{digest('faq')}",
        f"carpool:ns:{digest('docs')}",
        f"carpool:e:{{{FINGERPRINT}}}",
    }
    deadline = time.monotonic() + 2
    while await keys(raw) & index_keys:
        assert time.monotonic() < deadline, await keys(raw)
        await asyncio.sleep(0.005)
    await store.refresh_stats()  # reaps the expired entry from the counts
    assert store.entries == 0 and store.bytes == 0
    assert await keys(raw) == set()


async def test_a_prefix_separates_stores_on_one_server(
    redis_server: RedisServer, raw: aredis.Redis
) -> None:
    a, b = store_on(redis_server, prefix="a*:"), store_on(redis_server, prefix="b:")
    try:
        await a.put("k", entry(tags=("t",)))
        await b.put("k", entry(tags=("t",)))
        assert await a.invalidate(Selector(everything=True)) == 1
        assert await a.get("k") is None and await b.get("k") is not None
        assert await a.invalidate(Selector(tag="t")) == 0
        # (a's indexes and its count of invalidations stay: supersets that expire by themselves)
        assert not any(key.startswith("a*:e:") for key in await keys(raw))
        assert {key for key in await keys(raw) if key.startswith("b:e:")}
    finally:
        await a.aclose()
        await b.aclose()


def test_a_prefix_with_a_hash_tag_brace_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix"):
        RedisStore("redis://127.0.0.1:1/0", prefix="{carpool}:")


async def test_a_client_that_decodes_responses_is_refused(redis_server: RedisServer) -> None:
    client = aredis.Redis.from_url(redis_server.url, decode_responses=True)
    with pytest.raises(ValueError, match="decode"):
        store_on(redis_server, client=client)
    await client.aclose()


async def test_a_client_passed_in_stays_open_after_aclose(
    redis_server: RedisServer, raw: aredis.Redis
) -> None:
    store = store_on(redis_server, client=raw)
    await store.put("k", entry())
    await store.aclose()
    assert await raw.ping() is True


# --------------------------------------------------------------------------- counts


async def test_counts_are_the_whole_shared_cache_refreshed_by_gets(
    redis_server: RedisServer,
) -> None:
    a = store_on(redis_server)
    b = store_on(redis_server, stats_interval=0)
    try:
        e = entry(tags=("t",))
        await a.put("1", e)
        await a.put("2", e)
        assert (a.entries, a.bytes) == (2, 2 * e.size)
        await b.get("1")  # refreshes b's counts in the background
        await eventually(
            lambda: (b.entries, b.bytes) == (2, 2 * e.size), timeout=2, what="b's counts"
        )
        await b.invalidate(Selector(tag="t"))
        await a.refresh_stats()
        assert (a.entries, a.bytes) == (0, 0)
    finally:
        await a.aclose()
        await b.aclose()


# --------------------------------------------------------------------------- failures


async def test_a_dead_server_makes_every_call_fail_fast_then_a_restart_heals(
    redis_server: RedisServer, store: RedisStore
) -> None:
    await store.put("k", entry(tags=("t",)))
    redis_server.kill()
    calls = [
        store.get("k"),
        store.put("k", entry()),
        store.invalidate(Selector(tag="t")),
        store.invalidate(Selector(prefix="x")),
        store.invalidate(Selector(everything=True)),
        store.refresh_stats(),
    ]
    await assert_each_fails_fast(calls)
    assert store.entries == 1  # the last value seen
    redis_server.restart()  # empty: nothing is persisted
    assert await store.get("k") is None
    await store.put("k", entry())
    assert await store.get("k") is not None


async def test_a_hung_server_fails_a_call_within_the_socket_timeout(
    redis_server: RedisServer, raw: aredis.Redis
) -> None:
    store = store_on(redis_server, socket_timeout=0.2)
    try:
        await store.put("k", entry())
        # A cluster client retries a timeout and re-reads the topology, which times out too
        # (its own policy, redis/connection.py): 0.6-0.8 s at a 0.2 s timeout. The pause is
        # the bound: a call that tried again more times would be answered once it ended.
        timeouts, pause = (4, 1500) if redis_server.cluster else (1, 400)
        for node in getattr(redis_server, "nodes", [redis_server]):
            async with aredis.Redis.from_url(node.url) as client:
                await client.execute_command("CLIENT", "PAUSE", pause, "ALL")
        with pytest.raises(StoreUnavailable, match="Timeout|cannot be connected"):
            await asyncio.wait_for(store.get("k"), 5)
        await asyncio.sleep(pause / 1000)  # (the subject here is the pause itself)
        await raw.ping()  # answered once the pause is over
        assert await store.get("k") is not None
    finally:
        await store.aclose()


async def test_a_command_redis_refuses_raises_store_unavailable(
    store: RedisStore, raw: aredis.Redis
) -> None:
    await raw.set("carpool:prefixes", "not a sorted set")
    with pytest.raises(StoreUnavailable, match="WRONGTYPE"):
        await store.put("k", entry())


async def test_the_invalidation_count_never_repeats_a_value_once_redis_lost_it(
    store: RedisStore, raw: aredis.Redis
) -> None:
    """A call read the generation (``since``) after an invalidation; Redis then restarted
    empty (here: the counter lost) and one invalidation answered before the call's answer was
    put: the answer, which may predate what was dropped, must be taken back. (Before, the
    counter restarted at 0 and came back to the value ``since`` held: the put was kept.)"""
    await store.invalidate(Selector(tag="x"))
    since = await store.generation()
    await raw.delete("carpool:generation")  # as Redis restarting empty
    assert await store.invalidate(Selector(tag="t")) == 0
    assert not await store.put(FINGERPRINT, entry(tags=("t",)), since=since)
    assert await store.get(FINGERPRINT) is None


async def test_invalidating_everything_drops_only_the_stores_own_keys(
    store: RedisStore, raw: aredis.Redis
) -> None:
    await store.put("a" * 32, entry(tags=("t",), namespace="n"))
    # Other layers keep their records under the same prefix: an idempotency record must survive.
    await raw.set("carpool:idem:{" + "b" * 40 + "}", b"record")
    assert await store.invalidate(Selector(everything=True)) == 1
    # The indexes stay (a put racing this must not lose its entry's: they expire with their
    # members), and the count of invalidations.
    assert {k for k in await keys(raw) if not k.startswith(("carpool:tag:", "carpool:ns:"))} == {
        "carpool:idem:{" + "b" * 40 + "}",
        "carpool:prefixes",
        "carpool:generation",
    }
