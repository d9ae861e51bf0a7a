"""The ASGI app: a thin adapter from HTTP to ``Gateway.handle``.

Contract:
- The cached endpoints (``carpool.apis``: chat, completions, embeddings, responses, messages)
  are served by a raw ASGI path (no framework on the hot path): read the
  body within ``limits.max_body_bytes`` (413 beyond it, and the connection is closed without
  reading the rest: it would be read with no deadline) and within
  ``limits.body_read_timeout`` seconds (408 after it, and the connection is closed: a body that
  trickles in must not hold a connection forever), hand it to the pipeline, send the ``Reply``
  (a whole one longer than a slice, ``reply.SLICE_BYTES``, in slices: the server's flow
  control then holds a slice for a client that does not read, not the whole answer).
  Pass-through and admin bodies are read under the same two limits; a pass-through body past
  ``inbound.STREAMED_FROM`` (1 MiB) goes to the upstream as it comes (``inbound.read_upload``),
  never held whole, but where routing reads it (``routing.state.reads_body``: a
  ``POST /batches``): past either limit as it goes, the call is cut (its upstream never gets
  the body whole) and the client answered 413 or 408; a client that leaves before its body's
  end takes its call with it. Its connection is watched for its leaving only from that end
  on (``_Relay`` too: an upstream may answer before it).
- Under ``carpool serve``, a small request to a cached endpoint is served below ASGI by the HTTP
  protocol (``http_protocol.py``): a byte-identical repeat whose answer is stored through
  ``answer_now``, the rest through ``serve``, which is this path's own after the body is read:
  the same reply, headers and counts as here, refusals (client keys) left to here; headers over
  ``limits.max_header_bytes`` are refused there as they arrive.
- While a request waits or streams, a watcher listens for the client going away; if it does, the
  request's task is cancelled, which releases its place in the flight (and, for the last client,
  cancels the upstream call). Not while a retry with its Idempotency-Key waits on its record
  (``ClientWatch.keep``, ``idempotency.once``): it goes on, its reply written to no one, and is
  cancelled once no retry waits, if still running. A client leaving is not an error and is not
  logged as one.
- A request still running when the server's shutdown runs out of grace (``shutdown.grace_s``) is
  cancelled by uvicorn; a cancel that is the shutdown's (the gateway is draining: ``carpool
  serve`` sets it on the signal, the HTTP protocol as uvicorn stops each worker; or uvicorn's
  own cancel message), never one of a client that left, is ended in its API's terms, not as a
  crash: a reply not begun is a 503 with ``Retry-After`` in the API's error shape
  (``ShuttingDown``, ``x-carpool: bypass``, counted in ``rejected``), a stream under way ends
  with the API's error event and its end (``[DONE]`` where it has one). Logged at INFO, without
  a traceback. What the cancel undid on its way (a flight's place, an idempotency record, a
  stream's answer not kept) is as for a client that left: nothing partial is stored; that
  cleanup runs before the lifespan closes the layers (``Gateway.settle``: ``serve`` keeps its
  task in ``Gateway.serving``). So is any other request the shutdown cuts (``_cut_unserved``):
  a pass-through call not answered yet is a 503 with ``Retry-After`` in OpenAI's error shape,
  with its ``x-request-id``; a pass-through answer being relayed has its connection cut, never
  its body ended as if whole.
- Mounted by a host app that does not forward its lifespan (Starlette's ``Mount``), the gateway
  is started by its first request (``Gateway.bind``), as by a library call; once the gateway
  is closed (the host's lifespan closed it), every ``/v1`` request is refused as one the
  shutdown cut (``ShuttingDown``, 503, ``Retry-After``), never served on closed layers; but
  another worker's (``carpool.peers``), which a closing worker serves while it settles.
- Everything else (``/healthz``, ``/readyz``, ``/stats``, ``/metrics``, ``/dashboard``,
  ``/admin/*`` and pass-through of other ``/v1/*`` paths) is a small Starlette app. Pass-through
  takes GET (HEAD), POST, PUT, PATCH, DELETE and OPTIONS (a browser's CORS preflight), on a
  cached endpoint's path too for all but POST, its only cached request; any other method is a
  405.
- A request whose handling fails (an exception nothing handled: a bug) is logged with its
  traceback and, if nothing was sent yet, answered 500 in OpenAI's error shape (a cached
  endpoint's in its API's, ``x-carpool: bypass``): ``InternalError``, never a bare
  ``Internal Server Error``; once its head is sent, it is cut. A head the server refused
  (``send`` raised) is none sent; but a server that counts its reply begun all the same
  (uvicorn: it checks a head's fields once it marked it started) takes no 500 after it: the
  connection is cut then too, the one failure logged.
- Pass-through is confined to the upstream's ``/v1``: the path is judged as it came on the wire
  (ASGI ``raw_path``) by ``paths.confine`` (dot segments, encoded separators, control characters,
  empty segments: 400; outside ``passthrough.allow``: 403) before anything is read or sent; what
  is forwarded is the upstream's base URL plus the confined relative path, and the query string
  as it came. A pass-through answer keeps its upstream's ``Content-Length``
  (``upstream.http``). A pass-through answer its upstream cuts after its head (``UpstreamAnswerCut``,
  logged by ``ReplicaSet.passthrough`` as the upstream's) is cut for its client too: its
  connection closed, never its body ended as if whole; not logged as a failure of the
  gateway's (under carpool's HTTP protocol, ``CUT``; uvicorn's own logs that a response was
  left incomplete). A pass-through client that leaves takes its call with it: before the
  answer (watched once its whole body is read, so a client waiting for the answer is not gone:
  ``ReceiveWatch``), the upstream request is cancelled; during the relay, the relay ends. However
  its relay ends (whole, cut, its client gone before or during the body), the answer is closed
  (``PassthroughResponse.aclose``): its call counted in flight no more, its connection let go. An ``Idempotency-Key`` (or ``X-Idempotency-Key``) on a
  pass-through call, whatever its method, is held to the cached endpoints' rule
  (``Gateway.passthrough``): an invalid one is their 400 (problem+json) and nothing is sent; a
  valid one is forwarded (not with a key the gateway holds) but recorded nowhere: a retry runs
  the call again, unless the upstream honours the key. Pass-through requests are in none of
  ``/stats``' request counters (``requests``, ``rejected``...): neither their answers nor the
  gateway's refusals of them (a client key refused, headers too large, a path refused, an
  invalid idempotency key), in OpenAI's error shape without ``x-carpool``; only their calls,
  in ``upstream_calls``. A cached endpoint's refusals are in ``rejected``, in its API's shape
  with ``x-carpool: bypass``: those of a POST to its path alone (``_endpoint_api``), any other
  method there being pass-through's.
- With ``admin_token`` set, ``/stats``, ``/metrics`` and ``/dashboard`` need it (401 otherwise,
  OpenAI's error shape, compared in constant time): ``Authorization: Bearer <token>``, or Basic
  with the token as the password (either scheme in any case, RFC 9110 §11.1), so that a browser asks for it and then sends it with the
  dashboard's own polls of ``/stats``. Without a token they are open, as is ``/healthz``.
  A request to ``/v1`` that presents the token (a browser sends the Basic credentials it
  was asked for at the origin's root to every path there) is a 401
  (``AdminTokenPresented``), read no further and sent nowhere: never upstream as a client's
  credential.
- With ``allowed_hosts`` (``carpool serve`` on loopback: ``localhost``), a request naming the
  gateway in ``Host`` by another name (an address always passes) is a 403 (``HostNotAllowed``),
  on every path, before anything else is read (DNS rebinding); the held path leaves it to this.
- ``/dashboard`` is served with a Content-Security-Policy that runs and applies only the page's
  own inline script and style (their SHA-256, taken at import from the bytes served), loads
  nothing, connects only to the gateway and may not be framed, with ``nosniff``,
  ``Cache-Control: no-store`` and ``Referrer-Policy: no-referrer`` (``_DASHBOARD_HEADERS``).
- In front of the embedded simulated engine (no upstreams configured), ``GET /sim/stats`` is the
  simulated replicas' own counters (``SimReplica.stats()``: ``{"simulated": true, "replicas":
  [...]}``), under the same admin-token rule as ``/stats``; in front of real upstreams it is
  not served (404).
- In front of the embedded simulated engine, every answer of a cached endpoint (hits, misses,
  joiners, streams, bypasses, errors and the gateway's own refusals) says so:
  ``x-carpool-simulated: true`` (``SIMULATED_LABEL``, the simulator's own label), once, on
  either transport (here, and ``http_protocol.py`` for what it writes itself). A ``GET`` there
  is passed through, and carries the simulator's own. In front of real upstreams nothing is
  added, and the hit path does no more work for it.
- A worker of ``--workers N`` without ``redis`` serves this app to its peers on a unix socket
  too (``carpool.peers``): only what came through it with the run's secret is a peer's. A
  peer's request is not held to ``limits.max_header_bytes`` again: the worker that passed it
  on measured the client's own headers, and the hop adds its own.
- Among the workers of ``--workers N`` without Redis, ``/metrics`` answers the run's sum and
  ``/stats`` the answering worker's document with the run's totals (``run``): the others' are
  asked through their doors, which answer for their own worker alone (``peers.metrics``), with
  every namespace it labels a ``carpool_semantic_*`` series with: the merge ranks them again.
- ``/stats`` and ``/metrics`` first bring the figures read from Redis up to date
  (``Gateway.refresh_figures``: the shared cache's counts, at most one stats interval old),
  never failing when Redis does not answer (``admin.refresh``).
- Under ``carpool serve`` (one process, or each worker: ``create_worker_app``), startup collects
  the garbage then freezes the collector (``gc.freeze``): what was built lives as long as the
  process, and full collections no longer walk it. ``create_app`` never does: a host that mounts
  it keeps its collector as it was.
- ``/healthz`` is liveness (always 200 while serving); its body says ``degraded`` when Redis is,
  or when a replica is down, and each replica's health by its public label. ``/readyz`` is 200
  while some replica is believed reachable (``ReplicaSet.ready``), 503 otherwise, while the
  gateway is draining (``gateway.draining``), and once it is closed (no probe then).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import gc
import hashlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from importlib import resources
from itertools import chain
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .admin_http import admin_routes
from .admin_http import error as admin_error
from .apis import BY_PATH, Api, api_at
from .auth import ClientKeys, presented_anywhere, presents
from .config.loader import (
    CONFIG_FILE_VARIABLE,
    PARENT_VARIABLE,
    RUN_VARIABLE,
    SIGINT_IGNORED_VARIABLE,
    load_resolved,
)
from .draining import grace_cut_at_info
from .errors import (
    AdminRequired,
    AdminTokenPresented,
    BodyNotForwarded,
    CarpoolError,
    ClientKeyRefused,
    HeadersTooLarge,
    HostNotAllowed,
    InternalError,
    RequestError,
    ShuttingDown,
    UpstreamError,
)
from .inbound import ClientWatch, Deadlines, ReceiveWatch, Upload, read_body, read_upload
from .logs import configure as configure_logging
from .metrics import COUNTED, COUNTED_ELSEWHERE, Counted
from .openapi import document as openapi_document
from .outcome import Outcome
from .paths import confine
from .peers import PEER, PEERS_VARIABLE, Peers, claim, meeting
from .peers.metrics import merge, run_totals
from .pipeline import Gateway, Reply
from .reply import SLICE_BYTES, refusal
from .request import ENDPOINTS, TEXT_HEADERS, ClientRequest, header_text
from .request_id import CURRENT as REQUEST_ID
from .request_id import HEADER, UPSTREAM_HEADER, request_id
from .routing.state import reads_body
from .upstream.base import PassthroughResponse
from .wiring import build_gateway

log = logging.getLogger("carpool.server")


Scope = dict[str, Any]

# What the embedded simulated engine's answers carry through the gateway (the engine's own label,
# ``upstream.sim.replies.SIMULATED_HEADER``): see the module contract.
SIMULATED_LABEL = (b"x-carpool-simulated", b"true")


class GatewayApp:
    """The gateway's ASGI application."""

    def __init__(
        self, gateway: Gateway, *, freeze_gc: bool = False, grace_s: float | None = None
    ) -> None:
        self.gateway = gateway
        self.freeze_gc = freeze_gc  # ``carpool serve``'s own process only (see the contract)
        # A server that does not say when its shutdown began (``Gateway.stop_by``: uvicorn's
        # own, as each worker of ``--workers N`` runs): its grace period, counted from the
        # lifespan's end, where nothing of its own connections' says otherwise.
        self.grace_s = grace_s
        self.max_body = gateway.config.limits.max_body_bytes
        self.max_headers = gateway.config.limits.max_header_bytes
        self.deadlines = Deadlines(gateway.config.limits.body_read_timeout)
        # (kept by the HTTP protocol: a client reading nothing of its reply, ``http_protocol.py``)
        self.send_timeout = gateway.config.limits.send_timeout
        self.allow = gateway.config.passthrough.allow
        # In front of the embedded simulated engine: its answers are labelled (module contract).
        self.simulated = bool(simulated_replicas(gateway))
        self.other = _control_app(gateway, self.deadlines, self)
        keys_file = gateway.config.auth.client_keys_file
        self.client_keys = ClientKeys.load(keys_file) if keys_file else None
        self.admin_token = gateway.config.admin_token or None
        allowed = gateway.config.allowed_hosts
        self.allowed_hosts = None if allowed is None or "*" in allowed else frozenset(allowed)

    def _host_refused(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request names the gateway by a host name ``allowed_hosts`` does not hold."""
        if self.allowed_hosts is None:
            return False
        for name, value in headers:
            if name == b"host":
                return not _host_allowed(value, self.allowed_hosts)
        return False  # (HTTP/1.0's, or a peer's own hop)

    def _admin_token_in(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request presents the admin token as its credential (refused on /v1)."""
        return self.admin_token is not None and presented_anywhere(self.admin_token, headers)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.other(scope, receive, send)
            return
        if scope.get("root_path"):  # (mounted by a host app, or served under a prefix)
            scope = _below(scope, scope["root_path"])
        if not self.gateway.started and not self.gateway.closed:
            # Mounted by a host app that does not forward its lifespan (Starlette's ``Mount``):
            # never started, its invalidations never listened to. Started by its first request,
            # as by a library call. (Closed: refused, ``_route``.)
            self.gateway.bind()
        # Every response says which request it answers (``request_id``), as its log lines do.
        rid = scope[RID] = request_id(scope["headers"])
        REQUEST_ID.set(rid.decode("ascii"))
        headed = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal headed
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, rid)]
                await send(message)
                headed = True  # (only once taken: a head the server refused, a 500 may follow)
                return
            await send(message)

        cached = scope["method"] == "POST" and _cached_path(scope["path"])
        respond = _labelled(send_with_id) if self.simulated and cached else send_with_id
        try:
            await self._route(scope, receive, respond)
        except asyncio.CancelledError as cancel:
            # The shutdown's cancel of a request ``serve`` does not end itself (pass-through, a
            # body still being read...): uvicorn made it a bare text/plain 500 with a traceback.
            if not self._stopping(cancel):
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # (in a task here)
            await self._cut_unserved(scope, respond, headed, cached)
        except Exception:  # (a bug: said in the log, and to the client in its API's terms)
            log.exception("a request failed (500)")
            if not headed:
                error, api = InternalError(), api_at(scope["path"])
                try:
                    await _send_whole(
                        respond,
                        error.status,
                        [*_raw(error.headers()), *([Outcome.BYPASS.header] if cached else [])],
                        api.error_body(error) if api is not None and cached else error.body(),
                    )
                except RuntimeError:
                    # The server refused a head and counts its reply begun all the same
                    # (uvicorn checks a head's fields once it marked it started), so it takes
                    # no other: the client's connection is cut, as for a reply failed once
                    # begun. What failed is logged above; this is no second failure.
                    pass

    async def _route(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.gateway.closed and scope["path"].startswith("/v1/") and scope.get(PEER) is not True:
            # Closed by a host app's lifespan, the app still mounted: refused as a request the
            # shutdown cut is, never served on closed layers (an upstream pool opened again,
            # nothing to close it). Not another worker's (``carpool.peers``): a worker closing
            # under ``serve --workers`` settles its calls first, and its peers' requests for
            # the keys it owns are served meanwhile (refused, the 503 reached their clients).
            await self._refuse(send, ShuttingDown(CLOSED), _endpoint_api(scope))
            return
        if scope.get(PEER) is not True and self._host_refused(scope["headers"]):
            # A name that is not this gateway's: a web page's own, made to resolve here (DNS
            # rebinding), reading /stats or calling /v1 from the operator's browser. Sent
            # nowhere, whatever the path.
            await self._refuse(send, HostNotAllowed(), _endpoint_api(scope))
            return
        if (
            self.client_keys is not None
            and scope["path"].startswith("/v1/")
            and not self.client_keys.accepts(scope["headers"])
        ):
            # Before anything is read, cached, shared or sent upstream (``auth.py``); in the
            # API's error shape, and ``bypass`` on a cached endpoint, as every refusal there.
            # Counted in ``rejected`` there only, as the 431 below (and ``http_protocol``'s):
            # pass-through is in none of ``/stats``' request counters, its answers and the
            # gateway's refusals alike (the module doc).
            await self._refuse(send, ClientKeyRefused(), _endpoint_api(scope))
            return
        if (
            scope["path"].startswith("/v1/")
            and scope.get(PEER) is not True
            and self._admin_token_in(scope["headers"])
        ):
            # A browser that opened /dashboard sends its Basic credentials (the token) to
            # every path of the origin: never upstream, as a client's credential would go.
            await self._refuse(send, AdminTokenPresented(), _endpoint_api(scope))
            return
        if (
            scope["type"] == "http"
            and _header_bytes(scope["headers"]) > self.max_headers
            and scope.get(PEER) is not True
        ):
            # Checked here too: under uvicorn's own protocol nothing else does (carpool's refuses
            # them as they arrive: ``http_protocol.py``), and they go upstream.
            # Not a peer's (``carpool.peers``): its worker measured the client's own headers,
            # and the hop's own (its host, accept, accept-encoding) are not the client's.
            await self._refuse(send, HeadersTooLarge(self.max_headers), _endpoint_api(scope))
        elif scope["type"] == "http" and scope["method"] == "POST" and _cached_path(scope["path"]):
            # ``/v1/chat/completions/`` is the same endpoint: never around the cache's rules.
            await self._cached_endpoint(scope, receive, send, scope["path"].rstrip("/"))
        elif scope["type"] == "http" and scope["path"].startswith("/v1/"):
            # Judged here, before routing: a decoded path the router would not match (a
            # newline in it) still gets the 400 in OpenAI's shape, not a bare 404.
            try:
                # Kept in the scope for the pass-through route: judged once.
                scope[CONFINED] = _passthrough_path(scope, self.allow)
            except RequestError as error:
                await _send_whole(send, error.status, _raw(error.headers()), error.body())
                return
            await self.other(scope, receive, send)
        else:
            await self.other(scope, receive, send)

    def held_request(
        self, path: str, raw_headers: list[tuple[bytes, bytes]], query: bytes, body: bytes
    ) -> ClientRequest | None:
        """A request to a cached endpoint whose whole body the HTTP protocol (``http_protocol.py``)
        holds, for ``answer_now`` and ``serve``; None: it takes the ASGI path (``__call__``),
        where it is refused (client keys, the admin token). Its headers are within
        ``limits.max_header_bytes``: the protocol refuses them as they arrive."""
        if self.client_keys is not None and not self.client_keys.accepts(raw_headers):
            return None
        if self._admin_token_in(raw_headers) or self._host_refused(raw_headers):
            return None  # (refused there too)
        return ClientRequest(path, body, _decoded(raw_headers), query)

    def answer_now(self, client: ClientRequest) -> Reply | None:
        """The reply to a held request (``held_request``) that is a byte-identical repeat of one
        whose answer is stored (``Gateway.repeat_now``), counted as ``serve`` counts it: for the
        HTTP protocol, which sends it before it makes a task for the request. None: ``serve``."""
        started = time.monotonic()
        reply = self.gateway.repeat_now(client)
        if reply is not None:
            self.gateway.observe(reply, time.monotonic() - started)
        return reply

    async def _cached_endpoint(self, scope: Scope, receive: Any, send: Any, path: str) -> None:
        headers = _decoded(scope["headers"])
        started = time.monotonic()
        try:
            body = await read_body(receive, headers, self.max_body, self.deadlines)
        except RequestError as error:
            self.gateway.stats.rejected += 1
            await _send_whole(
                send,
                error.status,
                [*_raw(error.headers()), Outcome.BYPASS.header],
                BY_PATH[path].error_body(error),
            )  # (the API's error shape)
            return
        if body is None:  # the client left before sending its body
            if scope.get(PEER) is not True:  # (a peer's: counted where it came from)
                self.gateway.stats.abandoned += 1  # (it was counted nowhere: requests too)
            return
        client = ClientRequest(
            path,
            body,
            headers,
            scope.get("query_string", b""),
            peer=scope.get(PEER) is True,  # (set by the peers' door only)
        )
        del body  # (the client's to hold: ``Gateway.handle`` lets it go once parsed)
        await self.serve(client, ReceiveWatch(receive), partial(_send_reply, send), started)

    async def serve(
        self, client: ClientRequest, watch: ClientWatch, respond: Respond, started: float
    ) -> None:
        """A cached endpoint's request with its whole body, from ``Gateway.handle`` to its reply
        sent by ``respond``: the ASGI path's (``_send_reply``) or the HTTP protocol's for a
        request it held. ``watch`` (made in this task) cancels it if its client leaves while it
        waits or streams."""
        client.on_wait = watch.start
        client.keep = watch.keep
        counted = Counted()  # (``Stats.count`` fills it in: this request's, in its task's context)
        COUNTED.set(counted)
        COUNTED_ELSEWHERE.set(client.peer)  # (a peer's: counted where it came from, but keyed)
        reply: Reply | None = None
        task = asyncio.current_task()
        if task is not None:  # (``Gateway.settle`` lets it end, cut, before the layers close)
            self.gateway.serving.add(task)
        try:
            reply = await self.gateway.handle(client)
            if reply.stream is not None:
                watch.start()
            await respond(reply, watch)
        except asyncio.CancelledError as cancel:
            if watch.client_left:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # (in a task here)
                if not counted.done and not client.peer:  # (left before any outcome was counted:
                    self.gateway.stats.abandoned += 1  # its keyed request's record may settle)
            elif self._stopping(cancel):
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # (in a task here)
                await self._cut(client, watch, respond)
            else:
                raise
        finally:
            self.gateway.serving.discard(task)
            watch.stop()
            if reply is not None:
                reply.close()
                self.gateway.observe(reply, time.monotonic() - started)
            else:  # (cancelled once counted, as its record was kept: timed under its outcome)
                self.gateway.observe_unanswered(counted, time.monotonic() - started)

    async def _cut_unserved(self, scope: Scope, send: Any, headed: bool, cached: bool) -> None:
        """Ends a request other than ``serve``'s that the server's shutdown cut (``_stopping``),
        as ``_cut`` ends one of ``serve``'s: not answered yet (a pass-through call waiting on
        its upstream, a body still coming), a 503 with ``Retry-After`` in its API's error shape
        (a cached endpoint's with ``x-carpool: bypass``, counted in ``rejected``; pass-through
        in OpenAI's, in no request counter); an answer being relayed (a pass-through stream),
        its connection cut (``CUT``), never its body ended as if whole. Logged without a
        traceback: nothing failed."""
        if not headed:
            log.info("shutting down: a request still waiting was cut (503, Retry-After)")
            await self._refuse(send, ShuttingDown(), api_at(scope["path"]) if cached else None)
            return
        log.info("shutting down: an answer still being relayed was cut (its connection closed)")
        cut = scope.get(CUT)
        if cut is not None:
            cut()  # (else the server closes it, the response left incomplete)

    async def _refuse(self, send: Any, error: CarpoolError, api: Api | None) -> None:
        """The gateway's own refusal of a request it served nothing of: on a cached endpoint
        (``api``), in that API's error shape with ``x-carpool: bypass``, counted in
        ``rejected``; elsewhere (pass-through) in OpenAI's, in no request counter."""
        if api is not None:
            self.gateway.stats.rejected += 1
        await _send_whole(
            send,
            error.status,
            [*_raw(error.headers()), *([Outcome.BYPASS.header] if api is not None else [])],
            api.error_body(error) if api is not None else error.body(),
        )

    def _stopping(self, cancel: asyncio.CancelledError) -> bool:
        """Whether ``cancel`` is the server's shutdown cutting the request (its grace period
        over), not a client that left (told by its watch, and seen first): the gateway is
        draining (``carpool serve`` sets it on the signal, each worker's protocol when uvicorn
        stops it: ``http_protocol.py``), or the cancel is uvicorn's own (another host)."""
        return self.gateway.draining or cancel.args == (_GRACE_OVER,)

    async def _cut(self, client: ClientRequest, watch: ClientWatch, respond: Respond) -> None:
        """Ends a request the server's shutdown cut (``_stopping``) as its API ends a failure,
        not as a crash: a reply not started yet is a 503 with ``Retry-After`` in its API's error
        shape (``x-carpool: bypass``: the gateway's own refusal); a stream under way ends with its
        API's error event, then its end (``[DONE]`` where the API has one); a whole reply whose
        head went out already (its client not reading) is left as it is. Logged without a
        traceback: nothing failed. What the cancel undid on its way here (the flight's place,
        an idempotency record) stays undone, as for a client that left."""
        api, error = BY_PATH[client.path], ShuttingDown()
        if not watch.headed:
            log.info("shutting down: a request still waiting was cut (503, Retry-After)")
            counted = COUNTED.get()
            if (counted is None or not counted.done) and not client.peer:
                self.gateway.stats.rejected += 1  # (a refusal's count: no outcome was given)
            await respond(refusal(error, api), watch)
        elif not watch.finished:
            log.info("shutting down: a stream still running was cut (it ends with an error)")
            await respond(
                # (How many events went out is not known here: none numbered.)
                Reply(200, [], stream=_Last(api.error_event(error, None) + api.stream_end)),
                watch,
            )
        else:
            log.info("shutting down: a reply still being sent was cut")


# The message of uvicorn's cancel of a request still running when its graceful shutdown's time
# (``timeout_graceful_shutdown``: ``shutdown.grace_s``) is over.
_GRACE_OVER = "Task cancelled, timeout graceful shutdown exceeded"


class _Last:
    """What is left to send of a stream under way: one last piece (``exchange.Relay.ended``)."""

    __slots__ = ("piece", "ended")

    def __init__(self, piece: bytes) -> None:
        self.piece, self.ended = piece, False

    def __aiter__(self) -> _Last:
        return self

    async def __anext__(self) -> bytes:
        if self.ended:
            raise StopAsyncIteration
        self.ended = True
        return self.piece


def _document(text: str) -> dict[str, Any] | None:
    """A worker's ``/stats`` document, or None if it is none (never a 500 for the run's)."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


# How a reply is sent: ``_send_reply`` (ASGI) or the HTTP protocol's own writes.
Respond = Callable[[Reply, ClientWatch], Awaitable[None]]


# The scope key of a pass-through request's confined path (relative to /v1).
CONFINED = "carpool.confined_path"
# The scope key of what cuts the request's connection, its response begun and not to be ended
# (``_Relay``): set by carpool's HTTP protocol (``http_protocol.py``), which then writes
# nothing more and logs nothing of it. Under another server it is absent: the response is left
# incomplete, and the server closes the connection (uvicorn's own with an error line).
CUT = "carpool.cut_connection"
# The scope key of the request's id (``request_id``), for what carpool's HTTP protocol logs of
# it outside its task (a client cut for reading nothing: ``limits.send_timeout``).
RID = "carpool.request_id"


class _Relay(StreamingResponse):
    """A pass-through answer relayed as it comes. Cut by its upstream part-way (its body
    raising an ``UpstreamError``, which ``ReplicaSet.passthrough`` logged), its client's
    connection is cut too: never ended as if whole (chunked, a short body would read as the
    whole answer), nor taken for the gateway's own failure. However the relay ends (whole,
    cut, its client gone before or during the body), the answer is closed: its replica's count
    of calls in flight goes back down, its connection is let go."""

    def __init__(
        self, answer: PassthroughResponse, cut: Any, uploaded: asyncio.Event | None = None
    ) -> None:
        super().__init__(answer.body, answer.status)
        self.answer = answer
        self.cut: Callable[[], None] | None = cut
        self.uploaded = uploaded

    async def listen_for_disconnect(self, receive: Any) -> None:
        # (Its request's body still going to the upstream, ``inbound.Upload`` reads the
        # connection until its end: Starlette's listener would take, and drop, its pieces.)
        if self.uploaded is not None:
            await self.uploaded.wait()
        await super().listen_for_disconnect(receive)

    async def stream_response(self, send: Any) -> None:  # (Starlette's, but for a cut)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            try:
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError:
                if self.cut is not None:
                    self.cut()
                return  # (left incomplete: the server closes the connection)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.answer.aclose()


def _below(scope: Scope, root: str) -> Scope:
    """``scope`` as if the app were served at the root, for a request under ``root`` (its
    ``root_path``: a host app's ``Mount``, a server's ``--root-path``; ASGI keeps it in
    ``path``, so every /v1 request fell through to the pass-through route, a 500). Its raw path
    loses the prefix too (when the server kept it there), so the pass-through judges the rest as
    sent (``_passthrough_path``); a request not below ``root`` is left as it is."""
    path = scope["path"]
    if not path.startswith(root) or path[len(root) : len(root) + 1] not in ("", "/"):
        return scope
    raw = scope.get("raw_path")
    if raw is not None:
        # (Segment by segment: the raw path holds the prefix as sent, percent-encoded.)
        parts, segments = raw.split(b"/"), root.split("/")
        if len(parts) >= len(segments) and all(
            unquote_to_bytes(part) == segment.encode("utf-8")
            for part, segment in zip(parts[1 : len(segments)], segments[1:], strict=True)
        ):
            raw = b"/" + b"/".join(parts[len(segments) :])
    return {**scope, "path": path[len(root) :] or "/", "raw_path": raw, "root_path": ""}


def _passthrough_path(scope: Scope, allow: list[str]) -> str:
    """The confined path relative to /v1 (``paths.confine``), judged on the path as sent, not
    as decoded: "%2e%2e" and "%2f" must be seen for what they are."""
    return confine(scope.get("raw_path") or scope["path"].encode("utf-8"), allow)


CLOSED = "The gateway is closed and serves no more requests. Retry it."


def _endpoint_api(scope: Scope) -> Api | None:
    """The cached endpoint whose request this is (its refusals in its API's shape, with
    ``x-carpool: bypass``, counted in ``rejected``): a POST to its path, the only request
    there it caches; any other method on that path is pass-through's."""
    return api_at(scope["path"]) if scope["method"] == "POST" else None


