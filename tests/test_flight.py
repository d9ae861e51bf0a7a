"""The single-flight contract of carpool.flight, one test per clause (see the module docstring).

Time that a flight reads (its window, its age) passes on a ``ManualClock``; the join timeouts
are asyncio's and run on the event loop's time.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.answer import Answer
from carpool.broadcast import JOINED_BYTES, Broadcast
from carpool.clock import ManualClock
from carpool.errors import FlightAbandoned, UpstreamTimeout
from carpool.flight import FlightGroup, JoinTimeout
from fakes.waiting import eventually


class Upstream:
    """A lead function whose calls are counted and held until the test releases them."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = 0
        self.error: Exception | None = None
        self.complete = True

    async def __call__(self, broadcast: Broadcast) -> Answer:
        self.calls += 1
        n = self.calls
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return Answer("chat", f"answer {n}".encode(), self.complete)


async def wait_answer(ticket, timeout=None):
    try:
        await ticket.wait_done(timeout)
        return ticket.broadcast.answer, ticket.broadcast.error
    finally:
        ticket.release()


async def test_concurrent_identical_requests_make_one_upstream_call_and_share_the_answer():
    group, upstream = FlightGroup(window=0), Upstream()
    tickets = [group.acquire("k", upstream) for _ in range(100)]
    assert [t.leader for t in tickets].count(True) == 1
    waiting = [asyncio.create_task(wait_answer(t)) for t in tickets]
    upstream.release.set()
    results = await asyncio.gather(*waiting)
    assert upstream.calls == 1
    assert {answer.body for answer, _ in results} == {b"answer 1"}


async def test_leader_error_reaches_every_waiter_and_is_never_kept():
    group, upstream = FlightGroup(window=10), Upstream()
    upstream.error = UpstreamTimeout("too slow")
    tickets = [group.acquire("k", upstream) for _ in range(5)]
    waiting = [asyncio.create_task(wait_answer(t)) for t in tickets]
    upstream.release.set()
    results = await asyncio.gather(*waiting)
    assert all(answer is None and error is upstream.error for answer, error in results)
    assert group.get("k") is None  # not joinable, not lingering: the next call is fresh
    upstream.error = None
    answer, _ = await wait_answer(group.acquire("k", upstream))
    assert answer.body == b"answer 2"


async def test_finished_flight_stays_joinable_for_the_window_then_is_gone():
    clock = ManualClock()
    # (Steps of a power of two: added to a clock reading of any size they sum exactly, so the
    # window ends at the second step whatever the machine's uptime; 0.04 + 0.01 may not.)
    group, upstream = FlightGroup(window=0.0625, clock=clock), Upstream()
    upstream.release.set()
    first = group.acquire("k", upstream)
    await wait_answer(first)
    flight = group.get("k")
    assert flight is not None and flight.broadcast.done
    clock.advance(0.046875)  # (3/64)
    assert group.joinable("k")
    joiner = group.acquire("k", upstream)
    assert not joiner.leader
    assert (await wait_answer(joiner))[0].body == b"answer 1"
    clock.advance(0.015625)  # (1/64): the window has closed
    assert group.get("k") is None and not group.joinable("k")
    assert upstream.calls == 1
    assert (await wait_answer(group.acquire("k", upstream)))[0].body == b"answer 2"


class PerKeyWindow:
    """A window policy that gives each key the window the test names."""

    def __init__(self, windows: dict[str, float]) -> None:
        self.windows = windows
        self.longest = max(windows.values())

    def arrival(self, key: str, now: float) -> None:
        return None

    def window(self, key: str, now: float, duration: float) -> float:
        return self.windows[key]


