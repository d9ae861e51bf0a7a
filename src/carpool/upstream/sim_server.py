"""The simulated engine over HTTP: each replica as its own OpenAI-compatible server.

Contract:
- ``create_app(replica)`` serves ``POST /v1/chat/completions``, ``/v1/completions``,
  ``/v1/embeddings``, ``/v1/responses``, ``/v1/messages``, ``GET /v1/models`` (and
  ``/v1/models/{id}``) and ``GET /sim/stats`` (the replica's counters). Streams are SSE
  (``data: {...}\\n\\n`` frames, then ``data: [DONE]\\n\\n``); those of the Responses and
  Messages APIs are typed events (``event: TYPE\\ndata: {...}\\n\\n``) with no ``[DONE]``.
  Malformed JSON is a 400 and an unknown path a 404, in OpenAI's error shape, naming the path as
  it came (the Responses and Messages APIs' other paths: their own 404s,
  ``replies.not_found_reply``). Every response carries
  ``x-carpool-simulated: true``.
- A request whose client disconnects before its answer is ready is abandoned, as vLLM and SGLang
  abort one whose connection closed: a whole answer (or an embeddings call) is cancelled where
  it is, queued or decoding, so its slot is freed at once and the tokens it had yet to decode are
  never counted; a stream ends with its response (at the disconnect, or at the first chunk
  sent after it), which closes the replica's stream (``_sse``). The gateway relies on it: it
  cancels a call every client left (``coalesce.finish_abandoned: false``) to free the engine.
- ``serve_replicas(config, host, port)`` runs ``config.replicas`` servers on ``port``,
  ``port+1``, ... in one event loop until interrupted (SIGINT/SIGTERM stop them all), printing one
  line per replica that says it is simulated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from carpool.config import SimConfig
from carpool.config.urls import url_host
from carpool.signals import stopping
from carpool.sse import event_frame
from carpool.upstream.sim import (
    JSON_HEADERS,
    SIMULATED_HEADER,
    SimReplica,
    SimReply,
    build_replicas,
    error_reply,
    not_found_reply,
)
from carpool.upstream.sim.replies import strip_v1

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {SIMULATED_HEADER[0]: SIMULATED_HEADER[1], "cache-control": "no-cache"}


def _json(status: int, payload: Any) -> Response:
    return Response(
        orjson.dumps(payload), status, headers=JSON_HEADERS, media_type="application/json"
    )


async def _sse(chunks: AsyncIterator[dict[str, Any]], typed: bool = False) -> AsyncIterator[bytes]:
    # Close the replica's stream however this one ends (client gone, server stopping), so its
    # slot is freed now rather than when the generator is garbage-collected.
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]  # (an async generator: it has aclose)
        async for chunk in chunks:
            if typed:
                yield event_frame(str(chunk["type"]).encode(), orjson.dumps(chunk))
            else:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    if not typed:
        yield SSE_DONE


def _to_response(reply: SimReply) -> Response:
    if reply.chunks is not None:
        return StreamingResponse(
            _sse(reply.chunks, reply.typed),
            reply.status,
            headers=SSE_HEADERS,
            media_type="text/event-stream",
        )
    return _json(reply.status, reply.body)


async def _client_left(receive: Receive) -> bool:
    """Whether the next message is the client's disconnect. The body is read already, so a
    server's ``receive`` waits until the connection closes (then ``http.disconnect``); a wrapper
    that replays the body (``carpool bench``'s upstreams) may answer another at once: that is
    no disconnect, and there is nothing more to watch."""
    return bool((await receive())["type"] == "http.disconnect")


async def _unless_abandoned(
    request: Request, work: Coroutine[Any, Any, SimReply]
) -> SimReply | None:
    """``work``'s reply, or None when the client disconnected first: then ``work`` is cancelled
    (module contract), as a real engine aborts a request nobody waits for any more."""
    serving = asyncio.create_task(work)
    leaving = asyncio.create_task(_client_left(request.receive))
    try:
        await asyncio.wait((serving, leaving), return_when=asyncio.FIRST_COMPLETED)
        if not serving.done() and not (leaving.exception() is None and leaving.result()):
            await asyncio.wait((serving,))  # (no disconnect to come: served as it is)
    finally:
        # However this ends (an answer, a disconnect, the server stopping): no task outlives it.
        for task in (serving, leaving):
            if not task.done():
                task.cancel()
        await asyncio.gather(serving, leaving, return_exceptions=True)
    return None if serving.cancelled() else serving.result()


def create_app(replica: SimReplica) -> Starlette:
    """An OpenAI-compatible app for one simulated replica."""

    async def generate(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            replica.counted(strip_v1(request.url.path).lstrip("/"), error=True)
            return _to_response(error_reply(400, f"the request body is not valid JSON: {exc}"))
        reply = await _unless_abandoned(
            request, replica.handle(request.url.path, body, request.headers)
        )
        if reply is None:  # (nobody reads it: nginx's "client closed request")
            return Response(status_code=499, headers=dict([SIMULATED_HEADER]))
        return _to_response(reply)

    async def models(request: Request) -> Response:
        return _json(200, replica.models())

    async def model(request: Request) -> Response:
        replica.counted("models")
        return _json(200, replica.model_card(request.path_params["model"]))

    async def stats(request: Request) -> Response:
        return _json(200, replica.stats())

    async def unknown(request: Request) -> Response:
        path = request.url.path
        replica.counted("other", error=True)
        if path.startswith("/v1/"):  # (the replies speak of paths relative to /v1)
            return _to_response(not_found_reply(request.method, path[len("/v1") :]))
        return _to_response(error_reply(404, f"Invalid URL ({request.method} {path})"))

    routes = [
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/embeddings", generate, methods=["POST"]),
        Route("/v1/responses", generate, methods=["POST"]),
        Route("/v1/messages", generate, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/sim/stats", stats, methods=["GET"]),
        # Last: whatever the routes above do not serve (wrong path or method) is OpenAI's 404.
        Route(
            "/{rest:path}",
            unknown,
            methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        ),
    ]
    return Starlette(routes=routes)


class _ReplicaServer(uvicorn.Server):
    """A uvicorn server that leaves signals to ``serve_replicas``: uvicorn's own handlers would
    each replace the previous one, so Ctrl-C would reach one replica at a time."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _stop_on_signals(servers: Sequence[uvicorn.Server]) -> list[int]:
    """Make SIGINT/SIGTERM stop every server (SIGINT unless ignored: ``carpool.signals``);
    returns the signals handled."""
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for server in servers:
            server.should_exit = True

    handled = []
    for sig in stopping():  # (not SIGINT where it is ignored: a background job's)
        try:
            loop.add_signal_handler(sig, stop_all)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or a platform without loop signal handlers
    return [int(sig) for sig in handled]


async def serve_replicas(config: SimConfig, host: str, port: int) -> None:
    """Serve ``config.replicas`` replicas on ports ``port``, ``port+1``, ... until stopped (port 0:
    each replica on a free port)."""
    replicas = build_replicas(config)
    servers = [
        _ReplicaServer(
            uvicorn.Config(
                create_app(replica),
                host=host,
                port=port + i if port else 0,
                log_level="warning",
                lifespan="off",
            )
        )
        for i, replica in enumerate(replicas)
    ]
    handled = _stop_on_signals(servers)
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    try:
        await _announce_when_started(replicas, servers, tasks, host)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # When one replica stops (a signal, a failure, or this coroutine is cancelled), stop them
        # all and wait for them, so no server outlives the call.
        for server in servers:
            server.should_exit = True
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for sig in handled:
            loop.remove_signal_handler(sig)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


async def _announce_when_started(
    replicas: list[SimReplica],
    servers: Sequence[uvicorn.Server],
    tasks: list[asyncio.Task[None]],
    host: str,
) -> None:
    """Print each replica's URL once it listens (the bound port, which matters for port 0)."""
    for replica, server, task in zip(replicas, servers, tasks, strict=True):
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if not server.started:
            continue  # it failed to start; uvicorn has logged why, and the caller sees it end
        sockets = server.servers[0].sockets if server.servers else ()
        if not sockets:
            continue  # started and stopped at once (a Ctrl-C as it started): nothing to say
        bound = sockets[0].getsockname()[1]
        print(
            f"carpool sim (SIMULATED engine, not a real model): replica {replica.name} on "
            f"http://{url_host(host)}:{bound}/v1",
            flush=True,
        )
