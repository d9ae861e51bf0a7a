"""The ``Store`` contract (store/base.py), run against every backend through one fixture.

Backend-specific behaviour lives beside it: test_memory.py (LRU, byte budget), test_redis.py
(key layout, failures).

Time: the memory backend reads a ``ManualClock`` that the tests move; the Redis backends expire
entries on the server, so their tests let real time pass (``let_pass``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from carpool.answer import Answer
from carpool.clock import SYSTEM_CLOCK, Clock, ManualClock
from carpool.redis.store import RedisStore
from carpool.store import Entry, MemoryStore, Store
from carpool.store.base import Selector

# "memory-packed": the memory store keeping no entry's objects (each packed: store/packed.py),
# as it keeps all but its most recently used ones.
BACKENDS = ["memory", "memory-packed", "redis", "redis-cluster"]
SHARED_BACKENDS = ["redis", "redis-cluster"]  # backends that several gateway instances share


def redis_url(request: pytest.FixtureRequest) -> tuple[str, bool]:
    """(URL, cluster?) of the server the backend under test runs on."""
    if request.param == "redis-cluster":
        return request.getfixturevalue("redis_cluster").url, True
    return request.getfixturevalue("redis_server").url, False


# User input that must work as a tag or namespace and never collide with another.
ODD_NAMES = [
    "",
    " ",
    "a",
    "a ",
    "A",
    "a b",
    "{",
    "}",
    "{x}",
    "x} *evil",
    ":",
    "a:b",
    "*",
    "?",
    "[a]",
    "\\",
    "\n",
    "x\ny",
    "tag:a",
    "carpool:",
    ",",
    "a,b",
    "ünïcödé",
    "日本語",
    "🙂",
]


@pytest.fixture
def manual_clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, manual_clock: ManualClock) -> AsyncIterator[Store]:
    if request.param.startswith("memory"):
        hot = 0 if request.param == "memory-packed" else 1024
        backend: Store = MemoryStore(100_000_000, clock=manual_clock, hot=hot)
    else:
        url, cluster = redis_url(request)
        backend = RedisStore(url, cluster=cluster)
    yield backend
    await backend.aclose()


@pytest.fixture
def clock(store: Store, manual_clock: ManualClock) -> Clock:
    """The clock the backend's expiry follows: the manual one for the memory store, the system's
    for Redis (the server expires entries)."""
    return manual_clock if isinstance(store, MemoryStore) else SYSTEM_CLOCK


@pytest.fixture(params=SHARED_BACKENDS)
async def two_instances(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Store, Store]]:
    url, cluster = redis_url(request)
    a, b = RedisStore(url, cluster=cluster), RedisStore(url, cluster=cluster)
    yield a, b
    await a.aclose()
    await b.aclose()


def entry(
    body: bytes = b"x" * 100,
    ttl: float = 60.0,
    *,
    frames: list[bytes] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    **kw,
) -> Entry:
    return Entry(Answer("chat", body, True, frames=frames), clock.now() + ttl, **kw)


def counted(store: Store, key: str, entry: Entry) -> int:
    """What ``store.bytes`` counts for ``entry`` under ``key``: what it holds in the process for
    the memory store (store/memory.py), its payload (``Entry.size``) for Redis."""
    return store.counted(key, entry) if isinstance(store, MemoryStore) else entry.size


async def until(condition: Callable[[], Awaitable[bool]], timeout: float = 2.0) -> None:
    """Return once ``await condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        await asyncio.sleep(0.005)


async def let_pass(clock: Clock, seconds: float, condition: Callable[[], Awaitable[bool]]) -> None:
    """Let ``seconds`` pass for the backend: move its manual clock, or (Redis) wait in real time
    until ``condition`` holds."""
    if isinstance(clock, ManualClock):
        clock.advance(seconds)
    else:
        await until(condition)


def assert_same(got: Entry | None, put: Entry, store: Store) -> None:
    """``got`` (from ``store``) is ``put``, byte for byte; its times (the answer's ``created``,
    ``expires``) as the memory store keeps them, or within a second where Redis keeps them: in Redis time
    (ms, stamped by its scripts), read back on this process's clock, a round trip or two apart
    (``redis.store``'s contract: instances' clocks may be minutes apart, Redis's is one)."""
    assert got is not None
    a, b = got.answer, put.answer
    assert (a.kind, a.body, a.complete, a.tokens, a.frames, a.usage_frame) == (
        b.kind,
        b.body,
        b.complete,
        b.tokens,
        b.frames,
        b.usage_frame,
    )
    assert type(a.body) is bytes and type(a.created) is float
    assert (got.tags, got.namespace, got.prompt_prefix) == (
        put.tags,
        put.namespace,
        put.prompt_prefix,
    )
    slack = 0.0 if isinstance(store, MemoryStore) else 1.0
    assert a.created == pytest.approx(b.created, abs=slack)
    assert got.expires == pytest.approx(put.expires, abs=slack)


