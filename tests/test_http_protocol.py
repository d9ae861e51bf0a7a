"""The HTTP protocol (``carpool.http_protocol``): exact hits answered as they are parsed, every
other request exactly as uvicorn's own protocol serves it. Raw sockets where the bytes on the wire
matter (reads split, pipelining, HTTP/1.0, 100-continue, a malformed body)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from carpool.config import Config
from carpool.http_protocol import GatewayProtocol
from carpool.reply import SLICE_BYTES, Reply
from carpool.server import GatewayApp, create_app
from carpool.wiring import build_gateway
from fakes.raw_upstream import RawCall, raw_upstream
from fakes.serving import ServedApp, serve_app, serve_app_with_server
from fakes.upstream import FakeUpstream
from fakes.waiting import eventually

CHAT = "/v1/chat/completions"


def _body(content: str = "What is carpool?") -> bytes:
    return orjson.dumps(
        {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}
    )


def _request(body: bytes, *, version: str = "1.1", extra: str = "") -> bytes:
    return (
        f"POST {CHAT} HTTP/{version}\r\nhost: gw\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length: status, headers, body."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    return status, headers, await reader.readexactly(length)


class _Counted:
    """How many requests ``answer_now`` was asked about, and how many it answered."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app
        self.asked = self.answered = 0
        original = app.answer_now

        def answer_now(*args: Any) -> Any:
            answered = original(*args)
            self.asked += 1
            self.answered += answered is not None
            return answered

        app.answer_now = answer_now  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def _gateway(fake: Any, **config: Any) -> AsyncIterator[tuple[ServedApp, _Counted]]:
    app = create_app(build_gateway(Config(upstreams=[fake.url], **config)))
    counted = _Counted(app)
    async with serve_app_with_server(app) as served:
        yield served, counted


@contextlib.asynccontextmanager
async def _socket(served: ServedApp) -> AsyncIterator[tuple[Any, Any]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _store(served: ServedApp, body: bytes) -> bytes:
    """A miss, stored: its answer."""
    async with httpx.AsyncClient(base_url=served.url) as client:
        response = await client.post(
            CHAT, content=body, headers={"content-type": "application/json"}
        )
    assert response.headers["x-carpool"] == "miss"
    return response.content


async def test_an_exact_hit_is_answered_as_it_is_parsed_as_the_asgi_path_answers_it(fake):
    gateway = build_gateway(Config(upstreams=[fake.url]))
    app = create_app(gateway)
    counted = _Counted(app)
    async with (
        serve_app_with_server(app) as served,
        serve_app_with_server(app, http="httptools") as plain,  # uvicorn's own protocol
        httpx.AsyncClient() as client,
    ):
        body = _body()
        miss = await client.post(served.url + CHAT, content=body)
        assert (counted.asked, counted.answered) == (1, 0)  # held, asked, handed over
        hits = [await client.post(url + CHAT, content=body) for url in (served.url, plain.url)]
    assert counted.answered == 1 and fake.count() == 1
    assert miss.headers["x-carpool"] == "miss"
    here, there = hits
    assert here.content == there.content == miss.content
    volatile = {"date", "x-request-id"}
    assert [(k, v) for k, v in here.headers.items() if k not in volatile] == [
        (k, v) for k, v in there.headers.items() if k not in volatile
    ]
    assert here.headers["x-carpool"] == "hit" and here.headers["age"] == "0"
    assert here.headers["x-request-id"] != there.headers["x-request-id"]
    assert gateway.stats.outcomes["hit"] == 2


async def test_a_middleware_around_the_gateway_sees_every_request_hits_included(fake):
    """Only uvicorn's own wrappers are looked through for the gateway: a middleware of the
    user's around it (here one that refuses a request without its token) is never skipped by
    answering a hit as it is parsed."""
    gateway = build_gateway(Config(upstreams=[fake.url]))

    class Guard:  # (an ASGI middleware as Starlette's are: the app it wraps in ``app``)
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and (b"x-token", b"letmein") not in scope["headers"]:
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"no"})
                return
            await self.app(scope, receive, send)

    body, token = _body(), {"x-token": "letmein"}
    async with serve_app_with_server(Guard(create_app(gateway))) as served:
        async with httpx.AsyncClient(base_url=served.url) as client:
            stored = await client.post(CHAT, content=body, headers=token)
            assert stored.headers["x-carpool"] == "miss"
            refused = await client.post(CHAT, content=body)  # a hit, if it were let through
            again = await client.post(CHAT, content=body, headers=token)
    assert refused.status_code == 401 and refused.content == b"no"
    assert again.headers["x-carpool"] == "hit" and fake.count() == 1


async def test_pipelined_hits_are_answered_in_order(fake):
    async with _gateway(fake) as (served, counted):
        bodies = [_body(f"q{i}") for i in range(3)]
        stored = [await _store(served, body) for body in bodies]
        async with _socket(served) as (reader, writer):
            writer.write(b"".join(_request(body) for body in bodies))  # in one write
            answers = [await _response(reader) for _ in bodies]
    assert [headers["x-carpool"] for _, headers, _ in answers] == ["hit"] * 3
    assert [answer for *_, answer in answers] == stored  # each its own, in order
    assert len(set(stored)) == 3 and counted.answered == 3


async def test_a_hit_with_a_malformed_request_behind_it_in_the_same_read_is_answered_before_the_400(
    fake,
):
    # The hit's answer waits for the loop's next turn; uvicorn's 400 is written at once, as the
    # bytes after it are parsed: the hit's goes first.
    async with _gateway(fake) as (served, counted):
        stored = await _store(served, _body())
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()) + b"NOT HTTP AT ALL\r\n\r\n")
            hit = await _response(reader)
            refused = await _response(reader)
            assert await reader.read() == b""
    assert (hit[0], hit[1]["x-carpool"], hit[2]) == (200, "hit", stored)
    assert refused[0] == 400 and counted.answered == 1


async def test_a_hit_whose_client_closes_its_side_after_the_request_still_gets_its_answer(fake):
    # Its answer is written a turn of the loop later; the end of the client's side does not
    # lose it, whenever it is read (with the data, on uvloop, only when the data filled the
    # read's buffer: then ``eof_received`` sends the answer first).
    async with _gateway(fake) as (served, counted):
        stored = await _store(served, _body())
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()))
            writer.write_eof()
            status, headers, answer = await _response(reader)
            assert await reader.read() == b""
    assert (status, headers["x-carpool"], answer) == (200, "hit", stored)
    assert counted.answered == 1


async def test_a_hit_pipelined_behind_a_request_still_being_answered_waits_its_turn(fake):
    async with _gateway(fake) as (served, counted):
        await _store(served, _body("stored"))
        fake.gate = asyncio.Event()  # the next upstream call waits
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body("new")) + _request(_body("stored")))
            await fake.wait_for_calls(2)  # (the store's call, then the new one, held)
            fake.gate.set()
            first, second = await _response(reader), await _response(reader)
    assert (first[1]["x-carpool"], second[1]["x-carpool"]) == ("miss", "hit")
    assert counted.answered == 0  # the hit was not held: it was queued behind the miss


async def test_a_body_that_comes_in_two_reads_is_handed_to_the_app_with_what_came(fake):
    async with _gateway(fake) as (served, counted):
        body = _body()
        await _store(served, body)
        asked = counted.asked
        request = _request(body)
        async with _socket(served) as (reader, writer):
            writer.write(request[:-10])
            tasks = served.server.server_state.tasks
            while not tasks:  # handed over after the first read: the request's task exists
                await asyncio.sleep(0)
            writer.write(request[-10:])
            status, headers, _ = await _response(reader)
    assert (status, headers["x-carpool"]) == (200, "hit")  # (the ASGI path's hit)
    assert counted.asked == asked  # never complete while held: never asked


async def test_a_body_over_the_hold_limit_is_handed_over_whole(fake):
    async with _gateway(fake) as (served, counted):
        limit = served.server.config.loaded_app.app.gateway.repeats.max_body
        body = _body("x" * (limit + 1000))
        await _store(served, body)
    assert fake.calls[-1].body["messages"][0]["content"] == "x" * (limit + 1000)
    assert counted.asked == 0


@pytest.mark.parametrize(
    ("version", "extra"),
    [("1.0", ""), ("1.1", "connection: close\r\n")],
    ids=["http/1.0", "connection close"],
)
async def test_a_request_without_keep_alive_takes_the_asgi_path(fake, version, extra):
    async with _gateway(fake) as (served, counted):
        body = _body()
        await _store(served, body)
        asked = counted.asked
        async with _socket(served) as (reader, writer):
            writer.write(_request(body, version=version, extra=extra))
            status, headers, _ = await _response(reader)
            assert await reader.read() == b""  # closed after its answer
    assert (status, headers["x-carpool"]) == (200, "hit")
    assert counted.asked == asked


