"""carpool/redis/connection.py: one client per instance, a pool callers wait on, one error."""

from __future__ import annotations

import ast
import asyncio
import collections
import contextlib
import socket
from pathlib import Path

import pytest

pytest.importorskip("redis")

from carpool.redis.connection import (  # noqa: E402
    ANSWERED,
    PoolExhausted,
    close_client,
    connect,
    stop_reader,
    unavailable,
)
from carpool.redis.idempotency import RedisIdempotencyRecords  # noqa: E402
from carpool.redis.store import RedisStore  # noqa: E402
from carpool.store.base import StoreUnavailable  # noqa: E402
from carpool.store.memory import MemoryStore  # noqa: E402
from carpool.store.shared import _ANSWERED, SharedStore  # noqa: E402
from fakes.waiting import WAIT_S, cancelled_after, eventually  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "src" / "carpool"


def test_the_client_library_is_imported_by_the_redis_package_only():
    importers = set()
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            if any(n == "redis" or n.startswith("redis.") for n in names):
                importers.add(path.relative_to(SOURCE).parts[0])
    assert importers == {"redis"}


def test_the_failures_a_layer_counts_apart_are_those_the_health_counts():
    # Two lists of one set (the connection module cannot import the health's: a cycle): a
    # failure the health counts apart that a layer counted as a Redis error too (or the other
    # way) would say Redis failed when it answered.
    assert all(issubclass(kind, ANSWERED) for kind in _ANSWERED)
    assert all(kind in _ANSWERED for kind in ANSWERED)


@pytest.mark.parametrize(
    "failure",
    [
        AttributeError("'NoneType' object has no attribute 'writelines'"),
        TypeError("'NoneType' object is not subscriptable"),
        OSError("connection reset"),
    ],
)
def test_the_client_librarys_failure_on_a_torn_down_connection_is_store_unavailable(failure):
    # redis-py's cluster client, on a node killed mid-call, fails with AttributeError: that is
    # Redis being down (degrade to memory), not a bug of the request (a 500).
    with pytest.raises(StoreUnavailable, match="get: "), unavailable("get"):
        raise failure


def test_a_connection_redis_reset_is_redis_failing_on_uvloop_too_never_a_500(redis_server):
    # ``carpool serve`` runs on uvloop, whose transport, closed by a reset, refuses the next
    # write with a RuntimeError ("unable to perform operation on <TCPTransport closed=True>;
    # the handler is closed"), which escaped the translation: after a Redis restart or a
    # middlebox's reset, a cache read answered a 500 and a follower's flight a 502, Redis
    # answering again meanwhile (a review's churn run, with Redis paused and killed).
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(_read_after_a_reset(redis_server))


async def _read_after_a_reset(redis_server) -> None:
    from fakes.latency_proxy import LinkProxy

    proxy = await LinkProxy(redis_server.host, redis_server.port).start()
    # With its retry (the default), a stale connection is retried at once on a new one, as a
    # reset one is; without, the failure is Redis's.
    retried = connect(proxy.url, connect_timeout=5, socket_timeout=5)
    alone = connect(proxy.url, connect_timeout=5, socket_timeout=5, retries=0)
    try:
        for client in (retried, alone):
            await client.set(b"k", b"v")
        pooled = [c.connection_pool._available_connections[0] for c in (retried, alone)]
        proxy.reset()
        # (Their transports closed: the next write on each is refused, not sent.)
        await eventually(
            lambda: all(c._writer.transport.is_closing() for c in pooled), what="the reset seen"
        )
        with unavailable("get"):
            assert await retried.get(b"k") == b"v"
        with pytest.raises(StoreUnavailable, match="get: "), unavailable("get"):
            await alone.get(b"k")
        with unavailable("get"):  # (the connection was dropped: a new one answers)
            assert await alone.get(b"k") == b"v"
    finally:
        for client in (retried, alone):
            await close_client(client)
        await proxy.aclose()


