"""Shared records with a way down: ``FallbackRecords`` (Redis, else this process's records).

A Redis failure raises ``StoreUnavailable`` in ``carpool.redis.idempotency``; here it sends the
record to the in-process records instead, so that no request fails because Redis did.
"""

from __future__ import annotations

from ..store.base import StoreUnavailable
from .memory import MemoryIdempotencyRecords
from .records import Begin, IdempotencyRecords, StoredResponse


class FallbackRecords:
    """Shared records that fall back to this process's records while the shared backend is down.

    A record begun locally (Redis unreachable) is finished, abandoned and renewed locally: its
    owner token says where it lives. Retries that reach the same instance stay protected while
    Redis is down; retries on other instances then are not (stated in the README).
    """

    def __init__(self, shared: IdempotencyRecords, local: MemoryIdempotencyRecords) -> None:
        self.shared = shared
        self.local = local
        self._local_tokens: set[str] = set()

    async def begin(self, key: str, fingerprint: str) -> Begin:
        try:
            return await self.shared.begin(key, fingerprint)
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
        except StoreUnavailable:
            return await self.local.wait(key, fingerprint, timeout)

    async def aclose(self) -> None:
        await self.shared.aclose()
        await self.local.aclose()