@pytest.mark.parametrize(("version", "extra"), [("1.1", ""), ("1.0", "")])
async def test_a_header_sent_on_two_lines_is_both_its_values_on_either_path(fake, version, extra):
    # RFC 9110 §5.3: Cache-Control: no-cache beside Cache-Control: max-age=3600 is both
    # directives; the last line alone served a hit to a client that asked for none.
    async with _gateway(fake) as (served, _):
        body = _body()
        await _store(served, body)
        async with _socket(served) as (reader, writer):
            lines = "cache-control: no-cache\r\ncache-control: max-age=3600\r\n"
            writer.write(_request(body, version=version, extra=lines + extra))
            status, headers, _ = await _response(reader)
    assert (status, headers["x-carpool"]) == (200, "miss") and fake.count() == 2


async def _head_only(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """A response's status and headers, its body left to read."""
    status = int((await reader.readline()).split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


def _stream_body(content: str) -> bytes:
    return orjson.dumps({**orjson.loads(_body(content)), "stream": True})


@pytest.mark.parametrize("extra", ["", "connection: keep-alive\r\n"], ids=["plain", "keep-alive"])
@pytest.mark.parametrize("answer", ["miss", "coalesced", "hit"])
async def test_an_http10_stream_is_sent_unframed_and_its_connection_closed_at_its_end(
    fake, answer, extra
):
    """RFC 9112 6.1: chunked is never sent to a client that did not send HTTP/1.1. A stream
    answered to HTTP/1.0 (a miss, a flight joined) was chunked all the same, and its client read
    the chunk sizes as part of the events. Its body is the events as they are, ended by the
    connection's close, even when the client asked to keep the connection; a hit has its
    length, as before."""
    async with _gateway(fake) as (served, _):
        body = _stream_body(f"http/1.0 {answer}")
        leader = None
        if answer == "hit":
            await _store(served, body)
        elif answer == "coalesced":
            fake.chunk_gate = asyncio.Event()
            leader = asyncio.create_task(_store(served, body))
            await fake.chunk_gate_reached.wait()  # (the call goes on: the next one joins it)
        async with _socket(served) as (reader, writer):
            writer.write(_request(body, version="1.0", extra=extra))
            status, headers = await _head_only(reader)  # (a joiner's once it joined)
            if leader is not None:
                fake.chunk_gate.set()
            streamed = await reader.read()  # (all that comes until the connection closes)
        if leader is not None:
            await leader
    assert (status, headers["x-carpool"]) == (200, answer) and fake.count() == 1
    assert streamed.startswith(b"data: {") and streamed.endswith(b"data: [DONE]\n\n"), streamed
    assert "transfer-encoding" not in headers
    if answer == "hit":
        assert headers["content-length"] == str(len(streamed))
    else:
        assert "content-length" not in headers and headers["connection"] == "close"


async def test_an_http10_passthrough_stream_is_sent_unframed_and_its_connection_closed():
    """A pass-through answer without a length (an upstream's chunked stream, relayed as it
    comes) to an HTTP/1.0 client: its bytes as they are, ended by the connection's close."""
    events = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'

    def respond(call: RawCall) -> bytes:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        return head + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
            len(events),
            events,
        )

    async with (
        raw_upstream(respond) as upstream,
        serve_app_with_server(
            create_app(build_gateway(Config(upstreams=[upstream.url])))
        ) as served,
        _socket(served) as (reader, writer),
    ):
        writer.write(
            b"POST /v1/threads/runs HTTP/1.0\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: 2\r\nconnection: keep-alive\r\n\r\n{}"
        )
        status, headers = await _head_only(reader)
        streamed = await reader.read()
    assert (status, headers["content-type"]) == (200, "text/event-stream")
    assert streamed == events
    assert "transfer-encoding" not in headers and "content-length" not in headers
    assert headers["connection"] == "close"


async def test_a_request_expecting_100_continue_takes_the_asgi_path(fake):
    async with _gateway(fake) as (served, counted):
        await _store(served, _body())
        asked = counted.asked
        outcomes = []
        for body in (_body(), _body("new")):
            request = _request(body, extra="expect: 100-continue\r\n")
            head, _, _ = request.partition(b"\r\n\r\n")
            async with _socket(served) as (reader, writer):
                writer.write(head + b"\r\n\r\n")
                assert (await reader.readline()).startswith(b"HTTP/1.1 100")
                await reader.readline()
                writer.write(body)
                status, headers, _ = await _response(reader)
                outcomes.append((status, headers["x-carpool"]))
    assert outcomes == [(200, "hit"), (200, "miss")]  # (expect is no part of the fingerprint)
    assert counted.asked == asked
    assert "expect" not in fake.calls[-1].headers  # the client's 100-continue was its own


async def test_a_request_the_gateway_refuses_is_refused_on_the_asgi_path(fake, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    async with _gateway(
        fake, auth={"client_keys_file": str(keys)}, limits={"max_header_bytes": 600}
    ) as (served, counted):
        body = _body()
        good = {"authorization": "Bearer k1", "content-type": "application/json"}
        async with httpx.AsyncClient(base_url=served.url) as client:
            stored = await client.post(CHAT, content=body, headers=good)
            hit = await client.post(CHAT, content=body, headers=good)
            no_key = await client.post(CHAT, content=body)
            too_large = await client.post(CHAT, content=body, headers={**good, "x-pad": "p" * 600})
    assert (stored.headers["x-carpool"], hit.headers["x-carpool"]) == ("miss", "hit")
    assert no_key.status_code == 401 and too_large.status_code == 431
    assert counted.answered == 1


async def test_a_malformed_body_after_held_headers_is_a_400_with_no_task(fake):
    async with _gateway(fake) as (served, counted):
        async with _socket(served) as (reader, writer):
            writer.write(
                f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
                "zz\r\n".encode()
            )
            status, _, _ = await _response(reader)
            assert await reader.read() == b""
        assert status == 400
        assert not served.server.server_state.tasks and counted.asked == 0
    assert fake.count() == 0


async def test_hits_answered_as_parsed_are_counted_in_stats_and_metrics(fake):
    async with _gateway(fake) as (served, counted):
        body = _body()
        await _store(served, body)
        async with httpx.AsyncClient(base_url=served.url) as client:
            for _ in range(3):
                await client.post(CHAT, content=body)
            stats = (await client.get("/stats")).json()
            metrics = (await client.get("/metrics")).text
    assert counted.answered == 3
    assert stats["hits"] == 3
    assert 'carpool_request_duration_seconds_count{outcome="hit"} 3.0' in metrics


async def test_a_request_behind_a_hit_in_the_same_read_is_not_cut_by_the_keep_alive_timer(fake):
    async with _gateway(fake) as (served, _):
        await _store(served, _body("stored"))
        fake.gate = asyncio.Event()  # the miss's call waits
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body("stored")) + _request(_body("new")))  # in one write
            await fake.wait_for_calls(2)
            (connection,) = served.server.server_state.connections
            # While the miss is being answered, no timer may close its connection (the hit's
            # response armed one, within the read that brought the miss).
            assert connection.timeout_keep_alive_task is None
            fake.gate.set()
            outcomes = [(await _response(reader))[1]["x-carpool"] for _ in range(2)]
    assert outcomes == ["hit", "miss"]


async def test_a_client_that_does_not_read_is_not_sent_answers_without_end(fake):
    """Repeats pipelined by a client that reads nothing: answered here only while the
    connection can take more; then the ASGI path waits for the client, and reading pauses."""
    fake.answer_text = lambda number, body: "w " * 150_000  # a 300 KB stored answer
    async with _gateway(fake) as (served, _):
        body = _body("large")
        answer = await _store(served, body)
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        try:
            writer.write(_request(body) * 60)  # 18 MB of answers asked for, none read
            state = served.server.server_state
            await eventually(lambda: bool(state.tasks), what="the ASGI path taking over")
            (connection,) = state.connections
            buffered = connection.transport.get_write_buffer_size()
        finally:
            writer.transport.abort()
    assert buffered < 4 * len(answer)  # (every answer at once: 60 x 300 KB, less the kernel's)


async def test_a_failure_answering_at_once_is_logged_and_the_request_goes_the_asgi_way(
    fake, caplog
):
    async with _gateway(fake) as (served, counted):
        body = _body()
        await _store(served, body)
        gateway = served.server.config.loaded_app.app.gateway

        def broken(client: Any) -> None:
            raise RuntimeError("a bug")

        gateway.repeat_now = broken
        async with _socket(served) as (reader, writer):
            writer.write(_request(body))
            status, headers, _ = await _response(reader)
    assert (status, headers["x-carpool"]) == (200, "hit")  # (the ASGI path's hit)
    assert "answering a held request failed" in caplog.text


