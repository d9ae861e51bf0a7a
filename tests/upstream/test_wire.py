"""``carpool.upstream.wire``: the lean HTTP/1.1 client of the cached endpoints' upstream calls.

Each test runs a raw asyncio server that answers exactly the bytes it is given, so that every
way an answer can come (sized, chunked, until the connection ends, cut, late, interim) is seen.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from carpool.upstream import wire
from fakes.waiting import WAIT_S, eventually

# A server's answer to its n-th request.
Respond = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# Whether the server drops the connection as a request's head comes, its body unread (the
# server closing a kept connection as a request arrives on it): given the head and the writer.
Cut = Callable[[bytes, asyncio.StreamWriter], bool]


class Server:
    """Counts connections and requests (read whole); ``handle`` answers each request, but one
    that ``cut`` drops at its head (counted in ``cuts``)."""

    def __init__(self, handle: Respond, cut: Cut | None = None) -> None:
        self.handle = handle
        self.cut = cut
        self.connections = 0
        self.requests: list[bytes] = []
        self.cuts = 0
        self.closed = asyncio.Event()
        self.ends = 0  # connections that ended (closed by either side)
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.cut is not None and self.cut(head, writer):
                    self.cuts += 1
                    return  # (closed with the body unread: an RST)
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.handle(len(self.requests), reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.ends += 1
            self.closed.set()
            writer.close()


def answering(answer: bytes) -> Respond:
    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()

    return handle


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[tuple[Server, wire.Pool]]]]:
    servers: list[asyncio.Server] = []
    pools: list[wire.Pool] = []

    async def start(
        handle: Respond, cut: Cut | None = None, **pool: float
    ) -> tuple[Server, wire.Pool]:
        server = Server(handle, cut)
        listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
        servers.append(listening)
        server.port = listening.sockets[0].getsockname()[1]
        made = wire.Pool("127.0.0.1", server.port, **pool)  # type: ignore[arg-type]
        pools.append(made)
        return server, made

    yield start
    for made in pools:
        made.close()
    for listening in servers:
        listening.close()


def post(body: bytes = b"{}") -> tuple[bytes, bytes]:
    """A request's head and body, as ``Pool.request`` takes them."""
    return wire.request_head("/v1/chat/completions", "127.0.0.1", {}, len(body)), body


async def test_a_whole_answer_is_read_and_its_connection_reused(serve):
    server, pool = await serve(answering(OK))
    for _ in range(3):
        answer = await pool.request(*post(), True)
        assert (answer.status, answer.content_type) == (200, "application/json")
        assert await answer.read() == b"{}"
    assert server.connections == 1 and len(server.requests) == 3
    assert server.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1")


async def test_the_most_recently_used_idle_connection_is_reused_and_a_stale_one_is_not(
    serve, monkeypatch
):
    gate = asyncio.Event()

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n <= 2:
            await gate.wait()
        writer.write(OK)
        await writer.drain()

    server, pool = await serve(handle)
    first = asyncio.create_task(pool.request(*post(), True))
    second = asyncio.create_task(pool.request(*post(), True))
    await asyncio.sleep(0.05)
    gate.set()
    for task in (first, second):
        await (await task).read()
    assert server.connections == 2 and len(pool.idle) == 2
    await (await pool.request(*post(), True)).read()
    assert server.connections == 2
    real = wire.monotonic
    monkeypatch.setattr(wire, "monotonic", lambda: real() + 4.5)
    await (await pool.request(*post(), True)).read()
    assert server.connections == 3  # idle past keep-alive: both closed, a fresh one opened
    assert pool.open == 1


async def test_idle_connections_are_closed_at_their_keep_alive_with_no_traffic_after(serve):
    # (They were closed only as a later call came: after a burst, a server with no idle
    # timeout of its own held every connection until the gateway's next call.)
    gate = asyncio.Event()

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.write(OK)
        await writer.drain()

    server, pool = await serve(handle, keepalive_s=0.2)
    burst = [asyncio.create_task(pool.request(*post(), True)) for _ in range(3)]
    await eventually(lambda: len(server.requests) == 3)
    gate.set()
    for task in burst:
        await (await task).read()
    assert server.connections == 3 and len(pool.idle) == 3
    await eventually(lambda: pool.open == 0 and not pool.idle, what="idle connections closed")
    await eventually(lambda: server.ends == 3, what="the server seeing them close")
    assert pool._reaping is None  # (nothing idle: no timer left behind)
    await (await pool.request(*post(), True)).read()  # (and the pool serves on)
    assert server.connections == 4


async def test_beyond_the_limit_a_request_waits_for_a_connection(serve):
    gate = asyncio.Event()

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            await gate.wait()
        writer.write(OK)
        await writer.drain()

    server, pool = await serve(handle, limit=1)
    first = asyncio.create_task(pool.request(*post(), True))
    second = asyncio.create_task(pool.request(*post(), True))
    await asyncio.sleep(0.05)
    assert len(server.requests) == 1 and not second.done()
    gate.set()
    assert await (await first).read() == b"{}"
    assert await (await second).read() == b"{}"
    assert server.connections == 1


