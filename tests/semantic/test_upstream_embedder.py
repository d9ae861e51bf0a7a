"""``semantic.embedder: upstream`` over HTTP: the upstream's /v1/embeddings behind the fake, its
timeout (a hung embedder holds no reply), its credentials and the replicas' health."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("usearch")

from conftest import Served, run_gateway  # noqa: E402
from fakes.serving import serve_app  # noqa: E402
from fakes.upstream import FakeUpstream  # noqa: E402
from fakes.waiting import eventually  # noqa: E402

UPSTREAM_EMBEDDER = {"enabled": True, "embedder": "upstream", "embedding_dim": 8}


class HeldEmbeddings:
    """The fake upstream, its /v1/embeddings held (never answered) while ``released`` is
    clear; ``held`` counts the calls held."""

    def __init__(self, inner: FakeUpstream) -> None:
        self.inner = inner
        self.released = asyncio.Event()
        self.released.set()
        self.held = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == "/v1/embeddings"
            and not self.released.is_set()
        ):
            self.held += 1
            await self.released.wait()
        await self.inner(scope, receive, send)


@pytest.fixture
async def held() -> AsyncIterator[tuple[HeldEmbeddings, str]]:
    app = HeldEmbeddings(FakeUpstream())
    async with serve_app(app) as url:
        try:
            yield app, url + "/v1"
        finally:
            app.released.set()


async def chat(gw: Served, content: str, system: str | None = None) -> Any:
    messages = [{"role": "system", "content": system}] if system else []
    response = await gw.client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "temperature": 0,
            "messages": [*messages, {"role": "user", "content": content}],
        },
    )
    assert response.status_code == 200, response.text
    return response


async def test_a_hung_upstream_embedder_delays_no_reply_past_its_timeout_each_a_counted_miss(
    held,
):
    # The embeddings route never answers (the gateway's upstream_timeout is the default 600 s):
    # a lookup's embedding (probe) and a miss's (begun with its call, awaited to insert its
    # entry) both give up after semantic.embed_timeout_ms, a miss each, and the clients get
    # their answers while the embeddings calls are still unanswered.
    app, url = held
    semantic = {**UPSTREAM_EMBEDDER, "embed_timeout_ms": 50}
    async with run_gateway([url], semantic=semantic) as gw:
        await chat(gw, "How do I reset my router?")
        await eventually(lambda: gw.gateway.semantic.entries == 1, what="the first entry")
        app.released.clear()
        # A lookup in a scope with entries: its probe's embedding hangs.
        probed = await chat(gw, "How can I reset my router?")
        assert probed.headers["x-carpool"] == "miss"
        # A scope without entries: no probe, the embedding begun with the call hangs.
        unprobed = await chat(gw, "How do I reset my router?", system="Answer in French.")
        assert unprobed.headers["x-carpool"] == "miss"
        assert not app.released.is_set() and app.held >= 2  # answered, embeddings unanswered
        assert gw.gateway.semantic.embed_failures == 2
        assert gw.gateway.semantic.entries == 1  # no entry for a prompt not embedded in time
        assert app.inner.count("/v1/chat/completions") == 3
