"""The finished records in this process, shared fairly between tenants: ``Finished``.

Contract:
- ``Finished(max_records=, max_bytes=, size=, expires=, clock=, on_gone=)`` holds finished
  records by key; a key's tenant is its requester's own: the part before its first newline
  and any ``:`` (``once.scope_of`` writes the requester's scope there, then a digest of its
  other credentials, which a client can change at will: a cookie).
- After every ``put``: ``len <= max_records`` and ``bytes <= max_bytes``. Beyond a bound, the
  oldest record of all goes, as in a plain LRU, unless its tenant holds less than its fair
  share of both bounds (fewer than ``max_records // tenants`` records and fewer than
  ``max_bytes / tenants`` bytes, ``tenants`` those holding records; the tenant that put the
  record judged without it): then the oldest record of the tenant holding the largest share
  goes (share: the larger of its records over ``max_records`` and its bytes over
  ``max_bytes``; of equal shares, the tenant that gained a record least recently), but never
  the record just put (a tenant's first, larger than the others': the oldest of the largest
  other tenant goes then, if over its share, else the oldest of all, as in a plain LRU). So
  one tenant finishing records faster than the others evicts its own, never a quiet tenant's
  (a retry of theirs would run its generation again); and many tenants of a record each (keys
  a client without ``auth.client_keys_file`` can make up) are each at their share, so no
  tenant is evicted sooner than a plain LRU would evict it. A record too large for
  ``max_bytes`` on its own is not kept. Evictions are counted in ``evictions``.
- Expiry as ``carpool.lru``'s: ``expires(record)`` on the clock's monotonic time; lazy
  (``peek`` drops what it finds expired), ``expire()`` drops all that have.
- O(1) but ``expire`` (a scan) and an eviction's choice of tenant (O(log tenants)).
- ``on_gone(key, record)`` hears of every record dropped on its own (evicted or expired), not
  of those the caller pops or replaces.
- ``by_count(max_records)``: one bounded in records only, none expiring, for what holds records
  of one size fairly between tenants (``routing.state``: which replica made each stored
  response; ``state_index``: the responses deleted lately).

Why lists threaded through the records rather than an ``LRU`` a tenant: with a tenant per
record (many clients, one key each) an ``LRU`` would add ~1.4 KB a record; a ``_Tenant`` adds
~100 bytes.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from ..clock import SYSTEM_CLOCK, Clock
from ..lru import held

V = TypeVar("V")


class _Node(Generic[V]):
    """A record in its tenant's list (``older``/``newer``) and in the list of all
    (``before``/``after``), oldest first in each."""

    __slots__ = ("key", "value", "older", "newer", "before", "after")

    def __init__(self, key: str, value: V) -> None:
        self.key = key
        self.value = value
        self.older: _Node[V] | None = None
        self.newer: _Node[V] | None = None
        self.before: _Node[V] | None = None
        self.after: _Node[V] | None = None


class _Tenant(Generic[V]):
    """A tenant's records: their list's ends, how many and their bytes, and when it last
    gained one (in the order of puts)."""

    __slots__ = ("oldest", "newest", "count", "bytes", "gained")

    def __init__(self) -> None:
        self.oldest: _Node[V] | None = None
        self.newest: _Node[V] | None = None
        self.count = 0
        self.bytes = 0
        self.gained = 0


class Finished(Generic[V]):
    """Finished records, in the order of their puts and a list a tenant, bounded together (the
    module doc)."""

    def __init__(
        self,
        *,
        max_records: int,
        max_bytes: int,
        size: Callable[[str, V], int],
        expires: Callable[[V], float],
        clock: Clock = SYSTEM_CLOCK,
        on_gone: Callable[[str, V], None] | None = None,
    ) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.evictions = 0
        self._size = size
        self._expires = expires
        self._clock = clock
        self._on_gone = on_gone
        self._nodes: dict[str, _Node[V]] = {}
        self._first: _Node[V] | None = None  # the oldest of all
        self._last: _Node[V] | None = None
        self._tenants: dict[str, _Tenant[V]] = {}
        self._puts = 0
        self._bytes = 0
        # The tenants by (share, largest first; last put, earliest first), lazily: an entry is
        # stale once its tenant's rank has changed (``_largest`` skips it); rebuilt when stale
        # ones outnumber the rest.
        self._heap: list[tuple[float, int, str]] = []

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._nodes))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.peek(key) is not None

    @property
    def bytes(self) -> int:
        return self._bytes

    def peek(self, key: str) -> V | None:
        node = self._nodes.get(key)
        if node is None:
            return None
        if self._expires(node.value) <= self._clock.monotonic():
            self._gone(node)
            return None
        return node.value

    def put(self, key: str, record: V) -> bool:
        """Keep ``record`` under ``key`` as the newest; False if it is too large to keep
        (whatever was under ``key`` is gone either way)."""
        self.pop(key)
        counted = self._size(key, record)
        if counted > self.max_bytes:
            return False
        name = _tenant(key)
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant()
        node = self._nodes[key] = _Node(key, record)
        node.older, node.before = tenant.newest, self._last
        if tenant.newest is None:
            tenant.oldest = node
        else:
            tenant.newest.newer = node
        tenant.newest = node
        if self._last is None:
            self._first = node
        else:
            self._last.after = node
        self._last = node
        tenant.count += 1
        tenant.bytes += counted
        self._bytes += counted
        self._puts += 1
        tenant.gained = self._puts
        self._ranked(name, tenant)
        while len(self._nodes) > self.max_records or self._bytes > self.max_bytes:
            self.evictions += 1
            self._gone(self._evicted(name))
        return key in self._nodes

    def pop(self, key: str) -> V | None:
        node = self._nodes.get(key)
        if node is None:
            return None
        self._unlink(node)
        return node.value

    def expire(self) -> None:
        now, expires = self._clock.monotonic(), self._expires
        for node in [node for node in self._nodes.values() if expires(node.value) <= now]:
            self._gone(node)

    # ------------------------------------------------------------------ internals

    def _evicted(self, putter: str) -> _Node[V]:
        """The record a bound evicts when ``putter`` put one: the oldest of all, unless its
        tenant held less than its share of both bounds (``max_records // tenants`` records,
        ``max_bytes / tenants`` bytes; the putter's judged without the record it put, which
        would otherwise make its own oldest fair game); then the oldest of the tenant holding
        the largest share."""
        oldest = self._first
        assert oldest is not None  # (over a bound: some record is held)
        name = _tenant(oldest.key)
        tenant = self._tenants[name]
        held, held_bytes = tenant.count, tenant.bytes
        if name == putter and tenant.newest is not None:
            held, held_bytes = (
                held - 1,
                held_bytes - self._size(tenant.newest.key, tenant.newest.value),
            )
        if self._under_share(held, held_bytes):
            largest = self._largest()
            if self._tenants[largest].oldest is self._last:
                # Never the record just put (the putter's only one, larger than the others'):
                # kept no longer than its put, its retry would run again. The largest of the
                # others then, if over its share; else the oldest of all, as a plain LRU.
                other = self._largest_but(largest)
                if other is None:
                    return oldest
                rival = self._tenants[other]
                if self._under_share(rival.count, rival.bytes):
                    return oldest
                largest = other
            if largest != name:
                oldest_of_largest = self._tenants[largest].oldest
                assert oldest_of_largest is not None  # (a tenant with no record is not held)
                return oldest_of_largest
        return oldest

    def _under_share(self, count: int, size: int) -> bool:
        """Whether a tenant holding ``count`` records of ``size`` bytes holds less than its
        share of both bounds."""
        tenants = len(self._tenants)
        return count < self.max_records // tenants and size * tenants < self.max_bytes

    def _gone(self, node: _Node[V]) -> None:
        """``node`` dropped on its own: evicted, or found expired."""
        self._unlink(node)
        if self._on_gone is not None:
            self._on_gone(node.key, node.value)

    def _unlink(self, node: _Node[V]) -> None:
        del self._nodes[node.key]
        name = _tenant(node.key)
        tenant = self._tenants[name]
        if node.older is None:
            tenant.oldest = node.newer
        else:
            node.older.newer = node.newer
        if node.newer is None:
            tenant.newest = node.older
        else:
            node.newer.older = node.older
        if node.before is None:
            self._first = node.after
        else:
            node.before.after = node.after
        if node.after is None:
            self._last = node.before
        else:
            node.after.before = node.before
        node.older = node.newer = node.before = node.after = None
        counted = self._size(node.key, node.value)
        tenant.count -= 1
        tenant.bytes -= counted
        self._bytes -= counted
        if tenant.count == 0:
            del self._tenants[name]
        else:
            self._ranked(name, tenant)

    def _rank(self, name: str, tenant: _Tenant[V]) -> tuple[float, int, str]:
        share = max(tenant.count / max(self.max_records, 1), tenant.bytes / max(self.max_bytes, 1))
        return (-share, tenant.gained, name)

    def _ranked(self, name: str, tenant: _Tenant[V]) -> None:
        heapq.heappush(self._heap, self._rank(name, tenant))
        if len(self._heap) > 2 * len(self._tenants) + 64:
            self._heap = [self._rank(n, t) for n, t in self._tenants.items()]
            heapq.heapify(self._heap)

    def _largest(self) -> str:
        name = self._largest_but(None)
        assert name is not None  # (over a bound: some tenant is held)
        return name

    def _largest_but(self, but: str | None) -> str | None:
        """The tenant holding the largest share but ``but`` (None when there is no other)."""
        heap = self._heap
        passed: list[tuple[float, int, str]] = []  # (``but``'s entry, put back)
        try:
            while heap:
                name = heap[0][2]
                tenant = self._tenants.get(name)
                if tenant is None or heap[0] != self._rank(name, tenant):
                    heapq.heappop(heap)  # (stale)
                elif name == but:
                    passed.append(heapq.heappop(heap))
                else:
                    return name
            return None
        finally:
            for entry in passed:
                heapq.heappush(heap, entry)


def by_count(max_records: int) -> Finished[V]:
    """Records bounded in number only (each counts 0 bytes against an unreachable byte bound),
    none expiring: the share of a tenant is its records'."""
    return Finished(max_records=max_records, max_bytes=sys.maxsize, size=_uncounted, expires=_never)


def _uncounted(key: str, record: object) -> int:
    return 0


def _never(record: object) -> float:
    return math.inf


#: What a record's node takes (a ``_Node``; its place in the map is ``lru.SLOT_BYTES``), for a
#: ``size`` that counts what a record holds.
NODE_BYTES = held(_Node("", None))


def _tenant(key: str) -> str:
    """A key's tenant: its requester's own (``Fingerprint.owner``), the part before the first
    newline and before any ``:`` (``once.scope_of`` adds there a digest of the other
    credentials a client presented, a cookie among them: one a request would make a new
    tenant of each request)."""
    return key.partition("\n")[0].partition(":")[0]