def _unnumbered(body: bytes) -> bytes:
    return re.sub(rb'"id":"[^"]*"|\d', b"", body)


class _Writes(GatewayProtocol):
    """The gateway's protocol, keeping what each write to the client carried."""

    writes: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.transport = _KeptWrites(transport, self.writes)


class _KeptWrites:
    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def _chunked(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response sent in chunks: status, headers, the chunks joined."""
    status = int((await reader.readline()).split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    assert headers["transfer-encoding"] == "chunked"
    body = b""
    while size := int((await reader.readline()).strip(), 16):
        body += await reader.readexactly(size)
        assert await reader.readexactly(2) == b"\r\n"
    assert await reader.readexactly(2) == b"\r\n"
    return status, headers, body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_held_miss_is_served_by_the_protocol_as_the_asgi_path_serves_it(fake, stream):
    """A miss held whole is served in a task of the protocol's own: the same status, headers
    and bytes as through uvicorn's protocol (the ASGI path), a whole reply in one write, a
    stream's head with its first frame, and its last frame with the body's end."""
    gateway = build_gateway(Config(upstreams=[fake.url]))
    app = create_app(gateway)
    _Writes.writes = writes = []
    extra = {"stream": True} if stream else {}
    read = _chunked if stream else _response
    answers = []
    async with (
        serve_app_with_server(app, http=_Writes) as served,
        serve_app_with_server(app, http="httptools") as plain,  # uvicorn's own protocol
    ):
        for number, port in enumerate((served.port, plain.port)):
            body = orjson.dumps({**orjson.loads(_body(f"q{number}")), **extra})
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(_request(body))
                answers.append(await read(reader))
            finally:
                writer.close()
    (here, there) = answers
    assert fake.count() == 2 and here[0] == there[0] == 200
    volatile = {"date", "x-request-id"}
    assert [(k, v) for k, v in here[1].items() if k not in volatile] == [
        (k, v) for k, v in there[1].items() if k not in volatile
    ]
    assert here[1]["x-carpool"] == "miss"
    # (The fake numbers its answers, and echoes the prompt's words.)
    assert _unnumbered(here[2]) == _unnumbered(there[2])
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    if stream:
        assert b"\r\n\r\n" in writes[0] and b"data: " in writes[0]  # head and first frame
        assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # last frame and end
    else:
        assert writes == [writes[0]] and writes[0].endswith(here[2])  # one write, whole


async def test_a_held_request_whose_serving_fails_gets_a_500_and_the_failure_is_logged(
    fake, caplog
):
    """A 500 as uvicorn sends one, its default headers (``server``, ``date``) too, the connection
    closed; in OpenAI's error shape, not uvicorn's bare ``Internal Server Error``."""
    async with _gateway(fake) as (served, counted):
        gateway = served.server.config.loaded_app.app.gateway

        async def broken(client: Any) -> None:
            raise RuntimeError("a bug")

        gateway.handle = broken
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()))
            status, headers, body = await _response(reader)
            assert await reader.read() == b""  # and the connection closed
    assert (status, headers["connection"]) == (500, "close")
    assert orjson.loads(body)["error"]["code"] == "internal_error" and b"a bug" not in body
    assert headers["content-type"] == "application/json" and "x-request-id" in headers
    assert headers["server"] == "uvicorn" and "GMT" in headers["date"]
    assert counted.asked == 1 and "RuntimeError: a bug" in caplog.text


async def test_a_held_miss_answered_during_a_shutdown_says_its_connection_closes(fake):
    async with _gateway(fake) as (served, _):
        fake.gate = asyncio.Event()  # the call waits
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()))
            await fake.wait_for_calls(1)
            (connection,) = served.server.server_state.connections
            connection.shutdown()  # (what uvicorn does to each connection as it stops)
            fake.gate.set()
            status, headers, _ = await _response(reader)
            assert await reader.read() == b""
    assert (status, headers["x-carpool"], headers["connection"]) == (200, "miss", "close")


async def test_a_bypassed_streams_head_is_written_at_once_before_its_first_frame(fake):
    """A request of its own (sampled: not shared) is relayed as the upstream makes it: its head
    goes out at once, as uvicorn's ASGI path sends it, not held for its first frame."""
    app = create_app(build_gateway(Config(upstreams=[fake.url])))
    _Writes.writes = writes = []
    body = orjson.dumps(
        {
            "model": "m",
            "temperature": 1,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    async with (
        serve_app_with_server(app, http=_Writes) as served,
        _socket(served) as (reader, writer),
    ):
        writer.write(_request(body))
        status, headers, streamed = await _chunked(reader)
    assert (status, headers["x-carpool"]) == (200, "bypass")
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"\r\n\r\n")
    assert b"data: " not in writes[0] and b"data: " in writes[1]
    assert streamed.endswith(b"data: [DONE]\n\n")


async def test_a_held_streams_client_leaving_part_way_cancels_the_call(fake):
    """The protocol's own watch: a streaming client that leaves part way (its connection ends)
    takes its request, and with the last client the upstream call, with it."""
    async with _gateway(fake) as (served, _):
        fake.chunk_gate = asyncio.Event()  # the stream stops after its first words
        body = orjson.dumps({**orjson.loads(_body()), "stream": True})
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(_request(body))
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        writer.transport.abort()  # gone, part way
        await fake.wait_for_cancelled(1)
        gateway = served.server.config.loaded_app.app.gateway
        await eventually(lambda: gateway.flights.waiters == 0, what="the request released")
    assert fake.cancelled == 1 and not served.server.server_state.tasks


class _CannotServe(GatewayProtocol):
    def _serve(self, *args: Any) -> None:
        raise RuntimeError("a bug")


async def test_a_failure_starting_to_serve_a_held_request_sends_it_the_asgi_way(fake, caplog):
    app = create_app(build_gateway(Config(upstreams=[fake.url])))
    async with (
        serve_app_with_server(app, http=_CannotServe) as served,
        _socket(served) as (
            reader,
            writer,
        ),
    ):
        writer.write(_request(_body()))
        status, headers, _ = await _response(reader)
    assert (status, headers["x-carpool"]) == (200, "miss")  # (the ASGI path's)
    assert "answering a held request failed" in caplog.text and fake.count() == 1


async def test_a_held_stream_with_a_request_pipelined_behind_it_ends_cleanly_when_its_client_goes(
    fake, caplog
):
    """The connection's end reaches the held request even when uvicorn's current cycle is the
    request queued behind it: the stream's call is cancelled, nothing is written to the closed
    connection, nothing is logged as a failure."""
    async with _gateway(fake) as (served, _):
        fake.chunk_gate = asyncio.Event()  # the stream stops after its first words
        stream = orjson.dumps({**orjson.loads(_body("streamed")), "stream": True})
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(_request(stream) + _request(_body("queued")))  # in one write
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        (connection,) = served.server.server_state.connections
        assert connection.serving is not None and connection.cycle is not connection.serving
        writer.transport.abort()
        await fake.wait_for_cancelled(1)
        await eventually(lambda: not served.server.server_state.tasks, what="the tasks ended")
        assert connection.serving is None
    assert fake.count() == 1  # (the queued request was never started)
    assert "Exception in ASGI application" not in caplog.text


# --- what the protocol reads of a request: trailers, the head's size and its deadline -------


def _chunked_request(body: bytes, trailers: bytes) -> tuple[bytes, bytes]:
    """A chunked request: its head, and the rest (its body in one chunk, then ``trailers``)."""
    head = (
        f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()
    return head, b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailers)


async def _send_chunked(
    served: ServedApp, body: bytes, trailers: bytes, reads: int
) -> tuple[int, dict[str, str], bytes]:
    """A chunked request with ``trailers``, in one read (held) or two: its head, then, once
    uvicorn has the request (its cycle: the ASGI path), the rest."""
    head, rest = _chunked_request(body, trailers)
    async with _socket(served) as (reader, writer):
        if reads == 1:
            writer.write(head + rest)
        else:
            writer.write(head)
            connections = served.server.server_state.connections
            await eventually(
                lambda: any(c.cycle is not None for c in connections), what="uvicorn's cycle"
            )
            writer.write(rest)
        return await asyncio.wait_for(_response(reader), 5)


@pytest.mark.parametrize("reads", [1, 2], ids=["held", "asgi"])
async def test_trailer_fields_are_not_request_headers(fake, reads):
    """RFC 9110 6.5.1: a chunked body's trailer fields are not headers. One in a trailer was
    merged into the request's headers (httptools reports both alike): it changed the cache key
    and Cache-Control, and went upstream as a header."""
    async with _gateway(fake) as (served, _):
        body, smuggled = _body(), b"x-smuggled: yes\r\n"
        first = await _send_chunked(served, body, smuggled, reads)
        assert "x-smuggled" not in fake.calls[-1].headers  # (not forwarded)
        no_cache = await _send_chunked(
            served, body, b"cache-control: no-cache\r\n" + smuggled, reads
        )
        async with _socket(served) as (reader, writer):
            writer.write(_request(body))  # the same request, no trailer: the same key
            plain = await _response(reader)
    assert [answer[1]["x-carpool"] for answer in (first, no_cache, plain)] == ["miss", "hit", "hit"]
    assert fake.count() == 1


@pytest.mark.parametrize("reads", [1, 2], ids=["held", "asgi"])
async def test_a_client_key_sent_only_as_a_trailer_is_no_key(fake, tmp_path, reads):
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    async with _gateway(fake, auth={"client_keys_file": str(keys)}) as (served, _):
        status, _, _ = await _send_chunked(served, _body(), b"authorization: Bearer k1\r\n", reads)
    assert status == 401 and fake.count() == 0


async def _head_parsed(served: ServedApp) -> None:
    """Until the first read of the only connection is parsed (its target seen)."""
    connections = served.server.server_state.connections
    await eventually(
        lambda: any(getattr(c, "url", b"") for c in connections), what="the first read parsed"
    )


async def _refusal(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A refusal, then the connection's end: status, headers, its error object."""
    status, headers, body = await asyncio.wait_for(_response(reader), 5)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection closed
    return status, headers, orjson.loads(body)["error"]


@pytest.mark.parametrize("reads", [1, 2], ids=["one read", "never ending"])
async def test_headers_over_max_header_bytes_are_431_as_they_arrive_and_the_connection_closes(
    fake, reads
):
    """Counted as they arrive, not once the head is complete: a header line that never ends
    grew the gateway's memory without bound (64 MiB sent: RSS +150 MB, no answer)."""
    async with _gateway(fake, limits={"max_header_bytes": 1000}) as (served, _):
        async with _socket(served) as (reader, writer):
            if reads == 1:  # (the whole head at once: refused before any request exists)
                pads = "".join(f"x-pad-{i}: {'p' * 90}\r\n" for i in range(20))
                writer.write(_request(_body(), extra=pads))
            else:
                writer.write(f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\nx-pad: ".encode())
                await _head_parsed(served)
                writer.write(b"p" * 1500)  # (and never a line's end)
            status, headers, error = await _refusal(reader)
        assert not served.server.server_state.tasks
    assert (status, headers["connection"], error["code"]) == (431, "close", "headers_too_large")
    assert headers["x-carpool"] == "bypass" and headers["content-type"] == "application/json"
    assert fake.count() == 0


@pytest.mark.parametrize("reads", [1, 2], ids=["one read", "never ending"])
async def test_a_trailer_section_over_max_header_bytes_is_431_and_the_connection_closes(
    fake, reads
):
    """Trailer fields are dropped, but httptools keeps each line until it ends: they are held
    to the same limit as the headers, as they arrive."""
    async with _gateway(fake, limits={"max_header_bytes": 1000}) as (served, _):
        async with _socket(served) as (reader, writer):
            if reads == 1:
                head, rest = _chunked_request(_body(), b"x-t: " + b"t" * 1500 + b"\r\n")
                writer.write(head + rest)
            else:
                head, rest = _chunked_request(_body(), b"x-t: ")
                writer.write(head + rest[:-2])  # (the trailer line begun)
                connections = served.server.server_state.connections
                await eventually(
                    lambda: any(c.cycle is not None for c in connections), what="uvicorn's cycle"
                )
                writer.write(b"t" * 1500)
            status, headers, error = await _refusal(reader)
    assert (status, headers["connection"], error["code"]) == (431, "close", "headers_too_large")
    assert fake.count() == 0


@pytest.mark.parametrize("pieces", [1, 2])
async def test_a_request_target_over_max_header_bytes_is_414_as_it_arrives(fake, pieces):
    """The target was never counted (uvicorn adds each piece to the last: memory, and CPU
    quadratic in its length when it trickles in). Refused alike in one piece or two: in one,
    it was refused before its path was held, so in no endpoint's shape and counted nowhere."""
    async with _gateway(fake, limits={"max_header_bytes": 1000}) as (served, counted):
        async with _socket(served) as (reader, writer):
            if pieces == 1:
                writer.write(f"POST {CHAT}?q=".encode() + b"q" * 1500)
            else:
                writer.write(f"POST {CHAT}?q=".encode())
                await _head_parsed(served)
                writer.write(b"q" * 1500)
            status, headers, error = await _refusal(reader)
        stats = counted.app.gateway.snapshot()
    assert (status, headers["connection"], error["code"]) == (414, "close", "target_too_long")
    assert error["type"] == "invalid_request_error" and fake.count() == 0
    assert headers["x-carpool"] == "bypass" and stats["rejected"] == 1


@pytest.mark.parametrize(
    ("limit", "size"),
    [(None, 65_536), (None, 66_000), (200_000, 70_000)],
    ids=["default-one-past", "default", "raised"],
)
async def test_a_target_past_what_the_http_parser_takes_is_a_414_in_its_endpoints_shape(
    fake, limit, size
):
    """uvicorn parses every target with httptools, which refuses one past 65,535 bytes: a
    target the limit allowed (the default's 65,536, or a raised limit) was a 400 "not valid
    HTTP/1.1" in OpenAI's shape on every path, and one refused as too long lost its path (in
    no endpoint's shape, no ``x-carpool``, counted nowhere). 65,535 is the most taken."""
    limits = {} if limit is None else {"limits": {"max_header_bytes": limit}}
    prefix = b"POST /v1/messages?q="
    async with _gateway(fake, **limits) as (served, counted):
        async with _socket(served) as (reader, writer):
            writer.write(prefix + b"q" * (size - len(prefix) + len(b"POST ")))
            writer.write(b" HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\n\r\n{}")
            status, headers, error = await _refusal(reader)
        stats = counted.app.gateway.stats.snapshot()
    assert (status, headers["x-carpool"]) == (414, "bypass"), error
    assert "code" not in error and error["type"] == "invalid_request_error", error  # Anthropic's
    assert stats["rejected"] == 1 and fake.count() == 0


async def test_a_target_of_65535_bytes_is_served(fake) -> None:
    """The longest target uvicorn's parser takes, under the default limits: served."""
    async with _gateway(fake) as (served, _):
        target = "/v1/models?q="
        async with httpx.AsyncClient(base_url=served.url) as client:
            answer = await client.get(target + "q" * (65_535 - len(target)))
    assert answer.status_code == 200, answer.text
    assert fake.count("/v1/models") == 1


@pytest.mark.parametrize(
    "sent",
    [b"", f"POST {CHAT[:10]}".encode(), f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\ncontent-le".encode()],
    ids=["nothing", "inside the request line", "inside the headers"],
)
async def test_a_request_head_not_complete_within_body_read_timeout_is_cut(fake, sent):
    """Slowloris: a connection that sent nothing, or stopped inside its request line or
    headers, was held for good. Cut at the deadline: a 408 once a request began, else closed
    as uvicorn closes an idle connection, without a word."""
    async with _gateway(fake, limits={"body_read_timeout": 0.5}) as (served, _):
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with _socket(served) as (reader, writer):
            writer.write(sent)
            if sent:
                status, headers, error = await _refusal(reader)
            else:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            elapsed = loop.time() - started
    assert elapsed >= 0.5  # (not before the deadline)
    if sent:
        assert (status, headers["connection"], error["code"]) == (408, "close", "header_timeout")


async def test_an_idle_keep_alive_connection_is_left_to_uvicorns_keep_alive_timeout(fake):
    """Between requests the connection is uvicorn's: closed, without a word, after its
    ``timeout_keep_alive``, not at the head's deadline."""
    app = create_app(build_gateway(Config(upstreams=[fake.url], limits={"body_read_timeout": 0.2})))
    loop = asyncio.get_running_loop()
    async with serve_app_with_server(app, timeout_keep_alive=1) as served:
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()))
            status, _, _ = await _response(reader)
            answered = loop.time()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            idle = loop.time() - answered
    assert status == 200 and idle >= 0.9


class _Deadlines(GatewayProtocol):
    """The gateway's protocol, counting its head deadline's turns (``fired``)."""

    fired = 0

    def _head_deadline(self) -> None:
        type(self).fired += 1
        super()._head_deadline()


async def test_a_request_head_behind_one_being_answered_is_not_cut_while_it_waits(fake):
    """A request pipelined behind one still being answered: its head's deadline does not cut
    the connection (and the answer in progress) while it waits; after, it does."""
    app = create_app(build_gateway(Config(upstreams=[fake.url], limits={"body_read_timeout": 0.2})))
    _Deadlines.fired = 0
    fake.gate = asyncio.Event()  # the first request's call waits
    async with serve_app_with_server(app, http=_Deadlines) as served:
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()) + f"POST {CHAT} HTTP/1.1\r\nhost:".encode())
            await fake.wait_for_calls(1)
            await eventually(lambda: _Deadlines.fired >= 2, what="two turns of the deadline")
            fake.gate.set()
            status, headers, _ = await asyncio.wait_for(_response(reader), 5)
            assert (status, headers["x-carpool"]) == (200, "miss")
            status, headers, error = await _refusal(reader)
    assert (status, error["code"]) == (408, "header_timeout")


@pytest.mark.parametrize("size", [300, 70_000])
async def test_a_request_pipelined_behind_a_closing_connection_is_never_run(fake, caplog, size):
    # A 413 closes the connection, lingering: the request sent behind it in the same write
    # was still run (an upstream call whose answer nobody could read; with the client still
    # there, uvicorn then failed writing after the close). uvicorn's own protocol runs none.
    app = create_app(build_gateway(Config(upstreams=[fake.url], limits={"max_body_bytes": 200})))
    big = b'{"model": "m", "x": "' + b"a" * size + b'"}'
    async with serve_app_with_server(app) as served:
        async with _socket(served) as (reader, writer):
            writer.write(
                _request(big) + _request(_body("two")) + f"POST {CHAT} HTTP/1.1\r\nhost: g".encode()
            )
            status, _, _ = await asyncio.wait_for(_response(reader), 5)
            assert status == 413 and await asyncio.wait_for(reader.read(), 5) == b""
        await eventually(lambda: not served.server.server_state.tasks, what="no request running")
    assert fake.count() == 0 and "Exception in ASGI application" not in caplog.text


@pytest.mark.parametrize("target", ["GET /healthz", "POST /nope", "POST /v1/../x"])
async def test_the_rest_of_a_body_answered_before_its_end_must_come_within_body_read_timeout(
    fake, target
):
    """Slowloris after the answer: a request answered before its body came (a 404, a
    refusal, a route that reads none), its client sending a byte of the rest now and then:
    each read disarmed the keep-alive timer and nothing else bounded it, so the connection was
    held for ever. It closes once the rest has not all come within ``body_read_timeout``."""
    async with _gateway(fake, limits={"body_read_timeout": 0.5}) as (served, _):
        async with _socket(served) as (reader, writer):
            writer.write(
                f"{target} HTTP/1.1\r\nhost: gw\r\ncontent-length: 1000000\r\n\r\n".encode()
            )
            status, _, _ = await asyncio.wait_for(_response(reader), 5)
            writer.write(b"x")  # a byte of the rest, then nothing
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
    assert status in (200, 400, 404)
    assert fake.count() == 0


async def test_the_rest_of_a_body_that_comes_in_time_keeps_the_connection(fake):
    async with _gateway(fake, limits={"body_read_timeout": 5}) as (served, _):
        async with _socket(served) as (reader, writer):
            writer.write(b"POST /nope HTTP/1.1\r\nhost: gw\r\ncontent-length: 4\r\n\r\nab")
            status, _, _ = await asyncio.wait_for(_response(reader), 5)
            writer.write(b"cd" + _request(_body()))  # the rest, then the next request
            again, _, _ = await asyncio.wait_for(_response(reader), 5)
    assert (status, again) == (404, 200)


@pytest.mark.parametrize(
    ("target", "upgrade"),
    [
        (CHAT, "h2c"),
        ("/v1/models", "h2c"),
        ("/v1/models", "websocket"),
    ],
)
async def test_a_request_with_a_body_asking_to_upgrade_is_refused_never_served_without_it(
    fake, target, upgrade
):
    """The HTTP parser takes what follows an upgrade's head for the new protocol: the body was
    lost (pass-through sent the upstream an empty one, a cached endpoint said the JSON was
    empty), and a WebSocket upgrade was handed to a handshake that waited for ever."""
    async with _gateway(fake) as (served, _):
        async with _socket(served) as (reader, writer):
            body = _body()
            writer.write(
                (
                    f"POST {target} HTTP/1.1\r\nhost: gw\r\nconnection: Upgrade\r\n"
                    f"upgrade: {upgrade}\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    f"sec-websocket-version: 13\r\ncontent-length: {len(body)}\r\n\r\n"
                ).encode()
                + body
            )
            status, headers, error = await _refusal(reader)
    assert (status, headers["connection"], error["code"]) == (400, "close", "upgrade_not_served")
    assert fake.count() == 0


@pytest.mark.parametrize("upgrade", ["h2c", "websocket"])
async def test_a_request_without_a_body_asking_to_upgrade_is_served_as_if_it_had_not(
    fake, upgrade, caplog
):
    # Served, but uvicorn warned twice a request ("Unsupported upgrade request.", "No supported
    # WebSocket library detected"), at every log level: any client (curl --http2 sends h2c)
    # filled the log, with advice that was wrong here.
    caplog.set_level(logging.WARNING)
    async with _gateway(fake) as (served, _):
        async with _socket(served) as (reader, writer):
            for _ in range(3):
                writer.write(
                    f"GET /healthz HTTP/1.1\r\nhost: gw\r\nconnection: Upgrade\r\nupgrade: "
                    f"{upgrade}\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    "sec-websocket-version: 13\r\n\r\n".encode()
                )
                status, _, _ = await asyncio.wait_for(_response(reader), 5)
                assert status == 200
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def _upgrading(upgrade: str) -> bytes:
    """A bodiless request asking to upgrade the connection (served as if it had not)."""
    return (
        f"GET /healthz HTTP/1.1\r\nhost: gw\r\nconnection: Upgrade\r\nupgrade: {upgrade}\r\n"
        "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    ).encode()


@pytest.mark.parametrize("upgrade", ["h2c", "websocket"])
async def test_requests_pipelined_behind_a_bodiless_upgrade_request_are_each_answered(
    fake, upgrade
):
    """The parser stops at an upgrade request's end and the rest of that read was dropped: the
    requests pipelined behind it in the same read were never answered (a client reading its
    answers in order took the next one's for theirs), and a request's head dropped so left its
    body, coming in the next read, to be read as a request of its own."""
    async with _gateway(fake) as (served, _):
        async with _socket(served) as (reader, writer):
            writer.write(
                _upgrading(upgrade)
                + _request(_body())
                + _upgrading(upgrade)
                + b"GET /nope HTTP/1.1\r\nhost: gw\r\n\r\n"
            )
            statuses = [(await asyncio.wait_for(_response(reader), 5))[0] for _ in range(4)]
            assert statuses == [200, 200, 200, 404]
            # A head behind it in the same read, its body in the next: that body is its.
            body = _body("Is this a request of its own?")
            head = _request(body)[: -len(body)]
            writer.write(_upgrading(upgrade) + head)
            assert (await asyncio.wait_for(_response(reader), 5))[0] == 200
            writer.write(body)
            status, headers, answer = await asyncio.wait_for(_response(reader), 5)
    assert (status, headers["x-carpool"]) == (200, "miss"), answer
    assert fake.count() == 2


def _chunks(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


# Requests httptools cannot read (RFC 9112): the header fields after the request's own, its body.
_MALFORMED = {
    "content-length not a number": (b"content-length: abc\r\n", _body()),
    "two content-lengths": (b"content-length: %d\r\ncontent-length: 5\r\n" % len(_body()), _body()),
    "content-length and chunked": (
        b"content-length: 5\r\ntransfer-encoding: chunked\r\n",
        _chunks(_body()),
    ),
    "a bad chunk size": (b"transfer-encoding: chunked\r\n", b"zz\r\nabc\r\n0\r\n\r\n"),
    "a space before a colon": (b"content-length : %d\r\n" % len(_body()), _body()),
}
# A target and what its refusals look like: the API's error shape on a cached endpoint, with
# ``x-carpool: bypass`` and counted in ``rejected``; OpenAI's elsewhere, counted nowhere.
_TARGETS = [CHAT, "/v1/messages", "/v1/files"]


async def _refused_framing(
    fake: Any, target: str, fields: bytes, body: bytes
) -> tuple[int, dict[str, str], dict[str, Any], int]:
    """``target`` POSTed with ``fields`` and ``body``, its answer read to the connection's end:
    status, headers, JSON body, and the gateway's ``rejected`` count."""
    gateway = build_gateway(Config(upstreams=[fake.url]))
    async with serve_app_with_server(create_app(gateway)) as served:
        async with _socket(served) as (reader, writer):
            writer.write(
                f"POST {target} HTTP/1.1\r\nhost: gw\r\nx-request-id: framing-1\r\n"
                "content-type: application/json\r\n".encode()
                + fields
                + b"\r\n"
                + body
            )
            status, headers, content = await asyncio.wait_for(_response(reader), 5)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection closed
        await eventually(lambda: not served.server.server_state.tasks, what="no request running")
    assert fake.count() == 0  # (nothing of it reached the upstream)
    return status, headers, orjson.loads(content), gateway.stats.rejected


def _assert_in_the_apis_shape(
    target: str, headers: dict[str, str], answer: dict[str, Any], rejected: int
) -> dict[str, Any]:
    """The refusal is the API's error (its shape, ``bypass``, counted), with the request's id
    and ``connection: close``; its error object."""
    assert headers["x-request-id"] == "framing-1" and headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    if target == "/v1/messages":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    else:
        assert answer["error"]["type"] == "invalid_request_error"
    if target == "/v1/files":  # (pass-through: in no request counter, no x-carpool)
        assert "x-carpool" not in headers and rejected == 0
    else:
        assert headers["x-carpool"] == "bypass" and rejected == 1
    return answer["error"]


@pytest.mark.parametrize("target", _TARGETS)
@pytest.mark.parametrize("case", list(_MALFORMED))
async def test_a_request_with_malformed_framing_is_a_400_in_the_apis_shape_with_its_request_id(
    fake, case, target
):
    """uvicorn answered it itself: a text/plain 400 "Invalid HTTP request received.", without
    ``x-request-id``, in no API's error shape, counted nowhere."""
    fields, body = _MALFORMED[case]
    status, headers, answer, rejected = await _refused_framing(fake, target, fields, body)
    assert status == 400, answer
    error = _assert_in_the_apis_shape(target, headers, answer, rejected)
    assert "HTTP" in error["message"]
    if target != "/v1/messages":
        assert error["code"] == "invalid_http"


@pytest.mark.parametrize("target", _TARGETS)
@pytest.mark.parametrize(
    "fields",
    [
        b"transfer-encoding: gzip, chunked\r\n",
        b"transfer-encoding: gzip\r\ntransfer-encoding: Chunked\r\n",
    ],
    ids=["one line", "two lines"],
)
async def test_a_transfer_coding_other_than_chunked_is_501_in_the_apis_shape(fake, fields, target):
    """RFC 9112 6.1. The gzip was ignored: the body, de-chunked but still said to be gzip, was
    served as it came (a plain body labelled so, a 200; a compressed one, a 400 blaming its
    JSON), and passed through without its coding."""
    status, headers, answer, rejected = await _refused_framing(
        fake, target, fields, _chunks(_body())
    )
    assert status == 501, answer
    error = _assert_in_the_apis_shape(target, headers, answer, rejected)
    assert "Transfer-Encoding" in error["message"]
    if target != "/v1/messages":
        assert error["code"] == "unsupported_transfer_encoding"


async def test_a_malformed_requests_log_line_carries_the_id_its_refusal_does(fake):
    # The 400's x-request-id was the client's, its log line said "[-]" (no request's id): the
    # one could not be found by the other. And it was an INFO line a request, for any client.
    from carpool.request_id import RequestIdFilter

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.addFilter(RequestIdFilter())
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("carpool.server")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.DEBUG
    try:
        async with _gateway(fake) as (served, _):
            async with _socket(served) as (reader, writer):
                writer.write(
                    f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\nx-request-id: framing-9\r\n".encode()
                    + b"content-length: abc\r\n\r\n"
                )
                status, headers, error = await _refusal(reader)
    finally:
        logger.removeHandler(handler)
        logger.level = level
    assert (status, error["code"], headers["x-request-id"]) == (400, "invalid_http", "framing-9")
    said = [r for r in records if "not valid HTTP/1.1" in r.getMessage()]
    assert [(r.levelno, r.request_id) for r in said] == [(logging.DEBUG, "framing-9")]  # type: ignore[attr-defined]


async def test_a_malformed_request_pipelined_behind_one_being_answered_is_refused_after_its_answer(
    fake,
):
    """uvicorn's 400 was written as the bytes were parsed, the connection closed with it: the
    answer to the request before it was lost."""
    gateway = build_gateway(Config(upstreams=[fake.url]))
    async with serve_app_with_server(create_app(gateway)) as served:
        async with _socket(served) as (reader, writer):
            writer.write(
                b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n"
                + f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\nx-request-id: framing-2\r\n".encode()
                + b"content-length: abc\r\n\r\n"
            )
            answered, _, _ = await asyncio.wait_for(_response(reader), 5)
            status, headers, error = await _refusal(reader)
    assert answered == 200
    assert (status, error["code"], headers["x-request-id"]) == (400, "invalid_http", "framing-2")
    assert headers["x-carpool"] == "bypass" and gateway.stats.rejected == 1


async def test_a_malformed_body_refused_while_it_still_comes_is_answered_and_the_rest_dropped(
    fake,
):
    """The 400 was written and the connection closed at once, with the client still sending:
    the kernel reset the connection, and the client could lose its answer. It lingers, as
    the other refusals made as the request is read."""
    async with _gateway(fake) as (served, _):
        async with _socket(served) as (reader, writer):
            writer.write(
                f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".encode()
            )
            status, headers, _ = await asyncio.wait_for(_response(reader), 5)
            writer.write(b"x" * 4_000_000)  # (what the client was still sending)
            await asyncio.wait_for(writer.drain(), 5)  # read and dropped, never reset
            assert await asyncio.wait_for(reader.read(), 5) == b""  # (this side shut)
    assert (status, headers["connection"]) == (400, "close")
    assert fake.count() == 0


async def test_the_rest_of_a_body_answered_early_that_came_leaves_the_idle_connection_to_keep_alive(
    fake,
):
    """The rest of a body answered before its end came in time, then nothing: each read of
    the rest had disarmed uvicorn's keep-alive timer, and nothing armed it again (two writes
    held a connection for ever). Idle between requests, it is keep-alive's again."""
    app = create_app(build_gateway(Config(upstreams=[fake.url], limits={"body_read_timeout": 30})))
    async with serve_app_with_server(app, timeout_keep_alive=1) as served:
        async with _socket(served) as (reader, writer):
            writer.write(b"POST /nope HTTP/1.1\r\nhost: gw\r\ncontent-length: 10\r\n\r\n12345")
            status, _, _ = await asyncio.wait_for(_response(reader), 5)
            writer.write(b"67890")  # the rest, in time; then idle
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by keep-alive
    assert status == 404


@pytest.mark.parametrize("between", [b"\r\n", b"\r\n\r\n"])
async def test_a_blank_line_between_requests_does_not_hold_an_idle_connection_past_keep_alive(
    fake, between
):
    """A blank line after an answer (one a client may send between requests, RFC 9112 2.2)
    disarmed uvicorn's keep-alive timer, as every read does, and began no request that would
    arm the head's: the connection, idle, was held for ever. It is keep-alive's again."""
    app = create_app(build_gateway(Config(upstreams=[fake.url], limits={"body_read_timeout": 30})))
    async with serve_app_with_server(app, timeout_keep_alive=1) as served:
        async with _socket(served) as (reader, writer):
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
            status, _, _ = await asyncio.wait_for(_response(reader), 5)
            writer.write(between)  # then idle
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by keep-alive
    assert status == 200


async def test_a_pipelined_requests_late_body_still_gets_its_408(fake):
    """The rest timer of an answer given before its body's end was armed for the body of the
    request pipelined behind it, and closed the connection without that request's 408."""
    async with _gateway(fake, limits={"body_read_timeout": 0.5}) as (served, _):
        async with _socket(served) as (reader, writer):
            writer.write(
                b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n"
                b"POST /v1/models HTTP/1.1\r\nhost: gw\r\ncontent-length: 20\r\n\r\n12345"
            )
            first, _, _ = await asyncio.wait_for(_response(reader), 5)
            second, _, body = await asyncio.wait_for(_response(reader), 10)
    assert (first, second) == (200, 408)
    assert orjson.loads(body)["error"]["code"] == "body_timeout"


@pytest.mark.parametrize("status", [600, 999])
async def test_a_reply_with_a_status_of_no_known_reason_phrase_is_written_never_a_keyerror(
    fake, status
):
    """uvicorn's status lines cover 100-599: a reply of any other status (what an upstream's
    three digits can say) was a KeyError and a connection closed with no answer at all. It is
    written with an empty reason phrase (RFC 9112 4: the phrase may be empty)."""
    async with _gateway(fake) as (served, counted):
        gateway = served.server.config.loaded_app.app.gateway

        async def odd(client: Any) -> Reply:
            return Reply(status, [(b"content-type", b"application/json")], b"{}")

        gateway.handle = odd
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()))
            assert await reader.readuntil(b"\r\n") == b"HTTP/1.1 %d \r\n" % status
            assert b"content-length: 2\r\n" in await reader.readuntil(b"\r\n\r\n")
            assert await reader.readexactly(2) == b"{}"
    assert counted.asked == 1


# --- Clients that do not read what they are sent ------------------------------------------------

# Socket buffers made small at both ends, so that what a client does not read is soon left in
# the gateway's transport (the kernel's would otherwise hold megabytes of it on loopback).
_SMALL_BUFFER = 4096


@contextlib.asynccontextmanager
async def _small_buffered(
    served: ServedApp, server_buffer: int = _SMALL_BUFFER
) -> AsyncIterator[tuple[socket.socket, Any]]:
    """A connection to ``served`` with small socket buffers at both ends (the server's:
    ``server_buffer``), nothing sent yet: the client's socket (non-blocking: ``loop.sock_*``)
    and the server's protocol of it."""
    loop = asyncio.get_running_loop()
    state = served.server.server_state
    before = set(state.connections)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SMALL_BUFFER)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", served.port))
        await eventually(lambda: bool(set(state.connections) - before), what="the connection")
        (connection,) = set(state.connections) - before
        server_socket = connection.transport.get_extra_info("socket")
        server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, server_buffer)
        yield sock, connection
    finally:
        sock.close()


