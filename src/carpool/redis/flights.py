"""Cross-instance single-flight: identical requests on different gateway instances share one
upstream call, through Redis/Valkey (when ``redis`` is set and ``distributed.shared_flights``).

``flight.py`` coalesces the requests of one instance into one *local flight*. The lead function
of a local flight (``Gateway._lead``) calls ``SharedFlights.run(key, broadcast, call, store)``,
which coalesces the local flights of every instance:

- Lead or follow, decided by one atomic script (``claim``): with no live lock for the key, this
  instance becomes the GLOBAL leader (``SET P lock:{ID} TOKEN PX lease_ms``, in the script) and
  runs ``call`` (the upstream call, the assembly, the publishing into the local broadcast) then
  ``store`` (the shared exact store), as it would without Redis. Otherwise it FOLLOWS the leader
  that the lock names.
- The leader forwards each SSE frame its local broadcast receives to its own Redis stream (XADD
  MAXLEN ~ ``stream_maxlen``; frames that arrive during a round trip go together in the next
  one) and renews its lock and the stream's expiry every lease/3 while the call runs. Once
  ``call`` has returned, one script adds the final record (the answer or the error:
  :mod:`.flight_protocol`) and releases the lock: in the same round-trip time as ``store`` when
  the lock stays for the window with the answer, after it when the lock goes (a request that
  finds no lock must find the answer stored). Both finish (Redis answering: else see the
  failure rules) before the local flight ends: once any client has its answer, the answer is
  stored and every instance sees the call as finished (an invalidation drops its lingering
  answer; a retry after an error makes a new call). A leader whose lock an invalidation
  marked stale meanwhile (``forget_all``, from any instance) does not store its answer: it may
  predate what was dropped. It reads its lock again once stored, and a mark then (or the lock
  gone) takes the answer back (``forget``). What covers every store is the count of
  invalidations, which an invalidation moves first, before it
  drops the entries and then marks the locks (``admin.invalidate``): ``RedisStore.put`` takes
  back an answer whose call read the count before it moved, and a call reads it once its lock
  is claimed, so one claimed after the marks is fresh, and one claimed before them is marked:
  its answer lingers nowhere either. (Marked before the count moved, a call claimed in
  between was missed: its answer, taken back from the store, lingered in its lock.)
- After an invalidation the instances share one fresh call per key again: the first claim
  that finds a call marked stale sets it aside (its lock moves to ``P stale:{ID}:TOKEN``, which
  its leader renews and its followers read as their leader alive: they keep it to its end) and
  takes the lock for a fresh call, which every later request follows (``TAKE``). Nobody new
  follows the stale call, and it is not replayed once finished.
- A storable answer (``Answer.storable``: complete, and not kept out of shared caches by the
  upstream's ``no-store``/``private``) of a request that may linger (no ``no-store``) leaves
  the lock as
  ``=TOKEN:MS`` for ``coalesce.window_ms``: requests on any instance replay that stream within
  the window (honouring ``max_age``: ``Cache-Control: no-cache`` joins only a call still
  running), as a finished local flight lingers. Any other ending deletes the lock: the next
  request leads a new call. ``forget_all`` (``/admin/invalidate``) deletes every lingering
  lock, whichever instance made it; ``forget(keys)`` those of ``keys`` (a deleted response's
  calls, ``Gateway.forget_state``), marking their running calls stale as ``forget_all`` does.
- A replay is as old as the call it replays: the claim says how long ago that call ended
  (Redis time), and the local flight that replayed it finished then (``Broadcast.replayed``):
  a request that joins it here, while it replays or lingering, gets it only if that age is one
  it accepts (a ``no-cache`` one never does: it makes a fresh call), and it lingers here for
  what is left of this instance's window since then. A claim replays it only while it is
  younger than the request's ``max_age`` and than this instance's own window for the key
  (``window``; 0: none, only a call still running is joined), as a local flight is joinable
  only within its window: the instances' windows may differ (a fleet mid-change), and the
  lock lingers for its leader's. (Before, an instance with ``window_ms: 0`` replayed another's
  call for the whole of that one's window.) The final record says whether the answer
  may linger at all (not a ``no-store`` leader's, nor an answer that is not storable, nor a
  call set aside by an invalidation): a
  follower's local flight lingers only if it may.
- A claim that finds no call running may find its answer stored (``load``; the entry's key is
  in the lock's slot): a call that ended without a window (``coalesce.window_ms: 0``) after
  this request missed the cache. It serves that answer (a hit) rather than lead a second call.
- A follower relays the leader's stream, from its start, into its LOCAL broadcast: every local
  client of the flight, streaming or not, early or late, is served exactly as if this instance
  led, and gets the same ``Answer`` (or the same error) on the final record
  (:mod:`.flight_relay`). The frames the stream already held when it came are relayed only
  once the leader shows life since (a new entry, its lock renewed): a dead leader's are not.
  So a streaming client that joins the local flight meanwhile takes the frames it holds only
  once the leader shows life since that client came (``Broadcast.leader_elsewhere``).
  Its every read says the call is followed (``P followed:{ID}:TOKEN``, for lease_ms).

Failure rules. A leader's death is noticed through its lock, within lease_ms + one XREAD block
of the death (:mod:`.flight_relay`).
- Frames already relayed to clients cannot be taken back. A follower that has relayed NOTHING (a
  non-streaming leader, or no chunk yet) takes over transparently: it claims again, and leads
  (runs ``call`` and ``store``) or follows whichever instance claimed first (at most
  ``MAX_TAKEOVERS`` times, then it runs them alone). A follower that HAS relayed frames ends its
  flight with ``LeaderLost`` (an ``UpstreamStreamBroken``): its streaming clients, which got
  those frames, get an SSE error event, then the end of the stream (they retry, and the retry
  coalesces as usual); its clients that got nothing (non-streaming ones, and streaming ones
  that joined it since the leader last showed life: they hold their replay until it does)
  take the call over in the pipeline (``Gateway._follow``), or get the answer if the leader
  stored it.
- A leader whose local clients all left goes on with the call while a follower on any instance
  reads it (its followed key), and stores and ends it as usual; it is cancelled only once
  nobody follows: then it records ``gone`` (one script with that check, ``END``) and its
  local flight is cancelled (``Broadcast.on_abandoned``). A follower whose claim came just
  before finds that record having relayed nothing (its first frames wait for a sign of life)
  and claims again, to lead. A call nobody follows any more runs on for at most about
  lease_ms + lease/3 (the followed key's life, and when the leader asks again); a Redis
  failure keeps it going (unsure). A leader's call cancelled otherwise records ``gone`` too;
  followers treat it as a death without waiting for the lease.
- Join timeout: a follower that has received nothing (no frame, no final record) within
  ``coalesce.join_timeout_ms`` of the start of ``run`` runs ``call`` and ``store`` itself,
  without the lock and publishing nothing, as a local joiner that times out runs its own call
  (``flight.JoinTimeout``; such a local joiner's fresh call is made directly, not through Redis).
  So no waiter waits on another instance longer than the join timeout for a first sign of life.
  The local joiners of a flight whose lead follows (``Broadcast.lead_times_out``) leave the
  timeout to it: one that times out waits on for the lead's own call, which those that time
  out together share (each retaking its own flight made one call more than one instance does).
- Redis unreachable, refusing commands or slower than ``distributed.timeout``: no request fails
  because of it. Failing at the claim (or while the shared store reports Redis degraded, when it
  is not even tried): ``call`` runs here, as without Redis; a claim that failed may have landed
  (a timeout on our side), so its lock, if in our name, is ended as ``gone`` once Redis
  answers (tried for up to lease_ms): nobody follows a leader that does not know it leads. So
  is a claim cancelled on its way (its clients all left).
  Failing while leading: the call goes on for this instance's clients; publishing and renewing
  are tried again at the next renewal time (lease/3), as long as the lock is ours, the frames
  of a failed batch sent again with the next (a link that stalls for less than the lease costs
  its followers nothing). The end (the last frames, then the final record and the lock's
  release) is tried once before the local clients have their answer; should Redis fail it
  (a stall, a reset: not a refusal, a full Redis), it goes on in the background, nothing of
  theirs waiting on it: tried again with back-off (``BACKOFF_MIN`` doubling up to
  ``END_RETRY_MAX_S``), the lock renewed every lease/3 (for at most one more lease), until
  Redis takes it or the lease since the last renewal Redis took has run out (the followers
  take the call over then, as for a death). So a call that ends during a stall shorter than
  the lease reaches its followers once Redis answers, and is not made again. ``aclose`` ends
  that task (after ``CLOSE_WAIT_S`` for a command on its way: the lock is then left to its
  lease), and stops publishing and renewing for every flight still led here (their locks
  left to their leases too). A leader cancelled after its call returned (the gateway's close)
  still publishes the end, the answer with it. Failing while following: the follower reads
  again from where it was, its clients waiting, until Redis has failed it for lease_ms (or,
  nothing of the call seen, the join timeout passed): a stall shorter than the lease costs
  nothing here either. Only then: nothing relayed -> the call runs here; frames relayed ->
  ``UpstreamStreamBroken`` (its message names no Redis address or error), as for a death. Failures go to the shared store's health
  (``/stats``, ``/healthz``, the log, degraded mode); successes end a degraded period.
- Entries trimmed by MAXLEN before a follower read them, or a final record whose frame count
  is not what was relayed: see :mod:`.flight_relay`.
- A value carpool does not write (something else wrote it) is no Redis failure: Redis
  answered. A lock of another form or type (``CLAIM``: :mod:`.flight_protocol`) is no lock
  held: the claim drops it (logged) and leads; a record of a leader's stream carpool cannot
  read is its leader gone (:mod:`.flight_relay`). Any other ``WRONGTYPE`` goes to the shared
  store's health as such (counted apart, no degraded period).

The keys, the records and the scripts: :mod:`.flight_protocol`.

Round trips (measured by benchmarks/bench_distributed.py): a leader makes 1 (claim) + 1 per
batch of frames + 1 per lease/3 of call time (renewal) + 1 (end, alongside the store's), and its
store reads the invalidation generation before the call and after the put (``lead.py``); a
follower 1 (claim) + 1 per XREAD (the first does not block: what the stream holds; each other
returns as soon as entries arrive, or after the block time), its followed key set in the same
round trip; a leader whose clients all left, 1 per lease/3 while followed; none while Redis is
degraded, but for the end of a flight that Redis failed (1 or 2 per try, ``END_RETRY_MAX_S``
apart at the most, for up to a lease). Needs Redis >= 5 (streams; scripts that call TIME before
writing) or Valkey.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..answer import Answer
from ..broadcast import Broadcast
from ..errors import CarpoolError, UpstreamError
from .connection import (
    BACKOFF_MIN,
    Background,
    Health,
    PoolExhausted,
    RedisFull,
    StoreUnavailable,
    WrongType,
    close_client,
    counted_apart,
    read_topology,
    stop_reader,
    unavailable_in,
    wait_set,
    wrong_type,
)
from .flight_protocol import (
    CLAIM,
    END,
    FORGET,
    FRAMES,
    RENEW,
    TAKE,
    answer_record,
    entry_key,
    error_record,
    flight_keys,
    followed_keys,
    lock_names,
    stale_keys,
)
from .flight_relay import GONE, follow
from .keys import check_prefix

if TYPE_CHECKING:
    import redis.asyncio as aredis

__all__ = ["SharedFlights"]

log = logging.getLogger("carpool.flight")

Call = Callable[[Broadcast], Awaitable[Answer]]
# The leader's store: the key it put the answer under ("" if none); the key taken back.
Store = Callable[[Answer], Awaitable[str]]
Forget = Callable[[str], Awaitable[object]]
# The answer stored for the key, if any (the exact store's, whatever its age).
Load = Callable[[], Awaitable[Answer | None]]

MAX_TAKEOVERS = 3  # claims after a leader's death, within one run, before running alone
END_RETRY_MAX_S = 0.25  # s at most between two tries of a flight's end that Redis failed
CLOSE_WAIT_S = 1.0  # s ``aclose`` lets the background work finish before cancelling it

_unavailable = unavailable_in("the Redis flights")


class SharedFlights:
    """Cross-instance flights on ``client`` (a ``redis.asyncio`` client that does not decode
    responses). ``lease_ms``, ``stream_maxlen``: see the config; ``join_timeout`` (s): the
    coalescing join timeout; ``linger_ms``: the coalescing window (``coalesce.window_ms``);
    ``socket_timeout`` (s): the client's, which bounds the XREAD block; ``health``: the shared
    store, told of failures and asked before each claim; ``owns_client``: ``aclose`` closes it.
    """

    def __init__(
        self,
        client: aredis.Redis,
        *,
        prefix: str = "carpool:",
        lease_ms: float = 5000,
        stream_maxlen: int = 10_000,
        join_timeout: float = 30.0,
        linger_ms: float = 1000,
        socket_timeout: float = 0.5,
        health: Health | None = None,
        owns_client: bool = False,
    ) -> None:
        check_prefix(prefix)
        self.prefix = prefix
        self.lease_ms = max(1, int(lease_ms))
        self.maxlen = stream_maxlen
        self.join_timeout = join_timeout
        self.linger_ms = max(0, int(linger_ms))
        self.block_ms = max(1, int(min(lease_ms / 3, socket_timeout * 1000 / 2)))
        self.health = health
        self._client = client
        self._owns_client = owns_client
        self._claim = client.register_script(CLAIM)
        self._renew = client.register_script(RENEW)
        self._frames = client.register_script(FRAMES)
        self._end = client.register_script(END)
        self._take = client.register_script(TAKE)
        self._background = Background("shared flight cleanup", log)  # (claims taken back, ends)
        self._publishers: set[_Publisher] = set()  # (of the flights led here: ``aclose``)
        self._closing = False
        self._closed = asyncio.Event()  # (set by ``aclose``: background waits end at once)
        self.leading = 0  # flights this instance leads now
        self.following = 0  # flights this instance follows now
        self.counts = dict.fromkeys(
            (
                "led",  # calls led for every instance
                "followed",  # calls followed while running on another instance
                "replayed",  # finished calls replayed within the window
                "stored",  # claims that found the call ended and its answer stored
                "takeovers",  # calls led after their leader died
                "kept",  # calls led whose own clients all left, finished for other instances'
                "alone",  # calls run without Redis: unavailable, join timeout
                "broken",  # follows failed after frames were relayed
                "errors",  # Redis failures
                "frames_published",  # frames sent to Redis as leader
                "frames_relayed",  # frames relayed from Redis as follower
            ),
            0,
        )

    def __repr__(self) -> str:
        return f"<SharedFlights prefix={self.prefix!r} lease={self.lease_ms} ms>"

    def snapshot(self) -> dict[str, int]:
        return {**self.counts, "leading": self.leading, "following": self.following}

    async def forget_all(self) -> int:
        """After an invalidation (once it has moved Redis's count of them: the module's
        contract): stop replaying every finished call, and mark every running one stale, so that no request on any instance follows it (the first request that finds
        a stale call sets it aside and leads a fresh one, which the others follow: ``TAKE``);
        its followers keep it, and it is not replayed once finished.

        Scans the locks (one per call running or lingering, on every instance): only the keys
        whose whole name is a lock (``lock_names``: the pattern matches another deployment's
        keys, whose prefix begins with this one's, and another app's), one of another type
        left as it is (``_forget_batch``). Returns how many it dropped or marked (those it
        could: a Redis failure is reported, not raised).
        """
        pattern, name = lock_names(self.prefix)
        dropped = 0
        try:
            with _unavailable("forget finished flights"):
                await read_topology(self._client)
                batch: list[bytes] = []
                async for lock in self._client.scan_iter(match=pattern, count=500):
                    # Only a lock's whole name: the pattern also matches another deployment's
                    # keys (its prefix beginning with this one's) and another app's.
                    if name.fullmatch(lock) is None:
                        continue
                    batch.append(lock)
                    if len(batch) >= 500:
                        dropped += await self._forget_batch(batch)
                        batch = []
                if batch:
                    dropped += await self._forget_batch(batch)
        except StoreUnavailable as error:
            self._failed(error)
        return dropped

    async def forget(self, keys: Iterable[str]) -> int:
        """``forget_all`` for ``keys`` only (a deleted response's: ``Gateway.forget_state``),
        without a scan and without moving Redis's count of invalidations: their finished
        calls are replayed no more, their running ones are marked stale (nobody new follows
        them, their answers are not stored, nor replayed once finished). How many it dropped
        or marked; a Redis failure is reported, not raised (the locks linger to their window's
        end then, their entries already dropped)."""
        locks = [flight_keys(self.prefix, key)[0].encode() for key in keys]
        if not locks:
            return 0
        try:
            with _unavailable("forget a deleted response's flights"):
                return await self._forget_batch(locks)
        except StoreUnavailable as error:
            self._failed(error)
            return 0

    async def _forget_batch(self, locks: list[bytes]) -> int:
        """``FORGET`` each of ``locks``: how many it dropped or marked. A key of another type
        under a lock's name (something else wrote it) is left as it is, and the others are
        forgotten all the same; any other error is raised once all have run."""
        pipe = self._client.pipeline(transaction=False)
        for lock in locks:
            pipe.eval(FORGET, 1, lock)
        forgotten, failed = 0, None
        for lock, result in zip(locks, await pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(result, Exception):
                forgotten += result
            elif wrong_type(result):
                log.warning("%r is no flight's lock (something else wrote it): left", lock)
            elif failed is None:
                failed = result
        if failed is not None:
            raise failed
        return forgotten

    async def aclose(self) -> None:
        """Background work (a claim taken back, a flight's end tried again) ends: it stops
        waiting at once, gets ``CLOSE_WAIT_S`` for a command on its way, then is cancelled
        (a flight whose end never landed is left to its lease, as for a dead leader)."""
        self._closing = True
        self._closed.set()
        await self._background.drain(CLOSE_WAIT_S)
        for publisher in list(self._publishers):
            publisher.abort()
            await stop_reader(publisher.task)
        if self._owns_client:
            await close_client(self._client)

    # ------------------------------------------------------------------ the one entry point

    async def run(
        self,
        key: str,
        broadcast: Broadcast,
        call: Call,
        store: Store,
        *,
        max_age: float | None = None,
        window: float | None = None,
        linger: bool = True,
        forget: Forget | None = None,
        load: Load | None = None,
        kind: str | None = None,
    ) -> Answer:
        """The answer for ``key``: led here (``call`` runs, its output is shared, ``store``
        keeps it), followed from the instance that leads it (which stores it), or (Redis
        failing, join timeout) computed and stored here alone.

        ``max_age``: how long ago a finished call may have ended to be replayed (None: within
        the window; 0: only a call still running is joined). ``window``: this instance's own
        window for the key (s; None: unbounded): a finished call that ended longer ago is not
        replayed either, whatever the window its lock lingers for. ``linger``: whether this
        instance's answer may be replayed once finished (False for ``no-store``). ``forget``:
        takes back what ``store`` stored (the key it returned), when an invalidation came.
        ``load``: the answer stored for ``key``, asked when a claim finds no call running but
        an answer stored (``max_age`` None only: the request takes any cached answer) since
        the request missed the cache (a call ended meanwhile, without a window); the local
        broadcast is then ``cached`` (its clients are hits). ``kind``: the request's API; a
        followed answer of another is none (None: any API's).
        """
        if self.health is not None and not self.health.usable():
            return await self._alone(call, store, broadcast)
        lock, streams = flight_keys(self.prefix, key)
        stales, followed = stale_keys(self.prefix, key), followed_keys(self.prefix, key)
        entry, look = entry_key(self.prefix, key), int(load is not None and max_age is None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.join_timeout
        age_ms = -1 if max_age is None else int(max_age * 1000)
        if window is not None:
            # Bounded by this instance's window too, as its own finished calls are (a fleet
            # mid-change: the leader's window may be longer, its lock lingering for it).
            age_ms = int(window * 1000) if age_ms < 0 else min(age_ms, int(window * 1000))
        deaths = 0  # leaders followed that died or left
        for _ in range(MAX_TAKEOVERS + 1):
            token = secrets.token_hex(8)
            asked = loop.time()
            try:
                with _unavailable("claim a flight"):
                    reply = await self._claim(
                        keys=[lock, entry], args=[token, self.lease_ms, age_ms, look]
                    )
                    if reply[0] == b"stale":
                        # The call running began before an invalidation: set aside (its
                        # followers stay on it), and a fresh one led here for every instance.
                        stale = reply[1].decode()
                        reply = await self._take(
                            keys=[lock, stales + stale], args=[stale, token, self.lease_ms]
                        )
            except StoreUnavailable as error:
                self._failed(error)
                if not isinstance(error, PoolExhausted):  # (that one was never sent)
                    # It may have landed all the same (a timeout on our side): a lock in our
                    # name that nobody renews, publishes into or ends, followed for lease_ms.
                    self._background.spawn(
                        self._unclaim(lock, streams + token, stales + token, token)
                    )
                return await self._alone(call, store, broadcast)
            except asyncio.CancelledError:
                # Its clients left while the claim was on its way: it may have landed, a lock
                # every instance would wait on for lease_ms. Taken back if it is ours.
                self._background.spawn(self._unclaim(lock, streams + token, stales + token, token))
                raise
            self._answered()
            if reply[-1] == b"dropped":
                # (Redis answered: not a failure of Redis, nor a reason to share nothing.)
                log.warning(
                    "%s held what carpool does not write there (something else wrote it): "
                    "dropped, as no lock held",
                    lock,
                )
            if reply[0] == b"lead":
                self.counts["takeovers" if deaths else "led"] += 1
                return await self._lead(
                    lock,
                    streams + token,
                    stales + token,
                    token,
                    broadcast,
                    call,
                    store,
                    linger,
                    forget,
                    followed + token,
                )
            if reply[0] == b"again":  # the lock changed under the stale call's setting aside
                continue
            if reply[0] == b"stored":
                answer = await load() if load is not None else None
                if answer is not None:
                    self.counts["stored"] += 1
                    broadcast.cached = True
                    return answer
                look = 0  # (gone meanwhile, or expired by now: claim again, to lead)
                continue
            leader = reply[1].decode()
            running = reply[0] == b"follow"
            self.counts["followed" if running else "replayed"] += 1
            # The join timeout is this lead's from now on: its local joiners wait for the fresh
            # call it makes when ``deadline`` passes, rather than each make their own.
            broadcast.lead_times_out = True
            result = await follow(
                self,
                lock,
                streams + leader,
                stales + leader,
                leader,
                broadcast,
                deadline,
                # (A call still running: its leader must know it is followed.)
                followed + leader if running else None,
                kind,
            )
            if isinstance(result, Answer):
                if not running:
                    # A finished call replayed: as old as that call, not as this replay (its
                    # age counted from before the claim was sent, not to make it younger).
                    broadcast.replayed = int(reply[2]) / 1000 + loop.time() - asked
                return result
            if result != GONE:
                break
            deaths += 1
        return await self._alone(call, store, broadcast)

    async def _unclaim(self, lock: str, stream: str, stale: str, token: str) -> None:
        """After a failed claim: once Redis answers (tried again for up to lease_ms, when the
        lock would expire anyway), end the flight it may have claimed, as a leader that left
        (``gone``: its followers claim again at once), if the lock is in our name."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.lease_ms / 1000
        args: list[Any] = [token, 0, self.lease_ms, self.maxlen, "e", "g"]
        pause = 0.02
        while not self._closing:
            try:
                with _unavailable("take back a claim"):
                    await self._end(keys=[lock, stream, stale], args=args)
                return
            except StoreUnavailable:
                pass  # (reported by the claim already)
            left = until - loop.time()
            if left <= 0:
                return
            await wait_set(self._closed, min(pause, left))  # (or until ``aclose``)
            pause = min(pause * 2, 0.25)

    async def _alone(self, call: Call, store: Store, broadcast: Broadcast) -> Answer:
        self.counts["alone"] += 1
        answer = await call(broadcast)
        await store(answer)
        return answer

    # ------------------------------------------------------------------ leading

    async def _lead(
        self,
        lock: str,
        stream: str,
        stale: str,
        token: str,
        broadcast: Broadcast,
        call: Call,
        store: Store,
        linger: bool,
        forget: Forget | None = None,
        followed: str = "",
    ) -> Answer:
        publisher = _Publisher(self, lock, stream, stale, token, broadcast, followed)
        self.leading += 1
        try:
            answer = await call(broadcast)
        except asyncio.CancelledError:
            publisher.abort()
            if not publisher.left:
                # Cancelled otherwise than by its clients' leaving, which ended it already:
                # tell the followers now rather than by the lease.
                self._background.spawn(self._finish(lock, stream, stale, token, {"e": "g"}, 0))
            raise
        except CarpoolError as error:
            await self._close(publisher, error_record(error), 0)
            raise
        except Exception:  # a bug: followers get what the local clients get
            failure = UpstreamError("internal error while calling upstream")
            await self._close(publisher, error_record(failure), 0)
            raise
        finally:
            self.leading -= 1
        # The call has returned: should its clients all leave now, its store and end go on,
        # for the followers (and the cache).
        broadcast.on_abandoned, publisher.cancel = _finished, None
        try:
            return await self._land(publisher, answer, store, linger, forget)
        except BaseException:
            if not publisher.ending:
                # Cancelled (the gateway's close) or failed before its end was on its way:
                # the followers get the answer all the same, not to linger (it may not be
                # stored). Without it the publisher renewed the lock on, its followers
                # waiting on it, for as long as the process ran.
                self._background.spawn(
                    self._end_with(publisher, answer_record(answer, linger=False), 0)
                )
            raise

    async def _land(
        self,
        publisher: _Publisher,
        answer: Answer,
        store: Store,
        linger: bool,
        forget: Forget | None,
    ) -> Answer:
        """The answer of a call that returned: stored (unless an invalidation came while it
        ran), and the flight's end published with it."""
        lock, stale, token = publisher.lock, publisher.stale, publisher.token
        # Stored and ended (for the followers), both before the local clients have it.
        if await self._marked_stale(lock, stale, token):
            # An invalidation came while it ran (``forget_all``, on any instance): its answer
            # may predate what was dropped, so it is not stored (the followers still get it,
            # and do not let it linger).
            await self._close(publisher, answer_record(answer, linger=False), 0)
            return answer
        # (Whether it may linger where it is relayed: not a ``no-store`` request's answer, nor
        # one the upstream said no shared cache may keep, ``Answer.storable``.)
        linger = linger and answer.storable
        record = answer_record(answer, linger)
        lingers = linger and self.linger_ms > 0
        if lingers:
            # At once: the lock stays, with the answer, for the window.
            stored, _ = await asyncio.gather(
                store(answer), self._close(publisher, record, self.linger_ms)
            )
        else:
            # The store first: once the lock is gone, a request that finds none must find the
            # answer stored, or it would lead a second call.
            stored = await store(answer)
        # Read again once stored: an invalidation whose mark came after the read above finds
        # the lock marked now, or gone (the end drops a marked lock; an invalidation drops a
        # lingering one). Either way the answer is taken back. A mark that comes later comes
        # after its invalidation moved the count: before the store read it once the entry was
        # in (``RedisStore.put`` took it back), or after, then before its drop of the entries,
        # this one among them.
        if stored and forget is not None and not await self._fresh(lock, token, lingers):
            await forget(stored)
        if not lingers:
            await self._close(publisher, record, 0)
        return answer

    async def _marked_stale(self, lock: str, stale: str, token: str) -> bool:
        """Whether this leader's lock says an invalidation came (``~TOKEN``: ``FORGET``), or
        a claim since set this call aside (its stale key)."""
        read, holder = await self._holder(lock)
        if read and holder == "~" + token:
            return True
        if not read or holder == token:
            return False
        try:
            with _unavailable("read a flight's lock"):
                return bool(await self._client.exists(stale))
        except StoreUnavailable as error:
            self._failed(error)
            return False

    async def _fresh(self, lock: str, token: str, ended: bool) -> bool:
        """Whether this leader's lock is as no invalidation left it: still its own, running,
        or (``ended``: its end ran) lingering with its answer. A Redis failure says yes (its
        store went to this process's memory then, as any)."""
        read, holder = await self._holder(lock)
        if not read:
            return True
        if holder is None:
            return False
        return holder == token or (ended and holder.startswith(f"={token}:"))

    async def _holder(self, lock: str) -> tuple[bool, str | None]:
        """(whether Redis answered, the lock's value: None when there is no lock)."""
        try:
            with _unavailable("read a flight's lock"):
                holder = await self._client.get(lock)
        except WrongType:
            return True, None  # (something else wrote its name: no lock, as for ``CLAIM``)
        except StoreUnavailable as error:
            self._failed(error)
            return False, None
        return True, holder.decode("utf-8", "replace") if isinstance(holder, bytes) else holder

    async def _close(self, publisher: _Publisher, record: dict[str, Any], linger_ms: int) -> None:
        """The end of the flight, finished even if the local flight is cancelled meanwhile."""
        publisher.ending = True
        await asyncio.shield(self._background.spawn(self._end_with(publisher, record, linger_ms)))

    async def _end_with(
        self, publisher: _Publisher, record: dict[str, Any], linger_ms: int
    ) -> None:
        """The last frames, then the final record and the lock's release: tried once while
        the local clients wait; what Redis failed goes on in the background (``_end_later``)."""
        try:
            await publisher.close()
        finally:
            publisher.broadcast.on_publish = None
            publisher.broadcast.on_abandoned = None
        if publisher.aborted:
            return  # (stopped by ``aclose``: its lock is left to its lease)
        if publisher.unsent or not await self._finish(
            publisher.lock, publisher.stream, publisher.stale, publisher.token, record, linger_ms
        ):
            self._background.spawn(self._end_later(publisher, record, linger_ms))

    async def _end_later(
        self, publisher: _Publisher, record: dict[str, Any], linger_ms: int
    ) -> None:
        """The end of a flight that Redis failed (a stall, a reset), tried again with back-off,
        the lock renewed meanwhile (every lease/3), until Redis takes it, or until the lease
        since the last renewal Redis took would have run out: the followers have taken the call
        over by then (or will, the lock expiring), and the end is of no use to them. Without
        it a stall shorter than the lease, during which a call ended, cost its followers the
        lease and a second call (or a broken stream). Nothing of the local clients waits on
        it: they have their answer. Renewals keep the lock for at most one lease past the
        first failure (a Redis that renews but never takes the end must not hold it for ever).
        """
        loop = asyncio.get_running_loop()
        interval = self.lease_ms / 3000
        renew_by = loop.time() + self.lease_ms / 1000
        renew_at = publisher.renewed_at + interval
        pause, longest = BACKOFF_MIN, min(END_RETRY_MAX_S, interval)
        while not self._closing and loop.time() < publisher.held_until:
            await wait_set(self._closed, min(pause, max(0.0, publisher.held_until - loop.time())))
            pause = min(pause * 2, longest)
            if self._closing or loop.time() >= publisher.held_until:
                return
            if loop.time() >= renew_at and loop.time() < renew_by:
                renew_at = loop.time() + interval
                await publisher._renew()
            if publisher.unsent and not await publisher._flush():
                continue
            if await self._finish(
                publisher.lock,
                publisher.stream,
                publisher.stale,
                publisher.token,
                record,
                linger_ms,
            ):
                return

    async def _finish(
        self,
        lock: str,
        stream: str,
        stale: str,
        token: str,
        record: dict[str, Any],
        linger_ms: int,
    ) -> bool:
        """True once Redis took the end (or refused it for good: full, or a key of another
        type), False if it failed (it may be tried again)."""
        args: list[Any] = [token, linger_ms, linger_ms + self.lease_ms, self.maxlen]
        for name, value in record.items():
            args += [name, value]
        try:
            with _unavailable("end a flight"):
                await self._end(keys=[lock, stream, stale], args=args)
        except StoreUnavailable as error:
            self._failed(error)
            return _answered_by_redis(error)
        self._answered()
        return True

    # ------------------------------------------------------------------ health, tasks

    def _failed(self, error: StoreUnavailable) -> None:
        if not counted_apart(error):  # (Redis answered: the health counts it)
            self.counts["errors"] += 1
        if self.health is not None:
            self.health.report(error)
        else:
            log.debug("shared flights: %s", error)

    def _answered(self) -> None:
        if self.health is not None:
            self.health.report(None)


def _answered_by_redis(error: StoreUnavailable) -> bool:
    """Whether Redis answered the command ``error`` failed (full, a key of another type): no
    use sending it again. (Anything else, a stall, a reset, a busy pool, may pass.)"""
    return isinstance(error, (RedisFull, WrongType))


def _finished(cancel: Callable[[], object]) -> None:
    """A led call that has returned is not cancelled when its clients all leave."""


class _Publisher:
    """The leader's side: frames to the stream as they come (batched), the lease renewed.

    When every local client has left (``Broadcast.on_abandoned``), the call ends as ``gone``
    and is cancelled unless a follower reads it (its ``followed`` key: one script, ``END``);
    else it goes on for them, asked again every renewal time (lease/3): a follower's reads
    keep that key for lease_ms, so a call nobody reads any more is cancelled within about
    lease_ms + lease/3 of its last follower's leaving. A Redis failure then keeps it going too
    (unsure: a generation nobody reads costs less than failing clients who wait).

    A Redis failure (a stall longer than ``distributed.timeout``, a reset) stops nothing for
    good: the next try is at the next renewal time (lease/3 after the failed renewal was sent),
    publishing and renewing as long as the lock is ours; frames whose batch failed go again with
    the next (``sent`` moves on once Redis took them; a follower skips a frame it has).
    """

    def __init__(
        self,
        flights: SharedFlights,
        lock: str,
        stream: str,
        stale: str,
        token: str,
        broadcast: Broadcast,
        followed: str = "",
    ) -> None:
        self.flights = flights
        self.lock = lock
        self.stream = stream
        self.stale = stale  # this call's key once an invalidation set it aside
        self.token = token
        self.broadcast = broadcast
        self.followed = followed  # the key its followers' reads keep
        self.cancel: Callable[[], object] | None = None  # once every local client left
        self.leave_at = 0.0  # (loop time) when to ask again whether anyone follows
        self.left = False  # ended as gone, its clients all gone and no follower
        self.sent = 0  # frames Redis took
        self.sending = 0  # frames of the batch on its way (0: none)
        self.closing = False
        self.ending = False  # its end is on its way (``SharedFlights._close``)
        self.aborted = False  # the flight was cancelled: publish and renew no more
        self.renewing = True  # False once the lock is lost
        self.failing = False  # the last try failed: nothing more before the next renewal time
        self.refused = False  # Redis answered the last batch with a refusal (full, wrong type)
        loop = asyncio.get_running_loop()
        # (loop time) when the last renewal Redis took was sent, and when the lock it kept
        # runs out: the claim's, just made, at first (a few ms late: its round trip).
        self.renewed_at = loop.time()
        self.held_until = self.renewed_at + flights.lease_ms / 1000
        self._wake = asyncio.Event()
        self._closed = asyncio.Event()
        broadcast.on_publish = self._wake.set
        if followed:
            broadcast.on_abandoned = self._abandoned
        self.task = loop.create_task(self._run())
        flights._publishers.add(self)
        self.task.add_done_callback(lambda _: flights._publishers.discard(self))

    @property
    def unsent(self) -> int:
        """Frames of the call Redis has not taken yet, and may (none once the flight was
        cancelled, or Redis refused them for good)."""
        return 0 if self.aborted or self.refused else len(self.broadcast.frames) - self.sent

    def _abandoned(self, cancel: Callable[[], object]) -> None:
        """Every local client left: the loop asks at once whether anyone follows."""
        if not self.aborted:
            self.cancel, self.leave_at = cancel, 0.0
            self._wake.set()

    async def close(self) -> None:
        """Publish what is left (one more try, even after a failure), stop."""
        self.closing = True
        self._wake.set()
        self._closed.set()
        # (Waited for, not awaited: ``aclose`` may have cancelled it, the call it publishes
        # still running, whose clients get its answer all the same.)
        await asyncio.wait({self.task})

    def abort(self) -> None:
        self.broadcast.on_publish = self.broadcast.on_abandoned = None
        # Also stops the loop should redis-py swallow the cancellation (``stop_reader``).
        self.aborted = True
        self.task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.flights.lease_ms / 3000
        renew_at = loop.time() + interval
        try:
            while not self.aborted:
                # After a failure, frames wait for the next renewal time (or the close), not
                # to try a failing Redis once per frame.
                event = self._closed if self.failing else self._wake
                wake_at = renew_at if self.cancel is None else min(renew_at, self.leave_at)
                if not event.is_set():
                    await wait_set(event, max(0.0, wake_at - loop.time()))
                self._wake.clear()
                published = await self._flush()
                if self.closing:
                    # Frames published while that flush was on its way (the call ended
                    # meanwhile) go before the final record, or followers would miss them.
                    if published:
                        await self._flush()
                    return
                if self.cancel is not None and loop.time() >= self.leave_at:
                    if await self._leave():
                        return
                    self.leave_at = loop.time() + interval
                renewed = True
                if loop.time() >= renew_at:
                    sent_at = loop.time()
                    renewed = await self._renew()
                    # A failed renewal took its timeout already: the next one is due lease/3
                    # after it was sent (sooner than lease/3 after it failed), while the lock
                    # still holds.
                    renew_at = loop.time() + interval if renewed else sent_at + interval
                self.failing = not (published and renewed)
        except Exception:  # never let a bug here break the call itself
            log.exception("publishing flight %s failed", self.stream)

    async def _flush(self) -> bool:
        """Send the frames not sent yet; False if Redis failed (they go with the next)."""
        frames, start = self.broadcast.frames, self.sent
        end = len(frames)
        if start >= end or self.aborted:
            return True
        usage, flights = self.broadcast.usage_frame, self.flights
        args: list[Any] = [flights.maxlen, 2 * flights.lease_ms]
        for index in range(start, end):
            args += (index, frames[index], 1 if index == usage else 0)
        # The expiry with every batch, not the first only: the stream must expire if we die,
        # and one that Redis lost (restarted empty) is made again by the XADD, without an
        # expiry, and the renewal stops with the lock lost with it (a review found such streams
        # left for ever). One script: it runs on a full Redis too (followers wait on it).
        self.sending = end - start
        try:
            with _unavailable("publish frames"):
                await flights._frames(keys=[self.stream], args=args)
        except StoreUnavailable as error:
            flights._failed(error)
            self.refused = _answered_by_redis(error)
            return False
        finally:
            self.sending = 0
        # Only now: a batch that failed (or timed out, perhaps having landed) is sent again;
        # followers skip the frames they have (by index).
        self.sent = end
        flights.counts["frames_published"] += end - start
        flights._answered()
        return True

    async def _leave(self) -> bool:
        """Every local client left: True if the call ended as ``gone`` (nobody follows it;
        then it is cancelled), False if it goes on (a follower reads it, or Redis failed)."""
        flights = self.flights
        try:
            with _unavailable("leave a flight"):
                ended = await flights._end(
                    keys=[self.lock, self.stream, self.stale, self.followed],
                    args=[self.token, 0, flights.lease_ms, flights.maxlen, "e", "g"],
                )
        except StoreUnavailable as error:
            flights._failed(error)
            return False
        flights._answered()
        if not ended:
            if self.leave_at == 0.0:  # (the first time it is asked)
                flights.counts["kept"] += 1
            return False
        self.left = self.aborted = True  # (as ``abort``, but this task ends by itself)
        self.broadcast.on_publish = self.broadcast.on_abandoned = None
        cancel = self.cancel
        if cancel is not None:  # (None: the call returned meanwhile; its store goes on)
            cancel()
        return True

    async def _renew(self) -> bool:
        """False if Redis failed (tried again at the next renewal time)."""
        if not self.renewing:
            return True
        flights = self.flights
        sent_at = asyncio.get_running_loop().time()
        try:
            with _unavailable("renew a flight's lock"):
                held = await flights._renew(
                    keys=[self.lock, self.stream, self.stale],
                    args=[self.token, flights.lease_ms, 2 * flights.lease_ms],
                )
        except StoreUnavailable as error:
            flights._failed(error)
            return False
        flights._answered()
        if not held:  # expired (a long pause) or taken over: followers have moved on
            self.renewing = False
            self.held_until = sent_at
        else:
            self.renewed_at, self.held_until = sent_at, sent_at + flights.lease_ms / 1000
        return True
