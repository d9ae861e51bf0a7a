"""The in-process exact cache: second-chance LRU, TTL, bounded in bytes that count what it holds;
its two forms (objects for the most recently used entries, packed for the others) and its keys.

The backend-independent contract (get/put/replace/expiry/invalidate) is in test_store_contract.py
(against both forms); the packed form itself in test_packed.py.
"""

from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc

import orjson
import pytest

from carpool.answer import Answer
from carpool.clock import ManualClock
from carpool.lru import SLOT_BYTES, held
from carpool.store import Entry, MemoryStore, memory
from carpool.store.base import Selector
from carpool.store.memory import packed_size_of, size_of


def entry(body=b"x" * 100, ttl=60.0, now=None, **kw):
    return Entry(Answer("chat", body, True), (time.time() if now is None else now) + ttl, **kw)


async def test_a_put_keeps_no_objects_and_an_entry_hit_twice_keeps_them():
    """A put keeps the entry packed only (its objects are its flight's clients' already); a
    first hit unpacks an equal entry, a second keeps its objects: from then on a get returns
    the very object."""
    store = MemoryStore(10_000)
    e = entry()
    await store.put("k", e)
    assert store._hot == {} and store.bytes == packed_size_of("k", e)
    first = await store.get("k")
    assert first is not None and first is not e and first.answer.body == e.answer.body
    kept = store.get_now("k")
    assert kept is not None and store.get_now("k") is kept and await store.get("k") is kept
    assert store.bytes == size_of("k", e)


async def test_an_expired_entry_found_by_get_is_dropped():
    clock = ManualClock()
    store = MemoryStore(10_000, clock=clock)
    await store.put("k", entry(ttl=1, now=clock.now()))
    clock.advance(1)
    assert store.entries == 1
    assert await store.get("k") is None and store.entries == 0 and store.bytes == 0


async def test_an_entry_is_served_until_its_expiry_on_the_stores_clock_and_never_after():
    clock = ManualClock()
    store = MemoryStore(10_000, clock=clock)
    e = entry(ttl=30, now=clock.now())
    await store.put("k", e)
    clock.advance(29.5)
    got = store.get_now("k")
    assert got is not None and got.answer.body == e.answer.body and got.expires == e.expires
    clock.advance(0.5)  # exactly at ``expires``: expired
    assert store.get_now("k") is None and store.entries == 0 and store.bytes == 0


async def test_bytes_never_exceed_the_budget_least_recently_used_evicted_first():
    one = packed_size_of("a", entry())
    store = MemoryStore(one * 3)
    for key in "abc":
        await store.put(key, entry())
    await store.get("a")  # a is now the most recently used
    await store.put("d", entry())
    assert store.bytes <= one * 3 and store.evictions == 1
    assert await store.get("b") is None
    assert all([await store.get(k) for k in "acd"])


def budget_for(n: int) -> int:
    """A budget that holds ``n`` entries of ``entry()`` as their puts keep them (packed), and
    no entry's objects besides (an entry hit once keeps none: the eviction tests' hits)."""
    one = packed_size_of("a", entry())
    return n * one + one // 2


@pytest.mark.parametrize("hot", [0, 1024])
async def test_eviction_goes_in_the_order_of_the_puts_sparing_once_each_entry_hit_since(hot):
    store = MemoryStore(budget_for(4), hot=hot)
    for key in "abcd":
        await store.put(key, entry())
    store.get_now("c")
    store.get_now("a")
    await store.put("e", entry())  # a is spared (to the end, its mark cleared): b goes
    assert store.evictions == 1 and list(store._entries) == ["c", "d", "e", "a"]
    for key in "fgh":  # c is spared; d, e and a go, in the order of their put or spare
        await store.put(key, entry())
    assert store.evictions == 4
    assert [key for key in "abcdefgh" if store.get_now(key) is not None] == ["c", "f", "g", "h"]


