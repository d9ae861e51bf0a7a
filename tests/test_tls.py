"""An https upstream: trusted the way a user trusts a private CA, a refused certificate told to
the operator and (its kind only) to the client, a stream its client left let go at once, and
an answer cut short never served as a 200.

The CA and certificates are made by the ``openssl`` CLI (``fakes.tls``); the gateway trusts the
CA through ``SSL_CERT_FILE`` (or ``SSL_CERT_DIR``) in its environment, as docs/security.md
says, set before its first call to the replica."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from pathlib import Path

import httpx
import orjson
import pytest

from conftest import run_gateway
from fakes.raw_upstream import chat_completion, raw_upstream
from fakes.tls import Certs, endless_stream, make_certs, serve_tls
from fakes.upstream import FakeUpstream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def trusted(certs: Certs, monkeypatch: pytest.MonkeyPatch) -> Certs:
    """The test CA trusted as a user would: ``SSL_CERT_FILE`` names it."""
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    return certs


@pytest.mark.parametrize("how", ["SSL_CERT_FILE", "SSL_CERT_DIR"])
async def test_an_https_upstream_signed_by_a_private_ca_is_trusted_as_the_docs_say(
    certs: Certs, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "SSL_CERT_FILE":
        monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    else:  # (a c_rehash'ed directory, next to the system's bundle)
        hashed = certs.directory / "trusted"
        hashed.mkdir(exist_ok=True)
        (hashed / "ca.pem").write_bytes(Path(certs.ca).read_bytes())
        subprocess.run(["openssl", "rehash", str(hashed)], check=True, capture_output=True)
        monkeypatch.setenv("SSL_CERT_DIR", str(hashed))
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    fake = FakeUpstream()
    async with serve_tls(fake, certs) as url, run_gateway([url + "/v1"]) as gw:
        whole = await gw.client.post("/v1/chat/completions", json=CHAT)
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["message"]["content"]
        async with gw.client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True, "temperature": 0.5}
        ) as streamed:
            text = (await streamed.aread()).decode()
        assert streamed.status_code == 200 and "data: [DONE]" in text
        models = await gw.client.get("/v1/models")  # (pass-through: aiohttp)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"


@pytest.mark.parametrize(
    ("cert", "trust", "kind", "openssl_says"),
    [
        ("good", False, "unknown issuer", "unable to get local issuer certificate"),
        ("selfsigned", True, "unknown issuer", "self-signed certificate"),
        ("other", True, "hostname mismatch", "IP address mismatch"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_a_refused_certificate_names_its_kind_to_the_client_and_openssls_words_to_the_log(
    certs: Certs,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cert: str,
    trust: bool,
    kind: str,
    openssl_says: str,
    path: str,
) -> None:
    """A client is told what kind of certificate problem it is (a category of OpenSSL's verify
    code: never its message, which names the upstream's host); the operator's log line has
    OpenSSL's own words, on the cached endpoints as on pass-through."""
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    if trust:
        monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
    else:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    caplog.set_level(logging.WARNING, logger="carpool.routing")
    async with serve_tls(FakeUpstream(), certs, cert) as url, run_gateway([url + "/v1"]) as gw:
        if path == "/v1/models":
            response = await gw.client.get(path)
        else:
            response = await gw.client.post(path, json=CHAT)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert message == f"upstream replica-0 is unreachable (TLS certificate not trusted: {kind})"
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("carpool.routing")]
    assert any(openssl_says in line for line in logged), logged


async def test_a_stream_its_client_left_drops_its_tls_connection_so_the_engine_stops(
    trusted: Certs,
) -> None:
    """The engine (``fakes.tls.EndlessStream``) writes events for ever and reads nothing, so
    it learns its caller left only when a write fails. The gateway must drop the TCP connection
    (the next write fails at once), not close TLS cleanly: close_notify, then the socket kept
    open up to 30 s for the engine's reply (asyncio's ``ssl_shutdown_timeout``), the engine
    generating meanwhile. Asserted by what the engine sees first, not by a time: a
    close_notify (``how == "close_notify"``) or the connection gone (``"dropped"``); the wait
    for either is only a guard against a hang, both come as soon as the gateway acts."""
    with endless_stream(trusted) as engine:
        async with run_gateway([engine.url]) as gw:
            await _leave_after_some_events(gw.client, "/v1/chat/completions")
            assert await asyncio.to_thread(engine.gone.wait, 25)
            assert engine.how == "dropped"


async def test_a_pass_through_stream_its_client_left_drops_its_tls_connection_too(
    trusted: Certs,
) -> None:
    """As above, for a pass-through answer (aiohttp's connection)."""
    with endless_stream(trusted) as engine:
        async with run_gateway([engine.url]) as gw:
            await _leave_after_some_events(gw.client, "/v1/generate")
            assert await asyncio.to_thread(engine.gone.wait, 25)
            assert engine.how == "dropped"


async def _leave_after_some_events(client: httpx.AsyncClient, path: str) -> None:
    seen = 0
    async with client.stream("POST", path, json={**CHAT, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break  # (the client leaves: the response closed)


@pytest.mark.parametrize("temperature", [None, 0], ids=["bypass", "miss"])
async def test_a_whole_answer_cut_short_is_a_502_for_a_bypass_as_for_a_miss(
    temperature: float | None,
) -> None:
    """A close-delimited 2xx body (no length, not chunked) its server dropped midway is no
    answer: the same 502 on a sampled request (relayed, ``bypass``) as on a cached one."""
    body = chat_completion("cut short")
    cut = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + body[: len(body) // 2]
    async with raw_upstream(lambda call: (cut, True)) as up, run_gateway([up.url]) as gw:
        asked = dict(CHAT)
        if temperature is None:
            del asked["temperature"]  # (sampled: shares nothing)
        response = await gw.client.post("/v1/chat/completions", json=asked)
    assert response.headers["x-carpool"] == ("bypass" if temperature is None else "miss")
    assert response.status_code == 502
    assert orjson.loads(response.content)["error"]["message"] == (
        "the upstream answered with a body that is not JSON"
    )
    # (The engine took the call and answered: an SDK's retry would run it again, its three
    # tries three generations.)
    assert response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("temperature", [None, 0], ids=["bypass", "miss"])
@pytest.mark.parametrize(
    "body",
    [b"[]", b'data: {"choices": []}\n\n'],
    ids=["an array", "a stream to a call that asked for none"],
)
async def test_a_2xx_body_that_is_no_json_object_is_a_502_the_sdks_do_not_retry(
    temperature: float | None, body: bytes
) -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    async with raw_upstream(lambda call: answer) as up, run_gateway([up.url]) as gw:
        asked = dict(CHAT)
        if temperature is None:
            del asked["temperature"]  # (sampled: shares nothing)
        response = await gw.client.post("/v1/chat/completions", json=asked)
        calls = len(up.calls)
    assert response.status_code == 502 and calls == 1
    assert response.headers["x-should-retry"] == "false"
