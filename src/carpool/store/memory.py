"""The in-process exact cache: LRU with per-entry TTL, bounded in bytes (on ``carpool.lru``).

Contract (on top of ``store.base``):
- Total ``bytes`` never exceeds ``max_bytes`` after a ``put``: least recently used entries are
  evicted first (counted in ``evictions``); an entry larger than the whole budget is not stored
  at all (and, as any put, replaces what its key held).
- ``bytes`` counts what the entries hold in this process (``size_of``: the key, ``Entry.held``,
  the map's slot), so that ``max_bytes`` bounds the memory the cache takes, not only its
  payload.
- A ``get`` hit makes the entry most recently used; an expired entry found by ``get`` is dropped.
  Expiry reads ``clock.now()`` (wall-clock, as ``Entry.expires``): the system's by default.
- Every operation is O(1) except ``invalidate``, which scans (it is an admin action); it counts
  only live entries, and drops the expired ones it meets.
"""

from __future__ import annotations

from ..clock import SYSTEM_CLOCK, Clock
from ..lru import LRU, SLOT_BYTES, held
from .base import Entry, Selector


def size_of(key: str, entry: Entry) -> int:
    """What one entry counts against ``max_bytes``: its key, its objects and its slot."""
    return SLOT_BYTES + held(key) + entry.held


def _expires(entry: Entry) -> float:
    return entry.expires


class MemoryStore:
    def __init__(self, max_bytes: int, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.max_bytes = max_bytes
        self._entries: LRU[str, Entry] = LRU(
            max_bytes=max_bytes, size=size_of, expires=_expires, clock=clock, wall_clock=True
        )

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._entries.bytes

    @property
    def evictions(self) -> int:
        """Entries evicted to keep the budget (not the expired or invalidated ones)."""
        return self._entries.evictions

    async def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def get_now(self, key: str) -> Entry | None:
        """``get`` without a coroutine, for the hot path."""
        return self._entries.get(key)

    async def put(self, key: str, entry: Entry) -> None:
        self._entries.put(key, entry)

    async def invalidate(self, selector: Selector) -> int:
        doomed = self._entries.remove_if(lambda _, entry: selector.picks(entry))
        return len(doomed)

    def clear(self) -> None:
        self._entries.clear()

    async def aclose(self) -> None:
        self.clear()
