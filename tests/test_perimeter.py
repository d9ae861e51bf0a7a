"""The gateway's perimeter (issue 13, "trust"): what may cross it, in either direction.

1. Pass-through is confined to the upstream's ``/v1``: a path with a dot segment, an encoded
   separator, a backslash, a control character or an empty segment is a 400 in OpenAI's shape and
   nothing reaches the upstream; ``passthrough.allow`` narrows what is forwarded (403).
2. Nothing private leaves: an upstream URL's credentials, addresses and exception reprs never
   reach a client; with an admin token, /stats, /metrics and /dashboard need it.
3. Bad input stays bad input: JSON nested hundreds of levels deep is a 400, a body that trickles
   in is cut (408), and the gateway serves the next request.
4. Operators see a dead upstream: a rate-limited warning naming the replica (not its
   credentials), ``/healthz`` reporting it, ``/readyz`` 503 while no replica is reachable.

Everything talks HTTP to a real gateway on loopback in front of the counting fake upstream
(``fake.calls`` is exactly what reached it); the request line is written byte for byte where a
client library would normalise the path (httpx resolves ``..`` itself).
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import logging
import socket
from collections.abc import AsyncIterator, Mapping

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.config import Config, ConfigError, LimitsConfig
from carpool.errors import PathRefused, RequestError, UpstreamAnswerCut, UpstreamUnreachable
from carpool.request import ClientRequest, parse
from carpool.routing import build_policy
from carpool.routing.replicas import ReplicaSet
from carpool.upstream.base import PassthroughResponse, UpstreamRequest, UpstreamResponse
from carpool.upstream.http import HttpUpstream, replica_names
from conftest import run_gateway
from fakes.errors import assert_openai_error
from fakes.raw_upstream import RawCall, raw_upstream
from fakes.raw_upstream import answer as raw_answer
from fakes.serving import serve_app
from fakes.upstream import FakeUpstream

ADMIN = "perimeter-admin-token"
BEARER = {"Authorization": f"Bearer {ADMIN}"}
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}


class Raw:
    """An HTTP response read off the socket: status, lower-case headers (repeats kept), body."""

    def __init__(self, raw: bytes) -> None:
        head, _, self.content = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        self.status_code = int(status_line.split()[1])
        self.header_list = [(k.lower(), v) for k, v in (line.split(": ", 1) for line in lines)]
        self.headers = dict(self.header_list)
        self.text = self.content.decode("utf-8", "replace")

    def json(self):
        return orjson.loads(self.content)


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    return host, int(port)


async def raw_request(
    url: str,
    method: str,
    target: bytes,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
) -> Raw:
    """One request whose request line is ``target`` exactly as given (nothing normalised)."""
    host, port = address(url)
    reader, writer = await asyncio.open_connection(host, port)
    lines = [
        method.encode() + b" " + target + b" HTTP/1.1",
        f"host: {host}".encode(),
        f"content-length: {len(body)}".encode(),
        b"connection: close",
    ]
    lines += [f"{k}: {v}".encode("latin-1") for k, v in (headers or {}).items()]
    writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return Raw(raw)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def segments(path: str) -> list[str]:
    return path.split("?")[0].split("/")


# --- 1. pass-through is confined to the upstream's /v1 ------------------------------------------

ESCAPES = [
    b"/v1/../admin",
    b"/v1/./x/../../metrics",
    b"/v1/models/../../health",
    b"/v1/.",
    b"/v1/%2e%2e/admin",
    b"/v1/%2E%2E/admin",
    b"/v1/.%2e/metrics",
    b"/v1/%2e./metrics",
    b"/v1/%2e",
    b"/v1/x/%2e%2e%2f%2e%2e%2fadmin",
    b"/v1/%252e%252e/admin",
    b"/v1/%25252e%25252e/admin",
    b"/v1/a%2fb",
    b"/v1/..%2Fadmin",
    b"/v1/a%5cb",
    b"/v1/a%5C..",
    b"/v1/a\\b",
    b"/v1/..\\admin",
    b"/v1/a%00b",
    b"/v1/a%0ab",
    b"/v1/a%7f",
    b"/v1//admin",
    b"/v1/models//x",
    b"/v1/%c0%ae%c0%ae/admin",
    b"/v1/%ef%bc%8e%ef%bc%8e/admin",
    b"/v1/..;/admin",
    b"/v1/.../admin",
    b"/v1/a%zz",
    b"/v1%2f..%2fadmin",
    b"/v1%2F%2E%2E/admin",
    b"/%76%31/models",
    b"/v1/%2e%2e%2fadmin?x=1",
]


@pytest.mark.parametrize("target", ESCAPES, ids=lambda t: t.decode("latin-1"))
async def test_a_path_that_could_leave_v1_is_refused_and_never_reaches_the_upstream(
    gw, fake, target
):
    response = await raw_request(gw.url, "GET", target)
    assert response.status_code == 400, (target, response.status_code, response.text)
    if response.headers.get("content-type", "").startswith("application/json"):
        assert_openai_error(response, 400, "invalid_path")
    else:  # refused by the HTTP server itself (an invalid request line)
        assert target.count(b"\\") or b"%" not in target
    assert fake.calls == []
    assert (await gw.client.get("/v1/models")).status_code == 200  # still serving


async def test_passthrough_forwards_the_path_under_the_upstreams_v1_and_the_query_as_is(gw, fake):
    response = await raw_request(gw.url, "GET", b"/v1/models/meta-llama%40x?api-version=2&q=%20a")
    assert response.status_code == 200, response.text
    (call,) = fake.calls
    assert (call.method, call.path, call.query) == (
        "GET",
        "/v1/models/meta-llama@x",
        "api-version=2&q=%20a",
    )
    posted = await gw.client.post("/v1/files/f%C3%A9/content?purpose=x", content=b"abc")
    assert posted.status_code == 200 and posted.json()["path"] == "/v1/files/fé/content"
    assert fake.calls[-1].query == "purpose=x"


@pytest.mark.parametrize(
    "path", ["/v1/chat/completionsX", "/v1/completions2", "/v1/embeddingsx", "/v1/messagesX"]
)
async def test_a_cached_endpoints_path_with_a_character_more_is_another_path(gw, fake, path):
    # It was taken for the endpoint (as its trailing "/" is), found in no table: a 500.
    response = await gw.client.post(path, json={"model": "m", "prompt": "x"})
    assert response.status_code == 200 and "x-carpool" not in response.headers
    assert fake.calls[-1].path == path


@pytest.mark.parametrize("path", ["/v1/models", "/v1/files", "/v1/chat/completions"])
async def test_a_cors_preflight_is_passed_through_on_any_v1_path(path):
    """OPTIONS (a browser's CORS preflight, which an engine started with ``--allowed-origins``
    answers) was the gateway's own 405 on every /v1 path. It is passed through as any other
    method is, on a cached endpoint's path too: a preflight is no cached request."""
    allowed = (
        (b"access-control-allow-origin", b"https://app.example"),
        (b"access-control-allow-methods", b"GET, POST"),
        (b"access-control-allow-headers", b"authorization, content-type"),
    )

    def respond(call: RawCall) -> bytes:
        return raw_answer(200, b"OK", b"OK", b"text/plain; charset=utf-8", allowed)

    preflight = {
        "origin": "https://app.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        response = await gw.client.request("OPTIONS", path, headers=preflight)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-carpool" not in response.headers  # (no cached request: nothing to say of one)
    (call,) = upstream.calls
    assert call.line == f"OPTIONS {path} HTTP/1.1"
    assert {name: call.headers[name] for name in preflight} == preflight


async def test_passthrough_sends_a_header_sent_on_several_lines_as_one_joined_value(gw, fake):
    # The cached endpoints joined them (RFC 9110 5.3); pass-through kept only the last line.
    host, port = address(gw.url)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-odd: 1\r\nx-odd: 2\r\nconnection: close\r\n\r\n"
    )
    await writer.drain()
    assert Raw(await reader.read()).status_code == 200
    writer.close()
    assert fake.calls[-1].headers["x-odd"] == "1, 2"


