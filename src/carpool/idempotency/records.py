"""The records: one per key, with the fingerprint of the request that created it.

    (none) --begin--> PROCESSING --finish(2xx)----> SUCCESS  } kept ``retention`` s from the
                        |  ^     --finish(other)--> FAILED   } finish (release), then (none)
                        |  |     --release--------> RELEASED } again
                        |  '--begin, same fingerprint--'
                        |--abandon--> (none)
                        '--lease runs out--> (none)

- ``begin(key, fingerprint)``, atomic (one winner among any number of concurrent callers, on any
  number of instances sharing the backend):
  * no record (or an expired one): a PROCESSING record with a fresh owner token -> ``"new"``
    with the token; the caller processes the request and must end with ``finish``, ``abandon``
    or ``release``;
  * RELEASED with the same fingerprint: PROCESSING again, with a fresh owner token -> ``"new"``;
  * a record with another fingerprint, whatever its state -> ``"mismatch"`` (422);
  * PROCESSING -> ``"processing"`` (409, or ``wait`` for it);
  * SUCCESS/FAILED -> ``"done"`` with the stored response, to be replayed (in the same format
    and with the same usage asked: status, headers (those it keeps), body byte for byte; see
    ``replay_as``) plus ``idempotent-replayed: true``,
    without calling upstream, with its ``age`` (from ``response.created``).
- ``finish(key, token, response)``: only the owner token of a live PROCESSING record may finish;
  the record becomes SUCCESS (2xx) or FAILED (any other status: an upstream error is replayed
  too) and is kept ``retention`` seconds from now, with ``response.streamed``. The records
  store what they are given, of its headers only those a replay repeats (``replayable``: a
  framing one, ``content-length`` or ``transfer-encoding``, replayed beside the transport's
  own, framed the body twice): telling final from retryable (``is_final``) is the caller's job.
  Returns whether it was stored (False: not the owner, or the lease ran out / the record was
  evicted, so the answer is not kept).
- ``abandon(key, token)``: the owner gives up without a final answer (its client left and the
  call was cancelled, the gateway failed before an answer): the record is dropped, so a retry
  runs as ``"new"``. Returns whether there was a record to drop.
- ``release(key, token)``: the owner gives up without a final answer, but the key stays its
  request's: a list input some of whose items succeeded (``once``: their records are kept
  under the key, and only the same list may be answered from them). The record becomes
  RELEASED, kept ``retention`` seconds from now with its fingerprint: a retry of the same
  request begins it again as ``"new"`` (and recomputes what was not kept), another request is a
  ``"mismatch"``; its waiters are woken and ``wait`` answers None. Returns whether it was
  released (False: not the owner's, or no longer PROCESSING).
- ``renew(key, token)``: extends the owner's lease from now (in process: ``processing_ttl``; in
  Redis: ``idempotency.lease``, renewed by the records themselves); False when the
  record is no longer this owner's (then it may already run elsewhere). A PROCESSING record whose
  lease runs out (its owner died, or did not renew) is gone: the next ``begin`` takes over as
  ``"new"``, and the old owner's ``finish`` is refused.
- ``wait(key, fingerprint, timeout)``: for ``idempotency.on_conflict: wait``. Returns the stored
  response once the record of ``fingerprint`` (the waiting request's) is finished; None when the
  timeout passes, when there is no record (abandoned, lease run out, expired), when it is
  RELEASED, or when the record belongs to another fingerprint (taken over by another request,
  even before the first look). On None the caller should ``begin`` again (it may now be
  ``"new"``, ``"mismatch"``, or ``"processing"`` again: another waiter began it first), not
  assume a 409.
- Retention: SUCCESS, FAILED and RELEASED records live ``retention`` seconds (config
  ``idempotency.retention``, default 24 h) from their finish or release; then the key is free
  again.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal, Protocol

from ..reply import NO_STORE

PROCESSING_TTL = 660.0  # s: the default upstream timeout (600) + a margin

# The headers of its answer a record keeps, and so all a replay repeats (``replayable``).
_KEPT_HEADERS = frozenset({b"content-type", b"x-carpool-usage"})


def replayable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """What a record keeps of an answer's headers, and all a replay repeats of them: its
    content type, what it says of its usage (``x-carpool-usage``: the body it repeats is the
    same) and ``Cache-Control: no-store`` (an answer the upstream said no cache may store:
    ``reply.NO_STORE``); not its outcome (nor a stream's ``no-cache``, which a replay's own
    form says or not), nor its framing (``content-length``, ``transfer-encoding``: the
    transport writes its own, which a record's beside it would contradict)."""
    return [
        (name, value)
        for name, value in headers
        if name in _KEPT_HEADERS or (name, value) == NO_STORE
    ]


@dataclass(slots=True)
class StoredResponse:
    """A final response, replayed as it is: status, headers (raw ASGI pairs), body bytes, and
    ``streamed``: whether the request that made it asked for a stream (see ``replay_as``);
    ``created``: when its answer was made (wall-clock seconds on the gateway's clock: its
    reply's time less the ``age`` it said; shared records keep it on Redis's and read it back
    onto the reader's), for the replay's ``age``; None when unknown (a record written before
    it was kept)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    streamed: bool = False
    created: float | None = None


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

    async def release(self, key: str, token: str) -> bool: ...

    async def renew(self, key: str, token: str) -> bool: ...

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None: ...

    async def aclose(self) -> None: ...


def _new_token() -> str:
    return secrets.token_hex(16)
