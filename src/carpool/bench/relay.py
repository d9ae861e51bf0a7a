"""The byte relay: the floor of what any proxy adds on this machine, for comparisons.

    python -m carpool.bench.relay UPSTREAM_PORT      # announces its port (process.py)

Contract:
- Every connection it accepts is paired with one of its own to 127.0.0.1:``UPSTREAM_PORT``, and
  the bytes each side sends are written to the other as they come: no parsing, no copy but the
  read's, no counting, ``TCP_NODELAY`` both ways, on uvloop when installed (the gateway's loop).
  Either side closing closes the other. Not a gateway: a reference target. What it adds over
  calling the upstream directly is one more hop between processes (two socket writes and two
  wake-ups a request) and nothing else, so it is the least any proxy in Python adds here, the
  gateway's misses included (``bench_perf``).
- ``relay(upstream_port, health, log_path)`` (context manager) runs it in a child process and
  yields its ``process.Server`` once ``GET health`` answers through it (the upstream's path).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from . import process


@contextlib.contextmanager
def relay(
    upstream_port: int, health: str = "/", log_path: Path | None = None
) -> Iterator[process.Server]:
    with process.server(
        "carpool.bench.relay",
        [str(upstream_port)],
        name="the byte relay",
        health=health,
        log_path=log_path,
    ) as child:
        yield child


class _Side(asyncio.Protocol):
    """One end of a pair: what it reads goes to ``peer`` (held in ``early`` until it exists)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (a stream transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.write(data)
        else:
            self.early.append(data)

    def joined(self, peer: asyncio.Transport) -> None:
        self.peer = peer
        if self.early:
            peer.write(b"".join(self.early))
            self.early = []

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()


class _Client(_Side):
    """A client's end: its upstream end is opened as it connects."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        self.opening: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # (Held here: the loop keeps only a weak reference to a task, which may otherwise be
        # collected before its connection is made.)
        self.opening = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        assert self.transport is not None
        try:
            up, side = await asyncio.get_running_loop().create_connection(
                _Side, process.HOST, self.upstream_port
            )
        except OSError:
            self.transport.close()
            return
        side.joined(self.transport)
        self.joined(up)


def main() -> None:
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        # (Not ``uvloop.install()``: deprecated from Python 3.12, a policy set process-wide.)
        loop_factory = uvloop.new_event_loop
    upstream_port = int(sys.argv[1])
    sock = process.listen()
    process.announce(sock)
    process.exit_with_parent()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Client(upstream_port), sock=sock)
        await server.serve_forever()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())


if __name__ == "__main__":
    main()
