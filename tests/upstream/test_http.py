"""``carpool.upstream.http``: what ``HttpUpstream`` makes of what a replica does on the wire.

Each test runs a raw asyncio server that answers exactly the bytes it is given (or nothing),
and calls it through ``HttpUpstream`` (the cached endpoints' ``send``, and pass-through).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from carpool.config import LimitsConfig
from carpool.errors import UpstreamUnreachable
from carpool.upstream.base import UpstreamRequest
from carpool.upstream.http import HttpUpstream

Handle = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handle: Handle) -> AsyncIterator[int]:
    """A server on a free loopback port running ``handle`` for each connection: its port."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    listening = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield listening.sockets[0].getsockname()[1]
    finally:
        listening.close()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()  # (never a byte back, until the client goes)


CHAT = UpstreamRequest("/chat/completions", {"model": "m", "messages": []})


async def test_a_connect_timeout_is_an_unreachable_upstream_not_one_slow_to_answer():
    """A TLS handshake the server never answers: nothing was sent, so the replica is
    unreachable (502, tried elsewhere), as the config says, not a 504 "did not answer in
    time" (for the cached endpoints' calls and for pass-through alike)."""
    async with raw_server(_silent) as port:
        upstream = HttpUpstream(
            f"https://127.0.0.1:{port}/v1", LimitsConfig(upstream_connect_timeout=0.2)
        )
        try:
            with pytest.raises(UpstreamUnreachable, match="connection timed out") as sent:
                await upstream.send(CHAT)
            with pytest.raises(UpstreamUnreachable, match="connection timed out") as passed:
                await upstream.passthrough("GET", "/models", b"", {}, b"")
        finally:
            await upstream.aclose()
    assert sent.value.status == passed.value.status == 502


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def test_an_idle_connection_is_kept_for_limits_upstream_keepalive(monkeypatch):
    """The keep-alive is the operator's to match to the upstream server's (it was 4 s, fixed)."""
    from carpool.upstream import wire

    connections = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(OK)
            await writer.drain()

    async with raw_server(answer) as port:
        upstream = HttpUpstream(f"http://127.0.0.1:{port}/v1", LimitsConfig(upstream_keepalive=30))
        try:
            assert (await upstream.send(CHAT)).status == 200
            real = wire.monotonic
            monkeypatch.setattr(wire, "monotonic", lambda: real() + 20)  # (idle 20 s)
            assert (await upstream.send(CHAT)).status == 200
            assert connections == 1  # kept
            monkeypatch.setattr(wire, "monotonic", lambda: real() + 60)  # (idle 40 s more)
            assert (await upstream.send(CHAT)).status == 200
            assert connections == 2  # past it: closed, a new one
        finally:
            await upstream.aclose()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_stream_is_known_by_its_media_type_in_any_case():
    """Media types are case-insensitive (RFC 9110 8.3.1): a stream said to be
    ``Text/Event-Stream`` was read as a JSON body, a 502 "not JSON"."""

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: Text/Event-Stream; Charset=UTF-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + _chunk(b'data: {"n": 1}\n\n')
            + _chunk(b"data: [DONE]\n\n")
            + b"0\r\n\r\n"
        )
        await writer.drain()
        await reader.read()

    async with raw_server(stream) as port:
        upstream = HttpUpstream(f"http://127.0.0.1:{port}/v1", LimitsConfig())
        try:
            response = await upstream.send(
                UpstreamRequest("/chat/completions", {"model": "m", "stream": True}, stream=True)
            )
            assert response.streaming
            assert [payload async for payload in response.events()] == [[b'{"n": 1}']]
            await response.aclose()
        finally:
            await upstream.aclose()


async def test_pass_through_relays_no_hop_by_hop_header_of_the_answer():
    """They describe the upstream's connection to the gateway: those the answer's Connection
    names and proxy-authenticate, proxy-connection, te, trailer, upgrade were relayed."""
    body = b'{"object": "list", "data": []}'

    async def models(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"Connection: keep-alive, X-Internal-Hop\r\nconnection: x-other-hop\r\n"
            b"x-internal-hop: a\r\nx-other-hop: b\r\nkeep-alive: timeout=5\r\n"
            b"proxy-authenticate: Basic realm=up\r\nproxy-connection: keep-alive\r\n"
            b"te: trailers\r\ntrailer: x-t\r\nupgrade: h2c\r\n"
            b'alt-svc: h3=":443"\r\nx-end-to-end: c\r\n\r\n%s' % (len(body), body)
        )
        await writer.drain()
        await reader.read()

    async with raw_server(models) as port:
        upstream = HttpUpstream(f"http://127.0.0.1:{port}/v1", LimitsConfig())
        try:
            response = await upstream.passthrough("GET", "/models", b"", {}, b"")
            assert b"".join([chunk async for chunk in response.body]) == body
        finally:
            await upstream.aclose()
    relayed = {name.decode().lower(): value for name, value in response.headers}
    assert relayed == {
        "content-type": b"application/json",
        "content-length": b"%d" % len(body),  # (end to end: the bytes go out as they came)
        "alt-svc": b'h3=":443"',
        "x-end-to-end": b"c",
    }


@pytest.mark.parametrize(
    "held", [None, "key", "url"], ids=["client's key", "gateway's key", "gateway's URL credentials"]
)
async def test_pass_through_forwards_the_idempotency_key_and_cache_control(held):
    """Other /v1 paths pass through unchanged: a retried POST /v1/batches reached the upstream
    twice without its Idempotency-Key. Not the key when the gateway holds the upstream's, though
    (a key, or a user and password in the URL): every client's call is then the one account's
    (one client's key would replay another's)."""
    heads: list[bytes] = []

    async def batches(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head.lower())
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        writer.write(b'content-length: 16\r\n\r\n{"id":"batch_1"}')
        await writer.drain()
        await reader.read()

    headers = {
        "content-type": "application/json",
        "idempotency-key": "k-123",
        "x-idempotency-key": "k-456",
        "cache-control": "no-cache",
    }
    async with raw_server(batches) as port:
        userinfo = "user:pw@" if held == "url" else ""
        upstream = HttpUpstream(
            f"http://{userinfo}127.0.0.1:{port}/v1",
            LimitsConfig(),
            api_key="held" if held == "key" else None,
        )
        try:
            response = await upstream.passthrough("POST", "/batches", b"", headers, b"{}")
            assert b"".join([chunk async for chunk in response.body]) == b'{"id":"batch_1"}'
        finally:
            await upstream.aclose()
    (head,) = heads
    assert b"\r\ncache-control: no-cache\r\n" in head
    keys = [b"\r\nidempotency-key: k-123\r\n", b"\r\nx-idempotency-key: k-456\r\n"]
    assert [key in head for key in keys] == [held is None, held is None]
