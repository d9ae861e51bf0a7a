"""One upstream answer fanned out to every client of a flight, streaming or not.

Contract (CONTRACT.md "Streaming"):
- The leader's task ``publish``es SSE frames as they arrive, then ends the broadcast exactly once
  with ``finish(answer)`` or ``fail(error)``. Publishing never waits for any client, so a slow
  client never slows the others (or the upstream).
- ``follow`` yields every frame from the first one, so a client that joins late first receives
  every frame emitted so far, then the rest live; it returns when the broadcast has ended. The
  caller then reads ``error`` / ``answer`` to end its own stream.
- Frames are kept in one shared list, not copied per client: memory is one answer, not N.
- ``wait_started`` returns once there is a frame or an ending; ``wait_done`` once there is an
  ending. Both can be bounded by the caller with ``asyncio.timeout``.
- ``on_publish`` (optional, sync, must not raise) is called after each frame is published: the
  cross-instance leader (``redis/flights.py``) uses it to forward frames to Redis.
- ``remote`` is true when the frames and the ending were relayed from a call that another gateway
  instance made (this instance's clients of the flight are then all ``coalesced``); ``cached``
  when the answer came from another worker's exact cache (``carpool.peers``: they are ``hit``s).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from .answer import Answer
from .errors import CarpoolError


class Broadcast:
    __slots__ = (
        "frames",
        "usage_frame",
        "answer",
        "error",
        "remote",
        "cached",
        "on_publish",
        "_changed",
    )

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.usage_frame: int | None = None
        self.answer: Answer | None = None
        self.error: CarpoolError | None = None
        self.remote = False
        self.cached = False
        self.on_publish: Callable[[], None] | None = None
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.answer is not None or self.error is not None

    def publish(self, frame: bytes, usage_only: bool = False) -> None:
        if usage_only:
            self.usage_frame = len(self.frames)
        self.frames.append(frame)
        self._wake()
        if self.on_publish is not None:
            self.on_publish()

    def finish(self, answer: Answer) -> None:
        if not self.done:
            self.answer = answer
            self._wake()

    def fail(self, error: CarpoolError) -> None:
        if not self.done:
            self.error = error
            self._wake()

    def _wake(self) -> None:
        # One event per change: every waiter wakes once, then waits on the next one.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_started(self) -> None:
        while not self.frames and not self.done:
            await self._changed.wait()

    async def wait_done(self) -> None:
        while not self.done:
            await self._changed.wait()

    async def follow(self, include_usage: bool) -> AsyncIterator[bytes]:
        """Every frame so far, then the rest live, until the broadcast ends."""
        sent = 0
        while True:
            frames = self.frames
            while sent < len(frames):
                if include_usage or sent != self.usage_frame:
                    yield frames[sent]
                sent += 1
            if self.done:
                return
            await self._changed.wait()