async def test_lingering_flights_nobody_asks_for_are_freed_as_their_windows_end():
    """One timer frees them all (the earliest end first, whatever order they finished in), and
    a clock held still keeps them until the windows end on it."""
    clock = ManualClock()
    group = FlightGroup(window=PerKeyWindow({"long": 0.08, "short": 0.02}), clock=clock)
    for key in ("long", "short"):
        upstream = Upstream()
        upstream.release.set()
        await wait_answer(group.acquire(key, upstream))
    assert len(group) == 2
    await asyncio.sleep(0.05)
    assert len(group) == 2  # the loop's time passed, the group's clock did not
    clock.advance(0.03)
    await asyncio.sleep(0.05)
    assert len(group) == 1 and group.get("long") is not None
    clock.advance(0.06)  # (past 0.08, not at it: 0.03 + 0.05 may sum below it)
    await asyncio.sleep(0.1)
    assert len(group) == 0


async def test_a_finished_flight_is_joined_only_while_younger_than_max_age():
    clock = ManualClock()
    group, upstream = FlightGroup(window=10, clock=clock), Upstream()
    upstream.release.set()
    await wait_answer(group.acquire("k", upstream))
    clock.advance(2)
    assert group.joinable("k", max_age=2.5) and not group.joinable("k", max_age=2)
    joiner = group.acquire("k", upstream, max_age=2.5)
    assert not joiner.leader
    joiner.release()
    fresh = group.acquire("k", upstream, max_age=2)  # too old for it: a fresh call
    assert fresh.leader
    assert (await wait_answer(fresh))[0].body == b"answer 2"


async def test_a_flight_that_replayed_a_finished_call_is_as_old_as_that_call():
    """Its age (``max_age``) and its window count from the end of the call it replayed
    (``Broadcast.replayed``), not from the replay; a relayed answer its remote leader said may
    not linger (``Broadcast.may_linger``) does not."""
    clock = ManualClock()
    group = FlightGroup(
        window=PerKeyWindow({"replayed": 8, "too old": 4, "no-store": 8}), clock=clock
    )

    def relayed(age: float | None, may_linger: bool = True):
        async def lead(broadcast: Broadcast) -> Answer:
            broadcast.remote, broadcast.replayed, broadcast.may_linger = True, age, may_linger
            return Answer("chat", b"replayed", True)

        return lead

    await wait_answer(group.acquire("replayed", relayed(5)))  # (ended 5 s before the replay)
    assert group.joinable("replayed", max_age=6) and not group.joinable("replayed", max_age=5)
    clock.advance(2.5)  # (7.5 s after that call ended)
    assert group.joinable("replayed")
    clock.advance(1)  # (8.5 s: its window has closed)
    assert not group.joinable("replayed")
    await wait_answer(group.acquire("too old", relayed(5)))  # (its window ended 1 s ago)
    assert group.get("too old") is None
    await wait_answer(group.acquire("no-store", relayed(None, may_linger=False)))
    assert group.get("no-store") is None


async def test_incomplete_answer_does_not_linger_in_the_window():
    group, upstream = FlightGroup(window=10), Upstream()
    upstream.complete = False
    upstream.release.set()
    await wait_answer(group.acquire("k", upstream))
    assert group.get("k") is None


@pytest.mark.parametrize("answered", ["the broadcast's frames", "frames of its own", "whole"])
async def test_a_lingering_flight_is_a_tuple_the_collector_stops_walking_joiners_get_it_equal(
    answered,
):
    """Clause 3: a finished flight lingers as a plain tuple (no flight, broadcast, answer or
    frames list for the garbage collector to walk: untracked after one pass); a request that
    joins it gets a finished flight made again, its frames and its answer equal to the
    original's (the answer's frames the broadcast's list, a list of their own, or none), and
    the next joiner shares that flight."""
    group = FlightGroup(window=10)
    frames = [b"data: 1\n\n", b"data: usage\n\n", b"data: 2\n\n"]

    async def lead(broadcast: Broadcast) -> Answer:
        if answered == "whole":
            return Answer("chat", b"body", True, 7, 123.0)
        broadcast.publish_many(list(frames), 1)
        own = broadcast.frames if answered == "the broadcast's frames" else frames[::2]
        return Answer("chat", b"body", True, 7, 123.0, own, usage_frame=broadcast.usage_frame)

    led, _ = await wait_answer(group.acquire("k", lead))
    held = group._flights["k"]
    assert type(held) is tuple
    gc.collect()
    assert not gc.is_tracked(held)
    joiner = group.acquire("k", lead)
    broadcast, again = joiner.broadcast, group.acquire("k", lead)
    assert not joiner.leader and not again.leader and again.flight is joiner.flight
    assert broadcast.done and broadcast.frames == ([] if answered == "whole" else frames)
    assert broadcast.usage_frame == (None if answered == "whole" else 1)
    answer = broadcast.answer
    assert answer is not None and answer is not led
    if answered == "the broadcast's frames":
        assert answer.frames is broadcast.frames

    def fields(a: Answer) -> tuple:
        return (a.kind, a.body, a.complete, a.tokens, a.created, a.frames, a.usage_frame)

    assert fields(answer) == fields(led)
    joiner.release()
    again.release()


