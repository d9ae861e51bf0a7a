"""Request ids: every response carries ``x-request-id``, and every log line of its request.

Contract:
- ``request_id(headers)``: the client's own ``x-request-id`` when it sent a usable one (1 to 128
  characters of letters, digits and ``-_.:/+=``, a letter or a digit among them: echoed back as
  it came), else a new one (16 hex
  digits, from the OS's random generator). Anything else a client sends there is replaced, never echoed: a response
  header must not carry a client's arbitrary bytes.
- An upstream's own ``x-request-id`` (a pass-through answer) is relayed as
  ``x-upstream-request-id``: a response carries one ``x-request-id``, the gateway's.
- A client's id is never sent to an engine on a cached endpoint's call: each such call carries
  an id of its own (``new_call_id``, ``upstream.http``), logged with the client's. An engine
  names its answer after the id it is sent (vLLM: ``chatcmpl-<x-request-id>``), and that answer
  is served to other clients. Pass-through, whose answers are never shared, forwards it. A
  call's id is a UUID (version 4, its canonical text): llama-cpp-python's server refuses any
  other ``x-request-id`` with an empty 400 (starlette-context's ``RequestIdPlugin``).
- Ids cannot be predicted: both come from the OS's random generator (``os.urandom``). Drawn
  from the process's Mersenne Twister, 312 request ids, which any client gets (``/healthz``
  too), gave its state away, and with it the next call's id, which names another tenant's
  answer at the engine.
- ``CURRENT`` holds the id of the request the running task serves (a ``ContextVar``: tasks the
  request starts inherit it); ``RequestIdFilter`` puts it on every log record as
  ``record.request_id`` (``-`` outside a request), for the log format's ``%(request_id)s``.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable
from contextvars import ContextVar
from os import urandom

HEADER = b"x-request-id"
UPSTREAM_HEADER = b"x-upstream-request-id"  # an upstream's own id, relayed by pass-through
CURRENT: ContextVar[str] = ContextVar("carpool_request_id", default="-")
# (With a letter or a digit: a lone ``-``, the log lines' "outside any request", or ``...``
# would make a request's log lines look like none's.)
_USABLE = re.compile(rb"(?=[^A-Za-z0-9]*[A-Za-z0-9])[A-Za-z0-9\-_.:/+=]{1,128}")


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The id of a request with these (ASGI) headers: the client's when usable, else new."""
    for name, value in headers:
        if name == HEADER and _USABLE.fullmatch(value):
            return value
    return new_id().encode()


def new_id() -> str:
    """A new id: 16 hex digits, random (a request's)."""
    return urandom(8).hex()


def new_call_id() -> str:
    """A new upstream call's id: a random UUID, version 4, as its canonical text (see the
    module's contract)."""
    return str(uuid.uuid4())


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the current request's id) to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = CURRENT.get()
        return True
