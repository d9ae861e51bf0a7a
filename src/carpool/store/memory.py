"""The in-process exact cache: second-chance LRU with per-entry TTL, bounded in bytes (on
``carpool.lru``).

Contract (on top of ``store.base``):
- Total ``bytes`` never exceeds ``max_bytes`` after a ``put``: the least recently used entries
  with objects let theirs go first (the entries stay, packed); only then are entries evicted,
  in the order they were put, sparing those used since (below; counted in ``evictions``); an
  entry larger than the whole budget is not stored at all (and, as any put, replaces what its
  key held).
- ``bytes`` counts what the entries hold in this process, so that ``max_bytes`` bounds the
  memory the cache takes, not only its payload: per entry its key, its packed form, its place
  in the map (``lru.SLOT_BYTES``, the most a place takes: a map that only grew takes less) and,
  while it has them, its objects, with the frames its answer synthesized for streaming hits
  since it was kept (``Answer.sse``, stored without frames: a non-streamed miss's), counted
  when they are made (``Answer.on_synthesized``): the least recently used entries with objects
  (this one last) let theirs go until ``bytes`` is within ``max_bytes`` again (no eviction: the
  entries stay, packed). Not counted: a fixed cost, the keys of the last hits on packed entries
  (``hot`` at most), frames made for a hit on a packed entry (that entry is the hit's alone).
- Two forms, one behaviour: every entry is kept packed into one bytes object (``store.packed``:
  about 40% of the memory of its objects); the ``hot`` entries most recently hit also keep
  their objects (a ``get`` returns the very ``Entry``, with what its answer computed since, as
  frames synthesized for streaming clients: each stream hit after the first sends them as they
  are). A hit on another unpacks a new, equal ``Entry``;
  a second hit while the first is among the last ``hot`` ones keeps its objects, if the budget
  has room for them without evicting (the least recently used entry with objects, beyond
  ``hot``, lets its own go). A put keeps none: what was put is its flight's clients' already,
  and objects kept from every put would live on through the garbage collector's young passes
  (at 1,000 misses a second, a thousand answers' objects walked by each: 0.7 ms passes, the
  middle generation's 2.6 ms, against 0.25 and 0.3 without). Which entries keep objects
  changes nothing else: not the order of eviction, not what is returned, not the expiry; an
  entry evicted loses them too.
- Keys: a fingerprint's (32 lowercase hex digits) is kept as an int of its last 60 bits (32
  bytes: the map's key) and, in the packed form, the rest; any other string as it is. Two keys
  that share their last 60 bits share one place: the later put replaces the earlier one's entry
  (a miss for that key, never the other's answer). A digest's bits are all alike; keys made
  otherwise (a counter) differ most in their last digits.
- Eviction is second chance (``lru``: CLOCK), close to least recently used: a ``get`` hit
  marks its entry used, in place (its packed form: a copy with the mark, on its first hit in a
  lap); an eviction goes in the order of the puts, but spares an entry used since it was put or
  last spared (it goes to the end, unmarked: a new lap), and never takes the entry put last
  while another is here. So an entry hit in its lap is never evicted while one that was not is
  here; unlike LRU, of two entries hit, the one hit first may outlive the other. Why not move a
  hit entry to the end: each move leaves a hole in the map's table and takes a new slot, so
  that reading every entry of a full store once doubles the table (+42 MB at 1M entries:
  docs/architecture.md); a mark takes no place, and a hit on a marked entry writes nothing.
- An expired entry found by ``get`` is dropped. Expiry reads ``clock.now()`` (wall-clock, as
  ``Entry.expires``): the system's by default. An entry already expired when put (an answer
  back-dated by an upstream's ``age``: ``Exchange.fetch``) is not stored: it takes no room,
  evicts nothing and is not counted (as one larger than the budget, it still replaces what
  its key held).
- Expired entries no ``get`` finds are reaped (``reap``): at most once a ``SWEEP_EVERY``
  seconds (the clock's ``monotonic()``), a step looks at the next ``SWEEP_STEP`` entries in
  the map's order, from where the last one stopped, and drops the expired ones with their
  objects (not evictions). A ``put`` takes a step when one is due, and so do the reports
  (``/stats`` and ``/metrics``, ``admin.gauges``), so that ``entries`` and ``bytes`` come to
  count the live entries only, and the memory of the others is released, whether or not
  answers are stored meanwhile; a store of n entries is looked through in n / ``SWEEP_STEP``
  steps.
- Every operation is O(1) amortized (an eviction spares an entry at most once a hit) except
  ``invalidate``, which scans (it is an admin action); it counts only live entries, and drops
  the expired ones it meets; and a step of ``reap``, which looks at ``SWEEP_STEP`` entries
  after stepping over those before them at the speed of C (``LRU.sweep``: ~6 ms at a million
  entries).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from functools import partial
from typing import TypeAlias

from ..answer import Answer
from ..clock import SYSTEM_CLOCK, Clock
from ..lru import LRU, SLOT_BYTES, allocated, held
from . import packed
from .base import Entry, Selector, synthesized_held

#: How many of the entries most recently hit keep their objects (all are packed).
HOT = 1024
#: Seconds between two steps of ``reap``, and how many entries a step looks at (~1 ms).
SWEEP_EVERY = 1.0
SWEEP_STEP = 4096

# The map's key for a key (``_place``). The map holds only ints, strings and bytes, which the
# garbage collector does not track: a full collection does not walk its million entries.
Place: TypeAlias = int | str
# An entry's objects, kept while it is hot: its place, the entry, and what they count.
Hot: TypeAlias = tuple[Place, Entry, int]
Packed: TypeAlias = bytes  # (``store.packed``)

_is_fingerprint = re.compile("[0-9a-f]{32}").fullmatch
_USED = packed.USED
# The last 15 digits, 60 bits: an int below 2**60 takes 32 bytes, a bigger one 48 or more.
_PLACE_FROM = 17
_INT_PLACE = held(2**59)
# A hot entry's places in ``_hot`` (an OrderedDict: its table's share and list node, at most)
# and in ``_hot_places``, and its tuple.
_HOT_PLACES = 3 * SLOT_BYTES + held(("", None, 0))
# What the objects of an unpacked usual entry take besides its body and prompt prefix: the
# Entry, the Answer and its dict, two floats and an int (counted even when a shared small one).
_sample = Answer.restored("chat", b"", True, 2**40, 0.5)
_UNPACKED = held(Entry(_sample, 0.5), _sample, _sample.created, 0.5, _sample.tokens, {})
del _sample
# A hot entry's answer's ``on_synthesized``: a partial of the store's method and the key.
_hook = partial(print, "")
_HOOK = held(_hook, _hook.args, _hook.keywords)
del _hook


def _place(key: str) -> Place:
    """The map's key for ``key``: an int of a fingerprint's last 60 bits, else ``key``."""
    if len(key) == 32 and _is_fingerprint(key):
        return int(key[_PLACE_FROM:], 16)
    return key


def _rest(key: str, place: Place) -> bytes:
    """What a packed entry keeps of its key besides ``place``: a fingerprint's first 72 bits (9
    bytes, to digit 18: 4 bits over the place's, to be whole bytes); nothing of another key."""
    return bytes.fromhex(key[: _PLACE_FROM + 1]) if type(place) is int else b""


