"""carpool as a library: the same pipeline without HTTP, and a pinned public surface."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

import carpool
from carpool import Config, FunctionUpstream, Outcome, build_gateway
from carpool.request import ClientRequest
from fakes.waiting import eventually

ROOT = Path(__file__).resolve().parents[1]


def _completion(content: str) -> dict:
    """A whole chat answer, as a wrapped function returns it."""
    return {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": content},
            }
        ],
    }


def test_public_surface_is_pinned():
    assert carpool.__all__ == sorted(carpool.__all__)
    assert set(carpool.__all__) == {
        "BodyTooLarge",
        "CarpoolError",
        "Config",
        "ConfigError",
        "FlightAbandoned",
        "FunctionUpstream",
        "Gateway",
        "Outcome",
        "Reply",
        "RequestError",
        "UpstreamError",
        "UpstreamStatusError",
        "UpstreamStreamBroken",
        "UpstreamTimeout",
        "UpstreamUnreachable",
        "build_gateway",
        "create_app",
    }
    # (Imported as first used: each name is there, none is another's.)
    assert all(getattr(carpool, name).__name__ == name for name in carpool.__all__)
    assert set(carpool.__all__) <= set(dir(carpool))
    with pytest.raises(AttributeError):
        carpool.no_such_name  # noqa: B018


def test_the_package_says_its_version_and_that_it_is_typed():
    """``carpool.__version__`` is the installed distribution's (``carpool --version``'s), and
    the package carries its PEP 561 marker: a library user's mypy reads its types."""
    import importlib.metadata
    import importlib.resources

    assert carpool.__version__ == importlib.metadata.version("carpool")
    assert "__version__" in dir(carpool)
    assert (importlib.resources.files("carpool") / "py.typed").is_file()


def test_readme_library_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "library.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "model calls: 1" in out and "miss=1 coalesced=49, then hit" in out


