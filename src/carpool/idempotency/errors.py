"""Idempotency errors, answered as RFC 9457 problem details (``application/problem+json``), with
OpenAI's ``error`` member beside them (message, type, param, code) for the SDKs that read only it.

- ``IdempotencyKeyInvalid`` (400): the key is empty, too long or not a valid header string
  (``parse_key``); it is refused before any record is begun.
- ``IdempotencyConflict`` (409): a request with the key is still being processed (``begin`` said
  ``"processing"``, with ``idempotency.on_conflict: reject``, or after waiting in vain).
- ``IdempotencyMismatch`` (422): the key was used with another request (another fingerprint).
- ``IdempotencyFormatMismatch`` (422): the stored response has no faithful form in the format
  (stream or not) the retry asks for (``replay_as``).
- ``IdempotencyUnavailable`` (503, ``Retry-After``): the shared records answer, but every
  connection to them stayed busy, or Redis refused another (its ``maxclients``: ``PoolExhausted``
  either way): the request was not run, so a retry with the same key is safe. (Running it on this instance's records instead could run the key twice.)
- ``IdempotencyResponseNotKept`` (507): the request ran, but the shared records were full
  (Redis at ``maxmemory``) when its response was to be kept: what its retries are answered
  (the record says it ran, without the response), never a second run. A record in Redis that
  cannot be read is answered so too (it ran, or may have), its message saying that instead
  (``redis.idempotency``); a retry is told the message its record holds.
"""

from __future__ import annotations

import orjson

from ..errors import CarpoolError

PROBLEM_TYPE = "https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/"


class IdempotencyError(CarpoolError):
    """An idempotency error, answered as RFC 9457 problem details (``application/problem+json``)."""

    type = "invalid_request_error"  # OpenAI's type, for an SSE error event
    problem_type = PROBLEM_TYPE
    title = "Idempotency-Key error"

    def body(self) -> bytes:
        # RFC 9457 allows members of one's own: ``message`` and ``code`` are where the openai
        # Python SDK looks for an error's text and code without an ``error`` member (its
        # message was "Error code: 422"); the Node SDK reads only ``error`` (OpenAI's shape:
        # its message was "422 status code (no body)", its ``code`` undefined).
        return orjson.dumps(
            {
                "type": self.problem_type,
                "title": self.title,
                "status": self.status,
                "detail": self.message,
                "message": self.message,
                "code": self.code,
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": None,
                    "code": self.code,
                },
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


class IdempotencyUnavailable(IdempotencyError):
    """503: the shared records could not be read in time although Redis answers (every pooled
    connection stayed busy, or Redis refused another past its ``maxclients``); nothing was
    run, and a retry with the same key is safe."""

    status = 503
    type = "server_error"
    code = "idempotency_unavailable"
    title = "Idempotency-Key records are busy"
    retry_after = 1  # s: a pool that ran out frees its connections within a command's time

    def __init__(
        self,
        message: str = "The records of Idempotency-Keys are busy; the request was not run. "
        "Retry it with the same key.",
    ) -> None:
        super().__init__(message)

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "retry-after": str(self.retry_after)}


class IdempotencyResponseNotKept(IdempotencyError):
    """507: the request ran, its response could not be kept (the shared records were full, or
    its record could not be read: the message says which): stored in its place, so that a
    retry is told, not run again."""

    status = 507
    type = "server_error"
    code = "idempotency_response_not_kept"
    title = "The response to this Idempotency-Key was not kept"

    def __init__(
        self,
        message: str = "The request with this Idempotency-Key ran, but its response could not "
        "be kept (the shared store was full), so it cannot be replayed. Use a new "
        "Idempotency-Key to run it again.",
    ) -> None:
        super().__init__(message)

    def headers(self) -> dict[str, str]:
        # Every retry with the key gets this same 507: the SDKs, which retry a 5xx on their
        # own, are told not to (as for a replayed 5xx).
        return {**super().headers(), "x-should-retry": "false"}
