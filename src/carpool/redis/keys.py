"""What the Redis layers share about key names, and the one reply shape two of them read.

Contract:
- A key prefix (``distributed.key_prefix``) must not contain ``{`` or ``}``: the layers put a
  Redis Cluster hash tag after it (``check_prefix`` raises ``ValueError``).
- ``key_id(key)`` is the ``ID`` of a cache key in key names, and its hash tag: the fingerprint as
  it is when it is one (32 lowercase hex digits); any other key is replaced by its 40-hex BLAKE2b
  digest (no raw text in a key; the lengths keep both spaces apart): ``ENTRY_ID`` matches
  both, and nothing else. The exact store's entry and
  a flight's lock and streams for the same key share that ID, so one slot.
- ``digest(text)``: user input (tags, namespaces) is only ever its 32-hex BLAKE2b digest in a
  key name.
- ``glob_escape(text)`` is ``text`` matched literally in a SCAN/KEYS pattern.
- ``tagged(prefix, family)`` is how a layer finds its own keys ``P family{ID}`` (an entry, a
  lock) by SCAN: the pattern, and the whole name that a key the pattern matched must have to be
  carpool's (its group 1: the ID). A SCAN pattern is no boundary: another deployment's prefix
  may begin with this one's (``carpool:e:`` under ``carpool:``, its every key matching
  ``carpool:e:*``), and another app may write under it. Only a key whose whole name is one
  carpool writes is acted on.
- ``xread_entries(reply)`` is the entries of a one-stream XREAD reply, whichever protocol
  (RESP2 or RESP3) the client speaks.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

__all__ = [
    "ENTRY_ID",
    "check_prefix",
    "digest",
    "glob_escape",
    "key_id",
    "tagged",
    "xread_entries",
]

_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
ENTRY_ID = re.compile(rb"[0-9a-f]{32}|[0-9a-f]{40}")


def check_prefix(prefix: str) -> None:
    """Refuse a prefix that would break the hash tags."""
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"the Redis key prefix {prefix!r} must not contain '{{' or '}}'")


def key_id(key: str) -> str:
    """The ``ID`` of ``key`` in Redis key names: its hash tag."""
    if _FINGERPRINT.fullmatch(key):
        return key
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN/KEYS pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def tagged(prefix: str, family: str) -> tuple[str, re.Pattern[bytes]]:
    """The keys ``prefix + family + "{ID}"``: a SCAN pattern for them (which matches other keys
    too), and the whole name of one, to ``fullmatch`` each key found (group 1: the ID)."""
    start = prefix + family
    name = re.escape(start.encode()) + rb"\{(" + ENTRY_ID.pattern + rb")\}"
    return glob_escape(start) + "{*}", re.compile(name)


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