async def test_hot_objects_let_go_before_any_entry_is_evicted():
    """Which entries keep their objects changes nothing else, not the order of eviction: a put
    that needs room first takes it from the least recently used entries' objects (they stay,
    packed), and evicts an entry only when no objects are left to let go. The same puts and
    hits keep the same entries with or without hot objects."""
    one = packed_size_of("a", entry())
    objects = size_of("a", entry()) - one  # what a hot entry's objects add
    budget = 4 * one + objects - 1  # room for 3 entries and one's objects, or 4 entries packed
    kept = {}
    for hot in (0, 1024):
        store = MemoryStore(budget, hot=hot)
        for key in "abc":
            await store.put(key, entry())
        store.get_now("a")
        kept_a = store.get_now("a")  # a second hit: with hot, a keeps its objects (room)
        assert (store._hot != {}) == bool(hot)
        await store.put("d", entry())
        assert store.bytes <= budget and store.evictions == 0 and store._hot == {}
        kept[hot] = [key for key in "abcd" if store.holds(key)]
        again = store.get_now("a")  # a is still served, unpacked anew
        assert again is not None and again is not kept_a and again.answer.body == b"x" * 100
    assert kept[0] == kept[1024] == ["a", "b", "c", "d"]


@pytest.mark.parametrize("hot", [0, 1024])
async def test_the_entry_put_last_is_evicted_last_even_when_every_other_was_hit(hot):
    store = MemoryStore(budget_for(3), hot=hot)
    for key in "abc":
        await store.put(key, entry())
    for key in "abc":
        assert store.get_now(key) is not None
    await store.put("d", entry())  # all spared once; then the first of them goes, not d
    assert store.evictions == 1
    assert [key for key in "abcd" if store.get_now(key) is not None] == ["b", "c", "d"]


@pytest.mark.parametrize("hot", [0, 1024])
async def test_an_entry_spared_is_marked_again_by_its_next_hit(hot):
    # (With hot, a hit on an entry that kept its objects checks the mark without the map's get.)
    store = MemoryStore(budget_for(3), hot=hot)
    for key in "abc":
        await store.put(key, entry())
    store.get_now("a")
    await store.put("d", entry())  # a spared, b gone
    assert store.get_now("a") is not None  # used again in its new lap
    for key in "efg":
        await store.put(key, entry())
    assert store.evictions == 4
    assert [key for key in "abcdefg" if store.get_now(key) is not None] == ["a", "f", "g"]


@pytest.mark.parametrize("hot", [0, 1024])
async def test_a_hit_marks_its_entry_in_place_so_reads_leave_the_map_as_it_was(hot):
    # A hit that moved its entry to the end would leave a hole and take a new slot: reading
    # every entry of a store that only grew would double the map's table.
    store = MemoryStore(1 << 30, hot=hot)
    keys = [f"{i:032x}" for i in range(20_000)]
    for key in keys:
        await store.put(key, entry())
    table, order = sys.getsizeof(store._entries.mapping), list(store._entries)
    for _ in range(2):
        assert all(store.get_now(key) is not None for key in keys)
    assert sys.getsizeof(store._entries.mapping) == table and list(store._entries) == order


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
    assert store.entries == 1 and store.bytes == packed_size_of("k", entry(b"x" * 300))


async def test_invalidate_drops_the_expired_entries_it_meets_without_counting_them():
    clock = ManualClock()
    store = MemoryStore(100_000, clock=clock)
    await store.put("short", entry(ttl=1, now=clock.now(), tags=("t",)))
    await store.put("long", entry(ttl=60, now=clock.now(), tags=("t",)))
    await store.put("other", entry(ttl=1, now=clock.now(), tags=("u",)))
    clock.advance(1)
    assert await store.invalidate(Selector(tag="t")) == 1
    assert store.entries == 0 and store.bytes == 0 and store.evictions == 0


