"""Idempotency records in Redis/Valkey, shared by every gateway instance (the protocol:
``carpool.idempotency.records``; the way down to the in-process records when Redis is down:
``carpool.idempotency.fallback``).

Leases: a record being processed lives ``lease`` seconds (``idempotency.lease``, default 6) and
its owner renews it every lease/3 while the request runs (a task per record begun here, stopped
by ``finish``/``abandon``/``release``), so a record whose instance died is free again within
``lease`` seconds, while one whose request runs for minutes stays taken. A renewal that fails (Redis down
or paused) is tried again at the next interval; one that finds the record no longer this owner's
(its lease ran out, Redis restarted empty) stops. A ``begin`` cancelled on its way (its client
left) may have landed, a record nobody renews or settles, refusing the client's retry (409) for
the lease: its record is released in the background (``_take_back``), if it is its own.

A ``finish`` that Redis failed (a stall, a reset, a pool busy past its wait: anything but a
refusal, a full Redis or a key of another type) raises as before (the caller keeps a copy of the
answer: ``FallbackRecords``), and goes on in the background (``_finish_later``; nothing of the
request waits on it): tried again with back-off (``BACKOFF_MIN`` doubling up to
``FINISH_RETRY_MAX``), the record's lease renewed meanwhile (for at most one more lease), until
Redis takes it, or until the lease since the last renewal Redis took has run out: then the key
may run again on another instance, once (what a failed finish always risked). So a request
that finishes during a Redis pause shorter than the lease is replayed everywhere once Redis
answers, never run again. ``aclose`` ends those tasks (after ``CLOSE_WAIT_S`` for a command on
its way).

Health: the instance's one health (``connection.Health``, the shared store's), as every Redis
layer: every call (renewals included) reports its failure or success to it, and one that failed
is counted here too (``errors``; a full pool or a full Redis is the health's count only). Unlike
the other layers, ``begin`` and ``wait`` call Redis even while it says Redis is down: a record
that may be there (processing, or done) must not be taken for absent because another layer's call failed;
only this call's own failure sends a request to this process's records (``FallbackRecords``). A call that finds every pooled
connection busy (``PoolExhausted``) is reported once (counted and logged there, never a
degraded period) and tried again, pausing ``BACKOFF_MIN`` doubling, until ``pool_timeout``
has passed since it began: a cluster node's pool does not wait by itself, a single server's
already waited that long (then it is not tried again). A connection Redis refused past its
``maxclients`` (``MaxClients``, a ``PoolExhausted``) is tried again so too: a connection of
this instance's, or a slot, may be free in a moment.

Clocks: the instances' wall clocks may be minutes apart (separate machines), so when a record's
answer was made is kept on Redis's clock (``TIME``, read by the scripts), as the shared exact
cache keeps its entries' (``carpool.redis.store``): a ``finish`` sends its answer's age, read on
this instance's ``clock`` as it is sent, and the script stamps Redis's now less that age; a read
(``begin``, ``wait``) returns Redis's now with the record, and the answer's ``created`` is on
this instance's clock, as long ago as it is on Redis's. So a replay's ``Age`` is Redis time,
whichever instance ran the key. (Before, the writer's wall clock was kept and the replaying
instance's subtracted from it: a retry on an instance 5 minutes behind the writer said
``age: 0``, on one ahead 300 s too old.) A record of an older gateway, without Redis's time,
is read as before: its writer's wall clock, on this instance's (a rolling upgrade's records
live for the retention at most); the writer's wall clock is still kept for older gateways'
reads.

A record that cannot be read (something else wrote the key: a field missing or malformed, its
state among them, a status no HTTP answer has, a header its writer never keeps, a framing one
above all, a key of another type, ``WRONGTYPE``) is a request that ran, or may have, whose
response was not kept: ``begin`` and ``wait`` answer it as ``_UNREADABLE_ANSWER``
(the 507 a full Redis leaves, its message saying why: the record could not be read, which the
retry is told as it is), logged with the record's digest, and
the health is told Redis answered. Its key never runs again (a request that ran would), nor
fails with a 500 for the record's retention.

The 507 a full Redis leaves (``_NOT_KEPT_ANSWER``) is written as its status alone, with neither
headers nor body (``_finish_args``), and read back as that 507 (``_decode``): a full Redis
takes it past ``maxmemory`` for the retention, from every keyed request: ~200 bytes a record
(``MEMORY USAGE``), not ~1.4 KB with the 507's text. (A gateway from before 12-07 reads such a
record as one it cannot read: the unreadable record's 507, logged.)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from typing_extensions import Unpack

from ..clock import SYSTEM_CLOCK, Clock
from ..http_syntax import CONTROL
from ..idempotency import SSE_TYPE, Begin, StoredResponse, _new_token
from ..idempotency.errors import IdempotencyResponseNotKept
from ..idempotency.records import replayable
from .connection import (
    ALWAYS,
    BACKOFF_MIN,
    GROWS,
    POOL_TIMEOUT,
    REDIS_NOW,
    Background,
    ConnectOptions,
    Health,
    PoolExhausted,
    RedisFull,
    StoreUnavailable,
    WrongType,
    byte_client,
    close_client,
    connect,
    counted_apart,
    unavailable_in,
    wait_set,
)
from .keys import check_prefix

if TYPE_CHECKING:
    import redis.asyncio as aredis

__all__ = ["LEASE", "RedisIdempotencyRecords"]

log = logging.getLogger("carpool.idempotency")

LEASE = 6.0  # s a record being processed lives unless its owner renews it

POLL_MIN = 0.005  # s: first pause of ``wait`` between two reads of the record
POLL_MAX = 0.25  # s: longest pause (the back-off grows by half each time)
FINISH_RETRY_MAX = 0.25  # s at most between two tries of a finish that Redis failed
CLOSE_WAIT_S = 1.0  # s ``aclose`` lets a finish on its way land before cancelling it

# KEYS[1] = the record; ARGV = fingerprint, token, lease ms. A finished record comes with
# Redis's now (ms), last, for the age of its answer (``_decode``). Only no key at all is
# ``new``: a hash without its state is ``stateless`` (answered as unreadable, never run again).
_BEGIN = (
    ALWAYS
    + REDIS_NOW
    + """
