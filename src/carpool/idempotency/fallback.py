"""Shared records with a way down: ``FallbackRecords`` (Redis, else this process's records).

The one health of an instance (``store.shared.SharedStore``), as every Redis-backed layer: the
shared records (``carpool.redis.idempotency``) report every call's failure or success to it
(``/stats``, ``/healthz``, the log, the degraded period), but call Redis for every ``begin`` and
``wait`` even while it says Redis is down (a record there must not be taken for absent because
another layer's call failed; a hung Redis then costs each keyed request one timeout). Here:

- ``StoreUnavailable`` (this call to Redis failed): the record lives in this process's records
  instead, so that no request fails because Redis did (but see ``FallbackRecords``: a key this
  instance began or finished in Redis is not run again here).
- ``PoolExhausted`` (a subclass: Redis answers, every pooled connection stayed busy for
  ``pool_timeout``, or Redis refused a new one past its ``maxclients``, ``MaxClients``; counted
  as ``pool_exhausted`` or ``max_clients`` and logged by the health, never a degraded
  period): never this process's records, which would let the key run here while it runs, or
  has run, on another instance. ``begin``/``wait`` raise ``IdempotencyUnavailable`` (503 with
  ``Retry-After``: the request is not run; its retry with the same key is safe); a ``finish``
  that meets it returns False, as after any failed finish (a copy kept here: ``finish``).
- A ``finish`` in Redis that failed (but for a refusal: a full Redis) goes on in the background
  there, the record's lease renewed (``carpool.redis.idempotency``): once Redis takes it, a retry
  on any instance is replayed. Only if the lease runs out first may a retry on another instance
  run the key again, once.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from ..redis.connection import PoolExhausted
from ..store.base import StoreUnavailable
from .errors import IdempotencyUnavailable
from .memory import MemoryIdempotencyRecords
from .records import Begin, IdempotencyRecords, StoredResponse


@dataclass(slots=True)
class _Open:
    """A record this instance began in Redis and has not settled: its owner token, its
    request's fingerprint, and ``settled``, set once it is (finished, abandoned, released)."""

    token: str
    fingerprint: str
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class FallbackRecords:
    """Shared records that fall back to this process's records while the shared backend is down.

    A record begun locally (Redis unreachable) is finished, abandoned and renewed locally: its
    owner token says where it lives. A record begun in Redis is settled in Redis even while the
    health says Redis is down (one call, bounded by ``distributed.timeout``): skipping it would
    leave the key held until its lease ran out, then free to run again although it had an
    answer. While Redis cannot be read, a retry reaching this instance is answered from what
    this instance knows: its records begun in Redis and still open are ``processing``, those it
    finished there are replayed (a copy is kept here), others run here; retries on other
    instances then are not protected (stated in docs/idempotency.md).

    A key that has a record here (begun here while Redis could not be read, or a copy of one
    this instance finished, or tried to finish, in Redis) is answered from it first, whatever
    Redis says: Redis back, it has no record of a key run here meanwhile, and a key whose
    finish there failed is free there should its lease run out before the finish, tried again
    in the background, lands. So is a key this instance began in Redis and still runs: a
    Redis pause past the lease lapses its record there while its owner lives.

    While Redis cannot be read, a retry that waits (``wait``) for a record this instance began
    there and has not settled waits for it to be settled here (then finds the copy kept here,
    or nothing): ``begin`` says ``processing`` for it, and a ``wait`` that answered None at
    once would send a waiting retry round ``begin`` and ``wait`` without a pause.
    """

    def __init__(self, shared: IdempotencyRecords, local: MemoryIdempotencyRecords) -> None:
        self.shared = shared
        self.local = local
        self._local_tokens: set[str] = set()
        # This instance's records begun in Redis and not settled yet: key -> its token,
        # fingerprint and settling. While Redis cannot be read, a retry of one of them here is answered
        # ``processing`` (or ``mismatch``), not run again from this process's records.
        self._open_in_shared: dict[str, _Open] = {}

    async def begin(self, key: str, fingerprint: str) -> Begin:
        known = self.local.look(key, fingerprint)
        if known is not None:
            return known
        opened = self._open_in_shared.get(key)
        if opened is not None:
            # This instance's own run, whatever Redis says: down, or up again after a pause
            # that outlasted the lease, its record there lapsed (the owner's renewals failed,
            # the owner alive), where a ``new`` would run the key a second time here.
            return Begin("processing" if opened.fingerprint == fingerprint else "mismatch")
        try:
            begin = await self.shared.begin(key, fingerprint)
        except PoolExhausted as exhausted:
            raise IdempotencyUnavailable() from exhausted
        except StoreUnavailable:
            begin = await self.local.begin(key, fingerprint)
            if begin.token is not None:
                self._local_tokens.add(begin.token)
            return begin
        if begin.token is not None:
            self._open_in_shared[key] = _Open(begin.token, fingerprint)
        return begin

    def _owner(self, token: str) -> IdempotencyRecords:
        return self.local if token in self._local_tokens else self.shared

    def _settled(self, key: str, token: str) -> _Open | None:
        self._local_tokens.discard(token)
        opened = self._open_in_shared.get(key)
        if opened is not None and opened.token == token:
            del self._open_in_shared[key]
            opened.settled.set()
            return opened
        return None

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool:
        owner = self._owner(token)
        try:
            finished = await owner.finish(key, token, response)
        except StoreUnavailable:
            finished = False
        opened = self._settled(key, token)
        if opened is not None:
            # Kept here too, and looked up first (``begin``): a retry that reaches this instance
            # is replayed, not run again, while Redis cannot be read and after; also when this
            # finish could not reach it (it is tried again there in the background while the
            # record's lease holds; should the lease run out first, a retry on another instance
            # runs again then), and when Redis refused it (the record lapsed in a pause past
            # the lease, or full).
            local = await self.local.begin(key, opened.fingerprint)
            if local.token is not None:
                await self.local.finish(key, local.token, response)
        return finished

    async def abandon(self, key: str, token: str) -> bool:
        try:
            return await self._owner(token).abandon(key, token)
        except StoreUnavailable:
            return False
        finally:
            self._settled(key, token)

    async def release(self, key: str, token: str) -> bool:
        try:
            return await self._owner(token).release(key, token)
        except StoreUnavailable:
            return False  # (its lease there runs out: the key is free again, as if abandoned)
        finally:
            self._settled(key, token)

    async def renew(self, key: str, token: str) -> bool:
        try:
            return await self._owner(token).renew(key, token)
        except StoreUnavailable:
            return False

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None:
        if self.local.look(key, fingerprint) is not None:  # (answered from here: ``begin``)
            return await self.local.wait(key, fingerprint, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        fell = False
        try:
            answer = await self.shared.wait(key, fingerprint, timeout)
        except PoolExhausted as exhausted:
            raise IdempotencyUnavailable() from exhausted
        except StoreUnavailable:
            answer, fell = None, True
        if answer is not None:
            return answer
        opened = self._open_in_shared.get(key)
        if opened is not None and opened.fingerprint == fingerprint:
            # This instance's own run, begun in Redis: waited for here (the class doc), Redis
            # down or its record there lapsed (``begin`` says ``processing`` for it: a wait
            # that answered None at once would send a retry round ``begin`` and ``wait``
            # without a pause); then only what is kept here: its answer, or nothing.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await opened.settled.wait()
            fell = False
        # (Also a run of this instance's that settled as Redis's wait ended: its copy here.)
        left = max(0.0, deadline - loop.time()) if fell else 0.0
        return await self.local.wait(key, fingerprint, left)

    async def aclose(self) -> None:
        await self.shared.aclose()
        await self.local.aclose()
