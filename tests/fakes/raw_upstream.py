"""An upstream whose answers are raw bytes, for what the ASGI fake (``fakes.upstream``) cannot
send: a status uvicorn would not write (101 taken as final, 600-999), an answer without a
content type, exactly the head a test wants, an answer that trickles in (a body a byte at a
time, a stream kept warm by SSE comments).

    async with raw_upstream(lambda call: answer(304, b"Not Modified")) as up:
        ...  # point the gateway at up.url; up.calls, up.arrived

Details:
- Each request (its head, and a body of ``content-length`` bytes, or a chunked one) is recorded
  in ``calls`` once whole (a ``RawCall``: request line, lower-case headers, the body parsed as
  JSON or None, and its bytes) and ``arrived`` is set (``headed`` as soon as its head is read,
  its body maybe still coming); then, once ``gate`` (when one is set) is, the bytes ``respond(call)``
  returns are written as they are (``respond`` may be a coroutine function: its result is
  awaited), or, when it returns an async iterable of bytes, each piece as it comes (drained
  before the next: an answer that trickles in, for as long as the iterable goes on). The
  connection is kept for the next request, unless ``respond`` returned ``close=True`` along
  with its bytes (a tuple), then it is closed. ``connections`` counts the connections taken,
  ``ended`` those over (either side closed it: a gateway that gave up on an answer trickling
  in closes it, and the next write fails). ``server`` is the listening server (closed: no
  new connection is taken, those open are kept). ``port``: where it listens (0: a free one; a
  port given: an upstream that comes back where the gateway was refused).
- ``answer(status, reason, body, content_type, headers)`` makes an answer's bytes, with its
  ``content-length`` (``content_type=None``: no ``content-type`` line at all);
  ``chat_completion(text)`` a complete chat answer's body.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RawCall", "RawUpstream", "answer", "chat_completion", "raw_upstream"]


@dataclass
class RawCall:
    line: str
    headers: dict[str, str]
    body: Any = field(default=None)
    data: bytes = b""  # (the body's bytes, a chunked one's decoded)


async def _dechunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body's bytes (its trailer section skipped); ``IncompleteReadError`` when the
    connection ends before its last chunk: a body cut short is no call."""
    data = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass
            return bytes(data)
        data += await reader.readexactly(size)
        await reader.readexactly(2)


def answer(
    status: int,
    reason: bytes = b"",
    body: bytes = b"",
    content_type: bytes | None = b"application/json",
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> bytes:
    """An HTTP/1.1 answer's bytes, with its ``content-length``."""
    head = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    if content_type is not None:
        head += b"content-type: " + content_type + b"\r\n"
    for name, value in headers:
        head += name + b": " + value + b"\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def chat_completion(text: str = "fine") -> bytes:
    """A complete chat completion's JSON body answering ``text``."""
    return json.dumps(
        {
            "id": "chatcmpl-raw",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()


# Its bytes (with whether to close the connection after them), or its pieces as they come.
Answered = bytes | tuple[bytes, bool] | AsyncIterable[bytes]
Respond = Callable[[RawCall], Answered | Awaitable[Answered]]


class RawUpstream:
    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.server: asyncio.Server | None = None
        self.calls: list[RawCall] = []
        self.arrived = asyncio.Event()
        self.headed = asyncio.Event()  # (a request's head read, its body maybe still coming)
        self.gate: asyncio.Event | None = None
        self.url = ""
        self.connections = 0
        self.ended = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                line, *fields = head.decode("latin-1").split("\r\n")
                headers = {}
                for field_line in fields:
                    name, colon, value = field_line.partition(":")
                    if colon:
                        headers[name.strip().lower()] = value.strip()
                self.headed.set()
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    raw = await _dechunked(reader)
                else:
                    raw = await reader.readexactly(int(headers.get("content-length", "0")))
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                call = RawCall(line, headers, body, raw)
                self.calls.append(call)
                self.arrived.set()
                if self.gate is not None:
                    await self.gate.wait()
                out = self.respond(call)
                if inspect.isawaitable(out):
                    out = await out
                if isinstance(out, AsyncIterable):
                    async for piece in out:
                        writer.write(piece)
                        await writer.drain()
                    continue
                data, close = out if isinstance(out, tuple) else (out, False)
                writer.write(data)
                await writer.drain()
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.ended += 1
            writer.close()


@contextlib.asynccontextmanager
async def raw_upstream(respond: Respond, port: int = 0) -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream(respond)
    server = upstream.server = await asyncio.start_server(upstream.serve, "127.0.0.1", port)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        yield upstream
    finally:
        server.close()
