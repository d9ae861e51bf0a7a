"""carpool's error tree.

Every error the gateway answers with is one of these, so the HTTP status and the OpenAI error body
(``{"error": {"message", "type", "code"}}``) are decided in one place. Errors of the layer below
(aiohttp, Redis, pydantic) are translated at the boundary, keeping the original as ``__cause__``.

A message reaches the client, so it says what happened in words and nothing private: no
exception repr, no address or URL, no credential. An upstream is called by its public label
(``replica-0``, or the configured name); the detail (the cause) goes to the log.

    CarpoolError                      base; never raised itself
    ├── RequestError                  400: the client's request is malformed or invalid
    │   ├── BodyTooLarge              413: body over ``limits.max_body_bytes``
    │   ├── HeadersTooLarge           431: headers over ``limits.max_header_bytes``
    │   ├── TargetTooLong             414: a request target over ``limits.max_header_bytes``
    │   ├── BodyTimeout               408: body not received within ``limits.body_read_timeout``
    │   ├── HeadersTimeout            408: request line and headers, likewise
    │   ├── ContentCodingRefused      415: a cached endpoint's body in a content coding (gzip...)
    │   ├── MalformedHttp             400: a request that is not valid HTTP/1.1 (its framing...)
    │   ├── TransferCodingRefused     501: a transfer coding other than chunked (RFC 9112 6.1)
    │   ├── PathRefused               400: a pass-through path that could leave the upstream's /v1
    │   └── PathNotAllowed            403: a pass-through path outside ``passthrough.allow``
    ├── AdminRequired                 401: /stats, /metrics, /dashboard without the admin token
    ├── UpstreamError                 the upstream call did not produce an answer
    │   ├── UpstreamUnreachable       502: connection refused / reset / DNS
    │   ├── GatewayOverloaded         503: this machine could not open a connection (no file
    │   │   │                         descriptor, no local port): no verdict on the replica
    │   │   └── UpstreamBusy          503: every connection to the replica held past
    │   │                             ``limits.upstream_queue_timeout`` (tried once elsewhere)
    │   ├── UpstreamTimeout           504: no answer within ``limits.upstream_timeout``
    │   │   └── UpstreamNoAnswer      504: sent whole, and no answer in time (not run elsewhere;
    │   │                             502 when the connection dropped unanswered, or the
    │   │                             answer was malformed)
    │   ├── UpstreamKeyRefused        502: a 401/403 to a call with the gateway's own key
    │   ├── UpstreamRedirected        502: a redirect (not followed): a pass-through call's with a
    │   │                             ``Location``, any 3xx to a cached endpoint's call
    │   ├── UpstreamBadStatus         502: a final status no answer has (1xx, 600-999)
    │   ├── UpstreamStatusError       the upstream answered with an error status: passed through
    │   └── UpstreamStreamBroken      502: a stream ended or failed before it was complete
    │       │                         (the engine took the call: ``x-should-retry: false``)
    │       ├── UpstreamStreamStalled 504: a stream with no event for ``limits.upstream_timeout``
    │       └── UpstreamAnswerCut     502 (504 not whole in time): a whole answer cut after its head
    │           └── UpstreamContentCoding 502: an answer in a content coding the gateway cannot read
    ├── FlightAbandoned               499: every client of a flight left and its call was cancelled
    ├── ShuttingDown                  503: cut by the server's shutdown (``shutdown.grace_s`` over),
    │                                 or sent to a gateway closed already (a mounted app's)
    └── InternalError                 500: the gateway failed (a bug): what the client gets of it
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from . import exact_json


class CarpoolError(Exception):
    """Base of every error carpool raises on purpose."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    # Headers its answer carries besides its JSON content type (``headers``).
    also: tuple[tuple[str, str], ...] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def error_object(self) -> dict[str, Any]:
        """The error as an OpenAI error object (the value of ``"error"``), with its ``param`` as
        OpenAI's always has one (the field at fault, or null): the SDKs read ``e.param``."""
        return {
            "message": self.message,
            "type": self.type,
            "param": getattr(self, "param", None),
            "code": self.code,
        }

    def body(self) -> bytes:
        """The error as OpenAI's JSON error shape, ready to send."""
        return orjson.dumps({"error": self.error_object()})

    def headers(self) -> dict[str, str]:
        return {"content-type": "application/json", **dict(self.also)}


