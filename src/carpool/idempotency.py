"""Idempotency keys (draft-ietf-httpapi-idempotency-key-header semantics, as Stripe's): the records.

A client that sends ``Idempotency-Key: "K"`` (or ``X-Idempotency-Key``) may retry the same request
safely: it is processed at most once while its record lives, and a retry gets the first answer.

The key
- ``parse_key(headers)`` reads ``idempotency-key``, else ``x-idempotency-key``; None when neither
  is sent. The value is a structured-field string (``"..."``, with ``\\"`` and ``\\\\`` escapes)
  or, leniently, the bare text. It is refused with ``IdempotencyKeyInvalid`` (400) when it is
  empty (or blank), longer than 255 characters once unquoted, or not a valid header string
  (anything outside printable ASCII 0x20-0x7E, a malformed quoted string).
- The records take the key already scoped by the caller (tenant + the raw key): records never
  cross tenants. A backend outside the process hashes it before it goes into its key space.

One record per key, with the fingerprint of the request that created it:

    (none) --begin--> PROCESSING --finish(2xx)----> SUCCESS  } kept ``retention`` s from the
                          |      --finish(other)--> FAILED   } finish, then (none) again
                          |--abandon--> (none)
                          '--lease runs out--> (none)

- ``begin(key, fingerprint)``, atomic (one winner among any number of concurrent callers, on any
  number of instances sharing the backend):
  * no record (or an expired one): a PROCESSING record with a fresh owner token -> ``"new"``
    with the token; the caller processes the request and must end with ``finish`` or ``abandon``;
  * a record with another fingerprint, whatever its state -> ``"mismatch"`` (422);
  * PROCESSING -> ``"processing"`` (409, or ``wait`` for it);
  * SUCCESS/FAILED -> ``"done"`` with the stored response, to be replayed (in the same format:
    status, headers, body byte for byte; see ``replay_as``) plus ``idempotent-replayed: true``,
    without calling upstream.
- ``finish(key, token, response)``: only the owner token of a live PROCESSING record may finish;
  the record becomes SUCCESS (2xx) or FAILED (any other status: an upstream error is replayed
  too) and is kept ``retention`` seconds from now, with ``response.streamed``. The records
  store what they are given: telling final from retryable (``is_final``) is the caller's job.
  Returns whether it was stored (False: not the owner, or the lease ran out / the record was
  evicted, so the answer is not kept).
- ``abandon(key, token)``: the owner gives up without a final answer (its client left and the
  call was cancelled, the gateway failed before an answer): the record is dropped, so a retry
  runs as ``"new"``. Returns whether there was a record to drop.
- ``renew(key, token)``: extends the owner's lease from now (in process: ``processing_ttl``; in
  Redis: ``idempotency.lease``, renewed by the records themselves); False when the
  record is no longer this owner's (then it may already run elsewhere). A PROCESSING record whose
  lease runs out (its owner died, or did not renew) is gone: the next ``begin`` takes over as
  ``"new"``, and the old owner's ``finish`` is refused.
- ``wait(key, fingerprint, timeout)``: for ``idempotency.on_conflict: wait``. Returns the stored
  response once the record of ``fingerprint`` (the waiting request's) is finished; None when the
  timeout passes, when there is no record (abandoned, lease run out, expired), or when the record
  belongs to another fingerprint (taken over by another request, even before the first look). On None the
  caller should ``begin`` again (it may now be ``"new"``, ``"mismatch"``...), not assume a 409.
- Retention: SUCCESS and FAILED records live ``retention`` seconds (config
  ``idempotency.retention``, default 24 h) from their finish; then the key is free again.

Final or retryable (``is_final``; the table is its docstring)
- Only a request the upstream executed is frozen as its final answer (the draft's and Stripe's
  rule: a result is saved only once the request began executing): a complete 2xx answer, or an
  error of the upstream for a request it executed and refused or failed (most 4xx, 500). The
  caller ``finish``es with those only. A 500 is final as Stripe keeps it: the engine ran the
  request and failed on it, and the contract replays "success or upstream error"; a client that
  wants another try after one uses a new key.
- Everything else is retryable, and the caller ``abandon``s the record, so that a retry with the
  same key runs again: the gateway's own refusals, an unreachable upstream (502), a timeout
  (504), 408/409/425/429, a proxy's 502/503/504, a flight abandoned (499), a 200 that is not a
  complete answer (an error body, a body cut or not JSON, a stream that ended with an error
  event or without ``[DONE]``). A timeout is retryable although the engine may have run the
  request: the gateway has no answer to replay, freezing the 504 for the retention would turn a
  slow moment into a day-long failure, and running an LLM call twice costs tokens but has no
  other effect; so a timed-out request is run at least once, not at most once.
- A record is taken before the request runs, so the gateway's refusals of a request as sent
  (400 bad body or fields, 413, 431, an invalid key: ``parse``/``parse_key``) never reach it.
- A list input (the caller's ``list_items``) has one record for the list and one per item
  (``key`` + ``"\\n"`` + index): an item's record is finished only with a complete 2xx answer,
  and the list's only when every item has one; otherwise the list's record is dropped and a
  retry recomputes just the items without an answer.

The format
- ``StoredResponse.streamed`` is the format of the request that made the record (``stream``
  is outside the request digest, so a retry may ask for the other one). ``replay_as`` gives the
  stored response in the format a retry asks for: as it is in the same format; a complete 2xx
  chat/completion answer converted (JSON synthesized into SSE chunks, SSE assembled into the
  JSON body); otherwise None, and the caller answers ``IdempotencyFormatMismatch`` (422): an
  error or an embedding stored for one format is never replayed in the other, and a client
  never gets JSON on a stream or SSE for a non-streaming request.

Backends: ``MemoryIdempotencyRecords`` (one process; bounded: expired records are swept lazily
and the oldest are evicted beyond ``max_records``/``max_bytes``) and
``carpool.redis.idempotency.RedisIdempotencyRecords`` (shared by every instance; layout and
leases in its docstring). A Redis failure raises ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson

from .apis import APIS, Api
from .errors import CarpoolError, UpstreamStreamBroken
from .store.base import StoreUnavailable

__all__ = [
    "HEADER",
    "HEADER_ALIAS",
    "MAX_KEY_LENGTH",
    "REPLAYED_HEADER",
    "Begin",
    "IdempotencyConflict",
    "IdempotencyError",
    "IdempotencyFormatMismatch",
    "IdempotencyKeyInvalid",
    "IdempotencyMismatch",
    "IdempotencyRecords",
    "MemoryIdempotencyRecords",
    "StoredResponse",
    "is_final",
    "parse_key",
    "replay_as",
]

HEADER = "idempotency-key"
HEADER_ALIAS = "x-idempotency-key"
MAX_KEY_LENGTH = 255
REPLAYED_HEADER = (b"idempotent-replayed", b"true")  # added to every replayed response

PROCESSING_TTL = 660.0  # s: the default upstream timeout (600) + a margin
PROBLEM_TYPE = "https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/"


# --------------------------------------------------------------------------- errors


class IdempotencyError(CarpoolError):
    """An idempotency error, answered as RFC 9457 problem details (``application/problem+json``)."""

    type = "invalid_request_error"  # OpenAI's type, for an SSE error event
    problem_type = PROBLEM_TYPE
    title = "Idempotency-Key error"

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "type": self.problem_type,
                "title": self.title,
                "status": self.status,
                "detail": self.message,
            }
        )

    def headers(self) -> dict[str, str]:
        return {"content-type": "application/problem+json"}


class IdempotencyKeyInvalid(IdempotencyError):
    """400: the key is empty, longer than 255 characters, or not a valid header string."""

    status = 400
    code = "idempotency_key_invalid"
    title = "Idempotency-Key is invalid"


class IdempotencyConflict(IdempotencyError):
    """409: a request with this key is still being processed."""

    status = 409
    code = "idempotency_conflict"
    title = "A request is outstanding for this Idempotency-Key"

    def __init__(
        self,
        message: str = "A request with the same Idempotency-Key is still being "
        "processed; retry once it has finished.",
    ) -> None:
        super().__init__(message)


class IdempotencyMismatch(IdempotencyError):
    """422: this key was already used with a different request."""

    status = 422
    code = "idempotency_mismatch"
    title = "Idempotency-Key is already used"

    def __init__(
        self,
        message: str = "This Idempotency-Key was already used with a different "
        "request; a new request needs a new key.",
    ) -> None:
        super().__init__(message)


class IdempotencyFormatMismatch(IdempotencyMismatch):
    """422: the stored response cannot be replayed in the format (stream or not) the retry asks
    for, e.g. an error stored for a streaming request, retried without ``stream``."""

    code = "idempotency_format_mismatch"
    title = "Idempotency-Key's response is in another format"

    def __init__(self, streamed: bool) -> None:
        stored, asked = ("a stream", "without") if streamed else ("not a stream", "with")
        super().__init__(
            f"This Idempotency-Key holds the response to the same request as {stored}; it "
            f'cannot be replayed to a request {asked} "stream": true. Retry in the first '
            "request's format, or use a new key."
        )


# --------------------------------------------------------------------------- the header


def parse_key(headers: Mapping[str, str]) -> str | None:
    """The idempotency key of a request, or None if it has none (header names lower-case).

    ``Idempotency-Key`` wins over ``X-Idempotency-Key``. Raises ``IdempotencyKeyInvalid``.
    """
    name = HEADER
    raw = headers.get(HEADER)
    if raw is None:
        name = HEADER_ALIAS
        raw = headers.get(HEADER_ALIAS)
        if raw is None:
            return None
    label = "Idempotency-Key" if name == HEADER else "X-Idempotency-Key"
    value = raw.strip(" \t")
    for char in value:
        if not " " <= char <= "~":
            raise IdempotencyKeyInvalid(
                f"The {label} header holds a character that is not printable ASCII "
                f"(U+{ord(char):04X})."
            )
    if value.startswith('"'):
        value = _sf_string(value, label)
    if not value.strip():
        raise IdempotencyKeyInvalid(f"The {label} header is empty.")
    if len(value) > MAX_KEY_LENGTH:
        raise IdempotencyKeyInvalid(
            f"The {label} header is {len(value)} characters long; at most {MAX_KEY_LENGTH} "
            "are allowed."
        )
    return value


def _sf_string(text: str, label: str) -> str:
    """The content of a structured-field string (RFC 8941 §3.3.3), printable ASCII already."""
    out: list[str] = []
    i, end = 1, len(text)
    while i < end:
        char = text[i]
        if char == "\\":
            if i + 1 < end and text[i + 1] in '"\\':
                out.append(text[i + 1])
                i += 2
                continue
            break
        if char == '"':
            if i == end - 1:
                return "".join(out)
            break
        out.append(char)
        i += 1
    raise IdempotencyKeyInvalid(
        f"The {label} header is not a valid string: a quoted value "
        'must end with its closing quote and escape only \\" and \\\\.'
    )


# --------------------------------------------------------------------------- the records


@dataclass(slots=True)
class StoredResponse:
    """A final response, replayed as it is: status, headers (raw ASGI pairs), body bytes, and
    ``streamed``: whether the request that made it asked for a stream (see ``replay_as``)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    streamed: bool = False

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(n) + len(v) for n, v in self.headers)


