"""An HTTP proxy, as an egress proxy is (squid's roles): a ``CONNECT`` tunnel to an https
upstream, an http upstream's requests taken in absolute form, each to the host they name
looked up in ``hosts`` (so a test's upstream has a name that is no loopback host, which the
gateway would reach directly).

    proxy = await HttpProxy(hosts={"upstream.test": 8443}).start()
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)          # http://127.0.0.1:PORT
    ...
    proxy.tunnels      # ["upstream.test:8443", ...]: each CONNECT's target, in order
    proxy.requests     # ["POST http://upstream.test:8080/v1/chat/completions", ...]
    proxy.credentials  # each request's Proxy-Authorization (None: none sent), in order

- ``require``: a ``Proxy-Authorization`` value; a request without it is answered 407 (and the
  connection closed), as a proxy whose user or password is wrong.
- ``stall``: every request is read and never answered (a proxy stuck reaching the upstream);
  ``stalled`` is set once one was.
- ``own``: a whole answer (bytes) the proxy gives every http request itself, in place of the
  upstream's (an ACL's 403, a 503 when the upstream is down), then closes.
- An http upstream's connection: the first request names where every later one on it goes (as
  the gateway sends them: one replica a pool); each request is relayed whole, its head as sent
  (uvicorn reads a target in absolute form), ``Proxy-Authorization`` left out (hop-by-hop).
"""

from __future__ import annotations

import asyncio
import contextlib


class HttpProxy:
    def __init__(
        self,
        hosts: dict[str, int],
        require: str | None = None,
        stall: bool = False,
        own: bytes | None = None,
    ) -> None:
        self.hosts = hosts
        self.own = own
        self.require = require
        self.stall = stall
        self.stalled = asyncio.Event()
        self.tunnels: list[str] = []
        self.requests: list[str] = []
        self.credentials: list[str | None] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> HttpProxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> HttpProxy:
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    def _where(self, authority: str) -> int:
        host, _, port = authority.rpartition(":")
        assert self.hosts.get(host) is not None, f"the proxy knows no host {host}"
        return self.hosts[host]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: asyncio.StreamWriter | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.decode("latin-1").split("\r\n")
                method, target, _ = line.split(" ", 2)
                named = dict(f.split(": ", 1) for f in fields if f)
                lower = {k.lower(): v for k, v in named.items()}
                sent = lower.get("proxy-authorization")
                self.credentials.append(sent)
                if self.require is not None and sent != self.require:
                    writer.write(
                        b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                        b'proxy-authenticate: Basic realm="test"\r\n'
                        b"content-length: 0\r\nconnection: close\r\n\r\n"
                    )
                    await writer.drain()
                    return
                if self.stall:
                    self.stalled.set()
                    await reader.read()  # (until the gateway gives up and closes)
                    return
                if method == "CONNECT":
                    self.tunnels.append(target)
                    up_reader, upstream = await asyncio.open_connection(
                        "127.0.0.1", self._where(target)
                    )
                    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    await asyncio.gather(
                        self._pipe(reader, upstream), self._pipe(up_reader, writer)
                    )
                    return
                self.requests.append(f"{method} {target}")
                if self.own is not None:
                    writer.write(self.own)
                    await writer.drain()
                    return
                if upstream is None:
                    authority = target.split("://", 1)[1].split("/", 1)[0]
                    up_reader, upstream = await asyncio.open_connection(
                        "127.0.0.1", self._where(authority)
                    )
                    self._tasks.add(asyncio.ensure_future(self._pipe(up_reader, writer)))
                kept = [f for f in fields if f and not f.lower().startswith("proxy-authorization")]
                upstream.write("\r\n".join([line, *kept, "", ""]).encode("latin-1"))
                length = int(lower.get("content-length", "0"))
                upstream.write(await reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # (the gateway gone, or the proxy closing: ``aclose``)
        finally:
            self._tasks.discard(task)
            for side in (writer, upstream):
                if side is not None:
                    side.close()

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await source.read(65536):
                target.write(data)
                await target.drain()
        target.close()
