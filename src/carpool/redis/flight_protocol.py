"""The records of a cross-instance flight (:mod:`.flights`) in Redis/Valkey: the lock, the
leader's stream and its final record, and the Lua scripts that change them.

Key layout (``P`` = ``distributed.key_prefix``; ``ID`` = the exact store's ID of the same
fingerprint, ``keys.key_id``: ``{ID}`` puts every key of a fingerprint, its cached entry
included, in one Redis Cluster slot; every script and pipeline touches the keys of one ID only):

    P lock:{ID}            STRING  TOKEN (16 hex) while the leader's call runs: PX lease_ms,
                                   renewed every lease/3 (compare-and-expire); then, for a
                                   complete answer that may linger, "=TOKEN:MS" (MS = Redis
                                   time of the end, for max_age) with PX coalesce.window_ms;
                                   otherwise deleted (compare-and-delete) at the end. An
                                   invalidation marks a running call's "~TOKEN" (``FORGET``);
                                   the next claim sets it aside (``P stale:{ID}:TOKEN``) and
                                   takes the lock for a fresh call (``TAKE``)
    P stale:{ID}:TOKEN     STRING  "1" while the call of TOKEN, set aside by an invalidation,
                                   still runs: its leader renews it (PX lease_ms) instead of
                                   the lock, its followers read it as their leader alive, its
                                   end deletes it. Nobody new follows it
    P followed:{ID}:TOKEN  STRING  "1" while a follower reads the call of TOKEN: every read of
                                   every follower sets it, PX lease_ms. A leader whose own
                                   clients all left ends its call (``gone``) only once it is
                                   gone: nobody waits on the call anywhere
    P flight:{ID}:TOKEN    STREAM  one leader's output. One stream per leader: a follower never
                                   mixes two calls, and a new leader never deletes what another
                                   instance is still reading. Entries: one per frame {i: index,
                                   f: frame bytes, u: 1 for the usage-only chunk}, then one final
                                   record {e: a (answer) | x (error) | g (gone), m: orjson meta,
                                   b: body}. Created by the first frame (or the final record);
                                   MAXLEN ~ stream_maxlen; PX 2 x lease_ms while the call runs
                                   (renewed with the lock), then window_ms + lease_ms (lease_ms
                                   if it may not linger): time for followers to read the end

The final record is the answer (body, kind, complete, tokens, created, the usage frame's index,
the frame count: the frames are already in the stream; whether it may linger in the window
of an instance that relayed it: not a ``no-store`` leader's, nor a call set aside by an
invalidation; a record without it, from an older instance: it may; and an incomplete one's
``requester``: ``Answer.for_others``) or the error (an
``UpstreamStatusError`` as status, content type and body exactly as the upstream sent them,
with ``asked``, the digest of the request body it answered; any other error as class, status,
message and code, and the engine's own error object of a stream that failed; both with
``requester``, whose call it was: ``UpstreamError.for_others``):
``answer_record``/``error_record`` write it, ``answer_from``/``error_from`` read it back as the
same ``Answer`` or the same error.

A record is read only once checked (``frame_from``, ``final_from``): an entry that is neither
a frame with its index nor a final record, a meta that is no JSON object or lacks a field or
has one of another type, an answer of another API than the request's or whose body is no JSON
object, a status that is no integer HTTP defines (a status error's: no 2xx either) is
``Unreadable``: something else wrote it, and its follower takes it as its leader gone
(:mod:`.flight_relay`). So is a lock that holds none of the forms above (``CLAIM`` drops it).
Before, such a record was served (a 200 whose body was the record's, a status line 999) or
failed the request (a 500, a 502 "internal error").
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..answer import Answer
from ..apis import APIS
from ..errors import (
    CarpoolError,
    GatewayOverloaded,
    UpstreamAnswerCut,
    UpstreamAnswerUnreadable,
    UpstreamBadStatus,
    UpstreamBusy,
    UpstreamContentCoding,
    UpstreamError,
    UpstreamKeyRefused,
    UpstreamNoAnswer,
    UpstreamRedirected,
    UpstreamStatusError,
    UpstreamStreamBroken,
    UpstreamStreamStalled,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from .connection import ALWAYS
from .keys import key_id, tagged
from .store_layout import StoreKeys

__all__ = [
    "CLAIM",
    "END",
    "FOLLOWED",
    "FORGET",
    "FRAMES",
    "RENEW",
    "TAKE",
    "Unreadable",
    "answer_from",
    "answer_record",
    "entry_key",
    "error_from",
    "error_record",
    "final_from",
    "flight_keys",
    "frame_from",
    "followed_keys",
    "lingers",
    "lock_names",
    "stale_keys",
]


def flight_keys(prefix: str, key: str) -> tuple[str, str]:
    """The lock of ``key``'s flights, and the start of its streams' keys (TOKEN follows)."""
    ident = key_id(key)
    return f"{prefix}lock:{{{ident}}}", f"{prefix}flight:{{{ident}}}:"


def entry_key(prefix: str, key: str) -> str:
    """The exact store's entry of ``key`` (:mod:`.store_layout`): in the slot of its lock."""
    return StoreKeys(prefix).entry(key_id(key))