async def test_forget_starts_a_fresh_flight_and_the_old_one_finishing_never_removes_it():
    group = FlightGroup(window=10)
    old, new = Upstream(), Upstream()
    old_ticket = group.acquire("k", old)
    await old.started.wait()
    group.forget("k")
    new_ticket = group.acquire("k", new)
    assert new_ticket.leader and new_ticket.flight is not old_ticket.flight
    old.release.set()
    await wait_answer(old_ticket)
    assert group.get("k") is new_ticket.flight  # the old flight's end did not remove it
    new.release.set()
    await wait_answer(new_ticket)


async def test_leader_client_leaving_does_not_cancel_the_call_while_others_wait():
    group, upstream = FlightGroup(window=0), Upstream()
    leader = group.acquire("k", upstream)
    joiner = group.acquire("k", upstream)
    await upstream.started.wait()
    leader.release()  # the leader's client disconnected
    upstream.release.set()
    answer, error = await wait_answer(joiner)
    assert error is None and answer.body == b"answer 1"
    assert upstream.cancelled == 0


async def test_upstream_call_is_cancelled_when_all_clients_have_gone():
    group, upstream = FlightGroup(window=0), Upstream()
    tickets = [group.acquire("k", upstream) for _ in range(3)]
    await upstream.started.wait()
    flight = tickets[0].flight
    for ticket in tickets:
        ticket.release()
    await flight.task
    assert upstream.cancelled == 1
    assert isinstance(flight.broadcast.error, FlightAbandoned)
    assert group.get("k") is None  # a later request starts afresh


async def test_upstream_call_is_cancelled_when_all_clients_have_gone_by_a_lead_that_asks_to():
    """A lead whose call others may wait on elsewhere (``Broadcast.on_abandoned``) is handed
    the cancellation: the call runs until it uses it; the flight is dropped at once."""
    group, upstream, handed = FlightGroup(window=0), Upstream(), []

    async def lead(broadcast: Broadcast) -> Answer:
        broadcast.on_abandoned = handed.append
        return await upstream(broadcast)

    ticket = group.acquire("k", lead)
    await upstream.started.wait()
    task, flight = ticket.flight.task, ticket.flight
    ticket.release()
    assert len(handed) == 1 and group.get("k") is None
    await asyncio.sleep(0)
    assert not task.done() and upstream.cancelled == 0
    handed[0]()
    await task
    assert upstream.cancelled == 1 and isinstance(flight.broadcast.error, FlightAbandoned)


async def test_upstream_call_is_finished_when_all_clients_have_gone_with_finish_abandoned():
    group, upstream = FlightGroup(window=10, finish_abandoned=True), Upstream()
    ticket = group.acquire("k", upstream)
    await upstream.started.wait()
    ticket.release()
    upstream.release.set()
    await ticket.flight.task
    assert upstream.cancelled == 0
    assert ticket.flight.broadcast.answer.body == b"answer 1"


