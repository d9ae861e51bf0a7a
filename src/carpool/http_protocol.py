"""The HTTP/1.1 protocol carpool serves on: uvicorn's httptools protocol, plus the cached
endpoints' small requests served without the ASGI machinery: exact hits answered as the request
is parsed, before any task exists for it, and the rest in a task of its own, whose reply is
written here.

Why: on an exact hit the gateway's work is a dictionary look-up and a write, while uvicorn's ASGI
machinery (a request cycle, an event, a task, the middleware, two sends that each check every
header and write once) costs more than that. Measured on a 2-core VM, hits served through ASGI
ran at about 0.6 of a bare ASGI app returning fixed bytes; answered here, they need none of it.
On a miss the same machinery cost ~0.1 ms of the gateway's ~0.5 ms, and its two writes (head,
then body) woke the client twice.

Contract:
- ``GatewayProtocol`` is ``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`` for every
  request but one kind: a ``POST`` to a cached endpoint's exact path (``request.ENDPOINTS``), over
  HTTP/1.1 with keep-alive, without ``Expect: 100-continue`` or an upgrade, while no earlier
  request of the connection is still being answered (and under uvicorn's concurrency limit, if
  one is set). Such a request's body is held while it is parsed; once it is complete,
  ``GatewayApp.held_request`` makes it a ``ClientRequest`` (None: refused there, client keys, so
  the ASGI path refuses it) and ``GatewayApp.answer_now`` is asked for its reply
  (the request's first step, ``Gateway.repeat_now``: a byte-identical repeat whose answer is
  stored). If there is one, the whole response (uvicorn's default headers, the reply's,
  ``content-length`` and ``x-request-id``) is made at once and written in one piece in the
  loop's next turn, and the connection goes on as after any response. Why the next turn: the
  requests of every connection ready are then read before the answers are written, as when an
  ASGI app's task writes them. Written within the read, an answer cost the kernel three times
  the work (19-20 µs of system time per hit against 6, under wrk: hits at 0.55 of the
  fixed-bytes app instead of 0.85). Whatever would write to the connection or close it first
  sends it before: a request behind it in the same read, a refusal (``_refuse``), the end of
  the client's side, a shutdown, the keep-alive timer. A reply longer than a slice
  (``reply.SLICE_BYTES``) is not written at once: it is written as a served request's is
  (below), in a task, a slice at a time.
- Otherwise the request is served in a task of its own by ``GatewayApp.serve``, as the ASGI path
  serves it (the same ``Gateway.handle``, the same watch for the client leaving, the same counts),
  with uvicorn's request cycle for the connection's state (requests pipelined behind it wait,
  the client leaving is seen, a shutdown makes it the connection's last). Its reply is written
  with the status line and headers uvicorn would write, in its order (a status it has no
  line for, outside 100-599, with an empty reason phrase: ``status_line``): a whole one in
  one write, or, longer than a slice, a slice at a time (``Reply.slices``: views of the
  answer's bytes, its frames joined a few at a time; never a copy of the whole); a stream
  chunked, its head with its first frame (a bypassed stream's head at once), a frame longer
  than a slice in slices; waiting while the client does not read, so that a client that stops
  reading holds about a slice beyond the transport's high-water mark. A failure there is what
  uvicorn makes of an app's: logged, a 500 if nothing was sent (in the API's error shape:
  ``InternalError``), the connection closed; not the shutdown's cancel once the grace period is
  over, which ``GatewayApp.serve`` answers (a 503, or a stream's error event and end), nor a
  reply cut once begun, whose connection is closed without a word. ``shutdown`` (uvicorn
  stopping) marks the gateway draining, in each worker too, so that ``serve`` knows its cancel
  (``Gateway.begin_draining``: the requests waiting in an embeddings batch are sent then).
  While the gateway drains (SIGTERM, ``Gateway.draining``), every answer says ``Connection:
  close`` and its connection closes after it (``_draining``), none held.
- A client that reads nothing of what it is sent for ``limits.send_timeout`` seconds, while
  the transport holds more than its high-water mark for it (writing paused), has its
  connection aborted (``_send_deadline``; looked at every quarter of that, so within 1.25 times
  it), whatever waits to write to it (a reply written here, uvicorn's cycle for a request of
  the ASGI path, a close waiting to send what is left): its request ends as a client's that
  left (a stream's place in its flight released, the flight going on for the others), and
  what was held for it (a slice, the flight's frames) is let go. A client that reads some,
  however slowly, is not cut: what it has not read is the transport's buffer and, on Linux,
  the kernel's send queue (``_unread``), which grows to megabytes and takes more only once a
  good part of it is read (the transport's alone stood still for seconds while a steady reader
  read: it was cut part-way). Under another server (the app under uvicorn's own protocol),
  its flow control bounds what is held (a slice), not for how long.
- A connection lost (its client closed it, or it was aborted) is its client leaving for every
  request on it (``connection_lost``), not only uvicorn's current cycle (the request parsed
  last): the one being answered, on either path, with requests pipelined behind it too, ends as
  a client's that left whatever it waits for (its upstream, the client to read), writes
  nothing more, and is logged as no failure (one a waiting retry keeps going,
  ``ClientWatch.keep``, ends so once let go, writing nothing meanwhile); those queued behind it
  are never run.
- A body is held only within one read from the socket: one not complete when the bytes read so
  far are parsed (a large body, one that trickles in) is handed to uvicorn with what has
  arrived, and its app reads the rest under its usual limits (size, ``body_read_timeout``). A
  body over ``hold_limit`` bytes is handed over at once.
- What is read of a request is bounded as it arrives, when the app served is the gateway's
  (under any wrappers: ``_limits_app``): its target to ``limits.max_header_bytes`` bytes
  (414; 65,535 at most, the most uvicorn's URL parser takes: any target, any app), its header
  names and values together to as many (431; counted as ``GatewayApp`` counts them), and a
  chunked body's trailer section as its headers; a line still coming
  counts as what has come of it. The refusal is the API's error (for a POST to a cached
  endpoint's path: its shape, ``x-carpool: bypass``, counted as rejected; any other method
  there is pass-through's, as elsewhere) with ``connection: close``, and the
  connection closes, lingering. Pipelined behind requests still being answered (a fault in
  its head or in its body), it is written once they are (closed at once, their answers were
  lost); while its own answer is under way
  (a trailer section too large), the connection only closes.
- The request line and headers must all come within ``limits.body_read_timeout`` seconds of
  the connection (its first request) or of the request's first byte (``_head_deadline``): else
  a 408 (the same shape) and the connection closes, lingering, or, nothing of a request having
  come, it closes without a word, as uvicorn closes an idle one. Not while an earlier request
  of the connection is still being answered: the time counts again from then. Between
  requests, an idle connection is uvicorn's (its ``timeout_keep_alive``:
  ``limits.client_keepalive``).
- A request httptools cannot read (RFC 9112: a ``Content-Length`` that is no number, two that
  differ, one beside ``Transfer-Encoding``, a bad chunk size, a space before a header's colon,
  a malformed request line), and one that names no host (HTTP/1.1 without ``Host``) or
  several (two ``Host`` lines, or one listing two: RFC 9112 3.2) is ``MalformedHttp``: a 400
  ``invalid_http`` naming the parser's reason, and a ``Transfer-Encoding`` naming a coding other than chunked (``gzip, chunked``,
  on one line or two), which httptools reads as chunked and hands on still coded, is
  ``TransferCodingRefused``: a 501 ``unsupported_transfer_encoding`` (RFC 9112 6.1). Both are
  refused as the 431 is, and the connection closes, lingering (the rest of a body may still be
  coming: closed at once, the client could lose its answer): for a POST to a cached endpoint's
  path in its API's shape, ``x-carpool: bypass``, counted as rejected; else in OpenAI's; with
  ``x-request-id`` (the client's, if its header came before the fault). Not uvicorn's
  text/plain 400, which carried none. Under another app, they are uvicorn's.
- A request answered before its body's end (a 404, a refusal, a route that reads none): the
  rest must come within ``limits.body_read_timeout`` seconds of the answer, or the connection
  closes, lingering (each read of it disarms uvicorn's keep-alive timer, and no app reads it:
  a byte now and then held the connection for ever).
- A request asking to upgrade the connection (``Upgrade``: ``h2c``, a WebSocket) with a body
  is refused, 400 ``upgrade_not_served``, and the connection closes: httptools takes what
  follows the head for the new protocol, so its body would be lost. Without a body it is
  served as if it asked for none (RFC 9110 7.8; no WebSocket is served: ``ws: none``), said at
  debug only (uvicorn warned twice a request, at every level, advising a WebSocket library: any
  client, ``curl --http2`` included, could fill the log).
- uvicorn's request cycles close the connection through the protocol (``_CycleTransport``): a
  close while the client may still be sending its request (a 413 or a 408 answered before its
  body's end) lingers (``_linger``): this side is shut once what was written is sent, and what
  still comes is read and dropped until the client closes its side, for 2 s at most. Closed at
  once with data unread, the kernel resets the connection, and the client may lose its answer.
- A request of the ASGI path can be cut by its app (its scope's ``server.CUT``, called once its
  response began and will not end: a pass-through answer its upstream cut): its connection
  closes as uvicorn closes one whose app left its response incomplete, but without uvicorn's
  error line (the app logged why), and nothing more is written to it.
- A request over HTTP/1.0 (or 0.9) is answered as uvicorn answers it, but for an answer without
  a length (a stream, a pass-through answer relayed as it comes), which uvicorn sent chunked
  whatever the request's version (RFC 9112 6.1: never to a client that did not send HTTP/1.1):
  its body goes out as it comes, with ``connection: close``, and the connection closes at its
  end, a client's ``Connection: keep-alive`` notwithstanding (``_UnframedCycle``). Such a
  request is never held (above): it takes the ASGI path.
- A chunked body's trailer fields are not headers (RFC 9110 6.5.1): httptools reports them as
  it reports headers, and they are dropped, on either path.
- ``protocol()``: the ``http`` setting of a uvicorn serving the gateway (``carpool serve``, its
  workers, the benchmarks' embedded gateway). Under another server, or another app, the ASGI
  path serves every request; so it does for an app of the user's wrapped around the gateway's
  (only uvicorn's own middleware, and wrappers marked ``TRANSPARENT``, are looked through:
  ``_gateway_app``), which must see every request.
- In front of the embedded simulated engine (``GatewayApp.simulated``), what is written here for
  a cached endpoint (an answer, a refusal) carries ``x-carpool-simulated: true`` before its
  ``x-request-id``, as the ASGI path's does (``server.py``); the bytes are chosen once per
  connection, so a hit costs nothing more otherwise.
- Not done here: uvicorn's access log (off under ``carpool serve``, which counts requests in
  ``/stats`` and ``/metrics`` instead) has no line for a request answered or served here.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections.abc import Callable
from fcntl import ioctl
from functools import partial
from termios import TIOCOUTQ
from time import monotonic
from typing import Any, cast
from urllib.parse import unquote

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from .apis import Api, api_at
from .errors import (
    CarpoolError,
    HeadersTimeout,
    HeadersTooLarge,
    InternalError,
    MalformedHttp,
    RequestError,
    TargetTooLong,
    TransferCodingRefused,
    UpgradeWithBody,
)
from .inbound import ClientWatch
from .outcome import Outcome
from .reply import SLICE_BYTES, Reply, sliced
from .request import ENDPOINTS, ClientRequest
from .request_id import CURRENT as REQUEST_ID
from .request_id import HEADER, request_id
from .server import CUT, RID, SIMULATED_LABEL, GatewayApp

__all__ = ["GatewayProtocol", "protocol"]

log = logging.getLogger("carpool.server")

_ENDPOINTS = frozenset(path.encode("ascii") for path in ENDPOINTS)


def status_line(status: int) -> bytes:
    """The status line of a response: uvicorn's for 100-599, else with an empty reason phrase
    (RFC 9112 4 allows one). The gateway relays no such status (``exchange.send``), but a
    missing line was a KeyError and a connection closed with no answer at all."""
    line = STATUS_LINE.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


_POST = b"POST"
_REQUEST_ID = HEADER + b": "
# In front of the simulated engine, the label goes before the request's id (``_head``).
_LABELLED_REQUEST_ID = b"%s: %s\r\n%s" % (*SIMULATED_LABEL, _REQUEST_ID)


# Set true on a wrapper of the gateway's app (its ``app``) that hands every request to the
# cached endpoints on to it as it came: it is looked through (``_gateway_app``).
TRANSPARENT = "carpool_transparent"


def _nothing() -> None:
    pass


# Where the request being read stands (``GatewayProtocol.phase``).
_IDLE, _HEAD, _BODY = 0, 1, 2
# How long a connection closed while its client may still be sending lingers (``_linger``).
_LINGER_S = 2.0


def _unread(transport: Any) -> int:
    """What the client of ``transport`` has not read yet: the transport's buffer and, where the
    kernel says (Linux: ``SIOCOUTQ``, which is ``TIOCOUTQ``), its send queue, sent or not but
    not acknowledged by the client. A reader that reads some makes it shrink."""
    left: int = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            queued = ioctl(sock.fileno(), TIOCOUTQ, b"\0\0\0\0")
        except (OSError, ValueError):
            return left  # (a kernel that says nothing of a socket's queue, or closed)
        left += int.from_bytes(queued, sys.byteorder, signed=True)
    return left


def protocol() -> type[GatewayProtocol]:
    """The ``http`` setting of a uvicorn serving the gateway's app."""
    return GatewayProtocol


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's protocol, plus exact hits answered as they are parsed (module contract)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gateway_app = _gateway_app(self.app)
        self.hold_limit = (
            self.gateway_app.gateway.repeats.max_body if self.gateway_app is not None else 0
        )
        # The gateway's limits on what is read of a request (``_limits_app``: through any
        # wrapper of the user's), if it is the gateway that is served.
        self.limits_app = _limits_app(self.app)
        self.max_head = self.limits_app.max_headers if self.limits_app else sys.maxsize
        self.max_target = min(self.max_head, MOST_TARGET)
        self.head_timeout = self.limits_app.deadlines.timeout if self.limits_app else None
        # How long a client may read nothing of what it was sent (``_send_deadline``), and,
        # while the transport holds more than it takes (writing paused), the bytes it held
        # when the client last read some, since when, and the timer that looks again.
        self.send_timeout = self.limits_app.send_timeout if self.limits_app else None
        self.send_left = 0
        self.send_since = 0.0
        self.send_timer: asyncio.TimerHandle | None = None
        # In front of the simulated engine its answers say so (``_head``, ``_refuse``).
        self.simulated = self.limits_app is not None and self.limits_app.simulated
        self.request_id_line = _LABELLED_REQUEST_ID if self.simulated else _REQUEST_ID
        # Since when the request line and headers have been awaited (None: not awaited), and
        # the timer that cuts them (``_head_deadline``): one a connection, moved on, not one a
        # request.
        self.head_since: float | None = None
        self.head_timer: asyncio.TimerHandle | None = None
        # The request held: its path and query, and its body's parts so far; None while
        # no request is held.
        self.held: list[bytes] | None = None
        self.held_size = 0
        self.held_target: tuple[str, bytes] = ("", b"")
        # The held request being served, if any: its cycle and its watch (``_serve``).
        self.serving: RequestResponseCycle | None = None
        self.watch: ClientWatch | None = None
        # uvicorn's current cycle before the request being read made its own: with this one
        # pipelined, the one being answered or queued ahead of it (``_refuse``).
        self.before: RequestResponseCycle | None = None
        # The cycle of the request uvicorn last started on the ASGI path (``_start_asgi_task``):
        # with requests pipelined behind it, not uvicorn's current one (``connection_lost``).
        self.answering: RequestResponseCycle | None = None
        # A response answered here, not written yet (``_send_soon``).
        self.soon: bytes | None = None
        # Where the request being read stands: between requests, in its head (its header
        # fields are headers; after it, trailer fields), in its body.
        self.phase = _IDLE
        # What is read of the request so far, as it arrives: its target (what came after its
        # first piece, which is ``url``, is kept in ``url_more``: uvicorn adds each piece to
        # the last), its header (or trailer) fields, and the bytes of the reads since one was
        # last reported (-1: one was, in this read): ``data_received``.
        self.target_size = self.fields_size = self.quiet = 0
        self.url_more: bytearray | None = None
        # Its ``Transfer-Encoding`` names a coding other than chunked (``_codes``).
        self.transfer_coded = False
        # Its ``Host`` lines, and whether one lists several (RFC 9112 3.2: exactly one host).
        self.hosts = 0
        self.hosts_listed = False
        # The request was refused as it was read (``_refuse``): answered, the connection closing.
        self.refused = False
        # Its refusal, while requests before it are still being answered (``_refuse_now``).
        self.refusal: bytes | None = None
        # The connection closing while the client may still send (``_linger``); the proxy
        # uvicorn's cycles write through and close (``_cycle_transport``).
        self.lingering = False
        self.linger_timer: asyncio.TimerHandle | None = None
        self.cycle_transport: _CycleTransport | None = None
        # The rest of a body its request was answered before (``on_response_complete``) must
        # come by this timer, or the connection closes.
        self.rest_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()  # (a connection that sends nothing is cut too)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # (read and dropped: ``_linger``)
        # uvicorn's, but for a request refused as it is parsed: answered already (``_refuse``);
        # and one httptools cannot read, refused as the gateway refuses the others.
        self._unset_keepalive_if_required()
        try:
            self._feed(data)
        except httptools.HttpParserError as error:
            if self.refused:
                return
            if self.limits_app is None:  # (not the gateway's app: uvicorn's protocol)
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            # uvicorn's 400 was text/plain, without ``x-request-id``, counted nowhere. The
            # parser's reason is a fixed phrase of llhttp's ("Invalid character in
            # Content-Length"), never the client's bytes; a callback's failure (a target
            # uvicorn cannot take) has none worth saying.
            callback = isinstance(error, httptools.HttpParserCallbackError)
            reason = None if callback else str(error)
            # (At debug: any client can send such bytes, each request a line. Under the id its
            # refusal carries, which no request's context holds here.)
            rid = request_id(self.headers)
            said = REQUEST_ID.set(rid.decode("ascii"))
            try:
                log.debug(
                    "a request that is not valid HTTP/1.1 was refused (400): %s",
                    reason or "a request target the server cannot take",
                )
            finally:
                REQUEST_ID.reset(said)
            self._refuse(MalformedHttp(reason), rid)
            return
        except httptools.HttpParserUpgrade:
            self.handle_websocket_upgrade()  # (``_feed`` raised it for that only)
            return
        if self.quiet < 0:
            self.quiet = 0
        elif self.phase != _IDLE:
            # Nothing of this read was reported: it is all one header or trailer line still
            # coming (or a chunk's framing), which httptools keeps until the line ends.
            self.quiet += len(data)
            if self.fields_size + self.quiet > self.max_head:
                self._refuse(HeadersTooLarge(self.max_head))
                return
        if self.held is not None:  # its body did not all come in this read: uvicorn's
            self._hand_over(complete=False)
        elif (
            self.phase == _IDLE
            and self.timeout_keep_alive_task is None
            and not self.pipeline
            and (self.cycle is None or self.cycle.response_complete)
        ):
            # A read that began no request (a blank line between requests, which httptools
            # skips) disarmed uvicorn's keep-alive timer and armed no head's: idle again, the
            # connection was held for ever. Keep-alive's again, as after an answer.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _feed(self, data: bytes) -> None:
        """``data`` to the parser, which stops at the end of a request asking to upgrade the
        connection: ``HttpParserUpgrade`` is raised when that upgrade is served (uvicorn's
        WebSocket, outside ``carpool serve``); otherwise the request was served as if it had
        asked for none, and the parser goes on with the rest of the read (what was pipelined
        behind it: dropped, its answers went to the requests after it, and a head dropped so
        left its body to be read as a request)."""
        while True:
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                if self._should_upgrade():
                    raise
                self._unsupported_upgrade_warning()
                data = data[upgrade.args[0] :] if upgrade.args else b""
                if not data or self.refused:
                    return

    def on_message_begin(self) -> None:
        self._send_now()  # (a request behind one answered here, in the same read: after it)
        # A response answered here, within this read, armed the keep-alive timer; uvicorn
        # disarms it only when a read begins, and this request came in the same read.
        self._unset_keepalive_if_required()
        super().on_message_begin()
        self.phase, self.target_size, self.fields_size, self.quiet = _HEAD, 0, 0, -1
        self.url_more = None
        self.transfer_coded = False
        self.hosts, self.hosts_listed = 0, False
        if self.head_since is None:  # (a connection's first request: since the connection)
            self.head_since = self.loop.time()
            if self.head_timer is None:
                self._await_head()

    def on_url(self, url: bytes) -> None:
        self.quiet = -1
        self.target_size += len(url)
        if self.url_more is not None:
            self.url_more += url
        elif self.url:  # (a target in pieces: not uvicorn's ``url += piece``, quadratic)
            self.url_more = bytearray(self.url)
            self.url_more += url
        else:
            self.url = url
        if self.target_size > self.max_target:
            # (Refused once held, in one piece or several alike: its path names the endpoint
            # whose shape and count the refusal takes.)
            self._refuse(TargetTooLong(self.max_target))
            raise _Refused

    def on_header(self, name: bytes, value: bytes) -> None:
        self.quiet = -1
        self.fields_size += len(name) + len(value)  # (as ``server._header_bytes`` counts)
        if self.fields_size > self.max_head:
            self._refuse(HeadersTooLarge(self.max_head))
            raise _Refused
        # httptools reports a chunked body's trailer fields as it reports headers: they are
        # not headers (RFC 9110 6.5.1), and never reach the request's (its key, its
        # Cache-Control, the client-key check, what goes upstream).
        if self.phase == _HEAD:  # (uvicorn's ``on_header``, inlined: one call a header less)
            name = name.lower()
            if name == b"expect" and value.lower() == b"100-continue":
                self.expect_100_continue = True
            elif name == b"transfer-encoding" and _codes(value):
                self.transfer_coded = (
                    True  # (refused once the head is complete: ``on_headers_complete``)
                )
            elif name == b"host":
                self.hosts += 1
                self.hosts_listed = self.hosts_listed or b"," in value
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.url_more is not None:  # (first: a refusal below reads the whole target)
            self.url, self.url_more = bytes(self.url_more), None
        if (
            self.hosts != 1 or self.hosts_listed
        ) and self.limits_app is not None:  # (uvicorn's way under another app)
            if self.hosts > 1 or self.hosts_listed or self.parser.get_http_version() != "1.0":
                # RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request without Host,
                # and to any with more than one (``allowed_hosts`` judges one name).
                self._refuse(MalformedHttp("a request names its one host in one Host line"))
                raise _Refused
        if self.parser.should_upgrade() and _has_body(self.headers):
            # httptools takes what follows the head for the new protocol: the body would be
            # lost, an empty one served (pass-through sent none upstream).
            self._refuse(UpgradeWithBody())
            raise _Refused
        if self.transfer_coded and self.limits_app is not None:
            # httptools takes ``gzip, chunked`` for chunked and hands on the body still coded:
            # it was served as it came (a plain body labelled so, a 200), passed through
            # without its coding. RFC 9112 6.1: a coding the server does not know, 501.
            codings = b", ".join(v for n, v in self.headers if n == b"transfer-encoding")
            self._refuse(TransferCodingRefused(codings.decode("latin-1")))
            raise _Refused
        self.phase, self.fields_size, self.quiet = _BODY, 0, -1  # (then its trailer's)
        self.head_since = None
        target = self._held_target()
        if target is None:
            self.before = self.cycle
            super().on_headers_complete()
            self._cycle_transport()
            self._cuttable()
            self._unchunked()
            return
        self.held, self.held_size, self.held_target = [], 0, target

    def on_body(self, body: bytes) -> None:
        self.quiet = -1
        if self.held is None:
            super().on_body(body)
            return
        self.held.append(body)
        self.held_size += len(body)
        if self.held_size > self.hold_limit:
            self._hand_over(complete=False)

    def on_message_complete(self) -> None:
        self.phase, self.quiet = _IDLE, -1
        rest = self.rest_timer
        if rest is not None:
            rest.cancel()
            self.rest_timer = None
        if self.held is None:
            super().on_message_complete()
            if rest is not None and self.timeout_keep_alive_task is None and not self.pipeline:
                # The rest of a body answered before its end came in time: each of its reads
                # disarmed uvicorn's keep-alive timer. Between requests again, it is armed
                # again, or the connection, idle, was held for ever.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
            return
        if not self._answer():
            self._hand_over(complete=True)

    # Whatever else may write to the connection, or close it, sends what was answered here first.
    def send_400_response(self, msg: str) -> None:
        self._send_now()
        super().send_400_response(msg)

    def eof_received(self) -> None:
        self._send_now()  # (the transport closes once its buffer is written)
        super().eof_received()

    def shutdown(self) -> None:
        self._send_now()
        if self.limits_app is not None:
            # uvicorn is stopping (called on each connection): the gateway is draining, in each
            # worker too, so a request its grace period cuts is ended as one (``GatewayApp._cut``),
            # and what waits in an embeddings batch leaves now, not after the grace period.
            gateway = self.limits_app.gateway
            gateway.begin_draining()
            grace = self.config.timeout_graceful_shutdown
            if gateway.stop_by is None and grace is not None:
                # (a worker's server does not say when its grace period ends: it is from now)
                gateway.stop_by = monotonic() + 0.1 + grace
        super().shutdown()

    def on_response_complete(self) -> None:
        behind = bool(self.pipeline)  # (then the body being read is the next request's)
        super().on_response_complete()
        if self.refusal is not None:
            self._refuse_now()
            return
        if (
            self.phase == _BODY
            and not behind
            and self.head_timeout is not None
            and self.rest_timer is None
        ):
            # Answered before its body's end (a 404, a refusal, an endpoint that reads none):
            # each read of the rest disarms the keep-alive timer, and no app reads it under
            # ``body_read_timeout``: a client sending a byte now and then held the connection
            # for ever. The rest must come within that long, or the connection closes.
            self.rest_timer = self.loop.call_later(self.head_timeout, self._rest_too_late)

    def _rest_too_late(self) -> None:
        self.rest_timer = None
        if self.phase != _IDLE:
            self._linger()

    def timeout_keep_alive_handler(self) -> None:
        self._send_now()
        super().timeout_keep_alive_handler()

    def pause_writing(self) -> None:
        """The transport holds more than its high-water mark: the client is not reading as fast
        as it is sent. From now on it must read some every ``send_timeout`` seconds
        (``_send_deadline``), whoever waits for it (a reply written here, uvicorn's cycle, a
        connection closing once its buffer is sent)."""
        super().pause_writing()
        if self.send_timeout is not None and self.send_timer is None:
            self.send_left = _unread(self.transport)
            self.send_since = self.loop.time()
            self._send_watch()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None

    def _send_watch(self) -> None:
        assert self.send_timeout is not None
        self.send_timer = self.loop.call_later(self.send_timeout / 4, self._send_deadline)

    def _send_deadline(self) -> None:
        """Closes the connection of a client that has read nothing of what it was sent for
        ``send_timeout`` seconds (looked at every quarter of it: cut within 1.25 times that).
        Aborted, not closed: a close waits to send what the transport holds, which this client
        would never take, and the reply (a whole answer's slice, a flight it follows) held on.
        Its request ends as one whose client left (``connection_lost``): a stream's place in
        its flight released, the flight going on for its other clients."""
        self.send_timer = None
        timeout, transport = self.send_timeout, self.transport
        if timeout is None or not self.flow.write_paused:
            return
        left, now = _unread(transport), self.loop.time()
        if left < self.send_left:  # (it read some: it is slow, not gone)
            self.send_left, self.send_since = left, now
        elif now - self.send_since >= timeout:
            # (Under the id of the request being answered: this runs in the connection's
            # context, on uvloop even when a request's write filled the transport.)
            answered = [c for c in (self.serving, self.answering) if c and not c.response_complete]
            rid = cast(dict[str, Any], answered[0].scope).get(RID) if answered else None
            said = REQUEST_ID.set(rid.decode("ascii")) if rid else None
            try:
                log.info("a client read nothing for %g s: its connection is closed", timeout)
            finally:
                if said is not None:
                    REQUEST_ID.reset(said)
            transport.abort()
            return
        self._send_watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.held = self.soon = self.refusal = None
        for timer in (self.linger_timer, self.head_timer, self.rest_timer, self.send_timer):
            if timer is not None:
                timer.cancel()
        self.linger_timer = self.head_timer = self.rest_timer = self.send_timer = None
        super().connection_lost(exc)
        # uvicorn tells only its current cycle, the request parsed last: with requests pipelined
        # behind the one being answered, the last one queued. The one answered went on as if
        # its client were there (a stream held its place in its flight; its watch waits on its
        # own cycle) and wrote to the closed connection, which uvloop refuses: a RuntimeError,
        # logged as the gateway's 500. Every request of the connection is told.
        queued = (cycle for cycle, _ in self.pipeline)
        for cycle in (self.answering, self.serving, *queued):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        if self.watch is not None:
            self.watch.left()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self.answering = cycle  # (the first of a connection, or one pipelined, now answered)
        if self._draining():
            cycle.keep_alive = False  # (uvicorn says ``Connection: close``, then closes)
        super()._start_asgi_task(cycle, app)

    def _draining(self) -> bool:
        """Whether the gateway is draining (SIGTERM, ``draining.py``): every answer then says
        ``Connection: close`` and its connection closes after it, so that a proxy keeping
        connections to the gateway sends nothing more on one the drain's end would close
        under its next request (its client got a 502). Not held meanwhile (``_held_target``)."""
        app = self.limits_app
        return app is not None and app.gateway.draining

    def _held_target(self) -> tuple[str, bytes] | None:
        """The path and query of a request that may be held (module contract), else None."""
        parser = self.parser
        if (
            self.gateway_app is None
            or parser.get_method() != _POST
            or self.expect_100_continue
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or parser.should_upgrade()
            or (self.cycle is not None and not self.cycle.response_complete)
            or self.pipeline
            or self.transport.is_closing()
            or self._draining()
            # The client does not read what it was sent: the ASGI path waits for it to (and
            # pauses the requests behind), where answering here would only pile answers up.
            or self.flow.write_paused
            # (uvicorn answers a 503 over its concurrency limit, when one is set)
            or (
                self.limit_concurrency is not None
                and max(len(self.connections), len(self.tasks)) >= self.limit_concurrency
            )
        ):
            return None
        # The path as sent (origin form): one that needs decoding, or with a fragment, or in
        # absolute form, is not an endpoint's exact path, and goes uvicorn's way.
        path, _, query = self.url.partition(b"?")
        if path not in _ENDPOINTS or query.find(b"#") != -1 or self.root_path:
            return None
        return path.decode("ascii"), query

    def _answer(self) -> bool:
        """Answers the held request here: at once if ``answer_now`` has its reply, else in a
        task of its own (``_serve``); False: it goes the ASGI way."""
        app = self.gateway_app
        assert app is not None and self.held is not None
        body = self.held[0] if len(self.held) == 1 else b"".join(self.held)
        path, query = self.held_target
        started = monotonic()
        try:
            client = app.held_request(path, self.headers, query, body)
            if client is None:
                return False
            rid = request_id(self.headers)
            reply = app.answer_now(client)
            if reply is None:
                self._serve(client, rid, path, query, started)
                self.held = None
                return True
        except Exception:  # (a bug: not the client's; raised here, httptools would say 400)
            log.exception("answering a held request failed; it goes the ASGI way")
            return False
        self.held = None
        if reply.parts is not None or len(reply.body) > SLICE_BYTES:
            # Too long for one write: written a slice at a time in a task of its own, waiting
            # for the client to read (``_respond``), as a reply served there is.
            self._serve(client, rid, path, query, started, reply)
            return True
        head = self._head(reply, rid, len(reply.body))
        head.append(reply.body)
        self._send_soon(b"".join(head))
        try:
            reply.close()
        except Exception:  # (sent already: nothing else may follow it on the wire)
            log.exception("closing a reply answered at once failed")
        # As after any response: counted, reading resumed, the keep-alive timer armed.
        self.on_response_complete()
        return True

    def _send_soon(self, data: bytes) -> None:
        """Write ``data`` in the loop's next turn, after the reads that are ready (module
        contract), or before whatever else would write or close first (``_send_now``)."""
        self._send_now()  # (none is left: a request's beginning sent it)
        self.soon = data
        self.loop.call_soon(self._send_now)

    def _send_now(self) -> None:
        data, self.soon = self.soon, None
        if data is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _serve(
        self,
        client: ClientRequest,
        rid: bytes,
        path: str,
        query: bytes,
        started: float,
        reply: Reply | None = None,
    ) -> None:
        """The held request, not answered at once, served in a task of its own as the ASGI path
        serves it (``GatewayApp.serve``), its reply written here: a whole one in one write (a
        long one a slice at a time), a stream with its first frame. Its cycle is uvicorn's, for
        what the connection does meanwhile (requests pipelined behind it, the client leaving, a
        shutdown). ``reply``: its answer, made at once (``_answer``) but too long to be written
        in one piece: only written."""
        scope = self.scope  # (as uvicorn would have filled it, for whoever reads the cycle's)
        scope["method"], scope["path"], scope["raw_path"] = "POST", path, path.encode("ascii")
        scope["query_string"] = query
        cycle = RequestResponseCycle(
            scope=self.scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=True,
            on_response=self.on_response_complete,
        )
        cycle.more_body = False  # (its whole body is the client's: ``receive`` only waits)
        # Told by ``connection_lost`` if the client leaves (no watcher task needed).
        watch = _ConnectionWatch(self.flow)
        served = self._served(cycle, client, rid, watch, started, reply)
        task = (
            self.loop.create_task(served, context=contextvars.Context())
            if self.config.reset_contextvars  # (uvicorn's opt-in, kept)
            else self.loop.create_task(served)
        )
        watch.task = task
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        self.cycle = self.serving = cycle
        self.watch = watch

    async def _served(
        self,
        cycle: RequestResponseCycle,
        client: ClientRequest,
        rid: bytes,
        watch: ClientWatch,
        started: float,
        reply: Reply | None,
    ) -> None:
        REQUEST_ID.set(rid.decode("ascii"))
        cast(dict[str, Any], cycle.scope)[RID] = rid  # (a key of ours)
        app = self.gateway_app
        assert app is not None
        try:
            if reply is None:
                await app.serve(client, watch, partial(self._respond, cycle, rid), started)
            else:  # (answered, counted and timed already: ``_answer``)
                try:
                    await self._respond(cycle, rid, reply, watch)
                finally:
                    reply.close()
            if not cycle.response_complete and not cycle.disconnected:
                self.transport.close()  # (a reply cut once begun: never left open, as uvicorn's)
        except BaseException as exc:  # (as uvicorn's cycle: a bug, or a cancel not handled)
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not cycle.response_started and not cycle.disconnected:
                cycle.response_started = True
                self.transport.write(self._internal_error(client.path, rid))
            self.transport.close()
        finally:
            cycle.on_response = _nothing  # (as uvicorn's: the protocol is not kept by it)
            if self.watch is watch:
                self.serving = self.watch = None

    async def _respond(
        self, cycle: RequestResponseCycle, rid: bytes, reply: Reply, state: ClientWatch
    ) -> None:
        """``reply`` on the wire: a whole one in one write (a long one a slice at a time:
        ``Reply.slices``); a stream as chunks, its head with its first frame; waiting whenever
        the client does not read what it was sent. Once its head is sent (``state.headed``), a
        stream is the rest of it (``GatewayApp._cut``)."""
        flow, write = self.flow, self.transport.write
        if reply.stream is None:
            state.finished = True
            if flow.write_paused and not cycle.disconnected:
                await flow.drain()
            if cycle.disconnected:
                return
            cycle.response_started = state.headed = True
            top, pieces = self._head(reply, rid, reply.size, cycle.keep_alive), reply.slices()
            write(b"".join((*top, next(pieces, b""))))  # (the head with its first slice)
            for piece in pieces:  # (a long one: each slice once the client took the last)
                if flow.write_paused and not cycle.disconnected:
                    await flow.drain()
                if cycle.disconnected:
                    return
                write(piece)
            self._complete(cycle)
            return
        head = None if state.headed else self._head(reply, rid, None, cycle.keep_alive)
        if reply.outcome is Outcome.BYPASS and head is not None and not cycle.disconnected:
            # Its own call, relayed as the upstream makes it: the head now, as the upstream's
            # came (a flight's reply comes with its first frame ready: sent with it).
            cycle.response_started = state.headed = True
            write(b"".join(head))
            head = None
        stream = reply.stream
        async for frame in stream:
            if flow.write_paused and not cycle.disconnected:
                await flow.drain()
            if cycle.disconnected or not frame:
                continue
            # The last piece (``exchange.Relay.ended``): the body's end goes with it.
            last = getattr(stream, "ended", False)
            end = b"\r\n0\r\n\r\n" if last else b"\r\n"
            if len(frame) > SLICE_BYTES:  # (one long frame: not copied whole into the chunk)
                if head is not None:
                    cycle.response_started = state.headed = True
                    write(b"".join(head))
                    head = None
                write(b"%x\r\n" % len(frame))
                for piece in sliced(frame, SLICE_BYTES):
                    if flow.write_paused and not cycle.disconnected:
                        await flow.drain()
                    if cycle.disconnected:
                        break
                    write(piece)
                else:
                    write(end)
            elif head is not None:
                cycle.response_started = state.headed = True
                write(b"".join((*head, b"%x\r\n" % len(frame), frame, end)))
                head = None
            else:
                write(b"".join((b"%x\r\n" % len(frame), frame, end)))
            if cycle.disconnected:
                continue
            if last:
                state.finished = True
                self._complete(cycle)
                return
        state.finished = True
        if flow.write_paused and not cycle.disconnected:
            await flow.drain()
        if not cycle.disconnected:
            cycle.response_started = state.headed = True
            write(b"".join((*head, b"0\r\n\r\n")) if head is not None else b"0\r\n\r\n")
            self._complete(cycle)

    def _complete(self, cycle: RequestResponseCycle) -> None:
        """As uvicorn's cycle ends a response: the connection goes on (or closes), counted."""
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    def _internal_error(self, path: str, rid: bytes) -> bytes:
        """The 500 of a request whose serving failed, as uvicorn sends one (its default headers,
        the connection closed), in the API's error shape (``InternalError``), as the ASGI path's
        (``server.GatewayApp``)."""
        return self._closing_error(InternalError(), api_at(path), rid)

    def _closing_error(self, error: CarpoolError, api: Api | None, rid: bytes) -> bytes:
        """``error`` as a whole response after which the connection closes: uvicorn's default
        headers, in the API's error shape for a cached endpoint's path (``api``: with
        ``x-carpool: bypass``, and the simulator's label in front of it), else OpenAI's."""
        body = api.error_body(error) if api is not None else error.body()
        head = [status_line(error.status)]
        for name, value in (
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            *((Outcome.BYPASS.header,) if api is not None else ()),
            *((SIMULATED_LABEL,) if api is not None and self.simulated else ()),
            (b"content-length", str(len(body)).encode("ascii")),
            (HEADER, rid),
            (b"connection", b"close"),
        ):
            head += (name, b": ", value, b"\r\n")
        return b"".join((*head, b"\r\n", body))

    def _head(
        self, reply: Reply, rid: bytes, length: int | None, keep_alive: bool = True
    ) -> list[bytes]:
        """The response's head (uvicorn's default headers, the reply's, ``x-request-id``), its
        body ``length`` bytes long (``content-length``); None: a stream, chunked."""
        content = [status_line(reply.status)]
        for name, value in (*self.server_state.default_headers, *reply.headers):
            content += (name, b": ", value, b"\r\n")
        if length is not None:  # (in uvicorn's order: the reply's, then ours)
            content += (b"content-length: ", str(length).encode("ascii"), b"\r\n")
        content += (self.request_id_line, rid, b"\r\n")
        if not keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"transfer-encoding: chunked\r\n\r\n" if length is None else b"\r\n")
        return content

    def _cycle_transport(self) -> None:
        """uvicorn's cycle (just made) writes and closes through ``_CycleTransport``: its close
        after a response (``connection: close``, a 413 or 408 among them) lingers."""
        proxy = self.cycle_transport
        if proxy is None or proxy.transport is not self.transport:
            proxy = self.cycle_transport = _CycleTransport(self.transport, self._close)
        if self.cycle is not None:
            self.cycle.transport = proxy  # type: ignore[assignment]

    def _cuttable(self) -> None:
        """uvicorn's cycle just made for this request can be cut by its app (``server.CUT``)."""
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # (none made: an upgrade)
            cast(dict[str, Any], cycle.scope)[CUT] = partial(self._cut, cycle)  # (a key of ours)

    def _unchunked(self) -> None:
        """uvicorn's cycle just made for a request over HTTP/1.0 (or 0.9) sends an answer without
        a length unframed, never chunked (``_UnframedCycle``)."""
        cycle = self.cycle
        if (
            cycle is not None
            and cycle.scope is self.scope  # (none made: an upgrade)
            and self.scope["http_version"] in _BEFORE_CHUNKED
        ):
            # uvicorn makes a cycle of its own class; only ``send`` differs. Its task has not run
            # yet (it starts in the loop's next turn): the app is handed this ``send``.
            cycle.__class__ = _UnframedCycle

    def _cut(self, cycle: RequestResponseCycle) -> None:
        """Cuts ``cycle``'s response, begun and not to be ended (a pass-through answer its
        upstream cut part-way: ``server._Relay``): the connection closes as uvicorn closes one
        whose app left its response incomplete, without uvicorn's error line (the app logged
        why); the cycle writes nothing more (its client's side is gone, as far as it knows)."""
        if cycle.response_complete or cycle.disconnected:
            return
        cycle.disconnected = True
        cycle.message_event.set()
        cycle.transport.close()

    def _close(self) -> None:
        """Closes the connection: at once between requests; while the client may still be
        sending a request (a body answered 413 or 408 before its end), lingering."""
        if self.phase == _IDLE:
            self.transport.close()
        else:
            self._linger()

    def _linger(self) -> None:
        """Closes the connection once the client has had time to read what it was sent: its side
        is shut (after what was written), and what it still sends is read and dropped until it
        closes its own, or for ``_LINGER_S`` at most. Closed at once, with data unread or still
        coming, the kernel resets the connection, and the client may lose its answer."""
        transport = self.transport
        if self.lingering or transport.is_closing():
            return
        if not transport.can_write_eof():  # (TLS)
            transport.close()
            return
        self.lingering = True
        # A request pipelined behind is never run: its answer could not be sent (uvicorn starts
        # the next cycle unless the transport says it is closing, which lingering it is not).
        self.pipeline.clear()
        self.flow.resume_reading()  # (paused with a body unread, nothing would come)
        transport.write_eof()
        self.linger_timer = self.loop.call_later(_LINGER_S, transport.close)

    def _await_head(self) -> None:
        """The request line and headers are awaited from now, for ``head_timeout`` seconds."""
        if self.head_timeout is None:
            return  # (not the gateway's app: uvicorn's protocol)
        if self.head_since is None:
            self.head_since = self.loop.time()
        if self.head_timer is None:
            due = self.head_since + self.head_timeout
            self.head_timer = self.loop.call_at(due, self._head_deadline)

    def _head_deadline(self) -> None:
        """Cuts a connection whose request line and headers did not all come within
        ``head_timeout`` seconds: a 408 if a request began, else closed without a word, as
        uvicorn closes an idle connection. Not while an earlier request is still being
        answered (this one waits behind it, unread): its time counts again from then."""
        self.head_timer = None
        since, timeout = self.head_since, self.head_timeout
        if (
            since is None
            or timeout is None
            or self.refused  # (answered, or to be once those before it are: ``_refuse``)
            or self.lingering
            or self.transport.is_closing()
        ):
            return  # (none awaited: the next head arms it again)
        now = self.loop.time()
        cycle = self.cycle
        if now >= since + timeout and (
            self.pipeline
            or self.flow.read_paused
            or (cycle is not None and not cycle.response_complete)
        ):
            since = self.head_since = now
        if now < since + timeout:
            self.head_timer = self.loop.call_at(since + timeout, self._head_deadline)
        elif self.phase == _HEAD:
            self._refuse(HeadersTimeout(timeout))
        else:
            self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        # (uvicorn's two warnings a request: the module's contract)
        log.debug("a request asking to upgrade the connection is served as HTTP/1.1")

    def _refuse(self, error: RequestError, rid: bytes | None = None) -> None:
        """Answers ``error`` (431, 414, 408, a malformed request's 400, 501) to the request being
        read, in the API's error shape, and closes the connection, lingering. While earlier
        requests of the connection are still being answered, once they are (``refusal``);
        while its own answer is under way (its trailer section), it only closes it (not to be
        cut into). The parser reads no more of it."""
        self.refused = True
        self._send_now()
        cycle = self.cycle
        earlier = False
        if (
            self.phase == _BODY
            and self.held is None
            and cycle is not None
            and cycle.scope is self.scope  # (not an earlier request's: uvicorn's made none)
        ):
            # (its body or trailer section: uvicorn has the request, whose app reads no more)
            if self.before is not None and self.pipeline and self.pipeline[0][0] is cycle:
                # Pipelined behind requests still being answered, its cycle queued, never
                # started: dropped, and the refusal written once they are answered, as a
                # refused head's (closed at once, their answers were lost, and its own).
                self.pipeline.popleft()
                self.cycle, earlier, free = self.before, True, False
            else:
                free = not self.pipeline and not cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
        else:
            free = cycle is None or cycle.response_complete
            earlier = not free
        self.held = None
        if not free and not earlier:
            self.transport.close()
            return
        # Only a POST is a cached endpoint's request: any other method on its path is
        # pass-through's, refused in OpenAI's shape and counted nowhere (as ``GatewayApp``).
        target = self.url if self.url_more is None else self.url_more  # (a target in pieces)
        api = api_at(_target_path(target)) if self.parser.get_method() == _POST else None
        if api is not None and self.limits_app is not None:
            self.limits_app.gateway.stats.rejected += 1
        refusal = self._closing_error(error, api, rid or request_id(self.headers))
        if earlier:
            # Pipelined behind requests not answered yet: closed now, their answers were lost
            # with it (and uvicorn's 400 cut into them). Written once they are.
            self.refusal = refusal
            return
        self.transport.write(refusal)
        self._linger()

    def _refuse_now(self) -> None:
        """The refusal kept for after the answers to the requests before it (``_refuse``):
        written once the last of them is complete, and the connection closes, lingering."""
        refusal, cycle = self.refusal, self.cycle
        if refusal is None or self.pipeline or (cycle is not None and not cycle.response_complete):
            return
        self.refusal = None
        if not self.transport.is_closing():  # (the last answer closed it: ``connection: close``)
            self.transport.write(refusal)
            self._linger()

    def _hand_over(self, complete: bool) -> None:
        """The held request to uvicorn, with the body it has so far, as if never held."""
        held, self.held = self.held, None
        if held is None or self.transport.is_closing():
            return  # (uvicorn refused the request as it was parsed: a 400, closed)
        self.before = self.cycle
        super().on_headers_complete()  # (its cycle and task, from the parser's state)
        self._cycle_transport()
        self._unchunked()
        cycle = self.cycle
        if held:
            cycle.body = bytearray().join(held)
        if complete:
            cycle.more_body = False
        cycle.message_event.set()


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request with these (lower-case) header fields has a body."""
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" 0"))
        for name, value in headers
    )


def _codes(value: bytes) -> bool:
    """Whether a ``Transfer-Encoding`` value names a coding other than chunked (``gzip,
    chunked``; codings are case-insensitive, RFC 9112 7)."""
    return any(coding.strip() not in (b"chunked", b"") for coding in value.lower().split(b","))


class _Refused(Exception):
    """Raised in a parser callback once the request is refused (``_refuse``): the parser stops."""


class _CycleTransport:
    """The connection's transport as uvicorn's request cycles use it (``write``, ``is_closing``,
    ``close``), its ``close`` the protocol's (``GatewayProtocol._close``)."""

    __slots__ = ("transport", "write", "is_closing", "close")

    def __init__(self, transport: Any, close: Any) -> None:
        self.transport = transport
        self.write = transport.write
        self.is_closing = transport.is_closing
        self.close = close

    def __getattr__(self, name: str) -> Any:  # (anything else a cycle may use: the transport's)
        return getattr(self.transport, name)