def stale_keys(prefix: str, key: str) -> str:
    """The start of the keys of ``key``'s calls set aside by an invalidation (TOKEN follows)."""
    return f"{prefix}stale:{{{key_id(key)}}}:"


def followed_keys(prefix: str, key: str) -> str:
    """The start of the keys that say a follower reads one of ``key``'s calls (TOKEN follows)."""
    return f"{prefix}followed:{{{key_id(key)}}}:"


def lock_names(prefix: str) -> tuple[str, re.Pattern[bytes]]:
    """Every flight's lock: a SCAN pattern, and the whole name a key it matches must have to be
    a lock (``keys.tagged``: a key of another deployment whose prefix begins with this one's, or
    another app's, is no lock of ours)."""
    return tagged(prefix, "lock:")


# KEYS: lock, the exact store's entry (``entry_key``). ARGV: token, lease ms, max age ms (-1:
# any age), 1 to look for a stored answer (with any age) before leading, else 0.
# Returns {'lead'} | {'follow', TOKEN} | {'replay', TOKEN, AGE} (a finished call lingering in
# the window, AGE ms after its end, Redis time) | {'stale', TOKEN} (a call begun
# before an invalidation runs: ``TAKE`` sets it aside, in the key of its token) | {'stored'}
# (no call runs, its answer is stored: a call that ended, without a window, since this request
# missed the cache); 'lead' and 'stored' with 'dropped' after them when the lock's name held
# what carpool does not write there (something else wrote it: a key of another type, a value
# of another form, one without an expiry, which every lock has): no lock held, it is dropped.
# (Before, the script failed on it, ``=abc`` having no ``:``, and the claimer took that for
# Redis failing; a word where a token belongs was followed, a leader nobody was, on each
# request until the join timeout, for as long as the value stayed: for ever without expiry.)
CLAIM = (
    ALWAYS
    + """
local holder = redis.pcall('GET', KEYS[1])  -- (WRONGTYPE: a table, the error)
local unreadable = type(holder) == 'table'
if type(holder) == 'string' then
  local mark, leader, rest = string.match(holder, '^([~=]?)(%x+)(.*)$')
  if leader == nil or #leader ~= 16 or redis.call('PTTL', KEYS[1]) < 0 then
    unreadable = true
  elseif mark == '~' and rest == '' then
    return {'stale', leader}
  elseif mark == '' and rest == '' then
    return {'follow', leader}
  elseif mark == '=' and string.match(rest, '^:%d+$') then
    local max_age, now = tonumber(ARGV[3]), redis.call('TIME')
    local age = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
      - tonumber(string.sub(rest, 2))
    if max_age < 0 or age < max_age then return {'replay', leader, age} end
  else
    unreadable = true
  end
end
local dropped = nil
if unreadable then
  redis.call('DEL', KEYS[1])
  dropped = 'dropped'
end
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return {'stored', dropped} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {'lead', dropped}
"""
)

