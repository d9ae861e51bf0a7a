"""carpool.lru: the one bounded map behind the in-process caches, clause by clause, then against a
model under random operations (hypothesis)."""

from __future__ import annotations

import sys
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from carpool.clock import ManualClock
from carpool.lru import LRU, SLOT_BYTES, allocated, held

# A value is (name, size, expires): what ``size`` and ``expires`` read never changes.
Value = tuple[str, int, float]
FOREVER = float("inf")


def sized(key: str, value: Value) -> int:
    return value[1]


def expiry(value: Value) -> float:
    return value[2]


def marked(value: Value) -> Value:
    """``value`` marked used (for second chance): a 4th item."""
    return value if len(value) == 4 else (*value, "used")  # type: ignore[return-value]


def unmarked(value: Value) -> Value:
    return value[:3] if len(value) == 4 else value


def lru(clock: ManualClock | None = None, **kw) -> tuple[LRU[str, Value], list[tuple[str, Value]]]:
    """An LRU over ``Value``s, and the list its ``on_evict`` appends to."""
    heard: list[tuple[str, Value]] = []
    cache: LRU[str, Value] = LRU(
        size=sized,
        expires=expiry,
        clock=clock or ManualClock(monotonic=0.0),
        on_evict=lambda k, v: heard.append((k, v)),
        **kw,
    )
    return cache, heard


# --------------------------------------------------------------------------- bounds


def test_the_entry_bound_evicts_the_least_recently_used_first():
    cache, heard = lru(max_entries=3)
    for key in "abc":
        assert cache.put(key, (key, 1, FOREVER)) == []
    assert cache.get("a") is not None  # a is now the most recently used
    assert cache.put("d", ("d", 1, FOREVER)) == [("b", ("b", 1, FOREVER))]
    assert list(cache) == ["c", "a", "d"] and heard == [("b", ("b", 1, FOREVER))]
    assert cache.evictions == 1 and len(cache) == 3


def test_the_byte_bound_counts_the_size_of_each_entry_and_evicts_until_within_it():
    cache, heard = lru(max_bytes=10)
    cache.put("a", ("a", 4, FOREVER))
    cache.put("b", ("b", 4, FOREVER))
    assert cache.bytes == 8
    evicted = cache.put("c", ("c", 9, FOREVER))  # both older ones must go
    assert [k for k, _ in evicted] == ["a", "b"] and [k for k, _ in heard] == ["a", "b"]
    assert cache.bytes == 9 and list(cache) == ["c"] and cache.evictions == 2


def test_both_bounds_hold_together():
    cache, _ = lru(max_entries=2, max_bytes=10)
    cache.put("a", ("a", 1, FOREVER))
    cache.put("b", ("b", 1, FOREVER))
    cache.put("c", ("c", 1, FOREVER))  # the entry bound
    assert list(cache) == ["b", "c"]
    cache.put("d", ("d", 9, FOREVER))  # 1 + 9: within the byte bound
    assert list(cache) == ["c", "d"] and cache.bytes == 10
    cache.put("e", ("e", 9, FOREVER))  # the byte bound
    assert list(cache) == ["e"] and cache.bytes == 9


def test_a_value_larger_than_the_whole_budget_is_not_stored_and_still_replaces():
    cache, heard = lru(max_bytes=10)
    cache.put("a", ("a", 4, FOREVER))
    cache.put("k", ("old", 4, FOREVER))
    assert cache.put("k", ("new", 11, FOREVER)) == []
    assert "k" not in cache and cache.get("k") is None  # the old value is gone too
    assert list(cache) == ["a"] and cache.bytes == 4
    assert heard == [] and cache.evictions == 0  # nothing was evicted for it


def test_a_put_replaces_the_value_and_its_size_and_makes_it_the_most_recently_used():
    cache, heard = lru(max_bytes=100)
    cache.put("k", ("old", 30, FOREVER))
    cache.put("j", ("j", 5, FOREVER))
    cache.put("k", ("new", 7, FOREVER))
    assert cache.peek("k") == ("new", 7, FOREVER) and cache.bytes == 12
    assert list(cache) == ["j", "k"] and heard == []