async def test_passthrough_answers_carry_one_date_and_one_server_header(gw, fake):
    # The upstream's were relayed beside the ones the gateway's server writes: two of each.
    response = await raw_request(gw.url, "GET", b"/v1/models")
    assert response.status_code == 200
    names = [name for name, _ in response.header_list]
    assert names.count("date") == 1 and names.count("server") <= 1


async def test_an_upstream_urls_own_query_comes_before_the_clients_on_every_call(
    gateway_with, fake
):
    """Azure's ``?api-version=`` in the upstream URL: pass-through appended the path to the
    whole URL, so the path went into its query (``/v1?api-version=.../models``)."""
    async with gateway_with(upstreams=[fake.url + "?api-version=2024-06-01"]) as gw:
        assert (await gw.chat("hello")).status_code == 200
        assert (fake.calls[-1].path, fake.calls[-1].query) == (
            "/v1/chat/completions",
            "api-version=2024-06-01",
        )
        for target, query in (
            ("/v1/models", "api-version=2024-06-01"),
            ("/v1/models?limit=5&q=%20a", "api-version=2024-06-01&limit=5&q=%20a"),
        ):
            response = await gw.client.get(target)
            assert response.status_code == 200, response.text
            assert (fake.calls[-1].path, fake.calls[-1].query) == ("/v1/models", query)


SEGMENT = st.one_of(
    st.sampled_from(
        [
            "models",
            "x",
            ".",
            "..",
            "...",
            "%2e",
            "%2E",
            "%2e%2e",
            ".%2E",
            "%2f",
            "%2F",
            "%5c",
            "%5C",
            "%252e",
            "%252e%252e",
            "%25252f",
            "%00",
            "%0a",
            "%7f",
            "",
            "a%20b",
            "%",
            "%zz",
            "..;x",
            "%c0%ae",
            "%ef%bc%8e%ef%bc%8e",
            "admin",
            "metrics",
            "%40",
            "caf%C3%A9",
            "%25",
            "a;b",
            "~u",
        ]
    ),
    st.text(alphabet="abcAZ09-._~%/\\:@!$&'()*+,;=", min_size=1, max_size=6),
)


@PROPERTY
@given(parts=st.lists(SEGMENT, min_size=1, max_size=5), trailing=st.booleans())
async def test_passthrough_never_leaves_the_upstreams_v1(gw, fake, parts, trailing):
    target = ("/v1/" + "/".join(parts) + ("/" if trailing else "")).encode()
    calls = len(fake.calls)
    response = await raw_request(gw.url, "GET", target)
    assert response.status_code < 500, (target, response.text)
    new = fake.calls[calls:]
    if response.status_code == 400:
        assert new == [], target
        return
    # Forwarded: one call, under /v1, and no dot segment left for anyone to resolve.
    (call,) = new
    assert call.path.startswith("/v1/"), (target, call.path)
    assert not {".", ".."} & set(segments(call.path)), (target, call.path)
    assert "\\" not in call.path and "\x00" not in call.path


async def test_passthrough_allow_list_forwards_only_the_listed_prefixes(fake, gateway_with):
    async with gateway_with(passthrough={"allow": ["/models", "/files/uploads"]}) as gw:
        for path in ("/v1/models", "/v1/models/m1", "/v1/files/uploads/u1"):
            assert (await gw.client.get(path)).status_code == 200, path
        for path in ("/v1/modelsx", "/v1/files", "/v1/files/other", "/v1/fine_tuning/jobs"):
            assert_openai_error(await gw.client.get(path), 403, "path_not_allowed")
        assert_openai_error(
            await raw_request(gw.url, "GET", b"/v1/models/../admin"), 400, "invalid_path"
        )
        assert [c.path for c in fake.calls] == [
            "/v1/models",
            "/v1/models/m1",
            "/v1/files/uploads/u1",
        ]
    async with gateway_with(passthrough={"allow": []}) as gw:  # off
        assert_openai_error(await gw.client.get("/v1/models"), 403, "path_not_allowed")
        assert (await gw.chat()).status_code == 200  # cached endpoints unaffected


@pytest.mark.parametrize(
    "prefix", ["models", "/../admin", "/models/./x", "//x", "/a%2fb", "/a\\b", "/a?b"]
)
def test_passthrough_allow_list_entries_must_be_plain_paths(prefix):
    with pytest.raises(ConfigError, match="passthrough.allow"):
        Config.load(overrides={"passthrough": {"allow": [prefix]}}, env={})


async def test_the_http_upstream_itself_never_sends_a_dot_segment(fake):
    upstream = HttpUpstream(fake.url, LimitsConfig())
    try:
        for path in ("/../admin", "/%2e%2e/admin", "/a/../../metrics", "//x"):
            with pytest.raises(PathRefused):
                await upstream.passthrough("GET", path, b"", {}, b"")
        assert fake.calls == []
    finally:
        await upstream.aclose()


# --- 2. nothing private leaves ---------------------------------------------------------------------

SECRET_USER, SECRET_PASSWORD, SECRET_KEY = "alice", "pa55-s3cret", "k3y-in-query"


def private_bits(port: int) -> list[str]:
    return [
        SECRET_USER,
        SECRET_PASSWORD,
        SECRET_KEY,
        "127.0.0.1",
        str(port),
        "Error(",
        "ConnectionKey",
        "Connect call",
    ]


