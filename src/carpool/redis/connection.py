"""The one owner of the Redis/Valkey client: connecting, the pool, error translation, health.

Contract
--------
- :func:`connect` returns a ``redis.asyncio`` client (bytes, never decoded) on a
  :class:`~redis.asyncio.BlockingConnectionPool` of ``max_connections``: a caller that finds every
  connection busy *waits* for one, up to ``pool_timeout`` seconds. The library's default pool
  instead fails at once past 100 connections ("Too many connections"), which a burst of a few
  hundred concurrent requests reached while Redis was healthy, switching the instance to
  running every call alone. Each command may take ``socket_timeout`` (a hung Redis fails a call
  in that long, never hangs it), a connection ``connect_timeout``; a refused or reset connection
  is retried ``retries`` times at once (a pooled connection may be stale after a restart), a
  timeout never is.
- :func:`unavailable` translates the client library's errors (and socket errors) into
  :class:`StoreUnavailable`, the one error every Redis-backed layer raises; a wait for a pooled
  connection that ran out is :class:`PoolExhausted`, a subclass: Redis answered, this instance
  had more callers than connections. The health (``store.shared.SharedStore``, which every layer
  reports to) counts and logs it and does **not** start a degraded period.
- :class:`Health` is what a layer asks before a Redis call (``usable()``) and tells after it
  (``report(error or None)``): one state per instance, shared by every layer on that Redis.
- The redis-py library is imported by the modules of this package only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from ..store.base import StoreUnavailable

if TYPE_CHECKING:
    import redis.asyncio as aredis

__all__ = ["Health", "PoolExhausted", "StoreUnavailable", "connect", "unavailable"]

SOCKET_TIMEOUT = 0.5      # s per command: Redis answers in well under a ms; a hung one must fail
CONNECT_TIMEOUT = 0.25    # s per connection attempt
RETRIES = 1               # immediate retries on a refused/reset connection (never on a timeout)
MAX_CONNECTIONS = 1000    # per instance; Valkey's default maxclients is 10,000
POOL_TIMEOUT = 5.0        # s a caller may wait for a free pooled connection


class PoolExhausted(StoreUnavailable):
    """Every pooled connection stayed busy for ``pool_timeout``: this instance is overloaded,
    Redis is not down (never a reason for a degraded period)."""


class Health(Protocol):
    def usable(self) -> bool: ...

    def report(self, error: StoreUnavailable | None) -> None: ...


def connect(url: str, *, socket_timeout: float = SOCKET_TIMEOUT,
            connect_timeout: float = CONNECT_TIMEOUT, retries: int = RETRIES,
            max_connections: int = MAX_CONNECTIONS,
            pool_timeout: float = POOL_TIMEOUT) -> aredis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://``) on a blocking pool."""
    try:
        import redis.asyncio as aredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("sharing through Redis needs the redis extra: "
                          "pip install 'carpool[redis]'") from exc
    pool = aredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout,
        socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), retries, supported_errors=(RedisConnectionError,)))
    return aredis.Redis(connection_pool=pool)


@contextlib.contextmanager
def unavailable(what: str) -> Iterator[None]:
    """Translate the Redis client's errors (and socket timeouts) into ``StoreUnavailable``."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError
    try:
        yield
    except RedisConnectionError as exc:
        # BlockingConnectionPool's own wording when its wait for a connection runs out.
        kind = PoolExhausted if "No connection available" in str(exc) else StoreUnavailable
        raise kind(f"{what}: {type(exc).__name__}: {exc}") from exc
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


class ClusterNotSupported(ValueError):
    """``--redis`` names a node of a Redis Cluster / Valkey cluster (not supported yet)."""


async def check_server(url: str, *, timeout: float = CONNECT_TIMEOUT * 4) -> bool:
    """At start-up: True when ``url`` answers (False: unreachable now, the instance starts
    degraded and tries again). Raises :class:`ClusterNotSupported` for a cluster node: every
    call would otherwise hit MOVED for keys of the other masters and flip the instance between
    up and degraded, running every flight alone, while it said answers were shared."""
    client = connect(url, socket_timeout=timeout, connect_timeout=timeout, retries=0)
    try:
        with unavailable("read the server's mode"):
            info = await client.info("cluster")
    except StoreUnavailable:
        return False
    finally:
        await client.aclose()
    if str(info.get("cluster_enabled", 0)) == "1":
        raise ClusterNotSupported(
            f"the Redis server at {url} runs in cluster mode, which carpool does not support "
            "yet: point --redis at a standalone server (or the primary of a replicated "
            "Sentinel setup)")
    return True