async def test_joiner_waiting_longer_than_join_timeout_runs_its_own_call():
    group, slow = FlightGroup(window=0), Upstream()
    leader = group.acquire("k", slow)
    joiner = group.acquire("k", slow)
    await slow.started.wait()
    with pytest.raises(JoinTimeout):
        await joiner.wait_done(0.01)
    fresh = Upstream()
    fresh.release.set()
    retaken = joiner.retake(fresh)
    assert retaken.leader  # it leads a fresh flight of its own
    answer, _ = await wait_answer(retaken)
    assert answer.body == b"answer 1" and fresh.calls == 1
    slow.release.set()
    assert (await wait_answer(leader))[0] is not None  # the slow leader still gets its answer


async def test_timed_out_joiners_share_one_fresh_call():
    group, slow, fresh = FlightGroup(window=0), Upstream(), Upstream()
    group.acquire("k", slow)
    joiners = [group.acquire("k", slow) for _ in range(3)]
    for joiner in joiners:
        with pytest.raises(JoinTimeout):
            await joiner.wait_done(0.001)
    retaken = [joiner.retake(fresh) for joiner in joiners]
    assert [t.leader for t in retaken] == [True, False, False]
    fresh.release.set()
    await asyncio.gather(*(wait_answer(t) for t in retaken))
    assert fresh.calls == 1
    slow.release.set()


async def test_a_joiner_that_times_out_retakes_on_the_terms_it_acquired_on():
    group, slow = FlightGroup(window=10, clock=ManualClock()), Upstream()
    group.acquire("k", slow)
    no_store = group.acquire("k", slow, linger=False)
    no_cache = group.acquire("k", slow, max_age=0)
    plain = group.acquire("k", slow)
    await slow.started.wait()
    for joiner in (no_store, plain, no_cache):
        with pytest.raises(JoinTimeout):
            await joiner.wait_done(0.001)
    # A no-store request's fresh call does not linger once finished.
    own = Upstream()
    own.release.set()
    await wait_answer(no_store.retake(own))
    assert group.get("k") is None
    # A plain one's does: a no-cache request that times out then leads a call of its own.
    fresh, again = Upstream(), Upstream()
    fresh.release.set()
    await wait_answer(plain.retake(fresh))
    assert group.get("k") is not None  # lingering in its window
    retaken = no_cache.retake(again)
    assert retaken.leader
    again.release.set()
    answer, _ = await wait_answer(retaken)
    assert answer.body == b"answer 1" and again.calls == 1
    slow.release.set()


@pytest.mark.parametrize("ending", ["answer", "error", "cancel", "bug"])
async def test_no_waiter_hangs_on_any_exit_path(ending):
    group = FlightGroup(window=0, finish_abandoned=False)
    gate = asyncio.Event()

    async def lead(broadcast: Broadcast) -> Answer:
        broadcast.publish(b"data: {}\n\n")
        await gate.wait()
        if ending == "error":
            raise UpstreamTimeout("slow")
        if ending == "bug":
            raise KeyError("a bug in the lead function")
        return Answer("chat", b"{}", True)

    tickets = [group.acquire("k", lead) for _ in range(10)]
    waiting = [asyncio.create_task(wait_answer(t)) for t in tickets[1:]]
    followers = [asyncio.create_task(_follow_all(t.broadcast)) for t in tickets[1:]]
    await asyncio.sleep(0)
    if ending == "cancel":
        tickets[0].flight.task.cancel()
    gate.set()
    tickets[0].release()
    async with asyncio.timeout(5):
        results = await asyncio.gather(*waiting)
        await asyncio.gather(*followers)
    assert all((answer is None) != (error is None) for answer, error in results)
    assert group.waiters == 0


async def _follow_all(broadcast: Broadcast) -> list[bytes]:
    """Every piece of the broadcast, as a client's relay takes them, until it ends."""
    pieces, sent = [], 0
    while True:
        piece, sent = broadcast.take(sent, include_usage=True)
        if piece:
            pieces.append(piece)
        elif broadcast.done:
            return pieces
        else:
            await broadcast.wait_changed()