def test_evict_drops_the_least_recently_used_as_a_bound_does():
    cache, heard = lru(max_bytes=100)
    for key in "abc":
        cache.put(key, (key, 30, FOREVER))
    cache.get("a")
    assert cache.evict() == ("b", ("b", 30, FOREVER)) and heard == [("b", ("b", 30, FOREVER))]
    assert list(cache) == ["c", "a"] and cache.bytes == 60 and cache.evictions == 1
    cache.clear()
    assert cache.evict() is None and cache.evictions == 1


def test_eviction_follows_the_order_of_use_through_many_holes():
    # Every use and eviction leaves a hole at the dict's front: the order holds across them
    # and across the eviction front's refills.
    cache, _ = lru(max_entries=1000)
    for i in range(1000):
        cache.put(str(i), (str(i), 1, FOREVER))
    for i in range(0, 1000, 2):
        cache.get(str(i))  # the even keys are now the most recently used, in order
    evicted = [k for i in range(1000, 1700) for k, _ in cache.put(str(i), (str(i), 1, FOREVER))]
    odd, even = [str(i) for i in range(1, 1000, 2)], [str(i) for i in range(0, 1000, 2)]
    assert evicted == odd + even[:200]
    cache.touch(even[200])
    assert [k for k, _ in cache.put("x", ("x", 1, FOREVER))] == [even[201]]
    assert list(cache)[-2:] == [even[200], "x"] and len(cache) == 1000


def test_no_bound_means_unbounded():
    cache: LRU[int, int] = LRU()
    for i in range(1000):
        cache.put(i, i)
    assert len(cache) == 1000 and cache.bytes == 0 and cache.evictions == 0


def test_a_byte_budget_needs_a_size_function():
    with pytest.raises(ValueError):
        LRU(max_bytes=10)


def test_values_are_never_none():
    cache: LRU[str, object] = LRU()
    with pytest.raises(TypeError):
        cache.put("k", None)


# --------------------------------------------------------------------------- recency


def test_put_get_and_touch_make_an_entry_recent_peek_in_and_index_do_not():
    cache, _ = lru(max_entries=10)
    for key in "abcd":
        cache.put(key, (key, 1, FOREVER))
    assert cache.peek("a") is not None and "b" in cache and cache["c"][0] == "c"
    assert list(cache) == ["a", "b", "c", "d"]
    cache.get("a")
    cache.touch("b")
    cache.touch("nope")  # nothing to touch: nothing happens
    assert list(cache) == ["c", "d", "a", "b"]
    assert [k for k, _ in cache.items()] == ["c", "d", "a", "b"]


def test_a_miss_answers_the_default():
    cache, _ = lru()
    default: Value = ("default", 0, FOREVER)
    assert cache.get("k") is None and cache.peek("k") is None and "k" not in cache
    assert cache.get("k", default) is default and cache.peek("k", default) is default
    assert cache.pop("k") is None and cache.pop("k", default) is default
    with pytest.raises(KeyError):
        cache["k"]


# --------------------------------------------------------------------------- second chance


def test_second_chance_needs_both_mark_and_unmark():
    with pytest.raises(ValueError):
        LRU(mark=marked)
    with pytest.raises(ValueError):
        LRU(unmark=unmarked)


def test_second_chance_a_get_or_touch_marks_the_entry_in_place_and_moves_nothing():
    cache, _ = lru(max_entries=10, mark=marked, unmark=unmarked)
    for key in "abcd":
        cache.put(key, (key, 1, FOREVER))
    assert cache.get("b") == ("b", 1, FOREVER, "used")
    cache.touch("c")
    cache.touch("nope")
    assert cache.peek("a") == ("a", 1, FOREVER) and "d" in cache  # a look is no use
    assert list(cache.items()) == [
        ("a", ("a", 1, FOREVER)),
        ("b", ("b", 1, FOREVER, "used")),
        ("c", ("c", 1, FOREVER, "used")),
        ("d", ("d", 1, FOREVER)),
    ]
    assert cache.mapping["b"] == ("b", 1, FOREVER, "used") and len(cache.mapping) == 4


