"""Several gateway instances sharing one real Redis/Valkey (CONTRACT.md config `redis`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess

import httpx
import pytest

from carpool import errors
from conftest import redis_keys, redis_settings, run_gateway
from fakes.instances import answered_by, free_port, instances, serve_env, start_serve
from fakes.latency_proxy import LinkProxy
from fakes.waiting import WAIT_S, eventually

pytest.importorskip("redis")


@contextlib.asynccontextmanager
async def gateways(n, fake, redis_server, **config):
    """``n`` instances in front of ``fake`` sharing ``redis_server``."""
    # Generous Redis timeouts: 100 connections opening at once on a busy 2-core machine must
    # not count as an outage (which would rightly make each instance call upstream itself).
    distributed = {
        "retry_interval": 0.05,
        "timeout": 2.0,
        "connect_timeout": 2.0,
        **config.pop("distributed", {}),
    }
    shared = {**redis_settings(redis_server, **distributed), "admin_token": "t", **config}
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_gateway([fake.url], **shared)) for _ in range(n)]


@contextlib.asynccontextmanager
async def two_gateways(fake, redis_server, **config):
    async with gateways(2, fake, redis_server, **config) as (a, b):
        yield a, b


@contextlib.asynccontextmanager
async def fleet(fake, redis_server, *configs):
    """One instance per config (a fleet mid-change: its configs differ), sharing
    ``redis_server``, each with the generous Redis timeouts of ``gateways``."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            (await stack.enter_async_context(gateways(1, fake, redis_server, **config)))[0]
            for config in configs
        ]


async def until_relaying(c, a=None) -> None:
    """Until C relays the first words (3 frames) of the stream A leads. It takes one read and
    one block (~0.2 s in 30 runs); it timed out once at 5 s in CI, cause unknown: the wait is
    as long as its siblings', and a failure says what the flights were doing (A's too when it
    runs in this process)."""
    counts = c.gateway.shared_flights.counts

    def flights(gw) -> dict:
        running = [(f.clients, len(f.broadcast.frames)) for f in gw.gateway.flights.running()]
        shared = gw.gateway.shared_flights
        return {"counts": shared.counts, "following": shared.following, "running": running}

    await eventually(
        lambda: counts["frames_relayed"] >= 3,
        timeout=10,
        what="C relaying A's first words",
        state=lambda: {"A": a and flights(a), "C": flights(c)},
    )


async def test_an_answer_stored_via_one_instance_is_a_hit_on_another(fake, shared_redis):
    async with two_gateways(fake, shared_redis) as (a, b):
        first = await a.chat()
        again = await b.chat()
        assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
        assert again.json() == first.json() and fake.count() == 1
        stats = await b.client.get("/stats", headers={"Authorization": "Bearer t"})
        assert stats.json()["redis"]["state"] == "up"


# A fleet mid-change (a rolling config change): what one instance's config makes an answer must
# not reach a client of another whose config would not have given it. ``window_ms: 0``: the
# second request reads the store, not a lingering call.
NO_WINDOW = {"window_ms": 0}


async def test_a_key_the_upstream_refused_on_one_instance_reads_no_shared_namespace_on_another(
    fake, shared_redis
):
    """A 401 or 403 takes back every acceptance of the refused key, but only on the instance
    that saw it: on another, the key accepted there before read the shared namespaces on (other
    tenants' answers, made after the refusal too) until `tenant.accepted_ttl`, every request a
    hit, so no call there was refused. The refusal reaches every instance now (the invalidation
    channel), and one whose subscription was cut forgets every acceptance."""
    from fakes.waiting import eventually

    fake.valid_keys = {"sk-a", "sk-r"}
    shared = {"tenant": {"shared_namespaces": ["pub"]}, "coalesce": NO_WINDOW}
    revoked = {"Authorization": "Bearer sk-r", "x-carpool-namespace": "pub"}
    owner = {"Authorization": "Bearer sk-a", "x-carpool-namespace": "pub"}
    async with fleet(fake, shared_redis, shared, shared) as (a, b):
        assert (await b.chat("hi", headers=revoked)).status_code == 200  # accepted on B
        await eventually(lambda: b.gateway.invalidations.listening, what="B subscribed")
        fake.valid_keys = {"sk-a"}  # revoked upstream
        assert (await a.chat("hello", headers=revoked)).status_code == 401  # seen on A
        assert (await a.chat(QUESTION, headers=owner)).headers["x-carpool"] == "miss"
        await eventually(
            lambda: b.gateway.invalidations.counts["refusals_received"] == 1,
            what="the refusal told to B",
        )
        got = await b.chat(QUESTION, headers=revoked)
        assert got.status_code == 401, (got.status_code, got.headers.get("x-carpool"))
        # Counted where an operator alerts: /metrics (it was in /stats alone).
        told, taken = [x.gateway.metrics.render().decode() for x in (a, b)]
        assert "carpool_redis_refusals_received_total 1.0" in taken
        assert "carpool_redis_refusals_unsent_total 0.0" in told
        assert "carpool_redis_refusals_pending 0.0" in told


async def test_an_answer_made_with_a_held_key_is_not_served_where_the_gateway_holds_none(
    fake, shared_redis
):
    """A calls the upstream with a key it holds; B passes its clients' credentials on, and the
    upstream refuses an anonymous client's. B's anonymous client gets that refusal for a
    prompt A answered too, not A's answer."""
    fake.valid_keys = {"sk-held"}
    held = {"upstream": {"api_key": "sk-held"}, "coalesce": NO_WINDOW}
    async with fleet(fake, shared_redis, held, {"coalesce": NO_WINDOW}) as (a, b):
        assert (await a.chat(QUESTION)).headers["x-carpool"] == "miss"
        got = await b.chat(QUESTION)
        assert got.status_code == 401, (got.status_code, got.headers.get("x-carpool"))
        assert fake.count() == 2


async def test_a_call_made_with_a_held_key_is_not_followed_where_the_gateway_holds_none(
    fake, shared_redis
):
    """The same rule for a call still running: B's anonymous client does not follow A's call
    (made with A's key) but makes its own, which the upstream refuses."""
    fake.valid_keys = {"sk-held"}
    async with fleet(fake, shared_redis, {"upstream": {"api_key": "sk-held"}}, {}) as (a, b):
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(QUESTION))
        alone = None
        try:
            await fake.wait_for_calls(1)
            alone = asyncio.create_task(b.chat(QUESTION))
            await fake.wait_for_calls(2)  # B's own call: it followed none
        finally:
            fake.gate.set()
            answers = await asyncio.gather(led, *[alone] if alone else [])
        assert [answer.status_code for answer in answers] == [200, 401]


async def test_a_keyed_request_run_with_a_held_key_is_not_replayed_where_the_gateway_holds_none(
    fake, shared_redis
):
    """A retry on B of a keyed request A ran with its key is another request there (a 422),
    never A's answer replayed to a client the upstream would refuse, nor run twice."""
    fake.valid_keys = {"sk-held"}
    keyed = {"Idempotency-Key": '"k"'}
    async with fleet(fake, shared_redis, {"upstream": {"api_key": "sk-held"}}, {}) as (a, b):
        assert (await a.chat(QUESTION, headers=keyed)).status_code == 200
        retry = await b.chat(QUESTION, headers=keyed)
        assert retry.status_code == 422 and "idempotent-replayed" not in retry.headers
        assert fake.count() == 1


async def test_an_answer_to_a_collapsed_prompt_is_not_served_where_white_space_is_kept(
    fake, shared_redis
):
    """A collapses white space (``fingerprint.normalize_whitespace``), B does not: for B
    "hi there" and "hi  there" are two prompts, and A's answer to the second, sent upstream as
    it came, is not B's answer to the first."""
    async with fleet(
        fake,
        shared_redis,
        {"fingerprint": {"normalize_whitespace": True}, "coalesce": NO_WINDOW},
        {"coalesce": NO_WINDOW},
    ) as (a, b):
        assert (await a.chat("hi  there")).headers["x-carpool"] == "miss"
        got = await b.chat("hi there")
        assert got.headers["x-carpool"] == "miss"
        assert content(got) == "answer 2 to hi there"


async def test_an_answer_keyed_without_a_neutral_header_is_not_served_where_that_header_is_keyed(
    fake, shared_redis
):
    """A lists ``x-deployment`` in ``fingerprint.neutral_headers``, B does not (for B it may
    change the answer): A's answer to a client that sent ``x-deployment: beta`` is not B's to
    a client that sent none."""
    async with fleet(
        fake,
        shared_redis,
        {"fingerprint": {"neutral_headers": ["x-deployment"]}, "coalesce": NO_WINDOW},
        {"coalesce": NO_WINDOW},
    ) as (a, b):
        beta = {"x-deployment": "beta"}
        assert (await a.chat(QUESTION, headers=beta)).headers["x-carpool"] == "miss"
        assert (await b.chat(QUESTION)).headers["x-carpool"] == "miss"
        assert fake.count() == 2


async def test_instances_whose_configs_agree_on_what_keys_share_answers(fake, shared_redis):
    """Those settings keep apart only instances that differ in them: two holding a key
    (another one: a key rotated), or two with the same neutral headers, share."""
    same = {
        "fingerprint": {"normalize_whitespace": True, "neutral_headers": ["x-deployment"]},
        "coalesce": NO_WINDOW,
    }
    async with fleet(
        fake,
        shared_redis,
        {**same, "upstream": {"api_key": "sk-old"}},
        {**same, "upstream": {"api_key": "sk-new"}},
    ) as (a, b):
        assert (await a.chat("hi  there", headers={"x-deployment": "beta"})).headers[
            "x-carpool"
        ] == "miss"
        assert (await b.chat("hi there")).headers["x-carpool"] == "hit"


async def test_an_answer_and_a_record_kept_for_the_longest_ttl_are_shared_through_redis(
    fake, shared_redis
):
    # (A TTL past what Redis takes as an expiry failed every put, unsaid: no answer shared.)
    from carpool.config.base import LONGEST_TTL

    longest = {"cache": {"default_ttl": LONGEST_TTL}, "idempotency": {"retention": LONGEST_TTL}}
    async with two_gateways(fake, shared_redis, coalesce={"window_ms": 0}, **longest) as (a, b):
        assert (await a.chat()).headers["x-carpool"] == "miss"
        assert (await b.chat()).headers["x-carpool"] == "hit"
        keyed = {"Idempotency-Key": '"k"'}
        first = await a.chat("another question", headers=keyed)
        retry = await b.chat("another question", headers=keyed)
        assert retry.headers["idempotent-replayed"] == "true" and retry.json() == first.json()
        assert fake.count() == 2


async def test_an_invalidation_on_one_instance_reaches_every_instance(fake, shared_redis):
    async with two_gateways(fake, shared_redis) as (a, b):
        await a.chat(headers={"x-carpool-tags": "faq"})
        dropped = await a.client.post(
            "/admin/invalidate", json={"tag": "faq"}, headers={"Authorization": "Bearer t"}
        )
        assert dropped.json() == {"invalidated": 1}
        assert (await b.chat()).headers["x-carpool"] == "miss"


async def keys_and_values(target) -> dict[bytes, bytes]:
    """Every key on ``target`` (each node of a cluster), with its value as ``DUMP`` writes it
    (any type; without its TTL)."""
    import redis.asyncio as aredis

    found: dict[bytes, bytes] = {}
    for node in getattr(target, "nodes", [target]):
        client = aredis.Redis.from_url(node.url)
        try:
            async for key in client.scan_iter(match="*", count=1000):
                found[key] = await client.dump(key)
        finally:
            await client.aclose()
    return found


async def test_invalidating_everything_touches_no_key_outside_the_instances_own_shapes(
    fake, shared_redis
):
    """Two deployments on one Redis whose prefixes nest (``carpool:``, and ``carpool:e:``,
    which the config accepts), and another app's keys under the first's prefix: ``{"all":
    true}`` on the first drops its own entries and lingering locks only. Before, its scans
    acted on every key their patterns matched: it deleted the second deployment's entry and
    idempotency record (a retry there ran the request again) and the other app's
    ``carpool:e:other-app``, rewrote a string at ``carpool:lock:other-app-str``, and a hash at
    ``carpool:lock:other-app-hash`` failed every such invalidation (the instance degraded), as
    did a hash under a lock's very name."""
    from carpool.redis.connection import connect

    lingering = {"coalesce": {"window_ms": 60_000, "adaptive": False}}
    nested = {"distributed": {"key_prefix": "carpool:e:"}, **lingering}
    keyed = {"Idempotency-Key": "order-1"}
    async with gateways(1, fake, shared_redis, **nested) as (d,):
        assert (await d.chat("the nested deployment's", headers=keyed)).status_code == 200
    raw = connect(shared_redis.url, cluster=shared_redis.cluster)
    try:
        await raw.set("carpool:e:other-app", b"another app's")
        await raw.set("carpool:lock:other-app-str", b"another app's")
        await raw.hset("carpool:lock:other-app-hash", b"field", b"another app's")
        # (Under a lock's very name, no string: left as it is, the other locks forgotten.)
        await raw.hset("carpool:lock:{" + "f" * 32 + "}", b"field", b"another app's")
    finally:
        await raw.aclose()
    foreign = await keys_and_values(shared_redis)
    nested_keys = {k for k in foreign if k.startswith(b"carpool:e:") and b"other-app" not in k}
    for shape in (b"carpool:e:e:{", b"carpool:e:idem:{", b"carpool:e:lock:{"):
        assert any(k.startswith(shape) for k in nested_keys), (shape, nested_keys)
    async with gateways(1, fake, shared_redis, **lingering) as (a,):
        assert (await a.chat("the first deployment's")).status_code == 200
        own = {k for k in await redis_keys(shared_redis) if k not in foreign}
        for shape in (b"carpool:e:{", b"carpool:lock:{"):  # (its entry, its lingering lock)
            assert any(k.startswith(shape) for k in own), (shape, own)
        invalidated = await a.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": "Bearer t"}
        )
        health = (await a.client.get("/healthz")).json()
        left = await keys_and_values(shared_redis)
        again = await a.chat("the first deployment's")
    assert invalidated.status_code == 200, invalidated.text
    assert invalidated.json() == {"invalidated": 1}
    assert health["redis"]["state"] == "up" and health["redis"]["errors"] == 0, health
    assert {k: v for k, v in left.items() if k in foreign} == foreign
    dropped = (b"carpool:e:{", b"carpool:lock:{", b"carpool:{stats}:")  # (its entry, lock, counts)
    assert not {k for k in left if k not in foreign and k.startswith(dropped)}
    assert again.headers["x-carpool"] == "miss" and fake.count() == 3


