"""How the shared exact cache (:mod:`.store`) lays out its data in Redis/Valkey: the key names,
an entry's encoding, and the Lua scripts that keep the entries, the indexes and the counts.

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
- Every script touches keys of one slot only, and multi-key work is pipelined per key, so the
  layout works on Redis Cluster. The prefix must not contain ``{`` or ``}``.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from ..answer import Answer
from ..store.base import Entry
from .connection import ALWAYS, GROWS
from .keys import digest, glob_escape

__all__ = [
    "COUNT",
    "DROP",
    "FORMAT",
    "INDEX",
    "PUT",
    "STATS",
    "STATS_ADD",
    "StoreKeys",
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
        # Every key of the store's own families, as SCAN patterns (Redis globs give braces no
        # meaning: the families are patterns as they are), and how an entry's key begins.
        self.families = [glob_escape(prefix) + family for family in ("e:*", "{stats}:*")]
        self.entry_start = f"{prefix}e:{{".encode()
        self.generation = f"{prefix}generation"

    def entry(self, entry_id: str) -> str:
        return f"{self.prefix}e:{{{entry_id}}}"

    def tag(self, tag: str) -> str:
        return f"{self.prefix}tag:{digest(tag)}"

    def namespace(self, namespace: str) -> str:
        return f"{self.prefix}ns:{digest(namespace)}"


# Add MEMBER to the index ZSET with score EXPIRES unless it is already there with a higher one,
# drop the members expired by NOW, and let the key expire with its last member.
INDEX = (
    GROWS
    + """
local key, expires, now = KEYS[1], tonumber(ARGV[2]), ARGV[3]
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local old = redis.call('ZSCORE', key, ARGV[1])
if not old or tonumber(old) < expires then redis.call('ZADD', key, ARGV[2], ARGV[1]) end
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', key, math.max(1, tonumber(last[2]) - tonumber(now)))
return 1
"""
)

# Count one invalidation: KEYS = the generation, ARGV = a random start (1 to 2^62) for a counter
# made anew. (Counting from 0 again after Redis restarted empty, a put whose ``since`` was read
# before the restart matched the first invalidation after it: its stale answer was kept.)
COUNT = (
    ALWAYS
    + """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
redis.call('INCR', KEYS[1])
return 1
"""
)

# Replace the entry hash: ARGV = PX, then field, value pairs.
PUT = (
    GROWS
    + """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
)

# Drop the entry if it still matches: ARGV = mode (t: tag digest, n: namespace digest,
# p: prompt prefix, x: this exact expiry, ``xm``: the entry one put wrote), value, now (ms).
# 1 if a live entry was dropped; an entry already expired by NOW (its PX may run a round trip
# later than its own expiry) is dropped but not counted.
DROP = (
    ALWAYS
    + """
local mode, value = ARGV[1], ARGV[2]
local expires = redis.call('HGET', KEYS[1], 'xm')
if expires and tonumber(expires) <= tonumber(ARGV[3]) then
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

# Reap the entries expired by NOW, then 'add' ID EXPIRES SIZE | 'del' ID... | 'read';
# returns {live entries, bytes}. KEYS = live, size, bytes. ``STATS`` runs on a full Redis (it
# frees, or only counts); ``STATS_ADD``, the same script for 'add', is refused like the entry.
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
STATS, STATS_ADD = ALWAYS + _STATS, GROWS + _STATS


def encode(entry: Entry) -> list[Any]:
    """The field, value pairs of the entry's hash."""
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
        "," + "".join(digest(t) + "," for t in entry.tags),
        "ns",
        digest(entry.namespace),
        "pp",
        entry.prompt_prefix,
        # The exact expiry (not rounded up), so the drop script and get agree on "expired".
        "xm",
        f"{entry.expires * 1000:.3f}",
    ]
    if answer.frames is not None:
        fields += ["f", b"".join(answer.frames)]
    return fields


def decode(
    header: bytes | None, body: bytes | None, frames: bytes | None, prompt_prefix: bytes | None
) -> Entry | None:
    """The entry of the hash fields ``m``, ``b``, ``f``, ``pp``; None if it is absent, of
    another format or expired."""
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


def _split(joined: bytes, lengths: list[int] | None) -> list[bytes] | None:
    if lengths is None:
        return None
    frames, at = [], 0
    for length in lengths:
        frames.append(joined[at : at + length])
        at += length
    return frames
