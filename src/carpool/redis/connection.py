"""The one owner of the Redis/Valkey client: connecting, the pool, error translation, health.

Contract
--------
- :func:`connect` returns a ``redis.asyncio`` client (bytes, never decoded) on a
  :class:`~redis.asyncio.BlockingConnectionPool` of ``max_connections``: a caller that finds every
  connection busy *waits* for one, up to ``pool_timeout`` seconds. The library's default pool
  instead fails at once past 100 connections ("Too many connections"), which a burst of a few
  hundred concurrent requests reached while Redis was healthy, switching the instance to
  running every call alone. (A cluster client's pools, one per node of ``max_connections``, do
  not wait: past them a call is ``PoolExhausted`` at once.) The blocking pool opens at most
  ``CONNECTS_AT_ONCE`` connections at a time (a burst on a cold instance opened one per
  request, and on loaded cores some outlasted the connect timeout: a degraded moment), and
  hands out a connected connection before one it must (re)open (``_pool_class``). Each
  command may take ``socket_timeout`` (a hung Redis fails a call in that long, never hangs
  it), a connection ``connect_timeout``; a refused or reset connection is retried ``retries``
  times at once (a pooled connection may be stale after a restart; on uvloop a write on one a
  reset closed is a ``RuntimeError``, retried and translated alike), a timeout never is.
- :func:`unavailable` translates the client library's errors (and socket errors) into
  :class:`StoreUnavailable`, the one error every Redis-backed layer raises; a wait for a pooled
  connection that ran out is :class:`PoolExhausted`, a subclass: Redis answered, this instance
  had more callers than connections. The health (``store.shared.SharedStore``, which every layer
  reports to) counts and logs it and does **not** start a degraded period. A connection Redis
  refused because it serves as many clients as it may (``maxclients``: "max number of clients
  reached", its reply to the handshake) is :class:`MaxClients`, a subclass of that one: Redis
  answered and ran nothing, every layer takes it as a busy pool (a keyed request is refused,
  never run from this process's records), and the health counts it apart (``max_clients``: the
  remedy is Redis's ``maxclients``, or fewer connections per instance, not more). Before, it
  was Redis down: a burst that met it made an instance degraded, its keyed requests run from
  its own records (twice across instances). A write Redis refused because it is full
  (``maxmemory`` reached under ``noeviction``: ``OOM``) is :class:`RedisFull`, another:
  Redis answered; the health counts it (``full``), logs it, and
  does not start a degraded period either. A command on a key that holds another type than
  carpool writes there (``WRONGTYPE``: something else wrote it) is :class:`WrongType`, a
  third: Redis answered; the layer that reads the key treats it as a value it cannot read
  (``store``: a miss, the key dropped; ``idempotency``: a response not kept), never as an
  outage (:func:`wrong_type` tells it among the replies of a pipeline that returns its
  errors, or raised by one). A layer that does not handle it takes it as a failed call, which
  the health counts (``wrong_type``) and logs, starting no degraded period (before, it did:
  a value something else wrote under one of carpool's names switched sharing off for every
  key, again each time a request read it). A command a Redis Cluster
  refused while its slot was being migrated (a reshard between its steps: ``TRYAGAIN`` for a
  command on several keys, some moved and some not, or redirections, until redis-py's 16
  tries ran out: ``ClusterError: TTL exhausted``) is :class:`SlotMoving`, a fourth: Redis
  answered and ran nothing; the health counts it (``slot_moving``), logs it, and starts no
  degraded period (a reshard's minutes of those made an instance flap degraded, sharing
  off). The layers take it as a failed call otherwise. A call whose task was
  cancelled during it ends cancelled, even where the client library then returned its reply
  or failed (redis-py's send uses ``asyncio.wait_for``, which on Python 3.11 returns a result
  that came with the cancellation, gh-86296: a lease keeper cancelled there renewed on and,
  with Redis stopped, never ended).
- Every Lua script declares its flags (a ``#!lua`` first line; Redis >= 7.0, every Valkey):
  one that adds an answer to a cache is refused whole by a full Redis, before it writes
  anything (without the line, Redis checks memory at the script's first command that grows
  it: a script beginning with a DEL went past ``maxmemory``, without bound), and one that frees
  memory or keeps a generation from running twice (invalidations, flights, idempotency
  records, the counts) says ``allow-oom`` (without it, a full Redis could not be emptied
  through /admin/invalidate). :data:`GROWS` and :data:`ALWAYS` are the two first lines.
- :func:`wait_set` waits for an event, for so many seconds at most: a background task's
  pause between two tries, which a change or its layer's close ends early.
- :func:`connect`'s client owns its pool: :func:`close_client` closes its connections too (a
  close that outlasted the connect timeout on a busy loop is logged at debug level, its socket
  shut all the same), as every layer that owns its client does in its ``aclose``.
- :func:`stop_reader` and :class:`Background` (``carpool.background``'s, named here for the
  layers of this package): a reader stopped even where redis-py's cluster client swallowed its
  cancellation, and a layer's work off its callers' path, drained in its ``aclose``.
- :class:`Health` is what a layer asks before a Redis call (``usable()``) and tells after it
  (``report(error or None)``): one state per instance, shared by every layer on that Redis.
  While degraded, a True from ``usable()`` is the one attempt per ``retry_interval``: the caller
  that gets it must make its call (the others stay off Redis until then).
  ``invalidated_elsewhere()`` is what the invalidation subscriber tells it of another
  instance's invalidation (what this instance keeps locally while degraded is dropped).
- :func:`url_problem` is what redis-py would refuse in a URL when :func:`connect` makes its
  first connection (an unknown or malformed query parameter), and a database path that is no
  number (redis-py reads ``/abc`` as database 0): the config refuses them when it loads, so
  ``carpool check-config`` says what ``carpool serve`` would fail on. Its message quotes nothing
  of the URL but the parameter's name.
- :func:`server_mode` (``carpool serve``'s start) tells a cluster node from a standalone server,
  refuses a server older than Redis 7.0 (:func:`version_problem`: the scripts' first lines) and
  warns, in the log, when the server evicts keys (``maxmemory-policy`` other than
  ``noeviction``: :func:`eviction_problem` says what breaks).
- The redis-py library is imported by the modules of this package only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from ..background import Background, stop_reader
from ..config.urls import urls_without_credentials
from ..store.base import StoreUnavailable

if TYPE_CHECKING:
    import redis.asyncio as aredis

log = logging.getLogger("carpool.redis")

__all__ = [
    "Background",
    "Backoff",
    "ALWAYS",
    "GROWS",
    "Health",
    "MaxClients",
    "PoolExhausted",
    "RedisFull",
    "SlotMoving",
    "StoreUnavailable",
    "WrongType",
    "connect",
    "eviction_problem",
    "server_mode",
    "close_client",
    "stop_reader",
    "wait_set",
    "wrong_type",
    "url_problem",
    "unavailable",
    "version_problem",
    "unavailable_in",
]

SOCKET_TIMEOUT = 0.5  # s per command: Redis answers in well under a ms; a hung one must fail
CONNECT_TIMEOUT = 0.25  # s per connection attempt
RETRIES = 1  # immediate retries on a refused/reset connection (never on a timeout)
MAX_CONNECTIONS = 1000  # per instance; Valkey's default maxclients is 10,000
CONNECTS_AT_ONCE = 16  # connections a pool opens at a time (``_pool_class``)
POOL_TIMEOUT = 5.0  # s a caller may wait for a free pooled connection
BACKOFF_MIN = 0.05  # s before a background reader's first retry after a Redis failure


class Backoff:
    """The pauses of a background reader (a subscriber, a stream reader) between its attempts
    to reach Redis again: ``BACKOFF_MIN`` s, doubling up to ``longest``; ``reset()`` after a
    success. (Request paths never wait: they skip Redis for ``distributed.retry_interval``.)"""

    def __init__(self, longest: float) -> None:
        self.longest = max(longest, BACKOFF_MIN)
        self.pause = BACKOFF_MIN

    def reset(self) -> None:
        self.pause = BACKOFF_MIN

    async def wait(self) -> None:
        await asyncio.sleep(self.pause)
        self.pause = min(self.pause * 2, self.longest)


async def wait_set(event: asyncio.Event, seconds: float) -> None:
    """Until ``event`` is set, ``seconds`` at most (the module's contract). (A timeout scope,
    not ``asyncio.wait_for``, whose wrapping task could lose a cancel.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


async def close_client(client: Any) -> None:
    """Close ``client`` and its connections (the module's contract). A connection whose close
    outlasted the connect timeout (on a busy loop) is closed all the same, its socket shut:
    that is no failure of the caller's close."""
    from redis.exceptions import RedisError

    try:
        await client.aclose()
    except (RedisError, OSError) as error:
        log.debug("closing a Redis client: %s", error)


class PoolExhausted(StoreUnavailable):
    """Every pooled connection stayed busy for ``pool_timeout``: this instance is overloaded,
    Redis is not down (never a reason for a degraded period)."""


class MaxClients(PoolExhausted):
    """Redis refused a new connection: it serves ``maxclients`` clients already (every
    instance's connections, and anyone else's). Redis answers and ran nothing (never a reason
    for a degraded period); handled as a busy pool, counted apart (the module's contract)."""


def _past_maxclients(error: BaseException) -> bool:
    """Whether ``error`` is Redis's (and Valkey's) reply to a connection past ``maxclients``:
    "max number of clients reached", which redis-py raises as a ConnectionError, as for a
    socket that failed; or, from a node in cluster mode, "max number of clients + cluster
    connections reached", which it raises as a ResponseError (``_translated``)."""
    said = str(error)
    return said.startswith("max number of clients") and said.rstrip().endswith("reached")


class WrongType(StoreUnavailable):
    """A key holds a value of another type than carpool writes there (``WRONGTYPE``): Redis
    answered, something else wrote the key (never a reason for a degraded period where the
    layer handles it: the module's contract)."""


class RedisFull(StoreUnavailable):
    """Redis refused a write that grows it: ``maxmemory`` reached under ``noeviction``. Redis
    answers (never a reason for a degraded period); what was refused is not shared."""


class SlotMoving(StoreUnavailable):
    """A Redis Cluster refused the command while its keys' slot was being migrated, until the
    client's tries ran out (the module's contract). Redis answers and ran nothing (never a
    reason for a degraded period)."""


# The failures that are Redis's answer, not its absence: the health (``SharedStore``) counts
# each apart (``max_clients``, ``pool_exhausted``, ``full``, ``slot_moving``, ``wrong_type``),
# none a degraded period.
ANSWERED = (PoolExhausted, RedisFull, SlotMoving, WrongType)


def counted_apart(error: StoreUnavailable) -> bool:
    """Whether ``error`` is one the health counts apart (``ANSWERED``): a layer then counts it
    in no ``errors`` of its own (``carpool_redis_errors_total``), which says Redis failed."""
    return isinstance(error, ANSWERED)


# The first line of every Lua script (the module's contract): refused whole by a full Redis,
# or run even then (it frees memory, or keeps a generation from running twice).
GROWS = "#!lua\n"
ALWAYS = "#!lua flags=allow-oom\n"
# Redis's own time in ms (``now``; ``at``, the same as an argument's text: no exponent), for a
# script to read after its flags line: the one clock every instance's scripts read, whose wall
# clocks may be minutes apart (separate machines). (On a Cluster, the clock of the node that
# holds the script's keys.) The shared store's scripts and the semantic stream's head read it.
REDIS_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local at = string.format('%.0f', now)
"""
MIN_VERSION = (7, 0)  # the first Redis that reads a script's flags (every Valkey does)


class Health(Protocol):
    def usable(self) -> bool: ...

    def report(self, error: StoreUnavailable | None) -> None: ...

    def invalidated_elsewhere(self) -> int: ...


class ConnectOptions(TypedDict, total=False):
    """``connect``'s settings, as every Redis layer takes them (``**options``)."""

    socket_timeout: float
    connect_timeout: float
    retries: int
    max_connections: int
    pool_timeout: float
    cluster: bool


def byte_client(client: aredis.Redis) -> aredis.Redis:
    """``client``, checked: carpool keeps bytes (bodies, frames), so it must not decode."""
    if client.get_connection_kwargs().get("decode_responses"):
        raise ValueError("the Redis client must not decode responses: bodies are bytes")
    return client


def connect(
    url: str,
    *,
    socket_timeout: float = SOCKET_TIMEOUT,
    connect_timeout: float = CONNECT_TIMEOUT,
    retries: int = RETRIES,
    max_connections: int = MAX_CONNECTIONS,
    pool_timeout: float = POOL_TIMEOUT,
    cluster: bool = False,
) -> aredis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``) on a blocking pool.

    ``cluster``: redis-py's cluster client (see ``_cluster_class``), starting from the node at
    ``url``: it learns the others and follows MOVED/ASK. Its own policy retries a timeout too,
    re-reading the topology (a failover looks like one), so a hung cluster fails a call in a
    few ``socket_timeout``: 0.6-0.8 s at 0.2 s, measured. Every key layout here keeps each
    script and each pipeline in one slot (hash tags), so it works unchanged on a cluster."""
    try:
        import redis.asyncio as aredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
    except ImportError as exc:  # pragma: no cover - depends on the install
        from ..extras import install_hint

        raise ImportError(
            f"sharing through Redis needs the redis extra: {install_hint('redis')}"
        ) from exc
    # (uvloop's RuntimeError on a write to a transport a reset closed: a stale connection as
    # a reset one is, in ``_translated``'s words; nothing of the command was sent.)
    # (redis-py types them as its own errors; it catches whatever it is given.)
    retried = (RedisConnectionError, RuntimeError)
    retry = Retry(NoBackoff(), retries, supported_errors=retried)  # type: ignore[arg-type]
    if cluster:
        # (Its per-node pools do not wait for a free connection: sized generously instead.)
        cluster_class: Any = _cluster_class()
        clustered: aredis.Redis = cluster_class.from_url(
            url,
            max_connections=max_connections,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=retry,
            # A MOVED updates that one slot's owner (a new node added), never the whole client:
            # every fifth MOVED (redis-py's default) closed every node's connections under the
            # commands using them, and a reshard of a live flight's slot made both instances
            # flap degraded (54 periods in 10 s, measured; 5 without). A connection error
            # still reads the topology again, and a scan of every master reads it first
            # (``read_topology``).
            reinitialize_steps=0,
        )
        return clustered
    pool = _pool_class().from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=retry,
    )
    # (Its owner: the client's ``aclose`` closes the pool's connections too. Given a pool,
    # ``Redis(connection_pool=...)`` leaves them open: the sockets of a closed layer's client
    # stayed until the process ended.)
    return aredis.Redis.from_pool(pool)


@functools.cache
def _pool_class() -> Any:
    """redis-py's blocking pool, opening at most ``CONNECTS_AT_ONCE`` connections at a time.

    A burst of requests on a cold instance had it open one connection per request at once
    (~350 on each of 3 instances): on loaded cores some took longer than the connect timeout,
    a degraded moment in which every request ran its call alone. Past that many connections
    on their way, a caller waits for one: a connection made, or one a call gave back (a call
    takes well under a ms), within the same ``pool_timeout``. Not for two attempts' time
    (connect and socket timeouts) after a connection failed to open (Redis down or hung):
    each caller then fails in its own attempt, not in turn after those before it (a wait that
    outlasted ``pool_timeout`` would be taken for a busy pool, Redis up).

    It hands out a connected connection first, one it must open again only when none is free
    (``LiveFirst``). redis-py's pool hands out the connection given back last, and gives back
    one that failed to open as well: after a burst that met Redis's ``maxclients``, the refused
    ones lay on top of the pool's live connections, so that each later call opened one again,
    refused again, the live ones below never used (two instances whose idle connections held
    every slot between them stayed degraded for as long as Redis ran)."""
    import redis.asyncio as aredis

    class LiveFirst(aredis.ConnectionPool):
        # (A base of ``Pool`` after the blocking pool, whose ``get_connection`` takes its
        # connection from ``super().get_available_connection()``: this one.)
        def get_available_connection(self) -> Any:
            available = self._available_connections
            if available and not available[-1].is_connected:
                # (Those not connected hold no socket: below the live ones, in one pass, so
                # that the calls after this one find a live one on top at once again.)
                live = [c for c in available if c.is_connected]
                if live:
                    available[:] = [c for c in available if not c.is_connected] + live
            return super().get_available_connection()  # type: ignore[no-untyped-call]  # (redis-py's, unannotated)

    class Pool(aredis.BlockingConnectionPool, LiveFirst):
        connecting = 0  # connections being opened now
        failed_at = -math.inf  # (loop time) when the last one that failed to open failed

        def can_get_connection(self) -> bool:
            return bool(self._available_connections) or (
                len(self._in_use_connections) < self.max_connections
                and (self.connecting < CONNECTS_AT_ONCE or self._failing())
            )

        def _failing(self) -> bool:
            # (Two attempts' worth: the TCP connect, then the handshake's reply. While
            # callers try, each failure comes within one attempt of the last.)
            kwargs = self.connection_kwargs
            attempt = (kwargs.get("socket_connect_timeout") or CONNECT_TIMEOUT) + (
                kwargs.get("socket_timeout") or SOCKET_TIMEOUT
            )
            return asyncio.get_running_loop().time() - self.failed_at < 2 * attempt

        async def ensure_connection(self, connection: Any) -> None:
            if connection.is_connected:
                await super().ensure_connection(connection)
                return
            self.connecting += 1
            try:
                await super().ensure_connection(connection)
            except Exception:
                self.failed_at = asyncio.get_running_loop().time()
                raise
            finally:
                self.connecting -= 1
                # Every waiter, not one: one woken and cancelled in the same turn would take
                # the wake-up with it (Python 3.11's Condition), the others left waiting while
                # there is room, until ``pool_timeout``, for nothing.
                async with self._condition:
                    self._condition.notify_all()

    return Pool


def url_problem(url: str) -> str | None:
    """What is wrong with ``url`` for redis-py, or None (also when redis-py is not installed:
    ``connect`` then says which extra to install). A cluster client's own options
    (``read_from_replicas``...) pass: the config may turn ``distributed.cluster`` on."""
    try:
        import redis.asyncio as aredis
        from redis.connection import parse_url
        from redis.exceptions import RedisError
    except ImportError:  # pragma: no cover - depends on the install
        return None
    scheme, _, rest = url.partition("://")
    path = rest.split("?", 1)[0].split("#", 1)[0].partition("/")[2]
    try:
        read = parse_url(url)
    except (ValueError, RedisError) as exc:
        return urls_without_credentials(str(exc))
    if scheme != "unix" and path.strip("/") and "db" not in read:
        # (redis-py reads "/2/" and "/%31" as databases 2 and 1, and "/abc" as none: database 0)
        return "the path must be a database number (redis://host:port/0)"
    try:  # (what connect does, up to the socket: the pool reads the URL, a connection its options)
        aredis.BlockingConnectionPool.from_url(url).make_connection()
    except TypeError as exc:  # (an option no connection takes: "... argument 'foo'")
        name = str(exc).rsplit(" ", 1)[-1]
        if name.strip("'") in _cluster_options():
            return None
        return f"a query parameter redis-py does not know ({name})"
    except (ValueError, RedisError) as exc:
        return urls_without_credentials(str(exc))
    return None


@functools.cache
def _cluster_options() -> frozenset[str]:
    import inspect

    from redis.asyncio.cluster import RedisCluster

    return frozenset(inspect.signature(RedisCluster.__init__).parameters)


@functools.cache
def _cluster_class() -> type:
    from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
    from redis.cluster import PRIMARY

    class Cluster(RedisCluster):
        """redis-py's cluster client, its topology read before the first command is routed.

        Its own lazy start-up races: callers that arrive together each pick their node from
        the startup node before one of them has read the topology, which then closes that
        node's connections under the others (measured: 20 concurrent calls on a fresh client,
        7 to 12 of them failed, one with an ``AttributeError`` from inside the library).
        Every command, pipeline and pub/sub call here waits for that one reading first."""

        async def ready(self) -> None:
            if self._initialize:
                await self.initialize()  # (itself under the client's lock: runs once)

        def get_node(self, host: Any = None, port: Any = None, node_name: str | None = None) -> Any:
            node = super().get_node(host, port, node_name)
            if node is None and node_name is not None and host is None:
                # An ASK to a node this client does not know yet (a master added since it
                # read the topology, importing a slot): redis-py looks it up by name and
                # failed on None inside (an AttributeError: Redis taken for failing, the
                # instance degraded). Learned as a MOVED to it would teach it.
                name, _, number = node_name.rpartition(":")
                manager = self.nodes_manager
                node = ClusterNode(name, int(number), PRIMARY, **manager.connection_kwargs)
                manager.set_nodes(manager.nodes_cache, {node.name: node})
            return node

        async def read_topology(self) -> None:
            await self.ready()
            await self.nodes_manager.initialize()  # (its connections kept, lazily renewed)

        async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
            await self.ready()
            return await super().execute_command(*args, **kwargs)

        def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
            pipe = super().pipeline(transaction, shard_hint)
            pipe.execute = self._ready_first(pipe.execute)  # type: ignore[method-assign,assignment]  # (wrapped: topology first)
            return pipe

        def pubsub(self, *args: Any, **kwargs: Any) -> Any:
            pubsub = super().pubsub(*args, **kwargs)
            pubsub.execute_command = self._ready_first(  # type: ignore[method-assign,assignment]  # (wrapped: topology first)
                pubsub.execute_command
            )
            return pubsub

        def _ready_first(
            self,
            method: Callable[..., Awaitable[Any]],
        ) -> Callable[..., Awaitable[Any]]:
            async def call(*args: Any, **kwargs: Any) -> Any:
                await self.ready()
                return await method(*args, **kwargs)

            return call

    return Cluster


async def read_topology(client: Any) -> None:
    """Before a scan of the whole keyspace: a cluster client's masters read again (a single
    server's client: nothing to do). A cluster client learns a master added since it read the
    topology only once redirected there (MOVED), and its ``scan_iter`` scans the masters it
    knows: an invalidation of everything answered 200 and left the answers a new master held."""
    read = getattr(client, "read_topology", None)
    if read is not None:
        await read()


@contextlib.contextmanager
def unavailable(what: str) -> Iterator[None]:
    """Translate the Redis client's errors (and socket timeouts) into ``StoreUnavailable``; a
    cancellation the client library swallowed during the call is raised at its end (the
    module's contract), whether the call then returned or failed (a read that failed after the
    send that took the cancellation: taken for Redis failing, a lease keeper renewed on)."""
    task = _current_task()
    cancels_before = task.cancelling() if task is not None else 0
    try:
        with _translated(what):
            yield
    except Exception as exc:
        if task is not None and task.cancelling() > cancels_before:
            raise asyncio.CancelledError from exc
        raise
    if task is not None and task.cancelling() > cancels_before:
        # Raised here, as it would have been had it come a moment later. (An
        # ``asyncio.timeout`` around the call that expired during it takes it back as its
        # TimeoutError.)
        raise asyncio.CancelledError


# uvloop's words for a write on a transport already closed (``_translated``).
_CLOSED_TRANSPORT = "unable to perform operation on"


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    from redis.exceptions import (
        ClusterError,
        MaxConnectionsError,
        OutOfMemoryError,
        RedisClusterException,
        RedisError,
        ResponseError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        yield
    except OutOfMemoryError as exc:
        raise RedisFull(f"{what}: Redis is full (maxmemory): {exc}") from exc
    except TryAgainError as exc:  # (a pipeline's, which redis-py does not try again)
        raise SlotMoving(f"{what}: a slot being migrated: {exc}") from exc
    except ClusterError as exc:
        # redis-py's cluster client ran out of tries: TRYAGAIN, ASK or MOVED every time, which
        # only a slot in migration answers (a node that failed raises its own error at once).
        kind = SlotMoving if "TTL exhausted" in str(exc) else StoreUnavailable
        raise kind(f"{what}: {type(exc).__name__}: {exc}") from exc
    except ResponseError as exc:
        kind = (
            MaxClients
            if _past_maxclients(exc)
            else WrongType
            if wrong_type(exc)
            else StoreUnavailable
        )
        raise kind(f"{what}: {type(exc).__name__}: {exc}") from exc
    except RedisConnectionError as exc:
        # BlockingConnectionPool's own wording when its wait for a connection runs out; a
        # cluster node's pool does not wait: it raises MaxConnectionsError at once. Redis
        # refusing a connection past its maxclients answered: no outage either.
        kind = (
            MaxClients
            if _past_maxclients(exc)
            else PoolExhausted
            if isinstance(exc, MaxConnectionsError) or "No connection available" in str(exc)
            else StoreUnavailable
        )
        raise kind(f"{what}: {type(exc).__name__}: {exc}") from exc
    except (RedisError, RedisClusterException, OSError) as exc:
        # (RedisClusterException, "no node reachable", is not a RedisError.)
        raise StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
    except (AttributeError, TypeError) as exc:
        # redis-py's cluster client, on a node killed mid-call, uses the connection it tore
        # down ("'NoneType' object has no attribute 'writelines'"): Redis failed, not the
        # request, which must not become a 500 (the message is logged with the failure).
        raise StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:
        # uvloop (``carpool serve``'s loop) refuses a write on a transport a reset closed with
        # a RuntimeError, where asyncio's raises an OSError: a connection Redis (or a
        # middlebox) reset, which redis-py drops as it raises. Any other RuntimeError is a bug.
        if _CLOSED_TRANSPORT not in str(exc):
            raise
        raise StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


def wrong_type(error: BaseException) -> bool:
    """Whether ``error`` is Redis's ``WRONGTYPE`` (a key holding another type than the command
    works on): raised, or as a pipeline run with ``raise_on_error=False`` returns it among its
    replies."""
    from redis.exceptions import ResponseError

    if not isinstance(error, ResponseError):
        return False
    # (In a script too: Redis >= 7 keeps the error's code at the start of its message. One a
    # pipeline's ``execute`` raised says first which command it was: "Command # 2 (XREAD ...)
    # of pipeline caused error: ('WRONGTYPE ...',)", its error's arguments after; before, a
    # key of another type read in a pipeline was taken for Redis failing.)
    said = str(error).rpartition("caused error: ")[2]
    return said.lstrip("('\"").startswith("WRONGTYPE")


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # (no loop running: a synchronous caller)
        return None


def unavailable_in(layer: str) -> Callable[[str], contextlib.AbstractContextManager[None]]:
    """:func:`unavailable` for one layer: ``_unavailable = unavailable_in("the Redis store")``,
    then ``with _unavailable("get"):`` fails as "the Redis store failed to get: ..."."""
    return lambda operation: unavailable(f"{layer} failed to {operation}")


async def server_mode(url: str, *, timeout: float = CONNECT_TIMEOUT * 4) -> str | None:
    """At start-up: ``"cluster"`` when ``url`` is a node of a Redis Cluster / Valkey cluster,
    ``"standalone"`` for any other server, None when it does not answer now (the instance then
    starts degraded and tries again). A cluster node spoken to by a plain client answers MOVED
    for the keys of the other masters: the instance would flip between up and degraded and
    run every flight alone, so ``carpool serve`` turns ``distributed.cluster`` on instead.

    It raises ``ValueError`` for a server older than Redis 7.0 (:func:`version_problem`) or one
    that refused the URL's user and password (an answer: waiting would never share), and
    reads the server's ``maxmemory-policy`` (``INFO memory``; a server that refuses it is not
    checked): a warning in the log when it is an eviction policy (:func:`eviction_problem`).
    An ACL user that may not run INFO has the mode and the version read from ``HELLO``."""
    client = connect(url, socket_timeout=timeout, connect_timeout=timeout, retries=0)
    try:
        try:
            with unavailable("read the server's mode"):
                info = await client.info("cluster")
        except StoreUnavailable as error:
            # INFO refused (an ACL user with ``-@dangerous``, the usual one on a Redis shared
            # with other services): HELLO, which such a user may send, says the mode and the
            # version (no memory policy: not checked). Not asked of a Redis down (its wait
            # twice over, for nothing).
            if _credentials_refused(error):
                raise ValueError(
                    "Redis refused this user and password (check them in the URL): "
                    f"{error.__cause__}"
                ) from error
            if not _refused(error):
                return None
            hello = await _hello(client)
            if hello is None:
                return None
            info = {"cluster_enabled": 1 if hello.get("mode") == "cluster" else 0}
            server = (
                {"redis_version": hello.get("version")} if hello.get("server") == "redis" else {}
            )
            memory: dict[str, Any] = {}
        else:
            try:
                with unavailable("read the server's version"):
                    server = await client.info("server")
            except StoreUnavailable:  # (INFO server not allowed: nothing to say)
                server = {}
            try:
                with unavailable("read the server's memory policy"):
                    memory = await client.info("memory")
            except StoreUnavailable:  # (INFO memory not allowed: nothing to say)
                memory = {}
    finally:
        await close_client(client)
    too_old = version_problem(server)
    if too_old is not None:
        raise ValueError(too_old)
    problem = eviction_problem(memory)
    if problem is not None:
        log.warning("%s", problem)
    return "cluster" if str(info.get("cluster_enabled", 0)) == "1" else "standalone"


def _refused(error: BaseException) -> bool:
    """Whether ``error`` (a ``StoreUnavailable``) is Redis refusing the command to this user
    (``NOPERM``: its ACL), an answer."""
    from redis.exceptions import NoPermissionError

    return isinstance(error.__cause__, NoPermissionError)


def _credentials_refused(error: BaseException) -> bool:
    """Whether ``error`` (a ``StoreUnavailable``) is Redis refusing this client's user and
    password (``WRONGPASS``, or ``NOAUTH``: none given where one is needed), an answer that no
    wait mends."""
    from redis.exceptions import AuthenticationError

    return isinstance(error.__cause__, AuthenticationError)


async def _hello(client: Any) -> dict[str, Any] | None:
    """The server's HELLO (its ``server``, ``version``, ``mode``... as text), None when it does
    not answer. (A map in RESP3; in RESP2, a list of names and values.)"""
    try:
        with unavailable("say hello"):
            reply = await client.execute_command("HELLO")
    except StoreUnavailable:
        return None
    if isinstance(reply, list):
        reply = dict(zip(reply[::2], reply[1::2], strict=False))
    if not isinstance(reply, dict):
        return None
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): v.decode() if isinstance(v, bytes) else v
        for k, v in reply.items()
    }


def version_problem(server: dict[str, Any]) -> str | None:
    """Why carpool cannot use the server whose ``INFO server`` is ``server``, or None. Every
    script's first line declares its flags (the module's contract), which a Redis older than
    7.0 reads as Lua and fails on: every shared call would fail. Valkey says ``redis_version``
    7.2.4 (the Redis it forked from) besides its own ``valkey_version``."""
    version = str(server.get("redis_version", "") or "")
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # (a server that names itself otherwise: not ours to judge)
    if not version or found >= MIN_VERSION:
        return None
    return (
        f"the server is Redis {version}; carpool needs Redis >= 7.0 or Valkey (its scripts "
        "declare their flags, so that a full Redis takes no more answers yet can be emptied)"
    )


def eviction_problem(memory: dict[str, Any]) -> str | None:
    """What an eviction policy in ``memory`` (a server's ``INFO memory``) breaks, or None
    (``noeviction``, or no policy said). Under ``allkeys-*`` or ``volatile-*`` Redis evicts
    what it chooses once ``maxmemory`` is reached: the tag and namespace indexes, the
    invalidation count and idempotency records (rarely read) go before hot entries, so an
    invalidation by tag drops nothing while the entry is served, and a request already run is
    run again when its retry comes."""
    policy = str(memory.get("maxmemory_policy", "noeviction") or "noeviction")
    if policy == "noeviction":
        return None
    return (
        f"Redis runs with maxmemory-policy {policy} (maxmemory "
        f"{memory.get('maxmemory', '?')} bytes): once full it evicts carpool's indexes and "
        "idempotency records before hot entries, so invalidations by tag, namespace or prefix "
        "can miss answers that stay served, and a retried request with an Idempotency-Key can "
        "run twice. Use maxmemory-policy noeviction, or a Redis of carpool's own"
    )