async def test_wrapped_function_is_coalesced_and_cached():
    gate, calls = asyncio.Event(), []

    async def call(path, body):
        calls.append(body)
        await gate.wait()
        return _completion("hi")

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    waiting = [asyncio.create_task(gateway.request("/v1/chat/completions", body)) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    replies = await asyncio.gather(*waiting)
    streamed = await gateway.request("/v1/chat/completions", {**body, "stream": True})
    assert len(calls) == 1 and "stream" not in calls[0]
    assert sorted(r.outcome for r in replies) == sorted([Outcome.MISS] + [Outcome.COALESCED] * 4)
    assert streamed.outcome is Outcome.HIT and b'"content":"hi"' in streamed.body
    assert streamed.body.endswith(b"data: [DONE]\n\n")
    await gateway.aclose()


async def test_a_long_answer_hit_as_a_stream_is_its_whole_body_through_the_library():
    """A streamed hit longer than a slice is kept as its answer's frames (``Reply.parted``),
    not joined for the transport: through the library, its ``body`` is all of it all the same,
    as long as the stream of the miss that stored it, and as every other hit of it."""

    async def call(path, body):
        return _completion(" ".join(["w" * 1000] * 300))  # ~300 KB

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {
        "model": "m",
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    miss = await gateway.request("/v1/chat/completions", body)
    hits = [await gateway.request("/v1/chat/completions", body) for _ in range(2)]
    assert [hit.outcome for hit in hits] == [Outcome.HIT] * 2
    for hit in hits:
        assert hit.parts is not None  # (its answer's frames, not joined...)
        size = hit.size
        assert hit.body.endswith(b"data: [DONE]\n\n")
        assert hit.parts is None and len(hit.body) == size > 300_000  # (...until read)
    assert hits[0].body == hits[1].body
    assert miss.outcome is Outcome.MISS and miss.body.endswith(b"data: [DONE]\n\n")
    await gateway.aclose()


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_bypassed_stream_of_a_function_is_sse_as_its_flights_are(include_usage):
    """A sampled request shares nothing (``bypass``): the function is called for it alone, and
    still never asked to stream; a client that asked for a stream is sent the answer as SSE,
    as a flight's client is, the usage chunk if it asked for it, never the JSON body."""
    calls = []

    async def call(path, body):
        calls.append(body)
        return {**_completion("hi"), "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
        **({"stream_options": {"include_usage": True}} if include_usage else {}),
    }
    reply = await gateway.request("/v1/chat/completions", body)
    assert reply.outcome is Outcome.BYPASS and len(calls) == 1 and "stream" not in calls[0]
    assert dict(reply.headers)[b"content-type"].startswith(b"text/event-stream")
    events = [line[6:] for line in reply.body.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hi"
    )
    assert any(chunk.get("usage") for chunk in chunks) is include_usage
    await gateway.aclose()


@pytest.mark.parametrize("temperature", [0, 0.7], ids=["flight", "bypass"])
async def test_a_json_answer_without_usage_says_so_shared_or_not(temperature):
    """An answer the upstream reported no usage for says ``x-carpool-usage: missing``: a
    flight's did, a bypassed one (sampled) did not."""

    async def call(path, body):
        return _completion("hi")  # (no usage)

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {
        "model": "m",
        "temperature": temperature,
        "messages": [{"role": "user", "content": "x"}],
    }
    reply = await gateway.request("/v1/chat/completions", body)
    assert reply.status == 200 and "usage" not in orjson.loads(reply.body)
    assert dict(reply.headers).get(b"x-carpool-usage") == b"missing"
    await gateway.aclose()


async def test_a_failing_function_reaches_every_waiter_as_502_and_is_not_stored():
    async def call(path, body):
        raise RuntimeError("model exploded")

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    replies = await asyncio.gather(
        *(gateway.request("/v1/chat/completions", body) for _ in range(3))
    )
    assert [r.status for r in replies] == [502] * 3
    assert gateway.store.entries == 0
    await gateway.aclose()


async def test_a_function_that_raises_is_a_failed_call_of_its_replica(caplog):
    # The client got its 502, but the replica's record said nothing: no upstream error, and
    # the replica healthy. (And each failure was an ERROR traceback, "flight ... failed
    # unexpectedly", besides the replica's line once per log interval.)
    async def call(path, body):
        raise RuntimeError("model server down")

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    for content in ("a", "b"):
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}
        reply = await gateway.request("/v1/chat/completions", body)
        assert reply.status == 502
        assert reply.json()["error"]["message"] == "upstream function raised RuntimeError"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["upstream function failed, left out for 5 s: raised RuntimeError"], said
    stats = gateway.snapshot()
    assert stats["upstream_calls"] == stats["upstream_errors"] == 2
    assert stats["replicas"]["function"]["errors"] == 2
    assert stats["replicas"]["function"]["state"] != "healthy"
    assert 'carpool_upstream_requests_total{replica="function",status="502"} 2.0' in (
        gateway.metrics.render().decode()
    )
    await gateway.aclose()


async def test_a_function_that_never_answers_is_a_504_after_the_upstream_timeout():
    # The function's call had no bound: its clients waited for ever, and joiners that gave up
    # waiting ran calls of their own, which hung too.
    cancelled = asyncio.Event()

    async def call(path, body):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    gateway = build_gateway(
        Config(limits={"upstream_timeout": 0.2}), upstreams=[FunctionUpstream(call)]
    )
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    reply = await asyncio.wait_for(gateway.request("/v1/chat/completions", body), 30)
    assert reply.status == 504 and reply.json()["error"]["code"] == "upstream_timeout"
    assert cancelled.is_set()  # (the function's call was stopped, not left running)
    stats = gateway.snapshot()
    assert stats["upstream_errors"] == 1 and stats["replicas"]["function"]["state"] != "healthy"
    await gateway.aclose()

    # A TimeoutError of the function's own (its client's timeout) is its failure, a 502.
    async def timed_out(path, body):
        raise TimeoutError

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(timed_out)])
    reply = await gateway.request("/v1/chat/completions", body)
    assert reply.status == 502 and "raised TimeoutError" in reply.json()["error"]["message"]
    await gateway.aclose()
    # A bound given with the function stands over the config's.
    assert FunctionUpstream(call, timeout=5.0).timeout == 5.0
    kept = FunctionUpstream(call, timeout=5.0)
    build_gateway(Config(limits={"upstream_timeout": 0.2}), upstreams=[kept])
    assert kept.timeout == 5.0