def _size(place: Place, blob: bytes) -> int:
    """What an entry counts in the map: its place there, its place's object and its packed
    form."""
    return (
        SLOT_BYTES
        + (_INT_PLACE if type(place) is int else held(place))
        + allocated(sys.getsizeof(blob))  # (``held(blob)``: a blob is never empty)
    )


def _objects(key: str, place: Place, entry: Entry) -> int:
    """What an entry's objects count while it keeps them (an entry a hit unpacked): its places
    in the hot tables, its place's object again (the map may have another since a get), its key
    (a string key is its own place), its answer's ``on_synthesized`` and the entry's objects: a
    usual entry's by their shape."""
    counted = _HOT_PLACES + _HOOK + held(place)
    if type(place) is int:
        counted += held(key)
    if not entry.tags and not entry.namespace and entry.answer.frames is None:
        counted += _UNPACKED + held(entry.answer.body, entry.prompt_prefix)
    else:
        counted += entry.held
    return counted + held(counted + 32)  # and that count itself (an int about that size)


def size_of(key: str, entry: Entry) -> int:
    """What ``entry`` counts under ``key`` while it keeps its objects (hot: those of the entry a
    hit unpacked, by their shape), before its answer synthesizes frames for streaming hits
    (then ``synthesized_held`` more)."""
    return packed_size_of(key, entry) + _objects(key, _place(key), entry)


