"""carpool's logs: one logger per layer, a request id on every line, text or JSON.

Contract:
- Loggers are named by layer: ``carpool.cli``, ``carpool.server``, ``carpool.flight``,
  ``carpool.lead``, ``carpool.reply``, ``carpool.routing`` (upstream failures, rate-limited by
  ``routing.log_interval``, with the replica's name), ``carpool.store``,
  ``carpool.invalidation``, ``carpool.semantic``; messages do not repeat the name.
- ``configure(level, fmt)`` (``carpool serve``: ``log_level``, ``log_format``): one handler on
  stderr for the root logger. ``text``: ``time level logger [request id] message``; ``json``:
  one JSON object per line with ``time``, ``level``, ``logger``, ``request_id``, ``message``
  (and ``exception`` when there is one), for log shippers. Every record carries the request id
  of the request it was logged for (``request_id.RequestIdFilter``), ``-`` outside one.
- No log line carries a credential, an upstream URL's user or query, or a prompt (the loggers'
  own contracts; ``tests/test_tenants_adversarial.py`` checks it at debug level), with one
  exception kept on purpose (docs/security.md): with ``semantic.mode: mark``, the debug line of
  a near miss (``reply.nearest``) quotes the nearest stored entry's first 200 characters, for
  tuning the threshold.
- ``Throttle(interval)``: when a line about one recurring thing is written: the first at once,
  then at most one per ``interval`` seconds, each saying how many were held back since the
  line before (a burst that fails every request is one line, not thousands).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Literal

import orjson

from .request_id import RequestIdFilter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class Throttle:
    """The module's contract: ``due(now)`` for each occurrence, on the caller's clock."""

    __slots__ = ("interval", "_logged_at", "_held")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._logged_at: float | None = None
        self._held = 0

    def due(self, now: float) -> int | None:
        """Whether this occurrence is logged: how many were held back since the last line
        (0: none), or None, when it is held back itself."""
        if self._logged_at is not None and now - self._logged_at < self.interval:
            self._held += 1
            return None
        held, self._held, self._logged_at = self._held, 0, now
        return held


class JsonFormatter(logging.Formatter):
    """One JSON object per record (``time`` in ISO 8601, UTC)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure(level: str, fmt: Literal["text", "json"] = "text") -> None:
    """Route every logger to stderr in ``fmt``, at ``level``, with request ids."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