local rec = redis.call('HMGET', KEYS[1], 's', 'fp', 't')
if not rec[1] then
  -- A record without its state (something else's edit): it may have run. Never 'new'.
  if redis.call('EXISTS', KEYS[1]) == 1 then return {'stateless'} end
  redis.call('HSET', KEYS[1], 's', 'p', 'fp', ARGV[1], 't', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'new'}
end
if rec[2] ~= ARGV[1] then return {'mismatch'} end
if rec[1] == 'r' then                            -- released: this request's to begin again
  redis.call('HSET', KEYS[1], 's', 'p', 't', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'new'}
end
if rec[1] == 'p' then
  if rec[3] == ARGV[2] then return {'new'} end   -- this very call, retried after a lost reply
  return {'processing'}
end
local r = redis.call('HMGET', KEYS[1], 'st', 'h', 'b', 'm', 'c', 'cr')
return {'done', r[1], r[2], r[3], r[4], r[5], r[6], now}
"""
)

# ARGV = token, state (s|f), retention ms, status, headers, body, streamed (1|0), created (the
# writer's wall clock, for older gateways' reads), the answer's age in ms ('': unknown): stamped
# ``cr``, when it was made on Redis's clock (the module's docstring). 1 if stored. ``_FINISH``
# is refused by a full Redis (a response's body, kept for the retention: by the request rate,
# without bound); ``_NOT_KEPT`` then records the small answer a retry gets
# (``IdempotencyResponseNotKept``): the request ran, it must not run again.
_FINISHING = """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[2] ~= ARGV[1] or rec[1] == 'r' then return 0 end
if rec[1] ~= 'p' then                            -- finished by this token: a retried call
  -- (Its first try may have run late, its bytes held by a stalled Redis: stamped younger
  -- than it was. The older stamp is the truer one.)
  if ARGV[9] ~= '' then
    local made = now - tonumber(ARGV[9])
    local was = tonumber(redis.call('HGET', KEYS[1], 'cr'))
    if was ~= nil and made < was then
      redis.call('HSET', KEYS[1], 'cr', string.format('%.0f', made))
    end
  end
  return 1
end
redis.call('HSET', KEYS[1], 's', ARGV[2], 'st', ARGV[4], 'h', ARGV[5], 'b', ARGV[6],
           'm', ARGV[7], 'c', ARGV[8])
if ARGV[9] == '' then
  redis.call('HDEL', KEYS[1], 'cr')
else
  redis.call('HSET', KEYS[1], 'cr', string.format('%.0f', now - tonumber(ARGV[9])))
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
_FINISH, _NOT_KEPT = GROWS + REDIS_NOW + _FINISHING, ALWAYS + REDIS_NOW + _FINISHING

# A record's fields, read as ``begin`` reads a finished one, with Redis's now (ms) first.
_READ = (
    ALWAYS
    + REDIS_NOW
    + """
local r = redis.call('HMGET', KEYS[1], 's', 'fp', 'st', 'h', 'b', 'm', 'c', 'cr')
return {now, r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]}
"""
)
_NOT_KEPT_ANSWER = StoredResponse(
    IdempotencyResponseNotKept.status,
    [
        (name.encode(), value.encode())
        for name, value in IdempotencyResponseNotKept().headers().items()
    ],
    IdempotencyResponseNotKept().body(),
)

# What a record that cannot be read answers (the module's docstring).
_UNREADABLE = IdempotencyResponseNotKept(
    "The request with this Idempotency-Key ran, or may have, but its record could not be "
    "read, so its response cannot be replayed. Use a new Idempotency-Key to run it again."
)
_UNREADABLE_ANSWER = StoredResponse(
    _UNREADABLE.status,
    [(name.encode(), value.encode()) for name, value in _UNREADABLE.headers().items()],
    _UNREADABLE.body(),
)

# ARGV = token. 1 if dropped.
_ABANDON = (
    ALWAYS
    + """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'p' or rec[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
)

# ARGV = token, retention ms. 1 if released (the fingerprint kept, no response: small).
_RELEASE = (
    ALWAYS
    + """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[2] ~= ARGV[1] then return 0 end
if rec[1] == 'r' then return 1 end               -- released by this token: a retried call
if rec[1] ~= 'p' then return 0 end
redis.call('HSET', KEYS[1], 's', 'r')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

# ARGV = token, lease ms. 1 if renewed.
_RENEW = (
    ALWAYS
    + """
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'p' or rec[2] ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

_unavailable = unavailable_in("the Redis idempotency records")


class RedisIdempotencyRecords:
    """The records in Redis/Valkey, shared by every gateway instance.

    ``target``: a URL (``redis://``, ``rediss://``, ``unix://``) or an existing ``redis.asyncio``
    client (not decoding responses; then its timeouts/retries apply and ``aclose`` leaves it
    open, unless ``owns_client``: the exact cache's client can be shared).

    Key layout (``P`` = the prefix, default ``carpool:``; ``{...}`` is a Redis Cluster hash tag):

        P idem:{ID}    HASH, PX = lease, then retention
                       s  = p (PROCESSING) | s (SUCCESS) | f (FAILED) | r (RELEASED)
                       fp = the request fingerprint       t = the owner token
                       st = status (decimal)              h = headers, orjson [[name, value]...]
                                                              (only those a record keeps:
                                                              ``records.replayable``)
                       b  = body bytes                        (latin-1 strings: byte-exact)
                       m  = 1 if the request streamed, else 0 (absent in records written
                            before it existed: then the stored content type says)
                       c  = when the answer was made on its writer's wall clock (seconds,
                            decimal; empty: unknown; absent in records written before it
                            existed): read only where ``cr`` is absent (an older gateway's)
                       cr = when the answer was made on Redis's clock (ms; absent: unknown,
                            or a record of an older gateway)

    - ``ID`` is the 40-hex BLAKE2b digest of the (scoped) key: no user input in key names.
    - Every operation is one Lua script on one key (atomic, Cluster-safe). The lease is the key's
      PX while PROCESSING, so Redis itself drops the record of a dead owner. ``begin`` retried
      after a lost reply recognises its own token and still answers ``new``.
    - ``wait`` polls the record (back-off ``POLL_MIN`` to ``POLL_MAX``, bounded by the
      timeout); a ``finish``/``abandon``/``release`` by this same instance wakes its waiters at
      once.
    - Every Redis or network failure, and any answer slower than ``socket_timeout``, raises
      ``StoreUnavailable`` (the client library's error is its ``__cause__``); a refused
      connection is retried once at once, a timeout never; every pooled connection busy is
      ``PoolExhausted``, once ``pool_timeout`` has passed (see the module's docstring).
    - ``health``: the instance's one health, asked and told as the module's docstring says
      (None: nothing asked or told).
    - ``clock``: the gateway's, whose ``now()`` the answers' ``created`` are read on (in Redis
      they are Redis time: the module's docstring).
    """

    def __init__(
        self,
        target: str | aredis.Redis,
        *,
        retention: float,
        lease: float = LEASE,
        prefix: str = "carpool:",
        poll_max: float = POLL_MAX,
        owns_client: bool | None = None,
        health: Health | None = None,
        clock: Clock = SYSTEM_CLOCK,
        **options: Unpack[ConnectOptions],
    ) -> None:
        check_prefix(prefix)
        if retention <= 0 or lease <= 0:
            raise ValueError("retention and lease must be positive")
        self.retention = retention
        self.lease = lease
        self.renewals = 0  # leases renewed (all records)
        self.errors = 0  # calls that failed (``/metrics``' component="idempotency")
        self._keepers: dict[str, asyncio.Task[None]] = {}  # token -> its renewing task
        # token -> (loop time) when its record's lease runs out: the begin's, or the last
        # renewal's Redis took, counted from when it was sent.
        self._held: dict[str, float] = {}
        # Finishes tried again, begins taken back:
        self._finishing = Background("idempotency record cleanup", log)
        self._closing = asyncio.Event()
        self.prefix = prefix
        self.poll_max = poll_max
        self.health = health
        self._clock = clock
        # (Also how long a call waits for a free connection when ``target`` is a client.)
        self.pool_timeout = options.get("pool_timeout", POOL_TIMEOUT)
        if isinstance(target, str):
            self.url = target
            client = connect(target, **options)
            self._owns_client = True
        else:
            client = target
            self.url = repr(client)
            self._owns_client = bool(owns_client)
        self._client = client = byte_client(client)
        self._begin = client.register_script(_BEGIN)
        self._finish = client.register_script(_FINISH)
        self._not_kept = client.register_script(_NOT_KEPT)
        self._abandon = client.register_script(_ABANDON)
        self._release_record = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._read = client.register_script(_READ)
        # Local wake-ups: waiters of this instance, set by its finish/abandon/release.
        self._changed: weakref.WeakValueDictionary[str, asyncio.Event] = (
            weakref.WeakValueDictionary()
        )
        self.waiters = 0

    def __repr__(self) -> str:
        return f"<RedisIdempotencyRecords {self.url} prefix={self.prefix!r}>"

    def record_key(self, key: str) -> str:
        """The Redis key of the record for ``key``."""
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20)
        return f"{self.prefix}idem:{{{digest.hexdigest()}}}"

    async def begin(self, key: str, fingerprint: str) -> Begin:
        # (Always asked, even while the health says Redis is down: a record that may be in
        # Redis must not be taken for absent because another layer's call failed.)
        token, record_key = _new_token(), self.record_key(key)
        sent = asyncio.get_running_loop().time()
        try:
            reply = await self._call(
                "begin",
                lambda: self._begin(keys=[record_key], args=[fingerprint, token, _ms(self.lease)]),
            )
        except WrongType as error:
            return Begin("done", response=_unreadable(record_key, error.__cause__))
        except asyncio.CancelledError:
            # Its client left while the begin was on its way: it may have landed, a record
            # in our name nobody renews or settles, refusing the client's retry (409) for the
            # lease. Released if it is ours (the script checks the token).
            if not self._closing.is_set():
                self._finishing.spawn(self._take_back(key, token))
            raise
        state = reply[0].decode()
        if state == "new":
            self._held[token] = sent + self.lease
            self._keepers[token] = asyncio.create_task(self._keep(key, token))
            return Begin("new", token)
        if state == "done":
            *fields, redis_now = reply[1:]
            return Begin("done", response=_decode(record_key, fields, redis_now, self._clock.now()))
        if state == "stateless":
            return Begin("done", response=_unreadable(record_key, "a record without its state"))
        return Begin(state)

    async def finish(self, key: str, token: str, response: StoredResponse) -> bool:
        """Keep ``response`` for the retries; on a full Redis (``RedisFull``), that the request
        ran (``_NOT_KEPT``: its retries are told so, never run again). True once settled."""
        record_key = self.record_key(key)
        script = self._finish
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + self.lease / 2, BACKOFF_MIN
        later = False  # tried again in the background, which releases the lease then
        try:
            while True:
                try:
                    done = await self._call(
                        "finish", self._finish_command(script, record_key, token, response)
                    )
                    break
                except RedisFull:
                    if script is self._not_kept:
                        raise
                    script, response = self._not_kept, _NOT_KEPT_ANSWER
                except PoolExhausted:
                    # Redis answers: a finished answer is worth more waiting (dropped, the
                    # lease would run out and a retry run the key again), for as long as the
                    # lease, renewed meanwhile, is safely alive.
                    if loop.time() + pause >= deadline:
                        raise
                    await asyncio.sleep(pause)
                    pause *= 2
        except (RedisFull, WrongType):  # (Redis answered: no use sending it again)
            raise
        except StoreUnavailable:
            # A stall, a reset: Redis may take it in a moment (the module's docstring).
            later = not self._closing.is_set()
            if later:
                self._finishing.spawn(self._finish_later(record_key, token, script, response))
            raise
        finally:
            if not later:
                self._release(token)  # (only now: the lease must outlive the script)
        self._wake(record_key)
        return bool(done)

    async def _take_back(self, key: str, token: str) -> None:
        """A begin cancelled on its way: its record released if it landed (once; should Redis
        fail this too, the lease frees the key)."""
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(self.lease / 6):
                await self.release(key, token)

    async def _finish_later(
        self, record_key: str, token: str, script: Any, response: StoredResponse
    ) -> None:
        """A finish Redis failed, tried again until it lands or the lease is lost (the module's
        docstring); the record's lease renewed by its keeper meanwhile, for one more lease at
        most (a Redis that renews but never takes the finish must not hold the key for ever)."""
        loop = asyncio.get_running_loop()
        renew_by = loop.time() + self.lease
        pause = BACKOFF_MIN
        try:
            while not self._closing.is_set():
                left = self._held.get(token, 0.0) - loop.time()
                if left <= 0:
                    return  # the lease ran out (or the record is no longer ours)
                await wait_set(self._closing, min(pause, left))
                pause = min(pause * 2, FINISH_RETRY_MAX)
                if self._closing.is_set() or loop.time() >= self._held.get(token, 0.0):
                    return
                if loop.time() >= renew_by:
                    keeper = self._keepers.pop(token, None)
                    if keeper is not None:
                        keeper.cancel()
                try:
                    # (No longer than the lease holds: a busy pool's wait is ``pool_timeout``.)
                    async with asyncio.timeout(max(0.0, self._held.get(token, 0.0) - loop.time())):
                        await self._call(
                            "finish", self._finish_command(script, record_key, token, response)
                        )
                except TimeoutError:
                    return  # (the lease ran out meanwhile)
                except RedisFull:
                    if script is self._not_kept:
                        return
                    # (The response is not kept: that the request ran is, as ``finish`` does.)
                    script, response = self._not_kept, _NOT_KEPT_ANSWER
                    continue
                except WrongType:
                    return
                except StoreUnavailable:
                    continue
                self._wake(record_key)
                return
        finally:
            self._release(token)

    def _finish_command(
        self, script: Any, record_key: str, token: str, response: StoredResponse
    ) -> Callable[[], Awaitable[Any]]:
        """The command that finishes ``record_key`` with ``response``: its arguments made as it
        is sent, so that its answer's age is as of then (a finish tried again later is stamped
        on Redis's clock then, not as young as at its first try; and should that first try
        run late, held by a stalled Redis, the older of their stamps is kept)."""
        return lambda: script([record_key], self._finish_args(token, response))

    def _finish_args(self, token: str, response: StoredResponse) -> list[Any]:
        if response is _NOT_KEPT_ANSWER:
            # Its status alone, no headers nor body (``_decode`` words it): written past a full
            # Redis's maxmemory by every keyed request, for the retention, the 507's ~900
            # bytes of text grew it by ~1.5 KB a request.
            return [token, "f", _ms(self.retention), response.status, "", "", 0, "", ""]
        headers = orjson.dumps(
            [[n.decode("latin-1"), v.decode("latin-1")] for n, v in replayable(response.headers)]
        )
        # (Sent as a duration, stamped on Redis's clock: this instance's may be minutes off.)
        made = response.created
        age_ms = "" if made is None else max(0, int((self._clock.now() - made) * 1000))
        return [
            token,
            "s" if 200 <= response.status < 300 else "f",
            _ms(self.retention),
            response.status,
            headers,
            response.body,
            int(response.streamed),
            "" if made is None else repr(float(made)),
            age_ms,
        ]

    async def abandon(self, key: str, token: str) -> bool:
        record_key = self.record_key(key)
        try:
            dropped = await self._call(
                "abandon", lambda: self._abandon(keys=[record_key], args=[token])
            )
        finally:
            self._release(token)
        self._wake(record_key)
        return bool(dropped)

    async def release(self, key: str, token: str) -> bool:
        record_key = self.record_key(key)
        try:
            released = await self._call(
                "release",
                lambda: self._release_record(keys=[record_key], args=[token, _ms(self.retention)]),
            )
        finally:
            self._release(token)
        self._wake(record_key)
        return bool(released)

    async def renew(self, key: str, token: str) -> bool:
        return bool(
            await self._call(
                "renew",
                lambda: self._renew(keys=[self.record_key(key)], args=[token, _ms(self.lease)]),
            )
        )

    async def _call(self, operation: str, command: Callable[[], Awaitable[Any]]) -> Any:
        """``command``'s reply, its failure or success told to the health (see the module's
        docstring: a full pool is told once, then waited for up to ``pool_timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.pool_timeout
        pause, told = BACKOFF_MIN, False
        while True:
            try:
                with _unavailable(operation):
                    reply = await command()
            except PoolExhausted as error:
                if not told:
                    told = True
                    self._report(error)
                left = deadline - loop.time()
                if left <= 0:
                    raise
                await asyncio.sleep(min(pause, left))
                pause *= 2
                continue
            except WrongType as error:
                self._report(error)  # (Redis answered: the health counts it apart)
                raise
            except StoreUnavailable as error:
                if not counted_apart(error):  # (Redis answered: the health counts it)
                    self.errors += 1
                self._report(error)
                raise
            self._report(None)
            return reply

    def _report(self, error: StoreUnavailable | None) -> None:
        if self.health is not None:
            self.health.report(error)

    async def _keep(self, key: str, token: str) -> None:
        """Renew the lease of ``token``'s record every lease/3 until it is settled or lost.

        Each renewal may take at most lease/6 (a wait for a pooled connection included); one
        that fails is tried again after lease/12, so a lease survives a Redis pause of about
        half of it (3 s at the default 6 s) rather than expiring while its request runs."""
        pause = self.lease / 3
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        while True:
            await asyncio.sleep(pause)
            # (Released, it is cancelled; it also stops by itself, should a client library
            # ever lose that cancellation: it renewed the record of a finished request on.)
            if self._keepers.get(token) is not me:
                return
            sent = loop.time()
            try:
                async with asyncio.timeout(self.lease / 6):
                    alive = await self.renew(key, token)
            except (StoreUnavailable, TimeoutError):
                pause = self.lease / 12  # Redis down, paused or busy: again soon
                continue
            if not alive:
                self._keepers.pop(token, None)
                self._held[token] = 0.0  # (lost: a finish tried again stops)
                return
            self._held[token] = sent + self.lease
            self.renewals += 1
            pause = self.lease / 3

    def _release(self, token: str) -> None:
        self._held.pop(token, None)
        keeper = self._keepers.pop(token, None)
        if keeper is not None:
            keeper.cancel()

    async def wait(self, key: str, fingerprint: str, timeout: float) -> StoredResponse | None:
        record_key = self.record_key(key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        mine = fingerprint.encode()
        pause = POLL_MIN
        self.waiters += 1
        try:
            while True:
                changed = self._changed.get(record_key)
                if changed is None:
                    changed = self._changed[record_key] = asyncio.Event()
                try:
                    redis_now, state, found, *fields = await self._call(
                        "wait", lambda: self._read(keys=[record_key])
                    )
                except WrongType as error:
                    return _unreadable(record_key, error.__cause__)
                if state is None or found != mine or state == b"r":
                    return None  # (RELEASED: not running; its request begins it again)
                if state != b"p":
                    return _decode(record_key, fields, redis_now, self._clock.now())
                left = deadline - loop.time()
                if left <= 0:
                    return None
                await wait_set(changed, min(pause, left))
                pause = min(pause * 1.5, self.poll_max)
        finally:
            self.waiters -= 1

    async def aclose(self) -> None:
        """The finishes tried again stop waiting (one on its way gets ``CLOSE_WAIT_S``, then
        is cancelled: the record is left to its lease), the leases are no longer renewed."""
        self._closing.set()
        await self._finishing.drain(CLOSE_WAIT_S)
        for token in list(self._keepers):
            self._release(token)
        if self._owns_client:
            await close_client(self._client)

    def _wake(self, record_key: str) -> None:
        changed = self._changed.pop(record_key, None)
        if changed is not None:
            changed.set()


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _decode(record_key: str, fields: list[Any], redis_now: Any, now: float) -> StoredResponse:
    """The response a finished record holds (``fields``: ``st``, ``h``, ``b``, ``m``, ``c``,
    ``cr`` as read, with ``redis_now``, Redis's now in ms); ``_UNREADABLE_ANSWER`` if it cannot
    be read (the module's docstring). Its answer's ``created`` is on the reader's clock, whose
    reading is ``now``: as long ago as ``cr`` is of ``redis_now`` (Redis time); a record of an
    older gateway (no ``cr``) has only its writer's wall clock, ``c``, taken as it is."""
    status, headers, body, streamed, created, made_ms = fields
    if status == str(_NOT_KEPT_ANSWER.status).encode() and headers == b"" and body == b"":
        return _NOT_KEPT_ANSWER  # (as ``_finish_args`` writes it: a response not kept)
    try:
        code = int(status)
        named = [(n, v) for n, v in orjson.loads(headers)]
        pairs = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in named]
        # Only what its writer keeps (``replayable``): another header, a framing one above all
        # (``content-length``, ``transfer-encoding``), went out beside the transport's own.
        readable = not any(CONTROL.search(v) for _, v in named) and replayable(pairs) == pairs
        if made_ms:
            made: float | None = now - max(0.0, int(redis_now) - float(made_ms)) / 1000
        else:
            made = float(created) if created else None  # (None, empty: unknown)
    except (TypeError, ValueError, AttributeError) as error:  # (JSONDecodeError: a ValueError)
        return _unreadable(record_key, error)
    if not (
        readable and 100 <= code <= 599 and isinstance(body, bytes) and math.isfinite(made or 0.0)
    ):
        return _unreadable(
            record_key, "a status, body or time no answer has, or a header none keeps"
        )
    if streamed is None:  # written before the field existed: the content type says
        streamed = any(n == b"content-type" and v.startswith(SSE_TYPE) for n, v in pairs)
    return StoredResponse(code, pairs, body, streamed in (True, b"1"), made)


def _unreadable(record_key: str, why: object) -> StoredResponse:
    log.warning(
        "an idempotency record in Redis cannot be read (%s), answered as a response not kept: %s",
        record_key,
        why,
    )
    return _UNREADABLE_ANSWER
