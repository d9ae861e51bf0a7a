"""The follower's side of a cross-instance flight (:mod:`.flights`): the relay of a remote
leader's stream to the local clients.

A follower reads the stream from its start (replay), then blocks for new entries (XREAD BLOCK
of at most min(lease/3, ``distributed.timeout``/2), so that the client's socket timeout never
cuts a block), publishing each frame into its LOCAL broadcast: every local client of the
flight, streaming or not, early or late, is served exactly as if this instance led. On the
final record it returns the same ``Answer`` (or raises the same error); it never stores it (the
leader does), nor lets it linger in this instance's window when the record says it may not
(``Broadcast.may_linger``: a ``no-store`` leader's). The local broadcast is marked ``remote``:
this instance's clients are all ``coalesced``.

A follower's first read does not block: it sees what the stream holds when it comes. Those
frames (a late joiner's replay) are held until the leader shows life since: a newer entry, or
its lock renewed (its expiry moved on: read in the same round trips while they are held). So
a request that comes after its leader died (its lock not expired yet) relays nothing of the
dead call, and is answered whole by a takeover; one that comes as its leader leaves (``gone``)
too. A live leader's replay waits for its next entry, or about one renewal period (lease/3)
and one block at most. Each read sets the call's followed key (``watch``), so that a leader
whose own clients all left goes on.

The same holds for a streaming client that joins the local flight while it relays
(``Broadcast.leader_elsewhere``): it holds the frames relayed so far (``Broadcast.hold``) until
the call shows life since it came, which the follower tells it (``Broadcast.showed_life``): new
entries, or the lock renewed, found by a read after one sent once it came (that one read the
stream to its end; the lock's expiry is read in the same round trips while a client holds). So
one that joins after the leader died takes none of the dead call's frames: the flight ends with
``LeaderLost`` before, and the client, which got nothing, is answered by a takeover
(``pipeline.py``). A live leader's joiner waits about what a replay does, and one read more.

A leader's death is noticed through its lock, read in the same round trip as each XREAD: the
lock is gone or names another leader (and the leader's call is not set aside, still running,
in its stale key: an invalidation came, and a fresh call took the lock), and one more read
finds no final record (so within lease_ms + one block of the death). What the follower does
then (take the call over, or end its flight with ``LeaderLost``) is in the failure rules of
:mod:`.flights`.

A read that fails (Redis stalled longer than ``distributed.timeout``, a reset connection) says
nothing of the leader, whose own link stalls as ours does and renews again after (lease/3): the
follower reads again from where it was (pauses from ``BACKOFF_MIN`` doubling up to one block),
its clients waiting, until Redis has failed it for lease_ms since it last answered (or, having
seen nothing of the call, until the join timeout): a stall shorter than the lease costs its
clients nothing. Past that, it gives up as the failure rules say (``DOWN``, or ``LeaderLost``
with frames relayed). A client is never told Redis's address or error (``LOST``): the log is.

An entry it cannot read (``flight_protocol.Unreadable``: something else wrote it, a record of
another form, an answer of another API than the request's, a status no HTTP status; or a key
of another type where the stream or the lock belongs, ``WRONGTYPE``) is taken as its leader
gone, at once: nothing relayed, ``GONE`` (the follower claims again, and runs the call alone
once its takeovers are spent); frames relayed, ``LeaderLost``. It is logged; Redis answered,
so it is no Redis failure. Before, it failed the request (a 502 "internal error", a 500), or
was served (a 200 with the record's body, a status line 999), and a key of another type was
taken for Redis failing: the instance degraded, the follower reading it again for the lease.

Entries trimmed by MAXLEN before a follower read them (it joined late, or fell that far
behind): with nothing relayed, it skips the frames and serves the answer whole from the final
record (streaming clients get frames synthesized from it); with frames relayed,
``UpstreamStreamBroken``. So is a final record whose frame count is not what was relayed (the
leader's publishing broke).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..answer import Answer
from ..broadcast import Broadcast
from ..errors import LeaderLost
from .connection import Backoff, StoreUnavailable, WrongType, unavailable_in
from .flight_protocol import (
    FOLLOWED,
    Unreadable,
    answer_from,
    error_from,
    final_from,
    frame_from,
    lingers,
)
from .keys import xread_entries

if TYPE_CHECKING:
    from .flights import SharedFlights

__all__ = ["DOWN", "GONE", "LOST", "READ_COUNT", "TIMEOUT", "follow"]

log = logging.getLogger("carpool.flight")

READ_COUNT = 1000  # entries per XREAD

# Why a follow ended without an answer.
GONE = "gone"  # the leader died or left: claim again (nothing was relayed)
TIMEOUT = "timeout"  # nothing within the join timeout: run the call here
DOWN = "unavailable"  # Redis failed: run the call here

# What a client that got part of a relayed stream is told when Redis failed longer than the
# lease (never Redis's address nor its error: those go to the log).
LOST = "lost the stream of the instance leading this call"

_unavailable = unavailable_in("the Redis flights")


async def follow(
    flights: SharedFlights,
    lock: str,
    stream: str,
    aside: str,
    token: str,
    broadcast: Broadcast,
    deadline: float,
    watch: str | None = None,
    kind: str | None = None,
) -> Answer | str:
    """Relay the leader's stream into ``broadcast`` until its final record. ``aside``: the
    leader's stale key (its call set aside by an invalidation, it still runs). ``watch``: the
    key that tells the leader someone follows its call (one still running), set with every
    read. ``kind``: the request's API (an answer of another is no answer to it; None: any)."""
    loop = asyncio.get_running_loop()
    ours, stale = token.encode(), b"~" + token.encode()
    ended = b"=" + ours + b":"
    last: bytes | str = b"0-0"
    relayed = 0  # frames published into the local broadcast
    taken = 0  # frames read in order, relayed or held (= next frame index)
    # The frames the stream held when we first looked, until the leader shows life since
    # (None: it has, or there were none): a dead leader's are never relayed.
    held: list[tuple[bytes, bool]] | None = []
    looking = True  # reading what the stream held then (not blocking)
    expires: float | None = None  # when its lock expires (loop time), as last read
    renewal = flights.lease_ms / 6000  # (s) its expiry moved on by more: renewed (lease/3)
    seen = 0  # frame records read, relayed or not: signs of life
    # The clients of the local flight holding their replay (``Broadcast.hold``) when the last
    # read that answered was sent, and whether it took all the stream held: what a read finds
    # after it (new entries, the lock renewed since) is then life since they came.
    vouching, drained = 0, False
    skipping = False  # frames were trimmed before we read them: serve the answer whole
    suspect = False  # the lock looked gone: read once more without blocking
    lease_s = flights.lease_ms / 1000
    answered = loop.time()  # when Redis last answered a read (or the follow began)
    failing = False  # the last read failed
    backoff = Backoff(flights.block_ms / 1000)  # the pauses between reads that failed
    flights.following += 1
    broadcast.leader_elsewhere = True
    try:
        while True:
            block: int | None = None if suspect or looking else flights.block_ms
            if not seen and block is not None:
                left_ms = int((deadline - loop.time()) * 1000)
                block = min(block, left_ms) if left_ms >= 1 else None
            asking = broadcast.holding  # (the clients holding as this read is sent)
            pipe = flights._client.pipeline(transaction=False)
            if watch is not None:
                pipe.eval(FOLLOWED, 1, watch, flights.lease_ms)
            pipe.xread({stream: last}, count=READ_COUNT, block=block)
            pipe.get(lock)
            pipe.exists(aside)
            if held is not None or asking > broadcast.lived_for:
                pipe.pttl(lock)
            try:
                with _unavailable("follow a flight"):
                    replies = await pipe.execute()
            except WrongType:
                # (Redis answered: something else wrote the stream's or the lock's name.)
                return _unreadable(flights, stream, "a key of another type", relayed)
            except StoreUnavailable as error:
                flights._failed(error)
                failing = True
                now = loop.time()
                # A stall or a reset shorter than the lease is no sign that the leader died
                # (its own link comes back as ours does): read again from where we were.
                # Not past the join timeout with nothing seen, nor past the lease since
                # Redis last answered: the leader may have died meanwhile, unseen.
                if now - answered < lease_s and (seen or now < deadline):
                    await backoff.wait()
                    continue
                if relayed:
                    # (The client hears what happened, not Redis's address or error: the log
                    # has them.)
                    log.warning("following %s: %s", stream, error.message)
                    raise _broken(flights, LOST) from None
                return DOWN
            answered = loop.time()
            if failing:  # (Redis answers again: a degraded period ends)
                failing = False
                backoff.reset()
                flights._answered()
            reply, holder, set_aside, *lease = replies[1:] if watch is not None else replies
            records = xread_entries(reply)
            for entry_id, fields in records:
                last = entry_id
                try:
                    frame = frame_from(fields)
                    if frame is None:  # (read whole before any held frame is relayed)
                        end, meta, body = final_from(fields, kind)
                except Unreadable as error:
                    return _unreadable(flights, stream, str(error), relayed)
                if frame is None:
                    if held and end != b"g":  # (the leader lived to end it)
                        relayed += _release(flights, broadcast, held)
                    return _ending(flights, end, meta, body, broadcast, relayed)
                seen += 1
                index, data, usage_only = frame
                if skipping or index < taken:
                    continue
                if index > taken:  # trimmed (MAXLEN) before we read it
                    if relayed:
                        raise _broken(
                            flights, "fell behind the stream of the instance leading this call"
                        )
                    skipping, held = True, None
                    continue
                taken += 1
                if held is not None:
                    held.append((data, usage_only))
                    if looking:
                        continue
                    frame_held, held = held, None  # new since we looked: the leader lives
                    relayed += _release(flights, broadcast, frame_held)
                    continue
                relayed += _release(flights, broadcast, [(data, usage_only)])
            if looking and len(records) < READ_COUNT:
                looking = False  # (what comes next came after we looked)
                if not held:
                    held = None
            renewed = False
            if lease:  # (its lock's expiry, read in this round trip)
                lock_held = holder in (ours, stale)
                until = loop.time() + lease[0] / 1000 if lock_held and lease[0] > 0 else None
                renewed = until is not None and expires is not None and until > expires + renewal
                expires = until
            else:
                expires = None  # (not read: the next read has none to compare with)
            if held and renewed:
                frame_held, held = held, None  # its lock renewed since: the leader lives
                relayed += _release(flights, broadcast, frame_held)
            if vouching > broadcast.lived_for and (renewed or (records and drained)):
                broadcast.showed_life(vouching)  # (they take the frames there are)
            vouching, drained = asking, len(records) < READ_COUNT
            if records:
                suspect = False
                continue
            if (
                holder != ours
                and holder != stale
                and not (holder or b"").startswith(ended)
                and not set_aside
            ):
                if suspect:  # gone, and no final record came after all
                    if relayed:
                        raise _broken(flights, "the instance leading this call stopped")
                    return GONE
                suspect = True
                continue
            suspect = False
            if not seen and loop.time() >= deadline:
                return TIMEOUT
    finally:
        broadcast.leader_elsewhere = False
        # The call is no other instance's any more: ended (an answer, a dead leader's
        # ``LeaderLost``), or this instance's own from here (a follow that timed out or found
        # the leader gone before relaying anything: this broadcast carries its own call next).
        # Whoever held takes what it carries, live.
        broadcast.showed_life(broadcast.holding)
        flights.following -= 1