async def test_a_stream_read_to_its_end_gives_its_connection_back(serve):
    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(chunk(b"data: [DONE]\n\n"))
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")  # the end, after the [DONE]: the connection drains
        await writer.drain()

    server, pool = await serve(handle)
    for _ in range(2):
        answer = await pool.request(*post(), False)
        got = b""
        async for data in answer.chunks():
            got += data
            if b"[DONE]" in got:
                break
        answer.release(drain=True)
        await asyncio.sleep(0.05)
        assert got == b"data: 1\n\ndata: [DONE]\n\n"
    assert server.connections == 1


async def test_a_stream_left_part_way_closes_its_connection(serve):
    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # (until the client goes)

    server, pool = await serve(handle)
    answer = await pool.request(*post(), False)
    async for _ in answer.chunks():
        break
    await answer.aclose()
    await asyncio.wait_for(server.closed.wait(), 5)  # the server saw the caller go
    assert pool.open == 0


async def test_a_body_that_ends_with_the_connection_is_whole_and_the_connection_not_kept(serve):
    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": 1}')
        await writer.drain()
        writer.close()

    server, pool = await serve(handle)
    assert await (await pool.request(*post(), True)).read() == b'{"a": 1}'
    assert await (await pool.request(*post(), True)).read() == b'{"a": 1}'
    assert server.connections == 2


async def test_an_interim_answer_is_skipped(serve):
    server, pool = await serve(answering(b"HTTP/1.1 100 Continue\r\n\r\n" + OK))
    answer = await pool.request(*post(), True)
    assert (answer.status, await answer.read()) == (200, b"{}")
    assert server.connections == 1


@pytest.mark.parametrize(
    ("answer", "reason", "answered"),
    [
        (b"", "connection closed by the upstream", False),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}", "malformed or truncated answer", True),
        (b"NOT HTTP AT ALL\r\n\r\n", "malformed or truncated answer", False),
    ],
)
async def test_an_answer_that_stops_short_is_a_failure_in_words(serve, answer, reason, answered):
    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        writer.close()

    _, pool = await serve(handle)
    with pytest.raises(wire.WireError) as raised:
        await (await pool.request(*post(), True)).read()
    assert (raised.value.reason, raised.value.answered) == (reason, answered)
    assert pool.open == 0


async def test_a_refused_connection_says_so():
    pool = wire.Pool("127.0.0.1", 1)
    with pytest.raises(wire.WireError, match="connection refused"):
        await pool.request(*post(), True)
    assert pool.open == 0


async def test_a_server_silent_for_the_answer_timeout_times_out(serve):
    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # (until the client goes)

    _, pool = await serve(handle, answer_timeout=0.2)
    answer = await pool.request(*post(), False)
    with pytest.raises(wire.WireTimeout):
        async for _ in answer.chunks():
            pass
    assert pool.open == 0


async def test_a_piece_unread_when_the_time_is_up_is_judged_once_its_reader_has_read_it(serve):
    """Bytes are no progress: only the reader says what is (``Answer.progressed``, a stream's
    event). A piece that came but was not read yet when the answer's time ran out (an event
    read in that very round of the loop, or a reader busy elsewhere) may be that progress: it
    is given to the reader, and the timeout judged at its next wait, once it has said (here it
    says nothing: timed out at once)."""
    more = asyncio.Event()

    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await more.wait()
        writer.write(chunk(b"data: 2\n\n"))
        await writer.drain()
        await reader.read()  # (until the client goes)

    _, pool = await serve(handle, answer_timeout=0.2)
    answer = await pool.request(*post(), False)
    pieces = answer.chunks()
    assert await anext(pieces) == b"data: 1\n\n"
    answer.progressed()
    more.set()
    connection = answer.connection
    await eventually(lambda: bool(connection.chunks), what="the second piece, unread")
    await eventually(lambda: connection.timer is None, what="the answer's time up")
    assert connection.failure is None and not connection.lost
    assert await anext(pieces) == b"data: 2\n\n"
    with pytest.raises(wire.WireTimeout):
        await anext(pieces)
    assert connection.lost and pool.open == 0


async def test_a_request_cancelled_while_it_waits_closes_its_connection(serve):
    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # (until the client goes)

    server, pool = await serve(handle)
    task = asyncio.create_task(pool.request(*post(), True))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.closed.wait(), 5)
    assert pool.open == 0 and not pool.busy


@pytest.mark.parametrize("value", ["a\r\nx-injected: 1", "a\nb", "a\x00b"])
def test_a_header_with_a_control_character_is_refused(value):
    with pytest.raises(ValueError, match="header injection"):
        wire.request_head("/v1/chat/completions", "h", {"x-custom": value}, 0)


@pytest.mark.parametrize("name", ["x-a:b", "x a", "x\ta", "", "x-\u00e9"])
def test_a_header_name_that_is_not_a_token_is_refused(name):
    with pytest.raises(ValueError, match="header injection"):
        wire.request_head("/v1/chat/completions", "h", {name: "v"}, 0)


