"""Pass-through (what the gateway relays without caching: ``/v1/files``, ``/v1/models``, any
other ``/v1`` path) keeps each call its own client's, and relays its bytes as they came.

1. No upstream cookie outlives its answer: one tenant's ``Set-Cookie`` never reaches another
   tenant's call, nor replaces a cookie a client sent itself; a cached endpoint's answer never
   stores nor serves one.
2. An answer relayed unchanged keeps its ``Content-Length`` (a HEAD's too); an upstream that cuts
   its body short still breaks its client's transfer.
3. A request body goes to the upstream as it comes, not once the gateway has all of it.
4. An upstream that refuses an upload part-way is heard: its answer reaches the client, and
   its replica stays in rotation; one that cuts it without answering is still a 502.
5. An answer whose header holds a control character, which no server may write, is a 502, as
   on the cached endpoints: never a connection closed without a status line.

Everything talks HTTP to a real gateway on loopback in front of ``fakes.raw_upstream``, reached
as ``localhost`` where cookies are concerned: aiohttp's cookie jar ignores those of a bare IP.
"""

from __future__ import annotations

import asyncio
import gzip
import logging

import httpx
import pytest

from conftest import Served, run_gateway
from fakes.raw_upstream import RawCall, chat_completion, raw_upstream
from fakes.raw_upstream import answer as raw_answer
from fakes.waiting import eventually

SESSION = (b"set-cookie", b"session=A; Path=/")


def by_name(url: str) -> str:
    """``url`` with its host named as a real upstream's is (api.openai.com, vllm.internal)."""
    return url.replace("127.0.0.1", "localhost")


# --- 1. no upstream cookie outlives its answer -----------------------------------------------


async def test_one_tenants_upstream_cookie_never_reaches_another_tenants_call():
    """The pass-through session kept aiohttp's cookie jar: tenant A's ``Set-Cookie`` went on every
    later call, tenant B's among them, and in place of tenant C's own cookie of that name."""

    def respond(call: RawCall) -> bytes:
        if call.line.startswith("GET /v1/login"):
            return raw_answer(200, b"OK", b"{}", headers=(SESSION,))
        return raw_answer(200, b"OK", b"{}")

    async with raw_upstream(respond) as upstream, run_gateway([by_name(upstream.url)]) as gw:
        a = await gw.client.get("/v1/login", headers={"Authorization": "Bearer sk-tenant-a"})
        gw.client.cookies.clear()  # (the test's client has a jar of its own: B is another)
        b = await gw.client.get("/v1/models", headers={"Authorization": "Bearer sk-tenant-b"})
        c = await gw.client.get(
            "/v1/models", headers={"Authorization": "Bearer sk-tenant-c", "Cookie": "session=C"}
        )
    assert a.status_code == b.status_code == c.status_code == 200
    assert a.headers.get("set-cookie") == "session=A; Path=/"  # (A's own: relayed to A)
    _, to_b, to_c = upstream.calls
    assert to_b.headers["authorization"] == "Bearer sk-tenant-b"
    assert "cookie" not in to_b.headers, to_b.headers
    assert to_c.headers.get("cookie") == "session=C", to_c.headers


async def test_a_cached_answers_upstream_cookie_is_never_stored_nor_sent_again():
    """A cached endpoint's answer carries only its content type from the upstream: a
    ``Set-Cookie`` on it is neither served (on the miss, nor on the hit another client gets) nor
    sent back to the upstream on a later call."""
    body = chat_completion("hello")

    def respond(call: RawCall) -> bytes:
        return raw_answer(200, b"OK", body, headers=(SESSION,))

    chat = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    async with raw_upstream(respond) as upstream, run_gateway([by_name(upstream.url)]) as gw:
        miss = await gw.client.post("/v1/chat/completions", json=chat)
        gw.client.cookies.clear()  # (the test's client has a jar of its own)
        hit = await gw.client.post("/v1/chat/completions", json=chat)
        other = await gw.client.post("/v1/chat/completions", json={**chat, "seed": 2})
    assert miss.headers["x-carpool"] == "miss" and hit.headers["x-carpool"] == "hit"
    assert other.status_code == 200
    for response in (miss, hit, other):
        assert "set-cookie" not in response.headers, response.headers
    assert len(upstream.calls) == 2
    assert all("cookie" not in call.headers for call in upstream.calls), upstream.calls


# --- 2. an answer relayed unchanged keeps its Content-Length ---------------------------------