async def _read_all(sock: socket.socket, until: bytes, pause: float = 0.0) -> bytes:
    """What ``sock`` receives until it ends with ``until`` (or the connection ends), read a
    little at a time, ``pause`` seconds between two reads."""
    loop = asyncio.get_running_loop()
    received = bytearray()
    while not received.endswith(until):
        data = await loop.sock_recv(sock, 65536)
        if not data:
            break
        received += data
        if pause:
            await asyncio.sleep(pause)
    return bytes(received)


def _content_of(body: bytes, stream: bool) -> str:
    """The answer's text in a response body: a JSON answer's, or a stream's chunks'."""
    if not stream:
        return orjson.loads(body)["choices"][0]["message"]["content"]
    text = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:])["choices"]:
                text.append(choice["delta"].get("content") or "")
    return "".join(text)


_LONG = " ".join(["w" * 1000] * 600)  # ~600 KB of answer, in 600 chunks when streamed


@pytest.mark.parametrize("asgi", [False, True], ids=["held", "asgi-path"])
async def test_a_client_that_reads_nothing_for_send_timeout_is_cut_and_its_stream_goes_on_for_the_others(
    fake, asgi
):
    """A streaming client that stops reading is cut once it has read nothing for
    ``limits.send_timeout`` seconds, as if it had left: its place in the flight is released,
    and another client of the same stream gets the whole answer. Either way its request went
    (held by the protocol, or the ASGI path's: ``connection: close`` is not held)."""
    fake.answer_text = lambda n, body: _LONG
    fake.chunk_gate = asyncio.Event()  # the stream waits, after its first words, for the joiner
    body = orjson.dumps({**orjson.loads(_body("long")), "stream": True})
    async with (
        _gateway(fake, limits={"send_timeout": 0.2}) as (served, _),
        _small_buffered(served) as (sock, connection),
    ):
        gateway = served.server.config.loaded_app.app.gateway
        state = served.server.server_state
        extra = "connection: close\r\n" if asgi else ""
        await asyncio.get_running_loop().sock_sendall(sock, _request(body, extra=extra))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:

            async def reads_it_all() -> bytes:
                async with client.stream("POST", CHAT, content=body) as response:
                    return await response.aread()

            reader = asyncio.create_task(reads_it_all())
            await eventually(lambda: gateway.flights.waiters == 2, what="the joiner")
            fake.chunk_gate.set()
            await eventually(
                lambda: connection not in state.connections,
                timeout=20,
                what="the client reading nothing cut",
            )
            read = await asyncio.wait_for(reader, 20)
        await eventually(lambda: gateway.flights.waiters == 0, what="every place released")
    assert _content_of(read, stream=True) == _LONG
    assert fake.count() == 1 and fake.cancelled == 0  # (the flight went on for the other)


