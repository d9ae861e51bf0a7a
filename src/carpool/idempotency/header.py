"""The ``Idempotency-Key`` header: ``parse_key``.

- ``parse_key(headers)`` reads ``idempotency-key``, else ``x-idempotency-key``; None when neither
  is sent. The value is a structured-field string (``"..."``, with ``\\"`` and ``\\\\`` escapes)
  or, leniently, the bare text. A quoted string may carry parameters (an RFC 8941 Item:
  ``"abc";p=1``), which are read past and ignored, as RFC 8941 asks of unknown ones. It is refused with ``IdempotencyKeyInvalid`` (400) when it is
  empty (or blank), longer than 255 characters once unquoted, or not a valid header string
  (anything outside printable ASCII 0x20-0x7E, a malformed quoted string), or when a bare
  value holds a comma (two header lines, joined: RFC 9110 5.3; a quoted key may hold one).
- The records take the key already scoped by the caller (tenant + the raw key): records never
  cross tenants. A backend outside the process hashes it before it goes into its key space.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .errors import IdempotencyKeyInvalid

HEADER = "idempotency-key"
HEADER_ALIAS = "x-idempotency-key"
MAX_KEY_LENGTH = 255
REPLAYED_HEADER = (b"idempotent-replayed", b"true")  # added to every replayed response
# An Item's parameters (RFC 8941 §3.1.2): ``;key`` or ``;key=bare-item`` (an integer or
# decimal, a string, a token, a byte sequence, a boolean), each key as the RFC spells it.
_PARAMETERS = re.compile(
    r';[ ]*[a-z*][a-z0-9_.*-]*(?:=(?:-?[0-9]+(?:\.[0-9]+)?|"(?:[^"\\]|\\["\\])*"'
    r"|[A-Za-z*][!#$%&'*+.^_`|~0-9A-Za-z:/-]*|:[A-Za-z0-9+/=]*:|\?[01]))?"
)


def parse_key(headers: Mapping[str, str]) -> str | None:
    """The idempotency key of a request, or None if it has none (header names lower-case).

    ``Idempotency-Key`` wins over ``X-Idempotency-Key``. Raises ``IdempotencyKeyInvalid``.
    """
    name = HEADER
    raw = headers.get(HEADER)
    if raw is None:
        name = HEADER_ALIAS
        raw = headers.get(HEADER_ALIAS)
        if raw is None:
            return None
    label = "Idempotency-Key" if name == HEADER else "X-Idempotency-Key"
    value = raw.strip(" \t")
    for char in value:
        if not " " <= char <= "~":
            raise IdempotencyKeyInvalid(
                f"The {label} header holds a character that is not printable ASCII "
                f"(U+{ord(char):04X})."
            )
    if value.startswith('"'):
        value = _sf_string(value, label)
    elif "," in value:
        # Two header lines arrive joined by a comma (RFC 9110 5.3): not one key the client
        # sent, and its retry with either line alone would not find the record.
        raise IdempotencyKeyInvalid(
            f"The {label} header holds more than one value (a comma): send one key, "
            "quoted if it holds a comma."
        )
    if not value.strip():
        raise IdempotencyKeyInvalid(f"The {label} header is empty.")
    if len(value) > MAX_KEY_LENGTH:
        raise IdempotencyKeyInvalid(
            f"The {label} header is {len(value)} characters long; at most {MAX_KEY_LENGTH} "
            "are allowed."
        )
    return value


def _sf_string(text: str, label: str) -> str:
    """The content of a structured-field string (RFC 8941 §3.3.3), printable ASCII already."""
    out: list[str] = []
    i, end = 1, len(text)
    while i < end:
        char = text[i]
        if char == "\\":
            if i + 1 < end and text[i + 1] in '"\\':
                out.append(text[i + 1])
                i += 2
                continue
            break
        if char == '"':
            rest, at = text[i + 1 :], 0
            while at < len(rest) and (parameter := _PARAMETERS.match(rest, at)) is not None:
                at = parameter.end()
            if at == len(rest):  # (nothing after the string but its parameters, if any)
                return "".join(out)
            break
        out.append(char)
        i += 1
    raise IdempotencyKeyInvalid(
        f"The {label} header is not a valid string: a quoted value "
        'must end with its closing quote and escape only \\" and \\\\.'
    )
