"""A client's side of a request to the gateway, whichever transport carries it: its body read
within limits, and its leaving watched while its request waits.

Contract:
- ``read_body(receive, headers, limit, deadlines)``: the whole body of an ASGI request (None: the
  client left first), within ``limit`` bytes (``BodyTooLarge``, before reading past a declared
  ``content-length`` over it) and ``deadlines.timeout`` seconds (``BodyTimeout``).
- ``read_upload(...)``: a pass-through body, under the same two limits: whole (bytes) when it
  ends within ``STREAMED_FROM`` bytes; else an ``Upload``, the rest of it read as the upstream
  call sends it (never held whole in memory: a file's upload of hundreds of MiB held twice its
  size). Its limits hold as it is read: past ``limit`` bytes, ``BodyTooLarge``; the time its
  client takes to send it (the waits for its next piece: not the upstream's taking it) at most
  ``deadlines.timeout`` seconds in all, ``BodyTimeout``; raised into whoever reads it, which
  gives up the call. Its end (or failure) is told (``ended``, ``done``: from then on the
  client's connection may be watched for its leaving); a client that leaves mid-body is told
  (``left``) and the read fails (``ClientLeft``).
- ``Deadlines``: one timer for every body being read, rather than one per request.
- ``ClientWatch``: cancels a request's task if its client leaves while it waits or streams
  (``start``), never after its reply is complete (``stop``); ``left`` is told when the client
  goes. While it is kept (``keep``: a retry with its Idempotency-Key waits on its record), a
  client leaving does not cancel it: it goes on, its reply written to no one, and is cancelled
  once the last keeper lets go, if it is still running. It also holds where the reply stands for whoever sends it: ``headed`` once its status
  and headers are sent, ``finished`` once its end is on its way. ``ReceiveWatch`` learns it from ASGI's ``receive`` (a watcher task, made only when the
  request waits); the HTTP protocol tells its own (``http_protocol.py``) from the connection.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from .errors import BodyTimeout, BodyTooLarge

__all__ = ["ClientWatch", "Deadlines", "ReceiveWatch", "Upload", "read_body", "read_upload"]

# A pass-through body is read whole up to this many bytes (what nearly every call's is: a
# batch, a moderation); past it, the rest goes to the upstream as it comes (``read_upload``).
STREAMED_FROM = 1024 * 1024


class ClientWatch:
    """Cancels the request's task if its client leaves while the request waits or streams
    (``start``), not after its reply is complete (``stop``). ``left`` is told when the client
    goes away: here by the HTTP protocol, which sees its connection end (``http_protocol.py``);
    for the ASGI path, by a watcher task (``ReceiveWatch``).

    Made in the request's task (the one to cancel), not in the first task that waits: the items
    of a list input wait in tasks of their own, and every one of them must be cancelled.
    """

    __slots__ = ("task", "started", "gone", "finished", "client_left", "headed", "kept")

    def __init__(self) -> None:
        self.task: asyncio.Task[Any] | None = asyncio.current_task()
        self.started = self.gone = self.finished = self.client_left = False
        # The reply's status and headers are sent (set by whoever sends them): a request cut
        # now can only end what was begun (``server.GatewayApp.serve``).
        self.headed = False
        self.kept = 0  # keepers not yet let go (``keep``)

    def start(self) -> None:
        self.started = True
        if self.gone:
            self._cancel()

    def stop(self) -> None:
        self.finished = True

    def left(self) -> None:
        self.gone = True
        if self.started:
            self._cancel()

    def keep(self) -> Callable[[], None]:
        """Keeps the request going should its client leave, until the function returned (to call
        once) lets go: a retry with the request's Idempotency-Key waits on its record
        (``idempotency.once``), and the record's run is that retry's answer too. Cancelled, the
        run was made again for the retry: two generations for one key, the first thrown away.
        Let go by its last keeper, a request whose client left meanwhile is cancelled then."""
        self.kept += 1
        held = True

        def let_go() -> None:
            nonlocal held
            if held:
                held = False
                self.kept -= 1
                if not self.kept and self.gone and self.started:
                    self._cancel()

        return let_go

    def _cancel(self) -> None:
        if self.kept:  # (once let go: ``keep``)
            return
        if not self.finished and not self.client_left and self.task is not None:
            self.client_left = True
            self.task.cancel()


class ReceiveWatch(ClientWatch):
    """The ASGI path's watch: a watcher task, made only when the request has to wait or stream
    (an immediate answer never creates it), reads ``receive`` until ``http.disconnect``."""

    __slots__ = ("receive", "watcher")

    def __init__(self, receive: Any) -> None:
        super().__init__()
        self.receive = receive
        self.watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.watcher is None and not self.finished:
            self.watcher = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        self.finished = True
        if self.watcher is not None:
            self.watcher.cancel()
            # Not kept: its cancellation's traceback holds this watch (the frames' ``self``),
            # a cycle only the garbage collector would free, every request that waited.
            self.watcher = None

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.went()
                return

    def went(self) -> None:
        """The client is gone (its disconnect read here, or by an ``Upload``): the request's
        task cancelled, whether the watch was started or not."""
        self.gone = self.started = True
        self._cancel()


async def read_body(
    receive: Any, headers: Mapping[str, str], limit: int, deadlines: Deadlines
) -> bytes | None:
    """The whole body (None: the client left), within ``limit`` bytes (``BodyTooLarge``) and
    ``deadlines.timeout`` seconds from now (``BodyTimeout``)."""
    read = await _read(receive, headers, limit, deadlines, math.inf)
    assert not isinstance(read, list)  # (no bound but the limit: it ended, or the client left)
    return read


async def read_upload(
    receive: Any,
    headers: Mapping[str, str],
    limit: int,
    deadlines: Deadlines,
    ended: Callable[[], None],
    left: Callable[[], None],
) -> bytes | Upload | None:
    """A pass-through body (None: the client left first): whole when it ends within
    ``STREAMED_FROM`` bytes, else an ``Upload`` of what was read and the rest to come (see the
    module doc); ``ended`` and ``left`` are the ``Upload``'s."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    read = await _read(receive, headers, limit, deadlines, STREAMED_FROM)
    if not isinstance(read, list):
        return read
    left_s = deadlines.timeout - (loop.time() - began)
    size = sum(map(len, read))
    return Upload(receive, read, size, limit, deadlines.timeout, left_s, ended, left)


