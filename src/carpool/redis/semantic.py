"""Semantic entries shared by every gateway instance, through a Redis/Valkey stream.

Each instance keeps its own ANN index (``SemanticCache``); ``SharedSemanticCache`` feeds it with
what the other instances store, so that an answer stored via one instance is a semantic candidate
on all of them (typically within a few milliseconds; the goal is 1 s).

Contract:
- ``insert(..., key=FINGERPRINT_KEY)`` stores the entry locally (with its answer) and returns,
  then appends a ``put`` record to the stream ``P semantic`` (``P`` = ``distributed.key_prefix``;
  ``XADD MAXLEN ~ distributed.stream_maxlen``) in a task of its own, which ``aclose`` lets
  finish: the caller (the flight, before it ends) never waits for Redis. An insert without
  ``key``, or whose texts (prompt and context) are over ``MAX_RECORD_TEXT`` bytes, stays
  local: every instance reads every record, and the stream is bounded in records only.
- A reader task per instance (started by ``start()``, from the server's startup or lazily by the
  first ``probe``/``insert``/``invalidate``, inside the event loop; stopped by ``aclose``, which
  then closes the embedder as ``SemanticCache.aclose`` does) reads
  the stream from its first record at start (those already there: an instance started or
  restarted later serves the fleet's entries too), then with ``XREAD BLOCK`` of at most half
  the client's socket timeout, and applies the records of the OTHER instances (its own carry
  its instance id and are skipped). Records go only from the stream's start (MAXLEN), so what
  is left of it, read in order, holds every ``invalidate`` that came after each ``put`` it holds:
  - ``put``: the entry goes into the local index as a *reference* to the exact cache (the
    answer itself never travels on the stream). When a probe's candidate passes every check,
    its answer is fetched with ``resolve(key)`` (``Gateway.store.get``, the exact store shared
    by all instances): a miss there means the answer is gone (expired, invalidated anywhere):
    the entry is dropped and the next candidate is tried. Records already expired, or of another
    embedding model or dimension, are ignored. A record's times are Redis's, not its writer's
    (the instances' wall clocks may be minutes apart, as the shared store's contract says): it
    carries its entry's TTL and its answer's age when it was added (``xd``, ``cd``, ms), and
    the reader counts them from the record's id (the Redis time it was added at) to Redis's
    now, read with the stream's head in the round trip after each read (``HEAD``), then puts
    them on its own clock. (A record of an older carpool has its writer's clock only.)
  - ``invalidate``: ``invalidate(tag|namespace|prefix|everything)`` of the local index, so that
    the entries each instance holds *with their answer* go too (remote ones would die at
    resolution anyway, since the exact store is shared and invalidated everywhere). It moves
    the cache's ``generation`` (as every ``invalidate`` does): an entry whose call began before
    it is not inserted (``Leader._insert_semantic``), though its answer was kept in Redis before
    the invalidation and the pub/sub message that moves the flights' epoch has not come. A
    prefix is remembered as a local one is (``SemanticCache``: no entry made before it, dated
    as a ``put``'s answer is, when it was added, on the reader's clock, is served to a prompt
    that starts with it): the entries of another prompt, which it drops nowhere, are not
    served to those prompts either. (Dated when read, an instance started later took every
    entry it read for older than the stream's prefix invalidations, and served none.)
- ``invalidate`` applies locally and publishes an ``invalidate`` record; one that Redis did not
  take (it failed, or the health says it is not to be tried) raises ``StoreUnavailable`` once
  applied locally: the other instances keep their entries (those held with their answers are
  served), so the admin endpoint must not report success (``admin.invalidate``: a 503). A full
  Redis (``maxmemory``, ``noeviction``) takes ``invalidate`` records still (a script that may
  run then: ``ALWAYS_APPEND``), not ``put`` records (``RedisFull``: counted by the health, the
  instance not degraded; the entry stays local).
- An instance with ``redis`` but without a semantic cache (a fleet mid-change: the cache turned
  on, or off, one instance at a time) publishes the same ``invalidate`` records, with no
  embedder (``SemanticInvalidations``, from ``admin.invalidate``; failing as above): the entries
  the others hold with their answers go wherever the invalidation was sent. (Before, such an
  instance wrote none, and the others served them as semantic hits until their TTL.)
- Redis never fails a request: a failed publish is counted (``errors``) and reported to the
  shared store's health (``SharedStore.report``: /stats, /healthz, degraded mode, the log); while
  that health says Redis is not to be tried, nothing is published (local-only behaviour). The
  reader backs off on failures (``BACKOFF_MIN`` doubling up to ``retry_interval``) and resumes
  from the stream's end again after one: records published while it was cut off are not replayed
  (the stream may have been trimmed past them, or Redis be new). An ``invalidate`` among them
  would never reach the entries this instance holds with their answers, so once it has resumed
  after a failure it forgets every entry (``forgotten``), as the invalidation channel forgets
  its flights when it subscribes again: misses, never an answer invalidated meanwhile. While it
  is cut off the instance serves what it holds, like the exact cache in degraded mode.
- Records it never read may also leave the stream while the reader is connected: trimmed by the
  others' ``XADD MAXLEN ~`` while it stalled (a GC or VM pause) or lagged by about
  ``stream_maxlen`` records, or the stream evicted (an ``allkeys-*`` policy) or deleted. XREAD
  says nothing of them, so after each XREAD (records or none) the reader reads where the stream
  stands (``HEAD``: a script; a few bytes back): no stream, or its first record past the id it
  read from (records go only from the start), and it forgets every entry too (``lost``, then
  ``forgotten``), before it applies what it read. A reader about ``stream_maxlen`` behind may
  forget with nothing lost: misses.
  ``ready`` is set each time the reader has positioned itself (tests wait on it).

Record layout (one stream entry, all values bytes):

    P semantic          STREAM, MAXLEN ~ distributed.stream_maxlen
      op   "put" | "invalidate"
      src  the publishing instance's id (16 hex, random per process)
    put:
      s    the scope (``SemanticView.scope``, a digest: tenant, namespace, freshness, params...)
      t    the compared text (``SemanticView.text``)
      ctx  a conversation's earlier turns (``SemanticView.context``; absent: none)
      v    the embedding: ``dim`` float32 values, little-endian (4 * dim bytes)
      e    the embedder's name (model); with the dimension, must match the reader's
      k    the exact-cache key of the answer (the fingerprint; resolved by ``store.get``)
      xd   its TTL when added, ms (counted in Redis time from the record's id)
      cd   its answer's age when added, ms (likewise; for max_age)
      x    expiry, the writer's wall-clock seconds (decimal; read only without xd)
      c    when the answer was created, the writer's wall-clock seconds (without cd)
      g    the tags, a JSON list of strings
      n    the namespace
      u    the scope's tenant (``Fingerprint.tenant``: a digest, ``*`` in a shared namespace),
           whose error budget a report of the entry counts in (``semantic/audit.py``)
      p    the prompt prefix (for prefix invalidation)
    invalidate:
      sel  "tag" | "namespace" | "prefix" | "all"
      val  the tag, namespace or prefix ("" for all)

The stream is one key (one Redis Cluster slot): every instance reads it; the load is one XADD
per stored answer, which is the rate of upstream calls, and per instance an XREAD and a ``HEAD``
script per batch of records read (or per ``BLOCK`` of half the socket timeout, idle).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from ..answer import Answer
from ..clock import SYSTEM_CLOCK, Clock
from ..config import SemanticConfig
from ..fingerprint import SemanticView
from ..semantic.cache import SemanticCache, SemanticEntry
from ..semantic.guard import Guard
from ..store.base import Selector
from .connection import (
    ALWAYS,
    REDIS_NOW,
    Background,
    Backoff,
    Health,
    StoreUnavailable,
    close_client,
    counted_apart,
    stop_reader,
    unavailable_in,
)
from .keys import xread_entries

if TYPE_CHECKING:
    import redis.asyncio as aredis

log = logging.getLogger("carpool.semantic")

# Bytes (UTF-8) of prompt and context a shared record may carry (``_inserted``).
MAX_RECORD_TEXT = 32_768
# Records per read: each page is parsed whole on the loop (redis-py's parser), 32 of ~2 KB at a
# time (256 held the loop for ~175 ms while a start read the stream).
READ_COUNT = 32

_SELECTORS = {"tag": "tag", "namespace": "namespace", "prefix": "prefix", "all": "everything"}

_unavailable = unavailable_in("the shared semantic cache")


# KEYS: the stream. ARGV: MAXLEN, then the record's field, value pairs. For ``invalidate``
# records, which a full Redis must take too: the other instances must drop their entries.
ALWAYS_APPEND = (
    ALWAYS
    + """
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 2))
return 1
"""
)


# KEYS: the stream. Where it stands, read after each XREAD (``_read``): {} when there is none,
# else {its first record's id ("": none), the last id it gave, its length, the records ever
# added, Redis's now in ms (what the records' ages count to: ``_times``)}. Read-only (a full
# Redis runs it too); XINFO's records stay in Redis.
HEAD = (
    ALWAYS
    + REDIS_NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local info, stream = redis.call('XINFO', 'STREAM', KEYS[1]), {}
for i = 1, #info, 2 do stream[info[i]] = info[i + 1] end
local first = stream['first-entry']
return {
  first and first[1] or '', stream['last-generated-id'], stream['length'],
  stream['entries-added'] or 0, at
}
"""
)