def test_a_header_value_is_written_as_the_bytes_the_client_sent_beyond_latin1_as_utf8():
    # A client's value is read a byte a character (latin-1): written as UTF-8, a "café" sent
    # in UTF-8 went as "cafÃ©"'s. Only a library caller's text goes beyond latin-1.
    sent = "caf\u00e9".encode()
    head = wire.request_head(
        "/p", "h", {"x-a": "tab\there", "x-b": sent.decode("latin-1"), "x-c": "\u2615"}, 3
    )
    assert b"x-a: tab\there\r\n" in head and b"x-b: caf\xc3\xa9\r\n" in head
    assert "x-c: \u2615\r\n".encode() in head
    assert head.endswith(b"content-length: 3\r\n\r\n") and b"accept: */*\r\n" in head
    plain = wire.request_head("/p", "h", {"x-b": "caf\u00e9"}, 0)
    assert b"x-b: caf\xe9\r\n" in plain  # (latin-1 bytes, as a client sent them)


async def test_through_the_http_upstream_a_stream_that_ended_whole_keeps_its_connection(fake):
    """aiohttp closed a stream's connection at its [DONE]: every streamed miss opened one."""
    from carpool.config import LimitsConfig
    from carpool.upstream.base import UpstreamRequest
    from carpool.upstream.http import HttpUpstream

    upstream = HttpUpstream(fake.url, LimitsConfig())
    body = {"model": "m", "messages": [{"role": "user", "content": "a b c"}], "stream": True}
    try:
        for _ in range(3):
            response = await upstream.send(UpstreamRequest("/chat/completions", body, stream=True))
            assert [payload async for payload in response.events()]
            await response.aclose()
        whole = {**body, "stream": False}
        response = await upstream.send(UpstreamRequest("/chat/completions", whole))
        assert response.status == 200 and b"answer 4 to a b c" in response.body
    finally:
        await upstream.aclose()
    assert len({call.peer for call in fake.calls}) == 1


@pytest.mark.parametrize(
    "body",
    [b"0\r\n\r\n", chunk(b'data: {"n": 1}\n\n') + b"0\r\n\r\n"],
    ids=["empty", "without its [DONE]"],
)
async def test_a_stream_that_did_not_end_whole_closes_its_connection_never_reused(body):
    """llama-cpp-python's server answers a streamed prompt over its context with a 200, an
    empty chunked body, then closes the connection a few ms later. The body ended whole as
    HTTP goes, with keep-alive, so the connection went back to the pool, and the next call
    (anyone's) was written on it as the server closed it: a 502 "took the call but gave no
    answer", its replica counted failed. Here that server's connection takes no call after it."""
    from carpool.config import LimitsConfig
    from carpool.errors import UpstreamStreamBroken
    from carpool.upstream.base import UpstreamRequest
    from carpool.upstream.http import HttpUpstream

    broke: set[asyncio.StreamWriter] = set()

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if writer in broke:
            writer.close()  # (the call read whole, never answered: the server closing)
        elif n == 1:
            writer.write(CHUNKED_HEAD + body)  # (the server keeps the connection, so far)
            broke.add(writer)
        else:
            writer.write(OK)
        await writer.drain()

    server = Server(handle)
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    upstream = HttpUpstream(f"http://127.0.0.1:{port}/v1", LimitsConfig())
    streamed = {"model": "m", "messages": [], "stream": True}
    try:
        response = await upstream.send(UpstreamRequest("/chat/completions", streamed, stream=True))
        with pytest.raises(UpstreamStreamBroken):
            async for _ in response.events():
                pass
        await response.aclose()
        after = await upstream.send(UpstreamRequest("/chat/completions", {"model": "m"}))
        assert (after.status, after.body) == (200, b"{}")
        assert server.connections == 2
    finally:
        await upstream.aclose()
        listening.close()


async def test_a_stream_read_to_its_done_leaves_nothing_for_the_loops_generator_finalizer(fake):
    """A stream's reader stops at [DONE], before the body's end. Were the body's pieces an
    async generator, the one left so would go to the loop's finalizer hook, which schedules its
    closing from any thread (a wake-up of the loop, and a task) for every stream."""
    from carpool.config import LimitsConfig
    from carpool.upstream.base import UpstreamRequest
    from carpool.upstream.http import HttpUpstream

    finalized: list[object] = []
    firstiter, finalizer = sys.get_asyncgen_hooks()
    assert finalizer is not None  # (the running loop's)

    def counting(agen: object) -> None:
        finalized.append(agen)
        finalizer(agen)

    upstream = HttpUpstream(fake.url, LimitsConfig())
    body = {"model": "m", "messages": [{"role": "user", "content": "a b c"}], "stream": True}
    sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=counting)
    try:
        for _ in range(3):
            response = await upstream.send(UpstreamRequest("/chat/completions", body, stream=True))
            assert [payload async for payload in response.events()]
            await response.aclose()
        gc.collect()
    finally:
        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)
        await upstream.aclose()
    assert finalized == []


