"""Idempotency keys (draft-ietf-httpapi-idempotency-key-header semantics, as Stripe's).

A client that sends ``Idempotency-Key: "K"`` (or ``X-Idempotency-Key``) may retry the same request
safely: it is processed at most once while its record lives, and a retry gets the first answer.

The package, one contract per module:
- ``header``: the key (``parse_key``: which header, what value is valid).
- ``errors``: what the gateway answers about a key (RFC 9457 problem details: 400, 409, 422,
  503 when the shared records are busy).
- ``records``: the records' protocol and states (``IdempotencyRecords``, ``Begin``,
  ``StoredResponse``): one record per key, begun, finished or abandoned, leased, retained.
- ``final``: final or retryable (``is_final``) and the replay's format (``replay_as``).
- ``memory``: ``MemoryIdempotencyRecords`` (one process; bounded); ``fallback``:
  ``FallbackRecords`` (the shared records, or this process's while Redis is down, by the
  instance's one Redis health, as every Redis layer). The shared backend is
  ``carpool.redis.idempotency.RedisIdempotencyRecords`` (shared by every instance; layout,
  leases and health in its docstring); a Redis failure raises ``StoreUnavailable``.
- ``once``: a request with a key, run at most once through the gateway (``AtMostOnce``: the
  records begun, finished or abandoned around ``Gateway._answer``). Not imported here: it
  stands on the request path, which imports this package.

The public names below are importable from ``carpool.idempotency`` as they always were.
"""

from .errors import PROBLEM_TYPE as PROBLEM_TYPE
from .errors import (
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyFormatMismatch,
    IdempotencyKeyInvalid,
    IdempotencyMismatch,
    IdempotencyUnavailable,
)
from .fallback import FallbackRecords as FallbackRecords
from .final import SSE_TYPE as SSE_TYPE
from .final import is_final, replay_as
from .header import HEADER, HEADER_ALIAS, MAX_KEY_LENGTH, REPLAYED_HEADER, parse_key
from .memory import MemoryIdempotencyRecords
from .records import PROCESSING_TTL as PROCESSING_TTL
from .records import Begin, IdempotencyRecords, StoredResponse
from .records import _new_token as _new_token

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
    "IdempotencyUnavailable",
    "MemoryIdempotencyRecords",
    "StoredResponse",
    "is_final",
    "parse_key",
    "replay_as",
]
