"""How the shared exact cache (:mod:`.store`) lays out its data in Redis/Valkey: the key names,
an entry's encoding, and the Lua scripts that keep the entries, the indexes and the counts.

Key layout (``P`` = the prefix, default ``carpool:``; ``{...}`` is a Redis Cluster hash tag):

    P e:{ID}          HASH, PX = TTL    one entry: m = orjson header (version, kind, complete,
                                        tokens, created, expires: the writer's clock, not
                                        judged; usage_frame, frame lengths, tags, namespace,
                                        body length: an older carpool's has none),
                                        b = body bytes, f = the frames concatenated (absent
                                        when the answer did not stream), tg = ",D1,D2," tag
                                        digests, ns = namespace digest, pp = prompt prefix,
                                        xm = expiry, cr = when the answer was made (ms, Redis
                                        time: ``PUT``'s stamps; an older carpool's entry has no
                                        cr: its header's is read)
    P tag:D           ZSET ID -> expires_ms    candidates for a tag (D = its digest)
    P ns:D            ZSET ID -> expires_ms    candidates for a namespace
    P prefixes        ZSET "ID\\nprompt prefix" -> expires_ms    candidates for prefix invalidation
    P {stats}:live    ZSET ID -> expires_ms    live entries (the ``entries`` count)
    P {stats}:size    HASH ID -> Entry.size
    P {stats}:bytes   STRING                   sum of the sizes (the ``bytes`` count)
    P generation      STRING                   invalidations so far (INCR by each, before it
                                               drops anything): a put whose call began under
                                               another value takes its entry back. Made anew
                                               (Redis restarted empty, the key lost), it starts
                                               at a random 62-bit value (``COUNT``), never where
                                               the lost one was: no value comes back

- ``ID`` (``keys.key_id``) is the fingerprint as it is when it is one (32 lowercase hex digits);
  any other key is replaced by its 40-hex BLAKE2b digest (no raw text in a key; the lengths keep
  both spaces apart). The entry's hash tag is its ID, so keys that a later layer adds for the
  same fingerprint (a flight's lock or stream) can share its slot and be used atomically with it
  in a Lua script.
- Tags and namespaces are user input: in keys they are only ever their BLAKE2b digest (32 hex).
- The index ZSETs are supersets, scored by expiry: a put adds its members (raising a score, never
  lowering it) *before* it writes the entry, and members are removed only once their score has
  passed (lazily, by the next put to that index), so no race can leave a live entry out of an
  index; each index key expires with its last member. Invalidating everything leaves them too
  (a put racing it must not lose the index of an entry it writes after the scan). The three
  ``{stats}`` keys share one slot because one Lua script updates them together; they go away
  when no entry is live.
- What the store finds by SCAN (invalidating everything; an index that was no sorted set) is
  an entry only if its whole name is ``P e:{ID}`` (``StoreKeys.entry_id``), and invalidating
  everything drops the three ``{stats}`` keys by name: the pattern ``P e:{*}`` also matches
  the keys of a deployment whose prefix is ``P e:`` (its entries, its idempotency records)
  and another app's, which are not the store's to drop.
- A value under an entry's key that no carpool wrote (something else wrote the key: a hash
  ``decode`` cannot read, ``Unreadable``, or another type, ``WRONGTYPE``) is dropped by the
  first get that reads it (``UNREADABLE``, if it is still the value read) or invalidation
  that meets it (``DROP``): a miss, once. ``decode`` checks what it can without parsing the
  body (a hit must not): its length against the header's (a body cut short, or another one
  put in its place), the answer's kind against the reader's API (the key is the request's
  fingerprint, which its API scopes: an entry of another kind under it was edited). A header
  field a reader does not know is passed over (an older carpool reads a newer one's entries,
  body length and all: a fleet mid-upgrade shares its cache); one it lacks is checked only
  when a carpool that writes it has to (an older carpool's entry has no body length: read
  unchecked).
- Every time here is Redis's (ms, ``TIME``, read by each script: ``REDIS_NOW``), never an instance's,
  whose wall clocks may be minutes apart: scripts are sent TTLs and ages, and ``GET`` returns
  Redis's now with the entry, so that its reader judges the entry's age and expiry on the same
  clock. (Scored by each writer's clock, the indexes lost live entries to an instance whose
  clock was ahead: invalidations missed them.)
- Every script touches keys of one slot only, and multi-key work is pipelined per key, so the
  layout works on Redis Cluster. The prefix must not contain ``{`` or ``}``.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from ..answer import Answer
from ..apis import APIS
from ..store.base import Entry
from .connection import ALWAYS, GROWS, REDIS_NOW
from .keys import digest, tagged

__all__ = [
    "COUNT",
    "DROP",
    "FORMAT",
    "GET",
    "INDEX",
    "INDEX_SLACK_MS",
    "PUT",
    "STATS",
    "STATS_ADD",
    "StoreKeys",
    "UNREADABLE",
    "Unreadable",
    "decode",
    "encode",
]

FORMAT = 1  # version of the entry header; another version reads as a miss


class StoreKeys:
    """The key names of the store under ``prefix`` (``P``)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.stats = [
            f"{prefix}{{stats}}:live",
            f"{prefix}{{stats}}:size",
            f"{prefix}{{stats}}:bytes",
        ]
        self.prefixes = f"{prefix}prefixes"
        # Every entry, as a SCAN pattern, and the whole name of one (``keys.tagged``): what
        # the pattern matches is an entry only if its whole name is one.
        self.entries, self._entry_name = tagged(prefix, "e:")
        self.generation = f"{prefix}generation"

    def entry_id(self, key: bytes) -> bytes | None:
        """The ID of the entry whose key is ``key``; None if ``key`` is no entry's name (a key
        of another deployment whose prefix begins with this one's, or of another app)."""
        name = self._entry_name.fullmatch(key)
        return None if name is None else name.group(1)

    def entry(self, entry_id: str) -> str:
        return f"{self.prefix}e:{{{entry_id}}}"

    def tag(self, tag: str) -> str:
        return f"{self.prefix}tag:{digest(tag)}"

    def namespace(self, namespace: str) -> str:
        return f"{self.prefix}ns:{digest(namespace)}"


