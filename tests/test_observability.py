"""Prometheus metrics, /stats latency and OpenTelemetry spans (issue 7, part 3)."""

from __future__ import annotations

import asyncio

import pytest

from carpool.batching.lists import PROBE_INPUTS
from carpool.clock import ManualClock
from carpool.config import Config
from carpool.metrics import Buckets
from carpool.tracing import NO_SPAN, Tracer
from carpool.wiring import build_gateway
from conftest import Served, redis_settings, run_gateway
from fakes.waiting import eventually


def samples(text: str, name: str) -> dict[str, float]:
    """``{'<labels>': value}`` of every sample line of metric ``name`` in a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


async def test_metrics_follow_prometheus_naming_conventions(gw):
    await gw.chat()
    text = (await gw.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name.startswith("carpool_"), name
            if kind == "counter":
                assert name.endswith("_total") or f"{name}_total " in text  # counters: _total
            if kind == "histogram":
                assert f"{name}_bucket" in text and f"{name}_sum" in text
            if {"duration", "wait"} & set(name.split("_")):
                assert name.endswith("_seconds"), name  # base units in the name
    assert (await gw.client.get("/metrics")).headers["content-type"].startswith("text/plain")


async def test_metrics_count_requests_by_route_and_outcome_and_upstream_calls_by_replica_and_status(
    gw, fake
):
    await gw.chat("a")
    await gw.chat("a")
    fake.fail_status, fake.fail_times = 500, 1
    assert (await gw.chat("b")).status_code == 500
    text = (await gw.client.get("/metrics")).text
    requests = samples(text, "carpool_requests_total")
    assert requests['{outcome="miss",route="/v1/chat/completions"}'] == 2
    assert requests['{outcome="hit",route="/v1/chat/completions"}'] == 1
    upstream = samples(text, "carpool_upstream_requests_total")
    assert upstream[f'{{replica="{fake.url}",status="200"}}'] == 1
    assert upstream[f'{{replica="{fake.url}",status="500"}}'] == 1
    durations = samples(text, "carpool_request_duration_seconds_count")
    assert durations['{outcome="hit"}'] == 1 and durations['{outcome="miss"}'] == 2
    assert samples(text, "carpool_tokens_saved_total")[""] > 0
    assert samples(text, "carpool_cache_entries")['{layer="exact"}'] == 1
    assert samples(text, "carpool_cache_bytes")['{layer="exact"}'] > 0
    assert samples(text, "carpool_redis_errors_total") == {'{component="store"}': 0}
    assert samples(text, "carpool_redis_pool_exhausted_total") == {"": 0}
    assert samples(text, "carpool_redis_full_total") == {"": 0}
    assert samples(text, "carpool_redis_slot_moving_total") == {"": 0}


async def test_healthz_shows_no_traffic_counters_when_the_admin_token_is_set(
    gateway_with, redis_server
):
    # /healthz is open whatever the admin token: it says whether Redis is up, not the shared
    # layers' counters (flights led and followed, invalidations, semantic records), which tell
    # when someone's request was a miss. Those are in /stats, behind the token.
    token = "t0ken-t0ken-t0ken-t0ken"
    async with gateway_with(admin_token=token, **redis_settings(redis_server)) as gw:
        assert (await gw.client.get("/stats")).status_code == 401
        before = (await gw.client.get("/healthz")).json()["redis"]
        for _ in range(2):
            await gw.chat("a secret prompt", headers={"Authorization": "Bearer victim"})
        after = (await gw.client.get("/healthz")).json()["redis"]
        assert after == before and set(after) == {"state", "errors", "down_since"}
        assert after["state"] == "up"
        admin = {"Authorization": f"Bearer {token}"}
        stats = (await gw.client.get("/stats", headers=admin)).json()["redis"]
        assert stats["state"] == "up" and stats["flights"]["led"] >= 1


async def test_stats_and_metrics_come_to_count_only_the_live_exact_entries(gateway_with, fake):
    """Expired answers nobody asks for again are reaped (a bounded step at most once a second,
    taken by the reports too): /stats and /metrics do not count them on and on."""
    clock = ManualClock()
    async with gateway_with(clock=clock, cache={"types": {"short": {"ttl": 1}}}) as gw:
        for question in ("a", "b"):
            await gw.chat(question)
        await gw.chat("c", headers={"x-carpool-type": "short"})
        assert (await gw.client.get("/stats")).json()["layers"]["exact"]["entries"] == 3
        clock.advance(2)
        exact = (await gw.client.get("/stats")).json()["layers"]["exact"]
        assert exact["entries"] == 2 and exact["bytes"] == gw.gateway.store.bytes
        clock.advance(3600)
        text = (await gw.client.get("/metrics")).text
        assert samples(text, "carpool_cache_entries")['{layer="exact"}'] == 0
        assert samples(text, "carpool_cache_bytes")['{layer="exact"}'] == 0
        assert gw.gateway.store.evictions == 0 and fake.count() == 3


async def test_stats_and_metrics_show_the_repeat_memos_entries_and_bytes_within_its_budget(
    gateway_with, fake
):
    """The memo of byte-identical repeats holds request bodies (up to
    ``fingerprint.repeat_memo_bytes`` per process): RSS grows with it, so the reports say how
    much it holds."""
    budget = 4096
    async with gateway_with(fingerprint={"repeat_memo_bytes": budget}) as gw:
        empty = (await gw.client.get("/stats")).json()["repeat_memo"]
        assert empty == {"entries": 0, "bytes": 0, "max_bytes": budget}
        for i in range(40):
            await gw.chat(f"question {i}")
        memo = (await gw.client.get("/stats")).json()["repeat_memo"]
        assert 0 < memo["entries"] < 40 and 0 < memo["bytes"] <= budget
        assert memo == {
            "entries": len(gw.gateway.repeats),
            "bytes": gw.gateway.repeats.bytes,
            "max_bytes": budget,
        }
        text = (await gw.client.get("/metrics")).text
        assert samples(text, "carpool_repeat_memo_entries")[""] == memo["entries"]
        assert samples(text, "carpool_repeat_memo_bytes")[""] == memo["bytes"]


async def test_stats_and_metrics_show_what_the_idempotency_records_hold_in_this_process(
    gateway_with, fake
):
    """Each keyed request's answer is kept for its retries, up to ``idempotency.max_bytes``
    (256 MiB) per process: RSS grew by hundreds of MB after a few keyed long streams while the
    reports showed the caches alone. They say how many records this process holds (and how
    many are being processed) and their bytes, within the budget."""
    budget = 1 << 20
    async with gateway_with(idempotency={"max_bytes": budget}) as gw:
        empty = (await gw.client.get("/stats")).json()["idempotency"]
        assert empty == {"records": 0, "processing": 0, "bytes": 0, "max_bytes": budget}
        answers = 0
        for i in range(3):
            reply = await gw.chat(f"charge order {i}", headers={"Idempotency-Key": f"order-{i}"})
            answers += len(reply.content)
        fake.gate = asyncio.Event()
        running = asyncio.create_task(
            gw.chat("charge order 3", headers={"Idempotency-Key": "order-3"})
        )
        await fake.wait_for_calls(4)
        held = (await gw.client.get("/stats")).json()["idempotency"]
        records = gw.gateway.layers.idempotency
        assert held == {
            "records": 3,
            "processing": 1,
            "bytes": records.bytes,
            "max_bytes": budget,
        }
        assert answers < held["bytes"] <= budget  # (each answer's bytes, and its record's)
        text = (await gw.client.get("/metrics")).text
        assert samples(text, "carpool_idempotency_records") == {"": 3}
        assert samples(text, "carpool_idempotency_processing") == {"": 1}
        assert samples(text, "carpool_idempotency_bytes") == {"": held["bytes"]}
        fake.gate.set()
        assert (await running).status_code == 200
        after = (await gw.client.get("/stats")).json()["idempotency"]
        assert (after["records"], after["processing"]) == (4, 0)
        assert after["bytes"] > held["bytes"]


async def test_with_redis_the_idempotency_figures_are_this_instances_copies_not_redis(
    gateway_with, fake, redis_server
):
    """With Redis the records are shared there, and each instance keeps a copy of the answers
    it finished (its fallback while Redis cannot be read): the figures count those copies,
    what this process's memory holds; the shared records' size is Redis's, not counted."""
    async with gateway_with(**redis_settings(redis_server)) as gw:
        await gw.chat("charge order 1", headers={"Idempotency-Key": "order-1"})
        figures = (await gw.client.get("/stats")).json()["idempotency"]
        copies = gw.gateway.layers.idempotency.local
        assert (figures["records"], figures["processing"]) == (1, 0)
        assert figures["bytes"] == copies.bytes > 0
        text = (await gw.client.get("/metrics")).text
        assert samples(text, "carpool_idempotency_records") == {"": 1}