async def test_a_deleted_response_is_dropped_on_every_instance(fake, shared_redis):
    # Deleted through one instance, the stored response another instance made and stored in
    # Redis is no longer served by either: the instance that stored it (which alone knows its
    # key) drops it, here and in Redis, once the deleter's message reaches it (pub/sub:
    # milliseconds; until then it may be served). (No window: nothing lingers.)
    fake.keeps_responses = True
    body = {"model": "m", "input": "Keep me, then delete me", "temperature": 0}
    async with two_gateways(fake, shared_redis, coalesce={"window_ms": 0}) as (a, b):
        rid = (await a.client.post("/v1/responses", json=body)).json()["id"]
        assert (await b.client.post("/v1/responses", json=body)).headers["x-carpool"] == "hit"
        channel = a.gateway.invalidations
        assert channel is not None
        assert (await b.client.delete(f"/v1/responses/{rid}")).status_code == 200
        await eventually(lambda: channel.counts["states_received"] == 1, what="A told of it")
        assert channel.counts["received"] == 0  # (no invalidation: A forgot no flight)
        again = await a.client.post("/v1/responses", json=body)
        assert again.headers["x-carpool"] == "miss" and again.json()["id"] != rid


async def test_no_instance_replays_a_deleted_responses_call_lingering_in_redis(fake, redis_server):
    # A finished call lingers in Redis for the window (its lock, ``=TOKEN:MS``), replayed to an
    # identical request on any instance. Deleted through the instance that made it (which
    # dropped its entries, in Redis too, before answering), the other replayed it all the same
    # within the window; so did the deleter once the other made it again and another deleted.
    fake.keeps_responses = True
    body = {"model": "m", "input": "Linger, then be deleted", "temperature": 0}
    async with two_gateways(
        fake, redis_server, coalesce={"window_ms": 60_000, "adaptive": False}
    ) as (a, b):
        rid = (await a.client.post("/v1/responses", json=body)).json()["id"]
        assert (await a.client.delete(f"/v1/responses/{rid}")).status_code == 200
        again = await b.client.post("/v1/responses", json=body)
        assert again.headers["x-carpool"] == "miss" and again.json()["id"] != rid
        # Made by B this time, deleted through A: once A's message reaches B, neither replays it.
        made = again.json()["id"]
        channel = b.gateway.invalidations
        assert channel is not None
        assert (await a.client.delete(f"/v1/responses/{made}")).status_code == 200
        await eventually(lambda: channel.counts["states_received"] == 2, what="B told of it")
        for gateway in (a, b):
            fresh = await gateway.client.post("/v1/responses", json=body)
            assert fresh.headers["x-carpool"] == "miss" and fresh.json()["id"] != made
            assert (await gateway.client.delete(f"/v1/responses/{fresh.json()['id']}")).is_success


async def test_an_instance_that_followed_a_deleted_response_serves_it_no_more(fake, redis_server):
    # B follows A's streamed call: B's own flight lingers with its answer in B's window. Deleted
    # through B, which had not made it (the response named by another instance's stream), B's
    # lingering flight was joined after the DELETE all the same, once A had dropped the rest.
    fake.keeps_responses = True
    fake.chunk_gate = asyncio.Event()
    body = {"model": "m", "input": "Followed, then deleted", "temperature": 0}
    async with two_gateways(
        fake, redis_server, coalesce={"window_ms": 60_000, "adaptive": False}
    ) as (a, b):
        leading = asyncio.create_task(a.client.post("/v1/responses", json={**body, "stream": True}))
        await fake.chunk_gate_reached.wait()
        following = asyncio.create_task(b.client.post("/v1/responses", json=body))
        assert b.gateway.shared_flights is not None
        await eventually(lambda: b.gateway.shared_flights.following == 1, what="B following")
        fake.chunk_gate.set()
        await leading
        followed = await following
        rid = followed.json()["id"]
        assert followed.headers["x-carpool"] == "coalesced"
        channel = a.gateway.invalidations
        assert channel is not None
        assert (await b.client.delete(f"/v1/responses/{rid}")).status_code == 200
        await eventually(lambda: channel.counts["states_received"] == 1, what="A told of it")
        again = await b.client.post("/v1/responses", json=body)
        assert again.headers["x-carpool"] == "miss" and again.json()["id"] != rid


async def test_a_deleted_stored_chat_completion_is_dropped_on_every_instance(fake, shared_redis):
    # As a stored response: deleted through one instance, the chat completion (``store:
    # true``) another instance made and stored in Redis is no longer served by either.
    fake.keeps_completions = True
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Keep me, then delete me"}],
        "temperature": 0,
        "store": True,
    }
    async with two_gateways(fake, shared_redis, coalesce={"window_ms": 0}) as (a, b):
        cid = (await a.client.post("/v1/chat/completions", json=body)).json()["id"]
        assert (await b.client.post("/v1/chat/completions", json=body)).headers[
            "x-carpool"
        ] == "hit"
        channel = a.gateway.invalidations
        assert channel is not None
        assert (await b.client.delete(f"/v1/chat/completions/{cid}")).status_code == 200
        await eventually(lambda: channel.counts["states_received"] == 1, what="A told of it")
        for gateway in (a, b):
            again = await gateway.client.post("/v1/chat/completions", json=body)
            assert again.status_code == 200 and again.json()["id"] != cid