async def test_an_unreachable_upstream_is_named_in_words_without_address_credentials_or_repr(
    caplog,
):
    port = closed_port()
    url = f"http://{SECRET_USER}:{SECRET_PASSWORD}@127.0.0.1:{port}/v1?key={SECRET_KEY}"
    async with run_gateway([url]) as gw:
        chat = await gw.chat()
        error = assert_openai_error(chat, 502, "upstream_unreachable")
        assert error["message"] == "upstream replica-0 is unreachable (connection refused)"
        streamed, text = await gw.stream_chat("streamed")
        passthrough = await gw.client.get("/v1/models")
        assert_openai_error(passthrough, 502, "upstream_unreachable")
        health = await gw.client.get("/healthz")
        for response in (chat, passthrough, health):
            for bit in private_bits(port):
                assert bit not in response.text, (bit, response.text)
        for bit in private_bits(port):
            assert bit not in text, (bit, text)
        # Operators (here without an admin token) see the URL, never its credentials or query.
        stats = (await gw.client.get("/stats")).json()
        assert list(stats["replicas"]) == [f"http://127.0.0.1:{port}/v1"]
        metrics = (await gw.client.get("/metrics")).text
        assert f'replica="http://127.0.0.1:{port}/v1"' in metrics
        for leak in (SECRET_USER, SECRET_PASSWORD, SECRET_KEY):
            assert leak not in metrics and leak not in str(stats)
    for leak in (SECRET_USER, SECRET_PASSWORD, SECRET_KEY):
        assert leak not in caplog.text


async def test_credentials_in_an_upstream_url_are_sent_as_basic_auth_not_in_the_url(fake):
    host, port = address(fake.url)
    url = f"http://{SECRET_USER}:{SECRET_PASSWORD}@{host}:{port}/v1"
    async with run_gateway([url]) as gw:
        # aiohttp refuses a URL's credentials beside an Authorization header: that was a 500.
        answered = await gw.chat(headers={"Authorization": "Bearer client-key"})
        assert answered.status_code == 200, answered.text
        assert (
            await gw.client.get("/v1/models", headers={"Authorization": "Bearer k"})
        ).status_code == 200
    basic = "Basic " + base64.b64encode(f"{SECRET_USER}:{SECRET_PASSWORD}".encode()).decode()
    assert [c.headers["authorization"] for c in fake.calls] == [basic, basic]


async def test_configured_upstream_names_are_what_every_surface_says(fake):
    host, port = address(fake.url)
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    async with run_gateway(
        [fake.url, dead], upstream_names=["gpu-a", "gpu-b"], routing={"policy": "round-robin"}
    ) as gw:
        for i in range(4):
            assert (await gw.chat(f"q{i}")).status_code == 200
        stats = (await gw.client.get("/stats")).json()
        assert set(stats["replicas"]) == {"gpu-a", "gpu-b"}
        assert stats["replicas"]["gpu-b"]["state"] in ("down", "probing")
        metrics = (await gw.client.get("/metrics")).text
        assert 'replica="gpu-a"' in metrics and str(port) not in metrics
        health = (await gw.client.get("/healthz")).json()
        assert health["replicas"]["gpu-a"]["healthy"] is True
        assert health["replicas"]["gpu-b"]["healthy"] is False
        assert health["status"] == "degraded"


async def test_the_same_upstream_twice_gets_two_distinct_names(fake):
    async with run_gateway([fake.url, fake.url]) as gw:
        assert (await gw.chat()).status_code == 200
        stats = (await gw.client.get("/stats")).json()
        assert set(stats["replicas"]) == {fake.url, fake.url + "#2"}
        health = (await gw.client.get("/healthz")).json()
        assert set(health["replicas"]) == {"replica-0", "replica-1"}
    named = replica_names(["http://u:p@h:1/v1?k=1", "http://h:1/v1", "http://v:q@h:1/v1"])
    assert named == [
        ("http://h:1/v1", "replica-0"),
        ("http://h:1/v1#2", "replica-1"),
        ("http://h:1/v1#3", "replica-2"),
    ]


@pytest.mark.parametrize(
    "names, why",
    [
        (["a"], "one name per upstream"),
        (["a", "a"], "distinct"),
        (["a", ""], "printable"),
        (["a", "b\n"], "printable"),
    ],
)
def test_upstream_names_are_one_per_upstream_distinct_and_printable(names, why):
    with pytest.raises(ConfigError, match=f"upstream_names.*{why}"):
        Config.load(
            overrides={"upstreams": ["http://a/v1", "http://b/v1"], "upstream_names": names}, env={}
        )


ADMIN_SURFACES = ["/stats", "/metrics", "/dashboard"]


async def test_an_admin_token_opens_every_admin_surface_whatever_its_characters(gateway_with):
    token = "jeton-sécret"  # (sent as UTF-8 bytes, read by the server as latin-1)
    raw = [(b"authorization", ("Bearer " + token).encode("utf-8"))]
    async with gateway_with(admin_token=token) as gw:
        stats = await gw.client.get("/stats", headers=raw)
        invalidate = await gw.client.post("/admin/invalidate", json={"all": True}, headers=raw)
        wrong = await gw.client.post(
            "/admin/invalidate", json={"all": True}, headers={"authorization": "Bearer jeton"}
        )
    assert (stats.status_code, invalidate.status_code, wrong.status_code) == (200, 200, 401)


async def test_a_credential_sent_twice_is_refused_by_the_client_keys(fake, tmp_path, gateway_with):
    keys = tmp_path / "keys.txt"
    keys.write_text("client-a\n")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    async with gateway_with(auth={"client_keys_file": str(keys)}) as gw:
        once = await gw.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": "Bearer client-a"}
        )
        twice = await gw.client.post(
            "/v1/chat/completions",
            json=body,
            headers=[("authorization", "Bearer other"), ("authorization", "Bearer client-a")],
        )
    # Which of the two the upstream would read is a guess: refused, as no key at all is.
    assert (once.status_code, twice.status_code) == (200, 401) and fake.count() == 1