def test_second_chance_a_put_keeps_its_value_unmarked_at_the_end():
    cache, _ = lru(mark=marked, unmark=unmarked)
    cache.put("a", ("a", 1, FOREVER))
    cache.put("b", ("b", 1, FOREVER))
    cache.get("a")
    cache.put("a", ("a2", 1, FOREVER, "used"))  # type: ignore[arg-type]
    assert list(cache.items()) == [("b", ("b", 1, FOREVER)), ("a", ("a2", 1, FOREVER))]


def test_second_chance_an_eviction_spares_the_entries_used_since_their_put_in_order():
    cache, heard = lru(max_entries=4, mark=marked, unmark=unmarked)
    for key in "abcd":
        cache.put(key, (key, 1, FOREVER))
    cache.get("c")
    cache.get("a")
    # a is spared (to the end, unmarked) and b, never used, goes; c is not reached.
    assert cache.put("e", ("e", 1, FOREVER)) == [("b", ("b", 1, FOREVER))]
    assert list(cache) == ["c", "d", "e", "a"] and cache.peek("a") == ("a", 1, FOREVER)
    # Then c is spared (after f), and the others go in the order of their put or spare.
    evicted = [k for key in "fgh" for k, _ in cache.put(key, (key, 1, FOREVER))]
    assert evicted == ["d", "e", "a"] and list(cache) == ["f", "c", "g", "h"]
    assert cache.evictions == 4 and [k for k, _ in heard] == ["b", "d", "e", "a"]


def test_second_chance_the_entry_put_last_is_evicted_last_even_when_every_other_was_used():
    cache, _ = lru(max_entries=3, mark=marked, unmark=unmarked)
    for key in "abc":
        cache.put(key, (key, 1, FOREVER))
    for key in "abc":
        cache.get(key)
    # All spared once, in order; the new one is not taken: the first spared is.
    assert cache.put("d", ("d", 1, FOREVER)) == [("a", ("a", 1, FOREVER))]
    assert list(cache) == ["b", "c", "d"]
    assert [cache.evict(), cache.evict(), cache.evict()] == [
        ("b", ("b", 1, FOREVER)),
        ("c", ("c", 1, FOREVER)),
        ("d", ("d", 1, FOREVER)),
    ]


def test_second_chance_a_spared_entry_is_marked_again_by_its_next_use():
    cache, _ = lru(max_entries=3, mark=marked, unmark=unmarked)
    for key in "abc":
        cache.put(key, (key, 1, FOREVER))
    cache.get("a")
    assert [k for k, _ in cache.put("d", ("d", 1, FOREVER))] == ["b"]  # a spared
    cache.touch("a")  # used again in its new lap
    evicted = [k for key in "efg" for k, _ in cache.put(key, (key, 1, FOREVER))]
    assert evicted == ["c", "d", "e"] and "a" in cache


def test_second_chance_order_holds_through_many_holes_and_front_refills():
    cache, _ = lru(max_entries=1000, mark=marked, unmark=unmarked)
    for i in range(1000):
        cache.put(str(i), (str(i), 1, FOREVER))
    for i in range(0, 1000, 2):
        cache.get(str(i))  # the even keys are marked used, in place
    evicted = [k for i in range(1000, 1700) for k, _ in cache.put(str(i), (str(i), 1, FOREVER))]
    odd, even = [str(i) for i in range(1, 1000, 2)], [str(i) for i in range(0, 1000, 2)]
    # Each put spares the next even key, which goes after it: the order of put or spare.
    new = [str(i) for i in range(1000, 1500)]
    queued = [k for pair in zip(new, even, strict=True) for k in pair]
    assert evicted == odd + queued[:200]
    assert list(cache) == queued[200:] + [str(i) for i in range(1500, 1700)]


