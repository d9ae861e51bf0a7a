"""Which HTTP proxy, if any, an upstream is reached through: the environment's, read as curl,
Go's net/http and the openai SDK (httpx) read it, so that a gateway behind an egress proxy
reaches OpenAI where its clients' SDKs did.

Contract:
- ``proxy_for(url, setting)``: the ``Proxy`` for an upstream URL, or None (directly).
  ``setting`` is ``upstream.proxy``: ``"none"``, never; ``"env"`` (the default): ``HTTPS_PROXY``
  for an https upstream, ``HTTP_PROXY`` for an http one, ``ALL_PROXY`` for either when that one
  is unset (each in lower or upper case, the lower first; ``HTTP_PROXY`` upper-case not read
  when ``REQUEST_METHOD`` is set, a CGI's: ``urllib.request.getproxies_environment``), unless
  ``NO_PROXY`` names the host (``_excluded``: domains, addresses and ranges of them, with or
  without a port, ``*`` for all). A loopback host
  (``localhost``, 127.0.0.0/8, ::1) is always reached directly, as Go's ``ProxyFromEnvironment``
  does: a gateway beside its engine, with the proxy variables of its host set for the
  internet, must not send its calls out and back.
- Only an ``http://`` proxy is used (a CONNECT tunnel for an https upstream, its requests in
  absolute form for an http one: ``upstream.wire``, aiohttp for pass-through). Another scheme
  (``https://``, ``socks5://``) or a URL that does not parse is ``Unusable``, which ``carpool
  serve`` logs as a warning, the upstream then reached directly (``usable_proxy``) as it was
  before the gateway read the variables.
- A user and password in the proxy's URL are sent as ``Proxy-Authorization: Basic`` (percent-
  decoded) to the proxy only: never to the upstream, never in a log line or an error message
  (``Proxy.public``: the URL without them); a proxy that refuses them is a 407 the upstream's
  callers see as "unreachable (proxy answered 407)".
- Redis, calls between workers and ``carpool bench``'s own requests never go through a proxy.
- An http upstream's calls go to the proxy in full, so the proxy's own answers come as the
  upstream's would. ``proxy_error`` reads what a proxy says of one it made itself: the
  ``error`` of the last member of RFC 9209's ``Proxy-Status`` (the proxy nearest the gateway;
  a member without one relayed the upstream's answer), or Squid's ``X-Squid-Error`` code.
  ``sent_nothing`` tells the errors that come before the call reached the upstream (it may be
  tried on another replica) from those after it may have (a read timeout, a connection the
  upstream closed: the engine may have run it, and a call is never run twice).
"""

from __future__ import annotations

import base64
import ipaddress
import urllib.request
from dataclasses import dataclass, field

from yarl import URL

from ..config.urls import without_credentials

__all__ = ["Proxy", "Unusable", "proxy_error", "proxy_for", "sent_nothing", "usable_proxy"]