async def test_with_an_admin_token_stats_metrics_and_dashboard_require_it(fake, gateway_with):
    def basic(user: str, password: str) -> dict[str, str]:
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {pair}"}

    async with gateway_with(admin_token=ADMIN) as gw:
        for path in ADMIN_SURFACES:
            for refused in (
                None,
                {"Authorization": "Bearer nope"},
                {"Authorization": f"Bearer {ADMIN}x"},
                {"Authorization": f"Bearer{ADMIN}"},
                {"Authorization": ADMIN},
                {"Authorization": f"Basic {ADMIN}"},
                basic(ADMIN, "nope"),
                {"x-admin-token": ADMIN},
            ):
                response = await gw.client.get(path, headers=refused)
                assert_openai_error(response, 401, "unauthorized")
                challenges = response.headers.get_list("www-authenticate")
                assert any(c.startswith("Bearer") for c in challenges)
                assert any(c.startswith("Basic") for c in challenges)  # a browser asks
                assert ADMIN not in response.text
            assert (await gw.client.get(path, headers=BEARER)).status_code == 200, path
            # Basic with the token as password: what a browser sends once asked.
            assert (await gw.client.get(path, headers=basic("", ADMIN))).status_code == 200
            assert (await gw.client.get(path, headers=basic("me", ADMIN))).status_code == 200
        for open_path in ("/healthz", "/readyz", "/openapi.json"):
            assert (await gw.client.get(open_path)).status_code == 200, open_path
    async with gateway_with() as gw:  # no token: open
        for path in ADMIN_SURFACES:
            assert (await gw.client.get(path)).status_code == 200, path


async def test_the_dashboard_polls_stats_with_what_the_browser_was_asked_for(fake, gateway_with):
    """The page fetches the relative ``stats`` with the browser's default credentials, so the
    Basic credentials it was asked for on /dashboard go with every poll."""
    async with gateway_with(admin_token=ADMIN) as gw:
        pair = base64.b64encode(f"admin:{ADMIN}".encode()).decode()
        page = await gw.client.get("/dashboard", headers={"Authorization": f"Basic {pair}"})
        assert page.status_code == 200 and "fetch('stats'" in page.text
        assert "credentials: 'omit'" not in page.text and "credentials:'omit'" not in page.text
        poll = await gw.client.get("/stats", headers={"Authorization": f"Basic {pair}"})
        assert poll.status_code == 200 and "requests" in poll.json()


async def test_the_authorization_scheme_is_read_in_any_case(fake, gateway_with, tmp_path):
    """RFC 9110 §11.1: the scheme is case-insensitive (``bearer``, ``BEARER``, ``basic``), on
    every surface that reads a credential: the admin token's and the client keys'."""
    keys = tmp_path / "keys.txt"
    keys.write_text("client-a\n")
    pair = base64.b64encode(f"admin:{ADMIN}".encode()).decode()
    config = {"admin_token": ADMIN, "auth": {"client_keys_file": str(keys)}}
    async with gateway_with(**config) as gw:
        for scheme in ("bearer", "BEARER", "bEaReR"):
            given = {"Authorization": f"{scheme} {ADMIN}"}
            for path in ADMIN_SURFACES:
                assert (await gw.client.get(path, headers=given)).status_code == 200, scheme
            invalidate = await gw.client.post(
                "/admin/invalidate", json={"all": True}, headers=given
            )
            assert invalidate.status_code == 200, scheme
            chat = await gw.chat(headers={"Authorization": f"{scheme} client-a"})
            assert chat.status_code == 200, scheme
        for scheme in ("basic", "BASIC"):
            given = {"Authorization": f"{scheme} {pair}"}
            assert (await gw.client.get("/stats", headers=given)).status_code == 200, scheme
        # The scheme only: the token itself is compared exactly.
        wrong = {"Authorization": f"bearer {ADMIN.upper()}"}
        assert (await gw.client.get("/stats", headers=wrong)).status_code == 401
        refused = await gw.client.post("/admin/invalidate", json={"all": True}, headers=wrong)
        assert refused.status_code == 401


@pytest.mark.parametrize("http", ["carpool", "httptools"])
async def test_a_failure_of_the_gateway_is_a_500_in_the_apis_error_shape(fake, http, caplog):
    """A bug (an exception nothing handled) is a 500 in the API's error shape on every path: a
    cached endpoint's request held by carpool's protocol or served through ASGI (uvicorn's own
    protocol), and the Starlette surfaces (``/stats``): never a bare ``Internal Server Error``.
    What failed is in the log, not in the answer."""
    import httpx

    from carpool.server import create_app
    from carpool.wiring import build_gateway
    from fakes.serving import serve_app_with_server

    app = create_app(build_gateway(Config(upstreams=[fake.url])))

    async def handle(_: object) -> None:
        raise RuntimeError("a bug in the gateway")

    def snapshot() -> None:
        raise RuntimeError("a bug in the gateway")

    app.gateway.handle = handle  # type: ignore[method-assign]
    app.gateway.snapshot = snapshot  # type: ignore[method-assign]
    options = {} if http == "carpool" else {"http": "httptools"}
    chat = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    async with serve_app_with_server(app, **options) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
            chatted = await client.post("/v1/chat/completions", json=chat)
            messages = await client.post("/v1/messages", json={**chat, "max_tokens": 4})
            stats = await client.get("/stats")
    assert_openai_error(chatted, 500, "internal_error", "server_error")
    assert chatted.headers["x-carpool"] == "bypass" and "x-request-id" in chatted.headers
    assert_openai_error(stats, 500, "internal_error", "server_error")
    assert messages.status_code == 500 and messages.json()["type"] == "error"  # (Anthropic's)
    assert messages.json()["error"]["type"] == "api_error"
    for response in (chatted, messages, stats):
        assert "a bug" not in response.text
    assert caplog.text.count("RuntimeError: a bug in the gateway") >= 3


@pytest.mark.parametrize("http", ["carpool", "httptools"])
@pytest.mark.parametrize("method", ["GET", "OPTIONS", "DELETE"])
async def test_only_a_post_to_a_cached_endpoints_path_is_that_endpoints_request_when_refused(
    fake, tmp_path, http, method
):
    """Any other method on a cached endpoint's path is pass-through: the gateway's refusal of it
    (a client key, headers too large: as they arrive under carpool's protocol, through ASGI
    under uvicorn's own) is pass-through's, in OpenAI's error shape, without ``x-carpool``,
    and in none of the request counters, as on ``/v1/models``; a POST there is the
    endpoint's request, refused in its API's shape and counted in ``rejected``."""
    import httpx

    from carpool.server import create_app
    from carpool.wiring import build_gateway
    from fakes.serving import serve_app_with_server

    keys = tmp_path / "keys"
    keys.write_text("good\n")
    config = Config(
        upstreams=[fake.url],
        auth={"client_keys_file": str(keys)},
        limits={"max_header_bytes": 4096},
    )
    options = {} if http == "carpool" else {"http": "httptools"}
    refusals = [({"authorization": "Bearer bad"}, 401), ({"x-pad": "p" * 8000}, 431)]
    async with serve_app_with_server(create_app(build_gateway(config)), **options) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:

            async def counters() -> tuple[int, int]:
                stats = (await client.get("/stats")).json()
                return stats["requests"], stats["rejected"]

            for path in ("/v1/chat/completions", "/v1/messages/", "/v1/models"):
                for headers, status in refusals:
                    headers = {"authorization": "Bearer good", **headers}
                    refused = await client.request(method, path, headers=headers)
                    assert_openai_error(refused, status)
                    assert "x-carpool" not in refused.headers, (path, status)
                    assert await counters() == (0, 0), (path, status)
            headers = {"x-api-key": "bad"}
            posted = await client.post("/v1/messages", json=CHAT_BODY, headers=headers)
    assert posted.status_code == 401 and posted.headers["x-carpool"] == "bypass"
    assert posted.json()["type"] == "error"  # (Anthropic's shape)
    assert fake.count() == 0