def test_an_entry_counts_its_key_its_packed_form_its_slot_and_while_hot_its_objects():
    plain = entry(b"x" * 200)
    streamed = Entry(
        Answer("chat", b"x" * 200, True, tokens=1234, frames=[b"a" * 100, b"b" * 100]),
        plain.expires,
        ("faq", "news"),
        "docs",
        "How do I",
    )
    key = "0123456789abcdef" * 2
    packed = packed_size_of(key, plain)
    assert SLOT_BYTES + 200 < packed < SLOT_BYTES + 200 + 150  # the key, 60 bits, and a head
    assert size_of(key, plain) - packed >= plain.held  # kept hot: its objects too
    more = packed_size_of(key, streamed) - packed
    assert more >= 2 * 100 + len("faq" + "news" + "docs" + "How do I")
    # A key that is not a fingerprint is kept as it is: it counts.
    assert packed_size_of("k" * 64, plain) - packed_size_of("k" * 32, plain) == 32
    # The same for the same entry at any time, also once it has synthesized frames to stream.
    counted = size_of("k", plain)
    plain.answer._synthesized[True] = [b"data: x\n\n"] * 10
    assert size_of("k", plain) == counted


async def test_the_most_recently_used_entries_keep_their_objects_the_others_are_packed():
    store = MemoryStore(1 << 30, hot=2)
    puts = {key: entry(prompt_prefix=key) for key in ("a", "b", "c")}
    for key, put in puts.items():
        await store.put(key, put)
    assert store.bytes == sum(packed_size_of(key, put) for key, put in puts.items())
    kept = {}
    for key in "bc":  # each hit twice: kept
        first = store.get_now(key)  # packed: a new, equal entry, not kept (a first hit)
        assert first is not None and first is not puts[key] and first.prompt_prefix == key
        kept[key] = store.get_now(key)  # a second one while the first is recent: kept
        assert kept[key] is not None and kept[key] is not first
    packed = packed_size_of("a", puts["a"])
    assert store.bytes == packed + size_of("b", puts["b"]) + size_of("c", puts["c"])
    assert store.get_now("c") is kept["c"] and store.get_now("b") is kept["b"]
    store.get_now("a")
    kept["a"] = store.get_now("a")
    assert kept["a"] is not None and store.get_now("a") is kept["a"]
    # ... and "c", the least recently used of the hot ones, lets its own go.
    assert store.get_now("b") is kept["b"] and store.get_now("c") is not kept["c"]
    await store.invalidate(Selector(everything=True))
    assert store.entries == 0 and store.bytes == 0


async def test_a_hot_entry_expires_with_its_objects_and_keeps_none_once_evictions_begin():
    clock = ManualClock()
    store = MemoryStore(10_000, clock=clock)
    await store.put("k", entry(ttl=30, now=clock.now()))
    store.get_now("k")
    assert store.get_now("k") is not None and list(store._hot) == ["k"]  # kept
    clock.advance(30)
    assert store.get_now("k") is None and store.entries == 0 and store.bytes == 0
    assert store._hot == {}
    await store.put("a", entry(now=clock.now()))
    for i in range(40):  # each one hit twice (its objects kept while there is room)
        evictions = store.evictions
        await store.put(f"k{i}", entry(now=clock.now()))
        if store.evictions > evictions:  # an entry evicted only once no objects were left
            assert store._hot == {}
        store.get_now(f"k{i}")
        store.get_now(f"k{i}")
    assert store.evictions > 0 and store.get_now("a") is None
    hot = [key for key in store._hot if store.holds(key)]
    assert hot == list(store._hot)
    others = [f"k{i}" for i in range(40) if store.holds(f"k{i}") and f"k{i}" not in hot]
    assert store.bytes == sum(size_of(key, entry()) for key in hot) + sum(
        packed_size_of(key, entry()) for key in others
    )


