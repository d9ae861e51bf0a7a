"""The shared exact cache: every gateway instance reads and writes one Redis/Valkey.

Contract (on top of ``store.base``):
- What one instance puts, every instance gets; an invalidation by any instance reaches all of them
  (the entries, and the indexes that find them, live in Redis only: nothing is cached locally).
- An entry lives in Redis exactly as long as its TTL (``PX`` = the time left until
  ``entry.expires``); an entry already expired is not stored (a put of one drops the key's entry,
  as a replace followed by expiry would). ``get`` also checks ``expires``, so clock rounding never
  serves an expired answer.
- Every Redis or network failure, and any answer slower than ``socket_timeout``, raises
  ``StoreUnavailable`` (the client library's error is its ``__cause__``). Nothing hangs: a refused
  connection is retried once at once (a pooled connection may be stale after a Redis restart),
  a timeout never is, so a dead Redis fails a call in milliseconds and a hung one in
  ``socket_timeout`` (connect: ``connect_timeout``).
- ``entries``/``bytes`` are the whole shared cache (all instances), as counted in Redis: an
  ``INCRBY``/``DECRBY`` byte counter and a set of live entries, kept by one Lua script that also
  reaps what expired. The properties are sync, so they return the last value this instance saw:
  refreshed by every put and invalidation, by ``refresh_stats()``, and in the background by gets
  (at most once per ``stats_interval``). They are approximate: a put racing an invalidation of
  the same key on another instance may be counted until its TTL ends. ``bytes`` is
  ``Entry.size`` summed, as for the memory store, not Redis's own memory use.
- ``invalidate`` returns how many live entries it dropped. Tag and namespace invalidation read an
  index of candidates and drop each candidate only if its entry, checked atomically in Redis,
  still carries the tag/namespace (a replaced entry is never dropped for its old tags). Prefix
  invalidation scans the prompt-prefix index (an admin action, O(entries)). ``everything`` SCANs
  and UNLINKs every key under the prefix (never FLUSHDB: other data may share the database).

Key layout (``P`` = the prefix, default ``carpool:``; ``{...}`` is a Redis Cluster hash tag):

    P e:{ID}          HASH, PX = TTL    one entry: m = orjson header (version, kind, complete,
                                        tokens, created, expires, usage_frame, frame lengths,
                                        tags, namespace), b = body bytes, f = the frames
                                        concatenated (absent when the answer did not stream),
                                        tg = ",D1,D2," tag digests, ns = namespace digest,
                                        pp = prompt prefix, xm = expiry in ms (for the Lua checks)
    P tag:D           ZSET ID -> expires_ms    candidates for a tag (D = its digest)
    P ns:D            ZSET ID -> expires_ms    candidates for a namespace
    P prefixes        ZSET "ID\\nprompt prefix" -> expires_ms    candidates for prefix invalidation
    P {stats}:live    ZSET ID -> expires_ms    live entries (the ``entries`` count)
    P {stats}:size    HASH ID -> Entry.size
    P {stats}:bytes   STRING                   sum of the sizes (the ``bytes`` count)

- ``ID`` is the fingerprint as it is when it is one (32 lowercase hex digits); any other key is
  replaced by its 40-hex BLAKE2b digest (no raw text in a key; the lengths keep both spaces
  apart). The entry's hash tag is its ID, so keys that a later layer adds for the same fingerprint
  (a flight's lock or stream) can share its slot and be used atomically with it in a Lua script.
- Tags and namespaces are user input: in keys they are only ever their BLAKE2b digest (32 hex).
- The index ZSETs are supersets, scored by expiry: a put adds its members (raising a score, never
  lowering it) *before* it writes the entry, and members are removed only once their score has
  passed (lazily, by the next put to that index), so no race can leave a live entry out of an
  index; each index key expires with its last member. The three ``{stats}`` keys share one slot
  because one Lua script updates them together; they go away when no entry is live.
- Every script touches keys of one slot only, and multi-key work is pipelined per key, so the
  layout works on Redis Cluster. The prefix must not contain ``{`` or ``}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import re
import time
from typing import TYPE_CHECKING, Any

import orjson

from ..answer import Answer
from ..store.base import Entry
from .connection import (
    CONNECT_TIMEOUT,
    MAX_CONNECTIONS,
    POOL_TIMEOUT,
    RETRIES,
    SOCKET_TIMEOUT,
    StoreUnavailable,
    connect,
    unavailable_in,
)

if TYPE_CHECKING:
    import redis.asyncio as aredis

__all__ = ["RedisStore", "StoreUnavailable"]

STATS_INTERVAL = 1.0  # s between background refreshes of ``entries``/``bytes`` by gets
BATCH = 500  # keys per SCAN page / per pipelined round trip in invalidations
FORMAT = 1  # version of the entry header; another version reads as a miss

_FINGERPRINT = re.compile(r"[0-9a-f]{32}")

# Add MEMBER to the index ZSET with score EXPIRES unless it is already there with a higher one,
# drop the members expired by NOW, and let the key expire with its last member.
_INDEX = """
local key, expires, now = KEYS[1], tonumber(ARGV[2]), ARGV[3]
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local old = redis.call('ZSCORE', key, ARGV[1])
if not old or tonumber(old) < expires then redis.call('ZADD', key, ARGV[2], ARGV[1]) end
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', key, math.max(1, tonumber(last[2]) - tonumber(now)))
return 1
"""

# Replace the entry hash: ARGV = PX, then field, value pairs.
_PUT = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# Drop the entry if it still matches: ARGV = mode (t: tag digest, n: namespace digest,
# p: prompt prefix), value, now (ms). 1 if a live entry was dropped; an entry already expired by
# NOW (its PX may run a round trip later than its own expiry) is dropped but not counted.
_DROP = """
local mode, value = ARGV[1], ARGV[2]
local expires = redis.call('HGET', KEYS[1], 'xm')
if expires and tonumber(expires) <= tonumber(ARGV[3]) then
  redis.call('UNLINK', KEYS[1])
  return 0