@dataclass(frozen=True)
class Proxy:
    host: str
    port: int
    #: The proxy's URL without its credentials: what a log line may say.
    public: str
    #: The variable it came from (``HTTPS_PROXY``...), for the log line.
    variable: str
    #: The user and password of the proxy's URL (percent-decoded), or None.
    credentials: tuple[str, str] | None = field(default=None, repr=False)

    @property
    def authorization(self) -> str | None:
        """``Proxy-Authorization``'s value (``Basic``), or None."""
        if self.credentials is None:
            return None
        pair = ":".join(self.credentials).encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")

    @property
    def url(self) -> str:
        """``http://host:port``: what aiohttp is given (credentials apart, as a header)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def connect_head(self, host: str, port: int) -> bytes:
        """The request opening a tunnel to ``host:port`` (RFC 9110 9.3.6)."""
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        auth = f"proxy-authorization: {self.authorization}\r\n" if self.authorization else ""
        return f"CONNECT {target} HTTP/1.1\r\nhost: {target}\r\n{auth}\r\n".encode("latin-1")


class Unusable(ValueError):
    """A proxy variable set for an upstream that the gateway cannot use (see the contract)."""


def proxy_for(url: str, setting: str = "env") -> Proxy | None:
    """The proxy ``url`` is reached through (see the module's contract); ``Unusable`` if the
    environment names one the gateway cannot use."""
    if setting == "none":
        return None
    target = URL(url)
    host = (target.raw_host or "").lower()
    if _loopback(host):
        return None
    found = urllib.request.getproxies_environment()
    scheme = target.scheme
    chosen = scheme if found.get(scheme) else "all"
    value = found.get(chosen)
    if not value:
        return None
    if _excluded(host, target.port, found.get("no", "")):
        return None
    variable = f"{chosen.upper()}_PROXY"
    public = without_credentials(value)
    try:
        proxy = URL(value if "://" in value else "http://" + value)  # (curl's: no scheme, http)
        port = proxy.port
    except ValueError:
        raise Unusable(f"{variable} ({public}) is not a URL") from None
    if proxy.scheme != "http" or not proxy.raw_host or port is None:
        raise Unusable(f"{variable} ({public}) is not an http:// proxy, the only kind carpool uses")
    credentials = None
    if proxy.user is not None or proxy.password is not None:
        # (yarl's ``user`` and ``password`` are percent-decoded, as curl sends them.)
        credentials = (proxy.user or "", proxy.password or "")
    return Proxy(proxy.raw_host, port, public, variable, credentials)


def _excluded(host: str, port: int | None, no_proxy: str) -> bool:
    """Whether ``NO_PROXY`` names ``host`` (``port`` its port), as curl and Go read it: ``*``,
    or entries apart by commas, each a domain (the name and every name under it; a leading dot
    changes nothing), an IP address or a range of them (``10.0.0.0/8``), with ``:port`` to
    name one port only (an IPv6 address in brackets then)."""
    for entry in no_proxy.lower().split(","):
        entry = entry.strip()
        if entry == "*":
            return True
        name, colon, only = entry.rpartition(":")
        if not (colon and only.isdigit()) or (name.count(":") and not name.startswith("[")):
            name, only = entry, ""  # (no port, or an IPv6 address's last group)
        if not name or (only and int(only) != port):
            continue
        name = name.strip("[]").lstrip(".")
        try:
            if ipaddress.ip_address(host) in ipaddress.ip_network(name, strict=False):
                return True
            continue
        except ValueError:
            pass  # (a name, or an address against a name)
        if host == name or host.endswith("." + name):
            return True
    return False


def _loopback(host: str) -> bool:
    if host in ("localhost", "localhost.") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def usable_proxy(url: str, setting: str = "env") -> Proxy | None:
    """``proxy_for``, or None (directly) for one the gateway cannot use: what the upstreams are
    built with (``carpool serve`` warned of it as it started)."""
    try:
        return proxy_for(url, setting)
    except Unusable:
        return None


# Errors a proxy names before it sent the call on: RFC 9209's types (prefixes end in "_") and
# Squid's codes. Any other error of the proxy's may have come after the upstream took the call.
_SENT_NOTHING = (
    "dns_",
    "destination_",
    "tls_",
    "connection_refused",
    "connection_timeout",
    "connection_limit_reached",
    "http_request_denied",
    "http_request_error",
    "proxy_configuration_error",
    "proxy_loop_detected",
    "proxy_internal_response",
    "ERR_ACCESS_DENIED",
    "ERR_CACHE_ACCESS_DENIED",
    "ERR_CONNECT_FAIL",
    "ERR_DNS_FAIL",
    "ERR_CANNOT_FORWARD",
    "ERR_FORWARDING_DENIED",
    "ERR_TOO_BIG",
    "ERR_INVALID_REQ",
    "ERR_INVALID_URL",
    "ERR_UNSUP_REQ",
)


def proxy_error(proxy_status: str, squid_error: str) -> str | None:
    """The error a proxy gives for an answer it made itself (see the contract), or None: the
    ``error`` parameter of the last ``Proxy-Status`` member (every line of it joined by commas),
    else the code of ``X-Squid-Error`` ("ERR_ACCESS_DENIED 0")."""
    if proxy_status:
        last = _outside_quotes(proxy_status, ",")[-1]
        for parameter in _outside_quotes(last, ";")[1:]:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "error":
                return value.strip().strip('"') or None
        return None  # (the nearest proxy relayed the answer: not its own)
    code = squid_error.split(" ", 1)[0].strip()
    return code or None


def sent_nothing(error: str) -> bool:
    """Whether a proxy's ``error`` (``proxy_error``) came before the call reached the upstream."""
    return error.startswith(_SENT_NOTHING)


def _outside_quotes(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` where it is not inside a quoted string (RFC 9651)."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\" and quoted:
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == separator and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts
