"""Dynamic batching with dedup: many concurrent single-item requests become one upstream call.

Contract
--------
:class:`KeyedBatcher` is the generic scheduler (it does not know about HTTP or embeddings):

- ``await submit(group, key, item, cost=1) -> result``. Items of the same ``group`` (any hashable:
  everything that must be equal for two items to share a call) that arrive within
  ``max_batch_delay_s`` of the first one waiting are passed together to
  ``compute(group, items) -> results`` (one result per item, same order). ``key`` identifies the
  item: submits with an equal ``key`` in the same group take *one* slot and share its result, and
  so does a submit whose item is already in a batch that was sent and is not finished yet
  (``join_running``). Every caller gets the result of its own item.
- A batch is closed and sent when it holds ``max_batch_size`` distinct items, when adding an item
  would take its ``cost`` over ``max_batch_cost`` (the waiting batch leaves and the item starts
  the next; an item dearer than the budget goes alone), when its cost reaches the budget, or
  ``max_batch_delay_s`` after its first item arrived (0: on the next turn of the event loop).
  With ``max_in_flight`` set, at most that many batches run at once; closed batches queue (FIFO)
  and leave as running ones finish. With ``grow_while_busy`` too, a batch whose delay is over
  while no slot is free is not closed: it stays open, still taking items (up to
  ``max_batch_size`` / ``max_batch_cost``), and leaves as soon as a slot frees (after the
  queued ones), so that under load the batches grow by themselves.
- If ``compute`` raises (or returns the wrong number of results), every caller of that batch gets
  the exception. A cancelled caller never cancels the batch for the others; an item whose every
  caller left before its batch was sent is dropped from it, and a sent batch whose every caller
  (of every item) has left is cancelled.
- ``observe_wait(seconds)`` (optional) is called exactly once per ``submit``: the time it waited in
  the buffer before its batch was sent (0 when it joined a running batch; up to its cancellation
  for a caller that left before).
- ``observe_size(items)`` (optional) is called once per ``compute`` call with its item count.
- Counters: ``batches`` (calls to ``compute``), ``items_sent`` (distinct items in them),
  ``requests`` (``submit`` calls), ``max_items_seen`` (largest batch).
- One batcher serves one event loop.

``semantic.embed``'s embedders use this scheduler with a single group, ``key = item = text``,
``cost = 1``, ``max_in_flight`` and ``grow_while_busy`` set.

:class:`EmbeddingBatcher` uses it for the gateway's ``/embeddings``:

- ``await embed(request) -> UpstreamResponse``. A request is *batchable* when it is a non-stream
  POST to ``/embeddings`` whose JSON body has a ``model`` string and an ``input`` that is a single
  non-empty string or a single non-empty list of token ids. Anything else (a list of inputs, a
  stream, an unknown shape) goes straight to ``send`` unchanged and is counted in ``bypassed``.
- Batch-compatible means: same path, same body apart from ``input`` and ``user`` (so the same
  ``model``, ``dimensions``, ``encoding_format``...), the same query string, and the same values
  of the identity headers (``key_headers``: the gateway passes the tenant's credential headers,
  ``identity.py``) and of every other forwarded header that might change the answer
  (``fingerprint.varying_headers``), so tenants' credentials and callers' options are never
  mixed. The merged call carries that body with a list ``input`` (its ``user`` dropped, as
  callers may differ), that query string and only those headers. The token budget (``max_batch_tokens``) counts approximate tokens: a string's
  characters / 4 (rounded up, at least 1), a token list's length.
- Each caller receives a complete OpenAI embeddings response for its own item, bytes ready to
  send: ``{"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": ...}],
  "model": ..., "usage": {"prompt_tokens", "total_tokens"}}``, the upstream's usage apportioned
  to the distinct items in proportion to their approximate tokens (integer shares by largest
  remainder, summing to the upstream's figures; a duplicate caller is charged its item's share).
  Response headers are the upstream's, less framing ones (``content-length``...), with
  ``content-type: application/json``.
- A non-2xx upstream answer reaches every caller of the batch as the same status, headers and
  body; an exception from ``send`` is raised to every caller; a 2xx answer that does not hold one
  embedding per input is an ``UpstreamError`` (502) for all of them.
- Usage: only what the upstream reported is apportioned (``prompt_tokens`` and
  ``total_tokens``, each when it is there); an upstream that reported none gives answers
  without ``usage``: nothing is invented.

Merging must not change an answer (issue 15): some engines answer a list of inputs wrongly
(llama-cpp-python's server: every item but the first gets a wrong vector), though they answer
each input alone right. So merging is asked of a :class:`ListCheck` (``lists``; None: always
merge, for an upstream known to be right):

- ``ListCheck.verdict(group)`` is True when merging the group's items is known safe on every
  replica, False when it is known unsafe on one (or ``mode`` is ``off``), None while unknown.
  ``mode`` ``on`` is always True. With ``auto``, a replica is known safe for a group's path,
  model, parameters and query string once a *probe* has sent it a 2-item list of two fixed
  sentences and each of them alone (with the group's credentials) and the list's vectors
  matched the single ones (cosine >= ``SAME_VECTOR``, same length). A list answered wrongly,
  malformed, or refused with a 4xx other than 408/409/429 makes it unsafe for good; a probe
  that cannot decide (a single answered non-2xx, a transport failure, a 5xx) is tried again
  after ``retry_s``. Verdicts are kept per replica for the process's life. Probes run in the
  background (``probe(group)``, at most one per replica and group at a time), started by the
  first batch of two or more items that could not be merged; their answers never reach a
  client. ``aclose()`` cancels those still running; ``wait_idle()`` waits for them.
- ``embed``: a group whose verdict is False is not buffered at all: the request goes to
  ``send`` as it came (counted in ``alone``). A batch closed while its verdict is not True is
  sent item by item, each item's body with its own single ``input``, concurrently, and each
  caller gets the upstream's own answer to its item, status included (an exception from
  ``send`` reaches the callers of that item only). A batch of one item is a list of one
  when merging is safe, the item alone otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import struct
import time
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, Generic, TypeVar, cast

import orjson

from carpool.errors import UpstreamError
from carpool.fingerprint import varying_headers
from carpool.identity import DEFAULT_CREDENTIAL_HEADERS
from carpool.upstream.base import Upstream, UpstreamRequest, UpstreamResponse

__all__ = ["DEFAULT_KEY_HEADERS", "EmbeddingBatcher", "KeyedBatcher", "ListCheck", "approx_tokens"]

I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")  # a result

DEFAULT_KEY_HEADERS = DEFAULT_CREDENTIAL_HEADERS
_DROPPED_RESPONSE_HEADERS = frozenset(
    {
        "content-length",
        "content-type",
        "transfer-encoding",
        "content-encoding",
        "connection",
        "keep-alive",
    }
)


# ------------------------------------------------------------------------------------------------
# The generic scheduler


class _Entry:
    """One distinct item of a batch and the callers waiting for it."""

    __slots__ = ("item", "cost", "future", "arrivals", "sent", "waiting", "batch")

    def __init__(self, item: Any, cost: float, future: asyncio.Future[Any]) -> None:
        self.item = item
        self.cost = cost
        self.future = future
        self.arrivals: list[float] = []  # loop time each still-buffered caller arrived
        self.sent = False
        self.waiting = 0  # callers awaiting the result now
        self.batch: _Batch | None = None  # once sent: the batch it went in


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
        compute: Callable[[Any, list[I]], Awaitable[Sequence[R]]],
        *,
        max_batch_size: int,
        max_batch_delay_s: float,
        max_batch_cost: float = math.inf,
        max_in_flight: int | None = None,
        join_running: bool = True,
        grow_while_busy: bool = False,
        observe_wait: Callable[[float], None] | None = None,
        observe_size: Callable[[int], None] | None = None,
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
        self.observe_size = observe_size
        self._open: dict[Hashable, _Batch] = {}  # group -> batch still filling
        self._queued: deque[_Batch] = deque()  # closed, waiting for a slot
        self._sent: dict[tuple[Hashable, Hashable], _Entry] = {}  # closed, not finished
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
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
            if (
                sent is not None
                and sent.task is not None
                and not entry.future.done()
                and not any(e.waiting for e in sent.entries.values())
            ):
                # Every caller of the batch has left: cancel it, and let no new caller join it.
                for key, candidate in sent.entries.items():
                    if self._sent.get((sent.group, key)) is candidate:
                        del self._sent[(sent.group, key)]
                sent.task.cancel()

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
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: _Batch) -> None:
        entries = list(batch.entries.values())
        self.batches += 1
        self.items_sent += len(entries)
        self.max_items_seen = max(self.max_items_seen, len(entries))
        if self.observe_size is not None:
            self.observe_size(len(entries))
        try:
            results = await self._compute(batch.group, [entry.item for entry in entries])
            if len(results) != len(entries):
                raise ValueError(
                    f"compute returned {len(results)} results for {len(entries)} items"
                )
        except asyncio.CancelledError:
            for entry in entries:
                entry.future.cancel()
            raise
        except Exception as exc:
            for entry in entries:
                if not entry.future.done():
                    entry.future.set_exception(exc)
        else:
            for entry, result in zip(entries, results, strict=True):
                if not entry.future.done():
                    entry.future.set_result(result)
        finally:
            for key, entry in batch.entries.items():
                if self._sent.get((batch.group, key)) is entry:
                    del self._sent[(batch.group, key)]
            self._in_flight -= 1
            if self._queued:
                self._dispatch()
            for due in [b for b in self._open.values() if b.due]:
                if self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
                    break
                self._close(due)

    def _observe(self, seconds: float) -> None:
        if self.observe_wait is not None:
            self.observe_wait(max(0.0, seconds))

    async def wait_idle(self) -> None:
        """Wait until every batch started so far has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _consume(future: asyncio.Future[Any]) -> None:
    """Mark a batch future's exception as retrieved, even if every caller was cancelled."""
    if not future.cancelled():
        future.exception()


# ------------------------------------------------------------------------------------------------
# /embeddings


class _BatchFailed(Exception):
    """The upstream answered the merged call with a non-2xx status: every caller gets it."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.headers = dict(headers)
        self.body = body


def approx_tokens(item: str | Sequence[int]) -> int:
    """Approximate tokens of one input: characters / 4 (at least 1) or a token list's length."""
    if isinstance(item, str):
        return max(1, math.ceil(len(item) / 4))
    return max(1, len(item))


def _single_item(value: Any) -> str | tuple[int, ...] | None:
    if isinstance(value, str):
        return value if value else None
    if isinstance(value, list) and value and all(type(token) is int for token in value):
        return tuple(value)
    return None


def _apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Integer shares of ``total`` in proportion to ``weights`` (largest remainder)."""
    weight_sum = sum(weights)
    if weight_sum <= 0:
        return [0] * len(weights)
    exact = [total * w / weight_sum for w in weights]
    shares = [math.floor(x) for x in exact]
    left = total - sum(shares)
    for i in sorted(range(len(weights)), key=lambda i: shares[i] - exact[i])[:left]:
        shares[i] += 1
    return shares


# The probe's two inputs: unrelated sentences, so that one's vector given for the other (the
# usual way a broken list goes wrong) cannot pass for right.
PROBE_INPUTS = (
    "carpool checks that a list of inputs is answered item by item.",
    "Zwei völlig andere Wörter: 42 Äpfel, drei Birnen.",
)
# Two vectors of one input are the same answer at this cosine or above: engines that batch on a
# GPU differ from their single answers in the last digits (padding, kernel order), far above
# this; a wrong item is another text's vector, far below it.
SAME_VECTOR = 0.99
# A list refused with these is not an answer about lists: the probe is tried again later.
_UNDECIDED = frozenset({408, 409, 429})


class ListCheck:
    """Whether merging embeddings inputs into one list call keeps every answer what it is alone,
    per replica; see the module docstring."""

    def __init__(
        self,
        mode: str,
        upstreams: Sequence[Upstream],
        *,
        retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        self.upstreams = list(upstreams)
        self.retry_s = retry_s
        self.clock = clock
        self._verdicts: dict[tuple[int, Hashable], bool] = {}
        self._retry_at: dict[tuple[int, Hashable], float] = {}
        self._probes: dict[tuple[int, Hashable], asyncio.Task[None]] = {}
        self.probes = 0  # probes run (each: three upstream calls)

    @staticmethod
    def _key(group: Any) -> Hashable:
        path, _identity, template, query = group
        return path, template, query  # what the engine answers: not who asks

    def verdict(self, group: Any) -> bool | None:
        if self.mode != "auto":
            return self.mode == "on"
        key = self._key(group)
        found = [self._verdicts.get((i, key)) for i in range(len(self.upstreams))]
        if False in found:
            return False
        return True if found and all(found) else None

    def probe(self, group: Any) -> None:
        """Start the probes this group still needs (never more than one per replica)."""
        if self.mode != "auto":
            return
        key, now = self._key(group), self.clock()
        for i, upstream in enumerate(self.upstreams):
            slot = (i, key)
            if (
                slot in self._verdicts
                or slot in self._probes
                or now < self._retry_at.get(slot, 0.0)
            ):
                continue
            task = asyncio.get_running_loop().create_task(self._probe(slot, upstream, group))
            self._probes[slot] = task

    async def _probe(self, slot: tuple[int, Hashable], upstream: Upstream, group: Any) -> None:
        self.probes += 1
        try:
            verdict = await probe_lists(upstream, group)
        finally:
            del self._probes[slot]
        if verdict is None:
            self._retry_at[slot] = self.clock() + self.retry_s
        else:
            self._verdicts[slot] = verdict

    def stats(self) -> dict[str, Any]:
        verdicts = list(self._verdicts.values())
        return {
            "mode": self.mode,
            "probes": self.probes,
            "lists_right": verdicts.count(True),
            "lists_wrong": verdicts.count(False),
        }

    async def wait_idle(self) -> None:
        while self._probes:
            await asyncio.gather(*list(self._probes.values()), return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        await self.wait_idle()


async def probe_lists(upstream: Upstream, group: Any) -> bool | None:
    """Whether ``upstream`` answers a 2-item list as it answers each item alone, for the
    group's path, body template, credentials and query: True, False, or None (undecided)."""
    path, identity, template, query = group
    body = orjson.loads(template)
    body.pop("encoding_format", None)  # floats, to compare

    async def ask(value: Any) -> tuple[int, bytes]:
        response = await upstream.send(
            UpstreamRequest(path, {**body, "input": value}, dict(identity), False, query)
        )
        try:
            if response.streaming:
                return 502, b""
            return response.status, response.body
        finally:
            await response.aclose()

    answers = await asyncio.gather(
        ask(list(PROBE_INPUTS)), *(ask(t) for t in PROBE_INPUTS), return_exceptions=True
    )
    for answer in answers:
        if isinstance(answer, asyncio.CancelledError):
            raise answer
    if any(isinstance(answer, BaseException) for answer in answers):
        return None  # unreachable, timed out: undecided
    # (none is an exception now: each is a (status, body) pair)
    (listed_status, listed_body), *singles = cast(list[tuple[int, bytes]], answers)
    alone = [_vectors(raw, 1) if 200 <= status < 300 else None for status, raw in singles]
    if any(vectors is None for vectors in alone):
        return None  # the singles are the reference: none, no verdict
    if not 200 <= listed_status < 300:
        return None if listed_status in _UNDECIDED or listed_status >= 500 else False
    listed = _vectors(listed_body, len(PROBE_INPUTS))
    return listed is not None and all(
        _same(one[0], item)  # type: ignore[index]  # (each is a list: checked above)
        for one, item in zip(alone, listed, strict=True)
    )


def _vectors(raw: bytes, count: int) -> list[list[float]] | None:
    """The ``count`` vectors of an embeddings answer in index order, or None if it has not."""
    try:
        data = sorted(orjson.loads(raw)["data"], key=lambda row: row["index"])
        if [row["index"] for row in data] != list(range(count)):
            return None
        out = []
        for row in data:
            value = row["embedding"]
            if isinstance(value, str):  # base64 little-endian float32
                packed = base64.b64decode(value)
                value = list(struct.unpack(f"<{len(packed) // 4}f", packed))
            out.append([float(x) for x in value])
        return out
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, struct.error):
        return None


def _same(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b) or not a:
        return False
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return norms > 0 and sum(x * y for x, y in zip(a, b, strict=True)) / norms >= SAME_VECTOR


class EmbeddingBatcher:
    """Dynamic batching with dedup for ``/embeddings``; see the module docstring."""

    def __init__(
        self,
        send: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]],
        *,
        max_batch_size: int = 32,
        max_batch_delay_s: float = 0.005,
        max_batch_tokens: int = 8192,
        observe_wait: Callable[[float], None] | None = None,
        observe_size: Callable[[int], None] | None = None,
        max_in_flight: int | None = None,
        key_headers: Iterable[str] = DEFAULT_KEY_HEADERS,
        lists: ListCheck | None = None,
    ) -> None:
        self._send = send
        self.key_headers = tuple(name.lower() for name in key_headers)
        self.lists = lists
        self.bypassed = 0
        self.alone = 0  # batchable requests/items sent alone, not merged
        self._core: KeyedBatcher[str | tuple[int, ...], Any] = KeyedBatcher(
            self._compute,
            max_batch_size=max_batch_size,
            max_batch_delay_s=max_batch_delay_s,
            max_batch_cost=max_batch_tokens,
            max_in_flight=max_in_flight,
            observe_wait=observe_wait,
            observe_size=observe_size,
        )

    @classmethod
    def from_config(
        cls,
        send: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]],
        config: Any,
        *,
        max_batch_tokens: int = 8192,
        observe_wait: Callable[[float], None] | None = None,
    ) -> EmbeddingBatcher:
        """From a ``BatchingConfig`` (``max_batch_size``, ``max_batch_delay_ms``)."""
        return cls(
            send,
            max_batch_size=config.max_batch_size,
            max_batch_delay_s=config.max_batch_delay_ms / 1000,
            max_batch_tokens=getattr(config, "max_batch_tokens", max_batch_tokens),
            observe_wait=observe_wait,
        )

    # counters of the scheduler
    @property
    def batches(self) -> int:
        return self._core.batches

    @property
    def items_sent(self) -> int:
        return self._core.items_sent

    @property
    def requests(self) -> int:
        return self._core.requests

    @property
    def max_items_seen(self) -> int:
        return self._core.max_items_seen

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "items_sent": self.items_sent,
            "requests": self.requests,
            "max_items_seen": self.max_items_seen,
            "bypassed": self.bypassed,
            "alone": self.alone,
            **({"lists": self.lists.stats()} if self.lists is not None else {}),
        }

    async def wait_idle(self) -> None:
        """Wait until every batch and every list probe started so far has finished."""
        await self._core.wait_idle()
        if self.lists is not None:
            await self.lists.wait_idle()

    async def aclose(self) -> None:
        """Cancel the list probes still running (before the upstreams close)."""
        if self.lists is not None:
            await self.lists.aclose()

    def _plan(self, request: UpstreamRequest) -> tuple[Hashable, str | tuple[int, ...]] | None:
        """(group, item) of a batchable request, else None."""
        path = "/" + request.path.lstrip("/")
        if path.startswith("/v1/"):
            path = path[3:]
        body = request.body
        if request.stream or path != "/embeddings" or not isinstance(body, Mapping):
            return None
        if body.get("stream") or not isinstance(body.get("model"), str):
            return None
        item = _single_item(body.get("input"))
        if item is None:
            return None
        rest = {k: v for k, v in body.items() if k not in ("input", "user")}
        try:
            template = orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            return None
        lowered = {k.lower(): v for k, v in request.headers.items()}
        # The credentials, and every forwarded header that might change the answer: the merged
        # call carries them, so only requests that agree on them share it.
        identity = tuple(
            (name, lowered[name]) for name in self.key_headers if name in lowered
        ) + varying_headers(lowered, self.key_headers)
        return (path, identity, template, request.query), item

    async def embed(self, request: UpstreamRequest) -> UpstreamResponse:
        plan = self._plan(request)
        if plan is None:
            self.bypassed += 1
            return await self._send(request)
        group, item = plan
        if self.lists is not None and self.lists.verdict(group) is False:
            # Known unsafe to merge: not even buffered, sent as the client sent it.
            self.alone += 1
            return await self._send(request)
        key = (type(item).__name__, item)
        try:
            result = await self._core.submit(group, key, item, approx_tokens(item))
        except _BatchFailed as failed:
            return UpstreamResponse(failed.status, failed.headers, failed.body)
        if isinstance(result, BaseException):  # this item's own call failed
            raise result
        return cast(UpstreamResponse, result)

    async def _compute(
        self, group: Any, items: list[str | tuple[int, ...]]
    ) -> list[UpstreamResponse | BaseException]:
        if self.lists is not None and self.lists.verdict(group) is not True:
            if len(items) > 1:
                self.lists.probe(group)  # in the background: these go alone now
            self.alone += len(items)
            return await asyncio.gather(
                *(self._one(group, item) for item in items), return_exceptions=True
            )
        async with self._call(group, [_value(item) for item in items]) as (response, body):
            if not 200 <= response.status < 300:
                raise _BatchFailed(response.status, response.headers, response.body)
            return [
                UpstreamResponse(200, headers, answer)
                for answer, headers in self._split(response, items, body["model"])
            ]

    async def _one(self, group: Any, item: str | tuple[int, ...]) -> UpstreamResponse:
        """One item in a call of its own: the upstream's answer to it, as it came."""
        async with self._call(group, _value(item)) as (response, _):
            if not 200 <= response.status < 300:
                return UpstreamResponse(response.status, response.headers, response.body)
            return UpstreamResponse(response.status, _answer_headers(response), response.body)

    @contextlib.asynccontextmanager
    async def _call(
        self,
        group: Any,
        value: Any,
    ) -> AsyncIterator[tuple[UpstreamResponse, dict[str, Any]]]:
        """The group's embeddings call with ``value`` as its input: the upstream's (non-stream)
        response and the body sent; the response is closed on the way out."""
        path, identity, template, query = group
        body = orjson.loads(template)
        body["input"] = value
        response = await self._send(UpstreamRequest(path, body, dict(identity), False, query))
        try:
            if response.streaming:
                raise UpstreamError("the upstream answered an embeddings call with a stream")
            yield response, body
        finally:
            await response.aclose()

    @staticmethod
    def _split(
        response: UpstreamResponse, items: list[str | tuple[int, ...]], model: str
    ) -> list[tuple[bytes, dict[str, str]]]:
        try:
            parsed = orjson.loads(response.body)
            data = sorted(parsed["data"], key=lambda row: row["index"])
            embeddings = [row["embedding"] for row in data]
            if [row["index"] for row in data] != list(range(len(items))):
                raise ValueError("indexes")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UpstreamError(
                f"the upstream's embeddings answer for {len(items)} inputs is malformed"
            ) from exc
        weights = [approx_tokens(item) for item in items]
        usage = parsed.get("usage") if isinstance(parsed.get("usage"), dict) else {}
        # Only what the upstream reported is shared out: a figure it did not give is not made up.
        shares = {
            name: _apportion(value, weights)
            for name in ("prompt_tokens", "total_tokens")
            if type(value := usage.get(name)) is int and value >= 0
        }
        model_name = parsed.get("model") if isinstance(parsed.get("model"), str) else model
        headers = _answer_headers(response)
        out = []
        for i, embedding in enumerate(embeddings):
            answer: dict[str, Any] = {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
                "model": model_name,
            }
            if shares:
                answer["usage"] = {name: values[i] for name, values in shares.items()}
            out.append((orjson.dumps(answer), headers))
        return out


def _value(item: str | tuple[int, ...]) -> str | list[int]:
    return item if isinstance(item, str) else list(item)


def _answer_headers(response: UpstreamResponse) -> dict[str, str]:
    """The upstream's headers for a JSON answer we send as bytes: framing ones dropped."""
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in _DROPPED_RESPONSE_HEADERS
    }
    headers["content-type"] = "application/json"
    return headers