async def test_a_passthrough_answer_keeps_its_content_length_a_heads_too():
    """A file's content (or a HEAD on it) came with ``Content-Length``; the gateway dropped it
    with the framing: the client got a chunked answer of unknown size, and a HEAD said nothing
    of the size. A coded answer is relayed as its bytes came: its length is theirs."""
    body = b"x" * 1000
    coded = gzip.compress(b'{"data": []}' * 100)

    def respond(call: RawCall) -> bytes:
        if "/gzipped" in call.line:
            zipped = ((b"content-encoding", b"gzip"),)
            return raw_answer(200, b"OK", coded, b"application/json", headers=zipped)
        if "/unchanged" in call.line:  # (a 304 may give the length of the body it does not send)
            return raw_answer(304, b"Not Modified", body)[: -len(body)]
        data = raw_answer(200, b"OK", body, b"application/octet-stream")
        return data[: -len(body)] if call.line.startswith("HEAD") else data

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        got = await gw.client.get("/v1/files/f1/content")
        head = await gw.client.head("/v1/files/f1/content")
        zipped = await gw.client.get("/v1/files/gzipped", headers={"accept-encoding": "gzip"})
        unchanged = await gw.client.get("/v1/files/unchanged", headers={"if-none-match": '"1"'})
        after = await gw.client.get("/v1/files/f1/content")  # (the connection still framed)
    assert got.status_code == 200 and got.content == body
    assert got.headers.get("content-length") == "1000", dict(got.headers)
    assert "transfer-encoding" not in got.headers
    assert head.status_code == 200 and head.content == b""
    assert head.headers.get("content-length") == "1000", dict(head.headers)
    assert zipped.headers.get("content-encoding") == "gzip"
    assert zipped.headers.get("content-length") == str(len(coded)), dict(zipped.headers)
    assert zipped.content == b'{"data": []}' * 100  # (decoded by the test's client)
    assert unchanged.status_code == 304 and unchanged.content == b""
    assert after.status_code == 200 and after.content == body


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_passthrough_answer_its_upstream_cuts_mid_body_breaks_its_clients_transfer(framing):
    """Whatever the upstream's framing, an answer cut after half its body never reaches its
    client as a whole one (a chunked end, or as many bytes as its Content-Length said)."""
    half = b"y" * 50_000

    def respond(call: RawCall) -> tuple[bytes, bool]:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
        if framing == "chunked":
            return head + b"transfer-encoding: chunked\r\n\r\n%x\r\n" % len(half) + half, True
        return head + b"content-length: 100000\r\n\r\n" + half, True

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        with pytest.raises(httpx.RemoteProtocolError):
            await gw.client.get("/v1/files/f1/content")


# --- 3. a request body goes to the upstream as it comes --------------------------------------

UPLOADED = raw_answer(200, b"OK", b'{"id": "file-1", "object": "file"}')
PIECE = 2**20