def packed_size_of(key: str, entry: Entry) -> int:
    """What ``entry`` counts under ``key`` packed alone."""
    place = _place(key)
    return _size(place, packed.pack(entry, _rest(key, place)))


class MemoryStore:
    def __init__(self, max_bytes: int, *, clock: Clock = SYSTEM_CLOCK, hot: int = HOT) -> None:
        self.max_bytes = max_bytes
        self.hot = hot
        # Bounded by ``put``, counting the hot objects too, not by itself.
        self._entries: LRU[Place, Packed] = LRU(
            size=_size,
            expires=packed.expires,
            clock=clock,
            wall_clock=True,
            on_evict=self._lost,
            mark=packed.marked,
            unmark=packed.unmarked,
        )
        self._blobs = self._entries.mapping  # (read by the hot path without a call)
        # By key, the objects of the hot entries, least recently used first; and their keys by
        # place, to find them from the map's entries.
        self._hot: OrderedDict[str, Hot] = OrderedDict()
        self._hot_places: dict[Place, str] = {}
        self._hot_bytes = 0
        # The keys last unpacked for a hit (``hot`` at most, oldest first): a second hit while
        # its key is here keeps the objects. (A first would waste the work when hits spread
        # wider than ``hot`` entries, each then pushing another out.)
        self._seen: OrderedDict[str, None] = OrderedDict()
        # (One bound method for every hot entry's hook: ``_keep``.)
        self._synthesized = self._count_synthesized

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._entries.bytes + self._hot_bytes

    @property
    def evictions(self) -> int:
        """Entries evicted to keep the budget (not the expired or invalidated ones)."""
        return self._entries.evictions

    def counted(self, key: str, entry: Entry) -> int:
        """What ``entry`` counts in ``bytes`` just after ``put(key, entry)`` (packed: a put keeps
        no objects)."""
        return packed_size_of(key, entry)

    async def get(self, key: str, kind: str | None = None) -> Entry | None:
        return self.get_now(key)  # (its entries are this process's: each of its key's kind)

    def get_now(self, key: str) -> Entry | None:
        """``get`` without a coroutine, for the hot path."""
        hot = self._hot.get(key)
        if hot is not None:  # (its place is the map's key object: nothing to parse)
            place, entry, _ = hot
            if entry.expires <= self._entries.now():
                self._forget(place)  # (as the map's get would: its expiry is the same)
                return None
            if not self._blobs[place][0] & _USED:  # (its place holds it while it is hot)
                self._entries.touch(place)  # marked used (``lru``: second chance), once a lap
            self._hot.move_to_end(key)
            return entry
        place = _place(key)
        blob = self._entries.peek(place)
        if blob is None:
            return None
        rest = _rest(key, place)
        if blob[1] != len(rest) or not blob.startswith(rest, packed.TAIL_AT):
            # Another key's, sharing this one's last 60 bits (``packed.has_tail``): a miss,
            # which marks nothing used (a model-based review: it gave that entry a second chance).
            return None
        self._entries.touch(place)
        entry = packed.unpack(blob)
        if self.hot:
            seen = self._seen
            if seen.pop(key, 0) is not None:  # (not seen lately: 0)
                seen[key] = None
                if len(seen) > self.hot:
                    seen.popitem(last=False)
            else:
                objects = _objects(key, place, entry)
                if self.bytes + objects <= self.max_bytes:  # room without evicting
                    self._keep(key, place, entry, objects)
        return entry

    def holds(self, key: str) -> bool:
        """Whether ``key`` has an entry here (expired or not), without reading it: it is not
        marked used, nor its objects kept."""
        if key in self._hot:
            return True
        place = _place(key)
        blob = self._blobs.get(place)
        # (Not another key's, sharing this one's last 60 bits.)
        return blob is not None and packed.has_tail(blob, _rest(key, place))

    async def forget(self, key: str) -> bool:
        """Drop ``key``'s entry (not another key's sharing its place); whether there was one."""
        if not self.holds(key):
            return False
        self._forget(_place(key))
        return True

    async def put(self, key: str, entry: Entry) -> None:
        place = _place(key)
        self._forget(place)
        # Already expired (an answer back-dated by its ``age``: never served), or larger than
        # the whole budget: not stored, but the step is taken all the same.
        if entry.expires > self._entries.now():
            blob = packed.pack(entry, _rest(key, place))
            if _size(place, blob) <= self.max_bytes:
                self._store(place, blob)
        self.reap()

    def _store(self, place: Place, blob: Packed) -> None:
        self._entries.put(place, blob)
        # Room is taken from the objects first, the least recently used first: which entries
        # keep objects must not change which entries are kept (an entry evicted for a copy of
        # another is a miss the budget could have served).
        while self._hot and self.bytes > self.max_bytes:
            self._let_go(next(iter(self._hot.values()))[0])
        while self.bytes > self.max_bytes:  # (the new entry, the most recent, fits: not it)
            if self._entries.evict() is None:
                break

    def reap(self) -> int:
        """Drop the expired entries among the next ``SWEEP_STEP``, if a step is due (one a
        ``SWEEP_EVERY`` seconds); how many."""
        return self._entries.reap(SWEEP_STEP, SWEEP_EVERY)

    async def invalidate(self, selector: Selector) -> int:
        picks = packed.matcher(selector)
        doomed = self._entries.remove_if(lambda _, blob: picks(blob))
        for place, _ in doomed:
            self._let_go(place)
        return len(doomed)

    def clear(self) -> None:
        self._entries.clear()
        self._hot.clear()
        self._hot_places.clear()
        self._hot_bytes = 0
        self._seen.clear()

    async def aclose(self) -> None:
        self.clear()

    def _keep(self, key: str, place: Place, entry: Entry, objects: int) -> None:
        """Keep ``entry``'s objects as the most recently used hot ones; the least recently
        used beyond ``hot`` let theirs go."""
        self._hot[key] = (place, entry, objects)
        self._hot_places[place] = key
        self._hot_bytes += objects
        # The frames its answer will synthesize for streaming hits live as long as its objects
        # here: counted when they are made, not on every hit (``_count_synthesized``).
        entry.answer.on_synthesized = partial(self._synthesized, key)
        if len(self._hot) > self.hot:
            self._let_go(next(iter(self._hot.values()))[0])

    def _count_synthesized(self, key: str, answer: Answer) -> None:
        """``answer`` (of ``key``'s hot entry, unless let go since) kept frames it synthesized:
        counted with its objects; the least recently used hot entries (this one last) let their
        objects go until the budget holds them."""
        hot = self._hot.get(key)
        if hot is None or hot[1].answer is not answer:
            return  # let go since (or another entry's objects now): not kept here
        place, entry, counted = hot
        objects = _objects(key, place, entry) + synthesized_held(answer)
        self._hot[key] = (place, entry, objects)
        self._hot.move_to_end(key)  # (made for a client of it now: the most recently used)
        self._hot_bytes += objects - counted
        while self._hot and self.bytes > self.max_bytes:
            self._let_go(next(iter(self._hot.values()))[0])

    def _let_go(self, place: Place) -> None:
        """Drop the objects of the entry at ``place``, if it keeps them."""
        key = self._hot_places.pop(place, None)
        if key is not None:
            self._hot_bytes -= self._hot.pop(key)[2]

    def _lost(self, place: Place, blob: Packed) -> None:
        """The map evicted or expired an entry: its objects go with it."""
        self._let_go(place)

    def _forget(self, place: Place) -> None:
        """Remove the entry at ``place``, if any (a put replaces it)."""
        self._entries.pop(place)
        self._let_go(place)
