"""The one HTTP/1.1 client of the benchmarks and of ``carpool bench``: lean, so that what it
measures is the server's time, not its own.

Contract:
- ``Conn``: one keep-alive connection (an asyncio protocol feeding httptools' response parser),
  one request at a time: ``conn.request(raw)`` writes the raw request and returns a future of its
  ``Response``; a connection lost or a response that does not parse fails that future.
  ``conn.reusable``: still open, and the server keeps it alive (no ``Connection: close``).
- ``Response``: the status, the ``x-carpool`` header (``carpool``), the content type, whether
  LiteLLM's ``x-litellm-cache-key`` header came (``litellm_hit``: LiteLLM sets it only on a
  cache hit), the body (de-chunked), and two ``time.monotonic()`` readings: ``first_at`` when the
  first body bytes were parsed (None without a body) and ``at`` when the last were.
  CLOCK_MONOTONIC is one clock for every process on Linux, so they compare with a server's.
- ``Address``: host, port, TLS and path prefix of a base URL (``Address.parse``); ``local(port)``
  is 127.0.0.1. ``build(method, path, address, body, headers)``: the raw request bytes, with
  ``host``, ``content-length``, and ``content-type: application/json`` when there is a body and
  ``headers`` name no content type; ``path`` goes after the address's prefix. ``headers`` are
  written as given, unchecked: a caller that takes them from a user checks them (``recorded.py``).
- ``connect(address)``, ``connect_many(address, n)`` (opened ``batch`` at a time) and
  ``close(conns)``.
- ``Pool(address)``: ``await pool.request(raw, timeout)`` sends on an idle connection, or a new one
  when none is idle (no limit: as many as requests in flight), and keeps the connection for the
  next request when it is reusable. A failure or a timeout aborts that connection.
- ``fetch(method, url, json_body, headers)``: one blocking request (urllib) for a scenario's setup
  and checks, outside anything timed: ``(status, headers with lower-case names, body)``; an
  error status is returned, not raised. Neither it nor ``Conn`` goes through a proxy
  (``HTTP_PROXY`` and the like are not read; ``DIRECT``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httptools

LOCALHOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int
    tls: bool = False
    prefix: str = ""  # a path before every request's path, without a trailing slash

    @classmethod
    def parse(cls, url: str) -> Address:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, parts.path.rstrip("/"))

    @classmethod
    def local(cls, port: int) -> Address:
        return cls(LOCALHOST, port)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.netloc}{self.prefix}"

    @property
    def netloc(self) -> str:
        """``host:port`` as a URL and the Host header write it: an IPv6 address in brackets
        (``urlsplit``'s ``hostname`` has none)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(slots=True)
class Response:
    status: int
    carpool: str | None
    body: bytes
    at: float  # time.monotonic() when the last byte was parsed
    first_at: float | None = None  # ... and the first body bytes
    content_type: str | None = None
    litellm_hit: bool = False


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.future: asyncio.Future[Response] | None = None
        self.closed = False
        self._begin()

    def _begin(self) -> None:
        self.carpool: str | None = None
        self.content_type: str | None = None
        self.litellm_hit = False
        self.body: list[bytes] = []
        self.first_at: float | None = None

    @property
    def reusable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def request(self, raw: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.future = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.future

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, error: Exception) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (a stream transport: create_connection)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self.closed = True
            self._fail(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"connection lost: {exc!r}"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name)
        if size == 9 and name.lower() == b"x-carpool":
            self.carpool = value.decode()
        elif size == 12 and name.lower() == b"content-type":
            self.content_type = value.decode()
        elif size == 19 and name.lower() == b"x-litellm-cache-key":
            self.litellm_hit = True

    def on_body(self, body: bytes) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.body.append(body)

    def on_message_complete(self) -> None:
        at = time.monotonic()
        if not self.parser.should_keep_alive():
            self.closed = True
        future = self.future
        if future is not None and not future.done():
            future.set_result(
                Response(
                    self.parser.get_status_code(),
                    self.carpool,
                    b"".join(self.body),
                    at,
                    self.first_at,
                    self.content_type,
                    self.litellm_hit,
                )
            )


def build(
    method: str,
    path: str,
    address: Address,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
) -> bytes:
    headers = headers or {}
    lines = [
        f"{method} {address.prefix}{path} HTTP/1.1",
        f"host: {address.netloc}",
        f"content-length: {len(body)}",
    ]
    if body and not any(name.lower() == "content-type" for name in headers):
        lines.append("content-type: application/json")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def connect(address: Address) -> Conn:
    loop = asyncio.get_running_loop()
    if address.tls:
        context = ssl.create_default_context()
        _, conn = await loop.create_connection(
            Conn, address.host, address.port, ssl=context, server_hostname=address.host
        )
    else:
        _, conn = await loop.create_connection(Conn, address.host, address.port)
    return conn


async def connect_many(address: Address, n: int, batch: int = 250) -> list[Conn]:
    conns: list[Conn] = []
    for start in range(0, n, batch):
        conns += await asyncio.gather(*(connect(address) for _ in range(min(batch, n - start))))
    return conns


def close(conns: Iterable[Conn]) -> None:
    for conn in conns:
        conn.close()


class Pool:
    """Connections to one address, reused one request at a time; no limit on how many."""

    def __init__(self, address: Address) -> None:
        self.address = address
        self.idle: list[Conn] = []

    async def request(self, raw: bytes, timeout: float | None = None) -> Response:
        conn = None
        while self.idle and conn is None:
            candidate = self.idle.pop()
            if candidate.reusable:
                conn = candidate
        if conn is None:
            conn = await connect(self.address)
        try:
            # (asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the answer when a
            # cancel comes in the same turn of the loop, and SIGTERM's one cancel is lost.)
            async with asyncio.timeout(timeout):
                response = await conn.request(raw)
        except BaseException:
            conn.abort()
            raise
        if conn.reusable:
            self.idle.append(conn)
        else:
            conn.close()
        return response

    def close(self) -> None:
        close(self.idle)
        self.idle.clear()


def fetch(
    method: str,
    url: str,
    json_body: Any = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, dict[str, str], bytes]:
    data = None if json_body is None else json.dumps(json_body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("content-type", "application/json")
    try:
        with DIRECT.open(request, timeout=timeout) as response:
            return response.status, _lower(response.headers.items()), response.read()
    except urllib.error.HTTPError as error:
        return error.code, _lower(error.headers.items()), error.read()


# Proxies left out (HTTP_PROXY and the like), as the load client (``Conn``) leaves them (the
# gateway uses them for its upstreams and judge only, never for a loopback host): urlopen's own
# opener sent a run's setup and checks through one, and the embedded gateway's probes on
# loopback too (a run failed as if it never started).
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in items}