@pytest.mark.parametrize(
    "unasked",
    [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 4\r\n\r\nEVIL",
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 20\r\n\r\n",
    ],
    ids=["a whole answer", "a head"],
)
async def test_bytes_after_an_answer_are_not_taken_for_it_and_its_connection_is_not_reused(
    serve, unasked
):
    error = (
        b'HTTP/1.1 500 Oops\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n{"e":"x"}'
    )

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(error + unasked if n == 1 else OK)  # (in one write: one read, likely)
        await writer.drain()

    server, pool = await serve(handle)
    first = await pool.request(*post(), True)
    assert (first.status, first.content_type) == (500, "application/json")
    assert await first.read() == b'{"e":"x"}'
    assert not pool.idle  # never reused
    second = await pool.request(*post(), True)
    assert (second.status, await second.read()) == (200, b"{}")
    assert server.connections == 2


async def test_a_chunked_answers_trailers_are_not_its_head(serve):
    trailed = CHUNKED_HEAD + chunk(b"data: 1\n\n") + b"0\r\ncontent-type: text/plain\r\n\r\n"
    _, pool = await serve(answering(trailed))
    answer = await pool.request(*post(), True)
    assert answer.content_type == "text/event-stream"
    assert await answer.read() == b"data: 1\n\n"


async def test_an_answer_nobody_asked_for_after_a_drained_streams_end_is_never_reused(serve):
    """A stream read to its [DONE] drains: the connection goes back once the body's end comes.
    Given back from inside the parser, it was idle before the rest of that read (an unasked
    answer) was parsed, and kept: the next request on it never saw its own answer's head."""
    drained = asyncio.Event()

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            writer.write(CHUNKED_HEAD + chunk(b"data: [DONE]\n\n"))
            await writer.drain()
            await drained.wait()
            # The body's end and an answer nobody asked for (in one write: one read, likely).
            writer.write(b"0\r\n\r\n" + OK)
        else:
            writer.write(OK)
        await writer.drain()

    server, pool = await serve(handle, answer_timeout=5)
    answer = await pool.request(*post(), False)
    async for data in answer.chunks():
        assert data == b"data: [DONE]\n\n"
        break
    answer.release(drain=True)
    drained.set()
    await asyncio.wait_for(server.closed.wait(), 5)  # the gateway closed it, not kept it
    assert not pool.idle
    second = await pool.request(*post(), True)
    assert (second.status, await second.read()) == (200, b"{}")
    assert server.connections == 2


async def test_closing_the_pool_fails_a_request_still_waiting_for_its_answer(serve):
    """``Pool.close`` closed a busy connection as one whose request was over: its read timer
    stopped, and nothing woke the request waiting for its answer, which waited forever."""
    asked = asyncio.Event()

    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.set()
        await reader.read()  # (never answers)

    _, pool = await serve(handle)  # (the read timeout: 600 s)
    waiting = asyncio.create_task(pool.request(*post(), True))
    await asyncio.wait_for(asked.wait(), 5)
    pool.close()
    with pytest.raises(wire.WireError, match="connection closed") as raised:
        await asyncio.wait_for(waiting, 5)
    assert not raised.value.answered and pool.open == 0


async def _first_held(serve: Any, first_answer: bytes) -> tuple[Any, Any, asyncio.Event, Any]:
    """A pool of one connection whose first request the server holds until ``gate`` is set,
    then answers with ``first_answer`` (the others at once): (server, pool, gate, first)."""
    asked = asyncio.Event()
    gate = asyncio.Event()

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            asked.set()
            await gate.wait()
        writer.write(first_answer if n == 1 else OK)
        await writer.drain()

    server, pool = await serve(handle, limit=1)
    first = asyncio.create_task(pool.request(*post(b'"first"'), True))
    await asyncio.wait_for(asked.wait(), 5)
    return server, pool, gate, first


async def _ask(pool: Any, body: bytes) -> bytes:
    return await (await pool.request(*post(body), True)).read()


async def test_a_request_waiting_past_its_queue_timeout_fails_busy_and_leaves_the_line(serve):
    """A request beyond the limit waited for a connection for as long as those holding them
    ran (a long stream: minutes); ``answer_timeout`` counts from its send only. Past
    ``queue_timeout`` it fails (``WireBusy``: nothing sent), out of the line: the connection
    freed then goes to the next request, no place lost."""
    asked, gate = asyncio.Event(), asyncio.Event()

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            asked.set()
            await gate.wait()
        writer.write(OK)
        await writer.drain()

    server, pool = await serve(handle, limit=1, queue_timeout=0.05)
    first = asyncio.create_task(pool.request(*post(b'"first"'), True))
    await asyncio.wait_for(asked.wait(), 5)
    with pytest.raises(wire.WireBusy) as busy:
        await asyncio.wait_for(_ask(pool, b'"waiting"'), WAIT_S)
    assert not busy.value.sent and not busy.value.answered
    assert not pool._waiting and pool.open == 1
    gate.set()
    assert await (await asyncio.wait_for(first, 5)).read() == b"{}"
    assert await asyncio.wait_for(_ask(pool, b'"later"'), 5) == b"{}"
    bodies = [request.rsplit(b"\r\n\r\n", 1)[1] for request in server.requests]
    assert bodies == [b'"first"', b'"later"'] and server.connections == 1 and pool.open == 1


