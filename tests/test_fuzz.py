"""A fuzz run against the gateway's HTTP surface, driven by its own OpenAPI document (issue #8, 3).

The gateway serves ``GET /openapi.json`` (``carpool/openapi/``). Schemathesis turns it into
requests, valid ones and deliberately invalid ones (wrong types, missing fields, out-of-range
values, odd headers), sent over loopback HTTP to a real gateway in front of the fake upstream.
Every response must be:
- never a 5xx (the fake is healthy, so not even 502/504 can occur);
- what the document says (status, content type, headers, body schema): schemathesis's checks;
- on the cached endpoints: labelled with ``x-carpool``; an error is OpenAI's error shape, or
  problem+json for idempotency errors;
and the gateway still serves afterwards.

Bounded: ``MAX_EXAMPLES`` requests, derandomized (the same cases every run), no example database.
The sync schemathesis calls run in a worker thread while the gateway serves in the test's loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = 150
ADMIN = "fuzz-admin-token"
CACHED = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
}
# The typed streams (no [DONE]) and the event each ends with when whole.
LAST_EVENT = {
    "/v1/responses": ("response.completed", "response.incomplete", "response.failed"),
    "/v1/messages": ("message_stop",),
}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def _strategy(document: dict[str, Any]) -> st.SearchStrategy[Any]:
    schema = schemathesis.openapi.from_dict(document)
    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE))
        if operation.method.upper() == "POST":
            strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(strategies)


def _header(response: Any, name: str) -> str | None:
    """A header of a schemathesis ``Response`` (its headers: lower-case name -> values)."""
    for key, values in response.headers.items():
        if key.lower() == name:
            return values[0] if isinstance(values, list) else values
    return None


def _check_cached_endpoint(case: Any, response: Any) -> None:
    assert _header(response, "x-carpool") is not None
    content_type = _header(response, "content-type") or ""
    if response.status_code < 400:
        if content_type.startswith("text/event-stream"):
            # schemathesis stops reading a stream after its first events (``stream_cut_short``):
            # only a stream it read to its end must end with [DONE] (with its last event, for
            # a typed stream).
            text = response.text.rstrip()
            if case.path in LAST_EVENT:
                last = text.rpartition("\n\n")[2]
                assert response.stream_cut_short or (
                    "[DONE]" not in text
                    and last.startswith(tuple(f"event: {name}\n" for name in LAST_EVENT[case.path]))
                ), text[-300:]
            else:
                assert response.stream_cut_short or text.endswith("data: [DONE]")
        else:
            orjson.loads(response.content)
        return
    body = orjson.loads(response.content)
    if content_type == "application/problem+json":
        assert response.status_code in (400, 409, 422)
        assert {"type", "title", "status", "detail"} <= set(body)
        return
    assert content_type.startswith("application/json")
    if case.path == "/v1/messages":  # Anthropic's error shape
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert isinstance(body["error"]["type"], str)
        return
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "code" in error


def fuzz(document: dict[str, Any], base_url: str) -> dict[int, int]:
    """Run the fuzz (blocking); the statuses seen, counted."""
    statuses: dict[int, int] = {}
    session = requests.Session()

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_strategy(document), admin=st.booleans())
    def run(case: Any, admin: bool) -> None:
        headers = (
            {"authorization": f"Bearer {ADMIN}"}
            if admin and case.path == "/admin/invalidate"
            else None
        )
        try:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=10)
        except (requests.exceptions.InvalidHeader, UnicodeEncodeError, ValueError):
            return  # a header the client library itself refuses to send
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:500])
        case.validate_response(response, checks=CHECKS, headers=headers)
        if case.path in CACHED:
            _check_cached_endpoint(case, response)

    try:
        run()
    finally:
        session.close()
    return statuses


async def test_fuzzing_the_http_surface_gets_only_well_formed_2xx_and_4xx_and_the_gateway_stays_up(
    fake, gateway_with
):
    # The fake's own vectors honour ``dimensions``; a negative one would crash it (a 500 that
    # the gateway passes through): fixed vectors keep the upstream healthy, as promised.
    fake.embedding_fn = lambda item: [0.6, 0.8]
    async with gateway_with(admin_token=ADMIN) as gw:
        document = (await gw.client.get("/openapi.json")).json()
        assert document["openapi"].startswith("3.")
        statuses = await asyncio.to_thread(fuzz, document, gw.url)
        assert sum(statuses.values()) >= MAX_EXAMPLES // 2
        assert not [s for s in statuses if s >= 500]
        assert 200 in statuses and 400 in statuses
        health = await gw.client.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert (await gw.chat()).status_code == 200
    print(f"fuzz statuses: {dict(sorted(statuses.items()))}, upstream calls: {fake.count()}")


async def test_the_openapi_document_describes_every_route_of_the_gateway(gw):
    document = (await gw.client.get("/openapi.json")).json()
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/healthz",
        "/readyz",
        "/stats",
        "/metrics",
        "/dashboard",
        "/openapi.json",
        "/admin/invalidate",
        "/admin/semantic/feedback",
        "/admin/semantic/audit",
        "/admin/semantic/audit/reset",
    }
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "413", "502", "504"} <= set(chat["responses"])
    request = document["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(request["required"])
    assert {
        "temperature",
        "top_p",
        "max_tokens",
        "seed",
        "stop",
        "tools",
        "response_format",
        "n",
        "logit_bias",
        "stream",
    } <= set(request["properties"])
    schemathesis.openapi.from_dict(document)  # a document schemathesis accepts


async def test_the_openapi_document_takes_the_nulls_the_gateway_takes(gw):
    # "prompt": null (a completion: OpenAI's default prompt) and "stream": null are served; a
    # client or fuzzer generated from the document refused what the gateway serves.
    document = (await gw.client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["prompt"]["nullable"] is True
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponseRequest", "MessageRequest"):
        assert schemas[name]["properties"]["stream"]["nullable"] is True, name
    assert "nullable" not in schemas["EmbeddingRequest"]["properties"]["input"]
    answered = await gw.client.post("/v1/completions", json={"model": "m", "prompt": None})
    assert answered.status_code == 200


async def test_the_openapi_document_says_what_the_gateway_itself_answers(gateway_with):
    """Against the gateway: statuses it produces itself that the document did not list (401,
    403, 415, 501, 503 on the cached endpoints), ``x-carpool-tags`` bounded at 1,024 where 32
    tags of 256 characters are accepted, and an invalidation of the default namespace (``""``)
    that the document refused."""
    from carpool.request import MAX_HEADER_TOKEN, MAX_TAGS

    async with gateway_with(admin_token=ADMIN) as gw:
        document = (await gw.client.get("/openapi.json")).json()
        admin = {"Authorization": f"Bearer {ADMIN}"}
        default = await gw.client.post("/admin/invalidate", json={"namespace": ""}, headers=admin)
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/embeddings"):
        post = document["paths"][path]["post"]
        assert {"401", "403", "415", "501", "503"} <= set(post["responses"]), path
        (tags,) = [p for p in post["parameters"] if p["name"] == "x-carpool-tags"]
        assert tags["schema"].get("maxLength", MAX_TAGS * MAX_HEADER_TOKEN) >= (
            MAX_TAGS * MAX_HEADER_TOKEN
        )
    selectors = document["components"]["schemas"]["Invalidate"]["oneOf"]
    (namespace,) = [s for s in selectors if "namespace" in s["properties"]]
    assert namespace["properties"]["namespace"].get("minLength", 0) == 0
    assert default.status_code == 200, default.text