class SharedSemanticCache(SemanticCache):
    """A ``SemanticCache`` fed by, and feeding, every instance through the stream ``P semantic``.

    ``client``: a ``redis.asyncio`` client that does not decode responses (the shared store's);
    ``socket_timeout`` (s): the client's, which bounds the XREAD block; ``retry_interval``: the
    reader's longest backoff; ``health``: the shared store; ``owns_client``: ``aclose`` closes it.
    """

    def __init__(
        self,
        config: SemanticConfig,
        embedder: Any,
        guard: Guard,
        resolve: Callable[[str], Awaitable[Answer | None]] | None,
        client: aredis.Redis,
        *,
        prefix: str = "carpool:",
        maxlen: int = 10_000,
        socket_timeout: float = 0.5,
        retry_interval: float = 1.0,
        health: Health | None = None,
        owns_client: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(config, embedder, guard, resolve, clock=clock)
        self.stream = prefix + "semantic"
        self.instance = secrets.token_hex(8).encode()
        self.maxlen = maxlen
        self.block_ms = max(1, int(socket_timeout * 1000 / 2))
        self.retry_interval = retry_interval
        self.health = health
        self.ready = asyncio.Event()
        self.counts = dict.fromkeys(
            (
                "published",
                "received",
                "invalidations_received",
                "ignored",
                "errors",
                "forgotten",
                "lost",
                "local_only",
            ),
            0,
        )
        self._client = client
        self._owns_client = owns_client
        self._reader: asyncio.Task[None] | None = None
        self._publishing = Background("publishing a semantic entry", log)
        self._closed = False

    def __repr__(self) -> str:
        return f"<SharedSemanticCache stream={self.stream!r} instance={self.instance.decode()}>"

    # ------------------------------------------------------------------ the cache's interface

    async def probe(
        self,
        view: SemanticView,
        max_age: float | None = None,
        prompt_prefix: Callable[[], str] | None = None,
        *,
        key: str | None = None,
    ) -> Any:
        self.start()
        return await super().probe(view, max_age, prompt_prefix, key=key)

    def _inserted(self, entry: SemanticEntry, vector: Any, key: str | None) -> None:
        self.start()
        if key is None:  # (an entry from another instance, or one without an answer's key)
            return
        text, context = entry.text.encode(), entry.context.encode()
        if len(text) + len(context) > MAX_RECORD_TEXT:
            # (A long conversation's record copied it whole: ~100 KB a record, over a GB at
            # the stream's length, read by every instance. Such an entry is this one's only.
            # Bytes, as the record carries them: 4-byte characters made it 4x the bound.)
            self.counts["local_only"] += 1
            return
        import numpy as np

        now = self._clock.now()
        # In this instance's index already (the caller waits for that: read-your-writes); the
        # others get it from the stream, published off the caller's path. Its view is the
        # focused one (``focus`` is idempotent: the receiver files it under the same scope).
        self._publishing.spawn(
            self._publish(
                {
                    b"op": b"put",
                    b"src": self.instance,
                    b"s": entry.scope.encode(),
                    b"t": text,
                    b"ctx": context,
                    b"v": np.asarray(vector, dtype="<f4").reshape(-1).tobytes(),
                    b"e": str(getattr(self.embedder, "name", "")).encode(),
                    b"k": key.encode(),
                    b"x": repr(float(entry.expires)).encode(),  # (for an older reader)
                    b"c": repr(float(entry.created)).encode(),
                    # Its TTL and age now, ms: the reader counts them in Redis time from the
                    # record's id (the module's contract), whatever this clock says.
                    b"xd": b"%d" % int((entry.expires - now) * 1000),
                    b"cd": b"%d" % max(0, int((now - entry.created) * 1000)),
                    b"g": orjson.dumps(list(entry.tags)),
                    b"n": entry.namespace.encode(),
                    b"u": entry.tenant.encode(),
                    b"p": entry.prompt_prefix.encode(),
                }
            )
        )

    async def invalidate(self, selector: Selector, made: float | None = None) -> int:
        """Here, then on the stream (the module's contract: ``StoreUnavailable`` when the
        record was not published)."""
        self.start()
        dropped = await super().invalidate(selector, made)
        record = invalidate_record(self.instance, selector)
        if record is None:
            return dropped
        published = await self._publish(record, always=True)
        if not published:  # (dropped here only: the other instances keep theirs)
            raise StoreUnavailable(
                "the semantic invalidate record did not reach Redis: the other instances keep "
                "their entries"
            )
        return dropped

    def snapshot(self) -> dict[str, Any]:
        return {**self.counts, "reading": self._reader is not None and not self._reader.done()}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the reader (idempotent; needs a running event loop)."""
        if self._reader is None and not self._closed:
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def aclose(self) -> None:
        self._closed = True
        await self._publishing.drain(None)  # entries being published: let them go out
        reader, self._reader = self._reader, None
        await stop_reader(reader)
        if self._owns_client:
            await close_client(self._client)
        await super().aclose()

    # ------------------------------------------------------------------ publishing, reading

    async def _publish(self, fields: dict[Any, Any], *, always: bool = False) -> bool:
        """Whether Redis took the record (a failure is reported, not raised). ``always``: a
        full Redis takes it too (``ALWAYS_APPEND``)."""
        if self.health is not None and not self.health.usable():
            return False  # Redis degraded: local only for now
        try:
            with _unavailable("publish a semantic entry"):
                if always:
                    pairs = [part for pair in fields.items() for part in pair]
                    await self._client.eval(ALWAYS_APPEND, 1, self.stream, self.maxlen, *pairs)
                else:
                    await self._client.xadd(
                        self.stream, fields, maxlen=self.maxlen, approximate=True
                    )
        except StoreUnavailable as error:
            self._failed(error)
            return False
        self.counts["published"] += 1
        if self.health is not None:
            self.health.report(None)
        return True

    async def _read(self) -> None:
        last: Any = None  # a stream id (bytes)
        missed = False  # cut off since the last record read: some may never be read
        started = False  # positioned once: the stream read from its first record then
        # (The id this reader had read up to when it was caught up, and the stream's count of
        # records ever added then: how many the next read must return, when it catches up.)
        caught: tuple[bytes, int] | None = None
        backoff = Backoff(self.retry_interval)
        while not self._closed:
            try:
                with _unavailable("read the semantic stream"):
                    # At start, the records already there, from the first (those gone before
                    # it held nothing of this reader's); after a failure, from the end.
                    from_start = last is None and not started
                    if from_start:
                        entries = _entries(await self._client.xrange(self.stream, count=READ_COUNT))
                        last, started = b"0-0", True
                    elif last is None:
                        top = await self._client.xrevrange(self.stream, count=1)
                        last = top[0][0] if top else b"0-0"
                    if missed:  # (after positioning: what comes later is read)
                        # (At start too: cut off at its first read, it stored entries of its
                        # own meanwhile, whose invalidations may have left the stream since.)
                        everything = Selector(everything=True)
                        self.counts["forgotten"] += await super().invalidate(everything)
                        missed = False
                    if last is not None and not self.ready.is_set():
                        self.ready.set()
                        if self.health is not None:
                            self.health.report(None)
                    if not from_start:
                        reply = await self._client.xread(
                            {self.stream: last}, count=READ_COUNT, block=self.block_ms
                        )
                        entries = xread_entries(reply)
                    # Records after ``last`` that left the stream before this read (trimmed by
                    # the XADDs' MAXLEN while this reader stalled or lagged, or the stream
                    # evicted) are never read, and XREAD says nothing of them.
                    head = await self._client.eval(HEAD, 1, self.stream)
                backoff.reset()
                read = entries[-1][0] if entries else last
                if not from_start and _left_unread(last, head, caught, len(entries), read):
                    # An ``invalidate`` among them, maybe: as above.
                    self.counts["lost"] += 1
                    everything = Selector(everything=True)
                    self.counts["forgotten"] += await super().invalidate(everything)
                caught = (read, int(head[3])) if head and head[2] and read == head[1] else None
                redis_now = int(head[4]) if head else None
                for ident, fields in entries:
                    last = ident
                    try:
                        await self._apply(fields, ident, redis_now)
                    except Exception:  # a malformed record never stops the reader
                        self.counts["ignored"] += 1
                        log.warning("ignoring a malformed semantic record %r", ident, exc_info=True)
                    # Requests between two records: a start reads up to ``stream_maxlen`` of
                    # them at once (10k: ~10 s here), which held the loop a page at a time.
                    await asyncio.sleep(0)
                if not head:  # gone: the next one begins anew
                    last = b"0-0"
                elif not head[2]:  # emptied: its next record comes after its last id
                    last = head[1]
            except StoreUnavailable as error:
                self._failed(error)
                self.ready.clear()
                last, missed = None, True  # resume from the end: Redis may be new
                await backoff.wait()

    async def _apply(
        self, fields: dict[bytes, bytes], ident: bytes = b"0-0", redis_now: int | None = None
    ) -> None:
        if fields.get(b"src") == self.instance:
            return
        op = fields.get(b"op")
        if op == b"invalidate":
            name = _SELECTORS.get(fields[b"sel"].decode())
            if name is None:
                self.counts["ignored"] += 1
                return
            self.counts["invalidations_received"] += 1
            value: Any = True if name == "everything" else fields[b"val"].decode()
            # When it was made, not read: an entry made after it (read later, by an instance
            # started since) predates no prefix it names.
            made = self._clock.now() - _since(ident, redis_now)
            await super().invalidate(Selector(**{name: value}), made)
            return
        if op != b"put":
            self.counts["ignored"] += 1
            return
        import numpy as np

        vector = np.frombuffer(fields[b"v"], dtype="<f4").astype(np.float32)
        now = self._clock.now()
        expires, created = _times(fields, ident, redis_now, now)
        if (
            vector.shape != (self.embedder.dim,)
            or expires <= now
            or fields.get(b"e", b"").decode() != str(getattr(self.embedder, "name", ""))
        ):
            self.counts["ignored"] += 1
            return
        self.counts["received"] += 1
        view = SemanticView(
            fields[b"s"].decode(), fields[b"t"].decode(), fields.get(b"ctx", b"").decode()
        )
        await super().insert(
            view,
            vector,
            None,
            expires,
            tuple(orjson.loads(fields.get(b"g", b"[]"))),
            fields.get(b"n", b"").decode(),
            fields.get(b"p", b"").decode(),
            ref=fields[b"k"].decode(),
            created=created,
            # (A record of an instance from before the field: the namespace's shared budget.)
            tenant=fields.get(b"u", b"*").decode(),
        )

    def _failed(self, error: StoreUnavailable) -> None:
        if not counted_apart(error):  # (Redis answered: the health counts it)
            self.counts["errors"] += 1
        if self.health is not None:
            self.health.report(error)
        else:
            log.debug("shared semantic cache: %s", error)


def invalidate_record(instance: bytes, selector: Selector) -> dict[bytes, bytes] | None:
    """The stream's ``invalidate`` record of ``selector``, from ``instance``; None for a
    selector that names nothing."""
    if selector.everything:
        sel, val = "all", ""
    elif selector.tag is not None:
        sel, val = "tag", selector.tag
    elif selector.namespace is not None:
        sel, val = "namespace", selector.namespace
    elif selector.prefix is not None:
        sel, val = "prefix", selector.prefix
    else:
        return None
    return {b"op": b"invalidate", b"src": instance, b"sel": sel.encode(), b"val": val.encode()}


class SemanticInvalidations:
    """The ``invalidate`` records of an instance without a semantic cache, on the stream
    ``P semantic`` the others' caches read (the module's contract): it holds no entry itself,
    so it reads nothing, embeds nothing and drops nothing here. ``client``, ``health``: the
    shared store's; ``owns_client``: ``aclose`` closes the client."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        prefix: str = "carpool:",
        maxlen: int = 10_000,
        health: Health | None = None,
        owns_client: bool = False,
    ) -> None:
        self.stream = prefix + "semantic"
        self.instance = secrets.token_hex(8).encode()
        self.maxlen = maxlen
        self.health = health
        self.counts = {"published": 0, "errors": 0}
        self._client = client
        self._owns_client = owns_client

    def __repr__(self) -> str:
        return f"<SemanticInvalidations stream={self.stream!r} instance={self.instance.decode()}>"

    async def invalidate(self, selector: Selector) -> None:
        """Publish ``selector``'s ``invalidate`` record; ``StoreUnavailable`` when Redis did not
        take it (or the health says it is not to be tried): the others keep their entries."""
        record = invalidate_record(self.instance, selector)
        if record is None:
            return
        if self.health is not None and not self.health.usable():
            raise StoreUnavailable("redis degraded: the semantic invalidate record is not sent")
        try:
            with _unavailable("publish a semantic invalidation"):
                pairs = [part for pair in record.items() for part in pair]
                # (A full Redis takes it too: the others must drop their entries.)
                await self._client.eval(ALWAYS_APPEND, 1, self.stream, self.maxlen, *pairs)
        except StoreUnavailable as error:
            if not counted_apart(error):  # (Redis answered: the health counts it)
                self.counts["errors"] += 1
            if self.health is not None:
                self.health.report(error)
            raise
        self.counts["published"] += 1
        if self.health is not None:
            self.health.report(None)

    async def aclose(self) -> None:
        if self._owns_client:
            await close_client(self._client)