async def test_after_an_invalidation_no_instance_follows_a_call_begun_before_it(fake, shared_redis):
    async with two_gateways(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()
        before = asyncio.create_task(a.chat("running"))
        await fake.wait_until(lambda: fake.count() == 1, what="the call led by A")
        response = await b.client.post(
            "/admin/invalidate", json={"all": True}, headers={"Authorization": "Bearer t"}
        )
        assert response.status_code == 200
        after_b = asyncio.create_task(b.chat("running"))
        await fake.wait_until(lambda: fake.count() == 2, what="B's own call")
        fake.gate.set()
        first, second = await before, await after_b
        assert second.headers["x-carpool"] == "miss"
        assert first.json()["id"] != second.json()["id"]
        # The stale call's answer is replayed to nobody: the next request gets the fresh one.
        third = await a.chat("running")
        assert third.json()["id"] == second.json()["id"] and fake.count() == 2


async def test_an_answer_taken_back_by_the_generation_is_not_replayed_from_its_lock(
    fake, redis_server
):
    """A call that claims its lock while B's invalidation is on its way, before its count
    moves: its answer may predate what was dropped. Before, the flights' locks were scanned
    and marked before the count moved: such a call's lock was missed, its answer taken back
    from the store (``RedisStore.put``) yet lingering in its lock, replayed to a request made
    after the invalidation answered. Now the count moves first: a call claimed after the scan
    began after the count (fresh); one claimed before is marked."""
    async with two_gateways(fake, redis_server) as (a, b):
        store = b.gateway.layers.store
        invalidate = store.invalidate
        reached, proceed = asyncio.Event(), asyncio.Event()

        async def held_invalidate(selector):  # the store's invalidation, held at its start
            reached.set()
            await proceed.wait()
            return await invalidate(selector)

        store.invalidate = held_invalidate
        fake.gate = asyncio.Event()
        invalidation = asyncio.create_task(
            b.client.post(
                "/admin/invalidate", json={"all": True}, headers={"Authorization": "Bearer t"}
            )
        )
        await asyncio.wait_for(reached.wait(), 5)
        before = asyncio.create_task(a.chat(QUESTION))  # claims its lock now, calls upstream
        await fake.wait_for_calls(1)
        proceed.set()
        assert (await invalidation).status_code == 200
        fake.gate.set()
        assert content(await before) == ANSWER_1  # (its own client gets it)
        after = await b.chat(QUESTION)
        assert after.headers["x-carpool"] == "miss"
        assert content(after) == f"answer 2 to {QUESTION}" and fake.count() == 2


async def test_redis_killed_requests_still_succeed_and_health_says_degraded(fake, killable_redis):
    async with two_gateways(fake, killable_redis) as (a, b):
        assert (await a.chat("before")).headers["x-carpool"] == "miss"
        killable_redis.kill()
        during = [await a.chat("during"), await a.chat("during"), await b.chat("before")]
        assert [r.status_code for r in during] == [200, 200, 200]
        # This instance keeps what it computed while Redis is down, in its own memory.
        assert [r.headers["x-carpool"] for r in during] == ["miss", "hit", "miss"]
        health = (await a.client.get("/healthz")).json()
        assert health["status"] == "degraded" and health["redis"]["errors"] >= 1
        assert (await a.client.get("/healthz")).status_code == 200
        killable_redis.restart()
        for gateway in (a, b):
            await until_redis_is_back(gateway)
        await b.chat("shared again")
        assert (await a.chat("shared again")).headers["x-carpool"] == "hit"


async def until_redis_is_back(served, timeout: float = WAIT_S) -> None:
    """Requests probe Redis again once per retry_interval; the first success ends degraded mode."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while served.gateway.redis_health()["state"] != "up":
        assert loop.time() < deadline, "the gateway never reconnected to Redis"
        await served.chat("probe")
        await asyncio.sleep(0.01)


def semantic_extra() -> dict:
    """The semantic layer, where its extra is installed (the dev install has it)."""
    import importlib.util

    installed = all(importlib.util.find_spec(m) for m in ("onnxruntime", "usearch"))
    return {"semantic": {"enabled": True}} if installed else {}


async def test_redis_down_every_layer_takes_the_one_way_down_and_back(fake, killable_redis):
    """The one fallback, every Redis-backed layer at once: the exact store, flights,
    invalidations, idempotency records and semantic entries all ask and tell the instance's one
    health. Redis killed: every request succeeds from this instance's memory and each instance
    says degraded, in one degraded period (but an invalidation, done in this instance only: a
    503 says the answers in Redis were not dropped); Redis back: both share through it again."""
    admin, key = {"Authorization": "Bearer t"}, {"Idempotency-Key": "order-1"}
    async with two_gateways(fake, killable_redis, **semantic_extra()) as (a, b):
        semantic = a.gateway.semantic is not None
        if semantic:
            for served in (a, b):
                await asyncio.wait_for(served.gateway.semantic.ready.wait(), 5)
        assert (await a.chat("before")).headers["x-carpool"] == "miss"
        killable_redis.kill()

        repeat = [await a.chat("repeat"), await a.chat("repeat")]  # an exact repeat
        down_since = a.gateway.redis_health()["down_since"]
        assert down_since is not None
        fake.gate = asyncio.Event()
        pair = [asyncio.create_task(b.chat("pair")) for _ in range(2)]  # a coalesced pair
        await eventually(lambda: b.gateway.flights.waiters == 2, what="the pair on one flight")
        fake.gate.set()
        pair = list(await asyncio.gather(*pair))
        fake.gate = None
        keyed = [await a.chat("charge", headers=key), await a.chat("charge", headers=key)]
        invalidated = await b.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        after_invalidation = await b.chat("pair")
        paraphrase = []
        if semantic:
            paraphrase = [await a.chat("How do I reset my router?")]
            await eventually(lambda: a.gateway.semantic.entries >= 1, what="the local entry")
            paraphrase.append(await a.chat("how can i reset my router"))

        everything = [*repeat, *pair, *keyed, after_invalidation, *paraphrase]
        assert [r.status_code for r in everything] == [200] * len(everything)
        assert invalidated.status_code == 503 and "did not reach Redis" in invalidated.text
        assert [r.headers["x-carpool"] for r in repeat] == ["miss", "hit"]
        assert sorted(r.headers["x-carpool"] for r in pair) == ["coalesced", "miss"]
        assert pair[0].json() == pair[1].json()
        assert keyed[1].headers["idempotent-replayed"] == "true"
        assert keyed[1].json() == keyed[0].json()
        assert after_invalidation.headers["x-carpool"] == "miss"  # B's own answer dropped
        if semantic:
            assert paraphrase[1].headers["x-carpool"] == "semantic-hit"
        for served in (a, b):
            health = (await served.client.get("/healthz")).json()
            assert health["status"] == "degraded" and health["redis"]["errors"] >= 1
        # One degraded period for every layer's failures: never back to up in between.
        assert a.gateway.redis_health()["down_since"] == down_since

        killable_redis.restart()
        for served in (a, b):
            await until_redis_is_back(served, timeout=10)
        await b.chat("shared again")
        assert (await a.chat("shared again")).headers["x-carpool"] == "hit"
        again = {"Idempotency-Key": "order-2"}
        first = await b.chat("charge again", headers=again)
        replayed = await a.chat("charge again", headers=again)  # the record is B's, in Redis
        assert replayed.headers["idempotent-replayed"] == "true"
        assert replayed.json() == first.json()
        for served in (a, b):
            assert (await served.client.get("/healthz")).json()["status"] == "ok"


async def test_the_invalidation_subscriber_survives_redis_restarting_and_delivers_again(
    fake, killable_redis
):
    """carpool/redis/invalidation.py: each instance's subscriber reconnects by itself; subscribed
    again, it forgets what lingered meanwhile and every key accepted (pub/sub replays nothing: an
    invalidation or a refusal may have been missed), then delivers as before. The window is long: only invalidations end it."""
    admin = {"Authorization": "Bearer t"}
    async with two_gateways(
        fake, killable_redis, coalesce={"window_ms": 60_000, "max_window_ms": 60_000}
    ) as (a, b):
        ia, ib = a.gateway.invalidations, b.gateway.invalidations
        await eventually(lambda: ia.listening and ib.listening, what="both instances subscribed")
        killable_redis.kill()
        await eventually(
            lambda: not ia.listening and not ib.listening, what="both subscribers cut off"
        )
        assert ia.counts["errors"] >= 1 and ib.counts["errors"] >= 1
        # Redis down: A answers alone, and the answer lingers in A's own window.
        assert (await a.chat("while down")).headers["x-carpool"] == "miss"
        assert len(a.gateway.flights) == 1
        assert len(a.gateway.accepted) == 1  # (its client's key, answered)
        # An invalidation on B while Redis is down is done in B only: a 503 (the answers in
        # Redis were not dropped, and may be there again once it answers), never sent.
        response = await b.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert ib.counts["unsent"] == 1 and ib.counts["published"] == 0
        killable_redis.restart()
        await eventually(
            lambda: ia.listening and ib.listening,
            timeout=10,
            what="both instances subscribed again",
        )
        assert ia.counts["resubscribed"] >= 1 and ia.counts["forgotten"] >= 1
        assert len(a.gateway.flights) == 0  # the missed invalidation cost nothing
        assert len(a.gateway.accepted) == 0  # (nor a refusal missed meanwhile)
        assert (await a.chat("while down")).headers["x-carpool"] == "miss"

        # Delivering again: an answer lingering on A, invalidated on B.
        received = ia.counts["received"]
        tagged = {"x-carpool-tags": "faq"}
        assert (await a.chat("after", headers=tagged)).headers["x-carpool"] == "miss"
        response = await b.client.post("/admin/invalidate", json={"tag": "faq"}, headers=admin)
        assert response.json() == {"invalidated": 1} and ib.counts["published"] == 1
        await eventually(
            lambda: ia.counts["received"] == received + 1,
            what="instance A told of the invalidation",
        )
        assert len(a.gateway.flights) == 0
        assert (await a.chat("after", headers=tagged)).headers["x-carpool"] == "miss"
        assert fake.count() == 4


async def test_the_invalidation_subscriber_notices_a_hung_redis_by_its_keepalive(
    killable_redis, monkeypatch
):
    """A Redis that stops answering (SIGSTOP) closes no connection: the subscriber's PING goes
    unanswered, it subscribes again once Redis answers, and forgets what lingered meanwhile."""
    from carpool.redis import invalidation
    from carpool.redis.connection import connect

    monkeypatch.setattr(invalidation, "KEEPALIVE", 0.1)
    monkeypatch.setattr(invalidation, "WAIT", 0.05)
    client = connect(killable_redis.url, socket_timeout=0.3, cluster=killable_redis.cluster)
    forgotten: list[int] = []
    channel = invalidation.InvalidationChannel(
        client,
        lambda: forgotten.append(1) or 1,
        socket_timeout=0.3,
        retry_interval=0.05,
        owns_client=True,
    )
    try:
        channel.start()
        await eventually(lambda: channel.listening, what="subscribed")
        for pid in killable_redis.pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            await eventually(lambda: not channel.listening, what="the hang noticed")
        finally:
            for pid in killable_redis.pids:
                os.kill(pid, signal.SIGCONT)
        await eventually(lambda: channel.listening, what="subscribed again")
        assert channel.counts["resubscribed"] == 1 and forgotten == [1]
        assert await client.publish(channel.channel, b"another instance") == 1
        await eventually(lambda: channel.counts["received"] == 1, what="delivered again")
        assert forgotten == [1, 1] and channel.counts["errors"] >= 1
    finally:
        await channel.aclose()


# ------------------------------------------------------------------------------------------------
# Cross-instance coalescing (carpool/redis/flights.py)

QUESTION = "What is carpool?"
ANSWER_1 = f"answer 1 to {QUESTION}"
# Redis timeouts for instances whose link is not under test: under load (pytest -n on two
# cores) a claim past the 0.5 s default made an instance go alone (a second upstream call, a
# follower never relaying). A death is still seen by the lease, not by these.
STEADY_LINK = {"timeout": 5.0, "connect_timeout": 5.0}
# QUESTION asked as a stream, at temperature 0 (shared).
STREAMED = {
    "model": "m",
    "messages": [{"role": "user", "content": QUESTION}],
    "temperature": 0,
    "stream": True,
}


def sse_text(raw: str) -> str:
    """The text a streaming client received (chat deltas joined); fails on an error event."""
    text = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    return "".join(text)


def content(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def shared(*gateways):
    return [served.gateway.shared_flights for served in gateways]


async def test_100_identical_requests_over_two_instances_make_one_upstream_call(fake, shared_redis):
    async with two_gateways(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()

        async def one(i: int) -> tuple[str, str]:
            served = (a, b)[i % 2]
            if (i // 2) % 2:  # half of them stream, on both instances
                response, raw = await served.stream_chat(QUESTION)
                assert response.status_code == 200
                return response.headers["x-carpool"], sse_text(raw)
            response = await served.chat(QUESTION)
            assert response.status_code == 200, response.text
            return response.headers["x-carpool"], content(response)

        tasks = [asyncio.create_task(one(i)) for i in range(100)]

        def all_attached() -> bool:
            flights = shared(a, b)
            return (
                a.gateway.flights.waiters + b.gateway.flights.waiters == 100
                and [f.leading for f in flights] in ([1, 0], [0, 1])
                and sum(f.following for f in flights) == 1
            )

        await fake.wait_for_calls(1)
        await eventually(all_attached, what="100 clients attached, one instance following")
        assert fake.count() == 1
        fake.gate.set()
        results = await asyncio.gather(*tasks)
    assert {text for _, text in results} == {ANSWER_1}
    assert collections.Counter(outcome for outcome, _ in results) == {"miss": 1, "coalesced": 99}
    assert fake.count() == 1


async def test_a_late_streaming_joiner_on_another_instance_gets_the_whole_text(fake, shared_redis):
    async with two_gateways(fake, shared_redis) as (a, b):
        fake.chunk_gate = asyncio.Event()  # the leader streams 2 words, then waits
        first = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        # The first frames (role chunk + 2 words) are in Redis before the joiner arrives...
        await eventually(lambda: a.gateway.shared_flights.counts["frames_published"] >= 3)
        late = asyncio.create_task(b.stream_chat(QUESTION))
        # ...it replays them while the rest does not exist yet...
        await eventually(lambda: b.gateway.shared_flights.counts["frames_relayed"] >= 3)
        assert not late.done()
        fake.chunk_gate.set()  # ...then gets the rest live.
        (response_a, raw_a), (response_b, raw_b) = await asyncio.gather(first, late)
    assert sse_text(raw_b) == sse_text(raw_a) == ANSWER_1
    assert (response_a.headers["x-carpool"], response_b.headers["x-carpool"]) == (
        "miss",
        "coalesced",
    )
    assert fake.count() == 1


async def test_a_joiner_after_older_chunks_were_trimmed_still_gets_the_whole_answer(
    fake, shared_redis
):
    """stream_maxlen 1: Redis drops the first node of 100 chunks; the late joiner on B relays
    nothing and serves the answer whole once it is complete (as SSE synthesized from it)."""
    words = " ".join(f"w{i}" for i in range(150))
    fake.answer_text = lambda n, body: f"{words} ({n})"
    fake.chunk_gate, fake.chunk_gate_after = asyncio.Event(), 140
    async with two_gateways(
        fake, shared_redis, distributed={"retry_interval": 0.05, "stream_maxlen": 1}
    ) as (a, b):
        first = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        await eventually(lambda: a.gateway.shared_flights.counts["frames_published"] >= 141)
        late = asyncio.create_task(b.stream_chat(QUESTION))
        await eventually(lambda: b.gateway.shared_flights.following == 1)
        fake.chunk_gate.set()
        (_, raw_a), (response_b, raw_b) = await asyncio.gather(first, late)
    assert sse_text(raw_b) == sse_text(raw_a) == f"{words} (1)"
    assert response_b.headers["x-carpool"] == "coalesced"
    assert b.gateway.shared_flights.counts["frames_relayed"] == 0 and fake.count() == 1


async def test_a_leaders_error_reaches_the_waiters_on_the_other_instance_and_is_not_stored(
    fake, shared_redis
):
    async with two_gateways(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()
        fake.fail_status, fake.fail_times = 503, 1
        fake.fail_body = {
            "error": {"message": "overloaded", "type": "server_error", "code": "busy"}
        }
        first = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_for_calls(1)
        waiters = [
            asyncio.create_task(b.chat(QUESTION)),
            asyncio.create_task(b.stream_chat(QUESTION)),
        ]
        await eventually(
            lambda: b.gateway.flights.waiters == 2 and b.gateway.shared_flights.following == 1
        )
        fake.gate.set()
        led, plain, (streamed, _) = await asyncio.gather(first, *waiters)
        assert [r.status_code for r in (led, plain, streamed)] == [503, 503, 503]
        assert plain.content == led.content and plain.json() == fake.fail_body
        assert streamed.json() == fake.fail_body
        assert [r.headers["x-carpool"] for r in (led, plain, streamed)] == [
            "miss",
            "coalesced",
            "coalesced",
        ]
        # Nothing stored, nothing lingering: the next request, on either instance, calls again.
        again = await b.chat(QUESTION)
        assert (again.status_code, again.headers["x-carpool"]) == (200, "miss")
        assert content(again) == f"answer 2 to {QUESTION}" and fake.count() == 2


async def test_a_4xx_refusing_another_instances_body_is_not_the_answer_of_a_joiner_elsewhere(
    fake, shared_redis
):
    # The relayed error says which body the upstream refused: on the other instance, a request
    # of the same key with that body shares it, one whose body differs (metadata is not in the
    # key) makes its own call.
    async with two_gateways(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()
        fake.fail_status, fake.fail_times = 400, 1
        first = asyncio.create_task(a.chat(QUESTION, metadata={"a": 1}))
        await fake.wait_for_calls(1)
        waiters = [
            asyncio.create_task(b.chat(QUESTION, metadata={"a": 1})),
            asyncio.create_task(b.chat(QUESTION, metadata={"a": "x"})),
        ]
        await eventually(
            lambda: b.gateway.flights.waiters == 2 and b.gateway.shared_flights.following == 1
        )
        fake.gate.set()
        led, same, other = await asyncio.gather(first, *waiters)
        assert [r.status_code for r in (led, same, other)] == [400, 400, 200]
        assert same.headers["x-carpool"] == "coalesced" and other.headers["x-carpool"] == "miss"
        assert fake.count() == 2 and fake.calls[1].body["metadata"] == {"a": "x"}


async def test_a_refusals_retry_headers_reach_a_joiner_on_another_instance(fake, shared_redis):
    # What the upstream said of when to retry crosses Redis with its status and body.
    async with two_gateways(fake, shared_redis) as (a, b):
        fake.gate = asyncio.Event()
        fake.fail_status, fake.fail_times = 429, 1
        fake.response_headers = [(b"retry-after", b"7"), (b"x-should-retry", b"false")]
        first = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_for_calls(1)
        joiner = asyncio.create_task(b.chat(QUESTION))
        await eventually(lambda: b.gateway.shared_flights.following == 1)
        fake.gate.set()
        for response in await asyncio.gather(first, joiner):
            assert response.status_code == 429 and response.headers["retry-after"] == "7"
            assert response.headers["x-should-retry"] == "false"
        assert fake.count() == 1


async def test_leader_instance_killed_mid_call_the_waiter_elsewhere_still_gets_a_full_answer(
    fake, shared_redis, tmp_path
):
    """A's process dies while B follows its call: B notices the death through A's lock (the
    lease runs out) and takes the call over, leading it under the lock (``takeovers``), rather
    than giving up at the join timeout, far longer, to make a call alone (``alone``: what a
    follower that never noticed the death would do)."""
    lease_ms, join_timeout_ms = 600, 5000
    settings = {
        "distributed": {
            "lease_ms": lease_ms,
            "retry_interval": 0.05,
            "cluster": shared_redis.cluster,
            **STEADY_LINK,
        },
        "coalesce": {"join_timeout_ms": join_timeout_ms},
    }
    port = free_port()
    env = serve_env(
        {
            "distributed": {"lease_ms": lease_ms, **STEADY_LINK},
            "coalesce": {"join_timeout_ms": join_timeout_ms},
        }
    )
    log = tmp_path / "instance-a.log"
    fake.gate = asyncio.Event()  # call 1 (instance A's) hangs until A is gone
    proc = start_serve(
        [
            "--upstream",
            fake.url,
            "--redis",
            shared_redis.url,
            "--port",
            str(port),
        ],
        env,
        log,
    )
    try:
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as a,
            run_gateway([fake.url], redis=shared_redis.url, **settings) as b,
        ):
            await until_serving(a, proc, log)
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": QUESTION}],
                "temperature": 0,
            }
            lost = asyncio.create_task(a.post("/v1/chat/completions", json=body))
            await fake.wait_for_calls(1)
            fake.gate = None  # the next call (B's takeover) answers at once
            waiter = asyncio.create_task(b.chat(QUESTION))
            await eventually(
                lambda: b.gateway.shared_flights.following == 1,
                what="instance B following A's call",
            )
            proc.kill()
            proc.wait()
            response = await waiter
            with contextlib.suppress(httpx.HTTPError):
                await lost
            # Nothing left behind on the surviving instance (test_faults.py's bookkeeping): no
            # waiter, no flight in progress, no shared flight led or followed.
            flights, shared = b.gateway.flights, b.gateway.shared_flights
            await eventually(
                lambda: (
                    flights.waiters == 0
                    and shared.leading == shared.following == 0
                    and not flights.running()
                ),
                what="instance B settled",
            )
            assert (await b.client.get("/stats")).json()["waiters"] == 0
    finally:
        proc.kill()
        proc.wait()
    assert response.status_code == 200, response.text
    assert content(response) == f"answer 2 to {QUESTION}"
    assert response.headers["x-carpool"] == "miss"  # B's client's request led call 2
    # Taken over once A's lease ran out, not made alone at the join timeout.
    counts = b.gateway.shared_flights.counts
    assert (counts["takeovers"], counts["alone"]) == (1, 0)
    assert fake.count() == 2


async def test_redis_killed_while_a_flight_is_in_progress_requests_still_succeed(
    fake, killable_redis
):
    # (B reads again for the lease, a stall being no death: a short one, for a short test.)
    async with two_gateways(fake, killable_redis, distributed={"lease_ms": 1000}) as (a, b):
        fake.gate = asyncio.Event()
        leading = [
            asyncio.create_task(a.chat(QUESTION)),
            asyncio.create_task(a.stream_chat(QUESTION)),
        ]
        await fake.wait_for_calls(1)
        following = [
            asyncio.create_task(b.chat(QUESTION)),
            asyncio.create_task(b.stream_chat(QUESTION)),
        ]
        await eventually(
            lambda: b.gateway.flights.waiters == 2 and b.gateway.shared_flights.following == 1
        )
        killable_redis.kill()
        fake.gate.set()
        led, (led_stream, raw_a), followed, (followed_stream, raw_b) = await asyncio.gather(
            *leading, *following
        )
        assert [r.status_code for r in (led, led_stream, followed, followed_stream)] == [200] * 4
        assert content(led) == sse_text(raw_a) == ANSWER_1
        # B could no longer follow A's call through Redis (for the lease): it made its own.
        assert content(followed) == sse_text(raw_b) == f"answer 2 to {QUESTION}"
        for served in (a, b):
            after = await served.chat("after")
            assert after.status_code == 200 and content(after).startswith("answer ")


async def test_a_leader_whose_clients_all_left_finishes_its_call_for_the_waiters_elsewhere(
    fake, shared_redis
):
    """A's only client hangs up mid-stream while a streaming and a non-streaming client wait
    on B: A's call goes on for them (one call, nothing cancelled), and its answer is stored."""
    async with two_gateways(fake, shared_redis) as (a, b):
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        waiters = [
            asyncio.create_task(b.stream_chat(QUESTION)),
            asyncio.create_task(b.chat(QUESTION)),
        ]
        await eventually(
            lambda: b.gateway.flights.waiters == 2 and b.gateway.shared_flights.following == 1
        )
        while not any(b"followed:" in key for key in await redis_keys(shared_redis)):
            await asyncio.sleep(0.01)  # (B's first read has said that it follows A's call)
        leader.cancel()  # A's only client goes
        await eventually(lambda: a.gateway.flights.waiters == 0, what="A's client gone")
        fake.chunk_gate.set()
        (streamed, raw), plain = await asyncio.gather(*waiters)
        assert sse_text(raw) == content(plain) == ANSWER_1 and '"error"' not in raw
        assert [r.headers["x-carpool"] for r in (streamed, plain)] == ["coalesced"] * 2
        assert fake.count() == 1 and fake.cancelled == 0
        # The answer, without a second call: stored by then, or (its store finishing) the
        # ended call's, replayed as its followers had it.
        again = await a.chat(QUESTION)
        assert again.headers["x-carpool"] in ("hit", "coalesced") and content(again) == ANSWER_1
        assert fake.count() == 1


async def test_a_call_is_cancelled_once_no_client_of_any_instance_waits(fake, shared_redis):
    """Alone, a leader whose client left cancels its call at once; with a waiter elsewhere,
    once that waiter has gone too (its reads stop: within lease_ms)."""
    lease = {"retry_interval": 0.05, "timeout": 2.0, "connect_timeout": 2.0, "lease_ms": 600}
    async with two_gateways(fake, shared_redis, distributed=lease) as (a, b):
        fake.gate = asyncio.Event()
        alone = asyncio.create_task(a.chat("alone"))
        await fake.wait_for_calls(1)
        alone.cancel()
        await fake.wait_for_cancelled(1)
        leader = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_for_calls(2)
        waiter = asyncio.create_task(b.chat(QUESTION))
        while not any(b"followed:" in key for key in await redis_keys(shared_redis)):
            await asyncio.sleep(0.01)  # (B's first read has said that it follows A's call)
        leader.cancel()
        await eventually(lambda: a.gateway.shared_flights.counts["kept"] == 1, what="kept")
        waiter.cancel()
        await fake.wait_for_cancelled(2)
        assert fake.count() == 2


async def test_a_stream_relayed_in_part_ends_with_an_error_event_when_its_leader_goes(
    fake, shared_redis
):
    """Frames already relayed cannot be taken back: the stream fails, its clients retry."""
    lease = {"retry_interval": 0.05, "timeout": 2.0, "connect_timeout": 2.0, "lease_ms": 600}
    async with two_gateways(fake, shared_redis, distributed=lease) as (a, b):
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        follower = asyncio.create_task(b.stream_chat(QUESTION))
        # (Relayed once A's lock is renewed: the frames were there before B came.)
        await eventually(lambda: b.gateway.shared_flights.counts["frames_relayed"] >= 3)
        for flight in a.gateway.flights.running():  # A's call ends, as its shutdown would
            assert flight.task is not None
            flight.task.cancel()
        response, raw = await asyncio.wait_for(follower, 5)
        assert response.status_code == 200 and response.headers["x-carpool"] == "coalesced"
        assert "data: [DONE]" not in raw
        last = json.loads(raw.strip().splitlines()[-1][len("data: ") :])
        assert last["error"]["code"] == "upstream_stream_broken"
        assert b.gateway.shared_flights.counts["broken"] == 1
        retry = await b.chat(QUESTION)  # the retry coalesces as usual: here, a new call
        assert retry.status_code == 200 and content(retry) == f"answer 2 to {QUESTION}"
        await asyncio.wait_for(leader, 5)


# A stall of one instance's link to Redis shorter than the lease (Redis and the other link
# fine): the stalled link's timeout is the subject, so it is short next to the lease, not so
# short that a claim on two loaded cores fails during the set-up (the instance would go alone,
# the other never follow); the other link's is as long as the test's waits. (Before, the whole
# Redis was stopped and both links had 0.3-0.5 s timeouts throughout: a 0.4 s stall in the
# set-up failed a test.)
STALLING_LINK = {"timeout": 2.0, "connect_timeout": 2.0, "retry_interval": 0.05}
# A keyed request's record outlives a stall of several 2 s timeouts (the answer's store, the
# record's finish, the renewals between) by far: a retry must find it finished, not lost.
LONG_RECORD_LEASE = {"idempotency": {"lease": 30.0}}


@contextlib.asynccontextmanager
async def a_link_that_stalls(redis_server, lease_ms=8000, **config):
    """A ``LinkProxy`` before ``redis_server``, with the settings of the instance whose link
    runs through it and of one whose link is steady (``config`` for both)."""
    proxy = await LinkProxy(redis_server.host, redis_server.port).start()
    stalling = {**STALLING_LINK, "lease_ms": lease_ms}
    steady = {**stalling, "timeout": WAIT_S, "connect_timeout": WAIT_S}
    try:
        yield (
            proxy,
            {"redis": proxy.url, "distributed": stalling, "admin_token": "t", **config},
            {"redis": redis_server.url, "distributed": steady, "admin_token": "t", **config},
        )
    finally:
        proxy.release()
        await proxy.aclose()


@contextlib.asynccontextmanager
async def stalled_and_steady(fake, redis_server, **config):
    """Two instances in front of ``fake``: the first's link to Redis runs through the
    ``LinkProxy`` yielded third, the second's is steady."""
    async with (
        a_link_that_stalls(redis_server, **config) as (proxy, stalling, steady),
        run_gateway([fake.url], **stalling) as first,
        run_gateway([fake.url], **steady) as second,
    ):
        yield first, second, proxy


@contextlib.contextmanager
def held(proxy):
    """``proxy``'s link stalled until the block ends."""
    proxy.hold()
    try:
        yield
    finally:
        proxy.release()


async def test_a_follower_relaying_a_stream_survives_a_redis_stall_shorter_than_the_lease(
    fake, redis_server
):
    """A leads a stream, B relays it to a streaming and a non-streaming client; B's link to
    Redis stalls for longer than its ``distributed.timeout`` (B's reads fail, twice) but less
    than the lease: B reads on from where it was once Redis answers. Before, B's first failed
    read ended its flight (an error event for the streaming client, a second upstream call for
    the other)."""
    async with stalled_and_steady(fake, redis_server) as (b, a, proxy):
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        streaming = asyncio.create_task(b.stream_chat(QUESTION))
        plain = asyncio.create_task(b.chat(QUESTION))
        shared = b.gateway.shared_flights
        await eventually(
            lambda: shared.counts["frames_relayed"] >= 3 and b.gateway.flights.waiters == 2
        )
        with held(proxy):
            # (Or, as before, B gave up at its first failed read.)
            await eventually(
                lambda: shared.counts["errors"] >= 2 or shared.counts["broken"],
                what="two failed reads on B",
            )
        fake.chunk_gate.set()
        (led, raw_a), (relayed, raw_b), whole = await asyncio.gather(leader, streaming, plain)
    assert sse_text(raw_a) == sse_text(raw_b) == content(whole) == ANSWER_1
    assert '"error"' not in raw_b and raw_b.rstrip().endswith("[DONE]")
    assert relayed.headers["x-carpool"] == whole.headers["x-carpool"] == "coalesced"
    assert fake.count() == 1
    assert (shared.counts["broken"], shared.counts["alone"], shared.counts["takeovers"]) == (
        0,
        0,
        0,
    )


async def test_a_call_ending_during_a_redis_stall_shorter_than_the_lease_is_not_made_again_by_its_follower(
    fake, redis_server
):
    """A leads, B follows; the upstream answers while A's link to Redis stalls, and A's client
    has its answer before the link is back (A's end of the flight failed). A ends the flight
    once Redis answers, well within the lease. Before, A tried that end once: its lock stayed
    until the lease ran out, and B then made the call a second time."""
    async with stalled_and_steady(fake, redis_server) as (a, b, proxy):
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_until(lambda: fake.count() == 1, what="the call A leads")
        followed = asyncio.create_task(b.chat(QUESTION))
        flights = b.gateway.shared_flights
        await eventually(lambda: flights.following == 1, what="B following A's call")
        with held(proxy):
            fake.gate.set()
            first = await led  # the call ended while A's link was stalled
        second = await followed
    assert second.json() == first.json()
    assert second.headers["x-carpool"] == "coalesced"
    assert fake.count() == 1
    assert flights.counts["takeovers"] == flights.counts["alone"] == 0


async def test_a_stream_ending_during_a_redis_stall_shorter_than_the_lease_reaches_its_follower_whole(
    fake, redis_server
):
    """As above, a stream that B relays in part before A's link stalls: B's client gets the
    rest, then [DONE]. Before, B gave the relay up once the lease ran out: an error event."""
    async with stalled_and_steady(fake, redis_server) as (a, b, proxy):
        fake.chunk_gate = asyncio.Event()
        led = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 10)
        followed = asyncio.create_task(b.stream_chat(QUESTION))
        flights = b.gateway.shared_flights
        # (Relayed once A shows life since B came: its next renewal, within lease/3.)
        await eventually(lambda: flights.counts["frames_relayed"] >= 3, timeout=10)
        with held(proxy):
            fake.chunk_gate.set()
            _, raw_a = await led
        _, raw_b = await followed
    assert sse_text(raw_b) == sse_text(raw_a) == ANSWER_1
    assert fake.count() == 1
    assert flights.counts["broken"] == flights.counts["takeovers"] == 0