async def test_a_large_passthrough_upload_reaches_the_upstream_while_its_client_still_sends_it():
    """A 32 MiB upload to /v1/files: the gateway read the whole body into memory (its pieces,
    then joined: twice its size) before it even opened the upstream call. It goes on as it
    comes, with the length its client declared, byte for byte."""
    size = 32 * PIECE
    upstream_had_it_mid_upload: bool | None = None

    async with raw_upstream(lambda call: UPLOADED) as upstream:

        async def body():
            nonlocal upstream_had_it_mid_upload
            for i in range(size // PIECE):
                if i == size // PIECE // 2:  # half sent: has the upstream call begun?
                    try:
                        await asyncio.wait_for(upstream.headed.wait(), 10)
                        upstream_had_it_mid_upload = True
                    except TimeoutError:
                        upstream_had_it_mid_upload = False
                yield bytes([i]) * PIECE

        async with run_gateway([upstream.url], limits={"max_body_bytes": 2 * size}) as gw:
            response = await gw.client.post(
                "/v1/files",
                content=body(),
                headers={"content-type": "application/octet-stream", "content-length": str(size)},
            )
    assert response.status_code == 200, response.text
    assert upstream_had_it_mid_upload, "the upstream saw nothing until the whole body was in"
    (call,) = upstream.calls
    assert call.headers.get("content-length") == str(size)
    assert "transfer-encoding" not in call.headers
    assert call.data == b"".join(bytes([i]) * PIECE for i in range(size // PIECE))


async def test_a_large_chunked_passthrough_upload_reaches_the_upstream_chunked():
    """Its length unknown until its end, a chunked body goes on chunked (buffered to learn its
    length, it would be held whole in memory again)."""
    pieces = [bytes([i]) * PIECE for i in range(4)]

    async def body():
        for piece in pieces:
            yield piece

    async with raw_upstream(lambda call: UPLOADED) as upstream, run_gateway([upstream.url]) as gw:
        response = await gw.client.post("/v1/files", content=body())  # (httpx: chunked)
    assert response.status_code == 200, response.text
    (call,) = upstream.calls
    assert call.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in call.headers
    assert call.data == b"".join(pieces)


async def test_a_streamed_upload_past_max_body_bytes_is_413_and_the_upstream_never_gets_it_whole():
    """Chunked, its size unknown until it is read: refused at the piece that passes the limit,
    the upstream's connection is cut there (never a body ended as if whole)."""

    async def body():
        for i in range(8):
            yield bytes([i]) * PIECE

    limits = {"max_body_bytes": 3 * PIECE}
    async with (
        raw_upstream(lambda call: UPLOADED) as upstream,
        run_gateway([upstream.url], limits=limits) as gw,
    ):
        response = await gw.client.post("/v1/files", content=body())
        after = await gw.client.get("/v1/models")  # (the replica stays in rotation)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "body_too_large"
    assert [call.line for call in upstream.calls] == ["GET /v1/models HTTP/1.1"]
    assert after.status_code == 200


async def open_upload(
    gw: Served, size: int, sent: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that declares a ``size``-byte upload to /v1/files and sends ``sent`` bytes."""
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"POST /v1/files HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % size
    writer.write(head + b"z" * sent)
    await writer.drain()
    return reader, writer


async def test_a_client_that_leaves_mid_upload_takes_its_call_with_it():
    """Its body half sent, the client goes: the upstream's connection is closed (the body never
    ended as if whole), and the replica, which did nothing wrong, stays in rotation."""
    async with raw_upstream(lambda call: UPLOADED) as upstream, run_gateway([upstream.url]) as gw:
        _, writer = await open_upload(gw, 8 * PIECE, 4 * PIECE)
        await asyncio.wait_for(upstream.headed.wait(), 10)  # (the call under way)
        writer.close()
        await eventually(lambda: upstream.ended == 1, what="the upstream's connection closed")
        after = await gw.client.get("/v1/models")
        state = gw.gateway.replicas.snapshot()[upstream.url]["state"]
    assert upstream.calls[0].line == "GET /v1/models HTTP/1.1" and len(upstream.calls) == 1
    assert after.status_code == 200 and state == "healthy"


async def test_a_client_that_stops_sending_mid_upload_is_408_and_the_upstream_never_gets_it_whole():
    """``limits.body_read_timeout`` covers the whole body, streamed or not: the client that
    stalls halfway is answered 408 (its connection closed) and the upstream's call is cut."""
    limits = {"body_read_timeout": 0.5}
    async with (
        raw_upstream(lambda call: UPLOADED) as upstream,
        run_gateway([upstream.url], limits=limits) as gw,
    ):
        reader, writer = await open_upload(gw, 8 * PIECE, 4 * PIECE)
        answer = await asyncio.wait_for(reader.read(), 10)  # (to the connection's end)
        writer.close()
        await eventually(lambda: upstream.ended == 1, what="the upstream's connection closed")
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"body_timeout" in answer and b"connection: close" in answer.lower()
    assert upstream.calls == []


# --- 4. an upstream that refuses an upload part-way is heard ---------------------------------

TOO_LARGE = raw_answer(
    413, b"Payload Too Large", b'{"error": "file too large"}', headers=((b"connection", b"close"),)
)


class PartReader:
    """An upstream that reads ``reads`` bytes of each call's body, then answers ``answer`` (or
    nothing) and closes, the rest unread: its kernel resets the connection (RST), as a server
    checking an upload's size as it reads it does. ``ignore_expect``: it reads the whole body
    but never sends ``100 Continue``, as an HTTP/1.0-minded server does."""

    def __init__(self, reads: int, answer: bytes | None) -> None:
        self.reads, self.answer = reads, answer
        self.heads: list[bytes] = []
        self.read: list[int] = []  # (each call's bytes read, its body's framing included)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.heads.append(await reader.readuntil(b"\r\n\r\n"))
            got = 0
            while got < self.reads and (piece := await reader.read(PIECE)):
                got += len(piece)
            self.read.append(got)
            if self.answer is not None:
                writer.write(self.answer)
                await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self) -> PartReader:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


UPLOADS = 100


async def test_an_upstreams_refusal_mid_upload_reaches_its_client_and_the_replica_stays():
    """An upstream reads 2 MiB of a 16 MiB upload, answers 413 and closes, the rest unread (its
    kernel resets the connection). Sent whole, the body was in the gateway's socket buffer
    before the answer came, which the loop read before the failed write; streamed, the gateway
    wrote a piece on the reset connection before reading the answer, which was lost: its
    client got a 502 ("gave no answer (connection reset)"), and the replica was left out of
    rotation for every tenant (2 to 94 of 100 uploads so)."""
    answers, states = [], []
    async with (
        PartReader(2 * PIECE, TOO_LARGE) as upstream,
        run_gateway([upstream.url], limits={"max_body_bytes": 64 * PIECE}) as gw,
    ):
        for _ in range(UPLOADS):
            response = await gw.client.post("/v1/files", content=b"x" * (16 * PIECE))
            answers.append((response.status_code, response.text))
            states.append(gw.gateway.replicas.snapshot()[upstream.url]["state"])
    refused = (413, '{"error": "file too large"}')
    assert answers == [refused] * UPLOADS, [a for a in answers if a != refused][:3]
    assert set(states) == {"healthy"}


async def test_an_upstream_that_cuts_an_upload_without_answering_is_a_502_and_the_replicas_fault():
    """Watched for a refusal as it goes, an upload whose upstream closes part-way with no
    answer is still no answer: its client gets a 502, and the replica is left out."""
    async with (
        PartReader(2 * PIECE, None) as upstream,
        run_gateway([upstream.url], limits={"max_body_bytes": 64 * PIECE}) as gw,
    ):
        response = await gw.client.post("/v1/files", content=b"x" * (16 * PIECE))
        state = gw.gateway.replicas.snapshot()[upstream.url]["state"]
    assert response.status_code == 502, response.text
    assert "gave no answer" in response.json()["error"]["message"]
    assert state == "down"


async def test_an_upstream_that_reads_the_whole_upload_before_answering_gets_all_of_it():
    """The watch stops a body only for an answer that came before its end: an upstream that
    reads it all (never sending ``100 Continue``, never asked to) gets every byte, declared
    length or chunked."""

    async def chunked():
        for i in range(16):
            yield bytes([i]) * PIECE

    async with (
        PartReader(16 * PIECE, UPLOADED) as upstream,
        run_gateway([upstream.url], limits={"max_body_bytes": 64 * PIECE}) as gw,
    ):
        whole = await gw.client.post("/v1/files", content=b"x" * (16 * PIECE))
        streamed = await gw.client.post("/v1/files", content=chunked())
    assert (whole.status_code, streamed.status_code) == (200, 200), (whole.text, streamed.text)
    assert all(b"expect" not in head.lower() for head in upstream.heads)
    assert len(upstream.read) == 2 and min(upstream.read) >= 16 * PIECE


# --- 5. an answer with a header no server may write ------------------------------------------


async def test_an_upstream_header_with_a_control_character_is_a_502_as_on_the_cached_endpoints(
    caplog,
):
    """A pass-through answer whose header value held a control character (ESC, as in
    ``a\\x1b[2Jb``) was relayed as it came: uvicorn refused to write it ("Invalid HTTP header
    value") with the reply marked begun, so its client's connection closed with no status line
    (the openai SDK sent the POST twice more: three calls upstream), and each request logged an
    error with its traceback. The cached endpoints refuse such an answer as malformed (a 502,
    not to be retried): so does pass-through. A tab and bytes past 0x7f are no control
    characters: relayed as they came."""
    caplog.set_level(logging.WARNING)
    evil = (b"x-evil", b"a\x1b[2Jb")

    def respond(call: RawCall) -> bytes:
        if "/v1/fine" in call.line:
            return raw_answer(200, b"OK", b"{}", headers=((b"x-fine", b"a\tb\xff"),))
        if "/v1/chat/completions" in call.line:
            return raw_answer(200, b"OK", chat_completion(), headers=(evil,))
        return raw_answer(200, b"OK", b"{}", headers=(evil,))

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        relayed = await gw.client.post("/v1/batches", json={"input_file_id": "file-1"})
        cached = await gw.client.post("/v1/chat/completions", json=chat)
        fine = await gw.client.get("/v1/fine")
    for refused in (relayed, cached):
        assert refused.status_code == 502, refused.text
        assert refused.headers["x-should-retry"] == "false"
        assert refused.json()["error"]["type"] == "upstream_error"
    assert relayed.json()["error"]["code"] == cached.json()["error"]["code"]
    assert "malformed" in relayed.json()["error"]["message"]
    assert "\x1b" not in relayed.text
    assert [call.line.split()[1] for call in upstream.calls].count("/v1/batches") == 1
    assert fine.status_code == 200
    assert (b"x-fine", b"a\tb\xff") in fine.headers.raw
    # (Not asyncio's "Task exception was never retrieved": another test's leftover, collected
    # meanwhile, as in ci36.)
    assert [
        r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name != "asyncio"
    ] == []


# --- 6. one upstream connection, one answer to each request ----------------------------------


@pytest.mark.parametrize(
    "first",
    [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\n\r\n",
        raw_answer(200, b"OK", b"{}"),
    ],
    ids=["204", "304", "200"],
)
async def test_an_answer_nobody_asked_for_on_a_kept_upstream_connection_is_never_relayed(first):
    """An upstream that sent bytes after an answer had ended (a 204's or 304's body coming
    late, an answer too many) left them on the pooled connection, and the next pass-through
    call on it, another tenant's, got them as its answer: every answer after it on that
    connection went to the client after its own (one tenant's file to the next). A kept
    connection with anything to read before its request is written is never reused."""
    relayed, sent = asyncio.Event(), asyncio.Event()

    async def respond(call: RawCall):
        if "/v1/files/a" in call.line:

            async def answers():
                yield first
                await relayed.wait()  # (the first answer relayed, its connection pooled)
                yield raw_answer(200, b"OK", b'{"id": "EVIL"}')
                sent.set()  # (written: the gateway's side of the connection has it to read)

            return answers()
        asked = call.line.split()[1].rsplit("/", 1)[1]
        return raw_answer(200, b"OK", b'{"id": "%s"}' % asked.encode())

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        a = await gw.client.get("/v1/files/a", headers={"Authorization": "Bearer sk-a"})
        assert a.status_code == int(first[9:12])
        relayed.set()
        await asyncio.wait_for(sent.wait(), 10)
        answers = []
        for tenant in ("b", "c", "d"):
            got = await gw.client.get(
                f"/v1/files/{tenant}", headers={"Authorization": f"Bearer sk-{tenant}"}
            )
            answers.append((got.status_code, got.json()))
    assert answers == [(200, {"id": tenant}) for tenant in ("b", "c", "d")]
    assert [call.line.split()[1] for call in upstream.calls] == [
        "/v1/files/a",
        "/v1/files/b",
        "/v1/files/c",
        "/v1/files/d",
    ]


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_on_a_get_head_or_options_is_refused_never_forwarded(method, framing):
    """A body on a GET went on to the upstream, and servers that read none on a GET (cpp-httplib,
    llama.cpp's server) took it for the next request on the connection: a request the gateway
    never judged (any path, outside its allow-list), its answer going to the next client. Such a
    body has no meaning (RFC 9110 9.3.1): refused with a 400 before anything is sent; an empty
    one (``Content-Length: 0``) is no body."""
    smuggled = b"POST /v1/x/smuggled HTTP/1.1\r\nhost: up\r\ncontent-length: 0\r\n\r\n"

    def respond(call: RawCall) -> bytes:
        answer = raw_answer(200, b"OK", b"{}")
        return answer[:-2] if call.line.startswith("HEAD") else answer

    headers = {"transfer-encoding": "chunked"} if framing == "chunked" else {}

    async def body():
        yield smuggled

    async with raw_upstream(respond) as upstream, run_gateway([upstream.url]) as gw:
        refused = await gw.client.request(
            method,
            "/v1/models",
            content=body() if framing == "chunked" else smuggled,
            headers=headers,
        )
        empty = await gw.client.request(method, "/v1/models", headers={"content-length": "0"})
    assert refused.status_code == 400, refused.text
    if method != "HEAD":
        assert refused.json()["error"]["code"] == "body_not_forwarded"
    assert empty.status_code == 200
    assert [call.line.split()[:2] for call in upstream.calls] == [[method, "/v1/models"]]