def test_the_admin_surfaces_compare_the_token_in_constant_time():
    from carpool import admin_http, auth, server

    source = inspect.getsource(auth.presents)
    assert "hmac.compare_digest(" in source and "==" not in source
    # (Both the read surfaces and the write surfaces check the token by it.)
    for surface in (inspect.getsource(server._admin_refusal), inspect.getsource(admin_http)):
        assert "presents(token, " in surface


# --- 3. bad input stays bad input ----------------------------------------------------------------


def nested(depth: int, kind: str) -> bytes:
    if kind == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def chat_with(extra: bytes, where: str) -> bytes:
    if where == "field":
        return (
            b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"x"}],"x":'
            + extra
            + b"}"
        )
    return (
        b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"x","meta":'
        + extra
        + b"}]}"
    )


@pytest.mark.parametrize("depth", [100, 300, 600, 900, 1100])
async def test_json_nested_hundreds_of_levels_deep_is_a_400_not_a_500(gw, fake, depth):
    for kind in "[{":
        response = await gw.client.post(
            "/v1/chat/completions",
            content=chat_with(nested(depth, kind), "field"),
            headers={"content-type": "application/json"},
        )
        error = assert_openai_error(response, 400)
        assert error["code"] in ("too_deep", "invalid_json")
        assert len(response.content) < 1000  # no traceback in it
    assert fake.calls == []
    assert (await gw.chat()).status_code == 200


@PROPERTY
@given(
    depth=st.integers(min_value=1, max_value=1200),
    kind=st.sampled_from("[{"),
    where=st.sampled_from(["field", "message"]),
    path=st.sampled_from(["/v1/chat/completions", "/v1/embeddings"]),
)
async def test_any_nesting_depth_gets_a_400_or_an_answer_never_a_500(
    gw, fake, depth, kind, where, path
):
    extra = nested(depth, kind)
    body = (
        chat_with(extra, where)
        if path.endswith("completions")
        else b'{"model":"e","input":"x","x":' + extra + b"}"
    )
    response = await gw.client.post(
        path, content=body, headers={"content-type": "application/json"}
    )
    # The body's own levels: the top object, the message list and message when inside one.
    levels = depth + (1 if where == "field" or path == "/v1/embeddings" else 3)
    if levels <= LimitsConfig().max_json_depth:
        assert response.status_code == 200, response.text
    else:
        assert_openai_error(response, 400)
    assert (await gw.client.get("/healthz")).status_code == 200


def test_max_json_depth_is_the_deepest_nesting_parse_accepts():
    def request(depth: int) -> ClientRequest:
        return ClientRequest("/v1/chat/completions", chat_with(nested(depth, "["), "field"))

    parse(request(3), 1 << 20, max_json_depth=4)  # object + 3 lists: 4 levels
    with pytest.raises(RequestError) as refused:
        parse(request(4), 1 << 20, max_json_depth=4)
    assert (refused.value.status, refused.value.code) == (400, "too_deep")
    with pytest.raises(ConfigError, match="max_json_depth"):
        Config.load(overrides={"limits": {"max_json_depth": 500}}, env={})


_CHAT = "/v1/chat/completions"
_JSON = {"content-type": "application/json"}


async def test_a_body_of_more_arrays_and_objects_than_max_json_containers_is_a_400(
    fake, gateway_with
):
    """Bytes alone did not bound what a body costs: 8 MB of ``[[...]]`` (millions of lists,
    under the depth limit) was parsed, depth-checked and copied on the event loop for 5-9 s,
    every tenant's requests waiting. More containers than ``limits.max_json_containers`` is a
    400 before the parse; brackets in a string are text, not counted."""
    most = 1000
    async with gateway_with(limits={"max_json_containers": most}) as gw:
        # (The body's own: the top object, the message list and the message.)
        over = chat_with(b"[" + b",".join([b"[]"] * (most - 3)) + b"]", "field")
        refused = await gw.client.post(_CHAT, content=over, headers=_JSON)
        error = assert_openai_error(refused, 400)
        assert error["code"] == "too_many_containers" and fake.calls == []
        within = chat_with(b"[" + b",".join([b"[]"] * (most - 4)) + b"]", "field")
        assert (await gw.client.post(_CHAT, content=within, headers=_JSON)).status_code == 200
        text = orjson.dumps({**orjson.loads(chat_with(b"1", "field")), "x": "[{" * 5 * most})
        assert (await gw.client.post(_CHAT, content=text, headers=_JSON)).status_code == 200


def test_counting_a_bodys_containers_takes_one_pass_whatever_its_strings():
    """Its strings are taken out before the brackets are counted: a string no quote closes
    was looked for again from each quote inside it (an unclosed run of \\" pairs: 220 KB
    took 45 s, the event loop held). Each is found once now."""
    from carpool.request import check_json_containers

    for strings in (b'"' + b'\\"' * 200_000, b'"\\' * 200_000, b'"' * 400_000):
        with pytest.raises(RequestError, match="arrays and objects"):
            check_json_containers(b"[" * 100_001 + strings, 100_000)
    check_json_containers(b'["' + b"[" * 300_000 + b'\\"]"]', 100_000)  # (all text)


async def test_the_admin_invalidate_body_nested_deep_is_a_400(fake, gateway_with):
    async with gateway_with(admin_token=ADMIN) as gw:
        for depth in (300, 900, 1100):
            for body in (nested(depth, "["), b'{"tag":' + nested(depth, "{") + b"}"):
                response = await gw.client.post("/admin/invalidate", content=body, headers=BEARER)
                assert_openai_error(response, 400)
        ok = await gw.client.post("/admin/invalidate", json={"all": True}, headers=BEARER)
        assert ok.json() == {"invalidated": 0}