@pytest.mark.parametrize("second_chance", [False, True])
def test_second_chance_a_use_takes_no_place_in_the_map(second_chance):
    # Why it exists: a use that moves its entry leaves a hole and takes a new slot, so that
    # using every entry of a map that only grew doubles its table; a mark replaces the value in
    # its slot.
    marks = {"mark": marked, "unmark": unmarked} if second_chance else {}
    cache: LRU[int, Value] = LRU(**marks)  # type: ignore[arg-type]
    for i in range(50_000):
        cache.put(10**12 + i, ("v", 1, FOREVER))
    filled = sys.getsizeof(cache.mapping)
    for _ in range(2):
        for i in range(50_000):
            cache.get(10**12 + i)
    if second_chance:
        assert sys.getsizeof(cache.mapping) == filled
    else:
        assert sys.getsizeof(cache.mapping) >= 1.9 * filled


# --------------------------------------------------------------------------- expiry


def test_an_entry_is_returned_until_its_expiry_and_never_from_then_on():
    clock = ManualClock(monotonic=100.0)
    cache, heard = lru(clock)
    cache.put("k", ("k", 3, 110.0))
    clock.advance(9.5)
    assert cache.get("k") is not None and "k" in cache and cache.peek("k") is not None
    clock.advance(0.5)  # exactly at the expiry: expired
    assert cache.get("k") is None
    assert len(cache) == 0 and cache.bytes == 0
    assert heard == [("k", ("k", 3, 110.0))] and cache.expirations == 1 and cache.evictions == 0


@pytest.mark.parametrize("look", ["get", "peek", "in", "index"])
def test_every_look_that_finds_an_entry_expired_drops_it(look):
    clock = ManualClock(monotonic=0.0)
    cache, heard = lru(clock)
    cache.put("k", ("k", 1, 5.0))
    clock.advance(5)
    if look == "get":
        assert cache.get("k") is None
    elif look == "peek":
        assert cache.peek("k") is None
    elif look == "in":
        assert "k" not in cache
    else:
        with pytest.raises(KeyError):
            cache["k"]
    assert len(cache) == 0 and heard == [("k", ("k", 1, 5.0))]


def test_expiry_is_lazy_until_expire_sweeps():
    clock = ManualClock(monotonic=0.0)
    cache, heard = lru(clock)
    cache.put("a", ("a", 1, 1.0))
    cache.put("b", ("b", 1, 9.0))
    cache.put("c", ("c", 1, 2.0))
    clock.advance(3)
    assert len(cache) == 3 and cache.bytes == 3  # not looked at: still held
    assert list(cache) == ["a", "b", "c"]  # iteration shows them, and drops nothing
    assert cache.expire() == 2
    assert list(cache) == ["b"] and [k for k, _ in heard] == ["a", "c"]
    assert cache.expirations == 2 and cache.expire() == 0


def test_sweep_drops_the_expired_among_a_bounded_step_going_on_where_the_last_stopped():
    clock = ManualClock(monotonic=0.0)
    cache, heard = lru(clock)
    for i, expires in enumerate([1.0, 9.0, 1.0, 1.0, 9.0, 1.0, 9.0]):
        cache.put(f"k{i}", (f"k{i}", 1, expires))
    clock.advance(3)
    assert cache.sweep(3) == 2  # k0 k1 k2: k0 and k2 expired
    assert list(cache) == ["k1", "k3", "k4", "k5", "k6"] and cache.bytes == 5
    assert cache.sweep(3) == 2  # from where it stopped: k3 k4 k5
    assert list(cache) == ["k1", "k4", "k6"] and [k for k, _ in heard] == ["k0", "k2", "k3", "k5"]
    assert cache.expirations == 4 and cache.evictions == 0
    cache.put("k7", ("k7", 1, 4.0))
    assert cache.sweep(3) == 0  # k6 and the last put, then nothing more this lap
    clock.advance(1)
    assert cache.sweep(2) == 0 and cache.sweep(2) == 1  # past the last: from the first again
    assert list(cache) == ["k1", "k4", "k6"] and cache.sweep(0) == 0