async def test_a_flight_acquired_without_linger_is_gone_as_soon_as_it_finishes():
    group, upstream = FlightGroup(window=10), Upstream()
    upstream.release.set()
    await wait_answer(group.acquire("k", upstream, linger=False))
    assert group.get("k") is None


async def test_forget_all_drops_running_and_lingering_flights_and_moves_the_epoch_on():
    group, done, running = FlightGroup(window=10), Upstream(), Upstream()
    done.release.set()
    await wait_answer(group.acquire("a", done))
    ticket = group.acquire("b", running)
    assert group.forget_all() == 2 and group.epoch == 1
    assert group.get("a") is None and group.get("b") is None
    # The running call goes on for the client it had; a new request leads a fresh one.
    fresh = group.acquire("b", running)
    assert fresh.leader and fresh.flight is not ticket.flight
    running.release.set()
    await wait_answer(ticket)
    await wait_answer(fresh)


async def test_invalidate_forgets_the_running_flights_and_only_the_lingering_ones_it_picks():
    clock = ManualClock()
    group, running = FlightGroup(window=10, clock=clock), Upstream()

    def labelled(labels, kept):
        async def lead(broadcast: Broadcast) -> Answer:
            broadcast.labels, broadcast.kept = labels, kept
            return Answer("chat", b"answer", True)

        return lead

    await wait_answer(group.acquire("named", labelled((("t",), "", "q"), False)))
    await wait_answer(group.acquire("stored", labelled((("t",), "", "q"), True)))
    await wait_answer(group.acquire("other", labelled((("u",), "", "q"), False)))
    await wait_answer(group.acquire("unlabelled", labelled(None, False)))
    joiner = group.acquire("named", running)  # (made again from its tuple: a Flight now)
    assert not joiner.leader and joiner.flight.broadcast.labels == (("t",), "", "q")
    joiner.release()
    ticket = group.acquire("running", running)
    dropped = group.invalidate(lambda labels: "t" in labels[0])
    assert sorted(dropped, key=str) == sorted(
        [((("t",), "", "q"), False), ((("t",), "", "q"), True), (None, False)], key=str
    )
    assert group.epoch == 1 and group.get("other") is not None
    assert all(group.get(key) is None for key in ("named", "stored", "unlabelled", "running"))
    running.release.set()
    await wait_answer(ticket)


async def test_live_counts_a_call_forgotten_while_it_runs_until_it_ends():
    group, running, done = FlightGroup(window=10), Upstream(), Upstream()
    done.release.set()
    await wait_answer(group.acquire("lingering", done))
    ticket = group.acquire("running", running)
    assert (len(group), group.live()) == (2, 2)
    group.forget_all()
    assert (len(group), group.live()) == (0, 1)  # (its call runs on, for its client)
    running.release.set()
    await wait_answer(ticket)
    await eventually(lambda: not group.calls, what="the call's end")
    assert group.live() == 0


# --- the broadcast's reads (carpool.broadcast) ----------------------------------------------