@pytest.mark.parametrize("kept", [True, False], ids=["given back", "closed"])
async def test_a_request_beyond_the_limit_is_served_before_any_that_came_after_it(serve, kept):
    """What the first request frees (its connection given back, or its place when its
    connection closes) is the waiting request's: a request that came later took it before the
    woken one ran, which then went to the back of the line (starved under steady load)."""
    first_answer = OK if kept else OK.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    server, pool, gate, first = await _first_held(serve, first_answer)
    waiting = asyncio.create_task(_ask(pool, b'"waiting"'))
    async with asyncio.timeout(5):
        while not pool._waiting:  # (until it has found the limit reached and waits in line)
            await asyncio.sleep(0)
    gate.set()
    answer = await asyncio.wait_for(first, 5)
    assert await answer.read() == b"{}"  # (done: frees the connection without yielding)
    async with asyncio.timeout(5):  # (no task of its own: it asks before the woken one runs)
        assert await _ask(pool, b'"later"') == b"{}"
    assert await asyncio.wait_for(waiting, 5) == b"{}"
    bodies = [request.rsplit(b"\r\n\r\n", 1)[1] for request in server.requests]
    assert bodies == [b'"first"', b'"waiting"', b'"later"']
    assert server.connections == (1 if kept else 2) and pool.open == 1


@pytest.mark.parametrize("handed", [False, True], ids=["while it waits", "once handed"])
async def test_a_waiting_request_that_leaves_passes_its_turn_on(serve, handed):
    server, pool, gate, first = await _first_held(serve, OK)
    leaving = asyncio.create_task(_ask(pool, b'"leaving"'))
    staying = asyncio.create_task(_ask(pool, b'"staying"'))
    async with asyncio.timeout(5):
        while len(pool._waiting) < 2:
            await asyncio.sleep(0)
    gate.set()
    answer = await asyncio.wait_for(first, 5)
    if not handed:
        leaving.cancel()
    assert await answer.read() == b"{}"  # (handed to the first in line)
    if handed:
        leaving.cancel()  # (its connection given, its task not yet run)
    assert await asyncio.wait_for(staying, 5) == b"{}"
    with pytest.raises(asyncio.CancelledError):
        await leaving
    bodies = [request.rsplit(b"\r\n\r\n", 1)[1] for request in server.requests]
    assert bodies == [b'"first"', b'"staying"'] and server.connections == 1
    assert pool.open == 1 and len(pool.idle) == 1 and not pool._waiting


@pytest.mark.parametrize("stalls", [False, True], ids=["cut", "stalled"])
async def test_a_whole_answer_cut_after_its_head_is_not_run_again_on_another_replica(serve, stalls):
    """Its head came, so the engine took the call (it sends a whole answer's head once the
    answer is computed); it was failed over like an unreachable replica: the generation ran
    twice, and the replica that answered was left out."""
    from carpool.config import LimitsConfig
    from carpool.errors import UpstreamError
    from carpool.routing import build_policy
    from carpool.routing.replicas import ReplicaSet
    from carpool.upstream.base import UpstreamRequest
    from carpool.upstream.http import HttpUpstream

    body = b'{"id": "x", "object": "chat.completion", "choices": []}'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"

    async def cut(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head % len(body) + body[:10])
        await writer.drain()
        if stalls:
            await reader.read()  # (until the client goes)
        else:
            writer.transport.abort()

    servers = [(await serve(cut))[0] for _ in range(2)]  # (whichever is chosen cuts)
    limits = LimitsConfig(upstream_timeout=0.2 if stalls else 600)
    upstreams = [
        HttpUpstream(f"http://127.0.0.1:{s.port}/v1", limits, label=f"replica-{i}")
        for i, s in enumerate(servers)
    ]
    seen: list[int] = []
    replicas = ReplicaSet(
        upstreams, build_policy("round-robin"), observe=lambda r, status, d: seen.append(status)
    )
    try:
        with pytest.raises(UpstreamError) as raised:
            await replicas.send(UpstreamRequest("/chat/completions", {"model": "m"}))
    finally:
        await replicas.aclose()
    assert sum(len(s.requests) for s in servers) == 1
    assert all(r.healthy for r in replicas.replicas)
    assert raised.value.status == seen[0] == (504 if stalls else 502) and len(seen) == 1
    assert raised.value.headers()["x-should-retry"] == "false"


def _replicas(ports: list[int], **limits: Any) -> Any:
    """A round-robin ``ReplicaSet`` of ``HttpUpstream``s on ``ports``, the first tried first,
    and the statuses its attempts were observed with."""
    from carpool.config import LimitsConfig
    from carpool.routing import build_policy
    from carpool.routing.replicas import ReplicaSet
    from carpool.upstream.http import HttpUpstream

    config = LimitsConfig(**limits)
    upstreams = [
        HttpUpstream(f"http://127.0.0.1:{port}/v1", config, label=f"replica-{i}")
        for i, port in enumerate(ports)
    ]
    seen: list[int] = []
    replicas = ReplicaSet(
        upstreams, build_policy("round-robin"), observe=lambda r, status, d: seen.append(status)
    )
    return replicas, seen


