"""Single-flight: identical requests in flight share one upstream call.

A *flight* is one upstream call for one fingerprint key. The first request for a key is its
*leader*; requests for the same key that arrive while it runs (or within the coalescing window after
it finished) are *joiners*. Each request holds a ``Ticket`` for as long as it is interested.

Contract (each clause has a test of the same name in tests/test_flight.py):
1. Concurrent identical requests make one upstream call and all get the same answer: ``acquire``
   starts the call only when no flight for the key exists.
2. A leader's error reaches every waiter and is never stored: the flight ends with the error, and
   is dropped at once so the next request calls again.
3. A finished flight stays joinable for the window, then is gone: a storable answer
   (``Answer.storable``) lingers for the window its ``WindowPolicy`` gives (joiners get it at
   once; see ``window.py``), one that is not (incomplete, or one the upstream's
   ``Cache-Control`` keeps out of shared caches: ``no-store``, ``private``; or one led by a
   ``no-store`` request, or relayed from another instance's leader that said so:
   ``Broadcast.may_linger``) does not linger at all. A flight that
   replayed a call another instance had finished (``Broadcast.replayed``) finished when that
   call did: its age and its window count from then. Lingering, it
   is kept as a plain tuple of strings, bytes and numbers (``_lingering_record``), not as the
   flight's objects: the garbage collector stops walking such a tuple after one pass, where a
   flight, its broadcast, its answer and its frames would be walked by every young pass for as
   long as the window (at 1,000 misses a second, a thousand flights: young passes 2x longer,
   the middle generation's 7x). A request that joins it gets a finished flight made again from
   the tuple (``_revived``): equal frames, an equal answer.
4. ``forget`` makes the next request start a fresh flight, and the old flight finishing never removes
   the new one: the group only ever drops the flight it holds if it is the same object.
   ``forget_all`` (an invalidation on another instance, which names no answer here) forgets
   every flight, running ones too (their clients keep their call), and moves ``epoch`` on: a
   call that began in an older epoch must not be stored. ``invalidate(picks)`` (an
   invalidation here) does the same to the running flights, and forgets only the lingering
   ones whose labels it picks (``Broadcast.labels``, kept with the answer; one without labels
   is picked by any); it returns the labels of those it dropped, with whether a cache keeps
   each answer (``Broadcast.kept``).
5. The leader's client disconnecting does not cancel the call while others wait: the call runs in its
   own task, not in any client's.
6. When all its clients have gone the upstream call is cancelled (unless ``finish_abandoned``): the
   last ``Ticket.release`` of an unfinished flight cancels its task and drops it, so a later request
   starts afresh instead of joining a dying call. A lead that set its broadcast's
   ``on_abandoned`` (clients of other instances may wait on the call: ``redis/flights.py``) is
   handed the cancellation instead, and cancels when nobody waits anywhere; the flight is
   dropped all the same (a later request here follows the call as those clients do).
7. A joiner that waits longer than ``join_timeout`` runs its own call: ``Ticket.wait_*`` raise
   ``JoinTimeout``; the caller then ``retake``s, which forgets the slow flight and leads a fresh one
   (or joins the fresh one another timed-out joiner already started), once. It does so on the
   terms its request acquired on (``max_age``, ``linger``): a ``no-store`` request's fresh call
   does not linger either, and a ``no-cache`` one joins no finished flight. (The pipeline waits
   on instead when the flight's lead times out itself, ``Broadcast.lead_times_out``: it follows
   another instance's call, and makes the fresh call in this very flight.)
8. No waiter can hang on any exit path: the flight's task ends the broadcast in every case (answer,
   error, cancellation, a bug in the lead function), so every ``wait_*`` returns or raises.
   ``calls`` holds every flight's task still running, forgotten ones too (a call kept for
   another instance's followers, one an invalidation forgot): what a closing gateway lets
   end, or cancels (``Gateway.settle``). ``live()`` counts those calls and the answers
   lingering: the flights ``/stats`` and ``carpool_flights`` report, a call forgotten by an
   invalidation counted until it ends.

Time: the window a finished flight lingers and the age of a finished flight (``max_age``) are read
from the group's ``clock.monotonic()`` (``carpool.clock``; the system's unless given another): a
lingering flight is gone for every request from the instant its window ends. Join timeouts run
on the event loop's time; so does the one timer of the group that frees the lingering flights no
one asks for (set for the earliest end of a window), but it frees a flight only once its window
has ended on the clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from array import array
from collections.abc import Awaitable, Callable
from typing import TypeGuard

from .answer import Answer
from .broadcast import Broadcast, Labels
from .clock import SYSTEM_CLOCK, Clock
from .errors import CarpoolError, FlightAbandoned, ShuttingDown, UpstreamError
from .window import FixedWindow, WindowPolicy

log = logging.getLogger("carpool.flight")

Lead = Callable[[Broadcast], Awaitable[Answer]]
_TIMER_SLACK = 0.002  # seconds
# A finished flight lingering in its window (clause 3): (lingers until, finished at, owner,
# remote, cached, the broadcast's frames (``_joined``), its usage frame, the answer's kind,
# body, complete, tokens, created, frames (None, ``_SAME``: the broadcast's, or joined), usage
# frame, the broadcast's labels and kept: what an invalidation reads). Frames are kept joined
# into one bytes object with their lengths in another: a tuple of a stream's thirty frames
# would be thirty more items for every pass to visit.
Lingering = tuple[
    float, float, str, bool, bool, bytes, bytes, "int | None",
    str, bytes, bool, int, float, "bytes | bool | None", "bytes | None", "int | None",
    "Labels | None", bool,
]  # fmt: skip
_SAME = True  # (the answer's frames are the broadcast's list)


class JoinTimeout(TimeoutError):
    """A joiner waited longer than ``coalesce.join_timeout_ms`` for the flight it joined."""


class Flight:
    __slots__ = (
        "key",
        "broadcast",
        "task",
        "clients",
        "started_at",
        "finished_at",
        "lingers_until",
        "linger",
        "owner",
    )

    def __init__(
        self, key: str, linger: bool = True, owner: str = "", *, started_at: float | None = None
    ) -> None:
        self.key = key
        self.linger = linger  # may stay joinable within the window once finished
        self.owner = owner  # who leads it (the leader's tenant), for the caller
        self.broadcast = Broadcast()
        self.task: asyncio.Task[None] | None = None
        self.clients = 0
        self.started_at = time.monotonic() if started_at is None else started_at
        self.finished_at: float | None = None
        self.lingers_until: float | None = None  # once finished: joinable until then


class Ticket:
    """One request's interest in a flight. Release it exactly when the request is done with it."""

    __slots__ = ("group", "flight", "leader", "max_age", "linger", "_released")

    def __init__(
        self,
        group: FlightGroup,
        flight: Flight,
        leader: bool,
        max_age: float | None = None,
        linger: bool = True,
    ) -> None:
        self.group = group
        self.flight = flight
        self.leader = leader
        # The terms it was acquired on (``FlightGroup.acquire``), which its ``retake`` keeps.
        self.max_age = max_age
        self.linger = linger
        self._released = False

    @property
    def broadcast(self) -> Broadcast:
        return self.flight.broadcast

    async def wait_started(self, timeout: float | None) -> None:
        """Until the first frame or the end; joiners give up after ``timeout`` seconds."""
        await self._bounded(self.flight.broadcast.wait_started(), timeout)

    async def wait_done(self, timeout: float | None) -> None:
        if self.leader or timeout is None:
            await self.flight.broadcast.wait_done()  # (``_bounded``'s unbounded case, inline)
        else:
            await self._bounded(self.flight.broadcast.wait_done(), timeout)

    async def _bounded(self, waiting: Awaitable[None], timeout: float | None) -> None:
        if self.leader or timeout is None:
            await waiting
            return
        try:
            async with asyncio.timeout(timeout):
                await waiting
        except TimeoutError:
            raise JoinTimeout(
                f"flight {self.flight.key} gave no answer within {timeout} s"
            ) from None

    def retake(self, lead: Lead, owner: str = "") -> Ticket:
        """After a ``JoinTimeout`` (or an answer that was not for this request): leave the
        flight and lead (or join) a fresh one, on the terms this ticket was acquired on: the
        request is the same (a ``no-store`` one's call must not linger, which would be a form
        of storing; a ``no-cache`` one must not join a finished flight)."""
        self.release()
        self.group.forget(self.flight.key, self.flight)
        return self.group.acquire(
            self.flight.key, lead, max_age=self.max_age, linger=self.linger, owner=owner
        )

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        flight = self.flight
        flight.clients -= 1
        self.group.waiters -= 1
        if flight.clients == 0 and not flight.broadcast.done and not self.group.finish_abandoned:
            self.group.forget(flight.key, flight)
            task = flight.task
            if task is not None:
                keeper = flight.broadcast.on_abandoned
                if keeper is None:
                    task.cancel()
                else:  # (other instances' clients may wait on it: its lead decides)
                    keeper(task.cancel)