@pytest.mark.parametrize("asgi", [False, True], ids=["held", "asgi-path"])
def test_the_cut_of_a_client_that_reads_nothing_is_logged_under_its_request_id(asgi, caplog):
    """On uvloop, as ``carpool serve`` runs, the transport says it is full in the connection's
    own context, not the writing request's: the line that says its client was cut carried no
    request id (``[-]``), against the logs' contract."""
    from carpool.request_id import RequestIdFilter

    caplog.handler.addFilter(RequestIdFilter())
    caplog.set_level(logging.INFO, logger="carpool")
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(_a_client_reads_nothing(asgi))
    (cut,) = [r for r in caplog.records if "read nothing" in r.getMessage()]
    assert cut.request_id == "stalled-1"


async def _a_client_reads_nothing(asgi: bool) -> None:
    fake = FakeUpstream()
    fake.answer_text = lambda n, body: _LONG  # more than the connection's buffers hold
    async with serve_app(fake) as url:
        fake.url = url + "/v1"
        async with (
            _gateway(fake, limits={"send_timeout": 0.2}) as (served, _),
            _small_buffered(served) as (sock, connection),
        ):
            state = served.server.server_state
            extra = "x-request-id: stalled-1\r\n" + ("connection: close\r\n" if asgi else "")
            await asyncio.get_running_loop().sock_sendall(
                sock, _request(_body("long"), extra=extra)
            )
            await eventually(
                lambda: connection not in state.connections,
                timeout=20,
                what="the client reading nothing cut",
            )


