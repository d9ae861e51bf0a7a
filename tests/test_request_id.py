"""Request ids (``carpool.request_id``): on every response, and on the log lines of its request."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from typing import Any

import pytest

from carpool.request_id import RequestIdFilter
from fakes.flights import flight_clients
from fakes.waiting import eventually

NEW_ID = re.compile(r"[0-9a-f]{16}")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        (
            "POST",
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("POST", "/v1/chat/completions", {"model": "m"}),  # a 400
        ("GET", "/healthz", None),
        ("GET", "/v1/models", None),  # pass-through
        ("GET", "/nowhere", None),  # a 404
    ],
    ids=["cached endpoint", "bad request", "control", "pass-through", "not found"],
)
async def test_every_response_carries_the_clients_request_id_or_a_new_one(gw, method, path, body):
    given = await gw.client.request(method, path, json=body, headers={"x-request-id": "req-42.a"})
    assert given.headers["x-request-id"] == "req-42.a"
    made = await gw.client.request(method, path, json=body)
    assert NEW_ID.fullmatch(made.headers["x-request-id"])
    other = await gw.client.request(method, path, json=body)
    assert other.headers["x-request-id"] != made.headers["x-request-id"]


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "<script>", "é", "-", "--", "..."])
async def test_an_unusable_request_id_is_replaced_not_echoed(gw, bad):
    response = await gw.client.get("/healthz", headers={"x-request-id": bad.encode("utf-8")})
    assert NEW_ID.fullmatch(response.headers["x-request-id"])


async def test_a_streamed_answer_carries_it_too(gw):
    async with gw.client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "s"}]},
        headers={"x-request-id": "stream-1"},
    ) as response:
        assert response.headers["x-request-id"] == "stream-1"
        await response.aread()


async def test_the_log_lines_of_a_request_carry_its_id(gw, fake, caplog):
    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.WARNING, logger="carpool")
    fake.fail_status = 500  # an upstream failure: logged by the replica set
    response = await gw.client.post(
        "/v1/chat/completions",
        json={"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-request-id": "trace-me"},
    )
    assert response.status_code >= 500
    lines = [r for r in caplog.records if r.name.startswith("carpool")]
    assert lines and all(r.request_id == "trace-me" for r in lines)
    outside = logging.makeLogRecord({})
    assert RequestIdFilter().filter(outside) is True and outside.request_id == "-"


async def test_an_upstreams_own_request_id_is_relayed_under_another_name(gateway_with):
    from fakes.serving import serve_app

    async def upstream(scope, receive, send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"up-1")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"data": []}'})

    async with serve_app(upstream) as url, gateway_with(upstreams=[f"{url}/v1"]) as gw:
        response = await gw.client.get("/v1/models", headers={"x-request-id": "mine"})
    assert response.status_code == 200
    assert response.headers.get_list("x-request-id") == ["mine"]
    assert response.headers["x-upstream-request-id"] == "up-1"


# What one client names its request by: an engine that names its answer after the request id
# it was sent (vLLM: ``"id": "chatcmpl-" + X-Request-Id``, else the body's ``request_id``) stored
# it in an answer that other clients were then served.
SECRET = "acme-corp-patient-4711"
CHAT = "/v1/chat/completions"
QUESTION = {
    "model": "m",
    "messages": [{"role": "user", "content": "Capital of France?"}],
    "temperature": 0,
}
NAMED_BY = {
    "x-request-id": lambda: ({"x-request-id": SECRET}, {}),
    "request_id": lambda: ({}, {"request_id": SECRET}),
}
# Two clients who may be served one answer: two tenants in a shared namespace, one tenant's
# two users (``user`` is out of the key).
CLIENTS = {
    "two tenants": (
        ({"authorization": "Bearer sk-alice", "x-carpool-namespace": "pub"}, {}),
        ({"authorization": "Bearer sk-bob", "x-carpool-namespace": "pub"}, {}),
    ),
    "two users": (
        ({"authorization": "Bearer sk-team"}, {"user": "alice"}),
        ({"authorization": "Bearer sk-team"}, {"user": "bob"}),
    ),
}


async def _two_clients(gw, who: str) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """The clients ``who`` names, each of whose credentials the upstream has accepted (a tenant
    is served from a shared namespace only then)."""
    alice, bob = CLIENTS[who]
    for headers, body in (alice, bob):
        warm = {**QUESTION, "messages": [{"role": "user", "content": "hi"}], **body}
        assert (await gw.client.post(CHAT, json=warm, headers=headers)).status_code == 200
    return alice, bob


@pytest.mark.parametrize("who", CLIENTS)
@pytest.mark.parametrize("named_by", NAMED_BY)
async def test_a_hit_never_carries_another_clients_request_id(fake, gateway_with, named_by, who):
    fake.names_after_request_id = True
    async with gateway_with(tenant={"shared_namespaces": ["pub"]}) as gw:
        (alice, alice_body), (bob, bob_body) = await _two_clients(gw, who)
        headers, body = NAMED_BY[named_by]()
        first = await gw.client.post(
            CHAT, json={**QUESTION, **alice_body, **body}, headers={**alice, **headers}
        )
        assert first.status_code == 200 and first.headers["x-carpool"] == "miss"
        calls = fake.count()
        second = await gw.client.post(CHAT, json={**QUESTION, **bob_body}, headers=bob)
        streamed = await gw.client.post(
            CHAT, json={**QUESTION, **bob_body, "stream": True}, headers=bob
        )
    assert fake.count() == calls  # both served from the cache
    assert (second.headers["x-carpool"], streamed.headers["x-carpool"]) == ("hit", "hit")
    assert SECRET not in second.text and SECRET not in streamed.text
    assert first.json()["id"] == second.json()["id"]  # (the one answer, named by the gateway)


@pytest.mark.parametrize("who", CLIENTS)
@pytest.mark.parametrize("named_by", NAMED_BY)
async def test_a_joiner_never_carries_its_leaders_request_id(fake, gateway_with, named_by, who):
    fake.names_after_request_id = True
    async with gateway_with(tenant={"shared_namespaces": ["pub"]}) as gw:
        (alice, alice_body), (bob, bob_body) = await _two_clients(gw, who)
        headers, body = NAMED_BY[named_by]()
        fake.gate = asyncio.Event()
        calls = fake.count()
        leader = asyncio.create_task(
            gw.client.post(
                CHAT, json={**QUESTION, **alice_body, **body}, headers={**alice, **headers}
            )
        )
        await fake.wait_for_calls(calls + 1)
        joiners = [
            asyncio.create_task(
                gw.client.post(CHAT, json={**QUESTION, **bob_body, **stream}, headers=bob)
            )
            for stream in ({}, {"stream": True})
        ]
        await eventually(lambda: flight_clients(gw) == 3, what="two joiners in the flight")
        fake.gate.set()
        await leader
        joined = await asyncio.gather(*joiners)
    assert fake.count() == calls + 1
    for response in joined:
        assert response.status_code == 200 and response.headers["x-carpool"] == "coalesced"
        assert SECRET not in response.text


async def test_an_upstream_call_carries_the_gateways_own_request_id_not_the_clients(gw, fake):
    """Each call of a cached endpoint names itself by an id the gateway made for it; the
    client's ``x-request-id``, ``request-id`` and body ``request_id`` never reach the engine."""
    given = {"x-request-id": "mine-1", "request-id": "mine-2"}
    for stream in (False, True):
        asked = [{"role": "user", "content": f"streamed: {stream}"}]
        body = {**QUESTION, "messages": asked, "request_id": "mine-3", "stream": stream}
        response = await gw.client.post(CHAT, json=body, headers=given)
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "mine-1"  # (the client's, echoed to it)
    completion = {"model": "m", "prompt": "p", "request_id": "mine-3"}
    embedding = {"model": "e", "input": "i", "request_id": "mine-3"}
    for path, body in (("/v1/completions", completion), ("/v1/embeddings", embedding)):
        assert (await gw.client.post(path, json=body, headers=given)).status_code == 200
    calls = fake.calls
    assert len(calls) == 4
    for call in calls:
        assert _is_uuid4(call.headers["x-request-id"])
        assert call.headers["request-id"] == call.headers["x-request-id"]
        assert "mine" not in json.dumps([call.headers, call.body])
    assert len({call.headers["x-request-id"] for call in calls}) == 4  # one per call


