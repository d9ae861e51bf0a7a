"""A lean HTTP/1.1 client for the upstream calls of the cached endpoints (``upstream.http``).

Why not aiohttp here: every miss makes one such call, and through aiohttp one cost the gateway
about 0.25 ms of CPU (its request and response objects, a task to write the body, a timer
rescheduled on every read); this does only what those calls need, in about a fifth of that:
one POST, its status, its content type and its body (whole, or as it comes for a stream), on
a kept connection. Pass-through and the peers keep aiohttp (any method, bodies relayed raw).

Contract:
- ``Pool``: the connections to one replica (``host``, ``port``; TLS with ``ssl``). At most
  ``limit`` are open at once; a request beyond waits, in turn, for one to be freed (first come,
  first served: a connection given back, or a place freed, goes to the request that has waited
  longest, never to one that came after it), for ``queue_timeout`` seconds at most: then it
  fails, ``WireBusy`` (nothing sent), its turn given up (what is freed goes to the next in
  line, as for a request cancelled while it waits). An idle one
  is reused, the most recently used first, unless it has been idle for ``keepalive_s`` or more
  (then it is closed: before the server drops it itself, which races with its reuse; the
  oldest idle ones are closed so too whenever a connection comes back, and by a timer at the
  oldest one's ``keepalive_s``, traffic or none: after a burst, a server with no idle timeout
  of its own was left holding every connection until the gateway's next call) or the server
  closed it or sent anything unasked. ``monotonic`` (this module's) is the idle clock.
- ``Pool.request(head, body, whole)`` sends a request's head and body on one connection, and
  returns an ``Answer`` once its status and headers have come, or (``whole``) once all of it
  has. A body of at most ``ONE_WRITE_BYTES`` goes with its head, in one write (a small call's
  latency: one segment, one wake of the server); a larger one is written after its head, never
  joined to it: the joined copy was one more copy of the body (a megabyte prompt, a megabyte)
  held for the whole call, beside the body itself, kept for a resend (below). It is sent
  once: a POST may not be sent again once a server may have read it whole,
  which no client can tell from a server that closed the connection just then (a drop 0.5 s
  into a generation and the keep-alive race read the same, a closed or reset connection with
  no byte of answer: sent again, a generation ran twice on its replica, and a third time on
  another once that one failed too). As Go's net/http client does for a request it may not
  replay (``shouldRetryRequest``: only "nothing written"), a request is sent again only when
  the server cannot have read it whole, for the keep-alive race (a server dropping a kept
  connection it deems idle as a request goes out on it) in its two forms:
  - the server's close (its FIN or RST, or anything it sent unasked: a 408, TLS's
    close_notify) had come when the request was to go out on a kept connection, the loop not
    yet told (readable in the kernel: ``Connection.stale``), or the transport was closing
    already: nothing is written on it; the request goes on a new connection, not counted as
    sent again (nothing was);
  - a kept connection (used before) closed or reset by the server before the request was
    written whole (``sent``, below: a large body the server never took): sent again, once, on
    a new connection (a place in the pool, in turn, first in line), never on one used before,
    and counted in ``resent`` (``upstream.http``'s, the replica set's ``upstream_calls``:
    the engine was asked twice).
  Any other failure is the caller's, once: one after the request was written whole (``sent``:
  it may be running, ``upstream.http``'s ``UpstreamNoAnswer``), a timeout, a byte of an
  answer, a failure on a connection opened for the request. The race is rare besides: an idle
  connection is closed at ``keepalive_s`` (4 s by default), before uvicorn's (vLLM's,
  SGLang's, llama.cpp's server's) 5 s.
- ``Answer.read()`` the whole body; ``Answer.chunks()`` the body as it comes. ``release(drain)``
  puts the connection back in the pool if the answer came to its end and the server keeps the
  connection; ``drain``: the caller has read all it wanted (a stream's ``[DONE]``), so the
  connection goes back once the rest of the answer (its end) has come, if it does in time.
  Otherwise it is closed, which tells the server the caller has gone (an engine then stops
  generating): aborted, as is any connection whose answer did not come whole (a failure, a
  timeout, a reader gone), never closed cleanly: over TLS a clean close waits up to 30 s
  (asyncio's ``ssl_shutdown_timeout``) for the server's close_notify, the socket open, and a
  server that notices a gone caller only when a write fails went on generating all that time.
  ``discard()`` closes it whatever came: a stream that did not end whole (no
  ``[DONE]``) is no answer its server finished, even when its HTTP body ended with keep-alive
  (llama-cpp-python's server answers a prompt over its context with an empty body, then closes
  the connection a few ms later: kept, the next request went on it as it closed). ``release``
  and ``discard`` are safe to call twice (the first counts), and after a failure or a
  cancellation; a request cancelled while it waits closes its connection.
- An answer's head (status line and headers, with those of any interim ``1xx`` answer before
  it) is at most ``MAX_HEAD`` bytes, counted as they come: beyond, the answer fails
  (``WireError``, "answer head too large") and its connection is closed. A server that sends
  an endless head would otherwise grow the gateway's memory without bound until the answer's
  timeout (below). A chunked body's trailer fields count so too, once each is whole. Of its
  fields, an ``Answer`` keeps its content type, what it says of when to retry
  (``errors.RETRY_FIELDS``, names lower-case, values as they came) and its ``Cache-Control``
  (``cache_control``: every line of it, joined by ", " as RFC 9110 5.3 allows; "" for none;
  a whole answer that says ``no-store`` or ``private`` is never stored, ``Answer.storable``;
  a stream's is not read, an SSE server's default of the live feed) and its
  ``Content-Encoding`` (``content_encoding``, its lines joined so too; "" for none): the body
  is never decoded here, ``upstream.http`` judges it (asked for ``identity``, an upstream or a
  proxy before it may compress all the same), and what a proxy says of it (``proxy_status``:
  its ``Proxy-Status`` lines joined so too; ``squid_error``: ``X-Squid-Error``; read by
  ``upstream.proxy.proxy_error``). The rest is read by no one.
- Timeouts: ``connect_timeout`` seconds for a new connection (TCP and TLS): a ``WireError``
  ("connection timed out"), like a refused one, since nothing was sent; ``answer_timeout``
  seconds for the answer, counted from when its request was sent (``WireTimeout``, the
  connection closed): a whole answer (``read``) must come all of it by then, head and body;
  an answer read as it comes (``chunks``) is given ``answer_timeout`` more each time its
  reader says it got something of use (``Answer.progressed``: a stream's event). Bytes alone
  are no progress: a server that sends a byte now and then (a body trickled in, a stream
  kept warm by SSE comments and nothing else) would otherwise hold its caller for ever.
  Pieces its reader has not read yet when the time is up may hold its progress: then it is
  judged when the reader next waits, once it has read them.
- Failures are ``WireError``: ``reason`` says what happened in a few words fit for a client
  (``reason_of``: no address, no repr; a certificate the TLS handshake refused, "TLS
  certificate not trusted: " and its kind, ``certificate_problem``: hostname mismatch,
  expired, unknown issuer..., OpenSSL's own message, which names the host, only in the
  ``__cause__``, for the operator's log); ``answered`` whether the status had come; ``sent``
  whether the request had been written whole by then (handed to the OS, over TLS to the TLS
  layer: the server may be running it; not written whole, it cannot be), a timeout's as a
  dropped connection's (``upstream.http`` tells them apart: a request sent whole may have run);
  a write that failed, or went on a connection already closing, sent nothing. The OS's or
  the parser's error is its ``__cause__``. A header name or value with a control character
  (but tab) is refused before anything is sent (``ValueError``, as aiohttp did: no header
  injection through the library API).
- A connection this machine could not open for want of its own resources (no file descriptor,
  no local port, no buffer or memory: ``local_reason``) is a ``WireLocal``: no failure of the
  replica's, which was never reached.
- ``Pool(..., tunnel=proxy)``: each connection is a tunnel through that HTTP proxy
  (``upstream.proxy``): a TCP connection to the proxy, ``CONNECT host:port``, and once it
  answers 2xx (its head at most ``MAX_HEAD`` bytes, nothing after it) TLS to the replica over
  it, all within ``connect_timeout``. Any other answer is a ``WireError`` ("proxy answered
  407"), as a refused connection: nothing was sent to the replica; so is a proxy that cannot be
  reached ("proxy: connection refused"). (An http replica behind a
  proxy needs no tunnel: its pool connects to the proxy and its requests name the replica's
  URL in full, ``upstream.http``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import select
import socket
import ssl as ssl_module
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping

import httptools

from .. import http_syntax
from ..errors import RETRY_FIELDS
from .proxy import Proxy

monotonic = time.monotonic  # the idle clock (a test moves it)

# The largest body written with its head in one write (``Pool.request``): joining them costs a
# copy of it, a few microseconds here; a larger one is written apart, with no copy.
ONE_WRITE_BYTES = 64 * 1024


class WireError(Exception):
    """A transport failure (see the module's contract)."""

    def __init__(self, reason: str, answered: bool = False, sent: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.answered = answered
        self.sent = sent


class WireLocal(WireError):
    """No connection opened for want of this machine's own resources (``local_reason``)."""


# The errors of a connection that never left this machine for want of its resources: no file
# descriptor (the process's, the system's), no local port for its address, no buffer, memory.
_LOCAL_ERRNOS = {
    errno.EMFILE: "too many open files",
    errno.ENFILE: "too many open files in the system",
    errno.EADDRNOTAVAIL: "no local port free",
    errno.ENOBUFS: "no buffer space",
    errno.ENOMEM: "out of memory",
}


def local_reason(error: BaseException | None) -> str | None:
    """The few words for a connection this machine could not open for want of its own
    resources; None: another failure (the replica's, or the network's). A name lookup that
    failed is one when no socket can be opened now: with no descriptor left, the resolver
    cannot read /etc/hosts or reach a DNS server, and says "name not known"."""
    reason = _LOCAL_ERRNOS.get(getattr(error, "errno", None) or 0)
    if reason is None and isinstance(error, socket.gaierror):
        try:
            socket.socket().close()
        except OSError as exhausted:
            return _LOCAL_ERRNOS.get(exhausted.errno or 0)
    return reason


class WireBusy(WireError):
    """No connection free for the request within ``queue_timeout`` (see the module's contract):
    every one the limit allows in use; nothing was sent."""


class WireTimeout(WireError):
    """The answer did not come within ``answer_timeout`` (see the module's contract; no
    connection in time is a plain ``WireError``: nothing was sent)."""


def reason_of(error: BaseException) -> str:
    """What went wrong with a connection, in a few words fit for a client (no repr, no address)."""
    if isinstance(error, WireError):
        return error.reason
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, socket.gaierror):
        return "name not resolved"
    if isinstance(error, ssl_module.SSLCertVerificationError):
        return f"TLS certificate not trusted: {certificate_problem(error)}"
    if isinstance(error, ssl_module.SSLError):
        return "TLS handshake failed"
    return os_reason(error) or (
        "connection failed" if isinstance(error, OSError) else "transport error"
    )


# OpenSSL's verify codes (``X509_V_ERR_*``), by what an operator would fix.
_CERTIFICATE_PROBLEMS = {
    9: "not yet valid",
    10: "expired",
    2: "unknown issuer",
    18: "unknown issuer",  # (self-signed)
    19: "unknown issuer",  # (a self-signed root in the chain)
    20: "unknown issuer",
    21: "unknown issuer",
    62: "hostname mismatch",
    64: "hostname mismatch",  # (an IP address)
}


def certificate_problem(error: ssl_module.SSLCertVerificationError) -> str:
    """The kind of a certificate the upstream's TLS handshake refused, fit for a client: a
    category of OpenSSL's verify code, never its message, which names the host the operator
    configured (a client never learns the upstream's address); the message is in the
    operator's log (the error is the ``WireError``'s cause, ``routing.replicas``)."""
    return _CERTIFICATE_PROBLEMS.get(error.verify_code, "verification failed")


def os_reason(error: BaseException | None) -> str | None:
    """The few words for a connection the OS refused, reset or could not route; None: neither
    (``reason_of``, and aiohttp's errors in ``upstream.http.reason``)."""
    number = getattr(error, "errno", None)
    if isinstance(error, ConnectionRefusedError) or number == errno.ECONNREFUSED:
        return "connection refused"
    if isinstance(error, ConnectionResetError) or number == errno.ECONNRESET:
        return "connection reset"
    if number in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "host unreachable"
    return None


def request_head(target: str, host: str, headers: Mapping[str, str], length: int) -> bytes:
    """A POST's head (request line and headers, ending with the blank line), each header value
    as the client sent it (``http_syntax.value_bytes``: latin-1, as the server read it; not
    UTF-8, as aiohttp wrote them, each byte over 0x7f two). ``headers``' names lower-case;
    ``host``, ``content-length`` added here, and ``accept`` (``*/*``) when absent, as aiohttp
    did."""
    if http_syntax.CONTROL.search("\t".join(headers.values())) is not None or not all(
        map(http_syntax.TOKEN.fullmatch, headers)
    ):
        raise ValueError(
            "Forbidden control character detected in headers. Potential header injection attack."
        )
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    accept = "" if "accept" in headers else "accept: */*\r\n"
    head = (
        f"POST {target} HTTP/1.1\r\nhost: {host}\r\n{accept}{lines}content-length: {length}\r\n\r\n"
    )
    try:
        return head.encode("latin-1")  # (the target, the host and the names are ASCII)
    except UnicodeEncodeError:
        # A value beyond latin-1 (a library caller's text): that one as UTF-8, the others so.
        fields = b"".join(
            [
                name.encode("ascii") + b": " + http_syntax.value_bytes(value) + b"\r\n"
                for name, value in headers.items()
            ]
        )
        return (
            f"POST {target} HTTP/1.1\r\nhost: {host}\r\n{accept}".encode("latin-1")
            + fields
            + f"content-length: {length}\r\n\r\n".encode("ascii")
        )


class Pool:
    """The kept connections to one replica (see the module's contract)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl: ssl_module.SSLContext | None = None,
        limit: int = 1000,
        queue_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        answer_timeout: float = 600.0,
        keepalive_s: float = 4.0,
        tunnel: Proxy | None = None,
    ) -> None:
        self.host, self.port, self.ssl = host, port, ssl
        self.tunnel = tunnel
        self.limit = limit
        self.queue_timeout = queue_timeout
        self.connect_timeout = connect_timeout
        self.answer_timeout = answer_timeout
        self.keepalive_s = keepalive_s
        self.open = 0  # connections open or being opened, counted against ``limit``
        self.idle: list[Connection] = []  # the most recently used last
        self.busy: set[Connection] = set()
        # The requests waiting for a connection, the longest waiting first: each is given a
        # connection (or None: a place, counted for it, to open one) by ``_hand``.
        self._waiting: deque[asyncio.Future[Connection | None]] = deque()
        self.closed = False
        self.resent = 0  # requests sent a second time (the keep-alive race, module contract)
        self._reaping: asyncio.TimerHandle | None = None  # (``_reap``, while any is idle)

    async def request(self, head: bytes, body: bytes, whole: bool) -> Answer:
        # Nobody waiting (the common case): the most recent idle one at once; else in turn.
        connection = None if self._waiting else self._idle()
        if connection is None:
            connection = await self._acquire()
        if connection.uses and connection.stale():
            # Closed by the server since it was last used (the keep-alive race, before the
            # request): nothing written on it, the request goes on a new one.
            self.discard(connection)
            connection = await self._acquire(first=True, fresh=True)
        try:
            return await self._exchange(connection, head, body, whole)
        except WireError as failure:
            # Sent again only if the server cannot have read it whole (see the module's
            # contract): a kept connection dropped before the request went whole.
            if (
                failure.sent
                or isinstance(failure, WireTimeout)
                or connection.uses < 2
                or connection.heard
                or self.closed
            ):
                raise
        self.resent += 1
        connection = await self._acquire(first=True, fresh=True)
        return await self._exchange(connection, head, body, whole)

    async def _exchange(
        self, connection: Connection, head: bytes, body: bytes, whole: bool
    ) -> Answer:
        """``head`` and ``body`` sent on ``connection``, and its answer's head (or, ``whole``,
        all of it)."""
        connection.begin()
        transport = connection.transport
        assert transport is not None  # (connected)
        try:
            if len(body) <= ONE_WRITE_BYTES:
                transport.write(head + body)
            else:
                # (Two writes, not ``writelines``: asyncio's joins its pieces on Python 3.11.)
                transport.write(head)
                transport.write(body)
        except (OSError, RuntimeError) as exc:  # (closed under it)
            self.discard(connection)
            raise WireError("connection failed") from exc
        # Handed to the OS whole at once (the common case), unless the transport is closing (a
        # failed write closes it, its data dropped; so does the server's close seen before):
        # else once its buffer drains (``resume_writing``).
        connection.sent = not transport.is_closing() and transport.get_write_buffer_size() == 0
        try:
            await connection.wait(END if whole else HEAD)
        except BaseException:
            self.discard(connection)
            raise
        return Answer(connection)

    def _idle(self) -> Connection | None:
        """The most recently used idle connection still fit for a request, if any."""
        idle = self.idle
        if not idle:
            return None
        now = monotonic()
        while idle:
            connection = idle.pop()
            if not connection.lost and now - connection.idle_since < self.keepalive_s:
                self.busy.add(connection)
                return connection
            self.discard(connection)
        return None

    async def _acquire(self, first: bool = False, fresh: bool = False) -> Connection:
        """A connection, in turn: an idle one or a new one while nobody waits ahead (and the
        limit allows), else the one given back or the place freed (``_hand``) once every
        request that waited before has had its own. A request that came later and found
        nobody waiting never takes what was freed for one that waits. ``first``: ahead of
        every request waiting (it has had its turn already); ``fresh``: a new connection,
        never one used before (in the place of the oldest idle one if idle ones hold every
        place, or of the one given back to it). Waits ``queue_timeout`` at most, in all: then
        ``WireBusy``, out of the line (long streams may hold every connection for minutes, and
        ``answer_timeout`` counts from the send only)."""
        waiting = self._waiting
        deadline: float | None = None  # (set as it first waits)
        # (``first``: also given a connection that closed before it ran: first in line again)
        while True:
            if self.closed:
                raise WireError("connection failed")
            while waiting and waiting[0].done():
                waiting.popleft()  # (one cancelled, its task not yet run to leave the line)
            if first or not waiting:
                connection = None if fresh else self._idle()
                if connection is not None:
                    return connection
                if self.open < self.limit:
                    self.open += 1
                    return await self._connect()
                if fresh and self.idle:
                    # Every place is held, some by idle connections: the oldest one's is this
                    # request's (not counted free, nor handed to one waiting behind it).
                    oldest = self.idle.pop(0)
                    oldest.counted = False
                    self.discard(oldest)
                    return await self._connect()
            waiter: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()
            if first:
                waiting.appendleft(waiter)
            else:
                waiting.append(waiter)
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.queue_timeout
            try:
                async with asyncio.timeout_at(deadline):
                    try:
                        given = await waiter
                    except BaseException:  # (the deadline's cancellation too)
                        if not waiter.done() or waiter.cancelled():
                            with contextlib.suppress(ValueError):  # (unless ``_hand`` dropped it)
                                waiting.remove(waiter)
                        elif waiter.exception() is None:
                            self._pass_on(waiter.result())  # (given and cancelled at once)
                        raise
            except TimeoutError:
                raise WireBusy("no connection free in time") from None
            if self.closed:
                self._pass_on(given)
                raise WireError("connection failed")
            if given is None:
                return await self._connect()  # (its place, counted for it already)
            if not given.lost:
                if not fresh:
                    return given
                # Its place: a server that drops every connection after an answer (without
                # saying so) would drop this one too.
                given.counted = False
                self.discard(given)
                return await self._connect()
            first = True

    async def _connect(self) -> Connection:
        """A new connection, in a place already counted in ``open`` (given up if it fails)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.tunnel is None:
                    _, connection = await loop.create_connection(
                        lambda: Connection(self),
                        self.host,
                        self.port,
                        ssl=self.ssl,
                        server_hostname=self.host if self.ssl is not None else None,
                    )
                else:
                    connection = await self._through(self.tunnel, loop)
        except TimeoutError as exc:
            self._gone()
            # Not a ``WireTimeout``: nothing was sent, so this is an unreachable replica (502,
            # tried elsewhere), not an upstream slow to answer a call it may be running.
            raise WireError("connection timed out") from exc
        except BaseException as exc:
            self._gone()
            if (local := local_reason(exc)) is not None:
                raise WireLocal(local) from exc
            if isinstance(exc, (OSError, ssl_module.CertificateError)):
                raise WireError(reason_of(exc)) from exc
            raise
        connection.counted = True
        sock = connection.transport.get_extra_info("socket")  # type: ignore[union-attr]
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if hasattr(select, "poll"):  # (``Connection.stale``; not on Windows)
                connection.poll = select.poll()
                connection.poll.register(sock.fileno(), select.POLLIN)
        if self.closed:
            connection.close()
            raise WireError("connection failed")
        self.busy.add(connection)
        return connection

    async def _through(self, proxy: Proxy, loop: asyncio.AbstractEventLoop) -> Connection:
        """A TLS connection to the replica through ``proxy``'s CONNECT tunnel (the module's
        contract)."""
        assert self.ssl is not None  # (an http replica's requests go to the proxy in full)
        try:
            transport, opening = await loop.create_connection(_Tunnel, proxy.host, proxy.port)
        except OSError as exc:
            if local_reason(exc) is not None:
                raise  # (this machine's want: ``_connect``)
            # The proxy's fault, not the replica's host: said so ("name not resolved" sent the
            # operator to the replica's DNS).
            raise WireError(f"proxy: {reason_of(exc)}") from exc
        try:
            transport.write(proxy.connect_head(self.host, self.port))
            await opening.answered
            connection = Connection(self)
            tls = await loop.start_tls(transport, connection, self.ssl, server_hostname=self.host)
        except BaseException:
            opening.answered.cancel()  # (a timeout's: the proxy's late failure is nobody's)
            transport.abort()
            raise
        assert tls is not None  # (None only for a transport closing: an error raised then)
        # (``start_tls`` does not call ``connection_made``; a connection opened with TLS has it.)
        connection.connection_made(tls)
        return connection

    def release(self, connection: Connection) -> None:
        """Back in the pool if it may be reused (its answer came whole, the server keeps it);
        the idle ones past their keep-alive closed meanwhile (the oldest first)."""
        if connection.reusable() and not self.closed:
            connection.finish()
            if self._waiting and self._hand(connection):
                return  # (busy still: the request that has waited longest has it now)
            self.busy.discard(connection)
            now = monotonic()
            self._close_expired(now)
            connection.idle_since = now
            self.idle.append(connection)
            if self._reaping is None:
                self._reap_at(self.keepalive_s)
        else:
            self.discard(connection)

    def _close_expired(self, now: float) -> None:
        idle = self.idle  # (the least recently used first)
        while idle and now - idle[0].idle_since >= self.keepalive_s:
            self.discard(idle.pop(0))

    def _reap_at(self, delay: float) -> None:
        self._reaping = asyncio.get_running_loop().call_later(delay, self._reap)

    def _reap(self) -> None:
        """The idle connections past their keep-alive closed; again at the next one's."""
        self._reaping = None
        if self.closed:
            return
        now = monotonic()
        self._close_expired(now)
        if self.idle:
            self._reap_at(max(0.0, self.idle[0].idle_since + self.keepalive_s - now))

    def discard(self, connection: Connection) -> None:
        """Closed, not reused."""
        self.busy.discard(connection)
        connection.close()

    def forget(self, connection: Connection) -> None:
        """A connection the server closed: out of the pool (it was idle, or busy)."""
        self.busy.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    def _gone(self) -> None:
        """A connection closed (or never opened): its place goes to the request that has
        waited longest (counted in ``open`` still, for it), else it is free."""
        if not (self._waiting and self._hand(None)):
            self.open -= 1

    def _hand(self, given: Connection | None) -> bool:
        """``given`` (a connection, or None: a place to open one) to the request that has
        waited longest; False when none waits. Handed over directly, not put where the next
        request to come could take it before the woken one runs."""
        waiting = self._waiting
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_result(given)
                return True
        return False

    def _pass_on(self, given: Connection | None) -> None:
        """What was handed to a request that cannot use it (cancelled, the pool closed)."""
        if given is None:
            self._gone()
        else:
            self.release(given)

    def close(self) -> None:
        """Close every connection: the requests waiting for an answer on one fail
        (``WireError``, "connection closed"), as do those waiting for one and those after this."""
        self.closed = True
        if self._reaping is not None:
            self._reaping.cancel()
            self._reaping = None
        waiting = self._waiting
        while waiting:  # (first: no place freed below is handed to one of them)
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_exception(WireError("connection failed"))
        for connection in [*self.idle, *self.busy]:
            connection.close()
        self.idle.clear()
        self.busy.clear()


