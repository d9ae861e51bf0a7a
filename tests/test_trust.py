"""Sharing is safe: a client gets exactly the answer its own request would have got, and only if it
could have got it (issue 13: identity, what is in the key, white space, invalidation of flights).

Every test talks HTTP to a real gateway in front of the counting fake upstream, whose answers
name the call that made them (``answer N to ...``): a client served another request's answer is
seen in the text, and every call that should have been made is seen in ``fake.count()``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.answer import Answer
from carpool.store import Entry
from fakes.waiting import eventually

CREDENTIALS = [
    "authorization",
    "api-key",
    "x-api-key",
    "openai-organization",
    "openai-project",
    "x-goog-api-key",
    "cf-aig-authorization",
    "cf-access-client-id",
    "cf-access-client-secret",
]
ADMIN = "admin-token"
PROPERTY = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def text(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


# --- 1. identity comes from every credential a client presents ------------------------------------


@PROPERTY
@given(
    name=st.sampled_from(CREDENTIALS),
    other=st.sampled_from([None, *CREDENTIALS]),
    value=st.sampled_from(["k1", "Bearer k1", "wrong", "valid2"]),
)
async def test_any_credential_header_that_differs_gets_its_own_answer(gw, fake, name, other, value):
    fake.reset()
    await gw.gateway.invalidate({"all": True})
    prompt = f"identity {name} {other} {value!r}"
    first = await gw.chat(prompt, headers={name: "valid"})
    # The same request with another value of that header, or with another credential besides,
    # is another tenant: its own upstream call.
    headers = {name: value} if other is None or other == name else {name: "valid", other: value}
    second = await gw.chat(prompt, headers=headers)
    assert second.headers["x-carpool"] == "miss"
    assert text(first) != text(second) and fake.count() == 2
    assert (await gw.chat(prompt)).headers["x-carpool"] == "miss"  # and no key at all
    assert (await gw.chat(prompt, headers={name: "valid"})).headers["x-carpool"] == "hit"


async def test_a_client_with_a_wrong_key_never_joins_a_call_in_flight(gw, fake):
    fake.gate = asyncio.Event()
    leader = asyncio.create_task(gw.chat("in flight", headers={"api-key": "valid"}))
    await fake.wait_until(lambda: fake.count() == 1, what="the leader's call")
    wrong = asyncio.create_task(gw.chat("in flight", headers={"api-key": "made-up"}))
    anonymous = asyncio.create_task(gw.chat("in flight"))
    await fake.wait_until(lambda: fake.count() == 3, what="a call for each credential")
    fake.gate.set()
    answers = {text(r) for r in await asyncio.gather(leader, wrong, anonymous)}
    assert len(answers) == 3


async def test_an_idempotency_key_is_scoped_by_every_credential(gw, fake):
    key = {"Idempotency-Key": '"order-1"'}
    first = await gw.chat("pay", headers={**key, "x-api-key": "valid"})
    replay = await gw.chat("pay", headers={**key, "x-api-key": "valid"})
    other = await gw.chat("pay", headers={**key, "x-api-key": "other"})
    assert replay.headers.get("idempotent-replayed") == "true" and text(replay) == text(first)
    assert "idempotent-replayed" not in other.headers and text(other) != text(first)
    assert fake.count() == 2


@pytest.mark.parametrize("name", ["cf-aig-authorization", "cf-new-token", "x-vendor-key"])
async def test_a_header_of_a_family_carpool_does_not_know_all_of_is_never_neutral(gw, fake, name):
    # Cloudflare's cf- headers are tracing and credentials both: only the tracing ones, by name,
    # leave the key; a credential carpool does not know by name stays in it.
    first = await gw.chat("cf", headers={name: "Bearer GOOD"})
    second = await gw.chat("cf", headers={name: "Bearer WRONG"})
    assert second.headers["x-carpool"] == "miss" and text(first) != text(second)
    assert (await gw.chat("cf", headers={name: "Bearer GOOD", "cf-ray": "8a1"})).headers[
        "x-carpool"
    ] == "hit"
    assert fake.count() == 2


@pytest.mark.parametrize(
    ("path_a", "path_b", "headers_a", "headers_b"),
    [
        ("?key=KEY-OF-A", "?key=KEY-OF-B", {}, {}),
        ("", "", {"cookie": "session=A"}, {"cookie": "session=B"}),
        ("", "", {"cookie": "AWSALB=1; sid=A"}, {"cookie": "AWSALB=1; sid=B"}),
    ],
)
async def test_an_idempotency_key_is_scoped_by_a_query_key_and_a_cookie_too(
    gw, fake, path_a, path_b, headers_a, headers_b
):
    # Credentials the tenant does not read by name: two clients told apart only by them must not
    # meet on one record (the second got a 422, judged against the first's request).
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "pay"}]}
    key = {"idempotency-key": "order-1"}
    a = await gw.client.post(
        f"/v1/chat/completions{path_a}", json=body, headers={**key, **headers_a}
    )
    b = await gw.client.post(
        f"/v1/chat/completions{path_b}", json=body, headers={**key, **headers_b}
    )
    again = await gw.client.post(
        f"/v1/chat/completions{path_a}", json=body, headers={**key, **headers_a}
    )
    assert b.status_code == 200 and "idempotent-replayed" not in b.headers
    assert text(a) != text(b) and text(again) == text(a)
    assert again.headers["idempotent-replayed"] == "true" and fake.count() == 2


@pytest.mark.parametrize(
    ("path_b", "headers_b", "replayed"),
    [
        ("", {"sentry-trace": "b-2"}, True),  # tracing: a new value each attempt, neutral
        ("", {"x-foo": "2"}, False),  # in the key: another request, a 422
        ("?api-version=2", {}, False),  # a query parameter that is no credential: a 422
    ],
)
async def test_a_retry_differing_in_anything_but_a_credential_is_never_run_twice(
    gw, fake, path_b, headers_b, replayed
):
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "pay"}]}
    key = {"idempotency-key": "order-1"}
    first = await gw.client.post(
        "/v1/chat/completions?api-version=1",
        json=body,
        headers={**key, "sentry-trace": "a-1", "x-foo": "1"},
    )
    retry = await gw.client.post(
        f"/v1/chat/completions{path_b or '?api-version=1'}",
        json=body,
        headers={**key, "sentry-trace": "a-1", "x-foo": "1", **headers_b},
    )
    assert first.status_code == 200 and fake.count() == 1
    if replayed:
        assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content
    else:
        assert retry.status_code == 422


async def test_a_retry_whose_load_balancer_or_analytics_cookies_changed_is_never_run_twice(
    gw, fake
):
    """AWS ALB re-issues its affinity cookie with a new value on every response, and a client
    with a cookie jar (the openai SDK's httpx client, a browser) sends it with its retry: the
    retry ran the generation again, during the first try too (no 409)."""
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "pay"}]}
    key = {"idempotency-key": "order-1"}
    fake.chunk_gate = asyncio.Event()
    first = asyncio.create_task(
        gw.client.post(
            "/v1/chat/completions",
            json={**body, "stream": True},
            headers={**key, "cookie": "sid=S; AWSALB=a1; AWSALBCORS=a1"},
        )
    )
    await fake.chunk_gate_reached.wait()  # (the first try is running)
    during = await gw.client.post(
        "/v1/chat/completions",
        json={**body, "stream": True},
        headers={**key, "cookie": "sid=S; AWSALB=b2; AWSALBCORS=b2"},
    )
    assert during.status_code == 409
    fake.chunk_gate.set()
    assert (await first).status_code == 200
    after = await gw.client.post(
        "/v1/chat/completions",
        json={**body, "stream": True},
        headers={**key, "cookie": "_ga=GA1.2.3; AWSALB=c3; sid=S; _ga_X1=GS1; __cf_bm=x"},
    )
    assert after.headers["idempotent-replayed"] == "true"
    assert fake.count() == 1


async def test_a_load_balancers_affinity_cookie_never_splits_the_cache_a_users_cookie_does(
    gw, fake
):
    first = await gw.chat("lb", headers={"cookie": "sid=S; AWSALB=a1"})
    again = await gw.chat("lb", headers={"cookie": "AWSALB=b2; _ga=GA1.2; sid=S"})
    other = await gw.chat("lb", headers={"cookie": "sid=T; AWSALB=b2"})
    assert again.headers["x-carpool"] == "hit" and text(again) == text(first)
    assert other.headers["x-carpool"] == "miss" and fake.count() == 2


@pytest.mark.parametrize(
    ("alice", "bob"),
    [
        # Two lines, joined: the user's session after the load balancer's cookie.
        (
            [("cookie", "AWSALB=lb1"), ("cookie", "session=alice")],
            [("cookie", "AWSALB=lb1"), ("cookie", "session=bob")],
        ),
        ([("cookie", "=alice-secret")], [("cookie", "=bob-secret")]),  # nameless
        ([("cookie", "AWSALB=lb1, session=alice")], [("cookie", "AWSALB=lb1, session=bob")]),
        ([("cookie", 'sid="a;AWSALB=x"')], [("cookie", 'sid="b;AWSALB=x"')]),  # quoted
    ],
    ids=["two-lines", "nameless", "comma-joined", "quoted"],
)
async def test_a_cookie_carpool_cannot_read_as_name_value_pairs_stays_whole_in_the_key(
    gw, fake, alice, bob
):
    """Only plain name=value pairs of the infrastructure's are left out: two Cookie lines
    joined by ", " read as one cookie named AWSALB, dropped, and a nameless cookie was dropped
    too: Bob got Alice's answer and her idempotency record's replay."""
    for key in (None, "order-1"):
        idempotency = [("idempotency-key", key)] if key else []
        content = f"mine ({key})"
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}
        first = await gw.client.post("/v1/chat/completions", json=body, headers=alice + idempotency)
        other = await gw.client.post("/v1/chat/completions", json=body, headers=bob + idempotency)
        assert first.headers["x-carpool"] == other.headers["x-carpool"] == "miss"
        assert "idempotent-replayed" not in other.headers and text(first) != text(other)
    assert fake.calls[0].headers["cookie"] == "; ".join(value for _, value in alice)


async def test_in_a_shared_namespace_a_made_up_key_never_reads_anything(fake, gateway_with):
    fake.valid_keys = {"good-1", "good-2"}
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        first = await gw.chat("shared", headers={"Authorization": "Bearer good-1", **shared})
        assert first.headers["x-carpool"] == "miss"
        for made_up in (
            {"Authorization": "Bearer forged"},
            {"api-key": "forged"},
            {"x-api-key": "forged"},
            {},
        ):
            response = await gw.chat("shared", headers={**made_up, **shared})
            assert response.status_code == 401 and response.headers["x-carpool"] == "miss"
        # A valid key the upstream has accepted reads it.
        await gw.chat("something else", headers={"Authorization": "Bearer good-2"})
        hit = await gw.chat("shared", headers={"Authorization": "Bearer good-2", **shared})
        assert hit.headers["x-carpool"] == "hit" and text(hit) == text(first)
        assert fake.count() == 6


async def test_in_a_shared_namespace_a_made_up_key_never_joins_a_call_in_flight(fake, gateway_with):
    fake.valid_keys = {"good"}
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        await gw.chat("warm up", headers={"Authorization": "Bearer good"})
        fake.gate = asyncio.Event()
        leader = asyncio.create_task(
            gw.chat("flight", headers={"Authorization": "Bearer good", **shared})
        )
        await fake.wait_until(lambda: fake.count() == 2, what="the leader's call")
        forged = asyncio.create_task(
            gw.chat("flight", headers={"Authorization": "Bearer forged", **shared})
        )
        await fake.wait_until(lambda: fake.count() == 3, what="the forged key's own call")
        fake.gate.set()
        assert (await leader).status_code == 200 and (await forged).status_code == 401


async def test_a_shared_namespace_is_filled_by_the_first_accepted_answer(fake, gateway_with):
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        first = await gw.chat("fill", headers={"Authorization": "Bearer a", **shared})
        await gw.chat("other", headers={"Authorization": "Bearer b"})
        hit = await gw.chat("fill", headers={"Authorization": "Bearer b", **shared})
        assert hit.headers["x-carpool"] == "hit" and text(hit) == text(first)


async def test_the_credentials_are_never_stored_or_shown(gw, fake):
    await gw.chat("secret", headers={"Authorization": "Bearer sk-very-secret"})
    stats = await gw.client.get("/stats")
    metrics = await gw.client.get("/metrics")
    assert "sk-very-secret" not in stats.text and "sk-very-secret" not in metrics.text


# --- 3. everything that changes what may be served is in the key or checked at read time --------


async def test_the_request_type_is_in_the_key(gw, fake):
    untyped = await gw.chat("typed")
    factual = await gw.chat("typed", headers={"x-carpool-type": "factual"})
    code = await gw.chat("typed", headers={"x-carpool-type": "code"})
    assert [r.headers["x-carpool"] for r in (untyped, factual, code)] == ["miss"] * 3
    assert len({text(untyped), text(factual), text(code)}) == 3
    # factual (ttl 0) is never stored, so never served from the cache.
    again = await gw.chat("typed", headers={"x-carpool-type": "factual"})
    assert again.headers["x-carpool"] in ("miss", "coalesced")
    assert (await gw.chat("typed", headers={"x-carpool-type": "code"})).headers[
        "x-carpool"
    ] == "hit"


async def test_the_readers_type_ttl_bounds_what_it_is_served_whoever_wrote_it(gw, fake):
    realtime = {"x-carpool-type": "realtime"}  # ttl 300 s
    first = await gw.chat("news", headers=realtime)
    assert (await gw.chat("news", headers=realtime)).headers["x-carpool"] == "hit"
    # An instance with a longer TTL for the type (or an older config) stored it 10 minutes ago.
    store = gw.gateway.store
    (key,) = store._seen  # (its one entry, hit once: its key noted)  # noqa: SLF001
    entry = await store.get(key)
    assert entry is not None
    old = Answer(
        entry.answer.kind, entry.answer.body, True, entry.answer.tokens, created=time.time() - 600
    )
    await store.put(
        key, Entry(old, time.time() + 3600, entry.tags, entry.namespace, entry.prompt_prefix)
    )
    gw.gateway.flights.forget_all()
    late = await gw.chat("news", headers=realtime)
    assert late.headers["x-carpool"] == "miss" and text(late) != text(first)


async def test_the_query_string_is_forwarded_and_in_the_key(gw, fake):
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "temperature": 0}

    async def ask(query: str):
        return await gw.client.post("/v1/chat/completions" + query, json=body)

    one = await ask("?api-version=2024-10-21")
    assert fake.calls[-1].query == "api-version=2024-10-21"
    two = await ask("?api-version=2025-01-01")
    assert fake.calls[-1].query == "api-version=2025-01-01"
    bare = await ask("")
    assert fake.calls[-1].query == ""
    assert [r.headers["x-carpool"] for r in (one, two, bare)] == ["miss"] * 3
    assert (await ask("?api-version=2024-10-21")).headers["x-carpool"] == "hit"
    assert fake.count() == 3


async def test_the_query_string_reaches_batched_embeddings(gw, fake):
    response = await gw.client.post(
        "/v1/embeddings?api-version=1", json={"model": "e", "input": "x"}
    )
    assert response.status_code == 200 and fake.calls[-1].query == "api-version=1"


# --- 4. white space is meaning ------------------------------------------------------------------

WHITE_SPACE_PAIRS = [
    ("def f():\n    return 1", "def f():\n  return 1"),  # Python indentation
    ("a    b", "a b"),  # counted spaces
    ("col1\tcol2", "col1 col2"),  # tabs
    ("line one  \nline two", "line one\nline two"),  # Markdown hard break
    ("~~~\nx  = 1\n~~~", "~~~\nx = 1\n~~~"),  # ~~~ fences
    ("text\n\n    indented code", "text\n\n indented code"),  # indented code blocks
    ("a\u00a0b", "a b"),  # non-ASCII space
    ("a\u3000b", "a b"),
    ("a\x0bb", "a b"),  # control characters
    ("trailing ", "trailing"),
]


@pytest.mark.parametrize("a, b", WHITE_SPACE_PAIRS)
async def test_white_space_is_meaning_prompts_that_differ_in_it_are_not_merged(gw, fake, a, b):
    first, second = await gw.chat(a), await gw.chat(b)
    assert [first.headers["x-carpool"], second.headers["x-carpool"]] == ["miss", "miss"]
    assert fake.count() == 2


@PROPERTY
@given(
    words=st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=2, max_size=5),
    spaces=st.lists(
        st.sampled_from([" ", "  ", "\t", "\n", "\u00a0", " \n", "\r\n"]), min_size=2, max_size=2
    ),
)
async def test_any_change_of_white_space_is_another_request(gw, fake, words, spaces):
    a, b = spaces[0].join(words), spaces[1].join(words)
    fake.reset()
    await gw.gateway.invalidate({"all": True})
    await gw.chat(a)
    await gw.chat(b)
    assert fake.count() == (1 if a == b else 2)


async def test_embeddings_inputs_keep_their_white_space_even_with_collapse(fake, gateway_with):
    async with gateway_with(fingerprint={"normalize_whitespace": True}) as gw:
        for text_ in ("a  b", "a b", " a b", "a\tb"):
            response = await gw.client.post("/v1/embeddings", json={"model": "e", "input": text_})
            assert response.headers["x-carpool"] == "miss", text_


# --- 7. invalidation covers calls in flight ------------------------------------------------------


async def test_after_an_invalidation_no_request_joins_a_call_begun_before_it(fake, gateway_with):
    async with gateway_with(admin_token=ADMIN) as gw:
        fake.gate = asyncio.Event()
        before = asyncio.create_task(gw.chat("invalidated"))
        await fake.wait_until(lambda: fake.count() == 1, what="the first call")
        response = await gw.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert response.status_code == 200
        after = asyncio.create_task(gw.chat("invalidated"))
        await fake.wait_until(lambda: fake.count() == 2, what="a fresh call after invalidation")
        fake.gate.set()
        first, second = await before, await after
        assert second.headers["x-carpool"] == "miss" and text(first) != text(second)
        # The call begun before the invalidation was not stored; the one after it was.
        third = await gw.chat("invalidated")
        assert third.headers["x-carpool"] in ("hit", "coalesced")
        assert text(third) == text(second) and fake.count() == 2


async def test_a_call_in_flight_during_an_invalidation_is_not_stored(fake, gateway_with):
    async with gateway_with(admin_token=ADMIN, coalesce={"window_ms": 0, "adaptive": False}) as gw:
        fake.gate = asyncio.Event()
        before = asyncio.create_task(gw.chat("stale"))
        await fake.wait_until(lambda: fake.count() == 1, what="the first call")
        await gw.client.post(
            "/admin/invalidate",
            json={"tag": "anything"},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        fake.gate.set()
        assert (await before).status_code == 200
        again = await gw.chat("stale")
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_the_semantic_cache_uses_the_same_identity(fake, gateway_with):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("usearch")
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(
        semantic={"enabled": True}, tenant={"shared_namespaces": ["docs"]}
    ) as gw:
        semantic = gw.gateway.semantic
        first = await gw.chat("How do I reset my router?", headers={"api-key": "valid"})
        await eventually(lambda: semantic.entries >= 1, what="the semantic insert")
        # Another credential in any header: no semantic hit across tenants.
        for other in ({"api-key": "made-up"}, {"x-api-key": "valid"}, {}):
            response = await gw.chat("how can i reset my router", headers=other)
            assert response.headers["x-carpool"] == "miss", other
        await eventually(lambda: semantic.entries >= 4, what="their own semantic inserts")
        # In a shared namespace: only once the upstream has accepted the credential.
        modem = await gw.chat("How do I reset my modem?", headers={"api-key": "a", **shared})
        await eventually(lambda: semantic.entries >= 5, what="the semantic insert")
        fake.valid_keys = {"a", "b"}
        forged = await gw.chat("how can i reset my modem", headers={"api-key": "forged", **shared})
        assert forged.status_code == 401
        await gw.chat("warm up", headers={"api-key": "b"})
        hit = await gw.chat("how can i reset my modem", headers={"api-key": "b", **shared})
        assert hit.headers["x-carpool"] == "semantic-hit"
        assert text(hit) == text(modem) != text(first)


async def test_acceptance_is_per_grant_a_key_refused_a_model_never_reads_its_answers(
    fake, gateway_with
):
    fake.valid_keys = {"good": {"premium", "small"}, "cheap": {"small"}}
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        secret = await gw.chat(
            "secret", model="premium", headers={"Authorization": "Bearer good", **shared}
        )
        assert secret.status_code == 200
        small = await gw.chat("hello", model="small", headers={"Authorization": "Bearer cheap"})
        assert small.status_code == 200  # accepted, for the small model only
        premium = await gw.chat(
            "secret", model="premium", headers={"Authorization": "Bearer cheap", **shared}
        )
        assert premium.status_code == 401 and premium.headers["x-carpool"] == "miss"


async def test_a_key_the_upstream_refuses_is_accepted_for_nothing_any_more(fake, gateway_with):
    fake.valid_keys = {"good"}
    shared = {"x-carpool-namespace": "docs"}
    # No coalescing window: a key's own answers linger in it, whatever the namespace.
    async with gateway_with(
        tenant={"shared_namespaces": ["docs"]}, coalesce={"window_ms": 0, "adaptive": False}
    ) as gw:
        await gw.chat("shared", headers={"Authorization": "Bearer good", **shared})
        assert (
            await gw.chat("shared", headers={"Authorization": "Bearer good", **shared})
        ).headers["x-carpool"] == "hit"
        fake.valid_keys = set()  # revoked upstream
        assert (await gw.chat("other", headers={"Authorization": "Bearer good"})).status_code == 401
        again = await gw.chat("shared", headers={"Authorization": "Bearer good", **shared})
        assert again.status_code == 401 and again.headers["x-carpool"] == "miss"


@pytest.mark.parametrize("refusal", [401, 403])
async def test_a_key_refused_on_a_pass_through_call_is_accepted_for_nothing_any_more(
    fake, gateway_with, refusal
):
    """A 401 or 403 for a tenant takes back its acceptance whatever call it answered: one to a
    pass-through call (``GET /v1/models``) did not, and the revoked key read another tenant's
    answers in the shared namespace for up to ``tenant.accepted_ttl``."""
    fake.valid_keys = {"a", "b"}
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        asked = await gw.chat("shared", headers={"Authorization": "Bearer a", **shared})
        assert asked.status_code == 200
        warm = await gw.chat("warm up", headers={"Authorization": "Bearer b"})
        assert warm.status_code == 200  # b accepted by the upstream
        if refusal == 401:
            fake.valid_keys = {"a"}  # b's key revoked upstream
        else:
            fake.fail_status, fake.fail_times = 403, 1  # b's key denied what it had
        models = await gw.client.get("/v1/models", headers={"Authorization": "Bearer b"})
        assert models.status_code == refusal
        again = await gw.chat("shared", headers={"Authorization": "Bearer b", **shared})
        assert again.headers["x-carpool"] == "miss", "a refused key read another tenant's answer"
        assert again.status_code == (401 if refusal == 401 else 200)


@pytest.mark.parametrize("temperature", [0, 0.7], ids=["flight", "bypass"])
async def test_a_call_sent_before_its_keys_refusal_accepts_nothing_when_it_ends(
    fake, gateway_with, temperature
):
    """A 2xx of a call sent before the upstream refused its key (a long stream that ends
    after the refusal) accepted the key again: the revoked key read the other tenants' answers
    in the shared namespaces for ``tenant.accepted_ttl``."""
    fake.valid_keys = {"a", "b"}
    a, b = {"Authorization": "Bearer a"}, {"Authorization": "Bearer b"}
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        assert (await gw.chat("shared", headers={**a, **shared})).status_code == 200
        fake.chunk_gate = asyncio.Event()
        slow = asyncio.create_task(gw.stream_chat("long", headers=b, temperature=temperature))
        await fake.chunk_gate_reached.wait()  # (its head said 200: sent with a good key)
        fake.valid_keys = {"a"}  # b's key revoked upstream
        assert (await gw.chat("other", headers=b)).status_code == 401
        fake.chunk_gate.set()
        streamed, text = await slow
        assert streamed.status_code == 200 and text.endswith("data: [DONE]\n\n")
        again = await gw.chat("shared", headers={**b, **shared})
        assert again.headers["x-carpool"] == "miss", "a revoked key read another tenant's answer"
        assert again.status_code == 401
        # A call sent after the refusal accepts again (the key reinstated).
        fake.valid_keys = {"a", "b"}
        assert (await gw.chat("again", headers=b)).status_code == 200
        assert (await gw.chat("shared", headers={**b, **shared})).headers["x-carpool"] == "hit"


async def test_in_a_shared_namespace_another_tenants_refusal_is_not_handed_to_a_joiner(
    fake, gateway_with
):
    fake.valid_keys = {"a", "b"}
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        for key in ("a", "b"):
            await gw.chat("warm up " + key, headers={"Authorization": f"Bearer {key}"})
        fake.valid_keys = {"b"}  # a's key revoked, not yet known
        fake.gate = asyncio.Event()
        calls = fake.count()
        led = asyncio.create_task(gw.chat("q", headers={"Authorization": "Bearer a", **shared}))
        await fake.wait_until(lambda: fake.count() == calls + 1, what="a's call")
        joined = asyncio.create_task(gw.chat("q", headers={"Authorization": "Bearer b", **shared}))
        await eventually(lambda: gw.gateway.flights.waiters == 2, what="b joining a's call")
        fake.gate.set()
        assert (await led).status_code == 401
        own = await joined
        assert own.status_code == 200 and fake.count() == calls + 2


async def test_an_idempotent_retry_is_replayed_even_after_the_key_became_accepted(
    fake, gateway_with
):
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        headers = {"Authorization": "Bearer new", "Idempotency-Key": '"k1"', **shared}
        first = await gw.chat("pay", headers=headers)
        retry = await gw.chat("pay", headers=headers)
        assert retry.status_code == 200 and retry.headers.get("idempotent-replayed") == "true"
        assert text(retry) == text(first) and fake.count() == 1


async def test_a_forwarded_header_that_may_change_the_answer_is_in_the_key(gw, fake):
    large = await gw.chat("deploy", headers={"azureml-model-deployment": "large"})
    tiny = await gw.chat("deploy", headers={"azureml-model-deployment": "tiny"})
    assert [r.headers["x-carpool"] for r in (large, tiny)] == ["miss", "miss"]
    assert fake.calls[-1].headers["azureml-model-deployment"] == "tiny"
    beta = await gw.chat("deploy", headers={"OpenAI-Beta": "assistants=v2"})
    assert beta.headers["x-carpool"] == "miss" and fake.count() == 3
    # Transport, tracing and SDK telemetry headers are not: the same request.
    same = await gw.chat(
        "deploy",
        headers={
            "user-agent": "other/1.0",
            "traceparent": "00-1-2-01",
            "x-stainless-retry-count": "1",
            "x-ms-client-request-id": "9f1c",  # (Azure SDKs: one per try)
            "azureml-model-deployment": "tiny",
        },
    )
    assert same.headers["x-carpool"] == "hit" and text(same) == text(tiny)


async def test_a_header_the_requests_connection_names_is_hop_by_hop_never_forwarded_nor_keyed(
    gw, fake
):
    """RFC 9110 7.6.1: the headers a request's ``Connection`` lists are for that hop only. Only
    a fixed list of hop-by-hop names was dropped: the listed ones went upstream (pass-through
    and cached endpoints alike) and split the cache key."""
    hop = {"Connection": "keep-alive, X-Hop-Secret", "X-Hop-Secret": "s3cr3t"}
    models = await gw.client.get("/v1/models", headers=hop)
    assert models.status_code == 200 and "x-hop-secret" not in fake.calls[-1].headers
    first = await gw.chat("hop", headers=hop)
    assert first.headers["x-carpool"] == "miss" and "x-hop-secret" not in fake.calls[-1].headers
    other = await gw.chat("hop", headers={**hop, "X-Hop-Secret": "other"})
    plain = await gw.chat("hop")
    assert [r.headers["x-carpool"] for r in (other, plain)] == ["hit", "hit"]
    # Not listed, the same header is an end-to-end one: forwarded, and in the key.
    listed_not = await gw.chat("hop", headers={"X-Hop-Secret": "s3cr3t"})
    assert listed_not.headers["x-carpool"] == "miss"
    assert fake.calls[-1].headers["x-hop-secret"] == "s3cr3t" and fake.count() == 3


async def test_embeddings_are_batched_only_with_the_same_forwarded_headers(gw, fake):
    bodies = [("openai-beta", "x"), ("openai-beta", "y"), ("azureml-model-deployment", "z")]
    responses = await asyncio.gather(
        *(
            gw.client.post(
                "/v1/embeddings", json={"model": "e", "input": f"item {i}"}, headers={name: value}
            )
            for i, (name, value) in enumerate(bodies)
        )
    )
    assert all(r.status_code == 200 for r in responses)
    seen = sorted(
        (c.headers.get("openai-beta", ""), c.headers.get("azureml-model-deployment", ""))
        for c in fake.calls
    )
    assert seen == sorted([("x", ""), ("y", ""), ("", "z")])


async def test_a_cached_endpoint_with_a_trailing_slash_is_the_same_endpoint(gw, fake):
    body = {"model": "m", "messages": [{"role": "user", "content": "slash"}], "temperature": 0}
    first = await gw.client.post("/v1/chat/completions", json=body)
    slash = await gw.client.post("/v1/chat/completions/", json=body)
    assert slash.headers["x-carpool"] == "hit" and slash.json() == first.json()
    assert [c.path for c in fake.calls] == ["/v1/chat/completions"]


async def test_an_answer_whose_prompt_is_embedded_during_an_invalidation_is_not_added(
    fake, gateway_with
):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("usearch")
    async with gateway_with(semantic={"enabled": True}, admin_token=ADMIN) as gw:
        semantic = gw.gateway.semantic
        embedding, release = asyncio.Event(), asyncio.Event()
        vector = semantic.vector

        async def slow_vector(view):
            embedding.set()
            await release.wait()
            return await vector(view)

        semantic.vector = slow_vector
        # no-cache: no probe, so the prompt is embedded while the upstream answers, and the
        # entry goes in once the embedding is done, before the flight ends.
        asked = asyncio.create_task(
            gw.chat("How do I reset my router?", headers={"Cache-Control": "no-cache"})
        )
        await embedding.wait()
        await gw.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        release.set()
        assert (await asked).status_code == 200
        assert semantic.entries == 0
        again = await gw.chat("how can i reset my router")
        assert again.headers["x-carpool"] == "miss"


async def test_acceptance_covers_the_forwarded_headers_a_key_may_be_refused(fake, gateway_with):
    shared = {"x-carpool-namespace": "docs"}
    premium = {"azureml-model-deployment": "premium"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        await gw.chat("warm", headers={"Authorization": "Bearer cheap"})  # accepted, plain
        secret = await gw.chat(
            "secret", headers={"Authorization": "Bearer good", **premium, **shared}
        )
        assert secret.headers["x-carpool"] == "miss"
        # cheap was never answered with that deployment: it reads nothing made with it.
        asked = await gw.chat(
            "secret", headers={"Authorization": "Bearer cheap", **premium, **shared}
        )
        assert asked.headers["x-carpool"] == "miss" and fake.count() == 3


async def test_a_joiner_refused_by_proxy_twice_still_gets_its_own_answer(fake, gateway_with):
    fake.valid_keys = {"a", "b", "c"}
    shared = {"x-carpool-namespace": "docs"}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        for key in "abc":
            await gw.chat("warm up " + key, headers={"Authorization": f"Bearer {key}"})
        fake.valid_keys = {"c"}  # a and b revoked upstream, not yet known
        fake.gate = asyncio.Event()
        led = asyncio.create_task(gw.chat("q", headers={"Authorization": "Bearer a", **shared}))
        await fake.wait_until(lambda: fake.count() == 4, what="a's call")
        b = asyncio.create_task(
            gw.stream_chat("q", headers={"Authorization": "Bearer b", **shared})
        )
        c = asyncio.create_task(
            gw.stream_chat("q", headers={"Authorization": "Bearer c", **shared})
        )
        await eventually(lambda: gw.gateway.flights.waiters == 3, what="b and c joining")
        fake.gate.set()
        assert (await led).status_code == 401
        (b_response, _), (c_response, c_text) = await b, await c
        assert b_response.status_code == 401
        assert c_response.status_code == 200 and c_text.rstrip().endswith("data: [DONE]")
        await eventually(lambda: gw.gateway.flights.waiters == 0, what="no waiter left")