async def _read(
    receive: Any, headers: Mapping[str, str], limit: int, deadlines: Deadlines, most: float
) -> bytes | list[bytes] | None:
    """The body, whole (bytes), or its pieces read once ``most`` bytes came before its end (a
    list), or None (the client left), under ``read_body``'s two limits."""
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    task = deadlines.enter()
    try:
        while size < most:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)
        return parts
    except asyncio.CancelledError:
        if not deadlines.expired(task) or task.cancelling() > 1:
            raise  # not (only) ours: a shutdown, say
        task.uncancel()  # we did it: the deadline passed
        raise BodyTimeout(deadlines.timeout) from None
    finally:
        deadlines.leave(task)


class ClientLeft(Exception):
    """The client left before its body's end (``Upload``): the call it was for is given up."""


class Upload:
    """The rest of a pass-through body, read as it is iterated, once (``read_upload``): what was
    read already first, then each piece as it comes. ``done`` is set once it ends or fails."""

    __slots__ = (
        "receive",
        "read",
        "size",
        "limit",
        "timeout",
        "left_s",
        "ended",
        "left",
        "done",
        "begun",
    )

    def __init__(
        self,
        receive: Any,
        read: list[bytes],
        size: int,
        limit: int,
        timeout: float,
        left_s: float,
        ended: Callable[[], None],
        left: Callable[[], None],
    ) -> None:
        self.receive = receive
        self.read = read
        self.size = size
        self.limit = limit
        self.timeout = timeout  # (``limits.body_read_timeout``, for its error)
        self.left_s = left_s  # what is left of it for the client to send the rest in
        self.ended = ended
        self.left = left
        self.done = asyncio.Event()
        self.begun = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[bytes]:
        if self.begun:
            raise RuntimeError("an upload is read once")
        self.begun = True
        try:
            read, self.read = self.read, []
            for piece in read:
                if piece:
                    yield piece
            del read
            loop = asyncio.get_running_loop()
            while True:
                # (Only the client's time counts: not the upstream's taking the pieces.)
                asked = loop.time()
                try:
                    async with asyncio.timeout(max(self.left_s, 0)):
                        message = await self.receive()
                except TimeoutError:
                    raise BodyTimeout(self.timeout) from None
                self.left_s -= loop.time() - asked
                if message["type"] == "http.disconnect":
                    self.left()
                    raise ClientLeft()
                chunk = message.get("body", b"")
                self.size += len(chunk)
                if self.size > self.limit:
                    raise BodyTooLarge(self.limit)
                more = message.get("more_body", False)
                if not more:
                    self.done.set()
                    self.ended()
                if chunk:
                    yield chunk
                if not more:
                    return
        finally:
            self.done.set()


class Deadlines:
    """Cuts body reads that last longer than ``timeout`` seconds (``limits.body_read_timeout``).

    One timer for every read in progress, ticking only while there are some, rather than one
    per request: ``asyncio.timeout`` costs about 5 µs a request, this a dict entry. A read is cut
    (its task cancelled, which ``read_body`` turns into ``BodyTimeout``) at the first tick after
    its deadline: between ``timeout`` and ``1.25 x timeout`` seconds after it started.
    """

    __slots__ = ("timeout", "reading", "cut", "timer")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.reading: dict[asyncio.Task[Any], float] = {}
        self.cut: set[asyncio.Task[Any]] = set()
        self.timer: asyncio.TimerHandle | None = None

    def enter(self) -> asyncio.Task[Any]:
        task = asyncio.current_task()
        assert task is not None
        loop = task.get_loop()
        self.reading[task] = loop.time() + self.timeout
        if self.timer is None:
            self.timer = loop.call_later(self.timeout / 4, self._tick, loop)
        return task

    def leave(self, task: asyncio.Task[Any]) -> None:
        self.reading.pop(task, None)
        self.cut.discard(task)

    def expired(self, task: asyncio.Task[Any]) -> bool:
        return task in self.cut

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for task in [t for t, deadline in self.reading.items() if deadline <= now]:
            del self.reading[task]
            self.cut.add(task)
            task.cancel()
        self.timer = loop.call_later(self.timeout / 4, self._tick, loop) if self.reading else None
