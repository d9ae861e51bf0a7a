"""An upstream reached through an HTTP proxy, as the environment names one (``upstream.proxy``,
docs/security.md "Proxies"): an https upstream through the proxy's CONNECT tunnel, an http one
in absolute form, the proxy's credentials sent to it and to nobody else, a proxy's refusal a
502 "unreachable", and loopback, ``NO_PROXY`` and ``upstream.proxy: none`` reached directly.

The upstream is named ``upstream.test``, a name only the test proxy knows (``fakes.proxy``): a
call that did not go through the proxy cannot reach it."""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from yarl import URL

from carpool.upstream.proxy import Unusable, proxy_error, proxy_for
from conftest import run_gateway
from fakes.proxy import HttpProxy
from fakes.serving import serve_app
from fakes.tls import Certs, make_certs, serve_tls
from fakes.upstream import FakeUpstream
from fakes.waiting import eventually

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0}
SAMPLED_STREAM = {**CHAT, "temperature": 0.7, "stream": True}
BASIC = "Basic " + base64.b64encode(b"carpool@corp:p:w/d").decode()
VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the machine's own (a CI host may set them)."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def upstream(
    request: pytest.FixtureRequest, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[FakeUpstream, str, int]]:
    """(the fake, its URL under the name ``upstream.test``, its port), over ``request.param``:
    "https" or "http"."""
    fake = FakeUpstream()
    if request.param == "https":
        monkeypatch.setenv("SSL_CERT_FILE", certs.ca)
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        async with serve_tls(fake, certs) as url:
            port = URL(url).port
            assert port is not None
            yield fake, f"https://upstream.test:{port}/v1", port
    else:
        async with serve_app(fake) as url:
            port = URL(url).port
            assert port is not None
            yield fake, f"http://upstream.test:{port}/v1", port