# Add MEMBER (ARGV[1]) to the index ZSET, scored by its expiry (now + ARGV[2]: the entry's TTL
# in ms plus ``INDEX_SLACK_MS``), unless it is already there with a higher score; drop the members
# expired by now, and let the key expire with its last member.
INDEX = (
    GROWS
    + REDIS_NOW
    + """
local key = KEYS[1]
local expires = now + tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', key, '-inf', at)
local old = redis.call('ZSCORE', key, ARGV[1])
if not old or tonumber(old) < expires then
  redis.call('ZADD', key, string.format('%.0f', expires), ARGV[1])
end
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', key, math.max(1, tonumber(last[2]) - now))
return 1
"""
)

# How much longer an index keeps a member than its entry lives: the entry's TTL starts a round
# trip after the index's (the indexes are written first), and on a Cluster the two scripts read
# the clocks of two nodes. A member kept past its entry costs a DROP that finds nothing.
INDEX_SLACK_MS = 1000

# A generation that is no count (written by something else: INCR refused it, and every
# invalidation failed) is made anew from the random start ARGV[1].
_RECOUNTED = """
local current = redis.call('GET', KEYS[1])
if current and (not string.match(current, '^%d+$') or #current > 18) then
  redis.call('SET', KEYS[1], ARGV[1])
end
"""

# Count one invalidation: KEYS = the generation, ARGV = a random start (1 to 2^62) for a counter
# made anew. (Counting from 0 again after Redis restarted empty, a put whose ``since`` was read
# before the restart matched the first invalidation after it: its stale answer was kept.)
COUNT = (
    ALWAYS
    + _RECOUNTED
    + """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('INCR', KEYS[1])
return 1
"""
)

# The generation as a count, made anew (``_RECOUNTED``) if it is none: KEYS, ARGV as ``COUNT``.
RECOUNT = ALWAYS + _RECOUNTED + "return redis.call('GET', KEYS[1])\n"

# Replace the entry hash: ARGV = PX (the TTL in ms), the answer's age in ms, then field, value
# pairs. Stamped in Redis time: ``xm`` = now + PX (its expiry) and ``cr`` = now - age (when the
# answer was made). Returns ``xm`` as written (``DROP``'s mode x).
PUT = (
    GROWS
    + REDIS_NOW
    + """
local expires = string.format('%.0f', now + tonumber(ARGV[1]))
local created = string.format('%.0f', now - tonumber(ARGV[2]))
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'xm', expires, 'cr', created, unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return expires
"""
)