async def test_passthrough_and_admin_bodies_over_the_limit_are_413_and_not_sent(fake, gateway_with):
    async with gateway_with(admin_token=ADMIN, limits={"max_body_bytes": 1000}) as gw:
        big = b"x" * 2000
        assert_openai_error(await gw.client.post("/v1/files", content=big), 413, "body_too_large")
        assert_openai_error(
            await gw.client.post("/admin/invalidate", content=big, headers=BEARER),
            413,
            "body_too_large",
        )
        assert fake.calls == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/files", "/admin/invalidate"])
async def test_a_body_that_trickles_in_gets_408_and_nothing_goes_upstream(fake, gateway_with, path):
    async with gateway_with(admin_token=ADMIN, limits={"body_read_timeout": 0.3}) as gw:
        host, port = address(gw.url)
        reader, writer = await asyncio.open_connection(host, port)
        body = orjson.dumps(CHAT_BODY)
        # (The admin token is for /admin only: the API refuses it, ``AdminTokenPresented``.)
        key = ADMIN if path.startswith("/admin") else "sk-client"
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\nauthorization: Bearer {key}\r\n\r\n".encode()
            + body[:10]
        )
        await writer.drain()  # ...and the rest never comes
        # Bounded only so that a regression fails instead of hanging; the gateway answers on
        # its own, and closes the connection (the rest of that body is not welcome).
        raw = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        response = Raw(raw)
        assert_openai_error(response, 408, "body_timeout")
        assert response.headers.get("connection") == "close"
        assert fake.calls == []
        assert (await gw.chat()).status_code == 200  # and it serves the next one


# --- 4. operators see a dead upstream ----------------------------------------------------------------


async def test_a_dead_upstream_is_logged_named_without_credentials_and_healthz_readyz_say_so(
    caplog,
):
    caplog.set_level(logging.WARNING, logger="carpool")
    port = closed_port()
    url = f"http://{SECRET_USER}:{SECRET_PASSWORD}@127.0.0.1:{port}/v1"
    async with run_gateway([url], routing={"backoff_s": 60}) as gw:
        # Nothing known yet: /readyz asks the replica itself, and finds it dead.
        assert (await gw.client.get("/readyz")).status_code == 503
        assert_openai_error(await gw.chat(), 502, "upstream_unreachable")
        warnings = [
            r
            for r in caplog.records
            if r.name == "carpool.routing" and r.levelno == logging.WARNING
        ]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        line = warnings[0].getMessage()
        assert "replica-0" in line and f"127.0.0.1:{port}/v1" in line
        assert "connection refused" in line
        assert SECRET_USER not in caplog.text and SECRET_PASSWORD not in caplog.text
        health = await gw.client.get("/healthz")
        assert health.status_code == 200  # still alive
        assert health.json()["status"] == "degraded"
        assert health.json()["replicas"]["replica-0"]["healthy"] is False
        ready = await gw.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False


async def test_healthz_and_readyz_with_a_healthy_upstream_and_with_the_simulator(gw, fake):
    assert (await gw.chat()).status_code == 200
    health = await gw.client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["replicas"] == {
        "replica-0": {"healthy": True, "state": "healthy", "failures": 0}
    }
    ready = await gw.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    async with run_gateway([]) as simulated:  # the embedded simulator
        assert (await simulated.chat()).status_code == 200
        assert (await simulated.client.get("/readyz")).status_code == 200
        assert (await simulated.client.get("/healthz")).json()["status"] == "ok"


async def test_concurrent_readyz_send_one_probe_per_replica(gw, fake, monkeypatch):
    """/readyz is open to anyone, and while no replica had answered in the last few seconds
    each call sent its own ``GET /models`` with the gateway's key: a hundred concurrent calls,
    a hundred upstream calls. They now wait for the one probe under way."""
    n = 20
    fake.gate = asyncio.Event()  # (the probe's /models held until every /readyz is in)
    replicas = gw.gateway.replicas
    ready, entered, all_in = replicas.ready, 0, asyncio.Event()

    async def counted(*args, **kwargs):  # (a spy: the /readyz calls that reached the replicas)
        nonlocal entered
        entered += 1
        if entered == n:
            all_in.set()
        return await ready(*args, **kwargs)

    monkeypatch.setattr(replicas, "ready", counted)
    calls = [asyncio.ensure_future(gw.client.get("/readyz")) for _ in range(n)]
    # Bounded only so that a regression fails instead of hanging.
    await asyncio.wait_for(all_in.wait(), 30)
    await fake.wait_for_calls(1)
    fake.gate.set()
    responses = await asyncio.gather(*calls)
    assert [r.status_code for r in responses] == [200] * n
    assert fake.count("/v1/models") == 1
    assert (await gw.client.get("/stats")).json()["upstream_calls"] == 1


async def test_readyz_turns_ready_at_the_next_probe_once_a_downed_replica_is_back():
    """Every replica down, /readyz asked only those out of back-off, and each readiness probe
    that failed doubled its replica's back-off (up to ``backoff_max_s``): with no traffic to
    find it out, an upstream back from a short outage stayed unready for up to a minute, a
    balancer sending nothing. Now, none eligible, every replica is asked, and a failed
    readiness probe leaves the back-off as it is."""
    ports = [closed_port(), closed_port()]
    urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
    routing = {"backoff_s": 600, "backoff_max_s": 3600}  # (the old probe: not before 10 min)
    async with run_gateway(urls, routing=routing) as gw:
        for _ in range(3):
            assert (await gw.client.get("/readyz")).status_code == 503
        health = (await gw.client.get("/healthz")).json()["replicas"]
        assert [r["failures"] for r in health.values()] == [1, 1]  # (never doubled)

        def models(call: RawCall) -> bytes:
            return raw_answer(200, b"OK", b'{"object": "list", "data": []}')

        async with raw_upstream(models, port=ports[1]) as back:  # no request, only /readyz
            ready = await gw.client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert len(back.calls) == 1  # (one probe found it back)
            health = (await gw.client.get("/healthz")).json()["replicas"]
            assert health["replica-1"]["healthy"] is True


async def test_readyz_answers_from_a_healthy_replica_while_another_hangs():
    """The readiness probe asked the replicas one after another, each within 2 s: one that
    took the call and never answered made every /readyz wait for it (Kubernetes gives a probe
    1 s by default), then left it out as if dead. Asked together, the first answer is
    /readyz's, and the hung replica's call is let go, no verdict on it."""
    hung = asyncio.Event()  # (its answer, once /readyz has answered)
    healthy = FakeUpstream()

    def models(call: RawCall) -> bytes:
        return raw_answer(200, b"OK", b'{"object": "list", "data": []}')

    async with raw_upstream(models) as hanging, serve_app(healthy) as other:
        hanging.gate = hung
        try:
            async with run_gateway([hanging.url, other + "/v1"]) as gw:
                ready = await gw.client.get("/readyz")
                assert ready.status_code == 200, ready.text
                assert len(hanging.calls) == 1 and not hung.is_set()  # (asked, still hanging)
                assert healthy.count("/v1/models") == 1
                health = (await gw.client.get("/healthz")).json()["replicas"]
                assert health["replica-0"] == {"healthy": True, "state": "healthy", "failures": 0}
        finally:
            hung.set()