@dataclass(slots=True)
class Begin:
    """What ``begin`` found: ``new`` (``token``: the owner's), ``processing``, ``mismatch``, or
    ``done`` (``response``: the stored one, to replay)."""

    state: Literal["new", "processing", "mismatch", "done"]
    token: str | None = None
    response: StoredResponse | None = None


class IdempotencyRecords(Protocol):
    async def begin(self, key: str, fingerprint: str) -> Begin: ...

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool: ...

    async def abandon(self, key: str, token: str) -> bool: ...

    async def renew(self, key: str, token: str) -> bool: ...

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None: ...

    async def aclose(self) -> None: ...


def _new_token() -> str:
    return secrets.token_hex(16)


# --------------------------------------------------------------------------- final or retryable

SSE_TYPE = b"text/event-stream"
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", SSE_TYPE)]
_RETRY_MEANT = frozenset((408, 409, 425, 429, 499))
_NOT_REACHED = frozenset((502, 503, 504))


def is_final(kind: str, response: StoredResponse) -> bool:
    """Whether ``response`` (to a request of ``kind``: "chat", "responses"..., ``carpool.apis``)
    is the request's final answer, kept for the retention and replayed; if not, it is retryable and a
    retry with the same key runs again.

        status            final  why
        2xx, complete     yes    executed and answered (JSON: ``Api.complete``; a stream:
                                 it ended whole ([DONE] or its last event), no error event,
                                 complete)
        2xx, incomplete   no     not an answer: an error body, a body cut or not JSON, a stream
                                 that failed part-way (error event) or was cut (no [DONE],
                                 no last event)
        4xx but below     yes    executed and refused by the upstream (400 bad parameters,
                                 401/403, 404 no such model, 413, 422...): the same request is
                                 refused again, so replaying the error is the answer
        408 409 425 429   no     not executed, the upstream asks for a retry (request timeout,
                                 conflict, too early, rate limited); 409 is also the gateway's
                                 "an item is still processing"
        499               no     the flight was abandoned: every client left, the call was
                                 cancelled
        500 501 505-511   yes    executed and failed in the engine: replayed, as Stripe does
                                 (it keeps 500s); a client that wants another try uses a new key
        502 503 504       no     not reached or not executed: the gateway's own "unreachable",
                                 "stream broken", "malformed answer" (502), "store unavailable"
                                 (503), "timeout" (504: see the module docstring), or a proxy in
                                 front of the engine saying the same
        other (1xx, 3xx,  no     not an answer of the engine (512-599: proxies' own codes such
        512-599)                 as 520-524)

    The gateway's own refusals of a request as sent (400, 413, 431, an invalid key) come before
    its record is begun; what it answers after that (409, 499, 502, 503, 504) is in the "no"
    rows. Never raises.
    """
    status = response.status
    if 200 <= status < 300:
        return _answered(kind, response)
    if 400 <= status < 500:
        return status not in _RETRY_MEANT
    return 500 <= status <= 511 and status not in _NOT_REACHED