def test_an_expired_entry_is_evicted_in_its_turn_like_any_other():
    clock = ManualClock(monotonic=0.0)
    cache, heard = lru(clock, max_entries=2)
    cache.put("a", ("a", 1, 9.0))
    cache.put("b", ("b", 1, 1.0))
    clock.advance(5)
    cache.put("c", ("c", 1, 9.0))  # the least recently used goes, expired or not
    assert list(cache) == ["b", "c"] and heard == [("a", ("a", 1, 9.0))]


def test_the_wall_clock_is_read_when_asked():
    clock = ManualClock(now=1_000.0, monotonic=0.0)
    wall, _ = lru(clock, wall_clock=True)
    mono, _ = lru(clock)
    assert wall.now() == 1_000.0 and mono.now() == 0.0
    wall.put("k", ("k", 1, 1_010.0))
    mono.put("k", ("k", 1, 10.0))
    clock.advance(10)
    assert wall.get("k") is None and mono.get("k") is None


def test_entries_without_an_expiry_function_never_expire():
    clock = ManualClock(monotonic=0.0)
    cache: LRU[str, Value] = LRU(clock=clock)
    cache.put("k", ("k", 1, 0.0))
    clock.advance(1e9)
    assert cache.get("k") == ("k", 1, 0.0)


# --------------------------------------------------------------------------- removal by the caller


def test_pop_remove_if_and_clear_are_the_callers_and_not_heard_as_evictions():
    clock = ManualClock(monotonic=0.0)
    cache, heard = lru(clock)
    for i, key in enumerate("abcdef"):
        cache.put(key, (key, i, FOREVER))
    assert cache.pop("a") == ("a", 0, FOREVER) and cache.bytes == 1 + 2 + 3 + 4 + 5
    removed = cache.remove_if(lambda key, value: value[1] % 2 == 1)
    assert removed == [("b", ("b", 1, FOREVER)), ("d", ("d", 3, FOREVER)), ("f", ("f", 5, FOREVER))]
    assert list(cache) == ["c", "e"] and cache.bytes == 2 + 4
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0
    assert heard == [] and cache.evictions == 0 and cache.expirations == 0


def test_remove_if_never_picks_an_expired_entry_and_drops_those_it_meets():
    clock = ManualClock(monotonic=0.0)
    cache, heard = lru(clock)
    cache.put("old", ("old", 1, 1.0))
    cache.put("live", ("live", 1, 9.0))
    clock.advance(2)
    shown: list[str] = []
    picked = cache.remove_if(lambda key, value: shown.append(key) or True)
    assert picked == [("live", ("live", 1, 9.0))] and shown == ["live"]
    assert heard == [("old", ("old", 1, 1.0))] and len(cache) == 0


# --------------------------------------------------------------------------- what a value holds


def test_held_counts_shared_objects_as_nothing():
    assert held(None, True, False, 0, 256, -5, "", b"", ()) == 0
    assert held() == 0


def test_held_is_getsizeof_rounded_up_to_what_the_allocator_hands_out():
    for obj in (b"x" * 200, "y" * 37, 3.5, 10**6, ("a", "b"), {}, b"z" * 4000):
        size = held(obj)
        assert size >= sys.getsizeof(obj) and size % 16 == 0 and size - sys.getsizeof(obj) < 32
    assert allocated(1) == 16 and allocated(16) == 16 and allocated(17) == 32
    assert allocated(512) == 512 and allocated(513) == 528  # malloc's 8-byte header, beyond


def test_held_counts_a_lists_item_array_as_well():
    items = [b"a", b"b", b"c"]
    assert held(items) >= sys.getsizeof(items) and held([]) == allocated(sys.getsizeof([]))


