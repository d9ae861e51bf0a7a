"""The in-process exact cache: LRU with per-entry TTL, bounded in bytes.

Contract (on top of ``store.base``):
- Total ``bytes`` never exceeds ``max_bytes`` after a ``put``: least recently used entries are
  evicted first; an entry larger than the whole budget is not stored at all.
- A ``get`` hit makes the entry most recently used; an expired entry found by ``get`` is dropped.
- Every operation is O(1) except ``invalidate``, which scans (it is an admin action).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from .base import Entry, selected


class MemoryStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self.evictions = 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    async def get(self, key: str) -> Entry | None:
        return self.get_now(key)

    def get_now(self, key: str) -> Entry | None:
        """``get`` without a coroutine, for the hot path."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= time.time():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry

    async def put(self, key: str, entry: Entry) -> None:
        size = entry.size
        if size > self.max_bytes:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = entry
        self._bytes += size
        while self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1

    async def invalidate(
        self,
        *,
        tag: str | None = None,
        namespace: str | None = None,
        prefix: str | None = None,
        everything: bool = False,
    ) -> int:
        doomed = [
            key
            for key, entry in self._entries.items()
            if selected(entry, tag=tag, namespace=namespace, prefix=prefix, everything=everything)
        ]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    async def aclose(self) -> None:
        self.clear()
