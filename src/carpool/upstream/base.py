"""What the gateway needs from an OpenAI-compatible engine, whatever it is.

Contract:
- ``Upstream.send(request)`` makes one call and returns an ``UpstreamResponse``. A non-2xx answer
  is *returned* (status + body), not raised: the pipeline passes it through. Transport failures are
  raised as ``UpstreamUnreachable`` (502) or ``UpstreamTimeout`` (504), the cause kept; one after
  the request was sent whole, before any answer, as ``UpstreamNoAnswer`` (an ``UpstreamTimeout``:
  504, or 502 when the connection dropped): the engine may have run it.
- A streaming response (``request.stream`` and a 2xx status) yields the ``data:`` payloads of the
  SSE stream, as bytes, without the ``data: `` prefix, until ``[DONE]`` (not yielded). The
  iterator ends normally only for a stream that ended whole: with ``[DONE]`` from an HTTP server,
  at the end of its stream for an in-process engine. A typed stream (``request.last_event`` set:
  the Responses and Messages APIs, which send no ``[DONE]``) ends whole with its last event,
  which is yielded. A stream that stops otherwise (the body ended cleanly, or was cut) or a
  transport failure part-way raises ``UpstreamStreamBroken``, after the payloads that did
  arrive: so the caller can tell an answer that ended from one that merely stopped. A typed
  stream's event names are not yielded: each payload names its own ``type``. Whether the answer was *complete* (every choice asked for finished:
  ``sse.is_complete``) is for the caller to judge.
- ``aclose()`` on a response releases its connection; it is safe to call twice and after a
  cancellation.
- A call names itself by an id of its own (``x-request-id``; ``request-id`` too when the client
  sent one), made for it by the gateway, in place of the client's: an engine names its answer
  after it, and the answer may be served to other clients. It is logged (DEBUG) with the
  client ids it serves (``UpstreamRequest.serves``), for operators to match gateway and engine
  logs: the clients' own text, so escaped and cut short (``http.logged_ids``). (``HttpUpstream``; the in-process upstreams are sent no headers.)
- ``passthrough`` forwards any other ``/v1/...`` call unchanged and is never cached. Its
  transport failures are told as ``send``'s are: ``UpstreamUnreachable`` / ``UpstreamTimeout``
  only when nothing can have been acted on (no connection; the routing tries another replica),
  ``UpstreamNoAnswer`` once the request may have reached the server. Its answer
  (``PassthroughResponse``) is read to its end or closed (``aclose``) by whoever relays it. Its
  request body (``RequestBody``) is bytes, or a large one (a file's upload) an async iterable of
  its pieces as they come from the client, to be read once: an upstream that sends it reads it
  as it sends it; one that does not may leave it unread. Its client's failures (limits, leaving)
  are raised from it, and are the caller's, never the upstream's.
- Implementations: ``carpool.upstream.http.HttpUpstream`` (a real server over pooled HTTP) and
  ``carpool.upstream.sim.SimUpstream`` (the embedded simulated engine, no sockets).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# Request headers that describe one hop (of any proxy's: the peers' too).
HOP_BY_HOP = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
    }
)
# Request headers that describe one hop, or that are addressed to carpool itself, are not
# forwarded (nor are carpool's own ``x-carpool-*`` controls, nor those a request's own
# ``Connection`` names: ``connection_listed``); every other one is.
NOT_FORWARDED = HOP_BY_HOP | frozenset(
    {
        "proxy-authorization",
        "proxy-connection",
        "accept-encoding",
        "cache-control",
        "idempotency-key",
        "x-idempotency-key",
        "content-type",
        # A cached endpoint's body goes as the gateway serializes it, never in the client's
        # coding (any but identity is refused: ``request.parse``); pass-through forwards it.
        "content-encoding",
        # The gateway has the whole body before it calls: a client's 100-continue was its own.
        "expect",
    }
)


# The request headers in which a client names its request: a cached endpoint's call carries
# the gateway's own id for the call in their place (``upstream.http``), never the client's.
REQUEST_ID_HEADERS = ("x-request-id", "request-id")

_NONE: frozenset[str] = frozenset()


def connection_listed(headers: Mapping[str, str]) -> frozenset[str]:
    """The header names a request's ``Connection`` header lists (lower-case names in
    ``headers``): hop-by-hop for that request (RFC 9110 7.6.1), so neither forwarded nor, since
    the upstream never sees them, part of its key."""
    value = headers.get("connection")
    return _listed(value) if value else _NONE


@functools.lru_cache(maxsize=256)  # (a few values, "keep-alive" most of all)
def _listed(value: str) -> frozenset[str]:
    return frozenset(name for token in value.split(",") if (name := token.strip().lower()))


def unstreamed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` asking for one whole answer: without ``stream`` and ``stream_options``."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


@dataclass(slots=True)
class UpstreamRequest:
    """One call to an upstream replica."""

    path: str  # relative to the replica's /v1 base, e.g. "/chat/completions"
    body: dict[str, Any]  # the JSON body to send
    headers: Mapping[str, str] = field(default_factory=dict)  # forwarded, lower-case names
    stream: bool = False
    query: str = ""  # the client's query string, forwarded as it came
    # For a typed stream (``apis.base.Api.last_event``): whether a payload is its last event,
    # after which it has ended whole. None: it ends with ``data: [DONE]``.
    last_event: Callable[[bytes], bool] | None = None
    # The ids the clients it serves named their requests by (``Request.client_ids``): logged
    # with the call's own id, never sent.
    serves: tuple[str, ...] = ()
    # The most bytes of a whole answer's body read (the judge's one-word reply): a larger one
    # is cut there (``UpstreamAnswerCut``), never read whole. None: no bound of the call's own.
    max_answer_bytes: int | None = None


class UpstreamResponse:
    """An upstream's answer: a complete body, or (streaming, 2xx) an iterator of SSE payloads,
    in lists: the payloads that came together (one read; the first event alone), never an empty
    list."""

    __slots__ = ("status", "headers", "body", "_events", "_close", "answered")

    def __init__(
        self,
        status: int,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        events: AsyncIterator[list[bytes]] | None = None,
        close: Any = None,
    ) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self.body = body
        self._events = events
        self._close = close
        # Told a 2xx answer's body once its reader has it whole (parsed; a stream assembled):
        # routing records what its replica now holds (``exchange.send``).
        self.answered: Callable[[dict[str, Any]], None] | None = None

    @property
    def streaming(self) -> bool:
        return self._events is not None

    def events(self) -> AsyncIterator[list[bytes]]:
        if self._events is None:
            raise RuntimeError("not a streaming response")
        return self._events

    async def aclose(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            await close()


@dataclass(slots=True)
class PassthroughResponse:
    """A pass-through answer: its status, raw headers and body as it comes. Whoever relays it
    reads the body to its end or calls ``aclose`` (it may do both): only then is what its maker
    holds for it let go (``close``: a connection, ``ReplicaSet``'s count of the call in flight),
    however the relay ended: read whole, left part-way, or never begun."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: AsyncIterator[bytes]
    replica: str = ""  # the name of the replica that answered (``ReplicaSet.passthrough``)
    close: Callable[[], Awaitable[None]] | None = None

    async def aclose(self) -> None:
        """Done with the answer: its body closed (a body never begun holds nothing then: an
        async generator runs no ``finally`` of its own before its first step), then ``close``.
        Safe to call twice."""
        try:
            closing = getattr(self.body, "aclose", None)
            if closing is not None:
                await closing()
        finally:
            close, self.close = self.close, None
            if close is not None:
                await close()


# A pass-through call's body: whole, or its pieces as they come (the module doc).
RequestBody = bytes | AsyncIterable[bytes]


class Upstream(Protocol):
    """One replica of an OpenAI-compatible deployment."""

    name: str  # a label for metrics and /stats, e.g. the base URL

    async def send(self, request: UpstreamRequest) -> UpstreamResponse: ...

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: RequestBody
    ) -> PassthroughResponse: ...

    async def aclose(self) -> None: ...