class Dead:
    """An in-process upstream that is never reachable."""

    name, label = "http://10.0.0.9:8000/v1", "replica-0"

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        raise UpstreamUnreachable("upstream replica-0 is unreachable (connection refused)")

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        raise UpstreamUnreachable("upstream replica-0 is unreachable (connection refused)")

    async def aclose(self) -> None:
        return None


async def test_failures_of_one_replica_are_logged_at_most_once_per_interval_with_a_count(caplog):
    caplog.set_level(logging.INFO, logger="carpool.routing")
    now = [1000.0]
    replicas = ReplicaSet(
        [Dead()], build_policy("round-robin"), clock=lambda: now[0], log_interval=30
    )
    request = UpstreamRequest("/chat/completions", {"model": "m"})

    async def fail_at(t: float) -> None:
        now[0] = t
        with pytest.raises(UpstreamUnreachable):
            await replicas.send(request)

    for t in (1000, 1001, 1010, 1029):
        await fail_at(t)
    with pytest.raises(UpstreamUnreachable):
        await replicas.passthrough("GET", "/models", b"", {}, b"")  # counts too
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        caplog.records[0].getMessage()
    ]
    assert "replica-0 (http://10.0.0.9:8000/v1)" in caplog.records[0].getMessage()
    await fail_at(1031)
    second = caplog.records[-1].getMessage()
    assert len(caplog.records) == 2 and "4 more failure(s) not logged in the last 31 s" in second
    # /readyz asks it, in vain, in back-off (no replica healthy) or not, its back-off as it was.
    assert replicas.replicas[0].errors == 6 and not await replicas.ready()
    assert replicas.replicas[0].errors == 7 and replicas.replicas[0].failures == 6
    now[0] = 5000
    assert not await replicas.ready() and replicas.replicas[0].errors == 8
    assert replicas.replicas[0].failures == 6 and len(caplog.records) == 2


class Cutting(Dead):
    """An in-process upstream whose pass-through answers are cut after their first byte (its
    cached endpoints' calls find it unreachable)."""

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        async def cut() -> AsyncIterator[bytes]:
            yield b"{"
            raise UpstreamAnswerCut("upstream replica-0 failed mid-answer (connection reset)")

        return PassthroughResponse(200, [], cut())


async def test_pass_through_answers_cut_are_logged_at_most_once_per_interval_with_a_count(caplog):
    """Each pass-through answer its replica cut was a warning of its own: a replica cutting
    every answer wrote a line per request, whatever ``routing.log_interval``. They are its
    failures as any: one line per interval, the next counting those held back (its other
    failures too: one budget per replica)."""
    caplog.set_level(logging.INFO, logger="carpool.routing")
    now = [1000.0]
    replicas = ReplicaSet(
        [Cutting()], build_policy("round-robin"), clock=lambda: now[0], log_interval=30
    )

    async def cut_at(t: float) -> None:
        now[0] = t
        answer = await replicas.passthrough("GET", "/files/f1/content", b"", {}, b"")
        with pytest.raises(UpstreamAnswerCut):
            async for _ in answer.body:
                pass

    for t in (1000, 1001, 1010, 1029):
        await cut_at(t)
    first = routing_lines(caplog)
    assert len(first) == 1 and "replica-0 (http://10.0.0.9:8000/v1) cut" in first[0]
    await cut_at(1031)
    assert len(routing_lines(caplog)) == 2
    assert "(3 more failure(s) not logged in the last 31 s)" in routing_lines(caplog)[1]
    now[0] = 1040
    with pytest.raises(UpstreamUnreachable):  # (within the interval: held back)
        await replicas.send(UpstreamRequest("/chat/completions", {"model": "m"}))
    await cut_at(1062)
    lines = routing_lines(caplog)
    assert len(lines) == 3 and "cut" in lines[2] and "(1 more failure(s)" in lines[2]


class Flaky(Dead):
    """An in-process upstream whose calls fail while ``failing`` says so."""

    failing = True

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        if self.failing:
            raise UpstreamUnreachable("upstream replica-0 is unreachable (connection refused)")
        return UpstreamResponse(200, {"content-type": "application/json"}, b"{}")


def routing_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "carpool.routing"]


async def test_a_replica_that_fails_and_recovers_over_and_over_is_logged_at_most_once_per_interval(
    caplog,
):
    # Its recovery does not make its next failure the first: that one is logged, and the line
    # saying it answers again; what follows within the interval is held back, and counted by
    # the first failure logged after it.
    caplog.set_level(logging.INFO, logger="carpool.routing")
    now = [1000.0]
    upstream = Flaky()
    replicas = ReplicaSet(
        [upstream], build_policy("round-robin"), clock=lambda: now[0], log_interval=30
    )
    request = UpstreamRequest("/chat/completions", {"model": "m"})

    async def call(t: float, fails: bool) -> None:
        now[0], upstream.failing = t, fails
        if fails:
            with pytest.raises(UpstreamUnreachable):
                await replicas.send(request)
        else:
            response, _, _ = await replicas.send(request)
            assert response.status == 200

    for t in range(1000, 1020, 2):  # (one replica: tried in its back-off all the same)
        await call(t, True)
        await call(t + 1, False)
    first = routing_lines(caplog)
    assert len(first) == 2
    assert "failed" in first[0] and "answers again after 1 failure(s)" in first[1]
    await call(1040, True)  # the first failure after a quiet period
    await call(1041, False)
    later = routing_lines(caplog)[2:]
    assert len(later) == 2 and "answers again" in later[1]
    assert "9 more failure(s) and 9 recoveries not logged in the last 39 s" in later[0]
    # A logged failure's recovery is logged, its failed probes held back in between or not.
    await call(1080, True)
    await call(1090, True)
    await call(1100, False)
    last = routing_lines(caplog)[4:]
    assert len(last) == 2 and "failed" in last[0]
    assert "answers again after 2 failure(s) (1 more failure(s) not logged" in last[1]


