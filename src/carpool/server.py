"""The ASGI app: a thin adapter from HTTP to ``Gateway.handle``.

Contract:
- The three cached endpoints are served by a raw ASGI path (no framework on the hot path): read the
  body within ``limits.max_body_bytes`` (413 beyond it, without reading the rest), hand it to the
  pipeline, send the ``Reply``.
- While a request waits or streams, a watcher listens for the client going away; if it does, the
  request's task is cancelled, which releases its place in the flight (and, for the last client,
  cancels the upstream call). A client leaving is not an error and is not logged as one.
- Everything else (``/healthz``, ``/stats``, ``/metrics``, ``/dashboard``, ``/admin/*`` and
  pass-through of other ``/v1/*`` paths) is a small Starlette app.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from importlib import resources
from itertools import chain
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .config import Config
from .errors import BodyTooLarge, CarpoolError, HeadersTooLarge, RequestError
from .openapi import document as openapi_document
from .outcome import Outcome
from .pipeline import Gateway, Reply
from .request import ENDPOINTS, ClientRequest

log = logging.getLogger("carpool.server")

Scope = dict[str, Any]


class GatewayApp:
    """The gateway's ASGI application."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.max_body = gateway.config.limits.max_body_bytes
        self.max_headers = gateway.config.limits.max_header_bytes
        self.other = _control_app(gateway)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and \
                sum(map(len, chain.from_iterable(scope["headers"]))) > self.max_headers:
            # Checked here because httptools accepts headers of any size, and they go upstream.
            cached = scope["path"] in ENDPOINTS
            if cached:
                self.gateway.stats.rejected += 1
            error = HeadersTooLarge(self.max_headers)
            await _send_whole(send, error.status, [(b"content-type", b"application/json"),
                                                   *([Outcome.BYPASS.header] if cached else [])],
                              error.body())
        elif scope["type"] == "http" and scope["path"] in ENDPOINTS and scope["method"] == "POST":
            await self._cached_endpoint(scope, receive, send)
        else:
            await self.other(scope, receive, send)

    async def _cached_endpoint(self, scope: Scope, receive: Any, send: Any) -> None:
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"]}
        started = time.monotonic()
        try:
            body = await _read_body(receive, headers, self.max_body)
        except RequestError as error:
            self.gateway.stats.rejected += 1
            await _send_whole(send, error.status, [(b"content-type", b"application/json"),
                                                   Outcome.BYPASS.header], error.body())
            return
        if body is None:
            return                                  # the client left before sending its body
        state = _Watch(receive)
        reply: Reply | None = None
        try:
            reply = await self.gateway.handle(
                ClientRequest(scope["path"], body, headers, on_wait=state.start))
            if reply.stream is not None:
                state.start()
            await _send_reply(send, reply, state)
        except asyncio.CancelledError:
            if not state.client_left:
                raise
            asyncio.current_task().uncancel()       # type: ignore[union-attr]  # we did it
        finally:
            state.stop()
            if reply is not None:
                reply.close()
                if reply.outcome is not None:
                    self.gateway.metrics.observe(reply.outcome, time.monotonic() - started)


class _Watch:
    """Cancels the request's task if its client disconnects before the reply is complete.

    Started only when the request has to wait or stream (``start``): an immediate answer never
    creates the watcher task.
    """

    __slots__ = ("receive", "task", "watcher", "finished", "client_left")

    def __init__(self, receive: Any) -> None:
        self.receive = receive
        # The request's task (the watch is made in it), not the first task that waits: the items
        # of a list input wait in tasks of their own, and every one of them must be cancelled.
        self.task: asyncio.Task[Any] | None = asyncio.current_task()
        self.watcher: asyncio.Task[None] | None = None
        self.finished = False
        self.client_left = False

    def start(self) -> None:
        if self.watcher is None:
            self.watcher = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        self.finished = True
        if self.watcher is not None:
            self.watcher.cancel()

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                if not self.finished and self.task is not None:
                    self.client_left = True
                    self.task.cancel()
                return


async def _read_body(receive: Any, headers: dict[str, str], limit: int) -> bytes | None:
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _send_whole(send: Any, status: int, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _send_reply(send: Any, reply: Reply, state: _Watch) -> None:
    if reply.stream is None:
        state.finished = True
        await _send_whole(send, reply.status, reply.headers, reply.body)
        return
    await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
    async for frame in reply.stream:
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    state.finished = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# ---------------------------------------------------------------------------------------------
# Everything that is not a cached endpoint


def _control_app(gateway: Gateway) -> Starlette:
    async def healthz(_: HttpRequest) -> Response:
        # Serving is what health means: a Redis outage degrades the gateway, it does not stop it.
        redis = gateway.redis_health()
        return JSONResponse({"status": "degraded" if redis["state"] == "degraded" else "ok",
                             "redis": redis})

    async def stats(_: HttpRequest) -> Response:
        return Response(orjson.dumps(gateway.snapshot()), media_type="application/json")

    async def metrics(_: HttpRequest) -> Response:
        return Response(gateway.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def dashboard(_: HttpRequest) -> Response:
        return HTMLResponse(_DASHBOARD)

    async def openapi(_: HttpRequest) -> Response:
        return Response(orjson.dumps(openapi_document()), media_type="application/json")

    async def invalidate(request: HttpRequest) -> Response:
        token = gateway.config.admin_token
        if not token:
            return _error(404, "not found", "not_found")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _error(401, "admin token required", "unauthorized")
        try:
            spec = orjson.loads(await request.body())
            dropped = await gateway.invalidate(spec)
        except (orjson.JSONDecodeError, RequestError) as error:
            return _error(400, str(error), "invalid_request")
        return JSONResponse({"invalidated": dropped})

    async def passthrough(request: HttpRequest) -> Response:
        try:
            upstream = await gateway.passthrough(
                request.method, "/" + request.path_params["path"], request.url.query.encode(),
                {k.lower(): v for k, v in request.headers.items()}, await request.body())
        except CarpoolError as error:
            return Response(error.body(), error.status, headers=error.headers())
        response = StreamingResponse(upstream.body, upstream.status)
        response.raw_headers = [h for h in upstream.headers
                                if h[0].lower() not in (b"content-length", b"transfer-encoding")]
        return response

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        gateway.start()
        # Everything built so far (modules, config, the model when semantic) lives as long as
        # the process: out of the collector's sight, a full collection no longer walks it.
        gc.freeze()
        yield
        await gateway.aclose()

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    return Starlette(routes=[
        Route("/healthz", healthz), Route("/stats", stats), Route("/metrics", metrics),
        Route("/dashboard", dashboard), Route("/admin/invalidate", invalidate, methods=["POST"]),
        Route("/openapi.json", openapi),
        Route("/v1/{path:path}", passthrough, methods=methods),
    ], lifespan=lifespan)


def _error(status: int, message: str, code: str) -> Response:
    return Response(orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                            "code": code}}), status,
                    media_type="application/json")


def create_app(gateway: Gateway | None = None) -> GatewayApp:
    return GatewayApp(gateway or Gateway())


def create_worker_app() -> GatewayApp:
    """The app of one worker process (``carpool serve --workers N``): its own gateway, built from
    the config file the parent wrote (``CARPOOL_CONFIG``)."""
    return GatewayApp(Gateway(Config.load(os.environ.get("CARPOOL_CONFIG"))))


# The live dashboard: one self-contained page (inline CSS and JS, no external resources) that
# polls /stats; a package file, read once at import.
_DASHBOARD = resources.files("carpool").joinpath("dashboard.html").read_text(encoding="utf-8")
