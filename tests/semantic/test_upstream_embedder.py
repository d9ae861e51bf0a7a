"""``semantic.embedder: upstream`` over HTTP: the upstream's /v1/embeddings behind the fake, its
timeout (a hung embedder holds no reply), its credentials, the replicas' health, and its lists
(merged only once the list check says they are answered item by item)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("usearch")
np = pytest.importorskip("numpy")

from carpool.batching import PROBE_INPUTS  # noqa: E402
from conftest import Served, run_gateway  # noqa: E402
from fakes.serving import serve_app  # noqa: E402
from fakes.upstream import FakeUpstream, _hash_vector  # noqa: E402
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
        # Answered, the embeddings unanswered. (At least the first held: on a busy machine the
        # second may time out before its request reaches the app; it counts as failed all the
        # same.)
        assert not app.released.is_set() and app.held >= 1
        assert gw.gateway.semantic.embed_failures == 2
        assert gw.gateway.semantic.entries == 1  # no entry for a prompt not embedded in time
        assert app.inner.count("/v1/chat/completions") == 3


async def test_a_hung_upstream_embedder_is_skipped_after_three_failures_until_a_try_answers(
    held,
):
    # Before, every lookup in a scope with entries waited the whole embed_timeout_ms (1 s by
    # default) for as long as the embedder hung. Three failed embeddings, then the check of a
    # text of the gateway's own that follows them failing too, open the breaker: lookups then
    # send no embeddings call (a miss at once) but one check a second, and a check that is
    # answered closes it.
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


async def test_one_requesters_text_the_embedder_fails_does_not_turn_off_the_semantic_cache_for_others(
    fake, gateway_with
):
    # llama.cpp's server answers 500 to an input over its physical batch (512 tokens): one
    # tenant's long prompts (well under semantic.max_text_chars) failed three embeddings in a row
    # and opened the embedder's one breaker, and every other tenant's paraphrases were misses for
    # as long as that tenant kept sending them. Failures in a row now open it only when the
    # embedder fails a text of the gateway's own too (one call each time they reach three): a
    # text it fails while it answers that one is its requester's miss, no one else's.
    fake.embedding_fn = by_words
    fake.fail_embeddings = lambda item: len(str(item).split()) > 300
    from carpool.semantic.embed import upstream as embed_upstream

    semantic = {**UPSTREAM_EMBEDDER, "embedding_dim": 64}
    long = "please tell me " + " ".join(["more about the history of the old city"] * 40)
    a, b = ({"authorization": f"Bearer tenant-{t}"} for t in "AB")
    async with gateway_with(semantic=semantic) as gw:
        cache = gw.gateway.semantic
        assert (await gw.chat("How do I reset my router?", headers=b)).status_code == 200
        await eventually(lambda: cache.entries == 1, what="B's entry")
        for n in range(4):
            for m in range(3):
                answered = await gw.chat(f"{long} {n} {m}", headers=a)
                assert answered.headers["x-carpool"] == "miss"
            await eventually(lambda n=n: cache.embed_failures == 3 * (n + 1), what="A's misses")
            paraphrase = await gw.chat("how do I reset my router", headers=b)
            assert paraphrase.headers["x-carpool"] == "semantic-hit", n
        own = embed_upstream.CHECK_TEXT
        checks = [c for c in fake.calls if c.path == "/v1/embeddings" and c.body["input"] == own]
        assert len(checks) == 4  # (one per three failures in a row: telling them apart)
        # The embedder down (it fails every text, its own too): still skipped after three
        # failures in a row and its check, but for one check a second.
        fake.fail_embeddings = lambda item: True
        for n in range(4):
            assert (await gw.chat(f"Question {n} about routers", headers=b)).status_code == 200
        assert cache.embedder.breaker.retry_at is not None
        sent = fake.count("/v1/embeddings")
        skipped = await gw.chat("how do I reset my router", headers=b)
        assert skipped.headers["x-carpool"] == "miss" and fake.count("/v1/embeddings") == sent


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


async def test_a_clients_text_the_embedder_answers_5xx_for_downs_no_replica(fake):
    # llama.cpp answers 500 to an input past its batch: each long prompt's embedding downed the
    # replica it went to (failed over to the other, downed too), for up to 60 s as they came,
    # though it served every chat. Not the replica's failure: the gateway's own call, for a
    # client's text; only an unreachable replica or a timeout says it is down.
    other = FakeUpstream()
    for each in (fake, other):
        each.embedding_fn = by_words
        each.fail_embeddings = lambda item: len(str(item).split()) > 300
    long = "please tell me " + " ".join(["more about the history of the old city"] * 40)
    semantic = {**UPSTREAM_EMBEDDER, "embedding_dim": 64}
    async with (
        serve_app(other) as other_url,
        run_gateway([fake.url, f"{other_url}/v1"], semantic=semantic) as gw,
    ):
        for n in range(3):
            assert (await gw.chat(f"{long} {n}")).status_code == 200
        await eventually(lambda: gw.gateway.semantic.embed_failures == 3, what="the misses")
        stats = (await gw.client.get("/stats")).json()
    replicas = stats["replicas"].values()
    assert all(r["state"] == "healthy" and r["failures"] == 0 for r in replicas), replicas
    assert stats["routing"].get("failover", 0) == 0, stats["routing"]


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


class EmbeddingsRewritten:
    """The fake upstream, each of its 2xx /v1/embeddings answers passed through ``rewrite`` (the
    parsed JSON in, the JSON to send out): an engine that answers embeddings otherwise."""

    def __init__(self, inner: FakeUpstream, rewrite: Callable[[Any], Any]) -> None:
        self.inner = inner
        self.rewrite = rewrite

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/embeddings":
            return await self.inner(scope, receive, send)
        start: dict[str, Any] = {}

        async def rewritten(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)  # (sent with the body: its length changes)
                return
            body = message["body"]
            if 200 <= start["status"] < 300:
                body = orjson.dumps(self.rewrite(orjson.loads(body)))
            headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
            length = (b"content-length", str(len(body)).encode())
            await send({**start, "headers": [*headers, length]})
            await send({"type": "http.response.body", "body": body})

        await self.inner(scope, receive, rewritten)


def first_vector_for_all(answer: Any) -> Any:
    """A list answered with its first item's vector for every item (a single input is answered
    right): one way an engine answers a list wrongly."""
    for row in answer["data"]:
        row["embedding"] = answer["data"][0]["embedding"]
    return answer


def numbered_from_1(answer: Any) -> Any:
    for row in answer["data"]:
        row["index"] += 1
    return answer


def by_words(text: Any) -> list[float]:
    """Prompts with the same words (case and punctuation aside) embed the same; others not."""
    words = " ".join(sorted(set(re.findall(r"[a-z0-9]+", str(text).lower()))))
    return _hash_vector(words, 64)


def embedded_texts(fake: FakeUpstream) -> list[Any]:
    """The inputs of the embedder's calls (the list probe's left out)."""
    probe = (list(PROBE_INPUTS), *PROBE_INPUTS)
    calls = [c.body["input"] for c in fake.calls if c.path == "/v1/embeddings"]
    return [given for given in calls if given not in probe]


@pytest.mark.parametrize("lists_right", [False, True], ids=["lists-wrong", "lists-right"])
async def test_an_upstream_embedding_is_the_same_whatever_it_was_batched_with(
    fake, gateway_with, lists_right
):
    # The embedder merged every micro-batch (every tenant's prompts) into one list call without
    # the list check the gateway's own /v1/embeddings batching asks: behind an engine that
    # answers lists wrongly (llama-cpp-python's server), every text but a batch's first got a
    # wrong vector. Its texts now go one by one until the probe says lists are answered item
    # by item, and merged only then.
    fake.broken_list_embeddings = not lists_right
    texts = ["How do I reset my router?", "What is the capital of France?"]
    later = ["Is it raining in Paris?", "How tall is Mount Everest?"]
    async with gateway_with(semantic=UPSTREAM_EMBEDDER) as gw:
        embedder = gw.gateway.semantic.embedder
        together = await embedder.embed_many(texts)  # (one micro-batch: asked together)
        await gw.gateway.batcher.wait_idle()  # the list probe that batch started
        then = await embedder.embed_many(later)
        alone = [await embedder.embed(text) for text in [*texts, *later]]
    np.testing.assert_allclose(np.vstack([together, then]), np.stack(alone), atol=1e-6)
    sent = embedded_texts(fake)
    assert texts not in sent  # before the probe's verdict: one by one
    assert (later in sent) is lists_right  # merged once it says lists are answered right
    assert sorted(given for given in sent if given != later) == sorted(
        [*texts, *texts, *later] + ([] if lists_right else later)
    )


async def test_a_prompt_embedded_with_another_tenants_gets_its_own_vector_in_the_cache():
    # Two tenants' prompts embedded in one list call, behind an engine that gives a list's
    # items its first one's vector: one of the two entries was stored under the other's
    # vector. Its tenant's paraphrase of it missed, and that tenant asking the other's
    # question hit it: an answer to another question, served as a semantic hit.
    fake = FakeUpstream()
    fake.embedding_fn = by_words
    semantic = {**UPSTREAM_EMBEDDER, "embedding_dim": 64, "batch_delay_ms": 50}
    theirs, mine = "How do I reset my router?", "How can I reset my router password?"
    async with serve_app(EmbeddingsRewritten(fake, first_vector_for_all)) as url:
        async with run_gateway([url + "/v1"], semantic=semantic) as gw:

            async def ask(content: str, tenant: str) -> Any:
                return await gw.client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "temperature": 0,
                        "messages": [{"role": "user", "content": content}],
                    },
                    headers={"authorization": f"Bearer {tenant}"},
                )

            first = await asyncio.gather(ask(theirs, "A"), ask(mine, "B"))
            assert [r.status_code for r in first] == [200, 200]
            await eventually(lambda: gw.gateway.semantic.entries == 2, what="both entries")
            # Tenant A's paraphrase of its own question: its entry, under its own vector.
            paraphrase = await ask("how do I reset my router", "A")
            assert paraphrase.headers["x-carpool"] == "semantic-hit"
            assert paraphrase.json()["choices"] == first[0].json()["choices"]
            # Tenant B asking A's question: B's entry is about a password, a miss.
            other = await ask("how do I reset my router", "B")
            assert other.headers["x-carpool"] == "miss", other.json()


async def test_an_embeddings_answer_not_indexed_0_to_n_minus_1_is_an_embedder_failure():
    # An answer whose ``data`` is not numbered exactly 0..n-1 does not say which vector is
    # whose: it was sorted by its indexes and taken (here a single text's vector numbered 1
    # was that text's). It is an embedder failure now: no entry, a counted miss.
    fake = FakeUpstream()
    async with serve_app(EmbeddingsRewritten(fake, numbered_from_1)) as url:
        async with run_gateway([url + "/v1"], semantic=UPSTREAM_EMBEDDER) as gw:
            answered = await chat(gw, "How do I reset my router?")
            assert answered.headers["x-carpool"] == "miss"
            await eventually(lambda: gw.gateway.semantic.embed_failures == 1, what="a failure")
            assert gw.gateway.semantic.entries == 0
    assert fake.count("/v1/embeddings") >= 1


async def test_an_embedding_dim_the_model_does_not_answer_is_named_once_with_both_lengths(caplog):
    # The fake's model answers 8 floats; the setting says 16 (as the default 1536 in front of a
    # 64- or 384-dimension model). Every embedding failed, and the log said only "the semantic
    # cache's embedder failed (ValueError; ...)", every 30 s: nothing named the setting.
    fake = FakeUpstream()
    semantic = {**UPSTREAM_EMBEDDER, "embedding_dim": 16}
    caplog.set_level(logging.WARNING, logger="carpool.semantic")
    async with serve_app(fake) as url, run_gateway([url + "/v1"], semantic=semantic) as gw:
        prompts = [f"How do I reset my router, take {n}?" for n in range(6)]
        for prompt in prompts:
            assert (await chat(gw, prompt)).headers["x-carpool"] == "miss"
        await eventually(lambda: gw.gateway.semantic.embed_failures >= 6, what="the failures")
        stats = (await gw.client.get("/stats")).json()["layers"]["semantic"]
    said = [r.getMessage() for r in caplog.records if r.name == "carpool.semantic"]
    named = [r for r in caplog.records if "semantic.embedding_dim" in r.getMessage()]
    assert [r.levelname for r in named] == ["ERROR"], said  # once, however many failed after it
    assert "returns vectors of 8 dimensions, semantic.embedding_dim says 16" in named[0].message
    # The failures that followed (the breaker's refusals among them): counted, not logged.
    assert [m for m in said if "the semantic cache's embedder failed" in m] == [named[0].message]
    assert not any("router" in m for m in said)  # no prompt in the log
    assert (
        stats["embed_problem"] in named[0].message
        and "semantic.embedding_dim" in stats["embed_problem"]
    )
    assert stats["embed_failures"] >= 6 and stats["entries"] == 0


async def test_an_embedding_dim_problem_is_over_once_the_model_answers_that_length_again():
    # It stayed in /stats after the model answered the right length again (a paraphrase was a
    # hit meanwhile): an operator told to change the setting would break a working config.
    fake = FakeUpstream()
    semantic = {**UPSTREAM_EMBEDDER, "embedding_dim": 16}
    async with serve_app(fake) as url, run_gateway([url + "/v1"], semantic=semantic) as gw:
        assert (await chat(gw, "How do I reset my router?")).headers["x-carpool"] == "miss"
        await eventually(lambda: gw.gateway.semantic.embed_problem is not None, what="it")
        fake.embedding_fn = lambda text: [1.0] + [0.0] * 15

        async def asked_again() -> bool:
            await chat(gw, "How do I reset my modem?")
            return gw.gateway.semantic.embed_problem is None

        for _ in range(50):  # (the breaker tries again once a second)
            if await asked_again():
                break
            await asyncio.sleep(0.1)
        stats = (await gw.client.get("/stats")).json()["layers"]["semantic"]
    assert stats["embed_problem"] is None