# The connection is closed after the answer (what else the client sends is not read); the SDKs
# do not retry the call (the engine took it).
_CLOSES = (("connection", "close"),)
_NOT_RETRIED = (("x-should-retry", "false"),)


class RequestError(CarpoolError):
    """The request cannot be served as sent: malformed JSON, wrong field types."""

    status = 400
    type = "invalid_request_error"

    def __init__(
        self, message: str, code: str | None = "invalid_request", param: str | None = None
    ):
        super().__init__(message)
        self.code = code
        self.param = param


class UpgradeWithBody(RequestError):
    """A request asks to upgrade the connection (``Upgrade``, an ``h2c`` or a WebSocket) and
    has a body: the HTTP parser takes what follows the head for the new protocol, so the body
    would be lost (an empty one served). The gateway serves no upgrade: refused, the connection
    closed. One without a body is served as if it asked for none (RFC 9110 7.8)."""

    also = _CLOSES

    def __init__(self) -> None:
        super().__init__(
            "a request with a body cannot ask to upgrade the connection (Upgrade): none is "
            "served; send it without the Upgrade header",
            "upgrade_not_served",
        )


class BodyTooLarge(RequestError):
    """The body is larger than ``limits.max_body_bytes``. The connection is closed after the
    answer: the rest of the body is not read (nor waited for)."""

    status = 413
    also = _CLOSES

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"request body is larger than the limit of {limit} bytes", "body_too_large"
        )


class ClientKeyRefused(CarpoolError):
    """401: a request to ``/v1/...`` without a key ``auth.client_keys_file`` lists (``auth.py``),
    answered before its body is read, in its API's error shape (Anthropic's on ``/v1/messages``)."""

    status = 401
    type = "invalid_request_error"  # (OpenAI's for a wrong key)
    code = "invalid_api_key"
    also = (("www-authenticate", "Bearer"),)

    def __init__(self) -> None:
        super().__init__("Incorrect API key provided: this gateway does not know it.")


class HeadersTooLarge(RequestError):
    """The request's headers are larger than ``limits.max_header_bytes`` (RFC 6585: 431)."""

    status = 431

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"request headers are larger than the limit of {limit} bytes", "headers_too_large"
        )


class TargetTooLong(RequestError):
    """The request target (path and query) is longer than ``limits.max_header_bytes`` (RFC 9110:
    414), refused by the HTTP protocol as it arrives; the connection is closed."""

    status = 414
    also = _CLOSES

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request target is longer than the limit of {limit} bytes", "target_too_long"
        )


class BodyTimeout(RequestError):
    """The body did not arrive within ``limits.body_read_timeout`` seconds (RFC 9110: 408). The
    connection is closed after the answer: the rest of the body may still be on its way."""

    status = 408
    also = _CLOSES

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"the request body was not received within {timeout:g} seconds", "body_timeout"
        )


class HeadersTimeout(RequestError):
    """The request line and headers did not all arrive within ``limits.body_read_timeout``
    seconds (RFC 9110: 408), cut by the HTTP protocol; the connection is closed."""

    status = 408
    also = _CLOSES

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"the request's headers were not received within {timeout:g} seconds",
            "header_timeout",
        )