async def test_stop_reader_cancels_again_a_task_that_swallowed_its_cancellation():
    # As redis-py's cluster client may: the command in flight returns as if never cancelled,
    # and the reader's loop goes on to its next command.
    swallowed = asyncio.Event()

    async def reader() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        swallowed.set()
        await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(reader())
    await asyncio.sleep(0)  # (started: waiting)
    await asyncio.wait_for(stop_reader(task), 10)
    assert swallowed.is_set() and task.cancelled()
    await stop_reader(None)  # (no reader: nothing to do)


def test_a_cancellation_the_client_library_swallowed_is_raised_once_its_call_ends():
    async def call(cancel_inside: bool, then_fail: bool = False) -> str:
        with unavailable("get"):
            if cancel_inside:
                # What redis-py's send does on Python 3.11 (asyncio.wait_for, gh-86296): the
                # cancellation arrives as the write completes, and the write's result wins.
                asyncio.current_task().cancel()  # type: ignore[union-attr]
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0)
            if then_fail:  # (the same command's read: Redis stalled, the socket timed out)
                raise OSError("timed out")
            return "reply"

    async def already_cancelled() -> str:
        # A cancellation its task had caught before the call (cleanup on the way out) is not
        # raised again by a call made while it cleans up.
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        return await call(False)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(call(True))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(call(True, then_fail=True))  # (not StoreUnavailable: Redis may be fine)
    with pytest.raises(StoreUnavailable):
        asyncio.run(call(False, then_fail=True))
    assert asyncio.run(call(False)) == "reply"
    assert asyncio.run(already_cancelled()) == "reply"


@pytest.mark.parametrize("backend", ["store", "idempotency"])
async def test_a_redis_call_cancelled_at_any_step_ends_cancelled(redis_server, backend):
    # A cancellation at every step of a real call: each one that came before the reply ends
    # the call cancelled. (Python 3.11's asyncio.wait_for, in redis-py's send, returned the
    # send's result instead for the cancellation that came with it: an idempotency record's
    # lease keeper cancelled there renewed on, and with Redis stopped, never ended.)
    if backend == "store":
        store = RedisStore(redis_server.url)
        call, close = (lambda: store.get("k")), store.aclose
    else:
        records = RedisIdempotencyRecords(redis_server.url, retention=60, lease=60)
        token = (await records.begin("k", "fp")).token
        assert token is not None
        call, close = (lambda: records.renew("k", token)), records.aclose
    try:
        await call()  # (connected: the steps swept are the call's own)
        cancelled_at = []
        # Every step of the call's own, then ever longer waits on its reply: a turn of the
        # loop takes no time while the call waits on its socket, and a busy machine's Redis
        # answered past 40 of them (3.13's cheaper turns, under CI's load).
        for steps in [*range(40), *(40 << k for k in range(1, 16))]:
            task = await cancelled_after(call(), steps)
            if task is None:
                break  # (every step was swept: the call had its reply)
            if not task.cancelled():
                cancelled_at.append((steps, task.result()))
        else:
            pytest.fail("the call did not end within 1.3 million turns of the loop")
        assert cancelled_at == [], "cancelled, yet these calls returned (step, reply)"
        assert steps > 1  # (a sweep, not a call that ended at once)
    finally:
        await close()


async def test_a_redis_call_cancelled_at_any_step_ends_cancelled_when_its_read_then_fails(
    redis_server,
):
    # Redis stalled (CLIENT PAUSE): every call's read times out. One whose send took the
    # cancellation (as above) then failed as Redis failing: an idempotency record's lease
    # keeper took it for an outage and renewed on, its record held past its request's end.
    # (Each call is cancelled at once: its read's timeout is what a lost cancel waits out.)
    store = RedisStore(redis_server.url, socket_timeout=1)
    admin = connect(redis_server.url)
    try:
        await store.get("k")  # (connected: the steps swept are the call's own)
        await admin.execute_command("CLIENT", "PAUSE", 60_000, "ALL")
        ended = []
        for steps in range(12):
            task = await cancelled_after(store.get("k"), steps)
            assert task is not None  # (Redis is paused: no call ends by itself here)
            ended.append("cancelled" if task.cancelled() else repr(task.exception()))
        assert ended == ["cancelled"] * 12
    finally:
        await store.aclose()
        await close_client(admin)