@pytest.mark.parametrize(
    "result, said",
    [
        (object(), "returned object, not a JSON object"),
        ({"choices": [{"message": {"content": object()}}]}, "returned what is not JSON"),
    ],
    ids=["sdk-object", "not-json-inside"],
)
async def test_a_function_that_returns_no_json_object_is_a_failed_call_of_its_replica(
    result, said, caplog
):
    # What the openai SDK returns (a ChatCompletion, not a dict) was a TypeError past the
    # function's failure handling: a 502 "internal error", the replica's record left healthy.
    async def call(path, body):
        return result

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    assert (await gateway.request("/v1/chat/completions", body)).status == 502
    stats = gateway.snapshot()
    assert stats["upstream_errors"] == 1 and stats["replicas"]["function"]["state"] != "healthy"
    assert any(said in record.getMessage() for record in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    await gateway.aclose()


def test_a_gateway_runs_on_the_event_loop_it_was_first_used_on():
    # ``asyncio.run`` a request at a time: the second loop's calls went through the first
    # loop's upstream connections (a 502 blamed on the upstream), and ``aclose`` then failed.
    async def call(path, body):
        return _completion("hi")

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    assert asyncio.run(gateway.request("/v1/chat/completions", body)).status == 200
    with pytest.raises(RuntimeError, match="event loop it was first used on"):
        asyncio.run(gateway.request("/v1/chat/completions", body))
    with pytest.raises(RuntimeError, match="event loop it was first used on"):
        asyncio.run(gateway.passthrough("GET", "/models", b"", {}, b""))


async def test_a_function_call_its_client_cancelled_is_no_failure_of_its_replica():
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def call(path, body):
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    asked = asyncio.create_task(gateway.request("/v1/chat/completions", body))
    await asyncio.wait_for(entered.wait(), 5)
    asked.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)  # its only client left: the call is cancelled
    await eventually(lambda: gateway.replicas.in_flight == 0, what="the call's end")
    stats = gateway.snapshot()
    assert stats["upstream_calls"] == 1 and stats["upstream_errors"] == 0
    assert stats["replicas"]["function"]["state"] == "healthy"
    await gateway.aclose()


async def test_embedded_simulated_engine_is_the_default_upstream():
    gateway = build_gateway(Config(sim={"decode_ms_per_token": 0.1}))
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    first = await gateway.request("/v1/chat/completions", body)
    second = await gateway.request("/v1/chat/completions", {**body, "stream": True})
    assert first.outcome is Outcome.MISS and second.outcome is Outcome.HIT
    assert first.json()["system_fingerprint"] == "carpool-sim"
    assert gateway.upstreams[0].name == "sim-0"
    await gateway.aclose()


def test_the_core_gateway_does_not_import_the_semantic_dependencies():
    code = (
        "import sys, carpool, carpool.cli, carpool.server, carpool.pipeline; "
        "g = carpool.build_gateway(); "
        "print(sorted(m for m in ('numpy', 'onnxruntime', 'usearch', 'tokenizers') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip() == "[]"


async def test_flights_and_idempotency_records_are_injected_as_given():
    from carpool.flight import FlightGroup
    from carpool.idempotency import MemoryIdempotencyRecords

    async def call(path, body):
        return _completion("hi")

    flights, records = FlightGroup(window=0.0), MemoryIdempotencyRecords(60.0)
    gateway = build_gateway(
        Config(), upstreams=[FunctionUpstream(call)], flights=flights, idempotency=records
    )
    assert gateway.flights is flights and gateway.idempotency is records
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    first = await gateway.request("/v1/chat/completions", body, {"Idempotency-Key": '"k"'})
    again = await gateway.request("/v1/chat/completions", body, {"Idempotency-Key": '"k"'})
    assert first.outcome is Outcome.MISS and len(records) == 1
    assert (b"idempotent-replayed", b"true") in again.headers
    assert gateway.snapshot()["redis"] == {"state": "off"}
    await gateway.aclose()


async def test_a_flights_clients_reply_before_its_answer_is_stored_and_it_is_in_the_same_turn():
    """With the in-process store, a miss's clients are woken with the answer first; the answer
    is stored right after they reply, before the event loop turns again (nothing that follows
    a reply can miss it); ``Gateway.request`` returns once it is stored."""

    async def call(path, body):
        return _completion("hi")

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    order: list[str] = []
    put = gateway.store.put

    async def recorded_put(key, entry):
        order.append("stored")
        await put(key, entry)

    gateway.store.put = recorded_put

    async def client() -> None:
        # (``handle``, as the HTTP transports call it: ``request`` returns a turn later)
        reply = await gateway.handle(ClientRequest("/v1/chat/completions", orjson.dumps(body)))
        order.append(f"replied {reply.outcome.value}")
        await asyncio.sleep(0)  # (one turn of the loop)
        order.append(f"then stored {gateway.store.entries}")

    await client()
    again = await gateway.request("/v1/chat/completions", body)
    assert order == ["replied miss", "stored", "then stored 1"]
    assert again.outcome is Outcome.HIT
    await gateway.aclose()


class _Cycle:
    """Garbage only the cycle collector frees: it refers to itself."""

    def __init__(self) -> None:
        self.me = self


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No automatic collection meanwhile: only what the code under test does happens."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def _started_with_garbage(app) -> weakref.ref[_Cycle]:
    """Start ``app`` (its lifespan) while a cycle dropped just before awaits collection."""
    from fakes.serving import serve_app

    garbage = _Cycle()
    dropped = weakref.ref(garbage)
    del garbage
    async with serve_app(app):
        return dropped


async def test_an_app_a_host_mounts_leaves_the_hosts_garbage_collector_as_it_was():
    # Its startup froze the collector of whatever process mounted it: the host's garbage of
    # that moment (and everything else) was never collected again.
    from carpool import create_app

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(lambda path, body: {})])
    frozen = gc.get_freeze_count()
    with _collector_paused():
        dropped = await _started_with_garbage(create_app(gateway))
    assert gc.get_freeze_count() == frozen
    gc.collect()
    assert dropped() is None