def traced(make, n):
    """Bytes Python allocated per object to build ``n`` objects with ``make(i)``."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [make(i) for i in range(n)]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return (grown - sys.getsizeof(kept)) / n, kept


@pytest.mark.parametrize(
    "make",
    [
        lambda i: b"%0200d" % i,  # a small body
        lambda i: f"{i:032x}",  # a fingerprint key
        lambda i: i + 0.5,  # a float
        lambda i: b"%03000d" % i,  # a larger body (malloc, not the small-object allocator)
    ],
    ids=["bytes", "str", "float", "large"],
)
def test_held_is_at_least_what_python_allocates_and_at_most_its_rounding_more(make):
    per_object, kept = traced(make, 2000)
    counted = held(kept[0])
    assert per_object <= counted <= per_object + 24, (per_object, counted)


def per_entry_place(keys: list, churn: int) -> float:
    """Bytes per entry an LRU of ``keys`` holds beyond its keys and values (one shared value),
    once filled and then through ``churn`` uses and ``churn`` evictions (holes: resizes)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache: LRU = LRU(max_entries=len(keys))
        for key in keys:
            cache.put(key, 1)
        for i in range(churn):
            cache.get(keys[i % len(keys)])
            cache.put(-1 - i, 1)  # evicts the least recently used (an int: shared or not, 32)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return (grown - 32 * min(churn, len(keys))) / len(keys)


@pytest.mark.parametrize("n", [1_000, 1_365, 1_366, 5_000, 21_845, 21_846])
@pytest.mark.parametrize("kind", ["str", "int"])
def test_slot_bytes_bounds_what_an_entrys_place_in_the_map_takes(n, kind):
    # Sizes just below and just above where the table doubles (2/3 of a power of two); keys of
    # both dict entry sizes (str: 16 bytes, any other: 24). Only what the map adds is counted.
    if kind == "str":
        keys: list = [f"{i:032x}" for i in range(n)]
    else:
        keys = [10**12 + i for i in range(n)]
    filled, churned = per_entry_place(keys, 0), per_entry_place(keys, 3 * n)
    assert filled <= SLOT_BYTES and churned <= SLOT_BYTES, (filled, churned)
    assert churned >= filled / 2  # (churn does not shrink the table)


def test_slot_bytes_is_not_far_above_the_worst_case():
    # Just above a third of a power of two, under churn: the table is 6 slots an entry.
    n = 2**15 // 3 + 8
    keys = [10**12 + i for i in range(n)]
    assert per_entry_place(keys, 3 * n) >= SLOT_BYTES * 0.85


# --------------------------------------------------------------------------- against a model


