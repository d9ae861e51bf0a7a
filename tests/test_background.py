"""``carpool.background``: a layer's work off its callers' path, kept, logged, drained."""

from __future__ import annotations

import asyncio
import logging

from carpool.background import Background

LOG = logging.getLogger("carpool.test_background")  # (a layer's own logger)


async def test_background_work_is_held_until_it_ends_and_a_failure_is_logged_with_what_it_was(
    caplog,
):
    background = Background("publishing a test entry", LOG)
    go, fail = asyncio.Event(), asyncio.Event()

    async def work(event: asyncio.Event, error: Exception | None) -> None:
        await event.wait()
        if error is not None:
            raise error

    kept = background.spawn(work(go, None))
    failing = background.spawn(work(fail, RuntimeError("boom")))
    assert set(background) == {kept, failing} and len(background) == 2
    with caplog.at_level("ERROR", logger=LOG.name):
        go.set()
        fail.set()
        await asyncio.wait({kept, failing})
        await asyncio.sleep(0)  # (the done callbacks run in the next turn)
    assert not background
    failed = [r for r in caplog.records if r.getMessage() == "publishing a test entry failed"]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert isinstance(failed[0].exc_info[1], RuntimeError)


async def test_background_drain_lets_work_end_for_its_grace_then_cancels_the_rest():
    background = Background("test work", LOG)
    quick, stuck = asyncio.Event(), asyncio.Event()
    ended = background.spawn(quick.wait())
    outlasting = background.spawn(stuck.wait())
    quick.set()
    await background.drain(0.05)
    assert ended.done() and not ended.cancelled()
    assert outlasting.cancelled() and not background
    unbounded = Background("test work", LOG)
    finishing = unbounded.spawn(asyncio.sleep(0.01))
    await unbounded.drain(None)  # (as long as it takes)
    assert finishing.done() and not finishing.cancelled()