async def test_a_flapping_replica_is_not_a_log_line_per_failure_and_recovery(fake, caplog):
    caplog.set_level(logging.INFO, logger="carpool.routing")
    # (An interval no run of this test outlasts: what is held back is held back.)
    async with run_gateway([fake.url], routing={"log_interval": 3600}) as gw:
        statuses = []
        for i in range(20):
            if i % 2 == 0:
                fake.fail_status, fake.fail_times = 500, 1  # this call fails, the next answers
            response = await gw.client.post(
                "/v1/chat/completions",
                json={**CHAT_BODY, "messages": [{"role": "user", "content": f"q{i}"}]},
            )
            statuses.append(response.status_code)
    assert statuses == [500, 200] * 10
    lines = routing_lines(caplog)
    assert len(lines) == 2
    assert "failed" in lines[0] and "answers again" in lines[1]


async def test_passthrough_never_follows_a_redirect_with_the_clients_credentials(gw, fake):
    # aiohttp followed it, the client's api-key and query along (it drops only Authorization
    # when the origin changes): an upstream's redirect sent them to whatever host it named.
    elsewhere = FakeUpstream()
    async with serve_app(elsewhere) as other:
        fake.redirect_to = f"{other}/v1/collect"
        response = await gw.client.get("/v1/files", headers={"api-key": "CLIENT-SECRET"})
        assert response.status_code == 502 and elsewhere.count() == 0
        assert response.json()["error"]["code"] == "upstream_redirect"


@pytest.mark.parametrize("status", [101, 600, 999])
async def test_passthrough_answers_a_status_no_client_can_read_with_a_502(status):
    """A final status no answer has (a 1xx taken as final, 600-999: httptools reads any three
    digits) was relayed: a 999 a KeyError in the server, a connection closed without an
    answer; a 101 told the client its connection switched protocols. A 502, as a cached
    endpoint answers it; a 304 is an answer (a conditional GET's) and is relayed."""

    def respond(call: RawCall) -> bytes | tuple[bytes, bool]:
        if call.line.startswith("GET /v1/files/same"):
            return raw_answer(304, b"Not Modified", content_type=None)
        return raw_answer(status, b"Whatever", b'{"error": "upstream words"}'), status == 101

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        response = await gw.client.get("/v1/files/odd")
        assert response.status_code == 502 and b"upstream words" not in response.content
        assert response.json()["error"]["code"] == "upstream_bad_status"
        same = await gw.client.get("/v1/files/same", headers={"if-none-match": '"1"'})
        assert same.status_code == 304 and same.content == b""


@pytest.mark.parametrize("status", [302, 999])
async def test_an_upstream_answering_the_readiness_probe_with_a_status_not_relayed_is_ready(
    status,
):
    """A redirect (or a 999) to ``GET /v1/models`` is an answer pass-through does not relay
    (a 502 for its client): the upstream is reachable, and /readyz says so rather than fail."""
    location = ((b"location", b"http://elsewhere.example/v1/models"),)

    def respond(call: RawCall) -> bytes:
        return raw_answer(status, b"Whatever", b"{}", headers=location)

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        ready = await gw.client.get("/readyz")
        assert ready.status_code == 200 and len(upstream.calls) == 1


def cut_models(call: RawCall) -> tuple[bytes, bool]:
    """``GET /v1/models`` answered 200, its head promising 100 bytes: 10 come, then the
    connection closes."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    return head + b'{"data": [', True


async def test_readyz_is_200_when_one_replica_cuts_its_models_answer_and_another_answers(caplog):
    """The cut escaped the readiness probe (aiohttp's ``ClientPayloadError``): /readyz was a 500
    with a traceback, the healthy replica never asked. A replica whose status line came is
    reachable, its body cut or not."""
    caplog.set_level(logging.WARNING)
    healthy = FakeUpstream()
    async with (
        raw_upstream(cut_models) as cutting,
        serve_app(healthy) as other,
        run_gateway([cutting.url, other + "/v1"]) as gw,
    ):
        ready = await gw.client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        assert len(cutting.calls) == 1  # (asked first: its head came, so it is reachable)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR and r.name != "asyncio"] == []


async def test_readyz_with_a_single_replica_that_cuts_its_models_answer_is_200_not_a_500(caplog):
    caplog.set_level(logging.WARNING)
    async with raw_upstream(cut_models) as cutting, run_gateway([cutting.url]) as gw:
        for _ in range(2):
            ready = await gw.client.get("/readyz")
            assert ready.status_code == 200 and ready.json()["ready"] is True
        assert gw.gateway.replicas.snapshot()[cutting.url]["state"] == "healthy"
    assert [r for r in caplog.records if r.levelno >= logging.ERROR and r.name != "asyncio"] == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/stats", "/v1/models"])
async def test_a_host_name_the_gateway_was_not_given_is_refused_an_address_is_served(
    fake, gateway_with, path
):
    """DNS rebinding: a web page the operator opens names the gateway by a name of its own,
    made to resolve to 127.0.0.1, and reads /stats (open without an admin token) and calls
    /v1 on the operator's machine. With ``allowed_hosts``, a ``Host`` naming another name is
    a 403 sent nowhere; an address and an allowed name are served."""
    async with gateway_with(allowed_hosts=["localhost", "Gateway.Internal."]) as gw:
        host, port = address(gw.url)

        async def asked(host_header: str | None) -> Raw:
            reader, writer = await asyncio.open_connection(host, port)
            head = f"{'POST' if 'chat' in path else 'GET'} {path} HTTP/1.1\r\n"
            if host_header is not None:
                head += f"host: {host_header}\r\n"
            body = orjson.dumps(CHAT_BODY) if "chat" in path else b""
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            writer.write((head + "connection: close\r\n\r\n").encode() + body)
            raw = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return Raw(raw)

        async def refused() -> None:
            for name in (
                "attacker.example",
                f"attacker.example:{port}",
                "localhost.evil",
                f"[attacker.example]:{port}",
            ):
                answer = await asked(name)
                assert answer.status_code == 403, (name, answer.status_code)
                assert answer.json()["error"]["code"] == "host_not_allowed"

        await refused()
        for name in (
            f"127.0.0.1:{port}",
            "localhost",
            f"LOCALHOST:{port}",
            "gateway.internal",
            f"[::1]:{port}",
            "[fe80::1%25eth0]",
            "127.1",
        ):
            assert (await asked(name)).status_code == 200, name
        await refused()  # (an answer stored meanwhile: a repeat is refused as well)
    assert fake.count() == (7 if path == "/v1/models" else 1 if "chat" in path else 0)


def test_carpool_serve_on_loopback_allows_only_localhost_by_name_unless_told(tmp_path):
    from carpool.cli import _allowed_hosts

    assert _allowed_hosts(Config(host="127.0.0.1")) == ["localhost"]
    assert _allowed_hosts(Config(host="::1")) == ["localhost"]
    assert _allowed_hosts(Config(host="0.0.0.0")) is None
    assert _allowed_hosts(Config(host="127.0.0.1", allowed_hosts=["*"])) == ["*"]