class FlightGroup:
    """The flights in progress (and lingering within the window), by fingerprint key."""

    def __init__(
        self,
        *,
        window: float | WindowPolicy,
        finish_abandoned: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.windows: WindowPolicy = (
            FixedWindow(window) if isinstance(window, (int, float)) else window
        )
        self.finish_abandoned = finish_abandoned
        self.clock = clock
        # Set by a closing gateway before it cancels the calls still running (``settle``):
        # their clients are told it is shutting down (a 503 to retry), not that they left.
        self.settling = False
        self.waiters = 0  # tickets not yet released, for /stats and metrics
        self.epoch = 0  # invalidations so far (``forget_all``)
        # Every flight's task still running, forgotten ones too (a call kept for another
        # instance's followers once its clients here left): what a closing gateway lets end.
        self.calls: set[asyncio.Task[None]] = set()
        # The flights by key: running, or finished and lingering (a ``Lingering`` tuple).
        self._flights: dict[str, Flight | Lingering] = {}
        # The lingering flights by the end of their window (a heap), and the one timer that
        # frees them: one tuple a flight, not a timer each (objects the collector would walk).
        self._ends: list[tuple[float, int, str]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when it fires, on the group's clock

    def __len__(self) -> int:
        """The flights a request may join: running, or finished and lingering."""
        return len(self._flights)

    def live(self) -> int:
        """The upstream calls in flight (forgotten ones too: an invalidation's, one kept for
        another instance's followers) and the answers lingering in their window."""
        running = sum(not task.done() for task in self.calls)
        return running + sum(not _running(held) for held in self._flights.values())

    def running(self) -> list[Flight]:
        """The flights whose call is in progress (not the finished ones lingering)."""
        return [held for held in self._flights.values() if _running(held)]

    def get(self, key: str) -> Flight | None:
        """The flight for ``key``: running, or finished and lingering (made again)."""
        held = self._flights.get(key)
        if held is None or _running(held):
            return held
        return self._lingering(key, held, self.clock.monotonic())

    def joinable(self, key: str, max_age: float | None = None) -> bool:
        """Whether ``acquire`` with this ``max_age`` would join a flight rather than lead one."""
        held = self._flights.get(key)
        if held is None or _running(held):
            return held is not None
        now = self.clock.monotonic()
        until, finished_at = _window_of(held)
        if now >= until:
            self.forget(key, held)
            return False
        return max_age is None or now - finished_at < max_age

    def acquire(
        self,
        key: str,
        lead: Lead,
        *,
        max_age: float | None = None,
        linger: bool = True,
        owner: str = "",
    ) -> Ticket:
        """Join the flight for ``key``, or lead a new one that runs ``lead`` in its own task.

        ``max_age`` bounds how long ago a finished flight may have finished to be joined
        (``Cache-Control: no-cache`` passes 0: only a call still in flight is joined).
        ``linger`` (for a new flight) allows its answer to stay joinable within the window; a
        ``no-store`` leader passes False, as lingering would be a form of storing. ``owner``
        (for a new flight) is kept as ``Flight.owner``.
        """
        held = self._flights.get(key)
        leader = False
        if _running(held):
            flight: Flight | None = held
        else:
            # No call running for the key: lead one, or join the answer lingering in its window.
            now = self.clock.monotonic()
            self.windows.arrival(key, now)
            flight = None if held is None else self._lingering(key, held, now)
            if (
                flight is not None
                and flight.finished_at is not None
                and max_age is not None
                and now - flight.finished_at >= max_age
            ):
                self.forget(key, flight)
                flight = None
            if flight is None:
                leader = True
                flight = self._flights[key] = Flight(key, linger, owner, started_at=now)
                flight.task = asyncio.get_running_loop().create_task(self._run(flight, lead))
                self.calls.add(flight.task)
                flight.task.add_done_callback(self.calls.discard)
        assert flight is not None
        flight.clients += 1
        self.waiters += 1
        return Ticket(self, flight, leader, max_age, linger)

    def forget(self, key: str, flight: Flight | Lingering | None = None) -> None:
        """Make the next request for ``key`` start a fresh flight (only if ``flight`` is current)."""
        current = self._flights.get(key)
        if current is not None and (flight is None or current is flight):
            del self._flights[key]

    def shut(self, key: str) -> None:
        """No request joins ``key``'s flight any more, lingering or running: a running one
        goes on for the clients it has, and does not linger once done (a deleted response's
        answer, whose call may be finishing, storing: ``state_index``)."""
        held = self._flights.pop(key, None)
        if type(held) is Flight:  # (running, or done and not yet lingering: ``_linger`` skips it)
            held.linger = False

    def _linger(self, flight: Flight, answer: Answer, until: float, now: float) -> None:
        """Keep the finished ``flight`` joinable until ``until``, as a tuple (clause 3), if it
        is still the key's: then the timer frees it."""
        if self._flights.get(flight.key) is not flight:
            return  # (forgotten meanwhile: nobody may join it)
        self._flights[flight.key] = _lingering_record(flight, answer, until)
        heapq.heappush(self._ends, (until, next(self._order), flight.key))
        if self._timer is None or until < self._timer_at:
            self._arm(until, now)

    def _arm(self, until: float, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = until
        # A little after the window, so that a loop whose timers round to milliseconds (uvloop)
        # does not fire just before it, only to be set again.
        self._timer = asyncio.get_running_loop().call_later(until - now + _TIMER_SLACK, self._free)

    def _free(self) -> None:
        """The timer: the lingering flights whose window has ended on the group's clock are
        gone (a test may hold that clock still: then it looks again when the next window
        would end)."""
        self._timer = None
        now = self.clock.monotonic()
        ends = self._ends
        while ends and ends[0][0] <= now:
            key = heapq.heappop(ends)[2]
            held = self._flights.get(key)
            # (Not a flight running for the key since, nor one lingering for a later window.)
            if held is not None and not _running(held) and _window_of(held)[0] <= now:
                del self._flights[key]
        if ends:
            self._arm(ends[0][0], now)

    def _lingering(self, key: str, held: Flight | Lingering, now: float) -> Flight | None:
        """The finished flight ``held`` for ``key`` if its window is still open at ``now``,
        made again from its tuple (kept so for the requests that join it next); else it is
        forgotten."""
        if now >= _window_of(held)[0]:
            self.forget(key, held)
            return None
        if type(held) is Flight:
            return held
        flight = self._flights[key] = _revived(key, held)  # type: ignore[arg-type]
        return flight

    def forget_all(self) -> int:
        """After an invalidation that names nothing here (another instance's): no request
        joins any flight there is now, running or lingering; the running ones go on for the
        clients they have. Returns how many."""
        self.epoch += 1
        dropped = len(self._flights)
        self._flights.clear()
        self._ends.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return dropped

    def invalidate(self, picks: Callable[[Labels], bool]) -> list[tuple[Labels | None, bool]]:
        """After an invalidation here: no request joins a running flight (its answer may
        predate what was dropped: the ``epoch`` moves on, and it is not stored), nor a
        lingering one whose labels ``picks`` (one without labels: picked). The lingering
        answers it does not pick stay joinable: they are as fresh as the cache's. Returns
        (labels, kept) of each lingering answer dropped."""
        self.epoch += 1
        dropped: list[tuple[Labels | None, bool]] = []
        for key, held in list(self._flights.items()):
            if _running(held):
                del self._flights[key]
                continue
            labels, kept = _labels_of(held)
            if labels is None or picks(labels):
                del self._flights[key]
                dropped.append((labels, kept))
        # (The timer and its heap stay: they skip a key no longer lingering, ``_free``.)
        return dropped

    async def _run(self, flight: Flight, lead: Lead) -> None:
        try:
            await self._fly(flight, lead)
        finally:
            # A flight lingering in its window does not keep its finished task (and with it a
            # coroutine, a context...): objects each miss the collector would walk meanwhile.
            flight.task = None

    async def _fly(self, flight: Flight, lead: Lead) -> None:
        broadcast = flight.broadcast
        try:
            answer = await lead(broadcast)
        except asyncio.CancelledError:
            # (Clients may still wait on a call a closing gateway cancelled: another worker's,
            # asking its key's owner, which then makes the call itself.)
            broadcast.fail(
                ShuttingDown() if self.settling else FlightAbandoned(FlightAbandoned.MESSAGE)
            )
            self.forget(flight.key, flight)
            return
        except CarpoolError as error:
            broadcast.fail(error)
            self.forget(flight.key, flight)
            return
        except Exception as error:  # a bug must not leave waiters hanging
            log.exception("flight %s failed unexpectedly", flight.key)
            # The client hears what happened, not how: the exception is in the log above.
            failure = UpstreamError("internal error while calling upstream")
            failure.__cause__ = error
            broadcast.fail(failure)
            self.forget(flight.key, flight)
            return
        broadcast.finish(answer)
        now = self.clock.monotonic()
        # A replay of a call another instance had finished (``Broadcast.replayed``) is as old as
        # that call: its age (``max_age``) and its window count from that call's end, not from
        # the replay (else each instance that replays it would open a window of its own).
        replayed = broadcast.replayed
        flight.finished_at = ended = now if replayed is None else now - replayed
        window = (
            self.windows.window(flight.key, now, now - flight.started_at)
            # (Not an answer whose remote leader said no: ``no-store``; nor one the upstream
            # said no shared cache may keep: ``Answer.storable``.)
            if answer.storable and flight.linger and broadcast.may_linger
            else 0
        )
        if ended + window > now:
            # Freed by the timer if no request comes to find its window closed (``_lingering``).
            self._linger(flight, answer, ended + window, now)
        else:
            self.forget(flight.key, flight)


def _running(held: Flight | Lingering | None) -> TypeGuard[Flight]:
    """Whether ``held`` is a flight whose call is in progress (not one finished, in any form)."""
    return type(held) is Flight and held.finished_at is None


def _window_of(held: Flight | Lingering) -> tuple[float, float]:
    """(lingers until, finished at) of a finished flight, whichever its form."""
    if type(held) is not Flight:
        return held[0], held[1]  # type: ignore[index]
    assert held.finished_at is not None
    until = held.lingers_until
    return (float("inf") if until is None else until), held.finished_at


def _labels_of(held: Flight | Lingering) -> tuple[Labels | None, bool]:
    """(labels, kept) of a finished flight, whichever its form."""
    if type(held) is Flight:
        return held.broadcast.labels, held.broadcast.kept
    return held[16], held[17]  # type: ignore[index]


def _lingering_record(flight: Flight, answer: Answer, until: float) -> Lingering:
    """The finished ``flight`` as a plain tuple (clause 3)."""
    broadcast = flight.broadcast
    frames = answer.frames
    assert flight.finished_at is not None
    own: tuple[bytes | bool | None, bytes | None] = (
        (None, None)
        if frames is None
        else (_SAME, None)
        if frames is broadcast.frames
        else _joined(frames)
    )
    return (
        until,
        flight.finished_at,
        flight.owner,
        broadcast.remote,
        broadcast.cached,
        *_joined(broadcast.frames),
        broadcast.usage_frame,
        answer.kind,
        answer.body,
        answer.complete,
        answer.tokens,
        answer.created,
        *own,
        answer.usage_frame,
        broadcast.labels,
        broadcast.kept,
    )


def _revived(key: str, record: Lingering) -> Flight:
    """A finished flight made again from its tuple: equal frames, an equal answer."""
    until, finished_at, owner, remote, cached, joined, lengths, usage_frame = record[:8]
    kind, body, complete, tokens, created, own, own_lengths, own_usage = record[8:16]
    flight = Flight(key, True, owner, started_at=finished_at)
    flight.finished_at, flight.lingers_until = finished_at, until
    broadcast = flight.broadcast
    broadcast.frames, broadcast.usage_frame = _split(joined, lengths), usage_frame
    broadcast.remote, broadcast.cached = remote, cached
    broadcast.labels, broadcast.kept = record[16], record[17]
    frames = broadcast.frames if own is _SAME else None
    if isinstance(own, bytes) and own_lengths is not None:  # (a list of its own: joined)
        frames = _split(own, own_lengths)
    broadcast.answer = Answer.restored(kind, body, complete, tokens, created, frames, own_usage)
    return flight


def _joined(frames: list[bytes]) -> tuple[bytes, bytes]:
    """``frames`` as one bytes object and their lengths (``_split`` gives them back)."""
    return b"".join(frames), array("I", [len(frame) for frame in frames]).tobytes()


def _split(joined: bytes, lengths: bytes) -> list[bytes]:
    sizes = array("I")
    sizes.frombytes(lengths)
    frames, at = [], 0
    for size in sizes:
        frames.append(joined[at : at + size])
        at += size
    return frames