async def test_carpool_serve_collects_the_garbage_before_freezing_the_rest():
    from carpool.server import GatewayApp

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(lambda path, body: {})])
    try:
        with _collector_paused():
            dropped = await _started_with_garbage(GatewayApp(gateway, freeze_gc=True))
            assert dropped() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # (this process runs other tests)


async def _ok(path, body):
    return _completion("hi")


_BODY = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}


async def test_a_trailing_slash_names_the_same_endpoint_as_over_http():
    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(_ok)])
    first = await gateway.request("/v1/chat/completions/", _BODY)
    again = await gateway.request("/v1/chat/completions", _BODY)
    assert (first.outcome, again.outcome) == (Outcome.MISS, Outcome.HIT)
    await gateway.aclose()


@pytest.mark.parametrize("path", ["/chat/completions", "/v1/models", "/v1/chat/completions//"])
async def test_a_path_that_is_no_cached_endpoint_is_a_value_error_naming_the_endpoints(path):
    # It was a bare KeyError of the path.
    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(_ok)])
    with pytest.raises(ValueError, match="/v1/chat/completions, /v1/completions") as raised:
        await gateway.request(path, _BODY)
    assert repr(path) in str(raised.value) and "passthrough" in str(raised.value)
    assert gateway.snapshot()["requests"] == 0
    await gateway.aclose()


@pytest.mark.parametrize(
    "headers, named",
    [({"x-carpool-namespace": 5}, "'x-carpool-namespace'"), ({b"cache-control": "x"}, "b'cac")],
)
async def test_a_header_that_is_not_text_is_a_type_error_naming_it(headers, named):
    # An int value was an AttributeError from deep in the header parsing.
    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(_ok)])
    with pytest.raises(TypeError, match=f"header {named}"):
        await gateway.request("/v1/chat/completions", _BODY, headers)
    await gateway.aclose()


@pytest.mark.parametrize("query", ["a=é€", "a=é", "a b", "a=1#x"])
async def test_a_query_no_url_could_carry_is_a_value_error_saying_why(query):
    # One out of latin-1 was a UnicodeEncodeError.
    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(_ok)])
    with pytest.raises(ValueError, match=f"query {query!r}: the query string"):
        await gateway.request("/v1/chat/completions", _BODY, query=query)
    assert gateway.snapshot()["requests"] == 0
    await gateway.aclose()


def _durations(gateway) -> dict[str, float]:
    """``carpool_request_duration_seconds_count`` by outcome, as /metrics renders it."""
    from prometheus_client.parser import text_string_to_metric_families

    page = gateway.metrics.render().decode()
    (family,) = (
        f for f in text_string_to_metric_families(page) if f.name.endswith("duration_seconds")
    )
    return {
        s.labels["outcome"]: s.value
        for s in family.samples
        if s.name.endswith("_count") and s.value
    }


