"""carpool.clock: the system's clocks, and the manual one tests move."""

from __future__ import annotations

import time

import pytest

from carpool.clock import SYSTEM_CLOCK, Clock, ManualClock, SystemClock


def test_the_system_clock_reads_the_systems_clocks():
    assert SYSTEM_CLOCK.monotonic is time.monotonic and isinstance(SYSTEM_CLOCK, SystemClock)
    before = time.time()
    now = SYSTEM_CLOCK.now()
    # (The wall clock as first read, moved on by the time elapsed since: off the system's by
    # no more than the steps it took meanwhile, none here.)
    assert before - 0.5 <= now <= time.time() + 0.5
    assert SystemClock().now() >= now


def test_a_manual_clock_stands_still_until_advanced_and_moves_both_readings_alike():
    clock: Clock = ManualClock(now=1_000.0, monotonic=5.0)
    assert (clock.now(), clock.monotonic()) == (1_000.0, 5.0)
    assert (clock.now(), clock.monotonic()) == (1_000.0, 5.0)  # reading it moves nothing
    assert isinstance(clock, ManualClock)
    clock.advance(2.5)
    assert (clock.now(), clock.monotonic()) == (1_002.5, 7.5)
    clock.advance(0)
    assert (clock.now(), clock.monotonic()) == (1_002.5, 7.5)


def test_a_manual_clock_starts_at_the_systems_readings():
    before_wall, before_mono = time.time(), time.monotonic()
    clock = ManualClock()
    assert before_wall <= clock.now() <= time.time()
    assert before_mono <= clock.monotonic() <= time.monotonic()


def test_a_manual_clock_never_goes_backwards():
    clock = ManualClock(now=10.0, monotonic=10.0)
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert (clock.now(), clock.monotonic()) == (10.0, 10.0)
