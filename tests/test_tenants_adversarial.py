"""Security (issue #8, part 4): tenants never see each other's answers, secrets never leak.

The fake upstream answers every call with the credential it was sent (``for Bearer tenant-7``),
so an answer that crossed tenants, through any layer, would be visible in its text:
- the exact cache, coalescing in flight, the semantic cache and idempotency keys, on one instance
  and on two instances sharing a real Valkey;
- the admin token comparison refuses every wrong token (equal length or not);
- neither a credential nor a prompt appears in the logs (DEBUG) or in a Redis key name; Redis key
  names are digests, so tags and namespaces made of glob and key syntax (``* ? [ ] { } :``, very
  long ones) cannot collide with or reach into other entries: invalidating one drops only its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import json
import logging
import re

import pytest

from carpool.errors import OTHERS_MESSAGE
from conftest import redis_keys, redis_settings, run_gateway
from fakes.waiting import eventually

TENANTS = 20
PROMPTS = ["What is carpool?", "How do I reset my router?", "Summarise the refund policy."]
ADMIN = "admin-token-0123456789"


def bearer(i: int) -> dict[str, str]:
    return {"Authorization": f"Bearer tenant-{i:02d}"}


def answer_of(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture
def tagged(fake):
    """The fake answers with the credential of the call (and the call number, unique)."""
    fake.answer_text = lambda n, body: (
        f"for {fake.calls[n - 1].headers.get('authorization', 'nobody')} call {n}"
    )
    return fake


def assert_own(response, i: int) -> None:
    assert answer_of(response).startswith(f"for Bearer tenant-{i:02d} call "), answer_of(response)


# --- one instance: exact cache and coalescing ------------------------------------------------------


async def test_twenty_tenants_sending_the_same_prompts_at_once_never_share_a_flight_or_an_answer(
    tagged, gw
):
    fake = tagged
    fake.gate = asyncio.Event()  # every call held: the duplicates must join
    requests = [(i, p) for i in range(TENANTS) for p in PROMPTS for _ in range(2)]
    pending = [asyncio.create_task(gw.chat(p, headers=bearer(i))) for i, p in requests]
    await fake.wait_for_calls(TENANTS * len(PROMPTS))
    await eventually(
        lambda: gw.gateway.flights.waiters == len(requests),
        what="every request waiting on its flight",
    )
    fake.gate.set()
    responses = await asyncio.gather(*pending)
    assert fake.count() == TENANTS * len(PROMPTS)  # one call per tenant and prompt
    for (i, _), response in zip(requests, responses, strict=True):
        assert_own(response, i)
    outcomes = collections.Counter(r.headers["x-carpool"] for r in responses)
    assert outcomes == {"miss": TENANTS * len(PROMPTS), "coalesced": TENANTS * len(PROMPTS)}

    # Sequentially, from the exact cache: every tenant its own answer, nobody else's.
    for i in range(TENANTS):
        for prompt in PROMPTS:
            again = await gw.chat(prompt, headers=bearer(i))
            assert again.headers["x-carpool"] == "hit"
            assert_own(again, i)
    # Anonymous is a tenant of its own, too.
    assert answer_of(await gw.chat(PROMPTS[0])).startswith("for nobody")
    assert fake.count() == TENANTS * len(PROMPTS) + 1


async def test_a_tenant_header_other_than_authorization_scopes_just_as_well(tagged, gateway_with):
    async with gateway_with(tenant={"header": "X-Team"}) as gw:
        for team in ("a", "b", "a*", "a?", "[a]", "{a}", "a:b"):
            response = await gw.chat(headers={"X-Team": team, "Authorization": "Bearer same"})
            assert response.headers["x-carpool"] == "miss", team
        again = await gw.chat(headers={"X-Team": "a*", "Authorization": "Bearer same"})
        assert again.headers["x-carpool"] == "hit"


async def test_an_empty_credential_header_is_another_tenant(tagged, gateway_with):
    # The upstream gets the empty header too (and may refuse it): such a request never reads
    # what the same key without it was answered.
    async with gateway_with() as gw:
        assert (await gw.chat(PROMPTS[0], headers=bearer(0))).headers["x-carpool"] == "miss"
        for empty in ("OpenAI-Organization", "api-key", "x-api-key"):
            again = await gw.chat(PROMPTS[0], headers={**bearer(0), empty: ""})
            assert again.headers["x-carpool"] == "miss", empty
        assert tagged.count() == 4


async def test_a_neutral_header_never_lets_one_tenant_read_anothers_answer(tagged, gateway_with):
    # Neutral headers only do not split the cache: the tenant is the credential headers.
    neutral = {"neutral_headers": ["x-edge-request"]}
    async with gateway_with(fingerprint=neutral) as gw:
        for i in range(3):
            same = {**bearer(i), "X-Edge-Request": "one", "Fly-Request-Id": "one"}
            assert_own(await gw.chat(PROMPTS[0], headers=same), i)
        for i in range(3):
            other = {**bearer(i), "X-Edge-Request": f"r{i}", "Fly-Request-Id": f"r{i}"}
            again = await gw.chat(PROMPTS[0], headers=other)
            assert again.headers["x-carpool"] == "hit"
            assert_own(again, i)
        assert tagged.count() == 3


async def test_in_a_shared_namespace_acceptance_leaves_out_the_neutral_headers(
    tagged, gateway_with
):
    # What the upstream accepted a tenant for (its grant) leaves them out as the key does: a
    # request id new each time kept an accepted tenant from ever reading a shared namespace.
    async with gateway_with(
        tenant={"shared_namespaces": ["docs"]}, fingerprint={"neutral_headers": ["x-edge-request"]}
    ) as gw:
        shared = {"x-carpool-namespace": "docs"}
        await gw.chat("warm up", headers={**bearer(0), "X-Edge-Request": "w", "Rndr-Id": "w"})
        computed = await gw.chat(PROMPTS[0], headers={**bearer(1), **shared, "Rndr-Id": "a"})
        read = await gw.chat(
            PROMPTS[0], headers={**bearer(0), **shared, "X-Edge-Request": "b", "Rndr-Id": "b"}
        )
        assert read.headers["x-carpool"] == "hit" and answer_of(read) == answer_of(computed)
        assert tagged.count() == 2


# --- one instance: the semantic cache ------------------------------------------------------------


async def test_no_semantic_hit_ever_crosses_tenants(tagged, gateway_with):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("usearch")
    fake = tagged
    async with gateway_with(semantic={"enabled": True}) as gw:
        for i in range(TENANTS):
            assert_own(await gw.chat("How do I reset my router?", headers=bearer(i)), i)
        await eventually(
            lambda: gw.gateway.semantic.entries >= TENANTS,
            timeout=10,
            what="every tenant's semantic entry",
        )
        paraphrases = await asyncio.gather(
            *(gw.chat("how can i reset my router", headers=bearer(i)) for i in range(TENANTS))
        )
        for i, response in enumerate(paraphrases):
            # Each tenant's paraphrase is served from its own entry (the layer is on), never
            # from another tenant's.
            assert response.headers["x-carpool"] == "semantic-hit", response.headers
            assert_own(response, i)
        # A tenant with no entry of its own gets no semantic hit from 20 others' entries.
        stranger = await gw.chat("how can i reset my router", headers=bearer(99))
        assert stranger.headers["x-carpool"] == "miss"
        assert_own(stranger, 99)
        assert fake.count() == TENANTS + 1


# --- one instance: idempotency keys ----------------------------------------------------------------


async def test_the_same_idempotency_key_in_twenty_tenants_never_replays_another_tenants_answer(
    tagged, gw
):
    fake = tagged
    key = {"Idempotency-Key": '"order-1"'}
    # Sampled requests: no cache layer shares them, only the idempotency record could.
    first = await asyncio.gather(
        *(
            gw.chat("Write a haiku.", temperature=0.9, headers={**bearer(i), **key})
            for i in range(TENANTS)
        )
    )
    for i, response in enumerate(first):
        assert "idempotent-replayed" not in response.headers
        assert_own(response, i)
    retried = await asyncio.gather(
        *(
            gw.chat("Write a haiku.", temperature=0.9, headers={**bearer(i), **key})
            for i in range(TENANTS)
        )
    )
    for i, (response, original) in enumerate(zip(retried, first, strict=True)):
        assert response.headers["idempotent-replayed"] == "true"
        assert response.content == original.content
        assert_own(response, i)
    # Another tenant's use of a key never makes it a mismatch (422) or a conflict (409) here.
    other = await gw.chat("Something else entirely", headers={**bearer(99), **key})
    assert other.status_code == 200 and "idempotent-replayed" not in other.headers
    assert fake.count() == TENANTS + 1


async def test_idempotency_keys_stay_scoped_by_tenant_even_in_a_shared_namespace(
    tagged, gateway_with
):
    """A shared namespace shares *cached* answers across tenants, by the config's choice; an
    idempotency record is a tenant's own retry state: another tenant sending the same key there
    must neither replay it (a sampled answer no cache would share) nor be refused with 422/409."""
    fake = tagged
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        shared = {"x-carpool-namespace": "docs", "Idempotency-Key": "k"}
        a = await gw.chat("Write a haiku.", temperature=0.9, headers={**bearer(1), **shared})
        assert_own(a, 1)
        b = await gw.chat("Write a haiku.", temperature=0.9, headers={**bearer(2), **shared})
        assert "idempotent-replayed" not in b.headers
        assert_own(b, 2)
        c = await gw.chat("Another question", temperature=0.9, headers={**bearer(3), **shared})
        assert c.status_code == 200
        assert_own(c, 3)
        # Deterministic answers in the shared namespace are still shared, as configured.
        d1 = await gw.chat("Shared FAQ", headers={**bearer(1), "x-carpool-namespace": "docs"})
        d2 = await gw.chat("Shared FAQ", headers={**bearer(2), "x-carpool-namespace": "docs"})
        assert d2.headers["x-carpool"] == "hit" and d2.content == d1.content
        assert fake.count() == 4


async def test_a_keyed_retry_in_a_shared_namespace_is_replayed_after_its_tenant_was_accepted(
    tagged, gateway_with
):
    """A tenant's first answer in a shared namespace accepts it (its requests read the shared
    scope from then on): its retry with the same key is the same request, replayed, not a 422
    for a digest taken in the other scope."""
    fake = tagged
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        shared = {**bearer(1), "x-carpool-namespace": "docs", "Idempotency-Key": "k"}
        first = await gw.chat("Shared FAQ", headers=shared)
        assert first.status_code == 200 and "idempotent-replayed" not in first.headers
        retry = await gw.chat("Shared FAQ", headers=shared)
        assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
        assert retry.content == first.content and fake.count() == 1


# --- several instances sharing Valkey ------------------------------------------------------------


@contextlib.asynccontextmanager
async def two_instances(fake, redis_server, **config):
    # (Timeouts generous: a call on loaded cores, pytest -n, took over 2 s, and the instance
    # served that request from its own memory. Where Valkey is killed, connections are refused
    # at once.)
    shared = {
        **redis_settings(redis_server, retry_interval=0.05, timeout=10.0, connect_timeout=10.0),
        "admin_token": ADMIN,
        **config,
    }
    async with run_gateway([fake.url], **shared) as a, run_gateway([fake.url], **shared) as b:
        yield a, b


async def scan_keys(redis_server) -> list[bytes]:
    return await redis_keys(redis_server)


# What carpool's key names may be: the prefix, a family, and digests (hex) only.
KEY_NAME = re.compile(
    rb"carpool:(e:\{[0-9a-f]{32,40}\}|tag:[0-9a-f]{32}|ns:[0-9a-f]{32}|prefixes|semantic"
    rb"|\{stats\}:(live|size|bytes)|idem:\{[0-9a-f]{40}\}|lock:\{[0-9a-f]{32,40}\}"
    rb"|(flight|followed):\{[0-9a-f]{32,40}\}:[0-9a-f]+)"
)


async def test_tenants_on_two_instances_sharing_valkey_never_share_answers_or_records(
    tagged, shared_redis
):
    pytest.importorskip("redis")
    fake = tagged
    async with two_instances(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()
        # Every tenant on both instances at once, twice each: only its own copies coalesce.
        calls = [(i, side) for i in range(TENANTS) for side in (a, b, a, b)]
        pending = [
            asyncio.create_task(side.chat(PROMPTS[0], headers=bearer(i))) for i, side in calls
        ]
        await fake.wait_for_calls(TENANTS)

        def waiting() -> int:  # every request on a flight of its instance, before any answer
            return sum(f.clients for side in (a, b) for f in side.gateway.flights.running())

        await eventually(lambda: waiting() == len(calls), what="every request on a flight")
        fake.gate.set()
        responses = await asyncio.gather(*pending)
        for (i, _), response in zip(calls, responses, strict=True):
            assert_own(response, i)
        assert fake.count() == TENANTS
        # Each flight runs until its answer is stored in Valkey, after its clients have it: a
        # request before then joins it (``coalesced``), as it should.
        await eventually(
            lambda: not a.gateway.flights.running() and not b.gateway.flights.running(),
            what="every answer stored",
        )
        for i in range(TENANTS):  # from the shared exact cache, on either side
            for side in (a, b):
                again = await side.chat(PROMPTS[0], headers=bearer(i))
                assert again.headers["x-carpool"] == "hit"
                assert_own(again, i)
        # Idempotency records in Valkey: the same key from every tenant, alternating instances.
        key = {"Idempotency-Key": "retry-me"}
        for i in range(TENANTS):
            side = (a, b)[i % 2]
            response = await side.chat(
                "Write a haiku.", temperature=0.9, headers={**bearer(i), **key}
            )
            assert "idempotent-replayed" not in response.headers
            assert_own(response, i)
            replay = await (b, a)[i % 2].chat(
                "Write a haiku.", temperature=0.9, headers={**bearer(i), **key}
            )
            assert replay.headers["idempotent-replayed"] == "true"
            assert replay.content == response.content
        assert fake.count() == 2 * TENANTS

        keys = await scan_keys(shared_redis)
        assert keys and not [k for k in keys if not KEY_NAME.fullmatch(k)], keys
        for k in keys:
            assert b"tenant" not in k and b"Bearer" not in k and b"haiku" not in k.lower()


WEIRD = [
    "*",
    "?",
    "[a]",
    "{a}",
    "a:b",
    "a*",
    "*a",
    "tag:*",
    "ns:*",
    "e:{*}",
    "\\",
    "a" * 256,
    "}{",
    "[^a]",
]


async def test_invalidating_a_tag_or_namespace_made_of_glob_syntax_drops_only_its_own_entries(
    fake, shared_redis
):
    pytest.importorskip("redis")
    async with two_instances(fake, shared_redis) as (a, b):
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for n, weird in enumerate(WEIRD):
            await a.chat(f"tagged {n}", headers={"x-carpool-tags": weird})
            await a.chat(f"namespaced {n}", headers={"x-carpool-namespace": weird})
        await a.chat("plain", headers={"x-carpool-tags": "plain", "x-carpool-namespace": "p"})
        calls = fake.count()
        assert calls == 2 * len(WEIRD) + 1
        for k in await scan_keys(shared_redis):
            assert KEY_NAME.fullmatch(k), k
        # Selectors that name nothing drop nothing, however they look.
        for selector in (
            {"tag": "a\nb"},
            {"tag": "a\r\n*"},
            {"namespace": "*\n"},
            {"tag": "t" * 10_000},
            {"namespace": "%s"},
            {"prefix": "*"},
            {"prefix": "?"},
            {"prefix": "[t]"},
        ):
            dropped = await b.client.post("/admin/invalidate", json=selector, headers=admin)
            assert dropped.json() == {"invalidated": 0}, selector
        # Each weird tag and namespace drops exactly its own entry, on the other instance.
        for n, weird in enumerate(WEIRD):
            by_tag = await b.client.post("/admin/invalidate", json={"tag": weird}, headers=admin)
            assert by_tag.json() == {"invalidated": 1}, weird
            by_ns = await b.client.post(
                "/admin/invalidate", json={"namespace": weird}, headers=admin
            )
            assert by_ns.json() == {"invalidated": 1}, weird
            # (Asked on b: a's own coalescing window may still hold the answer, see below.)
            assert (await b.chat(f"tagged {n}", headers={"x-carpool-tags": weird})).headers[
                "x-carpool"
            ] == "miss"
            assert (
                await b.chat(f"namespaced {n}", headers={"x-carpool-namespace": weird})
            ).headers["x-carpool"] == "miss"
            # ...and nothing else: the next weird ones, and the plain one, are still there.
            if n + 1 < len(WEIRD):
                assert (
                    await a.chat(f"tagged {n + 1}", headers={"x-carpool-tags": WEIRD[n + 1]})
                ).headers["x-carpool"] == "hit"
                assert (
                    await a.chat(
                        f"namespaced {n + 1}", headers={"x-carpool-namespace": WEIRD[n + 1]}
                    )
                ).headers["x-carpool"] == "hit"
            assert (
                await a.chat(
                    "plain", headers={"x-carpool-tags": "plain", "x-carpool-namespace": "p"}
                )
            ).headers["x-carpool"] == "hit"


async def test_an_answer_invalidated_on_one_instance_is_not_served_from_anothers_window(
    fake, shared_redis
):
    """B's invalidation reaches A's own coalescing window through Redis pub/sub
    (``invalidation.py``); the window is long, so only the invalidation can end it."""
    pytest.importorskip("redis")
    async with two_instances(
        fake, shared_redis, coalesce={"window_ms": 60_000, "max_window_ms": 60_000}
    ) as (a, b):
        await eventually(
            lambda: a.gateway.invalidations.listening, what="instance A subscribed to invalidations"
        )
        await a.chat(headers={"x-carpool-tags": "faq"})
        assert len(a.gateway.flights) == 1  # A's answer lingers in its window
        dropped = await b.client.post(
            "/admin/invalidate", json={"tag": "faq"}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert dropped.json() == {"invalidated": 1}
        await eventually(
            lambda: invalidations_of(a)["received"] == 1, what="instance A told of the invalidation"
        )
        assert invalidations_of(a)["forgotten"] == 1 and len(a.gateway.flights) == 0
        assert invalidations_of(b)["published"] == 1 and invalidations_of(b)["received"] == 0
        stats = (await a.client.get("/stats", headers={"Authorization": f"Bearer {ADMIN}"})).json()[
            "redis"
        ]["invalidations"]
        assert stats["received"] == 1 and stats["listening"] is True
        assert (await a.chat(headers={"x-carpool-tags": "faq"})).headers["x-carpool"] == "miss"
        assert fake.count() == 2


def invalidations_of(served) -> dict:
    return served.gateway.redis_health()["invalidations"]


# --- the admin token ----------------------------------------------------------------------------


async def test_the_admin_token_refuses_every_wrong_token_equal_length_or_not(fake, gateway_with):
    async with gateway_with(admin_token=ADMIN) as gw:

        async def invalidate(authorization: str | bytes | None):
            headers = {} if authorization is None else {"Authorization": authorization}
            return await gw.client.post("/admin/invalidate", json={"all": True}, headers=headers)

        wrong_same_length = ADMIN[:-1] + ("x" if ADMIN[-1] != "x" else "y")
        assert len(wrong_same_length) == len(ADMIN)
        refused = [
            None,
            "",
            "Bearer",
            f"Bearer {wrong_same_length}",
            f"Bearer {ADMIN[:-1]}",
            f"Bearer {ADMIN}x",
            f"Bearer {ADMIN}\tx",
            f"Basic {ADMIN}",
            ADMIN,
            f"Bearer {ADMIN.upper()}",
            b"Bearer \xff\xfe" + ADMIN.encode()[2:],
        ]
        for authorization in refused:
            response = await invalidate(authorization)
            assert response.status_code == 401, authorization
            error = response.json()["error"]
            assert error["code"] == "unauthorized" and ADMIN not in response.text
        # A scheme is read in any case, and spaces may be more than one (RFC 9110 11.4).
        for given in (f"Bearer {ADMIN}", f"bearer {ADMIN}", f"BEARER {ADMIN}", f"Bearer  {ADMIN}"):
            accepted = await invalidate(given)
            assert accepted.status_code == 200 and accepted.json() == {"invalidated": 0}
    async with gateway_with() as gw:  # no token configured: admin is off
        off = await gw.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": "Bearer anything"}
        )
        assert off.status_code == 404


def test_the_admin_token_is_compared_in_constant_time():
    """A supplement to the behaviour above: the comparison is ``hmac.compare_digest``."""
    from carpool import admin_http, auth

    source = inspect.getsource(admin_http.admin_routes)  # every /admin/* route goes through it
    refusal = source[source.index("def refusal") :]
    refusal = refusal[: refusal.index("\n    async def", 1)]
    assert "presents(token, " in refusal  # (``auth.presents``: the read surfaces' check too)
    assert "hmac.compare_digest(" in inspect.getsource(auth.presents)
    assert '== f"Bearer' not in source and '!= f"Bearer' not in source


# --- secrets in logs --------------------------------------------------------------------------------

SECRET = "sk-live-Zq8vTq2rWn5pXk1m"
PROMPT = "my private question about account 4417-1234"


async def test_no_credential_or_prompt_text_in_the_logs_at_debug(fake, gateway_with, caplog):
    caplog.set_level(logging.DEBUG)
    headers = {"Authorization": f"Bearer {SECRET}"}
    async with gateway_with(admin_token=ADMIN) as gw:
        assert (await gw.chat(PROMPT, headers=headers)).status_code == 200  # miss
        assert (await gw.chat(PROMPT, headers=headers)).status_code == 200  # hit
        await gw.stream_chat(PROMPT + " streamed", headers=headers)
        await gw.chat(PROMPT, headers={**headers, "Idempotency-Key": "k"})
        await gw.chat(PROMPT + " other", headers={**headers, "Idempotency-Key": "k"})  # 422
        await gw.chat(PROMPT, headers={**headers, "x-carpool-tags": "\x01"})  # 400
        fake.fail_status, fake.fail_times = 500, 1  # upstream
        await gw.chat(PROMPT + " failing", headers=headers)
        fake.cut_after = 1  # a broken stream
        await gw.stream_chat(PROMPT + " cut", headers=headers)
        fake.cut_after = None
        await gw.client.post(
            "/admin/invalidate",
            json={"prefix": PROMPT[:10]},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        await gw.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": f"Bearer {SECRET}"}
        )  # 401
        await gw.client.get("/v1/models", headers=headers)  # pass-through
    assert caplog.records, "nothing was logged at all: the capture did not work"
    text = caplog.text
    assert SECRET not in text and ADMIN not in text
    assert PROMPT not in text and "4417-1234" not in text


async def test_no_credential_or_prompt_text_in_the_logs_with_redis(fake, killable_redis, caplog):
    pytest.importorskip("redis")
    caplog.set_level(logging.DEBUG)
    headers = {"Authorization": f"Bearer {SECRET}"}
    async with two_instances(fake, killable_redis) as (a, b):
        await a.chat(PROMPT, headers={**headers, "x-carpool-tags": "t"})
        await b.chat(PROMPT, headers=headers)
        await b.chat(PROMPT, headers={**headers, "Idempotency-Key": "k"})
        killable_redis.kill()  # degraded mode logs its errors
        await a.chat(PROMPT + " while down", headers=headers)
    # The gateway's own logs are in there (the outage warning), with the clients' and Redis's.
    assert any(r.name.startswith("carpool") for r in caplog.records)
    assert SECRET not in caplog.text and PROMPT not in caplog.text


# --- an upstream's error is its requester's ------------------------------------------------------

LEAKY = {
    "error": {
        "message": "internal error: auth=Bearer tenant-01 user=alice-42",
        "type": "server_error",
        "code": "engine_crashed",
    }
}


async def _leader_and_joiners(gw, fake, leader: dict, joiners: list[dict], status: int = 500):
    """The leader's call held at the fake until every joiner is on its flight, then failed
    (answered ``status`` with ``LEAKY``: a 200 is an error reported in a 2xx body)."""
    fake.gate = asyncio.Event()
    fake.fail_status, fake.fail_body = status, LEAKY
    first = asyncio.create_task(gw.chat("Q", **leader))
    await fake.wait_for_calls(1)
    others = [asyncio.create_task(gw.chat("Q", **joiner)) for joiner in joiners]
    await eventually(
        lambda: sum(f.clients for f in gw.gateway.flights.running()) == 1 + len(joiners),
        what="the joiners on the flight",
    )
    fake.gate.set()
    return await first, await asyncio.gather(*others)


async def test_a_joiner_with_another_body_never_gets_the_upstreams_error_text(fake, gw):
    # ``user`` is out of the key: bob joins alice's call. The upstream's error text may quote
    # alice's request (its user, its metadata, its key): bob gets its status and code only.
    leader, (twin, other) = await _leader_and_joiners(
        gw, fake, {"user": "alice-42"}, [{"user": "alice-42"}, {"user": "bob"}]
    )
    assert leader.status_code == twin.status_code == other.status_code == 500
    assert leader.json() == twin.json() == LEAKY  # its own request's error: as it came
    error = other.json()["error"]
    assert "alice" not in other.text and "tenant-01" not in other.text
    assert (error["type"], error["code"]) == ("server_error", "engine_crashed")
    assert fake.count() == 1  # still one call: sharing the failure is not given up


async def test_a_tenant_joining_another_tenants_call_in_a_shared_namespace_gets_no_error_text(
    fake, gateway_with
):
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        docs = {"x-carpool-namespace": "docs"}
        for i in (1, 2):  # both accepted by the upstream: they share the namespace's calls
            assert (await gw.chat(f"warm {i}", headers={**bearer(i), **docs})).status_code == 200
        leader, (other,) = await _leader_and_joiners(
            gw, fake, {"headers": {**bearer(1), **docs}}, [{"headers": {**bearer(2), **docs}}]
        )
        assert leader.status_code == other.status_code == 500
        assert "tenant-01" in leader.text and "tenant-01" not in other.text
        assert other.json()["error"]["code"] == "engine_crashed" and fake.count() == 3


async def test_an_instance_following_another_requesters_call_gets_no_error_text(fake, shared_redis):
    pytest.importorskip("redis")
    async with two_instances(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()
        fake.fail_status, fake.fail_body = 500, LEAKY
        first = asyncio.create_task(a.chat("Q", user="alice-42"))
        await fake.wait_for_calls(1)
        other = asyncio.create_task(b.chat("Q", user="bob"))
        await eventually(
            lambda: b.gateway.layers.shared_flights.counts["followed"] == 1,
            what="b following a's call",
        )
        fake.gate.set()
        leader, joined = await first, await other
        assert leader.json() == LEAKY and joined.status_code == 500
        assert "alice" not in joined.text and joined.json()["error"]["code"] == "engine_crashed"
        assert fake.count() == 1


# --- an error reported in a 2xx body is its requester's too --------------------------------------

SCRUBBED = {"type": "server_error", "code": "engine_crashed"}


def sse_error(text: str) -> dict:
    """The error object of the error event ending an SSE text."""
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return json.loads(events[-1])["error"]


async def test_a_joiner_with_another_body_never_gets_the_error_text_of_a_2xx_body(fake, gw):
    # Some servers and proxies report an error with a 200: the body is the leader's failure as
    # much as a 500's, and may quote its request as well. A joiner of another request (``user``
    # is out of the key) gets the same shape with its type and code, not its words, whether it
    # asked JSON or a stream.
    leader, (twin, other, streamed) = await _leader_and_joiners(
        gw,
        fake,
        {"user": "alice-42"},
        [{"user": "alice-42"}, {"user": "bob"}, {"user": "bob", "stream": True}],
        status=200,
    )
    assert leader.json() == twin.json() == LEAKY  # its own request's error: as it came
    assert other.status_code == streamed.status_code == 200
    for response in (other, streamed):
        assert response.headers["x-carpool"] == "coalesced"
        assert "alice" not in response.text and "tenant-01" not in response.text
    error = other.json()["error"]
    assert {k: error[k] for k in SCRUBBED} == SCRUBBED and error["message"] == OTHERS_MESSAGE
    assert {k: sse_error(streamed.text)[k] for k in SCRUBBED} == SCRUBBED
    assert "[DONE]" not in streamed.text  # a failure, not a stream that ended well
    assert fake.count() == 1  # still one call: sharing the failure is not given up


async def test_a_tenant_joining_another_tenants_call_in_a_shared_namespace_gets_no_2xx_error_text(
    fake, gateway_with
):
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        docs = {"x-carpool-namespace": "docs"}
        for i in (1, 2):  # both accepted by the upstream: they share the namespace's calls
            assert (await gw.chat(f"warm {i}", headers={**bearer(i), **docs})).status_code == 200
        leader, (other,) = await _leader_and_joiners(
            gw,
            fake,
            {"headers": {**bearer(1), **docs}},
            [{"headers": {**bearer(2), **docs}}],
            status=200,
        )
        assert leader.json() == LEAKY and other.status_code == 200
        assert other.headers["x-carpool"] == "coalesced" and "tenant-01" not in other.text
        assert other.json()["error"]["code"] == "engine_crashed" and fake.count() == 3


async def test_an_instance_following_another_requesters_call_gets_no_2xx_error_text(
    fake, shared_redis
):
    pytest.importorskip("redis")
    async with two_instances(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()
        fake.fail_status, fake.fail_body = 200, LEAKY
        first = asyncio.create_task(a.chat("Q", user="alice-42"))
        await fake.wait_for_calls(1)
        others = [
            asyncio.create_task(b.chat("Q", user="bob")),
            asyncio.create_task(b.chat("Q", user="bob", stream=True)),
        ]
        await eventually(
            lambda: (
                b.gateway.layers.shared_flights.counts["followed"] == 1
                and sum(f.clients for f in b.gateway.flights.running()) == 2
            ),
            what="b following a's call, both of its clients on it",
        )
        fake.gate.set()
        leader, (joined, streamed) = await first, await asyncio.gather(*others)
        assert leader.json() == LEAKY
        assert "alice" not in joined.text + streamed.text
        assert (
            joined.json()["error"]["code"] == sse_error(streamed.text)["code"] == "engine_crashed"
        )
        assert fake.count() == 1


async def test_a_2xx_body_reporting_an_error_does_not_accept_the_credential(fake, gateway_with):
    # A proxy refusing a made-up key with a 200 and an error body: the upstream did not accept
    # it, so it reads nothing of a namespace shared across accepted tenants, whether the 200
    # came on a shared call, a bypass (its body relayed as it came), or a streamed bypass.
    fake.answer_text = lambda n, body: f"for {fake.calls[n - 1].headers.get('authorization')}"
    shared = {"x-carpool-namespace": "docs"}
    refused = {"error": {"message": "invalid api key", "type": "auth", "code": "invalid_api_key"}}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}) as gw:
        for prompt in ("Q", "R"):
            good = await gw.chat(prompt, headers={"Authorization": "Bearer good", **shared})
            assert good.status_code == 200
        refusals = [
            {"content": "anything"},
            {"content": "sampled", "temperature": 0.7},
            {"content": "sampled", "temperature": 0.7, "stream": True},
        ]
        for i, body in enumerate(refusals):
            made_up = {"Authorization": f"Bearer made-up-{i}", **shared}
            fake.fail_status, fake.fail_body, fake.fail_times = 200, refused, 1
            assert (await gw.chat(headers=made_up, **body)).status_code == 200
            calls = fake.count()
            read = await gw.chat("Q", headers=made_up)
            assert read.headers["x-carpool"] == "miss", body
            assert read.json()["choices"][0]["message"]["content"] == f"for Bearer made-up-{i}"
            assert fake.count() == calls + 1
        # A complete answer accepts, whole or streamed, shared or bypassed: the namespace is
        # read then.
        for i, asked in enumerate(
            [{}, {"stream": True}, {"temperature": 0.7}, {"temperature": 0.7, "stream": True}]
        ):
            new = {"Authorization": f"Bearer new-{i}", **shared}
            assert (await gw.chat(f"own {i}", headers=new, **asked)).status_code == 200
            hit = await gw.chat("R", headers=new, stream=asked.get("stream", False))
            assert hit.headers["x-carpool"] == "hit" and "good" in hit.text, asked


@pytest.mark.parametrize("api", ["messages", "chat"])
async def test_a_joiner_of_a_call_failed_with_a_body_that_is_no_json_gets_its_apis_error_shape(api):
    """The upstream failed the shared call with an HTML page: its leader gets it as it came,
    and a joiner (another spelling of the same request) the gateway's words, which were in
    OpenAI's shape on /v1/messages too (an Anthropic SDK cannot read it), ``code`` the status
    as a number (OpenAI's is a string or null)."""
    from fakes.raw_upstream import answer, raw_upstream

    gate = asyncio.Event()
    page = b"<html><body>503 Service Unavailable</body></html>"

    async def respond(_call):
        await gate.wait()
        return answer(503, b"Service Unavailable", page, b"text/html")

    path = "/v1/messages" if api == "messages" else "/v1/chat/completions"
    base = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Q"}]}
    async with raw_upstream(respond) as up, run_gateway([up.url]) as gw:
        first = asyncio.create_task(gw.client.post(path, json={**base, "temperature": 0}))
        await eventually(lambda: up.calls, what="the leader's call")
        # (Out of the key but not the same bytes: 0.0 for 0, another order of the keys.)
        joined = asyncio.create_task(gw.client.post(path, json={"temperature": 0.0, **base}))
        await eventually(
            lambda: sum(f.clients for f in gw.gateway.flights.running()) == 2,
            what="the joiner on the flight",
        )
        gate.set()
        leader, joiner = await first, await joined
    assert leader.status_code == joiner.status_code == 503
    assert leader.content == page
    error = joiner.json()
    assert joiner.headers["content-type"] == "application/json"
    if api == "messages":  # (Anthropic's: its type for a 503, no OpenAI fields)
        assert error == {"type": "error", "error": {"type": "api_error", "message": OTHERS_MESSAGE}}
    else:
        assert error["error"]["message"] == OTHERS_MESSAGE
        assert error["error"]["code"] is None or isinstance(error["error"]["code"], str), error
    assert len(up.calls) == 1
