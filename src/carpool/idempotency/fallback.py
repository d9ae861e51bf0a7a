"""Shared records with a way down: ``FallbackRecords`` (Redis, else this process's records).

The same way down as every Redis-backed layer (``store.shared.SharedStore``, the one health of
an instance): the shared records (``carpool.redis.idempotency``) ask that health before a
``begin`` or ``wait`` and raise ``StoreUnavailable`` without calling Redis while it says Redis
is down (a hung Redis costs one timeout per ``distributed.retry_interval``, not one per keyed
request), and report every call's failure or success to it (``/stats``, ``/healthz``, the log,
the degraded period). Here:

- ``StoreUnavailable`` (Redis down, or skipped while degraded): the record lives in this
  process's records instead, so that no request fails because Redis did.
- ``PoolExhausted`` (a subclass: Redis answers, every pooled connection stayed busy for
  ``pool_timeout``; counted as ``pool_exhausted`` and logged by the health, never a degraded
  period): never this process's records, which would let the key run here while it runs, or
  has run, on another instance. ``begin``/``wait`` raise ``IdempotencyUnavailable`` (503 with
  ``Retry-After``: the request is not run; its retry with the same key is safe); a ``finish``
  that meets it returns False (the answer is not kept: the record's lease runs out and a retry
  runs again, as after any failed finish).
"""

from __future__ import annotations

from ..redis.connection import PoolExhausted
from ..store.base import StoreUnavailable
from .errors import IdempotencyUnavailable
from .memory import MemoryIdempotencyRecords
from .records import Begin, IdempotencyRecords, StoredResponse


class FallbackRecords:
    """Shared records that fall back to this process's records while the shared backend is down.

    A record begun locally (Redis unreachable) is finished, abandoned and renewed locally: its
    owner token says where it lives. A record begun in Redis is settled in Redis even while the
    health says Redis is down (one call, bounded by ``distributed.timeout``): skipping it would
    leave the key held until its lease ran out, then free to run again although it had an
    answer. Retries that reach the same instance stay protected while Redis is down; retries on
    other instances then are not (stated in docs/idempotency.md).
    """

    def __init__(self, shared: IdempotencyRecords, local: MemoryIdempotencyRecords) -> None:
        self.shared = shared
        self.local = local
        self._local_tokens: set[str] = set()

    async def begin(self, key: str, fingerprint: str) -> Begin:
        try:
            return await self.shared.begin(key, fingerprint)
        except PoolExhausted as exhausted:
            raise IdempotencyUnavailable() from exhausted
        except StoreUnavailable:
            begin = await self.local.begin(key, fingerprint)
            if begin.token is not None:
                self._local_tokens.add(begin.token)
            return begin

    def _owner(self, token: str) -> IdempotencyRecords:
        return self.local if token in self._local_tokens else self.shared

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool:
        try:
            return await self._owner(token).finish(key, token, response)
        except StoreUnavailable:
            return False
        finally:
            self._local_tokens.discard(token)

    async def abandon(self, key: str, token: str) -> bool:
        try:
            return await self._owner(token).abandon(key, token)
        except StoreUnavailable:
            return False
        finally:
            self._local_tokens.discard(token)

    async def renew(self, key: str, token: str) -> bool:
        try:
            return await self._owner(token).renew(key, token)
        except StoreUnavailable:
            return False

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None:
        try:
            return await self.shared.wait(key, fingerprint, timeout)
        except PoolExhausted as exhausted:
            raise IdempotencyUnavailable() from exhausted
        except StoreUnavailable:
            return await self.local.wait(key, fingerprint, timeout)

    async def aclose(self) -> None:
        await self.shared.aclose()
        await self.local.aclose()