class ContentCodingRefused(RequestError):
    """A cached endpoint's body sent in a content coding (``Content-Encoding``: gzip, deflate,
    br...), which the gateway does not decode: its JSON is parsed and re-serialized, so the
    body must come as it is (``identity``). RFC 9110 15.5.16: 415, with ``Accept-Encoding``
    saying which coding would have been accepted."""

    status = 415
    also = (("accept-encoding", "identity"),)

    def __init__(self, coding: str) -> None:
        super().__init__(
            f"Content-Encoding {coding[:64]!r} is not accepted here: send the JSON body "
            "uncompressed (identity)",
            "unsupported_content_encoding",
        )


class MalformedHttp(RequestError):
    """A request the HTTP parser cannot read (RFC 9112): a malformed or ambiguous framing (a
    ``Content-Length`` that is no number, two that differ, one with ``Transfer-Encoding``, a
    bad chunk size), a header line it cannot split. Refused by the HTTP protocol as it is read;
    the connection is closed, since where the next request begins is unknown."""

    also = _CLOSES

    def __init__(self, reason: str | None = None) -> None:
        said = f" ({reason})" if reason else ""
        super().__init__(f"the request is not valid HTTP/1.1{said}", "invalid_http")


class TransferCodingRefused(RequestError):
    """A request whose ``Transfer-Encoding`` lists a coding other than ``chunked`` (``gzip,
    chunked``): the gateway decodes none, and the body would be read still coded. RFC 9112
    6.1: 501; the connection is closed."""

    status = 501
    also = _CLOSES

    def __init__(self, codings: str) -> None:
        super().__init__(
            f"Transfer-Encoding {codings[:64]!r} is not implemented: only chunked is; send the "
            "body uncompressed",
            "unsupported_transfer_encoding",
        )


class BodyNotForwarded(RequestError):
    """A pass-through ``GET``, ``HEAD`` or ``OPTIONS`` with a body (a ``Content-Length`` over 0,
    or a ``Transfer-Encoding``). Such a body has no meaning (RFC 9110 9.3.1), and a server that
    reads none on that method (cpp-httplib: llama.cpp's server) would take it for the next
    request on the connection: one the gateway never judged, its answer the next client's."""

    def __init__(self, method: str) -> None:
        super().__init__(
            f"a {method} request carries no body through this gateway: send it without one",
            "body_not_forwarded",
        )


class PathRefused(RequestError):
    """A pass-through path that could reach outside the upstream's ``/v1`` (``paths.confine``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "invalid_path")


class PathNotAllowed(RequestError):
    """A pass-through path that ``passthrough.allow`` does not list."""

    status = 403

    def __init__(self, path: str) -> None:
        super().__init__(f"/v1{path[:200]} is not forwarded by this gateway", "path_not_allowed")


class AdminRequired(CarpoolError):
    """An admin surface asked for without the admin token (``Authorization: Bearer <token>``,
    or Basic with the token as password, which lets a browser open /dashboard)."""

    status = 401
    type = "invalid_request_error"
    code = "unauthorized"
    also = (("www-authenticate", 'Bearer realm="carpool admin"'),)


class AdminTokenPresented(CarpoolError):
    """401: a request to ``/v1/...`` presenting the admin token as its credential (a browser
    that opened /dashboard sends its Basic credentials to every path of the origin): refused
    before its body is read, never sent upstream, in its API's error shape."""

    status = 401
    type = "invalid_request_error"
    code = "admin_token_not_a_credential"

    def __init__(self) -> None:
        super().__init__(
            "The gateway's admin token is no credential for /v1 requests and is never sent "
            "upstream: present an API key instead."
        )


class HostNotAllowed(CarpoolError):
    """403: a request naming the gateway, in its ``Host`` header, by a host name
    ``allowed_hosts`` does not hold (a web page's own name, made to resolve to the gateway's
    address: DNS rebinding); refused before its body is read, sent nowhere."""

    status = 403
    type = "invalid_request_error"
    code = "host_not_allowed"

    def __init__(self) -> None:
        super().__init__(
            "This gateway is not served under the host name this request names: add it to "
            "allowed_hosts, or name the gateway by its address."
        )


