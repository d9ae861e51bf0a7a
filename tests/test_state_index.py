"""The state index (``carpool.state_index``): what a stored response's DELETE drops, bounded."""

from __future__ import annotations

import asyncio

from carpool.state_index import PER_TAG, Held, StateIndex
from carpool.store.base import state_tag


def _recording(max_entries: int) -> tuple[StateIndex, list[Held]]:
    """An index of ``max_entries`` tags and what its ``evicted`` is handed to forget."""
    index = StateIndex(max_entries=max_entries)
    forgotten: list[Held] = []

    async def evicted(held: Held) -> None:
        forgotten.append(held)

    index.evicted = evicted
    return index, forgotten


async def test_one_response_continued_by_every_request_holds_a_bounded_list():
    """Each continuation of one stored response was added under its tag, which every add made
    the most recent: the tags were bounded, the keys under that one were not (each long gone
    from the cache). A tag holding ``PER_TAG`` answers lets its oldest go (forgotten) for
    each one added, which stays indexed."""
    index, forgotten = _recording(100)
    for n in range(5 * PER_TAG):
        index.add(["\nstate P", f"\nstate R{n}"], [f"key-{n}"])
        assert index.answers("\nstate P") <= PER_TAG
        assert index.answers("\nstate P") >= 1  # (the answer being stored: indexed)
    await asyncio.sleep(0)  # (the forgetting tasks run)
    assert sum(len(held.keys) for held in forgotten) >= 4 * PER_TAG
    last = index.take("\nstate P")
    assert f"key-{5 * PER_TAG - 1}" in last.keys


async def test_one_tenants_deletions_never_push_out_another_tenants_deleted_response():
    """The responses deleted lately were remembered in one bound for all tenants: a tenant
    deleting more than it while another tenant's call ran, continuing a response that tenant
    had deleted, pushed it out, and the call stored its answer (served later, though its
    response was gone). A tenant beyond its share now pushes out its own oldest."""
    index = StateIndex(max_entries=10, tombstones=4)
    quiet = state_tag("quiet", "resp_1")
    index.take(quiet)
    flood = [state_tag("loud", f"resp_{n}") for n in range(20)]
    for tag in flood:
        index.take(tag)
    assert index.deleted([quiet])
    assert index.deleted([flood[-1]]) and not index.deleted([flood[0]])
    assert index.fly([quiet], "key-1") == []  # (still known deleted: not indexed)


async def test_the_answers_under_every_tag_are_bounded_and_the_tags_just_added_stay():
    index, forgotten = _recording(10)
    for n in range(200):  # two tags an answer, each tag a few answers
        index.add([f"\nstate A{n % 7}", f"\nstate B{n}"], [f"key-{n}"])
        assert sum(index.answers(f"\nstate A{t}") for t in range(7)) <= 2 * 10
        assert index.answers(f"\nstate B{n}") == 1
    await asyncio.sleep(0)
    assert forgotten  # (what was pushed out was forgotten)


async def test_a_call_indexed_while_it_runs_leaves_nothing_once_it_ends_unkept():
    """A call is indexed from its start (``fly``) under the response it continues, so that a
    DELETE of it shuts the call's flight; one that fails or is not kept (``landed``, not
    lingering) leaves nothing behind, one that lingers stays indexed as a stored answer does,
    and an answer stored meanwhile under the same key stays indexed."""
    index = StateIndex(max_entries=10)
    failed = index.fly(["\nstate P"], "key-1")
    assert index.answers("\nstate P") == 1
    index.landed(failed, "key-1", lingers=False)
    assert index.answers("\nstate P") == 0
    lingering = index.fly(["\nstate P"], "key-2")
    index.landed(lingering, "key-2", lingers=True)
    stored = index.fly(["\nstate P"], "key-3")
    index.add(["\nstate P"], ["key-3"])  # (its answer, stored as it ends)
    index.landed(stored, "key-3", lingers=False)
    held = index.take("\nstate P")
    assert list(held.keys) == ["key-2", "key-3"] and not held.flying
    # Deleted: a call continuing it is not indexed (the upstream refuses it).
    assert index.fly(["\nstate P"], "key-4") == [] and index.answers("\nstate P") == 0


