"""Time as carpool's in-process layers read it: the system's clocks, or one that tests move.

Contract:
- A ``Clock`` has two readings, in seconds. ``now()`` is wall-clock time since the epoch (as
  ``time.time``): for instants that leave the process or outlive it (an entry's ``expires``, an
  answer's ``created``, Redis TTLs). ``monotonic()`` never goes backwards (as ``time.monotonic``):
  for durations and ages inside the process (a flight's linger and join age, how long ago a
  credential was accepted).
- ``SystemClock`` reads the system. ``SYSTEM_CLOCK`` is the one every component uses unless it
  is given another (``clock=``); its methods are ``time.time`` and ``time.monotonic`` themselves,
  so the default costs nothing on hot paths.
- ``ManualClock`` stands still until ``advance(seconds)`` moves both readings by the same amount,
  never backwards. It starts at the system's readings (unless told otherwise), so that times
  other code takes from the system clock (``Answer.created``) stay close to it.
- Only what reads a clock follows it: asyncio's own timers (``call_later``, ``asyncio.timeout``,
  ``asyncio.sleep``) still run on the event loop's time.
"""

from __future__ import annotations

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
    """The system's clocks: ``time.time`` and ``time.monotonic``."""

    now = staticmethod(time.time)
    monotonic = staticmethod(time.monotonic)


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