def replay_as(
    response: StoredResponse, kind: str, stream: bool, include_usage: bool
) -> StoredResponse | None:
    """``response`` in the format a retry asks for (``stream``), or None when it has no faithful
    form in it (then: ``IdempotencyFormatMismatch``). Same format: as it is. Another format: a
    complete 2xx answer of an API with streams (``carpool.apis``: chat, completions, Responses,
    Messages), its JSON body synthesized into the API's stream (with the usage chunk if
    ``include_usage``) or its stream assembled into the JSON body. An error, or an answer of
    another kind, stored for one format is not replayed in the other: the upstream might have
    answered the other format differently."""
    if response.streamed == stream:
        return response
    api = APIS.get(kind)
    if not 200 <= response.status < 300 or api is None or not api.streams:
        return None
    if stream:
        body = _json_body(response.body)
        if body is None or not api.complete(body):
            return None
        return StoredResponse(
            response.status,
            list(_SSE_HEADERS),
            b"".join(api.synthesize(body, include_usage)) + api.stream_end,
            True,
        )
    assembled = _assembled(api, response.body)
    if assembled is None:
        return None
    return StoredResponse(response.status, list(_JSON_HEADERS), orjson.dumps(assembled), False)


def _answered(kind: str, response: StoredResponse) -> bool:
    """A 2xx response is a complete answer (see ``is_final``)."""
    api = APIS.get(kind)
    if any(
        name == b"content-type" and value.startswith(SSE_TYPE) for name, value in response.headers
    ):
        if api is None or not api.streams:
            return False
        return _assembled(api, response.body) is not None
    body = _json_body(response.body)
    if body is None:
        return False
    if api is not None:
        return api.final(body)
    return "error" not in body  # another endpoint: its shape is unknown here


