"""The records in this process: ``MemoryIdempotencyRecords`` (the records' contract: ``records``).

One process only: a retry that reaches another instance is not protected (with ``redis``, the
shared records are, and these are their fallback: ``fallback``). Bounded: expired records are
swept lazily and *finished* ones (RELEASED ones too) are evicted beyond
``max_records``/``max_bytes``, the oldest first, but a tenant holding less than its share keeps its own while another holds more, so
that one tenant's flood of keys cannot evict another's records (``finished``; counted in
``evictions``, logged): a record being processed is never evicted
(its retry would run the generation again while it runs), and those are as many as the
requests in flight. Time is the ``clock``'s monotonic reading (``carpool.clock``: tests move
it).

``bytes`` (bounded by ``max_bytes``) counts what the finished and RELEASED records hold in this
process, as ``carpool.lru``'s budgets do (``held``, ``SLOT_BYTES``): each record's key (its
tenant, a key of up to 255 characters, a list item's index), fingerprint and token, its objects
and its place and node in ``finished``, and its stored response (body, headers: each pair's
tuple and bytes). Not counted: the records being processed (as many as the requests in flight,
never evicted), a tenant's own bookkeeping (~100 bytes a tenant holding records:
``finished``), an ``asyncio.Event`` a waiter made while the record ran. ``/stats`` and
``/metrics`` report it with ``kept`` and ``processing`` (``admin.gauges``).

A PROCESSING record's lease does not run out while the task that began it runs: in one process
an owner cannot die without its task ending, and a stream may outlive any fixed lease (its
upstream timeout bounds the gaps between chunks, not the whole). Once that task has ended
without a ``finish`` or an ``abandon`` (a bug), the lease counts from the ``begin`` (or the
last ``renew``) as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from ..clock import SYSTEM_CLOCK, Clock
from ..lru import SLOT_BYTES, held
from .finished import NODE_BYTES, Finished
from .records import PROCESSING_TTL, Begin, StoredResponse, _new_token, replayable

log = logging.getLogger("carpool.idempotency")

# Seconds between two warnings that finished records were evicted before their retention.
EVICTION_LOG_S = 60.0


@dataclass(slots=True, eq=False)
class _Record:
    fingerprint: str
    token: str
    expires: float  # monotonic: the lease, then the retention
    response: StoredResponse | None = None  # None while PROCESSING or RELEASED
    released: bool = False  # RELEASED: kept with its fingerprint, for its request to begin again
    changed: asyncio.Event | None = None  # created by the first waiter; set on any change
    owner: asyncio.Task[Any] | None = None  # the task that began it, while PROCESSING

    def wake(self) -> None:
        if self.changed is not None:
            self.changed.set()


class MemoryIdempotencyRecords:
    """The records in this process. ``retention``/``processing_ttl`` in seconds.

    Bounded: expired records are dropped when met and swept every ``sweep_interval`` seconds;
    beyond ``max_records`` finished records or ``max_bytes`` of what they hold (``_size``)
    finished ones are evicted, oldest first but fairly between tenants (``finished``; an evicted key is free
    again). Records being processed are kept
    apart (``_running``), never evicted. A response larger than ``max_bytes`` is not kept.
    """

    def __init__(
        self,
        retention: float,
        processing_ttl: float = PROCESSING_TTL,
        *,
        max_records: int = 100_000,
        max_bytes: int = 256 * 1024 * 1024,
        sweep_interval: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
        behind_redis: bool = False,
    ) -> None:
        if retention <= 0 or processing_ttl <= 0:
            raise ValueError("retention and processing_ttl must be positive")
        self.retention = retention
        self.processing_ttl = processing_ttl
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.sweep_interval = sweep_interval
        self._clock = clock
        # Each tenant's oldest first by finish (a look does not refresh: ``peek``); a record's
        # size is what it holds here (``_size``).
        self._records: Finished[_Record] = Finished(
            max_records=max_records,
            max_bytes=max_bytes,
            size=_size,
            expires=_expires,
            clock=clock,
            on_gone=_wake,
        )
        # The records being processed: apart, never evicted (as many as requests in flight).
        self._running: dict[str, _Record] = {}
        self._next_sweep = clock.monotonic() + sweep_interval
        self._evicted_logged_at = float("-inf")
        # Shared records' way down (``FallbackRecords``): an eviction here costs nothing while
        # Redis answers (it replays the retry), and is said so (``_evicted``).
        self.behind_redis = behind_redis
        self.waiters = 0  # tasks inside ``wait`` now

    def __len__(self) -> int:
        return len(self._records) + len(self._running)

    @property
    def kept(self) -> int:
        """The finished and RELEASED records held (expired ones until they are swept)."""
        return len(self._records)

    @property
    def processing(self) -> int:
        """The records being processed (as many as the keyed requests running here)."""
        return len(self._running)

    @property
    def bytes(self) -> int:
        return self._records.bytes

    @property
    def evictions(self) -> int:
        return self._records.evictions

    async def begin(self, key: str, fingerprint: str) -> Begin:
        now = self._clock.monotonic()
        self._sweep(now)
        found = self.look(key, fingerprint)
        if found is not None:
            return found
        # No record, or this request's RELEASED one: begun (again), apart with the running.
        self._records.pop(key)
        token = _new_token()
        owner = asyncio.current_task()
        self._running[key] = _Record(fingerprint, token, now + self.processing_ttl, owner=owner)
        return Begin("new", token)

    def look(self, key: str, fingerprint: str) -> Begin | None:
        """What ``begin`` would find for a request of ``fingerprint``, without beginning: None
        when there is no record, or a RELEASED one of this request (``begin`` begins it)."""
        record = self._found(key)
        if record is None:
            return None
        if record.fingerprint != fingerprint:
            return Begin("mismatch")
        if record.released:
            return None
        if record.response is None:
            return Begin("processing")
        return Begin("done", response=_copy(record.response))

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool:
        record = self._owned(key, token)
        if record is None:
            return False
        del self._running[key]  # among the finished, with its response's size, as the newest
        # (A copy, with the headers a record keeps: ``records``.)
        record.response = replace(response, headers=replayable(response.headers))
        record.owner = None
        record.expires = self._clock.monotonic() + self.retention
        record.wake()
        before = self._records.evictions
        kept = self._records.put(key, record)  # too large to keep: the key is free again
        if self._records.evictions > before:
            self._evicted()
        if not kept:
            # Said, or an operator would never learn why a retry ran again.
            log.warning(
                "a response of %d bytes (its record: %d) is larger than idempotency.max_bytes "
                "(%d): not kept, a retry with its key runs again",
                len(response.body),
                _size(key, record),
                self._records.max_bytes,
            )
        return kept

    async def abandon(self, key: str, token: str) -> bool:
        if self._owned(key, token) is None:
            return False
        self._drop(key)
        return True

    async def release(self, key: str, token: str) -> bool:
        record = self._owned(key, token)
        if record is None:
            return False
        del self._running[key]  # among the finished (its key and bookkeeping), as the newest
        record.released, record.owner = True, None
        record.expires = self._clock.monotonic() + self.retention
        record.wake()
        before = self._records.evictions
        self._records.put(key, record)
        if self._records.evictions > before:
            self._evicted()
        return True

    async def renew(self, key: str, token: str) -> bool:
        record = self._owned(key, token)
        if record is None:
            return False
        record.expires = self._clock.monotonic() + self.processing_ttl
        return True

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None:
        # The timeout is time spent waiting (the event loop's); leases are the clock's.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.waiters += 1
        try:
            while True:
                now = self._clock.monotonic()
                record = self._found(key)
                if record is None:
                    return None
                if record.fingerprint != fingerprint or record.released:
                    return None  # (RELEASED: not running; its request begins it again)
                if record.response is not None:
                    return _copy(record.response)
                left = deadline - loop.time()
                if left <= 0:
                    return None
                if record.changed is None:
                    record.changed = asyncio.Event()
                changed = record.changed
                # Wake at the latest when the lease runs out, to see the record gone.
                with contextlib.suppress(TimeoutError):
                    # (asyncio.timeout: wait_for on 3.11 loses a cancel that comes as it is set)
                    async with asyncio.timeout(max(0.0, min(left, _expires(record) - now)) + 0.001):
                        await changed.wait()
        finally:
            self.waiters -= 1

    async def aclose(self) -> None:
        for key in [*self._records, *self._running]:
            self._drop(key)

    # ------------------------------------------------------------------ internals

    def _found(self, key: str) -> _Record | None:
        """The record of ``key``, being processed or finished; a lease run out is none."""
        record = self._running.get(key)
        if record is None:
            return self._records.peek(key)
        if _expires(record) <= self._clock.monotonic():
            self._drop(key)
            return None
        return record

    def _owned(self, key: str, token: str) -> _Record | None:
        record = self._found(key)
        if (
            record is None
            or record.response is not None
            or record.released
            or record.token != token
        ):
            return None
        return record

    def _drop(self, key: str) -> None:
        record = self._running.pop(key, None) or self._records.pop(key)
        if record is not None:
            record.wake()

    def _evicted(self) -> None:
        """Finished records evicted before their retention: a retry of theirs runs again (a
        warning), or, ``behind_redis``, only while Redis fails (said at info)."""
        now = self._clock.monotonic()
        if now - self._evicted_logged_at >= EVICTION_LOG_S:
            self._evicted_logged_at = now
            if self.behind_redis:
                log.info(
                    "this instance's copies of idempotency records evicted before their "
                    "retention (%d so far): Redis keeps the records and replays their retries; "
                    "only while it fails does such a retry run again here",
                    self._records.evictions,
                )
                return
            log.warning(
                "idempotency records evicted before their retention (%d so far): a retry of "
                "theirs runs again; raise idempotency.max_records / max_bytes, or use redis",
                self._records.evictions,
            )

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_interval
        self._records.expire()
        for key in [key for key, record in self._running.items() if _expires(record) <= now]:
            self._drop(key)


def _size(key: str, record: _Record) -> int:
    """What a finished (or RELEASED) record holds in this process, so that ``max_bytes`` bounds
    the memory of the records, not only their answers' bytes (their keys run to 255 characters
    and more, and a list's items each have one: a small answer's record is mostly the rest):
    its place in the map, its node, its key, fingerprint and token, the record and its
    ``expires``, and its stored response with its headers (each pair a tuple of two bytes)."""
    counted = _RECORD_BYTES + held(key, record.fingerprint, record.token)
    response = record.response
    if response is not None:
        counted += _RESPONSE_BYTES + held(response.body, response.headers, response.created)
        for pair in response.headers:
            counted += held(pair, *pair)
    return counted


# What every finished record holds besides its strings and response (``_size``), measured once
# (tests/test_idempotency.py measures them again): its place in the map of ``Finished`` and its
# node there, the ``_Record`` and its ``expires`` (a float of its own).
_RECORD_BYTES = SLOT_BYTES + NODE_BYTES + held(_Record("", "", 0.0), 0.5)
# A stored response's object (its body, headers list and pairs are counted as they are).
_RESPONSE_BYTES = held(StoredResponse(200, [], b""))


def _expires(record: _Record) -> float:
    """The lease, then the retention (renewed in place); never while its owner runs still."""
    owner = record.owner
    if owner is not None and record.response is None and not owner.done():
        return math.inf
    return record.expires


def _wake(key: str, record: _Record) -> None:
    record.wake()  # evicted or expired: its waiters look again and find it gone


def _copy(response: StoredResponse) -> StoredResponse:
    return StoredResponse(
        response.status, list(response.headers), response.body, response.streamed, response.created
    )