async def test_an_instance_closing_while_its_flights_end_waits_for_redis_leaves_no_task_behind(
    fake, redis_server
):
    """The end of a flight that Redis failed is tried again in the background: an instance
    that closes meanwhile ends that task too."""
    async with (
        a_link_that_stalls(redis_server) as (proxy, stalling, steady),
        run_gateway([fake.url], **steady) as b,
        contextlib.AsyncExitStack() as stack,
    ):
        a = await stack.enter_async_context(run_gateway([fake.url], **stalling))
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_until(lambda: fake.count() == 1, what="the call A leads")
        followed = asyncio.create_task(b.chat(QUESTION))
        await eventually(lambda: b.gateway.shared_flights.following == 1)
        flights = a.gateway.shared_flights
        with held(proxy):
            fake.gate.set()
            await led
            ending = set(flights._background)
            assert ending, "the flight's end is being tried again"
            await stack.aclose()  # A closes, its lifespan closing its layers
            assert all(task.done() for task in ending) and not flights._background
        # (A never ended the flight: B makes the call itself once A's lease runs out.)
        assert (await followed).status_code == 200


def idempotency_states(redis_server) -> list[bytes | None]:
    """The state (``s``) of every idempotency record in ``redis_server``."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        return [client.hget(key, "s") for key in client.scan_iter(match="*idem:*")]
    finally:
        client.close()


async def test_a_keyed_request_finishing_during_a_redis_pause_shorter_than_the_lease_is_replayed_not_run_again(
    fake, redis_server
):
    """A keyed request begun in Redis by A whose upstream answers while A's link to Redis
    stalls: A's client has its answer, and A keeps its record's lease and finishes it once
    Redis answers; a retry on B is replayed. Before, A tried the finish once: the record stayed
    ``processing`` (a retry on B got 409) until the lease ran out, then a retry on B ran the
    request again."""
    keyed = {"Idempotency-Key": "order-9"}
    async with stalled_and_steady(fake, redis_server, **LONG_RECORD_LEASE) as (a, b, proxy):
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(QUESTION, headers=keyed))
        await fake.wait_until(lambda: fake.count() == 1, what="the keyed request on A")
        with held(proxy):  # (far shorter than the record's lease)
            fake.gate.set()
            first = await led  # its finish failed: A's link stalled
        await eventually(
            lambda: idempotency_states(redis_server) == [b"s"],
            timeout=15,
            what="A's record finished in Redis",
        )
        retry = await b.chat(QUESTION, headers=keyed)
    assert first.status_code == retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true" and retry.json() == first.json()
    assert fake.count() == 1


async def test_an_instance_closing_while_a_keyed_requests_finish_waits_for_redis_leaves_no_task_behind(
    fake, redis_server
):
    """A finish that Redis failed is tried again in the background: an instance that closes
    meanwhile ends that task too."""
    async with (
        a_link_that_stalls(redis_server, **LONG_RECORD_LEASE) as (proxy, stalling, _),
        contextlib.AsyncExitStack() as stack,
    ):
        a = await stack.enter_async_context(run_gateway([fake.url], **stalling))
        records = a.gateway.layers.shared_idempotency
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(QUESTION, headers={"Idempotency-Key": "order-10"}))
        await fake.wait_until(lambda: fake.count() == 1, what="the keyed request on A")
        with held(proxy):
            fake.gate.set()
            assert (await led).status_code == 200
            finishing = set(records._finishing)
            assert finishing, "the record's finish is being tried again"
            await stack.aclose()  # A closes, its lifespan closing its layers
            assert all(task.done() for task in finishing) and not records._finishing
            assert not records._keepers  # (nor is its lease renewed any more)


async def test_a_lost_relay_tells_the_client_no_redis_address(fake, redis_server):
    """B's link to Redis stalls for longer than the lease while B relays A's stream: B's
    streaming client gets the error event, which says what happened, not Redis's address or
    exception (those are in B's log)."""
    async with stalled_and_steady(fake, redis_server, lease_ms=3000) as (b, a, proxy):
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        follower = asyncio.create_task(b.stream_chat(QUESTION))
        shared = b.gateway.shared_flights
        await eventually(lambda: shared.counts["frames_relayed"] >= 3)
        with held(proxy):
            await eventually(lambda: shared.counts["broken"] == 1, what="B giving the relay up")
        fake.chunk_gate.set()
        (_, raw_a), (response, raw) = await asyncio.gather(leader, follower)
    assert sse_text(raw_a) == ANSWER_1  # (A's own client is not Redis's concern)
    assert response.status_code == 200 and "data: [DONE]" not in raw
    error = json.loads(raw.strip().splitlines()[-1][len("data: ") :])["error"]
    assert error["code"] == "upstream_stream_broken"
    assert error["message"] == "lost the stream of the instance leading this call"
    for leak in (str(redis_server.port), "127.0.0.1", "Timeout", "Error", "redis", "Redis"):
        assert leak not in raw


async def test_a_stream_arriving_after_its_leader_died_is_answered_whole_by_a_takeover(
    fake, shared_redis
):
    """Instance A (a process) is SIGKILLed mid-stream: its frames are in Redis, its lock not
    expired yet. A streaming request then arriving on B gets no frame of the dead call (they
    wait for a sign of life that never comes) and no error: B's takeover answers it whole."""
    lease_ms = 600
    distributed = {
        "lease_ms": lease_ms,
        "retry_interval": 0.05,
        "cluster": shared_redis.cluster,
        **STEADY_LINK,
    }
    fake.chunk_gate = asyncio.Event()  # A's stream stops after its first words
    async with (
        instances(1, fake.url, shared_redis.url, {"distributed": distributed}) as (a,),
        run_gateway([fake.url], redis=shared_redis.url, distributed=distributed) as b,
    ):
        lost = asyncio.create_task(a.client.post("/v1/chat/completions", json=STREAMED))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        while (await a.stats())["redis"]["flights"]["frames_published"] < 3:
            await asyncio.sleep(0.01)
        a.kill()
        fake.chunk_gate = None  # the takeover's call answers at once
        response, raw = await b.stream_chat(QUESTION)
        with contextlib.suppress(httpx.HTTPError):
            await lost
    assert response.status_code == 200 and response.headers["x-carpool"] == "miss"
    assert sse_text(raw) == f"answer 2 to {QUESTION}" and raw.rstrip().endswith("[DONE]")
    shared = b.gateway.shared_flights
    assert (shared.counts["takeovers"], shared.counts["frames_relayed"]) == (1, 0)
    assert fake.count() == 2


async def test_a_stream_joining_a_relayed_call_after_its_leader_died_is_answered_whole_by_the_takeover(
    fake, shared_redis
):
    """As above, but instance C already relays A's stream to a client of its own when A is
    SIGKILLed: a streaming request then joining C's flight gets no frame of the dead call (it
    holds them until the call shows life since it came, which never happens) and no error: the
    takeover answers it whole, one call shared with a request that came to B meanwhile. C's
    first client, which got A's first words, gets the error event. (Before, the joiner was
    replayed those words and then the error, while the takeover's answer existed.)"""
    lease_ms = 2000  # (the joiner comes long before C can notice the death)
    distributed = {
        "lease_ms": lease_ms,
        "retry_interval": 0.05,
        "cluster": shared_redis.cluster,
        **STEADY_LINK,
    }
    fake.chunk_gate = asyncio.Event()  # A's stream stops after its first words
    async with (
        instances(1, fake.url, shared_redis.url, {"distributed": distributed}) as (a,),
        run_gateway([fake.url], redis=shared_redis.url, distributed=distributed) as b,
        run_gateway([fake.url], redis=shared_redis.url, distributed=distributed) as c,
    ):
        lost = asyncio.create_task(a.client.post("/v1/chat/completions", json=STREAMED))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        following = asyncio.create_task(c.stream_chat(QUESTION))
        counts = c.gateway.shared_flights.counts
        await until_relaying(c)
        (relaying,) = c.gateway.flights.running()
        a.kill()
        fake.chunk_gate = None  # the takeover's call answers at once
        late = asyncio.create_task(c.stream_chat(QUESTION))
        await eventually(lambda: relaying.clients == 2, what="the late request joining C's flight")
        elsewhere = asyncio.create_task(b.stream_chat(QUESTION))
        (response, raw), (_, raw_first), (_, raw_b) = await asyncio.wait_for(
            asyncio.gather(late, following, elsewhere), 20
        )
        with contextlib.suppress(httpx.HTTPError):
            await lost
    assert response.status_code == 200 and '"error"' not in raw
    assert sse_text(raw) == sse_text(raw_b) == f"answer 2 to {QUESTION}"
    assert raw.rstrip().endswith("data: [DONE]")
    error = json.loads(raw_first.strip().splitlines()[-1][len("data: ") :])["error"]
    assert error["code"] == "upstream_stream_broken"
    assert counts["broken"] == 1
    assert fake.count() == 2


async def test_a_stream_held_on_a_follow_that_relayed_nothing_takes_this_instances_own_call_live(
    fake, shared_redis
):
    """B's flight follows A's call, which sends nothing; its streaming joiner holds (the call is
    led elsewhere). B's follow times out and B makes its own call in the same flight: the joiner
    takes that call's frames live, as its lead client does, not only once it has ended."""
    async with two_gateways(fake, shared_redis, coalesce={"join_timeout_ms": 300}) as (a, b):
        gate = fake.gate = asyncio.Event()  # A's call: stalled before any frame
        stalled = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_for_calls(1)
        fake.gate = None
        chunk_gate = fake.chunk_gate = asyncio.Event()  # B's own call pauses after 2 chunks
        got: dict[str, list[str]] = {"lead": [], "joiner": []}

        async def client(name: str) -> None:
            async with b.client.stream("POST", "/v1/chat/completions", json=STREAMED) as response:
                async for text in response.aiter_text():
                    got[name].append(text)

        frames = lambda name: "".join(got[name]).count("data: ")  # noqa: E731
        lead = asyncio.create_task(client("lead"))
        await eventually(lambda: len(b.gateway.flights.running()) == 1, what="B's flight")
        (flight,) = b.gateway.flights.running()
        joiner = asyncio.create_task(client("joiner"))
        await eventually(lambda: flight.clients == 2, what="the joiner on B's flight")
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 10)  # B's own call streams
        await eventually(lambda: frames("lead") >= 2, what="B's lead client's first words")
        # (Before, the joiner held until B's call ended: this timed out.)
        await eventually(lambda: frames("joiner") >= 2, what="the joiner's first words, live")
        assert not chunk_gate.is_set()  # (B's call is still under way)
        chunk_gate.set()
        gate.set()
        await asyncio.wait_for(asyncio.gather(lead, joiner, stalled), 20)
    assert "".join(got["joiner"]) == "".join(got["lead"])