async def test_a_slow_reader_that_keeps_reading_is_not_cut_by_send_timeout(fake):
    """``send_timeout`` bounds how long a client may read nothing, not how long it takes to
    read: a reader slower than the gateway writes (its writes wait for it), reading a little
    with pauses shorter than the timeout, gets its whole answer."""
    fake.answer_text = lambda n, body: " ".join(["w" * 1000] * 200)  # ~200 KB
    body = _body("slow")
    async with _gateway(fake, limits={"send_timeout": 0.2}) as (served, _):
        answer = await _store(served, body)
        async with _small_buffered(served) as (sock, connection):
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, _request(body))
            paused = False
            received = bytearray()
            while not received.endswith(answer):
                data = await loop.sock_recv(sock, 8192)
                assert data, "the connection was closed"
                received += data
                paused = paused or connection.flow.write_paused
                await asyncio.sleep(0.03)
    assert paused  # (the client did read slower than it was sent)
    assert received.endswith(answer)


async def test_a_slow_reader_is_not_cut_while_the_kernel_holds_what_it_has_not_read(fake):
    """The kernel's send buffer grows to megabytes (``tcp_wmem``), and the socket takes more
    only once a good part of it is read: the transport's buffer, all ``send_timeout`` looked
    at, did not move meanwhile, and a client reading steadily, slower than that, was cut
    part-way (at 5 KB/s, after 67 KB of a 60 s timeout's answer). What the kernel holds
    unread counts too now."""
    fake.answer_text = lambda n, body: " ".join(["w" * 1000] * 2000)  # ~2 MB
    body = _body("slow, a big kernel buffer")
    async with _gateway(fake, limits={"send_timeout": 0.5}) as (served, _):
        answer = await _store(served, body)
        async with _small_buffered(served, server_buffer=1024 * 1024) as (sock, connection):
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, _request(body))
            received = bytearray()
            while not received.endswith(answer):
                data = await loop.sock_recv(sock, 8192)
                assert data, f"the connection was closed after {len(received)} bytes"
                received += data
                await asyncio.sleep(0.02)
    assert received.endswith(answer)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("http", ["carpool", "httptools"])
