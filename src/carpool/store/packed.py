"""One exact-cache entry as one bytes object: the form in which the in-process store keeps every
entry (``store.memory``; its most recently used keep their objects too), hundreds of bytes less
than the objects.

Contract:
- ``unpack(pack(entry, tail))`` is an ``Entry`` equal to ``entry``: the same answer (kind, body,
  complete, tokens, created, frames, usage_frame), expiry, tags, namespace and prompt prefix;
  floats exactly, any text (lone surrogates too). Not kept: what an ``Answer`` computes on
  demand (frames it synthesized, ``usage_missing``): the unpacked one computes them again.
- ``tail``: up to 255 bytes the caller keeps with the entry (the store: the rest of its key),
  checked by ``has_tail`` without unpacking.
- ``expires(blob)`` reads the expiry alone, ``size(blob)`` what the blob holds in this process,
  ``matcher(selector)`` decides a ``Selector`` on blobs: none unpacks the usual entry.
- ``marked(blob)`` and ``unmarked(blob)``: the blob with the mark of a use set and cleared (for
  the store's second chance, ``lru``), the very blob if it already is so. Nothing else reads the
  mark: ``unpack``, ``expires``, ``size``, ``has_tail``, ``usual`` and ``matcher`` answer the
  same either way; ``pack`` leaves it cleared.
- A blob lives in this process only: its layout may change with any version.

Layout, little-endian: a head (flags u8, tail length u8, created f64, expires f64, a u32, b u16),
the tail, then either
- the usual entry (an answer of a known kind that did not stream, no tags, no namespace, tokens
  below 2**32, a prompt prefix under 64 KiB in UTF-8): the body, then the prompt prefix (UTF-8);
  a = tokens, b = the prefix's length;
- any other: ``marshal`` of (kind, tokens, frames, usage_frame, tags, namespace, prompt prefix),
  then the body; a = the marshal's length.
"""

from __future__ import annotations

import marshal
import struct
from collections.abc import Callable

from ..answer import Answer
from ..apis import APIS
from ..lru import held
from .base import Entry, Selector

_HEAD = struct.Struct("<BBddIH")
_HEAD_BYTES = _HEAD.size  # 24
TAIL_AT = _HEAD_BYTES  # where the tail starts; its length is the blob's second byte
_EXPIRES = struct.Struct("<d")  # at offset 10
_PREFIX_BYTES = struct.Struct("<H")  # at offset 22

_KINDS = tuple(APIS)  # the usual entry's kind, by its index in the flags
_KIND_INDEX = {kind: i for i, kind in enumerate(_KINDS)}
_KIND_MASK = 0b111
_GENERAL = 0b1000  # not the usual entry: its metadata is marshalled
_COMPLETE = 0b10000
#: The mark of a use (``marked``): its bit in a blob's first byte, for a check without a call.
USED = 0b100000
assert len(_KINDS) <= _KIND_MASK + 1
# The first byte of a marked and of an unmarked blob, by the first byte it had: a remark is a
# slice and a concatenation (a blob is immutable: the copy replaces it in its place in the map).
_MARKED = tuple(bytes((flags | USED,)) for flags in range(256))
_UNMARKED = tuple(bytes((flags & ~USED,)) for flags in range(256))

_SURROGATES = "surrogatepass"  # any str a prompt can hold, lone surrogates too, both ways


def pack(entry: Entry, tail: bytes = b"") -> bytes:
    """``entry`` as one bytes object, ``tail`` kept with it (see the module's contract)."""
    answer = entry.answer
    tokens, kind = answer.tokens, _KIND_INDEX.get(answer.kind)
    flags = _COMPLETE if answer.complete else 0
    prefix = entry.prompt_prefix.encode("utf-8", _SURROGATES)
    if (
        kind is not None
        and answer.frames is None
        and answer.usage_frame is None
        and not entry.tags
        and not entry.namespace
        and type(tokens) is int
        and 0 <= tokens < 1 << 32
        and len(prefix) < 1 << 16
    ):
        head = _HEAD.pack(
            flags | kind, len(tail), answer.created, entry.expires, tokens, len(prefix)
        )
        return b"".join((head, tail, answer.body, prefix))
    meta = marshal.dumps(
        (
            answer.kind,
            tokens,
            answer.frames,
            answer.usage_frame,
            entry.tags,
            entry.namespace,
            entry.prompt_prefix,
        )
    )
    head = _HEAD.pack(flags | _GENERAL, len(tail), answer.created, entry.expires, len(meta), 0)
    return b"".join((head, tail, meta, answer.body))


def unpack(blob: bytes) -> Entry:
    """The entry ``blob`` holds: new objects, equal to those packed."""
    flags, tail, created, expires, a, b = _HEAD.unpack_from(blob)
    start = _HEAD_BYTES + tail
    if flags & _GENERAL:
        end = start + a
        kind, tokens, frames, usage_frame, tags, namespace, prefix = marshal.loads(
            memoryview(blob)[start:end]
        )
        body = blob[end:]
    else:
        end = len(blob) - b
        kind, tokens, frames, usage_frame, tags, namespace = (
            _KINDS[flags & _KIND_MASK],
            a,
            None,
            None,
            (),
            "",
        )
        body = blob[start:end]
        prefix = blob[end:].decode("utf-8", _SURROGATES)
    answer = Answer.restored(
        kind, body, bool(flags & _COMPLETE), tokens, created, frames, usage_frame
    )
    return Entry(answer, expires, tags, namespace, prefix)


def marked(blob: bytes) -> bytes:
    """``blob`` marked used: itself if it is, else a copy with the mark."""
    return blob if blob[0] & USED else _MARKED[blob[0]] + blob[1:]


def unmarked(blob: bytes) -> bytes:
    """``blob`` not marked used: itself if it is not, else a copy without the mark."""
    return _UNMARKED[blob[0]] + blob[1:] if blob[0] & USED else blob


def usual(blob: bytes) -> bool:
    """Whether ``blob`` holds the usual entry (no frames, tags nor namespace: see the layout)."""
    return not blob[0] & _GENERAL


def has_tail(blob: bytes, tail: bytes) -> bool:
    """Whether ``blob`` was packed with ``tail``."""
    return blob[1] == len(tail) and blob.startswith(tail, _HEAD_BYTES)


def expires(blob: bytes) -> float:
    """The packed entry's ``expires``."""
    value: float = _EXPIRES.unpack_from(blob, 10)[0]
    return value


def size(blob: bytes) -> int:
    """What ``blob`` holds in this process (``lru.held``): one object, nothing it refers to."""
    return held(blob)


def matcher(selector: Selector) -> Callable[[bytes], bool]:
    """``selector.picks`` for packed entries: the usual entry (no tags, namespace "") is decided
    on its bytes; another is unpacked."""
    if selector.everything:
        return _always
    usual_namespace = selector.namespace == ""
    prefix = None if selector.prefix is None else selector.prefix.encode("utf-8", _SURROGATES)

    def picks(blob: bytes) -> bool:
        if blob[0] & _GENERAL:
            return selector.picks(unpack(blob))
        if usual_namespace:
            return True
        if prefix is None:
            return False
        # The prefix is the blob's end: UTF-8 keeps "starts with" (code point by code point).
        return blob.startswith(prefix, len(blob) - _PREFIX_BYTES.unpack_from(blob, 22)[0])

    return picks


def _always(blob: bytes) -> bool:
    return True