class UpstreamError(CarpoolError):
    """The upstream call failed; every waiter of the flight receives the same error, in its
    words only if the call was for the same request (``for_others``)."""

    status = 502
    type = "upstream_error"
    # Whose call failed: ``request.requester_digest`` of the body the leader sent (None: not
    # known, e.g. the gateway's own failure, or an older instance's record).
    requester: str | None = None

    def for_others(self) -> UpstreamError:
        """This error as told to a client that joined another requester's call: without any
        text of the upstream's (its message may quote that request: its ``user``, metadata,
        key). The gateway's own errors say nothing of the request: as they are."""
        return self


class UpstreamUnreachable(UpstreamError):
    """No connection to the upstream (refused, reset, name resolution)."""

    status = 502
    code = "upstream_unreachable"


class GatewayOverloaded(UpstreamError):
    """No connection to the upstream could be opened for want of this machine's own resources
    (no file descriptor, no local port: ``upstream.wire.local_reason``): the gateway's limit,
    not the replica's failure. No replica is left out or tried instead (this machine would fail
    again), no upstream error or status counted (``upstream_calls`` counts it as an attempt
    begun: a counter never goes back), for a routed call, a readiness probe (not ready: 503)
    and an embeddings list probe alike; counted in ``overloaded``; ``Retry-After``:
    descriptors free as calls end."""

    status = 503
    type = "server_error"
    code = "gateway_overloaded"
    retry_after = 1  # s
    also = (("retry-after", str(retry_after)),)
    reason = ""  # what this machine lacked, in a few words ("too many open files")
    # What the operator may do about it (``ReplicaSet``'s log line).
    advice = "raise the file descriptor limit, or take fewer client connections"

    def said(self) -> str:
        """What happened, for the operator's log line."""
        return f"{self.reason} on this machine"


class UpstreamBusy(GatewayOverloaded):
    """Every connection of the gateway's to a replica (``limits.upstream_max_connections``)
    stayed in use for ``limits.upstream_queue_timeout`` while the call waited for one (other
    calls' long streams hold theirs as long as they run): nothing was sent. The gateway's own
    limit, as ``GatewayOverloaded`` (its 503, ``Retry-After``, counted in ``overloaded``, no
    verdict on the replica: it is busy, not failing), but another replica's connections may be
    free: a routed call is tried once on another (``ReplicaSet.send``)."""

    advice = "raise limits.upstream_max_connections, or add replicas"

    def said(self) -> str:
        return self.reason


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer within ``limits.upstream_timeout`` seconds."""

    status = 504
    code = "upstream_timeout"


class UpstreamNoAnswer(UpstreamTimeout):
    """The request was written whole and no answer's head came within
    ``limits.upstream_timeout`` (504, ``code`` ``upstream_timeout``).

    The engine may be running it: it sends a whole answer's head once it has computed it, so
    a long generation is silent until then. As for an answer cut after its head
    (``UpstreamAnswerCut``), it is not run again on another replica (``routing.replicas``: the
    client would wait twice the timeout for a generation run twice), nor retried by the SDKs
    (``x-should-retry: false``). A plain ``UpstreamTimeout`` is one that cannot have run (the
    server never read the whole request): tried elsewhere.

    ``dropped``: not a timeout, the connection closed or reset after the request was written
    whole and before a byte of answer (an engine that crashed, or a proxy that cut the call,
    mid-generation), or an answer too malformed to read or relay (``upstream.wire``'s parser
    refused it; a pass-through answer's header holding a control character): a 502 (``code``
    ``upstream_unreachable``, as when nothing was sent), and likewise not run again, since the
    engine may have run it.
    """

    also = _NOT_RETRIED

    def __init__(self, message: str, dropped: bool = False) -> None:
        super().__init__(message)
        if dropped:
            self.status, self.code = 502, "upstream_unreachable"


class UpstreamRedirected(UpstreamError):
    """A pass-through call answered with a redirect. Not followed: the client's credentials
    (an ``api-key`` header, a query key) would go to whatever host it names; nor relayed: its
    ``Location`` names the upstream. A cached endpoint's call answered with any 3xx (a 304,
    one without ``Location``) too: no answer of those endpoints has such a status, and a
    joiner of another request's call would get it with a body (``for_others``), which no
    client reads after a 304: its connection's next answer would begin there."""

    status = 502
    code = "upstream_redirect"