async def test_callers_past_the_pool_size_wait_for_a_connection_instead_of_failing(redis_server):
    # (Generous timeouts: what is tested is the wait for a pooled connection; a busy 2-core
    # machine once took longer than the default 0.25 s to connect.)
    client = connect(
        redis_server.url, max_connections=2, pool_timeout=5, connect_timeout=5, socket_timeout=5
    )
    try:
        await client.set(b"k", b"v")
        # 300 calls at once on 2 connections: the library's default pool fails past its size
        # ("Too many connections"); this one queues them.
        replies = await asyncio.gather(*(client.get(b"k") for _ in range(300)))
        assert replies == [b"v"] * 300
        assert (
            len(client.connection_pool._available_connections)
            + len(client.connection_pool._in_use_connections)
            <= 2
        )
    finally:
        await close_client(client)


async def test_a_burst_on_a_new_client_opens_a_few_connections_at_a_time_not_one_per_caller(
    redis_server,
):
    # (A burst on a cold instance opened one per request at once, ~350: on loaded cores some
    # outlasted the connect timeout, a degraded moment, every request then running alone.)
    from carpool.redis.connection import CONNECTS_AT_ONCE

    client = connect(redis_server.url, connect_timeout=5, socket_timeout=5)
    pool = client.connection_pool
    most = 0

    async def get() -> bytes | None:
        nonlocal most
        most = max(most, pool.connecting)
        reply = await client.get(b"k")
        most = max(most, pool.connecting)
        return reply

    try:
        assert await asyncio.gather(*(get() for _ in range(300))) == [None] * 300
        assert 0 < most <= CONNECTS_AT_ONCE
        opened = len(pool._available_connections) + len(pool._in_use_connections)
        assert opened < 300, "a connection per caller"
    finally:
        await close_client(client)


async def test_a_connection_that_failed_to_open_once_does_not_unbound_the_next_burst(
    redis_server,
):
    # Callers try at once only while Redis fails (below): a failure long past left the
    # next burst opening a connection per caller again.
    from carpool.redis.connection import CONNECTS_AT_ONCE

    # (2 s, not 0.5: in the whole suite on two loaded cores, one of the burst's 16 connects at
    # once to the restarted server took longer than 0.5 s, a TimeoutError not this test's.)
    client = connect(redis_server.url, connect_timeout=2.0, socket_timeout=2.0, retries=0)
    pool = client.connection_pool
    try:
        redis_server.kill()
        with pytest.raises(StoreUnavailable), unavailable("get"):
            await client.get(b"k")
        assert pool._failing()
        redis_server.restart()
        await eventually(lambda: not pool._failing(), what="the failure two attempts old")
        most = 0

        async def get() -> bytes | None:
            nonlocal most
            reply = await client.get(b"k")
            most = max(most, pool.connecting)
            return reply

        assert await asyncio.gather(*(get() for _ in range(300))) == [None] * 300
        assert most <= CONNECTS_AT_ONCE
        assert len(pool._available_connections) + len(pool._in_use_connections) < 300
    finally:
        await close_client(client)