async def test_expired_entries_no_get_finds_are_reaped_a_bounded_step_a_second(monkeypatch):
    """Expiry is lazy, so a step of reaping drops the expired entries among the next
    ``SWEEP_STEP``, with their objects, at most once a ``SWEEP_EVERY`` (a put takes it when
    due, as the reports do): ``entries`` and ``bytes`` come to count the live ones only."""
    monkeypatch.setattr(memory, "SWEEP_STEP", 4)
    clock = ManualClock()
    store = MemoryStore(100_000, clock=clock)
    keys = [f"k{i}" for i in range(10)]
    for i, key in enumerate(keys):
        await store.put(key, entry(ttl=10 if i % 3 else 100, now=clock.now()))
    store.get_now("k1"), store.get_now("k1")  # (its objects kept)
    assert store._hot_bytes > 0
    clock.advance(10)
    assert store.entries == 10 and store.reap() == 2  # the first step: k0..k3
    assert store.entries == 8 and store._hot_bytes == 0 and store.evictions == 0
    assert store.reap() == 0  # not due before a second has passed
    clock.advance(memory.SWEEP_EVERY)
    await store.put("new", entry(now=clock.now()))  # a put takes the step: k4..k7
    assert store.entries == 9 - 3
    clock.advance(memory.SWEEP_EVERY)
    assert store.reap() == 1  # k8, k9 and new: the last ones
    live = ["k0", "k3", "k6", "k9", "new"]
    assert store.entries == 5 and all(store.holds(key) for key in live)
    assert store.bytes == sum(packed_size_of(key, entry()) for key in live)


async def test_an_entry_too_large_with_its_objects_is_kept_packed_if_it_fits_so():
    put = entry(b"x" * 1000)
    store = MemoryStore(packed_size_of("k", put) + 10)
    await store.put("k", put)
    got = store.get_now("k")
    assert store.entries == 1 and got is not None and got.answer.body == put.answer.body
    assert store.bytes == packed_size_of("k", put)


def chat_answer(i: int, words: int = 2000) -> Answer:
    """A whole chat answer as a non-streamed miss stores it: a body, no frames."""
    body = {
        "id": f"c{i}",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"word{i} " * words},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": words, "total_tokens": words + 1},
    }
    return Answer("chat", orjson.dumps(body), True, words + 1)


def synthesized_bytes(answer: Answer) -> int:
    """What the frames a streaming client of ``answer`` is sent take, with the usage chunk and
    without (made anew, on a copy)."""
    copy = Answer(answer.kind, answer.body, True, answer.tokens)
    return sum(held(frames, *frames) for frames in (copy.sse(True), copy.sse(False)))