async def test_a_stream_joining_a_relayed_call_takes_its_frames_once_its_live_leader_renews(
    fake, shared_redis
):
    """The other side of the rule above: a streaming request joining C's relay of A's call
    while A's upstream is paused (no frame comes) takes the frames relayed so far once A's
    lease renewal shows it alive, not at the call's end; then the rest live."""
    lease = {"retry_interval": 0.05, "timeout": 2.0, "connect_timeout": 2.0, "lease_ms": 600}
    async with two_gateways(fake, shared_redis, distributed=lease) as (a, c):
        fake.chunk_gate = asyncio.Event()  # A's stream stops after its first words
        leader = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        following = asyncio.create_task(c.stream_chat(QUESTION))
        counts = c.gateway.shared_flights.counts
        await until_relaying(c, a)
        (relaying,) = c.gateway.flights.running()
        received: list[str] = []

        async def join() -> None:
            async with c.client.stream("POST", "/v1/chat/completions", json=STREAMED) as response:
                async for text in response.aiter_text():
                    received.append(text)

        late = asyncio.create_task(join())
        await eventually(lambda: relaying.clients == 2, what="the late request joining C's flight")
        await eventually(
            lambda: "".join(received).count("data: ") >= 3,
            what="the joiner's first frames, A's upstream still paused",
        )
        assert not late.done()
        fake.chunk_gate.set()
        (_, raw_a), (_, raw_c), _ = await asyncio.gather(leader, following, late)
    assert sse_text("".join(received)) == sse_text(raw_c) == sse_text(raw_a) == ANSWER_1
    assert counts["broken"] == 0
    assert fake.count() == 1


