"""A real OpenAI-compatible replica over pooled HTTP (vLLM, SGLang, TGI, Ollama, OpenAI).

Contract (on top of ``upstream.base``):
- The calls of the cached endpoints (``send``: every miss and bypass) go through
  ``upstream.wire``, a lean HTTP/1.1 client: one pool of kept connections per replica, opened on
  first use (inside the event loop), at most ``limits.upstream_max_connections``, an idle one
  kept ``limits.upstream_keepalive`` seconds; connect and answer timeouts from ``limits``. A
  call that found every connection in use for ``limits.upstream_queue_timeout`` (long streams
  hold theirs as long as they run) is ``UpstreamBusy`` (``busy``: a 503, nothing sent, no
  verdict on the replica; pass-through's aiohttp pool sets no such bound). A
  call that meets the keep-alive race (the server drops a kept connection as the call goes out
  on it, before it could read the call whole) is sent again on a new connection by
  ``upstream.wire``, not failed (no 502, no healthy replica left out), and counted
  (``resent``). Measured on this machine, aiohttp spent
  about 0.25 ms of CPU on each such call, this about a fifth of that (benchmarks/README.md).
  A stream that ended whole (its ``[DONE]``, or a typed stream's last event)
  gives its connection back to the pool; any other closes it: one left part-way (the engine
  stops), one broken, and one whose body ended without it (a server closing the connection
  after an empty stream, llama-cpp-python's: the next call went on it, a 502).
- ``limits.upstream_timeout`` bounds such a call's answer (``upstream.wire``'s
  ``answer_timeout``): a whole answer's head and body must both come within it of the call
  being sent, bytes trickling in or not; a stream's first event within it of the call, and
  each next one within it of the one before (``wire_payloads`` notes each read that brought
  an event, ``Answer.progressed``: an SSE comment, a keep-alive, is none). Bytes alone kept
  such a call, and every client of its flight, waiting for ever. Past it the call's
  connection is closed (never reused: the engine stops) and its clients get a timeout (504
  ``upstream_timeout``; a streaming client sent frames already, the error event). Pass-through
  keeps aiohttp's timeout between two reads: its body goes as it comes to its one client, to
  which each byte is news; so does a worker's relay of another worker's stream
  (``sse_payloads``), whose own call is bounded so.
- Pass-through (any method, any body, relayed raw) keeps one ``aiohttp.ClientSession`` per
  replica, opened on first use, with the same limits and no cookie jar (an upstream's
  ``Set-Cookie`` is relayed to the client it answered, never kept and sent on another's call:
  a client's ``Cookie`` reaches the upstream as it sent it, and only its own); an answer's connection is let go once
  its body is read, or when the answer is closed (``PassthroughResponse.aclose``), read or not:
  aborted then if its body had not come to its end (its client left: the engine stops; over
  TLS a clean close would keep the socket open up to 30 s, ``upstream.wire``). A kept
  connection with anything to read before a call goes out on it (an answer nobody asked for)
  is closed, never reused (``_Connector.connect``), as ``wire`` does: its bytes would be the
  next call's answer, one tenant's to another.
- Through an HTTP proxy (``proxy``: ``upstream.proxy``'s choice for this replica's URL), on
  both transports: an https replica's calls in a CONNECT tunnel (``wire``'s; aiohttp's for
  pass-through), an http one's sent to the proxy naming the replica's URL in full; the proxy's
  credentials to it alone. Its refusal (a 407, a CONNECT answered with anything but a 2xx) is
  ``UpstreamUnreachable``, "proxy answered 407": nothing reached the replica; so is an answer
  the proxy names an error for (``proxy.proxy_error``) that came before the call went on
  (``proxy.sent_nothing``); any other such answer is ``UpstreamNoAnswer`` (504 for a
  timeout, else 502 "took the call but gave no answer": ``_proxy_failed``). A proxy that
  cannot be reached is "proxy: connection refused". A new
  pass-through connection is opened within ``limits.upstream_connect_timeout`` in all, TCP,
  CONNECT and TLS (``_Connector``), its wait for a place in the pool apart.
- An https replica is verified, on both transports, with one TLS context made at its first
  call (``_trust``): OpenSSL's default trust, the system's bundle, or what ``SSL_CERT_FILE``
  / ``SSL_CERT_DIR`` name (docs/security.md). A certificate it refuses fails the call as
  unreachable, "TLS certificate not trusted: " and its kind (``wire.certificate_problem``);
  OpenSSL's message, which names the host, goes to the operator's log only.
- Transport errors are translated here, the original error kept as ``__cause__``: a
  timeout before the answer's head -> ``UpstreamNoAnswer`` (504: the request was written whole,
  so the engine may be running it; not retried elsewhere), or ``UpstreamTimeout`` (504, tried
  elsewhere) when the server never read the whole request; a connection dropped (closed,
  reset) after the request was written whole and before a byte of answer ->
  ``UpstreamNoAnswer`` too (502, ``dropped``: the engine may have run it; never sent again,
  ``upstream.wire``); anything else before an answer -> ``UpstreamUnreachable`` (502),
  a connect timeout (TCP or TLS) included: nothing was sent (``connection timed out``).
  Pass-through (aiohttp, which cannot say whether a request went out whole) is told so
  too, warier: only a failure to connect is ``UpstreamUnreachable``; any failure once connected,
  before the answer's head (a timeout, the connection closed or reset), is ``UpstreamNoAnswer``
  (504, or 502 ``dropped``), as the request may have reached the engine. A
  whole answer cut or stalled after its head came -> ``UpstreamAnswerCut`` (502, 504 when it
  stalled: the engine took the call, not retried elsewhere; a pass-through answer's body
  raises it as it is read, its status relayed already), a
  failure while a stream is being read, or a stream that ends without ``[DONE]`` (for a typed
  stream, without its last event, ``[DONE]`` before it included: typed streams send none; an
  empty one included: its message says it sent nothing) ->
  ``UpstreamStreamBroken`` (502; ``UpstreamStreamStalled``, a timeout's 504, when no event
  came for ``limits.upstream_timeout``, which routing also judges its replica by). Their messages
  reach clients: they name the replica by its ``label`` and say what happened in words
  (``reason``, ``wire.reason_of``), never an exception repr, an address or a credential.
- Names (``replica_names``): ``name`` is what operators see (/stats, /metrics, logs): the
  configured one, or the URL without user, password, query and fragment; ``label`` is what
  clients may see (/healthz, error bodies): the configured name, or ``replica-<i>``.
- A user and password in the URL are not sent as part of it: they become the ``Authorization:
  Basic`` header of every call. They are a credential the gateway holds, as a key is
  (``api_key``, which goes before them): one notion, ``_held`` (a key, or
  ``config.urls.has_credentials``, as ``Config.holds_upstream_credentials``). With it, every
  credential the client presented (``Authorization``, ``api-key``, ``x-api-key`` and the
  tenant's credential headers) is left out of every call, the gateway's sent in its place.
- With a credential the gateway holds, an upstream 401 or 403 (to a cached endpoint's call or
  a pass-through) is ``UpstreamKeyRefused`` (502): its body is not relayed.
- The cached endpoints' calls go to the base URL's path plus the endpoint's, with the client's
  query string as it came (after the base URL's own query, if it has one: Azure's
  ``api-version``).
- Pass-through sends the path it is given (already confined by ``carpool.paths``) verbatim under
  the base URL's path: checked once more here, and never re-quoted or dot-resolved on the way;
  its query string too is the base URL's own, then the client's.
- Request headers are forwarded except hop-by-hop ones (those the request's ``Connection``
  names too) and carpool's own controls, and but for a cached endpoint's call's request ids:
  it carries its own (``x-request-id``, and ``request-id`` where the client sent one), a new
  one each call, never the client's (``upstream.base``), logged (DEBUG) with the client ids it
  serves (``logged_ids``: each cut to 128 characters, the non-printable ones escaped); each
  value's bytes as the client sent them
  (``http_syntax.value_bytes``: the server read them a byte a character, latin-1; written as
  UTF-8, each byte over 0x7f went as two), on both transports; one holding a control
  character is refused, never sent. aiohttp (pass-through) writes every value as UTF-8: a
  client's UTF-8 value is given to it as the text it spells (the same bytes on the wire); a
  value that is neither ASCII nor UTF-8 (legacy latin-1) goes as the UTF-8 of its latin-1
  reading (each byte over 0x7f two), as aiohttp can write no other: a deviation.
  Pass-through, which carpool neither caches nor makes idempotent, also forwards
  ``Cache-Control`` and the
  ``Idempotency-Key`` (``X-Idempotency-Key``) as they came (a valid one: the gateway refuses
  any other, ``Gateway.passthrough``), so that a retried
  ``POST /v1/batches`` is the upstream's to recognise; not the key, though, when the gateway
  holds the upstream's credential (``_held``): every client's call is then the one account's,
  and one client's key could replay another's answer. An upstream
  ``event: error`` in a stream is yielded as a payload ``{"error": ...}`` so the caller sees one
  shape for every mid-stream error (``apis.base.Api.failure`` reads it, and typed error events).
- Pass-through relays the answer's status, but a redirect's (with a ``Location``:
  ``UpstreamRedirected``, neither followed nor relayed) and a final status no answer has (a
  1xx, 600-999: ``UpstreamBadStatus``), both a 502; a 304 is relayed (a conditional GET's).
  An answer with a header value holding a control character (but the tab: ESC, DEL; aiohttp
  refuses NUL, CR, LF and a name that is no token itself) is malformed, and no server may
  write it on: refused as a cached endpoint's parser refuses it, a 502 ``UpstreamNoAnswer``
  (``dropped``: the engine may have acted on the call, so it is not sent again), its
  connection let go (``_let_go``); a tab, and bytes past 0x7f (obs-text), are relayed as they
  came.
- Pass-through relays the answer's headers but the hop-by-hop ones and those the gateway's
  server writes itself, ``Date`` and ``Server`` (``NOT_RELAYED``, and those its ``Connection``
  names; ``Transfer-Encoding`` among them) and, with a credential the gateway holds, what the upstream
  says of that credential's account (``HELD_KEY_NOT_RELAYED``) and of its quota left
  (``HELD_QUOTA_PREFIXES``). The cached endpoints' answers
  carry only their content type from the upstream (none when it named none), a whole
  answer's ``Cache-Control`` (every line of it, joined: whether a shared cache may store the
  answer, ``Answer.storable``; not relayed to the clients as it came (``reply.whole`` says
  ``no-store`` of such an answer); a stream's is not carried: SSE
  servers say ``no-store`` on every event stream by default, of the live feed, not of the
  answer), and a refusal what it says of when to retry (``errors.RETRY_HEADERS``).
- The cached endpoints ask the upstream for ``identity``; an upstream (or a proxy before it)
  may compress all the same. Relayed as they came, such bytes reached the client labelled
  ``application/json`` without their ``Content-Encoding`` (an SDK retrying a 429 could not
  read it), so they are judged here (``_decoded``): a whole answer, of any status, in gzip
  (``x-gzip``) or deflate is decoded (bounded: past ``MAX_DECODED`` bytes it is refused) and
  then judged as if it had come as ``identity`` (a refusal relayed readable, with when to
  retry; a 2xx stored and served decoded, with no ``Content-Encoding``); an empty body is
  none to decode. Any other coding (br, zstd, unknown), one that does not decode, and any
  coded stream (read as it comes) is ``UpstreamContentCoding`` (502, naming the coding; a
  streaming client's error event), its connection closed: never relayed nor stored; but a
  refusal (not 2xx) so coded keeps its status and when to retry, its text the gateway's own
  error naming the coding (a 429 stays one the SDKs retry). Pass-through is left as it is: it relays the
  bytes with their ``content-encoding`` as they came, and so with their ``Content-Length``
  (a HEAD's too; not one beside a ``Transfer-Encoding``, which says nothing of the body, nor
  a 204's or 304's, which have none). Likewise a
  pass-through request's body goes as it came, with its ``Content-Encoding``; a cached
  endpoint's call, whose body is the gateway's own serialization, carries none. A large one
  (``upstream.base.RequestBody``: its pieces as they come from the client) is sent as it is
  read, with the ``Content-Length`` its client declared, else chunked (its length is known
  only at its end; buffered to learn it, it would be held whole in memory again). Its
  client's failure as it is read (past ``limits.max_body_bytes`` or
  ``limits.body_read_timeout``: a ``RequestError``) is raised as it is, not as the
  upstream's: the call's connection closed, the body never ended as if whole. Such a body is
  watched as it goes (``_Heard``, RFC 9112 9.6): what the upstream sent is read before each
  next piece is written, so that an upstream refusing it part-way (reads 2 MiB, answers 413,
  closes with the rest unread, which resets the connection) is heard, its answer relayed and
  its replica not blamed, rather than lost to the reset (a 502 "gave no answer", the replica
  left out); an answer before the body's end that refuses it (4xx, 5xx) or closes ends the
  sending, the rest never written and the connection closed, not reused. A reset landing in
  the microseconds between that look and the write still loses it (``UpstreamNoAnswer``, as
  for an upstream that cuts the upload without answering).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import json
import logging
import select
import ssl
import weakref
import zlib
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

from ..config import LimitsConfig
from ..config.urls import has_credentials
from ..errors import (
    GatewayOverloaded,
    RequestError,
    UpstreamAnswerCut,
    UpstreamBadStatus,
    UpstreamBusy,
    UpstreamContentCoding,
    UpstreamError,
    UpstreamKeyRefused,
    UpstreamNoAnswer,
    UpstreamRedirected,
    UpstreamStreamBroken,
    UpstreamStreamStalled,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from ..http_syntax import CONTROL, TOKEN
from ..paths import confine
from ..request_id import new_call_id
from ..sse import SSEDecoder
from . import wire
from .base import (
    NOT_FORWARDED,
    PassthroughResponse,
    RequestBody,
    UpstreamRequest,
    UpstreamResponse,
    connection_listed,
)
from .proxy import Proxy, proxy_error, sent_nothing

# Response headers not relayed by pass-through: the chunked framing (the ASGI server frames a
# body of unknown length itself) and the other hop-by-hop ones (RFC 9110 7.6.1, and RFC 2616
# 13.5.1's list), which describe the upstream's connection to the gateway, not the gateway's to
# its client; so are those the answer's own ``Connection`` names. ``Content-Length`` is relayed
# (a file's size, a HEAD's answer): the body goes out as its bytes came, never re-coded.
NOT_RELAYED = frozenset(
    {
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        # The gateway's server writes its own: relayed, the client got two of each (two
        # ``Date`` lines, which a client merges into one value no parser reads).
        "date",
        "server",
    }
)
# Nor, when the gateway holds the upstream's credential (a key, or a URL's user and password),
# what an upstream says of that credential's account (OpenAI names its organization and project
# on every answer, Anthropic its organization) or the session it opens for it; nor the
# account's quota left (``HELD_QUOTA_PREFIXES``), which every client's calls spend: one client
# read the others' traffic in it. (When to retry, ``Retry-After``, is relayed.)
HELD_KEY_NOT_RELAYED = frozenset(
    {"openai-organization", "openai-project", "anthropic-organization-id", "set-cookie"}
)
HELD_QUOTA_PREFIXES = ("x-ratelimit", "anthropic-ratelimit-", "ratelimit")  # (the last: IETF's)
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# The statuses whose answer never has a body (RFC 9110 6.4.1): no ``Content-Length`` relayed.
_BODILESS = frozenset({204, 304})

# The most bytes a coded whole answer may decode to (``_decoded``). The gateway sets no limit on
# an answer as it comes (identity), but a few KiB of gzip can inflate to gigabytes; this is well
# over the largest answers of the cached endpoints (2,048 embeddings of 3,072 floats as JSON,
# about 130 MB).
MAX_DECODED = 256 * 1024 * 1024
# The content codings ``_decoded`` reads, and the ``wbits`` zlib reads each with (RFC 9110
# 8.4.1: gzip's header and trailer; deflate is the zlib format).
_DECODED = {"gzip": 31, "x-gzip": 31, "deflate": 15}

log = logging.getLogger("carpool.upstream")

_TIMEOUTS = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)
# aiohttp's failures to connect (refused, name resolution, TLS, a connect timeout): nothing of the
# request was sent. (aiohttp's own split: the errors it never resends.)
_NOT_CONNECTED = (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError)
# The query string is forwarded as it came; only what a URL cannot hold (space, control, non-ASCII
# bytes, "#") is percent-encoded, since the URL is handed to aiohttp as already encoded.
_QUERY_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "#")


# Request headers pass-through forwards and the cached endpoints' calls do not
# (``NOT_FORWARDED``): nothing of carpool's caching or idempotency applies to pass-through.
_PASSED = ("content-type", "content-encoding", "accept-encoding", "cache-control")
# And the client's idempotency key, unless the gateway holds the upstream's credential
# (module doc).
_PASSED_KEYS = (*_PASSED, "idempotency-key", "x-idempotency-key")

# The client's credentials, replaced as a whole when the gateway holds the upstream's (with the
# tenant's credential headers).
_CREDENTIAL_HEADERS = frozenset({"authorization", "api-key", "x-api-key"})


# The most characters of a client's request id its call's debug line shows (``logged_ids``): a
# usable ``x-request-id`` has at most 128 (``request_id``); a body's ``request_id`` has no bound.
LOGGED_ID_CHARS = 128


def logged_ids(ids: Sequence[str]) -> str:
    """Client-chosen request ids as a JSON list for a log line: each cut to ``LOGGED_ID_CHARS``
    (saying how many more there were) and with every character ``str.isprintable`` refuses
    escaped, not only those JSON must (NEL, LINE SEPARATOR: line breaks to a log viewer; a
    RIGHT-TO-LEFT OVERRIDE reorders what follows), readable non-ASCII ones as written."""

    def shown(client_id: str) -> str:
        text = client_id[:LOGGED_ID_CHARS]
        if len(client_id) > LOGGED_ID_CHARS:
            text += f"... ({len(client_id) - LOGGED_ID_CHARS:,} more characters)"
        quoted = json.dumps(text, ensure_ascii=False)  # (quotes, backslashes, C0 controls)
        return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in quoted)

    return "[" + ",".join(map(shown, ids)) + "]"


def _as_sent(value: str) -> str:
    """``value`` for aiohttp, which writes every header value as UTF-8, to put on the wire as
    the client sent it (``http_syntax.value_bytes``): the server read it a byte a character
    (latin-1), so a client's UTF-8 is given back to aiohttp as the text it spells. A value
    beyond latin-1 is a library caller's text, written as its UTF-8. Bytes that are neither
    (a legacy latin-1 value: Python's requests, urllib) aiohttp can only write as the UTF-8 of
    their latin-1 reading (docs/deviations.md); the cached endpoints' calls send them as they
    came (``wire.request_head``)."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    listed = connection_listed(headers)  # (hop-by-hop too, for this request)
    dropped = NOT_FORWARDED | listed if listed else NOT_FORWARDED
    return {
        name: value
        for name, value in headers.items()
        if name not in dropped and not name.startswith("x-carpool-")
    }


def public_url(url: str) -> str:
    """``url`` without user, password, query and fragment: fit for /stats, metrics and logs."""
    try:
        parsed = URL(url)
        return str(parsed.with_user(None).with_query(None).with_fragment(None)).rstrip("/")
    except ValueError:
        return "upstream"


def replica_names(urls: Sequence[str], names: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``(name, label)`` of each upstream (``upstream_names``, else derived; see the module doc).
    Derived names are made distinct: two URLs may differ only in their credentials or query."""
    if names:
        return [(name, name) for name in names]
    out: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, url in enumerate(urls):
        name = public_url(url)
        seen[name] = count = seen.get(name, 0) + 1
        out.append((name if count == 1 else f"{name}#{count}", f"replica-{i}"))
    return out


class _Heard:
    """The upstream's side of one streamed upload, watched as its pieces go (RFC 9112 9.6: a
    client sending a body watches the connection for an answer that refuses it).

    Why: an upstream that refuses an upload part-way (reads 2 MiB, answers 413, closes) leaves
    the rest unread, so its kernel resets the connection right behind its answer. A piece
    written on the connection then fails on the reset before the loop has read the answer,
    and the loop closes the socket with the answer unread in it: the client got a 502 ("gave
    no answer") and the replica was left out of rotation, though it had answered. So before
    each piece, anything the upstream sent is read first (the loop reads it; a piece going
    out from the loop's own writable callback was safe already: it reads before it writes);
    then a refusal (its status 4xx or 5xx, or a closing connection) ends the sending: the rest
    is never written, and the connection is closed once the answer is done with (the body was
    never ended as if whole, never reused)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None  # (``_WatchingRequest``)
        self.refused = False  # the upstream's answer came before the body's end, a refusal
        self.over = asyncio.Event()  # the call failed, or its answer was done with

    async def pieces(self, body: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        async for piece in body:
            await self.heard()
            yield piece

    async def heard(self) -> None:
        transport = self.transport
        socket = transport.get_extra_info("socket") if transport is not None else None
        if transport is None or socket is None:
            return
        poll = select.poll()
        poll.register(socket.fileno(), select.POLLIN | select.POLLPRI)
        # (Not while the transport reads nothing: what came stays there, and the call's own
        # timeout, or its reader, decides.)
        while not self.refused and not transport.is_closing() and poll.poll(0):
            if not transport.is_reading():
                break
            await asyncio.sleep(0)  # (the loop reads what came: an answer, the close)
        if self.refused or transport.is_closing():
            # (Nothing more goes out. The writer is cancelled as the answer is let go; should
            # the call fail first, ``over`` ends it, the connection closed with the call.)
            await self.over.wait()
            raise ConnectionResetError("the upstream answered before the body's end")


# The streamed upload being sent in this context (``_open``): aiohttp writes its body in a task
# made there, which tells the watch its connection (``_WatchingRequest``).
_SENDING: contextvars.ContextVar[_Heard | None] = contextvars.ContextVar("sending", default=None)


class _WatchingRequest(aiohttp.ClientRequest):
    """aiohttp's request, telling a streamed upload's ``_Heard`` which connection it goes on."""

    async def write_bytes(
        self, writer: Any, conn: aiohttp.connector.Connection, *rest: Any, **named: Any
    ) -> None:
        heard = _SENDING.get()
        if heard is not None:
            heard.transport = conn.transport
        # (The rest as it came: aiohttp 3.12 added ``content_length``, 3.10 has none.)
        await super().write_bytes(writer, conn, *rest, **named)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, each new connection opened within ``opening_timeout`` in all (TCP,
    a proxy's CONNECT, TLS): ``sock_connect`` bounds the TCP part only, and a proxy's answer to
    CONNECT was waited for as long as ``sock_read`` allows (minutes), while
    ``ClientTimeout.connect`` would count a wait for a place in the pool too (a busy replica's
    calls failed as unreachable, the replica left out). Overrides aiohttp 3's
    ``_create_connection``, which opens a new connection once its place is had."""

    def __init__(self, *, opening_timeout: float, **named: Any) -> None:
        super().__init__(**named)
        self._opening_timeout = opening_timeout
        self._new: weakref.WeakSet[Any] = weakref.WeakSet()  # (opened, not yet handed out)

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        # A kept connection on which the upstream sent anything since its last answer ended (a
        # 204's or 304's body coming late, an answer too many) would give those bytes to the
        # next call as its answer, and each answer after them to the call after its own: one
        # tenant's to another. Never reused, as the cached endpoints' client does not
        # (``wire.Connection.stale``); aiohttp looks only whether it is still open.
        while True:
            connection = await super().connect(req, traces, timeout)
            protocol = connection.protocol
            if protocol is None or protocol in self._new:
                self._new.discard(protocol)
                return connection
            if not (protocol.should_close or _readable(protocol.transport)):
                return connection
            connection.close()  # (and the next one: the pool's, or a new one)

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        try:
            async with asyncio.timeout(self._opening_timeout):
                protocol = await super()._create_connection(req, traces, timeout)
        except TimeoutError as exc:
            raise aiohttp.ConnectionTimeoutError("connection timed out") from exc
        self._new.add(protocol)
        return protocol


def _readable(transport: asyncio.BaseTransport | None) -> bool:
    """Whether ``transport``'s socket has something the loop has not read yet (bytes, the
    server's FIN or RST), or none is left to look at: one ``poll``, a microsecond."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return transport is None or transport.is_closing()
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def reason(error: BaseException) -> str:
    """What went wrong, in a few words fit for a client (no repr, no address)."""
    if isinstance(error, aiohttp.ClientProxyConnectionError):
        # (The proxy's fault, not the replica's host: as ``wire.Pool._through`` says it.)
        return "proxy: " + (wire.os_reason(error.os_error) or "connection failed")
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return "connection timed out"
    if isinstance(error, _TIMEOUTS):
        return "timed out"
    if isinstance(error, aiohttp.ClientConnectorDNSError):
        return "name not resolved"
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        refused = error.certificate_error
        if isinstance(refused, ssl.SSLCertVerificationError):
            return wire.reason_of(refused)  # (the same words as a cached endpoint's call)
        return "TLS handshake failed"
    if isinstance(error, aiohttp.ClientSSLError):
        return "TLS handshake failed"
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "connection closed by the upstream"
    if isinstance(error, aiohttp.ClientPayloadError):
        return "malformed or truncated answer"
    cause = error.os_error if isinstance(error, aiohttp.ClientConnectorError) else error
    return wire.os_reason(cause) or (
        "connection failed"
        if isinstance(error, aiohttp.ClientConnectionError)
        else "transport error"
    )


def overloaded(label: str, reason: str) -> GatewayOverloaded:
    """A call that could not open its connection for want of this machine's resources
    (``wire.local_reason``): a 503 to its clients, no verdict on the replica (counted and
    logged where calls are judged: ``ReplicaSet.overloaded``)."""
    error = GatewayOverloaded(
        f"the gateway could not open a connection to upstream {label} ({reason}): retry later"
    )
    error.reason = reason
    return error


def busy(label: str, waited: float) -> UpstreamBusy:
    """A call that found every connection to its replica in use for ``waited`` seconds
    (``limits.upstream_queue_timeout``): a 503 to its clients, no verdict on the replica."""
    error = UpstreamBusy(
        f"every connection of the gateway's to upstream {label} stayed busy for {waited:g} s: "
        "retry later"
    )
    error.reason = f"every connection busy for {waited:g} s"
    return error


class HttpUpstream:
    def __init__(
        self,
        base_url: str,
        limits: LimitsConfig,
        name: str | None = None,
        label: str | None = None,
        api_key: str | None = None,
        credential_headers: Iterable[str] = (),
        proxy: Proxy | None = None,
    ) -> None:
        self.name = name or public_url(base_url)
        self.label = label or name or "replica"
        url = URL(base_url.rstrip("/"))
        # Credentials in the URL: a header of every call, never part of a URL aiohttp sees
        # (nor of one that could reach an error message or a log line).
        self._auth = (
            "Basic "
            + base64.b64encode(f"{url.user or ''}:{url.password or ''}".encode()).decode("ascii")
            if has_credentials(base_url)
            else None
        )
        self.base_url = str(url.with_user(None)) if self._auth else base_url.rstrip("/")
        if api_key:  # (a held key goes before a URL's credentials)
            self._auth = f"Bearer {api_key}"
        # A credential the gateway holds (a key, ``upstream.api_key``, or the URL's user and
        # password, ``config.urls.has_credentials``: the module doc): sent in place of every
        # credential the client presented, which then never leaves the gateway. Every header
        # that names the client (the tenant's credential headers included) is left out: none
        # of them goes upstream next to the gateway's credential.
        self._held = self._auth is not None
        self._replaced: frozenset[str] = (
            _CREDENTIAL_HEADERS | {name.lower() for name in credential_headers}
            if self._held
            else frozenset()
        )
        self.limits = limits
        self._session: aiohttp.ClientSession | None = None  # pass-through's
        # The cached endpoints' calls (``upstream.wire``): where to, and what to say.
        bare = URL(self.base_url)
        self._tls = bare.scheme == "https"
        self._host = bare.raw_host or ""
        self._port = bare.port or (443 if self._tls else 80)
        self._netloc = f"[{self._host}]" if ":" in self._host else self._host
        if bare.explicit_port is not None and bare.explicit_port != (443 if self._tls else 80):
            self._netloc += f":{bare.explicit_port}"
        self._path = bare.raw_path.rstrip("/")
        # Pass-through's URLs: scheme, host and port, then the path (never after the query).
        self._origin = str(bare.origin())
        # A query in the URL goes before the client's (and alone when it sent none).
        self._base_query = bare.raw_query_string
        self._query = self._base_query + "&" if self._base_query else ""
        self._pool: wire.Pool | None = None
        self._context: ssl.SSLContext | None = None
        # Through an HTTP proxy (``upstream.proxy``): an https replica's calls in its CONNECT
        # tunnel (``wire``'s), an http one's sent to the proxy naming the replica's URL in full
        # (absolute form, RFC 9112 3.2.2), with the proxy's credentials beside.
        self.proxy = proxy
        self._forwarded = proxy is not None and not self._tls
        self._absolute = f"http://{self._netloc}" if self._forwarded else ""

    def _trust(self) -> ssl.SSLContext | None:
        """The TLS context of both transports (None over plain HTTP), made at the first call:
        OpenSSL's default trust (the system's bundle, or ``SSL_CERT_FILE``/``SSL_CERT_DIR``
        as the process found them then). One for both, so that pass-through trusts what the
        cached endpoints do (aiohttp's own is made as it is imported)."""
        if self._tls and self._context is None:
            self._context = ssl.create_default_context()
            self._context.set_alpn_protocols(["http/1.1"])  # (as aiohttp's: neither speaks h2)
        return self._context

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                request_class=_WatchingRequest,
                connector=_Connector(
                    limit=self.limits.upstream_max_connections,
                    limit_per_host=0,
                    # (Idle connections dropped before the upstream server drops them itself:
                    # reusing one it is closing at that moment fails the call, which a busy
                    # gateway hit 2-3 times in 2,000 requests with aiohttp's default of 15 s.
                    # ``upstream.wire`` sends such a call again on a new connection; aiohttp
                    # does so only for an idempotent method.)
                    keepalive_timeout=self.limits.upstream_keepalive,
                    ssl=self._trust() or True,
                    opening_timeout=self.limits.upstream_connect_timeout,
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self.limits.upstream_connect_timeout,
                    # (Between two reads, unlike a cached endpoint's call: a pass-through body
                    # goes to its one client as it comes, each byte news to it.)
                    sock_read=self.limits.upstream_timeout,
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                # No cookie jar: aiohttp's default kept every ``Set-Cookie`` of an upstream
                # named by host name and sent it on every later call, one tenant's session on
                # another tenant's call, in place of a client's own cookie of that name. A
                # cookie is its client's: relayed to it, and back only when it sends it.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    @property
    def resent(self) -> int:
        """Calls ``upstream.wire`` sent a second time (the keep-alive race): each an attempt,
        counted by the replica set (``upstream_calls``)."""
        return self._pool.resent if self._pool is not None else 0

    def _wire(self) -> wire.Pool:
        if self._pool is None:
            host, port, tunnel = self._host, self._port, self.proxy
            if self._forwarded and self.proxy is not None:
                host, port, tunnel = self.proxy.host, self.proxy.port, None
            self._pool = wire.Pool(
                host,
                port,
                ssl=self._trust(),
                tunnel=tunnel,
                limit=self.limits.upstream_max_connections,
                queue_timeout=self.limits.upstream_queue_timeout,
                connect_timeout=self.limits.upstream_connect_timeout,
                answer_timeout=self.limits.upstream_timeout,
                keepalive_s=self.limits.upstream_keepalive,
            )
        return self._pool

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        headers = forwarded_headers(request.headers)
        # The call's own id in place of the client's: an engine names its answer after it
        # (vLLM's ``chatcmpl-<x-request-id>``), and the answer is served to other clients.
        call_id = new_call_id()
        if "request-id" in headers:
            headers["request-id"] = call_id
        headers["x-request-id"] = call_id
        if log.isEnabledFor(logging.DEBUG):
            serves = logged_ids(request.serves)  # (a client's text: escaped, cut short)
            log.debug("upstream call %s to %s for request ids %s", call_id, self.name, serves)
        if self._auth is not None:  # (held)
            headers = {k: v for k, v in headers.items() if k.lower() not in self._replaced}
            headers["authorization"] = self._auth
        headers["content-type"] = "application/json"
        headers["accept-encoding"] = "identity"
        if self._forwarded and self.proxy is not None and self.proxy.authorization:
            headers["proxy-authorization"] = self.proxy.authorization
        body = orjson.dumps(request.body)
        query = self._query + request.query if request.query else self._base_query
        target = self._absolute + self._path + request.path + ("?" + query if query else "")
        head = wire.request_head(target, self._netloc, headers, len(body))
        # A stream is read as it comes; anything else whole, in one wait, unless its size is
        # bounded (counted as it comes).
        whole = not request.stream and request.max_answer_bytes is None
        try:
            answer = await self._wire().request(head, body, whole)
        except wire.WireError as exc:
            if isinstance(exc, wire.WireLocal):
                raise overloaded(self.label, exc.reason) from exc
            if isinstance(exc, wire.WireBusy):
                raise busy(self.label, self.limits.upstream_queue_timeout) from exc
            if exc.answered:
                raise self._mid_answer(exc) from exc
            timed_out = isinstance(exc, wire.WireTimeout)
            if exc.sent:
                # Written whole: the engine may be running it (see ``UpstreamNoAnswer``), also
                # when the connection then dropped with no byte of answer (an engine that
                # crashed mid-generation, a proxy's cut): not unreachable, never tried elsewhere
                # as one that cannot have run.
                if timed_out:
                    raise UpstreamNoAnswer(f"upstream {self.label} did not answer in time") from exc
                raise UpstreamNoAnswer(
                    f"upstream {self.label} took the call but gave no answer ({exc.reason})",
                    dropped=True,
                ) from exc
            if timed_out:
                raise UpstreamTimeout(
                    f"upstream {self.label} did not take the request in time"
                ) from exc
            # (Connected to the proxy, for an http replica behind one: its fault, said so.)
            said = "proxy: " + exc.reason if self._forwarded else exc.reason
            raise UpstreamUnreachable(f"upstream {self.label} is unreachable ({said})") from exc
        status, content_type = answer.status, answer.content_type
        if self._forwarded:
            error = proxy_error(answer.proxy_status, answer.squid_error)
            if status == 407 or error is not None:
                answer.discard()
                raise self._proxy_failed(status, error)
        if self._held and status in (401, 403):
            # The upstream refused the call made with the gateway's own key: its answer may
            # quote part of the key or name the account, and the client's key is not the one
            # at fault. A 502 of the gateway's (``UpstreamKeyRefused``): an answer about this
            # call as often as about the key, so no replica is left out for it.
            answer.release()
            raise UpstreamKeyRefused(
                f"upstream {self.label} refused the gateway's key ({status})", status
            )
        codings = _codings(answer.content_encoding)
        # (A media type is case-insensitive, RFC 9110 8.3.1: ``Text/Event-Stream`` is one.)
        if request.stream and 200 <= status < 300 and "text/event-stream" in content_type.lower():
            if codings:
                # Read as it comes, a stream is never decoded: its events would be none.
                answer.discard()  # (the engine stops: nothing of it can be used)
                raise self._coded(codings, "which the gateway does not decode in a stream")
            # (Without its Cache-Control: an SSE server's ``no-store`` is the live feed's.)
            return UpstreamResponse(
                status,
                {"content-type": content_type},
                events=wire_payloads(answer, request.last_event, f"upstream {self.label}"),
                close=_discarding(answer),
            )
        try:
            if request.max_answer_bytes is None:
                data = await answer.read()
            else:
                data = await self._bounded(answer, request.max_answer_bytes)
        except wire.WireError as exc:
            raise self._mid_answer(exc) from exc
        if codings and data:  # (an empty body is one in no coding: a bodiless 429 is one)
            try:
                data = self._decoded(data, codings)
            except UpstreamContentCoding as error:
                if 200 <= status < 300:
                    raise
                # A refusal keeps its status and when to retry (a 429 stays one the SDKs back
                # off from, not a 502 they must not retry); its unreadable text is replaced by
                # the gateway's own, naming the coding.
                data, content_type = error.body(), "application/json"
        # (None named: none relayed, never an empty one.)
        headers = {"content-type": content_type} if content_type else {}
        if answer.retry:  # (when to retry: ``errors.retry_headers`` reads it off a refusal)
            headers.update(answer.retry)
        if answer.cache_control:  # (whether a shared cache may store it: ``Answer.storable``)
            headers["cache-control"] = answer.cache_control
        return UpstreamResponse(status, headers, body=data)

    async def _bounded(self, answer: wire.Answer, most: int) -> bytes:
        """A whole answer's body of at most ``most`` bytes, read as it comes; past them, the
        connection closed (nothing more read) and ``UpstreamAnswerCut``."""
        pieces: list[bytes] = []
        size = 0
        try:
            async for piece in answer.chunks():
                size += len(piece)
                if size > most:
                    answer.discard()
                    raise UpstreamAnswerCut(
                        f"upstream {self.label} answered more than {most} bytes"
                    )
                pieces.append(piece)
        finally:
            answer.release()  # (after ``discard``, nothing: the first counts)
        return b"".join(pieces)

    def _decoded(self, data: bytes, codings: list[str]) -> bytes:
        """A whole answer's body in ``codings`` (in the order they were applied), decoded, at
        most ``MAX_DECODED`` bytes; else ``UpstreamContentCoding`` (see the module doc)."""
        for coding in reversed(codings):
            wbits = _DECODED.get(coding)
            if wbits is None:
                raise self._coded(codings, "which the gateway does not decode")
            decoder = zlib.decompressobj(wbits)
            try:
                # (One byte past the bound: what tells a body at the bound from one beyond.)
                data = decoder.decompress(data, MAX_DECODED + 1)
            except zlib.error as exc:
                raise self._coded(codings, "which does not decode") from exc
            if len(data) > MAX_DECODED:
                raise self._coded(codings, f"decoding to more than {MAX_DECODED} bytes")
            if not decoder.eof or decoder.unused_data:
                raise self._coded(codings, "which does not decode (cut, or bytes after it)")
        return data

    def _coded(self, codings: list[str], why: str) -> UpstreamContentCoding:
        # (The client reads the codings' names: a name that is no short token, the upstream's
        # text of any length, is not quoted.)
        named = [c if len(c) <= 32 and TOKEN.fullmatch(c) else "(unknown)" for c in codings]
        return UpstreamContentCoding(
            f"upstream {self.label} answered in content coding {', '.join(named)}"
            f" although asked for identity, {why}"
        )

    def _proxy_failed(self, status: int, error: str | None) -> UpstreamError:
        """An answer the proxy made itself (its 407; an answer to CONNECT but a 2xx; one it
        names an ``error`` for: ``upstream.proxy.proxy_error``). Unreachable (another replica
        may be tried) when the call cannot have reached the replica: a refusal, or an error
        the proxy names before sending (``sent_nothing``); else the replica may have taken it
        (the proxy's read timed out, the replica closed), and it is never run again elsewhere:
        ``UpstreamNoAnswer``, as when the connection drops after the call was written whole."""
        said = f"proxy answered {status}"
        if status == 407 or error is None or sent_nothing(error):
            return UpstreamUnreachable(f"upstream {self.label} is unreachable ({said})")
        if "timeout" in error.lower():
            return UpstreamNoAnswer(f"upstream {self.label} did not answer in time ({said})")
        return UpstreamNoAnswer(
            f"upstream {self.label} took the call but gave no answer ({said})", dropped=True
        )

    def _mid_answer(self, error: wire.WireError) -> UpstreamAnswerCut:
        """The answer's head came, its body did not whole: the engine took the call, so this
        is no failure to retry on another replica (as ``UpstreamUnreachable`` would be)."""
        if isinstance(error, wire.WireTimeout):
            return UpstreamAnswerCut(
                f"upstream {self.label} timed out sending its answer", timed_out=True
            )
        return UpstreamAnswerCut(f"upstream {self.label} failed mid-answer ({error.reason})")

    async def _open(
        self, method: str, url: str | URL, body: RequestBody | None, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        if self._auth is not None:  # (held)
            headers = {k: v for k, v in headers.items() if k.lower() not in self._replaced}
            headers["authorization"] = self._auth
        # The proxy's credentials: on the request itself when the proxy forwards it (an http
        # replica's), on the CONNECT that opens the tunnel otherwise (aiohttp's).
        proxy_headers = None
        if self.proxy is not None and self.proxy.authorization is not None:
            if self._forwarded:
                headers = {**headers, "proxy-authorization": self.proxy.authorization}
            else:
                proxy_headers = {"proxy-authorization": self.proxy.authorization}
        # A streamed upload is watched as it goes: a refusal before its end is heard (``_Heard``).
        heard: _Heard | None = None
        data = body
        if body is not None and not isinstance(body, bytes):
            heard = _Heard()
            data = heard.pieces(body)
        _SENDING.set(heard)
        response: aiohttp.ClientResponse | None = None
        try:
            response = await self._client().request(
                method,
                url,
                data=data,
                headers=headers,
                allow_redirects=False,
                proxy=self.proxy.url if self.proxy is not None else None,
                proxy_headers=proxy_headers,
            )
        except aiohttp.ClientHttpProxyError as exc:  # (CONNECT refused)
            raise self._proxy_failed(exc.status, None) from exc
        except _NOT_CONNECTED as exc:
            local = wire.local_reason(getattr(exc, "os_error", None))
            if local is not None:  # (this machine's want, as for ``send``)
                raise overloaded(self.label, local) from exc
            # (A connect timeout is a ``ServerTimeoutError`` too.) Nothing was sent: unreachable,
            # as for ``send``, and the routing may try the call on another replica.
            said = reason(exc)
            if (
                self.proxy is not None
                and not said.startswith("proxy")
                and (self._forwarded or isinstance(exc, aiohttp.ClientConnectorDNSError))
            ):
                # The proxy's connection (an http replica's only one; a name aiohttp resolves
                # only for the proxy): its fault, said so, as ``send`` says it.
                said = "proxy: " + said
            raise UpstreamUnreachable(f"upstream {self.label} is unreachable ({said})") from exc
        except _TIMEOUTS as exc:
            # Connected: the request went out (aiohttp cannot say whether whole), and the engine
            # may be running it: never tried elsewhere (the method may not be idempotent).
            raise UpstreamNoAnswer(f"upstream {self.label} did not answer in time") from exc
        except aiohttp.ClientError as exc:
            if isinstance(exc.__cause__, RequestError):
                # The body's own failure as it was sent (its client's: past the limits), not
                # the upstream's: the call is given up (its connection closed, the body cut
                # short of its end), the client told, the replica not blamed.
                raise exc.__cause__ from None
            # The connection closed or reset once made, before a byte of answer: as above.
            raise UpstreamNoAnswer(
                f"upstream {self.label} gave no answer ({reason(exc)})", dropped=True
            ) from exc
        finally:
            _SENDING.set(None)
            if heard is not None and response is None:
                heard.over.set()  # (no answer: a watch waiting on one is done)
        if heard is not None:
            # An answer before the body's end that refuses it, or closes, stops the body.
            closing = response.headers.get("connection", "").lower() == "close"
            heard.refused = response.status >= 400 or closing
        if self._forwarded:  # (as for ``send``)
            fields = response.headers
            error = proxy_error(
                ", ".join(fields.getall("proxy-status", ())), fields.get("x-squid-error", "")
            )
            if response.status == 407 or error is not None:
                response.release()
                raise self._proxy_failed(response.status, error)
        if self._held and response.status in (401, 403):
            # As for the cached endpoints' calls (``send``).
            response.release()
            raise UpstreamKeyRefused(
                f"upstream {self.label} refused the gateway's key ({response.status})",
                response.status,
            )
        return response

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: RequestBody
    ) -> PassthroughResponse:
        out_headers = forwarded_headers(headers)
        listed = connection_listed(headers)  # (hop-by-hop, for this request)
        for name in _PASSED if self._held else _PASSED_KEYS:
            if name in headers and name not in listed:
                out_headers[name] = headers[name]
        # (As the client sent them: aiohttp would write a value that is not ASCII as UTF-8.)
        out_headers = {name: _as_sent(value) for name, value in out_headers.items()}
        # Never ask for a compression the client did not: the bytes are relayed raw.
        out_headers.setdefault("accept-encoding", "identity")
        if not isinstance(body, bytes) and "content-length" in headers:
            # A body going on as it comes keeps the length its client declared (the server
            # read it so: never more, nor less unless the client left, the call cut then);
            # without one (chunked) it goes chunked: its length is not known before its end.
            out_headers["content-length"] = headers["content-length"]
        # Sent exactly as confined: yarl would otherwise re-quote and resolve dot segments.
        path = confine(b"/v1" + path.encode("ascii", "replace"))
        # As ``send`` builds a cached endpoint's target: the base URL's path, then its query and
        # the client's (appended to the whole base URL, the path went into its query).
        asked = quote(query, safe=_QUERY_SAFE) if query else ""
        query_string = self._query + asked if asked else self._base_query
        url = URL(
            self._origin + self._path + path + ("?" + query_string if query_string else ""),
            encoded=True,
        )
        response = await self._open(method, url, body or None, out_headers)
        if response.status in _REDIRECTS and "location" in response.headers:
            # Not followed: the client's credentials (its api-key, its query) would go to
            # whatever host the upstream named. Nor relayed: its Location names the upstream.
            response.release()
            raise UpstreamRedirected(
                f"upstream {self.label} answered a redirect ({response.status})"
            )
        if not 200 <= response.status < 600:
            # A 1xx taken as final (a 101: the gateway asked for no upgrade), 600-999: no answer
            # a client can read (``UpstreamBadStatus``), as for the cached endpoints' calls.
            response.release()
            raise UpstreamBadStatus(
                f"upstream {self.label} answered with status {response.status}, which no answer has"
            )
        if any(CONTROL.search(value.decode("latin-1")) for _, value in response.raw_headers):
            # A field value with a control character (ESC, DEL...; aiohttp refuses NUL, CR, LF
            # and a name that is no token itself) makes the answer malformed (RFC 9110 5.5).
            # No server may write it on: uvicorn refused it with the reply counted as begun,
            # and its client's connection closed with no status line (an SDK sent the call
            # again). Refused as the cached endpoints' parser refuses it (``upstream.wire``).
            _let_go(response)  # (aiohttp read its head well: kept if its body came whole)
            raise UpstreamNoAnswer(
                f"upstream {self.label} took the call but gave no answer (malformed answer: a"
                " header with a control character)",
                dropped=True,
            )
        dropped = NOT_RELAYED | HELD_KEY_NOT_RELAYED if self._held else NOT_RELAYED
        named = response.headers.getall("connection", ())
        if named:
            dropped = dropped | connection_listed({"connection": ",".join(named)})
        if "transfer-encoding" in response.headers or response.status in _BODILESS:
            # A length beside a chunked framing says nothing of the body (RFC 9112 6.3: the
            # server frames the client's answer then); a 304's is the size of a body not sent
            # (RFC 9110 8.6), which the ASGI server would wait for and, not seeing it, fail.
            dropped = dropped | {"content-length"}
        quota = HELD_QUOTA_PREFIXES if self._held else ()
        relayed = [
            (k, v)
            for k, v in response.raw_headers
            if (name := k.decode("latin-1").lower()) not in dropped and not name.startswith(quota)
        ]

        async def content() -> AsyncIterator[bytes]:
            # Its head came (its status relayed already): a failure now is the answer's cut,
            # said in the gateway's terms, as for a cached endpoint's (``_mid_answer``).
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except _TIMEOUTS as exc:  # (before ``ClientError``: aiohttp's read timeout is both)
                raise UpstreamAnswerCut(
                    f"upstream {self.label} timed out sending its answer", timed_out=True
                ) from exc
            except aiohttp.ClientError as exc:
                raise UpstreamAnswerCut(
                    f"upstream {self.label} failed mid-answer ({reason(exc)})"
                ) from exc
            finally:
                _let_go(response)

        async def close() -> None:
            # (Its body never read, ``content``'s ``finally`` never ran: the connection let go.)
            _let_go(response)

        return PassthroughResponse(response.status, relayed, content(), close=close)

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()


def sse_payloads(
    response: aiohttp.ClientResponse, last_event: Callable[[bytes], bool] | None, who: str
) -> AsyncIterator[list[bytes]]:
    """The ``data:`` payloads of an SSE answer read by aiohttp (``_payloads``); ``who`` names
    the sender in errors (``upstream <label>``; a peer worker's answer is read so too,
    ``carpool.peers``). The response is closed at the end, however it ends."""
    return _payloads(
        response.content.iter_any(),
        last_event,
        who,
        timeouts=_TIMEOUTS,
        errors=(aiohttp.ClientError,),
        reason=reason,
        done=lambda _ended: response.close(),
    )


def wire_payloads(
    answer: wire.Answer, last_event: Callable[[bytes], bool] | None, who: str
) -> AsyncIterator[list[bytes]]:
    """``sse_payloads`` of an answer read by ``upstream.wire``, each read that brought an event
    noted as its progress (``limits.upstream_timeout`` runs between two events, not two
    bytes). Its connection goes back to the
    pool once the stream ended whole, else it is closed (the upstream stops generating), also
    when its body ended whole as HTTP goes: a server that sent no ``[DONE]`` may be closing it
    (llama-cpp-python's, after a prompt over its context), and the next call would go on it."""
    return _payloads(
        answer.chunks(),
        last_event,
        who,
        timeouts=(wire.WireTimeout,),
        errors=(wire.WireError,),
        reason=wire.reason_of,
        done=lambda ended: answer.release(drain=True) if ended else answer.discard(),
        progressed=answer.progressed,
    )


def _codings(content_encoding: str) -> list[str]:
    """The content codings an answer's ``Content-Encoding`` lists, lower-case (RFC 9110 8.4.1:
    case-insensitive), ``identity`` (no coding) left out."""
    if not content_encoding:  # (every answer asks: nearly all say none)
        return []
    listed = (coding.strip().lower() for coding in content_encoding.split(","))
    return [coding for coding in listed if coding and coding != "identity"]


def _discarding(answer: wire.Answer) -> Callable[[], Awaitable[None]]:
    """A stream's ``aclose``: its connection closed unless its events were read to their end
    (``wire_payloads`` gave it back then; ``discard`` after that does nothing)."""

    async def close() -> None:
        answer.discard()

    return close


async def _payloads(
    chunks: AsyncIterator[bytes],
    last_event: Callable[[bytes], bool] | None,
    who: str,
    *,
    timeouts: tuple[type[BaseException], ...],
    errors: tuple[type[BaseException], ...],
    reason: Callable[[BaseException], str],
    done: Callable[[bool], None],
    progressed: Callable[[], None] | None = None,
) -> AsyncIterator[list[bytes]]:
    """The ``data:`` payloads of an SSE body, those of one read in one list, the stream's first
    event in a list of its own (``upstream.base``: until ``[DONE]`` or a typed stream's last
    event, else ``UpstreamStreamBroken``), whichever client reads it: its ``timeouts`` and
    ``errors`` become ``UpstreamStreamBroken`` (``UpstreamStreamStalled`` for a timeout);
    ``progressed()`` whenever a read brought payloads (not for one of comments
    only); ``done(ended whole)`` at the end."""
    decoder = SSEDecoder()
    sent = ended = broken = False
    try:
        async for data in chunks:
            pieces: tuple[bytes, ...] = (data,)
            if not sent:
                # The first event alone, before the rest of its read is decoded: its clients'
                # first byte waits on nothing after it (an engine that answers at once sends
                # the whole stream in one read). (The decoder takes a split anywhere.)
                cut = data.find(b"\n\n") + 2
                if 1 < cut < len(data):
                    pieces = (data[:cut], data[cut:])
            for piece in pieces:
                batch: list[bytes] = []
                for event, payload in decoder.feed(piece):
                    if payload == b"[DONE]":
                        if last_event is not None:
                            # A typed stream sends no [DONE]: one before its last event (a
                            # proxy's end of a stream it cut) ends it short, not whole.
                            broken = True
                            break
                        ended = True
                        break
                    if event == "error" and not payload.startswith(b'{"error"'):
                        payload = b'{"error":' + payload + b"}"
                    batch.append(payload)
                    if last_event is not None and last_event(payload):
                        ended = True
                        break  # a typed stream's last event: it ended whole
                if batch:
                    sent = True
                    if progressed is not None:
                        progressed()
                    yield batch
                if ended:
                    return
                if broken:
                    raise UpstreamStreamBroken(f"{who} ended its stream without its last event")
        # The body ended cleanly but the stream did not: a server that stopped (a crash, a
        # proxy's cut) reads just like this. Without [DONE] (or a typed stream's last event)
        # nothing says the answer is whole.
        if not sent:
            # llama.cpp's server answers a prompt over its context so: 200, then nothing.
            raise UpstreamStreamBroken(
                f"{who} ended its stream without sending anything (an input it could not take?)"
            )
        end = "[DONE]" if last_event is None else "its last event"
        raise UpstreamStreamBroken(f"{who} ended its stream without {end}")
    except timeouts as exc:
        raise UpstreamStreamStalled(f"{who} stalled mid-stream") from exc
    except errors as exc:
        raise UpstreamStreamBroken(f"{who} stream broke ({reason(exc)})") from exc
    finally:
        done(ended)


def _let_go(response: aiohttp.ClientResponse) -> None:
    """A pass-through answer done with: its connection back in the pool if its body came to its
    end, else aborted (as ``upstream.wire`` aborts a cut answer's): aiohttp would close it
    cleanly, which over TLS sends close_notify and keeps the socket open up to 30 s for the
    server's (asyncio's ``ssl_shutdown_timeout``), an engine generating all that time for a
    client gone. Aborted, the server's next write fails at once."""
    if not response.content.is_eof():
        connection = response.connection
        transport = connection.transport if connection is not None else None
        if transport is not None:
            transport.abort()
        response.close()
    else:
        response.release()


def closer(response: aiohttp.ClientResponse) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        response.close()

    return close