# KEYS: lock, the stale call's key (``stale_keys`` + its token). ARGV: the stale token, the new
# token, lease ms. If the lock is still "~STALE": the stale call is set aside in its key, for
# what is left of its lease, and the lock is the new token's: {'lead'}. Otherwise {'again'}
# (the lock changed meanwhile, or something else wrote it: claim again).
TAKE = (
    ALWAYS
    + """
if redis.pcall('GET', KEYS[1]) ~= '~' .. ARGV[1] then return {'again'} end
local left = redis.call('PTTL', KEYS[1])
if left > 0 then redis.call('SET', KEYS[2], '1', 'PX', left) end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {'lead'}
"""
)

# KEYS: lock, stream, this call's stale key. ARGV: token, lease ms, stream PX ms. 1 if renewed
# (the lock, or the stale key once set aside), 0 if the lock is lost. (A key of another type
# under the lock's name, ``pcall``: no lock of ours, as for every script that reads it.)
RENEW = (
    ALWAYS
    + """
local holder = redis.pcall('GET', KEYS[1])
if holder == ARGV[1] or holder == '~' .. ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif redis.call('PEXPIRE', KEYS[3], ARGV[2]) == 0 then
  return 0
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
)

# KEYS: lock, stream, this call's stale key, and (a leader whose own clients all left) its
# followed key. ARGV: token, linger ms (0: none), stream PX ms, MAXLEN, then the final record's
# field, value pairs. The record always goes to this leader's own stream; the lock is changed
# only if it is still this leader's; a stale key goes. 1, or 0 if nothing was done: the
# followed key was given and exists (a follower reads the call: it goes on). One script, so a
# follower's claim comes either before (its reads set the key, or it reads this record having
# relayed nothing: ``flight_relay``) or after (no lock: it leads).
END = (
    ALWAYS
    + """
if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[3])
local holder = redis.pcall('GET', KEYS[1])
if holder == '~' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
elseif holder == ARGV[1] then
  if tonumber(ARGV[2]) > 0 then
    local now = redis.call('TIME')
    local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    redis.call('SET', KEYS[1], '=' .. ARGV[1] .. ':' .. string.format('%.0f', ms), 'PX', ARGV[2])
  else
    redis.call('DEL', KEYS[1])
  end
end
return 1
"""
)

# KEYS: a call's followed key. ARGV: lease ms. A follower's read says it follows the call (a
# script for its flag: it runs on a full Redis too, as the leader's do).
FOLLOWED = (
    ALWAYS
    + """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
return 1
"""
)

# KEYS: stream. ARGV: MAXLEN, stream PX ms, then per frame its index, its bytes and "1" if it
# is the usage frame (else "0"). A leader's frames, added to its stream (``flights._flush``).
FRAMES = (
    ALWAYS
    + """
for i = 3, #ARGV, 3 do
  if ARGV[i + 2] == '1' then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'i', ARGV[i], 'f', ARGV[i + 1], 'u', 1)
  else
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'i', ARGV[i], 'f', ARGV[i + 1])
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

# KEYS: lock. Drop it if it is a finished call's (lingering in the window); mark a running
# call's "~TOKEN" (stale: its followers stay, nobody new follows it, it is not replayed once
# finished; the next claim sets it aside and leads a fresh call). 1 if either.
FORGET = (
    ALWAYS
    + """
local holder = redis.call('GET', KEYS[1])
if not holder then return 0 end
local mark = string.sub(holder, 1, 1)
if mark == '=' then
  redis.call('DEL', KEYS[1])
  return 1
end
if mark ~= '~' then
  redis.call('SET', KEYS[1], '~' .. holder, 'KEEPTTL')
  return 1
end
return 0
"""
)

