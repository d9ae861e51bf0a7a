"""Server-sent events: decoding and framing.

Pure functions and one small state machine; no I/O. This module is on the gateway's hot path, so
the decoder works on bytes and takes a fast path for the usual ``\\n``-terminated stream. What an
OpenAI stream's chunks say (assembling them into a body, synthesizing them from one) is
:mod:`carpool.chunks`; judging a body (complete? how many tokens?) is :mod:`carpool.completeness`.
Both are re-exported here.

Contract:

- ``SSEDecoder().feed(data) -> list[tuple[str | None, bytes]]`` returns one ``(event, payload)``
  pair per event completed by ``data``, in order. ``payload`` is the event's ``data`` lines joined
  with ``b"\\n"`` (one optional space after ``data:`` stripped); ``event`` is the value of the
  event's ``event:`` field, or ``None`` when it had none (or an empty one). An upstream error sent
  mid-stream arrives as ``("error", payload)``. Comments and ``id:``/``retry:``/unknown fields are
  ignored; an event without ``data`` lines yields nothing (as the SSE spec says). Lines may end in
  ``\\r\\n``, ``\\r`` or ``\\n``, and input may be split at any byte. ``[DONE]`` is returned like
  any payload: stopping on it is the caller's job.
- ``SSEDecoder.close() -> list`` ends the stream. Per the SSE spec an event not terminated by a
  blank line is *discarded*, so it always returns ``[]``; ``decoder.truncated`` then tells whether
  such a partial event (or line) was thrown away, i.e. whether the stream was cut mid-event.
- ``frame(payload)`` is one SSE event carrying ``payload``; ``DONE`` is the closing event;
  ``event_frame(name, payload)`` is one named event (the typed streams of ``carpool.apis``).
"""

from __future__ import annotations

from .chunks import assemble, synthesize
from .completeness import expected_choices, is_complete, usage_tokens, well_formed

__all__ = [
    "DONE",
    "SSEDecoder",
    "SSEEvent",
    "assemble",
    "event_frame",
    "expected_choices",
    "frame",
    "is_complete",
    "synthesize",
    "usage_tokens",
    "well_formed",
]

DONE = b"data: [DONE]\n\n"

SSEEvent = tuple[str | None, bytes]  # (event name, data payload)

_BOM = b"\xef\xbb\xbf"


def frame(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (which must not contain a line break)."""
    return b"data: " + payload + b"\n\n"


def event_frame(name: bytes, payload: bytes) -> bytes:
    """One named SSE event (``event: name``) carrying ``payload`` (no line break in either)."""
    return b"event: " + name + b"\ndata: " + payload + b"\n\n"


class SSEDecoder:
    """Incremental decoder of an SSE byte stream; see the module docstring for the contract."""

    __slots__ = ("_tail", "_skip_lf", "_started", "_data", "_event", "truncated")

    def __init__(self) -> None:
        self._tail: list[bytes] = []  # bytes of the current, unterminated line
        self._skip_lf = False  # the last feed ended in "\r": a leading "\n" is its pair
        self._started = False  # a first line was seen (a BOM may only precede it)
        self._data: list[bytes] = []  # data lines of the current event
        self._event: str | None = None  # event name of the current event
        self.truncated = False  # set by close(): a partial event was discarded

    def feed(self, data: bytes) -> list[SSEEvent]:
        if not data:  # (nothing: a "\r" just read may still pair with the next "\n")
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        # (``find``, not ``in``: CPython's bytes ``in`` first tries its argument as an integer,
        # and makes and drops a TypeError; this runs for every read of every stream.)
        if data.find(b"\r") != -1:
            # Normalise to "\n"; a trailing "\r" may be the first half of a split "\r\n".
            self._skip_lf = data[-1:] == b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if data.find(b"\n") == -1:
            # No line ends here: keep the pieces, join them once (linear, however many feeds).
            if data:
                self._tail.append(data)
            return []
        if self._tail:
            self._tail.append(data)
            data = b"".join(self._tail)
            self._tail = []
        if not self._started:
            self._started = True
            if data.startswith(_BOM):
                data = data[3:]
        out: list[SSEEvent] = []
        if not self._data and self._event is None:
            # The usual stream: whole events, each one "data: ..." line and a blank one (the
            # only line breaks up to the last blank line are the blank lines). Anything else
            # goes line by line, below.
            end = data.rfind(b"\n\n")
            if end >= 0:
                whole = data[:end]
                blocks = whole.split(b"\n\n")
                if (
                    whole[:6] == b"data: "
                    and whole.count(b"\n\ndata: ") == len(blocks) - 1
                    and whole.count(b"\n") == 2 * len(blocks) - 2
                ):
                    out = [(None, block[6:]) for block in blocks]
                    data = data[end + 2 :]
        lines = data.split(b"\n")
        rest = lines.pop()
        if rest:
            self._tail.append(rest)
        for line in lines:
            self._line(line, out)
        return out

    def _line(self, line: bytes, out: list[SSEEvent]) -> None:
        if line.startswith(b"data:"):  # the common case first
            value = line[5:]
            self._data.append(value[1:] if value[:1] == b" " else value)
        elif not line:
            if self._data:
                out.append((self._event, b"\n".join(self._data)))
                self._data = []
            self._event = None
        elif line[:1] == b":":
            pass  # a comment (keep-alive)
        else:
            name, colon, value = line.partition(b":")
            if value[:1] == b" ":
                value = value[1:]
            if name == b"data":  # "data" without a colon: an empty data line
                self._data.append(value)
            elif name == b"event":
                self._event = value.decode("utf-8", "replace") or None

    def close(self) -> list[SSEEvent]:
        """End of stream: an unterminated event is discarded (SSE spec), so this returns []."""
        self.truncated = bool(self._tail or self._data)
        self._tail, self._data, self._event, self._skip_lf = [], [], None, False
        return []
