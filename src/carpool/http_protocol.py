"""The HTTP/1.1 protocol carpool serves on: uvicorn's httptools protocol, plus exact hits answered
as the request is parsed, before any task exists for it.

Why: on an exact hit the gateway's work is a dictionary look-up and a write, while uvicorn's ASGI
machinery (a request cycle, an event, a task, the middleware, two sends that each check every
header and write once) costs more than that. Measured on a 2-core VM, hits served through ASGI
ran at about 0.6 of a bare ASGI app returning fixed bytes; answered here, they need none of it.

Contract:
- ``GatewayProtocol`` is ``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`` for every
  request but one kind: a ``POST`` to a cached endpoint's exact path (``request.ENDPOINTS``), over
  HTTP/1.1 with keep-alive, without ``Expect: 100-continue`` or an upgrade, while no earlier
  request of the connection is still being answered. Such a request's body is held while it is
  parsed; once it is complete, ``GatewayApp.answer_now`` is asked for its reply (the request's
  first step, ``Gateway.repeat_now``: a byte-identical repeat whose answer is stored). If there is
  one, the whole response (uvicorn's default headers, the reply's, ``content-length`` and
  ``x-request-id``) is written at once, and the connection goes on as after any response.
  Otherwise the request is handed to uvicorn with its body, exactly as if it had not been held.
- A body is held only within one read from the socket: one not complete when the bytes read so
  far are parsed (a large body, one that trickles in) is handed to uvicorn with what has
  arrived, and its app reads the rest under its usual limits (size, ``body_read_timeout``). A
  body over ``hold_limit`` bytes is handed over at once.
- Nothing else changes: what is not answered here takes the ASGI path (``server.GatewayApp``),
  whose answer for it is the same (``answer_now`` answers only what ``Gateway.handle`` would
  answer from the same step, and counts it alike).
- ``protocol()``: the ``http`` setting of a uvicorn serving the gateway (``carpool serve``, its
  workers, the benchmarks' embedded gateway). Under another server, or another app, the ASGI
  path serves every request.
"""

from __future__ import annotations

import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .request import ENDPOINTS

__all__ = ["GatewayProtocol", "protocol"]

log = logging.getLogger("carpool.server")

_ENDPOINTS = frozenset(path.encode("ascii") for path in ENDPOINTS)
_POST = b"POST"


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
        # The request held: its path and query, and its body's parts so far; None while
        # no request is held.
        self.held: list[bytes] | None = None
        self.held_size = 0
        self.held_target: tuple[str, bytes] = ("", b"")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.held is not None:  # its body did not all come in this read: uvicorn's
            self._hand_over(complete=False)

    def on_message_begin(self) -> None:
        # A response answered here, within this read, armed the keep-alive timer; uvicorn
        # disarms it only when a read begins, and this request came in the same read.
        self._unset_keepalive_if_required()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        target = self._held_target()
        if target is None:
            super().on_headers_complete()
            return
        self.held, self.held_size, self.held_target = [], 0, target

    def on_body(self, body: bytes) -> None:
        if self.held is None:
            super().on_body(body)
            return
        self.held.append(body)
        self.held_size += len(body)
        if self.held_size > self.hold_limit:
            self._hand_over(complete=False)

    def on_message_complete(self) -> None:
        if self.held is None:
            super().on_message_complete()
            return
        if not self._answer():
            self._hand_over(complete=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.held = None
        super().connection_lost(exc)

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
            # The client does not read what it was sent: the ASGI path waits for it to (and
            # pauses the requests behind), where answering here would only pile answers up.
            or self.flow.write_paused
        ):
            return None
        # The path as sent (origin form): one that needs decoding, or with a fragment, or in
        # absolute form, is not an endpoint's exact path, and goes uvicorn's way.
        path, _, query = self.url.partition(b"?")
        if path not in _ENDPOINTS or b"#" in query or self.root_path:
            return None
        return path.decode("ascii"), query

    def _answer(self) -> bool:
        """Writes the held request's response if ``answer_now`` has one (True)."""
        assert self.gateway_app is not None and self.held is not None
        body = self.held[0] if len(self.held) == 1 else b"".join(self.held)
        path, query = self.held_target
        try:
            answered = self.gateway_app.answer_now(path, self.headers, query, body)
        except Exception:  # (a bug: not the client's; raised here, httptools would say 400)
            log.exception("answering a repeat at once failed; it goes the ASGI way")
            return False
        if answered is None:
            return False
        self.held = None
        reply, request_id = answered
        content = [STATUS_LINE[reply.status]]
        for name, value in (
            *self.server_state.default_headers,
            *reply.headers,
            (b"content-length", str(len(reply.body)).encode("ascii")),
            (b"x-request-id", request_id),
        ):
            content += (name, b": ", value, b"\r\n")
        content += (b"\r\n", reply.body)
        self.transport.write(b"".join(content))
        try:
            reply.close()
        except Exception:  # (sent already: nothing else may follow it on the wire)
            log.exception("closing a reply answered at once failed")
        # As after any response: counted, reading resumed, the keep-alive timer armed.
        self.on_response_complete()
        return True

    def _hand_over(self, complete: bool) -> None:
        """The held request to uvicorn, with the body it has so far, as if never held."""
        held, self.held = self.held, None
        if held is None or self.transport.is_closing():
            return  # (uvicorn refused the request as it was parsed: a 400, closed)
        super().on_headers_complete()  # (its cycle and task, from the parser's state)
        cycle = self.cycle
        if held:
            cycle.body = bytearray().join(held)
        if complete:
            cycle.more_body = False
        cycle.message_event.set()


def _gateway_app(app: Any) -> Any:
    """The ``server.GatewayApp`` under uvicorn's middleware (``ProxyHeadersMiddleware``...), or
    None: another app is served, and this protocol is uvicorn's."""
    from .server import GatewayApp

    for _ in range(8):
        if isinstance(app, GatewayApp):
            return app
        app = getattr(app, "app", None)
    return None
