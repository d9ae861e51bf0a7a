"""One bounded map for the in-process caches: least recently used out first (or second chance),
optional expiry.

Contract:
- ``LRU(max_entries=, max_bytes=, size=, expires=, clock=, wall_clock=, on_evict=, mark=,
  unmark=)``; a bound left ``None`` does not bound. ``size(key, value)`` is what an entry
  counts against ``max_bytes`` (required with it); it is asked when the entry comes in and
  again when it goes, so it must give the same answer for the same entry (build it from what
  does not change). ``bytes`` is always the sum of ``size`` over the entries held.
- After every ``put``: ``len <= max_entries`` and ``bytes <= max_bytes``. The least recently
  used entries are evicted first (with second chance: below), the new one last; a value whose
  size alone exceeds ``max_bytes`` is not stored at all. A ``put`` always replaces: whatever
  was under its key is gone afterwards, stored or not.
- Recency: ``put``, ``get`` and ``touch`` make an entry the most recently used; ``peek``,
  ``in``, ``[]``, iteration and ``mapping`` do not. Values are never None (``get`` answers None for none).
- Second chance (``mark=`` and ``unmark=``, the CLOCK algorithm): instead, a ``get`` or
  ``touch`` moves nothing: it marks its entry used, in place. The entries stay in the order of
  their ``put``; eviction takes the first, but spares one marked used: it goes to the end,
  unmarked, and is counted nowhere (not an eviction, not heard). So an eviction takes, of the
  entries not used since they were put or last spared, the one put or spared first (if all
  were used, each is spared once and the first goes), never the last put while another is
  here (it goes after those it found spared): an entry used since is never the one, but of two
  used entries, the one used first may outlive the other. ``mark(value)`` and
  ``unmark(value)`` are the value marked used and not (the very value if it already is so),
  with the same size and expiry; a ``put`` keeps its value unmarked. Why: a move to the end
  leaves a hole in the dict's table and takes another slot, so that uses alone grow it
  (``SLOT_BYTES``); a mark takes no place.
- Expiry: ``expires(value)`` is the instant the entry expires (None: entries never do), on this
  cache's clock: ``clock.now()`` with ``wall_clock=True``, else ``clock.monotonic()``. From that
  instant on (``expires(value) <= now``) the entry is never returned: a ``get``, ``peek``,
  ``in``, ``[]`` or ``remove_if`` that finds it expired drops it. Expiry is lazy: an expired
  entry no one looks at holds its place (and counts toward the bounds) until it is evicted, found
  or swept: by ``expire()``, all at once, or ``sweep(limit)``, a bounded step (``limit``
  entries looked at, in the order of ``iter``, from where the last step stopped: by its
  place, so that an entry removed before it makes the next step begin one later; from the
  first again past the last); ``reap(limit, every)`` takes such a step only if the last one it
  took was ``every`` seconds ago or more (on the clock's monotonic time; the first ``every``
  seconds after the cache was made), so that a caller on a hot path may ask on every call. A
  time-to-live is an ``expires`` that adds it to a time the value holds
  (``expires=lambda v: v.at + ttl``).
- ``on_evict(key, value)`` hears of every entry the cache drops on its own: evicted for a bound
  (``put`` also returns those; or by ``evict()``, for a caller's own bound) or dropped expired;
  ``evictions`` and ``expirations`` count them.
  It is not called for what the caller removes (``pop``, ``remove_if``, ``clear``) or replaces.
- Every operation is O(1) amortized (plus the callbacks) except ``remove_if`` and ``expire``,
  which scan (an eviction that spares entries steps over each once per mark), and ``sweep``:
  O(limit), after stepping over the entries before its place at the speed of C (a dict finds
  its n-th key no faster: ~6 ns an entry). A use that moves
  its entry keeps the key object it was given (an equal one) in place of the stored one.

Byte budgets that bound what the process holds (``held``, ``SLOT_BYTES``): ``sys.getsizeof``
counts an object's own bytes, not the allocator's rounding nor the objects it refers to, so a
``size`` function sums ``held`` over every object the entry alone keeps alive, plus
``SLOT_BYTES`` for the entry's place in this map.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from itertools import islice
from typing import Generic, TypeVar

from .clock import SYSTEM_CLOCK, Clock

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: What one entry's place in an ``LRU`` holds, beyond its key and value: its share of the dict's
#: table (CPython 3.11, 64-bit: a 4-byte index per slot, a 24-byte entry per 2/3 of a slot, 16
#: for str keys). The table has 1.5 to 3 slots an entry while the map only grows; once entries
#: come and go (an eviction, a use that moves its entry, a second chance: each leaves a hole),
#: each resize makes it the first power of two over 3 slots an entry: up to 6, 120 bytes. The
#: most, and the eviction front's share (``LRU._front``), so that a budget bounds it
#: (tests/test_lru.py measures it).
SLOT_BYTES = 128

# The eviction front: the oldest keys taken in one pass, a share of the map (and a few).
_FRONT_SHARE = 32
_FRONT_MIN = 16

# Objects CPython shares, whatever holds them: they cost an entry nothing.
_SHARED_INTS = range(-5, 257)
_LIST_BYTES = sys.getsizeof([])


def allocated(nbytes: int) -> int:
    """What the allocator hands out for a request of ``nbytes``: CPython's small-object
    allocator rounds up to 16 bytes (64-bit builds) up to 512 bytes; beyond, malloc (glibc) adds
    an 8-byte header and rounds to 16."""
    if nbytes <= 512:
        return (nbytes + 15) & ~15
    return (nbytes + 8 + 15) & ~15


def held(*objects: object) -> int:
    """Bytes the allocator gives these objects themselves, not counting what they refer to.

    Objects CPython shares (None, booleans, small ints, empty strings, bytes and tuples) count
    0. A list counts its item array too (a separate allocation).
    """
    total = 0
    for obj in objects:
        if obj is None or obj is True or obj is False:
            continue
        kind = type(obj)
        if kind is int:
            if obj in _SHARED_INTS:
                continue
        elif kind is str or kind is bytes or kind is tuple:
            if not obj:  # an empty str, bytes or tuple is shared
                continue
        elif kind is list:
            items = sys.getsizeof(obj) - _LIST_BYTES
            total += allocated(_LIST_BYTES) + (allocated(items) if items else 0)
            continue
        nbytes = sys.getsizeof(obj)  # (``allocated``, inlined: a hit may count a dozen)
        total += (nbytes + 15 if nbytes <= 512 else nbytes + 23) & ~15
    return total


class LRU(Generic[K, V]):
    """A map bounded in entries and/or bytes, least recently used out first or second chance
    (module docstring)."""

    __slots__ = (
        "max_entries",
        "max_bytes",
        "evictions",
        "expirations",
        "_data",
        "_oldest",
        "_front",
        "_size",
        "_expires",
        "_time",
        "_on_evict",
        "_mark",
        "_unmark",
        "_newest",
        "_bytes",
        "_swept",
        "_monotonic",
        "_reaped",
    )

    def __init__(
        self,
        *,
        max_entries: int | None = None,
        max_bytes: int | None = None,
        size: Callable[[K, V], int] | None = None,
        expires: Callable[[V], float] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        wall_clock: bool = False,
        on_evict: Callable[[K, V], None] | None = None,
        mark: Callable[[V], V] | None = None,
        unmark: Callable[[V], V] | None = None,
    ) -> None:
        if max_bytes is not None and size is None:
            raise ValueError("a byte budget (max_bytes) needs a size function")
        if (mark is None) != (unmark is None):
            raise ValueError("second chance needs both mark and unmark")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.evictions = 0
        self.expirations = 0
        # In order of use, least recently used first: a use pops the key and puts it back at the
        # end (a plain dict: an OrderedDict's linked list and node array add 40 to 80 bytes an
        # entry). With second chance, in order of put (or of the last spare): a use marks the
        # value instead.
        self._data: dict[K, V] = {}
        # A dict finds its first key by stepping over the holes that pops leave at its front,
        # one by one: evicting with ``next(iter(data))`` would cost O(holes), quadratic overall.
        # Instead ``_oldest`` holds the first keys, in order, taken in one pass when it runs
        # out, and ``_front`` those of them still in place: a key used, replaced or removed
        # since leaves it. The first key of ``_oldest`` still in ``_front`` is the least
        # recently used (``_least_recently_used``).
        self._oldest: deque[K] = deque()
        self._front: set[K] = set()
        self._size = size
        self._expires = expires
        self._time: Callable[[], float] = clock.now if wall_clock else clock.monotonic
        self._monotonic = clock.monotonic  # (``reap``'s pace, whatever the wall clock does)
        self._reaped = clock.monotonic()  # (when ``reap`` last took a step: as if on creation)
        self._on_evict = on_evict
        self._mark = mark
        self._unmark = unmark
        # The key of the last put, evicted last (with second chance, the used ones it finds
        # spared go after it: it is not always the last key).
        self._newest: K | None = None
        self._bytes = 0
        self._swept = 0  # where the next ``sweep`` begins, in the order of ``iter``

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first (expired ones included); with second chance, in
        the order eviction meets them."""
        return iter(self._data)

    def items(self) -> Iterator[tuple[K, V]]:
        """The entries in the order of ``iter``."""
        return iter(self._data.items())

    def __contains__(self, key: object) -> bool:
        """Whether a live entry is under ``key`` (an expired one found is dropped)."""
        if key not in self._data:
            return False
        return self.peek(key) is not None  # (in the map: a K)

    def __getitem__(self, key: K) -> V:
        value = self.peek(key)
        if value is None:
            raise KeyError(key)
        return value

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def mapping(self) -> Mapping[K, V]:
        """The entries as held, in the order of ``iter`` (expired ones included), read-only: the
        same object for this cache's life, for a hot path that reads it without a call (a read
        there drops nothing, uses nothing)."""
        return self._data

    def now(self) -> float:
        """The time on this cache's clock (what ``expires`` is compared with)."""
        return self._time()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value under ``key``, made the most recently used (or marked used); ``default`` if
        none or expired."""
        data = self._data
        value = data.get(key)
        if value is None:
            return default
        if self._expires is not None and self._expires(value) <= self._time():
            self._expire(key, value)
            return default
        mark = self._mark  # (``peek`` and ``touch``, inlined: the hot path of every cache)
        if mark is None:
            del data[key]
            data[key] = value
            if self._front:
                self._front.discard(key)
        else:
            marked = mark(value)
            if marked is not value:  # (replacing a value keeps its place: no hole)
                data[key] = value = marked
        return value

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value under ``key`` without making it recently used; ``default`` if none or
        expired."""
        value = self._data.get(key)
        if value is None:
            return default
        if self._expires is not None and self._expires(value) <= self._time():
            self._expire(key, value)
            return default
        return value

    def touch(self, key: K) -> None:
        """Make ``key`` the most recently used (or mark it used), if it is here."""
        data, mark = self._data, self._mark
        if mark is None:
            value = data.pop(key, None)
            if value is not None:
                data[key] = value
                if self._front:
                    self._front.discard(key)
        else:
            value = data.get(key)
            if value is not None:
                marked = mark(value)
                if marked is not value:
                    data[key] = marked

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Store ``value`` (never None) under ``key`` as the most recently used; returns what
        was evicted to keep the bounds, least recently used first."""
        if value is None:
            raise TypeError("an LRU does not hold None (its get answers None for a miss)")
        if self._unmark is not None:
            value = self._unmark(value)
        data, size = self._data, self._size
        old = data.pop(key, None)
        if old is not None:
            if self._front:
                self._front.discard(key)
            if size is not None:
                self._bytes -= size(key, old)
        counted = 0 if size is None else size(key, value)
        if self.max_bytes is not None and counted > self.max_bytes:
            return []
        data[key] = value
        self._newest = key
        self._bytes += counted
        return self._bound()

    def evict(self) -> tuple[K, V] | None:
        """Evict the least recently used entry (with second chance: the first not marked used,
        sparing those before it), expired or not, as a bound does (counted in ``evictions``,
        heard by ``on_evict``), for a caller that bounds more than ``bytes``; None if empty."""
        if not self._data:
            return None
        key = self._least_recently_used()
        value = self._data.pop(key)
        if self._size is not None:
            self._bytes -= self._size(key, value)
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(key, value)
        return key, value

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove the entry under ``key`` (expired or not) and return its value, or ``default``."""
        value = self._data.pop(key, None)
        if value is None:
            return default
        if self._front:
            self._front.discard(key)
        if self._size is not None:
            self._bytes -= self._size(key, value)
        return value

    def remove_if(self, doomed: Callable[[K, V], bool]) -> list[tuple[K, V]]:
        """Remove the live entries ``doomed`` picks and return them; expired entries met on the
        way are dropped as expired, never picked (nor shown to ``doomed``)."""
        expires = self._expires
        now = self._time() if expires is not None else 0.0
        expired: list[tuple[K, V]] = []
        picked: list[tuple[K, V]] = []
        for key, value in self._data.items():
            if expires is not None and expires(value) <= now:
                expired.append((key, value))
            elif doomed(key, value):
                picked.append((key, value))
        for key, value in expired:
            self._expire(key, value)
        for key, _ in picked:
            self.pop(key)
        return picked

    def expire(self) -> int:
        """Drop every expired entry now; returns how many."""
        before = self.expirations
        self.remove_if(_never)
        return self.expirations - before

    def reap(self, limit: int, every: float) -> int:
        """``sweep(limit)``, if ``every`` seconds have passed since the last step it took (see
        the module doc); how many it dropped."""
        now = self._monotonic()
        if now - self._reaped < every:
            return 0
        self._reaped = now
        return self.sweep(limit)

    def sweep(self, limit: int) -> int:
        """Look at the next ``limit`` entries (from where the last sweep stopped, in the order of
        ``iter``; from the first again past the last) and drop the expired ones, as ``expire``
        does; returns how many."""
        data, expires = self._data, self._expires
        if expires is None or not data or limit <= 0:
            return 0
        at = self._swept if self._swept < len(data) else 0
        now = self._time()
        expired = [(k, v) for k, v in islice(data.items(), at, at + limit) if expires(v) <= now]
        for key, value in expired:
            self._expire(key, value)
        self._swept = at + limit - len(expired)  # (the first not looked at, once they are gone)
        return len(expired)

    def clear(self) -> None:
        """Drop everything (not counted as evictions)."""
        self._data.clear()
        self._oldest.clear()
        self._front.clear()
        self._newest = None
        self._bytes = 0
        self._swept = 0

    def _bound(self) -> list[tuple[K, V]]:
        """Evict the least recently used entries until within the bounds; returns them."""
        data = self._data
        evicted: list[tuple[K, V]] = []
        max_entries, max_bytes = self.max_entries, self.max_bytes
        while (max_entries is not None and len(data) > max_entries) or (
            max_bytes is not None and self._bytes > max_bytes
        ):
            gone = self.evict()
            if gone is None:
                break
            evicted.append(gone)
        return evicted

    def _least_recently_used(self) -> K:
        """The first key in the order of use (the map is not empty); it leaves the front. With
        second chance, the first not marked used: those before it go to the end, unmarked."""
        oldest, front, data, unmark = self._oldest, self._front, self._data, self._unmark
        while True:
            while oldest:
                key = oldest.popleft()
                if key in front:
                    front.remove(key)
                    if unmark is not None:
                        value = data[key]
                        unmarked = unmark(value)
                        if unmarked is not value:  # used since it was put or spared: spared
                            del data[key]
                            data[key] = unmarked
                            continue
                        if key == self._newest and len(data) > 1:  # behind those spared
                            del data[key]
                            data[key] = value
                            continue
                    return key
            # One pass over the holes for a share of the map: O(1) amortized an eviction. (A
            # spare is too: it clears the mark of a use.)
            oldest.extend(islice(data, len(data) // _FRONT_SHARE + _FRONT_MIN))
            front.update(oldest)

    def _expire(self, key: K, value: V) -> None:
        del self._data[key]
        if self._front:
            self._front.discard(key)
        if self._size is not None:
            self._bytes -= self._size(key, value)
        self.expirations += 1
        if self._on_evict is not None:
            self._on_evict(key, value)


def _never(key: object, value: object) -> bool:
    return False