# Read an entry: {now, m, b, f, pp, cr, xm} (a field it lacks: nil), so that the reader judges
# its age and expiry in Redis time, in the round trip that reads it. A read: it runs on a full
# Redis too.
GET = (
    ALWAYS
    + REDIS_NOW
    + """
local f = redis.call('HMGET', KEYS[1], 'm', 'b', 'f', 'pp', 'cr', 'xm')
return {now, f[1], f[2], f[3], f[4], f[5], f[6]}
"""
)

# Drop the entry if it still matches: ARGV = mode (t: tag digest, n: namespace digest,
# p: prompt prefix, x: this exact expiry, ``xm``: the entry one put wrote), value.
# 1 if a live entry was dropped; an entry already expired by now (Redis time; its PX may run
# later than its own expiry) is dropped but not counted.
DROP = (
    ALWAYS
    + REDIS_NOW
    + """
local mode, value = ARGV[1], ARGV[2]
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' then  -- none, or no entry (something else wrote it: ``UNREADABLE``)
  if kind ~= 'none' then redis.call('UNLINK', KEYS[1]) end
  return 0
end
local expires = redis.call('HGET', KEYS[1], 'xm')
if expires and (tonumber(expires) or 0) <= now then  -- (no number: unreadable)
  redis.call('UNLINK', KEYS[1])
  return 0
end
local name = mode == 't' and 'tg' or mode == 'n' and 'ns' or mode == 'x' and 'xm' or 'pp'
local field = redis.call('HGET', KEYS[1], name)
if not field then return 0 end
if mode == 't' then
  if not string.find(field, ',' .. value .. ',', 1, true) then return 0 end
elseif mode == 'n' or mode == 'x' then
  if field ~= value then return 0 end
elseif string.sub(field, 1, #value) ~= value then
  return 0
end
redis.call('UNLINK', KEYS[1])
return 1
"""
)

# Drop a value under an entry's key that ``decode`` could not read (``Unreadable``, or not a
# hash: ``WRONGTYPE``), if it is still the one read and not an entry put since: ARGV[1] = its
# header (``m``) as read, "" when it had none or was no hash. 1 if dropped.
UNREADABLE = (
    ALWAYS
    + """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind == 'hash' and (redis.call('HGET', KEYS[1], 'm') or '') ~= ARGV[1] then return 0 end
redis.call('UNLINK', KEYS[1])
return 1
"""
)

# Reap the entries expired by now (Redis time), then 'add' ID TTL SIZE (TTL in ms) |
# 'del' ID... | 'read'; returns {live entries, bytes}. KEYS = live, size, bytes. ``STATS`` runs on
# a full Redis (it frees, or only counts); ``STATS_ADD``, the same script for 'add', is refused
# like the entry.
_STATS = (
    REDIS_NOW
    + """
local live, size, total, op = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local function forget(id)
  local s = redis.call('HGET', size, id)
  if s then
    redis.call('DECRBY', total, s)
    redis.call('HDEL', size, id)
  end
  redis.call('ZREM', live, id)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', live, '-inf', at, 'LIMIT', 0, 1000)) do
  forget(id)
end
if op == 'add' then
  forget(ARGV[2])
  redis.call('ZADD', live, string.format('%.0f', now + tonumber(ARGV[3])), ARGV[2])
  redis.call('HSET', size, ARGV[2], ARGV[4])
  redis.call('INCRBY', total, ARGV[4])
elseif op == 'del' then
  for i = 2, #ARGV do forget(ARGV[i]) end
end
if redis.call('ZCARD', live) == 0 then
  redis.call('DEL', size, total)
  return {0, 0}
end
return {redis.call('ZCOUNT', live, '(' .. at, '+inf'), tonumber(redis.call('GET', total) or '0')}
"""
)
STATS, STATS_ADD = ALWAYS + _STATS, GROWS + _STATS


def encode(entry: Entry) -> list[Any]:
    """The field, value pairs of the entry's hash that the writer makes. Its header's
    ``created``/``expires`` are the writer's clock, kept for the format; what is judged is
    ``cr``/``xm``, stamped by ``PUT`` in Redis time."""
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
            "bl": len(answer.body),  # (``decode``: a body cut short is read as none)
        }
    )
    fields: list[Any] = [
        "m",
        header,
        "b",
        answer.body,
        "tg",
        "," + "".join(digest(t) + "," for t in entry.tags),
        "ns",
        digest(entry.namespace),
        "pp",
        entry.prompt_prefix,
    ]  # (``xm`` and ``cr``, in Redis time, are ``PUT``'s)
    if answer.frames is not None:
        fields += ["f", b"".join(answer.frames)]
    return fields


