"""URLs in the config: checked when the config loads, shown without their secrets.

- ``checked_url(value, schemes)``: the URL, or a ``ValueError`` that says what is wrong with it
  (a scheme not in ``schemes``, no host, a port that is no port, a malformed IPv6 address), so
  that ``carpool check-config`` refuses what ``carpool serve`` would fail on, both with exit 2
  naming the field. The message shows the URL through ``without_credentials``.
- ``without_credentials(url)``: the URL fit for a log line or an error message: any user and
  password replaced by ``***``, no query or fragment (where some services take their keys).
  It never raises, whatever the text.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from yarl import URL

_USERINFO = re.compile(r"//[^/?#]*@")


def without_credentials(url: str) -> str:
    text = url.split("#", 1)[0].split("?", 1)[0]
    try:
        parts = urlsplit(text)
    except ValueError:  # (a malformed IPv6 address): cut what could be a user and password
        return _USERINFO.sub("//***@", text)
    if "@" not in parts.netloc:
        return urlunsplit(parts)
    # (The port as written: ``parts.port`` raises on one that is not a number.)
    netloc = "***@" + parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=netloc))


def checked_url(value: str, schemes: tuple[str, ...]) -> str:
    shown = without_credentials(value)
    try:
        url = URL(value)
        url.port  # noqa: B018  (yarl checks the port when it is read)
    except ValueError as exc:  # (yarl's messages quote nothing of the URL)
        raise ValueError(f"{shown!r} is not a valid URL: {exc}") from None
    if url.scheme not in schemes:
        raise ValueError(f"{shown!r} is not a {' or '.join(schemes)} URL")
    if not url.host and url.scheme != "unix":
        raise ValueError(f"{shown!r} names no host")
    return value