# A leader's error, rebuilt by its followers as the same class (``error_from``): one missing
# here reaches them as a plain ``UpstreamError``, without the headers its class sends
# (``UpstreamBusy``'s ``Retry-After``, a stalled stream's ``x-should-retry: false``).
_ERRORS: dict[str, type[UpstreamError]] = {
    cls.__name__: cls
    for cls in (
        UpstreamError,
        GatewayOverloaded,
        UpstreamBusy,
        UpstreamUnreachable,
        UpstreamTimeout,
        UpstreamNoAnswer,
        UpstreamStreamBroken,
        UpstreamStreamStalled,
        UpstreamAnswerCut,
        UpstreamAnswerUnreadable,
        UpstreamContentCoding,
        UpstreamKeyRefused,
        UpstreamRedirected,
        UpstreamBadStatus,
    )
}


def answer_record(answer: Answer, linger: bool = True) -> dict[str, Any]:
    """``linger``: whether the answer may linger where it is relayed (``lingers``)."""
    meta = {
        "k": answer.kind,
        "c": answer.complete,
        "t": answer.tokens,
        "cr": answer.created,
        "fl": None if answer.frames is None else len(answer.frames),
        "u": answer.usage_frame,
        "l": linger,
        "r": answer.requester,
    }
    return {"e": "a", "m": orjson.dumps(meta), "b": answer.body}


def lingers(meta: dict[str, Any]) -> bool:
    """Whether an answer record's answer may linger where it is relayed (a record without the
    field, written by an older instance: it may, as it did then)."""
    return meta.get("l") is not False


def error_record(error: CarpoolError) -> dict[str, Any]:
    if isinstance(error, UpstreamStatusError):
        return {
            "e": "x",
            "m": orjson.dumps(
                {
                    "c": "status",
                    "s": error.status,
                    "ct": error.content_type,
                    "rh": error.also,
                    "a": error.asked,
                    "r": error.requester,
                }
            ),
            "b": error.content,
        }
    return {
        "e": "x",
        "m": orjson.dumps(
            {
                "c": type(error).__name__,
                "s": error.status,
                "ty": error.type,
                "co": error.code,
                "msg": error.message,
                "r": getattr(error, "requester", None),
                "ue": getattr(error, "upstream_error", None),
            }
        ),
    }


def error_from(meta: dict[str, Any], body: bytes) -> CarpoolError:
    """The leader's error, as the same class with the same status, type, code and message
    (of a record ``final_from`` read)."""
    if meta["c"] == "status":
        # (``rh``, when to retry, is absent from an older instance's record.)
        retry = tuple((str(name), str(value)) for name, value in meta.get("rh") or ())
        status_error = UpstreamStatusError(meta["s"], body, meta["ct"], retry)
        # (``a`` and ``r`` are absent from an older instance's record.)
        status_error.asked, status_error.requester = meta.get("a"), meta.get("r")
        return status_error
    kind = _ERRORS.get(meta["c"], UpstreamError)
    error = kind(meta["msg"])
    error.status, error.type, error.code = meta["s"], meta["ty"], meta["co"]
    error.requester = meta.get("r")
    if isinstance(error, UpstreamStreamBroken) and isinstance(meta.get("ue"), dict):
        error.upstream_error = meta["ue"]
    return error


def answer_from(meta: dict[str, Any], body: bytes, frames: list[bytes] | None) -> Answer:
    """The leader's answer, with ``frames`` (None: served whole, without the usage frame), of
    a record ``final_from`` read."""
    answer = Answer(
        meta["k"],
        body,
        meta["c"],
        meta["t"],
        meta["cr"],
        frames,
        meta["u"] if frames is not None else None,
    )
    # (Absent from an older instance's record: not known, told to every client as to others.)
    answer.requester = meta.get("r")
    return answer