def _cached_path(path: str) -> bool:
    """A cached endpoint's path (``/v1/chat/completions/`` too: ``_route``); one character
    more of any other kind (``/v1/chat/completionsX``) is another path, passed through."""
    return path in ENDPOINTS or (path[-1:] == "/" and path[:-1] in ENDPOINTS)


def _labelled(send: Any) -> Any:
    """``send``, with the simulator's label on the response's head (``SIMULATED_LABEL``)."""

    async def labelled(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), SIMULATED_LABEL]
        await send(message)

    return labelled


def _header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    return sum(map(len, chain.from_iterable(headers)))


# The methods whose body a pass-through call never forwards (``BodyNotForwarded``).
BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _announces_body(headers: Mapping[str, str]) -> bool:
    """Whether a request's head says a body follows: a ``Transfer-Encoding`` (its chunks may
    be none, but a server that reads no body would read them as a request), or a
    ``Content-Length`` other than 0 (the parser took it as a number)."""
    if "transfer-encoding" in headers:
        return True
    try:
        return int(headers.get("content-length", "0")) > 0
    except ValueError:
        return True


def _decoded(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI headers as ``ClientRequest`` takes them: lower-case names (as ASGI gives them).

    A header sent on several lines is one value, its lines joined by ", " (RFC 9110 §5.3):
    ``Cache-Control: no-cache`` beside ``Cache-Control: max-age=60`` is both directives, not
    the last one; a ``Cookie``'s by "; " (RFC 9113 §8.2.3: its cookies, as one line lists
    them). Values are their bytes a character each (latin-1), but the control headers that
    carry names: the UTF-8 text their bytes spell (``request.header_text``)."""
    decoded = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
    if len(decoded) != len(headers):
        joined: dict[str, list[str]] = {}
        for name, value in headers:
            joined.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))
        decoded = {
            name: ("; " if name == "cookie" else ", ").join(values)
            for name, values in joined.items()
        }
    for header in TEXT_HEADERS:
        read = decoded.get(header)
        if read is not None:
            decoded[header] = header_text(read)
    return decoded


def _raw(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def _send_whole(
    send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_reply(send: Any, reply: Reply, state: ClientWatch) -> None:
    """``reply`` as ASGI messages: whole, or its stream's frames as they come; once its head is
    sent (``state.headed``), a stream is the rest of it (``GatewayApp._cut``)."""
    if reply.stream is None:
        state.finished = True
        size = reply.size
        head = [*reply.headers, (b"content-length", str(size).encode())]
        await send({"type": "http.response.start", "status": reply.status, "headers": head})
        state.headed = True
        if size <= SLICE_BYTES:
            await send({"type": "http.response.body", "body": reply.body})
            return
        # A long one a slice at a time (``Reply.slices``): the server writes each once the
        # client took the last (uvicorn's flow control), so a client that does not read holds
        # a slice, not a copy of the whole answer. (ASGI's body is bytes: each slice a copy.)
        for piece in reply.slices():
            await send({"type": "http.response.body", "body": bytes(piece), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if not state.headed:
        await send(
            {"type": "http.response.start", "status": reply.status, "headers": reply.headers}
        )
        state.headed = True
    stream = reply.stream
    async for frame in stream:
        # The last piece (``exchange.Relay.ended``): the body ends with it.
        if getattr(stream, "ended", False):
            state.finished = True
            await send({"type": "http.response.body", "body": frame, "more_body": False})
            return
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    state.finished = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# ---------------------------------------------------------------------------------------------
# Everything that is not a cached endpoint


def _control_app(gateway: Gateway, deadlines: Deadlines, app: GatewayApp) -> Starlette:
    limits = gateway.config.limits

    async def body_of(request: HttpRequest) -> bytes | None:
        return await read_body(request.receive, request.headers, limits.max_body_bytes, deadlines)

    async def healthz(_: HttpRequest) -> Response:
        # Serving is what health means: a Redis outage or a dead replica degrades the gateway,
        # it does not stop it (readiness is /readyz). Open to all, whatever the admin token:
        # Redis's state, not its layers' traffic counters (/stats has them).
        redis = gateway.redis_state()
        replicas = gateway.replicas.health()
        degraded = redis["state"] == "degraded" or not all(r["healthy"] for r in replicas.values())
        return JSONResponse(
            {"status": "degraded" if degraded else "ok", "replicas": replicas, "redis": redis}
        )

    async def readyz(_: HttpRequest) -> Response:
        # ``draining``: for whoever stops the gateway gracefully (CONTRACT: 503 while draining).
        # (Closed: a host app's lifespan closed it, the app still mounted. Not probed: its
        # upstream connections are closed, and nothing would close one opened again.)
        ready = (
            not gateway.draining
            and not gateway.closed
            and await gateway.replicas.ready(gateway.config.routing.ready_timeout_s)
        )
        return JSONResponse(
            {"ready": ready, "replicas": gateway.replicas.health()}, 200 if ready else 503
        )

    async def stats(request: HttpRequest) -> Response:
        if (refusal := _admin_refusal(gateway, request)) is not None:
            return refusal
        await gateway.refresh_figures()
        doc, peers = gateway.snapshot(), gateway.layers.peers
        if peers is not None and request.scope.get(PEER) is not True:
            # This worker's document, and the run's figures (``peers.metrics.run_totals``).
            others = [_document(text) for text in await peers.stats()]
            doc["run"] = run_totals([doc, *(o for o in others if o is not None)])
        return Response(orjson.dumps(doc), media_type="application/json", headers=NOT_KEPT)

    sim_replicas = simulated_replicas(gateway)

    async def sim_stats(request: HttpRequest) -> Response:
        if (refusal := _admin_refusal(gateway, request)) is not None:
            return refusal
        doc: dict[str, Any] = {
            "simulated": True,
            "replicas": [replica.stats() for replica in sim_replicas],
        }
        peers = gateway.layers.peers
        if peers is not None and request.scope.get(PEER) is not True:
            # Each worker runs its own engine: ``run`` has every worker's replicas, as
            # ``/stats``' ``run`` its figures (a reader lands on any worker).
            docs = [doc, *(d for d in map(_document, await peers.sim_stats()) if d is not None)]
            replicas = [
                r for d in docs if isinstance(d.get("replicas"), list) for r in d["replicas"]
            ]
            doc["run"] = {"workers": len(docs), "replicas": replicas}
        return Response(orjson.dumps(doc), media_type="application/json", headers=NOT_KEPT)

    async def metrics(request: HttpRequest) -> Response:
        if (refusal := _admin_refusal(gateway, request)) is not None:
            return refusal
        await gateway.refresh_figures()
        peers = gateway.layers.peers
        # Among workers every namespace, for the merge to rank over the run's sums: a worker's
        # own top ones would sum to up to N x METRIC_NAMESPACES, each a part of its count.
        text = gateway.metrics.render(every_namespace=peers is not None)
        if peers is not None and request.scope.get(PEER) is not True:
            # One port for the run: the sum of the workers', or the counters went down between
            # two scrapes landing on different workers (``peers.metrics``).
            text = merge([text.decode(), *await peers.metrics()])
        return Response(
            text, media_type="text/plain; version=0.0.4; charset=utf-8", headers=NOT_KEPT
        )

    async def dashboard(request: HttpRequest) -> Response:
        if (refusal := _admin_refusal(gateway, request)) is not None:
            return refusal
        return HTMLResponse(_DASHBOARD, headers=_DASHBOARD_HEADERS)

    async def openapi(_: HttpRequest) -> Response:
        return Response(orjson.dumps(openapi_document()), media_type="application/json")

    async def passthrough(request: HttpRequest) -> Response:
        """Any other ``/v1/...`` call, relayed (``Gateway.passthrough``); the gateway's own
        refusals of it (an invalid idempotency key among them) in their error's shape."""
        scope = request.scope
        try:
            path = scope[CONFINED]  # judged by GatewayApp before routing
            headers = _decoded(scope["headers"])  # (a header's repeated lines, joined)
            # Watched once its whole body is read (waiting for the answer is no leaving): a
            # client gone before its answer takes its call with it, as a cached endpoint's last
            # client does, or the call held its upstream and its replica's slot until the
            # upstream answered or ``limits.upstream_timeout`` passed, and a shutdown's drain
            # waited for it. Once the answer is relayed, the relay sees its client go
            # (``_Relay``).
            if request.method in BODILESS_METHODS and _announces_body(headers):
                raise BodyNotForwarded(request.method)
            watch = ReceiveWatch(request.receive)
            body: bytes | Upload | None
            if reads_body(request.method, path):  # (routing reads it: whole, never large)
                body = await body_of(request)
            else:
                # A large body (a file's) goes on as it comes (``inbound.read_upload``), its
                # client watched from its end on, and gone before it, its call cancelled.
                body = await read_upload(
                    request.receive,
                    request.headers,
                    limits.max_body_bytes,
                    deadlines,
                    ended=watch.start,
                    left=watch.went,
                )
            if body is None:
                return Response(status_code=499)  # the client left
            if isinstance(body, bytes):
                watch.start()
            try:
                upstream = await gateway.passthrough(
                    request.method, path, scope.get("query_string", b""), headers, body
                )
            except asyncio.CancelledError:
                if not watch.client_left:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # (in a task here)
                return Response(status_code=499)  # (written to no one: the client left)
            finally:
                watch.stop()
        except CarpoolError as error:
            return _carpool_error(error)
        # (An upload the upstream answered before its end goes on: the relay reads nothing of
        # its client's connection before it ends, which would take the pieces still to come.)
        response = _Relay(upstream, scope.get(CUT), body.done if isinstance(body, Upload) else None)
        # One x-request-id per response, the gateway's: the upstream's own is kept under
        # another name (the only answers whose headers the gateway did not write). Its
        # ``Content-Length`` stays (``upstream.http``: the bytes go out as they came); a body
        # cut short of it still cuts the client's connection (``_Relay``).
        response.raw_headers = [
            (UPSTREAM_HEADER, value) if name.lower() == HEADER else (name, value)
            for name, value in upstream.headers
            if name.lower() != b"transfer-encoding"
        ]
        return response

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        gateway.start()
        if gateway.layers.peers is not None:  # (a worker: its peers' door opens with it)
            await gateway.layers.peers.listen(app)
        if app.freeze_gc:
            # Everything built so far (modules, config, the model when semantic) lives as long
            # as the process: out of the collector's sight, a full collection no longer walks
            # it. Garbage first, or its cycles would be frozen with it, never to be freed.
            gc.collect()
            gc.freeze()
        yield
        # The drain begun here too, not only by carpool's own connections as they close: a
        # worker that has none open still holds its peers' requests (``carpool.peers``), a
        # batch of them waiting out its delay, cut at the grace's end.
        gateway.begin_draining()
        if app.grace_s is not None and gateway.stop_by is None:
            gateway.stop_by = time.monotonic() + app.grace_s
        await gateway.aclose()

    async def failed(_: HttpRequest, __: Exception) -> Response:
        # Starlette's own would be a bare text 500; the exception goes on to ``GatewayApp``,
        # which logs it.
        return _carpool_error(InternalError())

    # OPTIONS too: a browser's CORS preflight, which an engine started with --allowed-origins
    # answers (on a cached endpoint's path as well: a preflight is no cached request).
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    routed = Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/stats", stats),
            *([Route("/sim/stats", sim_stats)] if sim_replicas else []),
            Route("/metrics", metrics),
            Route("/dashboard", dashboard),
            *admin_routes(gateway, body_of),
            Route("/openapi.json", openapi),
            Route("/v1/{path:path}", passthrough, methods=methods),
        ],
        lifespan=lifespan,
        exception_handlers={404: _not_served, 405: _not_served, Exception: failed},
    )
    # ``POST /v1`` is no endpoint: a 404, not a redirect to ``/v1/`` whose ``Location`` the
    # router would build from the client's own ``Host`` header.
    routed.router.redirect_slashes = False
    return routed