async def test_a_waiter_that_sees_nothing_within_the_join_timeout_runs_its_own_call(
    fake, shared_redis
):
    async with two_gateways(fake, shared_redis, coalesce={"join_timeout_ms": 300}) as (a, b):
        gate = fake.gate = asyncio.Event()
        slow = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_for_calls(1)
        fake.gate = None  # the next call answers at once
        # Follows A's call, gives up after 300 ms: its own call answers while A's still waits.
        response = await b.chat(QUESTION)
        assert not slow.done()
        assert (response.status_code, response.headers["x-carpool"]) == (200, "miss")
        assert content(response) == f"answer 2 to {QUESTION}"
        assert b.gateway.shared_flights.counts["alone"] == 1
        gate.set()
        assert content(await slow) == ANSWER_1


async def test_waiters_on_one_instance_timing_out_on_a_remote_call_share_one_fresh_call(
    fake, shared_redis
):
    """Five requests on B follow A's stalled call through one local flight. Its lead gives A's
    call up at the join timeout and makes its own; its joiners, timing out at the same moment,
    share that call. Before, they retook a flight of their own: a third call (one instance
    makes two: the stalled one and one fresh call)."""
    async with two_gateways(fake, shared_redis, coalesce={"join_timeout_ms": 300}) as (a, b):
        gate = fake.gate = asyncio.Event()
        stalled = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_for_calls(1)
        fake.gate = None
        fake.delay = 0.05  # (the fresh call's first byte comes after the joiners' timeout)
        waiters = await asyncio.gather(*(b.chat(QUESTION) for _ in range(5)))
        assert [content(r) for r in waiters] == [f"answer 2 to {QUESTION}"] * 5
        assert fake.count() == 2 and b.gateway.shared_flights.counts["alone"] == 1
        gate.set()
        assert content(await stalled) == ANSWER_1


async def test_an_unstored_answer_is_replayed_on_another_instance_within_the_window(
    fake, shared_redis
):
    """ttl 0 (type factual): never stored, but joinable within the window, on every instance."""
    async with two_gateways(fake, shared_redis) as (a, b):
        factual = {"x-carpool-type": "factual"}
        first = await a.chat(QUESTION, headers=factual)
        again = await b.chat(QUESTION, headers=factual)
        assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "coalesced")
        assert again.json() == first.json()
        # no-cache joins only a call still running: a finished one is not replayed.
        fresh = await b.chat(QUESTION, headers={**factual, "Cache-Control": "no-cache"})
        assert fresh.headers["x-carpool"] == "miss"
        assert content(fresh) == f"answer 2 to {QUESTION}" and fake.count() == 2


async def test_a_no_cache_request_never_takes_a_replay_of_a_call_that_ended_before_it(
    fake, redis_server
):
    """B's flight replays a call A finished (its answer lingering in the window); a no-cache
    request on B joins that flight while its claim is on its way (B's link held): it is not
    handed that finished answer, but makes a fresh call, as in one process (where it would
    have found the call finished, and joined none)."""
    from fakes.latency_proxy import LinkProxy

    factual = {"x-carpool-type": "factual"}  # (ttl 0: never stored, shared only by the window)
    window = {"window_ms": 600_000, "max_window_ms": 600_000, "adaptive": False}
    proxy = await LinkProxy(redis_server.host, redis_server.port).start()
    distributed = {"retry_interval": 0.05, "timeout": 30}  # (the hold is no outage)
    try:
        async with (
            run_gateway(
                [fake.url], coalesce=window, **redis_settings(redis_server, **distributed)
            ) as a,
            run_gateway([fake.url], coalesce=window, redis=proxy.url, distributed=distributed) as b,
        ):
            first = await a.chat(QUESTION, headers=factual)
            proxy.hold()
            flights = b.gateway.flights
            plain = asyncio.create_task(b.chat(QUESTION, headers=factual))
            await eventually(lambda: sum(f.clients for f in flights.running()) == 1)
            no_cache = {**factual, "Cache-Control": "no-cache"}
            fresh = asyncio.create_task(b.chat(QUESTION, headers=no_cache))
            await eventually(lambda: sum(f.clients for f in flights.running()) == 2)
            proxy.release()
            replayed, fresh_reply = await plain, await fresh
    finally:
        await proxy.aclose()
    assert (replayed.headers["x-carpool"], content(replayed)) == ("coalesced", content(first))
    assert fresh_reply.headers["x-carpool"] == "miss"
    assert content(fresh_reply) == f"answer 2 to {QUESTION}" and fake.count() == 2


async def backdate_lingering_lock(target, seconds: float) -> None:
    """Make the one call lingering in ``target``'s window look as if it ended ``seconds``
    earlier: its lock says when it ended (``=TOKEN:MS``, Redis time)."""
    import redis.asyncio as aredis

    raw = aredis.Redis.from_url(target.url)
    try:
        (lock,) = [key async for key in raw.scan_iter(match="carpool:lock:*")]
        token, ended = (await raw.get(lock)).decode().split(":")
        assert token.startswith("=")
        await raw.set(lock, f"{token}:{int(ended) - int(seconds * 1000)}", keepttl=True)
    finally:
        await raw.aclose()


async def test_a_replayed_answer_is_as_old_as_its_call_for_max_age_on_another_instance(
    fake, redis_server
):
    """The age of an answer B replayed from A's window counts from the end of A's call, not
    from B's replay: a max-age request on B does not take it once it is older than it accepts
    (here the call ended 100 s ago, as its lock in Redis says)."""
    factual = {"x-carpool-type": "factual"}  # (ttl 0: never stored, shared only by the window)
    window = {"window_ms": 600_000, "max_window_ms": 600_000, "adaptive": False}
    async with two_gateways(fake, redis_server, coalesce=window) as (a, b):
        first = await a.chat(QUESTION, headers=factual)
        await backdate_lingering_lock(redis_server, 100)
        replayed = await b.chat(QUESTION, headers=factual)
        assert (replayed.headers["x-carpool"], content(replayed)) == ("coalesced", content(first))
        younger = {**factual, "Cache-Control": "max-age=50"}
        fresh = await b.chat(QUESTION, headers=younger)
        assert fresh.headers["x-carpool"] == "miss"
        assert content(fresh) == f"answer 2 to {QUESTION}" and fake.count() == 2


async def test_a_replay_lingers_on_another_instance_no_longer_than_its_window_from_the_call_end(
    fake, redis_server
):
    """B keeps a call it replayed for its own window counted from the end of that call, not
    from its replay (windows would pile up from instance to instance): here A's window is
    longer than B's, A's call ended 50 s before B replays it (as its lock says; B's window is
    60 s), and once 15 s more have passed on B's clock B keeps nothing: its next request
    replays from Redis again (the lock, on Redis's clock, is still younger than B's window)."""
    from carpool.clock import ManualClock

    factual = {"x-carpool-type": "factual"}  # (ttl 0: never stored, shared only by the window)
    settings = redis_settings(redis_server, retry_interval=0.05, timeout=2.0)
    long, short = (
        {"window_ms": ms, "max_window_ms": ms, "adaptive": False} for ms in (600_000, 60_000)
    )
    clock = ManualClock()
    async with (
        run_gateway([fake.url], coalesce=long, **settings) as a,
        run_gateway([fake.url], clock, coalesce=short, **settings) as b,
    ):
        first = await a.chat(QUESTION, headers=factual)
        await backdate_lingering_lock(redis_server, 50)
        again = [await b.chat(QUESTION, headers=factual)]
        clock.advance(15)  # (65 s after A's call ended: B's window from the replay is open)
        again.append(await b.chat(QUESTION, headers=factual))
        assert [r.headers["x-carpool"] for r in again] == ["coalesced", "coalesced"]
        assert {content(r) for r in again} == {content(first)} and fake.count() == 1
        assert b.gateway.shared_flights.counts["replayed"] == 2


@pytest.mark.parametrize(
    "own",
    [
        {"window_ms": 0, "adaptive": False},
        {"window_ms": 300, "adaptive": False},
        {"window_ms": 0, "adaptive": True},
        {"window_ms": 300, "max_window_ms": 500, "adaptive": True},
    ],
    ids=["none", "300ms", "adaptive-none", "adaptive-300ms"],
)
@pytest.mark.parametrize("asked", [{}, {"Cache-Control": "max-age=600"}], ids=["", "max-age"])
async def test_an_instance_replays_no_call_that_ended_longer_ago_than_its_own_window(
    fake, redis_server, own, asked
):
    """A fleet mid-change: A's window 3 s, B's shorter (0: no finished answer lingers). A call
    A finished 1 s ago (as its lock in Redis says) lingers for A, but B does not replay it, as
    it would not join a call of its own that ended as long ago: a miss, a fresh call. (Before,
    B replayed it as ``coalesced`` for the whole of A's window, its own window 0 or not.) Nor
    to a request that accepts answers ten minutes old: ``max_age`` bounds a replay as the
    window does, never lengthens it. (The request's type has TTL 0: no stored answer, only the
    lingering flight, could serve it.)"""
    factual = {"x-carpool-type": "factual"}  # (ttl 0: never stored, shared only by the window)
    settings = redis_settings(redis_server, retry_interval=0.05, timeout=2.0)
    long = {"window_ms": 3000, "max_window_ms": 3000, "adaptive": False}
    async with (
        run_gateway([fake.url], coalesce=long, **settings) as a,
        run_gateway([fake.url], coalesce=own, **settings) as b,
    ):
        assert (await a.chat(QUESTION, headers=factual)).headers["x-carpool"] == "miss"
        await backdate_lingering_lock(redis_server, 1)
        again = await b.chat(QUESTION, headers={**factual, **asked})
        assert again.headers["x-carpool"] == "miss"
        assert content(again) == f"answer 2 to {QUESTION}" and fake.count() == 2
        assert b.gateway.shared_flights.counts["replayed"] == 0


async def test_a_no_store_leaders_answer_does_not_linger_on_an_instance_that_followed_it(
    fake, shared_redis
):
    """Lingering in the window is a form of storing: a no-store request's call, followed by
    a plain request on B, is not handed to B's next request (in one process, a no-store
    leader's flight does not linger either)."""
    window = {"window_ms": 600_000, "max_window_ms": 600_000, "adaptive": False}
    async with two_gateways(fake, shared_redis, coalesce=window) as (a, b):
        fake.gate = asyncio.Event()
        leader = asyncio.create_task(a.chat(QUESTION, headers={"Cache-Control": "no-store"}))
        await fake.wait_for_calls(1)
        follower = asyncio.create_task(b.chat(QUESTION))
        await eventually(lambda: b.gateway.shared_flights.counts["followed"] == 1)
        fake.gate.set()
        led, followed = await leader, await follower
        assert (led.headers["x-carpool"], followed.headers["x-carpool"]) == ("miss", "coalesced")
        assert content(followed) == ANSWER_1
        fake.gate = None
        later = await b.chat(QUESTION)
        assert later.headers["x-carpool"] == "miss"
        assert content(later) == f"answer 2 to {QUESTION}" and fake.count() == 2


def test_an_answer_record_of_an_older_instance_without_the_linger_field_lingers_as_before():
    import orjson

    from carpool.answer import Answer
    from carpool.redis.flight_protocol import answer_record, lingers

    answer = Answer("chat", b"{}", True)
    meta = orjson.loads(answer_record(answer)["m"])
    assert lingers(meta) and not lingers(orjson.loads(answer_record(answer, False)["m"]))
    del meta["l"]  # (as an instance before the field wrote it)
    assert lingers(meta)


def _upstream_errors(kind: type) -> list[type]:
    return [kind] + [sub for each in kind.__subclasses__() for sub in _upstream_errors(each)]


@pytest.mark.parametrize(
    "kind",
    [
        kind
        for kind in _upstream_errors(errors.UpstreamError)
        # (A status error has a record of its own; ``LeaderLost`` is made where a relay of
        # another instance's call was lost, never a leader's error.)
        if kind.__module__ == errors.__name__
        and kind not in (errors.UpstreamStatusError, errors.LeaderLost)
    ],
    ids=lambda kind: kind.__name__,
)
def test_a_leaders_error_reaches_a_follower_on_another_instance_as_the_same_error(kind):
    """Rebuilt as a plain ``UpstreamError``, a busy replica's 503 (``UpstreamBusy``) lost its
    ``Retry-After``, a stalled stream's 504 its ``x-should-retry: false``."""
    import orjson

    from carpool.redis.flight_protocol import error_from, error_record

    original = kind("what the leader was told")
    followed = error_from(orjson.loads(error_record(original)["m"]), b"")
    assert type(followed) is kind
    assert (followed.status, followed.code) == (original.status, original.code)
    assert followed.headers() == original.headers()


async def test_without_stream_usage_a_call_asked_without_usage_is_shared_elsewhere_only_by_its_shape(
    fake, redis_server
):
    async with two_gateways(fake, redis_server, upstream={"stream_usage": False}) as (a, b):
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(a.stream_chat(QUESTION))  # asked without usage
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        await eventually(lambda: a.gateway.shared_flights.counts["led"] == 1)
        alike = asyncio.create_task(b.stream_chat(QUESTION))  # follows it from the other instance
        await eventually(lambda: b.gateway.shared_flights.counts["followed"] == 1)
        # A non-streaming client's answer has the usage: it does not follow that call.
        waiting = asyncio.create_task(b.chat(QUESTION))
        try:
            await fake.wait_for_calls(2)  # its own call, while the other one is held
        finally:
            fake.chunk_gate.set()
        plain = await waiting
        assert plain.headers["x-carpool"] == "miss" and plain.json()["usage"]["total_tokens"] > 0
        (led, raw), (joined, joined_raw) = await leader, await alike
    assert (led.headers["x-carpool"], joined.headers["x-carpool"]) == ("miss", "coalesced")
    assert sse_text(joined_raw) == sse_text(raw) == ANSWER_1 and '"usage"' not in joined_raw
    assert fake.count() == 2