class Unreadable(ValueError):
    """A value under an entry's key that is no entry carpool wrote (``decode``)."""


def decode(read: list[Any], now: float, kind: str | None = None) -> Entry | None:
    """The entry of ``GET``'s reply (Redis's now in ms, then the hash fields ``m``, ``b``,
    ``f``, ``pp``, ``cr``, ``xm``); None if it is absent, of another format or expired (by
    Redis's clock). Its answer's ``created`` and its ``expires`` are on the reader's clock,
    whose reading is ``now``: as long ago and ahead of it as they are of Redis's now, so that
    the reader's ages (``Age``, ``max-age``, its own TTL) are Redis time, whatever its clock
    and the writer's. ``Unreadable`` if it is none that carpool writes: a header that is no
    JSON object, a field missing or of another type, frame lengths that are not the frames',
    a body of another length than the header says (none said: an older carpool's entry), an
    answer of another kind than ``kind`` (the API of the request whose key was read; None:
    not known) (checked here, on every read, without parsing the body: read later, such a
    value failed the request it was served to, or was served as a hit)."""
    redis_now, header, body, frames, prompt_prefix, created_ms, expires_ms = read
    if header is None:
        if body is None and frames is None and prompt_prefix is None:
            return None  # (no such key)
        raise Unreadable("fields without a header")
    try:
        meta = orjson.loads(header)
    except orjson.JSONDecodeError:
        raise Unreadable("a header that is no JSON") from None
    if not isinstance(meta, dict) or type(meta.get("v")) is not int:
        raise Unreadable("a header without its format")
    if meta["v"] != FORMAT:
        return None  # (another version's: a rolling upgrade, not ours to drop)
    try:
        expires, entry_kind, complete, tokens = meta["x"], meta["k"], meta["c"], meta["t"]
        created, usage_frame, lengths = meta["cr"], meta["u"], meta["fl"]
        tags, namespace = meta["tags"], meta["ns"]
    except KeyError as missing:
        raise Unreadable(f"a header without {missing}") from None
    if not (
        body is not None
        and _number(expires)
        and _number(created)
        and entry_kind in APIS
        and type(complete) is bool
        and type(tokens) is int
        and isinstance(tags, list)
        and all(isinstance(tag, str) for tag in tags)
        and isinstance(namespace, str)
    ):
        raise Unreadable("a header field of another type, or no body")
    length = meta.get("bl")  # (None: an older carpool's entry, read as it was)
    if length is not None and (type(length) is not int or length != len(body)):
        raise Unreadable(f"a body of {len(body)} bytes where its header says {length!r}")
    if kind is not None and entry_kind != kind:
        raise Unreadable(f"an answer of kind {entry_kind!r} under a key of {kind!r}")
    expires_at = _float(expires_ms)
    # (An entry of an older carpool has no ``cr``: its header's, the writer's wall clock.)
    created_at = created * 1000 if created_ms is None else _float(created_ms)
    if expires_at is None or created_at is None:
        raise Unreadable("an expiry or a creation time that is no number")
    if expires_at <= int(redis_now):
        return None
    split = _split(frames or b"", lengths)
    if usage_frame is not None and not (
        split is not None and type(usage_frame) is int and 0 <= usage_frame < len(split)
    ):
        raise Unreadable("a usage frame that is none of the frames")
    try:
        prefix = (prompt_prefix or b"").decode()
    except UnicodeDecodeError:
        raise Unreadable("a prompt prefix that is no UTF-8") from None
    return Entry(
        Answer(
            entry_kind,
            body,
            complete,
            tokens,
            now - max(0.0, int(redis_now) - created_at) / 1000,
            split,
            usage_frame,
        ),
        now + (expires_at - int(redis_now)) / 1000,
        tuple(tags),
        namespace,
        prefix,
    )


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _float(value: bytes | None) -> float | None:
    """A number field of the hash; None if it is absent or no finite number."""
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def _split(joined: bytes, lengths: Any) -> list[bytes] | None:
    if lengths is None:
        return None
    if (
        not isinstance(lengths, list)
        or not all(type(length) is int and length >= 0 for length in lengths)
        or sum(lengths) != len(joined)
    ):
        raise Unreadable("frame lengths that are not the frames'")
    frames, at = [], 0
    for length in lengths:
        frames.append(joined[at : at + length])
        at += length
    return frames