class UpstreamAnswerUnreadable(UpstreamError):
    """A whole 2xx answer whose body is no JSON object: not JSON (a close-delimited body its
    server dropped midway, an SSE stream to a call that asked for none) or another value (an
    array). The engine took the call and answered, so an SDK's retry would run it again (its
    three tries, three generations): ``x-should-retry: false``, as for an answer cut short."""

    status = 502
    code = "upstream_answer_unreadable"
    also = _NOT_RETRIED


class UpstreamBadStatus(UpstreamError):
    """A final status no answer can have: a 1xx taken as final (101 Switching Protocols, to a
    call that asked for no upgrade), or one HTTP does not define (600-999: the parser reads any
    three digits). Relayed, a 101 told the client its connection switched protocols, and a 999
    had no status line to be written with (the connection closed unanswered): a 502, on the
    cached endpoints and pass-through alike."""

    status = 502
    code = "upstream_bad_status"


class UpstreamKeyRefused(UpstreamError):
    """The upstream answered 401 or 403 to a call made with the gateway's own key
    (``upstream.api_key``, or a user and password in the upstream's URL). Its body is not
    relayed: it can quote part of the key or name the account, and it would blame the client's
    key, which was not sent.

    It is an answer, not a failure of the replica: about this request (OpenAI's 403 for a model
    the project may not use) as often as about the key. So routing neither fails over nor
    leaves the replica out (one client's request would take the gateway out of rotation), and
    the same call would be refused again: ``x-should-retry: false``. But with a key of its own
    per replica (``upstream.api_keys``, not all the same) it is that replica's key: routing
    leaves the replica out and tries the call on another (``routing.replicas``), and this is
    raised only when that failed too. ``upstream_status`` is the upstream's 401 or 403.
    """

    status = 502
    code = "upstream_key_refused"
    also = _NOT_RETRIED

    def __init__(self, message: str, upstream_status: int = 0) -> None:
        super().__init__(message)
        self.upstream_status = upstream_status