async def until_serving(
    client: httpx.AsyncClient, proc: subprocess.Popen, log, timeout: float = 60.0
) -> None:
    """Until the gateway in ``proc`` answers /healthz (it exits, or takes too long: fail). The
    bound is generous: a start that loads the semantic models in each of two workers took over
    10 s on this shared 2-core machine under load; one that exits fails at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        assert proc.poll() is None, f"instance A exited: {log.read_text()[-2000:]}"
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/healthz", timeout=0.5)).status_code == 200:
                problem = await answered_by(client, proc)
                assert problem is None, f"{problem}: {log.read_text()[-2000:]}"
                return
        assert loop.time() < deadline, f"instance A did not start: {log.read_text()[-2000:]}"
        await asyncio.sleep(0.02)


async def test_redis_restarted_empty_mid_call_nobody_fails_and_a_retry_may_run_twice(
    fake, killable_redis
):
    """What the README promises when Redis loses its data (a restart, a failover that lost
    writes): no request fails and none gets another's answer; what is lost is the dedup of the
    call in flight (a follower takes over) and of an idempotency key still processing."""
    key = {"Idempotency-Key": "order-7"}
    async with two_gateways(fake, killable_redis) as (a, b):
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(QUESTION))
        keyed = asyncio.create_task(a.chat("charge", headers=key))
        await fake.wait_for_calls(2)
        follower = asyncio.create_task(b.chat(QUESTION))
        await eventually(lambda: b.gateway.shared_flights.following == 1)
        killable_redis.restart(kill=True)  # empty: nothing is persisted
        retried = asyncio.create_task(b.chat("charge", headers=key))
        await fake.wait_for_calls(3)  # the record is gone: it runs again
        fake.gate.set()
        responses = await asyncio.gather(led, keyed, follower)
        retry = await retried
    assert [r.status_code for r in responses] == [200, 200, 200] and retry.status_code == 200
    assert content(responses[0]).endswith(QUESTION) and content(responses[2]).endswith(QUESTION)
    assert content(responses[1]).endswith("charge") and content(retry).endswith("charge")
    assert content(retry) != content(responses[1])  # run twice: two different answers
    assert fake.count("/v1/chat/completions") in (3, 4)  # + B's takeover, unless A's answer


async def test_a_cluster_node_killed_mid_flight_no_request_fails(fake):
    """The fault suites above kill a single server; on a cluster one node dies alone: here the
    one holding the flight's lock and stream (the other nodes keep answering)."""
    from conftest import redis_keys
    from fakes.redis_cluster import RedisCluster

    with RedisCluster() as cluster:
        # (B reads again for the lease, a stall being no death: a short one, for a short test.)
        async with two_gateways(fake, cluster, distributed={"lease_ms": 1000}) as (a, b):
            fake.gate = asyncio.Event()
            led = asyncio.create_task(a.chat(QUESTION))
            await fake.wait_for_calls(1)
            followed = asyncio.create_task(b.chat(QUESTION))
            await eventually(lambda: b.gateway.shared_flights.following == 1)
            holders = [
                node
                for node in cluster.nodes
                if any(b"lock:" in key for key in await redis_keys(node))
            ]
            assert len(holders) == 1
            holders[0].kill()
            fake.gate.set()
            responses = await asyncio.gather(led, followed)
            after = [await a.chat("after"), await b.chat("after")]
    assert [r.status_code for r in (*responses, *after)] == [200] * 4
    assert content(responses[0]) == ANSWER_1 and content(responses[1]).endswith(QUESTION)


async def test_frames_published_while_a_flush_is_on_its_way_are_sent_before_the_flight_closes(
    fake, shared_redis
):
    """The leader's publisher: a call that ends while a batch of its frames is on its way to
    Redis still sends the frames published meanwhile before its final record (followers saw a
    stream with gaps)."""
    from carpool.broadcast import Broadcast
    from carpool.redis.flights import _Publisher

    config = {"redis": shared_redis.url, "distributed": {"cluster": shared_redis.cluster}}
    async with run_gateway([fake.url], **config) as gw:
        flights = gw.gateway.shared_flights
        broadcast = Broadcast()
        stream = "carpool-test:{publisher}:stream"
        publisher = _Publisher(
            flights,
            "carpool-test:{publisher}:lock",
            stream,
            "carpool-test:{publisher}:stale",
            "t",
            broadcast,
        )
        broadcast.publish(b"data: 0\n\n")
        await asyncio.sleep(0)  # (its first flush: sent, its answer not yet read)
        assert publisher.sending == 1 and publisher.sent == 0
        broadcast.publish(b"data: 1\n\n")
        broadcast.publish(b"data: 2\n\n")
        await publisher.close()
        entries = await flights._client.xrange(stream)
        await flights._client.delete(stream)
    assert [fields[b"f"] for _, fields in entries] == [
        b"data: 0\n\n",
        b"data: 1\n\n",
        b"data: 2\n\n",
    ]


async def test_closing_the_invalidation_channel_while_redis_hangs_does_not_hang(killable_redis):
    """The subscriber's own connection is closed within ``socket_timeout`` even when Redis
    (SIGSTOP) answers nothing: an instance shutting down is not held by a hung Redis."""
    from carpool.redis import invalidation
    from carpool.redis.connection import connect

    client = connect(killable_redis.url, socket_timeout=0.3, cluster=killable_redis.cluster)
    channel = invalidation.InvalidationChannel(
        client, lambda: 0, socket_timeout=0.3, retry_interval=0.05, owns_client=True
    )
    channel.start()
    await eventually(lambda: channel.listening, what="subscribed")
    for pid in killable_redis.pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        closing = asyncio.ensure_future(channel.aclose())
        done, _ = await asyncio.wait({closing}, timeout=10)
        assert closing in done, "aclose still waiting on a hung Redis"
        closing.result()
    finally:
        for pid in killable_redis.pids:
            os.kill(pid, signal.SIGCONT)


async def test_the_invalidation_subscriber_stops_by_itself_once_its_channel_is_closed(
    shared_redis, monkeypatch
):
    """As if ``aclose``'s cancellation were swallowed by the client library (``stop_reader``):
    the closed flag alone ends the subscriber, its pub/sub connection closed."""
    from carpool.redis import invalidation
    from carpool.redis.connection import connect

    monkeypatch.setattr(invalidation, "WAIT", 0.05)
    client = connect(shared_redis.url, cluster=shared_redis.cluster)
    channel = invalidation.InvalidationChannel(client, lambda: 0, owns_client=True)
    channel.start()
    try:
        await eventually(lambda: channel.listening, what="subscribed")
        subscriber = channel._subscriber
        assert subscriber is not None
        channel._closed = True  # (aclose's first step; no cancellation here)
        await asyncio.wait_for(subscriber, 10)
        assert not channel.listening
    finally:
        await channel.aclose()


# --- the leader's end: stored before its lock goes, not at all once marked stale -------------


@contextlib.asynccontextmanager
async def shared_flights_on(target, distributed=None, **coalesce):
    """The shared flights as a gateway builds them (``wiring``), on ``target``."""
    from carpool.config import Config
    from carpool.wiring import build_shared_flights, build_store

    config = Config(
        upstreams=["http://127.0.0.1:9/v1"],
        coalesce=coalesce,
        **redis_settings(target, **(distributed or {})),
    )
    store = build_store(config)
    flights = build_shared_flights(config, store)
    assert flights is not None
    try:
        yield flights
    finally:
        await flights.aclose()
        await store.aclose()


async def test_a_leaders_answer_is_stored_before_its_lock_goes_when_nothing_lingers(redis_server):
    """Without a window the final record deletes the lock: a request on another instance that
    finds no lock then must find the answer stored, or it leads a second call. So the store
    comes first; the lock stays for as long as the store has not returned (its END ran at once
    beside the store before, and the lock went within a round trip)."""
    from carpool.answer import Answer
    from carpool.broadcast import Broadcast
    from carpool.redis.flight_protocol import flight_keys

    async with shared_flights_on(redis_server, window_ms=0) as flights:
        lock, _ = flight_keys(flights.prefix, "k")
        storing, stored = asyncio.Event(), asyncio.Event()

        async def call(_: Broadcast) -> Answer:
            return Answer("chat", b"{}", True)

        async def keep(_: Answer) -> str:
            storing.set()
            await stored.wait()
            return ""

        led = asyncio.create_task(flights.run("k", Broadcast(), call, keep))
        await storing.wait()
        loop = asyncio.get_running_loop()
        until = loop.time() + 0.2  # (the old order deleted it within a round trip)
        while loop.time() < until:
            assert await flights._client.exists(lock) == 1
            await asyncio.sleep(0.01)
        stored.set()
        await led
        assert await flights._client.exists(lock) == 0  # no window: gone once ended


async def test_a_leader_whose_lock_an_invalidation_marked_does_not_store_its_answer(redis_server):
    """An invalidation while a call runs (``forget_all`` from any instance marks its lock
    ``~TOKEN``): its answer may predate what was dropped, so it is not stored; its clients
    and followers still get it."""
    from carpool.answer import Answer
    from carpool.broadcast import Broadcast

    async with shared_flights_on(redis_server) as flights:
        kept: list[Answer] = []

        async def call(_: Broadcast) -> Answer:
            assert await flights.forget_all() == 1  # (an invalidation, meanwhile)
            return Answer("chat", b"{}", True)

        async def keep(answer: Answer) -> str:
            kept.append(answer)
            return "stored-key"

        async def plain(_: Broadcast) -> Answer:
            return Answer("chat", b"{}", True)

        answer = await flights.run("marked", Broadcast(), call, keep)
        assert answer.body == b"{}" and kept == []
        await flights.run("unmarked", Broadcast(), plain, keep)
        assert len(kept) == 1


async def test_a_claim_whose_clients_left_while_it_was_on_its_way_leaves_no_lock(redis_server):
    """The clients leaving cancels the flight while its claim is on its way to Redis: the claim
    may have landed all the same (its reply never read), a lock in this instance's name that
    nobody renews or ends. It is taken back, so a request for the key on any instance leads a
    call at once instead of waiting lease_ms on a flight nobody runs."""
    from carpool.answer import Answer
    from carpool.broadcast import Broadcast
    from carpool.redis.flight_protocol import flight_keys

    # (A lease far longer than the test: only taking the claim back removes the lock.)
    async with shared_flights_on(redis_server, {"lease_ms": 600_000}) as flights:
        lock, _ = flight_keys(flights.prefix, "left")
        claim, landed = flights._claim, asyncio.Event()

        async def claim_then_the_client_leaves(**kwargs):
            reply = await claim(**kwargs)
            landed.set()
            await asyncio.Event().wait()  # (its reply is never read: the cancellation comes)
            return reply

        async def call(_: Broadcast) -> Answer:
            return Answer("chat", b"{}", True)

        async def keep(_: Answer) -> str:
            return ""

        flights._claim = claim_then_the_client_leaves
        leaving = asyncio.create_task(flights.run("left", Broadcast(), call, keep))
        await landed.wait()
        assert await flights._client.exists(lock) == 1
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        flights._claim = claim

        loop = asyncio.get_running_loop()
        until = loop.time() + 5
        while await flights._client.exists(lock) and loop.time() < until:
            await asyncio.sleep(0.005)
        assert await flights._client.exists(lock) == 0, "the claim was not taken back"
        assert (await flights.run("left", Broadcast(), call, keep)).body == b"{}"
        assert flights.counts["led"] == 1 and flights.counts["alone"] == 0


async def test_a_leaders_stream_made_again_after_redis_lost_it_still_expires(redis_server):
    """Redis restarted empty under a streaming call (here: its stream deleted) makes the next
    frames' XADD create the stream again; it gets an expiry with them, as the first did (its
    leader may die before its end, whose script sets one too)."""
    from carpool.answer import Answer
    from carpool.broadcast import Broadcast
    from carpool.redis.flight_protocol import flight_keys

    async with shared_flights_on(redis_server) as flights:
        client, (_, streams) = flights._client, flight_keys(flights.prefix, "k")

        async def the_stream() -> bytes:
            for _ in range(500):  # (the publisher flushes within a round trip)
                found = [key async for key in client.scan_iter(match=streams + "*")]
                if found and await client.xlen(found[0]) >= 1:
                    return found[0]
                await asyncio.sleep(0.01)
            raise AssertionError("no stream")

        ttls: list[int] = []

        async def call(broadcast: Broadcast) -> Answer:
            broadcast.publish(b"data: 1\n\n")
            await client.delete(await the_stream())  # (as a Redis restarted empty)
            broadcast.publish(b"data: 2\n\n")
            ttls.append(await client.pttl(await the_stream()))  # before its end's script
            return Answer("chat", b"{}", True)

        async def keep(_: Answer) -> str:
            return ""

        await flights.run("k", Broadcast(), call, keep)
        assert ttls[0] > 0