# --------------------------------------------------------------------------- get / put


async def test_get_returns_what_was_put_byte_exact(store: Store) -> None:
    frames = [b'data: {"a":1}\n\n', b"", bytes(range(256)), b"data: \xff\xfe\r\n\r\n"]
    put = Entry(
        Answer(
            "completion",
            bytes(range(256)) * 3 + b"\r\n\x00",
            True,
            tokens=42,
            created=1712345678.1234567,
            frames=frames,
            usage_frame=2,
        ),
        time.time() + 60,
        ("faq", "news"),
        "docs",
        "How do I ünïcödé\n{*}",
    )
    await store.put("0123456789abcdef0123456789abcdef", put)
    assert_same(await store.get("0123456789abcdef0123456789abcdef"), put, store)
    assert store.entries == 1 and store.bytes == counted(
        store, "0123456789abcdef0123456789abcdef", put
    )


async def test_an_answer_that_did_not_stream_has_no_frames(store: Store) -> None:
    for key, frames in (("none", None), ("empty", [])):
        put = entry(b'{"ok": true}', frames=frames)
        await store.put(key, put)
        got = await store.get(key)
        assert_same(got, put, store)
        assert got is not None and got.answer.frames == frames


async def test_forget_drops_one_keys_entry_and_says_whether_there_was_one(store: Store) -> None:
    """``forget(key)``: a shared flight takes back what it stored when an invalidation came
    (``redis/flights.py``). Another key's entry stays; a key with none says so."""
    fingerprint = "0123456789abcdef0123456789abcdef"
    twin = "f" + fingerprint[1:]  # (another key, the same last 60 bits in the memory store)
    await store.put(fingerprint, entry(b"one"))
    await store.put("other", entry(b"two"))
    assert await store.forget(twin) is False
    assert await store.forget(fingerprint) is True
    assert await store.get(fingerprint) is None and await store.forget(fingerprint) is False
    got = await store.get("other")
    assert got is not None and got.answer.body == b"two" and store.entries == 1


async def test_a_miss_returns_none(store: Store) -> None:
    assert await store.get("0123456789abcdef0123456789abcdef") is None
    assert await store.get("never put") is None
    assert store.entries == 0 and store.bytes == 0


async def test_an_already_expired_entry_is_never_returned(store: Store, clock: Clock) -> None:
    await store.put("k", entry(ttl=-1, clock=clock))
    assert await store.get("k") is None


async def test_an_entry_is_not_returned_once_its_ttl_has_passed(store: Store, clock: Clock) -> None:
    put = entry(ttl=0.3, clock=clock)
    await store.put("k", put)
    got = await store.get("k")
    if got is not None or clock.now() < put.expires:  # a slow machine may be past it already
        assert_same(got, put, store)

    async def gone() -> bool:
        return await store.get("k") is None

    await let_pass(clock, 0.3, gone)
    assert await gone()
    assert clock.now() >= put.expires


async def test_put_replaces_the_entry_and_its_tags(store: Store) -> None:
    await store.put(
        "k", entry(b"old", frames=[b"o"], tags=("old",), namespace="a", prompt_prefix="old prompt")
    )
    new = entry(b"new", tags=("new",), namespace="b", prompt_prefix="new prompt")
    await store.put("k", new)
    assert_same(await store.get("k"), new, store)
    assert store.entries == 1 and store.bytes == counted(store, "k", new)
    # The old entry's tag, namespace and prefix no longer reach the new one.
    assert await store.invalidate(Selector(tag="old")) == 0
    assert await store.invalidate(Selector(namespace="a")) == 0
    assert await store.invalidate(Selector(prefix="old")) == 0
    assert_same(await store.get("k"), new, store)
    assert await store.invalidate(Selector(tag="new")) == 1


async def test_putting_an_expired_entry_replaces_the_live_one(store: Store, clock: Clock) -> None:
    await store.put("k", entry())
    await store.put("k", entry(ttl=-1, clock=clock))
    assert await store.get("k") is None


async def test_an_entry_already_expired_when_put_is_not_stored_counted_nor_evicting(
    store: Store, clock: Clock
) -> None:
    """An answer back-dated past its TTL (an upstream's ``age``) takes no room: the live
    entries stay, nothing is counted for it, nothing is evicted."""
    live = entry(clock=clock)
    await store.put("live", live)
    entries, size = store.entries, store.bytes
    for i in range(5):
        await store.put(f"dead {i}", entry(ttl=-3600, clock=clock))
    assert (store.entries, store.bytes) == (entries, size) == (1, counted(store, "live", live))
    assert_same(await store.get("live"), live, store)
    if isinstance(store, MemoryStore):
        assert store.evictions == 0 and store._entries.expirations == 0


# --------------------------------------------------------------------------- invalidate