async def _not_served(request: HttpRequest, exc: Exception) -> Response:
    """A path or method no route serves: 404 or 405 (with ``Allow``) in OpenAI's error shape,
    as every other error of the gateway's own (Starlette's default is plain text)."""
    status = getattr(exc, "status_code", 404)
    headers = getattr(exc, "headers", None) or {}
    if status == 405:
        response = admin_error(405, f"use {headers.get('Allow', '')}", "method_not_allowed")
        if "Allow" in headers:
            response.headers["allow"] = headers["Allow"]
        return response
    return admin_error(404, "not found", "not_found")


def simulated_replicas(gateway: Gateway) -> list[Any]:
    """The embedded simulated engine's replicas (``SimReplica``) the gateway fronts; empty in
    front of real upstreams (or of upstreams given to ``build_gateway`` that are not it)."""
    if gateway.config.upstreams:
        return []
    from .upstream.sim import SimUpstream

    return [u.replica for u in gateway.upstreams if isinstance(u, SimUpstream)]


def _carpool_error(error: CarpoolError) -> Response:
    return Response(error.body(), error.status, headers=error.headers())


@functools.lru_cache(maxsize=64)  # (a few values: the names clients call the gateway by)
def _host_allowed(value: bytes, allowed: frozenset[str]) -> bool:
    """Whether a ``Host`` value names the gateway by an address (always) or by a name in
    ``allowed`` (lower case, its port and a final dot taken off)."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):  # (an IPv6 address, its zone if any left out)
        literal = host[1:].partition("]")[0].partition("%")[0]
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(literal).version == 6
        return False
    name = host.partition(":")[0].rstrip(".")
    if not name or name.replace(".", "").isdigit():  # (no name: 127.1 is an address too)
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name in allowed
    return True


# The operator's documents (/stats, /metrics, /admin/*) and their refusals: a shared cache that
# keeps an answer without a directive for a default time (Varnish: 120 s) would serve one
# operator's figures, stale, to the next (with a token, RFC 9111 3.5 keeps it off already).
# And never read as another type: they carry names clients chose (a namespace "<script>...").
NOT_KEPT = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def _admin_refusal(gateway: Gateway, request: HttpRequest) -> Response | None:
    """None when the request may see the admin surfaces (no token configured, or it presents
    it); else the 401, with challenges for API clients (Bearer) and for browsers (Basic)."""
    token = gateway.config.admin_token
    if not token:
        return None
    if presents(token, request.headers.get("authorization", ""), basic=True):
        return None
    refusal = _carpool_error(
        AdminRequired("this needs the admin token: Authorization: Bearer <admin token>")
    )
    refusal.raw_headers += [
        (b"www-authenticate", b'Basic realm="carpool admin", charset="UTF-8"'),
        (b"cache-control", b"no-store"),
    ]
    return refusal


def create_app(gateway: Gateway | None = None) -> GatewayApp:
    """The gateway's ASGI app, for any server or host app to mount (the host's process is left
    as it is: its garbage collector is not frozen, unlike under ``carpool serve``)."""
    return GatewayApp(gateway or build_gateway())


def create_worker_app() -> GatewayApp:
    """The app of one worker process (``carpool serve --workers N``): its own gateway, built from
    the config file the parent wrote in the run's directory (``CARPOOL_CONFIG``); it stops once that parent is gone
    (``_leave_with_parent``). Without ``redis``, the worker takes
    a slot among its peers (``carpool.peers``, in the directory ``CARPOOL_PEERS`` names), or,
    every slot held, asks their owners until one frees (``Peers``). The file is the config
    the parent resolved (flags over ``CARPOOL_*`` over its file), written so that it reads back
    as exactly that config (``config.loader.resolved_text``; the parent checked that it does
    before starting any worker): read alone, not under the environment again (a variable beat
    a flag in every worker), its held keys as they were resolved (``load_resolved``: a key that
    looks like ``${OTHER}`` is not read from the environment a second time)."""
    config = load_resolved(os.environ.get(CONFIG_FILE_VARIABLE))
    configure_logging(config.log_level, config.log_format)  # (a fresh process: as its parent)
    grace_cut_at_info()  # (uvicorn's own server stops this worker: its cut at INFO too)
    _leave_with_parent(os.environ.get(PARENT_VARIABLE))
    _health_checks_answered_by_the_loop()
    _sigint_left_to_the_supervisor()
    directory = os.environ.get(PEERS_VARIABLE)
    peers = None
    if directory and not config.redis:
        slot = claim(Path(directory), config.workers)
        if slot is None:
            # uvicorn's SIGHUP starts each new worker while the old one holds its slot; SIGTTIN
            # adds one beyond N: a client of the owners meanwhile, it takes the first to free.
            log.info("every worker slot is held: this worker asks their owners until one frees")
        peers = Peers(slot or meeting(Path(directory), config.workers), config)
    return GatewayApp(
        build_gateway(config, peers=peers), freeze_gc=True, grace_s=config.shutdown.grace_s
    )


def _sigint_left_to_the_supervisor() -> None:
    """A Ctrl-C reaches every process of the group: each worker had the terminal's SIGINT and
    its supervisor's SIGTERM, and a second Ctrl-C was uvicorn's force quit in every worker (the
    requests in progress cut without an answer, the lifespan skipped: a Redis idempotency record
    left processing until its lease ran out). The supervisor stops its workers on a SIGINT (with
    a SIGTERM each, then kills one still running past the grace period): a worker only says it
    saw one, or ignores it where its supervisor does, and unblocks it (it starts blocked). (Called
    as uvicorn builds the app, inside its server's capture of the signals, which puts its own
    handler back as the worker ends.)"""
    if threading.current_thread() is not threading.main_thread():
        return  # (signals are handled on the main thread only)

    def said(signum: int, frame: FrameType | None) -> None:
        log.info(
            "SIGINT left to the supervisor, which stops its workers (to this worker alone: nothing)"
        )

    # Blocked until now (the supervisor's mask as it started this worker, ``supervisor._Worker``),
    # so uvicorn's handler, set by now, read none: this one in its place, or SIGINT ignored again
    # where the supervisor ignores it (a background job). Then unblocked.
    ignored = bool(os.environ.get(SIGINT_IGNORED_VARIABLE))
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else said)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _health_checks_answered_by_the_loop() -> None:
    """uvicorn's supervisor pings each worker, and a thread of the worker's answers: a worker
    whose event loop was stuck (a long computation, a blocking call), its process alive,
    answered on and was never replaced, and its peers' requests for the keys it owns waited
    for it up to the join and upstream timeouts. Each answer now waits for the loop to run a
    callback, once the worker serves (starting, it answers as uvicorn does): a stuck loop
    leaves the ping unanswered, and the supervisor kills and replaces the worker after its
    health check's timeout. (Called as uvicorn builds the app, on its running loop; without
    one, uvicorn's own answer stays.)"""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    from uvicorn.supervisors import multiprocess

    answer = multiprocess.Process.pong

    def pong(process: multiprocess.Process) -> None:
        if not getattr(getattr(process, "server", None), "started", False):
            # Starting (the app built on the loop, which does not turn meanwhile: a large model
            # took past the check's timeout, and the worker was killed for ever), or an older
            # uvicorn's ``Process``: answered as uvicorn does.
            answer(process)
            return
        process.child_conn.recv()
        turned = threading.Event()
        with contextlib.suppress(RuntimeError):  # (the loop closed: the worker is ending)
            loop.call_soon_threadsafe(turned.set)
            turned.wait()
        process.child_conn.send(process.server.started)

    multiprocess.Process.pong = pong  # type: ignore[method-assign,assignment]