async def test_a_client_that_does_not_read_a_long_answer_holds_a_slice_of_it_not_a_copy(
    fake, stream, http
):
    """A long stored answer asked by a client that reads nothing: what waits for it in the
    gateway's transport is about a slice of it (``SLICE_BYTES``, beyond the transport's
    high-water mark), not a copy of the whole, through carpool's protocol as through uvicorn's
    (the ASGI path); once it reads, it gets all of it."""
    fake.answer_text = lambda n, body: _LONG
    body = orjson.dumps({**orjson.loads(_body("long hit")), "stream": stream})
    app = create_app(build_gateway(Config(upstreams=[fake.url])))
    options = {"http": "httptools"} if http == "httptools" else {}
    async with serve_app_with_server(app, **options) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            stored = (await client.post(CHAT, content=body)).content
            hit = await client.post(CHAT, content=body)
        assert hit.headers["x-carpool"] == "hit" and hit.content == stored
        assert len(stored) > 8 * SLICE_BYTES
        async with _small_buffered(served) as (sock, connection):
            await asyncio.get_running_loop().sock_sendall(sock, _request(body))
            await eventually(lambda: connection.flow.write_paused, what="the writes waiting")
            for _ in range(10):  # (whatever would be written now, without waiting, is)
                await asyncio.sleep(0)
            held = connection.transport.get_write_buffer_size()
            _, high_water = connection.transport.get_write_buffer_limits()
            received = await _read_all(sock, stored)
    assert held <= high_water + SLICE_BYTES + 1024  # (+ the head)
    assert received.endswith(b"\r\n\r\n" + stored)


