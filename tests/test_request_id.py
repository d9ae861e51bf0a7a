"""Request ids (``carpool.request_id``): on every response, and on the log lines of its request."""

from __future__ import annotations

import logging
import re

import pytest

from carpool.request_id import RequestIdFilter

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


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "<script>", "é"])
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
