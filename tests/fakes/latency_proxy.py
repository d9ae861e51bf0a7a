"""A TCP proxy in front of one Redis, for one instance's link: ``hold()`` stops forwarding in
both directions (Redis itself stays fine, other links too) until ``release()``, as a link that
stalls; what was sent meanwhile is delivered, in order, once released. ``reset()`` resets every
connection open through it (a TCP RST to the client and to Redis), as a middlebox or a Redis
failover does; new ones are forwarded as before.

    proxy = await LinkProxy("127.0.0.1", port).start()
    url = proxy.url  # redis://127.0.0.1:PORT/0, for the instance whose link it is
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class LinkProxy:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # both ends of every connection

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def start(self) -> LinkProxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def reset(self) -> None:
        for writer in self._writers:
            sock = writer.get_extra_info("socket")
            if sock is not None:  # (linger 0: the close is a RST, not a FIN)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self._writers.clear()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._writers.update((writer, up_writer))
        for source, target in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(source, target))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self.flowing.wait()
                target.write(data)
                await target.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                target.close()