async def _ask(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """A cached endpoint's call (chat) or a pass-through one (``/v1/models``), by ``path``."""
    if path == "/v1/models":
        return await client.get(path)
    return await client.post(path, json=CHAT)


def _asked(fake: FakeUpstream) -> list[str]:
    return [call.path for call in fake.calls]


@pytest.mark.parametrize("upstream", ["https", "http"], indirect=True)
async def test_an_upstream_is_reached_through_the_proxy_the_environment_names(
    upstream: tuple[FakeUpstream, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole answers, a stream and pass-through all go through the proxy, with its credentials
    (percent-decoded from its URL); the upstream never sees them."""
    fake, url, port = upstream
    async with HttpProxy({"upstream.test": port}, require=BASIC) as proxy:
        with_credentials = proxy.url.replace("://", "://carpool%40corp:p%3Aw%2Fd@")
        variable = "HTTPS_PROXY" if url.startswith("https") else "http_proxy"
        monkeypatch.setenv(variable, with_credentials)
        async with run_gateway([url]) as gw:
            whole = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert whole.status_code == 200, whole.text
            assert whole.json()["choices"][0]["message"]["content"]
            async with gw.client.stream(
                "POST", "/v1/chat/completions", json=SAMPLED_STREAM
            ) as streamed:
                text = (await streamed.aread()).decode()
            assert streamed.status_code == 200 and "data: [DONE]" in text
            models = await gw.client.get("/v1/models")  # (pass-through: aiohttp)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
            again = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert again.headers["x-carpool"] == "hit"
    assert _asked(fake) == ["/v1/chat/completions", "/v1/chat/completions", "/v1/models"]
    assert all("proxy-authorization" not in call.headers for call in fake.calls)
    assert set(proxy.credentials) == {BASIC}
    if url.startswith("https"):
        assert proxy.tunnels and set(proxy.tunnels) == {f"upstream.test:{port}"}
        assert proxy.requests == []
    else:
        assert proxy.tunnels == []
        base = f"http://upstream.test:{port}/v1"
        assert proxy.requests == [
            f"POST {base}/chat/completions",
            f"POST {base}/chat/completions",
            f"GET {base}/models",
        ]


@pytest.mark.parametrize("upstream", ["https", "http"], indirect=True)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_a_proxy_that_refuses_its_credentials_is_a_502_unreachable_that_names_its_407(
    upstream: tuple[FakeUpstream, str, int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    fake, url, port = upstream
    caplog.set_level(logging.DEBUG)
    async with HttpProxy({"upstream.test": port}, require=BASIC) as proxy:
        monkeypatch.setenv("ALL_PROXY", proxy.url.replace("://", "://carpool:s3cret@"))
        async with run_gateway([url]) as gw:
            response = await _ask(gw.client, path)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert message == "upstream replica-0 is unreachable (proxy answered 407)"
    assert fake.calls == []
    assert "s3cret" not in response.text and "s3cret" not in caplog.text


def _answer(status: str, field: str) -> bytes:
    page = b"<html><body>squid/5.7: access denied to http://upstream.test/</body></html>"
    return (
        f"HTTP/1.1 {status}\r\n{field}\r\ncontent-type: text/html\r\n"
        f"content-length: {len(page)}\r\nconnection: close\r\n\r\n"
    ).encode() + page


@pytest.mark.parametrize("upstream", ["http"], indirect=True)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
@pytest.mark.parametrize(
    ("own", "status"),
    [
        (_answer("403 Forbidden", "x-squid-error: ERR_ACCESS_DENIED 0"), 403),
        (
            _answer("503 Service Unavailable", 'proxy-status: p; error="destination_unavailable"'),
            503,
        ),
    ],
    ids=["squid-403", "proxy-status-503"],
)
async def test_an_answer_the_proxy_marks_as_its_own_is_a_502_unreachable_not_the_upstreams(
    upstream: tuple[FakeUpstream, str, int],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    own: bytes,
    status: int,
) -> None:
    """An http upstream's calls go to the proxy in full, so its answers and the proxy's own come
    alike: one the proxy marks as its own (``X-Squid-Error``, RFC 9209's ``Proxy-Status`` with
    an ``error``) is no answer of the upstream's (its page, naming the proxy, never relayed; an
    Idempotency-Key's record not final; the replica not ready), as over a CONNECT tunnel."""
    fake, url, port = upstream
    async with HttpProxy({"upstream.test": port}, own=own) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        async with run_gateway([url]) as gw:
            response = await _ask(gw.client, path)
            ready = await gw.client.get("/readyz")
    assert response.status_code == 502, response.text
    message = response.json()["error"]["message"]
    assert message == f"upstream replica-0 is unreachable (proxy answered {status})"
    assert "squid" not in response.text and fake.calls == []
    assert ready.status_code == 503


@pytest.mark.parametrize("upstream", ["http"], indirect=True)
@pytest.mark.parametrize(
    ("own", "status", "said"),
    [
        (
            _answer("502 Bad Gateway", "x-squid-error: ERR_ZERO_SIZE_OBJECT 0"),
            502,
            "took the call but gave no answer (proxy answered 502)",
        ),
        (
            _answer("502 Bad Gateway", "proxy-status: p; error=connection_terminated"),
            502,
            "took the call but gave no answer (proxy answered 502)",
        ),
        (
            _answer("504 Gateway Timeout", "x-squid-error: ERR_READ_TIMEOUT 0"),
            504,
            "did not answer in time (proxy answered 504)",
        ),
    ],
    ids=["squid-zero-size", "connection-terminated", "squid-read-timeout"],
)
async def test_a_proxy_error_after_the_call_went_on_is_never_run_on_another_replica(
    upstream: tuple[FakeUpstream, str, int],
    monkeypatch: pytest.MonkeyPatch,
    own: bytes,
    status: int,
    said: str,
) -> None:
    """An error the proxy names after it sent the call on (the upstream closed, the proxy's
    read timed out): the upstream may have run it, so a pass-through POST is not tried on the
    other replica (run twice), as one whose connection dropped after it was written whole is
    not. (A cached endpoint's call is judged so too: tried elsewhere only when its replica has
    answered nothing since it was sent, taken for hung, ``routing.replicas``.)"""
    path = "/v1/batches"
    fake, url, port = upstream
    async with HttpProxy({"upstream.test": port, "second.test": port}, own=own) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        second = url.replace("upstream.test", "second.test")
        async with run_gateway([url, second]) as gw:
            response = await gw.client.post(path, json={**CHAT, "purpose": "batch"})
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"].endswith(said)
    assert len(proxy.requests) == 1, proxy.requests


@pytest.mark.parametrize(
    ("proxy_status", "squid", "error"),
    [
        ("", "", None),
        ("p; error=destination_unavailable", "", "destination_unavailable"),
        ('p; error="connection_refused"; details="x"', "", "connection_refused"),
        # (The last member is the nearest proxy's: an earlier hop's error is not its own.)
        ("origin-lb; error=http_response_timeout, fwd; received-status=504", "", None),
        (
            "origin-lb; received-status=503, fwd; error=destination_unavailable",
            "",
            "destination_unavailable",
        ),
        ('squid; received-status=200; details="no error=none, really"', "", None),
        ("", "ERR_ACCESS_DENIED 0", "ERR_ACCESS_DENIED"),
    ],
)
def test_what_a_proxy_says_of_an_answer_it_made_itself_is_read_from_its_last_member(
    proxy_status: str, squid: str, error: str | None
) -> None:
    assert proxy_error(proxy_status, squid) == error


@pytest.mark.parametrize("upstream", ["http"], indirect=True)
async def test_an_upstreams_own_error_through_the_proxy_is_relayed_as_without_one(
    upstream: tuple[FakeUpstream, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url, port = upstream
    fake.fail_status = 503
    async with HttpProxy({"upstream.test": port}) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        async with run_gateway([url]) as gw:
            response = await gw.client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "fake upstream failure"


@pytest.mark.parametrize("upstream", ["https", "http"], indirect=True)
async def test_a_pass_through_call_waiting_for_a_place_in_the_pool_is_not_a_connect_timeout(
    upstream: tuple[FakeUpstream, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``upstream_connect_timeout`` bounds the opening of a connection through the proxy (TCP,
    CONNECT, TLS), not a wait for one of ``upstream_max_connections`` in use: that wait is the
    call's turn, as without a proxy (it failed as unreachable, the replica left out)."""
    fake, url, port = upstream
    fake.gate = asyncio.Event()
    async with HttpProxy({"upstream.test": port}) as proxy:
        monkeypatch.setenv("ALL_PROXY", proxy.url)
        limits = {"upstream_max_connections": 1, "upstream_connect_timeout": 0.2}
        async with run_gateway([url], limits=limits) as gw:
            first = asyncio.ensure_future(gw.client.get("/v1/models"))
            await eventually(lambda: len(fake.calls) == 1)
            second = asyncio.ensure_future(gw.client.get("/v1/models"))
            # (Time passing is the premise, not what is hoped for: past the connect timeout.)
            await asyncio.sleep(1.0)
            assert not second.done() and len(fake.calls) == 1
            fake.gate.set()
            answers = [await first, await second]
            stats = (await gw.client.get("/stats")).json()
    assert [a.status_code for a in answers] == [200, 200]
    assert stats["upstream_errors"] == 0


@pytest.mark.parametrize("upstream", ["https", "http"], indirect=True)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_a_proxy_that_cannot_be_reached_is_named_as_the_one_at_fault(
    upstream: tuple[FakeUpstream, str, int], monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    fake, url, _ = upstream
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # (bound, never listening: refused)
    with closed:
        monkeypatch.setenv("ALL_PROXY", f"http://127.0.0.1:{closed.getsockname()[1]}")
        async with run_gateway([url]) as gw:
            response = await _ask(gw.client, path)
    assert response.status_code == 502, response.text
    message = response.json()["error"]["message"]
    assert message == "upstream replica-0 is unreachable (proxy: connection refused)"
    assert fake.calls == []


@pytest.mark.parametrize("upstream", ["https"], indirect=True)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_a_proxy_that_never_answers_the_connect_is_a_connection_timed_out(
    upstream: tuple[FakeUpstream, str, int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    """Within ``limits.upstream_connect_timeout`` (TCP, CONNECT and TLS together): nothing
    reached the replica, so a 502 "unreachable" as a connection that timed out, and the
    proxy's late failure is nobody's (no "exception was never retrieved")."""
    fake, url, port = upstream
    async with HttpProxy({"upstream.test": port}, stall=True) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        limits = {"upstream_connect_timeout": 0.3}
        async with run_gateway([url], limits=limits) as gw:
            response = await _ask(gw.client, path)
    assert proxy.stalled.is_set()
    assert response.status_code == 502, response.text
    message = response.json()["error"]["message"]
    assert message == "upstream replica-0 is unreachable (connection timed out)"
    assert fake.calls == []
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("upstream", ["https"], indirect=True)
@pytest.mark.parametrize(
    "how", ["upstream.proxy: none", "NO_PROXY names it", "NO_PROXY names its domain"]
)
async def test_an_upstream_the_settings_exclude_is_reached_directly(
    upstream: tuple[FakeUpstream, str, int], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Reached directly, ``upstream.test`` is a name nobody resolves: a 502 "name not resolved",
    the proxy never asked."""
    fake, url, port = upstream
    config = {}
    async with HttpProxy({"upstream.test": port}) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        if how == "upstream.proxy: none":
            config = {"upstream": {"proxy": "none"}}
        elif how == "NO_PROXY names it":
            monkeypatch.setenv("NO_PROXY", f"example.com, upstream.test:{port}")
        else:
            monkeypatch.setenv("no_proxy", ".test")
        async with run_gateway([url], **config) as gw:
            response = await gw.client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert "unreachable" in response.json()["error"]["message"]
    assert proxy.tunnels == [] and proxy.credentials == [] and fake.calls == []


@pytest.mark.parametrize("upstream", ["https", "http"], indirect=True)
async def test_a_loopback_upstream_is_reached_directly_whatever_the_environment_says(
    upstream: tuple[FakeUpstream, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url, port = upstream
    async with HttpProxy({"upstream.test": port}) as proxy:
        monkeypatch.setenv("ALL_PROXY", proxy.url)
        loopback = url.replace("upstream.test", "127.0.0.1")
        async with run_gateway([loopback]) as gw:
            response = await gw.client.post("/v1/chat/completions", json=CHAT)
            models = await gw.client.get("/v1/models")
    assert response.status_code == 200 and models.status_code == 200
    assert proxy.credentials == [] and len(fake.calls) == 2


@pytest.mark.parametrize(
    ("url", "no_proxy", "direct"),
    [
        ("https://api.example.com/v1", "", False),
        ("https://api.example.com/v1", "*", True),
        ("https://api.example.com/v1", "example.com", True),
        ("https://api.example.com/v1", ".example.com", True),
        ("https://example.com/v1", ".example.com", True),
        ("https://notexample.com/v1", "example.com", False),
        ("https://api.example.com:8443/v1", "api.example.com:8443", True),
        ("https://api.example.com/v1", "api.example.com:8443", False),
        ("https://10.1.2.3/v1", "10.0.0.0/8", True),
        ("https://10.1.2.3/v1", "10.1.2.3", True),
        ("https://11.1.2.3/v1", "10.0.0.0/8", False),
        ("https://[2001:db8::1]:8443/v1", "[2001:db8::1]:8443", True),
        ("https://[2001:db8::1]/v1", "2001:db8::/32", True),
        ("https://[2001:db8::1]/v1", "[2001:db8::1]:8443", False),
        ("https://localhost:8000/v1", "", True),
        ("https://127.0.0.9/v1", "", True),
        ("https://[::1]/v1", "", True),
    ],
)
def test_no_proxy_names_domains_addresses_ranges_and_ports_and_loopback_is_always_direct(
    monkeypatch: pytest.MonkeyPatch, url: str, no_proxy: str, direct: bool
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.corp:3128")
    monkeypatch.setenv("NO_PROXY", no_proxy)
    proxy = proxy_for(url)
    assert (proxy is None) is direct
    if proxy is not None:
        assert (proxy.host, proxy.port, proxy.variable) == ("proxy.corp", 3128, "HTTPS_PROXY")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("socks5://proxy.corp:1080", "is not an http:// proxy"),
        ("https://proxy.corp:3128", "is not an http:// proxy"),
        ("http://proxy.corp:99999", "is not a URL"),
    ],
)
def test_a_proxy_the_gateway_cannot_use_is_named_without_its_credentials(
    monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    monkeypatch.setenv("ALL_PROXY", value.replace("://", "://user:s3cret@"))
    with pytest.raises(Unusable) as refused:
        proxy_for("https://api.example.com/v1")
    assert why in str(refused.value) and "s3cret" not in str(refused.value)
    assert "ALL_PROXY" in str(refused.value)


def test_the_environment_is_read_only_for_upstream_proxy_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "proxy.corp:3128")  # (no scheme: http, as curl reads it)
    proxy = proxy_for("http://api.example.com/v1")
    assert proxy is not None and proxy.url == "http://proxy.corp:3128"
    assert proxy_for("http://api.example.com/v1", "none") is None
    assert proxy_for("https://api.example.com/v1") is None  # (HTTPS_PROXY unset, no ALL_PROXY)
