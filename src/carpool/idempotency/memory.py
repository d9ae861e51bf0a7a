"""The records in this process: ``MemoryIdempotencyRecords`` (the records' contract: ``records``).

One process only: a retry that reaches another instance is not protected (with ``redis``, the
shared records are, and these are their fallback: ``fallback``). Bounded: expired records are
swept lazily and the oldest are evicted beyond ``max_records``/``max_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from .records import PROCESSING_TTL, Begin, StoredResponse, _new_token


@dataclass(slots=True, eq=False)
class _Record:
    fingerprint: str
    token: str
    expires: float  # monotonic: the lease, then the retention
    response: StoredResponse | None = None  # None while PROCESSING
    changed: asyncio.Event | None = None  # created by the first waiter; set on any change
    size: int = 0

    def wake(self) -> None:
        if self.changed is not None:
            self.changed.set()


class MemoryIdempotencyRecords:
    """The records in this process. ``retention``/``processing_ttl`` in seconds.

    Bounded: expired records are dropped when met and swept every ``sweep_interval`` seconds;
    beyond ``max_records`` records or ``max_bytes`` of stored responses the oldest records (by
    creation or finish) are evicted, finished or not (an evicted key is free again, and its
    owner's ``finish`` is refused). A response larger than ``max_bytes`` is not kept.
    """

    def __init__(
        self,
        retention: float,
        processing_ttl: float = PROCESSING_TTL,
        *,
        max_records: int = 100_000,
        max_bytes: int = 256 * 1024 * 1024,
        sweep_interval: float = 30.0,
    ) -> None:
        if retention <= 0 or processing_ttl <= 0:
            raise ValueError("retention and processing_ttl must be positive")
        self.retention = retention
        self.processing_ttl = processing_ttl
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.sweep_interval = sweep_interval
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._bytes = 0
        self._next_sweep = time.monotonic() + sweep_interval
        self.waiters = 0  # tasks inside ``wait`` now
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        return self._bytes

    async def begin(self, key: str, fingerprint: str) -> Begin:
        now = time.monotonic()
        self._sweep(now)
        record = self._live(key, now)
        if record is None:
            token = _new_token()
            self._records[key] = _Record(fingerprint, token, now + self.processing_ttl)
            self._bound()
            return Begin("new", token)
        if record.fingerprint != fingerprint:
            return Begin("mismatch")
        if record.response is None:
            return Begin("processing")
        return Begin("done", response=_copy(record.response))

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool:
        now = time.monotonic()
        record = self._owned(key, token, now)
        if record is None:
            return False
        if response.size > self.max_bytes:  # too large to keep: the key is free again
            self._drop(key)
            return False
        record.response = _copy(response)
        record.size = response.size
        record.expires = now + self.retention
        self._bytes += record.size
        self._records.move_to_end(key)
        record.wake()
        self._bound()
        return key in self._records

    async def abandon(self, key: str, token: str) -> bool:
        if self._owned(key, token, time.monotonic()) is None:
            return False
        self._drop(key)
        return True

    async def renew(self, key: str, token: str) -> bool:
        now = time.monotonic()
        record = self._owned(key, token, now)
        if record is None:
            return False
        record.expires = now + self.processing_ttl
        return True

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None:
        deadline = time.monotonic() + timeout
        self.waiters += 1
        try:
            while True:
                now = time.monotonic()
                record = self._live(key, now)
                if record is None:
                    return None
                if record.fingerprint != fingerprint:
                    return None
                if record.response is not None:
                    return _copy(record.response)
                left = deadline - now
                if left <= 0:
                    return None
                if record.changed is None:
                    record.changed = asyncio.Event()
                changed = record.changed
                # Wake at the latest when the lease runs out, to see the record gone.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        changed.wait(), max(0.0, min(left, record.expires - now)) + 0.001
                    )
        finally:
            self.waiters -= 1

    async def aclose(self) -> None:
        for key in list(self._records):
            self._drop(key)

    # ------------------------------------------------------------------ internals

    def _live(self, key: str, now: float) -> _Record | None:
        record = self._records.get(key)
        if record is not None and record.expires <= now:
            self._drop(key)
            return None
        return record

    def _owned(self, key: str, token: str, now: float) -> _Record | None:
        record = self._live(key, now)
        if record is None or record.response is not None or record.token != token:
            return None
        return record

    def _drop(self, key: str) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self._bytes -= record.size
            record.wake()

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_interval
        for key in [k for k, r in self._records.items() if r.expires <= now]:
            self._drop(key)

    def _bound(self) -> None:
        """Evict the oldest records while over a bound (expired ones went at the last sweep)."""
        while self._records and (
            len(self._records) > self.max_records or self._bytes > self.max_bytes
        ):
            self._drop(next(iter(self._records)))
            self.evictions += 1


def _copy(response: StoredResponse) -> StoredResponse:
    return StoredResponse(response.status, list(response.headers), response.body, response.streamed)
