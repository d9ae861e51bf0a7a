"""Waiting for a condition the code under test will make true, bounded, without fixed sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

# How long a wait for what the code under test will do may take before the test fails: a bound,
# not a delay (each wait returns as soon as its condition holds). Generous, as on two loaded
# cores (``pytest -n``) 200 concurrent requests took more than 5 s to reach the fake upstream.
WAIT_S = 30.0


async def eventually(
    condition: Callable[[], bool],
    timeout: float = WAIT_S,
    what: str = "condition",
    state: Callable[[], object] | None = None,
) -> None:
    """Return as soon as ``condition()`` holds; fail after ``timeout`` seconds, saying
    ``state()`` then (what a failure seen once in CI needs to be understood)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            seen = "" if state is None else f"; then: {state()!r}"
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{seen}")
        await asyncio.sleep(0.002)


async def cancelled_after(work: Coroutine[Any, Any, Any], steps: int) -> asyncio.Task[Any] | None:
    """Run ``work`` for ``steps`` turns of the loop, then cancel it and return its task once it
    ended (within ``WAIT_S``); None if it had ended by itself before: a sweep over every step
    of a call (``for steps in range(n)``) is over."""
    task = asyncio.get_running_loop().create_task(work)
    for _ in range(steps):
        await asyncio.sleep(0)
    if task.done():
        return None
    task.cancel()
    await asyncio.wait({task}, timeout=WAIT_S)
    return task