def _assembled(api: Api, raw: bytes) -> dict[str, Any] | None:
    """The complete answer a whole SSE body makes: None unless it ended as the API's streams
    end (``[DONE]``, or its last event), no event in it is an error, and it is complete."""
    chunks = api.stream_chunks(raw)
    if chunks is None:
        return None
    try:
        body, complete = api.judge_stream(chunks, None)
    except UpstreamStreamBroken:
        return None
    return body if complete or api.final(body) else None


def _json_body(raw: bytes) -> dict[str, Any] | None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


# --------------------------------------------------------------------------- in process


@dataclass(slots=True, eq=False)
class _Record:
    fingerprint: str
    token: str
    expires: float  # monotonic: the lease, then the retention
    response: StoredResponse | None = None  # None while PROCESSING
    changed: asyncio.Event | None = None  # created by the first waiter; set on any change
    size: int = 0

    def wake(self) -> None:
        if self.changed is not None:
            self.changed.set()


class MemoryIdempotencyRecords:
    """The records in this process. ``retention``/``processing_ttl`` in seconds.

    Bounded: expired records are dropped when met and swept every ``sweep_interval`` seconds;
    beyond ``max_records`` records or ``max_bytes`` of stored responses the oldest records (by
    creation or finish) are evicted, finished or not (an evicted key is free again, and its
    owner's ``finish`` is refused). A response larger than ``max_bytes`` is not kept.
    """

    def __init__(
        self,
        retention: float,
        processing_ttl: float = PROCESSING_TTL,
        *,
        max_records: int = 100_000,
        max_bytes: int = 256 * 1024 * 1024,
        sweep_interval: float = 30.0,
    ) -> None:
        if retention <= 0 or processing_ttl <= 0:
            raise ValueError("retention and processing_ttl must be positive")
        self.retention = retention
        self.processing_ttl = processing_ttl
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.sweep_interval = sweep_interval
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._bytes = 0
        self._next_sweep = time.monotonic() + sweep_interval
        self.waiters = 0  # tasks inside ``wait`` now
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        return self._bytes

    async def begin(self, key: str, fingerprint: str) -> Begin:
        now = time.monotonic()
        self._sweep(now)
        record = self._live(key, now)
        if record is None:
            token = _new_token()
            self._records[key] = _Record(fingerprint, token, now + self.processing_ttl)
            self._bound()
            return Begin("new", token)
        if record.fingerprint != fingerprint:
            return Begin("mismatch")
        if record.response is None:
            return Begin("processing")
        return Begin("done", response=_copy(record.response))

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool:
        now = time.monotonic()
        record = self._owned(key, token, now)
        if record is None:
            return False
        if response.size > self.max_bytes:  # too large to keep: the key is free again
            self._drop(key)
            return False
        record.response = _copy(response)
        record.size = response.size
        record.expires = now + self.retention
        self._bytes += record.size
        self._records.move_to_end(key)
        record.wake()
        self._bound()
        return key in self._records

    async def abandon(self, key: str, token: str) -> bool:
        if self._owned(key, token, time.monotonic()) is None:
            return False
        self._drop(key)
        return True

    async def renew(self, key: str, token: str) -> bool:
        now = time.monotonic()
        record = self._owned(key, token, now)
        if record is None:
            return False
        record.expires = now + self.processing_ttl
        return True

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None:
        deadline = time.monotonic() + timeout
        self.waiters += 1
        try:
            while True:
                now = time.monotonic()
                record = self._live(key, now)
                if record is None:
                    return None
                if record.fingerprint != fingerprint:
                    return None
                if record.response is not None:
                    return _copy(record.response)
                left = deadline - now
                if left <= 0:
                    return None
                if record.changed is None:
                    record.changed = asyncio.Event()
                changed = record.changed
                # Wake at the latest when the lease runs out, to see the record gone.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        changed.wait(), max(0.0, min(left, record.expires - now)) + 0.001
                    )
        finally:
            self.waiters -= 1

    async def aclose(self) -> None:
        for key in list(self._records):
            self._drop(key)

    # ------------------------------------------------------------------ internals

    def _live(self, key: str, now: float) -> _Record | None:
        record = self._records.get(key)
        if record is not None and record.expires <= now:
            self._drop(key)
            return None
        return record

    def _owned(self, key: str, token: str, now: float) -> _Record | None:
        record = self._live(key, now)
        if record is None or record.response is not None or record.token != token:
            return None
        return record

    def _drop(self, key: str) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self._bytes -= record.size
            record.wake()

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_interval
        for key in [k for k, r in self._records.items() if r.expires <= now]:
            self._drop(key)

    def _bound(self) -> None:
        """Evict the oldest records while over a bound (expired ones went at the last sweep)."""
        while self._records and (
            len(self._records) > self.max_records or self._bytes > self.max_bytes
        ):
            self._drop(next(iter(self._records)))
            self.evictions += 1


