"""A Redis/Valkey that reached ``maxclients``: it answers, it cannot take another connection.

Its refusal ("max number of clients reached", the handshake's reply) is no outage: the
instance stays up (no degraded period: a keyed request never runs from this process's
records, where it could run twice), and once the burst that met it is over, the connections
the pool holds serve its calls (a refused one on top of the pool's stack hid them).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("redis")

import redis.asyncio as aredis  # noqa: E402
from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: E402

from carpool.redis.connection import (  # noqa: E402
    MaxClients,
    PoolExhausted,
    close_client,
    connect,
    unavailable,
)
from carpool.store.base import StoreUnavailable  # noqa: E402
from conftest import run_gateway  # noqa: E402
from fakes.waiting import eventually  # noqa: E402


async def other_clients(url: str, most: int | None = None) -> list[aredis.Redis]:
    """Connections of someone else's, held open on the server: ``most`` of them, or as many as
    it takes (``let_go`` closes them)."""
    held: list[aredis.Redis] = []
    while most is None or len(held) < most:
        client = aredis.Redis.from_url(url, single_connection_client=True)
        try:
            await client.ping()
        except RedisConnectionError as refused:
            await client.aclose()
            assert most is None and "max number of clients reached" in str(refused), refused
            break
        held.append(client)
    return held


async def let_go(held: list[aredis.Redis]) -> None:
    for client in held:
        await client.aclose()


async def ping(client: aredis.Redis) -> str:
    try:
        with unavailable("ping"):
            await client.ping()
    except StoreUnavailable as error:
        return "max clients" if "max number of clients reached" in str(error) else str(error)
    return "answered"


async def test_after_a_burst_past_maxclients_the_pools_live_connections_answer(
    redis_server_factory,
):
    # 8 of the server's 20 slots held by others: a burst of 60 calls gets 12 connections, the
    # rest refused. Those refused went back on top of the pool's stack (redis-py's pool hands
    # out the connection last given back), so every later call reopened one, refused again,
    # while the 12 connected ones below were never used: Redis answered, the instance failed.
    server = redis_server_factory(extra_args=["--maxclients", "20"])
    client = connect(server.url, connect_timeout=5, socket_timeout=5)
    pool = client.connection_pool
    others = await other_clients(server.url, 8)
    try:
        burst = await asyncio.gather(*(ping(client) for _ in range(60)))
        assert set(burst) == {"answered", "max clients"}, burst
        live = sum(1 for c in pool._available_connections if c.is_connected)
        assert 0 < live <= 12
        # (As many at once as there are live ones, the others still connected: each call is
        # given one of them.)
        after = await asyncio.gather(*(ping(client) for _ in range(live)))
        assert after == ["answered"] * live
        assert await ping(client) == "answered"
    finally:
        await close_client(client)
        await let_go(others)


async def test_maxclients_is_an_answer_counted_apart_not_redis_down(redis_server_factory):
    from carpool.redis.store import RedisStore
    from carpool.store.memory import MemoryStore
    from carpool.store.shared import SharedStore

    server = redis_server_factory(extra_args=["--maxclients", "4"])
    redis = RedisStore(server.url, connect_timeout=5, socket_timeout=5)
    shared = SharedStore(redis, MemoryStore(1 << 20))
    others = await other_clients(server.url)  # (every slot)
    try:
        with pytest.raises(MaxClients) as caught:
            await redis.get("k")
        assert isinstance(caught.value, PoolExhausted)  # (every layer's handling of one)
        assert await shared.get("k") is None  # a miss, not this process's memory
        health = shared.health()
        assert health["state"] == "up" and health["errors"] == 0
        assert health["max_clients"] == 1 and health["pool_exhausted"] == 0
    finally:
        await shared.aclose()
        await let_go(others)


async def test_a_cluster_nodes_maxclients_is_an_answer_counted_apart_not_redis_down(
    redis_server_factory,
):
    # A node with cluster mode on words its refusal "max number of clients + cluster
    # connections reached", which redis-py raises as a ResponseError (only the standalone
    # words are its ConnectionError): it was Redis down, a degraded period.
    from redis.exceptions import ResponseError

    from carpool.redis.store import RedisStore
    from carpool.store.memory import MemoryStore
    from carpool.store.shared import SharedStore
    from fakes.ports import free_port
    from fakes.redis_cluster import _node_args

    server = redis_server_factory(extra_args=[*_node_args(free_port()), "--maxclients", "4"])
    held: list[aredis.Redis] = []
    while True:  # (every slot)
        other = aredis.Redis.from_url(server.url, single_connection_client=True)
        try:
            await other.ping()
        except ResponseError as refused:
            await other.aclose()
            assert "max number of clients + cluster connections reached" in str(refused)
            break
        held.append(other)
    redis = RedisStore(server.url, connect_timeout=5, socket_timeout=5)
    shared = SharedStore(redis, MemoryStore(1 << 20))
    try:
        with pytest.raises(MaxClients):
            await redis.get("k")
        assert await shared.get("k") is None  # a miss, not this process's memory
        health = shared.health()
        assert health["state"] == "up" and health["max_clients"] == 1
    finally:
        await shared.aclose()
        await let_go(held)


async def test_a_keyed_request_on_a_redis_at_maxclients_is_refused_not_run_from_local_records(
    fake, redis_server_factory, caplog
):
    """Every slot of the server taken: Redis answers, this instance cannot read the key's
    record. Run from this process's records, the request could run a second time while another
    instance runs it (or has run it): a 503 with Retry-After instead, the instance not degraded,
    and once a slot is free its retry runs once, its next retry replayed."""
    server = redis_server_factory(extra_args=["--maxclients", "12"])
    config = {
        "redis": server.url,
        "distributed": {"pool_timeout": 0.2, "timeout": 5, "connect_timeout": 5},
    }
    key = {"Idempotency-Key": "order-12"}
    others = await other_clients(server.url)  # (every slot, before the instance took one)
    async with run_gateway([fake.url], **config) as gw:
        try:
            refused = await gw.chat("charge the card once", headers=key)
            calls_then = fake.count()
            redis = (await gw.client.get("/stats")).json()["redis"]
        finally:
            await let_go(others)
        retried = await gw.chat("charge the card once", headers=key)
        replayed = await gw.chat("charge the card once", headers=key)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1" and calls_then == 0
    assert redis["state"] == "up" and redis["errors"] == 0 and redis["max_clients"] >= 1
    assert "it serves as many clients as it may (maxclients)" in caplog.text
    assert retried.status_code == 200 and replayed.headers["idempotent-replayed"] == "true"
    assert replayed.json() == retried.json() and fake.count("/v1/chat/completions") == 1


async def test_two_instances_after_a_burst_past_maxclients_share_again_within_retry_interval(
    fake, redis_server_factory
):
    # Two instances whose burst took every slot of the server between them: each one's
    # refused connections hid its live ones (above), every probe of its degraded period was
    # refused in turn while the other instance's idle connections held the slots, and both
    # stayed degraded (each keyed request run from its own records) for as long as Valkey ran.
    server = redis_server_factory(extra_args=["--maxclients", "24"])
    retry_interval = 0.5
    config = {
        "redis": server.url,
        "distributed": {"retry_interval": retry_interval, "timeout": 5, "connect_timeout": 5},
    }
    async with run_gateway([fake.url], **config) as a, run_gateway([fake.url], **config) as b:
        await eventually(
            lambda: a.gateway.invalidations.listening and b.gateway.invalidations.listening,
            what="both subscribed",
        )
        burst = await asyncio.gather(
            *(gw.chat(f"burst {n} on {i}") for i, gw in enumerate((a, b)) for n in range(80))
        )
        assert {r.status_code for r in burst} == {200}
        stores = (a.gateway.store, b.gateway.store)
        assert sum(s.health()["max_clients"] for s in stores) >= 1  # (it did exceed)
        await eventually(
            lambda: not any(s.degraded for s in stores),
            timeout=retry_interval,
            what="both up",
            state=lambda: [s.health() for s in stores],
        )
        first = await a.chat("shared after the burst")
        second = await b.chat("shared after the burst")
        key = {"Idempotency-Key": "after-the-burst"}
        ran = await a.chat("keyed after the burst", headers=key)
        replayed = await b.chat("keyed after the burst", headers=key)
        health = [s.health() for s in stores]
    assert first.headers["x-carpool"] == "miss" and second.headers["x-carpool"] == "hit"
    assert ran.status_code == 200 and replayed.headers["idempotent-replayed"] == "true"
    assert all(h["state"] == "up" and h["errors"] == 0 for h in health), health


async def test_a_refused_connection_is_counted_apart_by_every_layer_never_as_a_redis_error(
    fake, redis_server_factory
):
    """Redis at ``maxclients`` answers: each layer's refused call is counted in ``max_clients``
    alone, so ``carpool_redis_errors_total`` agrees with ``/healthz``'s ``errors`` (0). (Before,
    the flights, invalidation and semantic layers also counted it as a failed call of their
    own: an operator alerting on Redis errors was paged for a Redis that answered.)"""
    server = redis_server_factory(extra_args=["--maxclients", "12"])
    config = {
        "redis": server.url,
        "distributed": {"pool_timeout": 0.2, "timeout": 5, "connect_timeout": 5},
    }
    others = await other_clients(server.url)  # (every slot, before the instance took one)
    async with run_gateway([fake.url], **config) as gw:
        try:
            answers = [await gw.chat(f"question {n}") for n in range(3)]
            metrics = (await gw.client.get("/metrics")).text
            redis = (await gw.client.get("/stats")).json()["redis"]
        finally:
            await let_go(others)
    assert [a.status_code for a in answers] == [200] * 3
    assert redis["state"] == "up" and redis["errors"] == 0 and redis["max_clients"] >= 3
    errors = {
        line.split("{", 1)[1].split("}", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("carpool_redis_errors_total{")
    }
    assert errors and set(errors.values()) == {0.0}, errors
