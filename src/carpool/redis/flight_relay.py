"""The follower's side of a cross-instance flight (:mod:`.flights`): the relay of a remote
leader's stream to the local clients.

A follower reads the stream from its start (replay), then blocks for new entries (XREAD BLOCK
of at most min(lease/3, ``distributed.timeout``/2), so that the client's socket timeout never
cuts a block), publishing each frame into its LOCAL broadcast: every local client of the
flight, streaming or not, early or late, is served exactly as if this instance led. On the
final record it returns the same ``Answer`` (or raises the same error); it never stores it (the
leader does). The local broadcast is marked ``remote``: this instance's clients are all
``coalesced``.

A leader's death is noticed through its lock, read in the same round trip as each XREAD: the
lock is gone or names another leader (and the leader's call is not set aside, still running,
in its stale key: an invalidation came, and a fresh call took the lock), and one more read
finds no final record (so within lease_ms + one block of the death). What the follower does
then (take the call over, or end its flight with ``LeaderLost``) is in the failure rules of
:mod:`.flights`.

Entries trimmed by MAXLEN before a follower read them (it joined late, or fell that far
behind): with nothing relayed, it skips the frames and serves the answer whole from the final
record (streaming clients get frames synthesized from it); with frames relayed,
``UpstreamStreamBroken``. So is a final record whose frame count is not what was relayed (the
leader's publishing broke).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import orjson

from ..answer import Answer
from ..broadcast import Broadcast
from ..errors import LeaderLost
from .connection import StoreUnavailable, unavailable_in
from .flight_protocol import answer_from, error_from
from .keys import xread_entries

if TYPE_CHECKING:
    from .flights import SharedFlights

__all__ = ["DOWN", "GONE", "READ_COUNT", "TIMEOUT", "follow"]

READ_COUNT = 1000  # entries per XREAD

# Why a follow ended without an answer.
GONE = "gone"  # the leader died or left: claim again (nothing was relayed)
TIMEOUT = "timeout"  # nothing within the join timeout: run the call here
DOWN = "unavailable"  # Redis failed: run the call here

_unavailable = unavailable_in("the Redis flights")


async def follow(
    flights: SharedFlights,
    lock: str,
    stream: str,
    aside: str,
    token: str,
    broadcast: Broadcast,
    deadline: float,
) -> Answer | str:
    """Relay the leader's stream into ``broadcast`` until its final record. ``aside``: the
    leader's stale key (its call set aside by an invalidation, it still runs)."""
    loop = asyncio.get_running_loop()
    ours, stale = token.encode(), b"~" + token.encode()
    ended = b"=" + ours + b":"
    last: bytes | str = b"0-0"  # (XREAD BLOCK waits for the stream to exist)
    relayed = 0  # frames published into the local broadcast (= next frame index)
    seen = 0  # frame records read, relayed or not: signs of life
    skipping = False  # frames were trimmed before we read them: serve the answer whole
    suspect = False  # the lock looked gone: read once more without blocking
    flights.following += 1
    try:
        while True:
            block: int | None = None if suspect else flights.block_ms
            if not seen and block is not None:
                left_ms = int((deadline - loop.time()) * 1000)
                block = min(block, left_ms) if left_ms >= 1 else None
            pipe = flights._client.pipeline(transaction=False)
            pipe.xread({stream: last}, count=READ_COUNT, block=block)
            pipe.get(lock)
            pipe.exists(aside)
            try:
                with _unavailable("follow a flight"):
                    reply, holder, set_aside = await pipe.execute()
            except StoreUnavailable as error:
                flights._failed(error)
                if relayed:
                    raise _broken(
                        flights,
                        f"lost the stream from the instance leading this call: {error.message}",
                    ) from None
                return DOWN
            records = xread_entries(reply)
            for entry_id, fields in records:
                last = entry_id
                if b"f" in fields:
                    seen += 1
                    index = int(fields[b"i"])
                    if skipping or index < relayed:
                        continue
                    if index > relayed:  # trimmed (MAXLEN) before we read it
                        if relayed:
                            raise _broken(
                                flights, "fell behind the stream of the instance leading this call"
                            )
                        skipping = True
                        continue
                    broadcast.remote = True
                    broadcast.publish(fields[b"f"], usage_only=b"u" in fields)
                    relayed += 1
                    flights.counts["frames_relayed"] += 1
                else:
                    return _ending(flights, fields, broadcast, relayed)
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
        flights.following -= 1


def _ending(
    flights: SharedFlights, fields: dict[bytes, bytes], broadcast: Broadcast, relayed: int
) -> Answer | str:
    """The answer or error of a final record (or ``GONE``)."""
    kind = fields[b"e"]
    if kind == b"g":
        if relayed:
            raise _broken(flights, "the instance leading this call left it")
        return GONE
    meta = orjson.loads(fields[b"m"])
    body = fields.get(b"b", b"")
    if kind == b"x":
        broadcast.remote = True
        raise error_from(meta, body)
    count = meta["fl"]
    if relayed and relayed != count:
        raise _broken(flights, "the stream of the instance leading this call has gaps")
    broadcast.remote = True
    frames = broadcast.frames if count is not None and relayed == count else None
    return answer_from(meta, body, frames)


def _broken(flights: SharedFlights, message: str) -> LeaderLost:
    flights.counts["broken"] += 1
    return LeaderLost(message)