# The versions httptools reads whose clients know no chunked coding (RFC 9112 6.1: it is sent
# only to a client that sent HTTP/1.1 or later).
_BEFORE_CHUNKED = frozenset(("0.9", "1.0"))


class _UnframedCycle(RequestResponseCycle):
    """uvicorn's request cycle for a client of HTTP/1.0 (``_BEFORE_CHUNKED``). uvicorn chunks an
    answer sent without a length (a stream) whatever the request's version, and such a client
    reads the chunk sizes as part of the body. Here its body goes out as it comes, the
    connection closed at its end (``connection: close``, even if the client asked to keep it:
    the close is the body's end). Any other answer is uvicorn's, unchanged."""

    unframed = False  # (its answer has no length: set once its head is sent)

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            headers = list(message.get("headers", ()))  # (any iterable: read twice below)
            names = {name.lower() for name, _ in (*self.default_headers, *headers)}
            if (
                b"content-length" not in names
                and self.scope["method"] != "HEAD"
                and message["status"] not in (204, 304)
            ):  # (where uvicorn would chunk it)
                self.unframed = True
                self.chunked_encoding = False  # (uvicorn then adds no chunked of its own)
                self.keep_alive = False
                message = {
                    **message,
                    "headers": [(n, v) for n, v in headers if n.lower() != b"transfer-encoding"],
                }
        elif message["type"] == "http.response.body" and self.unframed:
            # uvicorn counts an unchunked body down from its content-length, which an unframed
            # one has none of: each piece is all it waits for, and the last leaves nothing.
            self.expected_content_length = len(message.get("body", b""))
        await super().send(message)