end
local field = redis.call('HGET', KEYS[1], mode == 't' and 'tg' or mode == 'n' and 'ns' or 'pp')
if not field then return 0 end
if mode == 't' then
  if not string.find(field, ',' .. value .. ',', 1, true) then return 0 end
elseif mode == 'n' then
  if field ~= value then return 0 end
elseif string.sub(field, 1, #value) ~= value then
  return 0
end
redis.call('UNLINK', KEYS[1])
return 1
"""

# Reap the entries expired by NOW, then 'add' ID EXPIRES SIZE | 'del' ID... | 'read';
# returns {live entries, bytes}. KEYS = live, size, bytes.
_STATS = """
local live, size, total, now, op = KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]
local function forget(id)
  local s = redis.call('HGET', size, id)
  if s then
    redis.call('DECRBY', total, s)
    redis.call('HDEL', size, id)
  end
  redis.call('ZREM', live, id)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', live, '-inf', now, 'LIMIT', 0, 1000)) do
  forget(id)
end
if op == 'add' then
  forget(ARGV[3])
  redis.call('ZADD', live, ARGV[4], ARGV[3])
  redis.call('HSET', size, ARGV[3], ARGV[5])
  redis.call('INCRBY', total, ARGV[5])
elseif op == 'del' then
  for i = 3, #ARGV do forget(ARGV[i]) end
end
if redis.call('ZCARD', live) == 0 then
  redis.call('DEL', size, total)
  return {0, 0}
