"""Work a layer runs off its callers' path, and how it is stopped.

Contract:
- ``Background(what, log)`` holds a layer's tasks (a Redis claim taken back, a flight's end
  or a finish tried again, an entry published): ``spawn(work)`` starts ``work`` and keeps its
  task referenced until it ends (the loop holds tasks weakly: one nobody referenced could be
  collected mid-flight); a task that failed is logged on ``log`` ("``what`` failed", with its
  traceback), never left for asyncio's "exception was never retrieved"; a cancelled one is
  not. ``drain(grace)``, in the layer's ``aclose``, lets the tasks still running end for
  ``grace`` seconds (None: as long as they take), then stops each with ``stop_reader``.
  Iterating, ``len`` and truth read the tasks still running.
- ``stop_reader(task)`` ends a background task (one that loops on Redis commands: a
  subscriber, a stream reader): it cancels it and, while the task runs on, cancels it again
  every ``RECANCEL_S``, until it is done; whatever it ended with is dropped (it was being
  stopped). redis-py's cluster client can swallow a cancellation: the command then returns as
  if none had come (seen: about 1 in 60 tasks cancelled in an ``XREAD`` read again; an
  instance's shutdown then waited on it). Such loops also stop by themselves once their layer
  is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

RECANCEL_S = 0.25  # s between the cancellations of a reader that runs on (stop_reader): long
# enough for its own clean-up (a pub/sub connection closed) not to be cut by the next one


async def stop_reader(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` until it is done (the module's contract)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled():
        task.exception()  # (retrieved: asyncio logs none at exit)


class Background:
    """A layer's work off its callers' path (the module's contract)."""

    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what  # (named in the log line of a task that failed)
        self.log = log  # (the layer's own)
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("%s failed", self.what, exc_info=task.exception())

    async def drain(self, grace: float | None) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        for task in list(self._tasks):
            await stop_reader(task)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)