async def test_memory_store_budget_counts_frames_synthesized_for_streaming_hits():
    """A streaming client of a hit on an answer stored without frames is sent frames made from
    its body (``Answer.sse``), which a hot entry keeps for the next such hits (with the usage
    chunk and without: its text twice, and more). The budget counts them from when they are made,
    the least recently used hot entries letting their objects go to make room: ``bytes`` stays
    within ``max_bytes`` and counts what the store really holds."""
    keys = [f"{i:032x}" for i in range(2)]
    puts = {key: Entry(chat_answer(i), time.time() + 60) for i, key in enumerate(keys)}
    hot = sum(size_of(key, put) for key, put in puts.items())
    frames = synthesized_bytes(puts[keys[0]].answer)
    assert frames > 2 * len(puts[keys[0]].answer.body)  # (its text twice, and more)
    # Room for both entries hot, and for one's frames, not two's.
    store = MemoryStore(hot + frames + frames // 2)
    for key, put in puts.items():
        await store.put(key, put)
    kept = {}
    for key in keys:  # each hit twice: kept hot
        store.get_now(key)
        kept[key] = store.get_now(key)
        assert kept[key] is not None and store.get_now(key) is kept[key]
    assert store.bytes == hot
    first = kept[keys[0]].answer
    assert first.sse(True) is first.sse(True) and first.sse(False) is first.sse(False)
    # Counted (and the dict keeping them grown), both entries still hot: there is room.
    assert hot + frames <= store.bytes <= hot + frames + 256 <= store.max_bytes
    assert store.get_now(keys[0]) is kept[keys[0]] and store.get_now(keys[1]) is kept[keys[1]]
    # The other one's: no room for both; the least recently used hot entry lets its objects go.
    second = kept[keys[1]].answer
    second.sse(True), second.sse(False)
    assert store.bytes <= store.max_bytes and store.evictions == 0
    assert store.get_now(keys[1]) is kept[keys[1]] and second.sse(True) is second.sse(True)
    let_go = store.get_now(keys[0])
    assert let_go is not None and let_go is not kept[keys[0]]
    assert store.bytes >= packed_size_of(keys[0], puts[keys[0]]) + size_of(keys[1], puts[keys[1]])
    assert store.bytes - frames >= packed_size_of(keys[0], puts[keys[0]]) + size_of(
        keys[1], puts[keys[1]]
    )
    # Frames made later on an entry that is no longer hot are not the store's: not counted.
    counted = store.bytes
    first.sse(True), let_go.answer.sse(True)
    assert store.bytes == counted
    # Let go with their entry: nothing counted is left.
    await store.invalidate(Selector(everything=True))
    assert store.entries == 0 and store.bytes == 0


async def test_the_budget_bounds_what_hot_entries_really_hold_frames_synthesized_included():
    """The streaming hits of hot entries stored without frames (``Answer.sse``'s, kept): what
    the store counts is at least what Python allocated for them, and close to it."""
    store = MemoryStore(1 << 40, hot=64)
    keys = [f"{i:032x}" for i in range(64)]
    for i, key in enumerate(keys):
        await store.put(key, Entry(chat_answer(i, words=200), time.time() + 60))
        # A first hit: its packed form marked used (a new copy, in place of one made before
        # the measure: it would count as grown) and nothing kept.
        store.get_now(key)
    gc.collect()
    tracemalloc.start()
    try:
        before, counted = tracemalloc.get_traced_memory()[0], store.bytes
        for key in keys:
            got = store.get_now(key)  # (a second hit: kept)
            assert got is not None
            got.answer.sse(True), got.answer.sse(False)
        del got
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store._hot) == len(keys)
    assert grown <= store.bytes - counted <= grown * 1.25, (grown, store.bytes - counted)


FINGERPRINT = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("hot", [0, 1024])
async def test_keys_sharing_their_last_60_bits_share_a_place_and_never_an_answer(hot):
    store = MemoryStore(1 << 20, hot=hot)
    twin = "f" + FINGERPRINT[1:]  # another fingerprint, the same last 60 bits
    await store.put(FINGERPRINT, entry(b"one"))
    assert await store.get(twin) is None
    await store.put(twin, entry(b"two"))
    assert await store.get(FINGERPRINT) is None  # replaced: a miss, not the other's answer
    got = await store.get(twin)
    assert got is not None and got.answer.body == b"two" and store.entries == 1


@pytest.mark.parametrize("hot", [0, 1024])
async def test_a_miss_on_a_key_sharing_anothers_place_marks_that_entry_unused(hot):
    # Only a hit marks an entry used: the other key's miss gave it a second chance it had not
    # earned (a model-based review), so it outlived an entry put after it.
    store = MemoryStore(budget_for(2), hot=hot)
    twin = "f" + FINGERPRINT[1:]
    await store.put(FINGERPRINT, entry())
    await store.put("b" * 32, entry())
    assert store.get_now(twin) is None
    await store.put("c" * 32, entry())  # the first put goes, unmarked
    assert not store.holds(FINGERPRINT) and store.holds("b" * 32) and store.evictions == 1


async def test_a_put_that_stores_nothing_still_takes_a_due_reaping_step():
    clock = ManualClock()
    store = MemoryStore(budget_for(4), clock=clock)
    await store.put("old", entry(ttl=10, now=clock.now()))
    clock.advance(max(10, memory.SWEEP_EVERY))
    await store.put("late", entry(ttl=1, now=clock.now() - 5))  # already expired: not stored
    assert store.entries == 0 and store.bytes == 0


