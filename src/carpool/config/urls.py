"""URLs in the config: checked when the config loads, shown without their secrets.

- ``checked_url(value, schemes)``: the URL, or a ``ValueError`` that says what is wrong with it
  (white space anywhere in it, a scheme not in ``schemes``, no host, a port that is no port, a
  malformed IPv6 address, a link-local one's zone), so
  that ``carpool check-config`` refuses what ``carpool serve`` would fail on, both with exit 2
  naming the field. The message shows the URL through ``without_credentials``.
- ``without_credentials(url)``: the URL fit for a log line or an error message: any user and
  password replaced by ``***``, no query or fragment (where some services take their keys).
  It never raises, whatever the text.
- ``urls_without_credentials(text)``: every URL in a text (a library's error message) so.
- ``checked_host(value)``: an address to listen on, or a ``ValueError``: empty (every interface,
  unsaid), or one no socket call could take (a NUL or another control character, a lone
  surrogate, a non-ASCII name IDNA cannot encode: a TypeError or UnicodeError traceback once
  serve bound it), or neither an IP address nor a host name (a scheme, a port, a path, white
  space, a dotted quad out of range: serve failed to listen on it, check-config said ok). An
  IPv6 address in brackets, as URLs write it (``[::1]``), is taken without them.
  ``Config.host`` and ``carpool sim --host``.
- ``url_host(host)``: ``host`` as a URL or a ``host:port`` writes it: an IPv6 address in
  brackets (``http://[::1]:8080``: ``http://::1:8080`` is no URL).
- ``has_credentials(url)``: whether the URL holds a user or a password (``any_credentials``: one
  of several, remembered). An upstream's are a
  credential the gateway holds (``Config.holds_upstream_credentials``): sent as
  ``Authorization: Basic`` in place of the client's (``upstream.http``), with every protection
  of a held key.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import re
import socket

from yarl import URL


def without_credentials(url: str) -> str:
    # Not parsed first: a password written with a raw "/", "?" or "#" (an invalid URL, as
    # people write them) would end the host part early and show. Everything up to the last
    # "@" goes (over a path with an "@" in it, the host too: safe), then the query and fragment.
    scheme, separator, rest = url.partition("://")
    if not separator:
        scheme, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return scheme + separator + rest.split("#", 1)[0].split("?", 1)[0]


# A URL in a library's message: a scheme, then anything up to white space or a quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def urls_without_credentials(text: str) -> str:
    return _URL_IN_TEXT.sub(lambda found: without_credentials(found.group()), text)


def has_credentials(url: str) -> bool:
    # Read as ``upstream.http`` reads the URL it sends Basic credentials from (yarl): an empty
    # userinfo (``http://@host``) is none, a password alone (``http://:pw@host``) is one.
    parsed = URL(url)  # (a URL ``checked_url`` passed)
    return parsed.user is not None or parsed.password is not None


# Cached: every key's scope asks (``Config.holds_upstream_credentials``), of the same few
# configured URLs, and parsing each takes a fraction of a microsecond.
@functools.lru_cache(maxsize=16)
def any_credentials(urls: tuple[str, ...]) -> bool:
    """Whether any of ``urls`` holds a user or a password (``has_credentials``)."""
    return any(map(has_credentials, urls))


def checked_url(value: str, schemes: tuple[str, ...]) -> str:
    shown = without_credentials(value)
    if any(c.isspace() for c in value):
        # No URL holds any (RFC 3986): yarl took "http://a b/v1" as a host no lookup finds, and
        # a trailing space as "%20" added to the path of every call.
        raise ValueError(f"{shown!r} holds white space: no URL does (in a path, write %20)")
    try:
        url = URL(value)
        url.port  # noqa: B018  (yarl checks the port when it is read)
    except ValueError as exc:  # (yarl's messages quote nothing of the URL)
        raise ValueError(f"{shown!r} is not a valid URL: {exc}") from None
    if url.scheme not in schemes:
        raise ValueError(f"{shown!r} is not a {' or '.join(schemes)} URL")
    if not url.host and url.scheme != "unix":
        raise ValueError(f"{shown!r} names no host")
    if "%" in (url.raw_host or ""):
        # A link-local address's zone (RFC 6874, "[fe80::1%25eth0]"): the cached endpoints' calls
        # reached it, pass-through's client looked the zone up as a name (a 502, and the replica
        # left out), and both sent it in the Host header, which no client may.
        raise ValueError(
            f"{shown!r} names an IPv6 zone (%25...): not supported; give a routable address or "
            "a host name"
        )
    return value


def checked_host(value: str) -> str:
    if not value.strip():
        # (uvicorn and socket.create_server would listen on every interface)
        raise ValueError(
            "give an address to listen on (127.0.0.1; 0.0.0.0 or :: for every interface)"
        )
    if not value.isprintable():  # (NUL, a control character, a lone surrogate)
        raise ValueError("it holds a control character or a lone surrogate: no address does")
    if value.startswith("[") and value.endswith("]"):
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(value[1:-1]).version == 6:
                return value[1:-1]  # (as a URL writes it: the address is inside)
    name = value
    if not value.isascii():
        try:
            name = value.encode("idna").decode("ascii")  # (as the socket calls encode it)
        except UnicodeError:
            raise ValueError("no host name: IDNA cannot encode it") from None
    try:
        ipaddress.ip_address(name)
        return value
    except ValueError:
        pass
    # A name, then: what check-config passed and serve could never listen on ("http://host",
    # "127.0.0.1:8080", "a b", "999.1.1.1") is said here, as serve would fail on it.
    if len(name.rstrip(".")) > 253 or not all(
        _LABEL.fullmatch(label) for label in name.rstrip(".").split(".")
    ):
        raise ValueError(
            f"{value!r} is no address to listen on: an IP address (127.0.0.1, ::) or a host "
            "name, with no scheme, port or path (the port is the port setting)"
        )
    if _NUMERIC.fullmatch(name):
        try:
            socket.inet_aton(name)  # ("127.1", "0", "2130706433": IPv4 as the socket calls read it)
        except OSError:
            raise ValueError(
                f"{value!r} is no IPv4 address (and no host name is all numbers)"
            ) from None
    return value


def url_host(host: str) -> str:
    """``host`` as a URL writes it (the module's contract)."""
    return f"[{host}]" if ":" in host else host


_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")  # a label (RFC 1123; _ as in Docker names)
_NUMERIC = re.compile(r"[0-9.]+")
