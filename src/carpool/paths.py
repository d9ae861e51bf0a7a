"""Pass-through paths: what a client may reach under an upstream's ``/v1``, and how it is sent.

Contract (CONTRACT.md "HTTP surface": never outside the upstream's ``/v1``):
- ``confine(raw_path, allow)`` takes the request's path *as it came on the wire* (ASGI
  ``raw_path``, before any percent-decoding) and returns the path relative to ``/v1`` to forward,
  e.g. ``"/models/m1"``, or raises ``PathRefused`` (400) / ``PathNotAllowed`` (403).
- Refused (400), whatever the allow-list: a path that does not start with ``/v1/`` as sent; a
  dot segment (``.`` or ``..``, also before a ``;`` parameter) raw or percent-encoded at any depth
  (``%2e``, ``%2E``, ``%252e``...) or after Unicode NFKC folding (full-width dots); an encoded
  ``/`` or ``\\`` (``%2f``, ``%5c``, at any depth); a backslash; a control character (NUL, DEL,
  C1) or a space; a ``%`` that is not an escape; a byte outside ASCII, or escapes that do not
  decode to UTF-8 (overlong forms such as ``%c0%ae``); an empty segment (``//``;
  a single trailing ``/`` is kept). Each segment is decoded up to ``MAX_DECODES`` times to look
  for these; still changing after that is refused too. Why every depth: a proxy or engine in
  front of the admin routes (``/metrics``, ``/health``, cache flush, sleep) may decode once more
  than we do, and whoever resolves dot segments (yarl, the engine's router) must find none.
- Forwarded: each segment decoded once and re-encoded canonically (``quote`` with the RFC 3986
  ``pchar`` set), joined under ``/``; the caller appends it to the upstream's base URL (which ends
  in ``/v1``) and must send it as is, without resolving or re-quoting it.
- ``allow``: prefixes relative to ``/v1`` (``config.passthrough.allow``), matched by whole
  decoded segments; ``"/"`` allows everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import quote, unquote_to_bytes

from .errors import PathNotAllowed, PathRefused
from .unicode_forms import normal_form

MAX_DECODES = 4
# RFC 3986 pchar minus "%" (unreserved, sub-delims, ":" and "@"): kept as they are when re-encoding.
_PCHAR = "!$&'()*+,;=:@-._~"
_HEX = frozenset("0123456789abcdefABCDEF")


def confine(raw_path: bytes, allow: Sequence[str] = ("/",)) -> str:
    """The path relative to the upstream's ``/v1`` to forward (see the module doc)."""
    if not raw_path.startswith(b"/v1/"):
        raise PathRefused("the path must start with /v1/ as sent, without encoded characters")
    rest = raw_path[4:]
    if not rest.isascii():
        raise PathRefused("the path holds bytes outside ASCII (percent-encode them)")
    raw_segments = rest.decode("ascii").split("/") if rest else []  # [] for "/v1/" itself
    trailing = len(raw_segments) > 1 and raw_segments[-1] == ""
    if trailing:
        raw_segments.pop()
    decoded = [_segment(s) for s in raw_segments]
    texts = [text for text, _ in decoded]
    if not _allowed(texts, allow):
        raise PathNotAllowed("/" + "/".join(texts))
    return (
        "/" + "/".join(quote(once, safe=_PCHAR) for _, once in decoded) + ("/" if trailing else "")
    )


def _segment(raw: str) -> tuple[str, bytes]:
    """One raw segment, checked at every depth of decoding: its once-decoded text and bytes."""
    if raw == "":
        raise PathRefused("the path has an empty segment (//)")
    _check_escapes(raw)
    _check_text(raw)
    once = unquote_to_bytes(raw)
    previous, text = raw, _utf8(once)
    for _ in range(MAX_DECODES):
        _check_text(text)
        if text == previous:
            return _utf8(once), once
        previous, text = text, _utf8(unquote_to_bytes(text))
    raise PathRefused("the path is percent-encoded too many times over")


def _utf8(data: bytes) -> str:
    # Strict: an overlong form ("%c0%ae") is a dot to a lenient decoder further on.
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PathRefused("the path does not decode to UTF-8 text") from None


def _check_escapes(raw: str) -> None:
    at = raw.find("%")
    while at >= 0:
        pair = raw[at + 1 : at + 3]
        if len(pair) != 2 or not all(c in _HEX for c in pair):
            raise PathRefused("the path holds a % that is not a percent-escape")
        at = raw.find("%", at + 3)


def _check_text(text: str) -> None:
    """Refuse what a decoder at this depth would see as leaving the path, or as control."""
    compatible = normal_form("NFKC", text)
    if compatible is None:  # (its NFKC would be quadratic: ``unicode_forms``)
        raise PathRefused("the path holds a run of combining marks longer than any language's")
    for form in (text, compatible):
        if "/" in form or "\\" in form:
            raise PathRefused("the path holds an encoded / or \\, or a backslash")
        if any(c.isspace() or not c.isprintable() for c in form):
            raise PathRefused("the path holds a control character or white space")
        # "." and ".."; also "..;x" (servlet path parameters) and "...", which some servers
        # resolve like ".." (Windows drops trailing dots).
        if form.split(";", 1)[0].strip(".") == "":
            raise PathRefused(
                "the path holds a dot segment (. or ..), maybe percent-encoded, or an empty one"
            )


def _allowed(segments: list[str], allow: Sequence[str]) -> bool:
    for prefix in allow:
        wanted = [s for s in prefix.split("/") if s]
        if segments[: len(wanted)] == wanted:
            return True
    return False