async def test_a_passthrough_call_still_carries_the_clients_request_id(gw, fake):
    # Its answer is never shared: the engine may name it after the client's id.
    response = await gw.client.get("/v1/models", headers={"x-request-id": "mine"})
    assert response.status_code == 200
    assert fake.calls[-1].headers["x-request-id"] == "mine"


async def test_an_upstream_calls_id_is_logged_with_the_client_request_ids_it_serves(
    gw, fake, caplog
):
    caplog.set_level(logging.DEBUG, logger="carpool.upstream")
    body: dict[str, Any] = {**QUESTION, "request_id": "body-7"}
    response = await gw.client.post(CHAT, json=body, headers={"x-request-id": "head-7"})
    assert response.status_code == 200
    call_id = fake.calls[-1].headers["x-request-id"]
    lines = [r.getMessage() for r in caplog.records if call_id in r.getMessage()]
    assert len(lines) == 1 and "head-7" in lines[0] and "body-7" in lines[0]


def _is_uuid4(value: str) -> bool:
    try:
        return str(uuid.UUID(value, version=4)) == value
    except ValueError:
        return False


async def test_an_upstream_calls_id_is_a_uuid_as_llama_cpp_pythons_server_requires(gw, fake):
    """llama-cpp-python's server (starlette-context's RequestIdPlugin) refuses an
    ``x-request-id`` that is not a version-4 UUID with an empty 400: every call of every
    cached endpoint was refused when the gateway sent its 16-hex ids."""
    for path, body in (
        (CHAT, QUESTION),
        (CHAT, {**QUESTION, "messages": [{"role": "user", "content": "s"}], "stream": True}),
        ("/v1/completions", {"model": "m", "prompt": "p"}),
        ("/v1/embeddings", {"model": "e", "input": "i"}),
    ):
        assert (await gw.client.post(path, json=body)).status_code == 200
    assert len(fake.calls) == 4
    assert all(_is_uuid4(call.headers["x-request-id"]) for call in fake.calls)


@pytest.mark.parametrize("draw", ["request id", "upstream call id", "audit sample"])
def test_ids_and_draws_cannot_be_predicted_from_the_processs_random_generator(draw):
    """A new request id is sent to any client, unauthenticated ones too (``/healthz``): drawn
    from the process's Mersenne Twister, 312 of them gave its state away, and with it the next
    upstream call's id, drawn from the same generator, which an engine names another tenant's
    answer after (vLLM's ``chatcmpl-<x-request-id>``), and which semantic hits are audited.
    Each comes from the OS's generator now: reseeding the process's changes nothing."""
    import random

    from carpool.request_id import new_call_id, new_id
    from carpool.semantic.audit import Audits

    drawing = {"request id": new_id, "upstream call id": new_call_id}.get(draw)
    if drawing is None:
        drawing = Audits(rate=0.5)._sample
    random.seed(7)
    first = drawing()
    random.seed(7)
    assert drawing() != first