def _times(
    fields: dict[bytes, bytes], ident: bytes, redis_now: int | None, now: float
) -> tuple[float, float]:
    """A ``put`` record's expiry and its answer's making, on this instance's clock (``now``):
    its TTL and age when added (``xd``, ``cd``), counted in Redis time from its id to
    ``redis_now``. A record without them (an older carpool's), or read without Redis's now,
    gives its writer's clock (``x``, ``c``)."""
    ttl, age = fields.get(b"xd"), fields.get(b"cd")
    if ttl is None or age is None or redis_now is None:
        return float(fields[b"x"]), float(fields[b"c"])
    since = _since(ident, redis_now)
    return now + int(ttl) / 1000 - since, now - int(age) / 1000 - since


def _since(ident: bytes, redis_now: int | None) -> float:
    """Seconds since the record ``ident`` was added, in Redis time (0 without Redis's now)."""
    if redis_now is None:
        return 0.0
    return max(0, redis_now - int(ident.split(b"-")[0])) / 1000


def _left_unread(
    last: bytes, head: list[Any], caught: tuple[bytes, int] | None, count: int, read: bytes
) -> bool:
    """Whether records after ``last``, the id a reader read from, left the stream before it read
    them, by ``head`` (``HEAD``, read after that XREAD, which returned ``count`` records up to
    ``read``). Records leave only from the stream's start (MAXLEN; carpool deletes none), so
    one that went unread took ``last`` with it: the first record is then past ``last``. But
    ``last`` itself may go with nothing lost (read already; a short ``stream_maxlen`` trims it
    as soon as the next record comes): a reader that was caught up at ``last`` (``caught``:
    it and the count of records ever added then) and is again at ``read`` lost one only if it
    read fewer than were added since. Otherwise, a reader lagging by about the stream's length
    may be told so with nothing lost: it forgets its entries for nothing (misses)."""
    if not head:  # (evicted, deleted: whatever it held after ``last``)
        return last != b"0-0"
    first, newest, length, added = head[:4]  # (and Redis's now)
    if not length:  # (emptied: any record after ``last`` went)
        return _stream_id(newest) > _stream_id(last)
    if last == b"0-0":  # (read from its start: there was none, or an empty one, when we looked)
        return int(added) > int(length)
    if caught is not None and caught[0] == last and read == newest:
        return int(added) - caught[1] > count
    return _stream_id(first) > _stream_id(last)


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries of an XRANGE reply (ids and fields, as ``xread_entries`` gives them)."""
    return list(reply or ())


def _stream_id(ident: bytes) -> tuple[int, int]:
    milliseconds, _, sequence = ident.partition(b"-")
    return int(milliseconds), int(sequence or 0)
