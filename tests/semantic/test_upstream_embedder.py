"""``semantic.embedder: upstream`` over HTTP: the upstream's /v1/embeddings behind the fake, its
timeout (a hung embedder holds no reply), its credentials and the replicas' health."""

from __future__ import annotations

import asyncio
import contextlib
import socket
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


@contextlib.asynccontextmanager
async def hung_after_one_entry(held: Any) -> AsyncIterator[tuple[HeldEmbeddings, Served]]:
    """A gateway embedding through ``held`` (50 ms bound), one entry made, then its embeddings
    calls held (never answered until ``released``)."""
    app, url = held
    semantic = {**UPSTREAM_EMBEDDER, "embed_timeout_ms": 50}
    async with run_gateway([url], semantic=semantic) as gw:
        await chat(gw, "How do I reset my router?")
        await eventually(lambda: gw.gateway.semantic.entries == 1, what="the first entry")
        app.released.clear()
        yield app, gw


async def test_a_hung_upstream_embedder_delays_no_reply_past_its_timeout_each_a_counted_miss(
    held,
):
    # The embeddings route never answers (the gateway's upstream_timeout is the default 600 s):
    # a lookup's embedding (probe) and a miss's (begun with its call, awaited to insert its
    # entry) both give up after semantic.embed_timeout_ms, a miss each, and the clients get
    # their answers while the embeddings calls are still unanswered.
    async with hung_after_one_entry(held) as (app, gw):
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


async def test_a_hung_upstream_embedder_is_skipped_after_three_failures_until_a_try_answers(
    held,
):
    # Before, every lookup in a scope with entries waited the whole embed_timeout_ms (1 s by
    # default) for as long as the embedder hung. Three failed embeddings open the breaker: lookups
    # then send no embeddings call (a miss at once) but one try a second, and a try that
    # answers closes it.
    async with hung_after_one_entry(held) as (app, gw):
        breaker = gw.gateway.semantic.embedder.breaker
        for n in range(5):
            if breaker.retry_at is not None:
                break
            await chat(gw, f"How can I reset my router, take {n}?")
        assert breaker.retry_at is not None and breaker.failures == 3
        sent, failures = app.held, gw.gateway.semantic.embed_failures
        for n in range(3):
            skipped = await chat(gw, f"Router reset, please ({n})")
            assert skipped.headers["x-carpool"] == "miss"
        assert app.held == sent  # no embeddings call while it is open
        assert gw.gateway.semantic.embed_failures == failures + 3  # (each a counted miss)
        app.released.set()
        breaker.retry_at = 0.0  # (its retry_s has passed)
        await chat(gw, "How do I reset my modem?")
        assert breaker.retry_at is None and breaker.failures == 0
        await eventually(lambda: gw.gateway.semantic.entries == 2, what="an entry again")


async def test_the_upstream_embedder_sends_its_own_key_never_a_clients(
    fake, gateway_with, monkeypatch
):
    # Pass-through credentials: the clients' keys go upstream with their own calls, but the
    # embeddings (every tenant's prompts, batched together) carry semantic.embedder_api_key
    # (here from the environment). Without it they carried nothing: every embed a 401.
    monkeypatch.setenv("CARPOOL_TEST_EMBEDDER_KEY", "sk-embedder")
    fake.valid_keys = {"sk-tenant", "sk-embedder"}
    semantic = {**UPSTREAM_EMBEDDER, "embedder_api_key": "${CARPOOL_TEST_EMBEDDER_KEY}"}
    tenant = {"Authorization": "Bearer sk-tenant"}
    async with gateway_with(semantic=semantic) as gw:
        assert (await gw.chat("How do I reset my router?", headers=tenant)).status_code == 200
        await eventually(lambda: gw.gateway.semantic.entries == 1, what="the entry")
        probed = await gw.chat("How can I reset my router?", headers=tenant)  # (a probe)
        assert probed.status_code == 200
        await eventually(lambda: gw.gateway.semantic.entries == 2, what="the second entry")
        assert gw.gateway.semantic.embed_failures == 0
    calls = {c.path: c.headers.get("authorization") for c in fake.calls}
    embeds = [c.headers.get("authorization") for c in fake.calls if c.path == "/v1/embeddings"]
    assert len(embeds) >= 2 and set(embeds) == {"Bearer sk-embedder"}
    assert calls["/v1/chat/completions"] == "Bearer sk-tenant"


async def test_an_upstream_embedder_with_no_credentials_is_warned_about_at_start(
    fake, gateway_with, caplog
):
    # A keyless upstream (vLLM, TEI, Ollama) is common, so it is allowed; but one that wants a
    # key refuses every embedding: said once at start, and each refusal's warning names the key.
    async with gateway_with(semantic=UPSTREAM_EMBEDDER) as gw:
        fake.valid_keys = {"sk-tenant"}
        await gw.chat("How do I reset my router?", headers={"Authorization": "Bearer sk-tenant"})
        await eventually(lambda: gw.gateway.semantic.embed_failures == 1, what="the refusal")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w for w in warnings if "carry no credentials" in w and "embedder_api_key" in w]
    assert [w for w in warnings if "401" in w and "refused the embedder's credentials" in w]
    caplog.clear()
    for held in ({"embedder_api_key": "sk-embedder"}, {}):
        upstream = {} if held else {"upstream": {"api_key": "sk-held"}}
        async with gateway_with(semantic={**UPSTREAM_EMBEDDER, **held}, **upstream):
            pass
    assert not [r for r in caplog.records if "carry no credentials" in r.getMessage()]


async def test_the_upstream_embedder_goes_through_the_replicas_health_and_failover(fake):
    # Two replicas, one down: the embeddings are sent as the gateway's own calls are (the
    # downed replica left out, a failed attempt retried once on the other) and counted in
    # upstream_calls. Cycled over the raw upstreams, every other embedding failed.
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{unused.getsockname()[1]}/v1"
    async with run_gateway([fake.url, dead], semantic=UPSTREAM_EMBEDDER) as gw:
        for i in range(8):
            assert (await gw.chat(f"Question number {i} about routers")).status_code == 200
        await eventually(lambda: gw.gateway.semantic.entries == 8, what="every entry")
        assert gw.gateway.semantic.embed_failures == 0
        stats = (await gw.client.get("/stats")).json()
    tried = sum(replica["calls"] for replica in stats["replicas"].values())
    assert fake.count("/v1/embeddings") >= 8  # (one a prompt: a lookup's, or its call's)
    assert stats["upstream_calls"] == tried == fake.count() + stats["replicas"][dead]["calls"]