async def test_a_library_request_is_timed_in_the_latency_metrics_as_an_http_one_is():
    # Only the HTTP server timed requests: a library user's latency_ms and histogram stayed empty.
    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(_ok)])
    await gateway.request("/v1/chat/completions", _BODY)
    await gateway.request("/v1/chat/completions", _BODY)
    await gateway.request("/v1/chat/completions", {**_BODY, "stream": True})
    latency = gateway.snapshot()["latency_ms"]
    assert {outcome: figures["count"] for outcome, figures in latency.items()} == {
        "miss": 1,
        "hit": 2,
    }
    assert _durations(gateway) == {"miss": 1, "hit": 2}
    await gateway.aclose()


async def test_a_closed_gateway_refuses_requests_rather_than_open_connections_again():
    # Before, a closed gateway went on answering, and an HTTP upstream opened a new connection
    # pool that nothing would ever close.
    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(_ok)])
    assert (await gateway.request("/v1/chat/completions", _BODY)).status == 200
    await gateway.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await gateway.request("/v1/chat/completions", _BODY)
    with pytest.raises(RuntimeError, match="closed"):
        await gateway.passthrough("GET", "/models", b"", {}, b"")


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x00b", "a\x01b", "a\x7fb"])
async def test_a_header_value_http_cannot_carry_is_a_400_and_no_replicas_fault(value):
    # The upstream client refused to build the call, which counted as the replica failing:
    # three such calls downed both replicas, none having been sent anything.
    gateway = build_gateway(
        Config(), upstreams=[FunctionUpstream(_ok, "a"), FunctionUpstream(_ok, "b")]
    )
    reply = await gateway.request("/v1/chat/completions", _BODY, headers={"x-custom": value})
    assert reply.status == 400 and reply.json()["error"]["code"] == "invalid_header"
    counts = gateway.snapshot()
    assert (counts["rejected"], counts["upstream_errors"], counts["upstream_calls"]) == (1, 0, 0)
    assert all(r["state"] == "healthy" for r in gateway.replicas.health().values())
    with pytest.raises(ValueError, match="name"):
        await gateway.request("/v1/chat/completions", _BODY, headers={"x bad": "v"})
    await gateway.aclose()


@pytest.mark.parametrize(
    ("how", "prefix"),
    [("mounted", "/gw"), ("mounted", "/café llm"), ("root_path", "/gw")],
    ids=["mounted", "mounted-encoded", "root_path"],
)
async def test_an_app_mounted_under_a_prefix_serves_every_path_below_it(fake, how, prefix):
    """Mounted by a host app (``Mount("/gw", ...)``) or served with a ``root_path``, every /v1
    request was a 500: ASGI keeps the prefix in ``path``, and carpool routed on it."""
    from urllib.parse import quote

    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    from carpool import create_app
    from fakes.serving import serve_app

    gateway = build_gateway(Config(upstreams=[fake.url]))
    inner = create_app(gateway)
    if how == "mounted":
        app: object = Starlette(
            routes=[Route("/hello", lambda _: PlainTextResponse("host")), Mount(prefix, app=inner)]
        )
    else:

        async def app(scope, receive, send):  # (a server's root_path: a proxy stripped it)
            if scope["type"] == "http":
                scope = {**scope, "root_path": "/gw", "path": "/gw" + scope["path"]}
            await inner(scope, receive, send)

    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    # (A prefix sent percent-encoded, as a client sends it: the pass-through judged its raw
    # path with the prefix still on it.)
    sent = quote(prefix) if how == "mounted" else ""
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url + sent) as client:
        first = await client.post("/v1/chat/completions", json=body)
        again = await client.post("/v1/chat/completions", json=body)
        models = await client.get("/v1/models")
        healthz = await client.get("/healthz")
        escaped = await client.get("/v1/%2e%2e/admin")  # (judged as sent, below the prefix)
    assert (first.status_code, first.headers["x-carpool"]) == (200, "miss")
    assert again.headers["x-carpool"] == "hit" and again.json() == first.json()
    assert models.status_code == 200 and healthz.status_code == 200
    assert escaped.status_code == 400
    assert [call.path for call in fake.calls] == ["/v1/chat/completions", "/v1/models"]
    await gateway.aclose()  # (a mounted app's lifespan is the host's: it closes the gateway)