def _copy(response: StoredResponse) -> StoredResponse:
    return StoredResponse(response.status, list(response.headers), response.body, response.streamed)


class FallbackRecords:
    """Shared records that fall back to this process's records while the shared backend is down.

    A record begun locally (Redis unreachable) is finished, abandoned and renewed locally: its
    owner token says where it lives. Retries that reach the same instance stay protected while
    Redis is down; retries on other instances then are not (stated in the README).
    """

    def __init__(self, shared: IdempotencyRecords, local: MemoryIdempotencyRecords) -> None:
        self.shared = shared
        self.local = local
        self._local_tokens: set[str] = set()

    async def begin(self, key: str, fingerprint: str) -> Begin:
        try:
            return await self.shared.begin(key, fingerprint)
        except StoreUnavailable:
            begin = await self.local.begin(key, fingerprint)
            if begin.token is not None:
                self._local_tokens.add(begin.token)
            return begin

    def _owner(self, token: str) -> IdempotencyRecords:
        return self.local if token in self._local_tokens else self.shared

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool:
        try:
            return await self._owner(token).finish(key, token, response)
        except StoreUnavailable:
            return False
        finally:
            self._local_tokens.discard(token)

    async def abandon(self, key: str, token: str) -> bool:
        try:
            return await self._owner(token).abandon(key, token)
        except StoreUnavailable:
            return False
        finally:
            self._local_tokens.discard(token)

    async def renew(self, key: str, token: str) -> bool:
        try:
            return await self._owner(token).renew(key, token)
        except StoreUnavailable:
            return False

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None:
        try:
            return await self.shared.wait(key, fingerprint, timeout)
        except StoreUnavailable:
            return await self.local.wait(key, fingerprint, timeout)

    async def aclose(self) -> None:
        await self.shared.aclose()
        await self.local.aclose()