class _ConnectionWatch(ClientWatch):
    """The watch of a request served here: ``connection_lost`` tells it the client left. While
    its request waits, reading is resumed, as uvicorn's ``receive`` resumes it for the ASGI
    path's watcher: a request pipelined behind paused it, and a paused connection's end would
    not be seen."""

    __slots__ = ("flow",)

    def __init__(self, flow: Any) -> None:
        super().__init__()
        self.flow = flow

    def start(self) -> None:
        self.flow.resume_reading()
        super().start()


def _limits_app(app: Any) -> GatewayApp | None:
    """The ``server.GatewayApp`` under any wrappers (the user's too), whose limits the protocol
    keeps to as it reads; None: another app, no limits of the gateway's."""
    return _under(app, lambda _: True)


def _gateway_app(app: Any) -> GatewayApp | None:
    """The ``server.GatewayApp`` under uvicorn's own middleware (``ProxyHeadersMiddleware``...),
    or None: another app is served, and this protocol is uvicorn's. Only uvicorn's wrappers,
    and those that say they hand the cached endpoints' requests on as they come
    (``TRANSPARENT``), are looked through: a middleware of the user's around the gateway
    (authentication, limits) must see every request, so with one they all go the ASGI way."""
    return _under(
        app,
        lambda wrapper: (
            type(wrapper).__module__.startswith("uvicorn.middleware.")
            or getattr(wrapper, TRANSPARENT, False)
        ),
    )