async def _pipelined_client_leaves(stream: bool) -> None:
    """A client pipelines a request of another path, the one to be answered, and one more, on a
    connection with small buffers; closes it while the second is being answered on the ASGI path
    (queued behind the first, it is not held), its stream waiting on its upstream or its whole
    reply waiting for the client to read; then each request ends, none run after."""
    fake = FakeUpstream()
    if stream:
        fake.chunk_gate = asyncio.Event()  # the stream stops after its first words
    else:
        fake.answer_text = lambda n, body: _LONG  # more than the connection's buffers hold
    async with serve_app(fake) as url:
        fake.url = url + "/v1"
        async with _gateway(fake) as (served, _), _small_buffered(served) as (sock, connection):
            gateway = served.server.config.loaded_app.app.gateway
            answered = orjson.dumps({**orjson.loads(_body("answered")), "stream": stream})
            await asyncio.get_running_loop().sock_sendall(
                sock,
                b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n"
                + _request(answered)
                + _request(_body("queued")),
            )
            if stream:
                await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
            else:
                await eventually(lambda: connection.flow.write_paused, what="the reply waiting")
            # Answered on the ASGI path, and not uvicorn's newest cycle: the queued one is.
            assert connection.serving is None and len(connection.pipeline) == 1
            sock.close()  # (with what it was sent unread: the connection is reset)
            if stream:
                await fake.wait_for_cancelled(1)  # (its client was the flight's last)
            state = served.server.server_state
            await eventually(lambda: not state.tasks, what="the requests ended")
            assert gateway.flights.waiters == 0
    assert fake.count() == 1  # (the queued request was never run)


@pytest.mark.parametrize("stream", [True, False], ids=["stream-waiting", "reply-waiting"])
def test_a_request_answered_with_requests_pipelined_behind_it_ends_quietly_when_its_client_goes(
    stream, caplog
):
    """The request being answered on the ASGI path learns its client left as soon as the
    connection is lost, though uvicorn's current cycle is the request queued behind it: a
    stream waiting on its upstream is cancelled (its place in the flight released), a reply
    waiting for the client to read writes nothing more; nothing is logged as a failure. On
    uvloop, as ``carpool serve`` runs: its transport refuses a write once the connection is
    lost (a RuntimeError, which was logged as the gateway's 500)."""
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(_pipelined_client_leaves(stream))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# The first uvicorn with the two internals GatewayProtocol leans on: the hook it overrides to
# know the request being answered with others pipelined behind it, and the context setting it
# keeps (under 0.44 most of this file fails: held requests are answered with a 500).
_FIRST_UVICORN_WITH_THE_HOOKS = Version("0.45")


def test_the_uvicorn_carpool_requires_has_the_internals_its_protocol_leans_on() -> None:
    assert hasattr(HttpToolsProtocol, "_start_asgi_task")
    assert hasattr(uvicorn.Config(app=None), "reset_contextvars")
    assert Version(uvicorn.__version__) >= _FIRST_UVICORN_WITH_THE_HOOKS
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    (required,) = [Requirement(d) for d in dependencies if Requirement(d).name == "uvicorn"]
    allowed = [Version(f"0.{minor}") for minor in range(30, 60)]
    assert min(v for v in allowed if v in required.specifier) == _FIRST_UVICORN_WITH_THE_HOOKS


@pytest.mark.parametrize("target", [CHAT, "/v1/files"], ids=["cached", "pass-through"])
@pytest.mark.parametrize("between", [0, 1], ids=["right behind", "one more between"])
async def test_a_body_not_valid_http_pipelined_behind_one_being_answered_is_refused_after_its_answer(
    fake, target, between
):
    """A fault in the body of a request pipelined behind one being answered (its cycle queued
    by uvicorn) closed the connection at once without a word: the answers to the requests
    before it were lost, and its own refusal never written."""
    fake.gate = asyncio.Event()  # (the first request's call is held until the rest is read)
    async with _gateway(fake) as (served, _):
        async with _socket(served) as (reader, writer):
            writer.write(_request(_body()))
            await asyncio.wait_for(fake.arrived.wait(), 5)
            writer.write(
                b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n" * between
                + f"POST {target} HTTP/1.1\r\nhost: gw\r\nx-request-id: framing-3\r\n".encode()
                + b"transfer-encoding: chunked\r\n\r\nzz\r\n"
            )
            connections = served.server.server_state.connections
            await eventually(
                lambda: any(getattr(c, "refusal", None) for c in connections),
                what="the refusal kept for after the answers before it",
            )
            fake.gate.set()
            answered = [
                (await asyncio.wait_for(_response(reader), 5))[0] for _ in range(1 + between)
            ]
            status, headers, error = await _refusal(reader)
    assert answered == [200] * (1 + between)
    assert (status, error["code"], headers["x-request-id"]) == (400, "invalid_http", "framing-3")


@pytest.mark.parametrize(
    "target",
    ["/v1/%6Dessages", "http://gw/v1/messages", "/v1/messages/"],
    ids=["percent-encoded", "absolute-form", "trailing-slash"],
)
async def test_a_refusal_of_a_messages_path_however_written_is_in_anthropics_shape_and_counted(
    fake, target
):
    """The gateway serves ``/v1/%6Dessages`` and the absolute form as the Messages endpoint
    (uvicorn decodes the target's path), but the HTTP protocol's own refusals (431, 414, 408,
    400) read the raw target: OpenAI's shape, no ``x-carpool: bypass``, counted nowhere. The
    path is read as uvicorn reads it."""
    async with _gateway(fake, limits={"max_header_bytes": 1000}) as (served, counted):
        async with _socket(served) as (reader, writer):
            pads = "".join(f"x-pad-{i}: {'p' * 90}\r\n" for i in range(20))
            writer.write(_request(_body(), extra=pads).replace(CHAT.encode(), target.encode(), 1))
            status, headers, error = await _refusal(reader)
        stats = counted.app.gateway.stats.snapshot()
    assert (status, headers["x-carpool"]) == (431, "bypass")
    assert "code" not in error and error["type"] == "invalid_request_error", error  # Anthropic's
    assert (stats["rejected"], stats["requests"]) == (1, 1), stats


@pytest.mark.parametrize(
    ("version", "hosts", "status"),
    [
        ("1.1", [], 400),
        ("1.1", ["localhost", "evil.example"], 400),
        ("1.1", ["localhost, evil.example"], 400),
        ("1.0", ["localhost", "localhost"], 400),
        ("1.0", [], 200),
        ("1.1", ["localhost"], 200),
    ],
    ids=["none", "two", "a-list", "two-in-1.0", "none-in-1.0", "one"],
)
async def test_a_request_naming_no_host_or_several_is_400(fake, version, hosts, status):
    """RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request without Host, and to any
    request with more than one Host line or one naming several. They were served (and
    ``allowed_hosts`` judged only the first: ``Host: localhost`` then ``Host: evil.example``
    passed)."""
    async with _gateway(fake) as (served, _):
        async with _socket(served) as (reader, writer):
            body = _body()
            head = f"POST {CHAT} HTTP/{version}\r\n" + "".join(f"host: {h}\r\n" for h in hosts)
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            if status == 400:
                got, headers, error = await _refusal(reader)
                assert (got, error["code"]) == (400, "invalid_http"), error
                assert headers["x-carpool"] == "bypass"
            else:
                got, _, _ = await asyncio.wait_for(_response(reader), 5)
                assert got == status
