"""How long a finished answer stays joinable: the coalescing window, fixed or adaptive.

A finished flight lingers for a window so that identical requests arriving just after it get its
answer (``coalesced``) even when the answer is not stored (``factual`` ttl 0, ``no-cache``, a full
cache). The window trades upstream calls against the age of the answers it shares: every request
served from a lingering answer receives an answer as old as the time since it finished.

Contract:
- ``arrival(key, now)`` is called for every request that finds no call *running* for its key
  (it leads one, or joins a lingering answer): requests that join a running call are shared
  whatever the window, so they say nothing about it. ``window(key, now, duration)`` is asked
  when a flight for ``key`` finishes after a call of ``duration`` seconds; it answers seconds.
  ``longest``: the most it ever answers (how old a lingering answer can be).
- ``FixedWindow`` always answers ``coalesce.window_ms``.
- ``AdaptiveWindow`` (``coalesce.adaptive: true``) answers, per key class (the fingerprint key:
  the finest class there is, so one hot question never decides the window of a rare one):

      window = clamp(sqrt(T^2 + C x gap) - T,  min_window_ms, max_window_ms)

  with ``T`` the duration of the call that just finished, ``gap`` an exponentially weighted mean
  of the gaps between the key's arrivals (weight ``ALPHA`` on the newest) and ``C`` =
  ``coalesce.adaptive_tradeoff`` seconds. A key with fewer than ``MIN_GAPS`` gaps seen gets the
  configured ``window_ms``, at most ``max_window_ms`` (the config refuses a ``window_ms`` above
  it: ``config.caching``), so a key's first repeats see the documented window. No window is
  ever over ``max_window_ms``, whatever the key: it wins over ``min_window_ms`` should they
  cross (the config refuses that too).

  Why: while a key is asked every ``gap`` seconds, each cycle of ``T + W`` seconds costs one
  upstream call, and the requests served from the window (``W / gap`` of them) receive answers
  ``W / 2`` old on average. Minimising calls per second + (2 / C) x answer-age per second gives
  ``W^2 + 2TW = C x gap``, the rule above. A hot key (small gap) already shares through the
  requests that join its running call, so it gets a short window and fresh answers; a rare key
  (large gap) is shared only through the window, so it gets a long one. ``max_window_ms`` is the
  staleness bound: no lingering answer is ever shared older than it.
- ``window_ms: 0`` is no window at all, adaptive or not: no finished answer lingers, whatever
  the repeats (the adaptive window then answers 0 and remembers no key).
- Memory is bounded: the gap table keeps the ``capacity`` most recently seen keys
  (``carpool.lru``).
- The policies read no clock: the flight group passes ``now`` (its ``clock.monotonic()``).
- The rule is measured against fixed windows in ``benchmarks/bench_window.py``.
"""

from __future__ import annotations

import math
from typing import Protocol

from .lru import LRU

ALPHA = 0.3
MIN_GAPS = 3


class WindowPolicy(Protocol):
    #: The longest window it ever gives (s): how long a finished flight may stay joinable.
    longest: float

    def arrival(self, key: str, now: float) -> None: ...

    def window(self, key: str, now: float, duration: float) -> float: ...


class FixedWindow:
    def __init__(self, seconds: float) -> None:
        self.seconds = self.longest = seconds

    def arrival(self, key: str, now: float) -> None:
        return None

    def window(self, key: str, now: float, duration: float) -> float:
        return self.seconds


class AdaptiveWindow:
    def __init__(
        self, base: float, low: float, high: float, tradeoff: float, capacity: int = 100_000
    ) -> None:
        # The staleness bound first: ``high`` wins should the bounds cross.
        self.low, self.high, self.tradeoff = min(low, high), high, tradeoff
        self.off = base <= 0  # ``window_ms: 0``: no window, whatever the repeats
        # (A new key's window is ``window_ms`` as configured, at most the staleness bound: not
        # raised to ``low``, so a short window asked for is the window a key first sees.)
        self.base = 0.0 if self.off else min(self.high, base)
        self.longest = 0.0 if self.off else self.high
        self.capacity = capacity
        # key -> (last arrival, mean gap, gaps seen): a tuple of numbers, which the garbage
        # collector stops tracking (a hundred thousand lists it would walk every full pass)
        self._keys: LRU[str, tuple[float, float, int]] = LRU(max_entries=capacity)

    def __len__(self) -> int:
        return len(self._keys)

    def arrival(self, key: str, now: float) -> None:
        if self.off:
            return
        seen = self._keys.get(key)  # now the most recently seen
        if seen is None:
            self._keys.put(key, (now, 0.0, 0))
            return
        last, mean, gaps = seen
        gap = now - last
        self._keys.put(key, (now, gap if gaps == 0 else ALPHA * gap + (1 - ALPHA) * mean, gaps + 1))

    def window(self, key: str, now: float, duration: float) -> float:
        seen = self._keys.peek(key)
        if seen is None or seen[2] < MIN_GAPS:
            return self.base  # (clamped, or 0: off)
        best = math.sqrt(duration * duration + self.tradeoff * seen[1]) - duration
        return min(self.high, max(self.low, best))
