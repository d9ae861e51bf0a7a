"""The in-process exact cache: LRU, TTL, bounded in bytes.

The backend-independent contract (get/put/replace/expiry/invalidate) is in test_store_contract.py.
"""

from __future__ import annotations

import time

from carpool.answer import Answer
from carpool.store import Entry, MemoryStore


def entry(body=b"x" * 100, ttl=60.0, **kw):
    return Entry(Answer("chat", body, True), time.time() + ttl, **kw)


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


async def test_bytes_never_exceed_the_budget_least_recently_used_evicted_first():
    one = entry().size
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


async def test_replacing_a_key_keeps_the_byte_count_exact():
    store = MemoryStore(10_000)
    await store.put("k", entry(b"x" * 100))
    await store.put("k", entry(b"x" * 300))
    assert store.entries == 1 and store.bytes == entry(b"x" * 300).size