def _leave_with_parent(parent: str | None) -> None:
    """A worker stops (SIGTERM to itself: its graceful shutdown) once the ``carpool serve`` that
    started it is gone (``parent``, its pid; another parent pid then: init's or a subreaper's).
    Killed (SIGKILL, the OOM killer), the parent could not stop its workers: they served the
    port on, orphans, and the next ``carpool serve`` on it found it in use. Nor could it remove
    the run's directory it left for them in the temporary directory (``carpool.rundir``: the
    resolved config, a 0600 file with the run's keys, and the peers' meeting place), which they
    do (each worker, whichever first)."""
    if not parent or not parent.isdigit():
        return
    expected = int(parent)
    run = os.environ.get(RUN_VARIABLE)

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(PARENT_POLL_S)
        log.warning("carpool serve (pid %d) is gone: this worker stops", expected)
        if run:
            shutil.rmtree(run, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="carpool-parent-watch", daemon=True).start()


# How often a worker looks whether its ``carpool serve`` is still there (``_leave_with_parent``).
PARENT_POLL_S = 1.0


# The live dashboard: one self-contained page (inline CSS and JS, no external resources) that
# polls /stats; a package file, read once at import.
_DASHBOARD = resources.files("carpool").joinpath("dashboard.html").read_text(encoding="utf-8")


def _inline_hash(tag: str) -> str:
    """The CSP source of the page's one inline ``tag`` element (its opening tag at the start of
    a line: not one named in a comment): the SHA-256 of its text."""
    (text,) = re.findall(rf"^<{tag}>(.*?)</{tag}>", _DASHBOARD, re.DOTALL | re.MULTILINE)
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# The page draws what clients named (namespaces, models): should any of it ever reach the page
# as markup, the browser runs no script and applies no style but the page's own (their hashes,
# taken from the very bytes served), loads nothing (its icon is a ``data:`` URL), talks only to
# the gateway (its polls of ``stats``), and no other site may frame it. Behind the admin token,
# no copy is kept and no Referer leaves it.
_DASHBOARD_HEADERS = {
    "content-security-policy": "; ".join(
        [
            "default-src 'none'",
            f"script-src {_inline_hash('script')}",
            f"style-src {_inline_hash('style')}",
            "img-src data:",
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    ),
    "x-content-type-options": "nosniff",
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
}
