"""Single-flight: identical requests in flight share one upstream call.

A *flight* is one upstream call for one fingerprint key. The first request for a key is its
*leader*; requests for the same key that arrive while it runs (or within the coalescing window after
it finished) are *joiners*. Each request holds a ``Ticket`` for as long as it is interested.

Contract (each clause has a test of the same name in tests/test_flight.py):
1. Concurrent identical requests make one upstream call and all get the same answer: ``acquire``
   starts the call only when no flight for the key exists.
2. A leader's error reaches every waiter and is never stored: the flight ends with the error, and
   is dropped at once so the next request calls again.
3. A finished flight stays joinable for the window, then is gone: a complete answer lingers
   for the window its ``WindowPolicy`` gives (joiners get it at once; see ``window.py``), an
   incomplete one (or one led by a ``no-store`` request) does not linger at all, nor one its
   lead stored where every request that could join it reads it first (``Broadcast.stored``:
   such a request is a hit, not a joiner).
4. ``forget`` makes the next request start a fresh flight, and the old flight finishing never removes
   the new one: the group only ever drops the flight it holds if it is the same object.
   ``forget_all`` (an invalidation) forgets every flight, running ones too (their clients keep
   their call), and moves ``epoch`` on: a call that began in an older epoch must not be stored.
5. The leader's client disconnecting does not cancel the call while others wait: the call runs in its
   own task, not in any client's.
6. When all its clients have gone the upstream call is cancelled (unless ``finish_abandoned``): the
   last ``Ticket.release`` of an unfinished flight cancels its task and drops it, so a later request
   starts afresh instead of joining a dying call.
7. A joiner that waits longer than ``join_timeout`` runs its own call: ``Ticket.wait_*`` raise
   ``JoinTimeout``; the caller then ``retake``s, which forgets the slow flight and leads a fresh one
   (or joins the fresh one another timed-out joiner already started), once.
8. No waiter can hang on any exit path: the flight's task ends the broadcast in every case (answer,
   error, cancellation, a bug in the lead function), so every ``wait_*`` returns or raises.

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
from collections.abc import Awaitable, Callable

from .answer import Answer
from .broadcast import Broadcast
from .clock import SYSTEM_CLOCK, Clock
from .errors import CarpoolError, FlightAbandoned, UpstreamError
from .window import FixedWindow, WindowPolicy

log = logging.getLogger("carpool.flight")

Lead = Callable[[Broadcast], Awaitable[Answer]]
_TIMER_SLACK = 0.002  # seconds


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

    __slots__ = ("group", "flight", "leader", "_released")

    def __init__(self, group: FlightGroup, flight: Flight, leader: bool) -> None:
        self.group = group
        self.flight = flight
        self.leader = leader
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
        flight and lead (or join) a fresh one."""
        self.release()
        self.group.forget(self.flight.key, self.flight)
        return self.group.acquire(self.flight.key, lead, owner=owner)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        flight = self.flight
        flight.clients -= 1
        self.group.waiters -= 1
        if flight.clients == 0 and not flight.broadcast.done and not self.group.finish_abandoned:
            self.group.forget(flight.key, flight)
            if flight.task is not None:
                flight.task.cancel()


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
        self.waiters = 0  # tickets not yet released, for /stats and metrics
        self.epoch = 0  # invalidations so far (``forget_all``)
        self._flights: dict[str, Flight] = {}
        # The lingering flights by the end of their window (a heap), and the one timer that
        # frees them: one tuple a flight, not a timer each (objects the collector would walk).
        self._ends: list[tuple[float, int, Flight]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when it fires, on the group's clock

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, key: str) -> Flight | None:
        flight = self._flights.get(key)
        if flight is not None and flight.finished_at is not None:
            return self._lingering(flight, self.clock.monotonic())
        return flight

    def joinable(self, key: str, max_age: float | None = None) -> bool:
        """Whether ``acquire`` with this ``max_age`` would join a flight rather than lead one."""
        flight = self._flights.get(key)
        if flight is None or flight.finished_at is None:
            return flight is not None
        now = self.clock.monotonic()
        if self._lingering(flight, now) is None:
            return False
        return max_age is None or now - flight.finished_at < max_age

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
        flight = self._flights.get(key)
        leader = False
        if flight is None or flight.finished_at is not None:
            # No call running for the key: lead one, or join the answer lingering in its window.
            now = self.clock.monotonic()
            self.windows.arrival(key, now)
            if flight is not None:
                flight = self._lingering(flight, now)
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
        flight.clients += 1
        self.waiters += 1
        return Ticket(self, flight, leader)

    def forget(self, key: str, flight: Flight | None = None) -> None:
        """Make the next request for ``key`` start a fresh flight (only if ``flight`` is current)."""
        current = self._flights.get(key)
        if current is not None and (flight is None or current is flight):
            del self._flights[key]

    def _linger(self, flight: Flight, until: float, now: float) -> None:
        """Keep the finished ``flight`` joinable until ``until``: then the timer frees it."""
        flight.lingers_until = until
        heapq.heappush(self._ends, (until, next(self._order), flight))
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
            flight = heapq.heappop(ends)[2]
            self.forget(flight.key, flight)
        if ends:
            self._arm(ends[0][0], now)

    def _lingering(self, flight: Flight, now: float) -> Flight | None:
        """The finished ``flight`` if its window is still open at ``now``; else it is forgotten."""
        if flight.lingers_until is not None and now >= flight.lingers_until:
            self.forget(flight.key, flight)
            return None
        return flight

    def forget_all(self) -> int:
        """After an invalidation: no request joins any flight there is now, running or
        lingering; the running ones go on for the clients they have. Returns how many."""
        self.epoch += 1
        dropped = len(self._flights)
        self._flights.clear()
        self._ends.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
            broadcast.fail(FlightAbandoned("every client of this request left"))
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
        flight.finished_at = now = self.clock.monotonic()
        window = (
            self.windows.window(flight.key, now, now - flight.started_at)
            if answer.complete and flight.linger and not broadcast.stored
            else 0
        )
        if window > 0:
            # Freed by the timer if no request comes to find its window closed (``_lingering``).
            self._linger(flight, now + window, now)
        else:
            self.forget(flight.key, flight)
