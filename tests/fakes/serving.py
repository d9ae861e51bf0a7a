"""Serve any ASGI app over real HTTP on loopback, inside the *current* event loop.

    async with serve_app(app) as url:            # url == "http://127.0.0.1:PORT"
        async with httpx.AsyncClient(base_url=url) as client:
            ...

    async with serve_app_with_server(app) as served:   # served.url, served.server (uvicorn.Server)
        ...

The server runs as a task of the running loop (no thread, no subprocess), so tests can drive the
fake upstream, the gateway and the clients in one loop and synchronise with asyncio events.

Details:
- Port 0: the OS picks a free port; the URL carries the real one.
- Startup is awaited (bounded by ``startup_timeout``); a server that fails to start raises
  ``RuntimeError`` (uvicorn's ``sys.exit`` is turned into an exception so it cannot stop pytest).
- The server does not touch signal handlers (several servers may be nested or overlap in time)
  and wakes up at once when asked to stop, instead of polling every 0.1 s.
- The protocol is carpool's (``carpool.http_protocol``, what ``carpool serve`` runs): for the
  gateway's app it answers exact hits as they are parsed; for any other app it is uvicorn's.
  ``http="httptools"`` serves uvicorn's own.
- ``log_config=None`` by default: uvicorn does not reconfigure the process' logging; its records
  (``uvicorn.error`` at WARNING and above) propagate to the root logger, where pytest captures them.
- Exit asks the server to stop and waits up to ``shutdown_timeout`` seconds for in-flight requests
  to finish. After that it closes the remaining connections (an app waiting on them then sees
  ``http.disconnect``), cancels the request tasks still running, and forces the exit, so a hung
  request never hangs the test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from carpool.http_protocol import protocol

__all__ = ["ServedApp", "serve_app", "serve_app_with_server"]


class _InLoopServer(uvicorn.Server):
    """A ``uvicorn.Server`` fit for running inside a test's event loop."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._wake = asyncio.Event()

    # Leave signal handlers alone: overlapping servers would restore each other's handlers.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass

    async def main_loop(self) -> None:
        # Same as uvicorn's loop (on_tick refreshes the Date header and reports should_exit),
        # but it sleeps on an event that ``request_exit`` sets, so stopping takes no 0.1 s tick.
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # a multiple of 10: refresh the Date header each tick
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # uvicorn's shutdown, minus its fixed 0.1 s pause and 0.1 s polling (they add up over a
        # test suite) and minus timeout_graceful_shutdown (serve_app bounds the wait itself).
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()  # closes idle keep-alive connections, finishes busy ones
        while (state.connections or state.tasks) and not self.force_exit:
            await asyncio.sleep(0.002)
        if not self.force_exit:
            for server in self.servers:
                await server.wait_closed()
            await self.lifespan.shutdown()

    def request_exit(self) -> None:
        self.should_exit = True
        self._wake.set()


@dataclass(frozen=True)
class ServedApp:
    url: str  # "http://127.0.0.1:PORT", no trailing slash
    server: uvicorn.Server
    port: int


async def _run(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits the process when startup fails
        raise RuntimeError(f"uvicorn failed to start (exit code {exc.code})") from exc


async def _force_stop(server: uvicorn.Server) -> None:
    """Close what is left: connections first (apps see http.disconnect), then request tasks."""
    state = server.server_state
    for conn in list(state.connections):
        transport = getattr(conn, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.close()
    await asyncio.sleep(0)  # let connection_lost callbacks run
    tasks = list(state.tasks)
    if tasks:
        _done, pending = await asyncio.wait(tasks, timeout=1.0)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
    server.force_exit = True


@contextlib.asynccontextmanager
async def serve_app_with_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 10.0,
    shutdown_timeout: float = 5.0,
    **config_kwargs: Any,
) -> AsyncIterator[ServedApp]:
    """Serve ``app`` on ``host`` at a free port; yield a ``ServedApp`` (url, server, port).

    Extra keyword arguments go to ``uvicorn.Config`` (e.g. ``http="h11"``, ``log_config=...``).
    """
    options: dict[str, Any] = {
        "log_level": "warning",
        "lifespan": "auto",
        "log_config": None,
        "http": protocol(),
        "ws": "none",  # (as ``carpool serve``)
    }
    options.update(config_kwargs)
    config = uvicorn.Config(app, host=host, port=0, **options)
    server = _InLoopServer(config)
    loop = asyncio.get_running_loop()
    task = loop.create_task(_run(server), name=f"serve_app({type(app).__name__})")

    deadline = loop.time() + startup_timeout
    try:
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
                raise RuntimeError("uvicorn server stopped before it started")
            if loop.time() > deadline:
                raise TimeoutError(f"uvicorn server did not start within {startup_timeout} s")
            await asyncio.sleep(0.002)
    except BaseException:
        server.request_exit()
        server.force_exit = True
        task.cancel()
        await asyncio.wait([task])
        raise

    port = server.servers[0].sockets[0].getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    served = ServedApp(url=f"http://{url_host}:{port}", server=server, port=port)
    try:
        yield served
    except BaseException:
        await _stop(server, task, shutdown_timeout)
        raise
    await _stop(server, task, shutdown_timeout)
    if not task.cancelled() and task.exception() is not None:
        raise RuntimeError("the uvicorn server task failed") from task.exception()


async def _stop(server: _InLoopServer, task: asyncio.Task[None], shutdown_timeout: float) -> None:
    server.request_exit()
    done, _ = await asyncio.wait([task], timeout=shutdown_timeout)
    if not done:
        await _force_stop(server)
        done, _ = await asyncio.wait([task], timeout=5.0)
        if not done:  # pragma: no cover - last resort
            task.cancel()
            await asyncio.wait([task])


@contextlib.asynccontextmanager
async def serve_app(app: Any, *, host: str = "127.0.0.1", **kwargs: Any) -> AsyncIterator[str]:
    """Serve ``app`` in the current loop; yield its base URL ``http://127.0.0.1:PORT``.

    Keyword arguments: see ``serve_app_with_server``.
    """
    async with serve_app_with_server(app, host=host, **kwargs) as served:
        yield served.url
