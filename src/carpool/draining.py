"""Graceful shutdown of ``carpool serve`` (one worker): drain, then stop.

Contract: on the first SIGTERM the gateway turns unready (``Gateway.draining``: ``/readyz`` 503)
and keeps serving for ``shutdown.drain_s``, so that load balancers stop sending it requests (the
requests waiting in an embeddings batch are sent at once, whatever its delay, as on any stopping
signal: ``Gateway.begin_draining``, on the event loop, not in the signal's handler); then
uvicorn stops as it does on a signal: the listener closes, the requests in progress (a flight's
waiters, streams) get ``shutdown.grace_s`` to finish, those still running then are cut and told
so in their API's terms (``server.GatewayApp.serve``: a 503 with ``Retry-After``, or a stream's
error event and end; logged at INFO, not as a crash, and so is uvicorn's own line counting them,
its ERROR turned INFO: ``GraceCutAtInfo``), the lifespan closes the layers, the
process exits 0, whatever stopped it (SIGTERM, a second one, SIGINT). A second SIGTERM, or
SIGINT, skips what is left of the drain; a second signal once stopping (Ctrl-C twice) changes
nothing (said at INFO): never uvicorn's force quit, which a second SIGINT was, cutting the
requests at once, skipping the lifespan (the layers left open) and logging its cancel as an
ERROR traceback. A third stopping signal quits at once: the grace period ends then, the requests
still running cut as at its end (``_QUIT``), the calls left cancelled, and the lifespan closes
the layers as ever (exit 0). With Redis, a flight this instance leads still
finishes here within the grace period, its own clients gone or not: the lifespan's
``Gateway.aclose`` first lets the calls still running end until the grace period does
(``Gateway.stop_by``, set here as uvicorn's shutdown begins), then cancels those left, which the
other instances' followers take over at once (their leader left), and lets the cut requests'
cleanup run (an Idempotency-Key record given up) before it closes Redis and the upstream
clients (``Gateway.settle``). If the process is killed before, the followers take the call over
as after a crash. Each worker of ``--workers N`` runs uvicorn's own server, which sets no
``stop_by``: the HTTP protocol sets it as uvicorn stops the worker's connections
(``http_protocol``), else the lifespan's end does (``GatewayApp.grace_s``).

Once the socket is bound, ``listening`` is told the port it got (``--port 0``: the system's
choice), for ``carpool serve``'s "listening on" line.

SIGHUP is no stop: with one process there are no workers to restart (``--workers N`` is
uvicorn's supervisor, whose SIGHUP restarts them, on the config the run started with), and its
default action killed the process at once, the requests in progress cut, nothing logged. It is
logged as a WARNING saying so, and otherwise ignored: the gateway serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from .config import Config
from .signals import keeping_sigint_ignored

log = logging.getLogger("carpool.server")


class GraceCutAtInfo(logging.Filter):
    """uvicorn's "Cancel N running task(s), timeout graceful shutdown exceeded", an ERROR of
    ``uvicorn.error``, at INFO: the cut is the grace period the operator set doing its work,
    each request told so and logged (INFO), not a crash; an ERROR on every rollout that cut a
    long request paged someone for nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and "timeout graceful shutdown exceeded" in str(
            record.msg
        ):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def grace_cut_at_info() -> None:
    """``GraceCutAtInfo`` on uvicorn's logger, once (``carpool serve``'s server, or a worker's)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, GraceCutAtInfo) for f in logger.filters):
        logger.addFilter(GraceCutAtInfo())


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        gateway: Any,
        settings: Config,
        listening: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(config)
        grace_cut_at_info()
        self.gateway = gateway
        self.listening = listening  # told the port the socket got, once bound
        self.drain_s = settings.shutdown.drain_s
        self._drained_at: float | None = None
        self._signals = 0  # the stopping signals received (SIGTERM, SIGINT)
        self._quit = False  # a third one came: the grace period ends now

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.listening is not None:
            # (port 0: the one the system chose, which ``config.port`` does not say)
            self.listening(self.servers[0].sockets[0].getsockname()[1])

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's handles SIGINT and SIGTERM; SIGHUP is added beside them, and put back as
        # it was when they are (signals can only be handled on the main thread).
        # (SIGINT kept ignored where it was: a background job's, ``carpool.signals``.)
        with keeping_sigint_ignored(super().capture_signals()):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(signal.SIGHUP, self.handle_hangup)
            try:
                yield
            finally:
                signal.signal(signal.SIGHUP, previous)

    def handle_hangup(self, sig: int, frame: FrameType | None) -> None:
        log.warning(
            "SIGHUP ignored, serving on: one process has no workers to restart; run with "
            "--workers N for a SIGHUP that restarts them (on the config the run started with), "
            "or restart carpool serve to read its config again"
        )

    def _last_on_their_connections(self) -> None:
        """Each request in progress as the drain begins is its connection's last: its answer
        says ``Connection: close`` if it begins after this (uvicorn's and the held path's heads
        read ``keep_alive`` then), and the connection closes once it ends (a stream's too, its
        head gone before). A proxy keeping its connections then sends nothing more on one the
        drain's end would close under it; requests begun later are told by the protocol
        (``http_protocol._draining``)."""
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        self.gateway.draining = True  # (/readyz: 503 from now)
        # The rest of the drain's start (the batches sent) touches the event loop, which this
        # handler may have interrupted: on the loop, as soon as it can.
        with contextlib.suppress(RuntimeError):  # (no loop running yet: nothing batched)
            loop = asyncio.get_running_loop()
            loop.call_soon_threadsafe(self.gateway.begin_draining)
            loop.call_soon_threadsafe(self._last_on_their_connections)
        name = signal.Signals(sig).name
        if self._signals == 1 and sig == signal.SIGTERM and self.drain_s > 0:
            self._drained_at = time.monotonic() + self.drain_s
            log.info("SIGTERM: not ready, draining for %.1f s, then stopping", self.drain_s)
            return
        if self._signals >= 3:
            # Never uvicorn's force quit (a second SIGINT's): it skipped the lifespan, the
            # layers left open, and logged the lifespan's cancel as an ERROR traceback.
            if not self._quit:
                self._quit = True
                log.info("%s, a third signal: quitting now, the requests in progress cut", name)
            return
        if self.should_exit:
            log.info(
                "%s: already stopping, the requests in progress finishing within the grace "
                "period (%s s); one more signal quits at once, cutting them",
                name,
                self.config.timeout_graceful_shutdown,
            )
            return
        super().handle_exit(sig, frame)
        # Stopped on purpose, cleanly: exit 0 (uvicorn raises the signals it caught again once
        # stopped, so that the process ends as killed by them: 143, or 1 and "Aborted!").
        captured = getattr(self, "_captured_signals", None)
        if captured is not None:
            captured.clear()

    async def _wait_tasks_to_complete(self) -> None:
        # uvicorn's wait for the requests in progress, within the grace period; a third signal
        # ends it at once: the requests are cut as at the grace period's end (told so in their
        # API's terms, ``server.GatewayApp``), and uvicorn goes on to the lifespan's shutdown.
        waiting = asyncio.ensure_future(super()._wait_tasks_to_complete())
        try:
            while not self._quit and not waiting.done():
                await asyncio.wait(
                    {waiting}, timeout=0.1
                )  # (as uvicorn looks: a tenth of a second)
        finally:
            if not waiting.done():
                waiting.cancel()
        if waiting.done():
            waiting.result()
            return
        self.gateway.stop_by = time.monotonic()  # (the calls still running: cancelled at once)
        for task in self.server_state.tasks:
            task.cancel(msg=_QUIT)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The grace period ends then (uvicorn's: a tenth of a second, then ``grace_s``): the
        # lifespan's ``Gateway.aclose`` lets the calls still running end until then.
        grace = self.config.timeout_graceful_shutdown
        if grace is not None:
            self.gateway.stop_by = time.monotonic() + 0.1 + grace
        await super().shutdown(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self._drained_at is not None and time.monotonic() >= self._drained_at:
            self.should_exit = True
        return await super().on_tick(counter)


# The message of the cancel of a request still running when a third signal ends the grace period.
_QUIT = "Task cancelled, quitting at once (a third stopping signal)"
