"""JSON read with its integers as written, for what is parsed and then written, keyed or
assembled again.

Contract:
- ``loads(raw)`` is ``orjson.loads(raw)``: the same value, the same ``orjson.JSONDecodeError``
  for what is not JSON; but an integer literal outside the 64-bit range orjson reads as an
  integer ([-2**63, 2**64)), which orjson makes a double, silently rounded
  (123456789012345678901234567890 -> 1.2345678901234568e+29), comes back as a big integer: an
  ``orjson.Fragment`` of its digits, which ``orjson.dumps`` writes back as they came. A client's
  body, an upstream's answer or stream event parsed here and written again carries the
  integer it came with: to the upstream, in a stored, assembled or synthesized answer.
- A big integer is no ``int`` and no ``float`` (``is_big`` tells one): a field that must be an
  integer (``seed``, ``n``, ``top_k``) refuses it as it refused the rounded float, one that
  must be a number (``temperature``, ``top_p``) takes it; the fingerprint keys it by its
  value, written as its digits: never the float it rounds to, nor a string (``canonical``).
  ``big_int(n)`` makes one of an ``int``. (Fragments compare by identity, never by value.)
- The cost: text in which no such integer can stand (no 20 digits in a row after a separator,
  none of 19 after a minus: the usual body, event or answer) pays one ``bytes.translate`` and
  two searches beside orjson's parse, about a nanosecond a byte, and nothing more (a
  ``re.search(rb"\\d{19}")`` cost ten times as much). Text that may hold one (or a string
  that looks so: a rare second parse, never a wrong value) is parsed again by the standard
  library's ``json``, orjson having found it JSON (both take the last of duplicate keys), its
  integers in range ``int``s. Text nested deeper than that parser's recursion reaches keeps
  orjson's value (big integers rounded): a request body that deep is refused by its depth
  limit (``limits.max_json_depth``) before anything reads it.
- For what is written, keyed or assembled again; a reader of a status, an id or a count
  keeps ``orjson.loads``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# The integers orjson reads (and writes) as integers: [INT_MIN, INT_END).
INT_MIN, INT_END = -(2**63), 2**64


def _class_of(byte: int) -> int:
    """What can stand before a number in JSON (a separator, white space) as b" ", a minus as
    b"-", a digit as b"0", any other byte as b"x": an integer is a run of b"0" after b" " or
    b"-" (a fraction's or an exponent's digits follow an b"x": "." or "e")."""
    if byte in b"0123456789":
        return ord("0")
    if byte in b":[, \t\n\r":
        return ord(" ")
    return ord("-") if byte == ord("-") else ord("x")


_CLASSES = bytes(_class_of(byte) for byte in range(256))
# Every integer outside the range has 20 digits or more, or a minus and 19.
_POSITIVE = b" " + b"0" * 20
_NEGATIVE = b"-" + b"0" * 19


def loads(raw: bytes | bytearray | memoryview | str) -> Any:
    """``orjson.loads(raw)``, but for an integer outside 64 bits: a big integer (``is_big``)
    of its digits, not a rounded float."""
    value = orjson.loads(raw)
    data = raw.encode() if isinstance(raw, str) else bytes(raw)  # (bytes: itself, no copy)
    classes = data.translate(_CLASSES)
    # (``find``, not ``in``: see ``Api.frame``.)
    if (
        classes.find(_POSITIVE) == -1
        and classes.find(_NEGATIVE) == -1
        and not classes.startswith(_POSITIVE[1:])  # (a bare number)
    ):
        return value
    try:
        return json.loads(str(data, "utf-8"), parse_int=_integer)
    except RecursionError:
        return value  # (deeper than the standard parser goes: orjson's, as it was)


def _integer(literal: str) -> Any:
    """A JSON integer literal: an ``int`` within orjson's range, else a big integer."""
    if len(literal) > 21:  # (no int() of thousands of digits: Python refuses past 4300)
        return orjson.Fragment(literal)
    number = int(literal)
    return number if INT_MIN <= number < INT_END else orjson.Fragment(literal)


def is_big(value: Any) -> bool:
    """Whether ``value`` is a big integer ``loads`` read (or ``big_int`` made)."""
    return type(value) is orjson.Fragment


def big_int(number: int) -> Any:
    """``number`` as a big integer, written as its digits (any size, in range or not)."""
    return orjson.Fragment(str(number))