async def test_an_app_served_again_after_its_shutdown_refuses_to_start():
    """Its gateway closed by the first shutdown, a second startup (a second TestClient, a
    server restarted in the process) served misses on an upstream pool opened again and a 500
    for the rest: the startup fails, saying why."""
    from carpool import create_app

    app = create_app(build_gateway(Config(), upstreams=[FunctionUpstream(_ok)]))
    await _lifespan(app, "startup.complete")
    assert await _lifespan(app, "startup.failed") is not None


async def _lifespan(app: object, expected: str) -> str | None:
    """One lifespan of ``app`` (an ASGI app): startup, then shutdown if it started; the
    failure's message when it did not (``expected``: the startup's answer)."""
    messages: asyncio.Queue[dict] = asyncio.Queue()
    for kind in ("lifespan.startup", "lifespan.shutdown"):
        messages.put_nowait({"type": kind})
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}}
    # (A failed startup is also raised, after its message: a server logs it.)
    with (
        contextlib.suppress(RuntimeError)
        if expected == "startup.failed"
        else contextlib.nullcontext()
    ):
        await app(scope, messages.get, send)  # type: ignore[operator]
    assert sent[0]["type"] == f"lifespan.{expected}", sent
    return sent[0].get("message")


async def test_a_mounted_app_whose_gateway_is_closed_refuses_its_v1_requests_with_a_503():
    """Mounted by a host app, the gateway closed by the host while the app stays mounted: a
    cached endpoint served a miss on layers closed (the upstream pool opened again, nothing to
    close it), a pass-through call was a 500 with a traceback. Refused now, as a request the
    shutdown cut is: a 503 with ``Retry-After``, ``shutting_down``, nothing sent upstream; and
    /readyz says it is not ready (it said ready, and probed the upstream on closed layers)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from carpool import create_app
    from fakes.serving import serve_app

    calls = []

    async def call(path, body):
        calls.append(body)
        return _completion("hi")

    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call)])
    host = Starlette(routes=[Mount("/gw", app=create_app(gateway))])
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    async with serve_app(host) as url, httpx.AsyncClient(base_url=url + "/gw") as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await gateway.aclose()
        other = {**body, "messages": [{"role": "user", "content": "y"}]}
        refused = [
            await client.post("/v1/chat/completions", json=body),  # (its answer stored)
            await client.post("/v1/chat/completions", json=other),
            await client.get("/v1/models"),
        ]
        ready = await client.get("/readyz")  # (not ready: no balancer sends it traffic)
    assert ready.status_code == 503 and ready.json()["ready"] is False
    assert [r.status_code for r in refused] == [503] * 3
    assert {r.json()["error"]["code"] for r in refused} == {"shutting_down"}
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert len(calls) == 1


async def test_embeddings_waiting_in_a_batch_leave_as_the_apps_lifespan_shuts_down(fake):
    """A request none of carpool's own connections carries (another worker's, asking the key's
    owner over its peers' socket, under ``serve --workers``) waited in a batch through the
    shutdown: only those connections began the drain that sends a batch at once, and a worker
    with none open never did. Cut at the grace's end, its call made all the same by the worker
    that asked. The app's lifespan shutdown begins the drain too."""
    import httpx

    from carpool.server import GatewayApp

    config = Config(
        upstreams=[fake.url],
        batching={"embeddings": "on", "max_batch_delay_ms": 600_000},
    )
    gateway = build_gateway(config)
    app = GatewayApp(gateway, grace_s=20)
    lifespan: asyncio.Queue[dict] = asyncio.Queue()
    said: list[dict] = []

    async def say(message: dict) -> None:
        said.append(message)

    lifespan.put_nowait({"type": "lifespan.startup"})
    running = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}}, lifespan.get, say)
    )
    await eventually(lambda: bool(said), what="the startup")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        waiting = asyncio.create_task(
            client.post("/v1/embeddings", json={"model": "m", "input": "text"})
        )
        await eventually(lambda: gateway.batcher.requests == 1, what="the request in a batch")
        lifespan.put_nowait({"type": "lifespan.shutdown"})
        answer = await asyncio.wait_for(waiting, 10)
    await asyncio.wait_for(running, 10)
    assert answer.status_code == 200, answer.text
    assert fake.count("/v1/embeddings") == 1