class Unreadable(ValueError):
    """An entry of a flight's stream that is none carpool writes (``frame_from``,
    ``final_from``): something else wrote it."""


def frame_from(fields: dict[bytes, bytes]) -> tuple[int, bytes, bool] | None:
    """A frame entry's index, bytes and whether it is the usage-only chunk; None for a final
    record (or what should be one: ``final_from`` reads it)."""
    frame = fields.get(b"f")
    if frame is None:
        return None
    index = fields.get(b"i", b"")
    if not index.isdigit():  # (ASCII digits only: no sign, no spaces)
        raise Unreadable("a frame without its index")
    return int(index), frame, b"u" in fields


def final_from(
    fields: dict[bytes, bytes], kind: str | None = None
) -> tuple[bytes, dict[str, Any], bytes]:
    """A final record's end (``a``, ``x``, ``g``), meta and body, checked, for ``answer_from``
    or ``error_from``: ``Unreadable`` if it is none carpool writes. ``kind``: the request's
    API's (None: any API's)."""
    end = fields.get(b"e")
    if end == b"g":
        return end, {}, b""
    if end not in (b"a", b"x"):
        raise Unreadable("an entry that is neither a frame nor a final record")
    try:
        meta = orjson.loads(fields.get(b"m", b""))
    except orjson.JSONDecodeError:
        raise Unreadable("a final record whose meta is no JSON") from None
    if not isinstance(meta, dict):
        raise Unreadable("a final record whose meta is no JSON object")
    body = fields.get(b"b")
    if end == b"a":
        _check_answer(meta, body, kind)
    else:
        _check_error(meta)
    return end, meta, body or b""


def _check_answer(meta: dict[str, Any], body: bytes | None, kind: str | None) -> None:
    if meta.get("k") not in APIS or (kind is not None and meta["k"] != kind):
        raise Unreadable(f"an answer of another API than {kind or 'any'}")
    count, usage, lingering = meta.get("fl"), meta.get("u"), meta.get("l")
    if not (
        "fl" in meta
        and "u" in meta
        and type(meta.get("c")) is bool
        and type(meta.get("t")) is int
        and type(meta.get("cr")) in (int, float)
        and (count is None or (type(count) is int and count >= 0))
        and (usage is None or (type(usage) is int and count is not None and 0 <= usage < count))
        and (lingering is None or type(lingering) is bool)  # (absent: an older instance's)
        and _text_or_none(meta.get("r"))
    ):
        raise Unreadable("an answer whose meta lacks a field or has one of another type")
    try:
        parsed = orjson.loads(body) if body is not None else None
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):  # (every API's answer is a JSON object)
        raise Unreadable("an answer whose body is no JSON object")


def _check_error(meta: dict[str, Any]) -> None:
    status, named = meta.get("s"), meta.get("c")
    if not (type(status) is int and 100 <= status <= 599):
        raise Unreadable("an error whose status is none HTTP defines")
    if named == "status":
        retry = meta.get("rh")
        readable = (
            not 200 <= status < 300  # (an upstream's 2xx is an answer, never this error)
            and "ct" in meta
            and _text_or_none(meta["ct"])
            and (
                retry is None
                or (
                    isinstance(retry, list)
                    and all(
                        isinstance(pair, list)
                        and len(pair) == 2
                        and all(isinstance(part, str) for part in pair)
                        for pair in retry
                    )
                )
            )
            and _text_or_none(meta.get("a"))
            and _text_or_none(meta.get("r"))
        )
    else:
        readable = (
            isinstance(named, str)
            and isinstance(meta.get("ty"), str)
            and "co" in meta
            and _text_or_none(meta["co"])
            and isinstance(meta.get("msg"), str)
            and _text_or_none(meta.get("r"))
        )
    if not readable:
        raise Unreadable("an error whose meta lacks a field or has one of another type")


def _text_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)