async def fill(store: Store) -> dict[str, Entry]:
    puts = {
        "1": entry(tags=("faq", "shared"), namespace="docs", prompt_prefix="How do I"),
        "2": entry(tags=("news",), namespace="docs", prompt_prefix="What is"),
        "3": entry(tags=("shared",), namespace="code", prompt_prefix="How do I"),
        "4": entry(namespace="code", prompt_prefix="Why"),
    }
    for key, put in puts.items():
        await store.put(key, put)
    return puts


async def present(store: Store) -> set[str]:
    return {key for key in "1234" if await store.get(key) is not None}


async def test_invalidate_by_tag_drops_only_that_tag(store: Store) -> None:
    puts = await fill(store)
    assert await store.invalidate(Selector(tag="shared")) == 2
    assert await present(store) == {"2", "4"}
    assert await store.invalidate(Selector(tag="shared")) == 0
    assert await store.invalidate(Selector(tag="nope")) == 0
    assert store.entries == 2
    assert store.bytes == counted(store, "2", puts["2"]) + counted(store, "4", puts["4"])


async def test_invalidate_by_namespace_drops_only_that_namespace(store: Store) -> None:
    await fill(store)
    assert await store.invalidate(Selector(namespace="docs")) == 2
    assert await present(store) == {"3", "4"}
    assert await store.invalidate(Selector(namespace="doc")) == 0
    assert store.entries == 2


async def test_invalidate_by_prompt_prefix_drops_the_prompts_that_start_with_it(
    store: Store,
) -> None:
    await fill(store)
    assert await store.invalidate(Selector(prefix="How do")) == 2
    assert await present(store) == {"2", "4"}
    assert await store.invalidate(Selector(prefix="how")) == 0  # case matters
    assert (
        await store.invalidate(Selector(prefix="What is it")) == 0
    )  # longer than the stored prefix
    assert await store.invalidate(Selector(prefix="*")) == 0  # literal, not a pattern
    assert await store.invalidate(Selector(prefix="W")) == 2
    assert store.entries == 0 and store.bytes == 0


async def test_invalidate_everything_drops_all_and_the_store_keeps_working(store: Store) -> None:
    await fill(store)
    assert await store.invalidate(Selector(everything=True)) == 4
    assert await present(store) == set()
    assert store.entries == 0 and store.bytes == 0
    assert await store.invalidate(Selector(everything=True)) == 0
    put = entry(tags=("faq",))
    await store.put("1", put)
    assert_same(await store.get("1"), put, store)
    assert await store.invalidate(Selector(tag="faq")) == 1


async def test_expired_entries_are_not_counted_by_invalidate(store: Store, clock: Clock) -> None:
    await store.put("short", entry(ttl=0.05, tags=("t",), clock=clock))
    await store.put("long", entry(tags=("t",), clock=clock))

    async def expired() -> bool:
        return await store.get("short") is None

    await let_pass(clock, 0.05, expired)
    assert await store.invalidate(Selector(tag="t")) == 1


async def test_odd_tags_and_namespaces_work_and_never_collide(store: Store) -> None:
    for i, name in enumerate(ODD_NAMES):
        await store.put(f"t{i}", entry(tags=(name,), namespace="tagged"))
        await store.put(f"n{i}", entry(namespace=name))
    for i, name in enumerate(ODD_NAMES):
        assert await store.invalidate(Selector(tag=name)) == 1, repr(name)
        assert await store.get(f"t{i}") is None
        assert await store.invalidate(Selector(namespace=name)) == 1, repr(name)
        assert await store.get(f"n{i}") is None
        rest = [f"{kind}{j}" for kind in "tn" for j in range(i + 1, len(ODD_NAMES))]
        assert all([await store.get(key) is not None for key in rest]), repr(name)


async def test_odd_prompt_prefixes_are_matched_literally(store: Store) -> None:
    for i, name in enumerate(ODD_NAMES):
        await store.put(f"p{i}", entry(prompt_prefix=name + "|rest"))
    for i, name in enumerate(ODD_NAMES):
        assert await store.invalidate(Selector(prefix=name + "|")) == 1, repr(name)
        assert await store.get(f"p{i}") is None


# --------------------------------------------------------------------------- shared backends


async def test_two_instances_see_each_others_entries_and_invalidations(
    two_instances: tuple[Store, Store],
) -> None:
    a, b = two_instances
    put = entry(frames=[b"f"], tags=("faq",), namespace="docs", prompt_prefix="How")
    await a.put("k", put)
    assert_same(await b.get("k"), put, b)
    await b.put("j", entry(tags=("faq",)))
    assert await a.get("j") is not None
    assert await b.invalidate(Selector(tag="faq")) == 2
    assert await a.get("k") is None and await a.get("j") is None
    await a.put("k", put)
    assert await b.invalidate(Selector(namespace="docs")) == 1 and await a.get("k") is None
    await a.put("k", put)
    assert await b.invalidate(Selector(prefix="Ho")) == 1 and await a.get("k") is None
    await a.put("k", put)
    assert await b.invalidate(Selector(everything=True)) == 1 and await a.get("k") is None