class _CountedFrames(list[bytes]):
    """A broadcast's frames that count how many of them are read (an index: one; a slice: its
    length), as the work a ``take`` does: it joins what it reads."""

    read = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        got = super().__getitem__(index)
        self.read += len(got) if isinstance(index, slice) else 1
        return got


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_late_joiner_of_a_big_stream_takes_time_linear_in_its_size(include_usage):
    """A client far behind (a late joiner of a long stream) reads it a piece of about
    ``JOINED_BYTES`` at a time, and each take reads the frames of its piece (and a few more
    near the end): every frame is read about once in all, not all it has yet to take at each
    take (quadratic: a 64 MB stream took 42 s of the event loop every client shares)."""
    frame = b"data: " + b"x" * 2042 + b"\n\n"  # (2 KB: a chunk with its top logprobs)
    count = 8 * 1024 * 1024 // len(frame)  # 8 MB, 128 pieces
    broadcast = Broadcast()
    broadcast.frames = _CountedFrames()
    broadcast.publish_many([frame] * (count // 2))
    broadcast.publish_many([b"data: {usage}\n\n"], 0)  # (left out of a client's not asking)
    broadcast.publish_many([frame] * (count - count // 2))
    frames = broadcast.frames
    assert isinstance(frames, _CountedFrames) and frames.read == 0
    sent, pieces = 0, []
    while sent < len(frames):
        piece, sent = broadcast.take(sent, include_usage)
        assert len(piece) < JOINED_BYTES + len(frame)
        pieces.append(piece)
    read, published, taken = frames.read, len(frames), len(pieces)
    wanted = [f for i, f in enumerate(frames) if include_usage or i != count // 2]
    assert b"".join(pieces) == b"".join(wanted)
    # Each frame read once, and a few more around each piece's end: not the rest each time.
    assert taken >= 8 * 1024 * 1024 // JOINED_BYTES
    assert read <= published + 2 * taken


def _published(frames: list[bytes], usage: int | None, together: list[int]) -> Broadcast:
    """``frames`` published in runs of the sizes ``together`` (what is left: one by one)."""
    broadcast, start = Broadcast(), 0
    for size in together:
        run = frames[start : start + size]
        if run:
            inside = usage - start if usage is not None and start <= usage < start + size else None
            broadcast.publish_many(run, inside)
        start += size
    for index in range(start, len(frames)):
        broadcast.publish(frames[index], index == usage)
    return broadcast


async def test_waiters_that_leave_a_broadcast_publishing_nothing_leave_no_future_behind():
    broadcast = Broadcast()
    staying = asyncio.create_task(broadcast.wait_changed())

    def futures() -> list[asyncio.Future[None]]:
        return list(broadcast._waiters or ())

    for order in (list, reversed, lambda tasks: tasks[::2] + tasks[1::2]):
        # A crowd joins the stalled broadcast, then leaves in some order.
        crowd = [asyncio.create_task(broadcast.wait_changed()) for _ in range(100)]
        await eventually(lambda: len(futures()) == 101, what="the crowd waiting")
        for task in order(crowd):
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Fewer futures of waiters that left than of waiters still waiting.
            left = sum(future.cancelled() for future in futures())
            assert left < sum(not future.done() for future in futures())
        assert len(futures()) == 1 and not staying.done()
    # A waiter bounded by a timeout leaves the same way.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.001):
            await broadcast.wait_started()
    assert len(futures()) == 1
    broadcast.publish(b"data: {}\n\n")
    await staying  # the one still waiting is woken by the next frame
    assert broadcast._waiters is None


@settings(max_examples=200)
@given(
    st.lists(st.integers(1, 40_000), max_size=12),
    st.data(),
)
def test_take_reads_every_frame_once_in_order_in_pieces_of_about_joined_bytes_at_most(sizes, data):
    frames = [bytes([65 + i % 26]) * size for i, size in enumerate(sizes)]
    usage = data.draw(st.none() | st.integers(0, max(0, len(frames) - 1))) if frames else None
    together = data.draw(st.lists(st.integers(0, 5), max_size=4))
    broadcast = _published(frames, usage, together)
    one_by_one = _published(frames, usage, [])
    # Published together or one by one: the same frames, the same usage frame.
    assert (broadcast.frames, broadcast.usage_frame) == (one_by_one.frames, one_by_one.usage_frame)
    for include_usage in (False, True):
        start = sent = data.draw(st.integers(0, len(frames)))
        pieces = []
        while sent < len(frames):
            piece, after = broadcast.take(sent, include_usage)
            assert after > sent
            # At most about the bound: under it before its last frame.
            assert len(piece) < JOINED_BYTES + max(len(f) for f in frames[sent:after])
            pieces.append(piece)
            sent = after
        assert broadcast.take(sent, include_usage) == (b"", sent)
        wanted = [
            frame
            for index, frame in enumerate(frames)
            if index >= start and (include_usage or index != usage)
        ]
        assert b"".join(pieces) == b"".join(wanted)
