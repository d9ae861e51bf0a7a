"""The shared store with a way down: Redis when it answers, this process's memory when it does not.

Contract (on top of ``store.base``):
- While Redis answers, every operation goes to Redis only (``store.redis``, a
  ``carpool.redis.store.RedisStore``): nothing is kept locally, so an invalidation by any
  instance reaches every instance.
- When a Redis call fails (``StoreUnavailable``), the store is *degraded*: the call is answered by
  the in-process ``MemoryStore`` instead (a get finds what this instance stored meanwhile; a put
  stores there), so no client request fails because Redis did. While degraded, Redis is tried
  again at most once per ``retry_interval`` (a request never waits on a dead Redis twice in a
  row), by ONE caller: the first that finds the attempt due takes it (the next one is due
  ``retry_interval`` later), the calls meanwhile stay local instead of all waiting on a Redis
  that may hang; the first success ends the degraded period and empties the local store, whose
  entries may have missed invalidations made elsewhere in the meantime. An instance with no
  call to make takes the attempt itself: while degraded, a background task PINGs Redis
  whenever the attempt is due and no caller took it (``ping``: one per ``retry_interval`` at
  most, started with the degraded period, ended by ``up`` or ``aclose``), so an idle instance
  is up within about ``retry_interval`` of Redis answering. (Before, only a call or the
  invalidation subscriber's reconnection ended a period: a failure that landed after a
  success, the subscriber connected throughout, left an idle instance degraded for good.) A
  PING that fails is no call of a layer's: neither counted nor logged.
- An invalidation of another instance received through Redis (``invalidated_elsewhere``, from
  ``redis.invalidation.InvalidationChannel``'s subscriber) empties the local store at once: a
  degraded instance no longer serves, until its next Redis call succeeds, answers another
  instance's invalidation dropped (the message names no selector: everything local goes). The
  message also proves that Redis answers, so it ends a degraded period due for another attempt
  (one not yet due goes on until ``retry_interval``: a Redis that delivers messages but fails
  calls does not switch the instance up and down with every message).
- Failures are counted, logged when a degraded period begins and then at most once per
  ``log_interval`` (a relapse just after the "back" line is logged: the log's last word is
  the state's), and reported by ``health()``
  for ``/stats`` and ``/healthz``: ``errors`` counts every layer's failed Redis calls (this
  store's and those the other layers ``report``), ``store_errors`` this store's own only (what
  ``/metrics`` labels ``component="store"``: each other layer counts its own). A call that
  waited ``pool_timeout`` for a free connection (``PoolExhausted``: Redis answers, this
  instance is overloaded) is counted apart (``pool_exhausted``), starts no degraded period and
  does not use the local store (a get is a miss, a put is not kept: nothing would ever clear it
  of later invalidations). A connection Redis refused past its ``maxclients`` (``MaxClients``,
  a ``PoolExhausted``: Redis answers, it serves as many clients as it may) is the same, counted
  as ``max_clients`` (before, it began a degraded period: a burst that met it switched sharing
  off, and a keyed request ran from this process's records). A write a full Redis refused (``RedisFull``: ``maxmemory`` reached
  under ``noeviction``) is the same: Redis answers, the answer is not kept anywhere (counted as
  ``full``, logged), no degraded period. A command a Redis Cluster refused while its slot was
  being migrated (``SlotMoving``: a reshard between its steps) is the same again: Redis
  answers and ran nothing; a get is a miss, a put is not kept, counted as ``slot_moving``,
  logged, no degraded period (a reshard's minutes of them made an instance flap degraded).
  A command on a key of another type than carpool writes there (``WrongType``: something else
  wrote it) that a layer did not handle as a value it cannot read is the same once more:
  counted as ``wrong_type``, logged, no degraded period, nothing kept locally (before, it
  switched sharing off for every key).
- ``generation()`` before a call begins and ``put(..., since=...)`` with its answer: an
  invalidation by any instance in between takes the answer back from Redis
  (``RedisStore.put``).
- ``entries``/``bytes`` are Redis's counts of the whole shared cache (``RedisStore``) while
  Redis is up, the local store's while degraded. ``fresh_counts()``, awaited by the reports
  before they read them, has Redis's read again when older than its ``stats_interval``, never
  while degraded (the figures are then the local store's, which ``reap`` keeps live); a read
  that fails leaves the last ones and is neither counted nor reported (a report does not make
  the instance degraded). ``refresh_soon()`` starts such a read in the background (at start).
- Other layers that use the same Redis (flights, invalidations, semantic entries, idempotency
  records) share this state: they ``report()`` each Redis call's failure or success, and ask
  ``usable()`` before one (not the idempotency records: ``redis.idempotency`` says why). A
  True from ``usable()`` while degraded is the attempt (it is taken): ask it only to make the
  call; ``retry_due`` and ``degraded`` are questions only.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

from ..background import Background
from ..redis.connection import MaxClients, PoolExhausted, RedisFull, SlotMoving, WrongType
from ..redis.store import RedisStore
from .base import Entry, Selector, StoreUnavailable
from .memory import MemoryStore

log = logging.getLogger("carpool.store")


# The failures of calls Redis answered all the same (the module's contract): the count each
# goes to, and what the log says of it.
_ANSWERED: dict[type[StoreUnavailable], tuple[str, str]] = {
    # Redis refused a connection: it serves its maxclients already. (Before PoolExhausted,
    # which it is a kind of: the first that matches counts it.)
    MaxClients: (
        "max_clients",
        "redis refused a connection, it serves as many clients as it may (maxclients): %d "
        "calls refused so far, those ran without sharing; raise its maxclients or lower "
        "distributed.max_connections",
    ),
    # This instance had more callers than connections for pool_timeout.
    PoolExhausted: (
        "pool_exhausted",
        "every connection to redis stayed busy (%d times so far): raise "
        "distributed.max_connections or pool_timeout",
    ),
    # Redis takes no more answers until something expires or is dropped.
    RedisFull: (
        "full",
        "redis is full (maxmemory, noeviction): %d writes refused so far, those answers are "
        "not shared; raise maxmemory or lower the TTLs",
    ),
    # A reshard is moving the call's slot (the node ran nothing).
    SlotMoving: (
        "slot_moving",
        "a redis cluster slot is being migrated: %d calls refused so far (TRYAGAIN), those "
        "ran without sharing",
    ),
    # A key held another type than carpool writes there: something else wrote it.
    WrongType: (
        "wrong_type",
        "a redis key of carpool's holds another type (something else wrote it): %d calls "
        "refused so far (WRONGTYPE), those ran without sharing",
    ),
}


class SharedStore:
    def __init__(
        self,
        redis: RedisStore,
        local: MemoryStore,
        *,
        retry_interval: float = 1.0,
        log_interval: float = 30.0,
    ) -> None:
        self.redis = redis
        self.local = local
        self.retry_interval = retry_interval
        self.log_interval = log_interval
        self.errors = 0  # failed Redis calls, every layer's (the module's contract)
        self.store_errors = 0  # this store's own among them
        self.pool_exhausted = 0  # calls that found no free connection in time
        self.max_clients = 0  # calls whose connection Redis refused (its maxclients reached)
        self.full = 0  # writes a full Redis refused (maxmemory reached, noeviction)
        self.slot_moving = 0  # calls a Redis Cluster refused as their slot was migrating
        self.wrong_type = 0  # calls on a key of another type (something else wrote it)
        self._logged_at: dict[str, float] = {}  # (of each count in ``_ANSWERED``)
        self.down_since: float | None = None  # wall clock, for /stats
        self._next_try = 0.0  # monotonic
        self._last_log = float("-inf")
        self._probe = Background("the redis probe", log)  # (logs a task that failed)
        self._probing: asyncio.Task[None] | None = None  # while degraded, or ending
        self._closed = False

    @property
    def degraded(self) -> bool:
        return self.down_since is not None

    @property
    def entries(self) -> int:
        return self.local.entries if self.degraded else self.redis.entries

    @property
    def bytes(self) -> int:
        return self.local.bytes if self.degraded else self.redis.bytes

    def reap(self) -> int:
        """The local store's expired entries (what it holds since Redis went down)."""
        return self.local.reap()

    async def fresh_counts(self) -> None:
        """``entries``/``bytes`` brought up to date for a report (the module's contract)."""
        if not self.degraded:
            await self.redis.fresh_stats()

    def refresh_soon(self) -> None:
        """Redis's counts read again in the background (at start), unless degraded."""
        if not self.degraded:
            self.redis.refresh_soon()

    def health(self) -> dict[str, Any]:
        return {
            "state": "degraded" if self.degraded else "up",
            "errors": self.errors,
            "pool_exhausted": self.pool_exhausted,
            "max_clients": self.max_clients,
            "full": self.full,
            "slot_moving": self.slot_moving,
            "wrong_type": self.wrong_type,
            "down_since": self.down_since,
        }

    @property
    def retry_due(self) -> bool:
        """Whether Redis is up, or degraded and due for another attempt (a question only:
        ``usable`` is the attempt)."""
        return not self.degraded or time.monotonic() >= self._next_try

    def usable(self) -> bool:
        """Whether Redis should be tried now (up, or degraded and due for another attempt,
        which this caller then takes: see the module's contract)."""
        return not self._skip_redis()

    def report(self, error: StoreUnavailable | None) -> None:
        """Another layer's Redis call failed with ``error``, or (None) succeeded."""
        if error is None:
            self._answered()
        else:
            self._failed(error, own=False)  # (that layer counts it as its own)

    def invalidated_elsewhere(self) -> int:
        """Another instance's invalidation reached this one through Redis (the module's
        contract): the local store emptied; how many entries it held."""
        dropped = self.local.entries
        self.local.clear()
        if self.retry_due:
            self._answered()
        return dropped

    async def get(self, key: str, kind: str | None = None) -> Entry | None:
        if self._skip_redis():
            return self.local.get_now(key)
        try:
            entry = await self.redis.get(key, kind)
        except (PoolExhausted, SlotMoving, WrongType) as error:
            # Not an outage: the local store is not in use (nothing there is kept up to date
            # with invalidations), so this lookup is a miss.
            self._failed(error)
            return None
        except StoreUnavailable as error:
            self._failed(error)
            return self.local.get_now(key)
        self._answered()
        return entry

    async def generation(self) -> int:
        """Redis's count of invalidations (``RedisStore.generation``), read before a call
        begins, for ``put``'s ``since``; -1 when Redis is not to be tried or fails (a put
        with it takes its entry back from Redis: nothing says no invalidation came)."""
        if self._skip_redis():
            return -1
        try:
            generation = await self.redis.generation()
        except StoreUnavailable as error:
            self._failed(error)
            return -1
        self._answered()
        return generation

    async def put(self, key: str, entry: Entry) -> None:
        await self.keep(key, entry)

    async def keep(self, key: str, entry: Entry, *, since: int | None = None) -> bool:
        """``put``; False when an invalidation took ``entry`` back as outdated, so that no
        other layer keeps it either. ``since``: see ``RedisStore.put`` (an answer an
        invalidation may have outdated is taken back from Redis; one stored here while degraded
        is dropped when Redis is back)."""
        if not self._skip_redis():
            try:
                kept = await self.redis.put(key, entry, since=since)
            except (PoolExhausted, RedisFull, SlotMoving, WrongType) as error:
                self._failed(error)
                return True  # (not kept locally: see ``get``; but not outdated)
            except StoreUnavailable as error:
                self._failed(error)
            else:
                self._answered()
                return kept
        await self.local.put(key, entry)
        return True

    async def forget(self, key: str) -> bool:
        """``key``'s entry dropped here and in Redis (a failure there is reported, not raised:
        its entry may stay until its TTL); whether one was."""
        dropped = await self.local.forget(key)
        try:
            dropped = await self.redis.forget(key) or dropped
        except StoreUnavailable as error:
            self._failed(error)
        else:
            self._answered()
        return dropped

    async def invalidate(self, selector: Selector) -> int:
        """Here, then in Redis; one that did not reach Redis raises ``StoreUnavailable`` once
        done here (the answers there stay: the caller must say so, not report success)."""
        dropped = await self.local.invalidate(selector)
        try:
            dropped += await self.redis.invalidate(selector)
        except StoreUnavailable as error:
            self._failed(error)
            raise
        self._answered()
        return dropped

    async def aclose(self) -> None:
        self._closed = True
        await self._probe.drain(0)
        await self.redis.aclose()
        await self.local.aclose()

    def _skip_redis(self) -> bool:
        if not self.degraded:
            return False
        now = time.monotonic()
        if now < self._next_try:
            return True
        self._next_try = now + self.retry_interval  # this caller's attempt; the others wait
        return False

    def _failed(self, error: StoreUnavailable, *, own: bool = True) -> None:
        now = time.monotonic()
        for kind, (counted, said) in _ANSWERED.items():
            if isinstance(error, kind):
                # Redis answered: that call runs without it, but sharing is not switched off
                # for the others (no degraded period). Counted apart, logged now and then.
                count = getattr(self, counted) + 1
                setattr(self, counted, count)
                if now - self._logged_at.get(counted, float("-inf")) >= self.log_interval:
                    self._logged_at[counted] = now
                    log.warning(said, count)
                return
        self.errors += 1
        if own:
            self.store_errors += 1
        self._next_try = now + self.retry_interval
        begins = self.down_since is None
        if begins:
            self.down_since = time.time()
            self._probe_while_degraded()
        # A period's start is always logged: the line before it said "redis is back" (or none
        # did), and concurrent calls can land fail, answer, fail within milliseconds.
        if begins or now - self._last_log >= self.log_interval:
            self._last_log = now
            log.warning(
                "redis unavailable, serving from this instance's memory (%d errors so far): %s",
                self.errors,
                error.__cause__ or error,
            )

    def _answered(self) -> None:
        if self.down_since is not None:
            log.warning(
                "redis is back after %.1f s; dropping %d entries kept locally meanwhile",
                time.time() - self.down_since,
                self.local.entries,
            )
            self.down_since = None
            self.local.clear()

    def _probe_while_degraded(self) -> None:
        """Start the probe (the module's contract), unless one runs: it goes on through a
        relapse that came before it saw the instance up."""
        if self._closed or (self._probing is not None and not self._probing.done()):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a caller outside any loop: the next call will try Redis again
            return
        # In a blank context: the probe serves no request, and its "back" line must not name
        # the one whose failure began the period.
        self._probing = contextvars.Context().run(self._probe.spawn, self._ping_until_up())

    async def _ping_until_up(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._next_try - time.monotonic()))
            if not self.degraded or self._closed:
                return
            if self._skip_redis():
                continue  # a call took the attempt: the next one is due later
            try:
                await self.redis.ping()
            except StoreUnavailable:
                continue  # still down, as known: not a layer's failed call
            self._answered()
