"""The in-process exact cache: LRU, TTL, bounded in bytes that count what it holds.

The backend-independent contract (get/put/replace/expiry/invalidate) is in test_store_contract.py.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

from carpool.answer import Answer
from carpool.clock import ManualClock
from carpool.store import Entry, MemoryStore
from carpool.store.base import Selector
from carpool.store.memory import size_of


def entry(body=b"x" * 100, ttl=60.0, now=None, **kw):
    return Entry(Answer("chat", body, True), (time.time() if now is None else now) + ttl, **kw)


async def test_get_returns_the_very_object_that_was_put():
    store = MemoryStore(10_000)
    e = entry()
    await store.put("k", e)
    assert await store.get("k") is e and store.get_now("k") is e


async def test_an_expired_entry_found_by_get_is_dropped():
    store = MemoryStore(10_000)
    await store.put("k", entry(ttl=-1))
    assert store.entries == 1
    assert await store.get("k") is None and store.entries == 0 and store.bytes == 0


async def test_an_entry_is_served_until_its_expiry_on_the_stores_clock_and_never_after():
    clock = ManualClock()
    store = MemoryStore(10_000, clock=clock)
    e = entry(ttl=30, now=clock.now())
    await store.put("k", e)
    clock.advance(29.5)
    assert store.get_now("k") is e
    clock.advance(0.5)  # exactly at ``expires``: expired
    assert store.get_now("k") is None and store.entries == 0 and store.bytes == 0


async def test_bytes_never_exceed_the_budget_least_recently_used_evicted_first():
    one = size_of("a", entry())
    store = MemoryStore(one * 3)
    for key in "abc":
        await store.put(key, entry())
    await store.get("a")  # a is now the most recently used
    await store.put("d", entry())
    assert store.bytes <= one * 3 and store.evictions == 1
    assert await store.get("b") is None
    assert all([await store.get(k) for k in "acd"])


async def test_an_entry_larger_than_the_budget_is_not_stored():
    store = MemoryStore(50)
    await store.put("k", entry())
    assert store.entries == 0 and store.bytes == 0


async def test_an_entry_larger_than_the_budget_still_replaces_what_its_key_held():
    store = MemoryStore(size_of("k", entry()) * 2)
    await store.put("k", entry())
    await store.put("k", entry(b"x" * 10_000))
    assert await store.get("k") is None and store.entries == 0 and store.bytes == 0
    assert store.evictions == 0


async def test_replacing_a_key_keeps_the_byte_count_exact():
    store = MemoryStore(10_000)
    await store.put("k", entry(b"x" * 100))
    await store.put("k", entry(b"x" * 300))
    assert store.entries == 1 and store.bytes == size_of("k", entry(b"x" * 300))


async def test_invalidate_drops_the_expired_entries_it_meets_without_counting_them():
    clock = ManualClock()
    store = MemoryStore(100_000, clock=clock)
    await store.put("short", entry(ttl=1, now=clock.now(), tags=("t",)))
    await store.put("long", entry(ttl=60, now=clock.now(), tags=("t",)))
    await store.put("other", entry(ttl=1, now=clock.now(), tags=("u",)))
    clock.advance(1)
    assert await store.invalidate(Selector(tag="t")) == 1
    assert store.entries == 0 and store.bytes == 0 and store.evictions == 0


def test_an_entry_counts_its_key_its_objects_and_its_slot():
    plain = entry(b"x" * 200)
    streamed = Entry(
        Answer("chat", b"x" * 200, True, tokens=1234, frames=[b"a" * 100, b"b" * 100]),
        plain.expires,
        ("faq", "news"),
        "docs",
        "How do I",
    )
    assert size_of("k" * 32, plain) > plain.size  # the objects around the payload count
    more = size_of("k" * 32, streamed) - size_of("k" * 32, plain)
    assert more >= 2 * (100 + 33) + len("faq" + "news" + "docs" + "How do I")
    assert size_of("k" * 64, plain) - size_of("k" * 32, plain) == 32  # the key counts
    # The same for the same entry at any time, also once it has synthesized frames to stream.
    counted = size_of("k", plain)
    plain.answer._synthesized[True] = [b"data: x\n\n"] * 10
    assert size_of("k", plain) == counted


async def test_the_budget_bounds_what_the_entries_really_hold():
    """What the store counts is at least what Python allocated for its entries, and close to it
    (``scripts/measure_store_memory.py`` measures the same against RSS at 1M entries)."""
    n = 3000
    store = MemoryStore(1 << 40)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            streamed = [b"data: %0100d\n\n" % (i * 3 + j) for j in range(3)] if i % 2 else None
            answer = Answer("chat", b"%0200d" % i, True, tokens=300 + i, frames=streamed)
            await store.put(
                f"{i:032x}", Entry(answer, answer.created + 60, (), "", f"prompt number {i}")
            )
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.entries == n
    assert grown <= store.bytes <= grown * 1.25, (grown, store.bytes)
