"""One upstream answer fanned out to every client of a flight, streaming or not.

Contract (CONTRACT.md "Streaming"):
- The leader's task ``publish``es SSE frames as they arrive, then ends the broadcast exactly once
  with ``finish(answer)`` or ``fail(error)``. Publishing never waits for any client, so a slow
  client never slows the others (or the upstream).
- ``take`` reads every frame from the first one, so a client that joins late first receives
  every frame emitted so far, then the rest live: the frames from ``sent`` on that are there
  now, joined into one piece of at most about ``JOINED_BYTES`` (a burst of frames is one write
  to a client, not one each), for a caller that ``wait_changed``s for more until the broadcast
  has ended (``done``), then reads ``error`` / ``answer`` to end its own stream. It costs what that piece holds (and a few
  dozen frames' lengths more): a client far behind (a late joiner of a long stream) pays for
  each piece, not for all it has yet to take each time.
- Frames are kept in one shared list, not copied per client: memory is one answer, not N (and
  at most one joined piece per client, which its transport holds until the client reads, or,
  under ``carpool serve``, until it has read nothing for ``limits.send_timeout``: then it is
  cut, and lets go of the flight). ``whole``: the frames joined with their end, once, for the
  idempotency records of its keyed clients (``Relay.with_usage``): one copy for all of them.
- ``wait_started`` returns once there is a frame or an ending; ``wait_done`` once there is an
  ending; ``wait_changed`` once anything was published or it ended (or at once if it has). All
  can be bounded by the caller with ``asyncio.timeout``; a waiter costs one future, and a
  publish wakes only the waiters there are. A waiter that leaves (cancelled: its client gone,
  a timeout) does not leave its future for the next publish to drop, which a stalled flight
  may never make: the futures kept of waiters that left are always fewer than those of the
  waiters still waiting (none, when one waits or none does); a publish only resets a count.
- ``publish_many`` publishes frames that came together, as ``publish`` would one by one, with
  one wake-up of the waiters.
- ``on_publish`` (optional, sync, must not raise) is called after each publish: the
  cross-instance leader (``redis/flights.py``) uses it to forward frames to Redis.
- ``on_abandoned`` (optional, sync, must not raise): when every client of the flight left
  before its end, the flight group (``flight.py``) hands it the cancellation of the call
  instead of cancelling it: the cross-instance leader cancels only once no client of another
  instance waits on the call.
- ``remote`` is true when the frames and the ending were relayed from a call that another gateway
  instance made (this instance's clients of the flight are then all ``coalesced``); ``cached``
  when the answer came from another worker's exact cache (``carpool.peers``: they are ``hit``s),
  and ``created`` (wall-clock) when that answer was made, known from the owner's ``age`` as its
  head comes, before its frames: a streaming client's hit says its ``age`` too.
- ``replayed`` (seconds) is set when the frames and the ending were replayed from a call another
  instance had finished before this one asked (its answer lingering in the window): how old
  that answer was as the replay ended here. The flight (``flight.py``) counts its age and its
  window from the end of that call, and a joiner of it takes it only if that age is one it
  accepts (``pipeline.py``), as for a finished flight of its own. ``may_linger`` is false when
  the leader of a relayed call said its answer may not linger (a ``no-store`` request:
  lingering is a form of storing): it does not linger here either.
- ``lead_times_out`` is set when the flight's lead follows another instance's call
  (``redis/flights.py``): it gives that call up itself at the join timeout (counted from its
  start, which is before any joiner's) and then runs the fresh call in this very flight (as it
  does when it takes a dead leader's call over). A joiner that times out waits on
  (``pipeline.py``) rather than retake: the joiners that time out together share the lead's
  one fresh call, not one of their own besides.
- ``leader_elsewhere`` is true while the frames are relayed from a call that another instance
  leads, read through Redis (``redis/flight_relay.py``): a leader that may have died unseen (its
  death is noticed through its lease, late). A streaming client that joins then takes no frame
  until that call shows life since it came: it ``hold``s, then ``wait_alive``s, which returns
  once the relay said so (``showed_life``: a frame or a renewal of the leader's lease found by a
  read sent after it came), or the relay stopped (the call this instance's own from then, its
  frames live), or the broadcast ended (a dead leader's ``LeaderLost``: the client got
  nothing, and a takeover answers it: ``pipeline.py``).
- ``kept_for`` is the first joiner that would store the answer (its request and fingerprint,
  set by ``pipeline.py``): a ``no-store`` leader's answer is stored for it (``lead.py``), as
  ``no-store`` binds only the request that sends it.
- ``labels`` is what an invalidation names the answer by (``Labels``: its request's tags, its
  namespace, its prompt's start, as its cache entry keeps them) and ``kept`` whether a cache
  keeps it, both set by the lead with the answer (``lead.py``): the flight keeps them while the
  answer lingers in the window, for ``FlightGroup.invalidate``. None: a lead that set none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .answer import Answer
from .errors import CarpoolError

# What an invalidation names an answer by (``store.base.Selector``): its request's tags, its
# namespace, the start of its prompt (``store.base.prompt_text``).
Labels = tuple[tuple[str, ...], str, str]
# The most one joined piece of frames holds (``take``), beyond one frame bigger than that.
JOINED_BYTES = 64 * 1024
# The most frames ``take`` measures at once to give them all in one piece (more: it walks them
# up to ``JOINED_BYTES``): a bounded cost for a client behind, the usual read at C speed.
_MEASURED = 64


class Broadcast:
    __slots__ = (
        "frames",
        "usage_frame",
        "answer",
        "error",
        "remote",
        "cached",
        "created",
        "replayed",
        "may_linger",
        "lead_times_out",
        "leader_elsewhere",
        "holding",
        "lived_for",
        "kept_for",
        "labels",
        "kept",
        "whole",
        "on_publish",
        "on_abandoned",
        "_waiters",
        "_left",
    )

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.usage_frame: int | None = None
        self.answer: Answer | None = None
        self.error: CarpoolError | None = None
        self.remote = False
        self.cached = False
        self.created: float | None = None  # (the answer's, when its head said: ``age``)
        self.replayed: float | None = None  # (a replay: its answer's age as it ended here)
        self.may_linger = True  # (False: relayed from a leader whose answer may not linger)
        self.lead_times_out = False  # (its lead follows another instance's call: see above)
        self.leader_elsewhere = False  # (relayed from a leader that may have died: see above)
        self.holding = 0  # clients that held so far (``hold``), numbered in order
        self.lived_for = 0  # the call showed life since the first that many came
        self.kept_for: Any = None  # (a joiner that keeps what its no-store leader will not)
        self.labels: Labels | None = None  # (what an invalidation names the answer by)
        self.kept = False  # (a cache keeps the answer: the window's copy is not its only one)
        self.whole: bytes | None = None  # (the frames and the stream's end, once it ended whole)
        self.on_publish: Callable[[], None] | None = None
        self.on_abandoned: Callable[[Callable[[], object]], None] | None = None
        self._waiters: list[asyncio.Future[None]] | None = None  # (a list while some wait)
        self._left = 0  # futures in ``_waiters`` whose waiter left (or more: see ``_leave``)

    @property
    def done(self) -> bool:
        return self.answer is not None or self.error is not None

    def publish(self, frame: bytes, usage_only: bool = False) -> None:
        self.publish_many([frame], 0 if usage_only else None)

    def publish_many(self, frames: list[bytes], usage_only: int | None = None) -> None:
        """``frames`` in order; ``usage_only``: the index among them of the usage-only one."""
        if usage_only is not None:
            self.usage_frame = len(self.frames) + usage_only
        self.frames.extend(frames)
        if self._waiters:
            self._wake()
        if self.on_publish is not None:
            self.on_publish()

    def finish(self, answer: Answer) -> None:
        if not self.done:
            self.answer = answer
            self._wake()

    def fail(self, error: CarpoolError) -> None:
        if not self.done:
            self.error = error
            self._wake()

    def _wake(self) -> None:
        # Every waiter wakes once, then waits again with a future of its own (a cancelled
        # waiter cancels only its own).
        waiters, self._waiters = self._waiters, None
        self._left = 0
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    async def wait_changed(self) -> None:
        """Until the next frame or the ending (at once if it has ended)."""
        if self.done:
            return
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = [waiter]
        else:
            self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            self._leave(waiter)
            raise

    def _leave(self, waiter: asyncio.Future[None]) -> None:
        """A waiter left before it was woken: its future out of ``_waiters``, which a flight
        that publishes nothing more would otherwise keep, with every other that came and went.
        Not searched for one by one (a crowd leaving at once, as a stalled flight's joiners
        time out together, would take time quadratic in its size): counted, and the list
        rebuilt without the futures that are done once they are half of it, so each leaving
        costs O(1) amortized and publishing nothing more."""
        if waiter.done() and not waiter.cancelled():
            return  # (woken, then cancelled before it ran: ``_wake`` took the list away)
        waiter.cancel()  # (left otherwise than by cancellation: done, so that it is dropped)
        waiters = self._waiters
        if waiters is None:
            return
        # (The count may take in a future of a list ``_wake`` took since: the list is then
        # rebuilt sooner, never kept longer.)
        self._left += 1
        if 2 * self._left >= len(waiters):
            self._waiters = [w for w in waiters if not w.done()] or None
            self._left = 0

    def hold(self) -> int:
        """A client joining a call led elsewhere (``leader_elsewhere``) holds its replay: its
        number, for ``wait_alive``."""
        self.holding += 1
        return self.holding

    async def wait_alive(self, number: int) -> None:
        """Until the call shows life since the client ``number`` came (``showed_life``), or the
        broadcast ends."""
        while self.lived_for < number and not self.done:
            await self.wait_changed()

    def showed_life(self, upto: int) -> None:
        """The call showed life since the first ``upto`` clients that held came: they take it."""
        if upto > self.lived_for:
            self.lived_for = upto
            self._wake()

    async def wait_started(self) -> None:
        while not self.frames and not self.done:
            await self.wait_changed()

    async def wait_done(self) -> None:
        while not self.done:
            await self.wait_changed()

    def take(self, sent: int, include_usage: bool) -> tuple[bytes, int]:
        """(the frames from index ``sent`` on that are there now, joined, up to about
        ``JOINED_BYTES``; the index to take from next)."""
        frames = self.frames
        end = len(frames)
        if sent >= end:
            return b"", sent
        skip = None if include_usage else self.usage_frame
        if end - sent == 1:
            return (b"" if sent == skip else frames[sent]), end
        if end - sent <= _MEASURED:
            # The usual read, a client keeping up: every frame there (but the usage one, if
            # skipped) in one piece, measured and joined at C speed when it is within the bound.
            if skip is not None and sent <= skip < end:
                run = frames[sent:skip] + frames[skip + 1 : end]
            else:
                run = frames[sent:end]
            if sum(map(len, run)) <= JOINED_BYTES:
                return b"".join(run), end
        # A client further behind (a late joiner of a long stream): the frames from ``sent`` on
        # up to the bound, and only those, read and joined. It pays for what it takes, not for
        # all it has yet to take at each take (that was quadratic in the stream's size).
        pieces: list[bytes] = []
        size = 0
        while sent < end and size < JOINED_BYTES:
            if sent != skip:
                frame = frames[sent]
                pieces.append(frame)
                size += len(frame)
            sent += 1
        if size == JOINED_BYTES:
            # Exactly the bound: the piece is everything there if all after it is left out
            # (the usage frame), as a piece under the bound is.
            rest = sent
            while rest < end and (rest == skip or not frames[rest]):
                rest += 1
            if rest == end:
                sent = end
        return (pieces[0] if len(pieces) == 1 else b"".join(pieces)), sent
