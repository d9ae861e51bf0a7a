"""The coalescing window policies (carpool.window)."""

from __future__ import annotations

import math

from carpool.config import CoalesceConfig
from carpool.window import MIN_GAPS, AdaptiveWindow, FixedWindow
from carpool.wiring import window_policy


def test_fixed_window_is_always_window_ms():
    policy = window_policy(CoalesceConfig(adaptive=False, window_ms=250))
    assert isinstance(policy, FixedWindow)
    for t in range(5):
        policy.arrival("k", t)
    assert policy.window("k", 5, 1.0) == 0.25


def test_adaptive_window_is_window_ms_until_a_key_has_repeated_enough():
    policy = AdaptiveWindow(1.0, 0.05, 3.0, tradeoff=8.0)
    for t in range(MIN_GAPS):
        policy.arrival("k", t * 0.01)
        assert policy.window("k", t * 0.01, 0.5) == 1.0


def test_a_hot_key_gets_a_short_window_and_a_rare_key_a_long_one():
    policy = AdaptiveWindow(1.0, 0.05, 3.0, tradeoff=8.0)
    for i in range(10):
        policy.arrival("hot", i * 0.01)  # asked every 10 ms
        policy.arrival("rare", i * 2.0)  # asked every 2 s
    hot, rare = policy.window("hot", 1, 0.8), policy.window("rare", 20, 0.8)
    assert hot == max(0.05, math.sqrt(0.8**2 + 8.0 * 0.01) - 0.8)
    assert hot < 0.1 and rare == 3.0  # the staleness bound caps it


def test_adaptive_window_never_exceeds_the_staleness_bound_or_goes_below_the_minimum():
    policy = AdaptiveWindow(1.0, 0.05, 3.0, tradeoff=1000.0)
    for i in range(10):
        policy.arrival("k", i * 100.0)
    assert policy.window("k", 1000, 0.0) == 3.0
    for i in range(10):
        policy.arrival("z", i * 1e-6)
    assert policy.window("z", 1, 5.0) == 0.05


def test_the_gap_table_is_bounded():
    policy = AdaptiveWindow(1.0, 0.05, 3.0, tradeoff=8.0, capacity=100)
    for i in range(1000):
        policy.arrival(f"k{i}", i)
    assert len(policy) == 100


def test_the_adaptive_window_keeps_within_its_bounds_before_a_key_has_repeated_enough_too():
    """``max_window_ms`` is the staleness bound for every key, a new one's window (``window_ms``)
    included (a shorter one is kept as asked); should the bounds cross, the staleness bound
    wins."""
    for base, first in [(5.0, 3.0), (0.01, 0.01), (1.0, 1.0)]:
        policy = AdaptiveWindow(base, 0.05, 3.0, tradeoff=8.0)
        assert policy.window("new", 0, 0.5) == first and policy.longest == 3.0
    crossed = AdaptiveWindow(1.0, 5.0, 3.0, tradeoff=1000.0)
    for i in range(10):
        crossed.arrival("k", i * 100.0)
    assert crossed.window("new", 0, 0.5) == 1.0 and crossed.window("k", 1000, 0.0) == 3.0
    assert crossed.longest == 3.0


def test_window_ms_0_is_no_window_adaptive_or_not():
    for adaptive in (True, False):
        policy = window_policy(CoalesceConfig(window_ms=0, adaptive=adaptive))
        for i in range(10):
            policy.arrival("k", i * 0.5)
        assert policy.window("k", 5, 0.1) == 0 and policy.longest == 0
    assert len(window_policy(CoalesceConfig(window_ms=0))) == 0  # (no key remembered)
