"""Waiting for a condition the code under test will make true, bounded, without fixed sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(
    condition: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    """Return as soon as ``condition()`` holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.002)