async def test_callers_of_a_hung_redis_each_fail_as_redis_failing_not_as_a_busy_pool():
    # Redis hung (it takes connections, never answers): once a connection failed to open,
    # the callers waiting to open theirs try at once, each failing in its own timeout. Taking
    # turns, 16 at a time, the later ones outwaited the pool's wait: a busy pool, Redis up.
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(1024)  # (never accepted, never read: the kernel completes the handshakes)
    port = hung.getsockname()[1]
    client = connect(
        f"redis://127.0.0.1:{port}", connect_timeout=0.2, socket_timeout=0.2, pool_timeout=2
    )

    async def get() -> str:
        try:
            with unavailable("get"):
                await client.get(b"k")
        except PoolExhausted:
            return "pool exhausted"
        except StoreUnavailable:
            return "unavailable"
        return "answered"

    try:
        failures = await asyncio.gather(*(get() for _ in range(320)))  # (20 turns of 16)
        assert collections.Counter(failures) == {"unavailable": 320}
    finally:
        await close_client(client)
        hung.close()


async def test_closing_a_client_closes_its_connections_to_redis(redis_server):
    # (Generous timeouts: a CI run beside other tests took over 0.25 s to connect.)
    observer = connect(redis_server.url, connect_timeout=5, socket_timeout=5)
    client = connect(redis_server.url, connect_timeout=5, socket_timeout=5)

    async def connected() -> int:
        return int((await observer.info("clients"))["connected_clients"])

    try:
        alone = await connected()
        await asyncio.gather(*(client.get(b"k") for _ in range(20)))
        assert await connected() > alone
        await close_client(client)
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while await connected() > alone:  # (the server sees the sockets close in its time)
            assert asyncio.get_running_loop().time() < deadline, "connections left open"
            await asyncio.sleep(0.01)
    finally:
        await close_client(observer)


async def test_a_pool_wait_that_runs_out_is_counted_apart_and_redis_stays_up(redis_server):
    redis = RedisStore(redis_server.url, max_connections=1, pool_timeout=0.05)
    shared = SharedStore(redis, MemoryStore(1 << 20))
    try:
        holder = asyncio.create_task(redis.client.blpop([b"nothing"], timeout=2))
        while not redis.client.connection_pool._in_use_connections:  # until it holds the one
            await asyncio.sleep(0.001)
        with pytest.raises(PoolExhausted) as caught:
            await redis.get("k")
        assert isinstance(caught.value, StoreUnavailable)
        assert await shared.get("k") is None  # answered from memory, as a miss
        health = shared.health()
        assert health["state"] == "up" and health["errors"] == 0
        assert health["pool_exhausted"] == 1 and shared.usable()
        holder.cancel()
    finally:
        await shared.aclose()


async def test_server_mode_tells_a_cluster_node_from_a_standalone_server(
    redis_server, redis_cluster
):
    from carpool.redis.connection import server_mode

    assert await server_mode(redis_cluster.nodes[1].url) == "cluster"
    assert await server_mode(redis_server.url) == "standalone"
    redis_server.kill()
    assert await server_mode(redis_server.url) is None