@pytest.mark.parametrize("window_ms", [0, 1000])
async def test_a_leader_marked_while_it_stored_takes_its_answer_back(redis_server, window_ms):
    """The mark of an invalidation that came after the leader read its lock, while it stored
    (that invalidation may have dropped its entries before this store landed): read again
    once stored, the lock is marked, or gone (its end dropped a marked lock), and the answer
    is taken back (``forget``, with the key it was stored under). Without one, nothing is."""
    from carpool.answer import Answer
    from carpool.broadcast import Broadcast

    async with shared_flights_on(redis_server, window_ms=window_ms) as flights:
        taken_back: list[str] = []

        async def call(_: Broadcast) -> Answer:
            return Answer("chat", b"{}", True)

        async def forget(key: str) -> bool:
            taken_back.append(key)
            return True

        async def marked_meanwhile(_: Answer) -> str:
            assert await flights.forget_all() == 1  # (an invalidation, during the store)
            return "stored-key"

        async def quietly(_: Answer) -> str:
            return "other-key"

        await flights.run("a", Broadcast(), call, marked_meanwhile, forget=forget)
        assert taken_back == ["stored-key"]
        await flights.run("b", Broadcast(), call, quietly, forget=forget)
        assert taken_back == ["stored-key"]


async def test_each_instance_serves_no_answer_older_than_its_own_ttl(fake, shared_redis):
    """Each instance reads with its own TTLs, whoever stored the answer: one whose config says
    5 s (or 0, never cached) serves no answer older than that stored by an instance with a
    longer TTL (a TTL lowered on some instances first, or answers stored before it was). Its
    claim of the flight, which also finds an answer stored (no window), reads it so too. An
    answer's age is Redis time (``test_redis_clock``): it is Redis's clock that moves here."""
    from test_redis_clock import redis_time_passes

    longer = {"default_ttl": 3600, "types": {"faq": {"ttl": 3600}}}
    shorter = {"default_ttl": 1, "types": {"faq": {"ttl": 0}}}
    no_window = {"window_ms": 0}
    async with (
        gateways(1, fake, shared_redis, cache=longer, coalesce=no_window) as (a,),
        gateways(1, fake, shared_redis, cache=shorter, coalesce=no_window) as (b,),
    ):
        faq = {"x-carpool-type": "faq"}
        assert (await a.chat("never cached", headers=faq)).headers["x-carpool"] == "miss"
        assert (await b.chat("never cached", headers=faq)).headers["x-carpool"] == "miss"
        assert (await a.chat("aging")).headers["x-carpool"] == "miss"
        assert (await b.chat("aging")).headers["x-carpool"] == "hit"
        await redis_time_passes(shared_redis, 1.2)  # (past B's TTL; A's keeps them in Redis)
        assert (await b.chat("aging")).headers["x-carpool"] == "miss"
        assert (await a.chat("aging")).headers["x-carpool"] == "hit"
        assert fake.count() == 4


async def _entry_moved_to_a_new_master(cluster, *, finish: bool = True) -> None:
    """The slot of the one stored answer (its entry's keys) moved to a master added to
    ``cluster`` now (a scale-out); not ``finish``: left migrating, its keys moved."""
    import redis

    entry_key = next(key for key in await redis_keys(cluster) if key.startswith(b"carpool:e:"))
    with redis.Redis(host=cluster.nodes[0].host, port=cluster.nodes[0].port) as client:
        slot = client.execute_command("CLUSTER", "KEYSLOT", entry_key)
    added = await asyncio.to_thread(cluster.add_master)
    await asyncio.to_thread(cluster.move_slot, slot, added, finish=finish)


async def test_an_invalidation_of_everything_reaches_a_master_added_since_the_instance_started(
    fake, own_redis_cluster
):
    """A master added to the cluster (a scale-out) and given a slot holding a stored answer:
    ``{"all": true}`` sent to an instance that had not been redirected there yet scanned the
    masters it knew, answered 200, and the answer was served on as a hit from the new master.
    The topology is read again before the keyspace is scanned."""
    cluster = own_redis_cluster
    admin = {"Authorization": "Bearer t"}
    async with two_gateways(fake, cluster, admin_token="t") as (a, b):
        first = await a.chat("scale out")
        assert first.headers["x-carpool"] == "miss"
        await _entry_moved_to_a_new_master(cluster)
        invalidated = await b.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        assert invalidated.status_code == 200, invalidated.text
        again = await a.chat("scale out")
    assert again.headers["x-carpool"] == "miss"
    assert fake.count() == 2


async def test_a_read_redirected_to_a_master_the_instance_does_not_know_yet_follows_it(
    fake, own_redis_cluster
):
    """A slot migrating to a master added since the instance read the topology: a read of a
    key already moved is redirected there (ASK), and redis-py, not knowing that node, failed
    (an AttributeError inside it): Redis taken for failing, the instance degraded, the stored
    answer not served. The node is learned as a MOVED would teach it."""
    cluster = own_redis_cluster
    async with two_gateways(fake, cluster, admin_token="t") as (a, b):
        first = await a.chat("mid-migration")
        await _entry_moved_to_a_new_master(cluster, finish=False)
        again = await b.chat("mid-migration")
        health = (await b.client.get("/healthz")).json()
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
    assert fake.count() == 1
    assert health["redis"]["state"] == "up" and health["redis"]["errors"] == 0, health


async def test_a_command_on_a_slot_caught_mid_migration_leaves_the_instance_up(
    fake, own_redis_cluster
):
    """A reshard caught between its steps: a command on several keys of the slot, some moved
    and some not (a flight's claim reads the entry, moved, and writes the lock, not there
    yet), is refused with TRYAGAIN until redis-py's retries run out. Redis answered: the
    instance served the request (a miss, called upstream) and stays up, the refusal counted
    apart (``slot_moving``), not as Redis failing (a degraded period, sharing off)."""
    cluster = own_redis_cluster
    async with two_gateways(fake, cluster, admin_token="t") as (a, b):
        first = await a.chat("mid-reshard")
        await _entry_moved_to_a_new_master(cluster, finish=False)
        again = await b.chat("mid-reshard", headers={"cache-control": "no-cache"})
        health = (await b.client.get("/healthz")).json()
        stats = (await b.client.get("/stats", headers={"Authorization": "Bearer t"})).json()
        metrics = (await b.client.get("/metrics", headers={"Authorization": "Bearer t"})).text
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "miss")
    assert fake.count() == 2
    assert health["redis"]["state"] == "up" and health["redis"]["errors"] == 0, health
    moving = stats["redis"]["slot_moving"]
    assert moving >= 1, stats["redis"]
    assert f"carpool_redis_slot_moving_total {float(moving)}" in metrics


async def test_an_instance_on_a_port_another_gateway_holds_is_a_failure_not_that_gateway(
    fake, monkeypatch
):
    """Two draws of one port: the later instance's /healthz is answered by the gateway already
    there (before its own process, still starting, finds the port taken); ``instances`` says so
    rather than hand the test another test's gateway, its settings and its cache."""
    import fakes.instances as instances_module

    async with instances(1, fake.url, None) as (there,):
        monkeypatch.setattr(instances_module, "free_port", lambda *_: there.port)
        with pytest.raises(AssertionError, match="another process's"):
            async with instances(1, fake.url, None):
                pass


REVOKED = {"Authorization": "Bearer sk-r", "x-carpool-namespace": "pub"}
SHARED_PUB = {"tenant": {"shared_namespaces": ["pub"]}, "coalesce": NO_WINDOW}


async def test_a_refusal_seen_while_redis_is_out_of_reach_is_told_once_it_answers(
    fake, redis_server
):
    """A refusal's PUBLISH was tried once, and not at all while the instance's Redis health
    said to wait: lost, the other instances accepted the refused key until
    `tenant.accepted_ttl`. It is tried again until Redis takes it."""
    from fakes.waiting import eventually

    fake.valid_keys = {"sk-a", "sk-r"}
    async with stalled_and_steady(fake, redis_server, **SHARED_PUB) as (a, b, proxy):
        assert (await b.chat("hi", headers=REVOKED)).status_code == 200  # accepted on B
        await eventually(lambda: b.gateway.invalidations.listening, what="B subscribed")
        fake.valid_keys = {"sk-a"}  # revoked upstream
        with held(proxy):
            assert (await a.chat("hello", headers=REVOKED)).status_code == 401  # seen on A
        await eventually(
            lambda: b.gateway.invalidations.counts["refusals_received"] == 1,
            timeout=30,
            what="the refusal told to B once A's Redis answers",
        )
        assert len(b.gateway.accepted) == 0


async def test_an_instance_whose_first_subscription_failed_forgets_every_acceptance_once_subscribed(
    fake, redis_server
):
    """The first subscription forgot nothing (nothing lingers at startup), even when an attempt
    had failed before it: a refusal told meanwhile was missed, and the key accepted there
    read the shared namespaces on."""
    from fakes.waiting import eventually

    fake.valid_keys = {"sk-r"}
    async with a_link_that_stalls(redis_server, **SHARED_PUB) as (proxy, stalling, _):
        with held(proxy):
            async with run_gateway([fake.url], **stalling) as a:
                channel = a.gateway.invalidations
                await eventually(
                    lambda: channel.counts["errors"] >= 1, timeout=30, what="A's first try failed"
                )
                assert (await a.chat("hi", headers=REVOKED)).status_code == 200  # accepted
                assert len(a.gateway.accepted) == 1
                proxy.release()
                await eventually(lambda: channel.listening, timeout=30, what="A subscribed")
                assert len(a.gateway.accepted) == 0  # (a refusal may have been missed)


async def test_a_refusal_is_told_once_at_a_time_and_given_up_after_the_acceptance_ttl(
    monkeypatch,
):
    """``tell_refused`` retries until Redis takes the refusal, but not for ever: past
    ``refusal_retry_s`` (the gateway's ``tenant.accepted_ttl``: nobody accepts the key on an
    old answer any more) it gives up, counted; a tenant's refusal told again meanwhile is the
    one pending, past ``MAX_TELLING`` tenants waiting a refusal is counted, not told, and one
    task tells them all (a task a refusal, retrying while Redis was down, took a CPU and held
    the shutdown for minutes under a flood of 401s)."""
    from carpool.redis import invalidation
    from carpool.redis.connection import connect

    monkeypatch.setattr(invalidation, "MAX_TELLING", 2)
    client = connect(f"redis://127.0.0.1:{free_port()}", socket_timeout=0.2)  # (nobody there)
    channel = invalidation.InvalidationChannel(
        client, lambda: 0, retry_interval=0.05, owns_client=True, refusal_retry_s=0.5
    )
    try:
        channel.tell_refused("t1")
        channel.tell_refused("t1")  # (the one pending)
        channel.tell_refused("t2")
        channel.tell_refused("t3")  # (too many waiting)
        assert list(channel._pending) == ["t1", "t2"] and len(channel._telling) == 1
        assert channel.counts["refusals_unsent"] == 1
        await eventually(
            lambda: channel.counts["refusals_unsent"] == 3 and len(channel._telling) == 0,
            what="both refusals given up, the task ended",
        )
        assert channel.counts["published"] == 0
        errors = channel.counts["errors"]
        assert errors <= 0.5 / 0.05 + 1  # (one try a backoff step, not one a refusal)
        channel.tell_refused("t4")  # (told again once the last was given up)
        assert len(channel._telling) == 1
    finally:
        await channel.aclose()
    assert channel.counts["refusals_unsent"] == 4  # (closed while telling: never told)


async def test_refusals_are_told_many_to_a_message_and_one_refused_again_keeps_its_place(
    shared_redis,
):
    """One PUBLISH a refusal, awaited in turn, fell behind a flood of 401s (a few hundred a
    second with Redis 2 ms away): past 10,000 pending a revoked key's refusal was dropped, and
    a key refused again went to the back of the queue, never told while the flood lasted. Many
    are told in one message now, and a key refused again keeps its place."""
    from carpool.redis import invalidation
    from carpool.redis.connection import connect

    told = connect(shared_redis.url, cluster=shared_redis.cluster)
    listening = connect(shared_redis.url, cluster=shared_redis.cluster)
    teller = invalidation.InvalidationChannel(told, lambda: 0, owns_client=True)
    listener = invalidation.InvalidationChannel(listening, lambda: 0, owns_client=True)
    heard: list[str | None] = []
    listener.on_refusal = heard.append
    listener.start()
    try:
        await eventually(lambda: listener.listening, what="subscribed")
        tenants = [f"t{i:04d}" for i in range(1000)]
        for tenant in tenants:
            teller.tell_refused(tenant)
        teller.tell_refused("t0000")  # (refused again: its place kept)
        assert next(iter(teller._pending)) == "t0000"
        await eventually(lambda: len(heard) == 1000, what="every refusal heard")
        assert sorted(heard) == tenants  # type: ignore[type-var]
        assert teller.counts["published"] <= 1000 // invalidation.TOLD_AT_ONCE + 2
    finally:
        await teller.aclose()
        await listener.aclose()