end
return {redis.call('ZCOUNT', live, '(' .. now, '+inf'), tonumber(redis.call('GET', total) or '0')}
"""


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN/KEYS pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def xread_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries of a one-stream XREAD reply (RESP2: a list; RESP3: a map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        reply = next(iter(reply.values()))[0]
    else:
        reply = reply[0][1]
    entries: list[tuple[bytes, dict[bytes, bytes]]] = reply
    return entries


_unavailable = unavailable_in("the Redis store")


class RedisStore:
    """The exact cache in Redis/Valkey at ``url`` (``redis://``, ``rediss://``, ``unix://``).

    ``client``: an existing ``redis.asyncio`` client to use instead (then ``url`` is only a
    label, the timeouts and retries are the client's, and ``aclose`` leaves it open); it must
    not decode responses. Otherwise the client is :func:`.connection.connect`'s, with
    ``socket_timeout``/``connect_timeout`` (s), ``retries`` (immediate retries of a failed
    connection), ``max_connections`` and ``pool_timeout`` (s); ``stats_interval`` (s).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "carpool:",
        client: aredis.Redis | None = None,
        socket_timeout: float = SOCKET_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
        retries: int = RETRIES,
        max_connections: int = MAX_CONNECTIONS,
        pool_timeout: float = POOL_TIMEOUT,
        cluster: bool = False,
        stats_interval: float = STATS_INTERVAL,
    ) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"the Redis key prefix {prefix!r} must not contain '{{' or '}}'")
        self.url = url
        self.prefix = prefix
        self.stats_interval = stats_interval
        if client is None:
            client = connect(
                url,
                socket_timeout=socket_timeout,
                connect_timeout=connect_timeout,
                retries=retries,
                max_connections=max_connections,
                pool_timeout=pool_timeout,
                cluster=cluster,
            )
            self._owns_client = True
        else:
            self._owns_client = False
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the Redis client must not decode responses: bodies are bytes")
        self._client = client
        self._stats_keys = [
            f"{prefix}{{stats}}:live",
            f"{prefix}{{stats}}:size",
            f"{prefix}{{stats}}:bytes",
        ]
        self._prefixes_key = f"{prefix}prefixes"
        self._entries = 0
        self._bytes = 0
        self._stats_at = 0.0
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
        return RedisStore._id(key)

    # ------------------------------------------------------------------ keys

    @staticmethod
    def _id(key: str) -> str:
        if _FINGERPRINT.fullmatch(key):
            return key
        return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()

    def _entry_key(self, entry_id: str) -> str:
        return f"{self.prefix}e:{{{entry_id}}}"

    def _tag_key(self, tag: str) -> str:
        return f"{self.prefix}tag:{_digest(tag)}"

    def _namespace_key(self, namespace: str) -> str:
        return f"{self.prefix}ns:{_digest(namespace)}"

    # ------------------------------------------------------------------ the Store interface

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def bytes(self) -> int:
        return self._bytes

    async def get(self, key: str) -> Entry | None:
        with _unavailable("get"):
            fields: list[bytes | None] = await self._client.hmget(  # type: ignore[assignment]  # (redis-py's return type is a union over sync and async)
                self._entry_key(self._id(key)), "m", "b", "f", "pp"
            )  # (bytes: never decoded)
            header, body, frames, prompt_prefix = fields
        self._refresh_soon()
        if header is None or body is None:
            return None
        meta = orjson.loads(header)
        if meta.get("v") != FORMAT or meta["x"] <= time.time():
            return None
        return Entry(
            Answer(
                meta["k"],
                body,
                meta["c"],
                meta["t"],
                meta["cr"],
                _split(frames or b"", meta["fl"]),
                meta["u"],
            ),
            meta["x"],
            tuple(meta["tags"]),
            meta["ns"],
            (prompt_prefix or b"").decode(),
        )

    async def put(self, key: str, entry: Entry) -> None:
        entry_id, now = self._id(key), time.time()
        ttl_ms = math.ceil((entry.expires - now) * 1000)
        if ttl_ms <= 0:
            with _unavailable("put"):
                await self._drop([entry_id])
            return
        expires_ms, now_ms = math.ceil(entry.expires * 1000), int(now * 1000)
        answer = entry.answer
        header = orjson.dumps(
            {
                "v": FORMAT,
                "k": answer.kind,
                "c": answer.complete,
                "t": answer.tokens,
                "cr": answer.created,
                "x": entry.expires,
                "u": answer.usage_frame,
                "fl": None if answer.frames is None else [len(f) for f in answer.frames],
                "tags": list(entry.tags),
                "ns": entry.namespace,
            }
        )
        fields: list[Any] = [
            "m",
            header,
            "b",
            answer.body,
            "tg",
            "," + "".join(_digest(t) + "," for t in entry.tags),
            "ns",
            _digest(entry.namespace),
            "pp",
            entry.prompt_prefix,
            # The exact expiry (not rounded up), so the drop script and get agree on "expired".
            "xm",
            f"{entry.expires * 1000:.3f}",
        ]
        if answer.frames is not None:
            fields += ["f", b"".join(answer.frames)]
        indexes = [(self._tag_key(tag), entry_id) for tag in dict.fromkeys(entry.tags)]
        indexes += [
            (self._namespace_key(entry.namespace), entry_id),
            (self._prefixes_key, f"{entry_id}\n{entry.prompt_prefix}"),
        ]
        with _unavailable("put"):
            # The indexes first, then the entry: an index is never missing a live entry. Two
            # round trips, because a Cluster pipeline does not keep order across slots.
            pipe = self._client.pipeline(transaction=False)
            for index, member in indexes:
                pipe.eval(_INDEX, 1, index, member, expires_ms, now_ms)
            await pipe.execute()
            pipe = self._client.pipeline(transaction=False)
            pipe.eval(_PUT, 1, self._entry_key(entry_id), ttl_ms, *fields)
            pipe.eval(_STATS, 3, *self._stats_keys, now_ms, "add", entry_id, expires_ms, entry.size)
            _, counts = await pipe.execute()
        self._counted(counts)

    async def invalidate(
        self,
        *,
        tag: str | None = None,
        namespace: str | None = None,
        prefix: str | None = None,
        everything: bool = False,
    ) -> int:
        with _unavailable("invalidate"):
            if everything:
                return await self._drop_everything()
            dropped = 0
            if tag is not None:
                dropped += await self._drop_indexed(self._tag_key(tag), "t", _digest(tag))
            if namespace is not None:
                dropped += await self._drop_indexed(
                    self._namespace_key(namespace), "n", _digest(namespace)
                )
            if prefix is not None:
                dropped += await self._drop_indexed(self._prefixes_key, "p", prefix)
            return dropped

    async def refresh_stats(self) -> None:
        """Read ``entries``/``bytes`` from Redis now (reaping what expired)."""
        with _unavailable("stats"):
            counts = await self._client.eval(
                _STATS, 3, *self._stats_keys, int(time.time() * 1000), "read"
            )
        self._counted(counts)

    async def aclose(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(BaseException):
                await self._refreshing
            self._refreshing = None
        if self._owns_client:
            await self._client.aclose()

    # ------------------------------------------------------------------ internals

    async def _drop_indexed(self, index: str, mode: str, value: str) -> int:
        """Drop the candidates of one index that still match, checked entry by entry."""
        now_ms = time.time() * 1000
        wanted = value.encode("utf-8", "surrogatepass") if mode == "p" else b""
        seen: set[bytes] = set()
        batch: list[bytes] = []
        dropped = 0
        async for member, score in self._client.zscan_iter(index, count=BATCH):
            entry_id, _, prompt_prefix = member.partition(b"\n")
            if score <= now_ms or entry_id in seen or not prompt_prefix.startswith(wanted):
                continue
            seen.add(entry_id)
            batch.append(entry_id)
            if len(batch) >= BATCH:
                dropped += await self._drop([i.decode() for i in batch], mode, value)
                batch = []
        if batch:
            dropped += await self._drop([i.decode() for i in batch], mode, value)
        return dropped

    async def _drop(self, ids: list[str], mode: str = "p", value: str = "") -> int:
        """Drop the entries among ``ids`` that match (mode ``p`` with ``""`` matches all)."""
        pipe, now_ms = self._client.pipeline(transaction=False), time.time() * 1000
        for entry_id in ids:
            pipe.eval(_DROP, 1, self._entry_key(entry_id), mode, value, now_ms)
        results = await pipe.execute()
        gone = [entry_id for entry_id, hit in zip(ids, results, strict=True) if hit]
        if gone:
            self._counted(
                await self._client.eval(
                    _STATS, 3, *self._stats_keys, int(time.time() * 1000), "del", *gone
                )
            )
        return len(gone)

    async def _drop_everything(self) -> int:
        entry_key = f"{self.prefix}e:{{".encode()
        dropped = 0
        batch: list[bytes] = []

        async def unlink() -> int:
            pipe = self._client.pipeline(transaction=False)
            for key in batch:
                pipe.execute_command("UNLINK", key)  # (a cluster pipeline's unlink is not queued)
            results = await pipe.execute()
            return sum(
                n for key, n in zip(batch, results, strict=True) if key.startswith(entry_key)
            )

        # Only this store's own key families: other layers (idempotency records, flights) share
        # the prefix, and dropping cached answers must never forget that a request already ran.
        prefix = glob_escape(self.prefix)
        for family in ("e:*", "tag:*", "ns:*", "prefixes", "{stats}:*"):
            # (Redis globs give braces no meaning: the families are patterns as they are.)
            async for key in self._client.scan_iter(match=prefix + family, count=BATCH):
                batch.append(key)
                if len(batch) >= BATCH:
                    dropped += await unlink()
                    batch = []
        if batch:
            dropped += await unlink()
        self._counted([0, 0])
        return dropped

    def _counted(self, counts: list[Any]) -> None:
        self._entries, self._bytes = int(counts[0]), int(counts[1])
        self._stats_at = time.monotonic()

    def _refresh_soon(self) -> None:
        """Refresh the counts in the background if they are older than ``stats_interval``."""
        if self._refreshing is not None or time.monotonic() - self._stats_at < self.stats_interval:
            return
        self._stats_at = time.monotonic()  # one attempt per interval, even a failed one
        self._refreshing = asyncio.get_running_loop().create_task(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh_stats()
        except StoreUnavailable:
            pass  # the counts stay as last seen; the next get tries again
        finally:
            self._refreshing = None


def _split(joined: bytes, lengths: list[int] | None) -> list[bytes] | None:
    if lengths is None:
        return None
    frames, at = [], 0
    for length in lengths:
        frames.append(joined[at : at + length])
        at += length
    return frames
