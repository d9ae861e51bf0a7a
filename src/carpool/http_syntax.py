"""RFC 9110's header syntax, written once for every place that checks a header before it
goes on the wire (the upstream client, the library's headers, config, `carpool bench`).

Contract:
- ``TOKEN`` full-matches a header name (RFC 9110 5.1: ``tchar``, no space, tab, colon or
  separator).
- ``CONTROL`` finds what no header value may hold (RFC 9110 5.5: a control character but the
  tab), so no value can end its line and start another.
- ``value_bytes(value)``: a header value's bytes on the wire. A client's value is read by the
  server a byte a character (latin-1: the gateway keeps it so, ``server._decoded``), and goes
  back out as those bytes, byte for byte: UTF-8 would make every byte over 0x7f two (a client
  key written in UTF-8 was another key upstream). A value beyond latin-1 can only be text a
  library caller gave (``Gateway.request``): its UTF-8.
- ``cache_directives(cache_control)``: a ``Cache-Control`` value's directives as (name, argument)
  pairs, names lower-cased and stripped, arguments as written (lower-cased; a quoted argument's
  commas split it too: only a name is to be read from what comes after one). Read so for a
  request's controls (``request.parse_controls``) and an answer's (below).
- ``shared_cache_may_store(cache_control)``: whether an answer whose ``Cache-Control`` (its
  lines joined by ", ") is ``cache_control`` may be stored by a shared cache (RFC 9111 3):
  not with ``no-store`` (5.2.2.3) nor ``private`` (5.2.2.7, with field names or without: the
  gateway does not store an answer in part), directive names read case-insensitively.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def cache_directives(cache_control: str) -> Iterator[tuple[str, str]]:
    """(name, argument) of each directive of ``cache_control`` (see the contract)."""
    for directive in cache_control.lower().split(","):
        name, _, argument = directive.partition("=")
        # ("max-age = 5": RFC 9110 allows no spaces; a client sent them)
        yield name.strip(), argument


def shared_cache_may_store(cache_control: str) -> bool:
    """Whether a shared cache may store an answer that says ``cache_control`` (see the
    contract)."""
    return not any(name in ("no-store", "private") for name, _ in cache_directives(cache_control))


def value_bytes(value: str) -> bytes:
    """``value`` as it goes on the wire: a client's bytes as it sent them (see the contract)."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape")
