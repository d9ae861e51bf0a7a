"""The shared exact cache: every gateway instance reads and writes one Redis/Valkey.

Contract (on top of ``store.base``):
- What one instance puts, every instance gets; an invalidation by any instance reaches all of them
  (the entries, and the indexes that find them, live in Redis only: nothing is cached locally).
- An entry lives in Redis exactly as long as its TTL (``PX`` = the time left until
  ``entry.expires``); an entry already expired is not stored (a put of one drops the key's entry,
  as a replace followed by expiry would). ``get`` also checks ``expires``, so clock rounding never
  serves an expired answer.
- What is shared runs on Redis's clock (``TIME`` in the scripts), never an instance's: their
  wall clocks may be minutes apart (separate machines). A put sends durations (its TTL, its
  answer's age, read on the gateway's ``clock``); Redis stamps the entry's expiry and when its
  answer was made, the indexes' scores and the counts' live entries, and reaps them, on its
  own clock. ``get`` reads Redis's now with the entry (one round trip) and returns the entry
  with ``expires`` and ``created`` on this instance's clock, as far ahead and ago of its now as
  they are of Redis's: every age the gateway judges (``Age``, ``max-age``, its own TTL) is Redis
  time, whoever wrote the entry. (On a Redis Cluster a script reads its node's clock: the
  nodes' must agree; an index keeps its members ``INDEX_SLACK_MS`` past their entries.)
- Every Redis or network failure, and any answer slower than ``socket_timeout``, raises
  ``StoreUnavailable`` (the client library's error is its ``__cause__``). Nothing hangs: a refused
  connection is retried once at once (a pooled connection may be stale after a Redis restart),
  a timeout never is, so a dead Redis fails a call in milliseconds and a hung one in
  ``socket_timeout`` (connect: ``connect_timeout``).
- A full Redis (``maxmemory`` reached under ``noeviction``) takes no entry: ``put`` raises
  ``RedisFull`` (a ``StoreUnavailable``) and leaves nothing of it (an entry written as Redis
  filled up, its count refused, is dropped again); gets and invalidations work as ever.
- A value under an entry's key that carpool cannot read as an entry (something else wrote it:
  ``store_layout.Unreadable``, or a key of another type, ``WRONGTYPE``; a body of another
  length than its header says, an answer of another API than ``get``'s ``kind``, all checked
  without parsing the body) is a miss, never an error: Redis answered (no ``StoreUnavailable``, no degraded period). It is logged and dropped
  (unless an entry was put there since), so it costs one miss, not one per request until it
  expires; an invalidation that meets one drops it too. An index that is not carpool's (a
  member that names no entry: taken out of it; a key of another type: dropped, and every entry
  checked instead) never fails an invalidation nor leaves an answer it names.
- ``entries``/``bytes`` are the whole shared cache (all instances), as counted in Redis: an
  ``INCRBY``/``DECRBY`` byte counter and a set of live entries, kept by one Lua script that also
  reaps what expired. The properties are sync, so they return the last value this instance saw:
  refreshed by every put and invalidation, by ``refresh_stats()``, and, when older than
  ``stats_interval``, by ``fresh_stats()`` (awaited: the reports, ``/stats`` and ``/metrics``,
  read them through it) and in the background by gets and ``refresh_soon()`` (at start). One
  read at a time, shared by all of them; one that fails leaves the last value (never raised
  from ``fresh_stats``), and is tried again an interval later. So an idle instance's reports
  count what other instances stored, and what expired since, within ``stats_interval``. They
  are approximate: a put racing an invalidation of the same key on another instance may be
  counted until its TTL ends. ``bytes`` is ``Entry.size`` summed, as for the memory store, not
  Redis's own memory use.
- ``invalidate`` returns how many live entries it dropped. Tag and namespace invalidation read an
  index of candidates and drop each candidate only if its entry, checked atomically in Redis,
  still carries the tag/namespace (a replaced entry is never dropped for its old tags). Prefix
  invalidation scans the prompt-prefix index (an admin action, O(entries)). ``everything`` SCANs
  for the entries and UNLINKs each key whose whole name is one of this store's entries, and the
  counts (never FLUSHDB: other data may share the database; a key the SCAN pattern matches may
  be another deployment's, whose prefix begins with this one's, or another app's: left as it
  is); the indexes stay, supersets that expire with their members, so that a put racing it
  never leaves an entry out of its index.
- An invalidation that answered drops every answer of a call that began before it, on every
  instance, even one whose put was on its way meanwhile: each invalidation first INCRs a
  generation in Redis; ``put(..., since=generation())`` (the generation read before the call
  began) reads it again once the entry is in, and takes the entry back if it moved. (Should
  Redis fail on that read, the put raises ``StoreUnavailable`` and the entry may stay until
  its TTL.) A generation made anew (Redis restarted empty) starts at a random value, so no
  value read before the restart comes back after it (``since`` never matches again).

The key layout, an entry's encoding and the Lua scripts are :mod:`.store_layout`'s; the key IDs,
digests and SCAN escaping that the Redis layers share are :mod:`.keys` (``glob_escape`` and
``xread_entries`` are re-exported here).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

from ..clock import SYSTEM_CLOCK, Clock
from ..store.base import Entry, Selector
from .connection import (
    ConnectOptions,
    RedisFull,
    StoreUnavailable,
    WrongType,
    byte_client,
    close_client,
    connect,
    read_topology,
    stop_reader,
    unavailable_in,
)
from .keys import ENTRY_ID, check_prefix, digest, glob_escape, key_id, xread_entries
from .store_layout import (
    COUNT,
    DROP,
    GET,
    INDEX,
    INDEX_SLACK_MS,
    PUT,
    RECOUNT,
    STATS,
    STATS_ADD,
    UNREADABLE,
    StoreKeys,
    Unreadable,
    decode,
    encode,
)

if TYPE_CHECKING:
    import redis.asyncio as aredis

__all__ = ["RedisStore", "StoreUnavailable", "glob_escape", "xread_entries"]

log = logging.getLogger("carpool.store")

# (An entry's key, its ID) pairs: named out here, as ``RedisStore.bytes`` hides the type inside.
EntryKeys = AsyncIterator[tuple[bytes, bytes]]

STATS_INTERVAL = 1.0  # s between two reads of ``entries``/``bytes`` by reports and gets
BATCH = 500  # keys per SCAN page / per pipelined round trip in invalidations

_unavailable = unavailable_in("the Redis store")

Header = bytes | None  # (an entry's ``m`` as read; named here: ``bytes`` is a property below)


class RedisStore:
    """The exact cache in Redis/Valkey at ``url`` (``redis://``, ``rediss://``, ``unix://``).

    ``client``: an existing ``redis.asyncio`` client to use instead (then ``url`` is only a
    label, the timeouts and retries are the client's, and ``aclose`` leaves it open); it must
    not decode responses. Otherwise the client is :func:`.connection.connect`'s, with its
    ``options`` (``ConnectOptions``: timeouts, retries, pool, cluster); ``stats_interval`` (s).
    ``clock``: the gateway's, whose ``now()`` its entries' ``expires`` and answers' ``created``
    are read on (in Redis they are Redis time: the module's contract).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "carpool:",
        client: aredis.Redis | None = None,
        stats_interval: float = STATS_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
        **options: Unpack[ConnectOptions],
    ) -> None:
        check_prefix(prefix)
        self.url = url
        self.prefix = prefix
        self.stats_interval = stats_interval
        self._clock = clock
        self._owns_client = client is None
        self._client = byte_client(client if client is not None else connect(url, **options))
        self._keys = StoreKeys(prefix)
        self._entries = 0
        self._bytes = 0
        self._stats_at = float("-inf")  # (monotonic) never read yet: the first report reads them
        self._refreshing: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<RedisStore {self.url} prefix={self.prefix!r}>"

    @property
    def client(self) -> aredis.Redis:
        """The ``redis.asyncio`` client, for other layers sharing this Redis (do not close it)."""
        return self._client

    @staticmethod
    def key_id(key: str) -> str:
        """The ``ID`` of ``key`` in Redis key names: its hash tag (see the key layout)."""
        return key_id(key)

    # ------------------------------------------------------------------ the Store interface

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def bytes(self) -> int:
        return self._bytes

    async def get(self, key: str, kind: str | None = None) -> Entry | None:
        """``key``'s entry; ``kind``: the API of the request whose key it is (``Store.get``)."""
        entry_id = key_id(key)
        try:
            with _unavailable("get"):
                # (Redis's now comes with the fields, in the one round trip: ``decode``.)
                read: list[Any] = await self._client.eval(GET, 1, self._keys.entry(entry_id))
        except WrongType as error:
            await self._unreadable(entry_id, None, str(error.__cause__))
            return None
        self.refresh_soon()
        try:
            return decode(read, self._clock.now(), kind)
        except Unreadable as error:
            await self._unreadable(entry_id, read[1], str(error))
            return None

    async def generation(self) -> int:
        """The count of invalidations Redis has seen, from every instance (from a random
        start; 0 before any): read before a call begins, and given to ``put`` as ``since``
        with its answer."""
        with _unavailable("read the invalidation generation"):
            value = await self._client.get(self._keys.generation)
        try:
            return int(value or 0)
        except ValueError:
            # No count (written by something else): made anew from a random start, as after
            # Redis restarted empty (a put whose ``since`` predates it is taken back), not a
            # ValueError on every miss until someone deletes it.
            log.warning("the invalidation generation in Redis was no count: made anew")
            start = secrets.randbits(62) + 1
            with _unavailable("make the invalidation generation anew"):
                value = await self._client.eval(RECOUNT, 1, self._keys.generation, start)
            return int(value)

    async def put(self, key: str, entry: Entry, *, since: int | None = None) -> bool:
        """Store ``entry``; whether it stays. ``since``: the ``generation()`` read before the
        call that made it began; an invalidation since then (read once the entry is in) takes
        it back, as it may predate what was dropped."""
        entry_id, now = key_id(key), self._clock.now()
        # Sent as durations, stamped in Redis time by the scripts: this instance's clock may be
        # minutes off the others' (the module's contract).
        ttl_ms = math.ceil((entry.expires - now) * 1000)
        if ttl_ms <= 0:
            with _unavailable("put"):
                await self._drop([entry_id])
            return False
        age_ms = max(0, int((now - entry.answer.created) * 1000))
        fields = encode(entry)
        indexes = [(self._keys.tag(tag), entry_id) for tag in dict.fromkeys(entry.tags)]
        indexes += [
            (self._keys.namespace(entry.namespace), entry_id),
            (self._keys.prefixes, f"{entry_id}\n{entry.prompt_prefix}"),
        ]
        with _unavailable("put"):
            # The indexes first, then the entry: an index is never missing a live entry. Two
            # round trips, because a Cluster pipeline does not keep order across slots.
            pipe = self._client.pipeline(transaction=False)
            for index, member in indexes:
                pipe.eval(INDEX, 1, index, member, ttl_ms + INDEX_SLACK_MS)
            await pipe.execute()
        pipe = self._client.pipeline(transaction=False)
        pipe.eval(PUT, 1, self._keys.entry(entry_id), ttl_ms, age_ms, *fields)
        pipe.eval(STATS_ADD, 3, *self._keys.stats, "add", entry_id, ttl_ms, entry.size)
        try:
            with _unavailable("put"):
                expires, counts = await pipe.execute()
        except RedisFull:
            # Redis filled up between the two scripts (or before both): nothing of this put
            # stays, neither an entry no count has nor a count whose entry was refused.
            with _unavailable("put"):
                await self._drop([entry_id])
                await self._client.eval(STATS, 3, *self._keys.stats, "del", entry_id)
            raise
        self._counted(counts)
        if since is None:
            return True
        with _unavailable("put"):
            # A third round trip (a Cluster pipeline keeps no order across slots): an
            # invalidation counted before this read drops the entry itself (it is in, with its
            # indexes); one counted after ``since`` was read and before now may have missed it.
            if await self.generation() == since:
                return True
            await self._drop([entry_id], "x", expires.decode())
        return False

    async def forget(self, key: str) -> bool:
        """Drop ``key``'s entry; whether there was one."""
        with _unavailable("forget an entry"):
            return await self._drop([self.key_id(key)]) == 1

    async def invalidate(self, selector: Selector) -> int:
        with _unavailable("invalidate"):
            # Counted before anything is dropped: a put whose call began before this (its
            # answer may predate what goes) reads the count again once its entry is in.
            start = secrets.randbits(62) + 1  # (a counter made anew: see ``COUNT``)
            await self._client.eval(COUNT, 1, self._keys.generation, start)
            if selector.everything:
                return await self._drop_everything()
            dropped = 0
            if (tag := selector.tag) is not None:
                dropped += await self._drop_indexed(self._keys.tag(tag), "t", digest(tag))
            if (namespace := selector.namespace) is not None:
                dropped += await self._drop_indexed(
                    self._keys.namespace(namespace), "n", digest(namespace)
                )
            if selector.prefix is not None:
                dropped += await self._drop_indexed(self._keys.prefixes, "p", selector.prefix)
            return dropped

    async def ping(self) -> None:
        """Whether Redis answers (on a cluster, every node): returns once it has, raises
        ``StoreUnavailable`` otherwise (a degraded instance's probe, ``store.shared``)."""
        with _unavailable("ping"):
            await self._client.ping()

    def reap(self) -> int:
        """Nothing: Redis expires entries itself, and the counts' script reaps them."""
        return 0

    async def fresh_stats(self) -> None:
        """``entries``/``bytes`` read again from Redis if older than ``stats_interval`` (the
        reports'), the read awaited; bounded by the client's timeouts, and a failure leaves the
        last values (the module's contract)."""
        refreshing = self.refresh_soon()
        if refreshing is not None:
            # Shielded: a report whose client left does not cancel the read others wait on.
            await asyncio.shield(refreshing)

    def refresh_soon(self) -> asyncio.Task[None] | None:
        """Read ``entries``/``bytes`` again in the background if they are older than
        ``stats_interval``: the read (or the one already under way), None when they are fresh."""
        if self._refreshing is not None:
            return self._refreshing
        if time.monotonic() - self._stats_at < self.stats_interval:
            return None
        self._stats_at = time.monotonic()  # one attempt per interval, even a failed one
        self._refreshing = asyncio.get_running_loop().create_task(self._refresh_quietly())
        return self._refreshing

    async def refresh_stats(self) -> None:
        """Read ``entries``/``bytes`` from Redis now (reaping what expired)."""
        with _unavailable("stats"):
            counts = await self._client.eval(STATS, 3, *self._keys.stats, "read")
        self._counted(counts)

    async def aclose(self) -> None:
        refreshing, self._refreshing = self._refreshing, None
        await stop_reader(refreshing)
        if self._owns_client:
            await close_client(self._client)

    # ------------------------------------------------------------------ internals

    async def _drop_indexed(self, index: str, mode: str, value: str) -> int:
        """Drop the candidates of one index that still match, checked entry by entry. What
        something else wrote there is never a 500 and never leaves a named answer served: a
        member that names no entry is taken out; an index that is no sorted set is dropped,
        and every entry checked instead."""
        kind = await self._client.type(index)
        if kind not in (b"zset", b"none"):
            log.warning(
                "dropping %s, no index (something else wrote it): every entry checked", index
            )
            await self._client.unlink(index)
            return await self._drop_candidates(None, mode, value)
        return await self._drop_candidates(index, mode, value)

    async def _drop_candidates(self, index: str | None, mode: str, value: str) -> int:
        """The candidates: the members of ``index`` ("ID\\nprompt prefix"), or every entry
        (``None``); ``DROP`` checks each entry itself, the index only narrows the search."""
        wanted = value.encode("utf-8", "surrogatepass") if mode == "p" and index else b""
        seen: set[bytes] = set()
        batch: list[str] = []
        dropped = 0
        if index is None:
            await read_topology(self._client)
        members = (
            self._client.zscan_iter(index, count=BATCH)
            if index is not None
            else ((entry_id, 0) async for _, entry_id in self._entry_keys())
        )
        async for member, _ in members:
            entry_id, _, prompt_prefix = member.partition(b"\n")
            # (An expired candidate's ``DROP`` finds it so by Redis's clock: not counted.)
            if entry_id in seen or not prompt_prefix.startswith(wanted):
                continue
            seen.add(entry_id)
            if not ENTRY_ID.fullmatch(entry_id):
                if index is not None:
                    log.warning("dropping a member of %s that names no entry", index)
                    await self._client.zrem(index, member)
                continue
            batch.append(entry_id.decode())
            if len(batch) >= BATCH:
                dropped += await self._drop(batch, mode, value)
                batch = []
        if batch:
            dropped += await self._drop(batch, mode, value)
        return dropped

    async def _drop(self, ids: list[str], mode: str = "p", value: str = "") -> int:
        """Drop the entries among ``ids`` that match (mode ``p`` with ``""`` matches all)."""
        pipe = self._client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.eval(DROP, 1, self._keys.entry(entry_id), mode, value)
        results = await pipe.execute()
        gone = [entry_id for entry_id, hit in zip(ids, results, strict=True) if hit]
        if gone:
            self._counted(await self._client.eval(STATS, 3, *self._keys.stats, "del", *gone))
        return len(gone)

    async def _entry_keys(self) -> EntryKeys:
        """Every entry's key and ID, on every master: only the keys whose whole name is an
        entry's (the SCAN pattern matches others: the module's contract)."""
        async for key in self._client.scan_iter(match=self._keys.entries, count=BATCH):
            entry_id = self._keys.entry_id(key)
            if entry_id is not None:
                yield key, entry_id

    async def _drop_everything(self) -> int:
        dropped = 0
        batch: list[bytes] = []

        async def unlink() -> int:
            pipe = self._client.pipeline(transaction=False)
            for key in batch:
                pipe.execute_command("UNLINK", key)  # (a cluster pipeline's unlink is not queued)
            return sum(await pipe.execute())

        # Only this store's own keys, by their whole names: other layers (idempotency records,
        # flights) share the prefix, and dropping cached answers must never forget that a
        # request already ran; nor may it drop what another deployment, whose prefix begins
        # with this one's, or another app keeps under it.
        await read_topology(self._client)
        async for key, _ in self._entry_keys():
            batch.append(key)
            if len(batch) >= BATCH:
                dropped += await unlink()
                batch = []
        if batch:
            dropped += await unlink()
        # The counts, by their names (one slot): no entry they counted is left.
        await self._client.unlink(*self._keys.stats)
        self._counted([0, 0])
        return dropped

    async def _unreadable(self, entry_id: str, header: Header, why: str) -> None:
        """Drop the value under ``entry_id``'s key that is no entry (the module's contract),
        unless an entry was put there since it was read (its header is no longer ``header``)."""
        log.warning(
            "dropping a value in Redis that is no cache entry, under e:{%s}: %s", entry_id, why
        )
        with _unavailable("drop a value that is no entry"):
            if not await self._client.eval(
                UNREADABLE, 1, self._keys.entry(entry_id), header or b""
            ):
                return
            counts = await self._client.eval(STATS, 3, *self._keys.stats, "del", entry_id)
        self._counted(counts)

    def _counted(self, counts: list[Any]) -> None:
        self._entries, self._bytes = int(counts[0]), int(counts[1])
        self._stats_at = time.monotonic()

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh_stats()
        except StoreUnavailable:
            pass  # the counts stay as last seen; the next report or get tries again
        finally:
            self._refreshing = None