async def test_a_2xx_that_is_no_answer_is_counted_an_upstream_error():
    """An upstream behind a maintenance page (200, HTML) or answering a JSON array: each call is
    a 502 to its client, and a failed attempt in ``upstream_errors`` as a 5xx would be."""
    from fakes.raw_upstream import answer, raw_upstream

    bodies = [(b"<html>down for maintenance</html>", b"text/html"), (b"[1, 2, 3]", None)]

    def respond(call) -> bytes:
        body, content_type = bodies[len(up.calls) % 2]
        return answer(200, b"OK", body, content_type or b"application/json")

    async with raw_upstream(respond) as up, run_gateway([up.url]) as gw:
        for i in range(4):
            asked = {
                "model": "m",
                "temperature": 0,
                "messages": [{"role": "user", "content": f"q{i}"}],
            }
            response = await gw.client.post("/v1/chat/completions", json=asked)
            assert response.status_code == 502, response.text
        stats = (await gw.client.get("/stats")).json()
    assert stats["upstream_calls"] == len(up.calls) == 4
    assert stats["upstream_errors"] == 4


async def exact_figures(served: Served) -> list[tuple[float, float]]:
    """The exact cache's (entries, bytes) as ``/stats`` and then ``/metrics`` report them."""
    exact = (await served.client.get("/stats")).json()["layers"]["exact"]
    text = (await served.client.get("/metrics")).text
    layer = '{layer="exact"}'
    scraped = samples(text, "carpool_cache_entries")[layer], samples(text, "carpool_cache_bytes")
    return [(exact["entries"], exact["bytes"]), (scraped[0], scraped[1][layer])]


