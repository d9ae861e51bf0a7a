"""Time as carpool's in-process layers read it: the system's clocks, or one that tests move.

Contract:
- A ``Clock`` has two readings, in seconds. ``now()`` is wall-clock time since the epoch: for
  instants (an entry's ``expires``, an answer's ``created``; what Redis holds goes there as
  durations, stamped on Redis's own clock). ``monotonic()`` never goes backwards (as
  ``time.monotonic``): for durations and ages inside the process (a flight's linger and join
  age, how long ago a credential was accepted).
- ``SystemClock`` reads the system. ``SYSTEM_CLOCK`` is the one every component uses unless it
  is given another (``clock=``). Its ``now()`` is the wall clock as the process first read it,
  plus the time elapsed since (Linux's ``CLOCK_BOOTTIME``: time suspended counts; elsewhere
  ``time.monotonic``): it never jumps when the system's clock is stepped (NTP, an operator's
  ``date -s``), which moved every in-process expiry and age by the step (an hour back: every
  answer served an hour past its TTL; forward: every one gone at once, the survivors' ``Age``
  an hour old). Its ``monotonic`` is ``time.monotonic`` itself.
- ``ManualClock`` stands still until ``advance(seconds)`` moves both readings by the same amount,
  never backwards. It starts at the system's readings (unless told otherwise), so that times
  other code takes from the system clock (``Answer.created``) stay close to it.
- Only what reads a clock follows it: asyncio's own timers (``call_later``, ``asyncio.timeout``,
  ``asyncio.sleep``) still run on the event loop's time.
"""

from __future__ import annotations

import functools
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds since the epoch."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (its origin means nothing)."""
        ...


class SystemClock:
    """The system's clocks: the wall clock read once and moved on by the time elapsed since, and
    ``time.monotonic`` (the module's contract)."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self) -> None:
        self._at = time.time() - _elapsed()  # (the epoch's reading of the elapsed clock's 0)

    def now(self) -> float:
        return self._at + _elapsed()


# Time elapsed, steps of the wall clock left out: since boot, suspended time included (an
# answer's TTL runs on while the machine sleeps), where the system has such a clock.
_elapsed = (
    functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
    if hasattr(time, "CLOCK_BOOTTIME")
    else time.monotonic
)


SYSTEM_CLOCK: Clock = SystemClock()


class ManualClock:
    """A clock that moves only when told to (``advance``): for tests."""

    def __init__(self, now: float | None = None, monotonic: float | None = None) -> None:
        self._now = time.time() if now is None else now
        self._monotonic = time.monotonic() if monotonic is None else monotonic

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on both readings."""
        if seconds < 0:
            raise ValueError(f"a clock never goes backwards (advance({seconds}))")
        self._now += seconds
        self._monotonic += seconds