class Answer:
    """An answer being read (see the module's contract)."""

    __slots__ = (
        "connection",
        "status",
        "content_type",
        "retry",
        "cache_control",
        "content_encoding",
        "proxy_status",
        "squid_error",
        "_released",
    )

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.status = connection.status
        self.content_type = connection.content_type
        self.retry = connection.retry  # (``RETRY_FIELDS`` it said, as they came)
        self.cache_control = connection.cache_control
        self.content_encoding = connection.content_encoding  # ("" for none; never decoded here)
        self.proxy_status = connection.proxy_status
        self.squid_error = connection.squid_error
        self._released = False

    async def read(self) -> bytes:
        """The whole body; the connection back in the pool (or closed)."""
        connection = self.connection
        try:
            await connection.wait(END)
            chunks = connection.chunks
            connection.chunks = []
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            self.release()

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes: what came since the last piece, joined (a chunked body's
        chunks come one by one: a stream's frames, often dozens a read); raises ``WireError``
        if it stops short of its end."""
        return _Pieces(self.connection)

    def release(self, drain: bool = False) -> None:
        if self._released:
            return
        self._released = True
        connection = self.connection
        if drain and not connection.done and connection.failure is None and not connection.lost:
            connection.drain()
        else:
            connection.pool.release(connection)

    def progressed(self) -> None:
        """Its reader got something of use from the pieces it read (a stream's event): the
        answer has ``answer_timeout`` more from now (see the module's contract)."""
        self.connection.progress_at = self.connection.loop.time()

    def discard(self) -> None:
        """The connection closed, never reused, whatever came of the answer: its reader stopped
        short of what it wanted (a stream not ended whole), see the module's contract."""
        if self._released:
            return
        self._released = True
        self.connection.pool.discard(self.connection)

    async def aclose(self) -> None:
        self.release()


class _Pieces:
    """``Answer.chunks``: an iterator, not an async generator. A reader stops at the stream's
    ``[DONE]``, before the body's end: a generator left so would be finalized by the loop's
    hook, which schedules its ``aclose`` from any thread (a wake-up of the loop through its
    self-pipe, and a task) for every stream."""

    __slots__ = ("connection",)

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        connection = self.connection
        await connection.wait(NEWS)
        chunks = connection.chunks
        if not chunks:
            raise StopAsyncIteration  # (the end)
        connection.chunks = []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# The largest answer head taken, in bytes (see the module's contract): 64 KiB, as the gateway's
# own default for a request's (``limits.max_header_bytes``); Go's client takes 1 MiB, engines
# send well under 1 KiB.
MAX_HEAD = 64 * 1024


class _Tunnel(asyncio.Protocol):
    """A proxy's answer to ``CONNECT`` (``Pool._through``): ``answered`` is done once its head
    came, 2xx and nothing after it, else failed with a ``WireError`` naming its status."""

    def __init__(self) -> None:
        self.answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.head = b""

    def data_received(self, data: bytes) -> None:
        if self.answered.done():
            return
        self.head += data
        head, end, rest = self.head.partition(b"\r\n\r\n")
        if not end:
            if len(self.head) > MAX_HEAD:
                self.answered.set_exception(WireError("proxy answer head too large"))
            return
        status_line = head.split(b"\r\n", 1)[0].split(b" ", 2)
        status = status_line[1] if len(status_line) > 1 else b""
        if not (status_line[0].startswith(b"HTTP/1.") and status.isdigit() and len(status) == 3):
            self.answered.set_exception(WireError("malformed proxy answer"))
        elif not status.startswith(b"2"):
            self.answered.set_exception(WireError(f"proxy answered {status.decode()}"))
        elif rest:
            # (The replica speaks only after the client's first bytes: anything here is the
            # proxy's, and would be read as the replica's answer.)
            self.answered.set_exception(WireError("malformed proxy answer"))
        else:
            self.answered.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.answered.done():
            reason = reason_of(exc) if exc is not None else "connection closed by the proxy"
            self.answered.set_exception(WireError(reason))


# The fields in which a proxy speaks of an answer (``Answer.proxy_status``, ``squid_error``).
_PROXY_FIELDS = frozenset((b"proxy-status", b"x-squid-error"))


class _HeadTooLarge(Exception):
    """Raised by the parser's ``on_header`` past ``MAX_HEAD`` (the parser's error's context)."""


# What a request waits for (``Connection.wait``).
HEAD, NEWS, END = 0, 1, 2
# How long a connection whose reader has all it wanted waits for the rest of its answer (the
# end of a chunked body, after a stream's ``[DONE]``) to be reused, rather than closed.
DRAIN_S = 1.0


def _listed(said: str, line: bytes) -> str:
    """A field's lines so far (``said``) and one more, joined by ", " as RFC 9110 5.3 allows."""
    value = line.decode("latin-1")
    return f"{said}, {value}" if said else value


class Connection(asyncio.Protocol):
    """One kept connection, and the answer it is reading (one at a time)."""

    __slots__ = (
        "pool",
        "transport",
        "parser",
        "loop",
        "counted",
        "uses",
        "heard",
        "sent",
        "head_bytes",
        "field_bytes",
        "lost",
        "idle_since",
        "active",
        "status",
        "content_type",
        "retry",
        "cache_control",
        "content_encoding",
        "proxy_status",
        "squid_error",
        "sized",
        "interim",
        "headed",
        "done",
        "keep_alive",
        "unasked",
        "draining",
        "chunks",
        "failure",
        "waiter",
        "want",
        "progress_at",
        "timer",
        "poll",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.loop = asyncio.get_running_loop()
        self.counted = False  # against the pool's ``open``, until closed
        self.uses = 0  # requests sent on it, this one included
        self.heard = False  # a byte of this request's answer came
        self.sent = False  # this request was written whole (handed to the OS: ``_exchange``)
        self.head_bytes = 0  # bytes of this request's answer come before its head was whole
        self.field_bytes = 0  # the size of its header (and trailer) fields
        self.lost = False  # closed, by either side
        self.idle_since = 0.0
        self.active = False  # a request is in progress
        # The answer being read.
        self.status = 0
        self.content_type = ""
        self.retry: tuple[tuple[str, str], ...] = ()
        self.cache_control = ""  # (its lines joined: ``Answer.cache_control``)
        self.content_encoding = ""  # (likewise: ``Answer.content_encoding``)
        self.proxy_status = self.squid_error = ""  # (``Answer``'s: what a proxy said)
        self.sized = False  # a Content-Length or chunked: the body does not end at EOF
        self.interim = False  # a 1xx answer, before the real one
        self.headed = False
        self.done = False
        self.keep_alive = False
        # Bytes came after the answer (a second response nobody asked for): the connection is
        # never reused, and nothing of them is taken for the answer.
        self.unasked = False
        self.draining = False
        self.chunks: list[bytes] = []
        self.failure: WireError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.want = HEAD
        # When its answer last made progress (its request sent, or what its reader said:
        # ``Answer.progressed``): the answer's timeout runs from there. Bytes alone do not.
        self.progress_at = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.poll: select.poll | None = None  # its socket, readable or not (``stale``)

    # -------------------------------------------------------------------------- a request

    def begin(self) -> None:
        self.active = True
        self.uses += 1
        self.heard = self.sent = False
        self.head_bytes = self.field_bytes = 0
        self.status, self.content_type, self.sized, self.interim = 0, "", False, False
        self.retry, self.cache_control, self.content_encoding = (), "", ""
        self.proxy_status = self.squid_error = ""
        # (``unasked`` too: every field of the answer is this request's. A connection that got
        # anything unasked is never reused (``reusable``), so none is reset here in practice.)
        self.headed = self.done = self.keep_alive = self.draining = self.unasked = False
        self.chunks = []
        self.failure = None
        self.want = HEAD
        self.progress_at = now = self.loop.time()
        self.timer = self.loop.call_at(now + self.pool.answer_timeout, self._check_timeout)

    async def wait(self, want: int) -> None:
        """Until the answer's head has come (``HEAD``), a piece of its body or its end
        (``NEWS``), or its end (``END``); raises its failure."""
        self.want = want  # (also what it reads by while it does not wait: ``_check_timeout``)
        if self.timer is None and self.active and not self.done and not self.draining:
            # Its time ran out while its reader had pieces unread (``_check_timeout``): judged
            # now that it has read them (one may have been an event: progress).
            self._check_timeout()
        if self.failure is None and not (
            self.done or (want == HEAD and self.headed) or (want == NEWS and self.chunks)
        ):
            waiter = self.waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                self.waiter = None
        if self.failure is not None and not (want == NEWS and self.chunks):
            raise self.failure

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, failure: WireError, cause: BaseException | None = None) -> None:
        if self.failure is None and not self.done:
            failure.__cause__ = cause
            failure.sent = self.sent
            self.failure = failure
            self._wake()
        self.close()

    def _check_timeout(self) -> None:
        self.timer = None
        if not self.active or self.done:
            return
        left = self.progress_at + self.pool.answer_timeout - self.loop.time()
        if left > 0:
            self.timer = self.loop.call_later(left, self._check_timeout)
        elif self.want == NEWS and self.chunks:
            # Its reader has not read what came yet (a piece of it may be the progress it
            # would note: an event read in this very round of the loop): ``wait`` judges it
            # once it has.
            return
        else:
            # (``sent``, recorded by ``_fail``: a server that never read all of the request
            # cannot be running it, one that did may be: it answers a whole answer once
            # computed.)
            self._fail(WireTimeout("timed out", self.headed))

    def drain(self) -> None:
        """Its reader is done: back in the pool once the rest of the answer has come, if it
        comes within ``DRAIN_S``; else closed."""
        self.draining = True
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(DRAIN_S, self._drained)

    def _drained(self) -> None:
        self.timer = None
        if self.draining:
            self.pool.discard(self)

    def stale(self) -> bool:
        """Whether a kept connection is unfit for the next request before anything is written
        on it: closed, closing, or with something to read that the loop has not read yet (it
        reads a socket between two of its rounds): the server's FIN or RST, TLS's
        close_notify, bytes it sent unasked. The keep-alive race caught before the request
        goes out (see the module's contract); one call of ``poll`` (a microsecond)."""
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            return True
        if self.poll is None:
            return False
        try:
            return bool(self.poll.poll(0))
        except OSError:
            return True

    def reusable(self) -> bool:
        return (
            self.done
            and self.keep_alive
            and not self.lost
            and self.failure is None
            and not self.unasked
        )

    def finish(self) -> None:
        """The request is over (whether the connection is kept or not)."""
        self.active = False
        self.draining = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def close(self) -> None:
        # An answer that did not come whole (its reader left, it failed or timed out): the
        # connection is aborted, never closed cleanly. Over TLS a clean close sends
        # close_notify and keeps the socket open until the server's own comes (asyncio's
        # ``ssl_shutdown_timeout``, 30 s): an engine that notices a gone caller only when a
        # write fails went on generating all that time. Aborted, the server's next write fails
        # at once, as over plain TCP. An answer that came whole (idle, or done and not kept)
        # is closed cleanly.
        cut = self.active and not self.done
        if cut and self.failure is None:
            # Closed under a request still owed its answer (``Pool.close``): it fails now.
            # ``finish`` stops the answer's timer, and ``connection_lost`` fails no request that
            # is over, so a reader waiting for its head or body would wait forever.
            self.failure = WireError("connection closed", self.headed, self.sent)
            self._wake()
        self.finish()
        if self.transport is not None and not self.lost:
            self.lost = True
            if cut:
                self.transport.abort()
            else:
                self.transport.close()
        self._uncount()

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.pool._gone()

    # -------------------------------------------------------------------------- the protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (a stream transport)
        # ``resume_writing`` once the write buffer is empty (by default: once under 16 KiB): a
        # request not handed to the OS at once (over the socket's buffer) is sent whole then.
        transport.set_write_buffer_limits(high=0)  # type: ignore[attr-defined]

    def resume_writing(self) -> None:
        if self.active:
            self.sent = True  # (its request: the buffer drained)

    def data_received(self, data: bytes) -> None:
        if not self.active or self.done:
            # Nothing is owed: a server that speaks unasked (a 408 before it closes) is not
            # to be trusted with the next request.
            self.pool.discard(self)
            return
        # (No progress of itself: a byte now and then does not keep the answer's timeout off;
        # see the module's contract.)
        self.heard = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            too_large = isinstance(exc.__context__, _HeadTooLarge)
            reason = "answer head too large" if too_large else "malformed or truncated answer"
            self._fail(WireError(reason, self.headed), exc)
            return
        if not self.headed:
            # Every byte so far is the head's (or an interim answer's): the parser keeps a
            # field it has not seen whole, so an endless one is cut here, as it comes.
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                self._fail(WireError("answer head too large"))
                return
        if self.draining and self.done:
            # Back in the pool only now that the whole read is parsed: bytes after the answer's
            # end in the same read (an answer nobody asked for) are seen (``unasked``) before
            # it could be reused, never by the next request as the head of its own answer.
            self.pool.release(self)
        elif self.want == NEWS and self.chunks:
            self._wake()  # (once a read, not once a chunk of it: a stream's are its frames)

    def eof_received(self) -> bool:
        return False  # (the transport closes itself: ``connection_lost``)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.active and not self.done and self.failure is None:
            if self.headed and not self.sized and exc is None:
                self.on_message_complete()  # a body that ends with the connection
            elif not self.headed:
                reason = reason_of(exc) if exc is not None else "connection closed by the upstream"
                self._fail(WireError(reason), exc)
            else:
                self._fail(WireError("malformed or truncated answer", True), exc)
        self.finish()
        self.pool.forget(self)
        self._uncount()

    # -------------------------------------------------------------------------- the parser's

    def on_message_begin(self) -> None:
        if self.done:  # (httptools goes on parsing what follows an answer in the same read)
            self.unasked = True
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        # (A head that came whole in one read, up to its 256 KiB, is cut here.)
        self.field_bytes += len(name) + len(value) + 4
        if self.field_bytes > MAX_HEAD:
            raise _HeadTooLarge
        if self.headed or self.unasked:
            return  # a chunked body's trailers, or an unasked answer's: not the answer's head
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1")
        elif name == b"content-length" or name == b"transfer-encoding":
            self.sized = True
        elif name in RETRY_FIELDS:
            self.retry += ((name.decode("latin-1"), value.decode("latin-1")),)
        elif name == b"cache-control":
            # Every line: a ``no-store`` on the second line of several binds as on the first.
            self.cache_control = _listed(self.cache_control, value)
        elif name == b"content-encoding":
            # Every line too: codings are listed in the order they were applied, over lines.
            self.content_encoding = _listed(self.content_encoding, value)
        elif name in _PROXY_FIELDS:
            if name == b"proxy-status":
                self.proxy_status = _listed(self.proxy_status, value)
            else:
                self.squid_error = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.unasked:
            return
        status = self.parser.get_status_code()
        if status < 200 and status != 101:
            self.interim = True  # (100 Continue, 103 Early Hints: the answer is still to come)
            return
        self.status = status
        self.headed = True
        if self.want == HEAD:
            self._wake()

    def on_body(self, body: bytes) -> None:
        if not self.unasked:
            self.chunks.append(body)  # (the reader is woken once the read is parsed)

    def on_message_complete(self) -> None:
        if self.unasked:
            return
        if self.interim:
            self.interim = False
            self.content_type, self.sized, self.retry = "", False, ()
            self.cache_control = self.content_encoding = ""
            self.proxy_status = self.squid_error = ""
            return
        self.done = True
        self.keep_alive = not self.lost and self.parser.should_keep_alive()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.draining:
            self._wake()
        # (Draining, nobody waits: ``data_received`` gives it back once the read is parsed; a
        # body that ended with the connection is not reused at all.)