async def test_a_redis_that_evicts_keys_is_a_warning_at_start(redis_server, caplog):
    """Under an eviction policy Redis drops carpool's indexes and idempotency records before hot
    entries (an invalidation by tag then misses a served answer; a retried request runs twice):
    the start says so. ``noeviction`` (the default) says nothing."""
    import redis.asyncio as aredis

    from carpool.redis.connection import server_mode

    with caplog.at_level("WARNING", logger="carpool.redis"):
        assert await server_mode(redis_server.url) == "standalone"
    assert not [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    client = aredis.Redis.from_url(redis_server.url)
    try:
        await client.config_set("maxmemory-policy", "allkeys-lru")
    finally:
        await close_client(client)
    with caplog.at_level("WARNING", logger="carpool.redis"):
        assert await server_mode(redis_server.url) == "standalone"
    (warning,) = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert "allkeys-lru" in warning and "noeviction" in warning and "twice" in warning


def test_serve_pointed_at_any_cluster_node_takes_a_cluster_client(redis_cluster):
    # (test_workers.py then checks, through a cluster, that what is shared is shared.)
    from fakes.instances import free_port, serve_log

    url = redis_cluster.nodes[2].url
    log = serve_log("--redis", url, "--port", str(free_port()))
    assert f"{url} is a cluster node: using a cluster client" in log, log


async def test_pool_exhaustion_is_a_metric_and_a_log_line_never_a_degraded_instance(
    fake, redis_server, caplog
):
    from conftest import run_gateway

    config = {
        "redis": redis_server.url,
        "distributed": {"max_connections": 1, "pool_timeout": 0.05},
    }
    async with run_gateway([fake.url], **config) as gw:
        client = gw.gateway.store.redis.client
        holder = asyncio.create_task(client.blpop([b"nothing"], timeout=5))
        while not client.connection_pool._in_use_connections:
            await asyncio.sleep(0.001)
        response = await gw.chat("while every connection is busy")
        assert response.status_code == 200 and response.headers["x-carpool"] == "miss"
        # (Each read may refresh the figures, a Redis call that finds no connection either:
        # the metric is read between two reads of /stats.)
        before = (await gw.client.get("/stats")).json()["redis"]["pool_exhausted"]
        metrics = (await gw.client.get("/metrics")).text
        redis = (await gw.client.get("/stats")).json()["redis"]
        holder.cancel()
    # (each Redis call of that request found no connection: the lookup, the claim, the store)
    counted = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("carpool_redis_pool_exhausted_total ")
    )
    assert 1 <= before <= counted <= redis["pool_exhausted"]
    assert redis["state"] == "up" and redis["errors"] == 0
    assert "every connection to redis stayed busy" in caplog.text


async def test_a_cluster_nodes_full_pool_is_pool_exhausted_too(redis_cluster):
    redis = RedisStore(redis_cluster.url, cluster=True, max_connections=1)
    shared = SharedStore(redis, MemoryStore(1 << 20))
    try:
        await redis.get("warm")  # the topology read; the one connection made
        results = await asyncio.gather(*(redis.get("k") for _ in range(20)), return_exceptions=True)
        exhausted = [r for r in results if isinstance(r, PoolExhausted)]
        assert exhausted and all(r is None or isinstance(r, PoolExhausted) for r in results)
        for error in exhausted:
            shared.report(error)
        assert shared.health()["state"] == "up" and shared.pool_exhausted == len(exhausted)
    finally:
        await shared.aclose()


async def test_an_answer_put_while_the_pool_is_exhausted_is_not_kept_locally(redis_server):
    """Kept locally it would outlive invalidations made elsewhere (no degraded period ends to
    clear it) and be served in the next outage."""
    import time

    from carpool.answer import Answer
    from carpool.store.base import Entry

    redis = RedisStore(redis_server.url, max_connections=1, pool_timeout=0.05)
    shared = SharedStore(redis, MemoryStore(1 << 20))
    try:
        holder = asyncio.create_task(redis.client.blpop([b"nothing"], timeout=2))
        while not redis.client.connection_pool._in_use_connections:
            await asyncio.sleep(0.001)
        await shared.put("k", Entry(Answer("chat", b"{}", True), time.time() + 60))
        assert shared.local.entries == 0 and await shared.get("k") is None
        assert shared.pool_exhausted == 2 and not shared.degraded
        holder.cancel()
    finally:
        await shared.aclose()