async def test_a_timeout_after_the_request_was_sent_is_not_failed_over(serve):
    """The request went whole and no answer came in time from a replica that answered other
    calls meanwhile: the engine may be running it (a whole answer's head comes once it is
    computed). It was failed over like an unreachable replica: the generation ran twice, its
    client waiting up to twice the timeout. (A replica silent to every call since is taken for
    hung: routing/test_routing.py.)"""
    from carpool.errors import UpstreamError
    from carpool.upstream.base import UpstreamRequest

    made: dict[str, Any] = {}

    async def silent(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = made["replicas"].replicas[0]  # (another call of it answered meanwhile)
        first.answered_at = made["replicas"].clock()
        await reader.read()  # (never answers, until the client goes)

    servers = [(await serve(silent))[0] for _ in range(2)]
    replicas, seen = _replicas([s.port for s in servers], upstream_timeout=0.2)
    made["replicas"] = replicas
    try:
        with pytest.raises(UpstreamError) as raised:
            await replicas.send(UpstreamRequest("/chat/completions", {"model": "m"}))
    finally:
        await replicas.aclose()
    assert [len(s.requests) for s in servers] == [1, 0]
    assert raised.value.status == 504 and seen == [504]
    assert raised.value.code == "upstream_timeout"
    assert raised.value.headers()["x-should-retry"] == "false"
    # Silent that long, it may be hung: left out, the other one not.
    assert [r.healthy for r in replicas.replicas] == [False, True]


async def test_a_replica_streaming_to_other_calls_is_alive_and_a_call_it_left_unanswered_not_run_again(
    serve,
):
    """Only an answer's head counted as news of a replica: one streaming tokens to another call
    all along was taken for hung when a call of its own got no head in time, and that call
    (which it was running) was run again on another replica."""
    from carpool.errors import UpstreamNoAnswer
    from carpool.upstream.base import UpstreamRequest

    asked = asyncio.Event()

    async def busy(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if b'"stream":true' in streaming.requests[-1]:
            writer.write(CHUNKED_HEAD + chunk(b'data: {"n": 1}\n\n'))
            await writer.drain()
            await asked.wait()  # (its next tokens come while the other call waits)
            writer.write(chunk(b'data: {"n": 2}\n\n') + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        else:
            asked.set()
            await reader.read()  # (running it: no answer before the client goes)

    streaming, _ = await serve(busy)
    other, _ = await serve(answering(OK))
    replicas, seen = _replicas([streaming.port, other.port], upstream_timeout=0.5)
    stream_request = UpstreamRequest(
        "/chat/completions", {"model": "m", "stream": True}, stream=True
    )
    try:
        stream, replica, _ = await replicas.send(stream_request)
        assert replica.label == "replica-0"
        events = stream.events()
        assert await events.__anext__() == [b'{"n": 1}']  # (before the call below is sent)
        rest = asyncio.create_task(_drain(events))
        whole = UpstreamRequest("/chat/completions", {"model": "m"})
        with pytest.raises(UpstreamNoAnswer):  # (sent to the streaming one: its holder, say)
            await replicas.send(whole, holder=replica.name)
        assert await rest == [[b'{"n": 2}']]
        await stream.aclose()
    finally:
        await replicas.aclose()
    assert len(streaming.requests) == 2 and len(other.requests) == 0
    assert seen == [200, 504]


async def _drain(events: Any) -> list[list[bytes]]:
    return [batch async for batch in events]


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
@pytest.mark.parametrize("size", [2, 12_000_000], ids=["small", "over the socket buffers"])
async def test_a_call_dropped_unanswered_after_it_was_sent_whole_is_not_run_again_elsewhere(
    serve, reset, size
):
    """A replica that read the request whole and then dropped the connection without a byte
    of answer (a proxy's cut, mid-generation) may have run it: that was ``UpstreamUnreachable``,
    failed over like a call that cannot have run, and the generation ran twice. Now it is
    ``UpstreamNoAnswer`` (a 502): not run again on another replica while that one answers
    other calls (silent to every call since, it is taken for hung: routing/test_routing.py)."""
    from carpool.errors import UpstreamNoAnswer
    from carpool.upstream.base import UpstreamRequest

    arrived, go = asyncio.Event(), asyncio.Event()

    async def drops(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            arrived.set()  # (read whole: ``Server.serve``)
            await go.wait()
            _hang_up(writer, reset)
        else:
            writer.write(OK)
            await writer.drain()

    dropping, _ = await serve(drops)
    other, _ = await serve(answering(OK))
    replicas, seen = _replicas([dropping.port, other.port])
    first = replicas.replicas[0]
    try:
        body = {"model": "m", "input": "x" * size}
        call = asyncio.create_task(replicas.send(UpstreamRequest("/embeddings", body)))
        await asyncio.wait_for(arrived.wait(), 5)
        # Meanwhile it answers another call: alive, it may be running the first.
        answered, replica, _ = await replicas.send(
            UpstreamRequest("/embeddings", {"model": "m", "input": "y"}), holder=first.name
        )
        assert answered.status == 200 and replica is first
        go.set()
        with pytest.raises(UpstreamNoAnswer) as raised:
            await asyncio.wait_for(call, 5)
    finally:
        await replicas.aclose()
    assert len(dropping.requests) == 2 and len(other.requests) == 0
    assert raised.value.status == 502 and seen == [200, 502]
    assert raised.value.headers()["x-should-retry"] == "false"
    assert "took the call but gave no answer" in raised.value.message
    assert not first.healthy  # (left out all the same)


async def test_a_timeout_before_the_request_was_read_whole_is_failed_over(serve):
    """A server that never read the whole request cannot be running it: tried elsewhere."""
    import socket

    from carpool.routing import Decision
    from carpool.upstream.base import UpstreamRequest

    read = asyncio.Event()

    class Deaf(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.pause_reading()  # type: ignore[attr-defined]
            read.set()

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (the request stays unsent)
    sock.bind(("127.0.0.1", 0))
    deaf = await asyncio.get_running_loop().create_server(Deaf, sock=sock)
    answering_server, _ = await serve(answering(OK))
    replicas, seen = _replicas([sock.getsockname()[1], answering_server.port], upstream_timeout=0.3)
    big = {"model": "m", "input": "x" * 12_000_000}  # (over both ends' socket buffers)
    try:
        response, replica, decision = await replicas.send(UpstreamRequest("/embeddings", big))
    finally:
        await replicas.aclose()
        deaf.close()
    assert read.is_set() and response.status == 200
    assert (replica.label, decision) == ("replica-1", Decision.FAILOVER)
    assert seen == [504, 200] and len(answering_server.requests) == 1


def _hang_up(writer: asyncio.StreamWriter, reset: bool) -> None:
    """The server drops the connection: a FIN, or (``reset``) an RST."""
    if reset:
        import socket
        import struct

        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()


# A body over both ends' socket buffers: not written whole (``sent``) when the server drops
# the connection at its head.
BIG = b'"' + b"x" * 12_000_000 + b'"'


def _big(head: bytes, _: object = None) -> bool:
    """Whether a request's head says a body of a megabyte or more."""
    length = next(line for line in head.split(b"\r\n") if line.startswith(b"content-length:"))
    return int(length.split(b":")[1]) >= 1_000_000


def _bodies(server: Server) -> list[bytes]:
    return [request.rsplit(b"\r\n\r\n", 1)[1] for request in server.requests]


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_call_a_kept_connection_dropped_late_is_not_sent_again(serve, reset):
    """A server that read the request whole and then dropped the kept connection without a
    byte of answer (an engine killed mid-generation, a proxy's cut) may be running it. That
    was taken for the keep-alive race and sent again on a new connection: a generation ran
    twice on its replica (three times once failed over). It fails now, once (``sent``: the
    replica set's "may be running it")."""

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if n == 2:
            _hang_up(writer, reset)  # (read whole: no byte of an answer)
        else:
            writer.write(OK)
            await writer.drain()

    server, pool = await serve(handle, limit=1)
    assert await _ask(pool, b'"first"') == b"{}"
    with pytest.raises(wire.WireError) as raised:
        await _ask(pool, b'"second"')
    assert raised.value.sent and not raised.value.answered
    assert _bodies(server) == [b'"first"', b'"second"']
    assert server.connections == 1 and pool.resent == 0 and pool.open == 0


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_kept_connection_the_server_closed_before_the_request_is_not_written_to(
    serve, reset
):
    """The keep-alive race as it mostly comes: the server closed a kept connection it deemed
    idle, and its FIN (or RST) is there, the loop not yet told, as a request is to go out on
    it. Nothing is written on it: the request goes on a new connection, once (not counted as
    sent again: it was not)."""

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(OK)
        await writer.drain()
        if n == 1:
            _hang_up(writer, reset)

    server, pool = await serve(handle)
    assert await _ask(pool, b'"first"') == b"{}"
    kept = pool.idle[0]
    kept.transport.pause_reading()  # (the loop does not read its close: as if it came just now)
    await asyncio.wait_for(server.closed.wait(), 5)  # (closed: its FIN or RST sent)
    assert not kept.lost
    assert await _ask(pool, b'"second"') == b"{}"
    assert _bodies(server) == [b'"first"', b'"second"']
    assert server.connections == 2 and pool.resent == 0 and pool.open == 1


async def test_a_kept_connection_dropped_before_the_request_went_whole_sends_it_again_on_a_new_one(
    serve,
):
    """The keep-alive race as the request goes out: the server drops the kept connection as
    the request arrives, never reading it whole (it cannot be running it). That was a 502
    (and, with several replicas, a healthy one left out): it is sent again, once, on a new
    connection, and counted (``resent``: the replica set's ``upstream_calls``)."""
    # (Dropped at its head once, on the kept connection; read whole on the new one.)
    server, pool = await serve(answering(OK), lambda head, _: _big(head) and server.cuts == 0)
    assert await _ask(pool, b'"first"') == b"{}"
    assert await _ask(pool, BIG) == b"{}"
    assert _bodies(server) == [b'"first"', BIG] and server.cuts == 1
    assert server.connections == 2 and pool.resent == 1 and pool.open == 1 and len(pool.idle) == 1


async def test_a_call_sent_again_is_an_attempt_of_its_replica(serve):
    """``upstream_calls`` (the replica set's ``attempts``) counts what the engines were asked:
    a call the transport sent a second time was counted once."""
    from carpool.upstream.base import UpstreamRequest

    server, _ = await serve(answering(OK), lambda head, _: _big(head) and server.cuts == 0)
    replicas, seen = _replicas([server.port])
    try:
        for text in ("y", "x" * 12_000_000):  # (the second dropped at its head, on the kept one)
            response, _, _ = await replicas.send(
                UpstreamRequest("/embeddings", {"model": "m", "input": text})
            )
            assert response.status == 200
        assert replicas.attempts() == 3
        assert next(iter(replicas.snapshot().values()))["calls"] == 3
    finally:
        await replicas.aclose()
    assert server.cuts == 1 and len(server.requests) == 2 and seen == [200, 200]


@pytest.mark.parametrize(
    "drop",
    ["a new connection", "the second time", "after a byte of its answer"],
)
async def test_a_request_is_sent_again_only_for_a_reused_connection_dropped_before_any_byte(
    serve, drop
):
    """Never twice more, never after the answer began, never on a connection opened for it:
    the server took the request then (it may be running it)."""

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if drop == "after a byte of its answer" and n == 2:
            writer.write(b"HTTP/1.1 200")
            await writer.drain()
            _hang_up(writer, reset=False)
        else:
            writer.write(OK)
            await writer.drain()

    def cut(head: bytes, _: asyncio.StreamWriter) -> bool:
        # (Each time the big one comes: on the kept connection, then on the new one.)
        return drop != "after a byte of its answer" and _big(head)

    server, pool = await serve(handle, cut)
    if drop != "a new connection":
        assert await _ask(pool, b"{}") == b"{}"
    with pytest.raises(wire.WireError):
        await _ask(pool, b"{}" if drop == "after a byte of its answer" else BIG)
    assert server.cuts == {"a new connection": 1, "the second time": 2}.get(drop, 0)
    assert len(server.requests) == {"after a byte of its answer": 2}.get(drop, 1 - server.cuts % 2)
    assert pool.resent == (drop == "the second time") and pool.open == 0


async def test_a_request_sent_again_goes_on_a_connection_that_carried_nothing_before(serve):
    """Not on one just given back by another request: a server that drops every connection
    after its answer (without saying so) drops that one too, and it failed then, for good."""
    held = asyncio.Event()
    carried: dict[int, list[bytes]] = {}  # what each connection carried (by its port)

    def port(writer: asyncio.StreamWriter) -> int:
        return int(writer.get_extra_info("peername")[1])

    def cut(head: bytes, writer: asyncio.StreamWriter) -> bool:
        if _big(head) and server.cuts == 0:
            carried.setdefault(port(writer), []).append(b"big")
            return True
        return False

    async def handle(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = server.requests[-1].rsplit(b"\r\n\r\n", 1)[1]
        carried.setdefault(port(writer), []).append(b"big" if body == BIG else body)
        if body == b'"held"':
            await held.wait()
        writer.write(OK)
        await writer.drain()

    server, pool = await serve(handle, cut, limit=2)
    assert await asyncio.gather(_ask(pool, b"{}"), _ask(pool, b"{}")) == [b"{}", b"{}"]
    assert len(pool.idle) == 2
    holding = asyncio.create_task(_ask(pool, b'"held"'))
    async with asyncio.timeout(5):
        while len(server.requests) < 3:
            await asyncio.sleep(0)
    # The second idle one, dropped as its request comes; a third request waits for a place
    # (the dropped one's) and gives its connection back before the held one does.
    again = asyncio.create_task(_ask(pool, BIG))
    waiting = asyncio.create_task(_ask(pool, b'"waiting"'))
    assert await asyncio.wait_for(waiting, 5) == b"{}"
    assert await asyncio.wait_for(again, 5) == b"{}"
    held.set()
    assert await asyncio.wait_for(holding, 5) == b"{}"
    assert sorted(carried.values()) == sorted(
        [[b"{}", b'"held"'], [b"{}", b"big"], [b'"waiting"'], [b"big"]]
    )
    assert pool.resent == 1


@pytest.mark.parametrize("how", ["whole", "trickled", "interim answers without end"])
async def test_an_answer_head_over_64_kib_fails_the_answer(serve, how):
    """A 4 MB header was taken; a head trickled a KiB at a time (each piece restarting the read
    timer) grew the gateway's memory for ever."""

    async def handle(_: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if how == "whole":
            writer.write(OK.replace(b"\r\n\r\n", b"\r\nx-big: %s\r\n\r\n" % (b"a" * 100_000)))
            await writer.drain()
            await reader.read()
            return
        piece = b"a" * 1024
        if how == "trickled":
            writer.write(b"HTTP/1.1 200 OK\r\nx-big: ")
        else:
            piece = b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n" * 20
        while True:  # (until the client goes: a ConnectionError)
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)

    server, pool = await serve(handle)
    with pytest.raises(wire.WireError, match="answer head too large") as raised:
        await asyncio.wait_for(pool.request(*post(), True), 10)
    assert not raised.value.answered and pool.open == 0
    await asyncio.wait_for(server.closed.wait(), 5)  # (the connection closed)