async def until_reported(served: Served, figures: tuple[int, int], what: str) -> None:
    """Read ``served``'s reports until both say ``figures`` (bounded: they read Redis's counts
    again at most once per stats interval, 1 s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (reported := await exact_figures(served)) != [figures, figures]:
        assert loop.time() < deadline, f"{what}: reported {reported}, not {figures}"
        await asyncio.sleep(0.05)


async def test_with_redis_every_instance_reports_the_live_entries_of_the_whole_shared_cache(
    fake, redis_server
):
    # With Redis, the exact cache's figures are Redis's counts of the shared cache; they were
    # read again only by this instance's own puts, invalidations and gets: an idle instance
    # reported 0 while Redis held another's answers, and answers expired since stayed counted
    # however often the reports were read. The reports read the counts again themselves.
    config = {**redis_settings(redis_server), "cache": {"types": {"short": {"ttl": 3}}}}
    async with run_gateway([fake.url], **config) as a, run_gateway([fake.url], **config) as b:
        for question in ("a", "b"):
            assert (await a.chat(question)).headers["x-carpool"] == "miss"
        two = (a.gateway.store.entries, a.gateway.store.bytes)
        short = await a.chat("c", headers={"x-carpool-type": "short"})
        assert short.headers["x-carpool"] == "miss"
        three = (a.gateway.store.entries, a.gateway.store.bytes)
        assert two[0] == 2 and three[0] == 3 and three[1] > two[1]
        await until_reported(b, three, "the idle instance, of what the other one stored")
        await until_reported(a, two, "the instance that stored them, once one expired")
        await until_reported(b, two, "the idle instance, once one expired")
        assert fake.count() == 3


async def test_with_redis_each_layer_counts_its_own_failed_redis_calls_the_store_only_its_own(
    fake, redis_server
):
    # Every Redis layer tells the one health of its failures, and the health counted them all
    # as the store's: with Redis down and no request (no store call), the invalidation
    # subscriber's failed reconnections moved component="store" as much as their own series,
    # and the components' sum counted each of them twice. The idempotency records' failures had
    # no series but the store's.
    settings = redis_settings(redis_server, retry_interval=0.05)
    async with run_gateway([fake.url], **settings) as gw:
        assert (await gw.chat("before")).headers["x-carpool"] == "miss"
        channel = gw.gateway.invalidations
        assert channel is not None
        await eventually(lambda: not gw.gateway.flights.calls, what="the call's end, stored")
        redis_server.kill()
        await eventually(
            lambda: channel.counts["errors"] >= 2, what="the subscriber's failed reconnections"
        )
        scraped = await gw.client.get("/metrics")  # (answered: its figures' read fails quietly)
        assert scraped.status_code == 200
        errors = samples(scraped.text, "carpool_redis_errors_total")
        assert errors['{component="store"}'] == 0, errors
        assert errors['{component="invalidations"}'] >= 2
        assert errors['{component="flights"}'] == errors['{component="idempotency"}'] == 0
        stats = await gw.client.get("/stats")
        assert stats.status_code == 200 and stats.json()["redis"]["state"] == "degraded"
        keyed = await gw.chat("keyed", headers={"Idempotency-Key": '"k"'})
        assert keyed.status_code == 200  # (run from this process's records)
        errors = samples((await gw.client.get("/metrics")).text, "carpool_redis_errors_total")
        assert errors['{component="idempotency"}'] >= 1


async def test_every_request_stats_count_is_in_metrics_idempotency_refusals_included(gw, fake):
    key = {"Idempotency-Key": "order-1"}
    assert (await gw.chat("a", headers=key)).status_code == 200
    assert (await gw.chat("b", headers=key)).status_code == 422  # the gateway's own refusal
    assert (await gw.client.post("/v1/chat/completions", content=b"{")).status_code == 400
    stats = (await gw.client.get("/stats")).json()
    assert stats["requests"] == 3 and stats["rejected"] == 2 and stats["misses"] == 1
    text = (await gw.client.get("/metrics")).text
    counted = sum(samples(text, "carpool_requests_total").values())
    assert counted + samples(text, "carpool_requests_rejected_total")[""] == stats["requests"]
    assert samples(text, "carpool_upstream_calls_total")[""] == stats["upstream_calls"] == 1
    assert samples(text, "carpool_saved_without_usage_total")[""] == stats["saved_without_usage"]


async def test_readiness_probes_are_counted_in_upstream_calls(gw, fake):
    # /readyz's GET /models went to the engine with the gateway's key and into no counter:
    # /stats' upstream_calls, "every attempt sent to a replica", left it out.
    assert (await gw.client.get("/readyz")).status_code == 200
    assert (await gw.client.get("/readyz")).status_code == 200  # (the answer is recent: trusted)
    assert fake.count("/v1/models") == 1
    stats = (await gw.client.get("/stats")).json()
    assert stats["upstream_calls"] == 1 and stats["upstream_errors"] == 0
    assert stats["requests"] == 0  # (a control endpoint's: no request of the API)
    assert gw.gateway.replicas.snapshot()[fake.url]["calls"] == 1
    text = (await gw.client.get("/metrics")).text
    assert samples(text, "carpool_upstream_calls_total")[""] == 1
    upstream = samples(text, "carpool_upstream_requests_total")
    assert upstream == {f'{{replica="{fake.url}",status="200"}}': 1}


async def test_only_requests_counted_under_an_outcome_are_timed_under_it(gw):
    # The gateway's own refusals (counted in rejected) were timed under "bypass": the histogram
    # counted 5 bypasses where carpool_requests_total counted 1.
    key = {"Idempotency-Key": "order-1"}
    assert (await gw.chat("a", headers=key)).status_code == 200
    assert (await gw.chat("b", headers=key)).status_code == 422
    for _ in range(3):
        assert (await gw.client.post("/v1/chat/completions", content=b"{")).status_code == 400
    assert (await gw.chat("c", temperature=0.9)).headers["x-carpool"] == "bypass"
    text = (await gw.client.get("/metrics")).text
    counted = samples(text, "carpool_requests_total")
    assert samples(text, "carpool_requests_rejected_total")[""] == 4
    durations = samples(text, "carpool_request_duration_seconds_count")
    assert durations == {
        f'{{outcome="{outcome}"}}': n
        for outcome in ("hit", "semantic-hit", "coalesced", "miss", "bypass")
        if (n := counted.get(f'{{outcome="{outcome}",route="/v1/chat/completions"}}', 0))
    }
    latency = (await gw.client.get("/stats")).json()["latency_ms"]
    assert {outcome: figures["count"] for outcome, figures in latency.items()} == {
        "miss": 1,
        "bypass": 1,
    }


async def test_a_stream_the_upstream_breaks_after_its_head_is_an_upstream_error(gw, fake):
    fake.cut_after = 2
    response, text = await gw.stream_chat("cut")
    assert response.status_code == 200 and '"error"' in text  # (an SSE error event)
    stats = (await gw.client.get("/stats")).json()
    assert stats["upstream_calls"] == 1 and stats["upstream_errors"] == 1
    text = (await gw.client.get("/metrics")).text
    assert samples(text, "carpool_upstream_errors_total")[""] == 1


async def test_metrics_show_flights_and_waiters_in_progress(gw, fake):
    fake.gate = asyncio.Event()
    calls = [asyncio.create_task(gw.chat("held")) for _ in range(3)]
    await fake.wait_for_calls(1)
    await eventually(lambda: gw.gateway.flights.waiters == 3, what="three waiters")
    text = (await gw.client.get("/metrics")).text
    assert samples(text, "carpool_flights")[""] == 1
    assert samples(text, "carpool_flight_waiters")[""] == 3
    fake.gate.set()
    await asyncio.gather(*calls)


async def test_a_call_running_through_an_invalidation_is_still_a_flight_in_stats_and_metrics(
    fake, gateway_with
):
    # The invalidation forgot the running flight (nobody joins it any more): /stats flights
    # and carpool_flights fell to 0 while its call ran on (its waiter and the replica's
    # in_flight still 1).
    admin = {"Authorization": "Bearer s3cret"}
    async with gateway_with(admin_token="s3cret", coalesce={"window_ms": 0}) as gw:
        fake.gate = asyncio.Event()
        call = asyncio.create_task(gw.chat("held"))
        await fake.wait_for_calls(1)
        await gw.client.post("/admin/invalidate", json={"tag": "unrelated"}, headers=admin)
        stats = (await gw.client.get("/stats", headers=admin)).json()
        text = (await gw.client.get("/metrics", headers=admin)).text
        fake.gate.set()
        assert (await call).headers["x-carpool"] == "miss"
        assert (stats["waiters"], stats["flights"]) == (1, 1)
        assert samples(text, "carpool_flights")[""] == 1
        # Once it ended (no window: nothing lingers), it is no flight.
        await eventually(lambda: not gw.gateway.flights.calls, what="the call's end")
        assert (await gw.client.get("/stats", headers=admin)).json()["flights"] == 0


async def test_upstream_calls_count_every_call_the_engines_were_asked_list_probes_and_pass_through_too(
    gateway_with, fake
):
    """The embeddings list probe's three calls (sent with the tenant's key: billed) and a
    pass-through call reached the engine without being counted: ``upstream_calls`` said 2
    where the engine had been asked 6 times."""
    async with gateway_with(batching={"max_batch_delay_ms": 50}) as gw:  # "auto": probed
        two = await asyncio.gather(
            *(
                gw.client.post("/v1/embeddings", json={"model": "e", "input": f"text {i}"})
                for i in range(2)
            )
        )
        assert [response.status_code for response in two] == [200, 200]
        await gw.gateway.layers.batcher.wait_idle()  # (the probe, in the background)
        assert (await gw.client.get("/v1/models")).status_code == 200
        stats = (await gw.client.get("/stats")).json()
        text = (await gw.client.get("/metrics")).text
    assert stats["batching"]["lists"]["probes"] == 1
    assert stats["upstream_calls"] == len(fake.calls) == 6
    assert samples(text, "carpool_upstream_calls_total")[""] == 6
    by_status = samples(text, "carpool_upstream_requests_total")
    assert by_status == {f'{{replica="{fake.url}",status="200"}}': 6}


async def test_batch_sizes_are_those_of_the_calls_sent_a_batch_sent_item_by_item_is_calls_of_one(
    gateway_with, fake
):
    """Before the list probe's verdict a batch of two goes item by item; it was counted a
    call of two (``carpool_batch_size``, ``max_items_seen``): batching seen working where no
    list had been sent."""
    async with gateway_with(batching={"max_batch_delay_ms": 50}) as gw:
        await asyncio.gather(
            *(
                gw.client.post("/v1/embeddings", json={"model": "e", "input": f"text {i}"})
                for i in range(2)
            )
        )
        await gw.gateway.layers.batcher.wait_idle()
        stats = (await gw.client.get("/stats")).json()["batching"]
        text = (await gw.client.get("/metrics")).text
    inputs = [c.body["input"] for c in fake.calls if c.path == "/v1/embeddings"]
    inputs = [value if isinstance(value, list) else [value] for value in inputs]
    sent = [value for value in inputs if not set(value) <= set(PROBE_INPUTS)]  # (the batcher's)
    assert sorted(sent) == [["text 0"], ["text 1"]]
    assert samples(text, "carpool_batch_size_count")[""] == stats["batches"] == 2
    assert samples(text, "carpool_batch_size_sum")[""] == stats["items_sent"] == 2
    assert stats["max_items_seen"] == 1 and stats["alone"] == 2


async def test_metrics_show_batch_sizes_and_batch_wait(gateway_with, fake):
    # "on": merged at once (with "auto" the first batch goes alone while the probe runs).
    async with gateway_with(batching={"max_batch_delay_ms": 20, "embeddings": "on"}) as gw:
        await asyncio.gather(
            *(
                gw.client.post("/v1/embeddings", json={"model": "e", "input": f"text {i}"})
                for i in range(8)
            )
        )
        text = (await gw.client.get("/metrics")).text
    calls = [c for c in fake.calls if c.path == "/v1/embeddings"]
    assert samples(text, "carpool_batch_size_count")[""] == len(calls)
    assert samples(text, "carpool_batch_size_sum")[""] == 8  # every item sent once
    assert samples(text, "carpool_batch_wait_seconds_count")[""] == 8


async def test_metrics_show_the_similarity_of_semantic_hits(gateway_with, fake):
    pytest.importorskip("onnxruntime")
    async with gateway_with(semantic={"enabled": True}) as gw:
        await gw.chat("How do I reset my router?")
        await eventually(lambda: gw.gateway.semantic.entries >= 1, what="the semantic insert")
        hit = await gw.chat("how can i reset my router")
        assert hit.headers["x-carpool"] == "semantic-hit"
        text = (await gw.client.get("/metrics")).text
    similarity = float(hit.headers["x-carpool-similarity"])
    assert samples(text, "carpool_semantic_similarity_count")[""] == 1
    assert samples(text, "carpool_semantic_similarity_sum")[""] == pytest.approx(
        similarity, abs=1e-4
    )
    assert samples(text, "carpool_cache_entries")['{layer="semantic"}'] == 1


async def test_stats_report_latency_percentiles_per_outcome(gw):
    for _ in range(3):
        await gw.chat()
    latency = (await gw.client.get("/stats")).json()["latency_ms"]
    assert set(latency) == {"miss", "hit"}
    assert latency["hit"]["count"] == 2 and latency["miss"]["count"] == 1
    for figures in latency.values():
        assert 0 < figures["p50"] <= figures["p95"] <= figures["p99"]


# --- OpenTelemetry ------------------------------------------------------------------------------


def test_tracing_costs_nothing_when_no_tracer_provider_is_installed():
    tracer = Tracer("auto")  # the test process installs no global provider
    assert not tracer.enabled and tracer.span("carpool.exact") is NO_SPAN
    assert not Tracer("off").enabled


@pytest.fixture
def spans():
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_a_miss_records_a_span_per_layer_and_a_hit_only_the_lookup(gw, fake, spans):
    provider, exporter = spans
    gw.gateway.tracer = Tracer("on", provider=provider)
    secret_prompt = "a prompt that must never be a span attribute"
    await gw.chat(secret_prompt, headers={"authorization": "Bearer sk-secret"})
    miss = {s.name: s for s in exporter.get_finished_spans()}
    assert set(miss) == {"carpool.request", "carpool.exact", "carpool.flight", "carpool.upstream"}
    root = miss["carpool.request"]
    assert root.attributes["carpool.outcome"] == "miss"
    assert root.attributes["carpool.route"] == "/v1/chat/completions"
    for name in ("carpool.exact", "carpool.flight"):
        assert miss[name].parent.span_id == root.context.span_id
    assert miss["carpool.flight"].attributes["carpool.role"] == "leader"
    assert miss["carpool.upstream"].attributes["carpool.replica"] == fake.url
    assert miss["carpool.upstream"].context.trace_id == root.context.trace_id
    for span in miss.values():
        assert not any(
            secret_prompt in str(v) or "sk-secret" in str(v) for v in span.attributes.values()
        )
    exporter.clear()
    await gw.chat(secret_prompt, headers={"authorization": "Bearer sk-secret"})
    hit = {s.name: s for s in exporter.get_finished_spans()}
    assert set(hit) == {"carpool.request", "carpool.exact"}
    assert hit["carpool.request"].attributes["carpool.outcome"] == "hit"


async def test_a_request_the_gateway_refuses_itself_is_traced_as_rejected_not_bypass(
    gw, fake, spans
):
    # It is counted in `rejected`, not under an outcome: its span says the same, so traces and
    # carpool_requests_total{outcome="bypass"} agree.
    provider, exporter = spans
    gw.gateway.tracer = Tracer("on", provider=provider)
    refused = await gw.client.post("/v1/chat/completions", json={"model": "m", "messages": "x"})
    assert refused.status_code == 400 and refused.headers["x-carpool"] == "bypass"
    (root,) = exporter.get_finished_spans()
    assert root.attributes["carpool.outcome"] == "rejected"
    stats = (await gw.client.get("/stats")).json()
    assert stats["rejected"] == 1 and stats["bypass"] == 0 and fake.calls == []


async def test_a_tracer_provider_installed_after_the_gateway_is_built_is_used_once_it_starts(spans):
    provider, exporter = spans
    gateway = build_gateway(Config(upstreams=["http://127.0.0.1:9/v1"]))
    assert not gateway.tracer.enabled  # nobody collects yet
    gateway.tracer.provider = provider  # as opentelemetry's global one would be
    gateway.start()
    try:
        assert gateway.tracer.enabled
        assert (await gateway.request("/v1/chat/completions", b"not json")).status == 400
        assert [s.name for s in exporter.get_finished_spans()] == ["carpool.request"]
    finally:
        await gateway.aclose()


async def test_a_library_gateway_never_started_looks_its_tracer_up_on_its_first_request(spans):
    # Used without a server (or mounted in a host app that does not forward its lifespan), the
    # gateway never started: a tracer provider the host installed after building it was never
    # looked up, and no span was ever recorded.
    provider, exporter = spans
    gateway = build_gateway(Config(upstreams=["http://127.0.0.1:9/v1"]))
    gateway.tracer.provider = provider  # (installed after the gateway was built)
    try:
        assert (await gateway.request("/v1/chat/completions", b"not json")).status == 400
        assert [s.name for s in exporter.get_finished_spans()] == ["carpool.request"]
    finally:
        await gateway.aclose()


async def test_an_app_mounted_without_its_lifespan_starts_its_gateway_on_its_first_request(spans):
    # A host app that mounts it (``Mount``) does not forward its lifespan: the gateway was never
    # started, its tracer never looked up (nor, with Redis, its invalidations listened to).
    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from carpool import create_app
    from fakes.serving import serve_app

    provider, exporter = spans
    gateway = build_gateway(Config(upstreams=["http://127.0.0.1:9/v1"]))
    gateway.tracer.provider = provider  # (installed after the gateway was built)
    host = Starlette(routes=[Mount("/gw", app=create_app(gateway))])
    try:
        async with serve_app(host) as url, httpx.AsyncClient(base_url=url + "/gw") as client:
            refused = await client.post("/v1/chat/completions", content=b"not json")
        assert refused.status_code == 400
        assert [s.name for s in exporter.get_finished_spans()] == ["carpool.request"]
    finally:
        await gateway.aclose()


def test_buckets_count_a_value_on_a_bound_in_that_bucket_and_are_cumulative_up_to_inf():
    buckets = Buckets("x", "", (0.1, 1.0, float("inf")))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        buckets.observe(value)
    assert buckets.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert buckets.sum == pytest.approx(8.65)


async def test_a_client_that_leaves_before_sending_its_whole_body_is_counted_as_abandoned(gw):
    # (It was counted nowhere, not even in requests; a body that timed out is a rejected 408.)
    port = int(gw.url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"model":'
    )
    await writer.drain()
    writer.close()
    await eventually(lambda: gw.gateway.stats.abandoned == 1, what="the request abandoned")
    stats = (await gw.client.get("/stats")).json()
    assert stats["requests"] == stats["abandoned"] == 1 and stats["rejected"] == 0


async def test_a_client_that_leaves_before_its_answer_is_counted_as_abandoned(gw, fake):
    # It was counted in no outcome: /stats' requests left it out, /metrics too.
    fake.hang = True
    leaving = asyncio.create_task(gw.chat("a question nobody waits for"))
    await fake.wait_for_calls(1)
    leaving.cancel()
    await eventually(
        lambda: gw.gateway.stats.abandoned == 1, what="the request counted as abandoned"
    )
    stats = (await gw.client.get("/stats")).json()
    assert stats["requests"] == stats["abandoned"] == 1
    text = (await gw.client.get("/metrics")).text
    assert samples(text, "carpool_requests_abandoned_total")[""] == 1
    # A bypass (sampled) that its client leaves: abandoned too, not also counted a bypass.
    leaving = asyncio.create_task(gw.chat("a sampled one", temperature=0.9))
    await fake.wait_for_calls(2)
    leaving.cancel()
    await eventually(lambda: gw.gateway.stats.abandoned == 2, what="the bypass abandoned")
    stats = (await gw.client.get("/stats")).json()
    assert stats["requests"] == 2 and stats["bypass"] == 0


@pytest.mark.parametrize("token", [None, "t"])
async def test_the_operators_documents_and_their_refusals_say_no_store(gateway_with, token):
    """/stats, /metrics, /admin/* (and their 401s) said nothing of caching: a shared cache that
    keeps answers without a directive for a default time (Varnish: 120 s) served one
    operator's /stats, stale, to every other. Only /dashboard said ``no-store``."""
    async with gateway_with(admin_token=token) as gw:
        admin = {"Authorization": f"Bearer {token}"} if token else {}
        asked = [
            await gw.client.get("/stats", headers=admin),
            await gw.client.get("/metrics", headers=admin),
            await gw.client.get("/dashboard", headers=admin),
        ]
        if token:
            asked += [
                await gw.client.post("/admin/invalidate", json={"all": True}, headers=admin),
                await gw.client.get("/admin/semantic/audit", headers=admin),
                await gw.client.get("/stats"),
                await gw.client.get("/metrics"),
                await gw.client.post("/admin/invalidate", json={"all": True}),
            ]
    for response in asked:
        assert response.headers.get("cache-control") == "no-store", (
            response.request.url,
            response.status_code,
        )
    # Nor read as another type than it says (a namespace named "<script>..." is in /stats and
    # /metrics: JSON and text, never a page; only /dashboard said nosniff).
    for response in asked[:2]:
        assert response.headers.get("x-content-type-options") == "nosniff", response.request.url


def test_the_duration_buckets_tell_a_hit_of_tens_of_microseconds_from_one_of_hundreds():
    """The lowest bucket was 0.5 ms: 99 % of hits (13 us held repeats, 165 us on the ASGI
    path) shared it, and ``histogram_quantile`` said ~0.25 ms p50 whatever they took."""
    from carpool.metrics import DURATION_BUCKETS

    buckets = Buckets("x", "", DURATION_BUCKETS)
    for value in (0.000013, 0.000165):
        buckets.observe(value)
    counts = dict(buckets.cumulative())
    below = [bound for bound, count in counts.items() if count == 1]
    assert below and float(below[0]) <= 0.0001, counts
