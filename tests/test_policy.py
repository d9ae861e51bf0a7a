"""Cache controls, per-type TTLs, freshness tokens, tags, tenants and namespaces over HTTP
(CONTRACT.md "Cache controls on a request", "Tenants", "Admin")."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from carpool.clock import ManualClock
from conftest import redis_settings
from fakes.waiting import eventually
from test_limits import raw_post


def clients_on_flights(served) -> int:
    return sum(f.clients for f in served.gateway.flights.running())


async def outcome(served, content="What is carpool?", **headers) -> str:
    response = await served.chat(content, headers=headers or None)
    assert response.status_code == 200, response.text
    return response.headers["x-carpool"]


# --- Cache-Control ----------------------------------------------------------------------------


async def test_no_cache_calls_upstream_and_stores_the_result(gw, fake):
    assert await outcome(gw) == "miss"
    assert await outcome(gw, **{"Cache-Control": "no-cache"}) == "miss"
    fresh = await gw.chat()
    assert fresh.headers["x-carpool"] == "hit"
    assert fresh.json()["choices"][0]["message"]["content"].startswith("answer 2")


async def test_no_cache_still_joins_a_call_in_flight(gw, fake):
    fake.gate = asyncio.Event()
    first = asyncio.create_task(gw.chat())
    await fake.wait_for_calls(1)
    second = asyncio.create_task(gw.chat(headers={"Cache-Control": "no-cache"}))
    await eventually(lambda: clients_on_flights(gw) == 2)
    fake.gate.set()
    assert [r.headers["x-carpool"] for r in await asyncio.gather(first, second)] == [
        "miss",
        "coalesced",
    ]
    assert fake.count() == 1


async def test_no_store_neither_reads_nor_writes_the_cache(gw, fake):
    assert await outcome(gw, **{"Cache-Control": "no-store"}) == "miss"
    assert gw.gateway.store.entries == 0
    assert await outcome(gw) == "miss"  # nothing was stored
    assert await outcome(gw, **{"Cache-Control": "no-store"}) == "miss"  # nothing is read
    assert fake.count() == 3


async def test_no_store_may_still_coalesce_with_a_call_in_flight(gw, fake):
    fake.gate = asyncio.Event()
    first = asyncio.create_task(gw.chat())
    await fake.wait_for_calls(1)
    second = asyncio.create_task(gw.chat(headers={"Cache-Control": "no-store"}))
    await eventually(lambda: clients_on_flights(gw) == 2)
    fake.gate.set()
    assert (await first).headers["x-carpool"] == "miss"
    assert (await second).headers["x-carpool"] == "coalesced"
    assert fake.count() == 1


async def test_a_no_store_leaders_answer_is_stored_for_a_joiner_that_would_store_it(gw, fake):
    # no-store binds only the request that sends it: the plain request that joined its call
    # found nothing stored after, and the next identical request called the upstream again.
    fake.gate = asyncio.Event()
    first = asyncio.create_task(gw.chat(headers={"Cache-Control": "no-store"}))
    await fake.wait_for_calls(1)
    second = asyncio.create_task(gw.chat())
    await eventually(lambda: clients_on_flights(gw) == 2)
    fake.gate.set()
    assert (await first).headers["x-carpool"] == "miss"
    assert (await second).headers["x-carpool"] == "coalesced"
    assert await outcome(gw) == "hit" and fake.count() == 1
    # Alone, it stores nothing still.
    assert await outcome(gw, "another", **{"Cache-Control": "no-store"}) == "miss"
    assert await outcome(gw, "another") == "miss" and fake.count() == 3


async def test_max_age_refuses_an_answer_older_than_n_seconds(fake, gateway_with):
    clock = ManualClock()
    async with gateway_with(clock=clock) as gw:
        assert await outcome(gw) == "miss"
        assert await outcome(gw, **{"Cache-Control": "max-age=1"}) == "hit"
        clock.advance(1.3)  # the scenario: a 1.3 s old answer
        assert await outcome(gw, **{"Cache-Control": "max-age=1"}) == "miss"
        assert await outcome(gw, **{"Cache-Control": "max-age=60"}) == "hit"


async def test_max_age_is_read_with_spaces_around_its_equals_sign(fake, gateway_with):
    # ("max-age = 1" was dropped unread: a 100 s old answer served to a client asking for 1.)
    clock = ManualClock()
    async with gateway_with(clock=clock) as gw:
        assert await outcome(gw) == "miss"
        clock.advance(100)
        assert await outcome(gw, **{"Cache-Control": "max-age = 1"}) == "miss"


async def test_max_age_0_is_never_served_from_the_exact_cache(gw, fake):
    assert await outcome(gw) == "miss"
    assert await outcome(gw, **{"Cache-Control": "max-age=0"}) == "miss"
    assert await outcome(gw) == "hit"  # (its answer stored: max-age only bounds what it reads)
    assert fake.count() == 2


@pytest.mark.parametrize(
    "value", ["NO-CACHE", "No-Cache", "private, no-cache", "no-transform,no-cache"]
)
async def test_cache_control_is_read_in_any_case_and_as_a_list(gw, fake, value):
    assert await outcome(gw) == "miss"
    assert await outcome(gw, **{"Cache-Control": value}) == "miss"
    assert fake.count() == 2


async def test_of_two_max_ages_the_stricter_holds(fake, gateway_with):
    # ("max-age=0, max-age=100" was served a cached answer: the later, looser one won.)
    clock = ManualClock()
    async with gateway_with(clock=clock) as gw:
        assert await outcome(gw) == "miss"
        for value in ("max-age=0, max-age=100", "max-age=100, max-age=5"):
            clock.advance(10)  # (each miss stores a fresh answer: 10 s old at the next)
            assert await outcome(gw, **{"Cache-Control": value}) == "miss"
        assert await outcome(gw, **{"Cache-Control": "max-age=100"}) == "hit"
        assert fake.count() == 3


@pytest.mark.parametrize("value", ["max-age=abc", "max-age=-1", "max-age=1_0", "max-age=+5"])
async def test_a_malformed_cache_control_is_400(gw, fake, value):
    response = await gw.chat(headers={"Cache-Control": value})
    assert response.status_code == 400 and fake.count() == 0


# --- per-type TTL -----------------------------------------------------------------------------


async def test_a_type_with_ttl_1s_expires(fake, gateway_with):
    clock = ManualClock()
    async with gateway_with(cache={"types": {"short": {"ttl": 1}}}, clock=clock) as gw:
        assert await outcome(gw, **{"x-carpool-type": "short"}) == "miss"
        assert await outcome(gw, **{"x-carpool-type": "short"}) == "hit"
        clock.advance(0.9)
        assert await outcome(gw, **{"x-carpool-type": "short"}) == "hit"  # not yet
        clock.advance(0.2)  # the scenario: past its ttl
        assert await outcome(gw, **{"x-carpool-type": "short"}) == "miss"


async def test_factual_is_never_stored_but_coalesced_in_flight_and_within_the_window(gw, fake):
    factual = {"x-carpool-type": "factual"}
    fake.gate = asyncio.Event()
    first = asyncio.create_task(gw.chat(headers=factual))
    await fake.wait_for_calls(1)
    second = asyncio.create_task(gw.chat(headers=factual))
    await eventually(lambda: clients_on_flights(gw) == 2)
    fake.gate.set()
    assert [r.headers["x-carpool"] for r in await asyncio.gather(first, second)] == [
        "miss",
        "coalesced",
    ]
    assert await outcome(gw, **factual) == "coalesced"  # within the 1 s window
    assert gw.gateway.store.entries == 0 and fake.count() == 1


async def test_an_answer_expired_within_the_window_is_coalesced_not_called_again(
    fake, gateway_with
):
    """A type whose ttl is shorter than the coalescing window: its stored answer is a hit
    until it expires; then, within the window, a repeat joins the finished flight
    (``coalesced``: its answer is not in the cache), as with ttl 0. One upstream call."""
    clock, short = ManualClock(), {"x-carpool-type": "short"}
    async with gateway_with(
        cache={"types": {"short": {"ttl": 0.2}}},
        coalesce={"window_ms": 1000, "adaptive": False},
        clock=clock,
    ) as gw:
        assert await outcome(gw, **short) == "miss"
        assert await outcome(gw, **short) == "hit"
        clock.advance(0.4)  # past the ttl, within the window
        assert await outcome(gw, **short) == "coalesced" and fake.count() == 1
        clock.advance(1.0)  # past the window
        assert await outcome(gw, **short) == "miss" and fake.count() == 2


async def test_an_answer_evicted_within_the_window_is_coalesced_not_called_again(
    fake, gateway_with
):
    """A cache whose budget holds one answer: the second answer's put evicts the first, and a
    repeat of the first within the window joins its finished flight (``coalesced``)."""
    window = {"window_ms": 10_000, "adaptive": False}
    async with gateway_with(coalesce=window) as gw:
        assert await outcome(gw, "question A") == "miss"
        one = gw.gateway.store.bytes
    fake.reset()
    async with gateway_with(cache={"max_bytes": one * 3 // 2}, coalesce=window) as gw:
        assert await outcome(gw, "question A") == "miss"
        assert await outcome(gw, "question B") == "miss"
        assert gw.gateway.store.evictions == 1 and gw.gateway.store.entries == 1
        assert await outcome(gw, "question A") == "coalesced"
        assert fake.count() == 2


async def test_window_ms_0_lingers_no_answer_however_often_a_key_repeats(fake, gateway_with):
    """``coalesce.window_ms: 0`` is no window, the adaptive one (on by default) included: once a
    key has repeated enough for its own window, its finished answers still do not linger."""
    clock = ManualClock()
    async with gateway_with(coalesce={"window_ms": 0}, clock=clock) as gw:
        for _ in range(8):
            assert await outcome(gw, **{"x-carpool-type": "factual"}) == "miss"
            clock.advance(0.02)
        assert fake.count() == 8


async def test_factual_after_the_window_calls_upstream_again(fake, gateway_with):
    clock = ManualClock()
    async with gateway_with(coalesce={"window_ms": 50}, clock=clock) as gw:
        assert await outcome(gw, **{"x-carpool-type": "factual"}) == "miss"
        assert await outcome(gw, **{"x-carpool-type": "factual"}) == "coalesced"  # within it
        clock.advance(0.05)  # the window closes
        assert await outcome(gw, **{"x-carpool-type": "factual"}) == "miss"


# --- freshness tokens -------------------------------------------------------------------------


async def test_an_answer_stored_under_one_freshness_token_is_never_served_under_another(gw, fake):
    assert await outcome(gw, **{"x-carpool-freshness": "faq-2026-11-01"}) == "miss"
    assert await outcome(gw, **{"x-carpool-freshness": "faq-2026-11-01"}) == "hit"
    assert await outcome(gw, **{"x-carpool-freshness": "faq-2026-11-29"}) == "miss"
    assert await outcome(gw) == "miss"  # no token is another token too


async def test_different_freshness_tokens_do_not_coalesce(gw, fake):
    fake.gate = asyncio.Event()
    a = asyncio.create_task(gw.chat(headers={"x-carpool-freshness": "v1"}))
    b = asyncio.create_task(gw.chat(headers={"x-carpool-freshness": "v2"}))
    await fake.wait_for_calls(2)
    fake.gate.set()
    await asyncio.gather(a, b)
    assert fake.count() == 2


# --- tags and invalidation --------------------------------------------------------------------

ADMIN = {"Authorization": "Bearer s3cret"}


async def test_invalidation_by_tag_makes_the_next_request_a_miss(fake, gateway_with):
    async with gateway_with(admin_token="s3cret") as gw:
        assert await outcome(gw, "q1", **{"x-carpool-tags": "faq, pricing"}) == "miss"
        assert await outcome(gw, "q2", **{"x-carpool-tags": "other"}) == "miss"
        response = await gw.client.post("/admin/invalidate", json={"tag": "pricing"}, headers=ADMIN)
        assert response.status_code == 200 and response.json() == {"invalidated": 1}
        assert await outcome(gw, "q1", **{"x-carpool-tags": "faq, pricing"}) == "miss"
        assert await outcome(gw, "q2", **{"x-carpool-tags": "other"}) == "hit"


async def test_an_answer_served_under_a_tag_is_dropped_by_invalidating_that_tag(fake, gateway_with):
    # Tags were the storing request's alone: a request tagged "prices" read (or joined) the
    # answer stored under "catalog", and invalidating "prices" dropped nothing (0) while it
    # kept being served. Tags are in the key: each tag set has its own answer.
    async with gateway_with(admin_token="s3cret") as gw:
        assert await outcome(gw, "q", **{"x-carpool-tags": "catalog"}) == "miss"
        assert await outcome(gw, "q", **{"x-carpool-tags": "prices"}) == "miss"
        assert await outcome(gw, "q", **{"x-carpool-tags": "prices"}) == "hit"
        assert await outcome(gw, "q", **{"x-carpool-tags": "catalog"}) == "hit"
        assert await outcome(gw, "q", **{"x-carpool-tags": "prices, catalog"}) == "miss"
        assert await outcome(gw, "q", **{"x-carpool-tags": "catalog, prices"}) == "hit"
        response = await gw.client.post("/admin/invalidate", json={"tag": "prices"}, headers=ADMIN)
        assert response.json() == {"invalidated": 2}
        assert await outcome(gw, "q", **{"x-carpool-tags": "prices"}) == "miss"
        assert await outcome(gw, "q", **{"x-carpool-tags": "catalog"}) == "hit"
        assert fake.count() == 4


async def test_callers_tagged_otherwise_never_join_one_call(fake, gateway_with):
    async with gateway_with() as gw:
        fake.gate = asyncio.Event()
        a = asyncio.create_task(gw.chat(headers={"x-carpool-tags": "catalog"}))
        b = asyncio.create_task(gw.chat(headers={"x-carpool-tags": "prices"}))
        await fake.wait_for_calls(2)
        fake.gate.set()
        await asyncio.gather(a, b)
    assert fake.count() == 2


CHAT = "/v1/chat/completions"


def chat_of(content: str) -> dict:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}


async def raw_outcome(served, content: str, **headers: bytes) -> str:
    """The outcome of a chat whose header values are sent as these bytes (what curl or Go's
    net/http send for a UTF-8 string; httpx refuses non-ASCII values)."""
    response = await raw_post(served.url, CHAT, headers, orjson.dumps(chat_of(content)))
    assert response.status_code == 200, response.text
    return response.headers["x-carpool"]


@pytest.mark.parametrize("charset", ["utf-8", "latin-1"])
async def test_a_tag_or_namespace_sent_as_utf8_or_latin1_is_invalidated_by_the_name_an_operator_types(
    fake, gateway_with, charset
):
    # Read as latin-1, a UTF-8 "prix-été" was kept as "prix-Ã©tÃ©": the admin, naming it in
    # JSON, dropped nothing, and the answer was served on. Python's requests and urllib send
    # latin-1: the same name (it was refused as no UTF-8 for a while).
    tagged = {"x-carpool-tags": "prix-été, faq".encode(charset)}
    spaced = {"x-carpool-namespace": "café".encode(charset)}
    async with gateway_with(admin_token="s3cret") as gw:
        post = lambda body: gw.client.post("/admin/invalidate", json=body, headers=ADMIN)  # noqa
        assert await raw_outcome(gw, "q1", **tagged) == "miss"
        assert await raw_outcome(gw, "q2", **spaced) == "miss"
        assert (await post({"tag": "prix-été"})).json() == {"invalidated": 1}
        assert (await post({"namespace": "café"})).json() == {"invalidated": 1}
        assert await raw_outcome(gw, "q1", **tagged) == "miss"
        assert await raw_outcome(gw, "q2", **spaced) == "miss"
        assert fake.count() == 4


async def test_a_request_type_sent_as_utf8_takes_the_ttl_configured_for_it(fake, gateway_with):
    # Read as latin-1, "prévision" was no configured type: the default TTL stored its answer.
    types = {"types": {"prévision": {"ttl": 0}}}
    async with gateway_with(cache=types, coalesce={"window_ms": 0}) as gw:
        for _ in range(2):
            assert await raw_outcome(gw, "q", **{"x-carpool-type": "prévision".encode()}) == "miss"
        assert gw.gateway.store.entries == 0 and fake.count() == 2


async def test_control_headers_sent_as_utf8_over_http_are_the_text_the_library_sends(gw, fake):
    # One answer for one name, however it arrives: the library takes text, HTTP carries bytes.
    named = {"x-carpool-namespace": "café", "x-carpool-tags": "été", "x-carpool-freshness": "v-ü"}
    sent = {name: value.encode() for name, value in named.items()}
    assert await raw_outcome(gw, "q", **sent) == "miss"
    reply = await gw.gateway.request(CHAT, chat_of("q"), named)
    assert reply.status == 200 and dict(reply.headers)[b"x-carpool"] == b"hit"
    assert await raw_outcome(gw, "q", **sent) == "hit" and fake.count() == 1
    # The same names in latin-1 (Python's requests, urllib): the same answer.
    latin1 = {name: value.encode("latin-1") for name, value in named.items()}
    assert await raw_outcome(gw, "q", **latin1) == "hit" and fake.count() == 1


async def test_invalidation_by_namespace_prefix_and_all(fake, gateway_with):
    async with gateway_with(admin_token="s3cret") as gw:
        await gw.chat("How do I reset it?", headers={"x-carpool-namespace": "docs"})
        await gw.chat("How do I pay?")
        await gw.chat("What is new?")
        post = lambda body: gw.client.post("/admin/invalidate", json=body, headers=ADMIN)  # noqa
        assert (await post({"namespace": "docs"})).json() == {"invalidated": 1}
        assert (await post({"prefix": "How do"})).json() == {"invalidated": 1}
        assert (await post({"all": True})).json() == {"invalidated": 1}
        assert gw.gateway.store.entries == 0


# The coalescing window is held open by a clock that does not move: what lingers, lingers.
HELD_WINDOW = {"window_ms": 1000, "adaptive": False}


async def test_an_answer_only_the_coalescing_window_holds_is_counted_when_invalidated(
    fake, gateway_with
):
    # factual (ttl 0): its answer lives in the window alone. The invalidation dropped it (the
    # next request was a miss) but answered {"invalidated": 0}.
    factual = {"x-carpool-type": "factual", "x-carpool-tags": "t"}
    async with gateway_with(admin_token="s3cret", coalesce=HELD_WINDOW, clock=ManualClock()) as gw:
        assert await outcome(gw, **factual) == "miss"
        assert await outcome(gw, **factual) == "coalesced"
        dropped = await gw.client.post("/admin/invalidate", json={"tag": "t"}, headers=ADMIN)
        assert dropped.json() == {"invalidated": 1}
        assert await outcome(gw, **factual) == "miss" and fake.count() == 2


@pytest.mark.parametrize(
    "selector, named, other",
    [
        ({"tag": "t"}, {"x-carpool-tags": "t"}, {"x-carpool-tags": "u"}),
        ({"namespace": "ns"}, {"x-carpool-namespace": "ns"}, {"x-carpool-namespace": "other"}),
        ({"prefix": "How do"}, {}, {}),  # (the prompts tell them apart: "How do I..." / "Why...")
    ],
    ids=["tag", "namespace", "prefix"],
)
async def test_an_invalidation_drops_only_the_lingering_answers_it_names(
    fake, gateway_with, selector, named, other
):
    # Lingering answers kept no tag, namespace nor prompt: every one went, whatever was named.
    factual = {"x-carpool-type": "factual"}
    async with gateway_with(admin_token="s3cret", coalesce=HELD_WINDOW, clock=ManualClock()) as gw:
        assert await outcome(gw, "How do I pay?", **factual, **named) == "miss"
        assert await outcome(gw, "Why pay?", **factual, **other) == "miss"
        dropped = await gw.client.post("/admin/invalidate", json=selector, headers=ADMIN)
        assert dropped.json() == {"invalidated": 1}
        assert await outcome(gw, "Why pay?", **factual, **other) == "coalesced"
        assert await outcome(gw, "How do I pay?", **factual, **named) == "miss"
        assert fake.count() == 3


async def test_an_answer_both_stored_and_lingering_counts_once_when_invalidated(fake, gateway_with):
    # One copy a cache layer: the window's copy of an answer the exact cache keeps is the same
    # answer for the same requests (else the count would say whether the window was still open).
    async with gateway_with(admin_token="s3cret", coalesce=HELD_WINDOW, clock=ManualClock()) as gw:
        assert await outcome(gw, **{"x-carpool-tags": "t"}) == "miss"
        assert len(gw.gateway.flights) == 1  # (lingering)
        dropped = await gw.client.post("/admin/invalidate", json={"tag": "t"}, headers=ADMIN)
        assert dropped.json() == {"invalidated": 1}
        assert await outcome(gw, **{"x-carpool-tags": "t"}) == "miss" and fake.count() == 2


async def test_with_collapsed_white_space_a_prefix_drops_every_prompt_the_answer_was_served_to(
    fake, gateway_with
):
    # The entry kept its first prompt as sent ("Translate:  hello   world"); the prefix of the
    # prompt it was also served to ("Translate: hello") dropped nothing, and it was served on.
    async with gateway_with(admin_token="s3cret", fingerprint={"normalize_whitespace": True}) as gw:
        post = lambda body: gw.client.post("/admin/invalidate", json=body, headers=ADMIN)  # noqa
        # Named as either client wrote it: one entry, dropped.
        for prefix in ("Translate: hello", "  Translate:  hello"):
            assert await outcome(gw, "  Translate:  hello   world") == "miss"
            assert await outcome(gw, "Translate: hello world") == "hit"
            assert (await post({"prefix": prefix})).json() == {"invalidated": 1}, prefix
            assert await outcome(gw, "Translate: hello world") == "miss"
            assert (await post({"all": True})).json() == {"invalidated": 1}


LONG_SYSTEM = "You are a careful assistant. " * 60  # 1,680 characters


@pytest.mark.parametrize(
    ("path", "body", "prefix"),
    [
        (  # content as parts: the SDKs send either for the same text
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Translate: cat"}]}
                ]
            },
            "Translate",
        ),
        ("/v1/embeddings", {"input": ["Translate this", "Translate that"]}, "Translate"),
        ("/v1/completions", {"prompt": ["Translate this", "and that"]}, "Translate"),
        (  # a prefix longer than the start an entry keeps (1,024 characters)
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": "Translate: cat"},
                ]
            },
            LONG_SYSTEM + " Translate",
        ),
        (  # asked in NFD, dropped by its NFC form (one answer: the fingerprint is NFC)
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Cafe\u0301 menu"}]},
            "Caf\u00e9",
        ),
    ],
)
async def test_a_prefix_drops_every_answer_whose_prompt_starts_with_it(
    fake, gateway_with, path, body, prefix
):
    async with gateway_with(admin_token="s3cret") as gw:
        request = {"model": "m", "temperature": 0, **body}
        assert (await gw.client.post(path, json=request)).headers["x-carpool"] == "miss"
        dropped = await gw.client.post("/admin/invalidate", json={"prefix": prefix}, headers=ADMIN)
        assert dropped.json() == {"invalidated": 1}
        assert (await gw.client.post(path, json=request)).headers["x-carpool"] == "miss"


@pytest.mark.parametrize(
    "text",
    [
        "Cafe\u0301 " * 2_000_000,  # 14 MB of NFD: normalized whole, ~80 ms on the event loop
        "x" * 1023 + "e\u0301" * 3,  # a composition across the 1,024th character
        "Å" * 5000,
    ],
)
def test_the_prompt_start_kept_is_the_nfc_of_the_prompt_cut_to_1024_characters(text):
    import unicodedata

    from carpool.store.base import PROMPT_PREFIX_CHARS, prompt_text

    assert prompt_text(text) == unicodedata.normalize("NFC", text)[:PROMPT_PREFIX_CHARS]


async def test_admin_requires_the_token_and_is_disabled_without_one(fake, gateway_with):
    async with gateway_with(admin_token="s3cret") as gw:
        wrong = await gw.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        bad = await gw.client.post("/admin/invalidate", json={"colour": "red"}, headers=ADMIN)
        assert bad.status_code == 400
        # A body of null is JSON, not a client that left (it was a 499 with no body: the fuzz).
        null = await gw.client.post("/admin/invalidate", content=b"null", headers=ADMIN)
        assert null.status_code == 400 and null.json()["error"]["message"]
    async with gateway_with() as gw:
        assert (
            await gw.client.post("/admin/invalidate", json={"all": True}, headers=ADMIN)
        ).status_code == 404


async def test_admin_401_carries_a_bearer_challenge(fake, gateway_with):
    # The /admin/* 401 named no scheme (RFC 9110 §15.5.2: a 401 MUST carry WWW-Authenticate),
    # where /stats, /metrics and /dashboard's do. Bearer only: only it is accepted there.
    async with gateway_with(admin_token="s3cret") as gw:
        for method, path, headers in (
            ("POST", "/admin/invalidate", {}),
            ("POST", "/admin/invalidate", {"Authorization": "Bearer nope"}),
            ("GET", "/admin/semantic/audit", {}),
            ("DELETE", "/admin/nope", {}),  # (any other path or method: the same refusal)
        ):
            refused = await gw.client.request(method, path, headers=headers, json={"all": True})
            assert refused.status_code == 401, (method, path)
            assert refused.headers.get_list("www-authenticate") == ['Bearer realm="carpool admin"']
            assert refused.json()["error"]["code"] == "unauthorized"


async def test_every_admin_path_and_method_answers_in_openais_error_shape(fake, gateway_with):
    # Starlette answered a wrong method 405 and an unknown /admin path 404 in plain text, and
    # without a token a GET of an existing path said 405 where every admin path is 404.
    async with gateway_with() as gw:
        for method, path in (("GET", "/admin/invalidate"), ("POST", "/admin/nope")):
            response = await gw.client.request(method, path, headers=ADMIN)
            assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    async with gateway_with(admin_token="s3cret") as gw:
        anonymous = await gw.client.get("/admin/invalidate")
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "unauthorized"
        wrong_method = await gw.client.get("/admin/invalidate", headers=ADMIN)
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        assert wrong_method.json()["error"]["code"] == "method_not_allowed"
        unknown = await gw.client.post("/admin/nope", headers=ADMIN, json={})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


async def test_every_path_and_method_no_route_serves_answers_in_openais_error_shape(gw, fake):
    # Starlette answered them in plain text, and ``POST /v1`` with a redirect to ``/v1/`` built
    # from the client's own ``Host`` header (``Host: evil.example`` came back in ``Location``).
    for method, path in (
        ("GET", "/"),
        ("GET", "/nonexistent"),
        ("POST", "/v1"),
        ("GET", "/healthz/"),
    ):
        response = await gw.client.request(method, path, headers={"host": "evil.example"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
        assert "location" not in response.headers
        assert response.json()["error"]["param"] is None  # (OpenAI's shape: the SDKs read it)
    for path in ("/healthz", "/stats"):
        response = await gw.client.post(path, json={})
        assert (
            response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
        )
        assert "GET" in response.headers["allow"]
    assert fake.count() == 0


# --- tenants and namespaces -------------------------------------------------------------------


async def test_two_tenants_asking_the_same_question_at_the_same_moment_cause_two_calls(gw, fake):
    fake.gate = asyncio.Event()
    a = asyncio.create_task(gw.chat(headers={"Authorization": "Bearer tenant-a"}))
    b = asyncio.create_task(gw.chat(headers={"Authorization": "Bearer tenant-b"}))
    await fake.wait_for_calls(2)
    fake.gate.set()
    responses = await asyncio.gather(a, b)
    assert [r.headers["x-carpool"] for r in responses] == ["miss", "miss"]
    assert await outcome(gw, **{"Authorization": "Bearer tenant-a"}) == "hit"
    assert fake.count() == 2


async def test_a_configured_shared_namespace_is_shared_across_tenants(fake, gateway_with):
    async with gateway_with(tenant={"shared_namespaces": ["public-faq"]}) as gw:
        shared = {"x-carpool-namespace": "public-faq"}
        assert await outcome(gw, **{"Authorization": "Bearer a", **shared}) == "miss"
        # b reads the shared namespace once the upstream has accepted its key.
        assert (
            await outcome(gw, **{"Authorization": "Bearer b", "x-carpool-namespace": "own"})
            == "miss"
        )
        assert await outcome(gw, **{"Authorization": "Bearer b", **shared}) == "hit"
        assert (
            await outcome(gw, **{"Authorization": "Bearer b", "x-carpool-namespace": "x"}) == "miss"
        )


async def test_namespaces_are_separate_partitions(gw, fake):
    assert await outcome(gw, **{"x-carpool-namespace": "a"}) == "miss"
    assert await outcome(gw, **{"x-carpool-namespace": "b"}) == "miss"
    assert await outcome(gw, **{"x-carpool-namespace": "a"}) == "hit"


async def test_a_configured_tenant_header_separates_tenants(fake, gateway_with):
    async with gateway_with(tenant={"header": "X-Team"}) as gw:
        assert await outcome(gw, **{"X-Team": "red"}) == "miss"
        assert await outcome(gw, **{"X-Team": "blue"}) == "miss"
        assert await outcome(gw, **{"X-Team": "red"}) == "hit"
        # Authorization is still a credential beside it: another key is another tenant.
        assert await outcome(gw, **{"X-Team": "red", "Authorization": "Bearer other"}) == "miss"


# --- sampling policies ------------------------------------------------------------------------


async def test_x_carpool_share_sampled_shares_only_identical_parameters(gw, fake):
    opt_in = {"x-carpool-share": "sampled"}
    first = await gw.chat(temperature=0.9, headers=opt_in)
    assert first.headers["x-carpool"] == "miss"
    assert (await gw.chat(temperature=0.9, headers=opt_in)).headers["x-carpool"] == "hit"
    assert (await gw.chat(temperature=0.8, headers=opt_in)).headers["x-carpool"] == "miss"
    assert (await gw.chat(temperature=0.9)).headers["x-carpool"] == "bypass"


async def test_same_params_sampling_policy_shares_sampled_requests(fake, gateway_with):
    async with gateway_with(sampling="same-params") as gw:
        assert (await gw.chat(temperature=0.9)).headers["x-carpool"] == "miss"
        assert (await gw.chat(temperature=0.9)).headers["x-carpool"] == "hit"


async def _default_namespace_dropped(gw) -> None:
    await gw.chat("How do I reset it?", headers={"x-carpool-namespace": "docs"})
    await gw.chat("How do I pay?")
    response = await gw.client.post("/admin/invalidate", json={"namespace": ""}, headers=ADMIN)
    assert response.status_code == 200 and response.json()["invalidated"] >= 1
    assert await outcome(gw, "How do I pay?") == "miss"
    assert await outcome(gw, "How do I reset it?", **{"x-carpool-namespace": "docs"}) == "hit"


async def test_the_default_namespace_is_invalidated_by_its_empty_name(fake, gateway_with):
    # {"namespace": ""} was refused: the default namespace, where most answers live, could be
    # dropped only with everything else.
    async with gateway_with(admin_token="s3cret") as gw:
        await _default_namespace_dropped(gw)


async def test_the_default_namespace_is_invalidated_by_its_empty_name_in_redis(
    fake, gateway_with, shared_redis
):
    pytest.importorskip("redis")
    async with gateway_with(admin_token="s3cret", **redis_settings(shared_redis)) as gw:
        await _default_namespace_dropped(gw)