def _under(app: Any, through: Callable[[Any], bool]) -> GatewayApp | None:
    """The ``GatewayApp`` found by following ``.app`` through wrappers that ``through`` accepts
    (eight at most), or None."""
    for _ in range(8):
        if isinstance(app, GatewayApp):
            return app
        if not through(app):
            return None
        app = getattr(app, "app", None)
    return None


# The longest request target uvicorn's protocol parses (``httptools.parse_url``, on every
# request's head): past it, its head was a 400 "not valid HTTP" in OpenAI's shape, whatever
# ``limits.max_header_bytes`` allows; now the 414 of a target too long.
MOST_TARGET = 65_535


def _target_path(target: bytes | bytearray) -> str:
    """The path of a request target as uvicorn puts it in the ASGI scope, by which the gateway
    serves it (``/v1/%6Dessages`` and the absolute form ``http://host/v1/messages`` are the
    Messages endpoint): a refusal here is then in the shape of the endpoint served there. Read
    before its query (the parser refuses a target past ``MOST_TARGET``, a refused one's too)."""
    target = bytes(target).partition(b"?")[0].partition(b"#")[0]
    try:
        path = httptools.parse_url(target).path or b""
    except httptools.HttpParserInvalidURLError:
        return ""
    text = path.decode("latin-1")
    return unquote(text) if "%" in text else text
