"""The state index (``carpool.state_index``): what a stored response's DELETE drops, bounded."""

from __future__ import annotations

import asyncio

from carpool.state_index import PER_TAG, Held, StateIndex


async def test_one_response_continued_by_every_request_holds_a_bounded_list():
    """Each continuation of one stored response was added under its tag, which every add made
    the most recent: the tags were bounded, the keys under that one were not (each long gone
    from the cache). A tag over ``PER_TAG`` answers is pushed out whole (its answers
    forgotten) and starts again with the one being stored, which stays indexed."""
    index = StateIndex(max_entries=100)
    forgotten: list[Held] = []

    async def evicted(held: Held) -> None:
        forgotten.append(held)

    index.evicted = evicted
    for n in range(5 * PER_TAG):
        index.add(["\nstate P", f"\nstate R{n}"], [f"key-{n}"])
        assert index.answers("\nstate P") <= PER_TAG
        assert index.answers("\nstate P") >= 1  # (the answer being stored: indexed)
    await asyncio.sleep(0)  # (the forgetting tasks run)
    assert sum(len(held.keys) for held in forgotten) >= 4 * PER_TAG
    last = index.take("\nstate P")
    assert f"key-{5 * PER_TAG - 1}" in last.keys


async def test_the_answers_under_every_tag_are_bounded_and_the_tags_just_added_stay():
    index = StateIndex(max_entries=10)
    forgotten: list[Held] = []

    async def evicted(held: Held) -> None:
        forgotten.append(held)

    index.evicted = evicted
    for n in range(200):  # two tags an answer, each tag a few answers
        index.add([f"\nstate A{n % 7}", f"\nstate B{n}"], [f"key-{n}"])
        assert sum(index.answers(f"\nstate A{t}") for t in range(7)) <= 2 * 10
        assert index.answers(f"\nstate B{n}") == 1
    await asyncio.sleep(0)
    assert forgotten  # (what was pushed out was forgotten)