class Model(RuleBasedStateMachine):
    """The LRU beside the simplest thing it could be: a list, least recently used first."""

    keys = st.sampled_from("abcdefgh")

    @initialize(
        max_entries=st.none() | st.integers(0, 6),
        max_bytes=st.none() | st.integers(0, 40),
    )
    def start(self, max_entries, max_bytes):
        self.clock = ManualClock(monotonic=0.0)
        self.cache, self.heard = self._make(max_entries=max_entries, max_bytes=max_bytes)
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.model: list[tuple[str, Value]] = []
        self.expected_heard: list[tuple[str, Value]] = []
        self.evictions = self.expirations = 0
        self.serial = 0
        self.newest: str | None = None  # the key of the last put stored

    def _make(self, **bounds):
        return lru(self.clock, **bounds)

    def _use(self, i):
        """A get or touch of the model's ``i``-th entry (it becomes the last); its value now."""
        self.model.append(self.model.pop(i))
        return self.model[-1][1]

    def _evict_first(self):
        """The entry an eviction takes out of the model (not empty)."""
        return self.model.pop(0)

    def _find(self, key):
        return next((i for i, (k, _) in enumerate(self.model) if k == key), None)

    def _live(self, key):
        """The model's value for ``key``, after dropping it if expired (as a look does)."""
        i = self._find(key)
        if i is None:
            return None, None
        value = self.model[i][1]
        if value[2] <= self.clock.monotonic():
            del self.model[i]
            self.expected_heard.append((key, value))
            self.expirations += 1
            return None, None
        return i, value

    @rule(key=keys, size=st.integers(0, 15), ttl=st.none() | st.integers(0, 5))
    def put(self, key, size, ttl):
        self.serial += 1
        value = (
            f"{key}{self.serial}",
            size,
            FOREVER if ttl is None else self.clock.monotonic() + ttl,
        )
        i = self._find(key)
        if i is not None:
            del self.model[i]
        evicted = []
        if self.max_bytes is None or size <= self.max_bytes:
            self.model.append((key, value))
            self.newest = key
            while (self.max_entries is not None and len(self.model) > self.max_entries) or (
                self.max_bytes is not None and sum(v[1] for _, v in self.model) > self.max_bytes
            ):
                evicted.append(self._evict_first())
        self.evictions += len(evicted)
        self.expected_heard += evicted
        assert self.cache.put(key, value) == evicted

    @rule(key=keys)
    def get(self, key):
        i, value = self._live(key)
        if i is not None:
            value = self._use(i)
        assert self.cache.get(key) == value

    @rule(key=keys)
    def peek(self, key):
        _, value = self._live(key)
        assert self.cache.peek(key) == value

    @rule(key=keys)
    def contains(self, key):
        _, value = self._live(key)
        assert (key in self.cache) == (value is not None)

    @rule(key=keys)
    def touch(self, key):
        i = self._find(key)
        if i is not None:
            self._use(i)
        self.cache.touch(key)

    @rule(key=keys)
    def pop(self, key):
        i = self._find(key)
        value = None if i is None else self.model.pop(i)[1]
        assert self.cache.pop(key) == value

    @rule()
    def evict(self):
        gone = self._evict_first() if self.model else None
        if gone is not None:
            self.evictions += 1
            self.expected_heard.append(gone)
        assert self.cache.evict() == gone

    @rule(parity=st.integers(0, 1))
    def remove_if(self, parity):
        now = self.clock.monotonic()
        expired = [(k, v) for k, v in self.model if v[2] <= now]
        picked = [(k, v) for k, v in self.model if v[2] > now and v[1] % 2 == parity]
        self.model = [(k, v) for k, v in self.model if (k, v) not in expired + picked]
        self.expected_heard += expired
        self.expirations += len(expired)
        assert self.cache.remove_if(lambda k, v: v[1] % 2 == parity) == picked

    @rule()
    def expire(self):
        now = self.clock.monotonic()
        expired = [(k, v) for k, v in self.model if v[2] <= now]
        self.model = [(k, v) for k, v in self.model if v[2] > now]
        self.expected_heard += expired
        self.expirations += len(expired)
        assert self.cache.expire() == len(expired)

    @precondition(lambda self: self.serial % 7 == 3)
    @rule()
    def clear(self):
        self.model = []
        self.newest = None
        self.cache.clear()

    @rule(seconds=st.integers(0, 3))
    def advance(self, seconds):
        self.clock.advance(seconds)

    @invariant()
    def same_as_the_model(self):
        assert list(self.cache.items()) == self.model
        assert len(self.cache) == len(self.model)
        assert self.cache.bytes == sum(v[1] for _, v in self.model)
        assert self.heard == self.expected_heard
        assert (self.cache.evictions, self.cache.expirations) == (self.evictions, self.expirations)

    @invariant()
    def within_the_bounds(self):
        assert self.max_entries is None or len(self.cache) <= self.max_entries
        assert self.max_bytes is None or self.cache.bytes <= self.max_bytes


Model.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_the_lru_behaves_as_its_model = Model.TestCase


class SecondChanceModel(Model):
    """The LRU with second chance beside a list in the order of puts and spares, whose values
    carry the mark of a use (``marked``)."""

    def _make(self, **bounds):
        return lru(self.clock, mark=marked, unmark=unmarked, **bounds)

    def _use(self, i):
        key, value = self.model[i]
        self.model[i] = (key, marked(value))  # in place
        return self.model[i][1]

    def _evict_first(self):
        while True:
            key, value = self.model.pop(0)
            if value is not unmarked(value):  # used since it was put or spared: spared
                self.model.append((key, unmarked(value)))
            elif key == self.newest and self.model:  # the last put goes after the others
                self.model.append((key, value))
            else:
                return key, value


SecondChanceModel.TestCase.settings = Model.TestCase.settings
test_the_lru_with_second_chance_behaves_as_its_model = SecondChanceModel.TestCase