async def test_calls_running_count_in_the_bounds_and_are_shut_when_pushed_out():
    index, forgotten = _recording(10)
    running = [index.fly([f"\nstate R{n}"], f"key-{n}") for n in range(100)]
    assert len(index) <= 10 and sum(index.answers(f"\nstate R{n}") for n in range(100)) <= 20
    await asyncio.sleep(0)
    # (What was pushed out had its flights shut: ``Gateway._forget_held`` reads ``flying``.)
    assert {key for held in forgotten for key in held.flying} == {f"key-{n}" for n in range(90)}
    for n, flown in enumerate(running):
        index.landed(flown, f"key-{n}", lingers=False)  # (a pushed-out tag is left as it is)
    assert sum(index.answers(f"\nstate R{n}") for n in range(100)) == 0


async def test_a_pushed_out_tag_whose_forgetting_failed_is_logged(caplog):
    """Forgetting a pushed-out tag's answers asks the layers (Redis too): one that failed was
    left for asyncio's "exception was never retrieved", which a run may never print."""
    index = StateIndex(max_entries=1)
    tried = asyncio.Event()

    async def evicted(held: Held) -> None:
        tried.set()
        raise ConnectionError("redis is down")

    index.evicted = evicted
    index.add(["\nstate A"], ["key-a"])
    index.add(["\nstate B"], ["key-b"])  # (A pushed out)
    await tried.wait()
    await asyncio.sleep(0)  # (its task's done callback runs)
    failed = [r for r in caplog.records if r.name == "carpool.state"]
    assert [r.getMessage() for r in failed] == ["forgetting a pushed-out tag's answers failed"]
    assert isinstance(failed[0].exc_info[1], ConnectionError)


async def test_a_tag_at_its_bound_lets_only_its_oldest_answer_go():
    """A file every request attaches (a bot over one manual) tags every answer: pushed out
    whole at ``PER_TAG`` answers, the tag took all of them from every layer at each 1,024th
    question, and every one was a miss again. Its oldest goes for each one added now; a
    DELETE still takes every answer it holds."""
    index, forgotten = _recording(100)
    manual = state_tag("a", "file-manual")
    for n in range(PER_TAG + 20):
        index.add([manual], [f"key-{n}"])
    await asyncio.sleep(0)  # (the forgetting tasks run)
    assert [key for held in forgotten for key in held.keys] == [f"key-{n}" for n in range(20)]
    assert index.answers(manual) == PER_TAG
    assert set(index.take(manual).keys) == {f"key-{n}" for n in range(20, PER_TAG + 20)}


async def test_a_full_tag_never_lets_go_of_the_answer_being_stored():
    """An answer is indexed twice (its keys before it is put, its semantic entry after), and
    the oldest key went before any entry: once the keys ran out, each answer's entry took the
    key just stored, forgotten from the cache as soon as it was put; and an answer indexed
    under two keys (its own and a shared one) added two, let one go, and the tag grew past
    its bound. The oldest of keys and entries alike goes now, never what is being added."""
    index, forgotten = _recording(10_000)
    tag = state_tag("a", "file-report")
    for n in range(2 * PER_TAG):
        index.add([tag], [f"key-{n}", f"shared-{n}"])
        index.add([tag], entry=n)
        assert index.answers(tag) <= PER_TAG
    await asyncio.sleep(0)  # (the forgetting tasks run)
    gone = {item for held in forgotten for item in (*held.keys, *held.entries)}
    last = 2 * PER_TAG - 1
    assert not gone & {f"key-{last}", f"shared-{last}", last}
    held = index.take(tag)
    assert {f"key-{last}", f"shared-{last}"} <= set(held.keys) and last in held.entries


async def test_an_answer_stored_again_is_the_newest_of_its_full_tag():
    """An answer stored again (its entry expired, evicted by the cache's bound, asked with
    no-cache) kept its first place, the oldest: its semantic entry's index let its key go,
    forgotten from the cache as soon as it was put again."""
    index, forgotten = _recording(10_000)
    tag = state_tag("a", "file-report")
    for n in range(PER_TAG):
        index.add([tag], [f"key-{n}"])
    index.add([tag], ["key-0"])  # (stored again)
    index.add([tag], entry=1)
    await asyncio.sleep(0)
    assert [key for held in forgotten for key in held.keys] == ["key-1"]
    assert "key-0" in index.take(tag).keys