async def test_a_keyed_request_while_every_connection_is_busy_is_refused_not_run_twice(
    fake, redis_server, caplog
):
    """Redis answers, this instance has no free connection: the key's record cannot be read.
    Run anyway (from this process's records) it could run a second time while another instance
    runs it: the request gets a 503 with Retry-After instead, and its retry runs once."""
    import redis.asyncio as aredis

    from conftest import run_gateway
    from fakes.waiting import eventually

    # Two connections: one the invalidation subscriber holds, one the test takes.
    config = {
        "redis": redis_server.url,
        "distributed": {"max_connections": 2, "pool_timeout": 0.05},
    }
    key = {"Idempotency-Key": "order-9"}
    async with run_gateway([fake.url], **config) as gw:
        await eventually(lambda: gw.gateway.invalidations.listening, what="subscribed")
        client = gw.gateway.store.redis.client
        holder = asyncio.create_task(client.blpop([b"held"], timeout=30))
        in_use = client.connection_pool._in_use_connections
        await eventually(lambda: len(in_use) == 2, what="every connection taken")
        refused = await gw.chat("charge", headers=key)
        calls_then = fake.count()
        redis = (await gw.client.get("/stats")).json()["redis"]
        pusher = aredis.Redis.from_url(redis_server.url)
        await pusher.rpush(b"held", b"go")  # the connection is free again
        await pusher.aclose()
        await holder
        retried = await gw.chat("charge", headers=key)
        replayed = await gw.chat("charge", headers=key)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["status"] == 503 and calls_then == 0
    assert redis["state"] == "up" and redis["errors"] == 0 and redis["pool_exhausted"] >= 1
    assert "every connection to redis stayed busy" in caplog.text
    assert retried.status_code == 200 and replayed.headers["idempotent-replayed"] == "true"
    assert replayed.json() == retried.json() and fake.count("/v1/chat/completions") == 1


def test_a_server_older_than_redis_7_is_refused_at_start():
    """Every script's first line declares its flags (``#!lua``), which Redis reads from 7.0 on
    (every Valkey says 7.2.4, the Redis it forked from): an older server would fail every shared
    call, so ``carpool serve`` refuses it with the reason (``server_mode`` raises ValueError,
    exit status 2)."""
    from carpool.redis.connection import version_problem

    problem = version_problem({"redis_version": "6.2.14"})
    assert problem is not None and "6.2.14" in problem and ">= 7.0" in problem
    for fine in ("7.0.0", "7.2.4", "8.2.1", ""):
        assert version_problem({"redis_version": fine, "valkey_version": "9.1.2"}) is None
    assert version_problem({}) is None  # (INFO server refused: nothing to judge)


def test_every_lua_script_says_whether_a_full_redis_runs_it():
    """A script without its first line is checked for memory at its first command that grows
    Redis: one beginning with a DEL went past ``maxmemory`` (test_redis_full.py)."""
    import importlib
    import pkgutil

    import carpool.redis
    from carpool.redis.connection import ALWAYS, GROWS, REDIS_NOW

    scripts = {
        f"{module.name}.{name}": value
        for module in pkgutil.iter_modules(carpool.redis.__path__, "carpool.redis.")
        for name, value in vars(importlib.import_module(module.name)).items()
        if isinstance(value, str)
        and "redis.call(" in value
        and not name.startswith("__")
        # (Redis's time, read by scripts after their flags line: a part of them, no script.)
        and value is not REDIS_NOW
    }
    del scripts["carpool.redis.store_layout._STATS"]  # (the body of STATS and STATS_ADD)
    del scripts["carpool.redis.idempotency._FINISHING"]  # (of _FINISH and _NOT_KEPT)
    del scripts["carpool.redis.store_layout._RECOUNTED"]  # (of COUNT and RECOUNT)
    assert {"carpool.redis.idempotency._BEGIN", "carpool.redis.store_layout.PUT"} <= set(scripts)
    undeclared = [name for name, text in scripts.items() if not text.startswith((GROWS, ALWAYS))]
    assert not undeclared


def test_a_test_cluster_whose_bus_port_was_taken_meanwhile_starts_on_another():
    # (The tests' own cluster: a bus port picked free, then bound by another process before
    # its node started, failed the node's every attempt, a CI run's setup error.)
    from fakes.redis_cluster import RedisCluster

    cluster = RedisCluster()
    taken = cluster.bus_ports[1]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        with cluster:  # (returns once the three nodes form the cluster: state ok)
            assert cluster.bus_ports[1] != taken
            assert str(cluster.bus_ports[1]) in cluster.nodes[1].extra_args
