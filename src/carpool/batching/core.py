"""The generic batch scheduler: concurrent single-item submits coalesced into ``compute`` calls.

Contract
--------
:class:`KeyedBatcher` is the generic scheduler (it does not know about HTTP or embeddings):

- ``await submit(group, key, item, cost=1) -> result``. Items of the same ``group`` (any hashable:
  everything that must be equal for two items to share a call) that arrive within
  ``max_batch_delay_s`` of the first one waiting are passed together to
  ``compute(group, items) -> results`` (one result per item, same order). ``key`` identifies the
  item: submits with an equal ``key`` in the same group take *one* slot and share its result, and
  so does a submit whose item is already in a batch that was sent and is not finished yet
  (``join_running``, the default; without it such a submit starts the next batch, for a
  caller that must not share a call already under way). Every caller gets the result of its
  own item.
- A batch is closed and sent when it holds ``max_batch_size`` distinct items, when adding an item
  would take its ``cost`` over ``max_batch_cost`` (the waiting batch leaves and the item starts
  the next; an item dearer than the budget goes alone), when its cost reaches the budget, or
  ``max_batch_delay_s`` after its first item arrived (0: on the next turn of the event loop).
  With ``max_in_flight`` set, at most that many batches run at once; closed batches queue (FIFO)
  and leave as running ones finish. With ``grow_while_busy`` too, a batch whose delay is over
  while no slot is free is not closed: it stays open, still taking items (up to
  ``max_batch_size`` / ``max_batch_cost``), and leaves as soon as a slot frees (after the
  queued ones), so that under load the batches grow by themselves.
- ``flush()`` (the process is stopping: a wait for more items could outlast it) closes every
  batch still filling at once (sent, or queued behind ``max_in_flight``), and from then on no
  batch waits for more than the next turn of the event loop (``max_batch_delay_s`` 0).
- If ``compute`` raises (or returns the wrong number of results), every caller of that batch gets
  the exception. A cancelled caller never cancels the batch for the others; an item whose every
  caller left before its batch was sent is dropped from it, and a sent batch whose every caller
  (of every item) has left is cancelled.
- ``compute`` may give an item's result as an ``asyncio.Future`` (a task of its own, already
  running: the item's own call) instead: that item's callers get what it gives (its exception,
  if it raises), and it is cancelled once every caller of that item has left, while the others'
  go on. The batch runs (``max_in_flight``, ``wait_idle``) until every such task is done.
- ``observe_wait(seconds)`` (optional) is called exactly once per ``submit``: the time it waited in
  the buffer before its batch was sent (0 when it joined a running batch; up to its cancellation
  for a caller that left before).
- Counters: ``batches`` (calls to ``compute``), ``items_sent`` (distinct items in them),
  ``requests`` (``submit`` calls), ``max_items_seen`` (largest batch).
- One batcher serves one event loop.

``semantic.embed``'s embedders use this scheduler with a single group, ``key = item = text``,
``cost = 1``, ``max_in_flight`` and ``grow_while_busy`` set (and ``join_running``: a text's
vector does not change); :mod:`carpool.batching.embeddings` uses it for the gateway's
``/embeddings``, without ``join_running``.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from functools import partial
from typing import Any, Generic, TypeVar

__all__ = ["KeyedBatcher"]

I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")  # a result


class _Entry:
    """One distinct item of a batch and the callers waiting for it."""

    __slots__ = ("item", "cost", "future", "arrivals", "sent", "waiting", "batch", "task")

    def __init__(self, item: Any, cost: float, future: asyncio.Future[Any]) -> None:
        self.item = item
        self.cost = cost
        self.future = future
        self.arrivals: list[float] = []  # loop time each still-buffered caller arrived
        self.sent = False
        self.waiting = 0  # callers awaiting the result now
        self.batch: _Batch | None = None  # once sent: the batch it went in
        # once computed as a task of its own (``compute`` gave a future): that task
        self.task: asyncio.Future[Any] | None = None


class _Batch:
    __slots__ = ("group", "entries", "cost", "timer", "due", "task")

    def __init__(self, group: Hashable) -> None:
        self.group = group
        self.entries: dict[Hashable, _Entry] = {}
        self.cost = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.due = False  # delay over, kept open while no slot is free
        self.task: asyncio.Task[None] | None = None  # once sent: the task computing it


class KeyedBatcher(Generic[I, R]):
    """Coalesces concurrent ``submit`` calls into ``compute(group, items)`` calls; see the module
    docstring."""

    def __init__(
        self,
        compute: Callable[[Any, list[I]], Awaitable[Sequence[R | asyncio.Future[R]]]],
        *,
        max_batch_size: int,
        max_batch_delay_s: float,
        max_batch_cost: float = math.inf,
        max_in_flight: int | None = None,
        join_running: bool = True,
        grow_while_busy: bool = False,
        observe_wait: Callable[[float], None] | None = None,
    ) -> None:
        if (
            max_batch_size < 1
            or max_batch_delay_s < 0
            or max_batch_cost <= 0
            or (max_in_flight is not None and max_in_flight < 1)
        ):
            raise ValueError(
                "max_batch_size and max_in_flight must be >= 1, "
                "max_batch_delay_s >= 0 and max_batch_cost > 0"
            )
        self._compute = compute
        self.max_batch_size = max_batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self.max_batch_cost = max_batch_cost
        self.max_in_flight = max_in_flight
        self.join_running = join_running
        self.grow_while_busy = grow_while_busy
        self.observe_wait = observe_wait
        self._open: dict[Hashable, _Batch] = {}  # group -> batch still filling
        self._queued: deque[_Batch] = deque()  # closed, waiting for a slot
        self._sent: dict[tuple[Hashable, Hashable], _Entry] = {}  # closed, not finished
        self._in_flight = 0
        self._tasks: set[asyncio.Future[Any]] = set()  # batches', items' own (``_own``)
        self.batches = 0
        self.items_sent = 0
        self.requests = 0
        self.max_items_seen = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def idle(self) -> bool:
        """Nothing buffered, queued or running."""
        return not (self._open or self._queued or self._tasks)

    async def submit(self, group: Hashable, key: Hashable, item: I, cost: float = 1.0) -> R:
        loop = asyncio.get_running_loop()
        self.requests += 1
        now = loop.time()
        if self.join_running:
            entry = self._sent.get((group, key))
            if entry is not None:
                if entry.sent:
                    self._observe(0.0)
                    return await self._wait(entry, None, now)
                entry.arrivals.append(now)  # closed but queued: still in the buffer
                return await self._wait(entry, None, now)
        batch = self._open.get(group)
        entry = batch.entries.get(key) if batch is not None else None
        if entry is None:
            if batch is not None and batch.entries and batch.cost + cost > self.max_batch_cost:
                self._close(batch)
                batch = None
            if batch is None:
                batch = self._open[group] = _Batch(group)
            future: asyncio.Future[R] = loop.create_future()
            future.add_done_callback(_consume)
            entry = batch.entries[key] = _Entry(item, cost, future)
            batch.cost += cost
        entry.arrivals.append(now)
        assert batch is not None  # (a new entry was put in one just above)
        if len(batch.entries) >= self.max_batch_size or batch.cost >= self.max_batch_cost:
            self._close(batch)
        elif batch.timer is None and not batch.due:
            batch.timer = loop.call_later(self.max_batch_delay_s, self._timeout, batch)
        return await self._wait(entry, batch, now)

    async def _wait(self, entry: _Entry, batch: _Batch | None, arrived: float) -> R:
        entry.waiting += 1
        try:
            # shield: a caller that is cancelled must not cancel the batch its item is in.
            return await asyncio.shield(entry.future)
        except asyncio.CancelledError:
            if not entry.sent and arrived in entry.arrivals:
                entry.arrivals.remove(arrived)
                self._observe(asyncio.get_running_loop().time() - arrived)
                if (
                    not entry.arrivals
                    and batch is not None
                    and self._open.get(batch.group) is batch
                ):
                    self._drop(batch, entry)
            raise
        finally:
            entry.waiting -= 1
            sent = entry.batch
            if sent is not None and sent.task is not None and not entry.future.done():
                if not any(e.waiting for e in sent.entries.values()):
                    # Every caller of the batch has left: cancel it, and let no new caller
                    # join it.
                    for key, candidate in sent.entries.items():
                        if self._sent.get((sent.group, key)) is candidate:
                            del self._sent[(sent.group, key)]
                    sent.task.cancel()
                elif not entry.waiting and entry.task is not None:
                    # Every caller of this item has left, not the others: its own call goes.
                    self._abandon(sent, entry)

    def _abandon(self, batch: _Batch, entry: _Entry) -> None:
        """Cancel an item's own task (no new caller joins it), its batch going on."""
        for key, candidate in batch.entries.items():
            if candidate is entry and self._sent.get((batch.group, key)) is entry:
                del self._sent[(batch.group, key)]
        assert entry.task is not None
        entry.task.cancel()

    def _drop(self, batch: _Batch, entry: _Entry) -> None:
        """Every caller of an item still in an open batch left: take it out."""
        for key, candidate in batch.entries.items():
            if candidate is entry:
                del batch.entries[key]
                batch.cost -= entry.cost
                entry.future.cancel()
                break
        if not batch.entries:
            if batch.timer is not None:
                batch.timer.cancel()
            del self._open[batch.group]

    def flush(self) -> None:
        """Send every batch still filling now, and let none wait from now on (see the module
        docstring)."""
        self.max_batch_delay_s = 0.0
        for batch in list(self._open.values()):
            self._close(batch)

    def _timeout(self, batch: _Batch) -> None:
        batch.timer = None
        if (
            self.grow_while_busy
            and self.max_in_flight is not None
            and self._in_flight >= self.max_in_flight
        ):
            batch.due = True  # grows until a slot frees
            return
        self._close(batch)

    def _close(self, batch: _Batch) -> None:
        """The batch takes no more items: send it, or queue it while ``max_in_flight`` run."""
        if batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        if self._open.get(batch.group) is not batch:
            return  # already closed (a late timer)
        del self._open[batch.group]
        for key, entry in batch.entries.items():
            self._sent[(batch.group, key)] = entry
        self._queued.append(batch)
        self._dispatch()

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queued and (self.max_in_flight is None or self._in_flight < self.max_in_flight):
            batch = self._queued.popleft()
            live = {
                k: e
                for k, e in batch.entries.items()
                if (e.arrivals or e.waiting) and not e.future.done()
            }
            for key, entry in batch.entries.items():
                if key not in live:  # every caller left while it was queued
                    if self._sent.get((batch.group, key)) is entry:
                        del self._sent[(batch.group, key)]
                    entry.future.cancel()
            now = loop.time()
            for entry in live.values():
                entry.sent = True
                for arrived in entry.arrivals:
                    self._observe(now - arrived)
                entry.arrivals.clear()
            if not live:
                continue
            batch.entries = live
            for entry in live.values():
                entry.batch = batch
            self._in_flight += 1
            task = batch.task = loop.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(partial(self._ran, batch))

    async def _run(self, batch: _Batch) -> None:
        entries = list(batch.entries.values())
        self.batches += 1
        self.items_sent += len(entries)
        self.max_items_seen = max(self.max_items_seen, len(entries))
        own: list[asyncio.Future[Any]] = []  # the items' own tasks
        try:
            results = await self._compute(batch.group, [entry.item for entry in entries])
            if len(results) != len(entries):
                for result in results:
                    if isinstance(result, asyncio.Future):
                        result.cancel()
                raise ValueError(
                    f"compute returned {len(results)} results for {len(entries)} items"
                )
            for entry, result in zip(entries, results, strict=True):
                if isinstance(result, asyncio.Future):
                    own.append(result)
                    self._own(batch, entry, result)
                elif not entry.future.done():
                    entry.future.set_result(result)
            if own:
                await asyncio.wait(own)
        except asyncio.CancelledError:
            for task in own:
                task.cancel()
            for entry in entries:
                entry.future.cancel()
            raise
        except Exception as exc:
            for entry in entries:
                if not entry.future.done():
                    entry.future.set_exception(exc)

    def _ran(self, batch: _Batch, task: asyncio.Task[None]) -> None:
        """The end of ``batch``'s task, however it ended: its items joinable no more, its slot
        given back, the next batches sent. A callback of the task rather than ``_run``'s
        ``finally``: a task cancelled before its first step (every caller gone in the turn it
        was sent) runs none of ``_run``, and its slot was never given back: the semantic
        embedder, one slot for the local model, then queued every later embedding for good."""
        self._tasks.discard(task)
        for key, entry in batch.entries.items():
            if not entry.future.done():
                entry.future.cancel()  # (not run: its callers all left)
            if self._sent.get((batch.group, key)) is entry:
                del self._sent[(batch.group, key)]
        self._in_flight -= 1
        if self._queued:
            self._dispatch()
        for due in [b for b in self._open.values() if b.due]:
            if self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
                break
            self._close(due)

    def _own(self, batch: _Batch, entry: _Entry, task: asyncio.Future[Any]) -> None:
        """An item computed by a task of its own: its callers get what the task gives."""
        entry.task = task
        self._tasks.add(task)  # (``wait_idle`` and ``idle`` see it, cancelled ones included)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda done: _settle(entry.future, done))
        if not entry.waiting:  # every caller of this item left while ``compute`` ran
            self._abandon(batch, entry)

    def _observe(self, seconds: float) -> None:
        if self.observe_wait is not None:
            self.observe_wait(max(0.0, seconds))

    async def wait_idle(self) -> None:
        """Wait until every batch started so far has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _settle(future: asyncio.Future[Any], task: asyncio.Future[Any]) -> None:
    """Give ``future`` what ``task`` (done) gave."""
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif (exc := task.exception()) is not None:
        future.set_exception(exc)
    else:
        future.set_result(task.result())


def _consume(future: asyncio.Future[Any]) -> None:
    """Mark a batch future's exception as retrieved, even if every caller was cancelled."""
    if not future.cancelled():
        future.exception()