class UpstreamStreamBroken(UpstreamError):
    """A stream failed or ended before every choice had a finish reason.

    The upstream took the call (it answered 2xx and began a stream, an empty one included), so
    an automatic retry would run it again: the reply says ``x-should-retry: false``, which the
    ``openai`` and ``anthropic`` SDKs obey (they retry a 5xx otherwise). ``upstream_error`` is
    the engine's own error object when it reported one in the stream: clients get it as it is.
    """

    status = 502
    code = "upstream_stream_broken"
    also = _NOT_RETRIED

    def __init__(self, message: str, upstream_error: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.upstream_error = upstream_error

    def error_object(self) -> dict[str, Any]:
        if self.upstream_error is not None:
            return self.upstream_error
        return super().error_object()

    def for_others(self) -> UpstreamError:
        if self.upstream_error is None:
            return self  # (the gateway's words: how the stream ended)
        error = type(self)(OTHERS_MESSAGE, scrubbed(self.upstream_error))
        error.status, error.code = self.status, self.code
        return error


class UpstreamStreamStalled(UpstreamStreamBroken):
    """A stream that sent no event for ``limits.upstream_timeout`` since its call (or since its
    last event; bytes that are none, such as SSE comments, do not count): a timeout, 504 ``upstream_timeout`` to a client sent nothing yet, as the same
    stall of a whole answer's call is (``UpstreamAnswerCut``: a 502 here made a non-streaming
    client's status hang on whether its call happened to be a stream); streaming clients sent
    frames already get it as their error event. Not retried (``x-should-retry: false``): the
    engine took the call. Told apart for routing, which leaves out a replica whose stream
    stalled with nothing after its head while it answered no other call
    (``routing.replicas``: a stuck engine behind a live HTTP layer)."""

    status = 504
    code = "upstream_timeout"


class UpstreamAnswerCut(UpstreamStreamBroken):
    """A whole (not streamed) answer whose status and headers came, but whose body was cut
    (502) or not whole within ``limits.upstream_timeout`` of its call, however it trickled in
    (504, ``code`` ``upstream_timeout``).

    As for a stream that broke part-way, the engine took the call (an engine sends a whole
    answer's head once it has computed it): it is not run again on another replica
    (``routing.replicas``), nor retried by the SDKs (``x-should-retry: false``).
    """

    code = "upstream_answer_cut"

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        if timed_out:
            self.status, self.code = 504, "upstream_timeout"


class UpstreamContentCoding(UpstreamAnswerCut):
    """An answer to a cached endpoint's call in a content coding the gateway did not ask for
    (it asks for ``identity``: an upstream, or a proxy before it, compressed all the same) and
    cannot read: a coding other than gzip and deflate (br, zstd...), one that does not decode,
    or decodes past ``upstream.http.MAX_DECODED``, and any coded stream (read as it comes, it
    is never decoded). Its message names the coding. Relayed, the client got compressed bytes
    labelled ``application/json`` without their ``Content-Encoding``; stored, every hit would.

    As for an answer cut after its head, the engine took the call: not run again on another
    replica, nor retried by the SDKs (``x-should-retry: false``: it would come coded again).
    """

    code = "upstream_content_coding"


class LeaderLost(UpstreamStreamBroken):
    """This instance was relaying another instance's call and lost it (its leader died or
    left, or its stream broke) after relaying part of it: streaming clients that got those
    frames get this error event; a client that got nothing takes the call over instead."""


# What an upstream's refusal says of when to try again, relayed with its status and body: the
# SDKs back off by them (a 429's ``Retry-After`` dropped, they retried at once). Not what it
# says of the account (``x-ratelimit-*``): under a key the gateway holds, or a namespace shared
# across tenants, that is another's quota.
RETRY_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")
RETRY_FIELDS = frozenset(name.encode("ascii") for name in RETRY_HEADERS)  # (as raw header names)


def retry_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``RETRY_HEADERS`` of an upstream's answer, those that hold a short printable value."""
    return tuple(
        (name, value)
        for name in RETRY_HEADERS
        if (value := headers.get(name)) is not None and _RETRY_VALUE.fullmatch(value)
    )


_RETRY_VALUE = re.compile(r"[ -~]{1,64}")  # (an HTTP date, seconds, ms, true/false)


class UpstreamStatusError(UpstreamError):
    """The upstream answered with a non-2xx status; its status and body reach the client as
    they are, with its content type (none when it named none: ``content_type`` None) and what
    it said of when to retry (``RETRY_HEADERS``)."""

    def __init__(
        self,
        status: int,
        content: bytes,
        content_type: str | None = "application/json",
        retry: tuple[tuple[str, str], ...] = (),
    ):
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.content = content
        self.content_type = content_type
        self.also = retry
        # The digest of the body the upstream answered so (``request.body_digest``), where
        # known: a request of the same key with another body (fields out of the key, another
        # spelling) may be answered otherwise (``pipeline._refused_its_body``).
        self.asked: str | None = None
        # Whether the body is the gateway's words for an upstream body in no API's error shape
        # (``for_others`` of an HTML page, say): each API then shapes it as its own errors
        # (``apis.base.passed_through``), Anthropic's on /v1/messages.
        self.rewritten = False

    def body(self) -> bytes:
        return self.content

    def headers(self) -> dict[str, str]:
        # (An upstream that named no content type: none, never an empty one.)
        named = {"content-type": self.content_type} if self.content_type else {}
        return {**named, **dict(self.also)}

    def for_others(self) -> UpstreamError:
        try:
            parsed = orjson.loads(self.content)
        except orjson.JSONDecodeError:
            parsed = None
        error_object = scrubbed(self.error_object())
        # In the shape it came in: Anthropic's ``{"type": "error", "error": {...}}``, else OpenAI's;
        # a body in neither (not JSON, no error object) in the joiner's API's (``rewritten``).
        anthropic = isinstance(parsed, dict) and parsed.get("type") == "error"
        body = {"type": "error", "error": error_object} if anthropic else {"error": error_object}
        # (When to retry is the upstream's state, not the requester's: every joiner's too.)
        error = UpstreamStatusError(self.status, orjson.dumps(body), retry=self.also)
        error.asked, error.requester = self.asked, self.requester
        error.rewritten = not (isinstance(parsed, dict) and isinstance(parsed.get("error"), dict))
        if error.rewritten:
            error.message = OTHERS_MESSAGE  # (what an API's own shape says: ``Api.error_body``)
        return error

    def error_object(self) -> dict[str, Any]:
        """The upstream's error as an OpenAI error object, for an SSE error event."""
        try:
            parsed = exact_json.loads(self.content)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return dict(parsed["error"])
        return {
            "message": self.content.decode("utf-8", "replace")[:2000],
            "type": self.type,
            "code": None,  # (OpenAI's is a label or null: the status is the answer's)
        }


OTHERS_MESSAGE = (
    "the upstream failed the call this request shared with another one; its message was about "
    "that request and is not passed on"
)
_LABEL = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def scrubbed(upstream: dict[str, Any]) -> dict[str, Any]:
    """An upstream's error object with no text of its own: its ``type`` and ``code`` where they
    are labels (``server_error``, ``context_length_exceeded``; a number), the message ours."""

    def label(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return value if isinstance(value, str) and _LABEL.fullmatch(value) else None

    return {
        "message": OTHERS_MESSAGE,
        "type": label(upstream.get("type")) or "upstream_error",
        "code": label(upstream.get("code")),
        "param": None,
    }


class FlightAbandoned(CarpoolError):
    """Every client of a flight left, so its upstream call was cancelled. Nobody is left to see it."""

    status = 499
    type = "client_closed_request"
    code = "flight_abandoned"
    MESSAGE = "every client of this request left"


def error_event(error: CarpoolError) -> bytes:
    """The SSE frame that tells a streaming client its stream failed (OpenAI's SDK raises on it)."""
    return b"data: " + orjson.dumps({"error": error.error_object()}) + b"\n\n"


class ShuttingDown(CarpoolError):
    """503: the request was still running when the server's shutdown ran out of grace
    (``shutdown.grace_s``), and was cut (``server.GatewayApp.serve``). Its client gets this in
    its API's error shape: a reply not started yet as a 503 with ``Retry-After`` (another
    instance, or this one restarted, may answer the retry), a stream under way as its API's
    error event then its end. Also what a ``/v1`` request to an app whose gateway is closed
    already gets (mounted by a host that closed it: ``server.GatewayApp._route``)."""

    status = 503
    type = "server_error"
    code = "shutting_down"
    retry_after = 1  # s
    also = (("retry-after", str(retry_after)),)

    def __init__(
        self,
        message: str = "The gateway is shutting down and stopped this request before its "
        "answer was complete. Retry it.",
    ) -> None:
        super().__init__(message)


class InternalError(CarpoolError):
    """500: the gateway failed to answer (an exception nothing else handled: a bug). Its client
    gets this, in its API's error shape like every other answer of the gateway, never a bare
    ``Internal Server Error``; what failed goes to the log, never to the client."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(
        self, message: str = "The gateway failed to answer this request (its log says why)."
    ) -> None:
        super().__init__(message)