@pytest.mark.parametrize("hot", [0, 1024])
async def test_holds_says_whether_a_key_has_an_entry_without_reading_it(hot):
    """``holds``: the key's entry is here (hot or packed), not another key's sharing its place,
    not one too big to keep; asking marks nothing used and keeps no objects."""
    store = MemoryStore(1 << 20, hot=hot)
    assert not store.holds(FINGERPRINT)
    await store.put(FINGERPRINT, entry(b"one"))
    marks, kept = list(store._entries.mapping.values()), dict(store._hot)
    assert store.holds(FINGERPRINT) and not store.holds("f" + FINGERPRINT[1:])
    assert list(store._entries.mapping.values()) == marks and store._hot == kept
    await store.put("other", entry(b"x" * (1 << 21)))  # (more than the whole budget)
    assert not store.holds("other") and store.holds(FINGERPRINT)


@pytest.mark.parametrize("hot", [0, 1024])
async def test_a_key_that_is_not_a_fingerprint_is_its_own_key(hot):
    store = MemoryStore(1 << 20, hot=hot)
    others = [FINGERPRINT.upper(), "0x" + FINGERPRINT[2:], " " + FINGERPRINT[1:], FINGERPRINT[:-1]]
    await store.put(FINGERPRINT, entry(b"fingerprint"))
    for i, key in enumerate(others):
        await store.put(key, entry(b"%d" % i))
    assert store.entries == 1 + len(others)
    for i, key in enumerate(others):
        got = await store.get(key)
        assert got is not None and got.answer.body == b"%d" % i
    got = await store.get(FINGERPRINT)
    assert got is not None and got.answer.body == b"fingerprint"


async def test_the_map_holds_nothing_the_garbage_collector_walks():
    store = MemoryStore(1 << 30, hot=4)
    for i in range(50):
        await store.put(f"{i:032x}", entry(tags=("t",) if i % 2 else ()))
        store.get_now(f"{i // 2:032x}")
    assert not gc.is_tracked(store._entries._data)


@pytest.mark.parametrize("hot", [0, 3, 1024])
async def test_either_form_behaves_as_a_plain_map(hot):
    """Random puts, gets, invalidations and time against a dict: the same answers, whatever
    form each entry has (the budget large enough to evict nothing)."""
    rng = random.Random(hot)
    clock = ManualClock()
    store = MemoryStore(1 << 30, clock=clock, hot=hot)
    model: dict[str, Entry] = {}
    keys = [f"{rng.getrandbits(128):032x}" for _ in range(6)] + ["k", "K"]
    for step in range(1500):
        key, op = rng.choice(keys), rng.random()
        if op < 0.35:
            put = entry(
                b"%d" % step,
                ttl=rng.choice([5, 50, 500]),
                now=clock.now(),
                tags=rng.choice([(), ("t",)]),
                namespace=rng.choice(["", "n"]),
                prompt_prefix=rng.choice(["", "How", "Why"]),
            )
            await store.put(key, put)
            model[key] = put
        elif op < 0.9:
            got, want = store.get_now(key), model.get(key)
            if want is not None and want.expires <= clock.now():
                del model[key]
                want = None
            assert (got is None) == (want is None), step
            if got is not None and want is not None:
                assert (got.answer.body, got.tags, got.prompt_prefix, got.expires) == (
                    want.answer.body,
                    want.tags,
                    want.prompt_prefix,
                    want.expires,
                )
        elif op < 0.95:
            selector = rng.choice(
                [Selector(tag="t"), Selector(namespace=""), Selector(prefix="Ho")]
            )
            live = {k: e for k, e in model.items() if e.expires > clock.now()}
            doomed = [k for k, e in live.items() if selector.picks(e)]
            assert await store.invalidate(selector) == len(doomed)
            model = {k: e for k, e in live.items() if k not in doomed}
        else:
            clock.advance(rng.choice([1, 10, 100]))
    await store.invalidate(Selector(everything=True))
    assert store.entries == 0 and store.bytes == 0


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