def _release(flights: SharedFlights, broadcast: Broadcast, frames: list[tuple[bytes, bool]]) -> int:
    """Publish ``frames`` (bytes, usage-only) into the local broadcast; how many."""
    usage = next((i for i, (_, usage_only) in enumerate(frames) if usage_only), None)
    broadcast.remote = True
    broadcast.publish_many([frame for frame, _ in frames], usage)
    flights.counts["frames_relayed"] += len(frames)
    return len(frames)


def _ending(
    flights: SharedFlights,
    end: bytes,
    meta: dict[str, Any],
    body: bytes,
    broadcast: Broadcast,
    relayed: int,
) -> Answer | str:
    """The answer or error of a final record (``final_from``: its ``end``, meta and body), or
    ``GONE``."""
    if end == b"g":
        if relayed:
            raise _broken(flights, "the instance leading this call left it")
        return GONE
    if end == b"x":
        broadcast.remote = True
        raise error_from(meta, body)
    count = meta["fl"]
    if relayed and relayed != count:
        raise _broken(flights, "the stream of the instance leading this call has gaps")
    broadcast.remote = True
    # (A ``no-store`` leader's answer lingers nowhere: lingering is a form of storing.)
    broadcast.may_linger = lingers(meta)
    frames = broadcast.frames if count is not None and relayed == count else None
    return answer_from(meta, body, frames)


def _unreadable(flights: SharedFlights, stream: str, what: str, relayed: int) -> str:
    """An entry of the leader's stream (or its lock) that carpool does not write: its leader
    taken as gone (the module's contract)."""
    log.warning(
        "following %s: %s, which carpool does not write (something else wrote it): taken as "
        "its leader gone",
        stream,
        what,
    )
    if relayed:
        raise _broken(flights, "the stream of the instance leading this call could not be read")
    return GONE


def _broken(flights: SharedFlights, message: str) -> LeaderLost:
    flights.counts["broken"] += 1
    return LeaderLost(message)
